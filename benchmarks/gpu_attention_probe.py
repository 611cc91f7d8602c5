"""Attention speed probe for the GPU machine: diyfa vs SDPA backends, one process.

A developer's tool for tuning the kernels (the official runs are `diyfa bench flash`):
times forward and backward on the seed table and FlashAttention's sweep, prints the
autotuner's choices, writes JSON lines to $OUT/attention_probe.jsonl and a table last.

    python benchmarks/gpu_attention_probe.py [--quick] [--dims 64,128] [--seqlens ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import diyfa
from diyfa import tuning
from diyfa.flops import attention_flops

BACKENDS = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}


def provider_fn(name, causal):
    if name == "diyfa":
        return lambda q, k, v: diyfa.flash_attention(q, k, v, causal=causal)
    backend = BACKENDS[name]

    def run(q, k, v):
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def time_case(name, b, h, s, d, causal, dtype, mode):
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=dtype, requires_grad=mode == "bwd")
               for _ in range(3))  # fmt: skip
    fn = provider_fn(name, causal)
    if mode == "fwd":
        with torch.no_grad():
            fn(q, k, v)
            return do_bench(lambda: fn(q, k, v), warmup=50, rep=200, return_mode="median")
    out = fn(q, k, v)
    do = torch.randn_like(out)
    out.backward(do, retain_graph=True)
    return do_bench(lambda: out.backward(do, retain_graph=True), warmup=50, rep=200,
                    grad_to_none=[q, k, v], return_mode="median")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--providers", default="diyfa,sdpa-flash,sdpa-cudnn")
    ap.add_argument("--modes", default="fwd,bwd")
    ap.add_argument("--no-seed", action="store_true")
    args = ap.parse_args()
    out_dir = os.environ.get("OUT", ".")
    gpu = torch.cuda.get_device_name()
    print(f"{gpu} torch {torch.__version__} triton {triton.__version__} "
          f"autotune={tuning.autotune_enabled()}", flush=True)  # fmt: skip
    cases = []
    if not args.no_seed:
        cases += [(4, 8, s, 64, False, torch.float16, "fwd") for s in (512, 1024, 2048, 4096)]
    seqlens = [int(s) for s in args.seqlens.split(",")]
    if args.quick:
        seqlens = [s for s in seqlens if s in (1024, 4096, 16384)]
    for d in (int(x) for x in args.dims.split(",")):
        for causal in (False, True):
            for s in seqlens:
                for mode in args.modes.split(","):
                    cases.append((16384 // s, 2048 // d, s, d, causal, torch.bfloat16, mode))
    rows = []
    with open(os.path.join(out_dir, "attention_probe.jsonl"), "a") as f:
        for b, h, s, d, causal, dtype, mode in cases:
            flops = attention_flops(b, h, s, s, d, causal=causal, mode=mode,
                                    convention="published")  # fmt: skip
            row = {"b": b, "h": h, "s": s, "d": d, "causal": causal, "mode": mode,
                   "dtype": str(dtype).removeprefix("torch."), "gpu": gpu}  # fmt: skip
            for p in args.providers.split(","):
                t0 = time.time()
                try:
                    ms = time_case(p, b, h, s, d, causal, dtype, mode)
                    row[p] = round(flops / ms / 1e9, 1)
                except Exception as e:  # record and go on
                    row[p] = None
                    print(f"  {p} failed on {row}: {type(e).__name__}: {str(e)[:200]}")
                row[p + "_s"] = round(time.time() - t0, 1)
            f.write(json.dumps(row) + "\n")
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\nchosen configs (autotuner):")
    for fn_args, tuned in _autotuned_items():
        print(fn_args, {str(k): str(v) for k, v in tuned.cache.items()})
    provs = args.providers.split(",")
    print("\nTFLOPS (published convention)")
    print("d   causal mode  seqlen  " + "  ".join(f"{p:>10}" for p in provs) + "  diyfa/flash")
    for r in rows:
        vals = "  ".join(f"{(r[p] or 0):10.1f}" for p in provs)
        ratio = (r.get("diyfa") or 0) / (r.get("sdpa-flash") or float("inf"))
        print(f"{r['d']:<4}{r['causal']!s:<7}{r['mode']:<6}{r['s']:<8}{vals}  {ratio:.2f}")
    return 0


def _autotuned_items():
    # tuning.autotuned is functools.cache'd: walk the Autotuner objects it built.
    import gc

    from triton.runtime.autotuner import Autotuner

    for obj in gc.get_objects():
        if isinstance(obj, Autotuner) and obj.cache:
            yield obj.base_fn.__name__, obj


if __name__ == "__main__":
    sys.exit(main())
