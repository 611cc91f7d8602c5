"""FlashAttention backward for Hopper (sm90) in Gluon: TMA, ``wgmma`` and warp specialisation.

Status: runs on H200 (tests/test_hopper_bwd.py's GPU tests: the gradient matrix against
float64, both dQ modes, bitwise determinism). "auto" runs it where it measured faster than
the portable backward (:func:`auto_mode`: the atomic dQ for plain attention, packed
sequences and the variants, the deterministic path when asked for);
``backend="hopper"``
runs it wherever :func:`supports` allows, with the atomic dQ unless ``deterministic=True``.
Every other call, and every problem :func:`supports` refuses, takes the portable backward.

What the kernel does
    One program per block of ``BLOCK_N`` = 128 keys of one (batch, kv head), FlashAttention-2
    and -3's dK/dV-stationary loop: K, V, dK and dV stay on chip while the program walks the
    query blocks of every query head of its GQA group (dK/dV summed over the group in
    registers, no extra pass), skipping the query blocks that see none of its keys (above
    the causal band, or below a left window). A causal call's programs go out heaviest
    first, in sections of (batch, kv head) rows that fit in L2 (``ORDER_L2_BYTES``).

    - one *loader* warp: K and V once (two 64-key halves each), then Q and dO of each query
      block by TMA through a ring of ``STAGES`` buffers, with the block's LSE and delta by
      ``cp.async`` into the same stage (before 2026-11-24 the consumers read those with
      global loads, whose latency ncu found on their critical path; TMA cannot take them:
      a row of odd length starts at any 4-byte offset, TMA boxes at 16-byte ones;
      ``ready[s]`` completes on the byte count and the copies, ``empty[s]`` when both
      consumers are done with the stage);
    - two *consumer* warpgroups, each owning 64 of the 128 keys (one m64 ``wgmma``), so every
      product has the keys on its M side and nothing is transposed in registers:

        S^T  = K_c Q^T            (K from shared memory, Q^T a permuted shared view)
        dP^T = V_c dO^T           (issued right after S^T; the softmax runs while it works)
        P^T  = exp2(S^T * scale * log2(e) - lse)        (masked only on the band's edges
                                                         and past the last key; with the
                                                         variants, the forward's scores:
                                                         softcap's tanh, ALiBi's bias)
        dS^T = P^T * (dP^T - delta)                     (softcap: times 1 - tanh^2)
        dV_c += P^T dO            (P^T from registers)
        dK_c += dS^T Q            (dS^T from registers)

      Registers are moved to them from the loader (``setmaxnreg``).

      Atomic dQ mode only: each consumer writes its 64 rows of dS^T to a shared (128 keys,
      BLOCK_M) buffer (two of them, alternating by step) and arrives on ``ds_ready``. At
      d128 (``DQ_SPLIT``, the kernel's ``DQ_ATOMIC == 2``) both consumers then wait for the
      whole dS^T and each computes one 64-column half of the query block's dQ = dS K every
      step, reduce-added from its own two fp32 tiles in turn (FlashAttention-3's division;
      2026-11-24, +11-21% over the turns below); in FlashAttention-3's order since
      (``DQ_FA3_ORDER``, ``DQ_ATOMIC == 3``: dV waited for, the dQ piece issued before dK
      and stored while dK runs; +0-5%), the consumers meeting on one named barrier of both
      warpgroups once dS^T is written instead of ``ds_ready`` (``DS_NAMED``, the kernel's
      ``DQ_ATOMIC == 3 + 8``; 2026-11-26, level to +3%). At d64, plain attention
      (``default_config``, ``BWD_CONFIG_D64_ROWS128``, ``DQ_ATOMIC == 4``): 128 query rows per step
      (FlashAttention-3/4's d64 tile), the products m64n128, dV issued after dS^T (the
      kernel's ``LATE_DV``: P^T's 16-bit copy not live across the dP^T wait), LSE and delta
      read after their products' waits, and the block's rows split between the consumers
      for dQ (64 rows x every column each, the same order; 2026-11-25, +3-8%; packed
      sequences too, +2-9%). Otherwise (the variants' flags at d64) the
      consumers take turns (step ``it`` is consumer ``it % 2``'s) computing the query
      block's whole dQ = dS K (K = 128 keys: dS^T as the transposed A operand, K from both
      consumers' buffers), one column half at a time, each stored to the consumer's own
      fp32 shared-memory tile and added to an fp32 workspace by a TMA reduce-add
      (:func:`_tma_reduce_add`, FlashAttention-3's way) that runs on while the consumer
      does; a tile is rewritten two steps later, after ``tma.store_wait``. Buffer
      ``it % 2`` of dS^T is written again at step ``it + 2`` only after the writer has
      passed step ``it + 1``'s ``ds_ready`` wait or its own turn, both of which follow the
      reader's product. History on an H200 (d128 16k backward): one dQ per consumer with
      scalar atomics 293 TFLOPS, shared dS with ``red.global.add.v2.f32`` 429, TMA
      reduce-adds 505 (benchmarks/results/2026-11-2[34]_h200_bwd-breakdown_*).
    - epilogue: dK (times the softmax scale) and dV go out through the consumer's own K / V
      buffers by TMA (which clips rows past seqlen_k and columns past the head dim).

Two dQ modes (``atomic_dq``; ``backend="hopper"`` takes the atomic one unless
``deterministic=True``, "auto" the other, faster one where it measured so: see :func:`auto_mode`):
    - atomic: the kernel also accumulates dQ with fp32 TMA reduce-adds into a zeroed
      (batch, heads, padded seqlen_q, padded head dim) workspace, scaled and cast into dQ by
      one elementwise op; delta = rowsum(dO * O) comes from a small Triton kernel first.
      5 matmuls per block pair. The order of the additions varies: dQ is not bitwise
      reproducible (dK and dV are). "auto"'s default where it measured faster.
    - kernel dQ (deterministic): the portable dQ kernel (which also writes delta) runs first,
      then this kernel without dQ. Bitwise-reproducible, 7 matmuls per block pair: 2-14%
      slower than the atomic mode with the split dQ at d128 on an H200 (:func:`auto_mode`).

Variants: the forward's sliding window (query blocks wholly outside the band skipped by
:func:`_kv_program`, the band's edges masked), softcap (the scores recomputed through the
same tanh, dS^T times tanh's derivative 1 - t^2) and ALiBi (the bias recomputed); sinks need
nothing here (they are in the LSE, and delta = rowsum(dO * O) holds; their own gradient is
computed from delta by ``portable.sink_grad``). Compile-checked (every flag on: 48-672 bytes
of spills, ``tests/test_hopper_bwd.py``) and run on an H200
(``tests/test_variants.py::test_gpu_hopper_backward_variants``, both dQ modes, passed
2026-11-23); "auto" takes it for all four (:func:`auto_mode`).

Plain non-causal calls at head dims 72..128 with the atomic dQ run the kernel's causal
build with the band past their last key (``NONCAUSAL_AS_CAUSAL``: nothing masked or
skipped; that build's steps measured faster).

Scope (:func:`supports`): what the Hopper forward takes (sm90, fp16/bf16, TMA's alignment
rules, positive scale), head dims 64..256 that are multiples of 8 (computed as 64, 128 or
256), no value head dim other than q's below d129. Above 128 the two fp32 accumulators of this
kernel's division alone would be 256 registers per thread: those head dims run on
``hopper_bwd256``'s kernel (the head dim split between the consumers; the same variants
and packed sequences, and a value head dim of 72..256 of its own), by default in the
deterministic path (``WIDE_DQ_ATOMIC``). dO is
copied to a contiguous tensor when its strides break TMA's rules (autograd hands an
expanded, stride-0 gradient for ``out.sum()``).

Packed sequences (``VARLEN``, 2026-11-24): the descriptors are over batch-of-one (1, heads,
total, d) views; the host lists the (sequence, key block) pairs that hold keys, heaviest
first (:func:`kv_table`, the kernel's ``TILES``; the grid is (items, kv heads)); each program
offsets its keys and query rows by its sequence's cu_seqlens and masks with its lengths;
LSE and delta are (heads, total_q); dQ's reduce-adds go to a (1, heads, total_q, d)
workspace (a query block that runs past its sequence adds exact zeros to the next one's rows:
their P is 0); a sequence's last key block stores dK/dV by masked pointer stores (a TMA
store would overwrite the next sequence's rows). Unlike the forward, non-finite values in
one sequence's Q/dO/K rows can reach a neighbour's gradients here through 0 x inf (a
block's foreign rows are masked by zero probabilities, not zeroed); with finite inputs
every sequence's gradients are its own.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from diyfa._launcher import (
    Replay,
    ReplayCache,
    cdiv,
    compiling_only,
    launch,
    launch_recorded,
    next_power_of_2,
)
from diyfa.attention import portable
from diyfa.attention.hopper_fwd import (
    LOG2E,
    SHORT_WORK_D64,
    _desc,
    _dropout,
    _key_group,
    _seq,
    _tanh,
    _tile2d,
    alibi_flag,
    bhsd_view,
    cu_host,
    dq_rows,
    head_dim_pad,
    named_barrier,
    variant_args,
    work_table,
)
from diyfa.attention.hopper_fwd import supports as forward_supports
from diyfa.attention.problem import Problem

SUB_N = 64  # keys per consumer warpgroup: one m64 wgmma
CONSUMERS = 2
BLOCK_N = CONSUMERS * SUB_N

# padded head dim -> (BLOCK_M query rows per step, STAGES of Q/dO, consumer registers, loader
# registers). Registers per consumer thread at d128: dK + dV 128, S^T + dP^T 64 (BLOCK_M
# 64), dQ 64 once S^T and dP^T are dead. Shared memory (2-byte types): K, V 2 * 128 * d,
# Q + dO 2 * BLOCK_M * d per stage, dS^T 2 * 64 * BLOCK_M: 128 KB at d64, 144 KB at d128.
# (FlashAttention-3's 128-row query blocks at d64 measured far slower in a first try, with
# dV issued first and the statistics live across the waits: 792-892 bytes of
# spills, H200, bf16, 2026-11-25, benchmarks/results/2026-11-25_h200_bwd-d64-block128-*-ab_*,
# TFLOPS 64 / 128 rows, atomic dQ: 2 x 32 x 8192 462 / 282, causal 451 / 183; 16 x 32 x 1024
# 366 / 243; deterministic 407 / 310, causal 385 / 174.)
BWD_CONFIGS = {
    64: (64, 2, 240, 24),
    128: (64, 2, 240, 24),
    256: (64, 2, 240, 24),  # hopper_bwd256's kernel (the head dim split between consumers)
}
# d64 plain attention (causal or not, GQA, sinks: the LSE holds them, packed sequences; not
# the variants' flags): 128 query rows per step (FlashAttention-3/4's d64 tile), dV's
# product issued after dS^T (the kernel's LATE_DV), the rows' LSE and delta read from shared
# memory after their products' waits (32 registers each a thread at 128 rows), and the
# atomic dQ split by rows (fifth field 3: DQ_ATOMIC 4, each consumer 64 rows x 64 columns).
# ptxas spills 8-40 bytes (792-892 when the earlier try kept dV first and the statistics
# live across the waits; softcap, ALiBi and dropout spill 100-1100 at 128 rows: they keep
# 64). H200, bf16, benchmarks/hopper_bwd_ab.py, twice interleaved in one process,
# benchmarks/results/2026-11-25_h200_bwd-d64-rows128-ab_6a0494e-wip.txt, kernel TFLOPS
# 64 / 128 rows, atomic dQ: 1 x 32 x 16k 473, 468 / 501, 501; causal 457, 460 / 471, 468;
# 4 x 32 x 4096 422, 429 / 456, 456; causal 377, 380 / 387, 388; 16 x 32 x 1024 310, 314 /
# 325, 346; deterministic 1 x 32 x 16k 415, 415 / 430, 426, causal 396, 392 / 411, 414.
BWD_CONFIG_D64_ROWS128 = (128, 2, 240, 24, 3)
# The variants' flags that keep 64 rows at d64, and whether packed sequences take 128. H200,
# bf16, d64, 32 heads, one process, 3 rounds (benchmarks/rows128_ab.py,
# benchmarks/results/2026-11-25_h200_bwd-rows128-packed-window-ab_3b9d020-wip.txt), backward
# TFLOPS 64 / 128 rows, atomic dQ: the varlen mix 427 / 436, causal 395 / 404 (deterministic
# 388 / 406, 349 / 381); b1 8192 with a (1023, 0) window, causal, 334 / 321, a (255, 255)
# window 251 / 237 (deterministic 236 / 247, 195 / 202). So packed sequences take 128 rows
# and windows keep 64 (with the atomic dQ, which "auto" runs: auto_mode).
ROWS128_KEEP_64 = ("WINDOW", "SOFTCAP", "ALIBI", "DROPOUT")
ROWS128_PACKED = True
# Atomic dQ: every step each consumer computes a column half of dQ (True), or the
# consumers take turns computing all of it (False). A config's fifth field, when given,
# overrides these. At d64 the halves are 32 columns wide, and measured slower (H200, bf16,
# benchmarks/hopper_bwd_ab.py,
# benchmarks/results/2026-11-24_h200_bwd-dq-split-d64-ab_2e59141-wip.txt, TFLOPS turns /
# halves: 1 x 32 x 16k 448 / 390, causal 455 / 389; 4 x 32 x 4096 424 / 366, causal 384 /
# 330; 16 x 32 x 1024 335 / 308, causal 250 / 225): d64 keeps the turns.
DQ_SPLIT = True
DQ_SPLIT_D64 = False
# The split in FlashAttention-3's order (the kernel's DQ_ATOMIC == 3): dV waited for, then a
# step's dQ piece issued before dK and stored (and reduce-added) while dK runs, where the
# split waited for dV and dK, then issued dQ and waited for it. H200, bf16,
# benchmarks/hopper_bwd_ab.py --atomic 1, each twice interleaved in one process,
# benchmarks/results/2026-11-24_h200_bwd-dq-fa3-order-ab_1de28f0-wip.txt, TFLOPS split /
# this order: 2 x 16 x 8192 d128 538, 522 / 549, 530; causal 533, 500 / 536, 529; 1 x 16
# x 16k 546, 538 / 526, 549; causal 516, 535 / 545, 560; 4 x 16 x 4096 491, 499 / 504,
# 493; causal 445, 442 / 462, 459; 16 x 16 x 1024 389, 403 / 410, 422; causal 296, 303 /
# 308, 309. (Tried before, 2026-11-24, with dQ issued while dV still ran: level, every
# wgmma serialised by ptxas then. Leaving dK running into the next step as well, in
# pairs of steps, spilled 692 bytes: not kept. Again on 2026-11-26, dQ issued before dV's
# wait (waited for with two products pending; ptxas serialises nothing now): 3-7% slower at
# d64, level to 4% slower at d128, benchmarks/results/2026-11-26_h200_bwd-dq-early-ab_*.)
DQ_FA3_ORDER = True
# (mode 3, the column split at d128) The consumers meet on a named barrier (one bar.sync of
# both warpgroups, FlashAttention-3/4's) once their halves of a step's dS^T are in shared
# memory, where an mbarrier took a warpgroup barrier, an arrival, another barrier and a wait.
# H200, bf16, one process, 3 interleaved rounds, twice (benchmarks/hopper_flag_ab.py --kind
# bwd, benchmarks/results/2026-11-26_h200_bwd-handoff-ab_*.txt), median ms mbarrier / named:
# 8 x 16 x 2048 d128 1.329 / 1.328, 1.325 / 1.318; causal 0.795 / 0.775, 0.785 / 0.779;
# 2 x 16 x 8192 4.915 / 4.786, 4.856 / 4.780; causal 2.499 / 2.476, 2.470 / 2.446; 1 x 16 x
# 16384 9.506 / 9.277, 9.581 / 9.282; 4 x 32 x 4096 causal 2.784 / 2.755, 2.773 / 2.758.
# At d64 (mode 4, 128-row steps) slower: 8 x 32 x 2048 1.525 / 1.633, 2 x 32 x 8192 5.563 /
# 5.885, causal 2.959 / 3.053. (Tried with it and not kept, same runs: a warp of its own
# issuing the dQ reduce-adds, FlashAttention-3/4's division, named barriers "full" / "empty"
# per consumer, 0-5% slower at d128, 1-6% at d64; the stage of Q and dO handed back to the
# loader by a named barrier's bar.arrive, 1-4% slower at d128 with this, 1-5% at d64; the
# wait for the dQ tile's previous reduce-add after the dQ product, not before its issue, up
# to 4% slower. docs/attention.md, "How a step's pieces change hands".)
DS_NAMED = True
DS_BARRIER = gl.constexpr(14)  # its id (hopper_fwd.named_barrier; the forward's 12 and 13)
# (The split one step late, each step's dK issued with the previous step's dQ piece so that
# the consumers never wait for each other's half of the same step's dS^T (three dS^T buffers,
# one staging tile per consumer; commit 8622146, reverted), measured level or slower: H200,
# bf16, twice interleaved, benchmarks/results/2026-11-25_h200_bwd-dq-late-ab_8622146.txt,
# TFLOPS FA3 order / late: 2 x 16 x 8192 578, 538 / 549, 547; causal 578, 527 / 524, 473;
# 4 x 16 x 4096 527, 484 / 496, 507; causal 459, 471 / 414, 433; and its dQ was wrong with
# GQA (11 GPU tests failed), a bug not chased.)
# (d64's turns in that order, the whole dQ issued before dK on a consumer's turn, measured
# 1-5% slower: benchmarks/results/2026-11-24_h200_bwd-d64-turns-fa3-order-ab_d86407c.txt,
# 2 x 32 x 8192 478, 467 against 455, 451 TFLOPS; not kept.)
# The atomic dQ's fp32 tiles go to shared memory with their rows permuted within groups of 8
# (row 8a + 4b + c at 8a + 2c + b: conflict-free 8-byte stores into the 128-byte swizzle; the
# workspace keeps that order and _finish undoes it). Packed sequences (DQ_ROWS_PACKED): their
# blocks start anywhere in the packed rows, so each sequence's rows start on a multiple of 8
# in the workspace instead (hopper_fwd.dq_rows; head dims up to 128: this kernel's).
DQ_ROWS_PERMUTED = True
DQ_ROWS_PACKED = True
# Head dims above 128 (hopper_bwd256's kernel): the deterministic path (the portable dQ
# kernel, then the kernel for dK / dV) is the default there even without ``deterministic``,
# measured faster than the kernel's own atomic dQ at every point (H200, bf16, one process,
# benchmarks/wide_bwd_ab.py, 2 rounds, backward TFLOPS portable / atomic / deterministic,
# benchmarks/results/2026-11-25_h200_wide-bwd-ab_8d00954.txt: 16 x 8 x 1024 236 / 254 /
# 347, causal 165 / 204 / 274; 4 x 8 x 4096 264 / 296 / 389, causal 204 / 280 / 344; 1 x 8 x
# 16384 259 / 305 / 404, causal 232 / 315 / 398). (Its atomic dQ stages each 64-column
# piece through one 16 KB tile per consumer, all that 227 KB leaves, and waits for the
# previous piece's reduce-add to have read it.)
WIDE_DQ_ATOMIC = False


# Plain calls without the causal band at padded head dim 128 (atomic dQ) run the causal build
# with its band past the last key: nothing is masked or skipped, and ptxas's build of the
# causal kernel runs its steps faster (ncu, b1 h16 16k d128: ~3,560 SM cycles a step against
# ~3,910 for the non-causal build; docs/attention.md, "Why non-causal d128 trails"). H200,
# bf16, one process, 3 interleaved rounds (benchmarks/hopper_flag_ab.py --kind bwd --flag
# NONCAUSAL_AS_CAUSAL, benchmarks/results/2026-11-25_h200_bwd-noncausal-as-causal-ab_b40a9bf
# -wip.{txt,jsonl}), backward TFLOPS without / with: 1 x 16 x 16k d128 557.2 / 586.7, 2 x 8192
# 540.0 / 566.8, 4 x 4096 524.0 / 548.5, 8 x 2048 494.1 / 508.1; d64 (128-row steps, a
# different build) 1 x 32 x 16k 506.4 / 492.6, 4 x 4096 472.3 / 462.7: d128 only. (Causal
# calls, untouched: 4.853 / 4.820 ms.)
NONCAUSAL_AS_CAUSAL = True


def dq_rows_permuted(dq_atomic: bool, packed: bool, head_dim_padded: int) -> bool:
    """Whether the kernel writes the atomic dQ workspace with its rows permuted (_finish);
    packed sequences (DQ_ROWS_PACKED: each sequence from a multiple of 8, dq_rows) at head
    dims up to 128 only (this module's kernel, not hopper_bwd256's)."""
    return (DQ_ROWS_PERMUTED and dq_atomic
            and (not packed or (DQ_ROWS_PACKED and head_dim_padded <= 128)))


def auto_mode(p: Problem) -> str | None:
    """What "auto" runs for the backward of a problem the Hopper forward took (and
    :func:`supports` accepts): "kernel-dq" (this kernel for dK/dV after the portable dQ
    kernel: the deterministic mode's path), "atomic" (this kernel with its atomic dQ) or
    None (the portable backward).

    The rule now: "kernel-dq" when ``deterministic`` (or torch's deterministic algorithms)
    asks for it, else "atomic", variants and packed sequences alike; at head dims <= 64
    without the causal band, below ``ATOMIC_D64_KEYS`` keys and ``SHORT_WORK_D64`` scores,
    the portable backward; d256 as ``WIDE_DQ_ATOMIC`` says. The
    paragraphs below are how each part of it was measured, oldest first: a later one
    overrides what an earlier one kept.

    ``DIYFA_HOPPER_BWD=0`` turns the Gluon backward off for "auto", ``=1`` runs it wherever
    it applies, in the mode ``deterministic`` asks for. Unset: the measured rule, from one
    H200 run with every mode side by side (2026-11-23, benchmarks/results/*_fa4_9f4758b.jsonl,
    bf16 TFLOPS, portable / Gluon + portable dQ / Gluon atomic):

    - head dims 72..128: "kernel-dq", level with or ahead of the portable backward at every
      point (d128 16k 425 / 458 / 427, causal 380 / 441 / 354; 4k causal 336 / 387 / 301;
      GQA 8k 412 / 425 / 415);
    - head dims <= 64, causal: "kernel-dq" (16k 279 / 356 / 358, 4k 248 / 321 / 307);
    - head dims <= 64, not causal: portable (16k 363 / 361 / 381, 4k 354 / 343 / 354, 8k
      queries x 1k keys 332 / 276 / 287: the atomic mode's +5% at 16k is not worth giving
      up bitwise reproducibility for).

    Since the atomic dQ leaves by TMA reduce-adds (2026-11-24; H200, 2 x 16 heads x 8192,
    bf16, microseconds per backward, portable / atomic / kernel-dq,
    benchmarks/results/2026-11-24_h200_bwd-breakdown_0676026.jsonl): d128 5980 / 5446 /
    5932, causal 3754 / 3587 / 3093; d64 3683 / 3376 / 3868, causal 2686 / 1913 / 2045.
    Since the loader brings each step's LSE and delta into shared memory by cp.async
    (later on 2026-11-24, benchmarks/results/2026-11-24_h200_bwd-breakdown-stats_*.txt,
    same shapes): d128 6136 / 5996 / **5434**, causal 3744 / 3112 / **2849**; d64 3671 /
    **3060** / 3219, causal 2679 / **1578** / 1808. Packed sequences (29 sequences of
    128..7626 tokens, 64k tokens, TFLOPS, the same order): d128 GQA 16/4 371 / 434 /
    **440**, causal 337 / 344 / **414**; d64 263 / **389** / 357, causal 224 / **355** /
    334. So "auto" runs the deterministic path (the portable dQ kernel, then this kernel for
    dK/dV: bitwise-reproducible gradients, as a bonus) at head dims 72..128, and the atomic
    dQ at d64, except without the causal band below ``ATOMIC_D64_KEYS`` keys and
    ``hopper_fwd.SHORT_WORK_D64`` scores (portable: the same GPU time, a lighter host
    path); ``deterministic`` (or
    ``torch.use_deterministic_algorithms``) takes the deterministic path at d64 too (3219
    against the portable 3671; packed 357 / 334 against 263 / 224). The variants (window,
    ALiBi, sinks) take the deterministic path (H200, 2026-11-23, 8k tokens, d128, causal,
    bf16, benchmarks/results/2026-11-23_h200_flash_variants-fa4_ead758f.jsonl; TFLOPS
    portable / kernel-dq / atomic: sliding window 1023 265 / 297 / 241, ALiBi 327 / 377 /
    265, sinks 347 / 420 / 310); so does softcap since the statistics moved to shared memory
    (226 / 220 / 206 then; with tanh.approx, 2026-11-24, 302 / 303 / 217; since, portable
    300 against 320, benchmarks/results/2026-11-24_h200_flash_variants-fa4_3f3876a.jsonl).

    Since the atomic dQ at d128 is split by columns between the consumers every step
    (``DQ_SPLIT``, 2026-11-24; H200, bf16, benchmarks/hopper_bwd_ab.py, kernel TFLOPS,
    benchmarks/results/2026-11-24_h200_bwd-dq-split-ab_f1d60cd-wip.txt), it beats the deterministic
    path at every shape measured: 2 x 16 x 8192 506 / 495 (turns: 446), causal 477 / 448
    (425); 4 x 16 x 4096 458 / 439, causal 427 / 368; 16 x 16 x 1024 391 / 362, causal 279 /
    266. So plain d72..128 calls take "atomic" too. Packed sequences there keep the
    deterministic path (varlen suite, benchmarks/results/*_flash_varlen-bwd-split_620284d:
    d128 GQA 451 atomic against 439, causal 384 against 426), and so do softcap and ALiBi
    (variants suite, 8k d128 causal, ..._flash_variants-bwd-split_3dbec91.jsonl: softcap
    276 against 319, ALiBi 276 against 337), while a window or sinks take the atomic dQ at
    d72..128 (window 1023 343 against 331, sinks 463 against 442; d64 variants keep the
    deterministic path, measured before the split).

    Since the split runs in FlashAttention-3's order (``DQ_FA3_ORDER``; H200, bf16, one
    process, 2 rounds, backend="hopper" with and without ``deterministic``,
    benchmarks/bwd_mode_ab.py,
    benchmarks/results/2026-11-24_h200_bwd-mode-ab_dba219c.txt, backward TFLOPS
    deterministic / atomic): packed sequences at d128 (the varlen suite's mix, GQA 16/4) 445
    / 491, causal 409 / 415, so they take "atomic" too; 8k d128 causal softcap 329 / 300
    and ALiBi 402 / 395 keep the deterministic path; window 1023 332 / 402, sinks 460 /
    528, plain 460 / 552.

    Since softcap's 1 - t^2 joins P^T before the dP^T wait (2026-11-25; ptxas spills at d128
    causal 420 -> 236 bytes atomic, 280 -> 148 deterministic; H200, bf16, softcap 30, one
    process, 3 rounds, benchmarks/oldnew_ab.py,
    benchmarks/results/2026-11-25_h200_softcap-bwd-ab_f7bf9c5.txt, TFLOPS before / after):
    atomic 1 x 16 x 8192 367 / 530, causal 281 / 432, 4 x 16 x 4096 354 / 504, causal 277 /
    412; deterministic 367 / 405, 313 / 357, 353 / 401, 297 / 341. So softcap takes the
    atomic dQ at d72..128 too; ALiBi keeps the deterministic path.

    Since ALiBi's causal backward splits the bias on every tile (ALIBI 4) and the query
    term costs one conversion a step (2026-11-25; ptxas spills 344 -> 104 bytes atomic,
    d128 causal; H200, bf16, one process, 3 rounds, benchmarks/oldnew_ab.py --alibi,
    benchmarks/results/2026-11-25_h200_alibi-bwd-ab_*.txt, TFLOPS before / after): atomic
    1 x 16 x 8192 causal 355 / 458, not 483 / 546, 4 x 16 x 4096 causal 359 / 447, not 476
    / 532; deterministic 372 / 370, 423 / 440, 353 / 373, 410 / 432. So ALiBi takes the
    atomic dQ at d72..128 too. At d64 (ALIBI 4 there too since then;
    benchmarks/results/2026-11-25_h200_alibi64-bwd-ab_*.txt) causal ALiBi measured 334-342
    TFLOPS atomic against 280-294 deterministic (1 x 32 x 8192, 4 x 32 x 4096, 16 x 32 x
    1024), so causal ALiBi alone takes the atomic dQ at d64 as well; the other d64 variants
    keep the deterministic path.

    Since d64 plain attention and packed sequences run 128 query rows per step
    (``BWD_CONFIG_D64_ROWS128``), the d64 variants measured faster with the atomic dQ too
    (2026-11-25; H200, bf16, b1 h32 8192 causal, one process, 2 rounds,
    benchmarks/bwd_mode_ab.py 64, benchmarks/results/2026-11-25_h200_bwd-mode-d64_3b9d020-wip.txt,
    TFLOPS deterministic / atomic): softcap 30 306 / 399, ALiBi 318 / 426, window 1023 238 /
    333, sinks 397 / 455, a 127 window with sinks 46 / 45; plain 418 / 465, the varlen mix
    (h32) 402 / 438, causal 359 / 403. So every call without ``deterministic`` takes the
    atomic dQ at d64..128.

    Head dims above 128 (hopper_bwd256's kernel, 2026-11-25) take the deterministic path,
    variants and packed sequences too (``WIDE_DQ_ATOMIC``). (Until 2026-11-26 calls of more
    than 65535 (batch x heads) pairs went elsewhere: the portable dQ kernel's grid held at
    most that many; ``portable.bh_grid`` spreads them over two axes since.)"""
    env = os.environ.get("DIYFA_HOPPER_BWD")
    if env == "0":
        return None
    if head_dim_pad(p.head_dim) == 256:  # hopper_bwd256's kernel, whatever DIYFA_HOPPER_BWD=1
        return "atomic" if WIDE_DQ_ATOMIC and not p.deterministic else "kernel-dq"
    if env == "1":
        return "kernel-dq" if p.deterministic else "atomic"
    wide = head_dim_pad(p.head_dim) > 64
    small = p.batch * p.heads * p.seqlen_q * p.seqlen_k < SHORT_WORK_D64
    if not wide and not p.causal and p.seqlen_k < ATOMIC_D64_KEYS and small:
        return None
    return "kernel-dq" if p.deterministic else "atomic"


# Head dims <= 64 without the causal band take the atomic mode from this many keys; below,
# the portable backward. Its kernels' GPU time equals the atomic mode's there (b4 h8 d64, bf16,
# warm L2, benchmarks/results/2026-11-24_h200_bwd-breakdown-seed-shapes_395a03b.txt: 69 / 73
# us at 1024 keys, 253 / 252 at 2048; 951 / 912 at 4096) with two launches against four
# launches and two torch ops, and the benchmark timed the seed shape at 2048 keys at 329
# TFLOPS on the portable backward (babe81a) against 230 on the atomic one (89c61fd). Since the
# atomic mode's host path got lean (its dQ zeroed by the delta kernel and finished by one
# recorded kernel; replays calling the C launcher), 2048 keys (H200, fp16 b4 h8 d64, one
# process, benchmarks/results/2026-11-24_h200_host-ab_034a4aa-wip.jsonl and
# ..._seed-probe_034a4aa.jsonl): do_bench 220 us atomic against 260 portable (391 / 331
# TFLOPS), kernels 221 against 271 us; below 2048 keys the kernels are level (512 keys 26 /
# 29 us, 1024 keys 68 / 68) and the portable backward's host path is the lighter (110 against
# 164 us per call on that host at 512 keys).
ATOMIC_D64_KEYS = 2048


# --------------------------------------------------------------------------------------------
# Device code
# --------------------------------------------------------------------------------------------
@triton.jit
def _bwd_delta(O, DO, DELTA, ACC, stride_ob, stride_oh, stride_os, stride_od,
               stride_dob, stride_doh, stride_dos, stride_dod, heads, seqlen_q, acc_rows,
               HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, ACC_DIM: tl.constexpr,
               BLOCK: tl.constexpr):
    """delta = rowsum(dO * O) in fp32 for BLOCK rows of one (batch, head); DELTA is (batch,
    heads, seqlen_q) contiguous. With ACC_DIM > 0 it also zeroes those rows of the atomic
    dQ's fp32 workspace ACC, (batch, heads, acc_rows, ACC_DIM) contiguous, acc_rows >=
    seqlen_q (the grid covers acc_rows): one launch fewer than a separate fill."""
    off_bh = tl.program_id(0)  # batch x heads on axis 0 (CUDA allows 2^31 - 1 there)
    off_b = (off_bh // heads).to(tl.int64)
    off_h = (off_bh % heads).to(tl.int64)
    offs_m = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = (offs_m < seqlen_q)[:, None] & (offs_d < HEAD_DIM)[None, :]
    o = tl.load(O + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_os
                + offs_d[None, :] * stride_od, mask=mask, other=0.0)  # fmt: skip
    do = tl.load(DO + off_b * stride_dob + off_h * stride_doh + offs_m[:, None] * stride_dos
                 + offs_d[None, :] * stride_dod, mask=mask, other=0.0)  # fmt: skip
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + off_bh.to(tl.int64) * seqlen_q + offs_m, delta, mask=offs_m < seqlen_q)
    if ACC_DIM > 0:
        offs_a = tl.arange(0, ACC_DIM)
        tl.store(ACC + off_bh.to(tl.int64) * acc_rows * ACC_DIM + offs_m[:, None] * ACC_DIM
                 + offs_a[None, :], tl.zeros([BLOCK, ACC_DIM], dtype=tl.float32),
                 mask=(offs_m < acc_rows)[:, None])  # fmt: skip


@triton.jit
def _dq_finish(ACC, DQ, stride_qb, stride_qh, stride_qs, stride_qd, heads, seqlen_q, acc_rows,
               scale, CU_Q, STARTS, starts_at, HEAD_DIM: tl.constexpr, ACC_DIM: tl.constexpr,
               PERMUTED: tl.constexpr, BLOCK: tl.constexpr, PACKED: tl.constexpr):
    """dQ from the atomic mode's fp32 workspace ACC ((batch, heads, acc_rows, ACC_DIM)
    contiguous): scaled, cast to DQ's dtype and stored through DQ's strides, BLOCK rows of
    one (batch, head). PERMUTED: the workspace holds row 8a + 4b + c of each group of 8 at
    8a + 2c + b (dq_rows_permuted), read back from there. PACKED (grid (heads, blocks,
    sequences); ACC and DQ batch-of-one): sequence s's rows CU_Q[s].. of DQ from its rows
    STARTS[starts_at + s].. of the workspace (multiples of 8: hopper_fwd.dq_rows)."""
    if PACKED:
        off_b = 0
        off_h = tl.program_id(0).to(tl.int64)
        seq = tl.program_id(2)
        q_start = tl.load(CU_Q + seq)
        seqlen = tl.load(CU_Q + seq + 1) - q_start
        acc_start = tl.load(STARTS + starts_at + seq)
        off_bh = off_h
    else:
        off_bh = tl.program_id(0)
        off_b = (off_bh // heads).to(tl.int64)
        off_h = (off_bh % heads).to(tl.int64)
        q_start = 0
        seqlen = seqlen_q
        acc_start = 0
    offs_m = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    if PERMUTED:
        src = offs_m // 8 * 8 + offs_m % 4 * 2 + offs_m % 8 // 4
    else:
        src = offs_m
    offs_d = tl.arange(0, ACC_DIM)
    mask = (offs_m < seqlen)[:, None] & (offs_d < HEAD_DIM)[None, :]
    acc = tl.load(ACC + off_bh.to(tl.int64) * acc_rows * ACC_DIM
                  + (acc_start + src)[:, None].to(tl.int64) * ACC_DIM + offs_d[None, :],
                  mask=mask, other=0.0)  # fmt: skip
    tl.store(DQ + off_b * stride_qb + off_h * stride_qh
             + (q_start + offs_m)[:, None].to(tl.int64) * stride_qs
             + offs_d[None, :] * stride_qd, (acc * scale).to(DQ.dtype.element_ty),
             mask=mask)  # fmt: skip


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """``global[block at coord] += src`` (a shared-memory tile) by TMA (``cp.reduce.async
    .bulk.tensor ... .add``): issued like a TMA store (one thread, after a fence and a
    barrier) and waited for the same way (``tma.store_wait``). Gluon 3.6 builds the op but
    exposes no function for it."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD,
                                              tensor_desc.handle, coord, src.handle)


@gluon.jit
def _kv_program(heads, kv_group, seqlen_q, seqlen_k, causal_offset, left_offset, CU_Q, CU_K,
                TILES, section, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
                WINDOW: gl.constexpr, VARLEN: gl.constexpr):
    """(first key, tensor batch index, sequence, kv head, first query block, query blocks per
    head, first query row, first key row, seqlen_q, seqlen_k, causal offset) of this
    program; keys and query rows are counted from the sequence's start. Packed sequences
    (VARLEN): rows [CU[b], CU[b + 1]) of the batch-of-one views, and the program's (sequence,
    key block) is item ``program_id(0)`` of the host's work list ``TILES`` (``kv_table``:
    only blocks that hold keys, the heaviest first), its kv head ``program_id(1)``. Query
    blocks that see none of its keys are skipped: causal (or a right window: query i sees
    key j only if j <= i + causal_offset), those wholly above the band; with a left window
    (j >= i + left_offset), those wholly below it. Otherwise program p of the 1-D grid:
    (batch, kv head) rows in sections of ``section`` rows, each section key block by key
    block (``place_work``)."""
    if VARLEN:
        item = gl.program_id(0)
        off_b = gl.load(TILES + 2 * item)
        n0 = gl.load(TILES + 2 * item + 1) * BLOCK_N
        off_hk = gl.program_id(1)
    else:
        # Program p of the 1-D grid: the (batch, kv head) rows in sections of ``section``,
        # each section key block by key block (section 1: row by row, key blocks in order)
        num_n = gl.cdiv(seqlen_k, BLOCK_N)
        rows = gl.num_programs(0) // num_n
        per = section * num_n
        first = gl.program_id(0) // per * section
        within = gl.program_id(0) - first * num_n
        size = gl.minimum(section, rows - first)
        blk = within // size
        n0 = blk * BLOCK_N
        off_bhk = first + within - blk * size
        kv_heads = heads // kv_group
        off_b = off_bhk // kv_heads
        off_hk = off_bhk % kv_heads
    tb, q_start, k_start, seqlen_q, seqlen_k, causal_offset = _seq(
        off_b, CU_Q, CU_K, seqlen_q, seqlen_k, causal_offset, VARLEN)
    m_lo = 0
    if CAUSAL:
        m_lo = gl.maximum(n0 - causal_offset, 0) // BLOCK_M
    m_hi = gl.cdiv(seqlen_q, BLOCK_M)
    if WINDOW:
        # The last row that sees this block's last key; none when it is negative.
        last_row = n0 + BLOCK_N - 1 - left_offset
        m_hi = gl.minimum(m_hi, gl.where(last_row < 0, 0, last_row // BLOCK_M + 1))
    num_m = gl.maximum(m_hi - m_lo, 0)
    return (n0, tb, off_b, off_hk, m_lo, num_m, q_start, k_start, seqlen_q, seqlen_k,
            causal_offset)


@gluon.jit
def _stats_async(LSE, DELTA, lse_smem, delta_smem, bar, rows, seqlen_rows, tb, heads, off_h,
                 seqlen_q, total_q, q_start, VARLEN: gl.constexpr):
    """A query block's LSE and delta into shared memory by cp.async (4-byte copies: a row of
    odd length starts anywhere, where TMA needs 16-byte aligned boxes), rows past the
    sequence zero-filled (the consumers mask them), with each thread's arrival on ``bar``
    waiting for its copies (and counting none: the caller's expect that follows is the one
    arrival; this one comes first, so the stage cannot complete on the TMA bytes alone).
    Both backward kernels' loaders."""
    if VARLEN:  # (heads, total_q)
        base = off_h.to(gl.int64) * total_q + q_start
    else:  # (batch, heads, seqlen_q)
        base = (tb.to(gl.int64) * heads + off_h) * seqlen_q
    async_copy.async_copy_global_to_shared(lse_smem, LSE + base + rows, mask=rows < seqlen_rows)
    async_copy.async_copy_global_to_shared(delta_smem, DELTA + base + rows,
                                           mask=rows < seqlen_rows)  # fmt: skip
    async_copy.mbarrier_arrive(bar)


@gluon.jit
def _bwd_loader(q_desc, do_desc, k_desc, v_desc, LSE, DELTA, q_bufs, do_bufs,
                k_bufs, v_bufs, lse_bufs, delta_bufs, kv_ready,
                ready, empty, heads, kv_group, seqlen_q, seqlen_k, total_q, causal_offset,
                left_offset, CU_Q, CU_K, TILES, section, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
                VARLEN: gl.constexpr):
    """The loader warp: this program's K and V (each consumer's 64-key half), then Q, dO,
    LSE and delta of every (query head of the group, query block) step through the ring."""
    BLOCK_M: gl.constexpr = q_bufs.type.shape[3]
    SUB_N: gl.constexpr = k_bufs.type.shape[3]
    CONSUMERS: gl.constexpr = k_bufs.type.shape[0]
    STAGES: gl.constexpr = q_bufs.type.shape[0]
    n0, tb, _b, off_hk, m_lo, num_m, q_start, k_start, seqlen_rows, _sk, _co = _kv_program(
        heads, kv_group, seqlen_q, seqlen_k, causal_offset, left_offset, CU_Q, CU_K, TILES,
        section, BLOCK_M, CONSUMERS * SUB_N, CAUSAL, WINDOW, VARLEN)
    offs = gl.arange(0, BLOCK_M, layout=gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0]))
    mbarrier.expect(kv_ready.index(0),
                    CONSUMERS * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
    for c in gl.static_range(CONSUMERS):
        tma.async_copy_global_to_shared(k_desc, [tb, off_hk, k_start + n0 + c * SUB_N, 0],
                                        kv_ready.index(0), k_bufs.index(c))  # fmt: skip
        tma.async_copy_global_to_shared(v_desc, [tb, off_hk, k_start + n0 + c * SUB_N, 0],
                                        kv_ready.index(0), v_bufs.index(c))  # fmt: skip
    # Step it: query head off_h, query block m_lo + mi (advanced at the step's end: no
    # division by num_m per step, as in the consumers).
    off_h = off_hk * kv_group
    mi = 0
    for it in range(kv_group * num_m):
        row0 = (m_lo + mi) * BLOCK_M
        s = it % STAGES
        # A fresh mbarrier counts as having completed the phase before phase 0: the first
        # lap's waits on "empty" pass at once.
        mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
        _stats_async(LSE, DELTA, lse_bufs.index(s), delta_bufs.index(s), ready.index(s),
                     row0 + offs, seqlen_rows, tb, heads, off_h, seqlen_q, total_q, q_start,
                     VARLEN)  # fmt: skip
        mbarrier.expect(ready.index(s), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [tb, off_h, q_start + row0, 0], ready.index(s),
                                        q_bufs.index(s))  # fmt: skip
        tma.async_copy_global_to_shared(do_desc, [tb, off_h, q_start + row0, 0],
                                        ready.index(s), do_bufs.index(s))  # fmt: skip
        mi += 1
        if mi == num_m:
            mi = 0
            off_h += 1


@gluon.jit
def _store_rows(PTR, x, row0, col0, k_start, off_hk, stride_s, stride_h, seqlen_k, width):
    """The tile ``x`` (rows from ``row0`` of the sequence's keys, columns from ``col0``) into a
    packed (total, kv heads, dim) tensor by masked pointer stores: the rows before
    ``seqlen_k``, the columns before ``width`` (a packed sequence's last key block, which a
    TMA store would write past into the next sequence's rows). Both kernels' epilogues."""
    layout: gl.constexpr = x.type.layout
    rows = row0 + gl.arange(0, x.shape[0], layout=gl.SliceLayout(1, layout))
    cols = col0 + gl.arange(0, x.shape[1], layout=gl.SliceLayout(0, layout))
    at = (k_start + rows).to(gl.int64)[:, None]
    gl.store(PTR + at * stride_s + off_hk * stride_h + cols[None, :],
             x.to(PTR.dtype.element_ty),
             mask=(rows < seqlen_k)[:, None] & (cols < width)[None, :])  # fmt: skip


@gluon.jit
def _store_dkdv(dk, dv, k_smem, v_smem, k_bufs, v_bufs, done, dk_desc, dv_desc, DK, DV,
                stride_dks, stride_dkh, stride_dvs, stride_dvh, head_dim, sm_scale, tb, off_hk,
                k_start, key0, seqlen_k, masked, DQ_ATOMIC: gl.constexpr, C: gl.constexpr):
    """The consumer's epilogue: dK (scaled) and dV of its 64 keys, through its own K / V
    buffers by TMA (nothing reads them once the other consumer's last dQ product, which
    reads both halves of K, is done: the ``done`` barrier; TMA clips rows past the tensor's
    end and columns past the head dim), or, ``masked`` (a packed sequence's last block), by
    masked pointer stores of the rows before ``seqlen_k``."""
    if DQ_ATOMIC:
        mbarrier.arrive(done.index(0))
        mbarrier.wait(done.index(0), 0)
    if masked:
        _store_rows(DK, dk * sm_scale, key0, 0, k_start, off_hk, stride_dks, stride_dkh,
                    seqlen_k, head_dim)  # fmt: skip
        _store_rows(DV, dv, key0, 0, k_start, off_hk, stride_dvs, stride_dvh, seqlen_k,
                    head_dim)  # fmt: skip
    else:
        k_smem.store((dk * sm_scale).to(k_smem.dtype))
        v_smem.store(dv.to(v_smem.dtype))
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(dk_desc, [tb, off_hk, k_start + key0, 0],
                                        k_bufs.index(C))  # fmt: skip
        tma.async_copy_shared_to_global(dv_desc, [tb, off_hk, k_start + key0, 0],
                                        v_bufs.index(C))  # fmt: skip
        tma.store_wait(0)


@gluon.jit
def _dq_issue(ds_all, k_bufs, piece, layout, WIDTH: gl.constexpr, ROWS: gl.constexpr = False):
    """Issue column piece ``piece`` (``WIDTH`` wide) of a query block's dQ = dS K,
    asynchronously (K = every consumer's 64 keys, dS^T from ``ds_all`` as the transposed A
    operand); returns the accumulator, to be waited for. ROWS: row part ``piece`` instead
    (the block's rows split evenly between the consumers, every column)."""
    CONSUMERS: gl.constexpr = k_bufs.type.shape[0]
    SUB_N: gl.constexpr = k_bufs.type.shape[3]
    BLOCK_M: gl.constexpr = ds_all.type.shape[1]
    R: gl.constexpr = BLOCK_M // CONSUMERS if ROWS else BLOCK_M
    dq = gl.zeros([R, WIDTH], gl.float32, layout)
    for c in gl.static_range(CONSUMERS):
        ds_t = ds_all.slice(c * SUB_N, SUB_N, dim=0)
        if ROWS:
            ds_t = ds_t.slice(piece * R, R, dim=1)
            k_piece = _tile2d(k_bufs, c)
        else:
            k_piece = _tile2d(k_bufs, c).slice(piece * WIDTH, WIDTH, dim=1)
        dq = warpgroup_mma(ds_t.permute((1, 0)), k_piece, dq, use_acc=c > 0, is_async=True)
    return dq


@gluon.jit
def _dq_add(dq, dq_bufs, tile, piece, dq_desc, tb, off_h, row, PERMUTE: gl.constexpr):
    """A finished dQ piece (:func:`_dq_issue`, waited for) to fp32 tile ``tile`` of
    ``dq_bufs`` and into the workspace by a TMA reduce-add at query row ``row``; the caller
    has made sure that tile's previous reduce-add is done."""
    BLOCK_M: gl.constexpr = dq.shape[0]
    WIDTH: gl.constexpr = dq_desc.block_type.shape[3]
    if PERMUTE:
        # Row r = 8a + 4b + c of the block goes to row 8a + 2c + b (DQ_ROWS_PERMUTED; _finish
        # puts them back): a register relabelling, after which each half-warp's 8-byte stores
        # (4 rows x 8 columns) fall on 8 distinct 16-byte bank groups of the 128-byte swizzle
        # instead of 4, twice each (ncu: those stores took twice their ideal wavefronts).
        dq = dq.reshape([BLOCK_M // 8, 2, 4, WIDTH]).permute((0, 2, 1, 3))
        dq = dq.reshape([BLOCK_M, WIDTH])
    _tile2d(dq_bufs, tile).store(dq)
    fence_async_shared()
    gl.thread_barrier()  # every thread's part is written before the issue
    _tma_reduce_add(dq_desc, [tb, off_h, row, piece * WIDTH], dq_bufs.index(tile))


@gluon.jit
def _dq_piece(ds_all, k_bufs, dq_bufs, tile, piece, dq_desc, tb, off_h, row, layout,
              PERMUTE: gl.constexpr):
    """Column piece ``piece`` of a query block's dQ = dS K (the piece's width: the
    workspace descriptor's block), waited for and added to the workspace (:func:`_dq_issue`,
    :func:`_dq_add`)."""
    dq = _dq_issue(ds_all, k_bufs, piece, layout, dq_desc.block_type.shape[3])
    dq = warpgroup_mma_wait(0, deps=(dq,))
    _dq_add(dq, dq_bufs, tile, piece, dq_desc, tb, off_h, row, PERMUTE)


@gluon.jit
def _probs_t(st, lse, offs_k, offs_m, key0, row0, seqlen_k, key_tail, causal_offset,
             left_offset, qk_scale, tanh_scale, slope2, alibi_offset, CAUSAL: gl.constexpr,
             WINDOW: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, rows_end=0,
             ROWS_END: gl.constexpr = False):
    """P^T of a (keys ``offs_k`` from ``key0``, query rows ``offs_m`` from ``row0``) tile
    of q.k products ``st``, and, with SOFTCAP, tanh's derivative 1 - t^2 there (else ``st``
    back): the forward's scores recomputed in its order (SOFTCAP, tanh(q.k * tanh_scale),
    qk_scale carrying softcap * log2(e); ALIBI, minus slope2 * |i + offset - j| once scaled,
    base 2), P^T = 2^(scores - lse), zero where the key is past ``seqlen_k`` (``key_tail``:
    the tile runs past it) or outside the causal band or the window (masked only on tiles
    that cross an edge). ROWS_END (packed sequences): zero too on the query rows from
    ``rows_end`` on (the next sequence's), on the tiles that hold any; inside the masked
    branch, which the tiles of a sequence's last query block take (a select per row on
    every step was if-converted by ptxas and, with its predicates kept in registers, cost
    ~400M instructions over the varlen suite's causal d128 backward: ncu, 2026-11-25). Both
    backward kernels' (this one's and hopper_bwd256's)."""
    KEYS: gl.constexpr = st.shape[0]
    ROWS: gl.constexpr = st.shape[1]
    if SOFTCAP:
        st = _tanh(st * tanh_scale)
    if ALIBI:  # (positions in fp32: see portable._alibi)
        # As the forward does: a tile whose keys all lie on one side of every query's
        # diagonal j = i + alibi_offset splits the distance into a key term, sign * slope2 *
        # (j - key0), and a query term, -sign * slope2 * (i + alibi_offset - key0), taken off
        # with the LSE (one add per score where |distance| costs four).
        # ALIBI 4 (causal): every kept key is left of its diagonal, so every tile splits
        # (hopper_fwd's note); ALIBI 2: the tiles on one side split, ALIBI 1: none.
        split = ALIBI == 4
        sign_slope = slope2
        if ALIBI == 2:
            left = key0 + KEYS - 1 <= row0 + alibi_offset
            split = left | (key0 >= row0 + ROWS - 1 + alibi_offset)
            sign_slope = gl.where(left, slope2, -slope2)
        if split:
            key_term = (offs_k - key0).to(gl.float32) * sign_slope
            cols = gl.arange(0, ROWS, layout=lse.type.layout).to(gl.float32)
            lq = gl.fma(cols + (row0 + alibi_offset - key0).to(gl.float32), sign_slope, lse)
            pt = gl.exp2(st * qk_scale + key_term[:, None] - lq[None, :])
        else:
            dist = ((offs_m + alibi_offset).to(gl.float32)[None, :]
                    - offs_k.to(gl.float32)[:, None])  # fmt: skip
            pt = gl.exp2(st * qk_scale - slope2 * gl.abs(dist) - lse[None, :])
    else:
        pt = gl.exp2(st * qk_scale - lse[None, :])
    if SOFTCAP:  # d tanh: the score's gradient reaches q.k times (1 - t^2)
        st = 1.0 - st * st
    need_mask = key_tail
    if ROWS_END:
        need_mask = need_mask | (row0 + ROWS > rows_end)
    if CAUSAL:
        need_mask = need_mask | (row0 + causal_offset < key0 + KEYS - 1)
    if WINDOW:
        need_mask = need_mask | (row0 + ROWS - 1 + left_offset > key0)
    if need_mask:
        keep = offs_k[:, None] < seqlen_k
        if ROWS_END:
            keep = keep & (offs_m[None, :] < rows_end)
        if CAUSAL:
            keep = keep & (offs_k[:, None] <= offs_m[None, :] + causal_offset)
        if WINDOW:
            keep = keep & (offs_k[:, None] >= offs_m[None, :] + left_offset)
        pt = gl.where(keep, pt, 0.0)
    return pt, st


@gluon.jit
def _p16(pt, drop_scale, dtype: gl.constexpr, a_layout: gl.constexpr, DROPOUT: gl.constexpr):
    """P^T as dV's 16-bit register operand (dropout: the kept entries' P^T / (1 - p), the
    dropped ones' sign taken off)."""
    if DROPOUT:
        pt = gl.maximum(pt, 0.0) * drop_scale
    return gl.convert_layout(pt.to(dtype), a_layout)


@gluon.jit
def _split_tile(ds_ready, dq_bufs, it, C: gl.constexpr, CONSUMERS: gl.constexpr,
                NAMED: gl.constexpr = False):
    """The split dQ's (DQ_ATOMIC 2, 3 and 4) wait at step ``it``: for the step's whole dS^T
    (both consumers' halves), and for the reduce-add of two steps back to have read this
    consumer's fp32 tile ``it % 2``; returns that tile's index in ``dq_bufs``."""
    SPLIT: gl.constexpr = dq_bufs.type.shape[0] // CONSUMERS
    gl.static_assert(SPLIT == CONSUMERS, "a column half per consumer")
    if not NAMED:  # (NAMED: the consumers met on a named barrier already)
        mbarrier.wait(ds_ready.index(it % 2), (it // 2) & 1)
    tma.store_wait(1)
    gl.thread_barrier()
    return C * SPLIT + it % 2  # its two tiles in turn


@gluon.jit
def _bwd_consumer(dk_desc, dv_desc, lse_bufs, delta_bufs, dq_desc, q_bufs, do_bufs, k_bufs,
                  v_bufs, ds_bufs, dq_bufs, kv_ready, ready, empty, ds_ready, done, heads,
                  kv_group,
                  seqlen_q, seqlen_k, total_q, CU_Q, CU_K, TILES, section, DK, DV,
                  stride_dks, stride_dkh, stride_dvs, stride_dvh, head_dim, causal_offset,
                  qk_scale, sm_scale, left_offset, tanh_scale, SLOPES, stride_slopes_b,
                  alibi_offset, dropout_seed, dropout_thresh, dropout_keep,
                  CAUSAL: gl.constexpr, DQ_ATOMIC: gl.constexpr, WINDOW: gl.constexpr,
                  SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, VARLEN: gl.constexpr,
                  DQ_ROWS: gl.constexpr, C: gl.constexpr, DROPOUT: gl.constexpr):
    """Consumer warpgroup C: keys [n0 + 64 C, n0 + 64 C + 64) of the program's block."""
    BLOCK_M: gl.constexpr = q_bufs.type.shape[3]
    HEAD_DIM: gl.constexpr = q_bufs.type.shape[4]
    SUB_N: gl.constexpr = k_bufs.type.shape[3]
    CONSUMERS: gl.constexpr = k_bufs.type.shape[0]
    STAGES: gl.constexpr = q_bufs.type.shape[0]
    dtype: gl.constexpr = q_bufs.dtype
    # S^T and dP^T: (keys, queries); dK, dV: (keys, head dim); dQ: (queries, head dim).
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    d_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=d_layout, k_width=2)
    # dQ's column pieces: the workspace descriptor's block width
    h_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, dq_desc.block_type.shape[3], 16])
    key_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    query_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    # LATE_DV (128-row steps): dV's product issued after dS^T, so that P^T's 16-bit copy is
    # not live across the dP^T wait next to P^T, dP^T (64 registers each) and dK, dV
    LATE_DV: gl.constexpr = BLOCK_M > 64
    # DQ_ATOMIC's mode, and (+ 8, mode 3: DS_NAMED) the consumers meet on a named barrier
    # of both warpgroups once their halves of dS^T are written, instead of ds_ready
    MODE: gl.constexpr = DQ_ATOMIC % 8
    NAMED: gl.constexpr = DQ_ATOMIC >= 8

    n0, tb, off_b, off_hk, m_lo, num_m, q_start, k_start, seqlen_q, seqlen_k, causal_offset = (
        _kv_program(heads, kv_group, seqlen_q, seqlen_k, causal_offset, left_offset, CU_Q, CU_K,
                    TILES, section, BLOCK_M, CONSUMERS * SUB_N, CAUSAL, WINDOW, VARLEN))
    # (the query block's first row in the atomic dQ workspace: packed sequences with
    # permuted rows start on a multiple of 8 there, listed after TILES' pairs: dq_rows)
    dq_start = q_start
    if VARLEN:
        if DQ_ROWS:
            dq_start = gl.load(TILES + 2 * gl.num_programs(0) + off_b)
    key0 = n0 + C * SUB_N
    offs_k = key0 + gl.arange(0, SUB_N, layout=key_layout)
    # Steps that need a mask: past the last key (this consumer's keys run off the end),
    # causal blocks whose first row does not see this consumer's last key, and, with a left
    # window, blocks whose last row does not see its first key.
    key_tail = key0 + SUB_N > seqlen_k
    k_smem = _tile2d(k_bufs, C)
    v_smem = _tile2d(v_bufs, C)
    dk = gl.zeros([SUB_N, HEAD_DIM], gl.float32, layout=d_layout)
    dv = gl.zeros([SUB_N, HEAD_DIM], gl.float32, layout=d_layout)
    mbarrier.wait(kv_ready.index(0), 0)
    # Step it: query head off_h, query block m_lo + mi, advanced at the step's end (a
    # division by num_m per step sat on the softmax's path: ncu, 2026-11-24).
    off_h = off_hk * kv_group
    mi = 0
    if DROPOUT:  # the forward's mask, drawn again: this consumer's keys' groups
        drop_keys = (_key_group(offs_k) << 1) | (offs_k & 1)
        drop_scale = 1.0 / dropout_keep
    for it in range(kv_group * num_m):
        row0 = (m_lo + mi) * BLOCK_M
        offs_m = row0 + gl.arange(0, BLOCK_M, layout=query_layout)
        slope2 = 0.0
        if ALIBI:  # the (sequence, head)'s slope times log2(e)
            slope2 = gl.load(SLOPES + off_b * stride_slopes_b + off_h) * 1.4426950408889634

        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        # The block's row statistics came with Q and dO (the loader's cp.async). Rows past
        # seqlen_q come zero-filled, as do their Q and dO (TMA): P^T = 1 there but dO = 0
        # and delta = dP^T = 0, so they add nothing to dV, dK or dQ. A row that saw no key in
        # the forward (LSE -inf) has every key masked in every step that holds it (the masks
        # below). Packed sequences: the rows past the sequence are the next one's; the
        # steps that hold any (a sequence's last query block) mask them with the keys
        # (_probs_t's ROWS_END: P = 0 there, so dS = 0 whatever the next sequence's delta).
        # (No per-row selects on every step: ncu, 2026-11-24 and 2026-11-25.)
        if not LATE_DV:
            lse = lse_bufs.index(s).load(query_layout)
        q_smem = _tile2d(q_bufs, s)
        do_smem = _tile2d(do_bufs, s)
        q_t = q_smem.permute((1, 0))
        do_t = do_smem.permute((1, 0))
        st_tok = warpgroup_mma(k_smem, q_t, gl.zeros([SUB_N, BLOCK_M], gl.float32, s_layout),
                               use_acc=False, is_async=True)  # fmt: skip
        dpt_tok = warpgroup_mma(v_smem, do_t, gl.zeros([SUB_N, BLOCK_M], gl.float32, s_layout),
                                use_acc=False, is_async=True)  # fmt: skip
        st, _k, _qt = warpgroup_mma_wait(1, deps=(st_tok, k_smem, q_t))
        if LATE_DV:  # (not live across the wait: 32 registers a thread at 128 rows)
            lse = lse_bufs.index(s).load(query_layout)
        pt, st = _probs_t(st, lse, offs_k, offs_m, key0, row0, seqlen_k, key_tail,
                          causal_offset, left_offset, qk_scale, tanh_scale, slope2,
                          alibi_offset, CAUSAL, WINDOW, SOFTCAP, ALIBI, seqlen_q,
                          VARLEN)  # fmt: skip
        # dV's product (P^T rounded to the input dtype, as in the forward) runs while dS^T
        # is computed from the fp32 P^T (as the portable kernel does).
        if DROPOUT:
            # The forward's mask Z in P^T's sign (kept: P^T, dropped: -P^T; P^T >= 0, so no
            # register more is live across the dP^T wait). dV takes P^T Z / (1 - p); dS^T =
            # P^T (dP^T Z / (1 - p) - delta): kept, P^T (dP^T / (1 - p) - delta), dropped,
            # -P^T delta = (-P^T) delta.
            pt = _dropout(pt, drop_keys, row0, off_b * heads + off_h, dropout_seed,
                          dropout_thresh, True)  # fmt: skip
        if SOFTCAP or not LATE_DV:
            p16 = _p16(pt, drop_scale if DROPOUT else 1.0, dtype, a_layout, DROPOUT)
        if not LATE_DV:
            dv_tok = warpgroup_mma(p16, do_smem, dv, is_async=True)
        if SOFTCAP:
            # tanh's derivative into P^T before the dP^T wait (P^T itself is in p16 now):
            # one tile live across the wait instead of two (ptxas, d128 causal: spills 280 ->
            # 148 bytes deterministic, 420 -> 236 atomic; +14% / +54% on the H200, auto_mode;
            # dropout's sign survives, 1 - t^2 >= 0)
            pt = pt * st
        if not LATE_DV:
            delta = delta_bufs.index(s).load(query_layout)
        dpt, _v, _dot = warpgroup_mma_wait(0 if LATE_DV else 1, deps=(dpt_tok, v_smem, do_t))
        if LATE_DV:
            delta = delta_bufs.index(s).load(query_layout)
        if DROPOUT:  # (dS^T = P^T times this)
            dpt = gl.where(pt > 0.0, dpt * drop_scale - delta[None, :], delta[None, :])
        else:
            dpt = dpt - delta[None, :]
        if LATE_DV:
            if not SOFTCAP:
                p16 = _p16(pt, drop_scale if DROPOUT else 1.0, dtype, a_layout, DROPOUT)
            dv_tok = warpgroup_mma(p16, do_smem, dv, is_async=True)
        ds16 = (pt * dpt).to(dtype)
        if DQ_ATOMIC:
            # This consumer's 64 rows of the step's (128 keys, BLOCK_M) dS^T, for dQ below.
            ds_all = ds_bufs.index(it % 2)
            ds_all.slice(C * SUB_N, SUB_N, dim=0).store(ds16)
            fence_async_shared()
            if NAMED:
                named_barrier(DS_BARRIER, 2 * 128)
            else:
                gl.thread_barrier()  # every thread's rows are written before the arrival
                mbarrier.arrive(ds_ready.index(it % 2))
        dsa = gl.convert_layout(ds16, a_layout)
        if MODE == 3 or MODE == 4:
            # (DQ_FA3_ORDER) The column-half split below in FlashAttention-3's order: this
            # step's dQ piece is issued before dK, and stored and added to the workspace
            # while dK runs. dV (issued long before) is waited for first: a product issued
            # while another's accumulator registers are still being written makes ptxas
            # serialise every wgmma of the kernel (its C7515 note). DQ_ATOMIC 4: the same
            # with the block's rows split between the consumers instead of its columns.
            tile = _split_tile(ds_ready, dq_bufs, it, C, CONSUMERS, NAMED)
            dv, _p, _do = warpgroup_mma_wait(0, deps=(dv_tok, p16, do_smem))
            dq_tok = _dq_issue(ds_all, k_bufs, C, h_layout, dq_desc.block_type.shape[3],
                               MODE == 4)  # fmt: skip
            dk_tok = warpgroup_mma(dsa, q_smem, dk, is_async=True)
            dq = warpgroup_mma_wait(1, deps=(dq_tok,))
            # (mode 4: this consumer's rows, every column; else its column half, every row)
            part: gl.constexpr = C * (BLOCK_M // CONSUMERS) if MODE == 4 else 0
            _dq_add(dq, dq_bufs, tile, 0 if MODE == 4 else C, dq_desc, tb, off_h,
                    dq_start + row0 + part, DQ_ROWS)  # fmt: skip
            dk, _ds, _q = warpgroup_mma_wait(0, deps=(dk_tok, dsa, q_smem))
            mbarrier.arrive(empty.index(s))  # Q and dO of this stage are no longer read
        else:
            dk_tok = warpgroup_mma(dsa, q_smem, dk, is_async=True)
            dv, dk, _p, _ds, _q, _do = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, p16, dsa,
                                                                   q_smem, do_smem))
            mbarrier.arrive(empty.index(s))  # Q and dO of this stage are no longer read
        if MODE == 2:
            # (DQ_SPLIT at d128; DQ_SPLIT_D64, off, at d64) Every step, each consumer computes
            # its own column half of the query block's dQ = dS K (K = 128 keys: both
            # consumers' dS^T halves as the transposed A operand, K from both buffers),
            # FlashAttention-3's division, and adds it to the workspace by a TMA reduce-add;
            # the buffer rules are the turns' (below): ds buffer it % 2 is rewritten two steps
            # on, after the partner has passed step it + 1's ds_ready (so its step-it product
            # is done).
            tile = _split_tile(ds_ready, dq_bufs, it, C, CONSUMERS)
            _dq_piece(ds_all, k_bufs, dq_bufs, tile, C, dq_desc, tb, off_h, dq_start + row0,
                      h_layout, DQ_ROWS)  # fmt: skip
        elif MODE == 1:
            if it % 2 == C:
                # The consumers take turns: this one multiplies the whole block's dS (both
                # halves, K = 128 keys) by K into the query block's dQ and adds it to the
                # workspace, while the other one goes on with the next step. Buffer it % 2
                # is written again two steps on, after this wait's partner has passed its
                # own turn (see the module docstring).
                mbarrier.wait(ds_ready.index(it % 2), (it // 2) & 1)
                # In column halves of K at d128 (half the accumulator registers at a time;
                # each half starts on a whole 128-byte swizzle block); in one piece at d64.
                # K = 128 keys as two products of 64, one per consumer's K buffer. Each
                # half goes to this consumer's own fp32 buffer in shared memory and from
                # there into the workspace by a TMA reduce-add, which runs on while the
                # consumer goes on; its previous turn's reductions (two steps back) must
                # have read those buffers first.
                SPLIT: gl.constexpr = dq_bufs.type.shape[0] // CONSUMERS
                tma.store_wait(0)
                gl.thread_barrier()
                for h in gl.static_range(SPLIT):
                    _dq_piece(ds_all, k_bufs, dq_bufs, C * SPLIT + h, h, dq_desc, tb, off_h,
                              dq_start + row0, h_layout, DQ_ROWS)  # fmt: skip
        mi += 1
        if mi == num_m:
            mi = 0
            off_h += 1

    # Epilogue: a packed sequence's last block by masked stores, every other one by TMA.
    # (The plain kernel passes a literal False: a run-time flag there, even one always
    # false, fails Triton 3.6's lowering to LLVM with both stores under one branch.)
    if VARLEN:
        _store_dkdv(dk, dv, k_smem, v_smem, k_bufs, v_bufs, done, dk_desc, dv_desc, DK, DV,
                    stride_dks, stride_dkh, stride_dvs, stride_dvh, head_dim, sm_scale, tb,
                    off_hk, k_start, key0, seqlen_k, key_tail, DQ_ATOMIC, C)  # fmt: skip
    else:
        _store_dkdv(dk, dv, k_smem, v_smem, k_bufs, v_bufs, done, dk_desc, dv_desc, DK, DV,
                    stride_dks, stride_dkh, stride_dvs, stride_dvh, head_dim, sm_scale, tb,
                    off_hk, k_start, key0, seqlen_k, False, DQ_ATOMIC, C)  # fmt: skip


@gluon.jit
def _bwd_consumer0(dk_desc, dv_desc, lse_bufs, delta_bufs, dq_desc, q_bufs, do_bufs, k_bufs,
                   v_bufs,
                   ds_bufs, dq_bufs, kv_ready, ready, empty, ds_ready, done, heads, kv_group,
                   seqlen_q, seqlen_k, total_q, CU_Q, CU_K, TILES, section, DK, DV,
                   stride_dks, stride_dkh, stride_dvs, stride_dvh, head_dim, causal_offset,
                   qk_scale, sm_scale, left_offset, tanh_scale, SLOPES, stride_slopes_b,
                   alibi_offset, dropout_seed, dropout_thresh, dropout_keep,
                   CAUSAL: gl.constexpr, DQ_ATOMIC: gl.constexpr, WINDOW: gl.constexpr,
                   SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, VARLEN: gl.constexpr,
                   DQ_ROWS: gl.constexpr, DROPOUT: gl.constexpr):
    _bwd_consumer(dk_desc, dv_desc, lse_bufs, delta_bufs, dq_desc, q_bufs, do_bufs, k_bufs,
                  v_bufs,
                  ds_bufs, dq_bufs, kv_ready, ready, empty, ds_ready, done, heads, kv_group,
                  seqlen_q, seqlen_k, total_q, CU_Q, CU_K, TILES, section, DK, DV,
                  stride_dks, stride_dkh, stride_dvs, stride_dvh, head_dim, causal_offset,
                  qk_scale, sm_scale, left_offset, tanh_scale, SLOPES, stride_slopes_b,
                  alibi_offset, dropout_seed, dropout_thresh, dropout_keep, CAUSAL,
                  DQ_ATOMIC, WINDOW, SOFTCAP, ALIBI, VARLEN, DQ_ROWS, 0, DROPOUT)  # fmt: skip


@gluon.jit
def _bwd_consumer1(dk_desc, dv_desc, lse_bufs, delta_bufs, dq_desc, q_bufs, do_bufs, k_bufs,
                   v_bufs,
                   ds_bufs, dq_bufs, kv_ready, ready, empty, ds_ready, done, heads, kv_group,
                   seqlen_q, seqlen_k, total_q, CU_Q, CU_K, TILES, section, DK, DV,
                   stride_dks, stride_dkh, stride_dvs, stride_dvh, head_dim, causal_offset,
                   qk_scale, sm_scale, left_offset, tanh_scale, SLOPES, stride_slopes_b,
                   alibi_offset, dropout_seed, dropout_thresh, dropout_keep,
                   CAUSAL: gl.constexpr, DQ_ATOMIC: gl.constexpr, WINDOW: gl.constexpr,
                   SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, VARLEN: gl.constexpr,
                   DQ_ROWS: gl.constexpr, DROPOUT: gl.constexpr):
    _bwd_consumer(dk_desc, dv_desc, lse_bufs, delta_bufs, dq_desc, q_bufs, do_bufs, k_bufs,
                  v_bufs,
                  ds_bufs, dq_bufs, kv_ready, ready, empty, ds_ready, done, heads, kv_group,
                  seqlen_q, seqlen_k, total_q, CU_Q, CU_K, TILES, section, DK, DV,
                  stride_dks, stride_dkh, stride_dvs, stride_dvh, head_dim, causal_offset,
                  qk_scale, sm_scale, left_offset, tanh_scale, SLOPES, stride_slopes_b,
                  alibi_offset, dropout_seed, dropout_thresh, dropout_keep, CAUSAL,
                  DQ_ATOMIC, WINDOW, SOFTCAP, ALIBI, VARLEN, DQ_ROWS, 1, DROPOUT)  # fmt: skip


@gluon.jit
def _attn_bwd_hopper(q_desc, do_desc, k_desc, v_desc, dk_desc, dv_desc, LSE, DELTA, dq_desc,
                     heads, kv_group, seqlen_q, seqlen_k, total_q, CU_Q, CU_K, TILES, section,
                     DK, DV,
                     stride_dks, stride_dkh, stride_dvs, stride_dvh, head_dim, causal_offset,
                     qk_scale, sm_scale, left_offset, tanh_scale, SLOPES, stride_slopes_b,
                     alibi_offset, dropout_seed, dropout_thresh, dropout_keep,
                     CAUSAL: gl.constexpr, DQ_ATOMIC: gl.constexpr, STAGES: gl.constexpr,
                     CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
                     WINDOW: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr,
                     VARLEN: gl.constexpr, DQ_ROWS: gl.constexpr,
                     DROPOUT: gl.constexpr = False):
    """Grid (cdiv(seqlen_k, 128) * batch * kv_heads,) in ``section``'s order (``_kv_program``;
    packed sequences: below), launched with num_warps=4 (consumer 0); the partitions add 4
    warps (consumer 1) and 1 loader warp.
    Descriptors are 4-D over (batch, heads, seqlen, dim): Q and dO blocks (1, 1, BLOCK_M,
    padded dim), K, V, dK, dV blocks (1, 1, 64, padded dim). LSE (base 2) and DELTA are
    (batch, heads, seqlen_q) fp32; DQ the fp32 workspace (batch, heads, seqlen_q, padded
    dim), read only with DQ_ATOMIC. Packed sequences (VARLEN): the descriptors are over
    batch-of-one (1, heads, total, dim) views, sequence b is rows [CU[b], CU[b + 1]) (int32
    CU_Q, CU_K), the grid is (work items, kv heads) over the host's list of (sequence, key
    block) pairs ``TILES`` (:func:`kv_table`), LSE and DELTA are (heads, total_q), and a
    sequence's last key block leaves through masked stores into DK / DV ((total_k, kv
    heads, dim), strides stride_dk* / stride_dv*; ``head_dim`` the real head dim), since a
    TMA store would write the next sequence's rows. The variants (WINDOW, SOFTCAP, ALIBI;
    sinks need nothing here: they are in the LSE; DROPOUT, the forward's mask drawn again,
    ``hopper_fwd._dropout``) as the forward's ``variant_args`` sets them."""
    dtype: gl.constexpr = q_desc.dtype
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    SUB_N: gl.constexpr = k_desc.block_type.shape[2]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    q_bufs = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape,
                                        do_desc.layout)  # fmt: skip
    k_bufs = gl.allocate_shared_memory(dtype, [2] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [2] + v_desc.block_type.shape, v_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * SUB_N, BLOCK_M], dtype)
    ds_bufs = gl.allocate_shared_memory(dtype, [2, 2 * SUB_N, BLOCK_M], ds_layout)
    # The atomic mode's fp32 dQ tiles on their way to the workspace: per consumer, the
    # column halves its turn computes (whole blocks of the workspace's descriptor).
    # (DQ_ATOMIC 4: two per consumer, its row part of two steps in turn)
    DQ_TILES: gl.constexpr = (2 * (HEAD_DIM // dq_desc.block_type.shape[3])
                              if DQ_ATOMIC % 8 != 4 else 4) if DQ_ATOMIC else 1
    dq_bufs = gl.allocate_shared_memory(gl.float32, [DQ_TILES] + dq_desc.block_type.shape,
                                        dq_desc.layout)  # fmt: skip
    # Each stage's LSE and delta (BLOCK_M fp32 each), loaded with its Q and dO.
    stats_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    lse_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], stats_layout)
    delta_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], stats_layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready.index(0), count=1)
    mbarrier.init(ds_ready.index(0), count=2)  # one arrival per consumer
    mbarrier.init(ds_ready.index(1), count=2)
    mbarrier.init(done.index(0), count=2)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)  # the loader's expect; TMA counts the bytes
        mbarrier.init(empty.index(i), count=2)  # one arrival per consumer
    # (Argument tuples are written out in place: bound to a name first, their constexpr
    # members would reach the partitions as run-time values.)
    gl.warp_specialize([
        (_bwd_consumer0, (dk_desc, dv_desc, lse_bufs, delta_bufs, dq_desc, q_bufs, do_bufs,
                          k_bufs, v_bufs, ds_bufs, dq_bufs, kv_ready, ready, empty, ds_ready,
                          done, heads, kv_group, seqlen_q, seqlen_k, total_q, CU_Q, CU_K,
                          TILES, section, DK, DV,
                          stride_dks, stride_dkh, stride_dvs, stride_dvh, head_dim, causal_offset,
                          qk_scale, sm_scale, left_offset, tanh_scale, SLOPES, stride_slopes_b,
                          alibi_offset, dropout_seed, dropout_thresh, dropout_keep,
                          CAUSAL, DQ_ATOMIC, WINDOW, SOFTCAP, ALIBI, VARLEN, DQ_ROWS, DROPOUT)),
        (_bwd_consumer1, (dk_desc, dv_desc, lse_bufs, delta_bufs, dq_desc, q_bufs, do_bufs,
                          k_bufs, v_bufs, ds_bufs, dq_bufs, kv_ready, ready, empty, ds_ready,
                          done, heads, kv_group, seqlen_q, seqlen_k, total_q, CU_Q, CU_K,
                          TILES, section, DK, DV,
                          stride_dks, stride_dkh, stride_dvs, stride_dvh, head_dim, causal_offset,
                          qk_scale, sm_scale, left_offset, tanh_scale, SLOPES, stride_slopes_b,
                          alibi_offset, dropout_seed, dropout_thresh, dropout_keep,
                          CAUSAL, DQ_ATOMIC, WINDOW, SOFTCAP, ALIBI, VARLEN, DQ_ROWS, DROPOUT)),
        (_bwd_loader, (q_desc, do_desc, k_desc, v_desc, LSE, DELTA, q_bufs, do_bufs, k_bufs,
                       v_bufs, lse_bufs, delta_bufs, kv_ready, ready, empty, heads, kv_group,
                       seqlen_q, seqlen_k, total_q, causal_offset, left_offset, CU_Q, CU_K,
                       TILES, section, CAUSAL, WINDOW, VARLEN)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])  # fmt: skip


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------
def tma_ready(t4: torch.Tensor) -> bool:
    """Whether a (batch, heads, seqlen, dim) view meets TMA's rules: 16-byte aligned base,
    contiguous last dim, the other strides multiples of 16 bytes."""
    es = t4.element_size()
    return (t4.data_ptr() % 16 == 0 and t4.stride(3) == 1
            and not any(st * es % 16 or (st == 0 and n > 1)  # no broadcast (stride-0) axes
                        for st, n in zip(t4.stride()[:3], t4.shape[:3], strict=True)))  # fmt: skip


_DQ_STANDINS: dict = {}


def _dq_desc(dq_acc: torch.Tensor, block_m: int, dpad: int, dq_atomic: bool,
             halves: bool = False, cols: int | None = None):
    """The TMA descriptor of the atomic mode's fp32 dQ workspace, blocks of BLOCK_M rows x
    ``cols`` columns (default: one column half, 64 columns at d128; the whole 64 at d64
    unless ``halves``); without atomic dQ, one over a small stand-in of the same block shape
    (the kernel reads nothing through it)."""
    if cols is None:
        cols = dpad // 2 if dpad > 64 or halves else dpad
    if not dq_atomic:
        key = (dq_acc.device, block_m, cols)
        dq_acc = _DQ_STANDINS.get(key)
        if dq_acc is None:
            dq_acc = _DQ_STANDINS[key] = torch.zeros((1, 1, block_m, cols),
                                                     dtype=torch.float32, device=key[0])
    return _desc(dq_acc, block_m, cols)


# The packed backward's work order (kv_table): VARLEN_BY_SEQUENCE keeps a sequence's key
# blocks together (sequences by their heaviest block, heaviest first), so the programs
# running at once (one kv head's) reduce-add dQ into, and read Q and dO from, a few
# sequences' rows, as an equal-length batch's programs do; sorted by weight alone they
# spanned many sequences (DRAM traffic 10.3 GB against 2.9 GB for the same work in equal
# lengths, ncu on the H200, 2026-11-25).
VARLEN_BY_SEQUENCE = True


def kv_table(cu_q, cu_k, block_n: int, block_m: int, causal: bool,
             device) -> tuple[torch.Tensor, int]:
    """Packed sequences' key blocks as the kernel takes them (``TILES``): int32 (sequence,
    key block) pairs for every block that holds a key, the heaviest first (the most query
    blocks to visit, causal bottom-right; ties in sequence order), and their count. A
    (longest sequence x batch) grid would spend most of its programs past the short
    sequences' ends, and this order starts the long blocks first (as the forward's
    ``tile_table``; built and kept by ``hopper_fwd.work_table``)."""
    return work_table("kv", tuple(cu_q), tuple(cu_k), block_m, block_n, causal,
                      VARLEN_BY_SEQUENCE, device)  # fmt: skip


def bwd_args(q4, k4, v4, do4, dk4, dv4, lse2, delta, dq_acc, causal_offset: int,
             softmax_scale: float, causal: bool, dq_atomic: bool,
             config: tuple | None = None, qk_scale: float | None = None,
             variants: dict | None = None,
             packed: dict | None = None) -> tuple[tuple, dict, int]:
    """(grid, kernel arguments, num_warps) for (batch, heads, seqlen, dim) views; ``dq_acc``
    is the fp32 workspace (atomic dQ) or any tensor (kernel dQ: not read). ``qk_scale`` and
    ``variants`` as :func:`~diyfa.attention.hopper_fwd.variant_args` gives them with
    ``backward=True`` (default: softmax_scale * log2(e), no variant); the sinks' entries are
    dropped (the LSE
    holds them). ``packed`` (packed sequences: the views are batch-of-one): the sequence
    count, longest lengths and the VARLEN kernel arguments (:func:`hopper_backward`)."""
    b, h, sq, d = q4.shape
    sk = k4.shape[2]
    if packed is not None:
        b, sq, sk = packed["batch"], packed["seqlen_q"], packed["seqlen_k"]
    dpad = head_dim_pad(d)
    row_bytes = l2_row_bytes(q4, do4, k4.shape[1], sq, dq_atomic)
    band = causal  # (the call's own band, for the grid's order and packed work lists)
    if (NONCAUSAL_AS_CAUSAL and dpad == 128 and dq_atomic and not causal and not variants
            and packed is None):
        # (the causal build with its band past every key: nothing masked, nothing skipped)
        causal, causal_offset = True, cdiv(sk, BLOCK_N) * BLOCK_N
    block_m, stages, c_regs, l_regs, *rest = config or BWD_CONFIGS[dpad]
    # atomic dQ: 2 = every step a column half per consumer (DQ_SPLIT at d128, DQ_SPLIT_D64
    # at d64: halves of 32 columns), 3 = that in FlashAttention-3's order (DQ_FA3_ORDER),
    # 1 = turns; a config's fifth field: 0 turns, 1 split, 2 split in FA3's order
    split = rest[0] if rest else (DQ_SPLIT if dpad > 64 else DQ_SPLIT_D64)
    if split and not rest and DQ_FA3_ORDER:
        split = 2
    dq_mode = 1 + int(split) if dq_atomic else 0
    # (dQ mode 4, a config's fifth field 3: the split by rows, blocks of BLOCK_M / 2 rows)
    args = dict(q_desc=_desc(q4, block_m, dpad), do_desc=_desc(do4, block_m, dpad),
                k_desc=_desc(k4, SUB_N, dpad), v_desc=_desc(v4, SUB_N, dpad),
                dk_desc=_desc(dk4, SUB_N, dpad), dv_desc=_desc(dv4, SUB_N, dpad),
                LSE=lse2, DELTA=delta,
                dq_desc=_dq_desc(dq_acc, block_m // 2 if dq_mode == 4 else block_m, dpad,
                                 dq_atomic, dq_mode in (2, 3)),
                heads=h, kv_group=h // k4.shape[1],
                seqlen_q=sq, seqlen_k=sk, total_q=0, CU_Q=lse2, CU_K=lse2, TILES=lse2, DK=dk4,
                DV=dv4,
                stride_dks=0, stride_dkh=0, stride_dvs=0, stride_dvh=0, head_dim=d, VARLEN=False,
                causal_offset=causal_offset,
                qk_scale=softmax_scale * LOG2E if qk_scale is None else qk_scale,
                sm_scale=softmax_scale, CAUSAL=causal,
                DQ_ATOMIC=dq_mode + (8 if DS_NAMED and dq_mode == 3 else 0),
                STAGES=stages,
                CONSUMER_REGS=c_regs, LOADER_REGS=l_regs, left_offset=0, tanh_scale=1.0,
                SLOPES=lse2, stride_slopes_b=0, alibi_offset=0, WINDOW=False, SOFTCAP=False,
                ALIBI=False, DQ_ROWS=False, DROPOUT=False, dropout_seed=0, dropout_thresh=0,
                dropout_keep=1.0)  # fmt: skip
    # (the atomic dQ's rows in the workspace permuted within groups of 8: _dq_piece, _finish)
    args["DQ_ROWS"] = dq_rows_permuted(dq_mode > 0, packed is not None, dpad)
    grid = place_work(args, variants, packed, BLOCK_N, block_m, sk, b, k4.shape[1], band,
                      lse2.device, row_bytes)  # fmt: skip
    return grid, args, 4


# The order of a causal call's programs: its (batch, kv head) rows in sections whose Q, dO
# and atomic dQ workspace fit in ORDER_L2_BYTES of L2 (the row count rounded down to a power
# of 2), each section key block by key block, so that its heaviest programs (the first key
# blocks, visited by every query block below the band) start before its light ones and the
# grid ends on light programs (FlashAttention-3's backward orders its causal tiles so,
# longest first). 0: row by row, each row's key blocks in order (the grid's order before);
# ORDER_NONCAUSAL: the same sections for calls without the band.
ORDER_L2_BYTES = 40 * 2**20
ORDER_NONCAUSAL = False
# (A persistent grid, at most one program per SM walking these key blocks in turn, the next
# block's K and V loading while the consumers stored dK / dV through their fp32 dQ tiles, was
# built and measured slower on 2026-11-26 (commits acef859..6a9f124, reverted;
# docs/attention.md, "A persistent backward"): blocks from an atomic counter 0.81x / 0.77x at
# d128 causal 2k / 4k (the item read from shared memory is not uniform to ptxas: spills in
# the step loop), 0.96-1.01x at d64; blocks round robin 0.91x at d64 2k.)


def l2_row_bytes(q4, do4, kv_heads: int, seqlen_q: int, dq_atomic) -> int:
    """Bytes of one (batch, kv head) row of the grid (:func:`section_rows`): Q and dO of the
    kv head's query heads and, with the atomic dQ, their fp32 workspace (padded head dim)."""
    acc = 4 * head_dim_pad(q4.shape[3]) if dq_atomic else 0
    return (q4.shape[1] // kv_heads * seqlen_q
            * ((q4.shape[3] + do4.shape[3]) * q4.element_size() + acc))


def section_rows(rows: int, row_bytes: int, causal: bool) -> int:
    """How many (batch, kv head) rows of ``row_bytes`` each (Q, dO and the atomic dQ
    workspace of the query heads of one kv head) a section of the grid holds (ORDER_L2_BYTES;
    1 without the band unless ORDER_NONCAUSAL)."""
    if not ORDER_L2_BYTES or not (causal or ORDER_NONCAUSAL):
        return 1
    fit = max(1, ORDER_L2_BYTES // max(1, row_bytes))
    return max(1, min(rows, 1 << (fit.bit_length() - 1)))


def place_work(args: dict, variants: dict | None, packed: dict | None, block_n: int,
               block_m: int, seqlen_k: int, batch: int, kv_heads: int, causal: bool,
               device, row_bytes: int = 0) -> tuple:
    """Both backward kernels' arguments' last part, into ``args``: the variants' flags (the
    sinks' dropped: the LSE holds them), the grid's section (``section_rows``, for rows of
    ``row_bytes`` of Q, dO and dQ workspace each) and packed sequences' (their work list,
    ``kv_table``, as TILES); returns the grid: (key blocks of ``block_n`` x batch x kv
    heads,), or (work items, kv heads) for packed sequences."""
    if variants:
        args.update({k: v for k, v in variants.items() if k not in ("SINKS", "SINK_LOGITS")})
    if packed is None:
        args.update(section=section_rows(batch * kv_heads, row_bytes, causal))
        return (cdiv(seqlen_k, block_n) * batch * kv_heads,)
    args.update(packed["args"], section=1)
    table, items = kv_table(*packed["cu_host"], block_n, block_m, causal, device)
    args.update(TILES=table)
    return items, kv_heads


def compile_setup(head_dim: int, dtype: torch.dtype, variants: tuple[str, ...],
                  packed: bool, causal: bool = False) -> tuple[dict, dict | None]:
    """The compile-only problems' variant flags (``variants`` names them: WINDOW, SOFTCAP,
    ALIBI, DROPOUT; ALIBI's value as a ``causal`` call gets it) and packed-sequence setup (4
    sequences in 4096 rows, or None), as ``bwd_args`` takes them."""
    flags = {name: True for name in variants}
    if "WINDOW" in flags:
        flags["left_offset"] = -1000
    if "ALIBI" in flags:  # (the flag's value as bwd_args gives it)
        flags.update(ALIBI=alibi_flag(head_dim_pad(head_dim), backward=True, causal=causal),
                     SLOPES=torch.empty(16, dtype=torch.float32), alibi_offset=0)  # fmt: skip
    if "DROPOUT" in flags:
        flags.update(dropout_seed=2**40 + 3, dropout_thresh=portable.dropout_threshold(0.1),
                     dropout_keep=0.9)  # fmt: skip
    if not packed:
        return flags, None
    cu = torch.zeros(5, dtype=torch.int32)
    dkv = torch.empty(4096, 4, head_dim, dtype=dtype)
    bounds = (0, 1000, 2000, 3000, 4096)
    return flags, dict(batch=4, seqlen_q=1096, seqlen_k=1096, cu_host=(bounds, bounds), args=dict(
        CU_Q=cu, CU_K=cu, total_q=4096, DK=dkv, DV=dkv, stride_dks=dkv.stride(0),
        stride_dkh=dkv.stride(1), stride_dvs=dkv.stride(0), stride_dvh=dkv.stride(1),
        VARLEN=True))  # fmt: skip


def compile_bwd_for_hopper(head_dim: int = 128, dtype: torch.dtype = torch.bfloat16,
                           causal: bool = False, dq_atomic: bool = True,
                           config: tuple | None = None, variants: tuple[str, ...] = (),
                           packed: bool = False):
    """Compile the kernel for sm90a without a GPU (as ``bwd_args`` sets it up for a (2, 16,
    4096, head_dim) problem with 4 kv heads); returns Triton's ``CompiledKernel``.
    ``variants`` names the flags to set (WINDOW, SOFTCAP, ALIBI, DROPOUT); ``packed``: the packed-
    sequence build (VARLEN). Run it in a process that has not run kernels under the
    interpreter."""
    from diyfa._compile import compile_for_sm90

    q = torch.empty(2, 16, 4096, head_dim, dtype=dtype)
    kv = torch.empty(2, 4, 4096, head_dim, dtype=dtype)
    stats = torch.empty(2, 16, 4096, dtype=torch.float32)
    dq_acc = torch.empty(2, 16, 4096, head_dim_pad(head_dim), dtype=torch.float32)
    flags, pack = compile_setup(head_dim, dtype, variants, packed, causal)
    if packed:
        q, kv, stats, dq_acc = q[:1], kv[:1], stats[0], dq_acc[:1]
    _, args, num_warps = bwd_args(q, kv, kv, q, kv, kv, stats, stats, dq_acc, 0, 0.1, causal,
                                  dq_atomic, config, variants=flags, packed=pack)  # fmt: skip
    return compile_for_sm90(_attn_bwd_hopper, args, num_warps)


def delta(out4: torch.Tensor, do4: torch.Tensor, launched: list | None = None,
          res: torch.Tensor | None = None, acc: torch.Tensor | None = None) -> torch.Tensor:
    """rowsum(dO * O) in fp32, (batch, heads, seqlen_q), for (batch, heads, seqlen, dim)
    views of any strides (one Triton kernel; runs in the interpreter too), into ``res``
    (contiguous) when given. ``acc``: the atomic dQ's fp32 workspace, (batch, heads, rows >=
    seqlen_q, padded dim) contiguous, which the same kernel zeroes. ``launched``: a list that
    gets the GPU launch's (fn, kernel, grid, args), for a Replay."""
    b, h, sq, d = out4.shape
    if res is None:
        res = torch.empty((b, h, sq), dtype=torch.float32, device=out4.device)
    acc_rows = sq if acc is None else acc.shape[2]
    if b * h * acc_rows == 0:
        return res
    block = 64
    so, sdo = out4.stride(), do4.stride()
    args = dict(O=out4, DO=do4, DELTA=res, ACC=res if acc is None else acc, stride_ob=so[0],
                stride_oh=so[1], stride_os=so[2], stride_od=so[3], stride_dob=sdo[0],
                stride_doh=sdo[1], stride_dos=sdo[2], stride_dod=sdo[3], heads=h, seqlen_q=sq,
                acc_rows=acc_rows, HEAD_DIM=d, HEAD_DIM_PAD=max(16, next_power_of_2(d)),
                ACC_DIM=0 if acc is None else acc.shape[3], BLOCK=block)  # fmt: skip
    launch_recorded(_bwd_delta, (b * h, cdiv(acc_rows, block)), args, out4.is_cuda, launched)
    return res


def default_config(p: Problem, variants: dict | None = None) -> tuple:
    """The launch config of ``p``'s backward (``variants``: its kernel arguments from
    ``variant_args(p, backward=True)``, computed here if not given): BWD_CONFIG_D64_ROWS128
    at d64 without the variants' flags (``ROWS128_KEEP_64``: a window's left edge, softcap,
    ALiBi, dropout), packed sequences too (``ROWS128_PACKED``), else BWD_CONFIGS by the
    padded head dim."""
    dpad = head_dim_pad(p.head_dim)
    if dpad == 64 and (ROWS128_PACKED or p.cu_seqlens_q is None):
        if variants is None:
            variants = variant_args(p, backward=True)[3]
        if not any(variants.get(f) for f in ROWS128_KEEP_64):
            return BWD_CONFIG_D64_ROWS128
    return BWD_CONFIGS[dpad]


def default_atomic(p: Problem) -> bool:
    """Whether ``backend="hopper"`` runs ``p``'s backward with the atomic dQ: unless
    ``deterministic``, and not above d128 (``WIDE_DQ_ATOMIC``: slower there)."""
    return not p.deterministic and (WIDE_DQ_ATOMIC or head_dim_pad(p.head_dim) < 256)


def hopper_backward(do, q, k, v, out, lse2, problem: Problem, config: tuple | None = None,
                    atomic_dq: bool | None = None, delta_out=None):
    """(dq, dk, dv) through the Hopper kernel for a problem :func:`supports` accepts: dQ by
    the kernel's atomic adds (``atomic_dq``; default: unless ``problem.deterministic``) or by
    the portable dQ kernel first (bitwise reproducible). ``delta_out``: an fp32 tensor shaped
    like ``lse2`` that receives rowsum(dO * O) (left as given when there is nothing to run)."""
    p = problem
    if atomic_dq is None:
        atomic_dq = default_atomic(p)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    varlen = p.cu_seqlens_q is not None
    if (p.seqlen_q == 0 or p.seqlen_k == 0 or p.batch * p.heads == 0
            or (varlen and (p.total_q == 0 or k.shape[0] == 0))):  # (TMA takes no empty tensor)
        return dq.zero_(), dk.zero_(), dv.zero_()

    def view(t):  # (batch, heads, seqlen, dim); packed (total, heads, d) -> (1, heads, total, d)
        return t.unsqueeze(0).transpose(1, 2) if varlen else bhsd_view(t, p.layout)

    q4, k4, v4, do4, o4 = view(q), view(k), view(v), view(do), view(out)
    if not tma_ready(do4):  # e.g. the expanded, stride-0 gradient of out.sum()
        do = do.contiguous()
        do4 = view(do)
    # empty_like keeps a dense input's strides (which TMA took for k and v) and makes a
    # non-dense one's gradient contiguous: both meet TMA's rules at these head dims.
    dpad = head_dim_pad(p.head_dim)
    # The forward's band, scales and flags (plain attention: no flag; sinks: the LSE has them).
    upper, qk_scale, causal, variants = variant_args(p, backward=True)
    launch_config = config or default_config(p, variants)
    block_m = launch_config[0]
    stats = torch.empty_like(lse2) if delta_out is None else delta_out  # delta = rowsum(dO * O)
    permuted = dq_rows_permuted(atomic_dq, varlen, dpad)
    if atomic_dq:  # the fp32 dQ workspace the kernel's TMA reduce-adds go to
        rows = p.total_q
        if varlen and permuted:
            rows = dq_rows(cu_host(p)[0])[1]
        shape = ((1, p.heads, rows, dpad) if varlen else
                 (p.batch, p.heads, cdiv(p.seqlen_q, block_m) * block_m, dpad))  # fmt: skip
        dq_acc = torch.empty(shape, dtype=torch.float32, device=q.device)  # zeroed by delta
    else:  # (the kernel reads nothing through it)
        dq_acc = stats
    key = None if config is not None else portable.replay_key(
        "hopper-bwd", q, p, do.stride(), do.dtype, atomic_dq, permuted)  # fmt: skip
    roles = None
    if key is not None:
        roles = portable.own_roles(dict(q=q, k=k, v=v, out=out, lse=lse2, do=do, delta=stats,
                                        dk=dk, dv=dv), p)  # fmt: skip
        roles["dq"] = dq
        if atomic_dq:
            roles["dq_acc"] = dq_acc
        replay = _REPLAYS.get(key)
        if replay is not None and replay.run(roles):
            return dq, dk, dv
    launched = []
    if not atomic_dq:
        # The portable dQ kernel (a fixed order per row; it also writes delta), then this
        # kernel for dK and dV only.
        launched.append(portable._dq_launch(do, q, k, v, out, lse2, dq, stats, p))
    else:
        delta(o4, do4, launched, res=stats, acc=dq_acc)
    dk4, dv4 = view(dk), view(dv)
    packed = None
    if varlen:  # dK / dV's last block of a sequence by masked stores: their (total, h, d) form
        packed = dict(batch=p.batch, seqlen_q=p.seqlen_q, seqlen_k=p.seqlen_k,
                      cu_host=cu_host(p),
                      args=dict(CU_Q=p.cu_seqlens_q, CU_K=p.cu_seqlens_k, total_q=p.total_q,
                                DK=dk, DV=dv, stride_dks=dk.stride(0), stride_dkh=dk.stride(1),
                                stride_dvs=dv.stride(0), stride_dvh=dv.stride(1),
                                VARLEN=True))  # fmt: skip
    if dpad == 256:  # the head dim split between the consumers (hopper_bwd256)
        from diyfa.attention import hopper_bwd256

        fn = hopper_bwd256._attn_bwd_d256
        dq_desc = _dq_desc(dq_acc, block_m, dpad, atomic_dq, cols=hopper_bwd256.DQ_PIECE)
        grid, args, num_warps = hopper_bwd256.bwd_args(
            q4, k4, v4, do4, dk4, dv4, lse2, stats, dq_desc, upper, p.softmax_scale, causal,
            atomic_dq, permuted, launch_config, qk_scale, variants, packed)  # fmt: skip
    else:
        fn = _attn_bwd_hopper
        grid, args, num_warps = bwd_args(q4, k4, v4, do4, dk4, dv4, lse2, stats, dq_acc, upper,
                                         p.softmax_scale, causal, atomic_dq, launch_config,
                                         qk_scale, variants, packed)  # fmt: skip
    kernel = launch(fn, grid, args, {}, num_warps, 1)
    launched.append((fn, kernel, grid, args))
    if atomic_dq:
        _finish(view(dq), dq_acc, p.softmax_scale, permuted, launched,
                (p.cu_seqlens_q, args["TILES"], p.batch, p.seqlen_q) if varlen and permuted
                else None)  # fmt: skip
    if roles is not None and not compiling_only() and None not in launched:
        _REPLAYS.put(key, Replay.record(launched, roles, tuple(_DQ_STANDINS.values())))
    return dq, dk, dv


_REPLAYS = ReplayCache()  # launches kept per signature (_launcher.Replay)


def _finish(dq4: torch.Tensor, dq_acc: torch.Tensor, scale: float, permuted: bool = False,
            launched: list | None = None, packed: tuple | None = None) -> None:  # fmt: skip
    """dQ from the atomic mode's fp32 workspace: scaled, cast and written into ``dq4``, dQ's
    (batch, heads, seqlen, dim) view (packed: (1, heads, total, dim)), by one Triton kernel
    (``_dq_finish``; the interpreter on the CPU); ``permuted``: the workspace holds row 8a +
    4b + c of each group of 8 at 8a + 2c + b (:func:`dq_rows_permuted`), put back here.
    ``packed`` (packed sequences with permuted rows): (cu_seqlens_q, the work list whose
    last batch + 1 entries are the sequences' first rows in the workspace (``dq_rows``),
    the sequence count, the longest sequence). ``launched``: as for :func:`delta`."""
    b, h, sq, d = dq4.shape
    block = 64
    so = dq4.stride()
    args = dict(ACC=dq_acc, DQ=dq4, stride_qb=so[0], stride_qh=so[1], stride_qs=so[2],
                stride_qd=so[3], heads=h, seqlen_q=sq, acc_rows=dq_acc.shape[2], scale=scale,
                HEAD_DIM=d, ACC_DIM=dq_acc.shape[3], PERMUTED=permuted, BLOCK=block,
                CU_Q=dq_acc, STARTS=dq_acc, starts_at=0, PACKED=False)  # fmt: skip
    grid = (b * h, cdiv(sq, block))
    if packed is not None:
        cu_q, table, batch, longest = packed
        args.update(CU_Q=cu_q, STARTS=table, starts_at=table.shape[0] - batch - 1, PACKED=True)
        grid = (h, cdiv(longest, block), batch)
    launch_recorded(_dq_finish, grid, args, dq4.is_cuda, launched)


# --------------------------------------------------------------------------------------------
# Where it runs
# --------------------------------------------------------------------------------------------
def supports(p: Problem) -> str | None:
    """Why this kernel cannot run ``p``'s backward; None when it can."""
    reason = forward_supports(p)
    if reason is not None:
        return reason
    if p.head_dim_v != p.head_dim and (head_dim_pad(p.head_dim) < 256
                                       or head_dim_pad(p.head_dim_v) < 128):
        return (f"its backward takes a value head dim other than q's (here {p.head_dim_v} "
                f"and {p.head_dim}) only with q/k head dims above 128 and value head dims "
                "above 64 (portable)")  # fmt: skip
    if p.deterministic:  # (the portable dQ kernel's grid: portable.bh_grid)
        return portable.FAMILY.supports(p)
    return None


def backward(do, q, k, v, out, lse2, problem: Problem, forced: bool = False, delta_out=None):
    """The Hopper family's backward: this kernel where it applies (:func:`supports`) and was
    asked for (``forced``: ``backend="hopper"``, atomic dQ unless ``deterministic``) or
    :func:`auto_mode` picks it; else the portable backward (which reads the same LSE).
    ``delta_out``: receives rowsum(dO * O) (the family contract, dispatch.py)."""
    if supports(problem) is None:
        if forced:
            return hopper_backward(do, q, k, v, out, lse2, problem, delta_out=delta_out,
                                   atomic_dq=default_atomic(problem))  # fmt: skip
        mode = auto_mode(problem)
        if mode is not None:
            return hopper_backward(do, q, k, v, out, lse2, problem,
                                   atomic_dq=mode == "atomic", delta_out=delta_out)  # fmt: skip
    return portable.FAMILY.backward(do, q, k, v, out, lse2, problem, delta_out=delta_out)
