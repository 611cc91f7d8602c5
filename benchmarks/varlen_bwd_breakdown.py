"""Where the packed backward's time goes against the equal-length yardstick (issue 13: varlen
>= 0.95x the TFLOPS of the same tokens as equal-length batches), on a CUDA GPU (sm90).

For the varlen suite's mix (diyfa.bench.suites.varlen_mix: 64k tokens of 128..8192) and the
varlen-equal suite's batches (sequences of the mix's FLOP-weighted mean length), bf16, each
backward mode ("auto", the atomic dQ ``backend="hopper"``, the deterministic path): every
kernel's GPU time per backward (torch.profiler, 10 backwards), their sum, and the wall time
of one backward (CUDA events around ``torch.autograd.grad``, median of 20), so kernel time and
host time are told apart. TFLOPS by exact FLOPs (per sequence, causal halved as the suites
count them; backward 2.5x the forward).

    python3 benchmarks/varlen_bwd_breakdown.py [--dims 128,64] [--causal both]
        [--orders 1,0]   (hopper_bwd.VARLEN_BY_SEQUENCE for the packed cases: 1 a
                          sequence's key blocks together, 0 all by weight)
        [--equal-plain]  (the equal-length batches also with hopper_bwd.DQ_ROWS_PERMUTED
                          off: the atomic dQ's plain row order, as packed calls keep it)

One JSON line per (case, mode) to ``$OUT/varlen_bwd_breakdown.jsonl``; a table last.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

import diyfa
from diyfa.bench.suites import varlen_mix

MODES = {"auto": {}, "atomic": dict(backend="hopper"),
         "deterministic": dict(backend="hopper", deterministic=True)}  # fmt: skip


def flops(lengths, h, d, causal) -> float:
    return sum(4 * h * n * n * d * 2.5 / (2 if causal else 1) for n in lengths)


def packed_case(d, causal):
    lengths, cu, total, longest = varlen_mix()
    h = 2048 // d
    hk = h if d == 64 else 4
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(total, hk, d, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))  # fmt: skip

    def forward(q, k, v, **kw):
        return diyfa.flash_attention_varlen(q, k, v, cu, cu, longest, longest, causal=causal,
                                            **kw)  # fmt: skip
    return (q, k, v), forward, flops(lengths, h, d, causal)


def equal_case(d, causal):
    lengths, _, total, _ = varlen_mix()
    mean = sum(n * n for n in lengths) / total
    seq = max(128, int(round(mean / 128)) * 128)
    b = max(1, round(total / seq))
    h = 2048 // d
    hk = h if d == 64 else 4
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, seq, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(b, seq, hk, d, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))  # fmt: skip

    def forward(q, k, v, **kw):
        return diyfa.flash_attention(q, k, v, causal=causal, layout="bshd", **kw)
    return (q, k, v), forward, flops([seq] * b, h, d, causal)


def measure(inputs, forward, mode):
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = forward(*leaves, **MODES[mode])
    do = torch.randn_like(out)
    grad = lambda: torch.autograd.grad(out, leaves, do, retain_graph=True)  # noqa: E731
    for _ in range(3):
        grad()
    torch.cuda.synchronize()
    walls = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        grad()
        b.record()
        torch.cuda.synchronize()
        walls.append(a.elapsed_time(b) * 1e3)
    from triton.testing import do_bench

    bench_us = do_bench(grad, warmup=10, rep=60, return_mode="median") * 1e3  # (L2 flushed)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            grad()
        torch.cuda.synchronize()
    times = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            times[e.name[:60]] += e.device_time_total / 10
    return statistics.median(walls), times, bench_us


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", default="128,64")
    ap.add_argument("--causal", default="both", choices=("both", "yes", "no"))
    ap.add_argument("--orders", default="", help="packed work orders to run, e.g. 1,0")
    ap.add_argument("--equal-plain", action="store_true",
                    help="also the equal-length batches with the dQ rows in plain order")
    a = ap.parse_args()
    from diyfa.attention import hopper_bwd

    orders = [bool(int(x)) for x in a.orders.split(",")] if a.orders else [None]
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[a.causal]
    path = os.path.join(os.environ.get("OUT", "."), "varlen_bwd_breakdown.jsonl")
    rows = []
    with open(path, "w") as f:
        for d in (int(x) for x in a.dims.split(",")):
            for causal in causals:
                kinds = [("equal", equal_case, None)] + (
                    [("equal-plain", equal_case, None)] if a.equal_plain else []) + [
                    ("packed" if order is None else f"packed-order{int(order)}", packed_case,
                     order) for order in orders]  # fmt: skip
                for kind, make, order in kinds:
                    inputs, forward, fl = make(d, causal)
                    for mode in MODES:
                        if order is not None:
                            hopper_bwd.VARLEN_BY_SEQUENCE = order
                        hopper_bwd.DQ_ROWS_PERMUTED = kind != "equal-plain"
                        wall, times, bench_us = measure(inputs, forward, mode)
                        kernels = sum(times.values())
                        row = dict(d=d, causal=causal, kind=kind, mode=mode, wall_us=wall,
                                   kernel_us=kernels, do_bench_us=bench_us,
                                   tflops_do_bench=fl / bench_us / 1e6,
                                   tflops_wall=fl / wall / 1e6,
                                   tflops_kernels=fl / kernels / 1e6,
                                   kernels={k: round(v, 1) for k, v in times.most_common()})
                        f.write(json.dumps(row) + "\n")
                        f.flush()
                        rows.append(row)
                        print(f"d{d} causal={causal} {kind} {mode}: wall {wall:.0f} us "
                              f"({row['tflops_wall']:.0f} TFLOPS), kernels {kernels:.0f} us "
                              f"({row['tflops_kernels']:.0f}), do_bench {bench_us:.0f} us "
                              f"({row['tflops_do_bench']:.0f})", flush=True)
                        for name, us in times.most_common(4):
                            print(f"      {us:8.1f} us  {name}", flush=True)
                    del inputs
                    torch.cuda.empty_cache()
    print("\npacked / equal TFLOPS, by wall time and by kernel time")
    for d in (int(x) for x in a.dims.split(",")):
        for causal in causals:
            for mode in MODES:
                e = next(r for r in rows if (r["d"], r["causal"], r["kind"], r["mode"]) ==
                         (d, causal, "equal", mode))  # fmt: skip
                for p in (r for r in rows if (r["d"], r["causal"], r["mode"]) == (d, causal, mode)
                          and r["kind"] != "equal"):  # fmt: skip
                    print(f"d{d} causal={causal!s:5} {mode:13s} {p['kind']:14s} wall "
                          f"{p['tflops_wall']:4.0f} / {e['tflops_wall']:4.0f} = "
                          f"{p['tflops_wall'] / e['tflops_wall']:.2f}   kernels "
                          f"{p['tflops_kernels']:4.0f} / {e['tflops_kernels']:4.0f} = "
                          f"{p['tflops_kernels'] / e['tflops_kernels']:.2f}   do_bench "
                          f"{p['tflops_do_bench']:4.0f} / {e['tflops_do_bench']:4.0f} = "
                          f"{p['tflops_do_bench'] / e['tflops_do_bench']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
