"""The backward's kernels compiled on a worker thread during the first forward
(diyfa/attention/prefetch.py) and the compile-only launch mode it uses (diyfa/_launcher.py)."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from diyfa import _launcher
from diyfa._launcher import compile_only, compiling_only
from diyfa.attention import checks, prefetch
from diyfa.attention.dispatch import select

from .conftest import DEVICE
from .test_attention import _inputs, _run_and_check


def test_compile_only_is_per_thread_and_restored():
    seen = {}
    with compile_only():
        assert compiling_only()
        with compile_only():
            assert compiling_only()
        assert compiling_only()  # the inner block restores, not clears
        t = threading.Thread(target=lambda: seen.update(other=compiling_only()))
        t.start()
        t.join()
    assert seen == {"other": False}
    assert not compiling_only()


def _problem(q, k, v, **kw):
    kw.setdefault("causal", False)
    return checks.check_inputs(q, k, v, softmax_scale=None, align="bottom_right", **kw)


def test_kind_tells_apart_what_changes_the_backward_kernels():
    q = torch.randn(1, 4, 40, 64, device=DEVICE)
    kv = torch.randn(1, 2, 40, 64, device=DEVICE)
    base = _problem(q, kv, kv, layout="bhsd")
    fam = select(base)
    k0 = prefetch.kind(base, fam)
    # A length with the same divisibility by 16, a different window width: the same kernels.
    q2 = torch.randn(1, 4, 72, 64, device=DEVICE)
    kv2 = torch.randn(1, 2, 72, 64, device=DEVICE)
    assert prefetch.kind(_problem(q2, kv2, kv2, layout="bhsd"), fam) == k0
    assert (prefetch.kind(_problem(q, kv, kv, layout="bhsd", window_size=(5, 3)), fam)
            == prefetch.kind(_problem(q, kv, kv, layout="bhsd", window_size=(9, 1)), fam))
    others = [
        _problem(q, kv, kv, layout="bhsd", causal=True),
        _problem(q.half(), kv.half(), kv.half(), layout="bhsd"),
        _problem(q[..., :48], kv[..., :48], kv[..., :48], layout="bhsd"),
        _problem(q.transpose(1, 2), kv.transpose(1, 2), kv.transpose(1, 2), layout="bshd"),
        _problem(q, kv, kv, layout="bhsd", deterministic=True),
        _problem(q, kv, kv, layout="bhsd", window_size=(5, -1)),
        _problem(q, kv, kv, layout="bhsd", softcap=20.0),
        _problem(q, q, q, layout="bhsd"),  # no GQA
        _problem(q[:, :, :32], kv, kv, layout="bhsd"),  # seqlen_q divisible by 16
    ]
    kinds = {k0} | {prefetch.kind(p, fam) for p in others}
    assert len(kinds) == len(others) + 1


@pytest.mark.parametrize("case", ["bhsd", "bshd", "value_dim", "varlen"])
def test_standins_match_the_forward_outputs(case):
    """The worker compiles on stand-ins for out and lse2: they must be shaped and strided as
    the forward's outputs, or it compiles kernels the backward will not use."""
    g = torch.Generator().manual_seed(0)
    dv = 24 if case == "value_dim" else 32
    if case == "varlen":
        q = torch.randn(37, 4, 32, generator=g).to(DEVICE)
        k = torch.randn(41, 2, 32, generator=g).to(DEVICE)
        v = torch.randn(41, 2, 32, generator=g).to(DEVICE)
        cu_q = torch.tensor([0, 17, 37], dtype=torch.int32, device=DEVICE)
        cu_k = torch.tensor([0, 30, 41], dtype=torch.int32, device=DEVICE)
        p = checks.check_varlen_inputs(q, k, v, cu_q, cu_k, 20, 30, causal=True,
                                       softmax_scale=None)  # fmt: skip
    else:
        layout = "bshd" if case == "bshd" else "bhsd"
        shape = (2, 4, 19, 32) if layout == "bhsd" else (2, 19, 4, 32)
        q = torch.randn(shape, generator=g).to(DEVICE)
        k = torch.randn(shape, generator=g).to(DEVICE)
        v = torch.randn(shape[:-1] + (dv,), generator=g).to(DEVICE)
        p = _problem(q, k, v, layout=layout, causal=True)
    out, lse2 = select(p).forward(q, k, v, p)
    s_out, s_lse2 = prefetch.standins(q, v, p)
    for ours, real in ((s_out, out), (s_lse2, lse2)):
        assert (ours.shape, ours.stride(), ours.dtype, ours.device) == (
            real.shape, real.stride(), real.dtype, real.device)


def test_start_skips_cpu_tensors_and_kinds_it_has_seen(monkeypatch):
    monkeypatch.setattr(prefetch, "_seen", set())
    monkeypatch.setenv("DIYFA_PREFETCH_BACKWARD", "1")
    q = torch.randn(1, 2, 16, 32, device=DEVICE)
    p = _problem(q, q, q, layout="bhsd")
    fam = select(p)
    submitted = []

    class Pool:
        def submit(self, fn, *args):
            submitted.append(args)
            return "future"

    monkeypatch.setattr(prefetch, "_pool", Pool())
    if DEVICE == "cpu":  # the interpreter compiles nothing: never started
        assert prefetch.start(q, q, q, p, fam) is None
        assert not submitted
        return
    assert prefetch.start(q, q, q, p, fam) == "future"
    assert prefetch.start(q, q, q, p, fam) is None  # seen
    monkeypatch.setenv("DIYFA_PREFETCH_BACKWARD", "0")
    p2 = _problem(q, q, q, layout="bhsd", causal=True)
    assert prefetch.start(q, q, q, p2, fam) is None
    assert len(submitted) == 1


def test_wait_drops_the_worker_failure(caplog, monkeypatch):
    """The worker's failure is logged, never raised, and kept as text (its traceback would
    hold the worker's buffers): a failing backward in compile-only mode gives a string."""
    from concurrent.futures import Future

    class Family:
        def backward(self, *args):
            raise RuntimeError("boom")

    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    text = prefetch._compile_backward(Family(), None, torch.zeros(1), None, None, None, None)
    assert text == "RuntimeError('boom')"
    f = Future()
    f.set_result(text)
    g = Future()
    g.set_exception(RuntimeError("bang"))
    with caplog.at_level("DEBUG", logger="diyfa.attention.prefetch"):
        prefetch.wait(f)
        prefetch.wait(g)
        prefetch.wait(None)
    assert "boom" in caplog.text and "bang" in caplog.text


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,dtype", [(104, torch.float16), (24, torch.bfloat16)])
def test_gpu_backward_kernels_compile_on_the_worker(monkeypatch, head_dim, dtype):
    """A kind of problem this process has not run (head dim 104: the Hopper forward and the
    Gluon backward; 24: the portable kernels): every backward kernel compiles on the worker,
    in compile-only mode (Triton's warmup), none at the backward; the gradients are right."""
    from collections import defaultdict

    from triton import knobs

    from diyfa.attention import hopper_bwd, portable

    # As in a fresh process: no backward kernel in Triton's in-memory caches or diyfa's
    # launchers (the disk cache may hold them: a compile from it still calls the hook).
    for fn in (portable._attn_bwd_dq, portable._attn_bwd_dkdv, hopper_bwd._attn_bwd_hopper,
               hopper_bwd._bwd_delta):  # fmt: skip
        monkeypatch.setattr(fn, "device_caches", defaultdict(fn.create_binder))
    monkeypatch.setattr(_launcher, "_launchers", {})
    monkeypatch.setattr(portable, "_chosen", {})
    monkeypatch.setattr(prefetch, "_seen", set())
    monkeypatch.setenv("DIYFA_PREFETCH_BACKWARD", "1")
    compiles = []

    def hook(*, fn, is_manual_warmup, **kw):  # Triton's JITHook: after each compile
        compiles.append((fn.name, threading.current_thread().name, is_manual_warmup))

    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", hook)
    q, k, v = _inputs(2, 6, 6, 333, 333, head_dim, dtype, layout="bshd", device="cuda")
    _run_and_check(q, k, v, True, layout="bshd")  # forward and gradients by the 2x / 3x rule
    bwd = [c for c in compiles if "bwd" in c[0]]
    assert bwd, f"no backward kernel compiled: {compiles}"
    for name, thread, warmup in bwd:
        assert thread.startswith("diyfa-prefetch") and warmup, (name, thread, warmup)


@pytest.mark.gpu
def test_gpu_frozen_max_second_build_compiles_ahead(monkeypatch):
    """A frozen-max forward (hopper_fwd.FROZEN_MAX) launches two builds, the frozen one and
    the running max's that redoes a flagged call: for a kind of problem this process has
    not run, the second compiles on the ahead worker (prefetch.compile_ahead, Triton's
    warmup) while this thread compiles the first, and the output is right (2x rule)."""
    from collections import defaultdict

    from triton import knobs

    from diyfa.attention import hopper_fwd as hf

    fn = hf._attn_fwd_hopper
    monkeypatch.setattr(fn, "device_caches", defaultdict(fn.create_binder))
    monkeypatch.setattr(_launcher, "_launchers", {})
    monkeypatch.setattr(hf, "_REPLAYS", _launcher.ReplayCache())
    monkeypatch.setattr(hf, "FROZEN_MIN_KEYS", ((128, 0),))
    monkeypatch.setattr(hf, "FROZEN_MIN_PAIRS", 0)
    monkeypatch.setenv("DIYFA_PREFETCH_BACKWARD", "1")
    compiles = []

    def hook(*, fn, is_manual_warmup, **kw):  # Triton's JITHook: after each compile
        compiles.append((fn.name, threading.current_thread().name, is_manual_warmup))

    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", hook)
    q, k, v = _inputs(1, 4, 2, 333, 517, 128, torch.bfloat16, device="cuda")
    with torch.no_grad():  # (inference without the LSE: the frozen max)
        _run_and_check(q, k, v, False, grads=False, backend="hopper")
    fwd = [(thread.startswith("diyfa-ahead"), warmup) for name, thread, warmup in compiles
           if name == fn.__name__]  # fmt: skip
    assert sorted(fwd) == [(False, False), (True, True)], compiles
    compiles.clear()  # the next call of the kind: nothing to compile, nothing started
    with torch.no_grad():
        _run_and_check(q, k, v, False, grads=False, backend="hopper")
    assert not [c for c in compiles if c[0] == fn.__name__], compiles
