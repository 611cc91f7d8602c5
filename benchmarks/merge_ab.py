"""Decode switch A/B, in one process on a CUDA GPU: the last split program merges
(``decode.MERGE``) against the combine kernel, or (``--flag PAGED_ROWS_X``) paged programs
of > 16 rows cut into row blocks of 16 side by side against one program. GB/s = (K and V
bytes read + q + out) / time (``triton.testing.do_bench`` medians, the best of the rounds,
the two taken in turn, "on" and "off"); their outputs are compared (max |diff|).

Usage (device): python3 benchmarks/merge_ab.py OUT.jsonl
  [--shapes "16,8,16384,0;4,1,65536,16"]  (batch, new tokens, cached, page size (0:
                                           contiguous)[, kv heads (8)]; 32 q heads, d128, bf16)
  [--flag MERGE]  (the decode module's switch turned on / off: MERGE or PAGED_ROWS_X)
  [--sinks]  (with attention sinks: every call merges, one split too)
  [--rounds 3]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0] + "/src")
sys.path.insert(0, __file__.rsplit("/", 1)[0])

from decode_ab import inputs, run_record  # noqa: E402

import diyfa  # noqa: E402
from diyfa.attention import decode  # noqa: E402

SHAPES = ("16,8,16384,0;16,8,16384,16;16,8,16384,256;16,4,16384,16;16,1,16384,16;"
          "4,1,65536,0;1,1,131072,0;4,1,65536,16;1,1,131072,256;8,1,32768,0")


def main() -> int:
    from triton.testing import do_bench

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--sinks", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--flag", default="MERGE", choices=("MERGE", "PAGED_ROWS_X"))
    a = ap.parse_args()
    on = getattr(decode, a.flag)
    env, copy = run_record()
    rows = []
    with open(a.out, "w") as f:
        f.write(json.dumps({"record": "run", **env, "copy_gbps": round(copy)}) + "\n")
        for item in a.shapes.split(";"):
            b, t, n, page, *rest = (int(x) for x in item.split(","))
            hk = rest[0] if rest else 8
            q, k, v, seqlens, table = inputs(b, 32, hk, n, page or None, tokens=t)
            sinks = torch.randn(32, device="cuda") if a.sinks else None
            fn = functools.partial(diyfa.flash_attention_with_kvcache, q, k, v,
                                   cache_seqlens=seqlens, block_table=table, max_seqlen_k=n,
                                   sinks=sinks)  # fmt: skip
            nbytes = 2 * b * n * hk * 128 * 2 + 2 * b * t * 32 * 128 * 2
            row = {"b": b, "tokens": t, "n": n, "page": page, "kv_heads": hk, "sinks": a.sinks,
                   "flag": a.flag}
            outs = {}
            for _ in range(a.rounds):
                for flag in (on, False):
                    setattr(decode, a.flag, flag)
                    decode._PREPARED.clear()  # (launches kept from the other variant)
                    name = "on" if flag else "off"
                    outs[name] = fn().float()
                    ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
                    row[name] = max(row.get(name, 0), round(nbytes / (ms * 1e-3) / 1e9))
            setattr(decode, a.flag, on)
            decode._PREPARED.clear()
            row["diff"] = (outs["on"] - outs["off"]).abs().max().item()
            row["ratio"] = round(row["on"] / row["off"], 3)
            del q, k, v, seqlens, table
            torch.cuda.empty_cache()
            f.write(json.dumps({"record": "measurement", **env, **row}) + "\n")
            f.flush()
            print(row, flush=True)
            rows.append(row)
    print(f"\ndecode {a.flag} A/B, GB/s (copy {copy:.0f}), on / off (ratio), max |diff|")
    for r in rows:
        print(f"b{r['b']} t{r['tokens']} n{r['n']} p{r['page']} hk{r['kv_heads']}"
              f"{' sinks' if r['sinks'] else ''}"
              f": {r['on']} / {r['off']} ({r['ratio']:.3f})  diff {r['diff']:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
