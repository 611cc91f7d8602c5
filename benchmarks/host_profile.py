"""Where the host time of a small diyfa call goes: cProfile over repeated calls, GPU machine.

Small shapes, so the GPU is idle and every microsecond is Python/launch cost.

    python3 benchmarks/host_profile.py [decode]    (a word: only the calls named with it)
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


# Decode: one new token, 4 sequences x 8 kv heads x 512 cached tokens (a few us of GPU work).
dq = torch.randn(4, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
kc, vc = (torch.randn(4, 512, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
lens = torch.full((4,), 512, dtype=torch.int32, device="cuda")
pages = (torch.randn(4 * 32, 16, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
kp, vp = pages
table = torch.randperm(4 * 32, device="cuda").to(torch.int32).view(4, 32)


def decode_checked():
    with torch.no_grad():
        diyfa.flash_attention_with_kvcache(dq, kc, vc, cache_seqlens=lens)


def decode_nosync():
    with torch.no_grad():
        diyfa.flash_attention_with_kvcache(dq, kc, vc, cache_seqlens=lens, max_seqlen_k=512)


def decode_paged_nosync():
    with torch.no_grad():
        diyfa.flash_attention_with_kvcache(dq, kp, vp, cache_seqlens=lens, block_table=table,
                                           max_seqlen_k=512)  # fmt: skip


def decode_sdpa():
    torch.nn.functional.scaled_dot_product_attention(dq.transpose(1, 2), kc.transpose(1, 2),
                                                     vc.transpose(1, 2), enable_gqa=True)


for name, fn in (("attention fwd", fwd), ("attention bwd", bwd), ("matmul 1024", mm),
                 ("decode checked", decode_checked), ("decode max_seqlen_k", decode_nosync),
                 ("decode paged max_seqlen_k", decode_paged_nosync),
                 ("decode sdpa (reference)", decode_sdpa)):  # fmt: skip
    if len(sys.argv) > 1 and sys.argv[1] not in name:  # e.g. "decode": only those calls
        continue
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
