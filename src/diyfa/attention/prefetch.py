"""Compile a call's backward kernels while its forward compiles.

The first call that meets a new kind of problem (dtype, head dim, causal, variant flags...)
compiles the forward's kernels, and its ``loss.backward()`` then compiles the backward's:
seconds each, one after the other (H200, bf16 d128 causal, empty caches: forward 4.2 s, then
backward 2.8 s). Compiling runs mostly outside the GIL (the MLIR and LLVM passes, ptxas and
the C compiler that builds each kernel's launcher are native code or subprocesses), so two
threads compile in about the time of one.

:func:`start`, called by the autograd path when a call wants gradients, hands the family's
backward to a worker thread the first time it sees a kind of problem. The worker runs it in
compile-only mode (:func:`diyfa._launcher.compile_only`: each launch compiles and loads its
kernel into Triton's caches and runs nothing) on stand-ins for ``out``, ``lse2`` and ``dO``
shaped as the forward gives them, while this thread compiles and runs the forward. The
backward :func:`wait`\\ s for the worker, then finds its kernels compiled.

The stand-ins are a guess: a dO with other strides than ``out``'s (rare) specialises the
kernels differently, and the backward compiles what it misses, as it would have anyway. No
result depends on the worker: it writes only tensors it allocated and its errors are
dropped (logged at DEBUG level).

Not started: for CPU tensors (the interpreter compiles nothing), while autotuning
(``DIYFA_AUTOTUNE=1`` benchmarks configs by running them), while the current stream is being
captured into a CUDA graph, when the stand-ins and the backward's buffers (about five times
q, k and v in fp32) would take more than an eighth of the GPU's free memory, and with
``DIYFA_PREFETCH_BACKWARD=0``. The worker makes a few small CUDA allocations and launches
(zero fills) of its own while it runs: a CUDA graph capture in global mode that begins during
those seconds would see them; set ``DIYFA_PREFETCH_BACKWARD=0`` to rule that out.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from diyfa.attention.dispatch import Family
from diyfa.attention.problem import Problem

log = logging.getLogger(__name__)

_seen: set[tuple] = set()  # kinds of problem whose backward was handed to the worker
_pool: ThreadPoolExecutor | None = None


def enabled() -> bool:
    """``DIYFA_PREFETCH_BACKWARD`` is not "0" (read at each new kind of problem)."""
    return os.environ.get("DIYFA_PREFETCH_BACKWARD", "1") != "0"


def kind(problem: Problem, family: Family) -> tuple:
    """What decides which backward kernels a problem compiles, as far as the forward can see
    it: the family (by identity: a named one may differ from "auto"'s), dtype, device, head
    dims, layout, causality, determinism, which variants are on, packed or not, and the
    lengths' divisibility by 16 (Triton specialises on it)."""
    p = problem
    return (id(family), p.dtype, p.device, p.head_dim, p.value_dim, p.layout, p.causal,
            p.deterministic, p.window_left >= 0, p.window_right >= 0, p.softcap > 0,
            p.alibi_slopes is None, p.sinks is None, p.dropout_p > 0, p.cu_seqlens_q is None,
            p.seqlen_q % 16 == 0, p.seqlen_k % 16 == 0, p.kv_heads == p.heads)  # fmt: skip


def _fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    need = 5 * 4 * (q.numel() + k.numel() + v.numel())
    free, _ = torch.cuda.mem_get_info(q.device)
    return need <= free // 8


def start(q, k, v, problem: Problem, family: Family) -> Future | None:
    """Hand ``family``'s backward for ``problem`` to the worker if this kind of problem
    (:func:`kind`) has not been seen; returns the worker's future (None: nothing started)."""
    key = kind(problem, family)
    if key in _seen:
        return None
    _seen.add(key)
    from diyfa import tuning  # here: importing diyfa.attention loads no Triton

    if not q.is_cuda or not enabled() or tuning.autotune_enabled():
        return None
    try:  # an optimisation: nothing here may fail the user's call
        if torch.cuda.is_current_stream_capturing() or not _fits(q, k, v):
            return None
        global _pool
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diyfa-prefetch")
        out, lse2 = standins(q, v, problem)
        return _pool.submit(_compile_backward, family, problem, q, k, v, out, lse2)
    except Exception as error:  # e.g. the stand-ins' allocation under a memory cap
        log.debug("backward prefetch not started: %r", error)
        return None


def standins(q: torch.Tensor, v: torch.Tensor, problem: Problem):
    """Uninitialised (out, lse2) shaped and strided as the families' forward returns them
    (ops.py's fake forward says the same): out contiguous in the call's layout with v's head
    dim; the base-2 LSE per query row, (batch, heads, seqlen_q), or (heads, total_q) for
    packed sequences."""
    out = torch.empty(q.shape[:-1] + v.shape[-1:], dtype=q.dtype, device=q.device)
    if problem.cu_seqlens_q is not None:
        shape = (problem.heads, q.shape[0])
    else:
        shape = (problem.batch, problem.heads, problem.seqlen_q)
    return out, torch.empty(shape, dtype=torch.float32, device=q.device)


def _compile_backward(family: Family, problem: Problem, q, k, v, out, lse2) -> str | None:
    """The worker's job; returns its failure as text (None: done). Not the exception itself:
    its traceback would keep the worker's buffers alive until the backward runs."""
    from diyfa._launcher import compile_only

    try:
        with torch.cuda.device(q.device), compile_only():
            family.backward(out, q, k, v, out, lse2, problem)
    except Exception as error:
        return repr(error)
    return None


_ahead_pool: ThreadPoolExecutor | None = None


def compile_ahead(fn, grid: tuple, args: dict, num_warps: int,
                  num_stages: int = 1) -> Future | None:
    """Compile the kernel of a launch this thread will make next-but-one on a worker thread
    (its own, not the backward's, which may be busy for seconds), compile-only, while this
    thread compiles and launches the one before: a call of two builds then waits for one
    compile, not two (the Hopper forward's frozen max, :func:`hopper_fwd._launch_call`).
    None (nothing started) where :func:`start` would not start either, inside
    :func:`diyfa._launcher.compile_only`, or when the launcher has the kernel already. Pass
    the future to :func:`wait` before that launch."""
    from diyfa import tuning
    from diyfa._launcher import compiling_only, launcher_for

    if compiling_only() or not enabled() or tuning.autotune_enabled():
        return None
    try:  # an optimisation: nothing here may fail the user's call
        if (torch.cuda.is_current_stream_capturing()
                or launcher_for(fn).compiled(args, num_warps, num_stages)):  # fmt: skip
            return None
        global _ahead_pool
        if _ahead_pool is None:
            _ahead_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diyfa-ahead")
        device = torch.cuda.current_device()
        return _ahead_pool.submit(_compile_launch, fn, grid, args, num_warps, num_stages,
                                  device)  # fmt: skip
    except Exception as error:
        log.debug("compile ahead not started: %r", error)
        return None


def _compile_launch(fn, grid, args, num_warps, num_stages, device) -> str | None:
    """The ahead worker's job (as :func:`_compile_backward`: the failure as text)."""
    from diyfa._launcher import compile_only, launch

    try:
        with torch.cuda.device(device), compile_only():
            launch(fn, grid, args, {}, num_warps, num_stages)
    except Exception as error:
        return repr(error)
    return None


def wait(future: Future | None) -> None:
    """Wait for the worker's compile of this call's backward, or of :func:`compile_ahead`'s
    kernel (if one was started); its failure is logged, never raised (the launch compiles
    what it needs itself)."""
    if future is None:
        return
    error = future.exception() or future.result()
    if error is not None:
        log.debug("prefetch failed (the launch compiles its kernel itself): %s", error)
