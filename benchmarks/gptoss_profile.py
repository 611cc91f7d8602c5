"""Where gpt-oss's attention layers spend a call's time on a CUDA GPU: b1 8192 tokens, 64 query
/ 8 kv heads, d64, bf16, bshd, causal, with sinks; the sliding layers with a (127, 0) window.
Cases: window + sinks, window only, sinks only, plain. Per case: do_bench medians of the
forward and the backward (TFLOPS by exact FLOPs), host us per call (50 calls queued without a
sync), the profiler's kernel list for the first case, then cProfile of 50 calls of its
backward and forward. Prints JSON rows and tables; rows also to $OUT/gptoss_prof.jsonl.

    python3 benchmarks/gptoss_profile.py
"""
# ruff: noqa: E401, E402, E501, E702
import functools
import json
import os
import time

import torch
from triton.testing import do_bench

import diyfa

OUT = os.environ.get("OUT", ".")
torch.manual_seed(0)
b, s, hq, hk, d = 1, 8192, 64, 8, 64
q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
k = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
v = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
sinks = torch.randn(hq, device="cuda", requires_grad=True)
do = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16)
rows = []
for name, kw in (("win127+sinks", dict(window_size=(127, 0), sinks=sinks)),
                 ("win127", dict(window_size=(127, 0))),
                 ("sinks", dict(sinks=sinks)), ("plain", {})):
    window = kw.get("window_size")
    fl_f = diyfa.attention_flops(b, hq, s, s, d, causal=True, window=window, mode="fwd", convention="exact")
    fl_b = diyfa.attention_flops(b, hq, s, s, d, causal=True, window=window, mode="bwd", convention="exact")
    inputs = (q, k, v) + ((sinks,) if "sinks" in kw else ())
    fwd = functools.partial(diyfa.flash_attention, q, k, v, causal=True, layout="bshd", **kw)
    out = fwd()
    bwd = functools.partial(torch.autograd.grad, out, inputs, do, retain_graph=True)
    bwd()
    ms_f = do_bench(fwd, warmup=10, rep=60, return_mode="median")
    ms_b = do_bench(bwd, warmup=10, rep=60, return_mode="median")
    torch.cuda.synchronize()
    for label, fn in (("fwd", fwd), ("bwd", bwd)):
        t0 = time.perf_counter()
        for _ in range(50):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        rows.append(dict(case=name, mode=label, host_us=(t1 - t0) / 50 * 1e6))
    r = dict(case=name, fwd_ms=ms_f, bwd_ms=ms_b, fwd_tflops=fl_f / ms_f / 1e9,
             bwd_tflops=fl_b / ms_b / 1e9)
    rows.append(r)
    print(json.dumps(r))
    if name in ("win127+sinks",):
        from torch.profiler import ProfilerActivity, profile
        for label, fn, limit in (("backward", bwd, 14), ("forward", fwd, 8)):
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    fn()
                torch.cuda.synchronize()
            print(f"== profiler {name} {label} x10")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=limit,
                                            max_name_column_width=60))
for r in rows:
    print(json.dumps(r))
with open(os.path.join(OUT, "gptoss_prof.jsonl"), "w") as f:
    for r in rows:
        f.write(json.dumps(r) + "\n")

# Python-level profile of the first case's backward and forward (host time per call).
import cProfile
import io
import pstats

kw = dict(window_size=(127, 0), sinks=sinks)
out = diyfa.flash_attention(q, k, v, causal=True, layout="bshd", **kw)
bwd = functools.partial(torch.autograd.grad, out, (q, k, v, sinks), do, retain_graph=True)
for label, fn in (("bwd", bwd), ("fwd", lambda: diyfa.flash_attention(q, k, v, causal=True, layout="bshd", **kw))):
    fn(); torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(50):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    sio = io.StringIO()
    pstats.Stats(pr, stream=sio).sort_stats("tottime").print_stats(22)
    print(f"== cProfile {label} x50 (tottime)")
    print(sio.getvalue()[-6000:])
