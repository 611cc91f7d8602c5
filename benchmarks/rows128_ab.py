"""A/B of the d64 Hopper backward's 128-row steps (``hopper_bwd.BWD_CONFIG_D64_ROWS128``) for
the calls that keep 64 rows by default: packed sequences (``hopper_bwd.ROWS128_PACKED``) and
sliding windows (``"WINDOW"`` in ``hopper_bwd.ROWS128_KEEP_64``), on an sm90 GPU, in one
process. Cases (bf16, d64, 32 heads): the varlen suite's mix (64k tokens of 128..8192), causal
and not; b1 8192 tokens with a (1023, 0) window (causal) and a (255, 255) window. Each in
both dQ modes (backend="hopper", ``deterministic`` True / False) and both row counts:
backward TFLOPS of ``torch.autograd.grad`` (do_bench median; exact FLOPs for windows), best
of ``--rounds`` interleaved rounds; the largest gradient difference between the row counts
(same mode) goes in the row.

    python3 benchmarks/rows128_ab.py [--rounds 3] [--out $OUT/rows128_ab.jsonl]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0] + "/src")

import diyfa  # noqa: E402
from diyfa._launcher import forget_replays  # noqa: E402
from diyfa.attention import hopper_bwd  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bwd_mode_ab import varlen_cases  # noqa: E402

KEEP_64 = hopper_bwd.ROWS128_KEEP_64


def set_rows(rows: int) -> None:
    """128 rows for packed sequences and windows, or the 64 they keep by default."""
    hopper_bwd.ROWS128_PACKED = rows == 128
    hopper_bwd.ROWS128_KEEP_64 = tuple(f for f in KEEP_64 if f != "WINDOW" or rows == 64)
    forget_replays()  # (a replay keeps the config it was recorded with)


def cases() -> list:
    """(name, backward FLOPs, forward(deterministic), inputs, dO)."""
    torch.manual_seed(0)
    h, d = 32, 64
    out = varlen_cases(d)
    b, s = 1, 8192
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))  # fmt: skip
    do = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    for window, causal in (((1023, 0), True), ((255, 255), False)):
        flops = diyfa.attention_flops(b, h, s, s, d, causal=causal, window=window, mode="bwd",
                                      convention="exact")  # fmt: skip

        def forward(det, window=window, causal=causal):
            return diyfa.flash_attention(q, k, v, causal=causal, layout="bshd",
                                         backend="hopper", deterministic=det,
                                         window_size=window)  # fmt: skip

        name = f"b1 h32 8192 d64 win{window[0]},{window[1]}{' causal' if causal else ''}"
        out.append((name, flops, forward, (q, k, v), do))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                  "rows128_ab.jsonl"))  # fmt: skip
    a = ap.parse_args()
    best: dict = {}
    grads: dict = {}
    all_cases = cases()
    for _ in range(a.rounds):
        for name, flops, forward, inputs, do in all_cases:
            for det in (True, False):
                for rows in (64, 128):
                    set_rows(rows)
                    out = forward(det)
                    fn = functools.partial(torch.autograd.grad, out, inputs, do,
                                           retain_graph=True)  # fmt: skip
                    g = fn()
                    key = (name, det, rows)
                    if key not in grads:
                        grads[key] = [t.float() for t in g]
                    ms = do_bench(fn, warmup=10, rep=60, return_mode="median")
                    tf = round(flops / (ms * 1e-3) / 1e12, 1)
                    best[key] = max(best.get(key, 0.0), tf)
    set_rows(64)
    with open(a.out, "w") as f:
        for name, *_ in all_cases:
            for det in (True, False):
                pairs = zip(grads[name, det, 64], grads[name, det, 128], strict=True)
                diff = max((x - y).abs().max().item() for x, y in pairs)
                row = {"case": name, "mode": "deterministic" if det else "atomic",
                       "rows64": best[name, det, 64], "rows128": best[name, det, 128],
                       "max_grad_diff": diff}  # fmt: skip
                f.write(json.dumps(row) + "\n")
                print(f"{name:34s} {row['mode']:13s} TFLOPS 64 rows {row['rows64']:6.1f}  "
                      f"128 rows {row['rows128']:6.1f}  grad diff {diff:.2e}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
