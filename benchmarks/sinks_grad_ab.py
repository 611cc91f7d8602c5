"""A/B of the sinks' gradient source on a CUDA GPU, in one process: the backward's own delta
(rowsum(dO * O), which the families write into ``delta_out``) against recomputing it from
dO and O in PyTorch ops (the way before 2026-11-25; ``recomputed`` here, in place of
``function.family_backward``). Cases (bf16, causal, bshd, 8192 tokens, "auto"): d64 32
heads with sinks, with a (127, 0) window and sinks (gpt-oss's sliding layers), d128 16 heads
with sinks (the variants suite's row). Backward TFLOPS of ``torch.autograd.grad`` (do_bench
median; exact FLOPs with the window), best of ``--rounds`` interleaved rounds; the sinks'
gradients of the two compared.

    python3 benchmarks/sinks_grad_ab.py [--rounds 3] [--out $OUT/sinks_grad_ab.jsonl]
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
from diyfa.attention import function  # noqa: E402

REAL = function.family_backward
LOG2E = 1.4426950408889634


def recomputed(family, do, q, k, v, out, lse2, problem, sinks_grad):
    """``function.family_backward`` as before: the sinks' gradient from dO and O."""
    dq, dk, dv = family.backward(do, q, k, v, out, lse2, problem)
    if not sinks_grad:
        return dq, dk, dv, None
    delta = (do.float() * out.float()).sum(-1)
    delta = delta.transpose(1, 2) if problem.layout == "bshd" else delta  # (bhsd like lse2)
    sink2 = problem.sinks.float()[None, :, None] * LOG2E
    return dq, dk, dv, -(torch.exp2(sink2 - lse2) * delta).sum((0, 2)).to(problem.sinks.dtype)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                  "sinks_grad_ab.jsonl"))  # fmt: skip
    a = ap.parse_args()
    torch.manual_seed(0)
    cases = []
    for d, window in ((64, None), (64, (127, 0)), (128, None)):
        b, h, s = 1, 2048 // d, 8192
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))  # fmt: skip
        sinks = torch.randn(h, device="cuda", requires_grad=True)
        do = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
        kw = {} if window is None else dict(window_size=window)
        out = diyfa.flash_attention(q, k, v, causal=True, layout="bshd", sinks=sinks, **kw)
        flops = diyfa.attention_flops(b, h, s, s, d, causal=True, window=window, mode="bwd",
                                      convention="exact" if window else "published")  # fmt: skip
        fn = functools.partial(torch.autograd.grad, out, (q, k, v, sinks), do,
                               retain_graph=True)  # fmt: skip
        name = f"b1 h{h} 8192 d{d} causal sinks" + (f" win{window[0]}" if window else "")
        cases.append((name, flops, fn))
    best, grads = {}, {}
    for _ in range(a.rounds):
        for name, flops, fn in cases:
            for source, patch in (("delta", REAL), ("recomputed", recomputed)):
                function.family_backward = patch
                grads.setdefault((name, source), fn()[3].float())
                ms = do_bench(fn, warmup=10, rep=60, return_mode="median")
                tf = round(flops / (ms * 1e-3) / 1e12, 1)
                best[name, source] = max(best.get((name, source), 0.0), tf)
    function.family_backward = REAL
    with open(a.out, "w") as f:
        for name, _, _ in cases:
            diff = (grads[name, "delta"] - grads[name, "recomputed"]).abs().max().item()
            row = {"case": name, "delta": best[name, "delta"],
                   "recomputed": best[name, "recomputed"], "dsinks_max_diff": diff}  # fmt: skip
            f.write(json.dumps(row) + "\n")
            print(f"{name:34s} backward TFLOPS recomputed {row['recomputed']:6.1f}  "
                  f"delta {row['delta']:6.1f}  dsinks diff {diff:.2e}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
