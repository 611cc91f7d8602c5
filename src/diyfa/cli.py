"""The ``diyfa`` command line: info | demo | flops (bench, report, tune, profile: see --help)."""

from __future__ import annotations

import argparse
import json
import os
import sys


def _ensure_interpreter_if_no_gpu() -> bool:
    """Without a GPU, switch the kernels to the Triton interpreter (before they are imported).

    Returns True when running on a GPU."""
    import torch

    if torch.cuda.is_available():
        return True
    os.environ["TRITON_INTERPRET"] = "1"
    return False


def _console():
    try:
        from rich.console import Console

        return Console()
    except ImportError:  # rich is in the bench extra; plain print otherwise
        return None


def _print_table(title: str, columns: list[str], rows: list[list]) -> None:
    console = _console()
    if console is None:
        print(title)
        print(" | ".join(columns))
        for r in rows:
            print(" | ".join(str(c) for c in r))
        return
    from rich.table import Table

    table = Table(title=title)
    for c in columns:
        table.add_column(c, justify="right")
    for r in rows:
        table.add_row(*[str(c) for c in r])
    console.print(table)


# ----------------------------------------------------------------------------------- info
def cmd_info(args) -> int:
    from diyfa.device import check_hopper_features, device_info, measure_ceilings

    info = device_info()
    data = {"device": info.as_dict(), "hopper_features": check_hopper_features()}
    if args.measure:
        data["ceilings"] = measure_ceilings()
    if args.json:
        print(json.dumps(data, indent=2, default=str))
        return 0
    rows = [[k, v] for k, v in info.as_dict().items()]
    if "ceilings" in data:
        rows += [[f"measured {k}", v] for k, v in data["ceilings"].items()]
    _print_table("diyfa device info", ["field", "value"], rows)
    return 0


# ---------------------------------------------------------------------------------- flops
def cmd_flops(args) -> int:
    from diyfa import flops

    if args.op == "matmul":
        f = flops.matmul_flops(args.m, args.n, args.k, batch=args.batch)
        nbytes = flops.matmul_bytes(args.m, args.n, args.k, dtype=args.dtype, batch=args.batch)
        rows = [["flops", f], ["min bytes", nbytes],
                ["intensity (flop/byte)", f"{flops.arithmetic_intensity(f, nbytes):.1f}"]]  # fmt: skip
        _print_table(f"matmul {args.m}x{args.n}x{args.k}", ["quantity", "value"], rows)
        return 0
    sk = args.seqlen_k or args.seqlen_q
    window = None
    if args.window is not None:
        window = args.window[0] if len(args.window) == 1 else tuple(args.window)
    common = dict(head_dim_v=args.head_dim_v, kv_heads=args.kv_heads, causal=args.causal,
                  window=window, align=args.align)  # fmt: skip
    rows = []
    for mode in flops.MODES:
        exact = flops.attention_flops(args.batch, args.heads, args.seqlen_q, sk, args.head_dim,
                                      mode=mode, **common)  # fmt: skip
        published = flops.attention_flops(args.batch, args.heads, args.seqlen_q, sk,
                                          args.head_dim, mode=mode, convention="published",
                                          **common)  # fmt: skip
        naive = flops.attention_flops(args.batch, args.heads, args.seqlen_q, args.seqlen_q,
                                      args.head_dim, mode=mode, convention="published",
                                      head_dim_v=args.head_dim_v, causal=args.causal)  # fmt: skip
        nbytes = flops.attention_bytes(args.batch, args.heads, args.seqlen_q, sk, args.head_dim,
                                       head_dim_v=args.head_dim_v, kv_heads=args.kv_heads,
                                       dtype=args.dtype, mode=mode)  # fmt: skip
        rows.append([mode, f"{exact:,}", f"{published:,}", f"{naive:,}", f"{nbytes:,}",
                     f"{flops.arithmetic_intensity(exact, nbytes):.1f}"])  # fmt: skip
    title = (f"attention b={args.batch} h={args.heads} sq={args.seqlen_q} sk={sk} "
             f"d={args.head_dim} causal={args.causal}")  # fmt: skip
    _print_table(title, ["mode", "exact flops", "published convention",
                         "naive (seqlen_q^2)", "min bytes", "flop/byte"], rows)  # fmt: skip
    if sk != args.seqlen_q:
        print(f"note: seqlen_k/seqlen_q = {sk / args.seqlen_q:.4g}: a FLOPs count that squares "
              "seqlen_q is off by this factor (seed 002).")  # fmt: skip
    return 0


# ----------------------------------------------------------------------------------- demo
def cmd_demo(args) -> int:
    on_gpu = _ensure_interpreter_if_no_gpu()
    import torch

    import diyfa
    from diyfa.device import device_info
    from diyfa.flops import attention_flops
    from diyfa.reference import attention_ref

    info = device_info()
    if on_gpu:
        print(f"GPU: {info.name} (sm_{info.compute_capability[0]}{info.compute_capability[1]}, "
              f"{info.sm_count} SMs)")  # fmt: skip
        device, dtype = "cuda", torch.float16
        check_shapes = [(2, 8, 1000, 1000, 64, False), (2, 8, 1023, 4097, 128, True)]
        bench_seqlens = [512, 1024, 2048, 4096]
        batch, heads, head_dim = 4, 8, 64
    else:
        print("No CUDA GPU: running the same pipeline under the Triton interpreter "
              "(TRITON_INTERPRET=1) on the CPU, on small shapes. Timings below are "
              "interpreter timings, not kernel speed.")  # fmt: skip
        device, dtype = "cpu", torch.float16
        check_shapes = [(1, 2, 113, 77, 40, True), (1, 2, 64, 130, 64, False)]
        bench_seqlens = [64, 128]
        batch, heads, head_dim = 1, 2, 64

    # 1) correctness: forward and gradients against a float64 reference
    rows = []
    torch.manual_seed(0)
    for b, h, sq, sk, d, causal in check_shapes:
        q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=True)
                   for s in (sq, sk, sk))  # fmt: skip
        out = diyfa.flash_attention(q, k, v, causal=causal)
        do = torch.randn_like(out)
        out.backward(do)
        ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref = attention_ref(*ref_in, causal=causal)
        ref.backward(do.double())
        errs = [(out.double() - ref).abs().max().item()]
        errs += [(t.grad.double() - r.grad).abs().max().item() for t, r in zip((q, k, v), ref_in)]
        rows.append([f"{b}x{h}x{sq}x{sk}x{d}", causal] + [f"{e:.1e}" for e in errs])
    _print_table("correctness vs float64 reference (max abs error, fp16)",
                 ["b x h x sq x sk x d", "causal", "out", "dq", "dk", "dv"], rows)  # fmt: skip

    # 2) the flagship benchmark: diyfa vs PyTorch SDPA, forward, the seed's table shape
    import time

    import torch.nn.functional as F

    def timeit(fn):
        fn()
        if on_gpu:
            from triton.testing import do_bench

            return do_bench(fn, warmup=50, rep=200, return_mode="median")
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    rows = []
    for s in bench_seqlens:
        q, k, v = (torch.randn(batch, heads, s, head_dim, device=device, dtype=dtype)
                   for _ in range(3))  # fmt: skip
        f = attention_flops(batch, heads, s, s, head_dim)
        t_sdpa = timeit(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v))
        t_ours = timeit(lambda q=q, k=k, v=v: diyfa.flash_attention(q, k, v))
        rows.append([s, f"{t_sdpa:.3f}", f"{t_ours:.3f}", f"{t_sdpa / t_ours:.2f}x",
                     f"{f / t_ours / 1e9:.1f}" if on_gpu else "-"])  # fmt: skip
    where = info.name if on_gpu else "CPU, Triton interpreter"
    _print_table(f"attention forward, fp16, batch {batch}, heads {heads}, d {head_dim} ({where})",
                 ["seqlen", "SDPA ms", "diyfa ms", "speed-up", "diyfa TFLOPS"], rows)  # fmt: skip
    return 0


# ----------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="diyfa", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("info", help="device facts, Hopper features, datasheet peaks")
    s.add_argument("--measure", action="store_true", help="also measure cuBLAS and copy ceilings")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_info)

    s = sub.add_parser("demo", help="correctness check + attention benchmark vs PyTorch SDPA")
    s.set_defaults(func=cmd_demo)

    s = sub.add_parser("flops", help="exact FLOPs, minimum bytes and intensity")
    fsub = s.add_subparsers(dest="op", required=True)
    a = fsub.add_parser("attention")
    a.add_argument("--batch", type=int, default=1)
    a.add_argument("--heads", type=int, default=1)
    a.add_argument("--kv-heads", type=int, default=None)
    a.add_argument("--seqlen-q", type=int, required=True)
    a.add_argument("--seqlen-k", type=int, default=None)
    a.add_argument("--head-dim", type=int, default=64)
    a.add_argument("--head-dim-v", type=int, default=None)
    a.add_argument("--causal", action="store_true")
    a.add_argument("--window", type=int, nargs="+", default=None, help="W (causal) or LEFT RIGHT")
    a.add_argument("--align", choices=["bottom_right", "top_left"], default="bottom_right")
    a.add_argument("--dtype", default="bf16")
    a.set_defaults(func=cmd_flops)
    m = fsub.add_parser("matmul")
    m.add_argument("m", type=int)
    m.add_argument("n", type=int)
    m.add_argument("k", type=int)
    m.add_argument("--batch", type=int, default=1)
    m.add_argument("--dtype", default="bf16")
    m.set_defaults(func=cmd_flops)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError) as e:
        print(f"diyfa: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
