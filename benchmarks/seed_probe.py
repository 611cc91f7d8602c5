"""Seed-table probe: where the small fp16 b4 h8 d64 calls spend their time (GPU machine).

    python3 benchmarks/seed_probe.py OUT.jsonl

For each seqlen: do_bench (L2 cleared, as the bench harness), do_bench_cudagraph, host us per
call (enqueue rate), kernel list and device time from torch.profiler; diyfa auto / portable /
hopper, cuDNN, flash; then pinned portable forward configs.
"""
import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench, do_bench_cudagraph

import diyfa
from diyfa import tuning
from diyfa.bench.harness import host_us_per_call

out_path = sys.argv[1]
rows = []
SEQS = [512, 1024, 2048, 4096]


def flops(s, mode):
    f = 4 * 4 * 8 * s * s * 64
    return f * (2.5 if mode == "bwd" else 1.0)


def providers(q, k, v):
    def d(backend):
        return lambda: diyfa.flash_attention(q, k, v, backend=backend)

    def sd(b):
        def f():
            with sdpa_kernel([b]):
                return F.scaled_dot_product_attention(q, k, v)
        return f
    return {"auto": d("auto"), "portable": d("portable"), "hopper": d("hopper"),
            "cudnn": sd(SDPBackend.CUDNN_ATTENTION), "flash": sd(SDPBackend.FLASH_ATTENTION)}


def host_us(fn, n=200):
    return host_us_per_call(fn, n, warmup=1)


def kernels(fn):
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    ks = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            ks.setdefault(e.name[:60], []).append(e.time_range.elapsed_us())
    return {k: round(sum(v) / 5, 2) for k, v in ks.items()}


def measure(tag, s, mode, fn):
    try:
        fn()
        torch.cuda.synchronize()
        ms = do_bench(fn, warmup=25, rep=200, return_mode="median")
        try:
            if mode == "bwd":
                raise RuntimeError("skipped")
            g = do_bench_cudagraph(fn, rep=200, return_mode="median")
        except Exception as e:  # noqa: BLE001
            g = float("nan")
            print(tag, "graph failed", type(e).__name__, str(e)[:100])
        h = host_us(fn)
        ks = kernels(fn)
        r = dict(tag=tag, s=s, mode=mode, us=ms * 1e3, graph_us=g * 1e3, host_us=h,
                 tflops=flops(s, mode) / ms / 1e9, graph_tflops=flops(s, mode) / g / 1e9,
                 kernels=ks, kernel_us=round(sum(ks.values()), 2))
    except Exception as e:  # noqa: BLE001
        r = dict(tag=tag, s=s, mode=mode, error=f"{type(e).__name__}: {str(e)[:200]}")
    rows.append(r)
    print(json.dumps(r), flush=True)


for s in SEQS:
    q, k, v = (torch.randn(4, 8, s, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    for name, fn in providers(q, k, v).items():
        measure(name, s, "fwd", fn)
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    do = torch.randn_like(q)
    for name, fn in providers(qg, kg, vg).items():
        try:
            o = fn()
        except Exception as e:  # noqa: BLE001
            print(name, "bwd fwd failed", e)
            continue
        measure(name, s, "bwd", lambda o=o, qg=qg, kg=kg, vg=vg, do=do: torch.autograd.grad(
            o, (qg, kg, vg), do, retain_graph=True))

# pinned portable forward configs at the short seqlens
for s in (512, 1024, 2048):
    q, k, v = (torch.randn(4, 8, s, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    for bm, bn, w, st in [(128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (64, 64, 4, 2),
                          (64, 128, 4, 2), (64, 32, 4, 3), (128, 128, 8, 2), (32, 64, 4, 3),
                          (64, 64, 8, 3)]:
        try:
            with tuning.pinned("attn_fwd", BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st):
                measure(f"portable-{bm}-{bn}-{w}-{st}", s, "fwd",
                        lambda q=q, k=k, v=v: diyfa.flash_attention(q, k, v,
                                                                    backend="portable"))
        except Exception as e:  # noqa: BLE001
            print("pin failed", bm, bn, w, st, e)

with open(out_path, "w") as f:
    for r in rows:
        f.write(json.dumps(r) + "\n")
print("\n== table (us / graph_us / host_us / kernel_us, TFLOPS)")
for r in rows:
    if "error" in r:
        print(r["tag"], r["s"], r["mode"], r["error"][:80])
    else:
        print(f"{r['tag']:24s} {r['s']:5d} {r['mode']} {r['us']:8.1f} {r['graph_us']:8.1f} "
              f"{r['host_us']:7.1f} {r['kernel_us']:8.1f}  {r['tflops']:6.1f} "
              f"{r['graph_tflops']:6.1f}")
