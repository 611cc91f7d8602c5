"""The Hopper backward at head dims 129..256 (computed as 256) in Gluon: the head dim split
between the two consumer warpgroups.

At d256 the d128 kernel's division (``hopper_bwd``: each consumer owns 64 keys and all of
their dK and dV) needs 2 x 64 x 256 fp32 accumulators per warpgroup, 256 registers per
thread before anything else. Here, as FlashAttention-3 divides its d256 backward, a program
owns ``BLOCK_N`` = 64 keys of one (batch, kv head) and each consumer warpgroup owns one
128-column half of their dK and dV (128 registers per thread for both); the scores are
divided the other way, by query rows, and the two halves meet in shared memory:

    consumer c, step (query head, block of BLOCK_M = 64 query rows), rows r_c = the block's
    32 rows [32 c, 32 c + 32):
        S^T_c  = K Q[r_c]^T             (64 keys x 32 rows, all 256 columns of K)
        dP^T_c = V dO[r_c]^T            (issued right after S^T_c)
        P^T_c  = exp2(S^T_c * scale * log2(e) - lse), dS^T_c = P^T_c * (dP^T_c - delta)
        P^T_c, dS^T_c -> columns r_c of the step's shared (64 keys, 64 rows) P^T and dS^T
                                        (both consumers arrive on ``pds_ready``, then wait)
        dV[:, half c] += P^T dO[:, half c]     (both from shared memory)
        dQ[:, half c]  = dS K[:, half c]       (atomic dQ mode: dS^T's transposed view; two
                                                 64-column pieces, each added to the fp32
                                                 workspace by a TMA reduce-add)
        dK[:, half c] += dS^T Q[:, half c]

    Every key of the block is in both consumers' products, so no reduction over consumers
    is needed anywhere; the price is a shared-memory round trip for P^T and dS^T (8 KB each
    per step) and n32 score products (their K operand re-read per 32 rows).

    Shared memory (bf16/fp16): K and V 32 KB each; Q in two stages (32 KB each, with their
    rows' LSE and delta); dO in one stage (its last reader, dV, comes early in a step: the
    next block's dO loads while dK and dQ run; FlashAttention-3 keeps one dO stage at d256
    too); P^T and dS^T in two buffers each (8 KB), alternating by step; the atomic dQ's fp32
    staging, one 64 x 64 tile per consumer (16 KB). 224 KB in all.

    The buffer rules: the loader refills a Q stage after both consumers' dK of it is done
    (``q_empty``) and dO after both consumers' dV (``do_empty``); P^T / dS^T buffer ``it %
    2`` is written again at step ``it + 2`` only after the writer has passed step ``it +
    1``'s ``pds_ready``, which the partner reaches after its step-``it`` products (their
    waits); the epilogue writes each consumer's dK and dV through its own column half of
    the K and V buffers (the partner's last reads of the whole of K and V, its S^T and
    dP^T, precede its last ``pds_ready`` arrival; its dQ reads only its own half of K).

Scope (``hopper_bwd.supports``): what the d128 kernel takes, at head dims 129..256 (GQA/MQA,
causal bottom-right, sinks: they are in the LSE; a window, softcap, ALiBi, packed sequences,
as ``hopper_bwd``'s kernel takes them), and a value head dim of its own above 64 (V, dO and
dV computed at its padded width, 128 or 256: each consumer's dV half as wide as half of it;
DeepSeek MLA's 192 / 128). Both dQ modes: the atomic one (dQ added by TMA reduce-adds, as in
``hopper_bwd``) and the deterministic one (the portable dQ kernel first, this kernel for dK
and dV only), the default here, faster at every point measured
(``hopper_bwd.WIDE_DQ_ATOMIC``; docs/attention.md, "Head dims above 128").
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from diyfa.attention.hopper_bwd import (
    BWD_CONFIGS,
    _kv_program,
    _probs_t,
    _stats_async,
    _store_rows,
    _tma_reduce_add,
    compile_setup,
    l2_row_bytes,
    place_work,
)
from diyfa.attention.hopper_fwd import (
    LOG2E,
    _desc,
    _dropout,
    _key_group,
    _tile2d,
    head_dim_pad,
)

BLOCK_N = 64  # keys per program, shared by both consumers
DQ_PIECE = 64  # columns of one dQ piece (one fp32 staging tile, one TMA reduce-add)


@gluon.jit
def _loader(q_desc, do_desc, k_desc, v_desc, LSE, DELTA, q_bufs, do_bufs, k_bufs, v_bufs,
            lse_bufs, delta_bufs, kv_ready, q_ready, q_empty, do_ready, do_empty, heads,
            kv_group, seqlen_q, seqlen_k, total_q, causal_offset, left_offset, CU_Q, CU_K,
            TILES, section, CAUSAL: gl.constexpr, WINDOW: gl.constexpr, VARLEN: gl.constexpr):
    """The loader warp: K and V once, then per step Q (with its rows' LSE and delta) into
    the Q ring and dO into its stage(s)."""
    BLOCK_M: gl.constexpr = q_bufs.type.shape[3]
    BLOCK_N: gl.constexpr = k_bufs.type.shape[3]
    STAGES: gl.constexpr = q_bufs.type.shape[0]
    DO_STAGES: gl.constexpr = do_bufs.type.shape[0]
    n0, tb, _b, off_hk, m_lo, num_m, q_start, k_start, seqlen_rows, _sk, _co = _kv_program(
        heads, kv_group, seqlen_q, seqlen_k, causal_offset, left_offset, CU_Q, CU_K, TILES,
        section, BLOCK_M, BLOCK_N, CAUSAL, WINDOW, VARLEN)
    offs = gl.arange(0, BLOCK_M, layout=gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0]))
    mbarrier.expect(kv_ready.index(0), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [tb, off_hk, k_start + n0, 0], kv_ready.index(0),
                                    k_bufs.index(0))  # fmt: skip
    tma.async_copy_global_to_shared(v_desc, [tb, off_hk, k_start + n0, 0], kv_ready.index(0),
                                    v_bufs.index(0))  # fmt: skip
    off_h = off_hk * kv_group
    mi = 0
    for it in range(kv_group * num_m):
        row0 = (m_lo + mi) * BLOCK_M
        s = it % STAGES
        mbarrier.wait(q_empty.index(s), ((it // STAGES) & 1) ^ 1)
        _stats_async(LSE, DELTA, lse_bufs.index(s), delta_bufs.index(s), q_ready.index(s),
                     row0 + offs, seqlen_rows, tb, heads, off_h, seqlen_q, total_q, q_start,
                     VARLEN)  # fmt: skip
        mbarrier.expect(q_ready.index(s), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [tb, off_h, q_start + row0, 0],
                                        q_ready.index(s), q_bufs.index(s))  # fmt: skip
        ds = it % DO_STAGES
        mbarrier.wait(do_empty.index(ds), ((it // DO_STAGES) & 1) ^ 1)
        mbarrier.expect(do_ready.index(ds), do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(do_desc, [tb, off_h, q_start + row0, 0],
                                        do_ready.index(ds), do_bufs.index(ds))  # fmt: skip
        mi += 1
        if mi == num_m:
            mi = 0
            off_h += 1


@gluon.jit
def _dq_piece_add(dq, dq_bufs, dq_desc, tb, off_h, row, col, PERMUTE: gl.constexpr,
                  C: gl.constexpr):
    """A finished dQ piece to this consumer's fp32 staging tile (once its previous
    reduce-add has read it) and into the workspace at (row, col) by a TMA reduce-add."""
    BLOCK_M: gl.constexpr = dq.shape[0]
    WIDTH: gl.constexpr = dq.shape[1]
    tma.store_wait(0)
    gl.thread_barrier()
    if PERMUTE:  # rows 8a + 4b + c at 8a + 2c + b (hopper_bwd._dq_add says why)
        dq = dq.reshape([BLOCK_M // 8, 2, 4, WIDTH]).permute((0, 2, 1, 3))
        dq = dq.reshape([BLOCK_M, WIDTH])
    _tile2d(dq_bufs, C).store(dq)
    fence_async_shared()
    gl.thread_barrier()
    _tma_reduce_add(dq_desc, [tb, off_h, row, col], dq_bufs.index(C))


@gluon.jit
def _store_half(dk, dv, k_smem, v_smem, k_bufs, v_bufs, dk_desc, dv_desc, DK, DV, stride_dks,
                stride_dkh, stride_dvs, stride_dvh, head_dim, head_dim_v, sm_scale, tb, off_hk,
                k_start, n0, seqlen_k, masked, C: gl.constexpr):
    """The epilogue: this consumer's column halves of dK (scaled) and dV, through its halves
    of the K and V buffers by TMA (which clips rows past seqlen_k and columns past the head
    dim), or, ``masked`` (a packed sequence's last block), by masked pointer stores of the
    rows before ``seqlen_k``."""
    COLS: gl.constexpr = dk.shape[1]
    COLS_V: gl.constexpr = dv.shape[1]
    dtype: gl.constexpr = k_smem.dtype
    if masked:
        _store_rows(DK, dk * sm_scale, n0, C * COLS, k_start, off_hk, stride_dks, stride_dkh,
                    seqlen_k, head_dim)  # fmt: skip
        _store_rows(DV, dv, n0, C * COLS_V, k_start, off_hk, stride_dvs, stride_dvh, seqlen_k,
                    head_dim_v)  # fmt: skip
    else:
        k_smem.slice(C * COLS, COLS, dim=1).store((dk * sm_scale).to(dtype))
        v_smem.slice(C * COLS_V, COLS_V, dim=1).store(dv.to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(dk_desc, [tb, off_hk, k_start + n0, C * COLS],
                                        k_bufs.index(0).slice(C * COLS, COLS, dim=3))
        tma.async_copy_shared_to_global(dv_desc, [tb, off_hk, k_start + n0, C * COLS_V],
                                        v_bufs.index(0).slice(C * COLS_V, COLS_V, dim=3))
    tma.store_wait(0)  # (the last dQ reduce-adds too)


@gluon.jit
def _consumer(dk_desc, dv_desc, dq_desc, lse_bufs, delta_bufs, q_bufs, do_bufs, k_bufs, v_bufs,
              pt_bufs, ds_bufs, dq_bufs, kv_ready, q_ready, q_empty, do_ready, do_empty,
              pds_ready, heads, kv_group, seqlen_q, seqlen_k, total_q, CU_Q, CU_K, TILES, section,
              DK, DV, stride_dks, stride_dkh, stride_dvs, stride_dvh, head_dim, head_dim_v,
              causal_offset, qk_scale, sm_scale, left_offset, tanh_scale, SLOPES, stride_slopes_b,
              alibi_offset, dropout_seed, dropout_thresh, dropout_keep,
              CAUSAL: gl.constexpr, DQ_ATOMIC: gl.constexpr,
              WINDOW: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr,
              VARLEN: gl.constexpr, DQ_ROWS: gl.constexpr, C: gl.constexpr,
              DROPOUT: gl.constexpr):
    """Consumer warpgroup C: rows [32 C, 32 C + 32) of each step's scores, columns [128 C,
    128 C + 128) of the program's dK and dV and of each step's dQ."""
    BLOCK_M: gl.constexpr = q_bufs.type.shape[3]
    HEAD_DIM: gl.constexpr = q_bufs.type.shape[4]
    BLOCK_N: gl.constexpr = k_bufs.type.shape[3]
    STAGES: gl.constexpr = q_bufs.type.shape[0]
    DO_STAGES: gl.constexpr = do_bufs.type.shape[0]
    HALF: gl.constexpr = BLOCK_M // 2
    COLS: gl.constexpr = HEAD_DIM // 2
    COLS_V: gl.constexpr = do_bufs.type.shape[4] // 2  # (the value head dim's half)
    PIECE: gl.constexpr = dq_desc.block_type.shape[3]
    dtype: gl.constexpr = q_bufs.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HALF, 16])
    d_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, COLS, 16])
    q_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, PIECE, 16])
    v_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, COLS_V, 16])
    key_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    query_layout: gl.constexpr = gl.SliceLayout(0, s_layout)

    n0, tb, off_b, off_hk, m_lo, num_m, q_start, k_start, seqlen_q, seqlen_k, causal_offset = (
        _kv_program(heads, kv_group, seqlen_q, seqlen_k, causal_offset, left_offset, CU_Q, CU_K,
                    TILES, section, BLOCK_M, BLOCK_N, CAUSAL, WINDOW, VARLEN))
    offs_k = n0 + gl.arange(0, BLOCK_N, layout=key_layout)
    key_tail = n0 + BLOCK_N > seqlen_k
    k_smem = _tile2d(k_bufs, 0)
    v_smem = _tile2d(v_bufs, 0)
    dk = gl.zeros([BLOCK_N, COLS], gl.float32, layout=d_layout)
    dv = gl.zeros([BLOCK_N, COLS_V], gl.float32, layout=v_layout)
    mbarrier.wait(kv_ready.index(0), 0)
    off_h = off_hk * kv_group
    mi = 0
    if DROPOUT:  # the forward's mask, drawn again (hopper_bwd's consumer)
        drop_keys = (_key_group(offs_k) << 1) | (offs_k & 1)
        drop_scale = 1.0 / dropout_keep
    for it in range(kv_group * num_m):
        row0 = (m_lo + mi) * BLOCK_M
        my_row0 = row0 + C * HALF
        offs_m = my_row0 + gl.arange(0, HALF, layout=query_layout)
        slope2 = 0.0
        if ALIBI:  # the (sequence, head)'s slope times log2(e)
            slope2 = gl.load(SLOPES + off_b * stride_slopes_b + off_h) * 1.4426950408889634
        s = it % STAGES
        mbarrier.wait(q_ready.index(s), (it // STAGES) & 1)
        q_smem = _tile2d(q_bufs, s)
        q_t = q_smem.slice(C * HALF, HALF, dim=0).permute((1, 0))
        st_tok = warpgroup_mma(k_smem, q_t, gl.zeros([BLOCK_N, HALF], gl.float32, s_layout),
                               use_acc=False, is_async=True)  # fmt: skip
        ds = it % DO_STAGES
        mbarrier.wait(do_ready.index(ds), (it // DO_STAGES) & 1)
        do_smem = _tile2d(do_bufs, ds)
        do_t = do_smem.slice(C * HALF, HALF, dim=0).permute((1, 0))
        dpt_tok = warpgroup_mma(v_smem, do_t, gl.zeros([BLOCK_N, HALF], gl.float32, s_layout),
                                use_acc=False, is_async=True)  # fmt: skip
        # Rows past seqlen_q: zero Q, dO, LSE and delta (TMA and cp.async zero-fill), so
        # P^T = 1 but dP^T - delta = 0 and dO = 0 there: they add nothing. Packed
        # sequences: the rows past the sequence are the next one's, masked with the keys
        # (_probs_t's ROWS_END: P = 0; hopper_bwd's consumer).
        lse = lse_bufs.index(s).slice(C * HALF, HALF).load(query_layout)
        st, _k, _qt = warpgroup_mma_wait(1, deps=(st_tok, k_smem, q_t))
        pt, st = _probs_t(st, lse, offs_k, offs_m, n0, my_row0, seqlen_k, key_tail,
                          causal_offset, left_offset, qk_scale, tanh_scale, slope2,
                          alibi_offset, CAUSAL, WINDOW, SOFTCAP, ALIBI, seqlen_q,
                          VARLEN)  # fmt: skip
        if DROPOUT:  # the mask in P^T's sign (hopper_bwd's consumer)
            pt = _dropout(pt, drop_keys, my_row0, off_b * heads + off_h, dropout_seed,
                          dropout_thresh, True)  # fmt: skip
        delta = delta_bufs.index(s).slice(C * HALF, HALF).load(query_layout)
        dpt, _v, _dot = warpgroup_mma_wait(0, deps=(dpt_tok, v_smem, do_t))
        if DROPOUT:  # (dS^T = P^T times this)
            dpt = gl.where(pt > 0.0, dpt * drop_scale - delta[None, :], delta[None, :])
        else:
            dpt = dpt - delta[None, :]
        if SOFTCAP:
            ds16 = (pt * dpt * st).to(dtype)
        else:
            ds16 = (pt * dpt).to(dtype)
        # This consumer's rows of the step's P^T and dS^T, then the partner's.
        pt_all = pt_bufs.index(it % 2)
        ds_all = ds_bufs.index(it % 2)
        if DROPOUT:  # P^T Z / (1 - p) for dV
            pt = gl.maximum(pt, 0.0) * drop_scale
        pt_all.slice(C * HALF, HALF, dim=1).store(pt.to(dtype))
        ds_all.slice(C * HALF, HALF, dim=1).store(ds16)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(pds_ready.index(it % 2))
        mbarrier.wait(pds_ready.index(it % 2), (it // 2) & 1)
        do_c = do_smem.slice(C * COLS_V, COLS_V, dim=1)
        dv_tok = warpgroup_mma(pt_all, do_c, dv, is_async=True)
        dv, _p, _do = warpgroup_mma_wait(0, deps=(dv_tok, pt_all, do_c))
        mbarrier.arrive(do_empty.index(ds))  # dO of this step is no longer read
        q_c = q_smem.slice(C * COLS, COLS, dim=1)
        if DQ_ATOMIC:
            # dQ[:, half C] = dS K[:, half C] in two pieces, the first issued before dK and
            # added to the workspace while dK runs.
            ds_t = ds_all.permute((1, 0))
            zero = gl.zeros([BLOCK_M, PIECE], gl.float32, q_layout)
            k_0 = k_smem.slice(C * COLS, PIECE, dim=1)
            k_1 = k_smem.slice(C * COLS + PIECE, PIECE, dim=1)
            dq0_tok = warpgroup_mma(ds_t, k_0, zero, use_acc=False, is_async=True)
            dk_tok = warpgroup_mma(ds_all, q_c, dk, is_async=True)
            dq0 = warpgroup_mma_wait(1, deps=(dq0_tok,))
            _dq_piece_add(dq0, dq_bufs, dq_desc, tb, off_h, q_start + row0, C * COLS,
                          DQ_ROWS, C)  # fmt: skip
            dq1_tok = warpgroup_mma(ds_t, k_1, zero, use_acc=False, is_async=True)
            dk, dq1, _ds, _q, _dst, _k0, _k1 = warpgroup_mma_wait(
                0, deps=(dk_tok, dq1_tok, ds_all, q_c, ds_t, k_0, k_1))
            _dq_piece_add(dq1, dq_bufs, dq_desc, tb, off_h, q_start + row0, C * COLS + PIECE,
                          DQ_ROWS, C)  # fmt: skip
        else:
            dk_tok = warpgroup_mma(ds_all, q_c, dk, is_async=True)
            dk, _ds, _q = warpgroup_mma_wait(0, deps=(dk_tok, ds_all, q_c))
        mbarrier.arrive(q_empty.index(s))  # Q of this stage is no longer read
        mi += 1
        if mi == num_m:
            mi = 0
            off_h += 1

    # Epilogue through this consumer's halves of the K and V buffers: the partner's last
    # reads of the whole of K and V (its S^T and dP^T) precede its last pds_ready arrival,
    # which this consumer has waited for; its dQ reads only its own half of K. (The plain
    # kernel passes a literal False: see hopper_bwd's consumer.)
    if VARLEN:
        _store_half(dk, dv, k_smem, v_smem, k_bufs, v_bufs, dk_desc, dv_desc, DK, DV,
                    stride_dks, stride_dkh, stride_dvs, stride_dvh, head_dim, head_dim_v, sm_scale,
                    tb, off_hk, k_start, n0, seqlen_k, key_tail, C)  # fmt: skip
    else:
        _store_half(dk, dv, k_smem, v_smem, k_bufs, v_bufs, dk_desc, dv_desc, DK, DV,
                    stride_dks, stride_dkh, stride_dvs, stride_dvh, head_dim, head_dim_v, sm_scale,
                    tb, off_hk, k_start, n0, seqlen_k, False, C)  # fmt: skip


@gluon.jit
def _consumer0(dk_desc, dv_desc, dq_desc, lse_bufs, delta_bufs, q_bufs, do_bufs, k_bufs, v_bufs,
               pt_bufs, ds_bufs, dq_bufs, kv_ready, q_ready, q_empty, do_ready, do_empty,
               pds_ready, heads, kv_group, seqlen_q, seqlen_k, total_q, CU_Q, CU_K, TILES, section,
               DK, DV, stride_dks, stride_dkh, stride_dvs, stride_dvh, head_dim, head_dim_v,
               causal_offset, qk_scale, sm_scale, left_offset, tanh_scale, SLOPES, stride_slopes_b,
               alibi_offset, dropout_seed, dropout_thresh, dropout_keep,
               CAUSAL: gl.constexpr, DQ_ATOMIC: gl.constexpr,
               WINDOW: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr,
               VARLEN: gl.constexpr, DQ_ROWS: gl.constexpr, DROPOUT: gl.constexpr):
    _consumer(dk_desc, dv_desc, dq_desc, lse_bufs, delta_bufs, q_bufs, do_bufs, k_bufs, v_bufs,
              pt_bufs, ds_bufs, dq_bufs, kv_ready, q_ready, q_empty, do_ready, do_empty,
              pds_ready, heads, kv_group, seqlen_q, seqlen_k, total_q, CU_Q, CU_K, TILES, section,
              DK, DV, stride_dks, stride_dkh, stride_dvs, stride_dvh, head_dim, head_dim_v,
              causal_offset, qk_scale, sm_scale, left_offset, tanh_scale, SLOPES, stride_slopes_b,
              alibi_offset, dropout_seed, dropout_thresh, dropout_keep, CAUSAL, DQ_ATOMIC,
              WINDOW, SOFTCAP, ALIBI, VARLEN, DQ_ROWS, 0, DROPOUT)  # fmt: skip


@gluon.jit
def _consumer1(dk_desc, dv_desc, dq_desc, lse_bufs, delta_bufs, q_bufs, do_bufs, k_bufs, v_bufs,
               pt_bufs, ds_bufs, dq_bufs, kv_ready, q_ready, q_empty, do_ready, do_empty,
               pds_ready, heads, kv_group, seqlen_q, seqlen_k, total_q, CU_Q, CU_K, TILES, section,
               DK, DV, stride_dks, stride_dkh, stride_dvs, stride_dvh, head_dim, head_dim_v,
               causal_offset, qk_scale, sm_scale, left_offset, tanh_scale, SLOPES, stride_slopes_b,
               alibi_offset, dropout_seed, dropout_thresh, dropout_keep,
               CAUSAL: gl.constexpr, DQ_ATOMIC: gl.constexpr,
               WINDOW: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr,
               VARLEN: gl.constexpr, DQ_ROWS: gl.constexpr, DROPOUT: gl.constexpr):
    _consumer(dk_desc, dv_desc, dq_desc, lse_bufs, delta_bufs, q_bufs, do_bufs, k_bufs, v_bufs,
              pt_bufs, ds_bufs, dq_bufs, kv_ready, q_ready, q_empty, do_ready, do_empty,
              pds_ready, heads, kv_group, seqlen_q, seqlen_k, total_q, CU_Q, CU_K, TILES, section,
              DK, DV, stride_dks, stride_dkh, stride_dvs, stride_dvh, head_dim, head_dim_v,
              causal_offset, qk_scale, sm_scale, left_offset, tanh_scale, SLOPES, stride_slopes_b,
              alibi_offset, dropout_seed, dropout_thresh, dropout_keep, CAUSAL, DQ_ATOMIC,
              WINDOW, SOFTCAP, ALIBI, VARLEN, DQ_ROWS, 1, DROPOUT)  # fmt: skip


@gluon.jit
def _attn_bwd_d256(q_desc, do_desc, k_desc, v_desc, dk_desc, dv_desc, LSE, DELTA, dq_desc,
                   heads, kv_group, seqlen_q, seqlen_k, total_q, CU_Q, CU_K, TILES, section, DK, DV,
                   stride_dks, stride_dkh, stride_dvs, stride_dvh, head_dim, head_dim_v,
                   causal_offset, qk_scale, sm_scale, left_offset, tanh_scale, SLOPES,
                   stride_slopes_b, alibi_offset, dropout_seed, dropout_thresh, dropout_keep,
                   CAUSAL: gl.constexpr, DQ_ATOMIC: gl.constexpr,
                   STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                   LOADER_REGS: gl.constexpr, DQ_ROWS: gl.constexpr, DO_STAGES: gl.constexpr,
                   WINDOW: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr,
                   VARLEN: gl.constexpr, DROPOUT: gl.constexpr = False):
    """Grid (cdiv(seqlen_k, 64) * batch * kv_heads,) (``hopper_bwd.place_work``), num_warps=4
    (consumer 0) plus 4 warps (consumer 1) and 1 loader warp. Descriptors are 4-D over (batch,
    heads, seqlen, dim): Q and dO blocks (1, 1, BLOCK_M, 256), K and V (1, 1, 64, 256), dK and dV
    (1, 1, 64, 128: a consumer's half); LSE (base 2) and DELTA (batch, heads, seqlen_q) fp32; the
    atomic dQ's fp32 workspace (batch, heads, rows, 256) in blocks (1, 1, BLOCK_M, 64). Packed
    sequences (VARLEN), the variants (WINDOW, SOFTCAP, ALIBI) and their arguments as
    ``hopper_bwd._attn_bwd_hopper`` takes them (the grid then (work items, kv heads) over
    ``kv_table``'s 64-key blocks)."""
    dtype: gl.constexpr = q_desc.dtype
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    q_bufs = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [DO_STAGES] + do_desc.block_type.shape,
                                        do_desc.layout)  # fmt: skip
    k_bufs = gl.allocate_shared_memory(dtype, [1] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [1] + v_desc.block_type.shape, v_desc.layout)
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    pt_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], p_layout)
    ds_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], p_layout)
    DQ_TILES: gl.constexpr = 2 if DQ_ATOMIC else 1
    dq_bufs = gl.allocate_shared_memory(gl.float32, [DQ_TILES] + dq_desc.block_type.shape,
                                        dq_desc.layout)  # fmt: skip
    stats_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    lse_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], stats_layout)
    delta_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], stats_layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [DO_STAGES, 1], mbarrier.MBarrierLayout())
    do_empty = gl.allocate_shared_memory(gl.int64, [DO_STAGES, 1], mbarrier.MBarrierLayout())
    pds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready.index(0), count=1)
    mbarrier.init(pds_ready.index(0), count=2)
    mbarrier.init(pds_ready.index(1), count=2)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)  # one arrival per consumer
    for i in gl.static_range(DO_STAGES):
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(do_empty.index(i), count=2)
    gl.warp_specialize([
        (_consumer0, (dk_desc, dv_desc, dq_desc, lse_bufs, delta_bufs, q_bufs,
                      do_bufs, k_bufs, v_bufs, pt_bufs, ds_bufs, dq_bufs, kv_ready, q_ready,
                      q_empty, do_ready, do_empty, pds_ready, heads, kv_group, seqlen_q,
                      seqlen_k, total_q, CU_Q, CU_K, TILES, section, DK, DV, stride_dks, stride_dkh,
                      stride_dvs, stride_dvh, head_dim, head_dim_v, causal_offset, qk_scale,
                      sm_scale, left_offset, tanh_scale, SLOPES, stride_slopes_b, alibi_offset,
                      dropout_seed, dropout_thresh, dropout_keep,
                      CAUSAL, DQ_ATOMIC, WINDOW, SOFTCAP, ALIBI, VARLEN, DQ_ROWS, DROPOUT)),
        (_consumer1, (dk_desc, dv_desc, dq_desc, lse_bufs, delta_bufs, q_bufs,
                      do_bufs, k_bufs, v_bufs, pt_bufs, ds_bufs, dq_bufs, kv_ready, q_ready,
                      q_empty, do_ready, do_empty, pds_ready, heads, kv_group, seqlen_q,
                      seqlen_k, total_q, CU_Q, CU_K, TILES, section, DK, DV, stride_dks, stride_dkh,
                      stride_dvs, stride_dvh, head_dim, head_dim_v, causal_offset, qk_scale,
                      sm_scale, left_offset, tanh_scale, SLOPES, stride_slopes_b, alibi_offset,
                      dropout_seed, dropout_thresh, dropout_keep,
                      CAUSAL, DQ_ATOMIC, WINDOW, SOFTCAP, ALIBI, VARLEN, DQ_ROWS, DROPOUT)),
        (_loader, (q_desc, do_desc, k_desc, v_desc, LSE, DELTA, q_bufs, do_bufs, k_bufs,
                   v_bufs, lse_bufs, delta_bufs, kv_ready, q_ready, q_empty, do_ready, do_empty,
                   heads, kv_group, seqlen_q, seqlen_k, total_q, causal_offset, left_offset,
                   CU_Q, CU_K, TILES, section, CAUSAL, WINDOW, VARLEN)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])  # fmt: skip


def bwd_args(q4, k4, v4, do4, dk4, dv4, lse2, delta, dq_desc, causal_offset: int,
             softmax_scale: float, causal: bool, dq_atomic: bool, dq_rows: bool,
             config: tuple | None = None, qk_scale: float | None = None,
             variants: dict | None = None,
             packed: dict | None = None) -> tuple[tuple, dict, int]:
    """(grid, kernel arguments, num_warps) for (batch, heads, seqlen, dim) views, as
    ``hopper_bwd.bwd_args`` builds them for its kernel: ``dq_desc`` the atomic dQ
    workspace's descriptor in (BLOCK_M, 64) blocks (or a stand-in's); ``dq_rows``: its rows
    permuted (``hopper_bwd.dq_rows_permuted``); ``qk_scale`` (default softmax_scale *
    log2(e)) and ``variants`` as ``hopper_fwd.variant_args`` gives them with
    ``backward=True``; ``packed``: the sequence count, longest lengths and VARLEN kernel
    arguments (``hopper_bwd.hopper_backward``). A config's fifth field: the dO stages."""
    b, h, sq, d = q4.shape
    sk = k4.shape[2]
    if packed is not None:
        b, sq, sk = packed["batch"], packed["seqlen_q"], packed["seqlen_k"]
    block_m, stages, c_regs, l_regs, *rest = config or BWD_CONFIGS[256]
    do_stages = rest[0] if rest else 1
    dv_pad = head_dim_pad(v4.shape[3])  # (a value head dim of its own: 128 or 256 here)
    args = dict(q_desc=_desc(q4, block_m, 256), do_desc=_desc(do4, block_m, dv_pad),
                k_desc=_desc(k4, BLOCK_N, 256), v_desc=_desc(v4, BLOCK_N, dv_pad),
                dk_desc=_desc(dk4, BLOCK_N, 128), dv_desc=_desc(dv4, BLOCK_N, dv_pad // 2),
                LSE=lse2, DELTA=delta, dq_desc=dq_desc, heads=h, kv_group=h // k4.shape[1],
                seqlen_q=sq, seqlen_k=sk, total_q=0, CU_Q=lse2, CU_K=lse2, TILES=lse2,
                DK=dk4, DV=dv4, stride_dks=0, stride_dkh=0, stride_dvs=0, stride_dvh=0,
                head_dim=d, head_dim_v=v4.shape[3], causal_offset=causal_offset,
                qk_scale=softmax_scale * LOG2E if qk_scale is None else qk_scale,
                sm_scale=softmax_scale, left_offset=0, tanh_scale=1.0, SLOPES=lse2,
                stride_slopes_b=0, alibi_offset=0, CAUSAL=causal,
                DQ_ATOMIC=dq_atomic,
                STAGES=stages, CONSUMER_REGS=c_regs, LOADER_REGS=l_regs, DQ_ROWS=dq_rows,
                DO_STAGES=do_stages, WINDOW=False, SOFTCAP=False, ALIBI=False,
                VARLEN=False, DROPOUT=False, dropout_seed=0, dropout_thresh=0,
                dropout_keep=1.0)  # fmt: skip
    grid = place_work(args, variants, packed, BLOCK_N, block_m, sk, b, k4.shape[1], causal,
                      lse2.device, l2_row_bytes(q4, do4, k4.shape[1], sq, dq_atomic))  # fmt: skip
    return grid, args, 4


def compile_for_hopper(dtype: torch.dtype = torch.bfloat16, causal: bool = False,
                       dq_atomic: bool = True, head_dim: int = 256,
                       config: tuple | None = None, variants: tuple[str, ...] = (),
                       packed: bool = False, head_dim_v: int | None = None):
    """Compile the kernel for sm90a without a GPU (a (2, 16, 4096, head_dim) problem with 4
    kv heads, as ``hopper_bwd.compile_bwd_for_hopper`` sets up its ``variants`` and
    ``packed``; ``head_dim_v``: a value head dim of its own); returns Triton's
    ``CompiledKernel``. Run it in a process that has not run kernels under the
    interpreter."""
    from diyfa._compile import compile_for_sm90

    q = torch.empty(2, 16, 4096, head_dim, dtype=dtype)
    kv = torch.empty(2, 4, 4096, head_dim, dtype=dtype)
    vv = kv if head_dim_v is None else torch.empty(2, 4, 4096, head_dim_v, dtype=dtype)
    oo = q if head_dim_v is None else torch.empty(2, 16, 4096, head_dim_v, dtype=dtype)
    stats = torch.empty(2, 16, 4096, dtype=torch.float32)
    dq_acc = torch.empty(2, 16, 4096, 256, dtype=torch.float32)
    flags, pack = compile_setup(head_dim, dtype, variants, packed, causal)
    if packed:
        q, kv, vv, oo, stats, dq_acc = q[:1], kv[:1], vv[:1], oo[:1], stats[0], dq_acc[:1]
    dq_desc = _desc(dq_acc, BWD_CONFIGS[256][0], DQ_PIECE)
    _, args, num_warps = bwd_args(q, kv, vv, oo, kv, vv, stats, stats, dq_desc, 0, 0.1, causal,
                                  dq_atomic, dq_atomic and not packed, config, None, flags,
                                  pack)  # fmt: skip
    return compile_for_sm90(_attn_bwd_d256, args, num_warps)
