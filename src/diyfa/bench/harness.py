"""The measurement harness: one case, one provider, one mode -> one record.

What a record holds and how each number is made
    time        on the GPU, ``triton.testing.do_bench(fn, warmup, rep, quantiles=[0.5, 0.2,
                0.8])`` after one untimed call: median, p20, p80 in ms. Without a GPU the
                kernels run in the Triton interpreter and the harness times a few calls with
                ``time.perf_counter`` (``timer`` says so): pipeline checks, not kernel speed.
    modes       fwd: the forward alone, inputs without grad.
                bwd: the backward alone, timed as ``torch.autograd.grad(out, (q, k, v), dout,
                retain_graph=True)`` on one fixed forward graph (not fwd+bwd minus fwd). It
                includes what the backward launches: the diyfa kernels' delta preprocess,
                dK/dV and dQ kernels; PyTorch's backends their own.
                fwd_bwd: the forward and ``autograd.grad`` on its output, both timed.
    memory      peak extra memory: ``max_memory_allocated()`` during one call, minus the memory
                allocated before it (inputs, and for bwd the saved forward graph) and minus
                what the call returns (output or gradients). Workspace and intermediates only.
    error       max abs error against the float64 reference (:mod:`diyfa.reference`) on the
                same inputs, restricted to batch 0 and the first kv-head group (attention is
                independent per batch and head; the scope is recorded). Above
                ``ref_max_scores`` score elements (or ``ref_max_matmul`` for matmul) it is
                skipped and recorded as "skipped: too large". bwd modes add dq/dk/dv errors.
    FLOPs       :mod:`diyfa.flops`: exact (unmasked pairs), published convention (halved
                when causal) and the naive seqlen_q^2 count; TFLOPS use the exact count,
                ``tflops_published`` the published one.
    utilisation % of the datasheet peak (:func:`diyfa.device.datasheet_peaks`) and % of the
                cuBLAS ceiling measured once per run (:func:`diyfa.device.measure_ceilings`).
    bandwidth   minimum bytes (:mod:`diyfa.flops`) / median time, and % of measured copy rate.

A provider that cannot run a case yields a record with that status and the reason, and the
run goes on: ``unavailable`` (not importable here, or not registered for the op),
``unsupported`` (its own check refuses the case, or it has no backward), ``oom`` (CUDA or host
allocation failed; the memory is released before the next job) and ``error`` (anything else
it raised, its check included). Reasons are one line: the exception's type and message with
newlines folded. Only KeyboardInterrupt stops a run; every record written before stays.
"""

from __future__ import annotations

import gc
import math
import time
import warnings
from collections.abc import Callable, Collection
from dataclasses import dataclass

import numpy as np
import torch

from diyfa.bench import progress as _progress
from diyfa.bench import providers as _providers
from diyfa.bench import results as _results
from diyfa.bench.suites import AttentionCase, MatmulCase, Plan


@dataclass
class Options:
    warmup_ms: int = 50
    rep_ms: int = 200
    cpu_reps: int = 3
    check_error: bool = True
    ref_max_scores: int = 1 << 28  # fp64 score elements the attention reference may build
    ref_max_matmul: int = 1 << 28  # elements of A + B + C for the fp64 matmul reference
    measure_memory: bool = True
    seed: int = 0
    # Rounds > 1: after every provider of a (suite, case, mode) has been measured, each is
    # timed again in turn, rounds - 1 times, and its median_ms becomes the median of the
    # rounds' medians (round_median_ms; p20_ms / p80_ms their percentiles). The group's
    # records are written when its last round ends, and its providers' inputs (and, for
    # the backward, graphs) stay on the GPU until then. Consecutive timings of one kernel
    # moved by up to 13% on an H200 (clocks follow power and temperature, 2026-11-24):
    # interleaved rounds spread that drift over every provider alike.
    rounds: int = 1


def on_gpu() -> bool:
    return torch.cuda.is_available()


def _device() -> str:
    return "cuda" if on_gpu() else "cpu"


# ---------------------------------------------------------------------------------- inputs
def attention_inputs(case: AttentionCase, layout: str, requires_grad: bool, seed: int = 0):
    """Random normal q, k, v; the same values for every provider (layout only differs)."""
    dtype = _providers.torch_dtype(case.dtype)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    dev = _device()
    shapes = [(case.batch, case.heads, case.seqlen_q, case.head_dim),
              (case.batch, case.hk, case.seqlen_k, case.head_dim),
              (case.batch, case.hk, case.seqlen_k, case.head_dim)]  # fmt: skip
    out = []
    for shape in shapes:
        t = torch.randn(shape, generator=gen, dtype=torch.float32) if dev == "cpu" else None
        if t is None:  # generate on the GPU: CPU generation of 1e9 numbers is slow
            g = torch.Generator(device=dev).manual_seed(seed + len(out))
            t = torch.randn(shape, generator=g, device=dev, dtype=torch.float32)
        t = t.to(dtype)
        if layout == "bshd":
            t = t.transpose(1, 2).contiguous()
        out.append(t.requires_grad_(requires_grad))
    return out


def varlen_inputs(case, requires_grad: bool, seed: int = 0):
    """Packed q (total, heads, d), k, v (total, kv_heads, d), int32 cumulative lengths (the
    same for queries and keys) and the longest length."""
    dtype = _providers.torch_dtype(case.dtype)
    dev = _device()
    g = torch.Generator(device=dev).manual_seed(seed)
    total = sum(case.lengths)

    def rnd(heads):
        t = torch.randn(total, heads, case.head_dim, generator=g, device=dev)
        return t.to(dtype).requires_grad_(requires_grad)

    cu = torch.tensor([0, *np.cumsum(case.lengths).tolist()], dtype=torch.int32, device=dev)
    return rnd(case.heads), rnd(case.kv_heads), rnd(case.kv_heads), cu, max(case.lengths)


def decode_inputs(case, seed: int = 0):
    """q (batch, seqlen_q, heads, d), the K/V cache (contiguous (batch, cache_len, kv_heads,
    d), or pages (num_pages, page_size, kv_heads, d) shuffled in the pool), cache_seqlens
    (all cache_len) and the block table (None for a contiguous cache)."""
    dtype = _providers.torch_dtype(case.dtype)
    dev = _device()
    g = torch.Generator(device=dev).manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=dev, dtype=torch.float32).to(dtype)

    b, n, hk, d = case.batch, case.cache_len, case.kv_heads, case.head_dim
    q = rnd(b, case.seqlen_q, case.heads, d)
    seqlens = torch.full((b,), n, dtype=torch.int32, device=dev)
    if case.page_size is None:
        return q, rnd(b, n, hk, d), rnd(b, n, hk, d), seqlens, None
    per_seq = -(-n // case.page_size)
    perm = torch.randperm(b * per_seq, generator=g, device=dev)
    table = perm.view(b, per_seq).to(torch.int32)
    pages = (b * per_seq, case.page_size, hk, d)
    return q, rnd(*pages), rnd(*pages), seqlens, table


def cache_of(case, k_cache, table, index: int):
    """Sequence ``index``'s cached keys (or values) as a contiguous (cache_len, kv_heads, d)."""
    if table is None:
        return k_cache[index, : case.cache_len]
    return k_cache[table[index].long()].flatten(0, 1)[: case.cache_len]


def matmul_inputs(case: MatmulCase, seed: int = 0):
    dtype = _providers.torch_dtype(case.dtype)
    dev = _device()
    g = torch.Generator(device=dev).manual_seed(seed)
    a = torch.randn(case.k, case.m, generator=g, device=dev).t() if case.trans_a else \
        torch.randn(case.m, case.k, generator=g, device=dev)  # fmt: skip
    b = torch.randn(case.n, case.k, generator=g, device=dev).t() if case.trans_b else \
        torch.randn(case.k, case.n, generator=g, device=dev)  # fmt: skip
    return a.to(dtype), b.to(dtype)


# ---------------------------------------------------------------------------------- timing
def time_fn(fn: Callable, options: Options) -> tuple[float, float, float, str]:
    """(median, p20, p80) in ms and the timer's name. Call ``fn`` once untimed before."""
    if on_gpu():
        from triton.testing import do_bench

        med, p20, p80 = do_bench(fn, warmup=options.warmup_ms, rep=options.rep_ms,
                                 quantiles=[0.5, 0.2, 0.8])  # fmt: skip
        return float(med), float(p20), float(p80), "triton.testing.do_bench"
    times = []
    for _ in range(max(1, options.cpu_reps)):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    med, p20, p80 = np.percentile(times, [50, 20, 80])
    return float(med), float(p20), float(p80), "time.perf_counter (CPU, Triton interpreter)"


def host_us_per_call(fn: Callable, calls: int = 200, warmup: int = 20) -> float:
    """Host microseconds per call of ``fn`` with the GPU idle: ``warmup`` calls, a
    synchronisation, then the time to issue ``calls`` more (the GPU's work is not waited for
    until after the clock stops). What the host path costs where the kernels are short."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    sync()
    return (t1 - t0) / calls * 1e6


def _nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.untyped_storage().nbytes()
    if isinstance(obj, (tuple, list)):
        return sum(_nbytes(o) for o in obj if o is not None)
    return 0


def peak_extra_memory(fn: Callable) -> int:
    """Peak memory one call of ``fn`` allocates beyond what exists before and what it returns."""
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    kept = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    extra = peak - base - _nbytes(kept)
    del kept
    return max(int(extra), 0)


# ---------------------------------------------------------------------------------- errors
def _attention_error(case, prov, q, k, v, out, grads, dout, options: Options) -> dict:
    from diyfa.reference import attention_ref

    g = case.heads // case.hk
    scores = g * case.seqlen_q * case.seqlen_k
    info = {"reference": "diyfa.reference.attention_ref, float64",
            "scope": f"batch 0, q heads 0..{g - 1}, kv head 0"}  # fmt: skip
    if scores > options.ref_max_scores:
        info["status"] = f"skipped: too large ({scores:,} scores > {options.ref_max_scores:,})"
        return info
    lay = prov.layout

    def sl(t, h):
        return t[:1, :h] if lay == "bhsd" else t[:1, :, :h]

    ref_in = [sl(t, n).detach().double().requires_grad_(grads is not None)
              for t, n in ((q, g), (k, 1), (v, 1))]  # fmt: skip
    # The variants (window, softcap, ALiBi, sinks) of the case, for the checked heads.
    opts = case.kernel_options(q.device) if getattr(case, "variant", False) else {}
    window = opts.get("window_size")
    ref = attention_ref(*ref_in, causal=case.causal, layout=lay,
                        window=(window[0], 0 if case.causal else window[1]) if window else None,
                        softcap=opts.get("softcap", 0.0),
                        alibi_slopes=(opts["alibi_slopes"][:g].double()
                                      if "alibi_slopes" in opts else None),
                        sinks=opts["sinks"][:g].double() if "sinks" in opts else None)  # fmt: skip
    info["status"] = "ok"
    info["out_max_abs"] = float((sl(out, g).double() - ref).abs().max())
    info["ref_max_abs"] = float(ref.abs().max())
    if grads is not None:
        ref.backward(sl(dout, g).double())
        for name, got, r, n in zip(("dq", "dk", "dv"), grads, ref_in, (g, 1, 1), strict=True):
            info[f"{name}_max_abs"] = float((sl(got, n).double() - r.grad).abs().max())
        info["grad_max_abs"] = max(info[f"{n}_max_abs"] for n in ("dq", "dk", "dv"))
    worst = [info["out_max_abs"]] + ([info["grad_max_abs"]] if grads is not None else [])
    if not all(math.isfinite(x) for x in worst):
        info["status"] = "wrong: non-finite values (NaN/inf) in the output or gradients"
    return info


def _varlen_error(case, prov, q, k, v, out, grads, dout, options: Options) -> dict:
    """Sequence 0 (every head) against the float64 reference, output and gradients."""
    from diyfa.reference import attention_ref

    n = case.lengths[0]
    info = {"reference": "diyfa.reference.attention_ref, float64", "scope": "sequence 0"}
    ref_in = [t[:n].detach().double()[None].requires_grad_(grads is not None)
              for t in (q, k, v)]  # fmt: skip
    ref = attention_ref(*ref_in, causal=case.causal, layout="bshd")
    info["status"] = "ok"
    info["out_max_abs"] = float((out[:n].double() - ref[0]).abs().max())
    info["ref_max_abs"] = float(ref.abs().max())
    if grads is not None:
        ref.backward(dout[:n].double()[None])
        for name, got, r in zip(("dq", "dk", "dv"), grads, ref_in, strict=True):
            info[f"{name}_max_abs"] = float((got[:n].double() - r.grad[0]).abs().max())
        info["grad_max_abs"] = max(info[f"{m}_max_abs"] for m in ("dq", "dk", "dv"))
    worst = [info["out_max_abs"]] + ([info["grad_max_abs"]] if grads is not None else [])
    if not all(math.isfinite(x) for x in worst):
        info["status"] = "wrong: non-finite values (NaN/inf) in the output or gradients"
    return info


def _decode_error(case, inputs, out) -> dict:
    """Sequence 0 (every head) against the float64 reference over its cache."""
    from diyfa.reference import attention_ref

    q, k_cache, v_cache, _, table = inputs
    k, v = (cache_of(case, t, table, 0)[None].double() for t in (k_cache, v_cache))
    ref = attention_ref(q[:1].double(), k, v, causal=True, layout="bshd")
    info = {"reference": "diyfa.reference.attention_ref, float64", "scope": "batch 0",
            "status": "ok", "out_max_abs": float((out[:1].double() - ref).abs().max()),
            "ref_max_abs": float(ref.abs().max())}  # fmt: skip
    if not math.isfinite(info["out_max_abs"]):
        info["status"] = "wrong: non-finite values (NaN/inf) in the output"
    return info


def _matmul_error(case, a, b, out, options: Options) -> dict:
    from diyfa.reference import matmul_ref

    elems = case.m * case.n + case.m * case.k + case.k * case.n
    info = {"reference": "diyfa.reference.matmul_ref, float64", "scope": "full"}
    if elems > options.ref_max_matmul:
        info["status"] = f"skipped: too large ({elems:,} elements > {options.ref_max_matmul:,})"
        return info
    ref = matmul_ref(a, b)
    info["status"] = "ok"
    info["out_max_abs"] = float((out.double() - ref).abs().max())
    info["ref_max_abs"] = float(ref.abs().max())
    return info


# --------------------------------------------------------------------------------- measure
def _classify(exc: BaseException, caught: list) -> tuple[str, str]:
    """(status, one-line reason) of a failed measurement; warnings about kernels that were
    not used (SDPA says why a backend refused) are appended."""
    text = " ".join(str(exc).split())  # Triton's compile errors span lines
    msg = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    notes = [str(w.message).strip().splitlines()[0] for w in caught
             if "kernel" in str(w.message).lower() or "not" in str(w.message).lower()]  # fmt: skip
    if notes:
        msg += " | " + " | ".join(dict.fromkeys(notes))
    msg = msg[:600]
    lower = msg.lower()
    if isinstance(exc, (torch.cuda.OutOfMemoryError, MemoryError)) or "out of memory" in lower \
            or "can't allocate memory" in lower:  # fmt: skip
        return "oom", msg
    if isinstance(exc, NotImplementedError) or "No available kernel" in msg:
        return "unsupported", msg
    return "error", msg


def _dtype_key(dtype: str) -> str:
    return "fp8" if dtype.startswith("fp8") else dtype


class Harness:
    """Measures (case, provider, mode) into records for one run."""

    def __init__(self, options: Options | None = None, *, env: dict | None = None,
                 run_id: str = "", datasheet: dict | None = None,
                 ceilings: dict | None = None):  # fmt: skip
        self.options = options or Options()
        self.env = env if env is not None else _results.environment()
        self.run_id = run_id
        self.datasheet = datasheet
        self.ceilings = ceilings if ceilings and ceilings.get("available") else None

    def measure(self, suite: str, case, provider: str, mode: str) -> dict:
        prov = _providers.REGISTRY.get((case.op, provider))
        rec = _results.measurement(
            run_id=self.run_id,
            env=self.env,
            suite=suite,
            case=case,
            provider=provider,
            mode=mode,
            baseline=prov is not None and prov.baseline,
        )
        rec["options"]["layout"] = prov.layout if prov and case.op == "attention" else None
        if prov is None:  # a suite may name a provider this installation does not register
            rec.update(status="unavailable", reason=f"no {case.op} provider {provider!r} is "
                       f"registered; known: {', '.join(_providers.names(case.op))}")  # fmt: skip
            return rec
        why = prov.unavailable()
        if why:
            rec.update(status="unavailable", reason=why)
            return rec
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                why = prov.cannot_run(case)
                if why is None and mode != "fwd" and not prov.backward:
                    why = f"{provider} has no backward"
                if why:
                    rec.update(status="unsupported", reason=why)
                else:
                    self._measure(rec, case, prov, mode)
            except Exception as exc:  # noqa: BLE001 - every failure becomes a record
                status, reason = _classify(exc, caught)
                rec.update(status=status, reason=reason)
            finally:
                gc.collect()  # a failed call's tensors (and an OOM's) go before the next job
                if on_gpu():
                    torch.cuda.empty_cache()
        return rec

    # The work of ``measure``: builds fn, checks error on the first call, memory, time.
    def _measure(self, rec: dict, case, prov, mode: str) -> None:
        opts = self.options
        if case.op in ("attention", "varlen"):
            if case.op == "attention":
                inputs = attention_inputs(case, prov.layout, mode != "fwd", opts.seed)
            else:
                inputs = varlen_inputs(case, mode != "fwd", opts.seed)
            q, k, v = inputs[:3]
            dout = None
            if mode == "fwd":

                def fn():
                    return prov.fn(case, *inputs)
            else:
                prov.fn(case, *inputs)  # compile/autotune: graph_out is a steady-state call
                graph_out = prov.fn(case, *inputs)
                dout = torch.randn_like(graph_out)
                if mode == "bwd":

                    def fn():
                        return torch.autograd.grad(graph_out, (q, k, v), dout, retain_graph=True)
                else:

                    def fn():
                        return torch.autograd.grad(prov.fn(case, *inputs), (q, k, v), dout)

            fn()  # untimed: compiles, autotunes
            # The error is judged on a second call: the steady-state launch path, which is
            # the one timed (a first call can take another path: autotuning, compiling).
            first = fn()
            if opts.check_error:
                if mode == "fwd":
                    out, grads = first, None
                else:
                    out, grads = graph_out.detach(), first
                check = _attention_error if case.op == "attention" else _varlen_error
                rec["error"] = check(case, prov, q, k, v, out, grads, dout, opts)
        elif case.op == "decode":
            inputs = decode_inputs(case, opts.seed)

            def fn():
                with torch.no_grad():
                    return prov.fn(case, *inputs)

            fn()  # untimed: compiles
            first = fn()
            if opts.check_error:
                rec["error"] = _decode_error(case, inputs, first)
        else:
            a, b = matmul_inputs(case, opts.seed)

            def fn():
                return prov.fn(case, a, b)

            fn()
            first = fn()  # steady state, as above
            if opts.check_error:
                rec["error"] = _matmul_error(case, a, b, first, opts)
        del first
        if on_gpu() and opts.measure_memory:
            rec["peak_extra_mem_bytes"] = peak_extra_memory(fn)
        elif not on_gpu():
            rec["memory_note"] = "not measured: no CUDA device"
        med, p20, p80, timer = time_fn(fn, opts)
        rec.update(median_ms=med, p20_ms=p20, p80_ms=p80, timer=timer, status="ok")
        self._derive(rec)
        if opts.rounds > 1:
            rec["_fn"] = fn  # timed again by ``more_rounds`` (run pops it before writing)

    def more_rounds(self, group: list[dict]) -> None:
        """Options.rounds: time the group's measured providers again, in turn, and keep the
        median of every round's median."""
        timed = [r for r in group if r.get("_fn") is not None]
        for rec in timed:
            rec["round_median_ms"] = [rec["median_ms"]]
        for _ in range(self.options.rounds - 1):
            for rec in timed:
                if rec["_fn"] is None:  # a round failed: keep the rounds timed before
                    continue
                try:
                    rec["round_median_ms"].append(time_fn(rec["_fn"], self.options)[0])
                except Exception as exc:  # noqa: BLE001 - keep the rounds timed so far
                    rec["round_note"] = f"a later round failed: {type(exc).__name__}: {exc}"
                    rec["_fn"] = None
        for rec in timed:
            rounds = rec["round_median_ms"]
            rec["median_ms"] = float(np.median(rounds))
            rec["p20_ms"], rec["p80_ms"] = (float(x) for x in np.percentile(rounds, [20, 80]))
            self._derive(rec)

    def _derive(self, rec: dict) -> None:
        """TFLOPS, utilisation and bandwidth from the median time (GPU runs only)."""
        ms = rec["median_ms"]
        if not ms or not on_gpu():
            return
        rec["tflops"] = rec["flops"]["exact"] / ms / 1e9
        rec["tflops_published"] = rec["flops"]["published"] / ms / 1e9
        rec["bandwidth_tbps"] = rec["min_bytes"] / ms / 1e9
        key = _dtype_key(rec["dtype"])
        if self.datasheet and self.datasheet.get(key):
            rec["util_datasheet_pct"] = 100 * rec["tflops"] / self.datasheet[key]
        if self.ceilings:
            name = {"fp16": "float16", "bf16": "bfloat16"}.get(rec["dtype"], rec["dtype"])
            ceiling = self.ceilings.get("matmul_tflops", {}).get(name)
            if ceiling:
                rec["util_ceiling_pct"] = 100 * rec["tflops"] / ceiling
            if self.ceilings.get("copy_tbps"):
                rec["bandwidth_pct_copy"] = 100 * rec["bandwidth_tbps"] / self.ceilings["copy_tbps"]


# ------------------------------------------------------------------------------------- run
def expand(plans: list[Plan], providers: list[str] | None = None,
           modes: list[str] | None = None) -> list[tuple[str, object, str, str]]:  # fmt: skip
    """(suite, case, provider, mode) for every measurement of ``plans``, in run order."""
    jobs = []
    for plan in plans:
        op = plan.cases[0].op if plan.cases else "attention"
        known = _providers.names(op)
        if providers:
            unknown = [
                p
                for p in providers
                if p not in known
                and not any(p in _providers.names(o)
                            for o in ("attention", "matmul", "decode", "varlen"))
            ]
            if unknown:
                raise ValueError(f"unknown providers {unknown}; attention: "
                                 f"{_providers.names('attention')}, matmul: "
                                 f"{_providers.names('matmul')}")  # fmt: skip
            chosen = [p for p in providers if p in known]
        else:
            chosen = list(plan.providers or known)
        plan_modes = list(modes or plan.modes)
        if op in ("matmul", "decode"):
            plan_modes = ["fwd"]
        for case in plan.cases:
            for mode in plan_modes:
                for p in chosen:
                    jobs.append((plan.suite, case, p, mode))
    return jobs


def job_key(job: tuple) -> tuple:
    """:func:`diyfa.bench.results.job_key` of a (suite, case, provider, mode) job."""
    suite, case, provider, mode = job
    return _results.job_key(suite, case.op, provider, case.shape(), case.options(), case.dtype,
                            mode)  # fmt: skip


def run(plans: list[Plan], harness: Harness, *, providers: list[str] | None = None,
        modes: list[str] | None = None, writer: _results.ResultsWriter | None = None,
        progress: bool = False, done: Collection[tuple] = ()) -> list[dict]:  # fmt: skip
    """Measure every job of ``plans`` whose :func:`job_key` is not in ``done`` (a resumed
    run's finished measurements); write each record as it comes (with Options.rounds > 1,
    each case's records when its rounds end), so an interrupt loses only the measurement
    (the case) under way; return the records. ``progress``: draw a bar on stderr
    (:class:`diyfa.bench.progress.Bar`)."""
    jobs = [j for j in expand(plans, providers, modes) if job_key(j) not in done]
    records: list[dict] = []
    group: list[dict] = []  # the records of one (suite, case, mode) still to be finished
    group_key = None

    def finish(recs):
        if harness.options.rounds > 1:
            harness.more_rounds(recs)
        for rec in recs:
            rec.pop("_fn", None)
            if writer is not None:
                writer.write(rec)

    with _progress.Bar(len(jobs), "measurements", enabled=progress) as bar:
        for suite, case, provider, mode in jobs:
            if (suite, case, mode) != group_key or harness.options.rounds == 1:
                finish(group)
                group, group_key = [], (suite, case, mode)
            bar.show(f"{suite} {provider} {mode} {case.label()}")
            rec = harness.measure(suite, case, provider, mode)
            records.append(rec)
            group.append(rec)
            bar.advance()
        finish(group)
    return records


def summary_rows(records: list[dict]) -> tuple[list[str], list[list[str]], list[str]]:
    """Columns, rows and notes of the end-of-run table (unavailable providers as notes)."""
    columns = ["suite", "case", "mode", "provider", "median ms", "p20-p80", "TFLOPS",
               "% peak", "% cuBLAS", "TB/s", "max err", "extra MB", "status"]  # fmt: skip
    rows, unavailable = [], {}

    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    for r in records:
        if r["status"] == "unavailable":
            unavailable[r["provider"]] = r["reason"]
            continue
        err = r.get("error") or {}
        e = err.get("grad_max_abs", err.get("out_max_abs"))
        err_s = f(e, ".1e") if err.get("status") == "ok" else ("skip" if err else "-")
        spread = "-" if r["p20_ms"] is None else f"{r['p20_ms']:.3f}-{r['p80_ms']:.3f}"
        mem = r["peak_extra_mem_bytes"]
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r['reason'][:60]}"
        rows.append([r["suite"], r["label"], r["mode"], r["provider"], f(r["median_ms"], ".3f"),
                     spread, f(r["tflops"], ".1f"), f(r["util_datasheet_pct"], ".0f"),
                     f(r["util_ceiling_pct"], ".0f"), f(r["bandwidth_tbps"], ".2f"), err_s,
                     "-" if mem is None else f"{mem / 1e6:.1f}", status])  # fmt: skip
    notes = [f"{p}: unavailable ({why})" for p, why in unavailable.items()]
    return columns, rows, notes
