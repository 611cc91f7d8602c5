"""diyfa.flash_attention: forward and every gradient against a float64 reference.

The rule (FlashAttention's): the kernel's max error against the float64 reference may be at
most 2x the error PyTorch itself makes computing the same thing in the same precision
(3x for gradients). CPU runs use the Triton interpreter on small shapes; `gpu` tests cover
the full matrix, long sequences, bf16 on the hardware, determinism and memory.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

import diyfa
from diyfa.reference import attention_mask, attention_ref

from .conftest import DEVICE

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
DTYPE_IDS = ["fp16", "bf16", "fp32"]
# Absolute floor of the rule: a few ulps at the output's scale (matters only for fp32, where
# PyTorch's own error can be ~1e-7 and both are rounding noise).
FLOOR = {torch.float16: 1e-5, torch.bfloat16: 1e-4, torch.float32: 2e-6}


def _inputs(b, h, hk, sq, sk, d, dtype, layout="bhsd", device=DEVICE, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def make(heads, s):
        shape = (b, heads, s, d) if layout == "bhsd" else (b, s, heads, d)
        return torch.randn(shape, generator=g).to(device=device, dtype=dtype).requires_grad_()

    return make(h, sq), make(hk, sk), make(hk, sk)


def _max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


def _check(name, ours, pt, ref, factor, dtype):
    """Assert |ours - ref| <= factor * |pt - ref| + floor; say where it failed."""
    err = (ours.double() - ref.double()).abs()
    pt_err = _max_err(pt, ref)
    bound = factor * pt_err + FLOOR[dtype]
    if not torch.isfinite(ours).all():
        pytest.fail(f"{name}: non-finite values at {torch.nonzero(~torch.isfinite(ours))[:5]}")
    if err.max().item() > bound:
        where = tuple(torch.nonzero(err == err.max())[0].tolist())
        pytest.fail(f"{name}: max error {err.max().item():.3e} (mean {err.mean().item():.3e}) "
                    f"at {where} exceeds {factor}x PyTorch's {pt_err:.3e} + {FLOOR[dtype]:.0e}")


# The harness rule for tiny problems (tests/test_fuzz.py, test_numerics.py): the 2x / 3x rule
# plus, elementwise, the roundings a correct kernel makes that PyTorch's result need not show
# when the max error is taken over a handful of elements. Unit roundoff of the input dtype
# (P, and dS in the backward, are rounded to it before their matmuls: FlashAttention's
# practice), and fp32 rounding of the terms that cancel in dS (with room for a few roundings).
UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 0.0}
CANCEL_ULPS = 4 * 2.0**-24
MANTISSA_BITS = {torch.float16: 10, torch.bfloat16: 7}


def half_ulp(ref: torch.Tensor, dtype: torch.dtype):
    """Half a unit in the last place of ``dtype`` at each reference value (0 for fp32): a
    result rounded to a 16-bit format may land on either neighbour of a value near the
    midpoint, PyTorch's on the nearer one."""
    if dtype not in MANTISSA_BITS:
        return torch.zeros_like(ref)
    _, exp = torch.frexp(ref.abs())
    return torch.ldexp(torch.ones_like(ref), exp - 2 - MANTISSA_BITS[dtype])


def rounding_slack(q, k, v, do, dtype, *, causal, softmax_scale, window, softcap, layout,
                   alibi_slopes=None, sinks=None):
    """Elementwise allowances (out, dq, dk, dv), shaped like out, q, k, v, computed in float64
    from the inputs, for roundings that the max-error rule cannot see on tiny problems:

    - every P element: its score is an fp32 dot (off by a few ulps of |q| . |k|) and the
      kernels form P = 2^(s log2(e) - m) with the exponent rounded at the size of s: a
      relative error of CANCEL_ULPS (1 + 2 scale |q| . |k|) in P, through out = P V /
      rowsum(P), dV = P^T dO and dS = P (dP - delta).

    - out, dv: P rounded to ``dtype`` before P @ V and P^T @ dO: u x (P @ |V|), u x
      (P^T @ |dO|) (dv summed over the GQA group).
    - dq, dk: dS = P (dP - delta) with delta = rowsum(dO * O) (FlashAttention's form)
      cancels exactly only in exact arithmetic: where a row sees one key dS is 0 and PyTorch
      reaches 0 bitwise (its delta is rowsum(P * dP), the same sum as dP's), so the floor
      alone would demand bitwise agreement of two summation orders; and dS is rounded to
      ``dtype`` before dS @ K. (CANCEL_ULPS + u) x scale x (P (|dO| |V|^T + |dO| . |O|))
      @ |K| (@ |Q| for dk, summed over the group): fp32 rounds dP and delta to a few ulps of
      the products they sum, not of their (cancelling) values.

    ``alibi_slopes`` and ``sinks`` as ``attention_ref`` takes them: ALiBi's bias joins the
    scores (and its size the exponent's rounding), a sink the softmax's denominator.
    """
    q, k, v, do = (t.detach().double() for t in (q, k, v, do))
    if layout == "bshd":
        q, k, v, do = (t.transpose(1, 2) for t in (q, k, v, do))
    b, h, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    group = h // max(hk, 1)
    kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    s = q @ kr.transpose(-1, -2) * scale  # P as attention_ref forms it
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    bias = torch.zeros((), dtype=s.dtype, device=s.device)
    if alibi_slopes is not None:
        dist = (torch.arange(sq, device=q.device)[:, None] + (sk - sq)
                - torch.arange(sk, device=q.device)[None, :]).abs().double()
        slopes = alibi_slopes.double()
        slopes = slopes[None, :, None, None] if slopes.dim() == 1 else slopes[:, :, None, None]
        bias = slopes * dist
        s = s - bias
    keep = attention_mask(sq, sk, causal=causal, window=window, device=q.device)
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    if sinks is not None:
        lse = torch.logaddexp(lse, sinks.double()[None, :, None, None])
    p = torch.exp(s - lse.masked_fill(torch.isinf(lse), 0.0))
    u = UNIT_ROUNDOFF[dtype]
    # P's relative error is that of its score's exponent: the fp32 dot q . k is off by a few
    # ulps of the products it sums (|q| . |k|), and the kernel's exponent s log2(e) - m is
    # rounded at the size of s, not of s - m. Both grow with the scores (scale 1 and a large
    # head dim: |s| ~ 20, and 2x PyTorch's error is then a coin toss on a handful of rows).
    # (ALiBi: the bias is part of the exponent's size.)
    sizes = scale * (q.abs() @ kr.abs().transpose(-1, -2)) + bias
    rel = CANCEL_ULPS * (1 + 2 * sizes)  # per P element
    o = p @ vr
    # The sizes of the products summed in dP = dO V^T and delta = rowsum(dO * O): a dot of
    # d products in fp32 is off by a few ulps of these (not of its result, which cancels).
    dp = do.abs() @ vr.abs().transpose(-1, -2)
    delta = (do.abs() * o.abs()).sum(-1, keepdim=True)
    terms = p * (dp + delta)
    pe = p * rel
    out = u * (p @ vr.abs()) + pe @ vr.abs() + pe.sum(-1, keepdim=True) * o.abs()
    dv = u * (p.transpose(-1, -2) @ do.abs()) + pe.transpose(-1, -2) @ do.abs()
    dv = dv.view(b, hk, group, sk, d).sum(2)
    dterms = terms * (CANCEL_ULPS + u + rel)
    dq = scale * (dterms @ kr.abs())
    dk = scale * (dterms.transpose(-1, -2) @ q.abs())
    dk = dk.view(b, hk, group, sk, d).sum(2)
    if layout == "bshd":
        out, dq, dk, dv = (t.transpose(1, 2) for t in (out, dq, dk, dv))
    return out, dq, dk, dv


def _run_and_check(q, k, v, causal, layout="bhsd", scale=None, grads=True, **options):
    """flash_attention (with ``options``) against float64, forward and gradients, by the
    2x / 3x rule."""
    dtype = q.dtype
    out = diyfa.flash_attention(q, k, v, causal=causal, layout=layout, softmax_scale=scale,
                                **options)  # fmt: skip
    assert out.shape == q.shape and out.dtype == dtype and out.device == q.device
    do = torch.randn_like(out)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    pt_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    kw = dict(causal=causal, layout=layout, softmax_scale=scale)
    ref = attention_ref(*ref_in, compute_dtype=torch.float64, **kw)
    pt = attention_ref(*pt_in, compute_dtype=dtype, **kw)
    _check("out", out, pt, ref, 2, dtype)
    if not grads:
        return
    out.backward(do)
    ref.backward(do.double())
    pt.backward(do)
    for name, t, p, r in zip(("dq", "dk", "dv"), (q, k, v), pt_in, ref_in, strict=True):
        _check(name, t.grad, p.grad, r.grad, 3, dtype)


# (batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim): odd lengths, q != k both ways,
# single rows, GQA and MQA, non-power-of-two head dims.
SHAPES = [
    (1, 2, 2, 1, 1, 16),
    (1, 2, 2, 17, 17, 40),
    (2, 2, 1, 113, 77, 64),
    (1, 2, 2, 77, 113, 80),
    (1, 4, 2, 128, 128, 32),
    (1, 3, 1, 33, 200, 96),
    (1, 1, 1, 200, 31, 112),
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}h{}hk{}q{}k{}d{}".format(*s))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_forward_and_gradients(shape, dtype, causal):
    b, h, hk, sq, sk, d = shape
    _run_and_check(*_inputs(b, h, hk, sq, sk, d, dtype), causal)


@pytest.mark.parametrize("d", [8, 24, 48, 128, 160, 192, 256])
def test_every_head_dim(d):
    causal = d % 16 == 0
    _run_and_check(*_inputs(1, 2, 1, 45, 70, d, torch.float16), causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_bshd_layout(dtype):
    q, k, v = _inputs(2, 4, 2, 50, 90, 64, dtype, layout="bshd")
    _run_and_check(q, k, v, True, layout="bshd")


def test_custom_scale():
    _run_and_check(*_inputs(1, 2, 2, 40, 40, 32, torch.float16), False, scale=0.3)


def test_rows_that_see_no_key_are_zero_never_nan():
    # Bottom-right causal with seqlen_q > seqlen_k: the first sq - sk rows see no key.
    q, k, v = _inputs(1, 2, 2, 50, 20, 32, torch.float16)
    out, lse = diyfa.flash_attention(q, k, v, causal=True, return_lse=True)
    assert torch.all(out[:, :, :30] == 0)
    assert torch.all(torch.isneginf(lse[:, :, :30])) and torch.isfinite(lse[:, :, 30:]).all()
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.all(q.grad[:, :, :30] == 0)
    _run_and_check(*_inputs(1, 2, 2, 50, 20, 32, torch.float16, seed=1), True)


@pytest.mark.parametrize("causal", [False, True])
def test_lse_matches_reference(causal):
    q, k, v = _inputs(2, 2, 1, 70, 45, 64, torch.float32)
    out, lse = diyfa.flash_attention_with_lse(q, k, v, causal=causal)
    ref, ref_lse = attention_ref(q, k, v, causal=causal, return_lse=True)
    assert lse.shape == (2, 2, 70) and lse.dtype == torch.float32
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert _max_err(lse[finite], ref_lse[finite]) < 1e-5


def test_packed_qkv_slices_and_transposed_views_need_no_copy():
    # A packed (b, s, 3, h, d) projection sliced into q, k, v: strided, non-contiguous views.
    b, s, h, d = 2, 37, 4, 32
    qkv = torch.randn(b, s, 3, h, d, device=DEVICE, dtype=torch.float16)
    q, k, v = (qkv[:, :, i].detach().requires_grad_() for i in range(3))
    assert not q.is_contiguous()
    _run_and_check(q, k, v, True, layout="bshd")
    # The same views seen as (b, h, s, d) by transposing: still no copy.
    qt, kt, vt = (qkv[:, :, i].transpose(1, 2).detach().requires_grad_() for i in range(3))
    _run_and_check(qt, kt, vt, False, layout="bhsd")


def test_no_hidden_copy_of_inputs(monkeypatch):
    qkv = torch.randn(1, 20, 3, 2, 16, device=DEVICE, dtype=torch.float16)
    q, k, v = (qkv[:, :, i] for i in range(3))
    calls = []
    real = torch.Tensor.contiguous
    monkeypatch.setattr(torch.Tensor, "contiguous", lambda self, *a, **kw: calls.append(1)
                        or real(self, *a, **kw))
    diyfa.flash_attention(q, k, v, layout="bshd")
    assert calls == []


def test_backward_is_deterministic():
    q, k, v = _inputs(1, 4, 2, 100, 130, 64, torch.float16)
    grads = []
    for _ in range(2):
        for t in (q, k, v):
            t.grad = None
        out = diyfa.flash_attention(q, k, v, causal=True)
        out.backward(torch.ones_like(out))
        grads.append([t.grad.clone() for t in (q, k, v)])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_batch_heads_past_one_grid_axis(monkeypatch):
    """More (batch, head) pairs than one grid axis holds (portable.bh_grid: CUDA's 65535,
    made 5 here so that the interpreter runs it small): the pairs go over two axes and
    the forward and every gradient, GQA, packed sequences too, still match float64."""
    from diyfa.attention import portable

    monkeypatch.setattr(portable, "MAX_GRID_Y", 5)
    grids = []
    bh_grid = portable.bh_grid
    monkeypatch.setattr(portable, "bh_grid", lambda *a: grids.append(bh_grid(*a)) or grids[-1])
    q, k, v = _inputs(4, 4, 2, 33, 40, 32, torch.float32)  # 16 pairs, 8 kv pairs
    _run_and_check(q, k, v, True, backend="portable")
    assert {g[1:] for g in grids} >= {(4, 4), (4, 2)}  # (heads x 1, batch) and (kv x 2, 2)
    cu = torch.tensor([0, 5, 5, 37, 50], dtype=torch.int32, device=DEVICE)
    q, k, v = (torch.randn(50, h, 32, device=DEVICE) for h in (4, 2, 2))
    out = diyfa.flash_attention_varlen(q, k, v, cu, cu, 32, 32, causal=True, backend="portable")
    for i in range(4):
        a, b = cu[i].item(), cu[i + 1].item()
        if a == b:  # (an empty sequence)
            continue
        ref = attention_ref(*(t[a:b].transpose(0, 1)[None].double() for t in (q, k, v)),
                            causal=True, compute_dtype=torch.float64)[0].transpose(0, 1)
        assert (out[a:b].double() - ref).abs().max().item() < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("kv_heads", [4, 16])
@pytest.mark.parametrize("backend", ["auto", "portable"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_gpu_batch_heads_past_65535(backend, deterministic, kv_heads):
    """4100 x 16 pairs (an embedding model's batch of short sequences): past the 65535 a
    grid axis holds, forward and gradients on every path against float64 by the 2x / 3x
    rule (GQA with 4100 x 4 kv pairs, and 4100 x 16 kv pairs: the Hopper backward's too)."""
    q, k, v = _inputs(4100, 16, kv_heads, 37, 37, 64, torch.bfloat16, device="cuda")
    _run_and_check(q, k, v, True, backend=backend, deterministic=deterministic)


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_drop_in_matches_pytorch_semantics(causal):
    # PyTorch's is_causal is top-left aligned when seqlen_q != seqlen_k.
    q, k, v = _inputs(1, 4, 2, 30, 50, 32, torch.float32)
    out = diyfa.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), is_causal=causal, enable_gqa=True)
    assert _max_err(out, ref) < 1e-5


def test_sdpa_drop_in_falls_back_for_float64_and_negative_scales():
    """What the kernels refuse (float64, a negative scale) the drop-in hands to PyTorch."""
    q = torch.randn(1, 2, 9, 16, dtype=torch.float64, device=DEVICE)
    out = diyfa.scaled_dot_product_attention(q, q, q)
    assert torch.equal(out, torch.nn.functional.scaled_dot_product_attention(q, q, q))
    q = q.half()
    out = diyfa.scaled_dot_product_attention(q, q, q, scale=-0.5)
    # (bitwise PyTorch's, NaNs included: its fp16 CUDA kernels return NaN for a negative
    # scale, H200 with torch 2.11, 2026-11-26)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(
        q, q, q, scale=-0.5), rtol=0, atol=0, equal_nan=True)


def test_sdpa_drop_in_falls_back_and_logs_once(caplog):
    q, k, v = _inputs(1, 2, 2, 8, 8, 16, torch.float32)
    mask = torch.zeros(8, 8, dtype=torch.bool, device=DEVICE).tril()
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            out = diyfa.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.equal(out, ref)
    assert sum("attn_mask" in r.message for r in caplog.records) == 1
    with pytest.raises(ValueError, match="enable_gqa=True"):
        diyfa.scaled_dot_product_attention(q, k[:, :1], v[:, :1])


def test_zero_length_sequences():
    q, k, v = _inputs(1, 2, 2, 5, 1, 16, torch.float16)
    empty_k = k[:, :, :0]
    out, lse = diyfa.flash_attention(q, empty_k, v[:, :, :0], return_lse=True)
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))


def _bad(**over):
    q, k, v = (torch.randn(1, 2, 8, 16, device=DEVICE, dtype=torch.float16) for _ in range(3))
    args = dict(q=q, k=k, v=v)
    args.update(over)
    return args


@pytest.mark.parametrize(
    "over,kwargs,err,match",
    [
        (dict(q=[1.0]), {}, TypeError, "q must be a torch.Tensor, got list"),
        (dict(k=torch.randn(2, 8, 16)), {}, ValueError, r"k must be 4-D .* got shape \(2, 8, 16\)"),
        (dict(v=torch.randn(1, 2, 8, 16, dtype=torch.float64)), {}, TypeError,
         "v.dtype is torch.float64; accepted: float16, bfloat16, float32"),
        (dict(k=torch.randn(1, 2, 8, 16, dtype=torch.float32)), {}, TypeError, "share a dtype"),
        (dict(q=torch.randn(1, 2, 8, 300, dtype=torch.float16),
              k=torch.randn(1, 2, 8, 300, dtype=torch.float16),
              v=torch.randn(1, 2, 8, 300, dtype=torch.float16)), {}, ValueError,
         "head_dim must be in 1..256, got 300"),
        (dict(k=torch.randn(1, 2, 8, 32, dtype=torch.float16)), {}, ValueError,
         "share head_dim, got q=16, k=32"),
        (dict(q=torch.randn(2, 2, 8, 16, dtype=torch.float16)), {}, ValueError,
         "batch sizes differ: q has 2, k has 1"),
        (dict(q=torch.randn(1, 3, 8, 16, dtype=torch.float16)), {}, ValueError,
         r"q heads \(3\) must be a multiple of k/v heads \(2\)"),
        (dict(v=torch.randn(1, 2, 9, 16, dtype=torch.float16)), {}, ValueError,
         "k and v must have the same heads and seqlen"),
        ({}, dict(layout="sbhd"), ValueError, "layout must be one of"),
        ({}, dict(causal=1), TypeError, "causal must be a bool"),
        ({}, dict(softmax_scale=float("nan")), ValueError, "softmax_scale must be finite"),
        ({}, dict(softmax_scale="0.1"), TypeError, "softmax_scale must be a float"),
        ({}, dict(softmax_scale=-1.0), ValueError, "softmax_scale must be finite and >= 0, got -1"),
    ],
    ids=["not-tensor", "rank", "dtype", "mixed-dtype", "head-dim-300", "head-dim-mismatch",
         "batch", "gqa-heads", "kv-mismatch", "layout", "causal-type", "scale-nan", "scale-type",
         "scale-negative"],
)
def test_bad_input_is_a_clear_error(over, kwargs, err, match):
    args = _bad(**{key: (t.to(DEVICE) if isinstance(t, torch.Tensor) else t)
                   for key, t in over.items()})
    with pytest.raises(err, match=match):
        diyfa.flash_attention(args["q"], args["k"], args["v"], **kwargs)


def test_cpu_tensors_without_interpreter_are_refused(monkeypatch):
    from diyfa import attention

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q = torch.randn(1, 1, 4, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match="CPU tensors.*TRITON_INTERPRET=1"):
        attention.flash_attention(q, q, q)


# ---------------------------------------------------------------------------------- GPU
GPU_SHAPES = [
    (2, 8, 8, 1024, 1024, 64), (1, 16, 4, 1023, 4097, 128), (2, 8, 1, 4097, 1000, 96),
    (1, 4, 4, 8192, 8192, 256), (4, 8, 2, 113, 1023, 160), (1, 8, 8, 2048, 2048, 192),
    (1, 32, 8, 4096, 4096, 128), (2, 12, 12, 333, 333, 40), (1, 8, 8, 1000, 1000, 80),
]


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "b{}h{}hk{}q{}k{}d{}".format(*s))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gpu_full_matrix(shape, dtype, causal):
    b, h, hk, sq, sk, d = shape
    _run_and_check(*_inputs(b, h, hk, sq, sk, d, dtype, device="cuda"), causal)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gpu_long_sequence_16k(dtype):
    # The float64 reference holds several 16k x 16k matrices per head: keep heads few.
    _run_and_check(*_inputs(1, 2, 1, 16384, 16384, 128, dtype, device="cuda"), True)


@pytest.mark.gpu
def test_gpu_head_dims_and_lengths_interleaved():
    """Alternating head dims and lengths in one process: each call must run the kernel
    compiled for its own constants (the lean launch path once reused a d64 kernel for d128,
    whose configs share warps and stages)."""
    from diyfa import _launcher
    from diyfa.attention import portable

    cases = [(64, 1024), (128, 1024), (64, 256), (128, 4096), (64, 1024), (32, 300)]
    slow_before = {}
    for rnd in range(3):  # a key's third call is the first one through the lean path
        if rnd == 1:
            slow_before = {fn: launcher.slow_launches
                           for fn, launcher in _launcher._launchers.items()}  # fmt: skip
        for d, s in cases:
            _run_and_check(*_inputs(1, 4, 4, s, s, d, torch.bfloat16, device="cuda"), False)
    fwd = _launcher._launchers[portable._attn_fwd]
    # rounds 2 and 3 made 12 forward calls; at most one per distinct key (5) was slow
    assert fwd.slow_launches - slow_before.get(portable._attn_fwd, 0) <= 5


@pytest.mark.gpu
def test_gpu_deterministic_backward_large():
    q, k, v = _inputs(2, 16, 4, 4096, 4096, 128, torch.bfloat16, device="cuda")
    grads = []
    for _ in range(3):
        for t in (q, k, v):
            t.grad = None
        diyfa.flash_attention(q, k, v, causal=True, deterministic=True).backward(
            torch.ones_like(q))
        grads.append([t.grad.clone() for t in (q, k, v)])
    for run in grads[1:]:
        for a, b in zip(grads[0], run, strict=True):
            assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fwd", "fwd_bwd"])
def test_gpu_memory_is_linear_in_seqlen(mode):
    """At seq 8192 nothing O(seqlen^2) is allocated: extra memory beyond inputs, outputs,
    LSE (and for backward: grads, delta) stays within a few MB."""
    b, h, s, d = 4, 8, 8192, 64
    q, k, v = _inputs(b, h, h, s, s, d, torch.float16, device="cuda")
    do = torch.randn_like(q)
    diyfa.flash_attention(q, k, v).backward(do)  # compile/autotune outside the measurement
    for t in (q, k, v):
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = diyfa.flash_attention(q, k, v)
    expected = out.numel() * 2 + b * h * s * 4  # output + LSE
    if mode == "fwd_bwd":
        out.backward(do)
        expected += 3 * q.numel() * 2 + b * h * s * 4  # dq, dk, dv + delta
        # ... and, where the backward adds into dQ atomically (the Gluon one's default on
        # Hopper), its fp32 dQ accumulator, linear in seqlen too (s is a multiple of its rows)
        from diyfa.attention import dispatch, hopper_bwd
        from diyfa.attention.checks import check_inputs

        p = check_inputs(q, k, v, causal=False, softmax_scale=None, layout="bhsd",
                         align="bottom_right")  # fmt: skip
        if (dispatch.select(p).name == "hopper" and hopper_bwd.supports(p) is None
                and hopper_bwd.auto_mode(p) == "atomic"):  # fmt: skip
            expected += q.numel() * 4
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - expected
    assert extra < 8 * 2**20, f"{extra / 2**20:.1f} MiB beyond inputs/outputs"
    # For scale: one fp32 score matrix would be b*h*s*s*4 bytes = 8 GiB.


@pytest.mark.gpu
def test_gpu_strided_views_no_copy_large():
    b, s, h, d = 2, 2048, 16, 128
    qkv = torch.randn(b, s, 3, h, d, device="cuda", dtype=torch.bfloat16)
    q, k, v = (qkv[:, :, i].detach().requires_grad_() for i in range(3))
    # A first call compiles, and its backward's compile on the prefetch worker allocates that
    # backward's buffers (prefetch.py): outside the measurement, which is of the forward's own
    diyfa.flash_attention(q, k, v, layout="bshd", causal=True).sum().backward()
    for t in (q, k, v):
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = diyfa.flash_attention(q, k, v, layout="bshd", causal=True)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - out.numel() * 2 - b * h * s * 4 * 2
    assert extra < 2**20, f"a hidden copy? {extra / 2**20:.1f} MiB extra"
    _run_and_check(q, k, v, True, layout="bshd")


def test_launch_steps_down_when_a_config_does_not_fit(monkeypatch):
    """A config that overflows shared memory (Triton's OutOfResources at compile time) makes
    the launcher try smaller ones from tuning.FALLBACKS, and remember the one that worked."""
    from triton.runtime.errors import OutOfResources

    from diyfa.attention import portable

    launched = []

    class FakeKernel:
        def __getitem__(self, grid):
            def run(**kw):
                if kw["BLOCK_M"] * kw["BLOCK_N"] > 32 * 32:
                    raise OutOfResources(300000, 232448, "shared memory")
                launched.append((kw["BLOCK_M"], kw["BLOCK_N"]))
            return run

    monkeypatch.setattr(portable.tuning, "autotune_enabled", lambda: False)
    monkeypatch.setattr(portable, "_chosen", {})
    t = torch.empty(1, dtype=torch.float32)
    args = dict(CAUSAL=False, SEQ_BUCKET=1024, VARLEN=False, WINDOW=False, SOFTCAP=False,
                ALIBI=False, SINKS=False, HEAD_DIM_V_PAD=256, DROPOUT=False)  # fmt: skip
    with diyfa.tuning.pinned("attn_fwd", BLOCK_M=128, BLOCK_N=128):
        portable._launch(FakeKernel(), "attn_fwd", lambda m: (1,), t, 256, **args)
    assert launched == [(32, 32)]
    # Unpinned: the default (here the interpreter's 32x32) fits and is remembered.
    portable._launch(FakeKernel(), "attn_fwd", lambda m: (1,), t, 256, **args)
    assert portable._chosen[("attn_fwd", False, None, torch.float32, 256, False, 1024,
                             False, False, False, False, False, 256, False, False)][0] == {
        "BLOCK_M": 32, "BLOCK_N": 32}
    with pytest.raises(OutOfResources):
        with diyfa.tuning.pinned("attn_fwd", BLOCK_M=64, BLOCK_N=64):
            monkeypatch.setattr(portable.tuning, "FALLBACKS", [(64, 32, 4, 1)])
            portable._launch(FakeKernel(), "attn_fwd", lambda m: (1,), t, 256, **args)
