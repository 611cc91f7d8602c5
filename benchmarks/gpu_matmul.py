"""GPU benchmark of diyfa.triton_matmul against cuBLAS (torch.matmul / torch._scaled_mm).

Run on a CUDA GPU: ``python benchmarks/gpu_matmul.py``. It first checks correctness on a few
shapes (error against a float64 reference at most 2x cuBLAS's), then times every case with
``triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")`` after one untimed
call (which also autotunes). Random normal inputs. One JSON line per measurement goes to
``$OUT/gpu_matmul.jsonl`` when OUT is set; a table (TFLOPS, ours / cuBLAS) is printed last.

fp8: e4m3 with per-tensor scales, b column-major (``torch._scaled_mm`` requires it). Triton's
fp8 dots on Hopper use the tensor cores' fast accumulation, so both cuBLAS modes are timed:
``use_fast_accum=False`` (the default) and ``True`` (the like-for-like comparison).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch
import triton
from triton.testing import do_bench

from diyfa import triton_matmul
from diyfa.reference import matmul_ref

SQUARE = [1024, 2048, 4096, 8192]
FP8_SIZES = [2048, 4096, 8192]
LLM_SHAPES = [(8192, 4096, 14336), (8192, 14336, 4096)]  # (M, N, K), bf16
FP8 = torch.float8_e4m3fn


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _env() -> dict:
    return {
        "gpu": torch.cuda.get_device_name(),
        "capability": ".".join(map(str, torch.cuda.get_device_capability())),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }


def _inputs(M, N, K, dtype):
    """a (M, K) row-major; b (K, N): row-major for 16-bit, column-major for fp8."""
    if dtype == FP8:
        a = torch.randn(M, K, device="cuda").to(FP8)
        b = torch.randn(N, K, device="cuda").to(FP8).t()
        scales = (torch.tensor(0.5, device="cuda"), torch.tensor(2.0, device="cuda"))
        return a, b, scales
    a = torch.randn(M, K, device="cuda", dtype=dtype)
    b = torch.randn(K, N, device="cuda", dtype=dtype)
    return a, b, (None, None)


def _providers(a, b, scales, dtype) -> dict:
    sa, sb = scales
    if dtype == FP8:
        return {
            "diyfa": lambda: triton_matmul(a, b, scale_a=sa, scale_b=sb),
            "cublas": lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb,
                                               out_dtype=torch.bfloat16),  # fmt: skip
            "cublas-fast-accum": lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb,
                                                          out_dtype=torch.bfloat16,
                                                          use_fast_accum=True),  # fmt: skip
        }
    return {"diyfa": lambda: triton_matmul(a, b), "cublas": lambda: torch.matmul(a, b)}


def check_correctness() -> bool:
    """Error against float64 must be <= 2x cuBLAS's on a few shapes, odd ones included."""
    print("correctness (max error vs float64; must be <= 2x cuBLAS's):")
    cases = [((512, 512, 512), torch.float16), ((1000, 4097, 1000), torch.bfloat16),
             ((2048, 2048, 2048), torch.bfloat16), ((4096, 4096, 4096), torch.float16),
             ((2048, 2048, 2048), FP8), ((1024, 4096, 14336), torch.bfloat16)]  # fmt: skip
    ok = True
    for (M, N, K), dtype in cases:
        label = f"  {M}x{N}x{K} {_name(dtype):>13}"
        try:
            a, b, (sa, sb) = _inputs(M, N, K, dtype)
            ref = matmul_ref(a, b)
            if sa is not None:
                ref = ref * sa.item() * sb.item()
            provs = _providers(a, b, (sa, sb), dtype)
            ours = (provs["diyfa"]().double() - ref).abs().max().item()
            theirs = (provs["cublas"]().double() - ref).abs().max().item()
            passed = ours <= 2 * theirs
            ok &= passed
            print(f"{label}: {'PASS' if passed else 'FAIL'}  ours {ours:.3g}  cuBLAS {theirs:.3g}")
        except Exception as exc:  # keep going: report and move on
            ok = False
            print(f"{label}: ERROR {type(exc).__name__}: {exc}")
            traceback.print_exc(limit=3)
    return ok


def bench_case(M, N, K, dtype, env, out_file) -> dict:
    """Time every provider on one shape; returns {provider: TFLOPS}."""
    a, b, scales = _inputs(M, N, K, dtype)
    flops = 2.0 * M * N * K
    result = {}
    for provider, fn in _providers(a, b, scales, dtype).items():
        try:
            fn()  # untimed: compiles and autotunes
            torch.cuda.synchronize()
            ms = do_bench(fn, warmup=50, rep=200, return_mode="median")
        except Exception as exc:
            print(f"  {M}x{N}x{K} {_name(dtype)} {provider}: ERROR {type(exc).__name__}: {exc}")
            continue
        tflops = flops / ms / 1e9
        result[provider] = tflops
        record = {"op": "matmul", "M": M, "N": N, "K": K, "dtype": _name(dtype),
                  "provider": provider, "median_ms": ms, "tflops": tflops, **env,
                  "time": time.strftime("%Y-%m-%dT%H:%M:%S")}  # fmt: skip
        if out_file is not None:
            out_file.write(json.dumps(record) + "\n")
            out_file.flush()
        print(f"  {M}x{N}x{K} {_name(dtype):>13} {provider:>17}: {ms:8.3f} ms {tflops:7.1f} TFLOPS")
    return result


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    torch.manual_seed(0)
    env = _env()
    print(f"{env['gpu']} (sm{env['capability']}), torch {env['torch']}, triton {env['triton']}")
    start = time.time()
    check_correctness()

    cases = [(s, s, s, d) for d in (torch.float16, torch.bfloat16) for s in SQUARE]
    if torch.cuda.get_device_capability() >= (8, 9):
        cases += [(s, s, s, FP8) for s in FP8_SIZES]
    cases += [(M, N, K, torch.bfloat16) for M, N, K in LLM_SHAPES]

    out_dir = os.environ.get("OUT")
    out_file = open(os.path.join(out_dir, "gpu_matmul.jsonl"), "a") if out_dir else None
    rows = []
    print("timing:")
    try:
        for M, N, K, dtype in cases:
            try:
                rows.append((M, N, K, dtype, bench_case(M, N, K, dtype, env, out_file)))
            except Exception as exc:
                print(f"  {M}x{N}x{K} {_name(dtype)}: ERROR {type(exc).__name__}: {exc}")
            torch.cuda.empty_cache()
    finally:
        if out_file is not None:
            out_file.close()

    print(f"\n{'M x N x K':>20} {'dtype':>13} {'ours':>7} {'cuBLAS':>7} {'ratio':>6}"
          f" {'fast-acc':>8} {'ratio':>6}   (TFLOPS)")  # fmt: skip
    for M, N, K, dtype, r in rows:
        ours, theirs, fast = r.get("diyfa"), r.get("cublas"), r.get("cublas-fast-accum")

        def fmt(x, width=7):
            return f"{x:{width}.1f}" if x is not None else f"{'-':>{width}}"

        def ratio(x, y):
            return f"{x / y:6.2f}" if x is not None and y else f"{'-':>6}"

        line = f"{f'{M}x{N}x{K}':>20} {_name(dtype):>13} {fmt(ours)} {fmt(theirs)} "
        line += ratio(ours, theirs)
        if dtype == FP8:
            line += f" {fmt(fast, 8)} {ratio(ours, fast)}"
        print(line)
    print(f"\ntotal {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
