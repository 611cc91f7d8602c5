"""Matrix multiplication in Triton: out = activation(scale_a * scale_b * (a @ b) + bias).

Shapes and layouts
    a: (M, K) and b: (K, N) give out: (M, N); batched a: (B, M, K) and b: (B, K, N) give
    (B, M, N). Any M, N, K >= 0 and any strides: transposed and sliced operands are read in
    place (every stride is a kernel argument; nothing is copied). ``out`` is a new contiguous
    tensor.

Dtypes and numerics (obeyed by both kernels)
    - Every product accumulates in fp32 (fp32 ``precision="ieee"`` on GPUs with fast fp64:
      in fp64, see below); the epilogue runs in fp32 and rounds once, to ``out_dtype``
      (default: the input dtype; bf16 for fp8 inputs).
    - fp16, bf16: tensor-core dots of the input values.
    - fp32: TF32 tensor-core dots by default (like ``torch.backends.cuda.matmul.allow_tf32``);
      ``precision="ieee"`` gives exact fp32 products (slower), summed in fp64 and rounded
      once where fp64 is fast (compute capability 8.0, 9.0, 10.0: A100, H100/H200, B200),
      else in fp32 partial sums per K tile. Under the interpreter both are exact.
      ``precision`` has no effect on the other dtypes.
    - fp8 (float8_e4m3fn, float8_e5m2, also mixed): needs ``scale_a`` and ``scale_b``, fp32,
      each per-tensor (one element) or per-row of a (M,) / per-column of b (N,). The scales
      multiply the fp32 accumulator, before the bias. Needs a GPU with fp8 tensor cores
      (compute capability >= 8.9) or the interpreter. On Hopper, Triton's default for fp8 dots
      is the tensor cores' fast (reduced-precision) accumulation, as cuBLAS's
      ``use_fast_accum=True``.
    - Epilogue, in order: scales, ``bias`` (N,) added to every row, activation: "relu",
      "gelu" (the tanh approximation, as ``F.gelu(x, approximate="tanh")``) or "silu".
    - Tile origins and batch offsets are 64-bit before they multiply strides; offsets inside
      a tile are 32-bit.

Kernels
    - ``_matmul_kernel`` (portable, every GPU): one program per output tile, pointer loads,
      grouped tile order so that consecutive programs share rows of a and columns of b in L2.
    - ``_matmul_tma_kernel`` (Hopper, sm90): persistent (one program per SM looping over
      tiles, in the same grouped order), operands and output moved by TMA through tensor
      descriptors built on the host (``TensorDescriptor``, block shapes set per config).
      Used for fp16/bf16/fp8 when every operand is row- or column-major with 16-byte
      aligned strides and base addresses (TMA's rule); otherwise the portable kernel runs.
      Options, off by default (measured slower): Triton's warp specialisation, a stream-K
      tail.
    Both share the tile-order and epilogue helpers.
    - ``_matmul_ws_kernel`` (matmul_ws.py, Hopper, Gluon): persistent and warp-specialised (a
      loader warp, two MMA warpgroups). Runs plain fp16/bf16 products (no scales, bias or
      activation) of one matrix pair with row-major a, when there are at least half as many
      128x256 tiles as SMs. Option, off by default (measured slower at 4096^3): a stream-K
      tail (``WS_STREAM_K``).

Launch configuration
    Config spaces, per-architecture defaults and shared-memory pruning are at the top of this
    file. Autotuning is opt-in (``DIYFA_AUTOTUNE=1``, winners saved across processes: see
    diyfa/tuning.py); its key is the dtypes, the layouts and the power-of-two buckets of M,
    N and K.

Limits
    a and b have the same rank (2-D or 3-D); no broadcasting of a batch dimension. The output
    dtype is fp16, bf16 or fp32 (no fp8 output). No autograd.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from diyfa import _interpreter, tuning
from diyfa._launcher import cdiv, compile_knobs, launcher_for, next_power_of_2, run_compiled
from diyfa._launcher import launch as fast_launch
from diyfa.device import interpreter_enabled, kernel_limits, require_kernel_device
from diyfa.ops.matmul_ws import _matmul_ws_kernel, ws_args, ws_problem, ws_small

if interpreter_enabled():
    _interpreter.apply()  # bf16 tl.dot is wrong in Triton 3.6's interpreter without it

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, *FP8_DTYPES)
OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ACTIVATIONS = (None, "relu", "gelu", "silu")
PRECISIONS = ("tf32", "ieee")
KERNELS = ("auto", "portable", "tma", "ws")
TMA_ALIGN = 16  # bytes: TMA needs 16-byte aligned base addresses and strides
FP8_ACC_DEFAULT = "fast"


def fp8_accumulation() -> int | None:
    """How many fp8 products Hopper's tensor cores may sum in their reduced-precision
    accumulator before the kernel adds the partial sum into its fp32 accumulator (Triton's
    ``max_num_imprecise_acc``): ``DIYFA_FP8_ACC`` = a multiple of 32 (one fp8 ``wgmma`` sums
    32), or "fast" (the default: Triton's Hopper default, never, as cuBLAS's
    ``use_fast_accum=True``). Measured on an H200 (2026-11-23, llm-matmul fp8 shapes, bf16
    out): fast 1293-1365 TFLOPS, 128 879-921, 32 645-658, against cuBLAS's 1221-1250 with
    use_fast_accum=False; but fast drifts on long sums (an output of 879 products came out
    1.4 bf16 ulps off, where 32 rounds within half an ulp: tests/test_fuzz_regressions.py).
    A setting above a config's BLOCK_K promotes once per tile. Read per call (the kernels are
    compiled per value); other GPUs and the interpreter accumulate in fp32 whatever it says."""
    value = os.environ.get("DIYFA_FP8_ACC", FP8_ACC_DEFAULT)
    if value == "fast":
        return None
    if not value.isdigit() or int(value) < 32 or int(value) % 32:
        raise ValueError(f"DIYFA_FP8_ACC must be 'fast' or a multiple of 32, got {value!r}")
    return int(value)


@triton.constexpr_function
def _promote_every(fp8_acc, block_k):
    """``max_num_imprecise_acc`` for one tile's dot: Triton refuses more than the dot's K, and
    promoting once per tile is what a larger setting means there."""
    return None if fp8_acc is None else min(fp8_acc, block_k)


# --------------------------------------------------------------------------------------------
# Configs: spaces, per-architecture defaults, pruning
# --------------------------------------------------------------------------------------------
# BLOCK_K is written for 2-byte inputs and scaled to keep a K tile at 128 bytes per row:
# x2 for fp8, /2 for fp32. So one entry means the same shared memory for every dtype.
# Portable entries: (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages).
PORTABLE_SPACE = [
    (128, 256, 64, 8, 8, 3),
    (256, 128, 64, 8, 8, 3),
    (128, 128, 64, 8, 8, 4),
    (128, 128, 64, 8, 4, 4),
    (128, 64, 64, 8, 4, 4),
    (64, 128, 64, 8, 4, 4),
]
# TMA entries add EPILOGUE_SUBTILE: store the output tile in two halves (less shared memory
# for the store buffer, so one more pipeline stage fits), and may add WARP_SPECIALIZE (Triton's
# Hopper warp specialisation; 4 warps, no subtiled store; off by default: slower on an H200
# in every config we measured).
TMA_SPACE = [
    (128, 256, 64, 8, 8, 3, False),
    (64, 128, 128, 8, 4, 4, False),  # small problems (1024^3: 128 tiles for 132 SMs)
    (128, 64, 128, 8, 4, 4, False),
    (128, 256, 64, 8, 8, 4, True),
    (256, 128, 64, 8, 8, 3, True),
    (128, 128, 64, 8, 8, 4, False),
    (128, 128, 64, 8, 4, 5, True),
    (128, 128, 128, 8, 8, 3, False),
]
# Defaults when autotuning is off, by major compute capability (8: Ampere/Ada, 9: Hopper).
# Ampere follows the seed guide (128x256x64, 3 stages, 8 warps); Hopper has the shared
# memory for one more stage. A default that does not fit the device's shared memory gives
# way to the first entry of the space that does.
DEFAULTS = {
    "portable": {8: (128, 256, 64, 8, 8, 3), 9: (128, 256, 64, 8, 8, 4)},
    "tma": {9: (128, 256, 64, 8, 8, 3, False)},
}
# Without autotuning, problems with fewer 128x256 tiles than half the SMs take smaller tiles
# with a longer K step (an H200 at 1024^3: 6.4 us per kernel against 13.7 us for 128x256).
SMALL_DEFAULTS = {"tma": {9: (64, 128, 128, 8, 4, 4, False)}}
# fp32 with precision="ieee" on the portable kernel (the fp32 products summed in fp64 on the
# fp64 tensor cores, see _matmul_kernel): 128 x 128 with 8 warps, 64 fp64 accumulators (128
# registers) a thread, no spills (ptxas, sm90a, 2026-11-23; 64 x 128 with 4 warps spilled
# 376 bytes). Run on an H200 (the GPU fuzz at 88e5549 and its regression rows at K = 132
# and 3922 passed), not timed.
IEEE_DEFAULT = (128, 128, 64, 8, 8, 4)
# Small tiles under the interpreter: the tests still cross several tiles and K steps.
INTERPRETER_DEFAULTS = {
    "portable": (32, 32, 32, 2, 4, 1),
    "tma": (32, 32, 32, 2, 4, 1, True),
}


@dataclass(frozen=True)
class MatmulConfig:
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    GROUP_M: int
    num_warps: int
    num_stages: int
    EPILOGUE_SUBTILE: bool | None = None  # TMA kernel only
    WARP_SPECIALIZE: bool | None = None  # TMA kernel only

    def meta(self) -> dict:
        meta = dict(BLOCK_M=self.BLOCK_M, BLOCK_N=self.BLOCK_N, BLOCK_K=self.BLOCK_K,
                    GROUP_M=self.GROUP_M)  # fmt: skip
        if self.EPILOGUE_SUBTILE is not None:
            meta["EPILOGUE_SUBTILE"] = self.EPILOGUE_SUBTILE
            meta["WARP_SPECIALIZE"] = bool(self.WARP_SPECIALIZE)
        return meta

    def triton_config(self, pre_hook=None) -> triton.Config:
        return triton.Config(self.meta(), num_warps=self.num_warps, num_stages=self.num_stages,
                             pre_hook=pre_hook)  # fmt: skip


def make_config(entry: tuple, elem_bytes: int) -> MatmulConfig:
    """A space or table entry as a config for inputs of ``elem_bytes`` bytes."""
    bm, bn, bk, group, warps, stages, *tma = entry
    bk = max(16, bk * 2 // elem_bytes)
    subtile = tma[0] if tma else None
    ws = (tma[1] if len(tma) > 1 else False) if tma else None
    return MatmulConfig(bm, bn, bk, group, warps, stages, subtile, ws)


def smem_bytes(cfg: MatmulConfig, elem_bytes: int, out_bytes: int) -> int:
    """Shared memory a config needs (an estimate): one a tile and one b tile per pipeline
    stage, plus, for the TMA kernel, the output tile (or half of it) staged for the store."""
    per_stage = (cfg.BLOCK_M + cfg.BLOCK_N) * cfg.BLOCK_K * elem_bytes
    total = per_stage * cfg.num_stages
    if cfg.EPILOGUE_SUBTILE is not None:
        store_n = cfg.BLOCK_N // 2 if cfg.EPILOGUE_SUBTILE else cfg.BLOCK_N
        total += cfg.BLOCK_M * store_n * out_bytes
    return total


def configs_for(kind: str, elem_bytes: int, out_bytes: int, smem_limit: int,
                capability_major: int | None = None) -> list:  # fmt: skip
    """The kind's space ("portable" or "tma") pruned to what fits ``smem_limit``; the tuned
    table's entry (``diyfa tune``) for this architecture comes first."""
    space = tuning.tuned_first(PORTABLE_SPACE if kind == "portable" else TMA_SPACE,
                               f"matmul_{kind}", capability_major, 0)  # fmt: skip
    configs = [make_config(e, elem_bytes) for e in space]
    fits = [c for c in configs if smem_bytes(c, elem_bytes, out_bytes) <= smem_limit]
    if not fits:  # never leave nothing: the smallest tile with a 2-stage pipeline
        small = min(configs, key=lambda c: c.BLOCK_M * c.BLOCK_N)
        fits = [MatmulConfig(small.BLOCK_M, small.BLOCK_N, small.BLOCK_K, small.GROUP_M,
                             small.num_warps, 2, small.EPILOGUE_SUBTILE,
                             small.WARP_SPECIALIZE)]  # fmt: skip
    return fits


def default_config(kind: str, elem_bytes: int, out_bytes: int, capability_major: int | None,
                   smem_limit: int | None, small: bool = False,
                   ieee: bool = False) -> MatmulConfig:  # fmt: skip
    """The config used without autotuning (interpreter, ``DIYFA_AUTOTUNE=0``): for ``small``
    problems the small-problem table's entry, for fp32 ``ieee`` on the portable kernel
    :data:`IEEE_DEFAULT`, else the tuned table's entry for the architecture, else the
    default table's."""
    if interpreter_enabled() or capability_major is None:
        return make_config(INTERPRETER_DEFAULTS[kind], elem_bytes)
    table = DEFAULTS[kind]
    small_table = SMALL_DEFAULTS.get(kind, {})
    if ieee and kind == "portable" and elem_bytes == 4:
        entry = IEEE_DEFAULT
    elif small and capability_major in small_table:
        entry = small_table[capability_major]
    else:
        entry = tuning.tuned_entry(f"matmul_{kind}", capability_major, 0) or (
            table[min(max(capability_major, min(table)), max(table))])  # fmt: skip
    cfg = make_config(entry, elem_bytes)
    if smem_limit is not None and smem_bytes(cfg, elem_bytes, out_bytes) > smem_limit:
        cfg = configs_for(kind, elem_bytes, out_bytes, smem_limit)[0]
    return cfg


@functools.cache
def _autotuned(kernel_fn, kind: str, elem_bytes: int, out_bytes: int, smem_limit: int,
               capability_major: int | None):  # fmt: skip
    """``kernel_fn`` autotuned over its pruned space (built once per key)."""
    hook = _set_block_shapes if kind == "tma" else None
    configs = [c.triton_config(pre_hook=hook)
               for c in configs_for(kind, elem_bytes, out_bytes, smem_limit, capability_major)]
    key = ["M_BUCKET", "N_BUCKET", "K_BUCKET", "A_ROW_MAJOR", "B_ROW_MAJOR", "SCALE_A",
           "SCALE_B", "HAS_BIAS", "ACTIVATION"]  # fmt: skip
    if "PRECISION" in kernel_fn.arg_names:  # tf32 and ieee (fp64 sums) want different tiles
        key.append("PRECISION")
    return triton.autotune(configs=configs, key=key)(kernel_fn)


def _bucket(n: int) -> int:
    """Autotuning key for a length: its next power of two (at least 16)."""
    return max(16, next_power_of_2(n))


# --------------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------------
@triton.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped order: tiles go down GROUP_M tile-rows before moving one tile-column right, so
    programs that run together reuse the same rows of a and columns of b from L2."""
    tiles_per_group = GROUP_M * num_pid_n
    first_m = (tile_id // tiles_per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    in_group = tile_id % tiles_per_group
    return first_m + in_group % group_rows, in_group // group_rows


@triton.jit
def _gelu_tanh(x):
    """GELU, tanh approximation: 0.5 x (1 + tanh(u)) = x * sigmoid(2u),
    u = sqrt(2/pi) (x + 0.044715 x^3)."""
    u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return x * tl.sigmoid(2.0 * u)


@triton.jit
def _epilogue(acc, offs_m, offs_n, M, N, scale_a, scale_b, bias,
              stride_sam, stride_sbn, stride_bias,
              SCALE_A: tl.constexpr, SCALE_B: tl.constexpr, HAS_BIAS: tl.constexpr,
              ACTIVATION: tl.constexpr):
    """fp32 accumulator tile -> scales -> bias -> activation (still fp32).

    ``scale_a``/``scale_b`` point at this batch's scales; SCALE_A/SCALE_B are "none",
    "tensor" (one value) or "row" (one per row of a / per column of b).
    """
    if SCALE_A == "tensor":
        acc = acc * tl.load(scale_a)
    elif SCALE_A == "row":
        acc = acc * tl.load(scale_a + offs_m * stride_sam, mask=offs_m < M, other=0.0)[:, None]
    if SCALE_B == "tensor":
        acc = acc * tl.load(scale_b)
    elif SCALE_B == "row":
        acc = acc * tl.load(scale_b + offs_n * stride_sbn, mask=offs_n < N, other=0.0)[None, :]
    if HAS_BIAS:
        b = tl.load(bias + offs_n * stride_bias, mask=offs_n < N, other=0.0)
        acc = acc + b.to(tl.float32)[None, :]
    if ACTIVATION == "relu":
        acc = tl.maximum(acc, 0.0)
    elif ACTIVATION == "gelu":
        acc = _gelu_tanh(acc)
    elif ACTIVATION == "silu":
        acc = acc * tl.sigmoid(acc)
    return acc


# --------------------------------------------------------------------------------------------
# Portable kernel: one program per output tile, pointer loads
# --------------------------------------------------------------------------------------------
@triton.jit
def _matmul_kernel(A, B, C, SCALE_A_PTR, SCALE_B_PTR, BIAS,
                   M, N, K,
                   stride_ab, stride_am, stride_ak,
                   stride_bb, stride_bk, stride_bn,
                   stride_cb, stride_cm, stride_cn,
                   stride_sab, stride_sam, stride_sbb, stride_sbn, stride_bias,
                   M_BUCKET, N_BUCKET, K_BUCKET,
                   A_ROW_MAJOR: tl.constexpr, B_ROW_MAJOR: tl.constexpr,
                   SCALE_A: tl.constexpr, SCALE_B: tl.constexpr, HAS_BIAS: tl.constexpr,
                   ACTIVATION: tl.constexpr, PRECISION: tl.constexpr, FP8_ACC: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr):
    # M/N/K_BUCKET and A/B_ROW_MAJOR only key the autotuner (the strides carry the layout).
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _tile_coords(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
    off_b = tl.program_id(1).to(tl.int64)
    start_m = pid_m.to(tl.int64) * BLOCK_M
    start_n = pid_n.to(tl.int64) * BLOCK_N

    rm = tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = (rm < M - start_m)[:, None]
    n_ok = (rn < N - start_n)[None, :]
    a_ptrs = (A + off_b * stride_ab + start_m * stride_am
              + rm[:, None] * stride_am + rk[None, :] * stride_ak)  # fmt: skip
    b_ptrs = (B + off_b * stride_bb + start_n * stride_bn
              + rk[:, None] * stride_bk + rn[None, :] * stride_bn)  # fmt: skip

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # fp32 with precision="ieee": the exact fp32 products (24 x 24 bits fit fp64's 53) summed
    # in fp64, rounded to fp32 once at the end, so the result is within half an fp32 ulp of
    # the exact sum plus fp64's error (~K 2^-53, relative to sum |a b|). Summed in fp32, one
    # K-long FMA chain had 2.2x cuBLAS's error at K = 426 on an H200, fp32 partial sums
    # per K tile still 9.4x at K = 3922 (GPU fuzz, 2026-11-23). On sm90 the fp64 dot is the
    # fp64 tensor-core mma (67 TFLOPS on an H100, as many as its fp32 CUDA-core FMAs).
    # PRECISION "ieee64" is "ieee" where the host found fast fp64. Elsewhere (fp64 at 1/64 of
    # fp32 on consumer and L-series GPUs) fp32 "ieee" sums each K tile's products into a
    # fresh fp32 partial added to the accumulator (1.4x cuBLAS's error at m = 1, K = 132 with
    # a partial per two tiles; per tile it passed; 9.4x at K = 3922 all the same).
    F64_SUM: tl.constexpr = PRECISION == "ieee64" and A.dtype.element_ty == tl.float32
    TWO_LEVEL: tl.constexpr = PRECISION == "ieee" and A.dtype.element_ty == tl.float32
    if F64_SUM:
        acc64 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float64)
    else:
        acc64 = acc  # (unused)
    part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=m_ok & (rk[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(rk[:, None] < k_left) & n_ok, other=0.0)
        if F64_SUM:
            acc64 = tl.dot(a.to(tl.float64), b.to(tl.float64), acc64, input_precision="ieee",
                           out_dtype=tl.float64)
        elif TWO_LEVEL:
            part = tl.dot(a, b, part, input_precision=PRECISION)
            if k_left > 0:  # always true; a reset the compiler cannot fold away (Triton
                # folds add(dot(a, b, 0), acc) into dot(a, b, acc))
                acc += part
                part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        else:
            acc = tl.dot(a, b, acc, input_precision=PRECISION,
                         max_num_imprecise_acc=_promote_every(FP8_ACC, BLOCK_K))
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if F64_SUM:
        acc = acc64.to(tl.float32)
    if TWO_LEVEL:
        acc += part
    offs_m = start_m.to(tl.int32) + rm
    offs_n = start_n.to(tl.int32) + rn
    acc = _epilogue(acc, offs_m, offs_n, M, N, SCALE_A_PTR + off_b * stride_sab,
                    SCALE_B_PTR + off_b * stride_sbb, BIAS, stride_sam, stride_sbn, stride_bias,
                    SCALE_A, SCALE_B, HAS_BIAS, ACTIVATION)  # fmt: skip
    c_ptrs = (C + off_b * stride_cb + start_m * stride_cm + start_n * stride_cn
              + rm[:, None] * stride_cm + rn[None, :] * stride_cn)  # fmt: skip
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=m_ok & n_ok)


# --------------------------------------------------------------------------------------------
# Hopper kernel: persistent, TMA tensor descriptors made on the device
# --------------------------------------------------------------------------------------------
@triton.jit
def _load_tile(desc, off_b, off_r, off_c, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
               ROW_MAJOR: tl.constexpr, BATCHED: tl.constexpr):
    """The (BLOCK_R, BLOCK_C) tile at (off_r, off_c) of the matrix ``desc`` describes.
    Out-of-bounds elements read as zero."""
    if ROW_MAJOR:
        if BATCHED:
            tile = desc.load([off_b, off_r, off_c]).reshape(BLOCK_R, BLOCK_C)
        else:
            tile = desc.load([off_r, off_c])
    else:
        if BATCHED:
            tile = desc.load([off_b, off_c, off_r]).reshape(BLOCK_C, BLOCK_R).T
        else:
            tile = desc.load([off_c, off_r]).T
    return tile


@triton.jit
def _store_tile(desc, off_b, off_m, off_n, tile, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BATCHED: tl.constexpr):
    """Store a (BLOCK_M, BLOCK_N) tile of the row-major output; TMA clips at the edges."""
    if BATCHED:
        desc.store([off_b, off_m, off_n], tile.reshape(1, BLOCK_M, BLOCK_N))
    else:
        desc.store([off_m, off_n], tile)


@triton.jit
def _tma_tile_coords(tile_id, tiles_per_batch, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(batch, tile row, tile column) of a tile: batches one after another, grouped order
    inside each."""
    off_b = tile_id // tiles_per_batch
    pid_m, pid_n = _tile_coords(tile_id % tiles_per_batch, num_pid_m, num_pid_n, GROUP_M)
    return off_b, pid_m, pid_n


@triton.jit
def _matmul_tma_kernel(a_desc, b_desc, c_desc, SCALE_A_PTR, SCALE_B_PTR, BIAS,
                       batch, M, N, K,
                       stride_sab, stride_sam, stride_sbb, stride_sbn, stride_bias,
                       M_BUCKET, N_BUCKET, K_BUCKET,
                       A_ROW_MAJOR: tl.constexpr, B_ROW_MAJOR: tl.constexpr,
                       BATCHED: tl.constexpr, SCALE_A: tl.constexpr, SCALE_B: tl.constexpr,
                       HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, NUM_SMS: tl.constexpr,
                       FP8_ACC: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr, EPILOGUE_SUBTILE: tl.constexpr,
                       WARP_SPECIALIZE: tl.constexpr, STREAM_K: tl.constexpr,
                       PARTIALS, FLAGS):
    # The descriptors are made on the host (``_tma_descriptors``) with this config's block
    # shapes. NUM_SMS (the grid size) is fixed per device: constexpr costs no extra compiles.
    # Warp specialisation (Triton's Hopper pass: producer warps issue the TMA loads, the
    # others run the MMAs and the epilogue) needs the tile loop unflattened.
    FLATTEN: tl.constexpr = not WARP_SPECIALIZE

    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    tiles_per_batch = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    # The epilogue finds its tile from a counter of its own (tile_id_c) rather than from the
    # loop variable: with the loops flattened, the pipeliner issues the next tile's loads
    # while this tile's epilogue runs, and a shared value would tie the two together.
    total_tiles = tiles_per_batch * batch
    # With STREAM_K, whole waves of tiles run here and the last, partial wave below (when
    # there is at least one whole wave).
    dp_tiles = total_tiles
    if STREAM_K:
        if total_tiles > NUM_SMS:
            dp_tiles = total_tiles // NUM_SMS * NUM_SMS
    tile_id_c = tl.program_id(0) - NUM_SMS
    for tile_id in tl.range(tl.program_id(0), dp_tiles, NUM_SMS, flatten=FLATTEN,
                            warp_specialize=WARP_SPECIALIZE):
        off_b, pid_m, pid_n = _tma_tile_coords(tile_id, tiles_per_batch, num_pid_m, num_pid_n,
                                               GROUP_M)  # fmt: skip
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            off_k = ki * BLOCK_K
            a = _load_tile(a_desc, off_b, off_m, off_k, BLOCK_M, BLOCK_K, A_ROW_MAJOR, BATCHED)
            b = _load_tile(b_desc, off_b, off_k, off_n, BLOCK_K, BLOCK_N, B_ROW_MAJOR, BATCHED)
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=_promote_every(FP8_ACC, BLOCK_K))

        tile_id_c += NUM_SMS
        off_b, pid_m, pid_n = _tma_tile_coords(tile_id_c, tiles_per_batch, num_pid_m, num_pid_n,
                                               GROUP_M)  # fmt: skip
        _tma_epilogue(acc, c_desc, off_b, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N,
                      SCALE_A_PTR, SCALE_B_PTR, BIAS, stride_sab, stride_sam, stride_sbb,
                      stride_sbn, stride_bias, SCALE_A, SCALE_B, HAS_BIAS, ACTIVATION,
                      BLOCK_M, BLOCK_N, EPILOGUE_SUBTILE, BATCHED)  # fmt: skip

    if STREAM_K:  # compiled in only when asked for (its atomics need the fp32 workspace)
        if dp_tiles < total_tiles:
            # The last, partial wave of tiles, shared out by K steps: program q (counted from the
            # last program, see below) runs steps [q * steps / NUM_SMS, (q + 1) * steps / NUM_SMS)
            # of the tail's tiles laid end to end. A tile split between programs is finished by
            # the one holding its first K step; the others leave fp32 partial sums in PARTIALS and
            # raise their flag. The finisher reaches that step at the end of its range, after the
            # others passed the tile at the start of theirs: short waits. Programs count from the
            # last so that a finisher's partners come before it in launch order (the interpreter
            # runs programs one by one, in that order).
            q = NUM_SMS - 1 - tl.program_id(0)
            sk_steps = (total_tiles - dp_tiles) * k_tiles
            step = q * sk_steps // NUM_SMS
            step_end = (q + 1) * sk_steps // NUM_SMS
            rows = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
            while step < step_end:
                tile = step // k_tiles
                k0 = step - tile * k_tiles
                k1 = tl.minimum(k_tiles, k0 + step_end - step)
                off_b, pid_m, pid_n = _tma_tile_coords(dp_tiles + tile, tiles_per_batch,
                                                       num_pid_m, num_pid_n, GROUP_M)  # fmt: skip
                off_m = pid_m * BLOCK_M
                off_n = pid_n * BLOCK_N
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for ki in range(k0, k1):
                    off_k = ki * BLOCK_K
                    a = _load_tile(a_desc, off_b, off_m, off_k, BLOCK_M, BLOCK_K, A_ROW_MAJOR,
                                   BATCHED)  # fmt: skip
                    b = _load_tile(b_desc, off_b, off_k, off_n, BLOCK_K, BLOCK_N, B_ROW_MAJOR,
                                   BATCHED)  # fmt: skip
                    acc = tl.dot(a, b, acc,
                                 max_num_imprecise_acc=_promote_every(FP8_ACC, BLOCK_K))
                if k0 != 0:  # a later part of the tile: leave it for the finisher
                    tl.store(PARTIALS + q.to(tl.int64) * (BLOCK_M * BLOCK_N) + rows, acc)
                    tl.debug_barrier()  # every thread's partial is written before the flag
                    tl.atomic_xchg(FLAGS + q, 1, sem="release", scope="gpu")
                else:
                    covered = k1
                    partner = q + 1
                    while covered < k_tiles:
                        partner_end = (partner + 1) * sk_steps // NUM_SMS
                        if partner_end > partner * sk_steps // NUM_SMS:  # empty ranges raise none
                            while tl.atomic_cas(FLAGS + partner, 1, 0, sem="acquire",
                                                scope="gpu") != 1:  # fmt: skip
                                pass
                            acc += tl.load(PARTIALS + partner.to(tl.int64) * (BLOCK_M * BLOCK_N)
                                           + rows, cache_modifier=".cg")  # fmt: skip
                        covered = partner_end - tile * k_tiles
                        partner += 1
                    _tma_epilogue(acc, c_desc, off_b, off_m, off_n, M, N, SCALE_A_PTR, SCALE_B_PTR,
                                  BIAS, stride_sab, stride_sam, stride_sbb, stride_sbn, stride_bias,
                                  SCALE_A, SCALE_B, HAS_BIAS, ACTIVATION, BLOCK_M, BLOCK_N,
                                  EPILOGUE_SUBTILE, BATCHED)  # fmt: skip
                step += k1 - k0


@triton.jit
def _tma_epilogue(acc, c_desc, off_b, off_m, off_n, M, N, SCALE_A_PTR, SCALE_B_PTR, BIAS,
                  stride_sab, stride_sam, stride_sbb, stride_sbn, stride_bias,
                  SCALE_A: tl.constexpr, SCALE_B: tl.constexpr, HAS_BIAS: tl.constexpr,
                  ACTIVATION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  EPILOGUE_SUBTILE: tl.constexpr, BATCHED: tl.constexpr):
    """Epilogue of one output tile, stored by TMA (whole, or in two halves)."""
    offs_m = off_m + tl.arange(0, BLOCK_M)
    scale_a = SCALE_A_PTR + off_b.to(tl.int64) * stride_sab
    scale_b = SCALE_B_PTR + off_b.to(tl.int64) * stride_sbb
    if EPILOGUE_SUBTILE:
        STORE_N: tl.constexpr = BLOCK_N // 2
        halves = tl.reshape(acc, (BLOCK_M, 2, STORE_N)).permute(0, 2, 1)
        acc0, acc1 = tl.split(halves)
        offs_n = off_n + tl.arange(0, STORE_N)
        acc0 = _epilogue(acc0, offs_m, offs_n, M, N, scale_a, scale_b, BIAS,
                         stride_sam, stride_sbn, stride_bias,
                         SCALE_A, SCALE_B, HAS_BIAS, ACTIVATION)  # fmt: skip
        _store_tile(c_desc, off_b, off_m, off_n, acc0.to(c_desc.dtype),
                    BLOCK_M, STORE_N, BATCHED)  # fmt: skip
        acc1 = _epilogue(acc1, offs_m, offs_n + STORE_N, M, N, scale_a, scale_b, BIAS,
                         stride_sam, stride_sbn, stride_bias,
                         SCALE_A, SCALE_B, HAS_BIAS, ACTIVATION)  # fmt: skip
        _store_tile(c_desc, off_b, off_m, off_n + STORE_N, acc1.to(c_desc.dtype),
                    BLOCK_M, STORE_N, BATCHED)  # fmt: skip
    else:
        offs_n = off_n + tl.arange(0, BLOCK_N)
        acc = _epilogue(acc, offs_m, offs_n, M, N, scale_a, scale_b, BIAS,
                        stride_sam, stride_sbn, stride_bias,
                        SCALE_A, SCALE_B, HAS_BIAS, ACTIVATION)  # fmt: skip
        _store_tile(c_desc, off_b, off_m, off_n, acc.to(c_desc.dtype),
                    BLOCK_M, BLOCK_N, BATCHED)  # fmt: skip


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------
def _as_3d(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 3 else t.unsqueeze(0)


def _device_facts(t: torch.Tensor) -> tuple[int | None, int | None, int | None]:
    """(major compute capability, shared memory per block, SM count); Nones off the GPU."""
    if not t.is_cuda or interpreter_enabled():
        return None, None, None
    lim = kernel_limits(t.device.index)
    return lim["capability_major"], lim["max_shared_mem"], lim["sm_count"]


FAST_FP64 = ((8, 0), (9, 0), (10, 0))  # fp64 (tensor cores) about as fast as fp32 FMAs


def _kernel_precision(precision: str, a: torch.Tensor) -> str:
    """The portable kernel's PRECISION: "ieee64" (fp32 products summed in fp64) for fp32
    "ieee" under the interpreter and on GPUs of FAST_FP64, else ``precision``."""
    if precision != "ieee" or a.dtype != torch.float32:
        return precision
    if not a.is_cuda or interpreter_enabled():
        return "ieee64"
    return "ieee64" if torch.cuda.get_device_capability(a.device) in FAST_FP64 else "ieee"


def _row_major(t: torch.Tensor) -> bool:
    """Whether the last dim of a (batch, rows, cols) tensor is the contiguous one."""
    return t.stride(2) == 1 or t.shape[2] == 1


def _tma_problem(a3: torch.Tensor, b3: torch.Tensor, out3: torch.Tensor) -> str | None:
    """Why TMA cannot read these operands (None when it can)."""
    if a3.dtype == torch.float32:
        return "fp32 inputs run on the portable kernel"
    if a3.shape[2] == 0:
        return "K is 0"
    for name, t in (("a", a3), ("b", b3), ("out", out3)):
        if t.data_ptr() % TMA_ALIGN:
            return f"{name}'s data pointer is not {TMA_ALIGN}-byte aligned"
        row_major = _row_major(t)
        if not row_major and t.stride(1) != 1 and t.shape[1] != 1:
            return f"{name} is neither row- nor column-major (strides {tuple(t.stride())})"
        outer = t.stride(1) if row_major else t.stride(2)
        for label, stride in (("batch", t.stride(0)), ("outer", outer)):
            if (stride * t.element_size()) % TMA_ALIGN:
                return (f"{name}'s {label} stride ({stride} elements) is not a multiple of "
                        f"{TMA_ALIGN} bytes")  # fmt: skip
    return None


def _operand_desc(t3: torch.Tensor, row_major: bool, batched: bool) -> TensorDescriptor:
    """A host TMA descriptor for a (batch, rows, cols) operand whose rows (row-major) or
    columns are contiguous: TMA needs the innermost stride to be 1, so a column-major matrix
    is described as its transpose. Block shapes are filled in per config
    (``_set_block_shapes``). Unbatched problems get 2-D descriptors."""
    batch, rows, cols = t3.shape
    if row_major:
        shape, strides = [rows, cols], [t3.stride(1), 1]
    else:
        shape, strides = [cols, rows], [t3.stride(2), 1]
    if batched:
        shape, strides = [batch, *shape], [t3.stride(0), *strides]
    # Built without TensorDescriptor.__init__'s checks (~2 us each): _tma_problem has checked
    # alignment and strides, and the block shape is set before any launch.
    desc = TensorDescriptor.__new__(TensorDescriptor)
    desc.base, desc.shape, desc.strides, desc.padding = t3, shape, strides, "zero"
    desc.block_shape = [1] * len(shape)
    return desc


def _desc_on(desc, base):
    """A copy of ``desc`` (shape, strides, block shape; a Triton or a Gluon descriptor)
    describing ``base`` instead. The launcher reads only ``base``'s data pointer, so a view
    (``b.t()``, ``a[0]``) may be given as the tensor it views."""
    copy = type(desc).__new__(type(desc))
    copy.__dict__.update(desc.__dict__)
    copy.base = base
    return copy


# Stream-K: the TMA kernel can share out the last, partial wave of tiles by K steps (see the
# kernel). Off by default: on an H200 (2026-11-21, interleaved A/B, autotuned configs) it was
# slower at 4096^3 (0.89x vs 0.98x cuBLAS, bf16) and at 8192x4096x14336, faster only at
# 4096x14336x4096 (+1.6%). Its fp32 partial sums and flags live in one buffer pair per
# (device, stream), sized for the largest tile: kernels on one stream run one at a time, and
# every flag raised in a launch is lowered in it. A CUDA graph being captured gets its own.
TMA_STREAM_K = False
# The same for the warp-specialised kernel (matmul_ws.py): off by default, see docs/matmul.md.
WS_STREAM_K = False
_MAX_TILE = 256 * 128
_stream_k_buffers: dict = {}


def _stream_k_workspace(device: torch.device, programs: int) -> tuple:
    """(partials, flags) for ``programs`` persistent programs on ``device``: a tile of
    partial sums per program; two flags per program (the warp-specialised kernel's consumers
    raise one each)."""
    def fresh():
        return (torch.empty(programs * _MAX_TILE, dtype=torch.float32, device=device),
                torch.zeros(2 * programs, dtype=torch.int32, device=device))  # fmt: skip

    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return fresh()
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
    key = (device, stream)
    bufs = _stream_k_buffers.get(key)
    if bufs is None or bufs[1].numel() < 2 * programs:
        bufs = _stream_k_buffers[key] = fresh()
    return bufs


def _set_block_shapes(args: dict) -> None:
    """Give the descriptors in ``args`` the block shapes of the config in ``args``
    (also the autotuner's pre-hook: each config it tries has its own tiles)."""
    bm, bn, bk = args["BLOCK_M"], args["BLOCK_N"], args["BLOCK_K"]
    if args["STREAM_K"] and bm * bn > _MAX_TILE:  # the workspace holds one tile per program
        raise ValueError(f"stream-K needs BLOCK_M * BLOCK_N <= {_MAX_TILE}, got {bm}x{bn}")
    lead = [1] if args["BATCHED"] else []
    a_block = [bm, bk] if args["A_ROW_MAJOR"] else [bk, bm]
    b_block = [bk, bn] if args["B_ROW_MAJOR"] else [bn, bk]
    store_n = bn // 2 if args["EPILOGUE_SUBTILE"] else bn
    args["a_desc"].block_shape = lead + a_block
    args["b_desc"].block_shape = lead + b_block
    args["c_desc"].block_shape = lead + [bm, store_n]


# The autotuner's choice per key, looked up here instead of through triton's Autotuner.run,
# whose per-call key building costs tens of microseconds: most of a 1024^3 product's time.
_AUTOTUNE_KEY = ("M_BUCKET", "N_BUCKET", "K_BUCKET", "A_ROW_MAJOR", "B_ROW_MAJOR", "SCALE_A",
                 "SCALE_B", "HAS_BIAS", "ACTIVATION", "PRECISION")  # fmt: skip
_chosen: dict[tuple, tuple[dict, int, int]] = {}


def _launch(kernel_fn, kind: str, grid, elem_bytes: int, out_bytes: int, major, smem,
            operands: tuple, args: dict, small: bool = False) -> None:  # fmt: skip
    """Launch autotuned (GPU) or with the default config (interpreter, DIYFA_AUTOTUNE=0).

    On the GPU the config chosen for a key is remembered, and later launches go through
    ``FastLauncher`` (diyfa/_launcher.py), which skips Triton's per-call argument binding;
    those return (kernel function, compiled kernel, grid, arguments) for ``_Replay``; the
    others None.
    """
    if major is None:  # interpreter
        cfg = default_config(kind, elem_bytes, out_bytes, major, smem)
        if kind == "tma":
            _set_block_shapes({**args, **cfg.meta()})
        kernel_fn[grid(cfg.meta())](**args, **cfg.meta(), num_warps=cfg.num_warps,
                                    num_stages=cfg.num_stages)  # fmt: skip
        return None
    autotune = tuning.autotune_enabled()
    a, b, out = operands
    key = (kind, autotune, small, a.dtype, b.dtype, out.dtype, a.device.index,
           *(args.get(name) for name in _AUTOTUNE_KEY))  # fmt: skip
    choice = _chosen.get(key)
    if choice is None and autotune:
        # A winner an earlier process found on this GPU (tuning.cached_choice).
        disk_key = key + (torch.cuda.get_device_name(a.device),)
        choice = tuning.cached_choice(disk_key)
        if choice is not None:
            _chosen[key] = choice
    if choice is None:
        if autotune:
            tuned = _autotuned(kernel_fn, kind, elem_bytes, out_bytes, smem, major)
            tuned[grid](**args)  # benchmarks the configs once, then runs the best
            best = tuned.best_config
            _chosen[key] = (dict(best.kwargs), best.num_warps, best.num_stages)
            tuning.remember_choice(disk_key, *_chosen[key])
            return None
        cfg = default_config(kind, elem_bytes, out_bytes, major, smem, small,
                             ieee=args.get("PRECISION") in ("ieee", "ieee64"))  # fmt: skip
        choice = _chosen[key] = (cfg.meta(), cfg.num_warps, cfg.num_stages)
    meta, num_warps, num_stages = choice
    if kind == "tma":
        _set_block_shapes({**args, **meta})
    g = grid(meta)
    compiled = fast_launch(kernel_fn, g, args, meta, num_warps, num_stages)
    return kernel_fn, compiled, g, {**args, **meta}


def _ws_problem(a3, b3, out3, scales, bias, activation) -> str | None:
    """Why the warp-specialised kernel cannot run this call (None when it can)."""
    plain = scales[0][0] == scales[1][0] == "none" and bias is None and activation is None
    return _tma_problem(a3, b3, out3) or ws_problem(a3, b3, out3, plain)


def _matmul(a, b, out, scales, bias, activation, precision, kernel):
    """Run one kernel on validated inputs, writing ``out``; returns what ``_launch`` did."""
    a3, b3, out3 = _as_3d(a), _as_3d(b), _as_3d(out)
    batch, M, K = a3.shape
    N = b3.shape[2]
    (mode_a, scale_a, sab, sam), (mode_b, scale_b, sbb, sbn) = scales
    dummy = out  # stands in for absent scale/bias pointers (never read)
    common = dict(
        C=out3, SCALE_A_PTR=scale_a if scale_a is not None else dummy,
        SCALE_B_PTR=scale_b if scale_b is not None else dummy,
        BIAS=bias if bias is not None else dummy,
        M=M, N=N, K=K, stride_cb=out3.stride(0), stride_cm=out3.stride(1),
        stride_sab=sab, stride_sam=sam, stride_sbb=sbb, stride_sbn=sbn,
        stride_bias=bias.stride(0) if bias is not None else 0,
        M_BUCKET=_bucket(M), N_BUCKET=_bucket(N), K_BUCKET=_bucket(K),
        A_ROW_MAJOR=_row_major(a3), B_ROW_MAJOR=_row_major(b3),
        SCALE_A=mode_a, SCALE_B=mode_b, HAS_BIAS=bias is not None, ACTIVATION=activation,
        FP8_ACC=fp8_accumulation() if a.dtype in FP8_DTYPES else None,
    )  # fmt: skip
    major, smem, num_sms = _device_facts(a)
    elem, out_bytes = a.element_size(), out.element_size()

    if kernel == "ws" or (kernel == "auto" and major == 9 and not ws_small(M, N, num_sms)
                          and _ws_problem(a3, b3, out3, scales, bias, activation) is None):
        workspace = _stream_k_workspace(a.device, num_sms) if WS_STREAM_K else None
        grid, args, num_warps = ws_args(a3[0], b3[0], out3[0], num_sms, stream_k=workspace)
        compiled = fast_launch(_matmul_ws_kernel, grid, args, {}, num_warps, 1)
        return _matmul_ws_kernel, compiled, grid, args
    if kernel == "auto":
        use_tma = major == 9 and _tma_problem(a3, b3, out3) is None
    else:
        use_tma = kernel == "tma"
    if use_tma:
        a_rm, b_rm = common["A_ROW_MAJOR"], common["B_ROW_MAJOR"]
        batched = batch > 1
        num_sms = num_sms or 4  # interpreter: a few programs, each looping over tiles

        def grid(meta):
            tiles = cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"]) * batch
            return (max(1, min(num_sms, tiles)),)

        small = cdiv(M, 128) * cdiv(N, 256) * batch < num_sms // 2
        del common["C"], common["stride_cb"], common["stride_cm"]
        ops = (a, b, out)
        partials = flags = out3  # placeholders, never read without stream-K
        if TMA_STREAM_K:
            partials, flags = _stream_k_workspace(a.device, num_sms)
        return _launch(_matmul_tma_kernel, "tma", grid, elem, out_bytes, major, smem, ops, dict(
            a_desc=_operand_desc(a3, a_rm, batched), b_desc=_operand_desc(b3, b_rm, batched),
            c_desc=_operand_desc(out3, True, batched), batch=batch, BATCHED=batched,
            NUM_SMS=num_sms, STREAM_K=TMA_STREAM_K, PARTIALS=partials, FLAGS=flags,
            **common), small)  # fmt: skip

    def grid(meta):
        return (cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"]), batch)

    operands = (a, b, out)
    return _launch(_matmul_kernel, "portable", grid, elem, out_bytes, major, smem, operands, dict(
        A=a3, B=b3, stride_ab=a3.stride(0), stride_am=a3.stride(1), stride_ak=a3.stride(2),
        stride_bb=b3.stride(0), stride_bk=b3.stride(1), stride_bn=b3.stride(2),
        stride_cn=out3.stride(2), PRECISION=_kernel_precision(precision, a),
        **common))  # fmt: skip


# --------------------------------------------------------------------------------------------
# Replays: a call shape seen before skips validation and argument assembly
# --------------------------------------------------------------------------------------------
# A validated call's launch depends on its tensors only through their data pointers once
# shapes, strides, dtypes, devices, pointer alignment and options are fixed; those form
# ``_replay_key``. Measured on an H200 host: ~54 us per 1024^3 call before, while the GPU
# work is ~7 us (torch.matmul's host cost is 8.6 us).
_REPLAYS_MAX = 256  # a bound on what a long run with many shapes keeps
_replays: dict[tuple, _Replay] = {}


def forget_choices() -> None:
    """Forget the configs chosen per autotuning key and the replays built on them (for
    forcing a config, as ``diyfa tune`` does)."""
    _chosen.clear()
    _replays.clear()


def _tensor_sig(t) -> tuple | None:
    if t is None:
        return None
    if type(t) is not torch.Tensor:
        return (type(t),)  # not replayed: _replay_key gives None for it
    return (t.dtype, t.shape, t.stride(), t.device, t.data_ptr() % TMA_ALIGN)


def _replay_key(a, b, out_dtype, scale_a, scale_b, bias, activation, precision,
                kernel) -> tuple | None:  # fmt: skip
    """What decides a call's launch, besides the data pointers; None: not replayable."""
    if type(a) is not torch.Tensor or type(b) is not torch.Tensor or _device_facts(a)[0] is None:
        return None
    extras = (_tensor_sig(scale_a), _tensor_sig(scale_b), _tensor_sig(bias))
    if any(e is not None and len(e) == 1 for e in extras):
        return None
    return (a.shape, b.shape, a.stride(), b.stride(), a.dtype, b.dtype, a.device, b.device,
            a.data_ptr() % TMA_ALIGN, b.data_ptr() % TMA_ALIGN, out_dtype, activation,
            precision, kernel, *extras, torch.cuda.current_device(),
            tuning.autotune_enabled(), compile_knobs(),
            fp8_accumulation() if a.dtype in FP8_DTYPES else None)  # fmt: skip


class _Replay:
    """One launch of a validated call, replayed with new tensors of the same kind."""

    _TENSOR_SLOTS = ("A", "B", "C", "a_desc", "b_desc", "c_desc", "SCALE_A_PTR",
                     "SCALE_B_PTR", "BIAS")  # fmt: skip

    def __init__(self, kernel_fn, compiled, grid, args, out_shape, out_dtype,
                 scale_a, scale_b, bias) -> None:  # fmt: skip
        self.launcher = launcher_for(kernel_fn)
        self.compiled, self.grid = compiled, grid
        self.out_shape, self.out_dtype = out_shape, out_dtype
        self.values = [args[name] for name in self.launcher.names]
        self.slots = {name: self.launcher.names.index(name)
                      for name in self._TENSOR_SLOTS if name in args}  # fmt: skip
        out = args["C"] if "C" in args else args["c_desc"].base
        for name in ("PARTIALS", "FLAGS"):  # the output stands in for them without stream-K
            if args.get(name) is out:
                self.slots[name] = self.launcher.names.index(name)
        self.descs = {}
        for name in ("a_desc", "b_desc", "c_desc"):
            if name in args:
                self.descs[name] = _desc_on(args[name], None)
        for i in self.slots.values():  # hold no tensor of the first call
            self.values[i] = None
        # absent scales and bias are pointed at the output (never read)
        self.present = (scale_a is not None, scale_b is not None, bias is not None)

    def __call__(self, a, b, scale_a, scale_b, bias) -> torch.Tensor | None:
        if not self.launcher.lean_ok():
            return None
        out = torch.empty(self.out_shape, dtype=self.out_dtype, device=a.device)
        values = list(self.values)
        tensors = {"A": a, "B": b, "C": out, "SCALE_A_PTR": scale_a if self.present[0] else out,
                   "SCALE_B_PTR": scale_b if self.present[1] else out,
                   "BIAS": bias if self.present[2] else out, "PARTIALS": out,
                   "FLAGS": out}  # fmt: skip
        for name, desc in self.descs.items():
            tensors[name] = _desc_on(desc, tensors[name[0].upper()])
        for name, i in self.slots.items():
            values[i] = tensors[name]
        run_compiled(self.compiled, self.grid, a.device.index, values)
        return out


# --------------------------------------------------------------------------------------------
# Input checks
# --------------------------------------------------------------------------------------------
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_operands(a, b) -> None:
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() not in (2, 3):
            raise ValueError(
                f"{name} must be 2-D (rows, cols) or 3-D (batch, rows, cols), got shape "
                f"{tuple(t.shape)}"
            )
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"{name}.dtype is {t.dtype}; accepted: "
                + ", ".join(_dtype_name(d) for d in SUPPORTED_DTYPES)
            )
    if a.dim() != b.dim():
        raise ValueError(
            f"a and b must have the same rank (both 2-D or both 3-D), got a {tuple(a.shape)} "
            f"and b {tuple(b.shape)}"
        )
    if a.dim() == 3 and a.shape[0] != b.shape[0]:
        raise ValueError(f"batch sizes differ: a has {a.shape[0]}, b has {b.shape[0]}")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(
            f"inner dimensions differ: a {tuple(a.shape)} has K={a.shape[-1]}, b "
            f"{tuple(b.shape)} has K={b.shape[-2]}"
        )
    a_fp8, b_fp8 = a.dtype in FP8_DTYPES, b.dtype in FP8_DTYPES
    if a.dtype != b.dtype and not (a_fp8 and b_fp8):
        raise TypeError(
            f"a and b must share a dtype (two fp8 kinds may mix), got a={_dtype_name(a.dtype)}, "
            f"b={_dtype_name(b.dtype)}"
        )
    if a.device != b.device:
        raise ValueError(f"a and b must be on one device, got a={a.device}, b={b.device}")
    require_kernel_device(a, "a and b")
    if a_fp8 and a.is_cuda:
        cc = torch.cuda.get_device_capability(a.device)
        if cc < (8, 9):
            raise ValueError(
                f"fp8 inputs need a GPU with fp8 tensor cores (compute capability >= 8.9); "
                f"{torch.cuda.get_device_name(a.device)} has {cc[0]}.{cc[1]}"
            )


def _check_scale(name: str, s, a, rows: int, per_row_shape: str):
    """Validate one scale; returns (mode, tensor, batch stride, row stride)."""
    if s is None:
        return "none", None, 0, 0
    if not isinstance(s, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (fp32) or None, got {type(s).__name__}")
    if s.dtype != torch.float32:
        raise TypeError(f"{name}.dtype is {s.dtype}; accepted: float32")
    if s.device != a.device:
        raise ValueError(f"{name} is on {s.device}, the operands on {a.device}")
    if s.numel() == 1:
        return "tensor", s, 0, 0
    batched = a.dim() == 3
    if batched and tuple(s.shape) == (a.shape[0], rows):  # (B, M) / (B, N), before any
        return "row", s, s.stride(0), s.stride(1)  # squeeze reads (B, 1) as (M, 1)
    squeezed = s.squeeze(-1) if name == "scale_a" and s.dim() >= 2 else s
    if name == "scale_b" and s.dim() >= 2 and s.shape[-2] == 1:
        squeezed = s.squeeze(-2)
    if squeezed.dim() == 1 and squeezed.shape[0] == rows:
        return "row", squeezed, 0, squeezed.stride(0)
    if batched and squeezed.dim() == 2 and tuple(squeezed.shape) == (a.shape[0], rows):
        return "row", squeezed, squeezed.stride(0), squeezed.stride(1)
    accepted = f"one element (per-tensor) or {per_row_shape}"
    if batched:
        accepted += " (or with a leading batch dim)"
    raise ValueError(f"{name} has shape {tuple(s.shape)}; accepted: {accepted}")


def _check_rest(a, b, out_dtype, scale_a, scale_b, bias, activation, precision, kernel):
    M, N = a.shape[-2], b.shape[-1]
    if a.dtype in FP8_DTYPES and (scale_a is None or scale_b is None):
        missing = [n for n, s in (("scale_a", scale_a), ("scale_b", scale_b)) if s is None]
        raise ValueError(
            "fp8 inputs need scale_a and scale_b (fp32, per-tensor or per-row); missing: "
            + ", ".join(missing)
        )
    scales = (_check_scale("scale_a", scale_a, a, M, f"per-row of a: ({M},) or ({M}, 1)"),
              _check_scale("scale_b", scale_b, a, N, f"per-column of b: ({N},) or (1, {N})"))
    if out_dtype is not None and out_dtype not in OUT_DTYPES:
        raise TypeError(
            f"out_dtype is {out_dtype}; accepted: None (the input dtype, bf16 for fp8) or "
            + ", ".join(_dtype_name(d) for d in OUT_DTYPES)
        )
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
        if bias.dim() != 1 or bias.shape[0] != N:
            raise ValueError(f"bias must have shape ({N},) (N of b), got {tuple(bias.shape)}")
        if bias.dtype not in OUT_DTYPES:
            raise TypeError(
                f"bias.dtype is {bias.dtype}; accepted: "
                + ", ".join(_dtype_name(d) for d in OUT_DTYPES)
            )
        if bias.device != a.device:
            raise ValueError(f"bias is on {bias.device}, the operands on {a.device}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    return scales


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------
def triton_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    scale_a: torch.Tensor | None = None,
    scale_b: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    precision: str = "tf32",
    kernel: str = "auto",
) -> torch.Tensor:
    """activation(scale_a * scale_b * (a @ b) + bias), computed by a Triton kernel.

    Args:
        a: (M, K) or (B, M, K); fp16, bf16, fp32, float8_e4m3fn or float8_e5m2. Any strides.
        b: (K, N) or (B, K, N), the same dtype as ``a`` (two fp8 kinds may mix).
        out_dtype: fp16, bf16 or fp32; default the input dtype (bf16 for fp8 inputs).
        scale_a: fp32, one element (per-tensor) or (M,) / (M, 1) (per row of a); for 3-D
            inputs also (B, M) / (B, M, 1). Required for fp8, optional otherwise.
        scale_b: fp32, one element or (N,) / (1, N) (per column of b); 3-D: also (B, N) /
            (B, 1, N). Required for fp8, optional otherwise.
        bias: (N,), fp16/bf16/fp32, added to every row after the scales.
        activation: None, "relu", "gelu" (tanh approximation) or "silu".
        precision: fp32 inputs only: "tf32" (tensor cores, default) or "ieee" (exact fp32).
        kernel: "auto" (on Hopper the warp-specialised kernel where it applies, else the TMA
            kernel where it applies; else the portable one), "portable", "tma" (raises if
            TMA cannot read the operands) or "ws" (raises where it cannot run: it needs a
            Hopper GPU, fp16/bf16, no scales, bias or activation, see ``matmul_ws.py``).

    Returns:
        A new contiguous (M, N) or (B, M, N) tensor of ``out_dtype``.

    Under ``torch.compile`` the call is the custom operator ``torch.ops.diyfa.matmul`` (one
    opaque node, no graph break); eager calls skip the operator dispatch (~10 us).
    """
    if torch.compiler.is_compiling():
        return torch.ops.diyfa.matmul(a, b, out_dtype, scale_a, scale_b, bias, activation,
                                      precision, kernel)  # fmt: skip
    return _triton_matmul(a, b, out_dtype, scale_a, scale_b, bias, activation, precision, kernel)


def _triton_matmul(a, b, out_dtype, scale_a, scale_b, bias, activation, precision, kernel):
    """triton_matmul's eager path (replays, checks, launch)."""
    key = _replay_key(a, b, out_dtype, scale_a, scale_b, bias, activation, precision, kernel)
    replay = _replays.get(key) if key is not None else None
    if replay is not None:
        out = replay(a, b, scale_a, scale_b, bias)
        if out is not None:
            return out
    _check_operands(a, b)
    scales = _check_rest(a, b, out_dtype, scale_a, scale_b, bias, activation, precision, kernel)
    if out_dtype is None:
        out_dtype = torch.bfloat16 if a.dtype in FP8_DTYPES else a.dtype
    out = torch.empty((*a.shape[:-1], b.shape[-1]), dtype=out_dtype, device=a.device)
    if kernel == "tma":
        major = _device_facts(a)[0]
        if major is not None and major < 9:
            raise ValueError(f"kernel='tma' needs a GPU with TMA (sm90+), got sm{major}x")
        problem = _tma_problem(_as_3d(a), _as_3d(b), _as_3d(out))
        if problem is not None:
            raise ValueError(f"kernel='tma' cannot run these inputs: {problem}")
    if kernel == "ws":
        major = _device_facts(a)[0]
        if major != 9:
            where = "the interpreter or a CPU tensor" if major is None else f"sm{major}x"
            raise ValueError(f"kernel='ws' needs a Hopper GPU (sm90), got {where}")
        problem = _ws_problem(_as_3d(a), _as_3d(b), _as_3d(out), scales, bias, activation)
        if problem is not None:
            raise ValueError(f"kernel='ws' cannot run these inputs: {problem}")
    if out.numel() == 0:
        return out
    launched = _matmul(a, b, out, scales, bias, activation, precision, kernel)
    if launched is not None and key is not None:
        if len(_replays) >= _REPLAYS_MAX:
            _replays.clear()
        _replays[key] = _Replay(*launched, tuple(out.shape), out.dtype,
                                scale_a, scale_b, bias)  # fmt: skip
    return out


@torch.library.custom_op("diyfa::matmul", mutates_args=())
def _matmul_op(a: torch.Tensor, b: torch.Tensor,
               out_dtype: Optional[torch.dtype],  # noqa: UP045 (the schema parser)
               scale_a: Optional[torch.Tensor], scale_b: Optional[torch.Tensor],  # noqa: UP045
               bias: Optional[torch.Tensor], activation: Optional[str],  # noqa: UP045
               precision: str, kernel: str) -> torch.Tensor:  # fmt: skip
    """``triton_matmul`` as a custom operator, for torch.compile (no autograd: inference)."""
    return _triton_matmul(a, b, out_dtype, scale_a, scale_b, bias, activation, precision, kernel)


@_matmul_op.register_fake
def _matmul_fake(a, b, out_dtype, scale_a, scale_b, bias, activation, precision, kernel):
    _check_operands(a, b)  # the eager shape and dtype errors, at trace time
    if out_dtype is None:
        out_dtype = torch.bfloat16 if a.dtype in FP8_DTYPES else a.dtype
    return torch.empty((*a.shape[:-1], b.shape[-1]), dtype=out_dtype, device=a.device)
