"""The "portable" kernel family: FlashAttention forward and backward in Triton
(FlashAttention-2 style). It runs every problem that passes diyfa.attention.checks, on
any CUDA GPU Triton supports and in the Triton interpreter; the dispatcher
(dispatch.py) falls back to it when no faster family supports a problem.

Layout and shapes
    q: (batch, heads, seqlen_q, head_dim)      for layout="bhsd" (PyTorch SDPA's layout)
    k, v: (batch, kv_heads, seqlen_k, head_dim)
    layout="bshd" swaps the seqlen and heads axes (flash-attn's layout). Any strides are
    accepted (slices of a packed QKV tensor, transposed views): the kernels take every stride
    as an argument and never copy the inputs. The output has the layout asked for.

Numerics (obeyed by every kernel below)
    - Matmuls accumulate in fp32. fp16/bf16 inputs: P is rounded to the input dtype before
      P @ V, as in FlashAttention. fp32 inputs: every dot runs in full fp32 ("ieee"), not
      TF32, so fp32 results are accurate (and slower).
    - Softmax in base 2 with the scale folded in: s2 = (q . k) * scale * log2(e), p = 2^(s2 - m).
    - The forward saves the log-sum-exp per query row in base 2 (lse2); the backward
      recomputes P = 2^(s2 - lse2) and uses delta = rowsum(dO * O).
    - Offsets of batch and head are 64-bit before they multiply strides.
    - A query row that sees no key (possible with causal masking when seqlen_q > seqlen_k)
      gives an output of zeros, an LSE of -inf and zero gradients: never NaN.

Masking
    causal=True aligns the mask bottom-right (FlashAttention's convention): query i sees key
    j iff j <= i + (seqlen_k - seqlen_q). With seqlen_q == seqlen_k this is the usual lower
    triangle. The SDPA drop-in uses top-left alignment (PyTorch's is_causal), offset 0.

Work split
    Each loop over K/V (forward, dQ) or over Q (dK/dV) is cut into blocks that need no mask
    (fully visible, fully in bounds) and blocks that do (the causal diagonal, the ragged
    tail): the same helper runs both, the MASKED flag is a compile-time constant.
    The backward is deterministic: dK/dV for a K/V block are summed by one program, over the
    query heads of its group (GQA) too; dQ is computed by a second kernel. No atomics.

Limits (enforced by checks.py)
    head_dim 1..256 (q and k share it, v's may differ: HEAD_DIM_V; non-powers of two are
    padded to the next power of two inside the kernel); fp16, bf16, fp32; dropout (its mask
    by _keep); no arbitrary additive masks. Any batch x heads whose batch splits over two
    grid axes (bh_grid; refused by _supports otherwise).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from diyfa import _interpreter, tuning
from diyfa._launcher import (
    Replay,
    ReplayCache,
    cdiv,
    compile_kernel,
    compiling_only,
    launch_recorded,
    next_power_of_2,
)
from diyfa._launcher import launch as fast_launch
from diyfa.attention.dispatch import Family
from diyfa.attention.problem import Problem, bhsd_strides
from diyfa.device import interpreter_enabled, kernel_limits

if interpreter_enabled():
    _interpreter.apply()  # bf16 tl.dot is wrong in Triton 3.6's interpreter without it

# Softcap's tanh by the GPU's own instruction (see _tanh): not in the interpreter (no PTX).
_APPROX_TANH = tl.constexpr(not interpreter_enabled())

LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------------
@triton.jit
def _load_2d(ptrs, row_ok, col_ok, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    """Load a tile, masking rows and/or columns only where the caller says it is needed."""
    if CHECK_ROWS:
        if CHECK_COLS:
            x = tl.load(ptrs, mask=row_ok & col_ok, other=0.0)
        else:
            x = tl.load(ptrs, mask=row_ok, other=0.0)
    else:
        if CHECK_COLS:
            x = tl.load(ptrs, mask=col_ok, other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def _visible(offs_q, offs_k, seqlen_q, seqlen_k, causal_offset, left_offset,
             CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """(q, k) pairs that are in bounds and inside the band (shapes broadcast): key j is
    visible from query i iff j <= i + causal_offset (CAUSAL: causal or a right window) and
    j >= i + left_offset (WINDOW: a left window)."""
    keep = (offs_q < seqlen_q) & (offs_k < seqlen_k)
    if CAUSAL:
        keep = keep & (offs_k <= offs_q + causal_offset)
    if WINDOW:
        keep = keep & (offs_k >= offs_q + left_offset)
    return keep


@triton.jit
def _band(causal_offset, window_left, window_right):
    """(upper, lower) offsets of the visible band of a sequence: key j is visible from query i
    iff i + lower <= j <= i + upper (each side only where its flag is set)."""
    return causal_offset + window_right, causal_offset - window_left


@triton.jit
def _kv_ranges(start_m, seqlen_k, causal_offset, left_offset, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """For the Q block at ``start_m``: keys [lo, full_lo) and [full_hi, hi) need a mask,
    [full_lo, full_hi) do not (every row sees every key there). Without a left window
    lo = full_lo = 0; keys outside [lo, hi) are not visited at all."""
    if CAUSAL:
        hi = tl.maximum(tl.minimum(seqlen_k, start_m + BLOCK_M + causal_offset), 0)
        full_hi = tl.maximum(tl.minimum(seqlen_k, start_m + causal_offset + 1), 0)
    else:
        hi = seqlen_k
        full_hi = seqlen_k
    full_hi = full_hi // BLOCK_N * BLOCK_N
    lo = 0
    full_lo = 0
    if WINDOW:
        lo = tl.maximum(start_m + left_offset, 0) // BLOCK_N * BLOCK_N
        full_lo = tl.cdiv(tl.maximum(start_m + BLOCK_M - 1 + left_offset, 0), BLOCK_N) * BLOCK_N
        full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
        full_hi = tl.maximum(full_hi, full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def _tanh(x, PRECISION: tl.constexpr):
    """tanh of the fp32 scores. On a GPU, for fp16/bf16 inputs (PRECISION != "ieee"): the
    hardware's ``tanh.approx.f32``, one MUFU instruction (relative error about 2^-11, far
    below the 16-bit inputs' own rounding of the scores). Otherwise (fp32 inputs, whose
    results must stay fp32-accurate, and the interpreter, which runs no PTX): 1 - 2 /
    (2^(2 x log2(e)) + 1), an exp2 and a division; exact at 0, +-1 far out (2 / inf = 0),
    never NaN for a number, absolute error ~1e-7 near 0 as the scores' own. The forward and
    the backward call this same function, so they agree on the scores."""
    if _APPROX_TANH and PRECISION != "ieee":
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        # (the exponent stops at 64: 2 / (2^64 + 1) is below fp32's half ulp of 1, and a
        # larger one would overflow exp2, which the interpreter's numpy warns about)
        return 1.0 - 2.0 / (tl.math.exp2(tl.minimum(x * 2.8853900817779268, 64.0)) + 1.0)


@triton.jit
def _alibi(offs_q, offs_k, slope2, alibi_offset):
    """ALiBi's bias in base 2, to subtract: slope * log2(e) * |i + sk - sq - j|. The row and
    column indices (broadcast vectors) go to fp32 first, so each score costs an add, not an
    integer-to-float conversion (as slow as an exponential on sm90: the MUFU-rate pipe);
    exact below 2^24 positions."""
    return slope2 * tl.abs((offs_q + alibi_offset).to(tl.float32) - offs_k.to(tl.float32))


# Philox4x32's constants (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC
# 2011), run for 7 rounds: the fewest its authors found to pass TestU01's BigCrush (10 is
# their margin), and the count flash-attention's and CK's dropout use.
PHILOX_ROUNDS = tl.constexpr(7)
PHILOX_MUL_A = tl.constexpr(0xD2511F53)
PHILOX_MUL_B = tl.constexpr(0xCD9E8D57)
PHILOX_KEY_A = tl.constexpr(0x9E3779B9)
PHILOX_KEY_B = tl.constexpr(0xBB67AE85)


@triton.jit
def _philox(c0, c1, c2, c3, k0, k1):
    """Philox4x32-7 of the counter (c0, c1, c2, c3) under the key (k0, k1), all uint32: the
    four words. (hopper_fwd's dropout computes the same rounds in PTX.)"""
    for _ in tl.static_range(PHILOX_ROUNDS):
        _c0, _c2 = c0, c2
        c0 = tl.umulhi(_c2, PHILOX_MUL_B) ^ c1 ^ k0
        c2 = tl.umulhi(_c0, PHILOX_MUL_A) ^ c3 ^ k1
        c1 = tl.mul(_c2, PHILOX_MUL_B, sanitize_overflow=False)
        c3 = tl.mul(_c0, PHILOX_MUL_A, sanitize_overflow=False)
        k0 = tl.add(k0, PHILOX_KEY_A, sanitize_overflow=False)
        k1 = tl.add(k1, PHILOX_KEY_B, sanitize_overflow=False)
    return c0, c1, c2, c3


@triton.jit
def _keep(bh, thresh, offs_q, offs_k, seed):
    """Whether (query, key) survives dropout (one broadcast 2-D block; ``offs_q`` and
    ``offs_k`` are positions in the sequence, ``bh`` = batch (or packed sequence) * heads +
    query head). The mask (``reference.dropout_mask`` on the host) is one Philox4x32-7 draw
    per group of eight pairs, queries {i, i + 8} x keys {j, j + 1, j + 8, j + 9} (i, j with
    bit 3 clear, j even): the counter (key group, query group, bh, 0), with groups
    (j >> 4) * 4 + ((j >> 1) & 3) and (i >> 4) * 8 + (i & 7), the key the seed's two 32-bit
    halves (``dropout_key``); the pair takes 16 bits, half (j & 1) of word 2 * (bit 3 of i)
    + (bit 3 of j), and is kept iff they are >= ``thresh`` (dropout_p * 2^16). Each thread
    of a Hopper wgmma accumulator holds whole groups (rows r, r + 8, columns c, c + 1, c + 8,
    c + 9), so the Gluon forward draws once per eight pairs; this kernel draws once per
    pair and picks its bits. The forward, both backward kernels and the Gluon kernels draw
    the same bits."""
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)  # (seed: dropout_key's, an int64)
    k1 = (seed >> 32).to(tl.uint32)
    qg = (((offs_q >> 4) << 3) | (offs_q & 7)).to(tl.uint32)
    kg = (((offs_k >> 4) << 2) | ((offs_k >> 1) & 3)).to(tl.uint32)
    zero = (qg & 0) + (kg & 0)  # the block's shape
    w0, w1, w2, w3 = _philox(kg + zero, qg + zero, zero + bh.to(tl.uint32), zero, k0, k1)
    q8 = (((offs_q >> 3) & 1).to(tl.uint32) + zero) == 1
    k8 = (((offs_k >> 3) & 1).to(tl.uint32) + zero) == 1
    word = tl.where(q8, tl.where(k8, w3, w2), tl.where(k8, w1, w0))
    shift = ((offs_k & 1) * 16).to(tl.uint32) + zero
    return ((word >> shift) & 0xFFFF) >= thresh


@triton.jit
def _slope(SLOPES, stride_slopes_b, off_b, off_h, ALIBI: tl.constexpr):
    """The ALiBi slope of (sequence, query head) times log2(e); 0 without ALiBi."""
    if ALIBI:
        return tl.load(SLOPES + off_b * stride_slopes_b + off_h) * 1.4426950408889634
    else:
        return 0.0


@triton.jit
def _sequence(off_b, CU_Q, CU_K, seqlen_q, seqlen_k, causal_offset, VARLEN: tl.constexpr):
    """(first query row, first key row, seqlen_q, seqlen_k, causal offset) of sequence
    ``off_b``. Varlen: packed sequences, row ranges [CU[b], CU[b + 1]), causal bottom-right
    per sequence; otherwise every sequence starts at row 0 of its batch entry."""
    if VARLEN:
        q_start = tl.load(CU_Q + off_b)
        q_end = tl.load(CU_Q + off_b + 1)
        k_start = tl.load(CU_K + off_b)
        k_end = tl.load(CU_K + off_b + 1)
        return (q_start.to(tl.int64), k_start.to(tl.int64), q_end - q_start, k_end - k_start,
                (k_end - k_start) - (q_end - q_start))  # fmt: skip
    else:
        return 0, 0, seqlen_q, seqlen_k, causal_offset


@triton.jit
def _q_program(CU_Q, CU_K, heads, kv_group, seqlen_q, seqlen_k, causal_offset,
               CAUSAL: tl.constexpr, VARLEN: tl.constexpr, BLOCK_M: tl.constexpr):
    """A program over one Q block (grid: Q blocks x batch * heads): (first row, batch, head,
    kv head) and its sequence's (q start, k start, seqlen_q, seqlen_k, causal offset).
    Causal: the heaviest Q blocks (last rows) start first, so the tail of the grid is light."""
    pid_m = tl.program_id(0)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m
    off_bh = tl.program_id(1) + tl.program_id(2) * tl.num_programs(1)  # (bh_grid)
    off_b = (off_bh // heads).to(tl.int64)
    off_h = (off_bh % heads).to(tl.int64)
    q_start, k_start, seqlen_q, seqlen_k, causal_offset = _sequence(
        off_b, CU_Q, CU_K, seqlen_q, seqlen_k, causal_offset, VARLEN)
    return (pid_m * BLOCK_M, off_b, off_h, off_h // kv_group, q_start, k_start, seqlen_q,
            seqlen_k, causal_offset)  # fmt: skip


@triton.jit
def _stats_row(off_b, off_h, heads, q_start, seqlen_q, total_q, VARLEN: tl.constexpr):
    """Index of a sequence's first row in LSE / delta: (batch, heads, seqlen_q) arrays, or
    (heads, total_q) for packed (varlen) sequences."""
    if VARLEN:
        return off_h.to(tl.int64) * total_q + q_start
    else:
        return (off_b.to(tl.int64) * heads + off_h) * seqlen_q


# --------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------
@triton.jit
def _fwd_inner(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
               offs_m, offs_d, lo, hi, seqlen_q, seqlen_k, causal_offset, left_offset, qk_scale,
               tanh_scale, slope2, alibi_offset,
               drop_bh, dropout_thresh, dropout_p, dropout_seed,
               BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
               HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr,
               CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
               ALIBI: tl.constexpr, DROPOUT: tl.constexpr, MASKED: tl.constexpr,
               PRECISION: tl.constexpr, FP8: tl.constexpr = False):
    """Online softmax over the K/V blocks [lo, hi). SOFTCAP: the raw scores become
    tanh(q.k * tanh_scale) (qk_scale then carries softcap * log2(e)). ALIBI: the scores are
    scaled here and get -slope2 * |i + alibi_offset - j| (base 2)."""
    d_ok = offs_d < HEAD_DIM
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)  # the value / output head dim
    dv_ok = offs_dv < HEAD_DIM_V
    for start_n in tl.range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kt = _load_2d(k_base + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd,
                      offs_n[None, :] < seqlen_k, d_ok[:, None], MASKED, HEAD_DIM != HEAD_DIM_PAD)
        if FP8:  # each wgmma's 32-product sum promoted into fp32: left in the tensor cores'
            # reduced precision over the whole head dim, a score lost ~2^-10 of sum |q_c k_c|
            # at d256 (H200 fuzz), enough to move a near-one-hot softmax by 17%
            qk = tl.dot(q, kt, max_num_imprecise_acc=32)
        else:
            qk = tl.dot(q, kt, input_precision=PRECISION)
        if SOFTCAP:
            qk = _tanh(qk * tanh_scale, PRECISION)
        if ALIBI:  # base-2 scores from here on: the scale folded in, the bias added
            qk = qk * qk_scale - _alibi(offs_m[:, None], offs_n[None, :], slope2, alibi_offset)
            s_scale = 1.0
        else:
            s_scale = qk_scale
        if MASKED:
            keep = _visible(offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, causal_offset,
                            left_offset, CAUSAL, WINDOW)
            qk = tl.where(keep, qk * s_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            # A row with no visible key so far keeps m = -inf: subtract 0 instead (no NaN).
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(qk - m_use[:, None])
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * s_scale)
            m_use = m_new
            p = tl.math.exp2(qk * s_scale - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:  # the normaliser keeps every probability; P @ V only the kept ones
            keep = _keep(drop_bh, dropout_thresh, offs_m[:, None], offs_n[None, :],
                         dropout_seed)  # fmt: skip
            p = tl.where(keep, p * (1.0 / (1.0 - dropout_p)), 0.0)
        v = _load_2d(v_base + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
                     offs_n[:, None] < seqlen_k, dv_ok[None, :], MASKED,
                     HEAD_DIM_V != HEAD_DIM_V_PAD)  # fmt: skip
        if FP8:  # P in e4m3 for P @ V, times 2^8: its large values near 256 (e4m3 reaches 448),
            # its small ones clear of e4m3's underflow (2^-9); the output takes the 2^8 back.
            # The tensor cores sum fp8 products in reduced precision; promoted into the fp32
            # accumulator once per block (max_num_imprecise_acc = BLOCK_N), so the running
            # output over every key block stays an fp32 sum.
            acc = tl.dot((p * 256.0).to(v.dtype), v, acc * alpha[:, None],
                         max_num_imprecise_acc=BLOCK_N)
        else:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _attn_fwd(Q, K, V, O, LSE, CU_Q, CU_K,
              stride_qb, stride_qh, stride_qs, stride_qd,
              stride_kb, stride_kh, stride_ks, stride_kd,
              stride_vb, stride_vh, stride_vs, stride_vd,
              stride_ob, stride_oh, stride_os, stride_od,
              heads, kv_group, seqlen_q, seqlen_k, causal_offset, qk_scale, total_q, SEQ_BUCKET,
              window_left, window_right, tanh_scale, SLOPES, stride_slopes_b, SINK_LOGITS,
              dropout_p, dropout_seed, dropout_thresh,
              DESCALE_Q, DESCALE_K, DESCALE_V, stride_ds_b, stride_ds_h,
              HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, HEAD_DIM_V: tl.constexpr,
              HEAD_DIM_V_PAD: tl.constexpr, CAUSAL: tl.constexpr,
              PRECISION: tl.constexpr, VARLEN: tl.constexpr, WINDOW: tl.constexpr,
              SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, SINKS: tl.constexpr,
              DROPOUT: tl.constexpr, FP8: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start_m, off_b, off_h, off_hk, q_start, k_start, seqlen_q, seqlen_k, causal_offset = (
        _q_program(CU_Q, CU_K, heads, kv_group, seqlen_q, seqlen_k, causal_offset, CAUSAL,
                   VARLEN, BLOCK_M))  # fmt: skip
    if VARLEN:
        if start_m >= seqlen_q:  # the grid covers the longest sequence
            return
    q_base = Q + off_b * stride_qb + q_start * stride_qs + off_h * stride_qh
    k_base = K + off_b * stride_kb + k_start * stride_ks + off_hk * stride_kh
    v_base = V + off_b * stride_vb + k_start * stride_vs + off_hk * stride_vh
    if FP8:  # e4m3 inputs: a stored value times its descale is the real one. q's and k's fold
        # into the scores' scale (the softcap's, with a softcap), v's into the output.
        ds = off_b * stride_ds_b + off_hk * stride_ds_h
        qk_descale = tl.load(DESCALE_Q + ds) * tl.load(DESCALE_K + ds)
        if SOFTCAP:
            tanh_scale = tanh_scale * qk_descale
        else:
            qk_scale = qk_scale * qk_descale

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    m_ok = offs_m < seqlen_q
    d_ok = offs_d < HEAD_DIM
    q = _load_2d(q_base + offs_m[:, None] * stride_qs + offs_d[None, :] * stride_qd,
                 m_ok[:, None], d_ok[None, :], True, HEAD_DIM != HEAD_DIM_PAD)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_V_PAD], dtype=tl.float32)
    if SINKS:  # the head's sink logit joins every row's denominator (it has no value)
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(SINK_LOGITS + off_h).to(
            tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    slope2 = _slope(SLOPES, stride_slopes_b, off_b, off_h, ALIBI)
    alibi_offset = causal_offset  # the bias is bottom-right aligned, whatever the band
    causal_offset, left_offset = _band(causal_offset, window_left, window_right)
    lo, full_lo, full_hi, hi = _kv_ranges(start_m, seqlen_k, causal_offset, left_offset,
                                          BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
    # The sequence's first row in the LSE (and the dropout mask's row numbering).
    row = _stats_row(off_b, off_h, heads, q_start, seqlen_q, total_q, VARLEN)
    drop_bh = off_b * heads + off_h  # the dropout mask's (batch, head)
    if WINDOW:  # keys left of the band's edge (masked)
        acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_base, v_base, stride_ks, stride_kd,
                                   stride_vs, stride_vd, offs_m, offs_d, lo, full_lo,
                                   seqlen_q, seqlen_k, causal_offset, left_offset, qk_scale,
                                   tanh_scale, slope2, alibi_offset, drop_bh, dropout_thresh,
                                   dropout_p, dropout_seed, BLOCK_N, HEAD_DIM,
                                   HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD, CAUSAL, WINDOW,
                                   SOFTCAP, ALIBI, DROPOUT, True,
                                   PRECISION, FP8)
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_base, v_base, stride_ks, stride_kd,
                               stride_vs, stride_vd, offs_m, offs_d, full_lo, full_hi,
                               seqlen_q, seqlen_k, causal_offset, left_offset, qk_scale,
                               tanh_scale, slope2, alibi_offset, drop_bh, dropout_thresh, dropout_p,
                               dropout_seed, BLOCK_N, HEAD_DIM,
                               HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD, CAUSAL, WINDOW, SOFTCAP,
                               ALIBI, DROPOUT, False, PRECISION, FP8)
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_base, v_base, stride_ks, stride_kd,
                               stride_vs, stride_vd, offs_m, offs_d, full_hi, hi,
                               seqlen_q, seqlen_k, causal_offset, left_offset, qk_scale,
                               tanh_scale, slope2, alibi_offset, drop_bh, dropout_thresh, dropout_p,
                               dropout_seed, BLOCK_N, HEAD_DIM,
                               HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD, CAUSAL, WINDOW, SOFTCAP,
                               ALIBI, DROPOUT, True, PRECISION, FP8)

    empty = l_i == 0.0  # rows that saw no key
    l_safe = tl.where(empty, 1.0, l_i)  # (log2 of 0 would be -inf, then replaced anyway)
    acc = acc / l_safe[:, None]
    if FP8:
        acc = acc * (tl.load(DESCALE_V + ds) * (1.0 / 256.0))
    lse2 = tl.where(empty, float("-inf"), m_i + tl.math.log2(l_safe))
    tl.store(LSE + row + offs_m, lse2, mask=m_ok)
    o_base = O + off_b * stride_ob + q_start * stride_os + off_h * stride_oh
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
    tl.store(o_base + offs_m[:, None] * stride_os + offs_dv[None, :] * stride_od,
             acc.to(O.dtype.element_ty), mask=m_ok[:, None] & (offs_dv < HEAD_DIM_V)[None, :])


# --------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------
@triton.jit
def _load_row_stats(LSE, DELTA, offs_m, seqlen_q, MASKED: tl.constexpr):
    """LSE (base 2) and delta for rows ``offs_m``; a row that saw no key gets LSE = +inf so
    that P = 2^(s - lse) = 0 for it."""
    if MASKED:
        lse = tl.load(LSE + offs_m, mask=offs_m < seqlen_q, other=0.0)
        delta = tl.load(DELTA + offs_m, mask=offs_m < seqlen_q, other=0.0)
    else:
        lse = tl.load(LSE + offs_m)
        delta = tl.load(DELTA + offs_m)
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    return lse, delta


@triton.jit
def _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, LSE, DELTA,
                    stride_qs, stride_qd, stride_dos, stride_dod,
                    offs_n, offs_d, lo, hi, seqlen_q, seqlen_k, causal_offset, left_offset,
                    qk_scale, tanh_scale, slope2, alibi_offset,
                    drop_bh, dropout_thresh, dropout_p, dropout_seed,
                    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                    HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr,
                    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                    ALIBI: tl.constexpr, DROPOUT: tl.constexpr, MASKED: tl.constexpr,
                    PRECISION: tl.constexpr):
    """Accumulate dK and dV of one K/V block over the Q blocks [lo, hi) of one head."""
    d_ok = offs_d < HEAD_DIM
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)  # the value / output head dim
    dv_ok = offs_dv < HEAD_DIM_V
    for start_m in tl.range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        qt = _load_2d(q_base + offs_m[None, :] * stride_qs + offs_d[:, None] * stride_qd,
                      offs_m[None, :] < seqlen_q, d_ok[:, None], MASKED, HEAD_DIM != HEAD_DIM_PAD)
        do = _load_2d(do_base + offs_m[:, None] * stride_dos + offs_dv[None, :] * stride_dod,
                      offs_m[:, None] < seqlen_q, dv_ok[None, :], MASKED,
                      HEAD_DIM_V != HEAD_DIM_V_PAD)  # fmt: skip
        lse, delta = _load_row_stats(LSE, DELTA, offs_m, seqlen_q, MASKED)
        qkt = tl.dot(k, qt, input_precision=PRECISION)  # (BLOCK_N, BLOCK_M)
        if SOFTCAP:
            qkt = _tanh(qkt * tanh_scale, PRECISION)
        st = qkt * qk_scale
        if ALIBI:
            st = st - _alibi(offs_m[None, :], offs_n[:, None], slope2, alibi_offset)
        pt = tl.math.exp2(st - lse[None, :])
        if MASKED:
            keep = _visible(offs_m[None, :], offs_n[:, None], seqlen_q, seqlen_k, causal_offset,
                            left_offset, CAUSAL, WINDOW)
            pt = tl.where(keep, pt, 0.0)
        if DROPOUT:  # the forward's mask, regenerated
            kept = _keep(drop_bh, dropout_thresh, offs_m[None, :], offs_n[:, None],
                         dropout_seed)  # fmt: skip
            dv = tl.dot(tl.where(kept, pt * (1.0 / (1.0 - dropout_p)), 0.0).to(do.dtype), do,
                        dv, input_precision=PRECISION)  # fmt: skip
        else:
            dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=PRECISION)
        dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        if DROPOUT:
            dpt = tl.where(kept, dpt * (1.0 / (1.0 - dropout_p)), 0.0)
        dst = pt * (dpt - delta[None, :])
        if SOFTCAP:  # through the tanh: d(softcap tanh(x / softcap)) = 1 - tanh^2
            dst = dst * (1.0 - qkt * qkt)
        dk = tl.dot(dst.to(qt.dtype), tl.trans(qt), dk, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, CU_Q, CU_K,
                   stride_qb, stride_qh, stride_qs, stride_qd,
                   stride_kb, stride_kh, stride_ks, stride_kd,
                   stride_vb, stride_vh, stride_vs, stride_vd,
                   stride_dob, stride_doh, stride_dos, stride_dod,
                   stride_dkb, stride_dkh, stride_dks, stride_dkd,
                   stride_dvb, stride_dvh, stride_dvs, stride_dvd,
                   heads, kv_group, seqlen_q, seqlen_k, causal_offset, qk_scale, sm_scale,
                   total_q, SEQ_BUCKET, window_left, window_right, tanh_scale, SLOPES,
                   stride_slopes_b, SINK_LOGITS, dropout_p, dropout_seed, dropout_thresh,
                   HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                   HEAD_DIM_V_PAD: tl.constexpr, CAUSAL: tl.constexpr,
                   PRECISION: tl.constexpr, VARLEN: tl.constexpr, WINDOW: tl.constexpr,
                   SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, SINKS: tl.constexpr,
                   DROPOUT: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    kv_heads = heads // kv_group
    off_bhk = tl.program_id(1) + tl.program_id(2) * tl.num_programs(1)  # (bh_grid)
    off_b = (off_bhk // kv_heads).to(tl.int64)
    off_hk = (off_bhk % kv_heads).to(tl.int64)
    q_start, k_start, seqlen_q, seqlen_k, causal_offset = _sequence(
        off_b, CU_Q, CU_K, seqlen_q, seqlen_k, causal_offset, VARLEN)
    alibi_offset = causal_offset
    causal_offset, left_offset = _band(causal_offset, window_left, window_right)
    start_n = tl.program_id(0) * BLOCK_N
    if VARLEN:
        if start_n >= seqlen_k:  # the grid covers the longest sequence
            return
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    n_ok = offs_n < seqlen_k
    d_ok = offs_d < HEAD_DIM
    kv_mask = n_ok[:, None] & d_ok[None, :]
    k = tl.load(K + off_b * stride_kb + k_start * stride_ks + off_hk * stride_kh
                + offs_n[:, None] * stride_ks + offs_d[None, :] * stride_kd, mask=kv_mask,
                other=0.0)  # fmt: skip
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)  # the value head dim
    v_mask = n_ok[:, None] & (offs_dv < HEAD_DIM_V)[None, :]
    v = tl.load(V + off_b * stride_vb + k_start * stride_vs + off_hk * stride_vh
                + offs_n[:, None] * stride_vs + offs_dv[None, :] * stride_vd, mask=v_mask,
                other=0.0)  # fmt: skip
    dk = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_V_PAD], dtype=tl.float32)

    # Q blocks: [lo, mid_lo) causal diagonal (masked), [mid_lo, mid_hi) no mask needed,
    # [mid_hi, end) the ragged tail (masked).
    end = tl.cdiv(seqlen_q, BLOCK_M) * BLOCK_M
    if CAUSAL:
        lo = tl.maximum(start_n - causal_offset, 0) // BLOCK_M * BLOCK_M
        first_full = tl.maximum(start_n + BLOCK_N - 1 - causal_offset, 0)
        mid_lo = tl.minimum(tl.cdiv(first_full, BLOCK_M) * BLOCK_M, end)
        mid_lo = tl.maximum(mid_lo, lo)
    else:
        lo = 0
        mid_lo = 0
    mid_hi = tl.maximum(seqlen_q // BLOCK_M * BLOCK_M, mid_lo)
    if WINDOW:
        # Query i sees key j only if i <= j - left_offset: rows past the block's last key
        # minus left_offset see none of it; rows past its first key minus it need the mask.
        mid_hi = tl.maximum(tl.minimum(mid_hi, tl.maximum(start_n - left_offset + 1, 0)
                                       // BLOCK_M * BLOCK_M), mid_lo)  # fmt: skip
        last = tl.maximum(start_n + BLOCK_N - left_offset, 0)
        end = tl.maximum(tl.minimum(end, tl.cdiv(last, BLOCK_M) * BLOCK_M), mid_hi)

    # fp32: each query head of the group sums into fresh accumulators, added to the total
    # after its loop. One sequential fp32 chain over all kv_group * seqlen_q rows (32k for
    # MQA with 8 heads at 4097) grew dK's error to ~3.5x PyTorch's, whose matmul sums one
    # head at a time. fp16/bf16 errors are dominated by input rounding: one chain, fewer
    # registers.
    for g in range(0, kv_group):  # the query heads that share this K/V head (GQA)
        off_h = off_hk * kv_group + g
        q_base = Q + off_b * stride_qb + q_start * stride_qs + off_h * stride_qh
        do_base = DO + off_b * stride_dob + q_start * stride_dos + off_h * stride_doh
        row = _stats_row(off_b, off_h, heads, q_start, seqlen_q, total_q, VARLEN)
        drop_bh = off_b * heads + off_h  # the dropout mask's (batch, head)
        slope2 = _slope(SLOPES, stride_slopes_b, off_b, off_h, ALIBI)
        if PRECISION == "ieee":
            dk_g = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)
            dv_g = tl.zeros([BLOCK_N, HEAD_DIM_V_PAD], dtype=tl.float32)
        else:
            dk_g = dk
            dv_g = dv
        dk_g, dv_g = _bwd_dkdv_inner(dk_g, dv_g, k, v, q_base, do_base, LSE + row, DELTA + row,
                                     stride_qs, stride_qd, stride_dos, stride_dod,
                                     offs_n, offs_d, lo, mid_lo, seqlen_q, seqlen_k,
                                     causal_offset, left_offset, qk_scale, tanh_scale, slope2,
                                     alibi_offset, drop_bh, dropout_thresh, dropout_p, dropout_seed,
                                     BLOCK_M, HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V,
                                     HEAD_DIM_V_PAD, CAUSAL,
                                     WINDOW, SOFTCAP, ALIBI, DROPOUT, True, PRECISION)
        dk_g, dv_g = _bwd_dkdv_inner(dk_g, dv_g, k, v, q_base, do_base, LSE + row, DELTA + row,
                                     stride_qs, stride_qd, stride_dos, stride_dod,
                                     offs_n, offs_d, mid_lo, mid_hi, seqlen_q, seqlen_k,
                                     causal_offset, left_offset, qk_scale, tanh_scale, slope2,
                                     alibi_offset, drop_bh, dropout_thresh, dropout_p, dropout_seed,
                                     BLOCK_M, HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V,
                                     HEAD_DIM_V_PAD, CAUSAL,
                                     WINDOW, SOFTCAP, ALIBI, DROPOUT, False, PRECISION)
        dk_g, dv_g = _bwd_dkdv_inner(dk_g, dv_g, k, v, q_base, do_base, LSE + row, DELTA + row,
                                     stride_qs, stride_qd, stride_dos, stride_dod,
                                     offs_n, offs_d, mid_hi, end, seqlen_q, seqlen_k,
                                     causal_offset, left_offset, qk_scale, tanh_scale, slope2,
                                     alibi_offset, drop_bh, dropout_thresh, dropout_p, dropout_seed,
                                     BLOCK_M, HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V,
                                     HEAD_DIM_V_PAD, CAUSAL,
                                     WINDOW, SOFTCAP, ALIBI, DROPOUT, True, PRECISION)
        if PRECISION == "ieee":
            dk += dk_g
            dv += dv_g
        else:
            dk = dk_g
            dv = dv_g

    dk = dk * sm_scale
    tl.store(DK + off_b * stride_dkb + k_start * stride_dks + off_hk * stride_dkh
             + offs_n[:, None] * stride_dks + offs_d[None, :] * stride_dkd,
             dk.to(DK.dtype.element_ty), mask=kv_mask)  # fmt: skip
    tl.store(DV + off_b * stride_dvb + k_start * stride_dvs + off_hk * stride_dvh
             + offs_n[:, None] * stride_dvs + offs_dv[None, :] * stride_dvd,
             dv.to(DV.dtype.element_ty), mask=v_mask)  # fmt: skip


@triton.jit
def _bwd_dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_kd,
                  stride_vn, stride_vd, offs_m, offs_d, lo, hi, seqlen_q, seqlen_k,
                  causal_offset, left_offset, qk_scale, tanh_scale, slope2, alibi_offset,
                  drop_bh, dropout_thresh, dropout_p, dropout_seed,
                  BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                  HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr,
                  CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                  ALIBI: tl.constexpr, DROPOUT: tl.constexpr, MASKED: tl.constexpr,
                  PRECISION: tl.constexpr):
    """Accumulate dQ of one Q block over the K/V blocks [lo, hi)."""
    d_ok = offs_d < HEAD_DIM
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)  # the value / output head dim
    dv_ok = offs_dv < HEAD_DIM_V
    for start_n in tl.range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kt = _load_2d(k_base + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd,
                      offs_n[None, :] < seqlen_k, d_ok[:, None], MASKED, HEAD_DIM != HEAD_DIM_PAD)
        vt = _load_2d(v_base + offs_n[None, :] * stride_vn + offs_dv[:, None] * stride_vd,
                      offs_n[None, :] < seqlen_k, dv_ok[:, None], MASKED,
                      HEAD_DIM_V != HEAD_DIM_V_PAD)  # fmt: skip
        qk = tl.dot(q, kt, input_precision=PRECISION)
        if SOFTCAP:
            qk = _tanh(qk * tanh_scale, PRECISION)
        s = qk * qk_scale
        if ALIBI:
            s = s - _alibi(offs_m[:, None], offs_n[None, :], slope2, alibi_offset)
        p = tl.math.exp2(s - lse[:, None])
        if MASKED:
            keep = _visible(offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, causal_offset,
                            left_offset, CAUSAL, WINDOW)
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, vt, input_precision=PRECISION)
        if DROPOUT:  # the forward's mask, regenerated
            kept = _keep(drop_bh, dropout_thresh, offs_m[:, None], offs_n[None, :],
                         dropout_seed)  # fmt: skip
            dp = tl.where(kept, dp * (1.0 / (1.0 - dropout_p)), 0.0)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - qk * qk)
        dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), dq, input_precision=PRECISION)
    return dq


@triton.jit
def _attn_bwd_dq(Q, K, V, O, DO, LSE, DELTA, DQ, CU_Q, CU_K,
                 stride_qb, stride_qh, stride_qs, stride_qd,
                 stride_kb, stride_kh, stride_ks, stride_kd,
                 stride_vb, stride_vh, stride_vs, stride_vd,
                 stride_ob, stride_oh, stride_os, stride_od,
                 stride_dob, stride_doh, stride_dos, stride_dod,
                 stride_dqb, stride_dqh, stride_dqs, stride_dqd,
                 heads, kv_group, seqlen_q, seqlen_k, causal_offset, qk_scale, sm_scale,
                 total_q, SEQ_BUCKET, window_left, window_right, tanh_scale, SLOPES,
                 stride_slopes_b, SINK_LOGITS, dropout_p, dropout_seed, dropout_thresh,
                 HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                 HEAD_DIM_V_PAD: tl.constexpr, CAUSAL: tl.constexpr,
                 PRECISION: tl.constexpr, VARLEN: tl.constexpr, WINDOW: tl.constexpr,
                 SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, SINKS: tl.constexpr,
                 DROPOUT: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start_m, off_b, off_h, off_hk, q_start, k_start, seqlen_q, seqlen_k, causal_offset = (
        _q_program(CU_Q, CU_K, heads, kv_group, seqlen_q, seqlen_k, causal_offset, CAUSAL,
                   VARLEN, BLOCK_M))  # fmt: skip
    if VARLEN:
        if start_m >= seqlen_q:  # the grid covers the longest sequence
            return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    m_ok = offs_m < seqlen_q
    d_ok = offs_d < HEAD_DIM
    q_mask = m_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + off_b * stride_qb + q_start * stride_qs + off_h * stride_qh
                + offs_m[:, None] * stride_qs + offs_d[None, :] * stride_qd, mask=q_mask,
                other=0.0)  # fmt: skip
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)  # dO and O have the value head dim
    o_mask = m_ok[:, None] & (offs_dv < HEAD_DIM_V)[None, :]
    do = tl.load(DO + off_b * stride_dob + q_start * stride_dos + off_h * stride_doh
                 + offs_m[:, None] * stride_dos + offs_dv[None, :] * stride_dod, mask=o_mask,
                 other=0.0)  # fmt: skip
    o = tl.load(O + off_b * stride_ob + q_start * stride_os + off_h * stride_oh
                + offs_m[:, None] * stride_os + offs_dv[None, :] * stride_od, mask=o_mask,
                other=0.0)  # fmt: skip
    # delta = rowsum(dO * O): this kernel runs first and leaves it for the dK/dV kernel.
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    row = _stats_row(off_b, off_h, heads, q_start, seqlen_q, total_q, VARLEN)
    drop_bh = off_b * heads + off_h  # the dropout mask's (batch, head)
    tl.store(DELTA + row + offs_m, delta, mask=m_ok)
    lse = tl.load(LSE + row + offs_m, mask=m_ok, other=0.0)
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    k_base = K + off_b * stride_kb + k_start * stride_ks + off_hk * stride_kh
    v_base = V + off_b * stride_vb + k_start * stride_vs + off_hk * stride_vh

    dq = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    slope2 = _slope(SLOPES, stride_slopes_b, off_b, off_h, ALIBI)
    alibi_offset = causal_offset
    causal_offset, left_offset = _band(causal_offset, window_left, window_right)
    lo, full_lo, full_hi, hi = _kv_ranges(start_m, seqlen_k, causal_offset, left_offset,
                                          BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
    if WINDOW:
        dq = _bwd_dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_ks, stride_kd,
                           stride_vs, stride_vd, offs_m, offs_d, lo, full_lo, seqlen_q,
                           seqlen_k, causal_offset, left_offset, qk_scale, tanh_scale, slope2,
                           alibi_offset, drop_bh, dropout_thresh, dropout_p, dropout_seed, BLOCK_N,
                           HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V,
                           HEAD_DIM_V_PAD, CAUSAL, WINDOW,
                           SOFTCAP, ALIBI, DROPOUT, True, PRECISION)
    dq = _bwd_dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_ks, stride_kd,
                       stride_vs, stride_vd, offs_m, offs_d, full_lo, full_hi, seqlen_q,
                       seqlen_k, causal_offset, left_offset, qk_scale, tanh_scale, slope2,
                       alibi_offset, drop_bh, dropout_thresh, dropout_p, dropout_seed, BLOCK_N,
                       HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD,
                       CAUSAL, WINDOW, SOFTCAP,
                       ALIBI, DROPOUT, False, PRECISION)
    dq = _bwd_dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_ks, stride_kd,
                       stride_vs, stride_vd, offs_m, offs_d, full_hi, hi, seqlen_q,
                       seqlen_k, causal_offset, left_offset, qk_scale, tanh_scale, slope2,
                       alibi_offset, drop_bh, dropout_thresh, dropout_p, dropout_seed, BLOCK_N,
                       HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD,
                       CAUSAL, WINDOW, SOFTCAP,
                       ALIBI, DROPOUT, True, PRECISION)
    dq = dq * sm_scale
    tl.store(DQ + off_b * stride_dqb + q_start * stride_dqs + off_h * stride_dqh
             + offs_m[:, None] * stride_dqs + offs_d[None, :] * stride_dqd,
             dq.to(DQ.dtype.element_ty), mask=q_mask)  # fmt: skip


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------
def _empty(batch, heads, seqlen, dim, layout, like: torch.Tensor,
           dtype: torch.dtype | None = None) -> torch.Tensor:
    shape = (batch, heads, seqlen, dim) if layout == "bhsd" else (batch, seqlen, heads, dim)
    return torch.empty(shape, dtype=dtype or like.dtype, device=like.device)


# (kernel, device, dtype, HEAD_DIM_PAD, CAUSAL, SEQ_BUCKET) -> the autotuner's choice. Looked up
# here rather than through triton's Autotuner.run, whose per-call key building over ~40
# arguments costs tens of microseconds: the whole kernel time of a small problem.
_chosen: dict[tuple, tuple[dict, int, int]] = {}


def _launch(kernel_fn, name: str, grid, t: torch.Tensor, head_dim_pad: int, **args):
    """Launch ``kernel_fn`` with the pinned/default config, or autotuned on the GPU.
    Returns (kernel_fn, compiled kernel, grid, arguments) when the launch went through
    ``FastLauncher`` (what a :class:`~diyfa._launcher.Replay` records), else None.

    A config that does not fit the GPU (Triton's OutOfResources, found at compile time before
    anything runs: e.g. fp32 tiles at head_dim 256) steps down through ``tuning.FALLBACKS``;
    what worked is remembered per key. Once a key has its config, GPU launches go through
    ``FastLauncher`` (see diyfa/_launcher.py), which skips Triton's per-call binding.
    """
    autotune = tuning.autotune_enabled()
    key = (name, autotune, t.device.index, t.dtype, head_dim_pad, args["CAUSAL"],
           args["SEQ_BUCKET"], args["VARLEN"], args["WINDOW"], args["SOFTCAP"], args["ALIBI"],
           args["SINKS"], args["HEAD_DIM_V_PAD"], args["DROPOUT"],
           args.get("FP8", False))  # fmt: skip
    pinned = name in tuning._pinned
    choice = None if pinned else _chosen.get(key)
    if choice is None and autotune and not pinned and t.is_cuda:
        # A winner an earlier process found on this GPU (tuning.cached_choice).
        disk_key = key + (torch.cuda.get_device_name(t.device),)
        choice = tuning.cached_choice(disk_key)
        if choice is not None:
            _chosen[key] = choice
    if choice is not None and t.is_cuda:
        meta, num_warps, num_stages = choice
        g = grid(meta)
        kernel = fast_launch(kernel_fn, g, args, meta, num_warps, num_stages)
        return None if compiling_only() else (kernel_fn, kernel, g, {**args, **meta})
    if choice is None:
        if autotune and not pinned and t.is_cuda:
            limits = kernel_limits(t.device.index)
            tuned = tuning.autotuned(kernel_fn, name, head_dim_pad, t.element_size(),
                                     limits["max_shared_mem"], limits["capability_major"])
            try:
                tuned[grid](**args)  # benchmarks every config once, then runs the best
                best = tuned.best_config
                _chosen[key] = (dict(best.kwargs), best.num_warps, best.num_stages)
                tuning.remember_choice(disk_key, *_chosen[key])
                return None
            except OutOfResources:
                pass  # every candidate was too large: fall back below
        major = kernel_limits(t.device.index)["capability_major"] if t.is_cuda else None
        cfg = tuning.default_config(name, head_dim_pad, major, t.element_size())
        choice = ({"BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"]}, cfg["num_warps"],
                  cfg["num_stages"])  # fmt: skip
    candidates = [choice] + [({"BLOCK_M": bm, "BLOCK_N": bn}, w, st)
                             for bm, bn, w, st in tuning.FALLBACKS
                             if bm * bn < choice[0]["BLOCK_M"] * choice[0]["BLOCK_N"]
                             and (bn >= 32 or not args.get("FP8"))]  # fp8 dots: K >= 32
    for i, (meta, num_warps, num_stages) in enumerate(candidates):
        try:
            if compiling_only():  # diyfa.attention.prefetch's worker: compile, run nothing
                compile_kernel(kernel_fn, grid(meta), {**args, **meta}, num_warps, num_stages)
            else:
                kernel_fn[grid(meta)](**args, **meta, num_warps=num_warps,
                                      num_stages=num_stages)  # fmt: skip
        except OutOfResources:
            if i == len(candidates) - 1:
                raise
            continue
        if not pinned:
            _chosen[key] = (meta, num_warps, num_stages)
        return None


# The tensor-free part of _common's arguments for problems without packed sequences, ALiBi,
# sinks or dropout (what a training or inference loop repeats), by the problem fields it reads.
_common_cache: dict[tuple, dict] = {}
_PLACEHOLDERS = ("CU_Q", "CU_K", "SLOPES", "SINK_LOGITS")


def _common(problem: Problem, stats: torch.Tensor) -> dict:
    """Arguments every kernel takes, from the problem. ``stats`` (the LSE) stands in for the
    cumulative lengths, slopes and sinks a problem does not have (the kernels never read
    them). Cached for problems without tensors of their own (~2 us a call saved)."""
    p = problem
    key = None
    if (p.cu_seqlens_q is None and p.alibi_slopes is None and p.sinks is None
            and p.dropout_p == 0):  # fmt: skip
        key = (p.heads, p.kv_heads, p.seqlen_q, p.seqlen_k, p.causal_offset, p.softmax_scale,
               p.head_dim, p.head_dim_v, p.causal, p.window_left, p.window_right, p.softcap,
               p.dtype, p.total_q, p.dropout_seed)  # fmt: skip
        args = _common_cache.get(key)
        if args is not None:
            args = args.copy()
            for name in _PLACEHOLDERS:
                args[name] = stats
            return args
    args = _build_common(p, stats)
    if key is not None:
        if len(_common_cache) >= 4096:
            _common_cache.clear()
        _common_cache[key] = args.copy()  # (its placeholders are replaced on every hit)
    return args


def _build_common(problem: Problem, stats: torch.Tensor) -> dict:
    """_common's arguments, built."""
    p = problem
    d = p.head_dim
    varlen = p.cu_seqlens_q is not None
    args = dict(
        heads=p.heads, kv_group=p.kv_group, seqlen_q=p.seqlen_q, seqlen_k=p.seqlen_k,
        causal_offset=p.causal_offset, qk_scale=p.softmax_scale * LOG2E, HEAD_DIM=d,
        HEAD_DIM_PAD=max(16, next_power_of_2(d)), HEAD_DIM_V=p.head_dim_v,
        HEAD_DIM_V_PAD=max(16, next_power_of_2(p.head_dim_v)),
        CAUSAL=p.causal or p.window_right >= 0,
        PRECISION="ieee" if p.dtype == torch.float32 else "tf32",
        CU_Q=p.cu_seqlens_q if varlen else stats, CU_K=p.cu_seqlens_k if varlen else stats,
        total_q=p.total_q, VARLEN=varlen,
        # The band: causal is a right window of 0; a side of -1 is unbounded (its flag off).
        window_left=max(p.window_left, 0), window_right=0 if p.causal else max(p.window_right, 0),
        WINDOW=p.window_left >= 0,
        # Softcap: scores softcap * tanh(q.k * scale / softcap); qk_scale carries the softcap.
        SOFTCAP=p.softcap > 0, tanh_scale=p.softmax_scale / p.softcap if p.softcap > 0 else 1.0,
        # ALiBi slopes ((heads,) or (batch, heads) fp32) and attention sinks ((heads,)); the
        # LSE stands in for an absent tensor (never read).
        ALIBI=p.alibi_slopes is not None,
        SLOPES=p.alibi_slopes if p.alibi_slopes is not None else stats,
        stride_slopes_b=(p.alibi_slopes.stride(0) if p.alibi_slopes is not None
                         and p.alibi_slopes.dim() == 2 else 0),
        SINKS=p.sinks is not None, SINK_LOGITS=p.sinks if p.sinks is not None else stats,
        # Dropout: Philox per group of (query, key) pairs with the call's seed (_keep).
        DROPOUT=p.dropout_p > 0, dropout_p=p.dropout_p, dropout_seed=dropout_key(p.dropout_seed),
        dropout_thresh=dropout_threshold(p.dropout_p),
    )  # fmt: skip
    if p.softcap > 0:
        args["qk_scale"] = p.softcap * LOG2E
    return args


def dropout_key(seed: int) -> int:
    """The Philox key the kernels get for a call's dropout seed: in [2^32, 2^62), so that
    Triton never compiles it as a 32-bit or constant argument (1 would be a constexpr); the
    key's halves are its low and high 32 bits (``reference.dropout_mask`` maps the same)."""
    return 2**32 + seed % (2**62 - 2**32)


def dropout_threshold(dropout_p: float) -> int:
    """The kernels' dropout threshold: a pair is dropped when its 16 Philox bits are below
    round(dropout_p * 2^16), so kept with probability 1 - dropout_p to within 2^-17 (the
    kept values are scaled by 1 / (1 - dropout_p) itself: a bias of at most 2^-17 / (1 -
    dropout_p) in the output's expectation; flash-attention's 8-bit threshold has up to
    2^-9)."""
    return min(round(dropout_p * 2**16), 2**16 - 1)


def _strides(t: torch.Tensor, problem: Problem) -> tuple[int, int, int, int]:
    """Strides of an output-like tensor in (batch, heads, seqlen, dim) order; packed (varlen)
    tensors are (total, heads, dim), their sequences addressed by row offsets (batch 0)."""
    if problem.cu_seqlens_q is not None:
        return (0, t.stride(1), t.stride(0), t.stride(2))
    return bhsd_strides(t, problem.layout)


def _outputs(q, problem: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty (out, lse2): (batch, heads, seqlen_q) LSE, or (heads, total_q) when packed."""
    p = problem
    if p.cu_seqlens_q is not None:
        out = torch.empty((p.total_q, p.heads, p.head_dim_v), dtype=q.dtype, device=q.device)
        return out, torch.empty((p.heads, p.total_q), dtype=torch.float32, device=q.device)
    out = _empty(p.batch, p.heads, p.seqlen_q, p.head_dim_v, p.layout, q, p.out_dtype)
    return out, torch.empty((p.batch, p.heads, p.seqlen_q), dtype=torch.float32,
                            device=q.device)  # fmt: skip


def empty_lse(lse2: torch.Tensor, problem: Problem) -> torch.Tensor:
    """The base-2 LSE of rows that see no key, in place: -inf, or the head's sink logit times
    log2(e) with sinks (the sink alone is in the denominator; its gradient is then 0, not
    NaN). ``lse2`` is (batch, heads, seqlen_q), or (heads, total_q) when packed."""
    if problem.sinks is None:
        return lse2.fill_(float("-inf"))
    return lse2.copy_((problem.sinks.float() * LOG2E)[:, None])  # (heads, 1), broadcast


@triton.jit
def _sink_grad(LSE, DELTA, SINKS, DSINKS, batch, seqlen, stride_b, stride_h,
               BLOCK: tl.constexpr):
    """dL/dsinks of one head (program h): -sum over its rows of 2^(sink * log2(e) - lse2) *
    delta, rows in a fixed order (deterministic). LSE and DELTA share their strides: (batch,
    heads, seqlen) or, packed, (heads, total) with stride_b 0 and batch 1."""
    h = tl.program_id(0)
    sink2 = tl.load(SINKS + h).to(tl.float32) * 1.4426950408889634
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for b in range(batch):
        base = h.to(tl.int64) * stride_h + b * stride_b  # (the LSE: < 2^31 floats)
        for start in range(0, seqlen, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            ok = offs < seqlen
            lse = tl.load(LSE + base + offs, mask=ok, other=0.0)
            delta = tl.load(DELTA + base + offs, mask=ok, other=0.0)
            acc += tl.where(ok, tl.exp2(sink2 - lse) * delta, 0.0)
    tl.store(DSINKS + h, (-tl.sum(acc, axis=0)).to(DSINKS.dtype.element_ty))


def sink_grad(lse2: torch.Tensor, delta: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The sinks' gradient, (heads,) in their dtype, from the base-2 LSE and the backward's
    delta = rowsum(dO * O) (same shape and strides: (batch, heads, seqlen_q), or (heads,
    total_q) when packed) by one small kernel (:func:`_sink_grad`; it replaces six PyTorch
    ops, ~40 us of host time per backward)."""
    dsinks = torch.empty_like(sinks)
    heads = sinks.shape[0]
    if heads == 0:
        return dsinks
    packed = lse2.dim() == 2
    args = dict(LSE=lse2, DELTA=delta, SINKS=sinks, DSINKS=dsinks,
                batch=1 if packed else lse2.shape[0], seqlen=lse2.shape[-1],
                stride_b=0 if packed else lse2.stride(0), stride_h=lse2.stride(-2),
                BLOCK=1024)  # fmt: skip
    launch_recorded(_sink_grad, (heads,), args, lse2.is_cuda)
    return dsinks


def _attention_forward(q, k, v, problem: Problem):
    """Run the forward kernel. Returns (out, lse2) with lse2 in base 2, (batch, heads,
    seqlen_q), or (heads, total_q) for packed sequences (``problem.cu_seqlens_q``). For
    packed sequences seqlen_q / seqlen_k are the longest ones (the grid's extent)."""
    p = problem
    b, h, sq, sk = p.batch, p.heads, p.seqlen_q, p.seqlen_k
    out, lse2 = _outputs(q, p)
    if sk == 0:  # nothing to attend to (but the sinks, which join the LSE)
        out.zero_()
        return out, empty_lse(lse2, p)
    if sq == 0 or b * h == 0:
        return out, lse2
    key = replay_key("fwd", q, p)
    roles = None
    if key is not None:
        roles = own_roles(dict(q=q, k=k, v=v, out=out, lse=lse2), p)
        replay = _REPLAYS.get(key)
        if replay is not None and replay.run(roles):
            return out, lse2
    common = _common(p, lse2)

    def grid(meta):
        return bh_grid(cdiv(sq, meta["BLOCK_M"]), b, h)

    if p.descales is None:
        fp8 = dict(DESCALE_Q=lse2, DESCALE_K=lse2, DESCALE_V=lse2, stride_ds_b=0,
                   stride_ds_h=0, FP8=False)  # fmt: skip
    else:  # (1,) per tensor, or contiguous (batch, kv_heads) (checks.check_fp8_inputs)
        # 8-bit dots need K >= 32 on the GPU: head dims pad to at least 32 (P @ V's K is
        # BLOCK_N, at least 32 in every fp8 config: tuning.FALLBACKS' smaller ones are
        # skipped below).
        common["HEAD_DIM_PAD"] = max(32, common["HEAD_DIM_PAD"])
        common["HEAD_DIM_V_PAD"] = max(32, common["HEAD_DIM_V_PAD"])
        dq_, dk_, dv_ = p.descales
        per_head = dq_.dim() == 2
        fp8 = dict(DESCALE_Q=dq_, DESCALE_K=dk_, DESCALE_V=dv_,
                   stride_ds_b=p.kv_heads if per_head else 0, stride_ds_h=1 if per_head else 0,
                   FP8=True)  # fmt: skip
    launched = _launch(_attn_fwd, "attn_fwd", grid, q, common["HEAD_DIM_PAD"],
                       Q=q, K=k, V=v, O=out, LSE=lse2,
                       **_named("q", p.q_strides), **_named("k", p.k_strides),
                       **_named("v", p.v_strides), **_named("o", _strides(out, p)),
                       SEQ_BUCKET=tuning.seq_bucket(sq, sk), **fp8, **common)  # fmt: skip
    if roles is not None and launched is not None:
        _REPLAYS.put(key, Replay.record([launched], roles))
    return out, lse2


# Launches kept per signature (_launcher.Replay): a training or inference loop repeats one
# problem, whose arguments and specialisation keys need building only once.
_REPLAYS = ReplayCache()


def replay_key(kind: str, q: torch.Tensor, problem: Problem, *extra) -> tuple | None:
    """The signature under which a call's launches are kept (``kind`` names the launch
    sequence; ``extra``: what else the arguments depend on, e.g. dO's strides), or None
    where they are not: off the GPU, and for problems with per-call work of their own
    (packed sequences' lengths, fp8's operands, a per-call dropout seed). Sinks and ALiBi
    slopes are the call's own tensors: the key holds their dtype, shape and strides, and
    the replay takes them as roles (:func:`own_roles`)."""
    p = problem
    if not q.is_cuda or not (p.cu_seqlens_q is None and p.descales is None
                             and p.dropout_p == 0):  # fmt: skip
        return None
    if p.sinks is None and p.alibi_slopes is None:
        return (kind, p, tuning.autotune_enabled(), *extra)
    own = tuple(None if t is None else (t.dtype, t.shape, t.stride())
                for t in (p.sinks, p.alibi_slopes))  # fmt: skip
    return (kind, p.without_own_tensors(), tuning.autotune_enabled(), own, *extra)


def own_roles(roles: dict, problem: Problem) -> dict:
    """``roles`` with the call's own tensors (sinks, ALiBi slopes) added, for a replay."""
    if problem.sinks is not None:
        roles["sinks"] = problem.sinks
    if problem.alibi_slopes is not None:
        roles["slopes"] = problem.alibi_slopes
    return roles


_STRIDE_NAMES = {p: tuple(f"stride_{p}{axis}" for axis in "bhsd")
                 for p in ("q", "k", "v", "o", "do", "dq", "dk", "dv")}  # fmt: skip


def _named(prefix: str, strides) -> dict:
    """{"stride_qb": ..., "stride_qh": ..., ...} for tensor ``prefix`` (a literal: twice as fast
    as dict(zip(...)) on this per-call path)."""
    n = _STRIDE_NAMES[prefix]
    return {n[0]: strides[0], n[1]: strides[1], n[2]: strides[2], n[3]: strides[3]}


def backward_dq(do, q, k, v, out, lse2, problem: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the dQ kernel, which also computes delta = rowsum(dO * O) for its rows. Returns
    (dq, delta); delta is shaped like ``lse2``. The caller has handled empty problems."""
    dq, delta = torch.empty_like(q), torch.empty_like(lse2)
    _dq_launch(do, q, k, v, out, lse2, dq, delta, problem)
    return dq, delta


def _dq_launch(do, q, k, v, out, lse2, dq, delta, problem: Problem):
    """Launch the dQ kernel into ``dq`` and ``delta``; returns what :func:`_launch` does."""
    p = problem
    common = _common(p, lse2)

    def grid_dq(meta):
        return bh_grid(cdiv(p.seqlen_q, meta["BLOCK_M"]), p.batch, p.heads)

    return _launch(_attn_bwd_dq, "attn_bwd_dq", grid_dq, q, common["HEAD_DIM_PAD"],
                   Q=q, K=k, V=v, O=out, DO=do, LSE=lse2, DELTA=delta, DQ=dq,
                   **_named("q", p.q_strides), **_named("k", p.k_strides),
                   **_named("v", p.v_strides), **_named("do", _strides(do, p)),
                   **_named("o", _strides(out, p)), **_named("dq", _strides(dq, p)),
                   sm_scale=p.softmax_scale,
                   SEQ_BUCKET=tuning.seq_bucket(p.seqlen_q, p.seqlen_k), **common)  # fmt: skip


def _attention_backward(do, q, k, v, out, lse2, problem: Problem, delta_out=None):
    """Run the two backward kernels. Returns (dq, dk, dv). Deterministic whatever
    ``problem.deterministic`` says: no atomics. ``delta_out``: an fp32 tensor shaped like
    ``lse2`` that receives rowsum(dO * O) (the family contract, dispatch.py)."""
    p = problem
    b, h, hk, sq, sk = p.batch, p.heads, p.kv_heads, p.seqlen_q, p.seqlen_k
    if sq == 0 or sk == 0 or b * h == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if 0 in do.stride():  # e.g. the expanded gradient of out.sum(): as the Hopper backward
        # does, one dense copy. The kernels are then specialised as for a training loop's dO
        # (prefetch.py compiles them during the forward on a dense stand-in).
        do = do.contiguous()
    dq = torch.empty_like(q)
    delta = torch.empty_like(lse2) if delta_out is None else delta_out
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    key = replay_key("bwd", q, p, do.stride(), do.dtype)
    roles = None
    if key is not None:
        roles = own_roles(dict(q=q, k=k, v=v, out=out, lse=lse2, do=do, dq=dq, delta=delta,
                               dk=dk, dv=dv), p)  # fmt: skip
        replay = _REPLAYS.get(key)
        if replay is not None and replay.run(roles):
            return dq, dk, dv
    # dQ first: it also writes delta = rowsum(dO * O), which dK/dV reads.
    launched_dq = _dq_launch(do, q, k, v, out, lse2, dq, delta, p)
    common = _common(p, lse2)

    def grid_dkdv(meta):
        return bh_grid(cdiv(sk, meta["BLOCK_N"]), b, hk)

    launched = _launch(_attn_bwd_dkdv, "attn_bwd_dkdv", grid_dkdv, q, common["HEAD_DIM_PAD"],
                       Q=q, K=k, V=v, DO=do, LSE=lse2, DELTA=delta, DK=dk, DV=dv,
                       **_named("q", p.q_strides), **_named("k", p.k_strides),
                       **_named("v", p.v_strides), **_named("do", _strides(do, p)),
                       **_named("dk", _strides(dk, p)), **_named("dv", _strides(dv, p)),
                       sm_scale=p.softmax_scale, SEQ_BUCKET=tuning.seq_bucket(sq, sk),
                       **common)  # fmt: skip
    if roles is not None and launched_dq is not None and launched is not None:
        _REPLAYS.put(key, Replay.record([launched_dq, launched], roles))
    return dq, dk, dv


def compile_for_hopper(kernel: str, dtype: torch.dtype = torch.bfloat16, num_warps: int = 4,
                       num_stages: int = 2, **args):
    """Compile one of the kernels ("attn_fwd", "attn_bwd_dq", "attn_bwd_dkdv") for sm90a
    without a GPU (Triton bundles ptxas); returns Triton's ``CompiledKernel``. ``args`` set
    constexprs and scalars over a plain causal d128 problem with 64 x 64 blocks; tensors are
    placeholders of ``dtype`` (statistics fp32, offsets int32). Run it in a process that has
    not run kernels under the interpreter (which leaves Triton's language module patched)."""
    from diyfa._compile import compile_for_sm90

    fn = {"attn_fwd": _attn_fwd, "attn_bwd_dq": _attn_bwd_dq, "attn_bwd_dkdv": _attn_bwd_dkdv}
    stats, offsets = torch.empty(16), torch.empty(16, dtype=torch.int32)
    base = dict(LSE=stats, DELTA=stats, SLOPES=stats, CU_Q=offsets, CU_K=offsets, qk_scale=0.5,
                sm_scale=0.5, tanh_scale=1.0, dropout_p=0.0, dropout_seed=3, HEAD_DIM=128,
                HEAD_DIM_PAD=128, HEAD_DIM_V=128, HEAD_DIM_V_PAD=128, CAUSAL=True,
                PRECISION="ieee" if dtype == torch.float32 else "tf32", VARLEN=False,
                WINDOW=False, SOFTCAP=False, ALIBI=False, SINKS=False, DROPOUT=False,
                FP8=False, DESCALE_Q=stats, DESCALE_K=stats, DESCALE_V=stats,
                BLOCK_M=64, BLOCK_N=64)  # fmt: skip
    if dtype == torch.float8_e4m3fn:  # fp8 inputs give a bf16 output
        base.update(FP8=True, O=torch.empty(16, dtype=torch.bfloat16))
    base.update(args)
    values = {p.name: base.get(p.name, torch.empty(16, dtype=dtype) if p.name.isupper() else 17)
              for p in fn[kernel].params}  # fmt: skip
    return compile_for_sm90(fn[kernel], values, num_warps, num_stages)


# --------------------------------------------------------------------------------------------
# The family
# --------------------------------------------------------------------------------------------
MAX_GRID_Y = 65535  # CUDA's limit on a grid's second and third axes


@functools.lru_cache(maxsize=256)
def _bh_split(batch: int, heads: int, limit: int) -> int | None:
    """The largest divisor ``a`` of ``batch`` with heads x a and batch / a within ``limit``
    each, or None where there is none (a prime batch past the limit, say)."""
    if heads > limit:
        return None
    if batch == 0:
        return 1
    for a in range(min(batch, limit // heads), 0, -1):
        if batch % a == 0:
            return a if batch // a <= limit else None
    return None


def bh_grid(blocks: int, batch: int, heads: int) -> tuple[int, int, int]:
    """The grid (blocks, heads x a, batch / a) of ``blocks`` programs per (batch, head) pair:
    the pairs over the second and third axes, where CUDA allows MAX_GRID_Y each (``a``:
    :func:`_bh_split`; the whole batch on the second axis while batch x heads fits there, so
    the order of the programs is then the plain (blocks, batch x heads) one). The kernels read
    pair program_id(1) + program_id(2) x num_programs(1): every program has one, no guard."""
    a = _bh_split(batch, heads, MAX_GRID_Y)
    if a is None:
        raise ValueError(_too_many_pairs(batch, heads))
    return blocks, heads * a, batch // a


def _too_many_pairs(batch: int, heads: int) -> str:
    return (f"batch {batch} x heads {heads}: no split of the pairs over two grid axes of at most "
            f"{MAX_GRID_Y} programs (the batch needs a divisor a with heads x a and batch / a "
            "both within it)")


def _supports(problem: Problem) -> str | None:
    """Everything that passed diyfa.attention.checks runs here, up to CUDA's grid limits
    (:func:`bh_grid`)."""
    for heads in {problem.heads, problem.kv_heads}:
        if _bh_split(problem.batch, heads, MAX_GRID_Y) is None:
            return _too_many_pairs(problem.batch, heads)
    return None


FAMILY = Family("portable", supports=_supports, forward=_attention_forward,
                backward=_attention_backward)
