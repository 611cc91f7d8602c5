"""Where the host time of a small diyfa call goes: cProfile over repeated calls, GPU machine.

Small shapes, so the GPU is idle and every microsecond is Python/launch cost.
"""

import cProfile
import pstats
import sys
import time

import torch

import diyfa

N = 300
q, k, v = (torch.randn(4, 8, 512, 64, device="cuda", dtype=torch.float16, requires_grad=True)
           for _ in range(3))  # fmt: skip
out = diyfa.flash_attention(q, k, v)
do = torch.randn_like(out)
a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)


def fwd():
    diyfa.flash_attention(q, k, v)


def bwd():
    torch.autograd.grad(out, (q, k, v), do, retain_graph=True)


def mm():
    diyfa.triton_matmul(a, a)


for name, fn in (("attention fwd", fwd), ("attention bwd", bwd), ("matmul 1024", mm)):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(N):
        fn()
    torch.cuda.synchronize()
    print(f"== {name}: {(time.perf_counter() - t0) / N * 1e6:.1f} us per call", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(N):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(12)
