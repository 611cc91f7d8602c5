"""Calls the Hopper family can run but "auto" leaves to the portable kernels because they
were never timed (``hopper_fwd.prefer``): packed sequences above d128 and a value head dim
other than q's, each on both families (``backend=`` "portable" / "hopper") in one process
on a CUDA GPU (sm90), forward and backward (``torch.autograd.grad``) timed by do_bench
(median), the best of ``--rounds`` interleaved rounds, in milliseconds, with the outputs'
and gradients' largest differences between the two.

    python3 benchmarks/untimed_ab.py OUT.jsonl [--rounds 2]

Cases: the varlen suite's mix of lengths (64k tokens, 128..8192) at d256 with 8 / 2 heads
(Gemma-like GQA) and at d192 with 10 / 2; DeepSeek-MLA-like q/k head dim 192 with value head
dim 128 (2 x 16 x 4096 and 16 x 16 x 1024); causal and not; bf16.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0] + "/src")

import diyfa  # noqa: E402
from diyfa.bench.suites import varlen_mix  # noqa: E402

BACKENDS = ("portable", "hopper")


def packed_case(d: int, h: int, hk: int, causal: bool):
    _lengths, cu, n, m = varlen_mix()
    q = torch.randn(n, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(n, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))  # fmt: skip

    def fwd(backend):
        return diyfa.flash_attention_varlen(q, k, v, cu, cu, m, m, causal=causal,
                                            backend=backend)  # fmt: skip

    return f"packed d{d} h{h}/{hk} causal={causal}", fwd, (q, k, v)


def value_dim_case(b: int, s: int, causal: bool):
    q, k = (torch.randn(b, 16, s, 192, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))  # fmt: skip
    v = torch.randn(b, 16, s, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def fwd(backend):
        return diyfa.flash_attention(q, k, v, causal=causal, backend=backend)

    return f"qk192 v128 {b}x16x{s} causal={causal}", fwd, (q, k, v)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    cases = []
    for causal in (False, True):
        cases += [packed_case(256, 8, 2, causal), packed_case(192, 10, 2, causal),
                  value_dim_case(2, 4096, causal), value_dim_case(16, 1024, causal)]
    rows = []
    for name, fwd, inputs in cases:
        torch.manual_seed(0)
        best, outs = {}, {}
        do = torch.randn_like(fwd("portable").detach())
        for _ in range(a.rounds):
            for backend in BACKENDS:
                f_ms = do_bench(functools.partial(fwd, backend), warmup=10, rep=60,
                                return_mode="median")  # fmt: skip
                out = fwd(backend)
                fn = functools.partial(torch.autograd.grad, out, inputs, do, retain_graph=True)
                outs[backend] = (out.detach(), fn())
                b_ms = do_bench(fn, warmup=10, rep=60, return_mode="median")
                old = best.get(backend, (f_ms, b_ms))
                best[backend] = (min(old[0], f_ms), min(old[1], b_ms))
        diff = [(x.float() - y.float()).abs().max().item() for x, y in
                zip((outs["hopper"][0], *outs["hopper"][1]),
                    (outs["portable"][0], *outs["portable"][1]), strict=True)]
        rec = dict(case=name, fwd_ms={b: round(best[b][0], 4) for b in BACKENDS},
                   bwd_ms={b: round(best[b][1], 4) for b in BACKENDS},
                   max_diff_out_dq_dk_dv=diff)  # fmt: skip
        rows.append(rec)
        print(json.dumps(rec), flush=True)
        del outs
    with open(a.out, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print("\ncase | fwd ms portable / hopper | bwd ms portable / hopper")
    for r in rows:
        print(f"{r['case']} | {r['fwd_ms']['portable']:.3f} / {r['fwd_ms']['hopper']:.3f} | "
              f"{r['bwd_ms']['portable']:.3f} / {r['bwd_ms']['hopper']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
