"""Decode against an fp8 (e4m3) KV cache on Hopper: the split kernel in Gluon (sm90).

The Triton split kernel (``decode._decode_split``) widens the e4m3 tiles to 16 bits in the
layouts of its two products, where Triton reads V a byte at a time from shared memory (P V's
operand pairs run along the keys, V's bytes along the head dim) and rebuilds q's operand every
step: 620 SASS instructions a thread per 64-key step against the bf16 cache's 412, so the fp8
cache, half the bytes, ran at only 1.16-1.37x the bf16 cache's tokens/s (docs/attention.md).

Here every layout is explicit. One warpgroup per (batch x kv head, split):
- K and V blocks arrive in e4m3 by TMA through a ring of ``STAGES`` (mbarriers), far ahead;
- each thread reads 16 contiguous bytes of a row at a time, widens them to fp16 (one
  instruction per two values) and stores them to an fp16 tile in shared memory, K's for S,
  then V's for P V (``ONE_TILE``; or one tile each), keys past the sequence's end zeroed there,
  so no garbage reaches the products;
- the products run on the tensor cores with the keys as M ("swap AB": a decode step has few
  query rows, the GQA group x the new tokens, padded to ``ROWS`` = wgmma's N):
  S^T = K Q^T (K from shared memory, Q^T from q's fp16 tile, written once), and
  O^T += V^T P^T (V^T as the transposed view of V's tile, P^T through shared memory);
- the softmax runs down S^T's columns (one query row each): the running max per column, P's
  column sums kept per thread and reduced once at the end.
Numerics are the Triton kernel's for contiguous fp8 caches: q times a power of two into fp16,
the power and the K descale in the scores' scale, P rounded to fp16, fp32 accumulation, the V
descale on the output.

The output is the Triton kernel's: one split writes O and the base-2 LSE itself (DIRECT),
more write their partials to the workspace for ``decode._combine``.

That warpgroup kernel (``_decode_split_fp8``) is latency-bound (ncu: each step waits on the
fence and barrier after the fp16 tiles' stores, on S, on the cross-warp max). The default
now (:data:`MMA`) is ``_decode_split_fp8_mma``: the same TMA ring, but each of the 4 warps
works on its own quarter of a block's keys with mma.sync (m16n8k16; q's <= 16 rows as M),
its operands straight from the e4m3 bytes in shared memory into registers, 16 or 32
contiguous bytes a row per load: the head dim is relabelled (:func:`_view_layout`: the
reduction's order is free, q is loaded in K's order and O stored back in memory's), widened
in registers; P goes from S's accumulator to P V's A operand with no data movement. Per
step: one barrier (every warp has read the stage: refill it), no shared-memory stores, no
cross-warp reduction until the end.

Paged caches (pages of a power of two >= 16 keys, :data:`MIN_PAGE`) take the same kernels:
the TMA box is a page (pages smaller than a block: a box each, at the row its table entry
gives) or a block (pages of a block or more), and boxes past the sequence read rows past the
cache's end (zeros), so a stage's byte count never changes. The mma.sync kernel issues its
first loads before it reads the sequence's length or q (:data:`EARLY_LENGTHS`), and merges
its splits itself (``decode.MERGE``'s counters: the last split of a (batch x kv head) to
finish) where there are at most ``decode.MERGE_SPLITS``.
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

from diyfa.device import kernel_limits

# The Gluon kernel for fp8 caches on sm90 where it applies (:func:`applies`); False: the
# Triton split kernel everywhere.
ENABLED = True
# (keys per block, ring stages, programs per SM, one fp16 tile[, warps: 4, or 8 at d128 with
# 128-key blocks: two warpgroups]; launch_warps). Shared memory a program: the ring, stages x
# 2 x BLOCK_N x d bytes, plus the fp16 K and V tiles, 2 x BLOCK_N x d x 2, or one tile that
# holds K for S, then V for P V (ONE_TILE), BLOCK_N x d x 2. H200, fp8 / bf16 cache tokens/s
# at b16 x 16k (benchmarks/fp8_decode.py --configs; docs/attention.md, "KV cache"): 64-4-2-0
# 1.30, 64-2-4-1 1.38-1.40, 64-3-3-1 1.36-1.38, 128-3-1-0 1.27-1.29, this 1.48-1.52, with 8
# warps 1.25-1.39.
CONFIG = (128, 2, 2, 1)
# The step's order (_step's EARLY_S; False: the first version's, for A/B runs).
EARLY_S = True
# The mma.sync kernel (_decode_split_fp8_mma: each warp on its own keys) instead of the
# warpgroup one (_decode_split_fp8), and its (keys per block, ring stages, programs per SM).
MMA = True
MMA_CONFIG = (128, 2, 2)
# Paged caches (pages of a power of two >= MIN_PAGE keys) on the Gluon kernels too (False:
# the Triton split kernel, for A/B runs).
PAGED = True
# The mma.sync kernel issues its first blocks' loads before it loads q (False: after, as
# first built), and, EARLY_LENGTHS, before it reads the sequence's length (the kernel's
# EARLY_ISSUE: 0, 1, 2; these for A/B runs).
EARLY_ISSUE = True
EARLY_LENGTHS = True
ROWS = 16  # query rows a program (wgmma's N): the GQA group x the new tokens, padded


def split_kernel():
    """The split kernel calls :func:`applies` takes run on (:data:`MMA`; one of
    :data:`KERNELS`)."""
    return KERNELS[MMA]


def launch_warps(d: int, config: tuple) -> int:
    """The warps of a program under ``config`` (:data:`CONFIG`'s shape) at head dim ``d``: its
    fifth entry where one is given, at d128 with blocks of 128 keys or more (the layouts put
    16 rows of S^T and O^T on each warp), else 4."""
    block_n, *rest = config
    return rest[3] if len(rest) > 3 and d == 128 and block_n >= 128 else 4


def register_cap(per_sm: int, warps: int = 4) -> int:
    """The launch's ``maxnreg`` for ``per_sm`` programs of ``warps`` warps an SM where their
    registers would not fit uncapped (0: none; at 64-key blocks the kernel takes ~145
    registers, 3 programs' worth of an SM's 64K)."""
    return 65536 // (32 * warps * per_sm) // 8 * 8 if per_sm * warps >= 16 else 0


@gluon.jit
def _wait_prior_grid():
    """PDL: wait for the kernel before this one (griddepcontrol.wait; a no-op without PDL)."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def _let_dependents_launch():
    """PDL: the next kernel (the combine) may be launched; it waits for this grid itself."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [],
                              dtype=gl.int32, is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def _issue(k_desc, v_desc, k_ring, v_ring, ready, i, row0, col, table, pool, hi,
           BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PAGE: gl.constexpr):
    """TMA loads of block ``i``'s K and V rows into ring stage i % STAGES. Contiguous caches
    (PAGE 0): rows row0 + i BLOCK_N on. Paged ones (PAGE: the page size, a power of two >= the
    descriptors' box of min(PAGE, BLOCK_N) rows): the block's keys row0 + i BLOCK_N on (row0:
    the split's first key), a box per page, or one per block for pages of BLOCK_N keys or
    more, at the row its ``table`` entry gives (clamped to the pool, as the Triton kernel
    does: a bad entry reads another page, never outside the cache); boxes wholly at or past
    ``hi`` (whose table entries may lie past the sequence's) read rows past the cache's end:
    zeros, no memory traffic, and the stage's byte count stays whole."""
    s = i % STAGES
    BOX: gl.constexpr = k_desc.block_type.shape[0]
    mbarrier.expect(ready.index(s), 2 * k_desc.block_type.nbytes * (BLOCK_N // BOX))
    if PAGE == 0:
        tma.async_copy_global_to_shared(k_desc, [row0 + i * BLOCK_N, col], ready.index(s),
                                        k_ring.index(s))  # fmt: skip
        tma.async_copy_global_to_shared(v_desc, [row0 + i * BLOCK_N, col], ready.index(s),
                                        v_ring.index(s))  # fmt: skip
    else:
        for j in gl.static_range(BLOCK_N // BOX):
            key = row0 + i * BLOCK_N + j * BOX
            used = key < hi
            page = gl.minimum(gl.maximum(gl.load(table + key // PAGE, mask=used, other=0), 0),
                              pool - 1)
            row = gl.where(used, page * PAGE + key % PAGE, pool * PAGE)
            tma.async_copy_global_to_shared(k_desc, [row, col], ready.index(s),
                                            k_ring.index(s).slice(j * BOX, BOX))
            tma.async_copy_global_to_shared(v_desc, [row, col], ready.index(s),
                                            v_ring.index(s).slice(j * BOX, BOX))


@gluon.jit
def _issue_first(k_desc, v_desc, k_ring, v_ring, ready, n, row0, col, table, pool, hi,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PAGE: gl.constexpr,
                 PDL_WAIT: gl.constexpr):
    """A program's first ``n`` (<= STAGES) blocks' loads, after the append (PDL_WAIT: the
    kernel before this one wrote the cache)."""
    if PDL_WAIT:
        _wait_prior_grid()
    for i in range(0, n):
        _issue(k_desc, v_desc, k_ring, v_ring, ready, i, row0, col, table, pool, hi, BLOCK_N,
               STAGES, PAGE)  # fmt: skip


@gluon.jit
def _widen(x8, start, hi, MASKED: gl.constexpr, BLOCK_N: gl.constexpr):
    """An e4m3 tile in fp16 (exact); MASKED: rows at or past ``hi`` (another sequence's keys,
    or never written) zeroed."""
    x = x8.to(gl.float16)
    if MASKED:
        key = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, x8.type.layout))
        x = gl.where(key[:, None] < hi, x, 0.0)
    return x


@gluon.jit
def _step(k_desc, v_desc, k_ring, v_ring, ready, k16, v16, q16, p16, i, n_blocks, row0, col,
          table, pool, lo, hi, causal_offset, qpos, k_scale, m_i, l_acc, o_acc,
          MASKED: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr,
          STAGES: gl.constexpr, HEAD_DIM: gl.constexpr, ROWS: gl.constexpr,
          ONE_TILE: gl.constexpr, EARLY_S: gl.constexpr, PAGE: gl.constexpr):
    """Block ``i`` of the split: widen K and V, S^T = K Q^T, the online softmax down the
    columns, O^T += V^T P^T (left running: the next step waits for it). MASKED: keys at or
    past ``hi`` zeroed and their scores -inf, and the causal mask (blocks every row sees
    wholly take MASKED = False). EARLY_S: the ring stage is refilled after the barrier that
    publishes K's fp16 tile (one barrier a step fewer), S's product runs while V is widened."""
    W: gl.constexpr = gl.num_warps()
    # (16 contiguous bytes a thread, 64 bytes of a row over 4 threads: at d128 the layout of
    # 4 x 8 threads, a whole row over 8, ran 10% slower on the H200; at d64 it covered the tile
    # twice)
    cv_layout: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [W, 1], [1, 0])
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1],
                                                       instr_shape=[16, ROWS, 16])  # fmt: skip
    s = i % STAGES
    mbarrier.wait(ready.index(s), (i // STAGES) & 1)
    k8 = k_ring.index(s).load(cv_layout)
    v8 = v_ring.index(s).load(cv_layout)
    if not EARLY_S:
        gl.thread_barrier()  # every thread has read stage s: refill it
        if i + STAGES < n_blocks:
            _issue(k_desc, v_desc, k_ring, v_ring, ready, i + STAGES, row0, col, table,
                   pool, hi, BLOCK_N, STAGES, PAGE)  # fmt: skip
    start = lo + i * BLOCK_N
    kw = _widen(k8, start, hi, MASKED, BLOCK_N)
    if not ONE_TILE and not EARLY_S:
        vw = _widen(v8, start, hi, MASKED, BLOCK_N)
    o_acc = warpgroup_mma_wait(0, deps=[o_acc])  # the last P V is done with k16, v16, p16
    k16.store(kw)
    if not ONE_TILE and not EARLY_S:
        v16.store(vw)
    fence_async_shared()
    gl.thread_barrier()
    zero = gl.zeros([BLOCK_N, ROWS], gl.float32, s_layout)
    if EARLY_S:
        # (the barrier above also saw every thread's reads of stage s done: refill it)
        if i + STAGES < n_blocks:
            _issue(k_desc, v_desc, k_ring, v_ring, ready, i + STAGES, row0, col, table,
                   pool, hi, BLOCK_N, STAGES, PAGE)  # fmt: skip
        t = warpgroup_mma(k16, q16.permute((1, 0)), zero, use_acc=False, is_async=True)
        if not ONE_TILE:  # V widened while S runs
            v16.store(_widen(v8, start, hi, MASKED, BLOCK_N))
        t = warpgroup_mma_wait(0, deps=[t])
    else:
        t = warpgroup_mma(k16, q16.permute((1, 0)), zero, use_acc=False)
    t = t * k_scale
    if MASKED:
        key = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
        keep = key[:, None] < hi
        if CAUSAL:
            keep = keep & (key[:, None] <= qpos[None, :] + causal_offset)
        t = gl.where(keep, t, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(t, 0))
    if MASKED:  # (a column with no key yet: no NaN)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(t - m_use[None, :])
    l_acc = l_acc * alpha[None, :] + p
    o_acc = o_acc * alpha[None, :]
    p16.store(p.to(gl.float16))
    if ONE_TILE:  # (S's product is done with K: the tile takes V, widened only now)
        v16.store(_widen(v8, start, hi, MASKED, BLOCK_N))
    fence_async_shared()
    gl.thread_barrier()
    o_acc = warpgroup_mma(v16.permute((1, 0)), p16, o_acc, is_async=True)
    return m_new, l_acc, o_acc


@gluon.jit
def _split_range(CACHE_SEQLENS, kv_heads, max_len, seqlen_q, split_len, seqlen_add,
                 CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr):
    """A split program's (batch, kv head, split, causal offset: key j <= row's query +
    offset, its keys [lo, hi), its blocks, the blocks every row sees wholly (run unmasked))."""
    off_bhk = gl.program_id(0)
    split = gl.program_id(1)
    off_b = off_bhk // kv_heads
    off_hk = off_bhk % kv_heads
    seqlen_k = gl.minimum(gl.load(CACHE_SEQLENS + off_b) + seqlen_add, max_len)
    causal_offset = seqlen_k - seqlen_q
    lo = split * split_len
    hi = gl.minimum(lo + split_len, seqlen_k)
    n_blocks = gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N)
    if CAUSAL:  # blocks wholly visible to query 0 (and so to every row) run unmasked
        n_full = gl.maximum(gl.minimum(hi, causal_offset + 1) - lo, 0) // BLOCK_N
    else:
        n_full = gl.maximum(hi - lo, 0) // BLOCK_N
    return off_b, off_hk, split, causal_offset, lo, hi, n_blocks, n_full


@gluon.jit
def _first_row(BLOCK_TABLE, stride_tb, off_b, cache_len, lo, PAGE: gl.constexpr):
    """:func:`_issue`'s row0 (contiguous: the split's first row of the (batch x cache_len)
    view; paged: its first key) and the sequence's block table row."""
    if PAGE == 0:
        return off_b * cache_len + lo, BLOCK_TABLE
    return lo, BLOCK_TABLE + off_b * stride_tb


@gluon.jit
def _out_rows(r, off_b, off_hk, kv_heads, kv_group, seqlen_q):
    """A program's query rows ``r`` (r -> head in the kv head's group r // seqlen_q, query
    r % seqlen_q): which are real (not padding), their head, their query, and their index in
    LSE (batch, heads, seqlen_q), which the split workspaces follow."""
    head = off_hk * kv_group + r // seqlen_q
    qpos = r % seqlen_q
    row = (off_b * (kv_heads * kv_group) + head).to(gl.int64) * seqlen_q + qpos
    return r < kv_group * seqlen_q, head, qpos, row


@gluon.jit
def _ring(k_desc, v_desc, STAGES: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr):
    """The TMA ring: K's and V's e4m3 stages and their mbarriers (initialised)."""
    k_ring = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_ring = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    return k_ring, v_ring, ready


@gluon.jit
def _q_and_scales(Q, K_DESCALE, V_DESCALE, stride_qb, stride_qs, stride_qh, stride_qd, off_b,
                  off_hk, kv_group, seqlen_q, qk_scale, stride_descale_b,
                  HEAD_DIM: gl.constexpr, ROWS: gl.constexpr):
    """The kv head's query rows (r -> head r // seqlen_q, query r % seqlen_q; ROWS padded
    with zeros) in fp16 times a power of two that keeps them in range, the scores' scale
    (that power, the K descale, the softmax scale in base 2) and the V descale."""
    q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [ROWS // 4, 128 // ROWS],
                                              [gl.num_warps(), 1], [1, 0])  # fmt: skip
    r_q = gl.arange(0, ROWS, layout=gl.SliceLayout(1, q_layout))
    d_q = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, q_layout))
    head_q = off_hk * kv_group + r_q // seqlen_q
    q = gl.load(Q + off_b.to(gl.int64) * stride_qb + (r_q % seqlen_q)[:, None] * stride_qs
                + head_q[:, None] * stride_qh + d_q[None, :] * stride_qd,
                mask=(r_q < kv_group * seqlen_q)[:, None], other=0.0).to(gl.float32)  # fmt: skip
    q_max = gl.max(gl.max(gl.abs(q), 1), 0)
    q_exp = gl.maximum(gl.ceil(gl.log2(q_max) - 15.0), 0.0)
    k_descale = gl.load(K_DESCALE + off_b * stride_descale_b + off_hk)
    v_descale = gl.load(V_DESCALE + off_b * stride_descale_b + off_hk)
    return ((q * gl.exp2(-q_exp)).to(gl.float16), qk_scale * k_descale * gl.exp2(q_exp),
            v_descale)


@gluon.jit
def _decode_split_fp8(Q, k_desc, v_desc, CACHE_SEQLENS, O_PART, LSE_PART, O, LSE,
                      BLOCK_TABLE, stride_tb, pool,
                      K_DESCALE, V_DESCALE,
                      stride_qb, stride_qs, stride_qh, stride_qd,
                      stride_ob, stride_os, stride_oh, stride_od,
                      cache_len, max_len, kv_heads, kv_group, seqlen_q, split_len, qk_scale,
                      batch, seqlen_add, stride_descale_b,
                      HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr,
                      STAGES: gl.constexpr, ROWS: gl.constexpr, DIRECT: gl.constexpr,
                      PDL: gl.constexpr, PDL_WAIT: gl.constexpr,
                      ONE_TILE: gl.constexpr, MAXNREG: gl.constexpr = 0,
                      EARLY_S: gl.constexpr = True, PAGE: gl.constexpr = 0):
    """Program (batch x kv head, split): the kv head's query rows (head in group, query:
    r -> head r // seqlen_q, query r % seqlen_q) against the split's keys, from an e4m3 cache
    (batch, cache_len, kv_heads, HEAD_DIM) read through 2-D descriptors of (batch x cache_len,
    kv_heads x HEAD_DIM). Lengths are clamped to ``max_len`` (the bound; see the Triton
    kernel). DIRECT: one split, the output and LSE written here; else the split's partials
    for ``decode._combine`` (no in-kernel merge here). MAXNREG: the launch's register cap
    (``maxnreg``, 0 for none), a parameter so that kernels compiled under different caps are
    kept apart."""
    if PDL:
        _let_dependents_launch()
    W: gl.constexpr = gl.num_warps()
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1],
                                                       instr_shape=[16, ROWS, 16])  # fmt: skip
    off_b, off_hk, split, causal_offset, lo, hi, n_blocks, n_full = _split_range(
        CACHE_SEQLENS, kv_heads, max_len, seqlen_q, split_len, seqlen_add, CAUSAL, BLOCK_N)

    q, k_scale, v_descale = _q_and_scales(Q, K_DESCALE, V_DESCALE, stride_qb, stride_qs,
                                          stride_qh, stride_qd, off_b, off_hk, kv_group,
                                          seqlen_q, qk_scale, stride_descale_b, HEAD_DIM, ROWS)
    q16 = gl.allocate_shared_memory(gl.float16, [ROWS, HEAD_DIM],
                                    gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM],
                                                                         gl.float16), q)

    k_ring, v_ring, ready = _ring(k_desc, v_desc, STAGES, BLOCK_N, HEAD_DIM)
    tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM],
                                                                     gl.float16)  # fmt: skip
    k16 = gl.allocate_shared_memory(gl.float16, [BLOCK_N, HEAD_DIM], tile_layout)
    if ONE_TILE:
        v16 = k16
    else:
        v16 = gl.allocate_shared_memory(gl.float16, [BLOCK_N, HEAD_DIM], tile_layout)
    p16 = gl.allocate_shared_memory(gl.float16, [BLOCK_N, ROWS],
                                    gl.NVMMASharedLayout.get_default_for([BLOCK_N, ROWS],
                                                                         gl.float16))  # fmt: skip
    fence_async_shared()
    gl.thread_barrier()

    row0, table = _first_row(BLOCK_TABLE, stride_tb, off_b, cache_len, lo, PAGE)
    col = off_hk * HEAD_DIM
    _issue_first(k_desc, v_desc, k_ring, v_ring, ready, gl.minimum(n_blocks, STAGES), row0,
                 col, table, pool, hi, BLOCK_N, STAGES, PAGE, PDL_WAIT)  # fmt: skip

    r_s = gl.arange(0, ROWS, layout=gl.SliceLayout(0, s_layout))
    qpos = r_s % seqlen_q
    m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(0, s_layout))
    l_acc = gl.zeros([BLOCK_N, ROWS], gl.float32, s_layout)
    # (an asynchronous product's accumulator, as each step leaves it)
    o_acc = warpgroup_mma_init(gl.zeros([HEAD_DIM, ROWS], gl.float32, s_layout))
    for i in range(0, n_full):
        m_i, l_acc, o_acc = _step(k_desc, v_desc, k_ring, v_ring, ready, k16, v16, q16, p16, i,
                                  n_blocks, row0, col, table, pool, lo, hi, causal_offset,
                                  qpos, k_scale, m_i, l_acc, o_acc, False, CAUSAL, BLOCK_N,
                                  STAGES, HEAD_DIM, ROWS, ONE_TILE, EARLY_S, PAGE)  # fmt: skip
    for i in range(n_full, n_blocks):
        m_i, l_acc, o_acc = _step(k_desc, v_desc, k_ring, v_ring, ready, k16, v16, q16, p16, i,
                                  n_blocks, row0, col, table, pool, lo, hi, causal_offset,
                                  qpos, k_scale, m_i, l_acc, o_acc, True, CAUSAL, BLOCK_N,
                                  STAGES, HEAD_DIM, ROWS, ONE_TILE, EARLY_S, PAGE)  # fmt: skip
    o_acc = warpgroup_mma_wait(0, deps=[o_acc])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))

    l_i = gl.sum(l_acc, 0)
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    lse2 = gl.where(empty, float("-inf"), m_i + gl.log2(l_safe))
    out = o_acc * (v_descale / l_safe)[None, :]
    # (rows of the output: the query rows are its columns here)
    st_layout: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [1, W], [0, 1])
    out = gl.convert_layout(out, st_layout)
    r_o = gl.arange(0, ROWS, layout=gl.SliceLayout(0, st_layout))
    d_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, st_layout))
    ok_o, head_o, qpos_o, row = _out_rows(r_o, off_b, off_hk, kv_heads, kv_group, seqlen_q)
    ok_l, _, _, row_l = _out_rows(r_s, off_b, off_hk, kv_heads, kv_group, seqlen_q)
    heads = kv_heads * kv_group
    if DIRECT:
        gl.store(LSE + row_l, lse2, mask=ok_l)
        gl.store(O + off_b.to(gl.int64) * stride_ob + qpos_o[None, :] * stride_os
                 + head_o[None, :] * stride_oh + d_o[:, None] * stride_od,
                 out.to(O.dtype.element_ty), mask=ok_o[None, :])  # fmt: skip
    else:
        rows_per_split = batch * heads * seqlen_q
        gl.store(LSE_PART + split * rows_per_split + row_l, lse2, mask=ok_l)
        gl.store(O_PART + (split * rows_per_split + row)[None, :] * HEAD_DIM + d_o[:, None], out,
                 mask=ok_o[None, :])  # fmt: skip


@triton.constexpr_function
def _view_layout(block_n, d, warps, swizzle, role):
    """A ring stage's e4m3 tile (``block_n`` keys of ``d`` bytes, as TMA wrote it: the NVMMA
    layout, 16-byte chunks of a row swizzled by ``swizzle`` bytes) seen as each warp's
    operand of the mma.sync kernel, its head dim relabelled so that a thread's operand
    registers are contiguous bytes of a row: role 0, K^T as (warps, d, keys), the products'
    logical d = 8 j + 2 i + k at column (d / 4) i + 2 j + k (q
    is loaded in the same order, so S = Q K^T is unchanged); role 1, V as (warps, keys, d),
    logical d = 8 a + b at column b d / 8 + a (the output is stored in that order). A linear
    layout: each offset bit's (warp, d, key) / (warp, key, d)."""
    log_d, nw = d.bit_length() - 1, block_n // warps
    logical = {}  # column -> logical d
    for dl in range(d):
        if role == 0:
            logical[(dl & 1) | ((dl >> 3) << 1) | (((dl >> 1) & 3) << (log_d - 2))] = dl
        else:
            logical[((dl & 7) << (log_d - 3)) | (dl >> 3)] = dl
    phases = swizzle // 16 - 1 if swizzle else 0
    bases = []
    for i in range((block_n * d).bit_length() - 1):
        offset = 1 << i
        a = offset ^ (((offset >> 7) & phases) << 4)  # the byte's place before the swizzle
        row, col = a // d, a % d
        w, key = row // nw, row % nw
        bases.append([w, logical[col], key] if role == 0 else [w, key, logical[col]])
    return gl.SharedLinearLayout(bases)


@triton.constexpr_function
def _d_first(lin):
    """``lin`` (a DistributedLinearLayout over (warps, keys, d)) with its d registers first:
    V's operand layout loaded as 16 contiguous bytes a key row, then its registers reordered
    (no data movement) into the operand's pairs of keys."""
    regs = [b for b in lin.reg_bases if b[2]] + [b for b in lin.reg_bases if not b[2]]
    return gl.DistributedLinearLayout(regs, lin.lane_bases, lin.warp_bases, lin.block_bases,
                                      lin.shape)


@gluon.jit
def _idx(n: gl.constexpr, dim: gl.constexpr, layout: gl.constexpr):
    """arange(n) along ``dim`` of a rank-3 ``layout``, broadcastable."""
    if dim == 0:
        return gl.arange(0, n, layout=gl.SliceLayout(1, gl.SliceLayout(2, layout)))[:, None, None]
    elif dim == 1:
        return gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout)))[None, :, None]
    else:
        return gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout)))[None, None, :]


@gluon.jit
def _mma_step(k_desc, v_desc, k_ring, v_ring, ready, q16, i, n_blocks, row0, col, table, pool,
              lo, hi, causal_offset, qpos, k_scale, m_i, l_acc, o_acc,
              MASKED: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, HEAD_DIM: gl.constexpr, ROWS: gl.constexpr,
              PAGE: gl.constexpr):
    """Block ``i`` of the split in the mma.sync kernel: each warp reads its BLOCK_N / warps
    keys of K and V from the ring stage into registers (16-byte loads), one barrier, the
    stage refilled, then per warp S = Q K^T, its own online softmax (max and sums over its
    keys only: no cross-warp step), O += P V with P straight from S's registers. MASKED:
    keys at or past ``hi`` get -inf scores and zero values (another sequence's bytes or NaN
    must not reach O), and the causal mask."""
    W: gl.constexpr = gl.num_warps()
    NW: gl.constexpr = BLOCK_N // W
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1, 1],
                                                  instr_shape=[1, 16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(0, mma, 2)
    b_l: gl.constexpr = gl.DotOperandLayout(1, mma, 2)
    v_ld: gl.constexpr = _d_first(gl.to_linear_layout(b_l, [W, NW, HEAD_DIM]))
    k_view: gl.constexpr = _view_layout(BLOCK_N, HEAD_DIM, W, k_desc.layout.swizzle_byte_width, 0)
    v_view: gl.constexpr = _view_layout(BLOCK_N, HEAD_DIM, W, k_desc.layout.swizzle_byte_width, 1)
    s = i % STAGES
    mbarrier.wait(ready.index(s), (i // STAGES) & 1)
    kt = k_ring.index(s)._reinterpret(gl.float8e4nv, [W, HEAD_DIM, NW], k_view).load(b_l)
    v8 = v_ring.index(s)._reinterpret(gl.float8e4nv, [W, NW, HEAD_DIM], v_view).load(v_ld)
    gl.thread_barrier()  # every warp has read stage s: refill it
    if i + STAGES < n_blocks:
        _issue(k_desc, v_desc, k_ring, v_ring, ready, i + STAGES, row0, col, table, pool, hi,
               BLOCK_N, STAGES, PAGE)  # fmt: skip
    t = mma_v2(q16, kt.to(gl.float16), gl.zeros([W, ROWS, NW], gl.float32, mma))
    t = t * k_scale
    start = lo + i * BLOCK_N
    if MASKED:
        key = start + _idx(W, 0, mma) * NW + _idx(NW, 2, mma)
        keep = key < hi
        if CAUSAL:
            keep = keep & (key <= qpos + causal_offset)
        t = gl.where(keep, t, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(t, 2))
    if MASKED:
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(t - m_use[:, :, None])
    l_acc = l_acc * alpha[:, :, None] + p
    o_acc = o_acc * alpha[:, :, None]
    vw = v8.to(gl.float16)
    if MASKED:
        vkey = start + _idx(W, 0, v_ld) * NW + _idx(NW, 1, v_ld)
        vw = gl.where(vkey < hi, vw, 0.0)
    o_acc = mma_v2(gl.convert_layout(p.to(gl.float16), a_l, assert_trivial=True),
                   gl.convert_layout(vw, b_l), o_acc)
    return m_new, l_acc, o_acc


@gluon.jit
def _decode_split_fp8_mma(Q, k_desc, v_desc, CACHE_SEQLENS, O_PART, LSE_PART, O, LSE,
                          BLOCK_TABLE, stride_tb, pool, COUNTERS,
                          K_DESCALE, V_DESCALE,
                          stride_qb, stride_qs, stride_qh, stride_qd,
                          stride_ob, stride_os, stride_oh, stride_od,
                          cache_len, max_len, kv_heads, kv_group, seqlen_q, split_len, qk_scale,
                          batch, seqlen_add, stride_descale_b,
                          HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr,
                          STAGES: gl.constexpr, ROWS: gl.constexpr, DIRECT: gl.constexpr,
                          PDL: gl.constexpr, PDL_WAIT: gl.constexpr, MAXNREG: gl.constexpr = 0,
                          PAGE: gl.constexpr = 0, MERGE: gl.constexpr = False,
                          EARLY_ISSUE: gl.constexpr = 2):
    """:func:`_decode_split_fp8`'s program (same arguments but its layout switches) on
    mma.sync: 4 warps, each on its own BLOCK_N / 4 keys of every ring stage, as a batched
    product over the warps (rank-3 mma layouts: q's 16 rows are every warp's A operand, a
    warp's keys its own B). No shared fp16 tiles, no fence and one barrier a step (the ring
    stage's refill); the warps' maxima, sums and outputs merged once at the end. MERGE: the
    last split of a (batch x kv head) to finish merges the splits (decode.MERGE's scheme,
    its counters at COUNTERS + batch + the program's (batch x kv head), zeroed by the device
    check), no combine kernel."""
    if PDL:
        _let_dependents_launch()
    W: gl.constexpr = gl.num_warps()
    NW: gl.constexpr = BLOCK_N // W
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1, 1],
                                                  instr_shape=[1, 16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(0, mma, 2)
    k_ring, v_ring, ready = _ring(k_desc, v_desc, STAGES, BLOCK_N, HEAD_DIM)
    fence_async_shared()
    gl.thread_barrier()
    if EARLY_ISSUE == 2:
        # the first blocks' loads on their way before the sequence's length is read: those
        # below the bound max_len (keys past the sequence's end are masked in the steps, as
        # in its last block; loads no step consumes are waited for at the end)
        lo0 = gl.program_id(1) * split_len
        bound = gl.minimum(lo0 + split_len, max_len)
        n_first = gl.minimum(gl.cdiv(gl.maximum(bound - lo0, 0), BLOCK_N), STAGES)
        row0, table = _first_row(BLOCK_TABLE, stride_tb, gl.program_id(0) // kv_heads,
                                 cache_len, lo0, PAGE)  # fmt: skip
        col = gl.program_id(0) % kv_heads * HEAD_DIM
        _issue_first(k_desc, v_desc, k_ring, v_ring, ready, n_first, row0, col, table, pool,
                     bound, BLOCK_N, STAGES, PAGE, PDL_WAIT)  # fmt: skip
    off_b, off_hk, split, causal_offset, lo, hi, n_blocks, n_full = _split_range(
        CACHE_SEQLENS, kv_heads, max_len, seqlen_q, split_len, seqlen_add, CAUSAL, BLOCK_N)
    if EARLY_ISSUE != 2:
        n_first = gl.minimum(n_blocks, STAGES)
        row0, table = _first_row(BLOCK_TABLE, stride_tb, off_b, cache_len, lo, PAGE)
        col = off_hk * HEAD_DIM
    if EARLY_ISSUE == 1:  # the first blocks' loads on their way before q's (a program's start)
        _issue_first(k_desc, v_desc, k_ring, v_ring, ready, n_first, row0, col, table, pool, hi,
                     BLOCK_N, STAGES, PAGE, PDL_WAIT)  # fmt: skip

    # q with its head dim in K's order (column 32 i + 2 j + k at d = 8 j + 2 i + k for d128),
    # in mma's A layout, a copy for every warp
    q, k_scale, v_descale = _q_and_scales(Q, K_DESCALE, V_DESCALE, stride_qb, stride_qs,
                                          stride_qh, stride_qd, off_b, off_hk, kv_group,
                                          seqlen_q, qk_scale, stride_descale_b, HEAD_DIM, ROWS)
    q = gl.reshape(gl.permute(gl.reshape(q, [ROWS, 4, HEAD_DIM // 8, 2]), (0, 2, 1, 3)),
                   [ROWS, HEAD_DIM])
    q16 = (gl.expand_dims(gl.convert_layout(q, gl.SliceLayout(0, a_l)), 0)
           + gl.zeros([W, ROWS, HEAD_DIM], gl.float16, a_l))
    if EARLY_ISSUE == 0:
        _issue_first(k_desc, v_desc, k_ring, v_ring, ready, n_first, row0, col, table, pool, hi,
                     BLOCK_N, STAGES, PAGE, PDL_WAIT)  # fmt: skip

    qpos = _idx(ROWS, 1, mma) % seqlen_q
    m_i = gl.full([W, ROWS], float("-inf"), gl.float32, gl.SliceLayout(2, mma))
    l_acc = gl.zeros([W, ROWS, NW], gl.float32, mma)
    o_acc = gl.zeros([W, ROWS, HEAD_DIM], gl.float32, mma)
    for i in range(0, n_full):
        m_i, l_acc, o_acc = _mma_step(k_desc, v_desc, k_ring, v_ring, ready, q16, i, n_blocks,
                                      row0, col, table, pool, lo, hi, causal_offset, qpos,
                                      k_scale, m_i, l_acc, o_acc, False, CAUSAL, BLOCK_N,
                                      STAGES, HEAD_DIM, ROWS, PAGE)
    for i in range(n_full, n_blocks):
        m_i, l_acc, o_acc = _mma_step(k_desc, v_desc, k_ring, v_ring, ready, q16, i, n_blocks,
                                      row0, col, table, pool, lo, hi, causal_offset, qpos,
                                      k_scale, m_i, l_acc, o_acc, True, CAUSAL, BLOCK_N,
                                      STAGES, HEAD_DIM, ROWS, PAGE)
    for i in range(n_blocks, n_first):  # (EARLY_ISSUE 2: loads past the sequence's blocks)
        mbarrier.wait(ready.index(i % STAGES), (i // STAGES) & 1)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))

    # the warps' partials merged: their maxima, sums and outputs to the row's
    m_all = gl.max(m_i, 0)
    m_ok = gl.where(m_all == float("-inf"), 0.0, m_all)
    scale = gl.exp2(m_i - m_ok[None, :])
    l_i = gl.sum(gl.sum(l_acc, 2) * scale, 0)
    o = gl.sum(o_acc * scale[:, :, None], 0)
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    lse2 = gl.where(empty, float("-inf"), m_all + gl.log2(l_safe))
    o_l: gl.constexpr = gl.SliceLayout(0, mma)
    out = o * gl.convert_layout(v_descale / l_safe, gl.SliceLayout(1, o_l))[:, None]
    # the head dim back in memory's order (logical d = 8a + b is column b x d/8 + a), then a
    # layout whose threads hold 16 contiguous bytes of a row
    out = gl.reshape(gl.permute(gl.reshape(out, [ROWS, HEAD_DIM // 8, 8]), (0, 2, 1)),
                     [ROWS, HEAD_DIM])
    st_layout: gl.constexpr = gl.BlockedLayout([1, 4], [128 // HEAD_DIM, HEAD_DIM // 4],
                                               [W, 1], [1, 0])
    out = gl.convert_layout(out, st_layout)
    r_o = gl.arange(0, ROWS, layout=gl.SliceLayout(1, st_layout))
    p_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, st_layout))
    ok_o, head_o, qpos_o, row = _out_rows(r_o, off_b, off_hk, kv_heads, kv_group, seqlen_q)
    r_l = gl.arange(0, ROWS, layout=lse2.type.layout)
    ok_l, _, _, row_l = _out_rows(r_l, off_b, off_hk, kv_heads, kv_group, seqlen_q)
    heads = kv_heads * kv_group
    if DIRECT:
        gl.store(LSE + row_l, lse2, mask=ok_l)
        gl.store(O + off_b.to(gl.int64) * stride_ob + qpos_o[:, None] * stride_os
                 + head_o[:, None] * stride_oh + p_o[None, :] * stride_od,
                 out.to(O.dtype.element_ty), mask=ok_o[:, None])
    else:
        rows_per_split = batch * heads * seqlen_q
        gl.store(LSE_PART + split * rows_per_split + row_l, lse2, mask=ok_l)
        gl.store(O_PART + (split * rows_per_split + row)[:, None] * HEAD_DIM + p_o[None, :], out,
                 mask=ok_o[:, None])
        if MERGE:  # the last of the splits to finish merges them
            if PDL and not PDL_WAIT:
                _wait_prior_grid()  # (the device check zeroes the counters)
            gl.thread_barrier()  # every thread's stores are the CTA's before the count
            done = gl.atomic_add(COUNTERS + batch + gl.program_id(0), 1, sem="acq_rel",
                                 scope="gpu")  # fmt: skip
            if done == gl.num_programs(1) - 1:
                out, lse = _merge_splits(O_PART, LSE_PART, row, ok_o, p_o, rows_per_split,
                                         gl.num_programs(1), ROWS, HEAD_DIM,
                                         st_layout)  # fmt: skip
                gl.store(LSE + row, lse, mask=ok_o)
                gl.store(O + off_b.to(gl.int64) * stride_ob + qpos_o[:, None] * stride_os
                         + head_o[:, None] * stride_oh + p_o[None, :] * stride_od,
                         out.to(O.dtype.element_ty), mask=ok_o[:, None])


@gluon.jit
def _merge_splits(O_PART, LSE_PART, row, ok, cols, rows_per_split, splits,
                  ROWS: gl.constexpr, HEAD_DIM: gl.constexpr, layout: gl.constexpr):
    """(out, lse2) of the rows ``row`` (``ok``: real ones) from every split's partial
    output and base-2 LSE in the workspace, as ``decode._merge_splits`` (no sinks here): lse =
    log2(sum_s 2^lse_s), out = sum_s 2^(lse_s - lse) out_s; rows no split saw a key of: zeros,
    -inf. The loads bypass L1 (other SMs wrote them)."""
    m = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, layout))
    for s in range(0, splits):
        m = gl.maximum(m, gl.load(LSE_PART + s * rows_per_split + row, mask=ok,
                                  other=float("-inf"), cache_modifier=".cg"))  # fmt: skip
    m_use = gl.where(m == float("-inf"), 0.0, m)
    total = gl.zeros_like(m)
    out = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout)
    for s in range(0, splits):
        ws_row = s * rows_per_split + row
        w = gl.exp2(gl.load(LSE_PART + ws_row, mask=ok, other=float("-inf"),
                            cache_modifier=".cg") - m_use)  # fmt: skip
        total += w
        out += gl.load(O_PART + ws_row[:, None] * HEAD_DIM + cols[None, :], mask=ok[:, None],
                       other=0.0, cache_modifier=".cg") * w[:, None]  # fmt: skip
    safe = gl.where(total == 0.0, 1.0, total)
    lse2 = gl.where(total == 0.0, float("-inf"), m_use + gl.log2(safe))
    return out / safe[:, None], lse2


# Both split kernels (warpgroup, mma.sync), for whoever must recognise their launches
# (decode.append_and_attend's replay recording).
KERNELS = (_decode_split_fp8, _decode_split_fp8_mma)


def applies(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, paged: bool,
            variants: bool, v_in_k: bool) -> bool:
    """Whether a checked decode call runs a Gluon split kernel (:func:`split_kernel`):
    :data:`ENABLED`, an e4m3 cache on an sm90 GPU, contiguous (batch, cache_len, kv_heads, d)
    caches, or paged ones (num_pages, page_size, kv_heads, d) with pages of a power of two
    >= :data:`MIN_PAGE` keys (TMA boxes of a page, or of a block), d = v's head dim = 64 or
    128, at most :data:`ROWS` query rows a kv head (the GQA group x the new tokens), no
    window, softcap, ALiBi or sinks (``variants``), two separate caches, and coordinates TMA
    can address (the caches' rows < 2^31)."""
    if not (ENABLED and q.is_cuda and k_cache.dtype == torch.float8_e4m3fn
            and v_cache.dtype == torch.float8_e4m3fn and not variants
            and not v_in_k):  # fmt: skip
        return False
    if kernel_limits(q.device.index)["capability_major"] != 9:
        return False
    b, sq, h, d = q.shape
    n, page, hk = k_cache.shape[0], k_cache.shape[1], k_cache.shape[2]
    if paged and (not PAGED or page < MIN_PAGE or page & (page - 1)):
        return False
    return (d in (64, 128) and v_cache.shape[3] == d and h // hk * sq <= ROWS
            and k_cache.is_contiguous() and v_cache.is_contiguous()
            and v_cache.shape == k_cache.shape and n * page < 2**31)  # fmt: skip


# The smallest page the kernels read by TMA, a box a page (16 rows of 64 or 128 bytes: whole
# swizzle periods); smaller pages take the Triton kernel.
MIN_PAGE = 16


@functools.cache
def _layout(block_n: int, d: int):
    return gl.NVMMASharedLayout.get_default_for([block_n, d], gl.float8e4nv)


def cache_desc(cache: torch.Tensor, block_n: int, paged: bool = False) -> GluonDescriptor:
    """A host TMA descriptor of a contiguous (batch, cache_len, kv_heads, d) cache, or a paged
    (num_pages, page_size, kv_heads, d) one, as its 2-D (batch x cache_len, kv_heads x d)
    view; boxes of (block_n, d), or (min(page_size, block_n), d) when paged (a page at a
    time); rows past the end read as zeros. Fields set directly (the checks above stand for
    the constructor's); the ring's shared layout is the box's (the same swizzle)."""
    n, rows, hk, d = cache.shape
    box = min(rows, block_n) if paged else block_n
    desc = object.__new__(GluonDescriptor)
    desc.base = cache
    desc.shape = [n * rows, hk * d]
    desc.strides = [hk * d, 1]
    desc.block_shape = [box, d]
    desc.layout = _layout(box, d)
    desc.padding = "zero"
    return desc
