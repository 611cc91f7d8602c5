"""The portable backward's launch configs side by side in one process on a CUDA GPU: each
candidate (BLOCK_M, BLOCK_N, warps, stages) of one kernel ("attn_bwd_dkdv" or "attn_bwd_dq")
pinned (``tuning.pinned``) while the other keeps its default, the whole backward timed
(``torch.autograd.grad`` of a portable-backend forward, do_bench median) and its gradients
compared with the first config's. Backward TFLOPS (published convention: 2.5x the forward's,
causal halved), the best of ``--rounds`` interleaved rounds. For head dims whose backward
runs on the portable kernels on Hopper (d256), or to re-time the defaults elsewhere.

    python3 benchmarks/portable_bwd_ab.py OUT.jsonl --head-dim 256 \\
        --shapes 2x8x8192,16x8x1024 --kernel attn_bwd_dkdv \\
        --configs "64,64,8,2;32,64,8,2;64,32,8,2"
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
from triton.testing import do_bench

import diyfa
from diyfa import tuning


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--shapes", default="2x8x8192,16x8x1024", help="BATCHxHEADSxSEQLEN,...")
    ap.add_argument("--kernel", default="attn_bwd_dkdv", choices=("attn_bwd_dkdv", "attn_bwd_dq"))
    ap.add_argument("--configs", required=True, help="BLOCK_M,BLOCK_N,warps,stages;...")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    configs = [tuple(int(x) for x in c.split(",")) for c in a.configs.split(";") if c]
    best: dict = {}
    cases = []
    for shape in a.shapes.split(","):
        b, h, s = (int(x) for x in shape.split("x"))
        for causal in (False, True):
            q, k, v = (torch.randn(b, h, s, a.head_dim, device="cuda", dtype=torch.bfloat16,
                                   requires_grad=True) for _ in range(3))  # fmt: skip
            do = torch.randn_like(q)
            flops = diyfa.attention_flops(b, h, s, s, a.head_dim, causal=causal, mode="bwd",
                                          convention="published")  # fmt: skip
            cases.append((f"{shape} {'causal' if causal else 'full'}", q, k, v, do, causal,
                          flops))  # fmt: skip
    ref: dict = {}
    for _ in range(a.rounds):
        for name, q, k, v, do, causal, flops in cases:
            for bm, bn, warps, stages in configs:
                with tuning.pinned(a.kernel, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps,
                                   num_stages=stages):  # fmt: skip
                    out = diyfa.flash_attention(q, k, v, causal=causal, backend="portable")
                    fn = functools.partial(torch.autograd.grad, out, (q, k, v), do,
                                           retain_graph=True)  # fmt: skip
                    grads = fn()
                    first = ref.setdefault(name, grads)
                    diff = max((g.float() - r.float()).abs().max().item()
                               for g, r in zip(grads, first, strict=True))  # fmt: skip
                    ms = do_bench(fn, warmup=5, rep=60, return_mode="median")
                key = (name, f"{bm}-{bn}-{warps}-{stages}")
                tflops = round(flops / (ms * 1e-3) / 1e12, 1)
                best[key] = (max(best.get(key, (0.0, 0.0))[0], tflops), diff)
    with open(a.out, "w") as f:
        for (name, cfg), (tflops, diff) in best.items():
            f.write(json.dumps({"case": name, "kernel": a.kernel, "config": cfg,
                                "tflops": tflops, "max_diff": diff}) + "\n")  # fmt: skip
    names = [f"{bm}-{bn}-{w}-{st}" for bm, bn, w, st in configs]
    print(f"{a.kernel} d{a.head_dim}, backward TFLOPS: " + " | ".join(names))
    for name, *_ in cases:
        print(f"{name:18s} " + " | ".join(f"{best[name, c][0]:6.1f}" for c in names))


if __name__ == "__main__":
    main()
