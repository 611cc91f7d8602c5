"""Attention variants (issue 14) on the portable kernels: sliding windows, softcap, ALiBi and
attention sinks.

Every case against the float64 reference (diyfa.reference.attention_ref with the same window
and softcap) by the 2x / 3x rule: forward and every gradient, with 16 x 16 blocks pinned so
that short sequences still span many blocks (the band's skipped, masked and unmasked
ranges all occur). Plus: blocks outside the band are never read, packed sequences, bad
values, where the Hopper family stands, and the custom op under opcheck.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import pytest
import torch

import diyfa
from diyfa import tuning
from diyfa.attention import dispatch, hopper_bwd
from diyfa.reference import attention_ref

from .conftest import DEVICE
from .test_attention import _check, _inputs
from .test_hopper_attention import _problem, _spy_launches


@contextlib.contextmanager
def _small_blocks():
    with (tuning.pinned("attn_fwd", BLOCK_M=16, BLOCK_N=16),
          tuning.pinned("attn_bwd_dq", BLOCK_M=16, BLOCK_N=16),
          tuning.pinned("attn_bwd_dkdv", BLOCK_M=16, BLOCK_N=16)):  # fmt: skip
        yield


def _ref_window(window_size, causal):
    left, right = window_size
    if (left, right) == (-1, -1):
        return None
    return (left, 0 if causal else right)


def _run_and_check(q, k, v, causal, window_size, softcap, layout="bhsd", alibi_slopes=None,
                   sinks=None, backend="auto", deterministic=False):
    """diyfa against float64 (forward, dq, dk, dv, and the sinks' gradient) by the 2x / 3x
    rule, PyTorch in the input dtype as the yardstick."""
    dtype = q.dtype
    with _small_blocks():
        out = diyfa.flash_attention(q, k, v, causal=causal, window_size=window_size,
                                    softcap=softcap, layout=layout, alibi_slopes=alibi_slopes,
                                    sinks=sinks, backend=backend,
                                    deterministic=deterministic)  # fmt: skip
        do = torch.randn_like(out)
        out.backward(do)
    kw = dict(causal=causal, window=_ref_window(window_size, causal), softcap=softcap,
              layout=layout, alibi_slopes=alibi_slopes)  # fmt: skip
    ins = [q, k, v] + ([sinks] if sinks is not None else [])
    ref_in = [t.detach().double().requires_grad_() for t in ins]
    pt_in = [t.detach().clone().requires_grad_() for t in ins]
    ref = attention_ref(*ref_in[:3], compute_dtype=torch.float64, sinks=(
        ref_in[3] if sinks is not None else None), **kw)  # fmt: skip
    pt = attention_ref(*pt_in[:3], compute_dtype=dtype, sinks=(
        pt_in[3] if sinks is not None else None), **kw)  # fmt: skip
    _check("out", out, pt, ref, 2, dtype)
    ref.backward(do.double())
    pt.backward(do)
    names = ("dq", "dk", "dv", "dsinks")[: len(ins)]
    for name, t, p, r in zip(names, ins, pt_in, ref_in, strict=True):
        _check(name, t.grad, p.grad, r.grad, 3, dtype)


CASES = [
    # (b, h, hk, sq, sk, d, dtype, causal, window_size, softcap, layout)
    (1, 2, 1, 150, 150, 32, torch.bfloat16, True, (40, 0), 0.0, "bhsd"),
    (1, 2, 2, 97, 160, 64, torch.float16, False, (17, 9), 0.0, "bhsd"),
    (2, 2, 1, 130, 61, 40, torch.float32, True, (30, 0), 3.0, "bshd"),
    (1, 2, 2, 64, 200, 16, torch.bfloat16, False, (50, -1), 0.0, "bhsd"),
    (1, 2, 2, 200, 64, 16, torch.float32, False, (-1, 7), 0.0, "bhsd"),
    (1, 4, 2, 120, 120, 32, torch.float16, True, (-1, -1), 20.0, "bhsd"),
    # A band of 3 keys (a band of 1, window (0, 0), makes dS exactly 0 in exact arithmetic,
    # which PyTorch's fp32 reaches bitwise and the 3x rule would then demand of any order).
    (1, 2, 2, 100, 100, 32, torch.float32, False, (1, 1), 0.0, "bhsd"),
    (1, 2, 1, 90, 140, 24, torch.bfloat16, True, (5, -1), 1.0, "bshd"),
    (1, 2, 2, 180, 40, 16, torch.float32, True, (10, 0), 0.0, "bhsd"),  # rows that see no key
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}h{}hk{}q{}k{}d{}-{}-c{}-w{}-cap{}-{}"
                         .format(*c[:6], str(c[6]).removeprefix("torch."), int(c[7]),
                                 f"{c[8][0]}_{c[8][1]}", c[9], c[10]))  # fmt: skip
def test_window_and_softcap(case):
    b, h, hk, sq, sk, d, dtype, causal, window_size, softcap, layout = case
    q, k, v = _inputs(b, h, hk, sq, sk, d, dtype, layout=layout)
    _run_and_check(q, k, v, causal, window_size, softcap, layout)


BIAS_CASES = [
    # (b, h, hk, sq, sk, d, dtype, causal, window_size, softcap, alibi shape, sinks, layout)
    (1, 4, 2, 77, 100, 32, torch.float32, False, (-1, -1), 0.0, "heads", False, "bhsd"),
    (2, 4, 2, 90, 60, 32, torch.bfloat16, True, (20, 0), 3.0, "batch", False, "bshd"),
    (1, 4, 4, 70, 70, 16, torch.float16, True, (-1, -1), 0.0, None, True, "bhsd"),
    (1, 4, 2, 100, 50, 16, torch.float32, True, (10, 0), 0.0, "heads", True, "bhsd"),
    (1, 2, 1, 64, 128, 64, torch.bfloat16, False, (-1, -1), 0.0, None, True, "bshd"),
]


@pytest.mark.parametrize("case", BIAS_CASES, ids=lambda c: "{}-c{}-w{}_{}-cap{}-alibi_{}-sinks{}-{}"
                         .format(str(c[6]).removeprefix("torch."), int(c[7]), *c[8], c[9],
                                 c[10], int(c[11]), c[12]))  # fmt: skip
def test_alibi_and_sinks(case):
    """ALiBi ((heads,) and (batch, heads) slopes) and attention sinks, alone and with windows,
    softcap, GQA and rows that see no key (their output is 0, the sink still in the LSE):
    forward, every input's gradient and the sinks' gradient by the 2x / 3x rule."""
    _run_bias_case(case, seed=7)


def _run_bias_case(case, seed, backend="auto", deterministic=False):
    """A BIAS_CASES-shaped case: its inputs, ALiBi slopes and sinks, through _run_and_check."""
    b, h, hk, sq, sk, d, dtype, causal, window_size, softcap, alibi, sinks, layout = case
    q, k, v = _inputs(b, h, hk, sq, sk, d, dtype, layout=layout)
    g = torch.Generator().manual_seed(seed)
    slopes = None
    if alibi is not None:
        slopes = (torch.rand((h,) if alibi == "heads" else (b, h), generator=g) * 0.5).to(DEVICE)
    sink = torch.randn(h, generator=g).to(DEVICE, dtype).requires_grad_() if sinks else None
    _run_and_check(q, k, v, causal, window_size, softcap, layout, slopes, sink, backend,
                   deterministic)  # fmt: skip


def _fresh_rows(script: str) -> list[dict]:
    """Run a compile-only ``script`` in a fresh Python (kernels run under the interpreter
    leave Triton patched: see test_hopper_attention) and return the JSON rows it printed
    last."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_blocks_outside_the_band_are_not_read():
    """NaN in V's first 16 keys: with causal and a 31-key window, the query blocks from row 48
    on have a band starting at key 17 or later, so the kernel must skip that block (reading
    it would put 0 * NaN into P @ V). Those rows are finite and equal the reference."""
    q, k, v = (t.detach() for t in _inputs(1, 2, 2, 256, 256, 32, torch.float32))
    v[:, :, :16] = float("nan")
    with _small_blocks():
        out = diyfa.flash_attention(q, k, v, causal=True, window_size=(31, 0))
    # (Those keys are outside every checked row's window: any finite value gives the same.)
    ref = attention_ref(q.double(), k.double(), v.nan_to_num(0.0).double(), causal=True,
                        window=(31, 0))  # fmt: skip
    tail = out[:, :, 48:]
    assert torch.isfinite(tail).all()
    assert (tail.double() - ref[:, :, 48:]).abs().max().item() < 1e-5


def test_sinks_without_keys():
    """seqlen_k = 0 with sinks: the output is 0, the LSE is the sink (the only term of the
    denominator) and the sinks' gradient is 0, not NaN; packed sequences too."""
    q = torch.randn(1, 2, 5, 16, device=DEVICE, requires_grad=True)
    k = torch.randn(1, 2, 0, 16, device=DEVICE, requires_grad=True)
    sinks = torch.tensor([0.5, -1.0], device=DEVICE, requires_grad=True)
    out, lse = diyfa.flash_attention(q, k, k, sinks=sinks, return_lse=True)
    assert (out == 0).all()
    assert torch.allclose(lse, sinks.detach()[None, :, None].expand(1, 2, 5))
    out.sum().backward()
    assert torch.equal(sinks.grad, torch.zeros(2, device=DEVICE))
    qp = torch.randn(5, 2, 16, device=DEVICE)
    kp = torch.randn(0, 2, 16, device=DEVICE)
    cu_q = torch.tensor([0, 5], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 0], dtype=torch.int32, device=DEVICE)
    outp, lsep = diyfa.flash_attention_varlen(qp, kp, kp, cu_q, cu_k, 5, 0, sinks=sinks,
                                              return_lse=True)  # fmt: skip
    assert (outp == 0).all() and torch.allclose(lsep, sinks.detach()[:, None].expand(2, 5))


@pytest.mark.parametrize("layout", ["bhsd", "bshd", "packed"])
def test_sinks_gradient_takes_the_backwards_delta(layout, monkeypatch):
    """With sinks the backward hands the families an fp32 ``delta_out`` shaped like the LSE,
    which they fill with rowsum(dO * O) (the delta their kernels compute anyway), and the
    sinks' gradient takes it from there instead of reading dO and O again: what it gets is
    that row sum, in the LSE's layout (packed: (heads, total)), zero for rows that see no
    key (sq > sk, causal), and the gradient is the one computed from dO and O."""
    from diyfa.attention import portable

    seen = []
    real = portable.sink_grad

    def spy(lse2, delta, sinks):
        seen.append(delta)
        return real(lse2, delta, sinks)

    monkeypatch.setattr(portable, "sink_grad", spy)
    g = torch.Generator().manual_seed(5)
    h, hk, d = 4, 2, 32
    sinks = torch.randn(h, generator=g).to(DEVICE).requires_grad_()
    if layout == "packed":
        lens_q, lens_k = [7, 0, 40], [3, 5, 33]
        q = torch.randn(sum(lens_q), h, d, generator=g)
        k, v = (torch.randn(sum(lens_k), hk, d, generator=g) for _ in range(2))
        q, k, v = (t.to(DEVICE).requires_grad_() for t in (q, k, v))
        cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32,
                                   device=DEVICE) for n in (lens_q, lens_k))  # fmt: skip
        out = diyfa.flash_attention_varlen(q, k, v, cu_q, cu_k, 40, 33, causal=True,
                                           sinks=sinks)  # fmt: skip
    else:
        shape = (lambda s, n: (1, n, s, d)) if layout == "bhsd" else (lambda s, n: (1, s, n, d))
        q = torch.randn(shape(50, h), generator=g)
        k, v = (torch.randn(shape(37, hk), generator=g) for _ in range(2))
        q, k, v = (t.to(DEVICE).requires_grad_() for t in (q, k, v))
        out = diyfa.flash_attention(q, k, v, causal=True, layout=layout, sinks=sinks)
    do = torch.randn(out.shape, generator=g).to(DEVICE)
    out.backward(do)
    (delta,) = seen
    rows = (do.double() * out.detach().double()).sum(-1)
    rows = rows.transpose(0, 1) if layout == "packed" else (
        rows.transpose(1, 2) if layout == "bshd" else rows)  # fmt: skip
    assert delta is not None and delta.dtype == torch.float32 and delta.shape == rows.shape
    assert torch.allclose(delta.double(), rows, rtol=1e-4, atol=1e-5)
    if layout != "packed":  # rows 0..12 see no key: O = 0, delta 0
        assert (delta[:, :, :13] == 0).all()
    lse = (diyfa.flash_attention_varlen(q, k, v, cu_q, cu_k, 40, 33, causal=True, sinks=sinks,
                                        return_lse=True)[1] if layout == "packed" else
           diyfa.flash_attention(q, k, v, causal=True, layout=layout, sinks=sinks,
                                 return_lse=True)[1])  # fmt: skip
    sink2 = sinks.detach().double() * 1.4426950408889634
    sink2 = sink2[:, None] if layout == "packed" else sink2[None, :, None]
    lse2 = lse.detach().double() * 1.4426950408889634
    expect = -(torch.exp2(sink2 - lse2) * rows).sum((1,) if layout == "packed" else (0, 2))
    assert torch.allclose(sinks.grad.double(), expect, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("packed", [False, True], ids=["bhs", "packed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sink_grad_kernel_sums_every_row(packed, dtype):
    """``portable.sink_grad`` (one program per head) sums 2^(sink log2 e - lse2) * delta over
    every row of its head, across batches and blocks of 1024 rows (a tail too), against the
    same sum in float64, and returns the sinks' dtype."""
    from diyfa.attention import portable

    g = torch.Generator().manual_seed(11)
    shape = (4, 2500) if packed else (3, 4, 2500)
    lse2 = (torch.randn(shape, generator=g) * 3 + 4).to(DEVICE)
    delta = torch.randn(shape, generator=g).to(DEVICE)
    sinks = torch.randn(4, generator=g).to(DEVICE, dtype)
    got = portable.sink_grad(lse2, delta, sinks)
    sink2 = sinks.double() * 1.4426950408889634
    terms = torch.exp2((sink2[:, None] if packed else sink2[None, :, None]) - lse2.double())
    want = -(terms * delta.double()).sum((1,) if packed else (0, 2))
    assert got.dtype == dtype and got.shape == (4,)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), want.to(dtype).double(), rtol=tol, atol=tol)


def test_hopper_windows_wider_than_the_sequences_are_dropped():
    """Window sides at least seqlen_q + seqlen_k never bind: the Hopper forward drops them
    (its offsets stay int32), and a narrower side is kept with the portable conventions."""
    from diyfa.attention.hopper_fwd import variant_args

    p = _problem()  # sq 300, sk 257, not causal
    upper, _, causal, variants = variant_args(dataclasses.replace(p, window_left=2**40,
                                                                  window_right=2**33))
    assert not causal and "WINDOW" not in variants and upper == p.causal_offset
    upper, _, causal, variants = variant_args(dataclasses.replace(p, window_left=50,
                                                                  window_right=7))
    assert causal and upper == p.causal_offset + 7
    assert variants["WINDOW"] and variants["left_offset"] == p.causal_offset - 50


def test_varlen_variants():
    """Packed sequences: the band and the ALiBi bias are per sequence (bottom-right within
    each, (batch, heads) slopes by sequence), forward and gradients per sequence against the
    reference, the sinks' gradient summed over all of them."""
    lens_q, lens_k = [37, 0, 80], [50, 10, 80]
    h, hk, d, dtype = 2, 1, 32, torch.float32
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lens_q), h, d, generator=g, dtype=dtype).to(DEVICE).requires_grad_()
    k = torch.randn(sum(lens_k), hk, d, generator=g, dtype=dtype).to(DEVICE).requires_grad_()
    v = torch.randn(sum(lens_k), hk, d, generator=g, dtype=dtype).to(DEVICE).requires_grad_()

    def cu(lens):
        return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,
                            device=DEVICE)  # fmt: skip

    slopes = torch.tensor([[0.3, 0.1], [0.2, 0.05], [0.4, 0.25]], device=DEVICE)  # per sequence
    sinks = torch.tensor([0.5, -1.0], device=DEVICE, requires_grad=True)
    with _small_blocks():
        out = diyfa.flash_attention_varlen(q, k, v, cu(lens_q), cu(lens_k), max(lens_q),
                                           max(lens_k), causal=True, window_size=(12, 0),
                                           softcap=4.0, alibi_slopes=slopes,
                                           sinks=sinks)  # fmt: skip
        out.backward(torch.ones_like(out))
    sinks_ref = sinks.detach().double().requires_grad_()
    qs, ks = 0, 0
    for i, (lq, lk) in enumerate(zip(lens_q, lens_k, strict=True)):
        ins = [t.detach()[s:s + n].double().transpose(0, 1).unsqueeze(0).requires_grad_()
               for t, s, n in ((q, qs, lq), (k, ks, lk), (v, ks, lk))]  # fmt: skip
        if lq:
            ref = attention_ref(*ins, causal=True, window=(12, 0), softcap=4.0,
                                alibi_slopes=slopes[i].double(), sinks=sinks_ref)
            ref.sum().backward()
            got = out[qs:qs + lq].transpose(0, 1).unsqueeze(0)
            assert (got.double() - ref).abs().max().item() < 1e-5
            for t, s, n, r in ((q, qs, lq, ins[0]), (k, ks, lk, ins[1]), (v, ks, lk, ins[2])):
                grad = t.grad[s:s + n].transpose(0, 1).unsqueeze(0).double()
                assert (grad - r.grad).abs().max().item() < 1e-5
        qs, ks = qs + lq, ks + lk
    assert (sinks.grad.double() - sinks_ref.grad).abs().max().item() < 1e-5


@pytest.mark.parametrize("kwargs, err, match", [
    (dict(alibi_slopes=torch.ones(2, dtype=torch.float16, device=DEVICE)), TypeError,
     r"alibi_slopes.dtype is torch.float16; accepted: float32"),
    (dict(alibi_slopes=torch.ones(3, device=DEVICE)), ValueError,
     r"alibi_slopes must have shape \(2,\) or \(1, 2\) \(heads=2, batch=1\), got \(3,\)"),
    (dict(alibi_slopes=torch.ones(4, device=DEVICE)[::2]), ValueError,
     r"alibi_slopes must be contiguous"),
    (dict(sinks=torch.ones(2, 1, device=DEVICE)), ValueError, r"sinks must have shape \(2,\)"),
    (dict(sinks=torch.ones(2, dtype=torch.int32, device=DEVICE)), TypeError,
     r"sinks.dtype is torch.int32"),
    (dict(sinks=[0.0, 1.0]), TypeError, r"sinks must be a torch.Tensor or None, got list"),
    (dict(window_size=(-2, 0)), ValueError, r"window_size sides must be >= 0 or -1.*\(-2, 0\)"),
    (dict(window_size=(3,)), TypeError, r"window_size must be a \(left, right\) pair"),
    (dict(window_size=(1.5, 0)), TypeError, r"pair of ints, got \(1.5, 0\)"),
    (dict(window_size=(4, 3), causal=True), ValueError, r"looks 3 keys ahead.*causal=True"),
    (dict(softcap=-1.0), ValueError, r"softcap must be a finite number >= 0.*-1.0"),
    (dict(softcap=float("inf")), ValueError, r"softcap must be a finite number >= 0.*inf"),
    (dict(softcap=float("nan")), ValueError, r"softcap must be a finite number >= 0.*nan"),
    (dict(softcap=True), TypeError, r"softcap must be a number, got True"),
], ids=["alibi-fp16", "alibi-shape", "alibi-strided", "sinks-shape", "sinks-int", "sinks-list",
        "left-2", "one-side", "float", "causal-ahead", "cap-neg", "cap-inf", "cap-nan",
        "cap-bool"])
def test_bad_values(kwargs, err, match):
    q, k, v = _inputs(1, 2, 2, 8, 8, 16, torch.float32)
    with pytest.raises(err, match=match):
        diyfa.flash_attention(q, k, v, **kwargs)


@pytest.mark.parametrize("replace", [
    dict(window_left=100), dict(window_right=3), dict(softcap=30.0),
    dict(alibi_slopes=torch.ones(4)), dict(sinks=torch.ones(4)),
], ids=["left", "right", "softcap", "alibi", "sinks"])
def test_hopper_family_takes_variants(replace):
    """The Hopper forward runs windows, softcap, ALiBi and sinks, by name and under "auto"
    (measured faster than the portable kernel on an H200); the Gluon backward takes them
    too, and "auto" runs it where it measured faster: every variant with the atomic dQ at
    d64..128 (ALiBi too since 2026-11-25, the d64 variants since they measured faster so
    after the 128-row steps), with plain attention's head-dim rule."""
    problem = dataclasses.replace(_problem(), **replace)
    assert dispatch.select(problem).name == "hopper"
    assert dict(dispatch.explain(problem))["hopper"] is None
    assert dispatch.select(problem, "hopper").name == "hopper"
    assert hopper_bwd.supports(problem) is None
    assert hopper_bwd.auto_mode(problem) == "atomic"
    assert hopper_bwd.auto_mode(dataclasses.replace(problem, deterministic=True)) == "kernel-dq"
    d64 = dataclasses.replace(_problem(d=64), **replace)
    assert hopper_bwd.auto_mode(d64) is None  # short and non-causal: portable
    assert hopper_bwd.auto_mode(dataclasses.replace(d64, causal=True)) == "atomic"
    assert hopper_bwd.auto_mode(dataclasses.replace(d64, causal=True, deterministic=True)) == (
        "kernel-dq")
    causal = dataclasses.replace(_problem(causal=True), window_right=0)
    assert dispatch.select(causal).name == "hopper"  # causal alone is not a window
    with pytest.raises(ValueError, match="cannot run this problem"):
        dispatch.select(dataclasses.replace(problem, value_dim=20), "hopper")
    # dropout joins any of them (its own flag; 2026-11-25)
    assert dispatch.select(dataclasses.replace(problem, dropout_p=0.1), "hopper").name == "hopper"


_COMPILE_HOPPER_VARIANTS = """
import json, torch
from diyfa._compile import spill_bytes
from diyfa.attention import hopper_fwd as hf
out = []
for d in (64, 128, 256):
    for causal in (False, True):
        k = hf.compile_for_hopper(d, torch.bfloat16, causal,
                                  variants=("WINDOW", "SOFTCAP", "ALIBI", "SINKS"))
        packed = hf.compile_for_hopper(d, torch.bfloat16, causal, packed=True)
        if d > 64:  # a smaller value head dim (MLA's 192 / 128 at d256's padding)
            vd = hf.compile_for_hopper(d, torch.bfloat16, causal, value_dim=d // 2)
            assert vd.metadata.shared <= 227 * 1024
        # O by TMA for a consumer's rows that all lie in the sequence (masked stores else)
        assert "cp.async.bulk.tensor.4d.global.shared" in packed.asm["ptx"]
        if d == 128 and not causal:  # VARLEN_O_TMA off: masked stores only
            hf.VARLEN_O_TMA = False
            masked = hf.compile_for_hopper(d, torch.bfloat16, causal, **{"packed": True})
            hf.VARLEN_O_TMA = True
            assert "cp.async.bulk.tensor.4d.global.shared" not in masked.asm["ptx"]
        out.append({"d": d, "causal": causal, "shared": k.metadata.shared,
                    "spilled": spill_bytes(k),
                    "tanh": k.asm["ptx"].count("tanh.approx.f32")})
print(json.dumps(out))
"""


def test_hopper_kernel_compiles_the_variants():
    """With every variant flag on (window, softcap, ALiBi, sinks), the Hopper forward compiles
    for sm90a at head dims 64/128/256, causal or not, fits the shared memory, spills at
    most a few scalars outside the K/V loop (ptxas, 2026-11-23: 0-48 bytes; 88 at d256
    causal with all four flags since the causal tiles are handed out by a counter,
    2026-11-24: the SASS has its STL/LDL at the program's start and per tile, none between
    the loop's wgmmas), and runs the hardware's tanh (the softcap) where the plain kernel
    has none; its packed-sequence build compiles and stores O by TMA where a consumer's rows
    all lie in the sequence (with VARLEN_O_TMA off, by masked stores only: a tile's rows
    past its sequence belong to the next one).
    In a fresh process (see test_hopper_attention)."""
    rows = _fresh_rows(_COMPILE_HOPPER_VARIANTS)
    plain = _fresh_rows(_COMPILE_HOPPER_VARIANTS.replace(
        'variants=("WINDOW", "SOFTCAP", "ALIBI", "SINKS")', "variants=()").replace(
        "packed=True", "packed=False"))  # fmt: skip
    for r, r0 in zip(rows, plain, strict=True):
        where = f"d{r['d']} causal={r['causal']}"
        assert r["shared"] <= 227 * 1024, where
        assert r["spilled"] <= 96, where
        assert r["tanh"] > 0 and r0["tanh"] == 0, where


HOPPER_VARIANT_CASES = [
    # (b, h, hk, sq, sk, d, dtype, causal, window_size, softcap, alibi, sinks, layout)
    (2, 4, 2, 300, 257, 128, torch.bfloat16, True, (100, 0), 0.0, None, False, "bhsd"),
    (1, 4, 4, 513, 700, 64, torch.float16, False, (64, 32), 0.0, None, False, "bshd"),
    (1, 4, 1, 1000, 1000, 128, torch.bfloat16, True, (-1, -1), 30.0, None, False, "bhsd"),
    (2, 8, 2, 333, 1024, 96, torch.bfloat16, True, (-1, -1), 0.0, "heads", False, "bhsd"),
    (1, 4, 2, 256, 200, 128, torch.float16, False, (-1, -1), 0.0, "batch", True, "bshd"),
    (1, 4, 4, 777, 777, 256, torch.bfloat16, True, (255, 0), 5.0, "heads", True, "bhsd"),
    (1, 2, 2, 200, 1500, 64, torch.bfloat16, False, (50, -1), 0.0, None, True, "bhsd"),
    (1, 2, 2, 1500, 100, 128, torch.bfloat16, True, (10, 0), 0.0, None, False, "bhsd"),
    (1, 8, 4, 1000, 1000, 256, torch.bfloat16, True, (300, 0), 50.0, None, False, "bshd"),
    (2, 4, 2, 333, 500, 192, torch.float16, False, (100, 50), 0.0, "batch", True, "bhsd"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", HOPPER_VARIANT_CASES,
                         ids=lambda c: "d{}-c{}-w{}_{}-cap{}-alibi_{}-sinks{}".format(
                             c[5], int(c[7]), *c[8], c[9], c[10], int(c[11])))  # fmt: skip
def test_gpu_hopper_forward_variants(case):
    """The Hopper forward's windows (left, left + right, causal + left; rows that see no
    key), softcap, ALiBi ((heads,) and (batch, heads)) and sinks against float64 by the 2x /
    3x rule, gradients through the portable backward from its LSE; GQA, seqlen_q != seqlen_k,
    head dims 64..256."""
    _run_bias_case(case, seed=11, backend="hopper")


# (non-causal without a window: the static round robin, whose tiles may be chained)
PERSISTENT_VARIANT_CASES = [c for c in HOPPER_VARIANT_CASES if c[5] <= 128] + [
    (1, 4, 2, 1000, 777, 128, torch.bfloat16, False, (-1, -1), 30.0, None, False, "bhsd"),
    (2, 4, 2, 700, 900, 64, torch.float16, False, (-1, -1), 0.0, "heads", True, "bshd"),
]


# (case, chain): unchained too only where it differs, the static round robin (neither causal
# nor windowed: hopper_args chains no other call)
_PERSISTENT_VARIANT_RUNS = [(c, 1) for c in PERSISTENT_VARIANT_CASES] + [
    (c, 0) for c in PERSISTENT_VARIANT_CASES if not c[7] and c[8] == (-1, -1)]


@pytest.mark.gpu
@pytest.mark.parametrize(("case", "chain"), _PERSISTENT_VARIANT_RUNS,
                         ids=["d{}-c{}-w{}_{}-cap{}-alibi_{}-sinks{}-chain{}".format(
                             c[5], int(c[7]), *c[8], c[9], c[10], int(c[11]), ch)
                             for c, ch in _PERSISTENT_VARIANT_RUNS])  # fmt: skip
def test_gpu_hopper_forward_variants_persistent(case, chain, monkeypatch):
    """The same cases (and two more without the causal band) with three SMs' worth of
    persistent programs, so that each program runs many tiles and carries each one's state
    (the window's first block, ALiBi's slope pieces, the sinks, softcap's fixed max) to the
    next, with tiles chained (Config.chain: a tile's first block run with the one before's
    last; static round robin only) and not."""
    from diyfa._launcher import ReplayCache
    from diyfa.attention import hopper_fwd as hf

    d = hf.head_dim_pad(case[5])
    monkeypatch.setattr(hf, "kernel_limits", lambda _i: {"sm_count": 3})
    monkeypatch.setattr(hf, "_REPLAYS", ReplayCache())  # (launches kept with 132 programs)
    monkeypatch.setitem(hf.HOPPER_CONFIGS, d, hf.HOPPER_CONFIGS[d]._replace(chain=chain))
    _run_bias_case(case, seed=11, backend="hopper")


def _alibi_slopes(h: int) -> list[float]:
    """ALiBi's standard slopes for h heads: 2^(-8 i / h), i = 1..h (the first the steepest)."""
    return [2.0 ** (-8.0 * i / h) for i in range(1, h + 1)]


FROZEN_VARIANT_CASES = [
    # (b, h, hk, sq, sk, d, causal, window_size, alibi, sinks, layout[, dtype: bf16])
    (2, 8, 2, 700, 2000, 128, True, (-1, -1), "heads", False, "bhsd"),
    (1, 8, 8, 1500, 1100, 64, False, (-1, -1), "batch", False, "bshd"),  # diagonals before keys
    (2, 4, 2, 900, 1300, 128, False, (-1, -1), "heads", True, "bhsd"),
    (1, 4, 4, 600, 3000, 64, True, (-1, -1), None, True, "bshd"),
    (1, 8, 1, 1000, 1000, 96, True, (-1, -1), "heads", True, "bhsd"),
    (2, 4, 2, 1000, 1200, 128, True, (300, 0), None, False, "bhsd"),
    (1, 4, 4, 700, 900, 64, False, (100, 40), None, True, "bshd"),  # (gpt-oss: sinks, window)
    (1, 4, 2, 500, 1500, 128, False, (200, -1), "heads", False, "bhsd"),
    (1, 4, 4, 1300, 600, 128, True, (130, 0), None, True, "bhsd"),  # rows that see no key
    (1, 4, 4, 1300, 600, 128, True, (130, 0), None, False, "bhsd"),  # ... and no sink
    (1, 4, 2, 900, 500, 64, True, (-1, -1), "heads", False, "bshd"),  # ALiBi, the same
    (2, 4, 2, 700, 2100, 128, True, (-1, -1), None, True, "bshd", torch.float16),
    (1, 4, 4, 1000, 1000, 64, False, (-1, -1), None, True, "bhsd", torch.float16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", FROZEN_VARIANT_CASES,
                         ids=lambda c: "b{}h{}hk{}q{}k{}d{}-c{}-w{}_{}-alibi_{}-sinks{}{}".format(
                             *c[:6], int(c[6]), *c[7], c[8], int(c[9]),
                             "-fp16" if len(c) > 11 else ""))  # fmt: skip
def test_gpu_hopper_frozen_max_with_alibi_and_sinks(case, monkeypatch):
    """hopper_fwd.FROZEN_VARIANTS: inference without the LSE runs bf16 ALiBi, windows and
    sinks (fp16 sinks too) under the frozen max, out against float64 by the 2x rule.
    ALiBi's standard slopes (the steepest 2^-1 at 8 heads) on random data need no second
    run (the flag stays 0): the first block's max is moved to the row's nearest key (without
    that move a causal row far from its first block passes it by its smaller bias and is
    flagged); so do windows whose rows' first visible key lies past their tile's first
    block. A call that returns its LSE runs the running max."""
    from diyfa.attention import hopper_fwd as hf

    calls = _spy_launches(monkeypatch)
    b, h, hk, sq, sk, d, causal, window, alibi, sinks, layout = case[:11]
    dtype = case[11] if len(case) > 11 else torch.bfloat16  # (fp16: sinks only)
    q, k, v = (t.detach() for t in _inputs(b, h, hk, sq, sk, d, dtype, layout=layout, seed=3))
    slopes = None
    if alibi is not None:
        slopes = torch.tensor(_alibi_slopes(h), device=DEVICE)
        if alibi == "batch":  # (each sequence its own order of the slopes)
            slopes = torch.stack([slopes.roll(i) for i in range(b)])
    sink = (torch.randn(h, generator=torch.Generator().manual_seed(5)).to(DEVICE, dtype)
            if sinks else None)  # fmt: skip
    kw = dict(causal=causal, layout=layout, alibi_slopes=slopes, sinks=sink)
    with torch.no_grad():
        out = diyfa.flash_attention(q, k, v, backend="hopper", window_size=window, **kw)
    assert len(calls) == 1 and calls[0]["ORDER"] & hf.ORDER_FROZEN.value
    assert calls[0]["COUNTER"][1].item() == 0  # (no row flagged: no second run)
    kw["window"] = _ref_window(window, causal)
    ref = attention_ref(q.double(), k.double(), v.double(), compute_dtype=torch.float64,
                        **dict(kw, sinks=None if sink is None else sink.double()))
    pt = attention_ref(q, k, v, compute_dtype=dtype, **kw)
    _check("out", out, pt, ref, 2, dtype)
    calls.clear()
    out_lse, _ = diyfa.flash_attention(q, k, v, backend="hopper", return_lse=True,
                                       window_size=window,
                                       **{n: w for n, w in kw.items() if n != "window"})
    assert len(calls) == 1 and not calls[0]["ORDER"] & hf.ORDER_FROZEN.value
    _check("out (running max)", out_lse, pt, ref, 2, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_hopper_frozen_window_redoes_rows_far_below_their_first_block(d, monkeypatch):
    """A (200, 0) window under the frozen max when key 5 scores ~300 nats above every other:
    the tile of rows 256..383 starts at block 0 (row 256's window starts at key 56), and its
    rows from 328 on see none of that block, so they take their max from the block's keys
    left of their window (WIDE_MAX), key 5's among them: their own keys lie far below it,
    their sums come out below seqlen_k x 2^-114 (or 0), the tile flags them (LOW_SUMS) and
    the second launch redoes the call. Out against float64 by the 2x rule."""
    from diyfa.attention import hopper_fwd as hf

    calls = _spy_launches(monkeypatch)
    q, k, v = _one_key_far_ahead(d)
    with torch.no_grad():
        out = diyfa.flash_attention(q, k, v, causal=True, window_size=(200, 0), backend="hopper")
    assert len(calls) == 1 and calls[0]["ORDER"] & hf.ORDER_FROZEN.value
    assert calls[0]["COUNTER"][1].item() == 1  # (flagged: the second launch ran)
    ref = attention_ref(q.double(), k.double(), v.double(), causal=True, window=(200, 0),
                        compute_dtype=torch.float64)  # fmt: skip
    pt = attention_ref(q, k, v, causal=True, window=(200, 0), compute_dtype=torch.bfloat16)
    _check("out", out, pt, ref, 2, torch.bfloat16)


def _one_key_far_ahead(d: int, jump: float = 300.0, every_key: bool = False) -> tuple:
    """bf16 (1, 2, 1000, d) q, k, v on the GPU whose key 5 scores about ``jump`` nats above
    every other key for every query (q and k_5 share a direction; the rest is noise);
    ``every_key``: every key scores about ``jump`` nats (negative: below 0)."""
    g = torch.Generator(device="cpu").manual_seed(d)
    b, h, s = 1, 2, 1000
    u = torch.randn(d, generator=g)
    u /= u.norm()
    alpha = (abs(jump) * d**0.5) ** 0.5  # (q . k_5 / sqrt(d) = jump)
    q = 0.3 * torch.randn(b, h, s, d, generator=g) + alpha * u
    k = 0.3 * torch.randn(b, h, s, d, generator=g)
    if every_key:
        k += math.copysign(alpha, jump) * u
    else:
        k[:, :, 5] += alpha * u
    v = torch.randn(b, h, s, d, generator=g)
    return tuple(t.to(DEVICE, torch.bfloat16) for t in (q, k, v))


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_hopper_frozen_window_rows_past_their_first_block_take_their_own_max(d,
                                                                                monkeypatch):
    """Every score about -150 nats (-216 base 2) with a (300, 0) window under the frozen
    max: a tile's rows whose window starts past its first block see none of that block, and
    take their max from its keys left of their window (``_softmax_step``'s WIDE_MAX), so
    their probabilities stay near 2^-64 and no row is flagged (flag 0). With a max of 0 for
    them, their probabilities (2^-216) flush to 0 and the call is redone. Out against
    float64 by the 2x rule."""
    from diyfa.attention import hopper_fwd as hf

    calls = _spy_launches(monkeypatch)
    q, k, v = _one_key_far_ahead(d, jump=-150.0, every_key=True)
    with torch.no_grad():
        out = diyfa.flash_attention(q, k, v, causal=True, window_size=(300, 0), backend="hopper")
    assert len(calls) == 1 and calls[0]["ORDER"] & hf.ORDER_FROZEN.value
    assert calls[0]["COUNTER"][1].item() == 0  # (no row flagged: no second run)
    ref = attention_ref(q.double(), k.double(), v.double(), causal=True, window=(300, 0),
                        compute_dtype=torch.float64)  # fmt: skip
    pt = attention_ref(q, k, v, causal=True, window=(300, 0), compute_dtype=torch.bfloat16)
    _check("out", out, pt, ref, 2, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_hopper_frozen_alibi_redoes_rows_far_below_their_first_block(d, monkeypatch):
    """ALiBi under the frozen max when the first block holds a key scoring ~300 nats above
    every other: with a steep slope the rows far from it take their max from keys near
    their diagonal, far below the first block's (moved) max, so their probabilities
    underflow and their sums come out below seqlen_k x 2^-114 (or 0); the tile flags them
    (``_flag_rows``' LOW_SUMS) and the call's second launch redoes it with the running max.
    Out against float64 by the 2x rule (without the flag those rows came out 0 / 0)."""
    from diyfa.attention import hopper_fwd as hf

    calls = _spy_launches(monkeypatch)
    q, k, v = _one_key_far_ahead(d)
    slopes = torch.tensor([0.5, 0.0625], device=DEVICE)
    with torch.no_grad():
        out = diyfa.flash_attention(q, k, v, causal=True, alibi_slopes=slopes, backend="hopper")
    assert len(calls) == 1 and calls[0]["ORDER"] & hf.ORDER_FROZEN.value
    assert calls[0]["COUNTER"][1].item() == 1  # (flagged: the second launch ran)
    ref = attention_ref(q.double(), k.double(), v.double(), causal=True, alibi_slopes=slopes,
                        compute_dtype=torch.float64)  # fmt: skip
    pt = attention_ref(q, k, v, causal=True, alibi_slopes=slopes, compute_dtype=torch.bfloat16)
    _check("out", out, pt, ref, 2, torch.bfloat16)


def test_softcap_fixed_max_rule():
    """Which softcap calls the Hopper forward runs with a fixed max (``SOFTCAP == 2``): bf16
    with softcap * log2(e) <= SOFTCAP_FIXED_MAX_LIMIT (the probabilities' range, 2^(64 - 2R)
    .. 2^64, inside bf16's and fp32's normal numbers), at padded head dims of 128 and more
    (d64 measured slower with it), without ALiBi or sinks (their terms are not bounded by
    the cap) or dropout (its row sums cannot add P's rounded operand); fp16, d64 and the
    backward keep the running max / the flag as it was."""
    from diyfa.attention import hopper_fwd as hf

    base = dataclasses.replace(_problem(causal=True), softcap=30.0)
    assert base.dtype == torch.bfloat16
    assert hf.variant_args(base)[3]["SOFTCAP"] == 2
    assert hf.variant_args(base, backward=True)[3]["SOFTCAP"] is True
    # only where no one reads the LSE: a call that returns or keeps it runs the running max
    variants = hf.variant_args(base)[3]
    assert hf.lse_read_variants(variants, lse_read=False) is variants
    assert hf.lse_read_variants(variants, lse_read=True)["SOFTCAP"] is True
    assert variants["SOFTCAP"] == 2  # (not changed in place)
    limit = hf.SOFTCAP_FIXED_MAX_LIMIT / hf.LOG2E
    assert hf.softcap_fixed_max(dataclasses.replace(base, softcap=limit * 0.999))
    slopes = torch.ones(base.heads)
    assert base.head_dim == 128 and hf.softcap_fixed_max(dataclasses.replace(base, head_dim=72))
    for other in (dict(softcap=limit * 1.001), dict(dtype=torch.float16),
                  dict(alibi_slopes=slopes), dict(sinks=slopes), dict(head_dim=64),
                  dict(dropout_p=0.1)):
        p = dataclasses.replace(base, **other)
        assert not hf.softcap_fixed_max(p), other
        assert hf.variant_args(p)[3]["SOFTCAP"] is True, other
    assert "SOFTCAP" not in hf.variant_args(dataclasses.replace(base, softcap=0.0))[3]


def test_alibi_flag_rule():
    """Which ALiBi form each kernel runs (``hopper_fwd.alibi_flag``): the forward at d64 /
    d128 adds the column term by the tensor cores (3) for bf16 without softcap; fp16 (its
    pieces of slope / scale overflow past 65504), fp8 (K = 32 products), softcap (the tanh
    comes first) and the backward take the split with FMAs (2), the causal backward on
    every tile (4); other head dims the distances (1). variant_args passes the problem's
    own."""
    from diyfa.attention import hopper_fwd as hf

    flag = hf.alibi_flag
    assert flag(128) == 3 and flag(64) == 3 and flag(256) == 1
    assert flag(128, dtype=torch.float16) == 2 and flag(128, dtype=torch.float8_e4m3fn) == 2
    assert flag(128, softcap=True) == 2 and flag(128, backward=True) == 2
    assert flag(128, backward=True, causal=True) == 4 and flag(128, causal=True) == 3
    assert flag(64, backward=True) == 1 and flag(64, backward=True, causal=True) == 4
    assert flag(256, backward=True, causal=True) == 1
    problem = dataclasses.replace(_problem(causal=True), alibi_slopes=torch.ones(4))
    assert hf.variant_args(problem)[3]["ALIBI"] == 3
    assert hf.variant_args(dataclasses.replace(problem, softcap=5.0))[3]["ALIBI"] == 2
    assert hf.variant_args(dataclasses.replace(problem, dtype=torch.float16))[3]["ALIBI"] == 2
    assert hf.variant_args(problem, backward=True)[3]["ALIBI"] == 4
    full = dataclasses.replace(problem, causal=False)
    assert hf.variant_args(full, backward=True)[3]["ALIBI"] == 2


_COMPILE_SOFTCAP = """
import json, torch
from diyfa._compile import spill_bytes
from diyfa.attention import hopper_fwd as hf
out = []
for d, dtype in ((128, torch.bfloat16), (256, torch.bfloat16), (128, torch.float16),
                 (64, torch.bfloat16)):
    k = hf.compile_for_hopper(d, dtype, True, variants=("SOFTCAP",))
    out.append({"d": d, "fixed": dtype == torch.bfloat16 and d >= 128,
                "spilled": spill_bytes(k),
                "max": k.asm["ptx"].count("max.f32"), "tanh": k.asm["ptx"].count("tanh.approx")})
print(json.dumps(out))
"""


def test_hopper_kernel_compiles_softcap_fixed_max():
    """The softcap build with the fixed max (bf16, d128 and d256) has no row max left in its
    PTX (no max.f32 at all); the fp16 and d64 ones keep it; all run the hardware tanh and
    spill at most a few scalars (ptxas, 2026-11-25: 0 bytes at d128, 28 at d256 causal).
    In a fresh process (see test_hopper_attention)."""
    rows = _fresh_rows(_COMPILE_SOFTCAP)
    for r in rows:
        assert r["tanh"] > 0 and r["spilled"] <= 96, r
        assert (r["max"] == 0) == r["fixed"], r


_COMPILE_ALIBI = """
import json, torch
from diyfa._compile import spill_bytes
from diyfa.attention import hopper_fwd as hf
out = []
for d, cfg in ((64, None), (128, None), (64, hf.HOPPER_CONFIGS_LONG[64])):
    for variants in (("ALIBI",), ()):
        k = hf.compile_for_hopper(d, torch.bfloat16, True, config=cfg, variants=variants)
        out.append({"d": d, "three": cfg is not None, "alibi": bool(variants),
                    "spilled": spill_bytes(k), "shared": k.metadata.shared,
                    "wgmma": k.asm["ptx"].count("wgmma.mma_async")})
print(json.dumps(out))
"""


def test_hopper_kernel_compiles_alibi_by_the_tensor_cores():
    """ALiBi's forward at d64 / d128 (ALIBI 3): the column term comes with S from one more
    K = 16 product per S (two issue sites per consumer: that many more wgmma in the PTX than
    the plain build), its operands fit the shared memory, and ptxas spills nothing with two
    consumers and at most 192 bytes with three (2026-11-25: 172 causal, where the split with
    FMAs spilled 132 and the plain build 84; the three-consumer build measured faster all
    the same, docs/attention.md). In a fresh process (see test_hopper_attention)."""
    rows = _fresh_rows(_COMPILE_ALIBI)
    for alibi, plain in zip(rows[0::2], rows[1::2], strict=True):
        assert alibi["alibi"] and not plain["alibi"] and alibi["d"] == plain["d"]
        # (the PTX holds each consumer's copy of the loop: two issue sites per consumer)
        assert alibi["wgmma"] == plain["wgmma"] + 2 * (3 if alibi["three"] else 2), alibi
        assert alibi["shared"] <= 227 * 1024, alibi
        assert alibi["spilled"] <= (192 if alibi["three"] else 0), alibi


_COMPILE_FROZEN_VARIANTS = """
import json, torch
from diyfa._compile import spill_bytes
from diyfa.attention import hopper_fwd as hf
hf.FROZEN_MIN_PAIRS = 0  # (compile_for_hopper's 2 x 16 x 4096 rows: too few pairs)
hf.FROZEN_MIN_KEYS = ((64, 0), (128, 0))  # (its windows span 1001 keys)
out = []
for d, causal, variants in ((64, True, ("ALIBI",)), (128, True, ("ALIBI",)),
                            (128, False, ("ALIBI", "SINKS")), (128, True, ("SINKS",)),
                            (128, True, ("WINDOW", "SINKS")), (128, True, ("WINDOW", "ALIBI"))):
    for hf.FROZEN_MAX in (True, False):
        k = hf.compile_for_hopper(d, torch.bfloat16, causal, variants=variants)
        out.append({"d": d, "causal": causal, "variants": variants, "frozen": hf.FROZEN_MAX,
                    "spilled": spill_bytes(k), "shared": k.metadata.shared,
                    "max": k.asm["ptx"].count("max.f32")})
print(json.dumps(out))
"""


def test_hopper_kernel_compiles_frozen_variants():
    """ALiBi, windows and sinks under the frozen max (FROZEN_VARIANTS): the builds compile
    for sm90a, fit the shared memory, and have a row max only in each tile's first block
    (fewer max.f32 than the running max's build; windows take two there, WIDE_MAX). ptxas
    spills up to 352 bytes (2026-11-26: d128 ALiBi 172 causal, 280 without the band, 352
    with sinks too, 252 with a window: the rounded row sums' registers beside ALiBi's; 14-16
    STL and LDL a block in one consumer's K/V loop of d128 causal; windows and sinks 24-60,
    none in the loop), and they measured faster all the same (hopper_fwd.FROZEN_VARIANTS).
    A bound, so that more shows up here. In a fresh process (see test_hopper_attention)."""
    rows = _fresh_rows(_COMPILE_FROZEN_VARIANTS)
    for frozen, running in zip(rows[0::2], rows[1::2], strict=True):
        where = f"d{frozen['d']} causal={frozen['causal']} {frozen['variants']}"
        assert frozen["frozen"] and not running["frozen"], where
        assert frozen["shared"] <= 227 * 1024, where
        assert frozen["max"] < running["max"], (where, frozen["max"], running["max"])
        assert frozen["spilled"] <= 360, (where, frozen["spilled"])


_COMPILE_ALIBI_BWD = """
import json, torch
from diyfa._compile import spill_bytes
from diyfa.attention import hopper_bwd as hb
out = []
for causal in (False, True):
    for atomic in (False, True):
        k = hb.compile_bwd_for_hopper(128, causal=causal, dq_atomic=atomic, variants=("ALIBI",))
        ptx = k.asm["ptx"]
        out.append({"causal": causal, "atomic": atomic, "spilled": spill_bytes(k),
                    "abs": ptx.count("abs.f32") + ptx.count("abs.ftz.f32"),
                    "ex2": ptx.count("ex2.approx")})
print(json.dumps(out))
"""


def test_hopper_backward_compiles_alibi_without_distances_when_causal():
    """ALiBi in the Gluon backward at d128: a causal call (ALIBI 4) has no distance (no
    abs in the PTX, and one exponential per score as the plain build: 64 ex2 over the two
    consumers' loops), a non-causal one keeps the distances for the diagonal's tiles (a
    second copy of the exponentials); ptxas spills at most 128 bytes in either dQ mode
    (2026-11-25: 104 / 108 causal, 96 / 40 not, where the split with distances on every
    diagonal tile spilled 344 / 148 causal and 216 / 64 not). In a fresh process (see
    test_hopper_attention)."""
    rows = _fresh_rows(_COMPILE_ALIBI_BWD)
    for r in rows:
        assert r["spilled"] <= 128, r
        if r["causal"]:
            assert r["abs"] == 0 and r["ex2"] == 64, r
        else:
            assert r["abs"] > 0 and r["ex2"] == 128, r


@pytest.mark.gpu
@pytest.mark.parametrize("softcap, dtype, d", [
    (30.0, torch.bfloat16, 128), (63.0, torch.bfloat16, 96), (50.0, torch.bfloat16, 256),
    (80.0, torch.bfloat16, 128), (30.0, torch.float16, 128),
], ids=["cap30", "cap63-d96", "cap50-d256", "cap80-running-max", "fp16-running-max"])
def test_gpu_hopper_softcap_fixed_max(softcap, dtype, d):
    """Softcap's fixed max at the edges of its range: rows whose every score lies far below
    -softcap (each p at the bottom of the range, 2^(64 - 2R)), rows far above +softcap (the
    top, 2^64), ordinary rows and rows that see no key (causal, seqlen_q > seqlen_k). The
    fixed max runs where no one reads the LSE (inference): out against float64 by the 2x
    rule. With the LSE returned, and with gradients (the backward reads it), the running
    max: out and LSE against float64, the gradients too. softcap 80 and fp16 take the
    running max throughout: the same checks."""
    torch.manual_seed(5)
    b, h, hk, sq, sk = 1, 4, 2, 700, 600
    direction = torch.ones(d, device="cuda") / d**0.5
    k = 10.0 * direction + 0.3 * torch.randn(b, hk, sk, d, device="cuda")
    q = torch.randn(b, h, sq, d, device="cuda")
    # scores of about -/+ lam * 100 * scale (scale = d^-0.5): -/+ 3 softcap
    lam = 3 * softcap * d**0.5 / 100
    q[:, :, 0::3] = -lam * 10.0 * direction + 0.3 * q[:, :, 0::3]
    q[:, :, 1::3] = lam * 10.0 * direction + 0.3 * q[:, :, 1::3]
    v = torch.randn(b, hk, sk, d, device="cuda")
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    out, lse = diyfa.flash_attention(q, k, v, causal=True, softcap=softcap, backend="hopper",
                                     return_lse=True)  # fmt: skip
    ref, ref_lse = attention_ref(*(t.detach().double() for t in (q, k, v)), causal=True,
                                 softcap=softcap, compute_dtype=torch.float64,
                                 return_lse=True)  # fmt: skip
    with torch.no_grad():  # (no LSE read: the fixed max where it applies)
        inference = diyfa.flash_attention(q, k, v, causal=True, softcap=softcap,
                                          backend="hopper")  # fmt: skip
        pt = attention_ref(q, k, v, causal=True, softcap=softcap, compute_dtype=dtype)
    err = (inference.double() - ref).abs().max().item()
    pt_err = (pt.double() - ref).abs().max().item()
    assert torch.isfinite(inference).all() and err <= 2 * pt_err, (err, pt_err)
    assert torch.isfinite(out).all()
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen) and not seen[:, :, :100].any()
    lse_err = (lse[seen].double() - ref_lse[seen]).abs().max().item()
    assert lse_err <= 1e-3 * ref_lse[seen].abs().max().item() + 1e-4, lse_err
    _run_and_check(q.detach().requires_grad_(), k.detach().requires_grad_(),
                   v.detach().requires_grad_(), True, (-1, -1), softcap,
                   backend="hopper")  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic-dq", "kernel-dq"])
@pytest.mark.parametrize("case", HOPPER_VARIANT_CASES,
                         ids=lambda c: "d{}-c{}-w{}_{}-cap{}-alibi_{}-sinks{}".format(
                             c[5], int(c[7]), *c[8], c[9], c[10], int(c[11])))  # fmt: skip
def test_gpu_hopper_backward_variants(case, deterministic, monkeypatch):
    """The Gluon backward's windows, softcap and ALiBi (sinks: through the LSE) in both dQ
    modes, after the Hopper forward, against float64 by the 3x rule: the same cases (above
    d128 the d256 kernel, its atomic dQ switched on for the atomic-dq runs)."""
    from diyfa.attention import hopper_bwd

    monkeypatch.setattr(hopper_bwd, "WIDE_DQ_ATOMIC", True)
    _run_bias_case(case, seed=12, backend="hopper", deterministic=deterministic)


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic-dq", "kernel-dq"])
@pytest.mark.parametrize("sq, sk, d, dtype", [
    (300, 1000, 128, torch.bfloat16), (1000, 300, 128, torch.bfloat16),
    (777, 777, 96, torch.float16), (64, 64, 128, torch.bfloat16),
    (700, 900, 64, torch.bfloat16), (513, 400, 64, torch.float16),
], ids=["short-q", "rows-without-keys", "d96-fp16", "one-block", "d64",
        "d64-fp16-rows-without-keys"])
def test_gpu_hopper_alibi_causal_backward(sq, sk, d, dtype, deterministic):
    """The causal backward's ALiBi on every tile as a key term and a query term (ALIBI 4,
    the diagonal's tiles too: the keys right of a query's diagonal take the wrong sign there
    and are masked after the exponential): steep slopes (up to 2, so those scores overflow
    to inf before the mask), queries that see no key, GQA; gradients against float64 by the
    3x rule, both dQ modes."""
    from diyfa.attention import hopper_fwd

    problem = dataclasses.replace(_problem(causal=True, d=d), alibi_slopes=torch.ones(4))
    assert hopper_fwd.variant_args(problem, backward=True)[3]["ALIBI"] == 4
    q, k, v = _inputs(2, 4, 2, sq, sk, d, dtype)
    slopes = torch.tensor([2.0, 0.7, 0.05, 0.0], device=DEVICE)
    _run_and_check(q, k, v, True, (-1, -1), 0.0, "bhsd", slopes, None, "hopper",
                   deterministic)  # fmt: skip


def test_custom_op_carries_the_variants():
    """The custom ops take the window and softcap (torch.compile path): opcheck, and the
    op's result equals the eager call's."""
    q, k, v = (t.detach() for t in _inputs(1, 2, 1, 40, 56, 16, torch.float32))
    args = (q, k, v, True, "bottom_right", None, "bhsd", "auto", False, 9, 0, 2.5, None, None)
    torch.library.opcheck(torch.ops.diyfa.attention_fwd.default, args)
    out, _ = torch.ops.diyfa.attention_fwd(*args)
    eager = diyfa.flash_attention(q, k, v, causal=True, window_size=(9, 0), softcap=2.5)
    assert torch.equal(out, eager)


def test_compiled_alibi_and_sinks_match_eager():
    """Under torch.compile (the custom ops): ALiBi and sinks reach the kernels, opcheck
    passes with both, and the outputs and every gradient (the sinks' too) equal eager's."""
    q, k, v = (t.detach() for t in _inputs(1, 4, 2, 33, 40, 16, torch.float32))
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], device=DEVICE)
    sinks = torch.tensor([0.3, -0.2, 1.0, 0.0], device=DEVICE)
    args = (q, k, v, True, "bottom_right", None, "bhsd", "auto", False, -1, 0, 0.0, slopes,
            sinks)  # fmt: skip
    torch.library.opcheck(torch.ops.diyfa.attention_fwd.default, args)

    def f(q, k, v, sinks):
        return diyfa.flash_attention(q, k, v, causal=True, alibi_slopes=slopes,
                                     sinks=sinks).square().sum()  # fmt: skip

    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    torch.compile(f, fullgraph=True, backend="aot_eager")(*leaves).backward()
    eager = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    f(*eager).backward()
    for a, b in zip(leaves, eager, strict=True):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("shape, dtype, causal, layout", [
    ((1, 2, 1, 40, 56, 192, 128), torch.bfloat16, True, "bhsd"),  # DeepSeek MLA's 192 / 128
    ((2, 4, 2, 33, 47, 64, 32), torch.float16, False, "bshd"),
    ((1, 2, 2, 30, 30, 32, 80), torch.float32, True, "bhsd"),  # a wider value
], ids=["d192-dv128", "d64-dv32", "d32-dv80"])
def test_value_head_dim(shape, dtype, causal, layout):
    """v's head dim differs from q's and k's: output (and dO, dV) have v's; forward and every
    gradient by the 2x / 3x rule."""
    b, h, hk, sq, sk, d, dv = shape
    q, k, _ = _inputs(b, h, hk, sq, sk, d, dtype, layout=layout)
    _, _, v = _inputs(b, h, hk, sq, sk, dv, dtype, layout=layout, seed=1)
    _run_and_check(q, k, v, causal, (-1, -1), 0.0, layout)
    assert diyfa.flash_attention(q, k, v, causal=causal, layout=layout).shape[-1] == dv


@pytest.mark.gpu
@pytest.mark.parametrize("shape, dtype, causal, layout", [
    ((2, 8, 2, 1000, 1000, 192, 128), torch.bfloat16, True, "bshd"),  # DeepSeek MLA
    ((1, 4, 4, 333, 700, 128, 64), torch.float16, False, "bhsd"),
    ((1, 4, 1, 513, 257, 96, 64), torch.bfloat16, True, "bhsd"),
    ((1, 2, 2, 200, 200, 256, 128), torch.bfloat16, False, "bshd"),
    ((2, 4, 2, 777, 333, 160, 96), torch.float16, True, "bhsd"),
], ids=["d192-dv128", "d128-dv64", "d96-dv64", "d256-dv128", "d160-dv96"])
@pytest.mark.parametrize("atomic", [False, True], ids=["det", "atomic"])
def test_gpu_hopper_value_head_dim(shape, dtype, causal, layout, atomic, monkeypatch):
    """The Hopper forward with a value head dim below q's (O's tile in the front of Q's
    buffer, stored by TMA), gradients through the Gluon backward above d128 (the d256
    kernel; its atomic dQ switched on for "atomic") and the portable one below: 2x / 3x
    rule."""
    from diyfa.attention import hopper_bwd

    monkeypatch.setattr(hopper_bwd, "WIDE_DQ_ATOMIC", atomic)
    b, h, hk, sq, sk, d, dv = shape
    q, k, _ = _inputs(b, h, hk, sq, sk, d, dtype, layout=layout)
    _, _, v = _inputs(b, h, hk, sq, sk, dv, dtype, layout=layout, seed=1)
    _run_and_check(q, k, v, causal, (-1, -1), 0.0, layout, backend="hopper")


def test_value_head_dim_everywhere_else():
    """A different value dim through packed sequences, the SDPA drop-in (now on the kernel),
    the custom op (opcheck: the fake output has v's head dim), with bad dims refused, "auto"
    on the Hopper family (measured faster), and why the Gluon backward leaves it to the
    portable one below d129."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(30, 2, 48, generator=g).to(DEVICE)
    k = torch.randn(30, 2, 48, generator=g).to(DEVICE)
    v = torch.randn(30, 2, 16, generator=g).to(DEVICE)
    cu = torch.tensor([0, 12, 30], dtype=torch.int32, device=DEVICE)
    out = diyfa.flash_attention_varlen(q, k, v, cu, cu, 18, 18, causal=True)
    assert out.shape == (30, 2, 16)
    for s0, s1 in ((0, 12), (12, 30)):
        ref = attention_ref(*(t[s0:s1].transpose(0, 1)[None].double() for t in (q, k, v)),
                            causal=True)  # fmt: skip
        assert (out[s0:s1].transpose(0, 1)[None].double() - ref).abs().max() < 1e-5
    q4, k4, v4 = (t[None].transpose(1, 2) for t in (q, k, v))  # (1, heads, seq, dim)
    sdpa = diyfa.scaled_dot_product_attention(q4, k4, v4, is_causal=True)
    assert torch.equal(sdpa, diyfa.flash_attention(q4, k4, v4, causal=True))  # no fallback
    torch.library.opcheck(torch.ops.diyfa.attention_fwd.default,
                          (q4, k4, v4, False, "bottom_right", None, "bhsd", "auto", False, -1,
                           -1, 0.0, None, None))  # fmt: skip
    with pytest.raises(ValueError, match="v's head_dim must be in 1..256, got 300"):
        diyfa.flash_attention(q4, k4, torch.randn(1, 2, 30, 300, device=DEVICE))
    with pytest.raises(ValueError, match="q and k must share head_dim, got q=48, k=16"):
        diyfa.flash_attention(q4, v4, v4)
    problem = dataclasses.replace(_problem(), value_dim=64)
    assert dispatch.select(problem).name == "hopper"  # (measured faster, 2026-11-25)
    assert dispatch.select(problem, "hopper").name == "hopper"
    assert "only with q/k head dims above 128" in hopper_bwd.supports(problem)
    for dv, why in ((20, "multiples of 8"), (192, "pad to at most q's (128)")):
        assert why in dispatch.explain(dataclasses.replace(problem, value_dim=dv))[0][1]


def _dropout_mask(q, k, causal, p, seed, layout="bhsd"):
    """The kept (query, key) pairs of diyfa's dropout for this seed: attention over a value
    that is the identity (v's head dim >= seqlen_k) gives out[i, j] = P_ij * Z_ij / (1 - p),
    nonzero exactly where a visible pair was kept (the mask depends on the seed and the
    pair's position only)."""
    kv_axis = 1 if layout == "bhsd" else 2
    sk = k.shape[3 - kv_axis]
    eye_shape = list(k.shape)
    eye_shape[-1] = max(16, sk)
    eye = torch.zeros(eye_shape, device=k.device, dtype=k.dtype)
    idx = torch.arange(sk, device=k.device)
    if layout == "bhsd":
        eye[:, :, idx, idx] = 1.0
    else:
        eye[:, idx, :, idx] = 1.0
    out = diyfa.flash_attention(q.detach(), k.detach(), eye, causal=causal, dropout_p=p,
                                layout=layout, generator=torch.Generator().manual_seed(seed))
    out = out if layout == "bhsd" else out.transpose(1, 2)
    return out[..., :sk] != 0


def _check_dropout(q, k, v, out, causal, layout, p, mask, dtype, **variants):
    """``out`` (a dropout call's, q, k, v requiring gradients) and its gradients against the
    float64 reference with ``mask`` (and ``variants``: the reference's window, softcap,
    alibi_slopes), by the 2x / 3x rule."""
    do = torch.randn_like(out)
    out.backward(do)
    kw = dict(causal=causal, layout=layout, dropout_p=p, dropout_mask=mask, **variants)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    pt_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref = attention_ref(*ref_in, compute_dtype=torch.float64, **kw)
    pt = attention_ref(*pt_in, compute_dtype=dtype, **kw)
    _check("out", out, pt, ref, 2, dtype)
    ref.backward(do.double())
    pt.backward(do)
    for name, t, pti, r in zip(("dq", "dk", "dv"), (q, k, v), pt_in, ref_in, strict=True):
        _check(name, t.grad, pti.grad, r.grad, 3, dtype)


@pytest.mark.parametrize("shape, dtype, causal, p, layout", [
    ((1, 4, 2, 40, 24, 16), torch.float32, False, 0.3, "bhsd"),
    ((2, 2, 1, 33, 20, 32), torch.bfloat16, True, 0.1, "bshd"),
    ((1, 2, 2, 50, 31, 64), torch.float16, False, 0.5, "bhsd"),
], ids=["fp32-gqa", "bf16-causal-bshd", "fp16-half"])
def test_dropout(shape, dtype, causal, p, layout):
    """Dropout against the float64 reference with the same mask (read back from the kernel):
    forward and every gradient by the 2x / 3x rule; the backward regenerates the forward's
    mask (a wrong mask would fail the gradients)."""
    b, h, hk, sq, sk, d = shape
    q, k, v = _inputs(b, h, hk, sq, sk, d, dtype, layout=layout)
    mask = _dropout_mask(q, k, causal, p, 11, layout)
    out = diyfa.flash_attention(q, k, v, causal=causal, dropout_p=p, layout=layout,
                                generator=torch.Generator().manual_seed(11))  # fmt: skip
    _check_dropout(q, k, v, out, causal, layout, p, mask, dtype)


def _seed(generator_seed: int) -> int:
    """The Philox seed a call with ``generator=torch.Generator().manual_seed(s)`` draws."""
    return int(torch.randint(0, 2**62, (), generator=torch.Generator().manual_seed(
        generator_seed)))


def test_dropout_mask_is_the_documented_one():
    """The kernels' mask is ``diyfa.reference.dropout_mask`` (the scheme the Hopper kernels
    share with the portable ones, pinned on the host): per (batch, head) with the query
    head's number, GQA, bshd, rows and keys past 16 (both bit-3 halves of each group), and
    packed sequences (positions counted from each sequence's start, numbered as batches)."""
    from diyfa.reference import dropout_mask

    q, k, _ = (t.detach() for t in _inputs(2, 4, 2, 37, 45, 16, torch.float32, layout="bshd"))
    got = _dropout_mask(q, k, False, 0.3, 21, "bshd")
    for b in range(2):
        for h in range(4):
            want = dropout_mask(_seed(21), b * 4 + h, 37, 45, 0.3)
            assert torch.equal(got[b, h].cpu(), want), (b, h)
    # packed: sequences of 20 and 44 tokens, 2 heads
    q, k, v = (t.detach() for t in _inputs(1, 2, 2, 64, 64, 16, torch.float32))
    cu = torch.tensor([0, 20, 64], dtype=torch.int32, device=DEVICE)
    qp, kp = (t[0].transpose(0, 1).contiguous() for t in (q, k))
    eye = torch.zeros(64, 2, 64, device=DEVICE)
    for s0, s1 in ((0, 20), (20, 64)):
        eye[torch.arange(s0, s1), :, torch.arange(s1 - s0)] = 1.0
    probs = diyfa.flash_attention_varlen(qp, kp, eye, cu, cu, 44, 44, dropout_p=0.4,
                                         generator=torch.Generator().manual_seed(8))
    for b, (s0, s1) in enumerate(((0, 20), (20, 64))):
        for h in range(2):
            got = probs[s0:s1, h, : s1 - s0] != 0
            assert torch.equal(got.cpu(), dropout_mask(_seed(8), b * 2 + h, s1 - s0, s1 - s0,
                                                       0.4)), (b, h)


def test_dropout_seeding_and_rate():
    """torch.manual_seed repeats a run bitwise, another seed changes the mask; about
    1 - p of the pairs are kept; the SDPA drop-in and packed sequences run it on the kernel;
    bad rates are refused."""
    q, k, v = (t.detach() for t in _inputs(1, 2, 2, 64, 64, 16, torch.float32))
    torch.manual_seed(5)
    a = diyfa.flash_attention(q, k, v, dropout_p=0.25)
    torch.manual_seed(5)
    b = diyfa.flash_attention(q, k, v, dropout_p=0.25)
    c = diyfa.flash_attention(q, k, v, dropout_p=0.25)
    assert torch.equal(a, b) and not torch.equal(a, c)
    kept = _dropout_mask(q, k, False, 0.25, 3).float().mean().item()
    assert abs(kept - 0.75) < 0.03  # 8192 pairs: 5 sigma is 0.024
    torch.manual_seed(5)
    sdpa = diyfa.scaled_dot_product_attention(q, k, v, dropout_p=0.25)
    assert torch.equal(sdpa, a)  # the kernel, top-left alignment is moot without causal
    # Packed sequences: per sequence against the reference with the kernel's own mask (an
    # identity value of 64 columns: key j of a sequence lands in column j).
    cu = torch.tensor([0, 20, 64], dtype=torch.int32, device=DEVICE)
    qp, kp, vp = (t[0].transpose(0, 1).contiguous() for t in (q, k, v))
    eye = torch.zeros(64, 2, 64, device=DEVICE)
    for s0, s1 in ((0, 20), (20, 64)):
        eye[torch.arange(s0, s1), :, torch.arange(s1 - s0)] = 1.0

    def packed(value):
        return diyfa.flash_attention_varlen(qp, kp, value, cu, cu, 44, 44, dropout_p=0.2,
                                            generator=torch.Generator().manual_seed(9))
    probs, out = packed(eye), packed(vp)
    for s0, s1 in ((0, 20), (20, 64)):
        n = s1 - s0
        mask = (probs[s0:s1, :, :n] != 0).transpose(0, 1)[None]
        ref = attention_ref(*(t[s0:s1].transpose(0, 1)[None].double() for t in (qp, kp, vp)),
                            dropout_p=0.2, dropout_mask=mask)  # fmt: skip
        assert (out[s0:s1].transpose(0, 1)[None].double() - ref).abs().max() < 1e-5
    for bad, err in ((1.0, ValueError), (-0.1, ValueError), ("0.1", TypeError)):
        with pytest.raises(err, match="dropout_p must be"):
            diyfa.flash_attention(q, k, v, dropout_p=bad)
    problem = dataclasses.replace(_problem(), dropout_p=0.1)
    assert dispatch.select(problem).name == "hopper"  # its forward; the backward portable
    assert hopper_bwd.supports(problem) is None  # and the Gluon backward
    assert hopper_bwd.supports(dataclasses.replace(problem, head_dim=256)) is None


def test_dropout_layout_is_the_asms():
    """The Hopper kernels' dropout (``hopper_fwd._dropout_asm``) takes a thread's 8
    consecutive accumulator registers as rows r, r + 8 x columns c, c + 1, c + 8, c + 9 (c
    a multiple of 16 plus twice the lane's quad index): the wgmma accumulator layouts it
    runs on, as Triton lays them out (register bits: column + 1, row + 8, column + 8;
    lane bits: column + 2, + 4, row + 1, + 2, + 4). A Triton that laid them out otherwise
    would draw another mask: this fails first."""
    from triton._C.libtriton import gluon_ir, ir
    from triton.experimental.gluon import language as gl

    ctx = ir.context()
    ir.load_dialects(ctx)
    builder = gluon_ir.GluonOpBuilder(ctx)
    for rows, cols in ((64, 32), (64, 64), (64, 128), (128, 64)):
        layout = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                           instr_shape=[16, cols, 16])  # fmt: skip
        ll = builder.to_linear_layout(layout._to_ir(builder), [rows, cols])
        assert ll.reg_bases[:3] == [[0, 1], [8, 0], [0, 8]], (rows, cols, ll)
        assert ll.lane_bases == [[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]], (rows, cols, ll)
        assert all(r == 0 or c % 16 == 0 for r, c in ll.reg_bases[3:]), (rows, cols, ll)


_COMPILE_HOPPER_DROPOUT = """
import json, torch
from diyfa._compile import spill_bytes
from diyfa.attention import hopper_bwd as hb, hopper_bwd256 as hb256, hopper_fwd as hf
out = []
for d in (64, 128, 256):
    for causal in (False, True):
        k = hf.compile_for_hopper(d, torch.bfloat16, causal, variants=("DROPOUT",))
        plain = hf.compile_for_hopper(d, torch.bfloat16, causal)
        out.append({"d": d, "causal": causal, "shared": k.metadata.shared,
                    "spilled": spill_bytes(k), "philox": k.asm["ptx"].count("0xCD9E8D57"),
                    "plain": plain.asm["ptx"].count("0xCD9E8D57")})
        for atomic in (True, False):
            if d == 256:
                k = hb256.compile_for_hopper(torch.bfloat16, causal, atomic, variants=("DROPOUT",))
            else:
                k = hb.compile_bwd_for_hopper(d, torch.bfloat16, causal, atomic,
                                              variants=("DROPOUT",))
            out.append({"d": d, "causal": causal, "shared": k.metadata.shared,
                        "spilled": spill_bytes(k), "philox": k.asm["ptx"].count("0xCD9E8D57"),
                        "plain": 0, "bwd": atomic})
print(json.dumps(out))
"""


def test_hopper_kernel_compiles_dropout():
    """The Hopper forward with dropout compiles for sm90a at head dims 64/128/256, causal or
    not, fits the shared memory, draws Philox (its multiplier in the PTX) where the plain
    kernel has none, and spills at most 128 bytes (ptxas, 2026-11-25: none at d64, 24-96
    at d128, 8-52 at d256; none in the K/V loop at d128, the SASS read); so do the Gluon
    backward's in both dQ modes (none at d64, 32-96 at d128, the plain kernel's 4-92; the
    d256 kernel's at most 320: 96-300, plain 52-288). In a fresh process (see
    test_hopper_attention)."""
    rows = _fresh_rows(_COMPILE_HOPPER_DROPOUT)
    for r in rows:
        where = f"d{r['d']} causal={r['causal']} backward={r.get('bwd')}"
        assert r["shared"] <= 227 * 1024, where
        assert r["spilled"] <= (320 if r["d"] == 256 and r.get("bwd") is not None else 128), where
        assert r["philox"] > 0 and r["plain"] == 0, where


HOPPER_DROPOUT_CASES = [
    # (b, h, hk, sq, sk, d, dtype, causal, p, layout)
    (2, 4, 2, 300, 257, 128, torch.bfloat16, True, 0.1, "bhsd"),
    (1, 4, 4, 513, 700, 64, torch.float16, False, 0.3, "bshd"),
    (1, 4, 1, 1000, 1000, 128, torch.bfloat16, False, 0.5, "bhsd"),
    (2, 2, 2, 333, 1024, 256, torch.bfloat16, True, 0.2, "bhsd"),
    (1, 8, 2, 2000, 1999, 96, torch.float16, True, 0.25, "bshd"),
    (1, 2, 2, 4096, 4096, 64, torch.bfloat16, True, 0.1, "bhsd"),
    (1, 4, 2, 700, 900, 128, torch.bfloat16, True, 0.15, "bshd"),  # + window, softcap, ALiBi
]


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic-dq", "kernel-dq"])
@pytest.mark.parametrize("case", HOPPER_DROPOUT_CASES,
                         ids=lambda c: f"d{c[5]}-c{int(c[7])}-p{c[8]}-{c[9]}-{c[3]}x{c[4]}")
def test_gpu_hopper_dropout(case, deterministic, monkeypatch):
    """The Hopper kernels' dropout draws ``reference.dropout_mask`` bit for bit: out against
    float64 with that mask by the 2x rule (a wrong mask is wrong by O(1)), and every
    gradient by the 3x rule, through the Gluon backward in both dQ modes (the portable
    dQ kernel regenerates the mask in the deterministic one; above d128 the d256 kernel,
    its atomic dQ switched on for the atomic-dq runs); GQA/MQA, seqlen_q != seqlen_k, odd
    lengths, both layouts, head dims 64..256; the last case with a window, softcap and
    ALiBi besides."""
    from diyfa.reference import dropout_mask

    monkeypatch.setattr(hopper_bwd, "WIDE_DQ_ATOMIC", True)
    b, h, hk, sq, sk, d, dtype, causal, p, layout = case
    q, k, v = _inputs(b, h, hk, sq, sk, d, dtype, layout=layout)
    variants = {}
    if case is HOPPER_DROPOUT_CASES[-1]:
        variants = dict(window=(200, 0), softcap=20.0,
                        alibi_slopes=torch.linspace(0.05, 0.4, h, device=DEVICE))
    kernel_kw = {("window_size" if k_ == "window" else k_): v_ for k_, v_ in variants.items()}
    out = diyfa.flash_attention(q, k, v, causal=causal, dropout_p=p, layout=layout,
                                backend="hopper", deterministic=deterministic,
                                generator=torch.Generator().manual_seed(4),
                                **kernel_kw)  # fmt: skip
    mask = torch.stack([torch.stack([dropout_mask(_seed(4), i * h + j, sq, sk, p)
                                     for j in range(h)]) for i in range(b)]).to(DEVICE)
    _check_dropout(q, k, v, out, causal, layout, p, mask, dtype, **variants)


@pytest.mark.gpu
def test_gpu_hopper_packed_dropout():
    """Packed sequences on the Hopper kernels with dropout: each sequence's output and
    gradients against float64 with ``reference.dropout_mask`` (positions from the
    sequence's start, the sequence numbered as a batch) by the 2x / 3x rule, causal or
    not, GQA, a zero-length sequence among them."""
    from diyfa.reference import dropout_mask

    lengths = [300, 0, 1000, 77, 513]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                      device=DEVICE)  # fmt: skip
    n, h, hk, d, p = sum(lengths), 4, 2, 128, 0.2
    dtype = torch.bfloat16
    for causal in (False, True):
        q = torch.randn(n, h, d, device=DEVICE, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(n, hk, d, device=DEVICE, dtype=dtype, requires_grad=True)
                for _ in range(2))  # fmt: skip
        out = diyfa.flash_attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths),
                                           causal=causal, dropout_p=p, backend="hopper",
                                           generator=torch.Generator().manual_seed(6))
        do = torch.randn_like(out)
        out.backward(do)
        for i, (s0, s1) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
            if s1 == s0:
                continue
            mask = torch.stack([dropout_mask(_seed(6), i * h + j, s1 - s0, s1 - s0, p)
                                for j in range(h)])[None].to(DEVICE)
            seq = [t.detach()[s0:s1].transpose(0, 1)[None] for t in (q, k, v)]
            ref_in = [t.double().requires_grad_() for t in seq]
            pt_in = [t.clone().requires_grad_() for t in seq]
            ref = attention_ref(*ref_in, causal=causal, dropout_p=p, dropout_mask=mask)
            pt = attention_ref(*pt_in, causal=causal, dropout_p=p, dropout_mask=mask,
                               compute_dtype=dtype)  # fmt: skip
            where = f"seq {i} causal={causal}"
            _check(f"out {where}", out[s0:s1].transpose(0, 1)[None], pt, ref, 2, dtype)
            g = do[s0:s1].transpose(0, 1)[None]
            ref.backward(g.double())
            pt.backward(g)
            for name, t, pti, r in zip(("dq", "dk", "dv"), (q, k, v), pt_in, ref_in,
                                       strict=True):  # fmt: skip
                _check(f"{name} {where}", t.grad[s0:s1].transpose(0, 1)[None], pti.grad,
                       r.grad, 3, dtype)  # fmt: skip


def test_dropout_under_torch_compile():
    """Dropout through the custom ops (fullgraph, no graph break): the seed is drawn inside
    the graph; run as traced (aot_eager) that is the eager call's draw from torch's default
    generator, so after the same torch.manual_seed the compiled call's output and gradients
    are bitwise the eager ones (flash_attention causal with GQA, packed sequences, the SDPA
    drop-in), and a second draw changes the mask; opcheck passes with dropout's rate and
    seed, and a rate without a seed is refused; a generator cannot be traced and is refused
    by name."""
    q, k, v = _inputs(1, 4, 2, 48, 40, 16, torch.float32)
    do = torch.randn(1, 4, 48, 16, device=DEVICE)

    def attn(q, k, v):
        return diyfa.flash_attention(q, k, v, causal=True, dropout_p=0.3)

    def sdpa(q, k, v):
        return diyfa.scaled_dot_product_attention(q, k, v, dropout_p=0.3, enable_gqa=True)

    for fn in (attn, sdpa):
        results = []
        for f in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
            torch.manual_seed(11)
            out = f(q, k, v)
            grads = torch.autograd.grad(out, (q, k, v), do)
            results.append((out, *grads))
            again = f(q, k, v)  # the next draw: another mask
        for eager, compiled in zip(*results, strict=True):
            assert torch.equal(eager, compiled)
        assert not torch.equal(again, results[1][0])
    cu = torch.tensor([0, 20, 48], dtype=torch.int32, device=DEVICE)
    qp = q[0].detach().transpose(0, 1).contiguous().requires_grad_()
    kp, vp = (t[0].detach().transpose(0, 1)[:48].contiguous().requires_grad_()
              for t in (torch.cat([k, k[:, :, :8]], 2), torch.cat([v, v[:, :, :8]], 2)))

    def packed(q, k, v):
        return diyfa.flash_attention_varlen(q, k, v, cu, cu, 28, 28, dropout_p=0.3)

    results = []
    for f in (packed, torch.compile(packed, fullgraph=True, backend="aot_eager")):
        torch.manual_seed(12)
        out = f(qp, kp, vp)
        results.append((out, *torch.autograd.grad(out, (qp, kp, vp), torch.ones_like(out))))
    for eager, compiled in zip(*results, strict=True):
        assert torch.equal(eager, compiled)
    seed = torch.tensor(2**40 + 7)
    args = (q.detach(), k.detach(), v.detach(), True, "bottom_right", None, "bhsd", "auto",
            False, -1, 0, 0.0, None, None, None, None, None, 0.3, seed)  # fmt: skip
    torch.library.opcheck(torch.ops.diyfa.attention_fwd.default, args)
    with pytest.raises(ValueError, match="dropout_p=0.3 needs dropout_seed"):
        torch.ops.diyfa.attention_fwd(*args[:-1], None)
    g = torch.Generator().manual_seed(1)
    f = torch.compile(lambda q, k, v: diyfa.flash_attention(q, k, v, dropout_p=0.1,
                                                            generator=g),
                      fullgraph=True, backend="aot_eager")  # fmt: skip
    with pytest.raises(Exception, match="generator= under torch.compile is not supported"):
        f(q, k, v)


_COMPILE_VARIANTS = """
from diyfa.attention import portable as P

for kernel in ("attn_fwd", "attn_bwd_dq", "attn_bwd_dkdv"):
    P.compile_for_hopper(kernel, tanh_scale=0.1, dropout_p=0.1, dropout_seed=2**40 + 3,
                         HEAD_DIM=192, HEAD_DIM_PAD=256, WINDOW=True, SOFTCAP=True,
                         ALIBI=True, SINKS=True, DROPOUT=True, BLOCK_N=32)
print("compiled")
"""


def test_variant_kernels_compile_for_hopper():
    """The interpreter runs the variants but compiles nothing: the three kernels with every
    variant on (window, softcap, ALiBi, sinks, dropout's Philox, a 192 / 128 value dim)
    compile for sm90 with Triton's toolchain, in a fresh process."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_VARIANTS], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
