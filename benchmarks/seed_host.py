"""The seed table's backward (fp16 b4 h8 d64, 512 / 1024 / 2048 tokens) on a CUDA GPU: host
microseconds per backward with the GPU idle (the best of 5 x 100 calls) and do_bench
microseconds (the median of 3), diyfa "auto" and cuDNN, for whichever diyfa tree is on
PYTHONPATH, so that two trees can be compared in fresh processes on the same host (the
host's speed moves these numbers by a third between machines). One JSON line per size.

    PYTHONPATH=src python3 benchmarks/seed_host.py TAG >> seed_host.jsonl
    PYTHONPATH=old/src python3 benchmarks/seed_host.py OLD >> seed_host.jsonl

(It measures the host time itself: older trees lack ``diyfa.bench.harness.host_us_per_call``.)
"""

from __future__ import annotations

import functools
import json
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import diyfa


def host_us_per_call(fn, calls: int = 100, warmup: int = 10) -> float:
    """Host microseconds per call with the GPU idle (its work waited for after the clock)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def main(tag: str) -> None:
    for s in (512, 1024, 2048):
        q, k, v = (torch.randn(4, 8, s, 64, device="cuda", dtype=torch.float16,
                               requires_grad=True) for _ in range(3))  # fmt: skip
        do = torch.randn(4, 8, s, 64, device="cuda", dtype=torch.float16)
        out = diyfa.flash_attention(q, k, v)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            out_cudnn = F.scaled_dot_product_attention(q, k, v)
        row = {"tree": tag, "s": s}
        for name, o in (("diyfa", out), ("cudnn", out_cudnn)):
            fn = functools.partial(torch.autograd.grad, o, (q, k, v), do, retain_graph=True)
            fn()
            torch.cuda.synchronize()
            row[name + "_host_us"] = round(min(host_us_per_call(fn) for _ in range(5)), 1)
            times = sorted(do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3
                           for _ in range(3))  # fmt: skip
            row[name + "_bench_us"] = round(times[1], 1)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
