"""Decode's split merge A/B: the last split program merges (``decode.MERGE``) against the
combine kernel, contiguous and paged caches, in one process on a CUDA GPU. GB/s = (K and V
bytes read + q + out) / time (``triton.testing.do_bench`` medians, the best of the rounds,
the two taken in turn); the outputs of the two are compared first (max |diff|).

Usage (device): python3 benchmarks/merge_ab.py OUT.jsonl
  [--shapes "16,8,16384,0;4,1,65536,16"]  (batch, new tokens, cached, page size (0:
                                           contiguous); 32 q heads / 8 kv heads, d128, bf16)
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

from decode_ab import decode_bytes, gbps, inputs, run_record  # noqa: E402

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
    a = ap.parse_args()
    env, copy = run_record()
    rows = []
    with open(a.out, "w") as f:
        f.write(json.dumps({"record": "run", **env, "copy_gbps": round(copy)}) + "\n")
        for item in a.shapes.split(";"):
            b, t, n, page = (int(x) for x in item.split(","))
            q, k, v, seqlens, table = inputs(b, 32, 8, n, page or None, tokens=t)
            sinks = torch.randn(32, device="cuda") if a.sinks else None
            fn = functools.partial(diyfa.flash_attention_with_kvcache, q, k, v,
                                   cache_seqlens=seqlens, block_table=table, max_seqlen_k=n,
                                   sinks=sinks)  # fmt: skip
            nbytes = decode_bytes(q, n, 8)
            row = {"b": b, "tokens": t, "n": n, "page": page, "sinks": a.sinks}
            outs = {}
            for _ in range(a.rounds):
                for merge in (True, False):
                    decode.MERGE = merge
                    decode._PREPARED.clear()  # (launches kept from the other variant)
                    name = "merge" if merge else "combine"
                    outs[name] = fn().float()
                    ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
                    row[name] = max(row.get(name, 0), gbps(nbytes, ms))
            decode.MERGE = True
            decode._PREPARED.clear()
            row["diff"] = (outs["merge"] - outs["combine"]).abs().max().item()
            row["ratio"] = round(row["merge"] / row["combine"], 3)
            del q, k, v, seqlens, table
            torch.cuda.empty_cache()
            f.write(json.dumps({"record": "measurement", **env, **row}) + "\n")
            f.flush()
            print(row, flush=True)
            rows.append(row)
    print(f"\ndecode merge A/B, GB/s (copy {copy:.0f}), merge / combine (ratio), max |diff|")
    for r in rows:
        print(f"b{r['b']} t{r['tokens']} n{r['n']} p{r['page']}{' sinks' if r['sinks'] else ''}"
              f": {r['merge']} / {r['combine']} ({r['ratio']:.3f})  diff {r['diff']:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
