"""The numerics contract (docs/errors.md, "Numerics"), tested.

1. NaN / inf stay confined: a non-finite query row changes only that row's output and LSE
   (and, in the backward, that row's dq and the dK / dV of its (batch, kv head)); every
   other row, head and batch is bitwise equal to a clean run. A non-finite key / value
   reaches only the (batch, kv head) that holds it; packed sequences never reach each
   other; cache rows past cache_seqlens and memory beside a strided view are never read.
2. Rows that see no key (causal with seqlen_q > seqlen_k, windows that exclude every key)
   give output 0 and LSE -inf, never NaN, and add exactly nothing to any gradient (their dq
   is 0, dK / dV equal a run where their dO is 0), forward and backward, packed too.
3. fp16 inputs whose scores reach the fp16 maximum (and beyond) give finite outputs, LSE
   and gradients that match the float64 reference: scores are formed in fp32.
"""

from __future__ import annotations

import pytest
import torch

import diyfa
from diyfa.ops.matmul import triton_matmul
from diyfa.reference import attention_ref

from .conftest import DEVICE
from .test_attention import rounding_slack

F16, F32 = torch.float16, torch.float32
# The NaN / inf tests feed non-finite values on purpose: the interpreter's numpy says so
# when they meet a matmul. What must hold (the other rows, bitwise) is asserted.
NAN_IN_MATMUL = pytest.mark.filterwarnings(
    "ignore:invalid value encountered in matmul:RuntimeWarning")


def _randn(*shape, dtype=F16, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype)


def _run(q, k, v, do, **kw):
    """(out, lse, dq, dk, dv) of flash_attention with upstream gradient ``do``."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))  # views stay views
    out, lse = diyfa.flash_attention(q, k, v, return_lse=True, **kw)
    out.backward(do)
    return out.detach(), lse, q.grad, k.grad, v.grad


def _same(a, b, where=...):
    """Bitwise equal at ``where``, with no NaN or +-inf there (an LSE's -inf, a row that sees
    no key, must be -inf in both)."""
    a, b = a[where], b[where]
    assert not (a.isnan() | a.isposinf()).any() and torch.equal(a, b)


# ----------------------------------------------------------------- 1. NaN / inf confinement
@NAN_IN_MATMUL
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")],
                         ids=["nan", "inf", "-inf"])  # fmt: skip
@pytest.mark.parametrize("dtype", [F16, F32], ids=["fp16", "fp32"])
def test_non_finite_query_row_stays_in_its_row(bad, dtype):
    """q[0, 1, 5] is non-finite (GQA: query heads 0-1 share kv head 0). Forward: only that
    row's output and LSE change. Backward: that row's dq, and dK / dV of kv head 0 of batch
    0 (every row's gradient sums there); everything else bitwise as in a clean run."""
    b, h, hk, sq, sk, d = 2, 4, 2, 40, 37, 32
    q, k, v = _randn(b, h, sq, d, dtype=dtype), _randn(b, hk, sk, d, dtype=dtype, seed=1), \
        _randn(b, hk, sk, d, dtype=dtype, seed=2)
    do = _randn(b, h, sq, d, dtype=dtype, seed=3)
    clean = _run(q, k, v, do, causal=True)
    q_bad = q.clone()
    q_bad[0, 1, 5] = bad
    out, lse, dq, dk, dv = _run(q_bad, k, v, do, causal=True)
    row = torch.zeros(b, h, sq, dtype=torch.bool, device=DEVICE)
    row[0, 1, 5] = True
    _same(out, clean[0], ~row)
    _same(lse, clean[1], ~row)
    _same(dq, clean[2], ~row)
    _same(dk, clean[3], (slice(None), slice(1, None)))  # kv head 1: query heads 2-3
    _same(dk[1], clean[3][1])  # batch 1
    _same(dv[1], clean[4][1])
    _same(dv[:, 1], clean[4][:, 1])


@NAN_IN_MATMUL
def test_non_finite_key_stays_in_its_batch_and_kv_head():
    """k[1, 0, 20] is NaN and v[1, 0, 9] inf: batch 0 and kv head 1 (query heads 2-3) are
    bitwise as in a clean run, forward and backward."""
    b, h, hk, sq, sk, d = 2, 4, 2, 33, 41, 24
    q, k, v = _randn(b, h, sq, d), _randn(b, hk, sk, d, seed=1), _randn(b, hk, sk, d, seed=2)
    do = _randn(b, h, sq, d, seed=3)
    clean = _run(q, k, v, do)
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[1, 0, 20] = float("nan")
    v_bad[1, 0, 9] = float("inf")
    out, lse, dq, dk, dv = _run(q, k_bad, v_bad, do)
    for got, want in zip((out, lse, dq), clean[:3], strict=True):
        _same(got[0], want[0])
        _same(got[:, 2:], want[:, 2:])
    for got, want in zip((dk, dv), clean[3:], strict=True):
        _same(got[0], want[0])
        _same(got[:, 1], want[:, 1])


def test_packed_sequences_never_reach_each_other():
    """Varlen: NaN in a query row and a key of sequence 1 leaves sequences 0 and 2 bitwise
    as in a clean run, outputs and every gradient (blocks straddle the boundaries)."""
    lens_q, lens_k = [13, 7, 21], [9, 17, 6]
    h, d = 2, 16
    cu_q = torch.tensor([0, 13, 20, 41], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 9, 26, 32], dtype=torch.int32, device=DEVICE)
    q, k, v = _randn(41, h, d), _randn(32, h, d, seed=1), _randn(32, h, d, seed=2)
    do = _randn(41, h, d, seed=3)

    def run(q, k, v):
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        out, lse = diyfa.flash_attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                                causal=True, return_lse=True)  # fmt: skip
        out.backward(do)
        return out.detach(), lse.t(), q.grad, k.grad, v.grad

    clean = run(q, k, v)
    q_bad, k_bad = q.clone(), k.clone()
    q_bad[15] = float("nan")  # sequence 1's third row
    k_bad[10] = float("nan")  # sequence 1's second key
    got = run(q_bad, k_bad, v)
    others_q = torch.cat([torch.arange(0, 13), torch.arange(20, 41)]).to(DEVICE)
    others_k = torch.cat([torch.arange(0, 9), torch.arange(26, 32)]).to(DEVICE)
    for i, (a, b) in enumerate(zip(got, clean, strict=True)):
        _same(a, b, others_q if i < 3 else others_k)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_cache_rows_past_the_lengths_are_never_read(paged):
    """NaN in every cache row past cache_seqlens (and in pages no table entry uses): the
    output equals a run over a clean cache bitwise."""
    b, hk, h, d, rows, page = 3, 2, 4, 16, 96, 16
    lens = torch.tensor([0, 37, 80], dtype=torch.int32, device=DEVICE)
    q = _randn(b, 2, h, d)
    k, v = _randn(b, rows, hk, d, seed=1), _randn(b, rows, hk, d, seed=2)
    k_bad, v_bad = k.clone(), v.clone()
    for i, n in enumerate(lens.tolist()):
        k_bad[i, n:] = float("nan")
        v_bad[i, n:] = float("nan")
    table = None
    if paged:  # pages 0..17 hold the sequences in order, pages 18..20 are spare (NaN)
        table = torch.arange(b * rows // page, dtype=torch.int32, device=DEVICE).view(b, -1)

        def pool(x):
            p = x.reshape(b * rows // page, page, hk, d)
            return torch.cat([p, torch.full_like(p[:3], float("nan"))])

        k, v, k_bad, v_bad = pool(k), pool(v), pool(k_bad), pool(v_bad)
    outs = []
    for kc, vc in ((k, v), (k_bad, v_bad)):
        outs.append(diyfa.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=lens,
                                                       block_table=table, num_splits=2,
                                                       return_lse=True))  # fmt: skip
    (out, lse), (out_bad, lse_bad) = outs
    _same(out_bad, out)
    assert torch.equal(lse_bad, lse)  # sequence 0 (empty): -inf in both


def test_memory_beside_strided_views_is_never_read():
    """q, k, v are every other column of tensors whose other columns are NaN, and their head
    dim (24) is padded to 32 inside the kernels: outputs and gradients equal a contiguous
    run's bitwise. Likewise triton_matmul on column slices."""
    b, h, s, d = 1, 2, 30, 24
    wide = [torch.full((b, h, s, 2 * d), float("nan"), dtype=F16, device=DEVICE)
            for _ in range(3)]  # fmt: skip
    dense = [_randn(b, h, s, d, seed=i) for i in range(3)]
    for w, x in zip(wide, dense, strict=True):
        w[..., 1::2] = x
    views = [w[..., 1::2] for w in wide]
    do = _randn(b, h, s, d, seed=7)
    for got, want in zip(_run(*views, do, causal=True), _run(*dense, do, causal=True),
                         strict=True):  # fmt: skip
        _same(got, want)
    a = torch.full((20, 64), float("nan"), dtype=F16, device=DEVICE)
    a[:, :40:2] = _randn(20, 20)
    m = _randn(20, 9, seed=1)
    assert torch.equal(triton_matmul(a[:, :40:2], m), triton_matmul(a[:, :40:2].contiguous(), m))


@NAN_IN_MATMUL
def test_matmul_non_finite_stays_in_its_row_and_column():
    a, b = _randn(37, 50), _randn(50, 29, seed=1)
    clean = triton_matmul(a, b)
    a_bad, b_bad = a.clone(), b.clone()
    a_bad[3, 7] = float("nan")
    b_bad[11, 5] = float("inf")
    out = triton_matmul(a_bad, b_bad)
    keep = torch.ones_like(out, dtype=torch.bool)
    keep[3], keep[:, 5] = False, False
    _same(out, clean, keep)


# -------------------------------------------------------------- 2. rows that see no key
MASKED = [
    # (seqlen_q, seqlen_k, causal, window_size): rows 0 .. n_masked - 1 see no key
    pytest.param(50, 20, True, (-1, -1), 30, id="causal-q50-k20"),
    pytest.param(40, 12, False, (0, 0), 28, id="window-0-0"),
    pytest.param(40, 25, True, (3, 0), 15, id="causal-window-3"),
    pytest.param(45, 30, False, (-1, 2), 13, id="window-right-2"),
]


@pytest.mark.parametrize("sq, sk, causal, window, n_masked", MASKED)
@pytest.mark.parametrize("dtype", [F16, F32], ids=["fp16", "fp32"])
def test_rows_that_see_no_key(sq, sk, causal, window, n_masked, dtype):
    """Output 0 and LSE -inf exactly there, finite elsewhere; their dq is 0 and dK / dV
    equal a run where their dO is 0 (bitwise: they add exactly nothing)."""
    b, h, hk, d = 2, 2, 1, 32
    kw = dict(causal=causal, window_size=window)
    q, k, v = _randn(b, h, sq, d, dtype=dtype), _randn(b, hk, sk, d, dtype=dtype, seed=1), \
        _randn(b, hk, sk, d, dtype=dtype, seed=2)
    ref_lse = attention_ref(q, k, v, causal=causal, window=window, return_lse=True)[1]
    assert torch.isneginf(ref_lse[:, :, :n_masked]).all()  # the case is what it says
    assert torch.isfinite(ref_lse[:, :, n_masked:]).all()
    do = _randn(b, h, sq, d, dtype=dtype, seed=3)
    out, lse, dq, dk, dv = _run(q, k, v, do, **kw)
    assert (out[:, :, :n_masked] == 0).all() and torch.isfinite(out).all()
    assert torch.isneginf(lse[:, :, :n_masked]).all()
    assert torch.isfinite(lse[:, :, n_masked:]).all()
    assert (dq[:, :, :n_masked] == 0).all()
    for g in (dq, dk, dv):
        assert torch.isfinite(g).all()
    do_zero = do.clone()
    do_zero[:, :, :n_masked] = 0
    _, _, dq0, dk0, dv0 = _run(q, k, v, do_zero, **kw)
    assert torch.equal(dq, dq0) and torch.equal(dk, dk0) and torch.equal(dv, dv0)


def test_rows_that_see_no_key_packed():
    """Varlen: per sequence (bottom-right), causal with more queries than keys, an empty key
    sequence, and a window: output 0, LSE -inf, dq 0, dK / dV untouched by those rows."""
    h, d = 2, 16  # query lengths 12, 5, 9; key lengths 4, 0, 9
    cu_q = torch.tensor([0, 12, 17, 26], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 4, 4, 13], dtype=torch.int32, device=DEVICE)
    q, k, v = _randn(26, h, d), _randn(13, h, d, seed=1), _randn(13, h, d, seed=2)
    do = _randn(26, h, d, seed=3)
    masked = torch.zeros(26, dtype=torch.bool, device=DEVICE)
    masked[:8] = True  # sequence 0: rows 0..7 see no key (12 queries, 4 keys, causal)
    masked[12:17] = True  # sequence 1: no keys at all

    def run(do):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out, lse = diyfa.flash_attention_varlen(qq, kk, vv, cu_q, cu_k, 12, 9, causal=True,
                                                window_size=(2, 0), return_lse=True)  # fmt: skip
        out.backward(do)
        return out.detach(), lse, qq.grad, kk.grad, vv.grad

    out, lse, dq, dk, dv = run(do)
    assert (out[masked] == 0).all() and torch.isfinite(out).all()
    assert torch.isneginf(lse[:, masked]).all() and torch.isfinite(lse[:, ~masked]).all()
    assert (dq[masked] == 0).all()
    do_zero = do.clone()
    do_zero[masked] = 0
    _, _, dq0, dk0, dv0 = run(do_zero)
    assert torch.equal(dq, dq0) and torch.equal(dk, dk0) and torch.equal(dv, dv0)


def test_rows_that_see_no_key_in_the_cache():
    """KV cache, causal, more new queries than cached keys: those rows give 0 and -inf."""
    q = _randn(2, 6, 2, 16)
    k, v = _randn(2, 8, 2, 16, seed=1), _randn(2, 8, 2, 16, seed=2)
    lens = torch.tensor([2, 0], dtype=torch.int32, device=DEVICE)
    out, lse = diyfa.flash_attention_with_kvcache(q, k, v, cache_seqlens=lens, causal=True,
                                                  return_lse=True)  # fmt: skip
    assert (out[0, :4] == 0).all() and (out[1] == 0).all() and torch.isfinite(out).all()
    assert torch.isneginf(lse[0, :, :4]).all() and torch.isneginf(lse[1]).all()
    assert torch.isfinite(lse[0, :, 4:]).all()


# ------------------------------------------------------------------ 3. large fp16 scores
# Causal: the backward forms 2^(s - lse) before it masks, and a masked score far above its
# row's LSE overflows to inf there (then replaced by 0; the GPU does the same silently).
@pytest.mark.filterwarnings("ignore:overflow encountered in exp2:RuntimeWarning")
@pytest.mark.parametrize("peak", [6.0e4, 2.0e5], ids=["near-fp16-max", "past-fp16-max"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fp16_scores_near_the_fp16_maximum(peak, causal):
    """fp16 q, k scaled so that the largest |score| is ``peak`` (PyTorch's own fp16 math
    overflows to inf / NaN there): the kernel forms scores in fp32, so output, LSE and
    gradients are finite and within 2x (3x for gradients) of PyTorch's fp32 error against
    float64, plus half an fp16 ulp of the values."""
    b, h, sq, sk, d = 1, 2, 33, 47, 64
    q, k, v = (_randn(b, h, s, d, dtype=F32, seed=i) for i, s in enumerate((sq, sk, sk)))
    scores = (q.double() @ k.double().transpose(-1, -2)).abs().max().item() / d**0.5
    c = (peak / scores) ** 0.5
    q, k = (q * c).half(), (k * c).half()
    v = v.half()
    assert torch.isfinite(q).all() and q.abs().max() < 6e4
    do = _randn(b, h, sq, d, seed=5)
    out, lse, dq, dk, dv = _run(q, k, v, do, causal=causal)
    pt16 = attention_ref(q, k, v, causal=causal, compute_dtype=F16)
    if peak > 6.5e4:
        assert not torch.isfinite(pt16).all()  # what fp16 scores would give
    for t in (out, lse, dq, dk, dv):
        assert torch.isfinite(t).all()
    ins64 = [t.double().requires_grad_() for t in (q, k, v)]
    ins32 = [t.float().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = attention_ref(*ins64, causal=causal, return_lse=True)
    pt, pt_lse = attention_ref(*ins32, causal=causal, compute_dtype=F32, return_lse=True)
    ref.backward(do.double())
    pt.backward(do.float())
    # (the allowances of rounding_slack: P's exponent is rounded at the size of the scores,
    # ~4e4 here, where an fp32 ulp is 0.004: dq, dk and dv all carry it; dv's went unchecked
    # until a CPU whose numpy rounds exp2 / log2 a little differently put it at 0.8%)
    _, slack_q, slack_k, slack_v = rounding_slack(*ins64, do, F16, causal=causal,
                                                  softmax_scale=None, window=None, softcap=0.0,
                                                  layout="bhsd")  # fmt: skip

    def within(name, ours, pt, ref, factor, slack=0.0):
        """Error beyond half an fp16 ulp (fp16 results), four fp32 ulps (fp32 results: the
        LSE of scores ~1e5 moves by ulps through base 2) and the cancellation slack: at most
        ``factor`` x PyTorch's fp32 error."""
        exp = torch.frexp(ref.abs())[1]
        ulps = torch.ldexp(torch.ones_like(ref), exp - (12 if ours.dtype == F16 else 22))
        err = (ours.double() - ref).abs() - ulps - slack
        allowed = factor * (pt.double() - ref).abs().max().item() + 1e-6
        assert err.max().item() <= allowed, f"{name}: {err.max().item():.3e} > {allowed:.3e}"

    within("out", out, pt, ref, 2)
    within("lse", lse[torch.isfinite(ref_lse)], pt_lse[torch.isfinite(ref_lse)],
           ref_lse[torch.isfinite(ref_lse)], 2)  # fmt: skip
    for name, g, p, r, s in zip(("dq", "dk", "dv"), (dq, dk, dv), ins32, ins64,
                                (slack_q, slack_k, slack_v), strict=True):  # fmt: skip
        within(name, g, p.grad, r.grad, 3, s)
