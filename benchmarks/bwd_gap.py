"""Where a backward call's time goes on the GPU, in one process on a CUDA GPU: the CUDA-event
time per call (``--calls`` back to back) against the call's kernels (``torch.profiler``, 5
calls): their summed durations, the span from a call's first kernel start to its last
kernel end, the largest gaps between consecutive kernels, and each kernel's time.

Shapes: b1 h16 16k d128 bf16 non-causal and causal, b8 h16 2048 d128 (``--shapes``,
``BxHxSxD[c]``); the default backend, ``torch.autograd.grad`` of one forward's output.

Usage (device): python3 benchmarks/bwd_gap.py [--shapes "1x16x16384x128;1x16x16384x128c"]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0] + "/src")
sys.path.insert(0, __file__.rsplit("/", 1)[0])

from hopper_flag_ab import backward  # noqa: E402

import diyfa  # noqa: E402

SHAPES = "1x16x16384x128;1x16x16384x128c;8x16x2048x128"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--calls", type=int, default=10)
    a = ap.parse_args()
    for spec in a.shapes.split(";"):
        causal = spec.endswith("c")
        shape = tuple(int(x) for x in spec.rstrip("c").split("x"))
        q, k, v = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        call = backward(functools.partial(diyfa.flash_attention, causal=causal), q, k, v)

        for _ in range(3):
            call()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(a.calls):
            call()
        e1.record()
        e1.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                call()
            torch.cuda.synchronize()
        kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                         if e.device_type == torch.autograd.DeviceType.CUDA)  # fmt: skip
        gaps = sorted(((kernels[i + 1][0] - kernels[i][1]) / 1000, kernels[i][2][:40],
                       kernels[i + 1][2][:40]) for i in range(len(kernels) - 1))[-6:]
        per_kernel: dict[str, float] = {}
        for start, end, name in kernels:
            per_kernel[name[:50]] = per_kernel.get(name[:50], 0.0) + (end - start) / 5 / 1000
        print(json.dumps(dict(
            shape=shape, causal=causal,
            event_ms_per_call=round(e0.elapsed_time(e1) / a.calls, 3),
            kernels_ms_per_call=round(sum(e - s for s, e, _ in kernels) / 5 / 1000, 3),
            span_ms_per_call=round((kernels[-1][1] - kernels[0][0]) / 5 / 1000, 3),
            largest_gaps_ms=[(round(g, 3), x, y) for g, x, y in gaps],
            kernels={n: round(t, 3) for n, t in per_kernel.items()})), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
