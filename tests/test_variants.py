"""Attention variants (issue 14) on the portable kernels: sliding windows and softcap.

Every case against the float64 reference (diyfa.reference.attention_ref with the same window
and softcap) by the 2x / 3x rule: forward and every gradient, with 16 x 16 blocks pinned so
that short sequences still span many blocks (the band's skipped, masked and unmasked
ranges all occur). Plus: blocks outside the band are never read, packed sequences, bad
values, where the Hopper family stands, and the custom op under opcheck.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

import diyfa
from diyfa import tuning
from diyfa.attention import dispatch
from diyfa.reference import attention_ref

from .conftest import DEVICE
from .test_attention import _check, _inputs
from .test_hopper_attention import _problem


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


def _run_and_check(q, k, v, causal, window_size, softcap, layout="bhsd"):
    dtype = q.dtype
    with _small_blocks():
        out = diyfa.flash_attention(q, k, v, causal=causal, window_size=window_size,
                                    softcap=softcap, layout=layout)  # fmt: skip
        do = torch.randn_like(out)
        out.backward(do)
    kw = dict(causal=causal, window=_ref_window(window_size, causal), softcap=softcap,
              layout=layout)  # fmt: skip
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    pt_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref = attention_ref(*ref_in, compute_dtype=torch.float64, **kw)
    pt = attention_ref(*pt_in, compute_dtype=dtype, **kw)
    _check("out", out, pt, ref, 2, dtype)
    ref.backward(do.double())
    pt.backward(do)
    for name, t, p, r in zip(("dq", "dk", "dv"), (q, k, v), pt_in, ref_in, strict=True):
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


def test_varlen_window_and_softcap():
    """Packed sequences: the band is per sequence (bottom-right within each), forward and
    gradients per sequence against the reference."""
    lens_q, lens_k = [37, 0, 80], [50, 10, 80]
    h, hk, d, dtype = 2, 1, 32, torch.float32
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lens_q), h, d, generator=g, dtype=dtype).to(DEVICE).requires_grad_()
    k = torch.randn(sum(lens_k), hk, d, generator=g, dtype=dtype).to(DEVICE).requires_grad_()
    v = torch.randn(sum(lens_k), hk, d, generator=g, dtype=dtype).to(DEVICE).requires_grad_()

    def cu(lens):
        return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,
                            device=DEVICE)  # fmt: skip

    with _small_blocks():
        out = diyfa.flash_attention_varlen(q, k, v, cu(lens_q), cu(lens_k), max(lens_q),
                                           max(lens_k), causal=True, window_size=(12, 0),
                                           softcap=4.0)  # fmt: skip
        out.backward(torch.ones_like(out))
    qs, ks = 0, 0
    for lq, lk in zip(lens_q, lens_k, strict=True):
        ins = [t.detach()[s:s + n].double().transpose(0, 1).unsqueeze(0).requires_grad_()
               for t, s, n in ((q, qs, lq), (k, ks, lk), (v, ks, lk))]  # fmt: skip
        if lq:
            ref = attention_ref(*ins, causal=True, window=(12, 0), softcap=4.0)
            ref.sum().backward()
            got = out[qs:qs + lq].transpose(0, 1).unsqueeze(0)
            assert (got.double() - ref).abs().max().item() < 1e-5
            for t, s, n, r in ((q, qs, lq, ins[0]), (k, ks, lk, ins[1]), (v, ks, lk, ins[2])):
                grad = t.grad[s:s + n].transpose(0, 1).unsqueeze(0).double()
                assert (grad - r.grad).abs().max().item() < 1e-5
        qs, ks = qs + lq, ks + lk


@pytest.mark.parametrize("kwargs, err, match", [
    (dict(window_size=(-2, 0)), ValueError, r"window_size sides must be >= 0 or -1.*\(-2, 0\)"),
    (dict(window_size=(3,)), TypeError, r"window_size must be a \(left, right\) pair"),
    (dict(window_size=(1.5, 0)), TypeError, r"pair of ints, got \(1.5, 0\)"),
    (dict(window_size=(4, 3), causal=True), ValueError, r"looks 3 keys ahead.*causal=True"),
    (dict(softcap=-1.0), ValueError, r"softcap must be a finite number >= 0.*-1.0"),
    (dict(softcap=float("inf")), ValueError, r"softcap must be a finite number >= 0.*inf"),
    (dict(softcap=float("nan")), ValueError, r"softcap must be a finite number >= 0.*nan"),
    (dict(softcap=True), TypeError, r"softcap must be a number, got True"),
], ids=["left-2", "one-side", "float", "causal-ahead", "cap-neg", "cap-inf", "cap-nan",
        "cap-bool"])
def test_bad_values(kwargs, err, match):
    q, k, v = _inputs(1, 2, 2, 8, 8, 16, torch.float32)
    with pytest.raises(err, match=match):
        diyfa.flash_attention(q, k, v, **kwargs)


@pytest.mark.parametrize("replace, reason", [
    (dict(window_left=100), "no sliding window yet"),
    (dict(window_right=3), "no sliding window yet"),
    (dict(softcap=30.0), "no softcap yet"),
], ids=["left", "right", "softcap"])
def test_hopper_family_refuses_variants(replace, reason):
    """On an H100 the variants run on the portable kernels, and "auto" says why."""
    problem = dataclasses.replace(_problem(), **replace)
    assert dispatch.select(problem).name == "portable"
    assert reason in dict(dispatch.explain(problem))["hopper"]
    causal = dataclasses.replace(_problem(causal=True), window_right=0)
    assert dispatch.select(causal).name == "hopper"  # causal alone is not a window


def test_custom_op_carries_the_variants():
    """The custom ops take the window and softcap (torch.compile path): opcheck, and the
    op's result equals the eager call's."""
    q, k, v = (t.detach() for t in _inputs(1, 2, 1, 40, 56, 16, torch.float32))
    args = (q, k, v, True, "bottom_right", None, "bhsd", "auto", False, 9, 0, 2.5)
    torch.library.opcheck(torch.ops.diyfa.attention_fwd.default, args)
    out, _ = torch.ops.diyfa.attention_fwd(*args)
    eager = diyfa.flash_attention(q, k, v, causal=True, window_size=(9, 0), softcap=2.5)
    assert torch.equal(out, eager)
