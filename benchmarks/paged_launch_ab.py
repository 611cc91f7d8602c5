"""Paged decode launches A/B: ``decode.PAGED_WAVES`` and ``PAGED_WAVES_LARGE_PAGES`` (BLOCK_N,
warps, programs per SM; the split count fills whole waves of them) and the pipeline depth,
against the default and the same cache contiguous, in one process on a CUDA GPU. GB/s = (K
and V bytes read + q + out) / time (``triton.testing.do_bench`` medians, the best of the
rounds); each variant's output is compared with the default's first.

Usage (device): python3 benchmarks/paged_launch_ab.py OUT.jsonl
  [--variants "128,4,2,3;64,4,3,3;128,4,2,3,0"]  (BLOCK_N, warps, programs per SM, stages;
                 a fifth 0: the kernel's table read per key, PAGE = 0, instead of one read
                 per page)
  [--shapes "16,1,16384,16;64,1,4096,16"]  (batch, new tokens, cached, page size; 32 q
                                            heads / 8 kv heads, d128, bf16)
  [--rounds 2]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0] + "/src")
sys.path.insert(0, __file__.rsplit("/", 1)[0])

from decode_ab import decode_bytes, gbps, inputs, parse_items, run_record  # noqa: E402

import diyfa  # noqa: E402
from diyfa.attention import decode  # noqa: E402

SHAPES = "16,8,16384,16;16,8,16384,256;16,1,16384,16;64,1,4096,16;128,1,512,16;4,1,65536,16"
VARIANTS = "64,4,3,3;128,8,2,3;128,4,2,3"


def _time(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--variants", default=VARIANTS)
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    env, copy = run_record()
    variants = ["contig", "default", *parse_items(a.variants)]
    saved = (decode.PAGED_WAVES, decode.PAGED_WAVES_LARGE_PAGES, decode.split_stages,
             decode._pow2_page)
    rows = []
    with open(a.out, "w") as f:
        f.write(json.dumps({"record": "run", **env, "copy_gbps": round(copy)}) + "\n")
        for b, t, n, page in parse_items(a.shapes):
            row = {"b": b, "tokens": t, "n": n, "page": page}
            data = {False: inputs(b, 32, 8, n, None, tokens=t),
                    True: inputs(b, 32, 8, n, page, tokens=t)}  # fmt: skip
            ref = None
            for _ in range(a.rounds):
                for var in variants:
                    name = var if isinstance(var, str) else "-".join(map(str, var))
                    q, k, v, seqlens, table = data[var != "contig"]
                    if isinstance(var, tuple):
                        decode.PAGED_WAVES = decode.PAGED_WAVES_LARGE_PAGES = var[:3]
                        decode.split_stages = lambda *_, _s=var[3], **__: _s
                        if len(var) > 4 and var[4] == 0:
                            decode._pow2_page = lambda _page: 0
                    decode._PREPARED.clear()  # (launches kept from another variant)
                    try:
                        fn = functools.partial(diyfa.flash_attention_with_kvcache, q, k, v,
                                               cache_seqlens=seqlens, block_table=table,
                                               max_seqlen_k=n)  # fmt: skip
                        o = fn()
                        if var != "contig":
                            ref = o if ref is None else ref
                            diff = (o.float() - ref.float()).abs().max().item()
                            if diff > 0.02:
                                row[name + "_diff"] = diff
                        row[name] = max(row.get(name, 0),
                                        gbps(decode_bytes(q, n, 8), _time(fn)))
                    finally:
                        (decode.PAGED_WAVES, decode.PAGED_WAVES_LARGE_PAGES,
                         decode.split_stages, decode._pow2_page) = saved
                        decode._PREPARED.clear()
            del data
            torch.cuda.empty_cache()
            f.write(json.dumps({"record": "measurement", **env, **row}) + "\n")
            f.flush()
            print(row, flush=True)
            rows.append(row)
    print(f"\npaged decode, GB/s (copy {copy:.0f}; ratio to the contiguous cache); "
          "BLOCK_N-warps-per_sm-stages")
    for r in rows:
        c = r["contig"]
        cells = [f"{k}={v}" + (f" ({v / c:.3f})" if k != "contig" and isinstance(v, int) else "")
                 for k, v in r.items() if k not in ("b", "tokens", "n", "page")]
        print(f"b{r['b']} t{r['tokens']} n{r['n']} p{r['page']}: " + "  ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
