"""Where a frozen-max forward's time goes, on an sm90 GPU: for a few shapes, the running max
and the frozen max (its thresholds at zero) in turn, ``triton.testing.do_bench``'s median per
call (L2 flushed before each) against ``torch.profiler``'s kernel times per call over 50
calls (warm L2): the kernel, the second launch and the counter's zeroing.

Usage (device): python3 benchmarks/frozen_fixed_cost.py
"""

from __future__ import annotations

import collections
import functools
import sys

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0] + "/src")

import diyfa  # noqa: E402
from diyfa._launcher import forget_replays  # noqa: E402
from diyfa.attention import hopper_fwd as hf  # noqa: E402

SHAPES = [(4, 16, 1024, 4096, 128, False), (4, 16, 4096, 4096, 128, False),
          (8, 16, 2048, 2048, 128, True), (4, 8, 2048, 2048, 64, False),
          (8, 16, 2048, 2048, 128, False)]  # (batch, heads, seqlen_q, seqlen_k, d, causal)


def call(b, h, sq, sk, d, causal, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(b, sk, h, d, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    return functools.partial(diyfa.flash_attention, q, k, v, causal=causal, layout="bshd",
                             backend="hopper")  # fmt: skip


def main() -> int:
    from triton.testing import do_bench

    keys, pairs = hf.FROZEN_MIN_KEYS, hf.FROZEN_MIN_PAIRS
    for shape in SHAPES:
        fn = call(*shape)
        for frozen in (False, True):
            hf.FROZEN_MIN_KEYS, hf.FROZEN_MIN_PAIRS = (((64, 0), (128, 0)), 0) if frozen else (
                keys, pairs)
            hf.FROZEN_MAX = frozen
            forget_replays()
            fn()
            torch.cuda.synchronize()
            ms = do_bench(fn, rep=100, return_mode="median")
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(50):
                    fn()
                torch.cuda.synchronize()
            events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            per_call = {n: max(c // 50, 1)
                        for n, c in collections.Counter(e.name for e in events).items()}
            times, seen = collections.defaultdict(float), collections.Counter()
            for e in events:
                # (a call's launches of one kernel told apart by their order in the call)
                times[f"{e.name[:30]}#{seen[e.name] % per_call[e.name]}"] += (
                    e.device_time_total / 50)
                seen[e.name] += 1
            kernels = "; ".join(f"{n}: {t:.1f} us" for n, t in times.items())
            print(shape, "frozen" if frozen else "running", f"do_bench {ms * 1000:.1f} us;",
                  kernels, flush=True)
    hf.FROZEN_MIN_KEYS, hf.FROZEN_MIN_PAIRS, hf.FROZEN_MAX = keys, pairs, True
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
