"""Where a backward's GPU time goes: each kernel's time per backward (torch.profiler), for the
backward modes side by side (portable, Hopper fast, Hopper deterministic).

    python benchmarks/bwd_breakdown.py [--shapes 2x16x8192x128,...] [--causal both]

One JSON line per (shape, causal, mode, kernel) to ``$OUT/bwd_breakdown.jsonl`` and a table on
stdout: microseconds per backward for each kernel, and the backward's TFLOPS from the summed
kernel time (2.5x the forward's FLOPs, FlashAttention's convention; causal halves them).
Needs a Hopper GPU.
"""

from __future__ import annotations

import argparse
import collections
import json
import os

import torch
from torch.profiler import ProfilerActivity, profile

import diyfa

MODES = {"portable": dict(backend="portable"), "hopper-fast": dict(backend="hopper"),
         "hopper-det": dict(backend="hopper", deterministic=True)}  # fmt: skip


def run(shape, causal, mode, reps=10):
    b, h, s, d = shape
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))  # fmt: skip
    out = diyfa.flash_attention(q, k, v, causal=causal, **MODES[mode])
    do = torch.randn_like(out)
    for _ in range(3):
        torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
        torch.cuda.synchronize()
    times = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            times[e.name[:60]] += e.device_time_total / reps
    flops = 4 * b * h * s * s * d * 2.5 / (2 if causal else 1)
    return times, flops


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="2x16x8192x128,4x16x4096x64,2x16x8192x64")
    ap.add_argument("--causal", default="both", choices=("both", "yes", "no"))
    args = ap.parse_args()
    out_path = os.path.join(os.environ.get("OUT", "."), "bwd_breakdown.jsonl")
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    with open(out_path, "w") as f:
        for shape_s in args.shapes.split(","):
            shape = tuple(int(x) for x in shape_s.split("x"))
            for causal in causals:
                for mode in MODES:
                    times, flops = run(shape, causal, mode)
                    total = sum(times.values())
                    print(f"{shape_s} causal={causal} {mode}: {total:.0f} us, "
                          f"{flops / total / 1e6:.0f} TFLOPS")
                    for name, us in times.most_common():
                        print(f"    {us:8.1f} us  {name}")
                        f.write(json.dumps(dict(shape=shape, causal=causal, mode=mode,
                                                kernel=name, us=us)) + "\n")


if __name__ == "__main__":
    main()
