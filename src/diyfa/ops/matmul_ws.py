"""A warp-specialised Hopper matmul written in Gluon (Triton's lower-level dialect).

Why a second Hopper kernel
    ``_matmul_tma_kernel`` (matmul.py) leaves the schedule to Triton's software pipeliner: the
    same warps issue the TMA loads, wait for them, run the MMAs and the epilogue. This kernel
    gives each job its own warps, as cuBLAS's Hopper kernels do:

    - one *loader* warp issues the TMA loads of A and B tiles into a ring of ``STAGES``
      shared-memory buffers, running ahead of the MMAs (into the next output tile too, while
      the current one's epilogue runs);
    - two *consumer* warpgroups (4 warps each) run the MMAs of one 128x256 output tile, each
      on its own 64 rows, and store their half of the tile through shared memory by TMA.

    Buffers are handed over with mbarriers: ``ready[s]`` completes when stage s's bytes have
    landed (the TMA unit counts them), ``empty[s]`` when both consumers are done reading it.
    A consumer keeps one asynchronous MMA in flight (``warpgroup_mma_wait(1)``) and frees
    the previous step's stage as soon as that step's MMA has retired. Each consumer is a
    partition of its own, so the two never wait on each other inside the K loop.

    The consumers get 232 registers per thread (the accumulator alone is 128), the loader 40.

    Option, off by default (``matmul.WS_STREAM_K``): a stream-K tail, the last partial wave of
    tiles shared out by K steps (same scheme as the Triton TMA kernel's). Measured on an H200
    it loses at 4096^3 (0.91x cuBLAS against 1.00x) and gains about 1% at 8192^3.

Scope
    fp16 and bf16, out dtype = input dtype, no scales, bias or activation, one matrix (2-D or
    a batch of 1); A row-major; B row-major or column-major (``w.t()``); TMA's alignment
    rules (matmul.py ``_tma_problem``). ``triton_matmul`` sends other calls to the Triton
    kernels, and small problems (fewer 128x256 tiles than half the SMs) too, which run faster
    on the smaller tiles there.

Measured on an H200 (torch 2.11, triton 3.6), see docs/matmul.md and benchmarks/results/.
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

from diyfa._launcher import cdiv

# (BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GROUP_M). 3 stages of 48 KB plus two 32 KB store
# buffers: 208 KB of the 227 KB an H100/H200 block may use. Measured on an H200 (interleaved,
# 7 rounds): GROUP_M 4 or 16, and 4 stages with each consumer's store split in two halves,
# were all within 2% of this at 4096^3 and 8192^3, none ahead on both sizes.
WS_CONFIG = (128, 256, 64, 3, 8)
CONSUMER_REGS = 232
LOADER_REGS = 40
_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}


@gluon.constexpr_function
def _pick(cond, a, b):
    return a if cond else b


@gluon.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
    """(row, column) of a tile in grouped order: GROUP_M tile rows are swept column by
    column, so that programs running at once share rows of A and columns of B in L2 (the
    same order as matmul.py's ``_tile_coords``)."""
    group = GROUP_M * num_pid_n
    first_m = (tile_id // group) * GROUP_M
    rows = gl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile_id % group) % rows
    pid_n = (tile_id % group) // rows
    return pid_m, pid_n


@gluon.jit
def _b_operand(b, B_KMAJOR: gl.constexpr):
    """B's (BLOCK_K, BLOCK_N) view of a stage: a K-major tile is read transposed."""
    if B_KMAJOR:
        return b.permute((1, 0))
    else:
        return b


@gluon.jit
def _schedule(M, N, K, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
              STREAM_K: gl.constexpr):
    """The work of every program, as the loader and the consumers walk it: (tile rows, tile
    columns, K steps per tile, dp, tail steps, this program's first and end tail step). Tiles
    [0, dp) are handed out whole, round robin; with STREAM_K the last, partial wave (when
    there is at least one whole wave) is the tail: its tiles' K steps laid end to end and cut
    into one equal range per program."""
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K, BLOCK_K)
    total = num_pid_m * num_pid_n
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    dp = total
    if STREAM_K:
        if total > programs:
            dp = total // programs * programs
    steps = (total - dp) * k_tiles
    return (num_pid_m, num_pid_n, k_tiles, dp, steps, pid * steps // programs,
            (pid + 1) * steps // programs)  # fmt: skip


@gluon.jit
def _segment(step, end, k_tiles):
    """The tail's K steps are laid end to end, tile after tile: (tile, first K step, end K
    step) of the run starting at ``step`` and ending at the tile's end or at ``end``."""
    tile = step // k_tiles
    k0 = step - tile * k_tiles
    k1 = gl.minimum(k_tiles, k0 + end - step)
    return tile, k0, k1


@gluon.jit
def _load_steps(a_desc, b_desc, a_bufs, b_bufs, ready, empty, off_m, off_n, k0, k1, it,
                B_KMAJOR: gl.constexpr):
    """Issue the loads of K steps [k0, k1) of one tile; ``it`` counts steps over the whole
    kernel (stage it % STAGES, lap it // STAGES)."""
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    NBYTES: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    for ki in range(k0, k1):
        s = it % STAGES
        # Wait until both consumers released the stage's previous contents. A fresh mbarrier
        # counts as having completed the phase before phase 0, so the first lap (waiting on
        # parity 1) passes at once.
        mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), NBYTES)
        tma.async_copy_global_to_shared(a_desc, [off_m, ki * BLOCK_K], ready.index(s),
                                        a_bufs.index(s))  # fmt: skip
        if B_KMAJOR:
            tma.async_copy_global_to_shared(b_desc, [off_n, ki * BLOCK_K], ready.index(s),
                                            b_bufs.index(s))  # fmt: skip
        else:
            tma.async_copy_global_to_shared(b_desc, [ki * BLOCK_K, off_n], ready.index(s),
                                            b_bufs.index(s))  # fmt: skip
        it += 1
    return it


@gluon.jit
def _loader(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K,
            GROUP_M: gl.constexpr, B_KMAJOR: gl.constexpr, STREAM_K: gl.constexpr):
    """The loader warp: fills stage after stage, in the consumers' order."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = _pick(B_KMAJOR, b_desc.block_type.shape[0],
                                  b_desc.block_type.shape[1])  # fmt: skip
    num_pid_m, num_pid_n, k_tiles, dp, _, step, end = _schedule(M, N, K, BLOCK_M, BLOCK_N,
                                                                BLOCK_K, STREAM_K)
    it = 0
    for tile_id in range(gl.program_id(0), dp, gl.num_programs(0)):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        it = _load_steps(a_desc, b_desc, a_bufs, b_bufs, ready, empty, pid_m * BLOCK_M,
                         pid_n * BLOCK_N, 0, k_tiles, it, B_KMAJOR)  # fmt: skip
    if STREAM_K:
        while step < end:
            tile, k0, k1 = _segment(step, end, k_tiles)
            pid_m, pid_n = _tile_coords(dp + tile, num_pid_m, num_pid_n, GROUP_M)
            it = _load_steps(a_desc, b_desc, a_bufs, b_bufs, ready, empty, pid_m * BLOCK_M,
                             pid_n * BLOCK_N, k0, k1, it, B_KMAJOR)  # fmt: skip
            step += k1 - k0


@gluon.jit
def _mma_steps(acc, a_bufs, b_bufs, ready, empty, n_steps, it, HALF: gl.constexpr,
               B_KMAJOR: gl.constexpr):
    """``n_steps`` (>= 1) K steps of this consumer's rows into ``acc``; every stage they read
    is released by the end."""
    SUB_M: gl.constexpr = a_bufs.type.shape[1] // 2
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    for i in range(n_steps):
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        a = a_bufs.index(s).slice(HALF * SUB_M, SUB_M)
        b = _b_operand(b_bufs.index(s), B_KMAJOR)
        acc = warpgroup_mma(a, b, acc, is_async=True)
        # One MMA left in flight: the previous step's has retired, free its stage.
        acc, _, _ = warpgroup_mma_wait(1, deps=(acc, a, b))
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=i > 0)
        it += 1
    acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES))
    return acc, it


@gluon.jit
def _store_rows(acc, c_desc, c_buf, off_m, off_n):
    """Epilogue of this consumer's rows of a tile. The previous tile's store must have read
    the buffer before it is reused (it had a whole K loop to do so); the fence orders the
    shared-memory writes before the TMA unit reads them. TMA clips rows and columns past M
    and N."""
    out = acc.to(c_desc.dtype)
    tma.store_wait(0)
    c_buf.store(out)
    fence_async_shared()
    tma.async_copy_shared_to_global(c_desc, [off_m, off_n], c_buf)


@gluon.jit
def _consumer(c_desc, a_bufs, b_bufs, c_bufs, ready, empty, M, N, K, PARTIALS, FLAGS,
              GROUP_M: gl.constexpr, B_KMAJOR: gl.constexpr, STREAM_K: gl.constexpr,
              HALF: gl.constexpr):
    """One consumer warpgroup: rows [HALF * BLOCK_M / 2, (HALF + 1) * BLOCK_M / 2) of every
    tile of this program; its epilogue goes through its own store buffer."""
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = _pick(B_KMAJOR, b_bufs.type.shape[1], b_bufs.type.shape[2])
    SUB_M: gl.constexpr = BLOCK_M // 2
    # The wgmma accumulator layout: 4 warps stacked along M, one m64nBLOCK_Nk16 instruction.
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    num_pid_m, num_pid_n, k_tiles, dp, steps, step, end = _schedule(M, N, K, BLOCK_M, BLOCK_N,
                                                                    BLOCK_K, STREAM_K)
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    c_buf = c_bufs.index(HALF)
    it = 0
    for tile_id in range(pid, dp, programs):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        acc = gl.zeros((SUB_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
        acc, it = _mma_steps(acc, a_bufs, b_bufs, ready, empty, k_tiles, it, HALF, B_KMAJOR)
        _store_rows(acc, c_desc, c_buf, pid_m * BLOCK_M + HALF * SUB_M, pid_n * BLOCK_N)
    if STREAM_K:
        # The last, partial wave shared out by K steps: program p runs steps
        # [p * steps / programs, (p + 1) * steps / programs) of the tail's tiles laid end to
        # end. A tile split between programs is finished by the one holding its first K step
        # (at the end of that program's range); the others run their part at the start of
        # theirs, leave fp32 partial sums in PARTIALS (one slot per program and consumer) and
        # raise a flag, which the finisher lowers again. Every program is resident (one per
        # SM), so the finisher's wait ends.
        rows = gl.arange(0, SUB_M, layout=gl.SliceLayout(1, acc_layout))
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
        offs = rows[:, None] * BLOCK_N + cols[None, :]
        while step < end:
            tile, k0, k1 = _segment(step, end, k_tiles)
            pid_m, pid_n = _tile_coords(dp + tile, num_pid_m, num_pid_n, GROUP_M)
            acc = gl.zeros((SUB_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
            acc, it = _mma_steps(acc, a_bufs, b_bufs, ready, empty, k1 - k0, it, HALF,
                                 B_KMAJOR)  # fmt: skip
            if k0 != 0:  # a later part of the tile: leave it for the finisher
                slot = pid * 2 + HALF
                gl.store(PARTIALS + slot.to(gl.int64) * (SUB_M * BLOCK_N) + offs, acc)
                gl.thread_barrier()  # every thread's partial is written before the flag
                gl.atomic_xchg(FLAGS + slot, 1, sem="release", scope="gpu")
            else:
                covered = k1
                partner = pid + 1
                while covered < k_tiles:
                    partner_end = (partner + 1) * steps // programs
                    if partner_end > partner * steps // programs:  # empty ranges raise none
                        slot = partner * 2 + HALF
                        while gl.atomic_cas(FLAGS + slot, 1, 0, sem="acquire",
                                            scope="gpu") != 1:  # fmt: skip
                            pass
                        acc += gl.load(PARTIALS + slot.to(gl.int64) * (SUB_M * BLOCK_N) + offs,
                                       cache_modifier=".cg")  # fmt: skip
                    covered = partner_end - tile * k_tiles
                    partner += 1
                _store_rows(acc, c_desc, c_buf, pid_m * BLOCK_M + HALF * SUB_M,
                            pid_n * BLOCK_N)  # fmt: skip
            step += k1 - k0
    tma.store_wait(0)


@gluon.jit
def _consumer_top(c_desc, a_bufs, b_bufs, c_bufs, ready, empty, M, N, K, PARTIALS, FLAGS,
                  GROUP_M: gl.constexpr, B_KMAJOR: gl.constexpr, STREAM_K: gl.constexpr):
    _consumer(c_desc, a_bufs, b_bufs, c_bufs, ready, empty, M, N, K, PARTIALS, FLAGS, GROUP_M,
              B_KMAJOR, STREAM_K, 0)  # fmt: skip


@gluon.jit
def _consumer_bottom(c_desc, a_bufs, b_bufs, c_bufs, ready, empty, M, N, K, PARTIALS, FLAGS,
                     GROUP_M: gl.constexpr, B_KMAJOR: gl.constexpr, STREAM_K: gl.constexpr):
    _consumer(c_desc, a_bufs, b_bufs, c_bufs, ready, empty, M, N, K, PARTIALS, FLAGS, GROUP_M,
              B_KMAJOR, STREAM_K, 1)  # fmt: skip


@gluon.jit
def _matmul_ws_kernel(a_desc, b_desc, c_desc, M, N, K, PARTIALS, FLAGS,
                      GROUP_M: gl.constexpr, STAGES: gl.constexpr, B_KMAJOR: gl.constexpr,
                      STREAM_K: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                      LOADER_REGS: gl.constexpr):
    """Persistent: program p handles tiles p, p + grid, p + 2 * grid, ... (grouped order),
    and with STREAM_K its share of the last wave's K steps. Launched with num_warps=4 (the
    first consumer); the partitions add 4 + 1 warps. PARTIALS (fp32, BLOCK_M * BLOCK_N per
    program) and FLAGS (int32, 2 per program, all 0) are read only with STREAM_K."""
    dtype: gl.constexpr = a_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    c_bufs = gl.allocate_shared_memory(c_desc.dtype, [2] + c_desc.block_type.shape,
                                       c_desc.layout)  # fmt: skip
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)  # the loader's expect; TMA counts the bytes
        mbarrier.init(empty.index(i), count=2)  # one arrival per consumer
    # (The argument tuples are written out in place: bound to a name first, their constexpr
    # members would reach the partitions as run-time values.)
    gl.warp_specialize([
        (_consumer_top, (c_desc, a_bufs, b_bufs, c_bufs, ready, empty, M, N, K, PARTIALS,
                         FLAGS, GROUP_M, B_KMAJOR, STREAM_K)),
        (_consumer_bottom, (c_desc, a_bufs, b_bufs, c_bufs, ready, empty, M, N, K, PARTIALS,
                            FLAGS, GROUP_M, B_KMAJOR, STREAM_K)),
        (_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, GROUP_M, B_KMAJOR,
                   STREAM_K)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])  # fmt: skip


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------
def ws_problem(a3: torch.Tensor, b3: torch.Tensor, out3: torch.Tensor, plain: bool) -> str | None:
    """Why this kernel cannot run these (batch, rows, cols) operands; None when it can.
    ``plain``: no scales, bias or activation. TMA's own rules are checked by the caller."""
    if a3.dtype not in _GL_DTYPES:
        return f"it takes fp16 or bf16 inputs, not {str(a3.dtype).removeprefix('torch.')}"
    if out3.dtype != a3.dtype:
        return "its output dtype is the input dtype"
    if not plain:
        return "it has no scales, bias or activation"
    if a3.shape[0] != 1:
        return "it multiplies one matrix pair (no batch)"
    if a3.stride(2) != 1:
        return "a must be row-major"
    if b3.stride(2) != 1 and b3.stride(1) != 1:
        return "b must be row- or column-major"
    return None


def ws_small(M: int, N: int, num_sms: int) -> bool:
    """Fewer output tiles than half the SMs: the Triton kernel's small tiles do better."""
    bm, bn = WS_CONFIG[:2]
    return cdiv(M, bm) * cdiv(N, bn) < num_sms // 2


def _desc(t: torch.Tensor, block: list[int]) -> GluonDescriptor:
    layout = gl.NVMMASharedLayout.get_default_for(block, _GL_DTYPES[t.dtype])
    return GluonDescriptor(t, list(t.shape), list(t.stride()), block, layout)


def ws_args(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, num_sms: int,
            config: tuple | None = None, stream_k: tuple | None = None):
    """(grid, kernel arguments, num_warps) for 2-D ``out = a @ b`` on this kernel, with
    ``config`` (default ``WS_CONFIG``); ``stream_k``: None, or the (partials, flags)
    workspace for ``num_sms`` programs, which turns the stream-K tail on."""
    bm, bn, bk, stages, group_m = config or WS_CONFIG
    M, K = a.shape
    N = b.shape[1]
    b_kmajor = b.stride(1) != 1
    if b_kmajor:  # a column-major b is described as its (N, K) row-major transpose
        b_desc = _desc(b.t(), [bn, bk])
    else:
        b_desc = _desc(b, [bk, bn])
    args = dict(a_desc=_desc(a, [bm, bk]), b_desc=b_desc, c_desc=_desc(out, [bm // 2, bn]),
                M=M, N=N, K=K, PARTIALS=stream_k[0] if stream_k else out,
                FLAGS=stream_k[1] if stream_k else out, STREAM_K=stream_k is not None,
                GROUP_M=group_m, STAGES=stages, B_KMAJOR=b_kmajor,
                CONSUMER_REGS=CONSUMER_REGS, LOADER_REGS=LOADER_REGS)  # fmt: skip
    grid = (max(1, min(num_sms, cdiv(M, bm) * cdiv(N, bn))),)
    return grid, args, 4


def compile_for_hopper(dtype: torch.dtype = torch.bfloat16, b_kmajor: bool = False,
                       stream_k: bool = False):
    """Compile the kernel for sm90a as ``ws_args`` sets it up for a 4096^3 product, without a
    GPU (Triton bundles ptxas); returns Triton's ``CompiledKernel`` (``.asm["ptx"]``,
    ``.metadata.shared``). For reading the PTX, and for the CPU test that it compiles. Run it
    in a process that has not run kernels under the interpreter (which leaves Triton's
    language module patched)."""
    from diyfa._compile import compile_for_sm90

    a = torch.empty(4096, 4096, dtype=dtype)
    workspace = None
    if stream_k:
        workspace = (torch.empty(132 * 128 * 256), torch.zeros(2 * 132, dtype=torch.int32))
    _, args, num_warps = ws_args(a, a.t() if b_kmajor else a, a, 132, stream_k=workspace)
    return compile_for_sm90(_matmul_ws_kernel, args, num_warps)
