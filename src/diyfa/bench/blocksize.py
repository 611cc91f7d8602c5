"""The block-size experiment: sweep tile shapes, warps and stages; read what each compiles to.

For attention forward (``_attn_fwd``), the two backward kernels (``_attn_bwd_dkdv``,
``_attn_bwd_dq``) and matmul, every config is forced through the public function with
:func:`diyfa.tuning.pinned` and measured: TFLOPS, and from the compiled kernel (Triton 3.6
keeps it in ``JITFunction.device_caches[device][0]``, a dict key -> ``CompiledKernel``)
registers per thread (``n_regs``), spilled registers (``n_spills``) and shared memory per
block (``metadata.shared``). From those and the device limits, :func:`occupancy` gives the
blocks that fit on one SM and which resource limits them. A config that does not fit
(``OutOfResources``) is recorded as such.

The backward's two kernels are swept one at a time (the other keeps its default) and timed
together as one backward: the ranking among one kernel's configs is what the sweep gives.

Without a GPU only the arithmetic runs (:func:`seed_arithmetic`, :func:`occupancy`).
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from diyfa.bench.progress import Bar

# Hopper (H100/H200 SXM) per-SM limits; used when no GPU says otherwise.
H100_LIMITS = {
    "registers_per_sm": 65536,
    "shared_memory_per_sm": 233472,  # 228 KiB
    "shared_memory_per_block_optin": 232448,  # 227 KiB
    "max_threads_per_sm": 2048,
    "max_blocks_per_sm": 32,
    "reserved_smem_per_block": 1024,  # the CUDA runtime keeps 1 KiB per block
    "register_alloc_unit": 256,  # registers are given to warps in units of 256
}


def limits_from_device(info=None) -> dict:
    """Per-SM limits of the present GPU (:func:`diyfa.device.device_info`), else Hopper's."""
    limits = dict(H100_LIMITS)
    if info is not None and getattr(info, "available", False):
        for key in ("registers_per_sm", "shared_memory_per_sm", "shared_memory_per_block_optin",
                    "max_threads_per_sm"):  # fmt: skip
            value = getattr(info, key, None)
            if value:
                limits[key] = value
    return limits


def attention_tile_smem(block_m: int, block_n: int, head_dim: int, elem_bytes: int = 2,
                        kv_stages: int = 1) -> int:  # fmt: skip
    """Shared memory of one attention tile set: Q (block_m x d) resident, K and V
    (block_n x d each) per pipeline stage."""
    return (block_m + 2 * block_n * kv_stages) * head_dim * elem_bytes


def occupancy(*, smem_per_block: int, regs_per_thread: int, num_warps: int,
              limits: dict | None = None) -> dict:  # fmt: skip
    """Blocks per SM allowed by shared memory, registers and threads; the least of them."""
    lim = dict(H100_LIMITS, **(limits or {}))
    threads = 32 * num_warps
    if smem_per_block > lim["shared_memory_per_block_optin"] or threads > 1024:
        return {"blocks_per_sm": 0, "limiter": "does not fit", "by_smem": 0, "by_regs": 0,
                "by_threads": 0, "warps_per_sm": 0}  # fmt: skip
    smem = smem_per_block + lim["reserved_smem_per_block"]
    by_smem = lim["shared_memory_per_sm"] // smem if smem_per_block else lim["max_blocks_per_sm"]
    unit = lim["register_alloc_unit"]
    regs_per_warp = math.ceil(regs_per_thread * 32 / unit) * unit
    by_regs = lim["registers_per_sm"] // (regs_per_warp * num_warps) if regs_per_thread else 99
    by_threads = lim["max_threads_per_sm"] // threads
    limits_ = {"shared memory": by_smem, "registers": by_regs, "threads": by_threads,
               "blocks": lim["max_blocks_per_sm"]}  # fmt: skip
    limiter = min(limits_, key=limits_.get)
    blocks = limits_[limiter]
    return {"blocks_per_sm": blocks, "limiter": limiter, "by_smem": by_smem, "by_regs": by_regs,
            "by_threads": by_threads, "warps_per_sm": blocks * num_warps}  # fmt: skip


def seed_arithmetic() -> dict:
    """Seed 000's claim: a 128x128 tile at head_dim 64 in fp16 takes "about 49 KB" of shared
    memory, "so 2 blocks per SM". Q 128x64 + K 128x64 + V 128x64 at 2 bytes = 48 KiB = 49,152
    bytes (49.2 kB). Within Hopper's 228 KiB per SM that single-buffered tile set allows 4
    blocks; 2 blocks follow once K and V are double-buffered (Q + 2 x (K + V) = 80 KiB, what
    a 2-stage pipeline holds) or once 8 warps use 128 registers per thread.
    """
    tile = attention_tile_smem(128, 128, 64, 2)
    double = attention_tile_smem(128, 128, 64, 2, kv_stages=2)
    return {
        "tile_bytes": tile,
        "tile_kib": tile / 1024,
        "tile_kb": tile / 1000,
        "smem_per_sm_kib": H100_LIMITS["shared_memory_per_sm"] / 1024,
        "blocks_single_buffer": occupancy(smem_per_block=tile, regs_per_thread=0, num_warps=4)[
            "blocks_per_sm"
        ],  # fmt: skip
        "kv_double_buffer_bytes": double,
        "blocks_kv_double_buffer": occupancy(smem_per_block=double, regs_per_thread=0, num_warps=4)[
            "blocks_per_sm"
        ],  # fmt: skip
        "blocks_8_warps_128_regs": occupancy(smem_per_block=tile, regs_per_thread=128, num_warps=8)[
            "blocks_per_sm"
        ],  # fmt: skip
    }


def format_seed_arithmetic() -> str:
    s = seed_arithmetic()
    return (
        f"Seed 000: 128x128 tile, head_dim 64, fp16: Q+K+V = 3 x 128 x 64 x 2 B = "
        f"{s['tile_bytes']:,} B = {s['tile_kib']:.0f} KiB ({s['tile_kb']:.1f} kB, the seed's "
        f"'~49 KB').\n"
        f"  shared memory alone ({s['smem_per_sm_kib']:.0f} KiB/SM, 1 KiB reserved per block): "
        f"{s['blocks_single_buffer']} blocks per SM\n"
        f"  K/V double-buffered ({s['kv_double_buffer_bytes'] // 1024} KiB): "
        f"{s['blocks_kv_double_buffer']} blocks per SM (the seed's 2)\n"
        f"  8 warps at 128 registers/thread: {s['blocks_8_warps_128_regs']} blocks per SM "
        "(registers, not shared memory, set the limit)"
    )


# --------------------------------------------------------------------------------- the sweep
KERNELS = {  # experiment name -> (tuning name, Triton kernel attribute, module)
    "attn_fwd": ("attn_fwd", "_attn_fwd", "diyfa.attention.portable"),
    "attn_bwd_dkdv": ("attn_bwd_dkdv", "_attn_bwd_dkdv", "diyfa.attention.portable"),
    "attn_bwd_dq": ("attn_bwd_dq", "_attn_bwd_dq", "diyfa.attention.portable"),
    "matmul": ("matmul", None, "diyfa.ops.matmul"),
}


@dataclass
class Result:
    kernel: str
    config: dict
    status: str = "ok"
    reason: str = ""
    ms: float | None = None
    tflops: float | None = None
    n_regs: int | None = None
    n_spills: int | None = None
    shared_bytes: int | None = None
    occupancy: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def space(kernel: str, quick: bool = False) -> list[dict]:
    """Configs to sweep: BLOCK_M/BLOCK_N(/BLOCK_K), warps 4/8/12 (1-3 warp groups), stages 2-4."""
    warps = (4, 8) if quick else (4, 8, 12)
    stages = (2, 3) if quick else (2, 3, 4)
    if kernel == "matmul":
        bms, bns, bks = ((128,), (128, 256), (64,)) if quick else ((64, 128), (64, 128, 256),
                                                                   (32, 64))  # fmt: skip
        return [dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)
                for m, n, k, w, s in itertools.product(bms, bns, bks, warps, stages)]  # fmt: skip
    if kernel == "attn_bwd_dkdv":
        bms, bns = ((32, 64), (64, 128)) if quick else ((16, 32, 64), (64, 128))
    else:
        bms, bns = ((128,), (64, 128)) if quick else ((64, 128), (32, 64, 128))
    return [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)
            for m, n, w, s in itertools.product(bms, bns, warps, stages)]  # fmt: skip


def _jit_fn(obj):
    """The JITFunction under autotune/heuristics wrappers."""
    while not hasattr(obj, "device_caches") and hasattr(obj, "fn"):
        obj = obj.fn
    return obj if hasattr(obj, "device_caches") else None


def compiled_kernels(jit) -> dict:
    """{cache key: CompiledKernel} of a JITFunction, over every device (Triton 3.6)."""
    fns = jit.fns if isinstance(jit, _Kernels) else [_jit_fn(jit)]
    out = {}
    for i, fn in enumerate(fns):
        if fn is None:
            continue
        for dev, cache in list(fn.device_caches.items()):
            for key, kernel in cache[0].items():
                out[(i, dev, key)] = kernel
    return out


def kernel_resources(kernel) -> dict:
    """Registers, spills and shared memory of a launched CompiledKernel."""
    if hasattr(kernel, "result"):
        kernel = kernel.result()
    if getattr(kernel, "n_regs", None) is None and hasattr(kernel, "_init_handles"):
        kernel._init_handles()
    return {
        "n_regs": getattr(kernel, "n_regs", None),
        "n_spills": getattr(kernel, "n_spills", None),
        "shared_bytes": getattr(kernel.metadata, "shared", None),
        "num_warps": getattr(kernel.metadata, "num_warps", None),
        "num_stages": getattr(kernel.metadata, "num_stages", None),
    }


def _pin(tuning, name: str, cfg: dict):
    params = inspect.signature(tuning.pinned).parameters
    kwargs = {k: v for k, v in cfg.items() if k in params}
    return tuning.pinned(name, **kwargs)


MATMUL_GROUP_M = 8  # the matmul sweep holds the grouped tile order fixed


@contextlib.contextmanager
def _pin_matmul(module, cfg: dict):
    """Force one config on diyfa.ops.matmul: autotuning off and its ``default_config``
    answering ``cfg`` (GROUP_M 8) while the block runs (it has no ``tuning.pinned`` entry)."""
    old_env = os.environ.get("DIYFA_AUTOTUNE")
    original = module.default_config

    def forced(kind, *args, **kwargs):
        subtile = None if kind == "portable" else False
        return module.MatmulConfig(cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], MATMUL_GROUP_M,
                                   cfg["num_warps"], cfg["num_stages"], subtile)  # fmt: skip

    os.environ["DIYFA_AUTOTUNE"] = "0"
    module.default_config = forced
    module.forget_choices()  # the launcher remembers the config per key: forget it both ways
    try:
        yield
    finally:
        module.forget_choices()
        module.default_config = original
        if old_env is None:
            os.environ.pop("DIYFA_AUTOTUNE", None)
        else:
            os.environ["DIYFA_AUTOTUNE"] = old_env


class _Kernels:
    """Several JITFunctions read as one (matmul: the portable and the TMA kernel)."""

    def __init__(self, *fns):
        self.fns = [f for f in fns if f is not None]


def _matmul_kernels(module) -> _Kernels:
    import triton

    fns = []
    for attr in dir(module):
        fn = _jit_fn(getattr(module, attr))
        if (fn is not None and isinstance(fn, triton.runtime.JITFunction) and "matmul" in attr
                and not fn.is_gluon()):  # the Gluon kernel has no swept config
            fns.append(fn)
    return _Kernels(*fns)


def sweep(kernel: str, *, head_dim: int = 64, seqlen: int = 4096, causal: bool = False,
          dtype: str = "bf16", size: int = 8192, quick: bool = False,
          configs: list[dict] | None = None, log=print, bar=None) -> list[Result]:  # fmt: skip
    """Measure every config of ``kernel`` on one shape (GPU only). FA-sweep shape: batch =
    16384 // seqlen, heads = 2048 // head_dim; matmul: size^3. ``bar``: a
    :class:`diyfa.bench.progress.Bar` advanced once per config."""
    import importlib

    import torch
    from triton.testing import do_bench

    from diyfa import flops, tuning
    from diyfa.bench.providers import torch_dtype
    from diyfa.device import device_info

    if not torch.cuda.is_available():
        raise RuntimeError("the block-size sweep needs a CUDA GPU")
    tname, attr, modname = KERNELS[kernel]
    limits = limits_from_device(device_info())
    configs = configs if configs is not None else space(kernel, quick)
    bar = bar or Bar(len(configs), enabled=False)
    try:
        module = importlib.import_module(modname)
    except ImportError as e:
        bar.advance(len(configs))
        return [Result(kernel, {}, "unavailable", f"{modname}: {e}")]
    jit = getattr(module, attr) if attr else _matmul_kernels(module)
    dt = torch_dtype(dtype)
    if kernel == "matmul":
        a = torch.randn(size, size, device="cuda", dtype=dt)
        b = torch.randn(size, size, device="cuda", dtype=dt)
        fl = flops.matmul_flops(size, size, size)
        # the Triton kernels' configs are swept: not the warp-specialised kernel that "auto"
        # takes for plain fp16/bf16 products on Hopper (its config is fixed)
        kind = "tma" if torch.cuda.get_device_capability()[0] == 9 else "portable"
        fn = lambda: module.triton_matmul(a, b, kernel=kind)  # noqa: E731
    else:
        batch, heads = max(1, 16384 // seqlen), 2048 // head_dim
        bwd = kernel != "attn_fwd"
        q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=dt,
                               requires_grad=bwd) for _ in range(3))  # fmt: skip
        from diyfa.attention import flash_attention

        mode = "bwd" if bwd else "fwd"
        fl = flops.attention_flops(batch, heads, seqlen, seqlen, head_dim, causal=causal,
                                   mode=mode)  # fmt: skip
        if bwd:
            out = flash_attention(q, k, v, causal=causal)
            do = torch.randn_like(out)
            fn = lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)  # noqa: E731
        else:
            fn = lambda: flash_attention(q, k, v, causal=causal)  # noqa: E731
    results = []
    for cfg in configs:
        bar.show(f"{kernel} {cfg}")
        res = Result(kernel, dict(cfg))
        before = set(compiled_kernels(jit))
        try:
            pin = _pin_matmul(module, cfg) if kernel == "matmul" else _pin(tuning, tname, cfg)
            with pin:
                fn()
                torch.cuda.synchronize()
                res.ms = float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
            res.tflops = fl / res.ms / 1e9
        except Exception as e:  # noqa: BLE001 - OutOfResources, compile errors: recorded
            name = type(e).__name__
            res.status = "does not fit" if name == "OutOfResources" else "error"
            res.reason = f"{name}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        new = [k for k in compiled_kernels(jit) if k not in before]
        kernels = compiled_kernels(jit)
        match = [kernels[k] for k in new] or [
            kern for kern in kernels.values()
            if getattr(kern.metadata, "num_warps", None) == cfg["num_warps"]
            and getattr(kern.metadata, "num_stages", None) == cfg["num_stages"]]  # fmt: skip
        if match:
            try:
                r = kernel_resources(match[-1])
                res.n_regs, res.n_spills, res.shared_bytes = (r["n_regs"], r["n_spills"],
                                                              r["shared_bytes"])  # fmt: skip
                res.occupancy = occupancy(smem_per_block=res.shared_bytes or 0,
                                          regs_per_thread=res.n_regs or 0,
                                          num_warps=cfg["num_warps"], limits=limits)  # fmt: skip
            except Exception as e:  # noqa: BLE001
                res.reason = (res.reason + f" (resources unreadable: {e})").strip()
        log(f"{kernel} {cfg}: {res.status} "
            f"{'' if res.tflops is None else f'{res.tflops:.1f} TFLOPS'} {res.reason}")  # fmt: skip
        results.append(res)
        torch.cuda.empty_cache()
        bar.advance()
    return results


def ranked(results: list[Result]) -> list[Result]:
    return sorted(results, key=lambda r: -(r.tflops or -1.0))


def table_rows(results: list[Result]) -> tuple[list[str], list[list[str]]]:
    cols = ["rank", "kernel", "BLOCK_M", "BLOCK_N", "BLOCK_K", "warps", "stages", "TFLOPS",
            "regs", "spills", "smem KiB", "blocks/SM", "limiter", "status"]  # fmt: skip
    rows = []
    for i, r in enumerate(ranked(results), 1):
        c = r.config

        def f(x, fmt="d"):
            return "-" if x is None else format(x, fmt)

        rows.append([str(i), r.kernel, f(c.get("BLOCK_M")), f(c.get("BLOCK_N")),
                     f(c.get("BLOCK_K")), f(c.get("num_warps")), f(c.get("num_stages")),
                     f(r.tflops, ".1f"), f(r.n_regs), f(r.n_spills),
                     "-" if r.shared_bytes is None else f"{r.shared_bytes / 1024:.1f}",
                     f(r.occupancy.get("blocks_per_sm")), r.occupancy.get("limiter", "-"),
                     r.status if r.status == "ok" else f"{r.status}: {r.reason[:50]}"])  # fmt: skip
    return cols, rows


def heatmap(results: list[Result], path: Path | str, title: str = "") -> Path | None:
    """Best TFLOPS over warps/stages for each (BLOCK_M, BLOCK_N): a PNG heatmap."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    ok = [r for r in results if r.tflops is not None]
    if not ok:
        return None
    bms = sorted({r.config["BLOCK_M"] for r in results})
    bns = sorted({r.config["BLOCK_N"] for r in results})
    grid = np.full((len(bms), len(bns)), np.nan)
    for r in ok:
        i, j = bms.index(r.config["BLOCK_M"]), bns.index(r.config["BLOCK_N"])
        grid[i, j] = np.fmax(grid[i, j], r.tflops)
    fig, ax = plt.subplots(figsize=(1.2 * len(bns) + 2.5, 1.0 * len(bms) + 1.8))
    im = ax.imshow(grid, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(bns)), [str(b) for b in bns])
    ax.set_yticks(range(len(bms)), [str(b) for b in bms])
    ax.set_xlabel("BLOCK_N")
    ax.set_ylabel("BLOCK_M")
    for i in range(len(bms)):
        for j in range(len(bns)):
            text = "no fit" if np.isnan(grid[i, j]) else f"{grid[i, j]:.0f}"
            ax.text(j, i, text, ha="center", va="center", color="w", fontsize=9)
    fig.colorbar(im, ax=ax, label="TFLOPS (best over warps, stages)")
    ax.set_title(title or results[0].kernel)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def winners_table(by_kernel: dict[str, list[Result]], capability_major: int,
                  head_dim: int) -> dict:  # fmt: skip
    """The best config per kernel in the shape of the tuned table (``diyfa.tuning``):
    {major: {kernel: {head-dim bucket: (BLOCK_M, BLOCK_N, num_warps, num_stages)}}}; matmul
    as {major: {"matmul_tma" (sm90, where the sweep runs the TMA kernel) or
    "matmul_portable": {0: (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
    num_warps, num_stages[, EPILOGUE_SUBTILE])}}}."""
    from diyfa.tuning import head_dim_bucket

    table: dict = {capability_major: {}}
    for kernel, results in by_kernel.items():
        best = [r for r in ranked(results) if r.tflops is not None]
        if not best:
            continue
        c = best[0].config
        if kernel == "matmul":
            entry = (c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], MATMUL_GROUP_M, c["num_warps"],
                     c["num_stages"])  # fmt: skip
            if capability_major == 9:
                table[capability_major]["matmul_tma"] = {0: entry + (False,)}
            else:
                table[capability_major]["matmul_portable"] = {0: entry}
            continue
        entry = tuple(c[k] for k in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"))
        table[capability_major][kernel] = {head_dim_bucket(head_dim): entry}
    return table


def experiment(kernels: list[str], *, head_dim: int = 64, seqlen: int = 4096,
               causal: bool = False, dtype: str = "bf16", size: int = 8192,
               quick: bool = False, out_dir: Path | str = "report/blocksize",
               write_table_path: Path | str | None = None, log=print,
               progress: bool = False) -> dict:  # fmt: skip
    """Run the sweep for ``kernels`` (GPU), save heatmaps and results JSON, return a summary.
    Without a GPU: the occupancy arithmetic only. ``progress``: a bar on stderr over every
    kernel's configs."""
    import torch

    from diyfa import tuning

    summary: dict = {"seed_arithmetic": seed_arithmetic(), "results": {}, "heatmaps": []}
    if not torch.cuda.is_available():
        summary["gpu"] = False
        return summary
    summary["gpu"] = True
    out_dir = Path(out_dir)
    by_kernel = {}
    total = sum(len(space(k, quick)) for k in kernels)
    with Bar(total, "configs", enabled=progress) as bar:
        for kernel in kernels:
            res = sweep(kernel, head_dim=head_dim, seqlen=seqlen, causal=causal, dtype=dtype,
                        size=size, quick=quick, log=log, bar=bar)  # fmt: skip
            by_kernel[kernel] = res
            summary["results"][kernel] = [r.as_dict() for r in res]
            png = heatmap(res, out_dir / f"{kernel}_d{head_dim}.png",
                          f"{kernel} d{head_dim} seq{seqlen} {dtype}")  # fmt: skip
            if png:
                summary["heatmaps"].append(str(png))
    major = torch.cuda.get_device_capability()[0]
    table = winners_table(by_kernel, major, head_dim)
    summary["winners"] = table
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"sweep_d{head_dim}.json").write_text(json.dumps(summary, indent=1, default=str))
    if write_table_path:
        summary["table_path"] = str(tuning.write_table(table, write_table_path))
    summary["by_kernel"] = by_kernel
    return summary
