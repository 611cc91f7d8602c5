"""Host-path A/B in one process (GPU machine): small seed-table calls (and a Hopper causal
forward, a decode step) with Triton's Python launcher and every call checked ("old":
``_launcher.DIRECT`` off, ``checks.checked_before`` bypassed) against the direct C launch
and remembered checks ("both"). Per mode and call: host microseconds per call with the GPU
idle (min and median of 7 x 100 calls, interleaved), do_bench as the bench harness runs it
(L2 cleared; median of 3), forward results compared bitwise with the old mode.

    python3 benchmarks/host_ab.py OUT.jsonl
"""
import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import diyfa
import diyfa.attention as attention
from diyfa import _launcher
from diyfa.bench.harness import host_us_per_call

out_path = sys.argv[1]
real_checked = attention.checked_before


def set_mode(mode):
    _launcher.DIRECT = mode != "old"
    attention.checked_before = real_checked if mode == "both" else (lambda *a: (None, None))
    _launcher.forget_replays()


def cases():
    out = {}
    for s in (512, 1024, 2048):
        q, k, v = (torch.randn(4, 8, s, 64, device="cuda", dtype=torch.float16) for _ in range(3))
        out[f"seed{s} fwd auto"] = (lambda q=q, k=k, v=v: diyfa.flash_attention(q, k, v), s, "fwd")
        out[f"seed{s} fwd hopper"] = (lambda q=q, k=k, v=v: diyfa.flash_attention(
            q, k, v, backend="hopper"), s, "fwd")
        qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
        do = torch.randn_like(q)
        for be in ("auto", "hopper"):
            o = diyfa.flash_attention(qg, kg, vg, backend=be)
            out[f"seed{s} bwd {be}"] = (lambda o=o, qg=qg, kg=kg, vg=vg, do=do: torch.autograd.grad(
                o, (qg, kg, vg), do, retain_graph=True), s, "bwd")
        if s == 512:
            out["seed512 fwd cudnn"] = (lambda q=q, k=k, v=v: _cudnn(q, k, v), s, "fwd")
            out["seed512 fwd sdpa"] = (lambda q=q, k=k, v=v: F.scaled_dot_product_attention(
                q, k, v), s, "fwd")
    q, k, v = (torch.randn(8, 16, 1024, 128, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    out["d128 1024 causal fwd hopper"] = (lambda: diyfa.flash_attention(
        q, k, v, causal=True), 1024, "fwd128")
    dq = torch.randn(4, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    kc, vc = (torch.randn(4, 512, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lens = torch.full((4,), 512, dtype=torch.int32, device="cuda")
    out["decode b4 512 max_seqlen_k"] = (lambda: diyfa.flash_attention_with_kvcache(
        dq, kc, vc, cache_seqlens=lens, max_seqlen_k=512), 0, "decode")
    return out


def _cudnn(q, k, v):
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v)


def flops(s, mode):
    f = 4 * 4 * 8 * s * s * 64
    return f * (2.5 if mode == "bwd" else 1.0)


CASES = cases()
MODES = ("old", "both")
rows = []
ref = {}


def host_min(fn, reps=100):
    return host_us_per_call(fn, reps, warmup=10)


host = {}
bench = {}
same = {}
for rnd in range(7):
    for mode in MODES:
        set_mode(mode)
        for name, (fn, _s, kind) in CASES.items():
            if mode != "old" and ("cudnn" in name or "sdpa" in name):
                continue
            with torch.no_grad() if kind != "bwd" else torch.enable_grad():
                res = fn()
                torch.cuda.synchronize()
                first = res[0] if isinstance(res, tuple) else res
                if rnd == 0 and mode == "old":
                    ref[name] = first.clone()
                elif name in ref and "bwd" not in name:
                    same.setdefault((name, mode), []).append(bool(torch.equal(ref[name], first)))
                host.setdefault((name, mode), []).append(host_min(fn))
                if rnd < 3:
                    bench.setdefault((name, mode), []).append(
                        do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3)

for (name, mode), hs in host.items():
    s_, kind = CASES[name][1], CASES[name][2]
    bs = sorted(bench[(name, mode)])
    r = dict(case=name, mode=mode, host_us_min=round(min(hs), 1),
             host_us_median=round(sorted(hs)[len(hs) // 2], 1), bench_us=round(bs[1], 1),
             bench_all=[round(b, 1) for b in bs], same=all(same.get((name, mode), [True])))
    if kind in ("fwd", "bwd"):
        r["tflops"] = round(flops(s_, kind) / bs[1] / 1e6, 1)
    rows.append(r)
with open(out_path, "w") as f:
    for r in rows:
        f.write(json.dumps(r) + "\n")
print("\n== host us min / median of 7, do_bench us median of 3 (TFLOPS); old -> new")
for name in CASES:
    cells = []
    for mode in MODES:
        m = [r for r in rows if r["case"] == name and r["mode"] == mode]
        if m:
            r = m[0]
            cells.append(f"{r['host_us_min']:6.1f} {r['host_us_median']:6.1f} {r['bench_us']:7.1f}"
                         + (f" ({r['tflops']:5.1f})" if "tflops" in r else "")
                         + ("" if r["same"] else " DIFF"))
    print(f"{name:30s} | " + " | ".join(cells))
