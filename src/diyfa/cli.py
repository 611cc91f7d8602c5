"""The ``diyfa`` command line: info | demo | flops | bench | report | tune | profile."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

WARMUP_MS, REP_MS = 50, 200  # diyfa bench's do_bench defaults (the resume hint repeats others)


class CommandError(Exception):
    """This machine cannot do what was asked (no GPU, no ncu): ``main`` prints the message as
    one line on stderr and exits 1."""


def _require_gpu(what: str, instead: str) -> None:
    """CommandError naming ``what`` needs the GPU and what was done ``instead``."""
    import torch

    if not torch.cuda.is_available():
        raise CommandError(f"{what} needs a CUDA GPU and torch {torch.__version__} sees none "
                           f"here; {instead}")  # fmt: skip


def _ensure_interpreter_if_no_gpu() -> bool:
    """Without a GPU, switch the kernels to the Triton interpreter (before they are imported).

    Returns True when running on a GPU."""
    import torch

    if torch.cuda.is_available():
        return True
    os.environ["TRITON_INTERPRET"] = "1"
    return False


def _console(width: int | None = None):
    try:
        from rich.console import Console

        console = Console()
        if width and not console.is_terminal:  # files and pipes: do not squeeze wide tables
            console = Console(width=width)
        return console
    except ImportError:  # rich is in the bench extra; plain print otherwise
        return None


def _print_table(
    title: str, columns: list[str], rows: list[list], width: int | None = None
) -> None:
    console = _console(width)
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

    if args.measure:
        _require_gpu("info --measure", "`diyfa info` without --measure describes this machine")
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
        rows = [
            ["flops", f],
            ["min bytes", nbytes],
            ["intensity (flop/byte)", f"{flops.arithmetic_intensity(f, nbytes):.1f}"],
        ]
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
        errs += [
            (t.grad.double() - r.grad).abs().max().item()
            for t, r in zip((q, k, v), ref_in, strict=True)
        ]
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
        speedup = f"{t_sdpa / t_ours:.2f}x" if on_gpu else "- (interpreter)"
        rows.append([s, f"{t_sdpa:.3f}", f"{t_ours:.3f}", speedup,
                     f"{f / t_ours / 1e9:.1f}" if on_gpu else "-"])  # fmt: skip
    where = info.name if on_gpu else "CPU, Triton interpreter"
    _print_table(f"attention forward, fp16, batch {batch}, heads {heads}, d {head_dim} ({where})",
                 ["seqlen", "SDPA ms", "diyfa ms", "speed-up", "diyfa TFLOPS"], rows)  # fmt: skip
    return 0


# ---------------------------------------------------------------------------------- bench
def _split(value: str | None) -> list[str] | None:
    return [v.strip() for v in value.split(",") if v.strip()] if value else None


def _resume_command(args, path) -> str:
    """The ``diyfa bench`` command that continues this one's run in ``path``."""
    parts = ["diyfa", "bench", args.target]
    for flag, value in (("--suite", args.suite), ("--providers", args.providers),
                        ("--modes", args.modes)):  # fmt: skip
        if value:
            parts += [flag, value]
    parts += ["--quick"] if args.quick else []
    parts += ["--warmup", str(args.warmup)] if args.warmup != WARMUP_MS else []
    parts += ["--rep", str(args.rep)] if args.rep != REP_MS else []
    parts += ["--no-error"] if args.no_error else []
    return shlex.join([*parts, "--resume", str(path)])


def _at_least_one(text: str) -> int:
    """argparse type: an integer >= 1."""
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def _same_measuring(run: dict, options, path) -> None:
    """Refuse to continue ``run`` with other timing or error-check options: its rows and the
    new ones share a run id and must be measured alike. Which jobs run (target, suites,
    providers, modes, --quick) may differ: what is done is skipped, the rest is measured."""
    before = dict(run.get("options") or {})
    before.setdefault("rounds", 1)  # (runs from before --rounds were timed once)
    differ = {k: (before[k], v) for k, v in vars(options).items() if k in before and before[k] != v}
    if differ:
        was = ", ".join(f"{k}={a!r}" for k, (a, _) in differ.items())
        now = ", ".join(f"{k}={b!r}" for k, (_, b) in differ.items())
        raise ValueError(f"cannot resume {path}: its run {run.get('run_id')} was measured with "
                         f"{was}, this command with {now}; give the same --warmup/--rep/"
                         "--rounds/--no-error, or start a new file with --out")  # fmt: skip


def cmd_bench(args) -> int:
    on_gpu = _ensure_interpreter_if_no_gpu()
    from diyfa.bench import harness, progress, results, suites
    from diyfa.bench import providers as _providers
    from diyfa.device import device_info, measure_ceilings

    suite_names = _split(args.suite)
    if args.list:
        for name, make in suites.SUITES.items():
            for target in suites.TARGETS:
                plan = make(target, args.quick)
                if plan is not None:
                    print(
                        f"{name:11s} {target:7s} {len(plan.cases):3d} cases, modes "
                        f"{','.join(plan.modes)}: " + "; ".join(c.label() for c in plan.cases)
                    )
        for op in ("attention", "varlen", "decode", "matmul"):
            for n in _providers.names(op):
                p = _providers.get(op, n)
                why = p.unavailable()
                print(f"provider {op:9s} {n:15s} {'unavailable: ' + why if why else 'available'}")
        return 0
    if not on_gpu:
        print(
            "No CUDA GPU: the suites need one. Running the 'smoke' suite (tiny shapes) in the "
            "Triton interpreter to check the pipeline; its timings are not kernel speed."
        )
        suite_names = ["smoke"]
    plans = suites.plans(args.target, suite_names, quick=args.quick)
    providers, modes = _split(args.providers), _split(args.modes)
    jobs = harness.expand(plans, providers, modes)
    names = sorted({p.suite for p in plans})
    info = device_info()
    env = results.environment()
    options = harness.Options(warmup_ms=args.warmup, rep_ms=args.rep,
                              check_error=not args.no_error, rounds=args.rounds)  # fmt: skip
    plan_options = {"quick": args.quick, "target": args.target, "providers": providers,
                    "modes": modes}  # fmt: skip
    done: dict = {}
    if args.resume:
        path = args.resume
        run, finished = results.resume_point(path, env)
        _same_measuring(run, options, path)
        done = {results.record_key(r): r for r in finished}
        ceilings = run.get("ceilings")  # the run's own, measured once when it began
        header = {**{k: v for k, v in run.items() if k != "_file"}, "env": env,
                  "suites": names, "options": {**vars(options), **plan_options},
                  "resumed": True}  # fmt: skip
    else:
        ceilings = None
        if on_gpu and not args.no_ceilings:
            print("measuring the cuBLAS and copy ceilings once for this run ...")
            ceilings = measure_ceilings()
        header = results.run_header(env, suites=names, device=info.as_dict(), ceilings=ceilings,
                                    options={**vars(options), **plan_options})  # fmt: skip
        if args.out:
            path = args.out
        elif on_gpu:
            path = results.default_path(env, names)
        else:
            path = "report/interpreter_smoke.jsonl"
    todo = [j for j in jobs if harness.job_key(j) not in done]
    for op in ("attention", "varlen", "decode", "matmul"):
        for n in _providers.names(op):
            why = _providers.get(op, n).unavailable()
            if why and any(j[2] == n and j[1].op == op for j in todo):
                print(f"note: {op} provider {n} is unavailable here: {why}")
    skipped = len(jobs) - len(todo)
    print(f"{len(todo)} measurements ({', '.join(names)}) -> {path}"
          + (f" (resuming run {header['run_id']}: {skipped} of this plan's {len(jobs)} "
             "already there)" if args.resume else ""))  # fmt: skip
    new: list[dict] = []
    if todo:
        h = harness.Harness(options, env=env, run_id=header["run_id"],
                            datasheet=info.datasheet, ceilings=ceilings)  # fmt: skip
        writer = results.ResultsWriter(path, header)
        try:
            new = harness.run(plans, h, providers=providers, modes=modes, writer=writer,
                              progress=progress.wanted(args.no_progress), done=done)  # fmt: skip
        except KeyboardInterrupt:
            print(f"diyfa: interrupted: {writer.count} finished measurements of this command "
                  f"are in {path} ({len(todo) - writer.count} left); resume with: "
                  f"{_resume_command(args, path)}", file=sys.stderr)  # fmt: skip
            return 130
        finally:
            writer.close()
    by_key = {**done, **{results.record_key(r): r for r in new}}
    records = [by_key[k] for k in map(harness.job_key, jobs) if k in by_key]
    columns, rows, notes = harness.summary_rows(records)
    _print_table(f"diyfa bench {args.target} ({info.name or 'CPU, Triton interpreter'})",
                 columns, rows, width=220)  # fmt: skip
    for note in notes:
        print(note)
    print(f"results: {path}  (render with: diyfa report {path})")
    return 0


# --------------------------------------------------------------------------------- report
def cmd_report(args) -> int:
    from diyfa.bench import results
    from diyfa.report import render

    files = args.files or results.latest_files(args.results_dir)
    if not files:
        print(
            f"diyfa: no results files given and none in {args.results_dir}/ "
            "(run `diyfa bench ...` on a GPU first)",
            file=sys.stderr,
        )
        return 2
    out = render(files, args.out)
    print(f"rendered {len(files)} file(s): {', '.join(str(f) for f in files)}")
    print(f"  {out['markdown']}\n  {out['html']}  ({len(out['figures'])} plots embedded)")
    return 0


# ----------------------------------------------------------------------------------- tune
def cmd_tune(args) -> int:
    import torch

    from diyfa.bench import blocksize, progress

    print(blocksize.format_seed_arithmetic())
    if not torch.cuda.is_available():
        print(
            "\nNo CUDA GPU: the block-size sweep needs one (compiled kernels report registers, "
            "spills and shared memory; the interpreter compiles nothing). Occupancy "
            "arithmetic only, Hopper limits:"
        )
        rows = []
        for bm, bn, d, stages, warps, regs in ((128, 128, 64, 1, 4, 0), (128, 128, 64, 2, 8, 128),
                                               (128, 64, 128, 2, 8, 168), (64, 64, 256, 2, 4, 200),
                                               (128, 128, 128, 3, 8, 255)):  # fmt: skip
            smem = blocksize.attention_tile_smem(bm, bn, d, 2, kv_stages=stages)
            occ = blocksize.occupancy(smem_per_block=smem, regs_per_thread=regs, num_warps=warps)
            rows.append([bm, bn, d, stages, warps, regs or "-", f"{smem / 1024:.0f}",
                         occ["blocks_per_sm"], occ["limiter"]])  # fmt: skip
        _print_table("attention tile: blocks per SM (fp16/bf16, K/V stages)",
                     ["BLOCK_M", "BLOCK_N", "d", "K/V stages", "warps", "regs/thread",
                      "smem KiB", "blocks/SM", "limited by"], rows, width=160)  # fmt: skip
        sys.stdout.flush()  # the arithmetic above, then the error line below
        _require_gpu("the block-size sweep", "printed the arithmetic above only")
    kernels = _split(args.kernels) or ["attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq", "matmul"]
    for k in kernels:
        if k not in blocksize.KERNELS:
            raise ValueError(f"unknown kernel {k!r}; accepted: {sorted(blocksize.KERNELS)}")
    table_path = args.write_table
    if table_path == "packaged":
        from diyfa import tuning

        table_path = tuning.TUNED_TABLE
    summary = blocksize.experiment(kernels, head_dim=args.head_dim, seqlen=args.seqlen,
                                   causal=args.causal, dtype=args.dtype, size=args.size,
                                   quick=args.quick, out_dir=args.out,
                                   write_table_path=table_path,
                                   progress=progress.wanted(args.no_progress))  # fmt: skip
    for kernel, res in summary["by_kernel"].items():
        cols, rows = blocksize.table_rows(res)
        _print_table(f"{kernel}: configs ranked by TFLOPS", cols, rows[: args.top], width=200)
    print("winners (diyfa.tuning.DEFAULTS shape):", summary["winners"])
    for png in summary["heatmaps"]:
        print(f"heatmap: {png}")
    if summary.get("table_path"):
        print(f"table: {summary['table_path']}")
    return 0


# -------------------------------------------------------------------------------- profile
def cmd_profile(args) -> int:
    import shutil
    import subprocess

    from diyfa.bench import profile

    program = profile.case_program(args.op, batch=args.batch, heads=args.heads,
                                   seqlen=args.seqlen, seqlen_k=args.seqlen_k,
                                   head_dim=args.head_dim, causal=args.causal,
                                   backward=args.backward, dtype=args.dtype,
                                   size=args.size)  # fmt: skip
    regex = args.kernel_regex or profile.default_kernel_regex(args.op, args.backward)
    cmd = profile.ncu_command(program, regex, args.launch_count)
    print(profile.format_command(cmd))
    sys.stdout.flush()  # the command (to run elsewhere), then any error line
    _require_gpu("profile", "nothing profiled (the ncu command above is for a GPU machine)")
    if shutil.which("ncu") is None:
        raise CommandError("ncu (Nsight Compute) is not on PATH: nothing profiled (the command "
                           "above was not run); install Nsight Compute or add it to PATH")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    launches = profile.parse_ncu_csv(proc.stdout)
    if proc.returncode != 0 or not launches:
        print(proc.stdout[-4000:])
        print(proc.stderr[-4000:], file=sys.stderr)
        print(f"ncu exited {proc.returncode}; {len(launches)} launches parsed", file=sys.stderr)
        return proc.returncode or 1
    cols, rows = profile.table(launches)
    _print_table(f"ncu: {args.op} ({regex})", cols, rows, width=200)
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

    s = sub.add_parser("bench", help="run benchmark suites; one JSON line per measurement")
    s.add_argument("target", choices=["flash", "matmul", "memory", "all"])
    s.add_argument(
        "--suite",
        default=None,
        help="comma list: seed,fa-sweep,cross,gqa,varlen,decode,paged-decode,llm-matmul,"
        "memory,smoke (default: the target's suites)",
    )
    s.add_argument("--providers", default=None, help="comma list (default: the suite's)")
    s.add_argument("--modes", default=None, help="comma list of fwd,bwd,fwd_bwd")
    s.add_argument("--quick", action="store_true", help="trim every suite (a first GPU run)")
    where = s.add_mutually_exclusive_group()
    where.add_argument(
        "--out",
        default=None,
        help="results file (default benchmarks/results/<date>_<gpu>_<suites>.jsonl)",
    )
    where.add_argument(
        "--resume",
        default=None,
        metavar="FILE",
        help="continue the last run in FILE: measure what this command's plan has that FILE "
        "lacks and append it there (same GPU and versions required; docs/benchmarking.md)",
    )
    s.add_argument("--warmup", type=int, default=WARMUP_MS, help="do_bench warmup, ms")
    s.add_argument("--rep", type=int, default=REP_MS, help="do_bench repetition time, ms")
    s.add_argument("--rounds", type=_at_least_one, default=1,
                   help="time each case's providers N times in turn and keep the median "
                   "(spreads the GPU's clock drift over every provider alike)")  # fmt: skip
    s.add_argument("--no-ceilings", action="store_true", help="skip measuring cuBLAS/copy")
    s.add_argument("--no-error", action="store_true", help="skip the float64 error check")
    s.add_argument("--no-progress", action="store_true",
                   help="no progress bar (none is drawn when stdout or stderr is not a "
                   "terminal)")  # fmt: skip
    s.add_argument("--list", action="store_true", help="list suites and providers, run nothing")
    s.set_defaults(func=cmd_bench)

    s = sub.add_parser("report", help="Markdown + HTML report from results files")
    s.add_argument("files", nargs="*", help="results .jsonl (default: the latest in --results-dir)")
    s.add_argument("--results-dir", default="benchmarks/results")
    s.add_argument("--out", default="report")
    s.set_defaults(func=cmd_report)

    s = sub.add_parser("tune", help="block-size experiment (GPU); occupancy arithmetic (CPU)")
    s.add_argument(
        "--kernels",
        default=None,
        help="comma list of attn_fwd,attn_bwd_dkdv,attn_bwd_dq,matmul (default all)",
    )
    s.add_argument("--head-dim", type=int, default=64)
    s.add_argument("--seqlen", type=int, default=4096)
    s.add_argument("--causal", action="store_true")
    s.add_argument("--dtype", default="bf16")
    s.add_argument("--size", type=int, default=8192, help="matmul M = N = K")
    s.add_argument("--quick", action="store_true")
    s.add_argument("--top", type=int, default=15, help="rows of each ranked table")
    s.add_argument("--no-progress", action="store_true",
                   help="no progress bar (none is drawn when stdout or stderr is not a "
                   "terminal)")  # fmt: skip
    s.add_argument("--out", default="report/blocksize", help="heatmaps and sweep JSON")
    s.add_argument(
        "--write-table",
        nargs="?",
        const="packaged",
        default=None,
        help="merge the winners into a tuned table (JSON) that the kernels read: with no "
        "value, diyfa's packaged one (diyfa/tuned_configs.json); else this path (use it "
        "through DIYFA_TUNED_TABLE=path)",
    )
    s.set_defaults(func=cmd_tune)

    s = sub.add_parser("profile", help="Nsight Compute metrics of one diyfa case")
    s.add_argument("--op", choices=["attention", "matmul"], default="attention")
    s.add_argument("--batch", type=int, default=4)
    s.add_argument("--heads", type=int, default=16)
    s.add_argument("--seqlen", type=int, default=4096)
    s.add_argument("--seqlen-k", type=int, default=None)
    s.add_argument("--head-dim", type=int, default=128)
    s.add_argument("--causal", action="store_true")
    s.add_argument("--backward", action="store_true", help="profile the backward kernels")
    s.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    s.add_argument("--size", type=int, default=4096, help="matmul M = N = K")
    s.add_argument("--kernel-regex", default=None)
    s.add_argument("--launch-count", type=int, default=4)
    s.set_defaults(func=cmd_profile)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one command. What the user gave (values, files) and what this machine lacks end in
    one ``diyfa: error:`` line on stderr, never a traceback: 2 for bad input (ValueError,
    TypeError, an unreadable file), 1 for a missing GPU or tool, 130 for Ctrl-C."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError) as e:
        print(f"diyfa: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        print(f"diyfa: error: {where}{e.strerror or e}", file=sys.stderr)
        return 2
    except CommandError as e:
        print(f"diyfa: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("diyfa: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
