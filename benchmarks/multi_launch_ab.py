"""Launch A/B for contiguous decode programs of more than 16 query rows (8 new tokens of a
GQA group of 4: ``decode.WIDE_MULTI``), in one process on a CUDA GPU. A variant is (BLOCK_N,
warps, programs per SM, whole waves 1/0, stages) put in place of what ``launch_config``
gives such programs; the default first. GB/s = (K and V bytes read + q + out) / time
(``triton.testing.do_bench`` medians, the best of the rounds, the variants in turn); each
output is compared with the default's (max |diff|, printed above 0.01).

Usage (device): python3 benchmarks/multi_launch_ab.py OUT.jsonl
  [--variants "64,4,2,1,3;128,4,1,1,3"] [--shapes "16,8,16384;4,8,65536"] [--rounds 3]
  [--rows-above 16]  (the programs patched: more query rows than this; 0: every contiguous
                      16-bit one, WIDE's and SHORT's too)
  (shapes: batch, new tokens, cached; 32 q heads / 8 kv heads, d128, bf16)
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

VARIANTS = ("64,4,2,1,3;64,4,3,1,2;64,4,4,1,2;128,4,1,1,3;64,8,2,1,3;32,4,4,1,3;64,4,3,0,2;"
            "64,4,3,0,3")
SHAPES = "16,8,16384;64,8,4096;4,8,65536;16,4,16384"


def _patched(variant, rows_above: int):
    """launch_config and split_stages giving ``variant`` to contiguous programs of more than
    ``rows_above`` rows (and short_cache None: SHORT's launch not taken over it)."""
    block_n, warps, per_sm, waves, stages = variant
    saved = decode.launch_config, decode.split_stages, decode.short_cache
    config = saved[0]

    def launch_config(paged, d_pad, dv_pad, elem_bytes, on_gpu, block_m=16, *args, **kw):
        if not paged and block_m > rows_above:
            return block_n, warps, per_sm, bool(waves)
        return config(paged, d_pad, dv_pad, elem_bytes, on_gpu, block_m, *args, **kw)

    decode.launch_config, decode.split_stages = launch_config, lambda *_, **__: stages
    decode.short_cache = lambda *_: False
    return saved


def main() -> int:
    from triton.testing import do_bench

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--variants", default=VARIANTS)
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows-above", type=int, default=16)
    a = ap.parse_args()
    env, copy = run_record()
    variants = ["default", *parse_items(a.variants)]
    rows = []
    with open(a.out, "w") as f:
        f.write(json.dumps({"record": "run", **env, "copy_gbps": round(copy)}) + "\n")
        for b, t, n in parse_items(a.shapes):
            q, k, v, seqlens, _ = inputs(b, 32, 8, n, None, tokens=t)
            fn = functools.partial(diyfa.flash_attention_with_kvcache, q, k, v,
                                   cache_seqlens=seqlens, max_seqlen_k=n)  # fmt: skip
            nbytes = decode_bytes(q, n, 8)
            row, ref = {"b": b, "tokens": t, "n": n}, None
            for _ in range(a.rounds):
                for var in variants:
                    name = var if isinstance(var, str) else "-".join(map(str, var))
                    saved = None
                    if var != "default":
                        saved = _patched(var, a.rows_above)
                    decode._PREPARED.clear()  # (launches kept from another variant)
                    try:
                        o = fn().float()
                        ref = o if ref is None else ref
                        diff = (o - ref).abs().max().item()
                        if diff > 0.01:
                            row[name + "_diff"] = diff
                        ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
                        row[name] = max(row.get(name, 0), gbps(nbytes, ms))
                    finally:
                        if saved is not None:
                            decode.launch_config, decode.split_stages, decode.short_cache = saved
                        decode._PREPARED.clear()
            del q, k, v, seqlens
            torch.cuda.empty_cache()
            f.write(json.dumps({"record": "measurement", **env, **row}) + "\n")
            f.flush()
            print(row, flush=True)
            rows.append(row)
    print(f"\ncontiguous decode, > 16 rows a program, GB/s (copy {copy:.0f}); "
          "BLOCK_N-warps-per_sm-waves-stages")
    for r in rows:
        print(f"b{r['b']} t{r['tokens']} n{r['n']}: " + "  ".join(
            f"{k}={v}" for k, v in r.items() if k not in ("b", "tokens", "n")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
