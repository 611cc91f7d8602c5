"""The Hopper backward's two dQ modes side by side on a CUDA GPU (sm90): the deterministic
path (the portable dQ kernel, then the Gluon kernel for dK / dV) against the atomic dQ,
both through backend="hopper" (``deterministic`` True / False), for the calls whose mode
"auto" picks by measurement (``hopper_bwd.auto_mode``): 8k-token d128 causal plain, softcap
30, ALiBi, a 1023 window, sinks, a 127 window with sinks (gpt-oss's) (b1 h16, bf16, bshd),
and the varlen suite's mix of packed sequences at d128 (GQA 16/4), causal and not; with a
head dim of 64, the same at d64 with 32 heads (the varlen suite's d64 rows: 32 kv heads).
Backward TFLOPS (``torch.autograd.grad`` timed by do_bench, median; exact FLOPs for the
windows), the best of 2 interleaved rounds.

    python3 benchmarks/bwd_mode_ab.py OUT.jsonl [HEAD_DIM]
"""

from __future__ import annotations

import functools
import json
import sys

import torch
from triton.testing import do_bench

import diyfa
from diyfa.bench.suites import varlen_mix


def backward_ms(forward, inputs, do) -> float:
    out = forward()
    fn = functools.partial(torch.autograd.grad, out, inputs, do, retain_graph=True)
    fn()
    torch.cuda.synchronize()
    return do_bench(fn, warmup=10, rep=60, return_mode="median")


def cases(d: int = 128) -> list:
    """(name, backward FLOPs, forward(deterministic), inputs, dO) at head dim ``d``."""
    torch.manual_seed(0)
    b, h, s = 1, 2048 // d, 8192
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))  # fmt: skip
    do = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    variants = [("plain", {}), ("softcap30", dict(softcap=30.0)),
                ("alibi", dict(alibi_slopes=torch.rand(h, device="cuda") * 0.1)),
                ("win1023", dict(window_size=(1023, 0))),
                ("sinks", dict(sinks=torch.randn(h, device="cuda"))),
                ("win127+sinks", dict(window_size=(127, 0),
                                      sinks=torch.randn(h, device="cuda")))]  # fmt: skip
    out = []
    for name, kw in variants:
        window = kw.get("window_size")
        flops = diyfa.attention_flops(b, h, s, s, d, causal=True, window=window, mode="bwd",
                                      convention="exact" if window else "published")  # fmt: skip

        def forward(det, kw=kw):
            return diyfa.flash_attention(q, k, v, causal=True, layout="bshd", backend="hopper",
                                         deterministic=det, **kw)  # fmt: skip

        out.append((f"{name} d{d}", flops, forward, (q, k, v), do))
    return out + varlen_cases(d)


def varlen_cases(d: int = 128) -> list:
    """The varlen suite's mix at head dim ``d`` (its heads: 16 / 4 at d128, else 2048 / d
    both), causal and not, as :func:`cases` lists them."""
    hp, hkp = (16, 4) if d == 128 else (2048 // d, 2048 // d)
    out = []
    lengths, cu, total, longest = varlen_mix("cuda")
    for causal in (False, True):
        qp = torch.randn(total, hp, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        kp, vp = (torch.randn(total, hkp, d, device="cuda", dtype=torch.bfloat16,
                              requires_grad=True) for _ in range(2))  # fmt: skip
        dop = torch.randn(total, hp, d, device="cuda", dtype=torch.bfloat16)
        flops = diyfa.attention_flops(heads=hp, head_dim=d, causal=causal, mode="bwd",
                                      convention="published", seqlens_q=lengths,
                                      seqlens_k=lengths)  # fmt: skip

        def forward(det, qp=qp, kp=kp, vp=vp, causal=causal):
            return diyfa.flash_attention_varlen(qp, kp, vp, cu, cu, longest, longest,
                                                causal=causal, backend="hopper",
                                                deterministic=det)  # fmt: skip

        out.append((f"varlen h{hp}/{hkp}{' causal' if causal else ''}", flops, forward,
                    (qp, kp, vp), dop))  # fmt: skip
    return out


def main(path: str, d: int = 128) -> None:
    best: dict = {}
    all_cases = cases(d)
    for _ in range(2):
        for name, flops, forward, inputs, do in all_cases:
            for det in (True, False):
                ms = backward_ms(functools.partial(forward, det), inputs, do)
                key = (name, "deterministic" if det else "atomic")
                best[key] = max(best.get(key, 0.0), round(flops / (ms * 1e-3) / 1e12, 1))
    with open(path, "w") as f:
        for name, *_ in all_cases:
            row = {"case": name, "deterministic": best[name, "deterministic"],
                   "atomic": best[name, "atomic"]}  # fmt: skip
            f.write(json.dumps(row) + "\n")
            print(f"{name:22s} backward TFLOPS deterministic {row['deterministic']:6.1f}  "
                  f"atomic {row['atomic']:6.1f}")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:3]))
