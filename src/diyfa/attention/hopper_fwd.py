"""FlashAttention forward for Hopper (sm90) in Gluon: TMA, ``wgmma`` and warp specialisation.

Why a second forward kernel
    The portable kernel (portable.py) leaves the schedule to Triton: the same warps load K/V,
    run the matmuls and the softmax, so the tensor cores idle while the exponentials run. On
    Hopper the fast kernels (FlashAttention-3, cuDNN) split the work by warps instead. This
    kernel does the same:

    - one *loader* warp issues TMA loads: the program's Q tiles once, then K and V blocks
      through a ring of ``STAGES`` shared-memory buffers (``k_ready``/``v_ready`` complete
      when a block's bytes have landed, ``kv_empty`` when every consumer is done with it: K
      after its S = Q K^T, V after its O += P V, so the next K loads early);
    - ``CONSUMERS`` (2 or 3) *consumer* warpgroups, each owning 64 query rows of the
      program's tile. A consumer runs S = Q K^T and O += P V with asynchronous
      ``warpgroup_mma`` (Q, K and V from shared memory, P from registers) and keeps the
      tensor core busy during its softmax: it issues S_j = Q K_j^T and O += P_{j-1} V_{j-1}
      back to back, waits for S_j only, and computes the softmax of block j while
      P_{j-1} V_{j-1} runs (FlashAttention-3's intra-warpgroup pipelining). Consumers are
      independent warpgroups, so one's softmax also overlaps the others' matmuls.
    - Registers are reallocated between them (``setmaxnreg``): the loader keeps 24-40.

Numerics are the portable kernel's (module docstring there): fp32 accumulation, base-2
softmax with the scale folded in, P rounded to the input dtype before P @ V, base-2 LSE
saved per row (-inf for a row that sees no key, whose output is zeros).

Masking: causal bottom-right (query i sees key j iff j <= i + seqlen_k - seqlen_q) or
top-left (offset 0). A consumer skips the K/V blocks wholly above its diagonal; only blocks
that straddle the diagonal or the end of the keys compute a mask (a run-time branch).

Tensors are addressed through 4-D TMA descriptors over the (batch, heads, seqlen, dim) view,
so any layout whose last dimension is contiguous and whose other strides are multiples of 16
bytes runs without copies; rows past seqlen are zero-filled on load and clipped on store by
the TMA unit. What does not fit these rules goes to the portable kernel (``supports``).

Scope (``supports``): sm90, fp16/bf16, head dims 64..256 that are multiples of 8 (computed
as 64, 128 or 256: TMA zero-fills the columns past the head dim and clips them on store),
positive softmax_scale, TMA's alignment rules. The backward is the portable kernel's, which
reads the same LSE. Everything else runs on the portable family.
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
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

from diyfa._launcher import cdiv, launch
from diyfa.attention import portable
from diyfa.attention.dispatch import Family
from diyfa.attention.problem import Problem

LOG2E = 1.4426950408889634
SUB_M = 64  # query rows per consumer warpgroup: one m64 wgmma
_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}

# padded head_dim -> (consumers, BLOCK_N, STAGES, ping-pong, consumer registers, loader
# registers). Shared memory: Q (consumers * 64 * d) + STAGES * 2 * BLOCK_N * d, 2 bytes
# each: 112 / 160 / 192 KB of the 227 KB a block may use. Chosen from A/B runs on an H100
# (docs/attention.md): ping-pong was within noise or slower everywhere, 3 consumers (192
# rows, BLOCK_N 64, 152 registers each) 2-5% slower at d64, 3 stages at d128 even.
HOPPER_CONFIGS = {
    64: (2, 128, 4, False, 232, 40),
    128: (2, 128, 2, False, 232, 40),
    256: (2, 64, 2, False, 232, 40),
}


# --------------------------------------------------------------------------------------------
# Device code
# --------------------------------------------------------------------------------------------
@gluon.jit
def _tile(heads, kv_group, CAUSAL: gl.constexpr):
    """(first query row, batch, head, kv head) of this program. Causal: the heaviest tiles
    (last rows) are launched first, so the tail of the grid is light."""
    pid_m = gl.program_id(0)
    if CAUSAL:
        pid_m = gl.num_programs(0) - 1 - pid_m
    off_bh = gl.program_id(1)
    off_b = off_bh // heads
    off_h = off_bh % heads
    return pid_m, off_b, off_h, off_h // kv_group


@gluon.jit
def _num_blocks(row0, rows, seqlen_q, seqlen_k, causal_offset, BLOCK_N: gl.constexpr,
                CAUSAL: gl.constexpr):
    """How many K/V blocks (from key 0) the query rows [row0, row0 + rows) need."""
    row_end = gl.minimum(row0 + rows, seqlen_q)
    hi = seqlen_k
    if CAUSAL:
        hi = gl.maximum(gl.minimum(seqlen_k, row_end + causal_offset), 0)
    n = gl.cdiv(hi, BLOCK_N)
    if row0 >= seqlen_q:
        n = 0
    return n


@gluon.jit
def _tile2d(bufs, i):
    """Stage ``i`` of a ring of (1, 1, rows, dim) TMA blocks, as a (rows, dim) operand."""
    return bufs.index(i).reshape([bufs.type.shape[3], bufs.type.shape[4]])


@gluon.jit
def _loader(q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, k_ready, v_ready, kv_empty,
            heads, kv_group, seqlen_q, seqlen_k, causal_offset,
            CAUSAL: gl.constexpr, CONSUMERS: gl.constexpr):
    """The loader warp: each consumer's Q tile, then the program's K/V blocks in order."""
    BLOCK_N: gl.constexpr = k_bufs.type.shape[3]
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    SUB_M: gl.constexpr = q_bufs.type.shape[3]
    pid_m, off_b, off_h, off_hk = _tile(heads, kv_group, CAUSAL)
    row0 = pid_m * (CONSUMERS * SUB_M)
    for c in gl.static_range(CONSUMERS):
        mbarrier.expect(q_ready.index(c), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [off_b, off_h, row0 + c * SUB_M, 0],
                                        q_ready.index(c), q_bufs.index(c))  # fmt: skip
    n = _num_blocks(row0, CONSUMERS * SUB_M, seqlen_q, seqlen_k, causal_offset, BLOCK_N, CAUSAL)
    for j in range(n):
        s = j % STAGES
        # Wait until every consumer released the stage's previous K (then V) block. A fresh
        # mbarrier counts as having completed the phase before phase 0: the first lap passes.
        mbarrier.wait(kv_empty.index(s), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [off_b, off_hk, j * BLOCK_N, 0],
                                        k_ready.index(s), k_bufs.index(s))  # fmt: skip
        mbarrier.wait(kv_empty.index(STAGES + s), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [off_b, off_hk, j * BLOCK_N, 0],
                                        v_ready.index(s), v_bufs.index(s))  # fmt: skip


@gluon.jit
def _softmax_step(s, m_i, l_i, start_n, offs_m, seqlen_k, causal_offset, qk_scale, need_mask,
                  CAUSAL: gl.constexpr):
    """Online softmax of one block of scores ``s`` (raw q.k): returns (p, m, l, alpha), where
    alpha = 2^(m_old - m_new) rescales what was accumulated before."""
    scale = qk_scale
    if need_mask:
        offs_n = start_n + gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, s.type.layout))
        keep = offs_n[None, :] < seqlen_k
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None] + causal_offset)
        s = gl.where(keep, s * qk_scale, float("-inf"))
        scale = 1.0
    m_new = gl.maximum(m_i, gl.max(s, 1) * scale)
    # A row with no visible key so far keeps m = -inf: subtract 0 instead (no NaN).
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s * scale - m_use[:, None])
    alpha = gl.exp2(m_i - m_use)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_i, alpha


@gluon.jit
def _take_turn(turns, k, C: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong: wait until the other consumer has issued its matmuls of turn k - 1 (consumer
    0) or k (consumer 1), so the two issue in alternation and one's softmax overlaps the
    other's matmuls. Consumer 0's first wait passes at once (a fresh mbarrier counts as
    having completed the phase before phase 0)."""
    if PINGPONG:
        mbarrier.wait(turns.index(C), (k & 1) ^ (1 - C))


@gluon.jit
def _pass_turn(turns, C: gl.constexpr, PINGPONG: gl.constexpr):
    if PINGPONG:
        mbarrier.arrive(turns.index(1 - C))


@gluon.jit
def _consumer(o_desc, LSE, q_bufs, k_bufs, v_bufs, q_ready, k_ready, v_ready, kv_empty, turns,
              heads, kv_group, seqlen_q, seqlen_k, causal_offset, qk_scale,
              CAUSAL: gl.constexpr, CONSUMERS: gl.constexpr, PINGPONG: gl.constexpr,
              C: gl.constexpr):
    """Consumer warpgroup C: query rows [C * 64, C * 64 + 64) of the program's tile."""
    BLOCK_N: gl.constexpr = k_bufs.type.shape[3]
    HEAD_DIM: gl.constexpr = k_bufs.type.shape[4]
    SUB_M: gl.constexpr = q_bufs.type.shape[3]
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    dtype: gl.constexpr = k_bufs.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    orow_layout: gl.constexpr = gl.SliceLayout(1, o_layout)

    pid_m, off_b, off_h, off_hk = _tile(heads, kv_group, CAUSAL)
    row0 = pid_m * (CONSUMERS * SUB_M) + C * SUB_M
    offs_m = row0 + gl.arange(0, SUB_M, layout=row_layout)
    # Every consumer walks all the blocks the program loads (the same count keeps the
    # ping-pong turns paired); blocks wholly above a consumer's diagonal come out masked.
    n = _num_blocks(pid_m * (CONSUMERS * SUB_M), CONSUMERS * SUB_M, seqlen_q, seqlen_k,
                    causal_offset, BLOCK_N, CAUSAL)  # fmt: skip
    # Blocks from `first_masked` on straddle the causal diagonal or the end of the keys.
    first_masked = seqlen_k // BLOCK_N
    if CAUSAL:
        first_masked = gl.minimum(first_masked, gl.maximum(row0 + causal_offset + 1, 0) // BLOCK_N)

    q_tile = q_bufs.index(C)  # (1, 1, 64, d): the TMA view
    q_smem = q_tile.reshape([SUB_M, HEAD_DIM])
    mbarrier.wait(q_ready.index(C), 0)
    m_i = gl.full([SUB_M], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.zeros([SUB_M], gl.float32, layout=row_layout)
    acc = gl.zeros([SUB_M, HEAD_DIM], gl.float32, layout=o_layout)
    if n > 0:
        # Block 0: S, softmax.
        mbarrier.wait(k_ready.index(0), 0)
        k_t = _tile2d(k_bufs, 0).permute((1, 0))
        _take_turn(turns, 0, C, PINGPONG)
        s_tok = warpgroup_mma(q_smem, k_t, gl.zeros([SUB_M, BLOCK_N], gl.float32, s_layout),
                              use_acc=False, is_async=True)  # fmt: skip
        _pass_turn(turns, C, PINGPONG)
        s, _qs, _kt = warpgroup_mma_wait(0, deps=(s_tok, q_smem, k_t))
        mbarrier.arrive(kv_empty.index(0))  # K_0 is no longer read
        p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, 0, offs_m, seqlen_k, causal_offset,
                                           qk_scale, first_masked == 0, CAUSAL)  # fmt: skip
        p16 = gl.convert_layout(p.to(dtype), p_layout)
        for j in range(1, n):
            # Issue S_j = Q K_j^T, then O += P_{j-1} V_{j-1}; wait for S_j only.
            s_idx = j % STAGES
            mbarrier.wait(k_ready.index(s_idx), (j // STAGES) & 1)
            k_t = _tile2d(k_bufs, s_idx).permute((1, 0))
            prev = (j - 1) % STAGES
            mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
            v_smem = _tile2d(v_bufs, prev)
            _take_turn(turns, j, C, PINGPONG)
            s_tok = warpgroup_mma(q_smem, k_t, gl.zeros([SUB_M, BLOCK_N], gl.float32, s_layout),
                                  use_acc=False, is_async=True)  # fmt: skip
            acc_tok = warpgroup_mma(p16, v_smem, acc, is_async=True)
            _pass_turn(turns, C, PINGPONG)
            s, _qs, _kt = warpgroup_mma_wait(1, deps=(s_tok, q_smem, k_t))
            mbarrier.arrive(kv_empty.index(s_idx))  # K_j is no longer read
            # Softmax of block j while P_{j-1} V_{j-1} runs on the tensor cores.
            p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, j * BLOCK_N, offs_m, seqlen_k,
                                               causal_offset, qk_scale, j >= first_masked,
                                               CAUSAL)  # fmt: skip
            acc, _p, _vs = warpgroup_mma_wait(0, deps=(acc_tok, p16, v_smem))
            mbarrier.arrive(kv_empty.index(STAGES + prev))  # nor V_{j-1}
            p16 = gl.convert_layout(p.to(dtype), p_layout)
            acc = acc * gl.convert_layout(alpha, orow_layout)[:, None]
        last = (n - 1) % STAGES
        mbarrier.wait(v_ready.index(last), ((n - 1) // STAGES) & 1)
        v_smem = _tile2d(v_bufs, last)
        _take_turn(turns, n, C, PINGPONG)
        acc_tok = warpgroup_mma(p16, v_smem, acc, is_async=True)
        _pass_turn(turns, C, PINGPONG)
        acc, _p, _vs = warpgroup_mma_wait(0, deps=(acc_tok, p16, v_smem))
        mbarrier.arrive(kv_empty.index(STAGES + last))
    # Epilogue: O / l through this consumer's Q buffer (Q is no longer read) by TMA, which
    # clips rows past seqlen_q; LSE (base 2) per row.
    empty = l_i == 0.0
    lse2 = gl.where(empty, float("-inf"), m_i + gl.log2(l_i))
    l_o = gl.convert_layout(gl.where(empty, 1.0, l_i), orow_layout)
    out = (acc / l_o[:, None]).to(dtype)
    off_bh = off_b.to(gl.int64) * heads + off_h
    gl.store(LSE + off_bh * seqlen_q + offs_m, lse2, mask=offs_m < seqlen_q)
    q_smem.store(out)
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [off_b, off_h, row0, 0], q_tile)
    tma.store_wait(0)


@gluon.jit
def _consumer0(o_desc, LSE, q_bufs, k_bufs, v_bufs, q_ready, k_ready, v_ready, kv_empty, turns,
               heads, kv_group, seqlen_q, seqlen_k, causal_offset, qk_scale,
               CAUSAL: gl.constexpr, CONSUMERS: gl.constexpr, PINGPONG: gl.constexpr):
    _consumer(o_desc, LSE, q_bufs, k_bufs, v_bufs, q_ready, k_ready, v_ready, kv_empty, turns,
              heads, kv_group, seqlen_q, seqlen_k, causal_offset, qk_scale, CAUSAL, CONSUMERS,
              PINGPONG, 0)  # fmt: skip


@gluon.jit
def _consumer1(o_desc, LSE, q_bufs, k_bufs, v_bufs, q_ready, k_ready, v_ready, kv_empty, turns,
               heads, kv_group, seqlen_q, seqlen_k, causal_offset, qk_scale,
               CAUSAL: gl.constexpr, CONSUMERS: gl.constexpr, PINGPONG: gl.constexpr):
    _consumer(o_desc, LSE, q_bufs, k_bufs, v_bufs, q_ready, k_ready, v_ready, kv_empty, turns,
              heads, kv_group, seqlen_q, seqlen_k, causal_offset, qk_scale, CAUSAL, CONSUMERS,
              PINGPONG, 1)  # fmt: skip


@gluon.jit
def _consumer2(o_desc, LSE, q_bufs, k_bufs, v_bufs, q_ready, k_ready, v_ready, kv_empty, turns,
               heads, kv_group, seqlen_q, seqlen_k, causal_offset, qk_scale,
               CAUSAL: gl.constexpr, CONSUMERS: gl.constexpr, PINGPONG: gl.constexpr):
    _consumer(o_desc, LSE, q_bufs, k_bufs, v_bufs, q_ready, k_ready, v_ready, kv_empty, turns,
              heads, kv_group, seqlen_q, seqlen_k, causal_offset, qk_scale, CAUSAL, CONSUMERS,
              PINGPONG, 2)  # fmt: skip


@gluon.jit
def _attn_fwd_hopper(q_desc, k_desc, v_desc, o_desc, LSE,
                     heads, kv_group, seqlen_q, seqlen_k, causal_offset, qk_scale,
                     CAUSAL: gl.constexpr, CONSUMERS: gl.constexpr, STAGES: gl.constexpr,
                     PINGPONG: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                     LOADER_REGS: gl.constexpr):
    """Grid (cdiv(seqlen_q, CONSUMERS * 64), batch * heads); launched with num_warps=4 (the
    first consumer), the partitions add 4 per further consumer and 1 loader warp.
    Descriptors are 4-D over (batch, heads, seqlen, dim) with blocks (1, 1, rows, dim).
    PINGPONG (two consumers only): the consumers take turns issuing their matmuls."""
    dtype: gl.constexpr = q_desc.dtype
    q_bufs = gl.allocate_shared_memory(dtype, [CONSUMERS] + q_desc.block_type.shape,
                                       q_desc.layout)  # fmt: skip
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    # kv_empty[s]: K stage s is free; kv_empty[STAGES + s]: V stage s is free.
    kv_empty = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(CONSUMERS):
        mbarrier.init(q_ready.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=CONSUMERS)  # one arrival per consumer
        mbarrier.init(kv_empty.index(STAGES + i), count=CONSUMERS)
    for i in gl.static_range(2):
        mbarrier.init(turns.index(i), count=1)
    # (Argument tuples are written out in place: bound to a name first, their constexpr
    # members would reach the partitions as run-time values.)
    if CONSUMERS == 3:
        gl.warp_specialize([
            (_consumer0, (o_desc, LSE, q_bufs, k_bufs, v_bufs, q_ready, k_ready, v_ready,
                          kv_empty, turns, heads, kv_group, seqlen_q, seqlen_k, causal_offset,
                          qk_scale, CAUSAL, CONSUMERS, False)),
            (_consumer1, (o_desc, LSE, q_bufs, k_bufs, v_bufs, q_ready, k_ready, v_ready,
                          kv_empty, turns, heads, kv_group, seqlen_q, seqlen_k, causal_offset,
                          qk_scale, CAUSAL, CONSUMERS, False)),
            (_consumer2, (o_desc, LSE, q_bufs, k_bufs, v_bufs, q_ready, k_ready, v_ready,
                          kv_empty, turns, heads, kv_group, seqlen_q, seqlen_k, causal_offset,
                          qk_scale, CAUSAL, CONSUMERS, False)),
            (_loader, (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, k_ready,
                       v_ready, kv_empty, heads, kv_group, seqlen_q, seqlen_k, causal_offset,
                       CAUSAL, CONSUMERS)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, LOADER_REGS])  # fmt: skip
    else:
        gl.warp_specialize([
            (_consumer0, (o_desc, LSE, q_bufs, k_bufs, v_bufs, q_ready, k_ready, v_ready,
                          kv_empty, turns, heads, kv_group, seqlen_q, seqlen_k, causal_offset,
                          qk_scale, CAUSAL, CONSUMERS, PINGPONG)),
            (_consumer1, (o_desc, LSE, q_bufs, k_bufs, v_bufs, q_ready, k_ready, v_ready,
                          kv_empty, turns, heads, kv_group, seqlen_q, seqlen_k, causal_offset,
                          qk_scale, CAUSAL, CONSUMERS, PINGPONG)),
            (_loader, (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, k_ready,
                       v_ready, kv_empty, heads, kv_group, seqlen_q, seqlen_k, causal_offset,
                       CAUSAL, CONSUMERS)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])  # fmt: skip


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------
def bhsd_view(t: torch.Tensor, layout: str) -> torch.Tensor:
    """``t`` as a (batch, heads, seqlen, dim) view (no copy)."""
    return t if layout == "bhsd" else t.transpose(1, 2)


def head_dim_pad(d: int) -> int:
    """The head dim the kernel computes with: 64, 128 or 256 (TMA zero-fills the columns past
    ``d`` on load and clips them on store)."""
    return 64 if d <= 64 else (128 if d <= 128 else 256)


def _desc(t4: torch.Tensor, rows: int) -> GluonDescriptor:
    block = [1, 1, rows, head_dim_pad(t4.shape[3])]
    layout = gl.NVMMASharedLayout.get_default_for(block, _GL_DTYPES[t4.dtype])
    return GluonDescriptor(t4, list(t4.shape), list(t4.stride()), block, layout)


def hopper_args(q4, k4, v4, o4, lse2, causal_offset: int, qk_scale: float, causal: bool,
                config: tuple | None = None):
    """(grid, kernel arguments, num_warps) for (batch, heads, seqlen, dim) views."""
    b, h, sq, d = q4.shape
    consumers, block_n, stages, pingpong, c_regs, l_regs = config or HOPPER_CONFIGS[head_dim_pad(d)]
    args = dict(q_desc=_desc(q4, SUB_M), k_desc=_desc(k4, block_n), v_desc=_desc(v4, block_n),
                o_desc=_desc(o4, SUB_M), LSE=lse2, heads=h, kv_group=h // k4.shape[1],
                seqlen_q=sq, seqlen_k=k4.shape[2], causal_offset=causal_offset,
                qk_scale=qk_scale, CAUSAL=causal, CONSUMERS=consumers, STAGES=stages,
                PINGPONG=pingpong and consumers == 2,
                CONSUMER_REGS=c_regs, LOADER_REGS=l_regs)  # fmt: skip
    grid = (cdiv(sq, consumers * SUB_M), b * h)
    return grid, args, 4


def compile_for_hopper(head_dim: int = 128, dtype: torch.dtype = torch.bfloat16,
                       causal: bool = False, config: tuple | None = None):
    """Compile the kernel for sm90a without a GPU (Triton bundles ptxas), as ``hopper_args``
    sets it up for a (2, 16, 4096, head_dim) problem; returns Triton's ``CompiledKernel``
    (``.asm["ptx"]``, ``.metadata``). Run it in a process that has not run kernels under
    the interpreter (which leaves Triton's language module patched)."""
    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.experimental.gluon._runtime import GluonASTSource

    q = torch.empty(2, 16, 4096, head_dim, dtype=dtype)
    lse = torch.empty(2, 16, 4096, dtype=torch.float32)
    _, args, num_warps = hopper_args(q, q, q, q, lse, 0, 0.1, causal, config)
    target = GPUTarget("cuda", 90, 32)
    backend = CUDABackend(target)
    fn = _attn_fwd_hopper
    signature, constants = {}, {}
    for i, p in enumerate(fn.params):
        if p.is_constexpr:
            signature[p.name] = "constexpr"
            constants[(i,)] = args[p.name]
        else:
            signature[p.name] = native_specialize_impl(backend, args[p.name], False, True, True)[0]
            if signature[p.name] == "constexpr":  # an int equal to 1 is compiled in
                constants[(i,)] = args[p.name]
    return triton.compile(GluonASTSource(fn, signature, constants), target=target,
                          options={"num_warps": num_warps})


def hopper_forward(q, k, v, problem: Problem, config: tuple | None = None):
    """(out, lse2) for a problem ``supports`` accepts; lse2 is the base-2 LSE, (batch, heads,
    seqlen_q) fp32, as the portable kernel writes it (its backward reads it)."""
    p = problem
    shape = (p.batch, p.heads, p.seqlen_q, p.head_dim)
    if p.layout == "bshd":
        shape = (p.batch, p.seqlen_q, p.heads, p.head_dim)
    out = torch.empty(shape, dtype=q.dtype, device=q.device)
    lse2 = torch.empty((p.batch, p.heads, p.seqlen_q), dtype=torch.float32, device=q.device)
    if p.seqlen_k == 0:  # nothing to attend to
        return out.zero_(), lse2.fill_(float("-inf"))
    if p.seqlen_q == 0 or p.batch * p.heads == 0:
        return out, lse2
    grid, args, num_warps = hopper_args(
        bhsd_view(q, p.layout), bhsd_view(k, p.layout), bhsd_view(v, p.layout),
        bhsd_view(out, p.layout), lse2, p.causal_offset, p.softmax_scale * LOG2E, p.causal,
        config)  # fmt: skip
    launch(_attn_fwd_hopper, grid, args, {}, num_warps, 1)
    return out, lse2


# --------------------------------------------------------------------------------------------
# The family
# --------------------------------------------------------------------------------------------
MAX_GRID_Y = 65535  # CUDA's limit on the grid's second axis (batch * heads)


def supports(p: Problem) -> str | None:
    """Why this kernel cannot run ``p``; None when it can."""
    if p.capability is None or p.capability[0] != 9:
        got = "no CUDA device" if p.capability is None else f"sm{p.capability[0]}{p.capability[1]}"
        return f"it needs a Hopper GPU (sm90), got {got}"
    if p.dtype not in _GL_DTYPES:
        return f"it takes fp16 or bf16, not {str(p.dtype).removeprefix('torch.')}"
    if p.head_dim % 8 or not 64 <= p.head_dim <= 256:
        return f"it takes head dims 64..256 that are multiples of 8, not {p.head_dim}"
    if p.softmax_scale <= 0:
        return f"it takes a positive softmax_scale, not {p.softmax_scale}"
    if p.batch * p.heads > MAX_GRID_Y:
        return f"batch * heads = {p.batch * p.heads} exceeds {MAX_GRID_Y}"
    if not p.aligned16:
        return "q, k and v must start on 16-byte boundaries (TMA)"
    es = p.dtype.itemsize
    for name, strides in (("q", p.q_strides), ("k", p.k_strides), ("v", p.v_strides)):
        if strides[3] != 1:
            return f"{name}'s head dim is not contiguous (stride {strides[3]})"
        if any(st * es % 16 for st in strides[:3]):
            return f"{name}'s strides {strides} are not multiples of 16 bytes (TMA)"
    return None


FAMILY = Family("hopper", supports=supports, forward=hopper_forward,
                backward=portable.FAMILY.backward)
