"""The Hopper backward (diyfa/attention/hopper_bwd.py, Gluon).

CPU (CI): the kernel compiles for sm90a with Triton's bundled ptxas in both modes and fits
(shared memory, the instructions its docstring names, spills bounded); the delta kernel
under the interpreter; where the backward goes ("auto" keeps the portable backward unless
``DIYFA_HOPPER_BWD=1``; ``backend="hopper"`` runs the Gluon one where it applies); the launch
arguments the host path builds (grid, descriptors, the dQ workspace, a stride-0 dO copied).
GPU (``gpu``): gradients through the Hopper backward in both modes by the 3x rule against
float64, bitwise-reproducible gradients in deterministic mode, GQA/MQA, causal with
seqlen_q != seqlen_k, rows that see no key, 16k tokens.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import types

import pytest
import torch

import diyfa
from diyfa.attention import dispatch, hopper_bwd, portable

from .conftest import DEVICE
from .test_attention import _inputs, _run_and_check
from .test_hopper_attention import _hopper_only, _problem

_COMPILE = """
import json, os, subprocess, sys, tempfile, torch, triton
from diyfa.attention import hopper_bwd as hb
ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
out = []
runs = [(d, causal, atomic, (), False) for d in (64, 128) for causal in (False, True)
        for atomic in (False, True)]
runs += [(d, True, atomic, ("WINDOW", "SOFTCAP", "ALIBI"), False) for d in (64, 128)
         for atomic in (False, True)]
runs += [(128, False, False, ("WINDOW",), False)]  # a left window without the causal band
runs += [(d, causal, atomic, (), True) for d in (64, 128) for causal in (False, True)
         for atomic in (False, True)]  # packed sequences
runs = [(*r, None) for r in runs]
# d64 plain attention's own config: 128 query rows per step (hopper_bwd.default_config)
runs += [(64, causal, atomic, (), False, hb.BWD_CONFIG_D64_ROWS128) for causal in (False, True)
         for atomic in (False, True)]
runs += [(64, causal, not causal, (), True, hb.BWD_CONFIG_D64_ROWS128) for causal in (False, True)]
for d, causal, atomic, variants, packed, cfg in runs:
    k = hb.compile_bwd_for_hopper(d, getattr(torch, sys.argv[1]), causal, atomic, cfg,
                                  variants=variants, packed=packed)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    done = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                          capture_output=True, text=True, check=True)
    out.append({"d": d, "causal": causal, "atomic": atomic, "variants": variants,
                "packed": packed, "cfg": cfg, "shared": k.metadata.shared, "ptx": k.asm["ptx"],
                "ptxas": done.stderr})
print(json.dumps(out))
"""

# ptxas's spill report of the current kernel (2026-11-23, triton 3.6, with the launch's
# divisibility hints): none at d64; at d128 92 bytes and, with the atomic dQ, 256. With
# window + softcap + ALiBi on: 48 bytes at d64 (atomic), 488 / 672 at d128 (softcap alone
# 300, ALiBi alone 332: the extra (keys, queries) tile of tanh' or distances); since tanh is
# 1 - 2 / (2^(2x log2 e) + 1) (2026-11-24), 156 bytes at d64 causal with the atomic dQ (an
# opt-in mode: "auto" runs softcap's backward on the portable kernel). Packed sequences
# (2026-11-24; their lengths and offsets are loaded values in registers, not arguments in
# the constant bank): 0 at d64, 96 / 256 bytes at d128 (deterministic / atomic), 92 / 556
# causal; they take the variants' bounds.
# Bounds that catch a regression (a tile's worth of registers spilled is kilobytes).
SPILL_BOUND = {(64, False): 0, (128, False): 512, (64, True): 192, (128, True): 1024}
# d64 with 128-row steps (hopper_bwd.BWD_CONFIG_D64_ROWS128): 8 / 16 bytes (deterministic /
# atomic), 12 / 40 causal (2026-11-25; 248-256 before the statistics were read after their
# waits); packed sequences 0 / 16, causal 0 / 32
SPILL_BOUND_ROWS128 = 64


def _spilled(ptxas: str) -> int:
    return int(ptxas.split(" bytes spill stores")[0].rsplit(" ", 1)[-1])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_hopper_bwd_compiles_and_fits(dtype):
    """For head dims 64 and 128, causal or not, fast (atomic dQ) and deterministic, with
    window + softcap + ALiBi, and packed sequences: the kernel compiles for sm90a without a
    GPU, fits 227 KB of shared memory, and is what its docstring says: wgmma for S^T = K
    Q^T and dP^T = V dO^T (m64 x BLOCK_M), for dV += P^T dO and dK += dS^T Q (m64 x head
    dim, A from registers), for dQ (the transposed dS^T from shared memory) only in the fast
    mode, with TMA reduce-adds of fp32 tiles to global memory there and none in the
    deterministic mode; 4-D TMA loads and stores; registers moved from the loader to the
    consumers. In a fresh process (the interpreter patches Triton)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE, dtype], env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    kind = {"bfloat16": "bf16", "float16": "f16"}[dtype]
    for r in json.loads(done.stdout.strip().splitlines()[-1]):
        block_m, _, c_regs, l_regs = (r["cfg"] or hopper_bwd.BWD_CONFIGS[r["d"]])[:4]
        where = (f"d{r['d']} causal={r['causal']} atomic={r['atomic']} {r['variants']} "
                 f"packed={r['packed']} config={r['cfg']}")
        ptx = r["ptx"]
        assert r["shared"] <= 227 * 1024, where
        assert f"wgmma.mma_async.sync.aligned.m64n{block_m}k16.f32.{kind}" in ptx, where
        assert f"wgmma.mma_async.sync.aligned.m64n{r['d']}k16.f32.{kind}" in ptx, where
        assert "cp.async.bulk.tensor.4d.shared::cluster.global" in ptx, where  # TMA loads
        assert "cp.async.bulk.tensor.4d.global.shared::cta" in ptx, where  # TMA stores
        assert f"setmaxnreg.inc.sync.aligned.u32 \t{c_regs};" in ptx, where
        assert f"setmaxnreg.dec.sync.aligned.u32 \t{l_regs};" in ptx, where
        # The fast mode's dQ leaves by TMA reduce-adds from shared memory; no per-thread
        # reductions in either mode.
        reductions = "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add" in ptx
        assert reductions == r["atomic"], where
        assert not re.search(r"\b(red|atom)\.global", ptx), where  # (not "shared.global")
        # d128's atomic dQ (the column split): the consumers meet on a named barrier of both
        # warpgroups once dS^T is written (hopper_bwd.DS_NAMED), nowhere else
        named = re.search(r"bar\.sync\s+%r\d+, 256;", ptx) is not None
        assert named == (r["d"] == 128 and r["atomic"]), where
        # No wgmma serialised by ptxas (its C7515 note: an accumulator written between a
        # product's issue and its wait; every product then waits for the one before).
        assert "C7515" not in r["ptxas"], (where, r["ptxas"])
        bound = SPILL_BOUND[r["d"], bool(r["variants"]) or r["packed"]]
        if block_m == 128:
            bound = SPILL_BOUND_ROWS128
        assert _spilled(r["ptxas"]) <= bound, (
            where, r["ptxas"])
        # One exp2 per score (64 per step at 64 rows: 32 a consumer thread), and softcap's
        # tanh by the hardware instruction.
        # (ALiBi's split bias has two paths, one per step: blocks on one side of the
        # diagonal and blocks across it, but in causal calls: hopper_fwd.alibi_flag.)
        paths = 2 if "ALIBI" in r["variants"] and hopper_bwd.alibi_flag(
            r["d"], backward=True, causal=r["causal"]) == 2 else 1  # fmt: skip
        assert ptx.count("ex2.approx") == block_m * paths, where
        assert ptx.count("tanh.approx.f32") == (64 if "SOFTCAP" in r["variants"] else 0), where
        # Packed sequences: a sequence's last key block leaves by masked stores (TMA would
        # write the next sequence's rows), the others by TMA.
        assert ("st.global" in ptx) == r["packed"], where


_COMPILE_WIDE = """
import json, os, subprocess, sys, tempfile, torch, triton
from diyfa.attention import hopper_bwd256 as hb
ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
out = []
runs = [(256, False, True, (), False), (256, True, True, (), False),
        (256, False, False, (), False), (256, True, False, (), False),
        (192, True, True, (), False)]
runs += [(256, True, atomic, ("WINDOW", "SOFTCAP", "ALIBI"), False) for atomic in (False, True)]
runs += [(256, causal, atomic, (), True) for causal, atomic in ((True, False), (False, True))]
runs = [(*r, None) for r in runs]
runs += [(192, True, False, (), False, 128), (192, False, True, (), True, 128)]  # value dims
for d, causal, atomic, variants, packed, dv in runs:
    k = hb.compile_for_hopper(getattr(torch, sys.argv[1]), causal, atomic, d, None, variants,
                              packed, dv)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    done = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                          capture_output=True, text=True, check=True)
    out.append({"d": d, "causal": causal, "atomic": atomic, "variants": variants,
                "packed": packed, "dv": dv, "shared": k.metadata.shared, "ptx": k.asm["ptx"],
                "ptxas": done.stderr})
print(json.dumps(out))
"""

# ptxas's spill report of the d256 kernel (2026-11-25, triton 3.6): 280 / 288 bytes with the
# atomic dQ (d256 / d192 causal), 52 / 68 without; window + softcap + ALiBi 152 / 320; packed
# sequences 52 (deterministic, causal) / 300 (atomic); a value head dim of 128: none.
SPILL_BOUND_WIDE = {True: 512, False: 256}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_hopper_bwd_d256_compiles_and_fits(dtype):
    """hopper_bwd256's kernel (head dims 129..256; plain, window + softcap + ALiBi, packed
    sequences) compiles for sm90a without a GPU, fits 227 KB of shared memory and is what
    its docstring says: n32 wgmma for each consumer's rows of S^T and dP^T, m64n128 for its
    column halves of dV and dK, m64n64 dQ pieces added by TMA reduce-adds only with the
    atomic dQ; one exp2 per score (16 per thread per step in each consumer) and softcap's
    tanh by the hardware instruction; 4-D TMA loads and stores (packed sequences: a
    sequence's last block by masked stores); registers moved to the consumers; no wgmma
    serialised (ptxas C7515) and spills bounded. In a fresh process."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_WIDE, dtype], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    kind = {"bfloat16": "bf16", "float16": "f16"}[dtype]
    _, _, c_regs, l_regs = hopper_bwd.BWD_CONFIGS[256]
    for r in json.loads(done.stdout.strip().splitlines()[-1]):
        where = (f"d{r['d']} causal={r['causal']} atomic={r['atomic']} {r['variants']} "
                 f"packed={r['packed']} dv={r['dv']}")
        ptx = r["ptx"]
        assert r["shared"] <= 227 * 1024, where
        for n in (32, 128):
            assert f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{kind}" in ptx, where
        n64 = f"wgmma.mma_async.sync.aligned.m64n64k16.f32.{kind}" in ptx  # dQ pieces
        reductions = "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add" in ptx
        assert reductions == r["atomic"], where
        assert n64 == (r["atomic"] or r["dv"] == 128), where  # (and dV's half at v 128)
        assert not re.search(r"\b(red|atom)\.global", ptx), where
        assert "cp.async.bulk.tensor.4d.shared::cluster.global" in ptx, where  # TMA loads
        assert "cp.async.bulk.tensor.4d.global.shared::cta" in ptx, where  # TMA stores
        assert f"setmaxnreg.inc.sync.aligned.u32 \t{c_regs};" in ptx, where
        assert f"setmaxnreg.dec.sync.aligned.u32 \t{l_regs};" in ptx, where
        assert ptx.count("ex2.approx") == 2 * 16, where
        assert ptx.count("tanh.approx.f32") == (32 if "SOFTCAP" in r["variants"] else 0), where
        assert ("st.global" in ptx) == r["packed"], where
        assert "C7515" not in r["ptxas"], (where, r["ptxas"])
        assert _spilled(r["ptxas"]) <= SPILL_BOUND_WIDE[r["atomic"]], (where, r["ptxas"])


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("shape", [(2, 3, 77, 40), (1, 2, 130, 128), (1, 1, 1, 8)])
def test_delta_kernel(shape, layout):
    """rowsum(dO * O) in fp32 from any strides (the kernel the fast mode runs first), against
    torch in float64."""
    b, h, s, d = shape
    g = torch.Generator().manual_seed(0)
    full = (b, h, s, d) if layout == "bhsd" else (b, s, h, d)
    o = torch.randn(full, generator=g).to(DEVICE, torch.bfloat16)
    do = torch.randn(full, generator=g).to(DEVICE, torch.bfloat16)
    o4, do4 = hopper_bwd.bhsd_view(o, layout), hopper_bwd.bhsd_view(do, layout)
    got = hopper_bwd.delta(o4, do4).cpu()
    want = (o4.double() * do4.double()).sum(-1).cpu()
    bound = 1e-4 * max(1.0, want.abs().max().item())
    assert got.shape == (b, h, s) and got.dtype == torch.float32
    assert (got.double() - want).abs().max().item() < bound
    # with the atomic dQ's workspace (rows padded past seqlen_q): zeroed by the same launch.
    # (Another build of the kernel: on a GPU its sums may round in another order, so it is
    # held to the same bound, not to the first build's bits; 2026-11-25, H200.)
    acc = torch.full((b, h, -(-s // 64) * 64 + 64, 64), float("nan"), device=DEVICE)
    again = hopper_bwd.delta(o4, do4, acc=acc).cpu()
    assert (again.double() - want).abs().max().item() < bound
    assert torch.equal(acc, torch.zeros_like(acc))


@pytest.mark.parametrize("kwargs, reason", [
    (dict(d=256, value_dim=64), "value head dim other than q's (here 64 and 256)"),
    (dict(d=128, value_dim=64), "only with q/k head dims above 128"),
    (dict(capability=(8, 0)), "needs a Hopper GPU"),
    (dict(dtype=torch.float32), "fp16 or bf16"),
    (dict(d=60), "multiples of 8"),
], ids=["d256-value-dim64", "d128-value-dim", "sm80", "fp32", "d60"])
def test_supports_says_why_not(kwargs, reason):
    assert reason in hopper_bwd.supports(_problem(**kwargs))


@pytest.mark.parametrize("kwargs", [dict(), dict(d=64, causal=True), dict(d=96, layout="bshd"),
                                    dict(d=72, hk=1), dict(d=256, causal=True),
                                    dict(d=136, hk=1, layout="bshd"),
                                    dict(d=192, sinks=torch.zeros(4)),
                                    dict(d=256, window_left=100, softcap=30.0,
                                         alibi_slopes=torch.ones(4), causal=True),
                                    dict(d=192, value_dim=128)],
                         ids=["d128", "d64-causal", "d96", "d72", "d256-causal", "d136-mqa",
                              "d192-sinks", "d256-variants", "d192-value-dim128"])
def test_supports_takes(kwargs):
    assert hopper_bwd.supports(_problem(**kwargs)) is None


@pytest.mark.parametrize("env, backend, kwargs, want", [
    (None, "auto", dict(), "hopper-atomic"),
    (None, "auto", dict(d=64, sk=4096), "hopper-atomic"),
    (None, "auto", dict(d=64, sk=4096, causal=True), "hopper-atomic"),
    (None, "auto", dict(d=80, deterministic=True), "hopper-kernel-dq"),
    (None, "auto", dict(causal=True), "hopper-atomic"),
    (None, "auto", dict(d=64, sk=4096, deterministic=True), "hopper-kernel-dq"),
    (None, "auto", dict(d=64, sk=4096, causal=True, deterministic=True), "hopper-kernel-dq"),
    ("1", "auto", dict(d=64, sk=4096), "hopper-atomic"),
    ("1", "auto", dict(deterministic=True), "hopper-kernel-dq"),
    ("0", "auto", dict(), "portable"),
    (None, "hopper", dict(), "hopper-atomic"),
    (None, "hopper", dict(deterministic=True), "hopper-kernel-dq"),
    (None, "hopper", dict(d=256), "hopper-kernel-dq"),
    ("1", "auto", dict(d=256), "hopper-kernel-dq"),
    (None, "auto", dict(d=192, causal=True), "hopper-kernel-dq"),
    # 65600 x 4 heads: past one grid axis, the same rules (portable.bh_grid; until
    # 2026-11-26 the deterministic path could not take them)
    (None, "auto", dict(d=256, b=16400, sq=2, sk=2), "hopper-kernel-dq"),
    (None, "hopper", dict(d=256, b=16400, sq=2, sk=2), "hopper-kernel-dq"),
    (None, "auto", dict(b=16400, sq=2, sk=2), "hopper-atomic"),
    (None, "auto", dict(b=16400, sq=2, sk=2, deterministic=True), "hopper-kernel-dq"),
    (None, "hopper", dict(d=192, variant=dict(window_left=100)), "hopper-kernel-dq"),
    (None, "auto", dict(variant=dict(window_left=100)), "hopper-atomic"),
    (None, "auto", dict(d=64, sk=4096, variant=dict(window_left=100)), "hopper-atomic"),
    (None, "auto", dict(variant=dict(softcap=30.0), causal=True), "hopper-atomic"),
    (None, "auto", dict(variant=dict(alibi_slopes=torch.ones(4)), causal=True),
     "hopper-atomic"),
    (None, "auto", dict(d=64, sk=4096, variant=dict(alibi_slopes=torch.ones(4)), causal=True),
     "hopper-atomic"),
    (None, "auto", dict(d=64, sk=4096, variant=dict(alibi_slopes=torch.ones(4))),
     "hopper-atomic"),
    ("1", "auto", dict(variant=dict(window_left=100)), "hopper-atomic"),
    (None, "hopper", dict(variant=dict(softcap=30.0)), "hopper-atomic"),
    (None, "hopper", dict(variant=dict(alibi_slopes=torch.ones(4)), deterministic=True),
     "hopper-kernel-dq"),
    (None, "hopper", dict(variant=dict(sinks=torch.ones(4))), "hopper-atomic"),
    (None, "hopper", dict(variant=dict(value_dim=64)), "portable"),
], ids=["auto-d128", "auto-d64", "auto-d64-causal", "auto-d80-det", "auto-d128-causal",
        "auto-d64-det", "auto-d64-causal-det", "enabled-d64",
        "enabled-det", "auto-disabled", "named", "named-det", "named-d256", "enabled-d256",
        "auto-d256", "auto-d256-huge-batch", "named-d256-huge-batch", "auto-huge-batch",
        "auto-huge-batch-det", "named-d192-window",
        "auto-window", "auto-window-d64", "auto-softcap", "auto-alibi", "auto-alibi-d64",
        "auto-alibi-d64-full", "enabled-window", "named-softcap",
        "named-det-alibi", "named-sinks", "named-value-dim"])
def test_where_the_backward_runs(env, backend, kwargs, want, monkeypatch):
    """"auto" runs the Gluon backward where it measured faster (hopper_bwd.auto_mode: the
    atomic dQ above d64 and at d64 from ATOMIC_D64_KEYS keys or causal, the kernel-dQ
    (deterministic) path when asked for); DIYFA_HOPPER_BWD=0 turns it off, =1 runs it
    wherever it applies; naming the family runs it with the atomic dQ unless deterministic.
    The variants (window, softcap, ALiBi, sinks) run in it when named or enabled; "auto"
    runs a window, softcap, ALiBi or sinks at d64..128 with the atomic dQ (each measured
    faster; at d64 since 2026-11-25)."""
    deterministic = kwargs.pop("deterministic", False)
    variant = kwargs.pop("variant", {})
    if env is None:
        monkeypatch.delenv("DIYFA_HOPPER_BWD", raising=False)
    else:
        monkeypatch.setenv("DIYFA_HOPPER_BWD", env)
    problem = dataclasses.replace(_problem(**kwargs), deterministic=deterministic, **variant)
    calls = []

    def fake_hopper(*args, atomic_dq=None, delta_out=None):
        atomic = (not problem.deterministic) if atomic_dq is None else atomic_dq
        calls.append("hopper-atomic" if atomic else "hopper-kernel-dq")

    monkeypatch.setattr(hopper_bwd, "hopper_backward", fake_hopper)
    # hopper_bwd's own reference to the portable module (not portable.FAMILY itself, which
    # dispatch.families() caches for the process).
    fake = dataclasses.replace(portable.FAMILY, backward=lambda *a, **k: calls.append("portable"))
    monkeypatch.setattr(hopper_bwd, "portable", types.SimpleNamespace(FAMILY=fake))
    dispatch.select(problem, backend).backward(None, None, None, None, None, None, problem)
    assert calls == [want]


def test_deterministic_option_reaches_the_problem():
    """``deterministic=True``, or torch's deterministic-algorithms mode, reaches the Problem the
    backward reads; a non-bool is refused."""
    from diyfa.attention.checks import check_inputs

    q = torch.empty(1, 2, 8, 64, device=DEVICE)

    def problem(**kw):
        return check_inputs(q, q, q, causal=False, softmax_scale=None, layout="bhsd",
                            align="bottom_right", **kw)  # fmt: skip

    assert problem().deterministic is False
    assert problem(deterministic=True).deterministic is True
    before = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        assert problem().deterministic is True
    finally:
        torch.use_deterministic_algorithms(before)
    with pytest.raises(TypeError, match="deterministic must be a bool, got 1"):
        problem(deterministic=1)


@pytest.mark.parametrize("deterministic", [False, True], ids=["fast", "deterministic"])
def test_host_path_builds_the_launch(deterministic, monkeypatch):
    """What hopper_backward hands the kernel, captured at the launch (CPU tensors; nothing runs on a
    GPU): one program per 128 keys of each (batch, kv head), row by row; Q/dO blocks of BLOCK_M rows
    and K/V/dK/dV blocks of 64 over the (batch, heads, seqlen, dim) views of a bshd call; a zeroed
    fp32 dQ workspace padded to whole query blocks and the padded head dim (fast mode) or the
    portable dQ kernel's delta (deterministic); a stride-0 dO (the gradient of ``out.sum()``) copied
    to a TMA-ready tensor. The fast mode's dQ is the workspace times the softmax scale."""
    b, h, hk, sq, sk, d = 2, 8, 2, 200, 300, 96
    q = torch.randn(b, sq, h, d, dtype=torch.bfloat16)
    k = torch.randn(b, sk, hk, d, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    out = torch.randn_like(q)
    do = torch.ones(1, 1, 1, 1, dtype=torch.bfloat16).expand_as(q)
    problem = dataclasses.replace(_problem(b=b, h=h, hk=hk, sq=sq, sk=sk, d=d, layout="bshd",
                                           scale=0.25), deterministic=deterministic)
    lse2 = torch.randn(b, h, sq)
    seen = {}

    def fake_launch(fn, grid, args, meta, num_warps, num_stages):
        seen.update(fn=fn, grid=grid, args=args, num_warps=num_warps)
        if args["DQ_ATOMIC"]:
            args["dq_desc"].base.fill_(2.0)

    def fake_dq(do_, q_, k_, v_, out_, lse2_, dq_, delta_, p_):  # the portable dQ kernel
        seen["portable_dq"] = True
        dq_.fill_(3.0)
        delta_.zero_()

    monkeypatch.setattr(hopper_bwd, "launch", fake_launch)
    monkeypatch.setattr(portable, "_dq_launch", fake_dq)
    if not deterministic:
        monkeypatch.setattr(hopper_bwd, "delta", lambda o4, do4, launched, res, acc: res.zero_())
    dq, dk, dv = hopper_bwd.hopper_backward(do, q, k, v, out, lse2, problem)
    block_m = hopper_bwd.BWD_CONFIGS[128][0]
    args = seen["args"]
    assert seen["fn"] is hopper_bwd._attn_bwd_hopper and seen["num_warps"] == 4
    assert seen["grid"] == (-(-sk // 128) * b * hk,) and args["section"] == 1  # (no band)
    # 0: the portable dQ kernel first; 3: the atomic dQ with a column half per consumer
    # every step (head dims padding to 128: hopper_bwd.DQ_SPLIT) in FlashAttention-3's
    # order (hopper_bwd.DQ_FA3_ORDER)
    assert args["DQ_ATOMIC"] == (0 if deterministic else 3 + 8)  # (+ 8: DS_NAMED)
    assert args["kv_group"] == 4 and args["seqlen_q"] == sq and args["seqlen_k"] == sk
    # (non-causal: the fast mode runs the causal build with its band past every key,
    # hopper_bwd.NONCAUSAL_AS_CAUSAL at padded head dim 128; the deterministic path its own)
    if deterministic:
        assert args["CAUSAL"] is False and args["causal_offset"] == sk - sq
    else:
        assert args["CAUSAL"] is True and args["causal_offset"] == -(-sk // 128) * 128
    assert args["sm_scale"] == 0.25
    qd, kd, dod, dkd = args["q_desc"], args["k_desc"], args["do_desc"], args["dk_desc"]
    assert list(qd.shape) == [b, h, sq, d] and list(qd.block_shape) == [1, 1, block_m, 128]
    assert list(kd.shape) == [b, hk, sk, d] and list(kd.block_shape) == [1, 1, 64, 128]
    assert list(qd.strides) == list(q.transpose(1, 2).stride())
    assert 0 not in dod.strides and hopper_bwd.tma_ready(dod.base)  # dO copied
    assert list(dkd.strides) == list(dk.transpose(1, 2).stride())
    if deterministic:
        assert seen.get("portable_dq") and (dq == 3.0).all()
    else:
        assert "portable_dq" not in seen
        dqd = args["dq_desc"]  # the fp32 workspace, blocks of a column half
        assert dqd.base.shape == (b, h, -(-sq // block_m) * block_m, 128)
        assert dqd.base.dtype == torch.float32 and list(dqd.block_shape) == [1, 1, block_m, 64]
        assert dq.shape == q.shape and (dq == 0.5).all()  # 2.0 x the scale
    assert args["VARLEN"] is False
    # the atomic dQ's workspace rows permuted (hopper_bwd.dq_rows_permuted; _finish undoes it)
    assert args["DQ_ROWS"] is (not deterministic)


def test_noncausal_d128_runs_the_causal_build():
    """NONCAUSAL_AS_CAUSAL: bwd_args gives a plain non-causal call at padded head dim 128 with
    the atomic dQ the causal build and a band past its last key (so no key is masked and no
    query block skipped: the band's offset is at least every padded key index), and leaves
    everything else as it was: causal calls, d64, the deterministic path, the variants, and
    every call with the flag off (packed sequences too: the rule asks ``packed is None``;
    not timed with it)."""
    def args_for(d=128, causal=False, atomic=True, variants=None, sk=300):
        q = torch.empty(2, 8, 200, d, dtype=torch.bfloat16)
        kv = torch.empty(2, 2, sk, d, dtype=torch.bfloat16)
        stats = torch.empty(2, 8, 200)
        acc = torch.empty(2, 8, 256, 128 if d > 64 else 64)
        _, args, _ = hopper_bwd.bwd_args(q, kv, kv, q, kv, kv, stats, stats, acc, sk - 200,
                                         0.1, causal, atomic, variants=variants)  # fmt: skip
        return args["CAUSAL"], args["causal_offset"]

    assert args_for() == (True, 384) and args_for(d=96, sk=4097) == (True, 4224)
    # the key blocks' last padded index stays inside the band: (-(-sk // 128)) * 128 - 1
    assert args_for(causal=True) == (True, 100)
    assert args_for(d=64) == (False, 100) and args_for(atomic=False) == (False, 100)
    assert args_for(variants=dict(SOFTCAP=True, tanh_scale=0.1)) == (False, 100)
    before = hopper_bwd.NONCAUSAL_AS_CAUSAL
    try:
        hopper_bwd.NONCAUSAL_AS_CAUSAL = False
        assert args_for() == (False, 100)
    finally:
        hopper_bwd.NONCAUSAL_AS_CAUSAL = before


def test_causal_grid_runs_in_sections():
    """The grid's order (hopper_bwd.ORDER_L2_BYTES): a causal call's (batch, kv head) rows in
    sections whose Q, dO and atomic dQ workspace fit in that much L2, a power of 2 of rows;
    calls without the band row by row (section 1); the grid 1-D, a program per key block."""
    def args_for(causal=True, atomic=True, b=2, h=16, hk=4, s=4096, d=128):
        q = torch.empty(b, h, s, d, dtype=torch.bfloat16)
        kv = torch.empty(b, hk, s, d, dtype=torch.bfloat16)
        stats = torch.empty(b, h, s)
        acc = torch.empty(b, h, s, d)
        grid, args, _ = hopper_bwd.bwd_args(q, kv, kv, q, kv, kv, stats, stats, acc, 0, 0.1,
                                            causal, atomic)  # fmt: skip
        return grid, args["section"]

    # 4 query heads a row x 4096 rows x (Q + dO 512 bytes + dQ workspace 512): 16 MiB a row
    assert args_for() == ((32 * 8,), 2)
    assert args_for(atomic=False) == ((32 * 8,), 4)  # 8 MiB: 5 fit, rounded down to 4
    assert args_for(s=512) == ((4 * 8,), 8)  # all 8 rows (16 would fit)
    assert args_for(b=1, hk=1, h=64, s=16384) == ((128,), 1)  # one row is past 40 MiB
    assert args_for(causal=False) == ((32 * 8,), 1) and args_for(d=64, causal=False)[1] == 1
    assert hopper_bwd.section_rows(1000, 1, True) == 1000
    assert hopper_bwd.section_rows(1000, 2**20, False) == 1


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_d64_plain_attention_takes_128_row_steps(causal, monkeypatch):
    """hopper_bwd.default_config: plain attention at d64 (causal or not, GQA, sinks, packed
    sequences) runs 128 query rows per step with the atomic dQ split by rows (DQ_ATOMIC 4:
    each consumer adds a (64 rows, 64 columns) tile, so the workspace's blocks are 64 rows,
    the workspace padded to whole 128-row blocks); the variants' flags keep 64 rows (at 128
    ptxas spilled 100-1100 bytes with softcap, ALiBi or dropout; windows measured slower
    with the atomic dQ), and so do the other head dims. What the launch gets, captured (CPU
    tensors; nothing runs)."""
    b, h, hk, sq, sk, d = 2, 4, 2, 200, 300, 64
    q = torch.randn(b, h, sq, d, dtype=torch.bfloat16)
    k = torch.randn(b, hk, sk, d, dtype=torch.bfloat16)
    v, out, do = torch.randn_like(k), torch.randn_like(q), torch.randn_like(q)
    problem = _problem(b=b, h=h, hk=hk, sq=sq, sk=sk, d=d, scale=0.25, causal=causal)
    seen = {}

    def fake_launch(fn, grid, args, meta, num_warps, num_stages):
        seen.update(fn=fn, grid=grid, args=args)
        args["dq_desc"].base.fill_(2.0)

    monkeypatch.setattr(hopper_bwd, "launch", fake_launch)
    monkeypatch.setattr(hopper_bwd, "delta", lambda o4, do4, launched, res, acc: res.zero_())
    dq, _, _ = hopper_bwd.hopper_backward(do, q, k, v, out, torch.randn(b, h, sq), problem,
                                          atomic_dq=True)  # fmt: skip
    args = seen["args"]
    assert hopper_bwd.default_config(problem) == hopper_bwd.BWD_CONFIG_D64_ROWS128
    assert args["DQ_ATOMIC"] == 4 and seen["grid"] == (-(-sk // 128) * b * hk,)
    assert list(args["q_desc"].block_shape) == [1, 1, 128, 64]
    assert list(args["do_desc"].block_shape) == [1, 1, 128, 64]
    dqd = args["dq_desc"]
    assert dqd.base.shape == (b, h, 256, 64) and list(dqd.block_shape) == [1, 1, 64, 64]
    assert (dq == 0.5).all()  # 2.0 x the scale
    # sinks are in the LSE: the same kernel
    sinks = dataclasses.replace(problem, sinks=torch.zeros(h))
    assert hopper_bwd.default_config(sinks) == hopper_bwd.BWD_CONFIG_D64_ROWS128
    # ... and so do packed sequences (hopper_bwd.ROWS128_PACKED)
    packed = dataclasses.replace(problem, cu_seqlens_q=torch.zeros(3, dtype=torch.int32))
    assert hopper_bwd.default_config(packed) == hopper_bwd.BWD_CONFIG_D64_ROWS128
    for other in (dict(softcap=30.0), dict(alibi_slopes=torch.ones(h)), dict(dropout_p=0.1),
                  dict(window_left=100)):
        assert hopper_bwd.default_config(dataclasses.replace(problem, **other)) == (
            hopper_bwd.BWD_CONFIGS[64]), other
        assert hopper_bwd.default_config(dataclasses.replace(packed, **other)) == (
            hopper_bwd.BWD_CONFIGS[64]), other
    for dd in (96, 128, 256):
        assert hopper_bwd.default_config(_problem(d=dd, causal=causal)) == (
            hopper_bwd.BWD_CONFIGS[hopper_bwd.head_dim_pad(dd)])


@pytest.mark.parametrize("deterministic", [False, True], ids=["fast", "deterministic"])
def test_host_path_builds_the_packed_launch(deterministic, monkeypatch):
    """Packed sequences (CPU tensors, nothing runs): batch-of-one (1, heads, total, dim)
    descriptors, one program per (key block that holds keys, kv head) from the host's work
    list (kv_table), the lengths and dK / dV's (total, kv heads, dim) strides for the
    masked stores of a sequence's last block, LSE and delta as (heads, total_q), and the
    fast mode's fp32 dQ workspace (1, heads, total_q, padded dim) scaled into dQ's (total,
    heads, d)."""
    from diyfa.attention.checks import check_varlen_inputs

    h, hk, d, lens = 4, 2, 80, [100, 0, 260, 7]
    total = sum(lens)
    cu = torch.tensor([0, 100, 100, 360, 367], dtype=torch.int32)
    q = torch.randn(total, h, d, dtype=torch.bfloat16)
    k, v = torch.randn(total, hk, d, dtype=torch.bfloat16), torch.randn(total, hk, d,
                                                                         dtype=torch.bfloat16)
    p = check_varlen_inputs(q, k, v, cu, cu, 260, 260, causal=True, softmax_scale=0.5,
                            deterministic=deterministic)  # fmt: skip
    p = dataclasses.replace(p, capability=(9, 0), aligned16=True)
    assert hopper_bwd.supports(p) is None
    seen = {}

    def fake_launch(fn, grid, args, meta, num_warps, num_stages):
        seen.update(grid=grid, args=args)
        if args["DQ_ATOMIC"]:
            args["dq_desc"].base.fill_(2.0)

    def fake_dq(do_, q_, k_, v_, out_, lse2_, dq_, delta_, p_):
        seen["delta"] = delta_
        dq_.fill_(3.0)

    monkeypatch.setattr(hopper_bwd, "launch", fake_launch)
    monkeypatch.setattr(portable, "_dq_launch", fake_dq)
    monkeypatch.setattr(hopper_bwd, "delta",
                        lambda o4, do4, launched, res, acc: seen.update(delta=res) or res.zero_())
    lse2 = torch.randn(h, total)
    dq, dk, dv = hopper_bwd.hopper_backward(torch.randn_like(q), q, k, v, torch.randn_like(q),
                                            lse2, p)  # fmt: skip
    args = seen["args"]
    # One program per key block that holds keys (1 + 0 + 3 + 1 of 128) and kv head, a
    # sequence's blocks together (hopper_bwd.VARLEN_BY_SEQUENCE), sequences by their
    # heaviest block, heaviest first (causal: query blocks 5, 3, 2 to visit in sequence 2,
    # 1 in sequences 0 and 3); by weight alone: 2.0, 2.1, 0.0, 2.2, 3.0.
    assert seen["grid"] == (5, hk)
    # (sequence, block) pairs, then the sequences' first rows in the atomic dQ workspace,
    # each on a multiple of 8 (hopper_fwd.dq_rows)
    starts = [0, 104, 104, 368, 376]
    assert args["TILES"].tolist() == [2, 0, 2, 1, 2, 2, 0, 0, 3, 0] + starts
    monkeypatch.setattr(hopper_bwd, "VARLEN_BY_SEQUENCE", False)
    hopper_bwd.hopper_backward(torch.randn_like(q), q, k, v, torch.randn_like(q), lse2, p)
    assert seen["args"]["TILES"].tolist() == [2, 0, 2, 1, 0, 0, 2, 2, 3, 0] + starts
    assert args["VARLEN"] is True and args["CAUSAL"] is True
    # (the atomic dQ's rows permuted within groups of 8, as for batches)
    assert args["DQ_ROWS"] is (not deterministic)
    assert args["seqlen_q"] == 260 and args["seqlen_k"] == 260 and args["total_q"] == total
    assert args["CU_Q"] is p.cu_seqlens_q and args["CU_K"] is p.cu_seqlens_k
    assert list(args["q_desc"].shape) == [1, h, total, d]
    assert list(args["k_desc"].shape) == [1, hk, total, d]
    assert args["DK"] is dk and args["DV"] is dv and args["head_dim"] == d
    assert (args["stride_dks"], args["stride_dkh"]) == (hk * d, d)
    assert seen["delta"].shape == lse2.shape
    assert dq.shape == q.shape
    if deterministic:
        assert (dq == 3.0).all() and not args["DQ_ATOMIC"]
    else:
        assert args["dq_desc"].base.shape == (1, h, 376, 128)
        assert (dq == 1.0).all()  # 2.0 x the scale


def test_host_path_passes_the_variants(monkeypatch):
    """A window, softcap, ALiBi and sinks reach the kernel as the forward sets them
    (``hopper_fwd.variant_args``): the band's offsets, softcap * log2(e) as qk_scale with
    scale / softcap as tanh_scale (the softmax scale still scales dK), the slopes; the sinks
    stay out (they are in the LSE)."""
    b, h, hk, sq, sk, d = 1, 4, 2, 100, 120, 64
    g = torch.Generator().manual_seed(0)  # (the same inputs every run)
    q = torch.randn(b, h, sq, d, dtype=torch.bfloat16, generator=g)
    k = torch.randn(b, hk, sk, d, dtype=torch.bfloat16, generator=g)
    slopes = torch.rand(h, generator=g)
    problem = dataclasses.replace(_problem(b=b, h=h, hk=hk, sq=sq, sk=sk, d=d, scale=0.5),
                                  causal=True, window_left=30, softcap=20.0,
                                  alibi_slopes=slopes, sinks=torch.zeros(h))  # fmt: skip
    seen = {}
    monkeypatch.setattr(hopper_bwd, "launch", lambda fn, grid, args, *a: seen.update(args))
    monkeypatch.setattr(hopper_bwd, "delta", lambda o4, do4, launched, res, acc: res.zero_())
    do = torch.randn(q.shape, dtype=q.dtype, generator=g)
    out = torch.randn(q.shape, dtype=q.dtype, generator=g)
    hopper_bwd.hopper_backward(do, q, k, k.clone(), out, torch.randn(b, h, sq, generator=g),
                               problem)  # fmt: skip
    assert seen["CAUSAL"] and seen["WINDOW"] and seen["SOFTCAP"] and seen["ALIBI"]
    assert seen["causal_offset"] == sk - sq and seen["left_offset"] == sk - sq - 30
    assert seen["qk_scale"] == pytest.approx(20.0 * hopper_bwd.LOG2E)
    assert seen["tanh_scale"] == pytest.approx(0.5 / 20.0) and seen["sm_scale"] == 0.5
    assert seen["SLOPES"] is slopes and seen["alibi_offset"] == sk - sq
    assert "SINKS" not in seen and "SINK_LOGITS" not in seen


# --------------------------------------------------------------------------------------------
# GPU: gradients through the Hopper backward
# --------------------------------------------------------------------------------------------
BWD_SHAPES = [
    (2, 8, 8, 1024, 1024, 64), (1, 16, 4, 1023, 4097, 128), (2, 8, 1, 4097, 1000, 96),
    (4, 8, 2, 113, 1023, 72), (1, 8, 8, 1000, 1000, 80), (2, 6, 2, 333, 77, 128),
    (1, 4, 4, 1, 500, 64), (1, 4, 2, 777, 3, 128), (3, 2, 1, 65, 129, 64),
]


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["fast", "deterministic"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", BWD_SHAPES, ids=lambda s: "b{}h{}hk{}q{}k{}d{}".format(*s))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gpu_hopper_bwd_matrix(shape, dtype, causal, deterministic, monkeypatch):
    _hopper_only(monkeypatch)
    b, h, hk, sq, sk, d = shape
    _run_and_check(*_inputs(b, h, hk, sq, sk, d, dtype, device="cuda"), causal,
                   deterministic=deterministic)  # fmt: skip


# Head dims above 128 (hopper_bwd256's kernel, computed as 256): odd lengths both ways, GQA
# and MQA, one query row, keys fewer than a block, d136/d160/d192 padded.
BWD_SHAPES_WIDE = [
    (2, 8, 2, 1024, 1024, 256), (1, 4, 4, 1023, 2049, 256), (2, 4, 1, 333, 77, 192),
    (1, 8, 2, 777, 3, 160), (3, 2, 1, 65, 129, 256), (1, 4, 4, 1, 500, 256),
    (2, 2, 2, 2049, 1000, 136), (1, 2, 1, 4096, 4096, 256),
]


@pytest.mark.gpu
@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", BWD_SHAPES_WIDE,
                         ids=lambda s: "b{}h{}hk{}q{}k{}d{}".format(*s))  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gpu_hopper_bwd_wide_heads(shape, dtype, causal, atomic, monkeypatch):
    """Head dims 136..256 through the d256 kernel (checked to have launched), with its
    atomic dQ (not the default there: WIDE_DQ_ATOMIC) and in the deterministic path."""
    from diyfa._launcher import ReplayCache
    from diyfa.attention import hopper_bwd256

    monkeypatch.setattr(hopper_bwd, "WIDE_DQ_ATOMIC", atomic)
    monkeypatch.setattr(hopper_bwd, "_REPLAYS", ReplayCache())  # every call launches
    ran = []
    launch = hopper_bwd.launch
    monkeypatch.setattr(hopper_bwd, "launch", lambda fn, *a: ran.append(fn) or launch(fn, *a))
    b, h, hk, sq, sk, d = shape
    _run_and_check(*_inputs(b, h, hk, sq, sk, d, dtype, device="cuda"), causal,
                   backend="hopper", deterministic=not atomic)  # fmt: skip
    assert ran and set(ran) == {hopper_bwd256._attn_bwd_d256}  # (prefetch may compile it too)


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["fast", "deterministic"])
def test_gpu_hopper_bwd_16k_bshd_and_rows_without_keys(deterministic, monkeypatch):
    _hopper_only(monkeypatch)
    _run_and_check(*_inputs(1, 2, 1, 16384, 16384, 128, torch.bfloat16, device="cuda"), True,
                   deterministic=deterministic)  # fmt: skip
    _run_and_check(*_inputs(2, 8, 2, 999, 1537, 128, torch.bfloat16, layout="bshd",
                            device="cuda"), True, layout="bshd", scale=0.3,
                   deterministic=deterministic)  # fmt: skip
    q, k, v = _inputs(1, 2, 2, 300, 100, 64, torch.bfloat16, device="cuda")  # 200 rows see none
    _run_and_check(q, k, v, True, deterministic=deterministic)


@pytest.mark.gpu
def test_gpu_hopper_bwd_sum_gradient_and_packed_views(monkeypatch):
    """``out.sum().backward()`` hands a stride-0 dO (copied for TMA); slices of a packed QKV
    tensor take the descriptors' strides."""
    _hopper_only(monkeypatch)
    g = torch.Generator(device="cpu").manual_seed(1)
    qkv = torch.randn(2, 1000, 3, 8, 128, generator=g).to("cuda", torch.bfloat16)
    q, k, v = (qkv[:, :, i].detach().requires_grad_() for i in range(3))
    _run_and_check(q, k, v, False, layout="bshd")
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    diyfa.flash_attention(q2, k2, v2, layout="bshd", backend="hopper").sum().backward()
    ref = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    diyfa.flash_attention(*ref, layout="bshd", backend="portable").sum().backward()
    for ours, theirs in zip((q2, k2, v2), ref, strict=True):
        assert (ours.grad.float() - theirs.grad.float()).abs().max().item() < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("deterministic", [False, True], ids=["fast", "deterministic"])
def test_gpu_hopper_bwd_causal_grid_in_sections(d, deterministic, monkeypatch):
    """Sections of 2 of 5 (batch, kv head) rows (the last holds one; ORDER_L2_BYTES sizes
    them, forced here), GQA, causal bottom-right with more keys than queries: every key
    block of every row runs once, so every gradient matches."""
    from diyfa._launcher import ReplayCache

    _hopper_only(monkeypatch)
    monkeypatch.setattr(hopper_bwd, "_REPLAYS", ReplayCache())  # every call launches
    sections = []
    monkeypatch.setattr(hopper_bwd, "section_rows",
                        lambda rows, row_bytes, causal: sections.append(rows) or 2)
    _run_and_check(*_inputs(5, 4, 1, 333, 517, d, torch.bfloat16, device="cuda"), True,
                   backend="hopper", deterministic=deterministic)  # fmt: skip
    assert sections and set(sections) == {5}


@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_hopper_bwd_deterministic_is_bitwise(causal, d):
    """deterministic=True: every gradient bitwise-equal over repeated runs (GQA, 4k)."""
    q, k, v = _inputs(2, 16, 4, 4096, 4096, d, torch.bfloat16, device="cuda")
    do = torch.randn_like(q)
    grads = []
    for _ in range(3):
        out = diyfa.flash_attention(q, k, v, causal=causal, backend="hopper", deterministic=True)
        grads.append(torch.autograd.grad(out, (q, k, v), do))
    for run in grads[1:]:
        for a, b in zip(grads[0], run, strict=True):
            assert torch.equal(a, b)


def test_tma_ready_refuses_broadcast_and_odd_strides():
    """TMA takes a view only with a contiguous last dim, 16-byte strides and no broadcast
    (stride-0) axis; anything else (e.g. dO expanded over the batch) is copied first."""
    base = torch.empty(1, 2, 8, 64, dtype=torch.bfloat16)
    assert hopper_bwd.tma_ready(base)
    assert not hopper_bwd.tma_ready(base.expand(3, 2, 8, 64))  # batch stride 0
    assert hopper_bwd.tma_ready(base.expand(1, 2, 8, 64))  # size-1 axis: its stride is unused
    assert not hopper_bwd.tma_ready(torch.empty(1, 2, 8, 65, dtype=torch.bfloat16)[..., :64])
    assert not hopper_bwd.tma_ready(base.transpose(2, 3))


def test_auto_mode_by_head_dim_band_and_keys(monkeypatch):
    """What "auto" runs for the backward: the atomic dQ at head dims 72..128 (split by
    columns between the consumers: measured faster than the deterministic path at every
    shape) and at d64 with the causal band, and without it from ATOMIC_D64_KEYS keys, the
    portable backward below (equal GPU time, lighter host path); the deterministic path
    (portable dQ kernel + Gluon dK/dV) whenever asked for, and for packed sequences at
    72..128."""
    monkeypatch.delenv("DIYFA_HOPPER_BWD", raising=False)
    keys = hopper_bwd.ATOMIC_D64_KEYS

    def mode(d, causal, sk, **kw):
        p = dataclasses.replace(_problem(b=4, h=8, hk=8, sq=sk, sk=sk, d=d, scale=0.125),
                                causal=causal, **kw)  # fmt: skip
        return hopper_bwd.auto_mode(p)

    assert mode(64, False, keys // 2) is None and mode(64, False, keys) == "atomic"
    assert mode(64, True, keys // 2) == "atomic"
    assert mode(128, False, keys // 2) == "atomic" and mode(128, True, keys) == "atomic"
    assert mode(96, True, keys // 4) == "atomic"
    assert mode(128, False, keys, deterministic=True) == "kernel-dq"
    assert mode(64, False, keys, deterministic=True) == "kernel-dq"
    assert mode(64, False, keys // 2, deterministic=True) is None


def test_short_d64_calls_by_work(monkeypatch):
    """d64 below 2048 keys: small calls (the seed shape, b4 h8 x 1k) run the Hopper forward
    and the portable backward, with the causal band the portable kernels for both; from
    SHORT_WORK_D64 scores (b16 h32 x 1k) the Hopper family takes them, its backward with
    the atomic dQ (measured faster there)."""
    from diyfa.attention import hopper_fwd

    monkeypatch.delenv("DIYFA_HOPPER_BWD", raising=False)
    small = _problem(b=4, h=8, hk=8, sq=1024, sk=1024, d=64)
    big = _problem(b=16, h=32, hk=32, sq=1024, sk=1024, d=64)
    assert 4 * 8 * 1024 * 1024 < hopper_fwd.SHORT_WORK_D64 <= 16 * 32 * 1024 * 1024
    assert dispatch.select(small).name == "hopper" and hopper_bwd.auto_mode(small) is None
    assert dispatch.select(dataclasses.replace(small, causal=True)).name == "portable"
    assert dispatch.select(big).name == "hopper"
    assert hopper_bwd.auto_mode(big) == "atomic"
    assert hopper_bwd.auto_mode(dataclasses.replace(big, causal=True)) == "atomic"


@pytest.mark.parametrize("seqlen_q", [1, 7, 8, 13, 64, 130])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_finish_puts_the_permuted_rows_back(seqlen_q, layout):
    """The atomic dQ workspace holds row 8a + 4b + c of each group of 8 at 8a + 2c + b
    (hopper_bwd.dq_rows_permuted; the kernel permutes its registers before the shared-memory
    store): _finish scales, casts and un-permutes it into dQ (a partial last group too), in
    either layout; unpermuted, it takes the rows as they are."""
    b, h, d, dpad = 2, 3, 40, 64
    rows = -(-seqlen_q // 64) * 64
    g = torch.Generator().manual_seed(seqlen_q)
    true = torch.randn(b, h, rows, dpad, generator=g)
    r = torch.arange(rows)
    ws = torch.empty_like(true)
    ws[:, :, r // 8 * 8 + r % 4 * 2 + r % 8 // 4] = true
    shape = (b, h, seqlen_q, d) if layout == "bhsd" else (b, seqlen_q, h, d)
    dq = torch.empty(shape, dtype=torch.bfloat16)
    got = hopper_bwd.bhsd_view(dq, layout)
    hopper_bwd._finish(got, ws, 0.5, permuted=True)
    assert torch.equal(got, (true[:, :, :seqlen_q, :d] * 0.5).to(torch.bfloat16))
    dq.fill_(float("nan"))  # (nothing left from the call before)
    hopper_bwd._finish(got, true, 0.5, permuted=False)  # the plain order: rows as they are
    assert torch.equal(got, (true[:, :, :seqlen_q, :d] * 0.5).to(torch.bfloat16))


def test_finish_puts_packed_sequences_rows_back():
    """Packed sequences' atomic dQ workspace (hopper_fwd.dq_rows): each sequence's rows from a
    multiple of 8, permuted within groups of 8 from there; _finish puts every sequence's rows
    back at its cu_seqlens rows of the packed dQ (empty sequences, partial groups), scaled
    and cast, and leaves the padding rows unread."""
    from diyfa.attention.hopper_fwd import dq_rows

    h, d, dpad, lens = 3, 40, 64, [13, 0, 8, 70, 1]
    cu = torch.tensor([0, 13, 13, 21, 91, 92], dtype=torch.int32)
    starts, rows = dq_rows(tuple(cu.tolist()))
    assert starts.tolist() == [0, 16, 16, 24, 96, 104] and rows == 104
    g = torch.Generator().manual_seed(0)
    true = torch.randn(1, h, sum(lens), dpad, generator=g)
    ws = torch.full((1, h, rows, dpad), float("nan"))
    for s, n in enumerate(lens):
        r = torch.arange(n)
        ws[:, :, starts[s] + r // 8 * 8 + r % 4 * 2 + r % 8 // 4] = true[:, :, cu[s] + r]
    table = torch.tensor([7, 7] + starts.tolist(), dtype=torch.int32)  # (one pair, then starts)
    dq = torch.empty(sum(lens), h, d, dtype=torch.bfloat16)
    got = dq.unsqueeze(0).transpose(1, 2)
    hopper_bwd._finish(got, ws, 0.5, permuted=True, packed=(cu, table, len(lens), max(lens)))
    assert torch.equal(got, (true[..., :d] * 0.5).to(torch.bfloat16))
