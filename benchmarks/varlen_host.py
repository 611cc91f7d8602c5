"""Where a packed (varlen) call's time goes, in one process on a GPU: host, kernels, the call.

The packed entry points wait for the cumulative lengths to reach the host (one wait per
call: ``checks.HostLengths``), so whatever the host does after that wait runs while the GPU
idles: a benchmark that times the call (``triton.testing.do_bench``, as ``diyfa bench``)
counts it, and so does a training step. For the varlen suite's mix
(``diyfa.bench.suites.varlen_lengths(65536, 128, 8192)``, bf16; d128 16 / 4 heads and d64
32 / 32, causal and not), forward and backward ("auto"), and the same tokens as 16 x 4096
equal-length batches, this prints per call:

- ``host_us``: the call's wall time on the host with the GPU idle before it (the checks'
  read then waits for nothing), median of 20;
- ``kernels_ms``: the GPU time of the call's kernels (``torch.profiler``, summed over 10
  calls);
- ``idle_us`` (forward): the GPU's idle time between the lengths' copy landing on the host
  and the attention kernel's start, each call queued behind other work (profiler);
- ``call_ms``: ``do_bench`` of the call (L2 flushed before each repetition), as the suites
  time it; TFLOPS from it by the published convention (causal per sequence).

``--ab`` also runs the packed calls with the packed forward's O by masked stores only
(``hopper_fwd.VARLEN_O_TMA`` off: "masked-o"). (At commit 5447834 it also ran the work
lists built by the Python loops they had before, "old-tables":
benchmarks/results/2026-11-24_h200_varlen-host_5447834.txt.)

Usage (device): python3 benchmarks/varlen_host.py [--out varlen_host.jsonl] [--ab]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0] + "/src")

import diyfa  # noqa: E402
from diyfa.attention import hopper_fwd  # noqa: E402
from diyfa.bench.results import environment  # noqa: E402
from diyfa.bench.suites import varlen_mix  # noqa: E402
from diyfa.flops import attention_flops  # noqa: E402


def _host_us(fn, n: int = 20) -> float:
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def _kernels_ms(fn, n: int = 10) -> float:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    us = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))
             for e in prof.key_averages())  # fmt: skip
    return us / n / 1e3


def _idle_us(fn, n: int = 10) -> float | None:
    """The GPU's idle time per call between the lengths' copy to the host landing and the
    attention kernel starting (what a packed call's host work after its wait costs), median
    over ``n`` calls queued behind a 256 MB fill each (the GPU busy when the call starts, as
    under do_bench); None without such a copy (equal-length calls)."""
    from torch.profiler import ProfilerActivity, profile

    fill = torch.empty(2**26, dtype=torch.int32, device="cuda")
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fill.zero_()
            fn()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type.name == "CUDA"),
                    key=lambda e: e.time_range.start)  # fmt: skip
    gaps, landed = [], None
    for e in events:
        if "Memcpy DtoH" in e.name:
            landed = e.time_range.end
        elif landed is not None and "_attn_" in e.name:
            gaps.append(e.time_range.start - landed)
            landed = None
    return statistics.median(gaps) if gaps else None


def main() -> int:
    from triton.testing import do_bench

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="varlen_host.jsonl")
    ap.add_argument("--ab", action="store_true")
    a = ap.parse_args()
    lengths, cu, total, longest = varlen_mix()
    env = environment()
    rows = []
    with open(a.out, "w") as f:
        for d, h, hk in ((128, 16, 4), (64, 32, 32)):
            g = torch.Generator(device="cuda").manual_seed(d)

            def rnd(*shape, g=g):
                return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)

            qp, kp, vp = rnd(total, h, d), rnd(total, hk, d), rnd(total, hk, d)
            qe, ke, ve = (t.view(16, 4096, -1, d).transpose(1, 2) for t in (qp, kp, vp))
            for causal in (False, True):
                def flops(mode, equal, causal=causal, h=h, d=d):
                    kw = dict(causal=causal, mode=mode, convention="published")
                    if equal:
                        return attention_flops(16, h, 4096, 4096, d, **kw)
                    return sum(attention_flops(1, h, n, n, d, **kw) for n in lengths)

                runs = ["equal", "packed"]
                if a.ab:
                    runs += ["packed-masked-o"]
                for name in runs:
                    hopper_fwd.VARLEN_O_TMA = name != "packed-masked-o"
                    if name == "equal":
                        q, k, v = (t.detach().requires_grad_() for t in (qe, ke, ve))

                        def call(q=q, k=k, v=v, causal=causal):
                            return diyfa.flash_attention(q, k, v, causal=causal)
                    else:
                        q, k, v = (t.detach().requires_grad_() for t in (qp, kp, vp))

                        def call(q=q, k=k, v=v, causal=causal):
                            return diyfa.flash_attention_varlen(q, k, v, cu, cu, longest, longest,
                                                                causal=causal)  # fmt: skip
                    out = call()
                    dout = torch.randn_like(out)

                    def bwd(out=out, q=q, k=k, v=v, dout=dout):
                        return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

                    def fwd(call=call):
                        with torch.no_grad():
                            return call()

                    bwd()
                    for mode, fn in (("fwd", fwd), ("bwd", bwd)):
                        row = dict(d=d, heads=h, kv_heads=hk, causal=causal, run=name,
                                   mode=mode, host_us=round(_host_us(fn), 1),
                                   kernels_ms=round(_kernels_ms(fn), 4),
                                   idle_us=_idle_us(fn) if mode == "fwd" else None)  # fmt: skip
                        ms = do_bench(fn, rep=100, return_mode="median")
                        fl = flops(mode, name == "equal")
                        row.update(call_ms=round(ms, 4), tflops=round(fl / ms / 1e9, 1),
                                   kernel_tflops=round(fl / row["kernels_ms"] / 1e9, 1))
                        rows.append(row)
                        f.write(json.dumps({**env, **row}) + "\n")
                        print(json.dumps(row), flush=True)
                    hopper_fwd.VARLEN_O_TMA = True
    print(f"\npacked vs equal-length calls ({env['gpu']}, torch {env['torch']}, "
          f"triton {env['triton']})")
    print(f"{'case':28s} {'run':18s} {'host us':>8s} {'idle us':>8s} {'kernels ms':>10s} "
          f"{'call ms':>8s} {'TFLOPS':>7s} {'kernel TFLOPS':>13s}")
    for r in rows:
        case = f"{r['mode']} d{r['d']} h{r['heads']}/{r['kv_heads']}"
        case += " causal" if r["causal"] else ""
        idle = "-" if r["idle_us"] is None else f"{r['idle_us']:.1f}"
        print(f"{case:28s} {r['run']:18s} {r['host_us']:8.1f} {idle:>8s} "
              f"{r['kernels_ms']:10.3f} {r['call_ms']:8.3f} {r['tflops']:7.1f} "
              f"{r['kernel_tflops']:13.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
