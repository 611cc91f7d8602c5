"""A/B of the packed (varlen) Hopper forward's work order, in one process on an sm90 GPU.

The work list (``hopper_fwd.tile_table``) is either every tile heaviest first or grouped by
sequence (``VARLEN_BY_SEQUENCE``); the kernel takes ``VARLEN_TILE_GROUP`` (causal:
``VARLEN_TILE_GROUP_CAUSAL``) tiles at a time for every head in turn (None: the whole list
per head); each order here sets both. Each order runs the varlen suite's mix
(``diyfa.bench.suites.varlen_lengths(65536, 128, 8192)``, bf16) at d128 (16 / 4 heads) and
d64 (32 / 32), causal and not: its output first checked against the first order's (the same
kernel over the same tiles: bitwise equal), then timed (``triton.testing.do_bench`` medians,
rounds interleaved), TFLOPS by the published convention (causal per sequence).

Usage (device): python3 benchmarks/varlen_order_ab.py [--out varlen_order_ab.jsonl]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0] + "/src")

import diyfa  # noqa: E402
from diyfa.attention import hopper_fwd  # noqa: E402
from diyfa.bench.results import environment  # noqa: E402
from diyfa.bench.suites import varlen_mix  # noqa: E402
from diyfa.flops import attention_flops  # noqa: E402

ORDERS = {  # label: (VARLEN_BY_SEQUENCE, VARLEN_TILE_GROUP)
    "heaviest-per-head": (False, None),
    "by-seq-per-head": (True, None),
    "by-seq-group8": (True, 8),
    "by-seq-group32": (True, 32),
    "heaviest-group8": (False, 8),
}


def _set(by_sequence: bool, group: int | None) -> None:
    hopper_fwd.VARLEN_BY_SEQUENCE = by_sequence
    hopper_fwd.VARLEN_TILE_GROUP = hopper_fwd.VARLEN_TILE_GROUP_CAUSAL = group


def main() -> int:
    from triton.testing import do_bench

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="varlen_order_ab.jsonl")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rep", type=int, default=60)
    a = ap.parse_args()
    lengths, cu, total, longest = varlen_mix()
    env = environment()
    before = (hopper_fwd.VARLEN_BY_SEQUENCE, hopper_fwd.VARLEN_TILE_GROUP,
              hopper_fwd.VARLEN_TILE_GROUP_CAUSAL)  # fmt: skip
    rows = []
    with open(a.out, "w") as f:
        for d, h, hk in ((128, 16, 4), (64, 32, 32)):
            g = torch.Generator(device="cuda").manual_seed(d)
            q = torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
            k = torch.randn(total, hk, d, device="cuda", dtype=torch.bfloat16, generator=g)
            v = torch.randn(total, hk, d, device="cuda", dtype=torch.bfloat16, generator=g)
            for causal in (False, True):
                flops = sum(attention_flops(1, h, n, n, d, causal=causal,
                                            convention="published") for n in lengths)  # fmt: skip

                def fwd(q=q, k=k, v=v, causal=causal):
                    return diyfa.flash_attention_varlen(q, k, v, cu, cu, longest, longest,
                                                        causal=causal, backend="hopper")

                row = dict(d=d, heads=h, kv_heads=hk, causal=causal, sequences=len(lengths),
                           tokens=total)  # fmt: skip
                first, times = None, {name: [] for name in ORDERS}
                for name, (by_seq, group) in ORDERS.items():
                    _set(by_seq, group)
                    out = fwd()
                    if first is None:
                        first = out
                    row[f"{name}_equal"] = bool(torch.equal(out, first))
                for _ in range(a.rounds):
                    for name, (by_seq, group) in ORDERS.items():
                        _set(by_seq, group)
                        times[name].append(do_bench(fwd, rep=a.rep, return_mode="median"))
                for name, ms in times.items():
                    row[name] = round(flops / (statistics.median(ms) * 1e-3) / 1e12, 1)
                rows.append(row)
                f.write(json.dumps({**env, **row}) + "\n")
                print(json.dumps(row), flush=True)
    (hopper_fwd.VARLEN_BY_SEQUENCE, hopper_fwd.VARLEN_TILE_GROUP,
     hopper_fwd.VARLEN_TILE_GROUP_CAUSAL) = before  # fmt: skip
    print(f"\npacked forward work order, TFLOPS ({env['gpu']}, triton {env['triton']})")
    for r in rows:
        cells = "  ".join(f"{n} {r[n]}{'' if r[n + '_equal'] else ' (DIFFERS)'}" for n in ORDERS)
        print(f"d{r['d']} h{r['heads']}/{r['kv_heads']}{' causal' if r['causal'] else '':7s} "
              f"{cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
