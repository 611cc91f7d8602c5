"""FlashAttention forward for Hopper (sm90) in Gluon: TMA, ``wgmma`` and warp specialisation.

Why a second forward kernel
    The portable kernel (portable.py) leaves the schedule to Triton: the same warps load K/V,
    run the matmuls and the softmax, so the tensor cores idle while the exponentials run. On
    Hopper the fast kernels (FlashAttention-3, cuDNN) split the work by warps instead. This
    kernel does the same:

    - one *loader* warp issues TMA loads: the program's Q tiles once, then K and V blocks
      through a ring of ``STAGES`` shared-memory buffers (``k_ready``/``v_ready`` complete
      when a block's bytes have landed, ``k_empty``/``v_empty`` when every consumer is done
      with it: K after its S = Q K^T, V after its O += P V, so the next K loads early);
    - ``CONSUMERS`` (2 or 3) *consumer* warpgroups, each owning 64 query rows of the
      program's tile. A consumer runs S = Q K^T and O += P V with asynchronous
      ``warpgroup_mma`` (Q, K and V from shared memory, P from registers) and keeps the
      tensor core busy during its softmax: it issues S_j = Q K_j^T and O += P_{j-1} V_{j-1}
      back to back, waits for S_j only, and computes the softmax of block j while
      P_{j-1} V_{j-1} runs (FlashAttention-3's intra-warpgroup pipelining). Consumers are
      independent warpgroups, so one's softmax also overlaps the others' matmuls.
    - Registers are reallocated between them (``setmaxnreg``): the loader keeps 24-40.
    - Programs are persistent (about one per SM): non-causal ones walk a static round robin
      of tiles, causal and windowed ones take the next tile from an atomic counter (the
      loader hands its number to the consumers through a shared-memory slot), and two Q
      buffers per consumer let the next tile's Q load while this one runs
      (docs/attention.md, "Scheduling"). A tile's O leaves through its Q buffer by a TMA
      store, which the consumer waits for only once the next tile's first block is under
      way (``DEFER_O_STORE``, two consumers).

Numerics are the portable kernel's (module docstring there): fp32 accumulation, base-2
softmax with the scale folded in, P rounded to the input dtype before P @ V, base-2 LSE
saved per row (-inf for a row that sees no key, whose output is zeros).

Masking: causal bottom-right (query i sees key j iff j <= i + seqlen_k - seqlen_q) or
top-left (offset 0); a sliding window's right side is the same with the offset moved, its
left side a second edge (key j visible iff j >= i + left_offset). Programs skip the K/V
blocks wholly outside the band; only blocks that straddle an edge or the end of the keys
compute a mask (a run-time branch).

Tensors are addressed through 4-D TMA descriptors over the (batch, heads, seqlen, dim) view,
so any layout whose last dimension is contiguous and whose other strides are multiples of 16
bytes runs without copies; rows past seqlen are zero-filled on load and clipped on store by
the TMA unit. What does not fit these rules goes to the portable kernel (``supports``).

Scope (``supports``): sm90, fp16/bf16, head dims 64..256 that are multiples of 8 (computed
as 64, 128 or 256: TMA zero-fills the columns past the head dim and clips them on store),
positive softmax_scale, TMA's alignment rules; sliding windows, softcap, ALiBi and
attention sinks (compile-time flags, the portable kernels' formulas; ALiBi's bias split by
side of the diagonal, ``alibi_flag``), a value head dim below q's, packed sequences without
variants (``VARLEN``: a host-made list of the tiles that hold rows, kept per lengths, rows
offset by cu_seqlens, O by TMA where a consumer's rows lie in the sequence and by a masked
store at its end; the launch replayed per lengths), and fp8 (e4m3) q, k, v with descales
for plain attention (``FP8``: V transposed per call by a small Triton kernel,
``transpose_v``; P through shared memory, 2^8 times larger (``P_SHIFT``); the fp8 sums as
``fp8_mode`` says, each mode with its launch config, ``fp8_config``). "auto" takes what
``prefer`` does not pass over (its docstring has the measurements). The backward is the
Gluon one (hopper_bwd.py) where it measured faster (``hopper_bwd.auto_mode``), else the
portable kernel's, which reads the same LSE. Everything else runs on the portable family.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
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

from diyfa._launcher import Replay, ReplayCache, cdiv, compiling_only, launch
from diyfa.attention import portable, prefetch
from diyfa.attention.checks import HostLengths, host_lengths, packed_lengths
from diyfa.attention.dispatch import Family
from diyfa.attention.portable import empty_lse, own_roles, replay_key
from diyfa.attention.problem import Problem
from diyfa.device import kernel_limits

LOG2E = 1.4426950408889634
SUB_M = 64  # query rows per consumer warpgroup: one m64 wgmma
_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}
_SMEM_DTYPES = {**_GL_DTYPES, torch.float32: gl.float32,  # + the backward's fp32 dQ tiles
                torch.float8_e4m3fn: gl.float8e4nv}  # fp8 q, k, v (hopper_forward)

class Config(NamedTuple):
    """One launch configuration of the kernel. Shared memory: Q (q_bufs * consumers * 64 * d)
    + stages * 2 * block_n * d, 2 bytes each, of the 227 KB a block may use."""

    consumers: int  # consumer warpgroups (64 query rows each): 2 or 3
    block_n: int  # keys per K/V block
    stages: int  # K/V ring depth
    per_sm: int  # programs per SM when persistent; 0: one program per tile
    consumer_regs: int  # setmaxnreg of the consumers
    loader_regs: int  # ... and of the loader warp
    pin: int = 0  # hold the wait for P V after the softmax (_consumer): 1 by a shared-memory
    # store, 2 by a global store that never runs (_pin)
    q_bufs: int = 1  # Q buffers per consumer: with 2 the next tile's Q loads during this one
    dynamic: int = 0  # 1: causal calls persistent too, tiles handed out by an atomic counter
    pingpong: int = 0  # 1: the consumers issue their products in turns (named barriers)
    lazy: int = 0  # 1: O is rescaled only when a row's max grows by more than LAZY_RESCALE
    chain: int = 0  # 1: a tile's first S and softmax run with the tile before's last P V
    # (ORDER_CHAIN; only where programs take their tiles round robin: hopper_args)


# The consumers wait for a tile's O store (and hand its Q buffer back) once the next tile's
# first block is under way (ORDER_DEFER_STORE; two Q buffers), not before they start it. H200,
# bf16, one process, 3 interleaved rounds (benchmarks/hopper_flag_ab.py --flag DEFER_O_STORE,
# benchmarks/results/2026-11-25_h200_fwd-defer-store-ab_206687b-wip.{txt,jsonl}), median ms
# with / without: d128 1 x 16 x 8192 (1023, 0) window 0.1370 / 0.1405, causal 0.4575 /
# 0.4633; 16 x 16 x 1024 0.2420 / 0.2473, causal 0.1624 / 0.1657; 4 x 16 x 4096 0.8528 /
# 0.8603; 16k 3.385 / 3.508; the varlen mix 3.541 / 3.586, causal 1.901 / 1.929; d64 (two
# consumers) 16 x 32 x 1024 0.3276 / 0.3311, 4 x 32 x 4096 causal level, the window level;
# but three consumers (d64 packed sequences, 192-row tiles) 4.914 / 4.855, causal 2.748 /
# 2.713: two consumers only. Again at 9afb09c, after the packed calls' clearing moved to the
# loader (benchmarks/results/2026-11-26_h200_fwd-defer-three-ab_9afb09c-wip.txt, 5 rounds):
# level at three consumers (d64 mix 4.616 / 4.610, causal 2.724 / 2.724, 4 x 4096 1.119 /
# 1.119, 16k 4.237 / 4.186, causal 2.220 / 2.226).
DEFER_O_STORE = True
# A tile's O leaves through V's ring where the config has one Q buffer per consumer, 64-key
# blocks and a V stage per consumer (d256; the kernel's ORDER_O_IN_V), for calls whose tiles
# come from the counter (the causal band, windows). H200, bf16, one process, 3 interleaved
# rounds (benchmarks/hopper_flag_ab.py --flag O_IN_V, benchmarks/results/
# 2026-11-26_h200_fwd-o-in-v-ab_cffcecf-wip.txt), median ms with / without, d256 causal: 8 x
# 8 x 2048 0.2443 / 0.2553, 4 x 8 x 4096 0.4474 / 0.4562, 2 x 8 x 8192 0.8406 / 0.8616, 16k
# 1.5241 / 1.5246, 4096 x 8192 0.6257 / 0.6294; window (1023, 0) at 8192 0.1296 / 0.1329;
# softcap 30, 4 x 8 x 4096 causal 0.4548 / 0.4636. Without the band (the static round robin)
# level to slower: 2048 0.4121 / 0.4128, 4096 0.7882 / 0.7775, 8192 1.5775 / 1.5244.
O_IN_V = True
# (Handing Q back right after the last S, in the K/V loop, as FlashAttention-3 does, instead of
# after the loop: mixed, median ms after the loop / in it, 2048 causal 0.2456 / 0.2526, 4096
# 0.4536 / 0.4565, 8192 0.887 / 0.8649, window 0.1303 / 0.1305 (..._fwd-early-q-ab_ca7920f.txt).)
# For A/Bs (benchmarks/hopper_flag_ab.py --flag TRY_CONFIG): (padded head dim, "plain",
# "softcap" or "other" (the other variants), then a Config's fields): the 16-bit forward runs
# that config for such calls unless one is passed; None: the defaults. In the kept launches'
# keys (_replay_settings).
TRY_CONFIG: tuple | None = None

# padded head_dim -> Config. Chosen from A/B runs on an H100 and an H200 (docs/attention.md).
HOPPER_CONFIGS = {
    64: Config(2, 128, 4, 1, 240, 24, 0, q_bufs=2, dynamic=1, chain=1),
    128: Config(2, 128, 2, 1, 240, 24, 1, q_bufs=2, dynamic=1, lazy=1, chain=1),
    256: Config(2, 64, 2, 1, 240, 24, 1, q_bufs=1, dynamic=1, lazy=1),  # (two Q buffers: too big)
}
# chain (chained tiles, ORDER_CHAIN): H200, bf16, FlashAttention's sweep (16k tokens), one
# process, 3 interleaved rounds, twice (scratch A/B of 2026-11-25, benchmarks/results/
# 2026-11-25_h200_fwd-chain-ab_*.jsonl), TFLOPS without / with, non-causal, 1024 / 2048 /
# 4096 / 16384 keys: d64 404 / 423, 455 / 485, 472 / 499, 513 / 521 (second run 405 / 419,
# 450 / 473, 463 / 497, 511 / 525); d128 555 / 565, 594 / 615, 616 / 639, 643 / 643 (552 /
# 555, 581 / 599, 601 / 628, 633 / 626). Causal calls (tiles from the counter) lost 0-3%
# (d128 16k 631 / 615) and the windowed one 5%: chained for the static round robin only.
# lazy (the lazy rescale, ORDER_LAZY): H200, bf16, FlashAttention's sweep (16k tokens), one
# process, 5 rounds (benchmarks/results/2026-11-24_h200_hopper-fwd-lazy64-ab_d66423d-wip.txt),
# TFLOPS without / with at 2048 / 4096 / 8192 / 16384 keys: d128 601.7 / 606.3, 617.7 / 622.4,
# 630.2 / 635.6, 642.9 / 644.3, causal 504.6 / 513.0, 554.9 / 564.4, 588.9 / 610.5, 618.7 /
# 637.6; d256 640.2 / 668.1, 645.1 / 700.2, 668.5 / 705.5, 681.6 / 726.3, causal 521.1 /
# 545.7, 578.2 / 610.4, 604.5 / 642.6, 674.2 / 718.2. At d64 (three consumers, 32 values a
# thread) it lost 0-7% with branches of 16 values (..._hopper-fwd-lazy-ab_d66423d.txt): off.
# With it, d256 pins by the shared-memory store (pin 1) again: same process, 3 rounds
# (..._hopper-fwd-pin-lazy-ab_7445983.txt), TFLOPS pin 0 / 1 / 2 at 2048 / 4096 / 8192 /
# 16384 keys: 627 / 666 / 671, 648 / 686 / 679, 659 / 726 / 690, 669 / 745 / 735; causal
# 521 / 544 / 546, 577 / 611 / 607, 614 / 645 / 648, 682 / 728 / 726; d128 kept pin 1 (best
# at 7 of 8 rows, pin 2 0.3% ahead at 8192 causal).
# From LONG_KEYS keys on, head dim 64 runs three consumers (192 query rows per tile): H200,
# bf16, 2026-11-23 (benchmarks/results/*_hopper-fwd-pin-ab_1fc2b6f.jsonl): 490.6 against
# 457.0 TFLOPS at 16k, 478.4 against 450.1 causal, 470.1 against 456.8 at 4096 (causal
# even); at 1024 keys it lost (359.7 against 373.0, causal 201.4 against 243.2). At 160
# registers each, ptxas spills 4 bytes, 136 causal (test_hopper_kernel_compiles_and_fits).
# Chosen by the key count alone, measured with as many queries as keys; with few query rows
# the third consumer mostly computes rows past the end (slower, not wrong). Since 2026-11-24
# plain calls without the causal band choose by the rows their busiest program runs instead
# (default_config, THREE_ROW_COST below).
# PIN keeps the wait for P V after the softmax (see _consumer): +2% at d128 (5 of 6
# shapes), -2..-3% at d64 and mixed at d256 in the same run, so d128 only (the store also
# brings a warpgroup barrier per block, which Triton adds before it: part of the effect and
# of the cost). Pinned by a global store that never runs (pin 2, no barrier; H200, bf16,
# one process, 3 rounds, 2026-11-24, benchmarks/results/*_hopper-fwd-pin2-ab_519a67b-wip
# .jsonl): d256 16k 646.7 -> 681.2 TFLOPS, causal 651.7 -> 672.0, 4096 647.4 -> 653.1,
# causal level (571.6 / 570.7); d64 -1..-13% (two or three consumers); d128 -1..-2.5%
# against the shared-memory store (*_fwd-joint-pin2-ab_519a67b-wip.txt). A second run at
# d256 (*_hopper-fwd-pin256-ab_519a67b-wip.jsonl), pin 0 / 1 / 2: 4096 641 / 662 / 657,
# causal 569 / 579 / 582, 16k 657 / 675 / 675, causal 653 / 672 / 680. So d256 pins, by
# the global store (within 1% of the shared one there; the side-by-side ran it); since the
# lazy rescale (below) by the shared-memory store.
# Causal calls (handed out by the dynamic scheduler) measured otherwise: two consumers won
# at 4096 keys (421.6 against 397.1 TFLOPS), three at 16k (470.4 against 452.6; H200, bf16,
# benchmarks/results/2026-11-24_h200_hopper-fwd-dynamic-ab_78d922a-wip.jsonl), so causal
# calls take three consumers from 16k keys (8k is not measured).
# Both thresholds measured again at 2048 and 8192 keys (H200, bf16, one process, 3 rounds,
# FlashAttention's sweep shapes, 2026-11-24, *_hopper-fwd-d64-keys-ab_393bf20.jsonl), two /
# three consumers: 2048 keys 442.3 / 463.8 (causal 385.5 / 357.2), 8192 keys 453.2 / 504.1,
# causal 437.2 / 471.8. So three from 2048 keys, causal from 8192.
LONG_KEYS = 2048
LONG_KEYS_CAUSAL = 8192
SHORT_KEYS_D64 = 2048  # "auto" leaves head dims <= 64 below this many keys to the portable kernel
# ... unless the call has at least this many (batch x heads x seqlen_q x seqlen_k) scores:
# H200, 2026-11-24, commit 3f3876a (..._flash_fasweep-fa4_3f3876a.jsonl and
# ..._flash_seed-fa4_3f3876a.jsonl), d64 at 1024 keys: b16 h32 (2^29 scores) ran faster on the
# Hopper family (forward 316 / 396 TFLOPS causal / not against the portable 285 / 393,
# backward 265 / 347 against 182 / 318), b4 h8 fp16 (2^25) on the portable kernels (forward 216
# against 157, backward 218 against 120-163).
SHORT_WORK_D64 = 2**28
# The three consumers issue their products in turns (pingpong; FlashAttention-3's warp-scheduler
# barrier, as FlashAttention-4 runs it: ncu against FA4, 2026-11-24): H200, bf16, one process,
# 3 interleaved rounds (benchmarks/results/2026-11-24_h200_hopper-fwd-pingpong-ab_17bc6f9-wip
# .jsonl), TFLOPS without / with: 4096 keys 471 / 489, 16k 490 / 516, causal 16k 474 / 486
# (causal 4096, which runs two consumers, 403 / 397). Two consumers: level at d64 (-1.7..+1.9%),
# mixed at d128 (+0.9..+1.4% non-causal, -1.2..-3.3% causal), slower at d256 causal (-3..-6%):
# three consumers only.
# d128 runs three consumers too (64-key blocks: with 128 ptxas spilled 850-1,100 bytes at 160
# registers), for plain calls without the causal band that run the frozen max (inference),
# from LONG_KEYS_D128 keys where the busiest program's rows (weighed by THREE_ROW_COST_LONG) say
# so. H200, one process, 3 interleaved rounds (benchmarks/hopper_flag_ab.py --flag TRY_CONFIG,
# 2026-11-26, benchmarks/results/2026-11-26_h200_fwd-d128-three-ab_9952406-wip.txt), median ms
# two consumers / three (4 stages), bf16 frozen max: 4 x 16 x 4096 0.8502 / 0.7873, 2 x 16 x
# 8192 1.640 / 1.552, 1 x 16 x 16384 3.216 / 3.024, 1 x 16 x 4096 x 15360 0.8029 / 0.7559, 4 x
# 32 x 4096 1.661 / 1.616; fp16 4 x 16 x 4096 0.8443 / 0.8001, 2 x 16 x 8192 1.723 / 1.588. But
# 8 x 16 x 2048 0.4522 / 0.4900 (three stages), causal calls mixed (4096 0.4673 / 0.4729, 8192
# 0.8806 / 0.8619, 16k 1.619 / 1.678) and the running max (training's forward, whose build
# spills 48 bytes with three) slower: 4 x 16 x 4096 0.8328 / 0.9239, 16k 3.352 / 3.590, the
# cross shape 0.7825 / 0.9092. Two consumers there. Packed sequences without the band too
# (the varlen mix, 5 rounds, ..._fwd-d128-three-varlen-ab_9730d4e-wip.txt: 3.322 / 3.160;
# causal 1.802 / 1.739, but causal keeps two as equal lengths do).
HOPPER_CONFIGS_LONG = {64: Config(3, 128, 4, 1, 160, 24, 0, q_bufs=2, dynamic=1, pingpong=1,
                                  chain=1),
                       128: Config(3, 64, 4, 1, 160, 24, 0, q_bufs=2, dynamic=1, pingpong=1,
                                   chain=1)}
LONG_KEYS_D128 = 4096


# A query row costs three consumers this much of what it costs two at d64 without the causal
# band (H200, bf16, b1 h32 16k, where the busiest program runs 4032 rows against 4096: 490.6
# against 457.0 TFLOPS on 2026-11-23, 0.946; 511.1 against 458.4 on 2026-11-24, 0.911).
# With it, the rows of the busiest program decide (_rows_per_program; H200, bf16, 3 rounds,
# benchmarks/results/2026-11-24_h200_hopper-fwd-consumers-ab_91b57b8-wip.jsonl, TFLOPS two /
# three consumers): b2 h16 8192 queries x 1024 keys 396.6 / 426.3 (three: 1964 weighed rows
# against 2048), b16 h32 1024 415.0 / 403.7 (two: 4285 against 4096), b8 h32 2048 442.1 /
# 458.0, b4 h32 4096 454.3 / 481.1, b1 h32 16k 458.4 / 511.1 (three), b4 h8 4096 454.6 / 454.5
# and b1 h16 4096 x 15360 466.2 / 469.3 (two: 536 against 512, level).
THREE_ROW_COST = 0.93
# ... from LONG_KEYS keys on, with chained tiles (Config.chain): H200, bf16 / fp16, both configs
# chained, 5 rounds (benchmarks/results/2026-11-25_h200_fwd-consumers-chain-ab_564391e.jsonl),
# a row's cost with three consumers against two came out 0.85-0.91 from 2048 keys (fp16 b4 h8
# 4096: 452.6 against 435.5 TFLOPS, bf16 b1 h16 4096 x 15360 477.9 against 456.0, both two
# by the rule above) and 0.92 at 1024 (b16 h32: 402.8 against 415.0).
THREE_ROW_COST_LONG = 0.86


def default_config(head_dim_padded: int, seqlen_k: int, causal: bool = False,
                   tiles: tuple[int, int, int] | None = None, three_ok: bool = False) -> Config:
    """The config the kernel runs for a padded head dim and (longest) key length (plain
    attention; hopper_args passes 0 keys for the variants). ``tiles``: (batch x heads,
    seqlen_q, persistent programs) of a plain call whose programs take the tiles round robin
    (no causal band, no packed sequences): three consumers at d64 where the rows the busiest
    program runs, weighed by THREE_ROW_COST (THREE_ROW_COST_LONG from LONG_KEYS keys), are
    fewer than with two; else by the key count
    (LONG_KEYS, LONG_KEYS_CAUSAL). d128: three only where ``three_ok`` (hopper_args: the call
    runs the frozen max, :data:`FROZEN_MAX`, and v's head dim pads as q's) and without the
    band, from LONG_KEYS_D128 keys: plain calls by the rows weighed by THREE_ROW_COST_LONG,
    packed sequences by their longest one's keys."""
    long = HOPPER_CONFIGS_LONG.get(head_dim_padded)
    if long is None:
        return HOPPER_CONFIGS[head_dim_padded]
    if head_dim_padded == 128:  # (calls without the band only: LONG_KEYS_D128)
        three = (three_ok and not causal and seqlen_k >= LONG_KEYS_D128
                 and (tiles is None  # (packed sequences, by their longest one's keys)
                      or _rows_per_program(3 * SUB_M, *tiles) * THREE_ROW_COST_LONG
                      < _rows_per_program(2 * SUB_M, *tiles)))  # fmt: skip
    elif tiles is not None:
        cost = THREE_ROW_COST_LONG if seqlen_k >= LONG_KEYS else THREE_ROW_COST
        three = (_rows_per_program(3 * SUB_M, *tiles) * cost
                 < _rows_per_program(2 * SUB_M, *tiles))  # fmt: skip
    else:
        three = seqlen_k >= (LONG_KEYS_CAUSAL if causal else LONG_KEYS)
    return long if three else HOPPER_CONFIGS[head_dim_padded]


def _rows_per_program(tile_rows: int, batch_heads: int, seqlen_q: int, programs: int) -> int:
    """Query rows (padded to whole tiles) the busiest of ``programs`` persistent programs
    runs when they take tiles of ``tile_rows`` round robin."""
    return cdiv(cdiv(seqlen_q, tile_rows) * batch_heads, programs) * tile_rows


# --------------------------------------------------------------------------------------------
# Device code
# --------------------------------------------------------------------------------------------
@gluon.jit
def _tile(t, num_m, heads, kv_group, TILES, tile_group, CAUSAL: gl.constexpr,
          VARLEN: gl.constexpr):
    """(query tile, batch, head, kv head) of work item ``t``. Tiles of one (batch, head) are
    consecutive, so programs running at once share its K/V in L2; causal: the heaviest
    tiles (last rows) of each head come first. Packed sequences (VARLEN): ``num_m`` tiles,
    listed by the host in ``TILES`` as (sequence, query tile) pairs (``tile_table``: no
    program for the tiles past a sequence's end), taken ``tile_group`` at a time for every
    head in turn (head-major within the group; the last group may be shorter)."""
    if VARLEN:
        group = t // (tile_group * heads)
        size = gl.minimum(tile_group, num_m - group * tile_group)
        r = t - group * tile_group * heads
        item = group * tile_group + r % size
        off_h = r // size
        return gl.load(TILES + 2 * item + 1), gl.load(TILES + 2 * item), off_h, off_h // kv_group
    pid_m = t % num_m
    if CAUSAL:
        pid_m = num_m - 1 - pid_m
    off_bh = t // num_m
    off_h = off_bh % heads
    return pid_m, off_bh // heads, off_h, off_h // kv_group


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
def _first_block(row0, left_offset, BLOCK_N: gl.constexpr, WINDOW: gl.constexpr):
    """The first K/V block the query rows from ``row0`` on need: with a left window (key j
    visible from query i only if j >= i + left_offset) the blocks wholly left of the first
    row's edge are skipped; else block 0."""
    lo = 0
    if WINDOW:
        lo = gl.maximum(row0 + left_offset, 0) // BLOCK_N
    return lo


@gluon.jit
def _seq(off_b, CU_Q, CU_K, seqlen_q, seqlen_k, causal_offset, VARLEN: gl.constexpr):
    """(tensor batch index, first query row, first key row, seqlen_q, seqlen_k, causal
    offset) of sequence ``off_b``. Packed sequences (VARLEN): rows [CU[b], CU[b + 1]) of a
    batch-of-one view, causal bottom-right per sequence; else batch entry b from row 0."""
    if VARLEN:
        q_start = gl.load(CU_Q + off_b)
        q_end = gl.load(CU_Q + off_b + 1)
        k_start = gl.load(CU_K + off_b)
        k_end = gl.load(CU_K + off_b + 1)
        return (0, q_start, k_start, q_end - q_start, k_end - k_start,
                (k_end - k_start) - (q_end - q_start))  # fmt: skip
    else:
        return off_b, 0, 0, seqlen_q, seqlen_k, causal_offset


@gluon.jit
def _clear_foreign_rows(v_smem, rows_left, LOADER: gl.constexpr = False):
    """Packed sequences: zero the rows of a V block from ``rows_left`` on, which belong to the
    next sequence (TMA clips only at the packed tensor's end). Their P is 0, but 0 x inf or
    NaN in P @ V would leak a neighbour's bad values into this sequence. Done in 16-row
    chunks, only for a block that runs past the sequence's end; both consumers may do it on
    the same stage at once: they write the same values, and each one's own writes precede
    its product (fence, barrier). LOADER: by the loader warp, in 8-row chunks (its 24
    registers), before it marks the stage ready (ORDER_FOREIGN_BY_LOADER)."""
    ROWS: gl.constexpr = v_smem.type.shape[0]
    if LOADER:
        CH: gl.constexpr = 8
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [1, 1], [1, 0])
    else:
        CH: gl.constexpr = 16
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    # (the loader's chunks 64 columns wide at most)
    COLS: gl.constexpr = v_smem.type.shape[1] if not LOADER else min(v_smem.type.shape[1], 64)
    if rows_left < ROWS:
        for c in gl.static_range(ROWS // CH):
            if c * CH + CH > rows_left:
                for h in gl.static_range(v_smem.type.shape[1] // COLS):
                    chunk = v_smem.slice(c * CH, CH, dim=0)
                    if COLS < v_smem.type.shape[1]:
                        chunk = chunk.slice(h * COLS, COLS, dim=1)
                    v = chunk.load(layout)
                    r = c * CH + gl.arange(0, CH, layout=gl.SliceLayout(1, layout))
                    chunk.store(gl.where((r < rows_left)[:, None], v, gl.zeros_like(v)))
        fence_async_shared()
        gl.thread_barrier()


@gluon.jit
def _tanh(x):
    """tanh by the hardware's ``tanh.approx.f32`` (one MUFU instruction, relative error about
    2^-11: the inputs here are fp16/bf16/fp8, whose scores carry more rounding than that), as
    the portable kernels compute it on a GPU for 16-bit inputs (portable._tanh); the backward
    recomputes the scores with this same function. (It was 1 - 2 / (2^(2 x log2(e)) + 1):
    an exp2 and a division, two MUFU instructions and their fix-ups per score, where the
    softmax has one.)"""
    return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=gl.float32,
                                     is_pure=True, pack=1)


@gluon.jit
def _tile2d(bufs, i):
    """Stage ``i`` of a ring of (1, 1, rows, dim) TMA blocks, as a (rows, dim) operand."""
    return bufs.index(i).reshape([bufs.type.shape[3], bufs.type.shape[4]])


@gluon.jit
def _issue_s(q_smem, k_t, zero, D: gl.constexpr, IMPRECISE: gl.constexpr,
             HALVES: gl.constexpr):
    """Issue S = Q K^T (asynchronous); returns two tokens. HALVES: two products over the
    halves of the head dim into separate accumulators, added in fp32 by :func:`_wait_s` (the
    fp8 tensor cores' reduced-precision sums then run over half the products, and nothing
    reads a product's registers before its wait); else one product (the second token is the
    first). ``zero``: S's zeros; D: the (padded) head dim."""
    if HALVES:
        t0 = warpgroup_mma(q_smem.slice(0, D // 2, dim=1), k_t.slice(0, D // 2, dim=0), zero,
                           use_acc=False, is_async=True)  # fmt: skip
        t1 = warpgroup_mma(q_smem.slice(D // 2, D // 2, dim=1), k_t.slice(D // 2, D // 2, dim=0),
                           zero, use_acc=False, is_async=True)  # fmt: skip
        return t0, t1
    else:
        t = _mma(q_smem, k_t, zero, False, IMPRECISE)
        return t, t


@gluon.jit
def _alibi_columns(s_tok, aug_q, aug_k, start_n, row0, alibi_offset, SUB_M: gl.constexpr):
    """ALIBI == 3: S += (the column term of ALiBi's split bias) / qk_scale by the tensor cores,
    one more K = 16 product (``aug_q``: the tile's sign * slope2 / qk_scale in three 16-bit
    pieces, in buffers 0 (keys left of every row's diagonal), 1 (right of it) and 2 (zeros:
    blocks across the diagonal, which take the distances); ``aug_k``: each key's column in
    the block, k-columns 0..2). So the softmax of a block on one side adds nothing per
    score: only its rows' term (_softmax_step)."""
    BLOCK_N: gl.constexpr = aug_k.type.shape[0]
    left = start_n + BLOCK_N - 1 <= row0 + alibi_offset
    right = start_n >= row0 + SUB_M - 1 + alibi_offset
    side = gl.where(left, 0, gl.where(right, 1, 2))
    return warpgroup_mma(aug_q.index(side), aug_k.permute((1, 0)), s_tok, use_acc=True,
                         is_async=True)  # fmt: skip


@gluon.jit
def _wait_s(t0, t1, q_smem, k_t, PENDING: gl.constexpr, HALVES: gl.constexpr):
    """Wait until at most PENDING asynchronous products are outstanding (S's are then done);
    S, the halves added."""
    if HALVES:
        s0, s1, _q, _k = warpgroup_mma_wait(PENDING, deps=(t0, t1, q_smem, k_t))
        return s0 + s1
    else:
        s, _q, _k = warpgroup_mma_wait(PENDING, deps=(t0, q_smem, k_t))
        return s


@gluon.jit
def _mma(a, b, acc, use_acc: gl.constexpr, IMPRECISE: gl.constexpr):
    """An asynchronous warpgroup_mma; IMPRECISE > 0: fp8 sums promoted into the fp32
    accumulator every IMPRECISE products (``max_num_imprecise_acc``), 0: the default (16-bit
    operands: fp32 sums; fp8: the tensor cores' own reduced-precision sums)."""
    if IMPRECISE > 0:
        return warpgroup_mma(a, b, acc, use_acc=use_acc, is_async=True,
                             max_num_imprecise_acc=IMPRECISE)  # fmt: skip
    else:
        return warpgroup_mma(a, b, acc, use_acc=use_acc, is_async=True)


@gluon.jit
def _p_operand(p, p_smem, dtype: gl.constexpr, p_layout: gl.constexpr, FP8: gl.constexpr):
    """P as P @ V's A operand: in registers, in the operands' dtype; fp8 (whose P comes 2^8
    times larger, _softmax_step's P_SHIFT) through shared memory (Triton 3.6 cannot keep an
    8-bit register operand alive across an asynchronous wgmma: "Unexpected bitwidth in
    WGMMAWaitGroupOp"). The caller has waited for the P @ V that read ``p_smem`` before."""
    if FP8:
        p_smem.store(p.to(dtype))
        fence_async_shared()
        gl.thread_barrier()  # every warp of the warpgroup has written its rows
        return p_smem
    else:
        return gl.convert_layout(p.to(dtype), p_layout)


@gluon.jit
def _v_operand(v_bufs, i, FP8: gl.constexpr):
    """Stage ``i`` of the V ring as P @ V's (BLOCK_N, dim) operand: fp8 holds V^T blocks
    (fp8 wgmma takes only K-major operands), read transposed."""
    if FP8:
        return _tile2d(v_bufs, i).permute((1, 0))
    else:
        return _tile2d(v_bufs, i)


@gluon.jit
def _put_tile(slot, t):
    """The loader warp tells the consumers which work item the Q buffer set it is about to
    fill belongs to (read after they wait for that Q; the loader rewrites the slot only
    after every consumer has released the buffer set)."""
    slot.store(gl.zeros([1], gl.int32, gl.BlockedLayout([1], [32], [1], [0])) + t)


@gluon.jit
def _get_tile(slot):
    """A consumer warpgroup reads the work item of the Q it has just waited for."""
    return gl.max(slot.load(gl.BlockedLayout([1], [32], [4], [0])), 0)


@gluon.jit
def _stage(g, STAGES: gl.constexpr):
    """Ring step ``g`` (>= 0) -> (stage, phase): g % STAGES and (g // STAGES) & 1, worked
    out unsigned (a mask and a shift for a power-of-two ring; signed, each took four or five
    uniform instructions per step: SASS read, 2026-11-24)."""
    u = g.to(gl.uint32)
    return (u % STAGES).to(gl.int32), ((u // STAGES) & 1).to(gl.int32)


@gluon.jit
def _loader(q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready,
            k_empty, v_empty, tile_ids, batch_heads, heads, kv_group, seqlen_q, seqlen_k,
            causal_offset, left_offset, CU_Q, CU_K, TILES, num_items, tile_group, COUNTER,
            v_raw, CAUSAL: gl.constexpr, CONSUMERS: gl.constexpr,
            WINDOW: gl.constexpr, VARLEN: gl.constexpr, FP8: gl.constexpr,
            DYNAMIC: gl.constexpr, ORDER: gl.constexpr):
    """The loader warp: for each tile of this program, each consumer's Q block (once the
    consumer has read the one before in that buffer: with two Q buffers per consumer the
    next tile's Q loads while this tile runs), then the tile's K/V blocks through the ring.
    ``it`` counts K/V blocks over the whole program: stage it % STAGES, lap it // STAGES;
    ``lap`` counts tiles: Q buffer set lap % Q_BUFS. The program's first work item is its
    program id; the next one the id plus the grid (static round robin) or (DYNAMIC) what an
    atomic counter hands out next, plus the grid. When none is left, the consumers are told
    so through the next Q buffer set's slot (item ``total``). Packed sequences with
    ORDER_FOREIGN_BY_LOADER: a block that runs past its sequence's end lands on ``v_raw``, the
    loader zeroes its V rows past the end (:func:`_clear_foreign_rows`, by this warp), and
    only then marks the stage ready, so the consumers never see the next sequence's values."""
    BLOCK_N: gl.constexpr = k_bufs.type.shape[3]
    FOREIGN: gl.constexpr = VARLEN and (ORDER & ORDER_FOREIGN_BY_LOADER) != 0
    raw_phase = 0
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    SUB_M: gl.constexpr = q_bufs.type.shape[3]
    BLOCK_M: gl.constexpr = CONSUMERS * SUB_M
    Q_BUFS: gl.constexpr = q_bufs.type.shape[0] // CONSUMERS
    num_m = gl.cdiv(seqlen_q, BLOCK_M)
    total = num_m * batch_heads
    if VARLEN:  # the host's list of tiles per head (tile_table)
        num_m = num_items
        total = num_items * heads
    # (ORDER_O_IN_V: tiles with blocks so far, whose O stores the next such tile's V loads
    # wait for)
    O_IN_V: gl.constexpr = _o_in_v(ORDER, Q_BUFS, VARLEN, FP8, v_bufs.type.shape[4],
                                   q_bufs.type.shape[4], BLOCK_N, SUB_M, STAGES, CONSUMERS)
    o_tiles = 0
    it = 0
    lap = 0
    t = gl.program_id(0)
    while t < total:
        pid_m, off_b, off_h, off_hk = _tile(t, num_m, heads, kv_group, TILES, tile_group, CAUSAL,
                                               VARLEN)
        tb, q_start, k_start, seqlen_q_t, seqlen_k_t, causal_offset_t = _seq(
            off_b, CU_Q, CU_K, seqlen_q, seqlen_k, causal_offset, VARLEN)
        row0 = pid_m * BLOCK_M
        qb = (lap % Q_BUFS) * CONSUMERS
        # A fresh mbarrier counts as having completed the phase before phase 0: the first
        # wait on an "empty" barrier passes at once.
        for c in gl.static_range(CONSUMERS):
            mbarrier.wait(q_empty.index(qb + c), ((lap // Q_BUFS) & 1) ^ 1)
        if DYNAMIC:
            _put_tile(tile_ids.index(lap % Q_BUFS), t)
        for c in gl.static_range(CONSUMERS):
            # (Packed sequences: rows past this sequence's end belong to the next one or
            # are zero-filled; the consumers neither use nor store them.)
            mbarrier.expect(q_ready.index(qb + c), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(
                q_desc, [tb, off_h, q_start + row0 + c * SUB_M, 0], q_ready.index(qb + c),
                q_bufs.index(qb + c))  # fmt: skip
        n = _num_blocks(row0, BLOCK_M, seqlen_q_t, seqlen_k_t, causal_offset_t, BLOCK_N,
                        CAUSAL)  # fmt: skip
        first = _first_block(row0, left_offset, BLOCK_N, WINDOW)
        for j in range(first, n):
            s, phase = _stage(it, STAGES)
            phase ^= 1
            # K and V stages are freed separately (K after S = QK^T, V after O += PV).
            mbarrier.wait(k_empty.index(s), phase)
            mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [tb, off_hk, k_start + j * BLOCK_N, 0],
                                            k_ready.index(s), k_bufs.index(s))  # fmt: skip
            if O_IN_V:
                if (j == first) & (o_tiles > 0):  # the tile before's O stores
                    mbarrier.wait(_o_stored(q_empty), (o_tiles - 1) & 1)
            mbarrier.wait(v_empty.index(s), phase)
            rows_left = seqlen_k_t - j * BLOCK_N  # (FOREIGN: the block's rows in its sequence)
            if FOREIGN and rows_left < BLOCK_N:  # (the sequence's last block: cleared here)
                mbarrier.expect(v_raw.index(0), v_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(v_desc, [tb, off_hk, k_start + j * BLOCK_N, 0],
                                                v_raw.index(0), v_bufs.index(s))  # fmt: skip
                mbarrier.wait(v_raw.index(0), raw_phase)
                raw_phase ^= 1
                _clear_foreign_rows(_tile2d(v_bufs, s), rows_left, True)
                mbarrier.arrive(v_ready.index(s))
            else:
                mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
                if FP8:  # V^T: (batch, kv heads, dim, seqlen) blocks of (dim, BLOCK_N)
                    tma.async_copy_global_to_shared(
                        v_desc, [tb, off_hk, 0, k_start + j * BLOCK_N], v_ready.index(s),
                        v_bufs.index(s))  # fmt: skip
                else:
                    tma.async_copy_global_to_shared(
                        v_desc, [tb, off_hk, k_start + j * BLOCK_N, 0], v_ready.index(s),
                        v_bufs.index(s))  # fmt: skip
            it += 1
        if O_IN_V:
            o_tiles += (n > first).to(gl.int32)
        lap += 1
        if DYNAMIC:
            t = gl.atomic_add(COUNTER, 1) + gl.num_programs(0)
        else:
            t += gl.num_programs(0)
    if DYNAMIC:
        qb = (lap % Q_BUFS) * CONSUMERS
        for c in gl.static_range(CONSUMERS):
            mbarrier.wait(q_empty.index(qb + c), ((lap // Q_BUFS) & 1) ^ 1)
        _put_tile(tile_ids.index(lap % Q_BUFS), total)
        for c in gl.static_range(CONSUMERS):
            mbarrier.arrive(q_ready.index(qb + c))  # no bytes: "nothing left"


# The kernel's ORDER flags (Config.pin, Config.pingpong): how the consumers' waits and
# product issues are ordered (see _consumer and _pingpong).
ORDER_PIN = gl.constexpr(1)
ORDER_PINGPONG = gl.constexpr(2)
ORDER_PIN_GLOBAL = gl.constexpr(4)
ORDER_LAZY = gl.constexpr(8)
ORDER_CHAIN = gl.constexpr(16)  # Config.chain
# DEFER_O_STORE: a tile's O leaves through its Q buffer by a TMA store; the consumer waits for
# that store to have read the buffer (and hands the buffer back to the loader) only once the
# next tile's first block is under way, not before it starts the next tile. Two Q buffers per
# consumer only: with one, the next tile's Q would wait for the buffer.
ORDER_DEFER_STORE = gl.constexpr(32)
# FROZEN_MAX: each row's max is taken from a tile's first block only (FROZEN_HEADROOM above
# it), then kept: the later blocks run the fixed-max softmax (no row max, no alpha, no O
# rescale), as softcap's fixed max does.
ORDER_FROZEN = gl.constexpr(64)
FROZEN_HEADROOM = gl.constexpr(64.0)
# fp16's P: its largest finite value is 2^16 (a later score may pass the first block's max by
# 24, base 2, about 16.6 nats, before P V's operand overflows and the call is redone) and it
# keeps full precision down to 2^-14 (subnormal to 2^-24: 2^-16 of the first block's max).
FROZEN_HEADROOM_FP16 = gl.constexpr(8.0)
# ROUNDED_SUMS, with a fixed max (ORDER_FROZEN, or softcap's SOFTCAP == 2): the row sums add
# P rounded to bf16 (P V's operand, from the one conversion it takes anyway), not the fp32
# exponentials (_rounded_p: a shift and a mask a pair of scores). A fixed max leaves a row's
# largest p short of 1 (the running max's is exactly 1), so its bf16 rounding, up to 2^-9 of
# it, went into O and not into l: a nearly one-hot row came out 2^-9 of its value off, where
# PyTorch is exact. Divided by the sums of the same rounded p, O is a mean of V whose weights
# sum to 1. The frozen max's first block (a running max, its largest p a power of 2) still
# adds the fp32 exponentials: the rounded sums carry bf16's rounding into the LSE (up to 2^-9
# of l where a few keys dominate a row: 1.1e-3 to 1.5e-3 on the short packed sequences of
# test_gpu_hopper_varlen), now only where later blocks hold a row's largest scores.
ORDER_ROUNDED_SUMS = gl.constexpr(128)
ORDER_Q_REGS = gl.constexpr(256)  # Q K^T's A operand from registers (Q_IN_REGS)
ORDER_FOREIGN_BY_LOADER = gl.constexpr(512)  # FOREIGN_BY_LOADER
# O_IN_V (one Q buffer per consumer, 64-key blocks, a V stage per consumer): a tile's O is
# staged for its TMA store in V's ring, not in Q's buffer (FlashAttention-3's d256 forward).
# The consumers hand Q back once the tile's last S is done, so the next tile's Q (and first K)
# load during the last P V and the epilogue; the loader holds the next tile's V loads until
# every consumer's O store has read the ring (_o_stored). Tiles without blocks store O
# through Q's buffer, as before.
ORDER_O_IN_V = gl.constexpr(1024)
O_IN_V_BARRIER = gl.constexpr(11)  # the consumers' named barrier: all done reading V
# Config.lazy: a row's running max moves only when a block's scores pass it by more than this
# (base 2), so after the first blocks O is seldom rescaled, and a consumer whose rows all kept
# their max skips the multiplies (_rescale). P and l then reach 2^LAZY_RESCALE times their
# usual size, which 16-bit P and the fp32 sums hold; m + log2(l) is the LSE either way.
# (FlashAttention-4's conditional rescaling.) Not with fp8, whose P already uses the range.
LAZY_RESCALE = gl.constexpr(8.0)
PINGPONG_BARRIER = gl.constexpr(12)  # consumer C's named barrier: 12 + C (Triton's: low ids)


@gluon.jit
def named_barrier(ID: gl.constexpr, THREADS: gl.constexpr, ARRIVE: gl.constexpr = False):
    """Named barrier ``ID`` (Triton takes the low ids) of ``THREADS`` threads, from a
    warpgroup: ``bar.sync`` (wait for all of them) or, ARRIVE, ``bar.arrive`` (count this
    warpgroup in and go on). Shared with other partitions' warps; both Hopper kernels'."""
    ids = gl.full([1], ID, gl.int32, layout=gl.BlockedLayout([1], [32], [4], [0]))
    op: gl.constexpr = "bar.arrive" if ARRIVE else "bar.sync"
    gl.inline_asm_elementwise(f"{op} $1, {THREADS};\n\tmov.u32 $0, $1;", "=r,r", [ids],
                              dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _pingpong(C: gl.constexpr, CONSUMERS: gl.constexpr, ARRIVE: gl.constexpr):
    """FlashAttention-3's warp-scheduler barrier: consumer C waits on its named barrier
    before issuing a block's products (``bar.sync``) and, once they are issued, lets the
    next consumer issue its own (``bar.arrive`` on that one's barrier; 256 threads: the two
    warpgroups). So the consumers' products queue in turns while the other one runs its
    softmax."""
    if ARRIVE:
        named_barrier(PINGPONG_BARRIER + (C + 1) % CONSUMERS, 256, True)
    else:
        named_barrier(PINGPONG_BARRIER + C, 256)


@gluon.jit
def _pin(x, PTR, seqlen_k):
    """A store of ``x`` (the row sums) that never runs (``seqlen_k`` >= 0), for ptxas to
    order the wait for P V after it (Config.pin 2, see ORDER_PIN in _consumer): to global
    memory, so Triton adds no warpgroup barrier for it, and every element to ``PTR`` (no
    address registers)."""
    gl.store(PTR + gl.full_like(x, 0, dtype=gl.int32), x, mask=seqlen_k < 0)


@gluon.jit
def _row_sums(p):
    """Each thread's partial sums of the rows of ``p`` (a wgmma accumulator): the columns a
    thread holds are 8 j + 2 (lane % 4) + e, so summing over j and e adds only its own
    registers; shape (rows, 4), one partial per lane of the quad that shares a row. The
    running row sums stay split so (FlashAttention-4 does the same): the shuffles of a full
    row reduction, per block, are left to the epilogue (ncu against FA4, 2026-11-24)."""
    ROWS: gl.constexpr = p.shape[0]
    COLS: gl.constexpr = p.shape[1]
    return gl.sum(gl.sum(p.reshape([ROWS, COLS // 8, 4, 2]), 3), 1)


@gluon.jit
def _rounded_p(p, ROUND: gl.constexpr):
    """(P's operand, the values the row sums add): ROUND, P rounded to nearest bf16 (1) or
    fp16 (2), packed in pairs as P V takes it, and the rounded values again in fp32 (bf16:
    the high half of a pair is itself the fp32 value with its low 16 bits cleared, the low
    half shifted up; fp16: each half converted); otherwise ``p`` twice."""
    if ROUND == 1:
        return gl.inline_asm_elementwise(
            "cvt.rn.bf16x2.f32 $0, $4, $3;\n\tshl.b32 $1, $0, 16;\n\t"
            "and.b32 $2, $0, 0xffff0000;", "=r,=r,=r,r,r", [p],
            dtype=(gl.bfloat16, gl.float32), is_pure=True, pack=2)
    elif ROUND == 2:
        return gl.inline_asm_elementwise(
            "{\n\t.reg .b16 lo, hi;\n\tcvt.rn.f16x2.f32 $0, $4, $3;\n\t"
            "mov.b32 {lo, hi}, $0;\n\tcvt.f32.f16 $1, lo;\n\tcvt.f32.f16 $2, hi;\n\t}",
            "=r,=r,=r,r,r", [p], dtype=(gl.float16, gl.float32), is_pure=True, pack=2)
    else:
        return p, p


@gluon.jit
def _softmax_step(s, m_i, l_i, start_n, offs_m, row0, seqlen_k, causal_offset, left_offset,
                  qk_scale, tanh_scale, slope2, alibi_offset, need_mask,
                  CAUSAL: gl.constexpr, WINDOW: gl.constexpr, SOFTCAP: gl.constexpr,
                  ALIBI: gl.constexpr, P_SHIFT: gl.constexpr, LAZY: gl.constexpr = 0.0,
                  FIXED: gl.constexpr = False, ROUND: gl.constexpr = False):
    """Online softmax of one block of scores ``s`` (raw q.k; qk_scale > 0, so a masked -inf
    stays -inf when scaled): returns (p, m, l, alpha), where alpha = 2^(m_old - m_new)
    rescales what was accumulated before. The variants, in the portable kernel's order:
    SOFTCAP, the scores become tanh(q.k * tanh_scale) (qk_scale then carries softcap *
    log2(e)); ALIBI, they are scaled here and get -slope2 * |i + alibi_offset - j| (base 2;
    ``row0``: the first of the rows ``offs_m``); then the masks (``need_mask``: the block
    straddles the end of the keys, the causal diagonal or the left window's edge). P_SHIFT:
    the running max is kept P_SHIFT below the true one, so p (and l) come out 2^P_SHIFT times
    larger, at no cost (fp8: P's e4m3 rounding needs its small values away from underflow);
    m + log2(l) is the LSE either way. LAZY > 0: m moves only where the block's max passes
    it by more than LAZY (alpha stays 1 elsewhere; p and l grow up to 2^LAZY). SOFTCAP == 2
    (:func:`softcap_fixed_max`): the tanh bounds every score by qk_scale, so ``m_i`` is a
    fixed max set before the first block: no row max, no alpha (returned as 1), no rescale.
    ROUND (ORDER_ROUNDED_SUMS): p comes back as P V's bf16 operand; with a fixed max l sums
    its values (with the running max, the fp32 exponentials)."""
    if SOFTCAP:
        s = _tanh(s * tanh_scale)
    cols = gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, s.type.layout))
    if ALIBI:
        # A block wholly on one side of the diagonal j = i + alibi_offset (every key of it
        # left of every row's, or right of it) splits -slope2 * |i + alibi_offset - j| into a
        # column term, sign * slope2 * (j - start_n), added to the scores here, and a row term,
        # -sign * slope2 * (i + alibi_offset - start_n), added to the row's max and taken off
        # in the exponential's argument (one add per score where |distance| costs four); both
        # measured from the block's first key, small where the probabilities are not. A
        # block across the diagonal takes the distances themselves.
        BLOCK_N: gl.constexpr = s.shape[1]
        SUB_M: gl.constexpr = offs_m.shape[0]
        left = start_n + BLOCK_N - 1 <= row0 + alibi_offset
        if (ALIBI >= 2) & (left | (start_n >= row0 + SUB_M - 1 + alibi_offset)):
            sign_slope = gl.where(left, slope2, -slope2)
            if ALIBI == 2:
                # Column c = 8 (c >> 3) + (c & 7): in the wgmma layout c >> 3 is the same for
                # every thread (a constant per register) and c & 7 one of two values a
                # thread, so the column term costs an FMA per column, with no conversion
                col_hi = ((cols >> 3) << 3).to(gl.float32)
                col_lo = (cols & 7).to(gl.float32) * sign_slope
                s = s * qk_scale + (col_hi * sign_slope + col_lo)[None, :]
            # (ALIBI == 3: the column term came with S, _alibi_columns; s stays unscaled)
            row_term = (offs_m + (alibi_offset - start_n)).to(gl.float32) * -sign_slope
        elif ALIBI == 3:  # the distances, in S's unscaled units
            dist = offs_m[:, None] + (alibi_offset - start_n) - cols[None, :]
            s = s - (slope2 / qk_scale) * gl.abs(dist).to(gl.float32)
            row_term = offs_m.to(gl.float32) * 0.0
        else:
            dist = offs_m[:, None] + (alibi_offset - start_n) - cols[None, :]
            s = s * qk_scale - slope2 * gl.abs(dist).to(gl.float32)
            row_term = offs_m.to(gl.float32) * 0.0
    # ORDER_FROZEN's first block with a window: a row that sees none of the block takes its
    # max from every key of the block the band shows it, the window's left edge aside, so
    # it still has a max of its own scores (their lead over its visible ones, if any, shows
    # in its sums: _flag_rows' LOW_SUMS); a row that sees some of the block, from those
    WIDE_MAX: gl.constexpr = WINDOW and P_SHIFT < 0
    s_max = s
    if need_mask:
        # Column c of the block is key start_n + c: visible iff c <= the row's last key
        # (and, with a left window, c >= the row's first key).
        last = seqlen_k - 1 - start_n
        if CAUSAL:
            last_row = gl.minimum(offs_m + (causal_offset - start_n), last)
            keep = cols[None, :] <= last_row[:, None]
        else:
            keep = cols[None, :] <= last
        if WIDE_MAX:
            s_max = gl.where(keep, s, float("-inf"))
        if WINDOW:
            keep = keep & (cols[None, :] >= (offs_m + (left_offset - start_n))[:, None])
        s = gl.where(keep, s, float("-inf"))
    if SOFTCAP == 2 or FIXED:
        if ALIBI == 3:  # (ALiBi under the frozen max: the row term as below)
            x = s * qk_scale - (m_i - row_term)[:, None]
        elif ALIBI:
            x = s - (m_i - row_term)[:, None]
        else:
            x = s * qk_scale - m_i[:, None]
        p, terms = _rounded_p(gl.exp2(x), ROUND)
        return p, m_i, l_i + _row_sums(terms), gl.full_like(m_i, 1.0)
    s_top = gl.max(s, 1)
    if WIDE_MAX:
        s_top = gl.where(s_top == float("-inf"), gl.max(s_max, 1), s_top)
    if ALIBI == 3:  # unscaled, but for the row term (base 2, scaled)
        m_block = s_top * qk_scale + row_term - P_SHIFT
    elif ALIBI:  # already base 2 and scaled, but for the row term
        m_block = s_top + row_term - P_SHIFT
    else:
        m_block = s_top * qk_scale - P_SHIFT
    if ALIBI and P_SHIFT < 0:
        # ORDER_FROZEN's first block with ALiBi: the block's max as if its nearest key to the
        # row's diagonal c = i + alibi_offset were the nearest key the row sees (up by slope2
        # times the distances' difference), so later blocks nearer the diagonal do not pass
        # it by their smaller bias (a causal row's first block lies farthest from it). Rows
        # whose scores there fall far below it are flagged (_flag_rows' LOW_SUMS). (Not the
        # sink's logit, m_i here: it has no distance.)
        c = offs_m + alibi_offset
        last = gl.minimum(start_n + s.shape[1], seqlen_k) - 1
        d_block = gl.maximum(gl.maximum(c - last, start_n - c), 0)
        d_row = gl.maximum(gl.maximum(c - (seqlen_k - 1), -c), 0)
        m_block = m_block + slope2 * (d_block - d_row).to(gl.float32)
    m_new = gl.maximum(m_i, m_block)
    if LAZY > 0:  # (m_i = -inf: any visible key moves it)
        m_new = gl.where(m_new > m_i + LAZY, m_new, m_i)
    # A row with no visible key so far keeps m = -inf: subtract 0 instead (no NaN).
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    if ALIBI == 3:
        p = gl.exp2(s * qk_scale - (m_use - row_term)[:, None])
    elif ALIBI:
        p = gl.exp2(s - (m_use - row_term)[:, None])
    else:
        p = gl.exp2(s * qk_scale - m_use[:, None])
    alpha = gl.exp2(m_i - m_use)
    # (l_i: the per-lane partial sums of _row_sums)
    alpha_l = gl.convert_layout(alpha, gl.SliceLayout(1, l_i.type.layout))
    # ROUND here (the frozen max's first block): P's bf16 operand, but the sums of the fp32
    # exponentials, as the running max keeps them (its largest p, a power of 2, is exact in
    # bf16): a row whose keys all lie in its tile's first block keeps the running max's LSE
    l_i = l_i * alpha_l[:, None] + _row_sums(p)
    if ROUND == 1:
        p = p.to(gl.bfloat16)
    elif ROUND == 2:
        p = p.to(gl.float16)
    if P_SHIFT < 0:  # a tile's first block under ORDER_FROZEN, whose max is kept: 0 where
        m_new = m_use  # a row has no key (its later scores are -inf too: p = 0)
    return p, m_new, l_i, alpha


def _lazy_asm(pack: int) -> str:
    """PTX of one :func:`_rescale` instance: ``pack`` accumulator values ($0.., tied to their
    inputs) times their rows' alphas, skipped by a branch when the thread's flag (the first
    of ``pack`` copies) is 0. (Labels inside braces are local to the instance.)"""
    muls = "\n".join(f"mul.f32 ${i}, ${i}, ${3 * pack + i};" for i in range(pack))
    return ("{\n.reg .pred p;\n"
            f"setp.ne.u32 p, ${2 * pack}, 0;\n@!p bra LAZY_SKIP;\n{muls}\nLAZY_SKIP:\n}}")


def _lazy_constraints(pack: int) -> str:
    return ",".join(["=f"] * pack + [str(i) for i in range(pack)] + ["r"] * pack
                    + ["f"] * pack)  # fmt: skip


LAZY_PACK = gl.constexpr(64)
LAZY_ASM = gl.constexpr(_lazy_asm(LAZY_PACK.value))
LAZY_CONSTRAINTS = gl.constexpr(_lazy_constraints(LAZY_PACK.value))


@gluon.jit
def _rescale(acc, alpha):
    """acc * alpha[:, None], the multiplies skipped by every thread whose rows all kept
    their max (alpha 1: the lazy rescale's common case). Each thread of the wgmma
    accumulator layout holds two rows; its flag (either alpha not 1) goes to every value it
    holds, and a branch per LAZY_PACK values skips them (64: one or two branches a block
    at head dims 128 and 256; 4 x 16 left 9 more instructions in the d128 loop)."""
    one = gl.full(alpha.shape, 1.0, gl.float32, layout=alpha.type.layout)
    flag = (alpha != one).to(gl.int32)
    # the thread's two rows: r and r + 8 (both alphas' flags, or-ed across the pair)
    both = gl.inline_asm_elementwise("or.b32 $0, $2, $3;\n\tmov.b32 $1, $0;", "=r,=r,r,r",
                                     [flag], dtype=gl.int32, is_pure=True, pack=2)
    return gl.inline_asm_elementwise(LAZY_ASM, LAZY_CONSTRAINTS,
                                     [acc, both[:, None], alpha[:, None]], dtype=gl.float32,
                                     is_pure=True, pack=LAZY_PACK)


def _dropout_asm(transposed: bool) -> str:
    """PTX of one :func:`_dropout` instance: 8 values of a wgmma accumulator ($8..$15, the
    thread's registers 8 m .. 8 m + 7: rows r, r + 8 x columns c, c + 1, c + 8, c + 9, c a
    multiple of 16 plus twice the lane's quad index) come out as themselves where kept, 0
    where dropped ($0..$7), by portable._keep's mask. Operands per input, one per value:
    $16.. the columns' groups, $24.. the rows', $32.. bh, $40.. / $48.. the key's halves,
    $56.. the 16-bit threshold. Forward (rows are queries): the 8 values are one group,
    one Philox4x32-7 draw (counter: column c's key group, the row's query group, bh, 0);
    the value at column + 1 takes a word's high 16 bits. ``transposed`` (the backward's
    S^T: rows are keys, columns queries; $24 = key group * 2 + the key's parity): two
    draws, one per query parity (columns c + e, c + e + 8), each giving the thread 4 of its
    8 values, the key's parity picking the 16 bits; a dropped value comes out negated, not
    0 (the values are probabilities, >= 0: the sign carries the mask without a register
    more; see hopper_bwd's consumer). Register k's bits: column + 1, row + 8,
    column + 8 (``test_dropout_layout_is_the_asms``)."""
    lines = ["{", ".reg .b32 c<4>, k0, k1, lo, hi, t, t16, x, sh;", ".reg .f32 nx;",
             ".reg .b64 w;",
             ".reg .pred q;", "mov.b32 t, $56;", "shl.b32 t16, t, 16;"]
    if transposed:
        lines += ["and.b32 sh, $24, 1;", "shl.b32 sh, sh, 4;"]
    for e in ((0, 1) if transposed else (0,)):
        if transposed:  # key group from the rows, query group from column c + e
            lines += ["shr.b32 c0, $24, 1;", f"mov.b32 c1, ${16 + e};"]
        else:
            lines += ["mov.b32 c0, $16;", "mov.b32 c1, $24;"]
        lines += ["mov.b32 c2, $32;", "mov.b32 c3, 0;", "mov.b32 k0, $40;", "mov.b32 k1, $48;"]
        for r in range(7):
            lines += ["mul.wide.u32 w, c2, 0xCD9E8D57;", "mov.b64 {lo, hi}, w;",
                      "mov.b32 c2, c0;",  # (c0 kept in c2 until its product)
                      "xor.b32 c0, hi, c1;", "xor.b32 c0, c0, k0;", "mov.b32 c1, lo;",
                      "mul.wide.u32 w, c2, 0xD2511F53;", "mov.b64 {lo, hi}, w;",
                      "xor.b32 c2, hi, c3;", "xor.b32 c2, c2, k1;", "mov.b32 c3, lo;"]
            if r < 6:
                lines += ["add.u32 k0, k0, 0x9E3779B9;", "add.u32 k1, k1, 0xBB67AE85;"]
        for k in range(8):
            col1, row8, col8 = k & 1, (k >> 1) & 1, (k >> 2) & 1
            if transposed:
                if col1 != e:
                    continue
                word = f"c{2 * col8 + row8}"  # (query's bit 3, key's)
                lines += [f"bfe.u32 x, {word}, sh, 16;", "setp.hs.u32 q, x, t;"]
            else:
                word = f"c{2 * row8 + col8}"
                if col1:  # the high 16 bits: compare the word with t << 16
                    lines += [f"setp.hs.u32 q, {word}, t16;"]
                else:  # the low 16 bits (a mask, not a shift: ptxas runs a shift as an
                    # IMAD, on the pipe the Philox multiplies load)
                    lines += [f"and.b32 x, {word}, 65535;", "setp.hs.u32 q, x, t;"]
            if transposed:  # dropped: the value negated (the backward's sign-coded mask)
                lines += [f"neg.f32 nx, ${8 + k};", f"selp.f32 ${k}, ${8 + k}, nx, q;"]
            else:
                lines += [f"selp.f32 ${k}, ${8 + k}, 0f00000000, q;"]
    return "\n".join(lines + ["}"])


DROPOUT_ASM = gl.constexpr(_dropout_asm(False))
DROPOUT_ASM_T = gl.constexpr(_dropout_asm(True))
DROPOUT_CONSTRAINTS = gl.constexpr(",".join(["=f"] * 8 + ["f"] * 8 + ["r"] * 48))


@gluon.jit
def _query_group(i):
    """A query position's dropout group (portable._keep): i and i + 8 (bit 3) share one."""
    return ((i >> 4) << 3) | (i & 7)


@gluon.jit
def _key_group(j):
    """A key position's dropout group (portable._keep): j, j + 1, j + 8, j + 9 (j even,
    bit 3 clear) share one."""
    return ((j >> 4) << 2) | ((j >> 1) & 3)


@gluon.jit
def _dropout(x, row_groups, col0, bh, seed, thresh, TRANSPOSED: gl.constexpr):
    """``x`` (a wgmma accumulator block) with the dropped pairs zeroed (TRANSPOSED: negated,
    for x >= 0 a sign-coded mask): portable._keep's mask
    (the same bits), drawn once per group of pairs a thread holds. ``row_groups`` (in
    SliceLayout(1, x's layout)): the rows' :func:`_query_group`, or with TRANSPOSED (rows
    are keys, columns queries: the backward's S^T) their :func:`_key_group` * 2 + the key's
    parity; ``col0``: the block's first column's position (a multiple of 16); ``bh``:
    (batch, query head); ``seed`` the call's key (portable.dropout_key), ``thresh`` its
    16-bit threshold (portable.dropout_threshold)."""
    cols = col0 + gl.arange(0, x.shape[1], layout=gl.SliceLayout(0, x.type.layout))
    zero = gl.zeros_like(x, dtype=gl.int32)
    if TRANSPOSED:
        col_groups = zero + _query_group(cols)[None, :]
    else:
        col_groups = zero + _key_group(cols)[None, :]
    rows = zero + row_groups[:, None]
    k0 = zero + (seed & 0xFFFFFFFF).to(gl.int32)
    k1 = zero + (seed >> 32).to(gl.int32)
    asm: gl.constexpr = DROPOUT_ASM_T if TRANSPOSED else DROPOUT_ASM
    return gl.inline_asm_elementwise(asm, DROPOUT_CONSTRAINTS,
                                     [x, col_groups, rows, zero + bh, k0, k1, zero + thresh],
                                     dtype=gl.float32, is_pure=True, pack=8)


@gluon.jit
def _tile_state(t, num_m, heads, kv_group, batch_heads, seqlen_q, seqlen_k, causal_offset,
                left_offset, qk_scale, SLOPES, stride_slopes_b, SINK_LOGITS, CU_Q, CU_K, TILES,
                tile_group, DESCALE, lap, aug_q, dtype: gl.constexpr,
                s_layout: gl.constexpr, CAUSAL: gl.constexpr, CONSUMERS: gl.constexpr,
                WINDOW: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr,
                SINKS: gl.constexpr, VARLEN: gl.constexpr, FP8: gl.constexpr, C: gl.constexpr,
                Q_BUFS: gl.constexpr, P_SHIFT: gl.constexpr, SUB_M: gl.constexpr,
                BLOCK_N: gl.constexpr):
    """What consumer C needs of work item ``t`` (< ``total``; the chained tail passes the
    last item for "none left", so that every load stays in bounds): (its Q
    buffer, batch, head, kv head, first query row of the sequence, the sequence's lengths and
    causal offset, the consumer's first row, the tile's K/V blocks [lo, n), the first
    blocks that straddle the causal diagonal or the end of the keys and the window's left
    edge, the running max and row sums to start from, ALiBi's slope, the scores' scale, V's
    descale). ALIBI == 3: also writes the slope's pieces into ``aug_q`` (_alibi_columns),
    which no product in flight may be reading."""
    BLOCK_M: gl.constexpr = CONSUMERS * SUB_M
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    qb = (lap % Q_BUFS) * CONSUMERS + C  # this tile's Q buffer
    pid_m, off_b, off_h, off_hk = _tile(t, num_m, heads, kv_group, TILES, tile_group, CAUSAL,
                                        VARLEN)  # fmt: skip
    tb, q_start, k_start, seqlen_q_t, seqlen_k_t, causal_offset_t = _seq(
        off_b, CU_Q, CU_K, seqlen_q, seqlen_k, causal_offset, VARLEN)
    row0 = pid_m * BLOCK_M + C * SUB_M
    offs_m = row0 + gl.arange(0, SUB_M, layout=row_layout)
    # Every consumer walks all the blocks the program loads for the tile; blocks wholly
    # above this consumer's diagonal come out masked (p = 0).
    n = _num_blocks(pid_m * BLOCK_M, BLOCK_M, seqlen_q_t, seqlen_k_t, causal_offset_t, BLOCK_N,
                    CAUSAL)  # fmt: skip
    lo = _first_block(pid_m * BLOCK_M, left_offset, BLOCK_N, WINDOW)
    # Blocks from `first_masked` on straddle the causal diagonal or the end of the keys;
    # with a left window, blocks that start left of this consumer's last row's first key
    # straddle the window's edge (`left_masked`: blocks before it).
    first_masked = seqlen_k_t // BLOCK_N
    if CAUSAL:
        first_masked = gl.minimum(first_masked,
                                  gl.maximum(row0 + causal_offset_t + 1, 0) // BLOCK_N)
    left_masked = 0
    if WINDOW:
        left_masked = gl.cdiv(gl.maximum(row0 + SUB_M - 1 + left_offset, 0), BLOCK_N)
    m_i = gl.full([SUB_M], float("-inf"), gl.float32, layout=row_layout)
    if SOFTCAP == 2:  # softcap bounds the scores by qk_scale (softcap_fixed_max)
        m_i = gl.full([SUB_M], 0.0, gl.float32, layout=row_layout) + (
            qk_scale - SOFTCAP_HEADROOM)
    # the row sums as per-lane partials (_row_sums), added up in the epilogue
    l_i = _row_sums(gl.zeros([SUB_M, BLOCK_N], gl.float32, s_layout))
    if SINKS:  # the head's sink logit joins every row's denominator (it has no value)
        sink2 = gl.load(SINK_LOGITS + off_h).to(gl.float32) * 1.4426950408889634
        m_i = gl.zeros([SUB_M], gl.float32, layout=row_layout) + sink2
        m_i -= P_SHIFT
        l_i += 2.0**P_SHIFT / 4  # (a quarter per partial: the sum is exact)
    slope2 = 0.0
    if ALIBI:  # the (sequence, head)'s slope times log2(e)
        slope2 = gl.load(SLOPES + off_b * stride_slopes_b + off_h) * 1.4426950408889634
    if ALIBI == 3:  # slope2 / qk_scale in three 16-bit pieces, + and - (_alibi_columns)
        AUG_K: gl.constexpr = aug_q.type.shape[2]
        aug_layout: gl.constexpr = gl.BlockedLayout([1, AUG_K], [32, 1], [4, 1], [1, 0])
        aug_col = gl.arange(0, AUG_K, layout=gl.SliceLayout(0, aug_layout))
        ratio = slope2 / qk_scale
        hi = ratio.to(dtype).to(gl.float32)
        mid = (ratio - hi).to(dtype).to(gl.float32)
        rest = ratio - hi - mid
        piece = gl.where(aug_col == 0, hi, gl.where(aug_col == 1, mid,
                                                    gl.where(aug_col == 2, rest, 0.0)))
        pieces = gl.zeros([SUB_M, AUG_K], gl.float32, aug_layout) + piece[None, :]
        aug_q.index(0).store(pieces.to(dtype))
        aug_q.index(1).store((-pieces).to(dtype))
        fence_async_shared()
        gl.thread_barrier()  # every warp of the warpgroup has written its rows
    qk_scale_t = qk_scale
    v_descale = 1.0
    if FP8:  # the (batch, kv head)'s descales: Q's times K's, then V's (checks.py)
        ds = off_b * (heads // kv_group) + off_hk
        qk_scale_t = qk_scale * gl.load(DESCALE + ds)
        v_descale = gl.load(DESCALE + batch_heads // kv_group + ds)
    return (qb, off_b, off_h, q_start, seqlen_q_t, seqlen_k_t, causal_offset_t, row0, offs_m, n,
            lo, first_masked, left_masked, m_i, l_i, slope2, qk_scale_t, v_descale)


@gluon.jit
def _epilogue(acc, m_i, l_i, stage, o_desc, LSE, O, off_b, off_h, heads, q_start, row0,
              offs_m,
              seqlen_q_t, total_q, head_dim, stride_ob, stride_os, stride_oh, v_descale,
              dropout_keep, row_layout: gl.constexpr, orow_layout: gl.constexpr,
              o_layout: gl.constexpr, VARLEN: gl.constexpr, FP8: gl.constexpr,
              DROPOUT: gl.constexpr, DEFER: gl.constexpr = False):
    """O / l by TMA through ``stage`` (this consumer's Q buffer, every S of the tile done, or
    with ORDER_O_IN_V a V stage), which clips rows past seqlen_q and columns past the head
    dim; LSE (base 2) per row. The caller then lets the loader bring a later tile's Q (V) into
    the buffer; with DEFER it first waits for the store itself (:func:`_release_q`), later."""
    SUB_M: gl.constexpr = stage.type.shape[2]
    HEAD_DIM: gl.constexpr = stage.type.shape[3]
    HEAD_DIM_V: gl.constexpr = acc.shape[1]
    dtype: gl.constexpr = stage.dtype
    q_smem = stage.reshape([SUB_M, HEAD_DIM])
    l_i = gl.convert_layout(gl.sum(l_i, 1), row_layout)
    empty = l_i == 0.0
    lse2 = gl.where(empty, float("-inf"), m_i + gl.log2(l_i))
    l_o = gl.convert_layout(gl.where(empty, 1.0, l_i), orow_layout)
    if DROPOUT:  # the kept probabilities' 1 / (1 - dropout_p)
        l_o = l_o * dropout_keep
    if VARLEN:
        # (heads, total_q) LSE. O: a TMA store would also write the rows past this
        # sequence's end, which are the next sequence's; so a consumer whose 64 rows all
        # lie in the sequence stores them by TMA (VARLEN == 2: VARLEN_O_TMA), and the
        # last rows of a sequence go by a masked store.
        gl.store(LSE + off_h.to(gl.int64) * total_q + q_start + offs_m, lse2,
                 mask=offs_m < seqlen_q_t)  # fmt: skip
        if VARLEN == 2 and HEAD_DIM_V == HEAD_DIM and row0 + SUB_M <= seqlen_q_t:
            q_smem.store((acc / l_o[:, None]).to(dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(o_desc, [0, off_h, q_start + row0, 0], stage)
            if not DEFER:
                tma.store_wait(0)
        else:
            rows = row0 + gl.arange(0, SUB_M, layout=orow_layout)
            cols = gl.arange(0, HEAD_DIM_V, layout=gl.SliceLayout(0, o_layout))
            o_ptrs = (O + (q_start + rows).to(gl.int64)[:, None] * stride_os
                      + off_h * stride_oh + cols[None, :])  # fmt: skip
            gl.store(o_ptrs, (acc / l_o[:, None]).to(dtype),
                     mask=(rows < seqlen_q_t)[:, None] & (cols < head_dim)[None, :])
    else:
        off_bh = off_b.to(gl.int64) * heads + off_h
        gl.store(LSE + off_bh * seqlen_q_t + offs_m, lse2, mask=offs_m < seqlen_q_t)
        if FP8:
            # bf16 O by a masked store (Q's fp8 buffer is half its size), with V's
            # descale (P's 2^8 is in l)
            rows = row0 + gl.arange(0, SUB_M, layout=orow_layout)
            cols = gl.arange(0, HEAD_DIM_V, layout=gl.SliceLayout(0, o_layout))
            o_ptrs = (O + off_b.to(gl.int64) * stride_ob + rows.to(gl.int64)[:, None]
                      * stride_os + off_h * stride_oh + cols[None, :])  # fmt: skip
            o_scale = v_descale
            gl.store(o_ptrs, (acc * (o_scale / l_o)[:, None]).to(O.dtype.element_ty),
                     mask=(rows < seqlen_q_t)[:, None] & (cols < head_dim)[None, :])
        elif HEAD_DIM_V == HEAD_DIM:
            q_smem.store((acc / l_o[:, None]).to(dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(o_desc, [off_b, off_h, row0, 0], stage)
        else:  # a smaller value head dim: O's tile in the front of Q's buffer
            o_smem = stage._reinterpret(dtype, o_desc.block_type.shape, o_desc.layout)
            o_smem.reshape([SUB_M, HEAD_DIM_V]).store((acc / l_o[:, None]).to(dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(o_desc, [off_b, off_h, row0, 0], o_smem)
        if not DEFER:
            tma.store_wait(0)


@gluon.jit
def _flag_rows(acc, l_i, offs_m, seqlen_q_t, seqlen_k_t, causal_offset_t, left_offset, FLAG,
               orow_layout: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
               LOW_SUMS: gl.constexpr):
    """ORDER_FROZEN: sets FLAG where a row of the tile (below ``seqlen_q_t``) has a row sum or
    an output that is not finite (a later block's scores passed the first block's max by
    more than the headroom allows, or P V overflowed), so the call runs again without the
    frozen max (its second launch). (An output row whose sum overflows a finite fp32 flags
    too: a needless second run, still right.) LOW_SUMS (ALiBi or a window, whose frozen max
    may lie far above a row's scores): also a row that sees a key (one of keys 0 ..
    seqlen_k_t - 1 within its band) and whose sum came out below seqlen_k_t x 2^-114: the
    exponentials flush p below 2^-126 to 0 (ex2.approx.ftz), at most seqlen_k_t x 2^-126 of
    the row's mass, so a row above the bound has lost at most 2^-12 of its sum (bf16's own
    rounding is 2^-9; with bf16's 64 of headroom a row's largest p is near 2^-64)."""
    l = gl.convert_layout(gl.sum(l_i, 1), orow_layout)
    o = gl.sum(acc, 1)
    bad = (o * 0.0 + l * 0.0) != 0.0  # inf * 0 and NaN are NaN
    rows = gl.convert_layout(offs_m, orow_layout)
    if LOW_SUMS:
        first = rows * 0
        if WINDOW:
            first = gl.maximum(rows + left_offset, 0)
        last = rows * 0 + seqlen_k_t - 1
        if CAUSAL:
            last = gl.minimum(rows + causal_offset_t, last)
        low = l < (seqlen_k_t * 1.0) * 4.81482486096809e-35  # (2^-114)
        bad = bad | (low & (first <= last))
    gl.store(FLAG + rows * 0, 1, mask=bad & (rows < seqlen_q_t))


@gluon.jit
def _release_q(q_empty, pend):
    """DEFER_O_STORE: once the TMA store of the tile before has read Q buffer ``pend`` (its
    O), the buffer goes back to the loader; -1: none pending. Returns -1."""
    if pend >= 0:
        tma.store_wait(0)
        mbarrier.arrive(q_empty.index(pend))
    return -1


@gluon.constexpr_function
def _o_in_v(order, q_bufs, varlen, fp8, head_dim_v, head_dim, block_n, sub_m, stages,
            consumers):
    """Whether the kernel runs ORDER_O_IN_V (the loader and the consumers decide alike): the
    flag, one Q buffer per consumer (so no chained tiles), neither packed sequences nor fp8,
    V's head dim Q's, and V stages of 64 x d, one per consumer at least."""
    return bool(order & ORDER_O_IN_V.value and q_bufs == 1 and not varlen and not fp8
                and head_dim_v == head_dim and block_n == sub_m and stages >= consumers)


@gluon.jit
def _o_stored(q_empty):
    """ORDER_O_IN_V: q_empty's last barrier, one arrival per consumer once its O store has
    read V's ring (the loader waits for it before the next tile's V loads)."""
    return q_empty.index(q_empty.type.shape[0] - 1)


@gluon.jit
def _open_tile(q_bufs, k_bufs, k_ready, k_empty, aug_q, aug_k, qb, g, lo, row0, offs_m, m_i, l_i,
               seqlen_k_t, causal_offset_t, left_offset, qk_scale_t, tanh_scale, slope2,
               alibi_offset, first_masked, left_masked, drop_bh, dropout_seed, dropout_thresh,
               s_layout: gl.constexpr, CONSUMERS: gl.constexpr, C: gl.constexpr,
               CAUSAL: gl.constexpr, WINDOW: gl.constexpr, SOFTCAP: gl.constexpr,
               ALIBI: gl.constexpr, DROPOUT: gl.constexpr, ORDER: gl.constexpr,
               P_SHIFT: gl.constexpr, LAZY: gl.constexpr, QK_IMPRECISE: gl.constexpr,
               QK_HALVES: gl.constexpr, ROUND: gl.constexpr = False):
    """A tile's first K/V block (``lo``, ring step ``g``), whose Q the caller has waited for:
    S, then its softmax; returns (p, m, l)."""
    SUB_M: gl.constexpr = q_bufs.type.shape[3]
    HEAD_DIM: gl.constexpr = q_bufs.type.shape[4]
    BLOCK_N: gl.constexpr = k_bufs.type.shape[3]
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    q_smem = q_bufs.index(qb).reshape([SUB_M, HEAD_DIM])
    s_idx, phase = _stage(g, STAGES)
    mbarrier.wait(k_ready.index(s_idx), phase)
    k_t = _tile2d(k_bufs, s_idx).permute((1, 0))
    if ORDER & ORDER_PINGPONG:
        _pingpong(C, CONSUMERS, False)
    s_tok, s_tok2 = _issue_s(q_smem, k_t, gl.zeros([SUB_M, BLOCK_N], gl.float32, s_layout),
                             HEAD_DIM, QK_IMPRECISE, QK_HALVES)  # fmt: skip
    if ALIBI == 3:
        s_tok = _alibi_columns(s_tok, aug_q, aug_k, lo * BLOCK_N, row0, alibi_offset, SUB_M)
        s_tok2 = s_tok
    if ORDER & ORDER_PINGPONG:
        _pingpong(C, CONSUMERS, True)
    s = _wait_s(s_tok, s_tok2, q_smem, k_t, 0, QK_HALVES)
    mbarrier.arrive(k_empty.index(s_idx))  # K_lo is no longer read
    p, m_i, l_i, alpha = _softmax_step(
        s, m_i, l_i, lo * BLOCK_N, offs_m, row0, seqlen_k_t, causal_offset_t, left_offset,
        qk_scale_t, tanh_scale, slope2, alibi_offset,
        (lo >= first_masked) | (lo < left_masked), CAUSAL, WINDOW, SOFTCAP, ALIBI, P_SHIFT, LAZY,
        False, ROUND)
    if DROPOUT:  # (the row sums l keep every probability; P V only the kept ones)
        p = _dropout(p, _query_group(offs_m), lo * BLOCK_N, drop_bh, dropout_seed,
                     dropout_thresh, False)  # fmt: skip
    return p, m_i, l_i


@gluon.jit
def _close_tile(v_bufs, v_ready, v_empty, p, p16, p_smem, acc, g, n, seqlen_k_t,
                p_layout: gl.constexpr, CONSUMERS: gl.constexpr, C: gl.constexpr,
                VARLEN: gl.constexpr, FP8: gl.constexpr, ORDER: gl.constexpr,
                LATE_P: gl.constexpr, PV_IMPRECISE: gl.constexpr):
    """A tile's last P V (block ``n`` - 1, ring step ``g``; ``p16`` its operand, or with
    LATE_P made here from ``p``); returns O."""
    BLOCK_N: gl.constexpr = v_bufs.type.shape[3] if not FP8 else v_bufs.type.shape[4]
    STAGES: gl.constexpr = v_bufs.type.shape[0]
    last, phase = _stage(g, STAGES)
    mbarrier.wait(v_ready.index(last), phase)
    v_smem = _v_operand(v_bufs, last, FP8)
    if VARLEN and not (ORDER & ORDER_FOREIGN_BY_LOADER):
        _clear_foreign_rows(v_smem, seqlen_k_t - (n - 1) * BLOCK_N)
    if LATE_P:
        p16 = _p_operand(p, p_smem, v_bufs.dtype, p_layout, FP8)
    if ORDER & ORDER_PINGPONG:
        _pingpong(C, CONSUMERS, False)
    acc_tok = _mma(p16, v_smem, acc, True, PV_IMPRECISE)
    if ORDER & ORDER_PINGPONG:
        _pingpong(C, CONSUMERS, True)
    acc, _p, _vs = warpgroup_mma_wait(0, deps=(acc_tok, p16, v_smem))
    mbarrier.arrive(v_empty.index(last))
    return acc


@gluon.jit
def _consumer(o_desc, LSE, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready,
              k_empty, v_empty,
              tile_ids, batch_heads, heads, kv_group, seqlen_q, seqlen_k, causal_offset,
              qk_scale, left_offset, tanh_scale, SLOPES, stride_slopes_b, alibi_offset,
              SINK_LOGITS, CU_Q, CU_K, TILES, num_items, tile_group, O, stride_ob,
              stride_os, stride_oh, DESCALE, FLAG, total_q, head_dim,
              dropout_seed, dropout_thresh, dropout_keep,
              CAUSAL: gl.constexpr, CONSUMERS: gl.constexpr, WINDOW: gl.constexpr,
              SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, SINKS: gl.constexpr,
              VARLEN: gl.constexpr, FP8: gl.constexpr, ORDER: gl.constexpr, DYNAMIC: gl.constexpr,
              C: gl.constexpr, DROPOUT: gl.constexpr):
    """Consumer warpgroup C: query rows [C * 64, C * 64 + 64) of each of the program's
    tiles. CHAIN (ORDER_CHAIN: Config.chain, two Q buffers, the static round robin): the
    next tile's first S is issued with this tile's last P V and its softmax runs while that
    product does, as inside a tile, instead of after this tile's epilogue (a tile of n
    blocks otherwise spends one block's softmax with no product of its own in flight)."""
    BLOCK_N: gl.constexpr = k_bufs.type.shape[3]
    HEAD_DIM: gl.constexpr = k_bufs.type.shape[4]
    # the value / output head dim (padded); fp8 V blocks are V^T's, (dim, BLOCK_N)
    HEAD_DIM_V: gl.constexpr = v_bufs.type.shape[3] if FP8 else v_bufs.type.shape[4]
    SUB_M: gl.constexpr = q_bufs.type.shape[3]
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    BLOCK_M: gl.constexpr = CONSUMERS * SUB_M
    dtype: gl.constexpr = k_bufs.dtype
    MMA_K: gl.constexpr = 32 if FP8 else 16  # wgmma's K per instruction: 32 bytes
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, MMA_K])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM_V, MMA_K])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout,
                                                 k_width=4 if FP8 else 2)  # fmt: skip
    # fp8 (FP8 > 0, the mode of FP8_PROMOTION): Q K^T promoted into fp32 every 32 products
    # and / or P V once per block, or left to the tensor cores' reduced-precision fp8 sums
    # (docs/attention.md, "fp8 attention forward"); 0: the default.
    QK_IMPRECISE: gl.constexpr = 32 if FP8 == 1 or FP8 == 3 else 0
    PV_IMPRECISE: gl.constexpr = BLOCK_N if FP8 == 1 or FP8 == 2 else 0
    QK_HALVES: gl.constexpr = FP8 == 5  # S as two asynchronous halves of the head dim
    # fp8: P comes out 2^8 times larger (its small values clear of e4m3's underflow at 2^-9,
    # the largest near 256, under e4m3's 448); l too, so O / l needs no correction
    P_SHIFT: gl.constexpr = 8.0 if FP8 else 0.0
    # (head dims of 128 and more: a thread holds LAZY_PACK or more of O's values)
    LAZY: gl.constexpr = (LAZY_RESCALE if (ORDER & ORDER_LAZY) and not FP8
                          and HEAD_DIM_V >= 2 * LAZY_PACK else 0.0)  # fmt: skip
    FROZEN: gl.constexpr = (ORDER & ORDER_FROZEN) != 0 and not FP8 and SOFTCAP != 2
    # the first block's max FROZEN_HEADROOM above the true one (bf16: p <= 2^-64 there)
    HEADROOM: gl.constexpr = FROZEN_HEADROOM if dtype == gl.bfloat16 else FROZEN_HEADROOM_FP16
    P_OPEN: gl.constexpr = P_SHIFT - HEADROOM if FROZEN else P_SHIFT
    # ORDER_ROUNDED_SUMS: the row sums of P's 16-bit operand (_rounded_p; 1: bf16, 2: fp16),
    # with a fixed max (dropout drops P in fp32: the host gives it no fixed max)
    ROUND: gl.constexpr = (((ORDER & ORDER_ROUNDED_SUMS) != 0 and (FROZEN or SOFTCAP == 2)
                            and not DROPOUT and not FP8)
                           * (1 if dtype == gl.bfloat16 else 2))  # fmt: skip
    P_DTYPE: gl.constexpr = dtype if ROUND else gl.float32  # (the softmax's p)
    Q_REGS: gl.constexpr = (ORDER & ORDER_Q_REGS) != 0 and not FP8
    q_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    # fp8: P's shared-memory operand (_p_operand); a token buffer otherwise
    P_M: gl.constexpr = SUB_M if FP8 else 16
    P_N: gl.constexpr = BLOCK_N if FP8 else 32
    p_smem = gl.allocate_shared_memory(dtype, [P_M, P_N],
                                       gl.NVMMASharedLayout.get_default_for([P_M, P_N], dtype))
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    orow_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    Q_BUFS: gl.constexpr = q_bufs.type.shape[0] // CONSUMERS
    # (chained tiles need the next tile's Q while this tile's is still in use; the static
    # round robin only: hopper_args)
    CHAIN: gl.constexpr = (ORDER & ORDER_CHAIN) != 0 and Q_BUFS == 2 and not DYNAMIC
    # (DEFER_O_STORE: the Q buffer whose O store may still be reading it, -1 for none; not
    # fp8, whose O leaves by a masked store from the registers)
    DEFER: gl.constexpr = (ORDER & ORDER_DEFER_STORE) != 0 and Q_BUFS == 2 and not FP8
    pend = -1
    # ORDER_O_IN_V: a tile's O leaves through V stage C (hopper_args: one Q buffer, so not
    # CHAIN either; a V stage of 64 x d per consumer)
    O_IN_V: gl.constexpr = _o_in_v(ORDER, Q_BUFS, VARLEN, FP8, HEAD_DIM_V, HEAD_DIM, BLOCK_N,
                                   SUB_M, STAGES, CONSUMERS)  # fmt: skip
    # LATE_P: P becomes P V's operand in the iteration that issues P V. A 16-bit P carried
    # into the next iteration comes out, at three consumers (160 registers), as 16-bit
    # registers whose halves ptxas swaps before the product (32 PRMT per block); a 32-bit P
    # carried makes two consumers spill (SASS read, 2026-11-24).
    LATE_P: gl.constexpr = CONSUMERS == 3
    pin = gl.allocate_shared_memory(gl.float32, [SUB_M, 4],
                                    gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    if ALIBI == 3:  # _alibi_columns' operands: the keys' columns once, the slope per tile
        AUG_K: gl.constexpr = 16
        aug_layout: gl.constexpr = gl.BlockedLayout([1, AUG_K], [32, 1], [4, 1], [1, 0])
        aug_k = gl.allocate_shared_memory(
            dtype, [BLOCK_N, AUG_K], gl.NVMMASharedLayout.get_default_for([BLOCK_N, AUG_K], dtype))
        aug_q = gl.allocate_shared_memory(
            dtype, [3, SUB_M, AUG_K], gl.NVMMASharedLayout.get_default_for([SUB_M, AUG_K], dtype))
        key_col = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, aug_layout))
        aug_col = gl.arange(0, AUG_K, layout=gl.SliceLayout(0, aug_layout))
        aug_k.store(gl.where(aug_col[None, :] < 3, key_col[:, None].to(gl.float32),
                             0.0).to(dtype))  # fmt: skip
        aug_q.index(2).store(gl.zeros([SUB_M, AUG_K], dtype, aug_layout))
    else:
        aug_k = pin
        aug_q = pin
    num_m = gl.cdiv(seqlen_q, BLOCK_M)
    it = 0
    lap = 0
    total = num_m * batch_heads
    if VARLEN:  # the host's list of tiles per head (tile_table)
        num_m = num_items
        total = num_items * heads
    if ORDER & ORDER_PINGPONG:
        if C == CONSUMERS - 1:  # consumer 0 issues first
            _pingpong(C, CONSUMERS, True)
    t = gl.program_id(0)
    if DYNAMIC:  # the loader's work items, in its order; ``total``: no more
        mbarrier.wait(q_ready.index(C), 0)
        t = _get_tile(tile_ids.index(0))
    if CHAIN:  # the first tile's state and first block
        (qb, off_b, off_h, q_start, seqlen_q_t, seqlen_k_t, causal_offset_t, row0, offs_m, n, lo,
         first_masked, left_masked, m_i, l_i, slope2, qk_scale_t, v_descale) = _tile_state(
            gl.minimum(t, total - 1), num_m, heads, kv_group, batch_heads, seqlen_q, seqlen_k,
            causal_offset, left_offset, qk_scale, SLOPES, stride_slopes_b, SINK_LOGITS, CU_Q,
            CU_K, TILES, tile_group, DESCALE, lap, aug_q, dtype, s_layout, CAUSAL, CONSUMERS,
            WINDOW, SOFTCAP, ALIBI, SINKS, VARLEN, FP8, C, Q_BUFS, P_SHIFT, SUB_M, BLOCK_N)
        acc = gl.zeros([SUB_M, HEAD_DIM_V], gl.float32, layout=o_layout)
        p = gl.zeros([SUB_M, BLOCK_N], P_DTYPE, s_layout)
        p16 = _p_operand(p, p_smem, dtype, p_layout, FP8)
        if t < total:
            mbarrier.wait(q_ready.index(qb), 0)
        if (t < total) & (n > lo):
            p, m_i, l_i = _open_tile(
                q_bufs, k_bufs, k_ready, k_empty, aug_q, aug_k, qb, gl.to_tensor(0), lo, row0,
                offs_m, m_i, l_i, seqlen_k_t, causal_offset_t, left_offset, qk_scale_t,
                tanh_scale, slope2, alibi_offset, first_masked, left_masked,
                off_b * heads + off_h, dropout_seed, dropout_thresh, s_layout, CONSUMERS, C,
                CAUSAL, WINDOW, SOFTCAP, ALIBI, DROPOUT, ORDER, P_OPEN, LAZY, QK_IMPRECISE,
                QK_HALVES, ROUND)
            if not LATE_P:
                p16 = _p_operand(p, p_smem, dtype, p_layout, FP8)
    while t < total:
        if not CHAIN:
            (qb, off_b, off_h, q_start, seqlen_q_t, seqlen_k_t, causal_offset_t, row0, offs_m, n,
             lo, first_masked, left_masked, m_i, l_i, slope2, qk_scale_t, v_descale) = _tile_state(
                t, num_m, heads, kv_group, batch_heads, seqlen_q, seqlen_k, causal_offset,
                left_offset, qk_scale, SLOPES, stride_slopes_b, SINK_LOGITS, CU_Q, CU_K, TILES,
                tile_group, DESCALE, lap, aug_q, dtype, s_layout, CAUSAL, CONSUMERS, WINDOW,
                SOFTCAP, ALIBI, SINKS, VARLEN, FP8, C, Q_BUFS, P_SHIFT, SUB_M, BLOCK_N)
            acc = gl.zeros([SUB_M, HEAD_DIM_V], gl.float32, layout=o_layout)
            if not DYNAMIC:
                mbarrier.wait(q_ready.index(qb), (lap // Q_BUFS) & 1)
        q_smem = q_bufs.index(qb).reshape([SUB_M, HEAD_DIM])
        if Q_REGS:  # Q K^T's A operand from registers after the tile's first block
            q_op = q_smem.load(q_layout)
        else:
            q_op = q_smem
        # (dropout: the rows' groups and the pair's (batch, head))
        drop_rows = _query_group(offs_m)
        drop_bh = off_b * heads + off_h
        if n > lo:
            if not CHAIN:  # block lo: S, softmax
                p, m_i, l_i = _open_tile(
                    q_bufs, k_bufs, k_ready, k_empty, aug_q, aug_k, qb, it, lo, row0, offs_m,
                    m_i, l_i, seqlen_k_t, causal_offset_t, left_offset, qk_scale_t, tanh_scale,
                    slope2, alibi_offset, first_masked, left_masked, drop_bh, dropout_seed,
                    dropout_thresh, s_layout, CONSUMERS, C, CAUSAL, WINDOW, SOFTCAP, ALIBI,
                    DROPOUT, ORDER, P_OPEN, LAZY, QK_IMPRECISE, QK_HALVES, ROUND)
                if not LATE_P:
                    p16 = _p_operand(p, p_smem, dtype, p_layout, FP8)
            if DEFER:  # the tile before's O store has had this tile's first block to run
                pend = _release_q(q_empty, pend)
            for j in range(lo + 1, n):
                # Issue S_j = Q K_j^T, then O += P_{j-1} V_{j-1}; wait for S_j only.
                g = it + j - lo
                s_idx, phase = _stage(g, STAGES)
                prev, prev_phase = _stage(g - 1, STAGES)
                mbarrier.wait(k_ready.index(s_idx), phase)
                mbarrier.wait(v_ready.index(prev), prev_phase)
                k_t = _tile2d(k_bufs, s_idx).permute((1, 0))
                v_smem = _v_operand(v_bufs, prev, FP8)
                # (Block j - 1 < n - 1 lies before the sequence's last key: no foreign rows.)
                if LATE_P:
                    p16 = _p_operand(p, p_smem, dtype, p_layout, FP8)
                if ORDER & ORDER_PINGPONG:
                    _pingpong(C, CONSUMERS, False)
                s_tok, s_tok2 = _issue_s(q_op, k_t,
                                         gl.zeros([SUB_M, BLOCK_N], gl.float32, s_layout),
                                         HEAD_DIM, QK_IMPRECISE, QK_HALVES)  # fmt: skip
                if ALIBI == 3:
                    s_tok = _alibi_columns(s_tok, aug_q, aug_k, j * BLOCK_N, row0, alibi_offset,
                                           SUB_M)  # fmt: skip
                    s_tok2 = s_tok
                acc_tok = _mma(p16, v_smem, acc, True, PV_IMPRECISE)
                if ORDER & ORDER_PINGPONG:
                    _pingpong(C, CONSUMERS, True)
                s = _wait_s(s_tok, s_tok2, q_op, k_t, 1, QK_HALVES)
                mbarrier.arrive(k_empty.index(s_idx))  # K_j is no longer read
                # Softmax of block j while P_{j-1} V_{j-1} runs on the tensor cores.
                p, m_i, l_i, alpha = _softmax_step(
                    s, m_i, l_i, j * BLOCK_N, offs_m, row0, seqlen_k_t, causal_offset_t,
                    left_offset,
                    qk_scale_t, tanh_scale, slope2, alibi_offset,
                    (j >= first_masked) | (j < left_masked), CAUSAL, WINDOW, SOFTCAP, ALIBI,
                    P_SHIFT, LAZY, FROZEN, ROUND)
                if DROPOUT:
                    p = _dropout(p, drop_rows, j * BLOCK_N, drop_bh, dropout_seed,
                                 dropout_thresh, False)  # fmt: skip
                if ORDER & ORDER_PIN:
                    # ptxas schedules the wait for P_{j-1} V_{j-1} as early as it can, which
                    # is before this softmax (it only orders the wait among memory
                    # operations): a store of the row sums, which need every exponential,
                    # keeps it here (SASS read, 2026-11-23).
                    pin.store(l_i)
                if ORDER & ORDER_PIN_GLOBAL:
                    _pin(l_i, LSE, seqlen_k_t)
                acc, _p, _vs = warpgroup_mma_wait(0, deps=(acc_tok, p16, v_smem))
                mbarrier.arrive(v_empty.index(prev))  # nor V_{j-1}
                if not LATE_P:
                    p16 = _p_operand(p, p_smem, dtype, p_layout, FP8)
                if SOFTCAP == 2 or FROZEN:  # (a fixed max: alpha is 1)
                    pass
                elif LAZY > 0:
                    acc = _rescale(acc, gl.convert_layout(alpha, orow_layout))
                else:
                    acc = acc * gl.convert_layout(alpha, orow_layout)[:, None]
            if O_IN_V:  # every S of the tile is done: Q's buffer goes back to the loader
                mbarrier.arrive(q_empty.index(qb))
            if not CHAIN:  # (LATE_P: P's operand made in _close_tile)
                acc = _close_tile(v_bufs, v_ready, v_empty, p, p if LATE_P else p16, p_smem, acc,
                                  it + n - 1 - lo, n, seqlen_k_t, p_layout, CONSUMERS, C, VARLEN,
                                  FP8, ORDER, LATE_P, PV_IMPRECISE)  # fmt: skip
                it += n - lo
        if CHAIN:
            # The next work item (its Q was loaded during this tile: two Q buffers), its
            # state, and its first block's S issued with this tile's last P V: the softmax
            # of one runs while the other is on the tensor cores, as inside a tile.
            nl = lap + 1
            t_next = t + gl.num_programs(0)
            (qb2, off_b2, off_h2, q_start2, seqlen_q2, seqlen_k2, causal_offset2, row02, offs_m2,
             n2, lo2, first_masked2, left_masked2, m_i2, l_i2, slope22, qk_scale2,
             v_descale2) = (
                _tile_state(gl.minimum(t_next, total - 1), num_m, heads, kv_group, batch_heads,
                            seqlen_q, seqlen_k, causal_offset, left_offset, qk_scale, SLOPES,
                            stride_slopes_b, SINK_LOGITS, CU_Q, CU_K, TILES, tile_group, DESCALE,
                            nl, aug_q, dtype, s_layout, CAUSAL, CONSUMERS, WINDOW, SOFTCAP,
                            ALIBI, SINKS, VARLEN, FP8, C, Q_BUFS, P_SHIFT, SUB_M, BLOCK_N))
            if t_next < total:
                mbarrier.wait(q_ready.index(qb2), (nl // Q_BUFS) & 1)
            blocks = gl.maximum(n - lo, 0)
            this_one = n > lo
            next_one = (t_next < total) & (n2 > lo2)
            p_next = p
            m_next = m_i2
            l_next = l_i2
            p16_next = p16
            if this_one & next_one:
                last, last_phase = _stage(it + n - 1 - lo, STAGES)
                mbarrier.wait(v_ready.index(last), last_phase)
                v_smem = _v_operand(v_bufs, last, FP8)
                if VARLEN and not (ORDER & ORDER_FOREIGN_BY_LOADER):
                    _clear_foreign_rows(v_smem, seqlen_k_t - (n - 1) * BLOCK_N)
                if LATE_P:
                    p16 = _p_operand(p, p_smem, dtype, p_layout, FP8)
                q_smem2 = q_bufs.index(qb2).reshape([SUB_M, HEAD_DIM])
                s_idx, phase = _stage(it + blocks, STAGES)
                mbarrier.wait(k_ready.index(s_idx), phase)
                k_t = _tile2d(k_bufs, s_idx).permute((1, 0))
                if ORDER & ORDER_PINGPONG:
                    _pingpong(C, CONSUMERS, False)
                s_tok, s_tok2 = _issue_s(q_smem2, k_t,
                                         gl.zeros([SUB_M, BLOCK_N], gl.float32, s_layout),
                                         HEAD_DIM, QK_IMPRECISE, QK_HALVES)  # fmt: skip
                if ALIBI == 3:
                    s_tok = _alibi_columns(s_tok, aug_q, aug_k, lo2 * BLOCK_N, row02,
                                           alibi_offset, SUB_M)  # fmt: skip
                    s_tok2 = s_tok
                acc_tok = _mma(p16, v_smem, acc, True, PV_IMPRECISE)
                if ORDER & ORDER_PINGPONG:
                    _pingpong(C, CONSUMERS, True)
                s = _wait_s(s_tok, s_tok2, q_smem2, k_t, 1, QK_HALVES)
                mbarrier.arrive(k_empty.index(s_idx))
                p_next, m_next, l_next, _alpha = _softmax_step(
                    s, m_i2, l_i2, lo2 * BLOCK_N, offs_m2, row02, seqlen_k2, causal_offset2,
                    left_offset, qk_scale2, tanh_scale, slope22, alibi_offset,
                    (lo2 >= first_masked2) | (lo2 < left_masked2), CAUSAL, WINDOW, SOFTCAP,
                    ALIBI, P_OPEN, LAZY, False, ROUND)
                if DROPOUT:
                    p_next = _dropout(p_next, _query_group(offs_m2), lo2 * BLOCK_N,
                                      off_b2 * heads + off_h2, dropout_seed, dropout_thresh,
                                      False)  # fmt: skip
                if ORDER & ORDER_PIN:
                    pin.store(l_next)
                if ORDER & ORDER_PIN_GLOBAL:
                    _pin(l_next, LSE, seqlen_k2)
                acc, _p, _vs = warpgroup_mma_wait(0, deps=(acc_tok, p16, v_smem))
                mbarrier.arrive(v_empty.index(last))
                if not LATE_P:
                    p16_next = _p_operand(p_next, p_smem, dtype, p_layout, FP8)
            elif this_one:
                acc = _close_tile(v_bufs, v_ready, v_empty, p, p16, p_smem, acc,
                                  it + n - 1 - lo, n, seqlen_k_t, p_layout, CONSUMERS, C, VARLEN,
                                  FP8, ORDER, LATE_P, PV_IMPRECISE)  # fmt: skip
            elif next_one:
                p_next, m_next, l_next = _open_tile(
                    q_bufs, k_bufs, k_ready, k_empty, aug_q, aug_k, qb2, it + blocks, lo2, row02,
                    offs_m2, m_i2, l_i2, seqlen_k2, causal_offset2, left_offset, qk_scale2,
                    tanh_scale, slope22, alibi_offset, first_masked2, left_masked2,
                    off_b2 * heads + off_h2, dropout_seed, dropout_thresh, s_layout, CONSUMERS, C,
                    CAUSAL, WINDOW, SOFTCAP, ALIBI, DROPOUT, ORDER, P_OPEN, LAZY, QK_IMPRECISE,
                    QK_HALVES, ROUND)
                if not LATE_P:
                    p16_next = _p_operand(p_next, p_smem, dtype, p_layout, FP8)
            it += blocks
        lap += 1

        if DEFER:  # (a tile without blocks)
            pend = _release_q(q_empty, pend)
        if FROZEN:  # (the call's second launch redoes the call if any row is flagged)
            _flag_rows(acc, l_i, offs_m, seqlen_q_t, seqlen_k_t, causal_offset_t, left_offset,
                       FLAG, orow_layout, CAUSAL, WINDOW, (ALIBI != 0) | WINDOW)  # fmt: skip
        if O_IN_V and n > lo:
            # Once every consumer is done with V's ring (the loader holds the next tile's V
            # loads for _o_stored), O through V stage C.
            named_barrier(O_IN_V_BARRIER, CONSUMERS * 128)
            _epilogue(acc, m_i, l_i, v_bufs.index(C), o_desc, LSE, O, off_b, off_h, heads,
                      q_start, row0, offs_m, seqlen_q_t, total_q, head_dim, stride_ob, stride_os,
                      stride_oh, v_descale, dropout_keep, row_layout, orow_layout, o_layout,
                      VARLEN, FP8, DROPOUT)  # fmt: skip
            mbarrier.arrive(_o_stored(q_empty))
        else:
            _epilogue(acc, m_i, l_i, q_bufs.index(qb), o_desc, LSE, O, off_b, off_h, heads,
                      q_start, row0, offs_m, seqlen_q_t, total_q, head_dim, stride_ob, stride_os,
                      stride_oh, v_descale, dropout_keep, row_layout, orow_layout, o_layout,
                      VARLEN, FP8, DROPOUT, DEFER)  # fmt: skip
            if DEFER:
                pend = qb
            else:
                mbarrier.arrive(q_empty.index(qb))
        if CHAIN:  # the next tile's state
            t = t_next
            qb = qb2
            off_b = off_b2
            off_h = off_h2
            q_start = q_start2
            seqlen_q_t = seqlen_q2
            seqlen_k_t = seqlen_k2
            causal_offset_t = causal_offset2
            row0 = row02
            offs_m = offs_m2
            n = n2
            lo = lo2
            first_masked = first_masked2
            left_masked = left_masked2
            m_i = m_next
            l_i = l_next
            slope2 = slope22
            qk_scale_t = qk_scale2
            v_descale = v_descale2
            p = p_next
            p16 = p16_next
            acc = gl.zeros([SUB_M, HEAD_DIM_V], gl.float32, layout=o_layout)
        elif DYNAMIC:  # (lap counts this tile already)
            mbarrier.wait(q_ready.index((lap % Q_BUFS) * CONSUMERS + C), (lap // Q_BUFS) & 1)
            t = _get_tile(tile_ids.index(lap % Q_BUFS))
        else:
            t += gl.num_programs(0)
    if DEFER:  # the last tile's O store
        _release_q(q_empty, pend)


@gluon.jit
def _consumer0(o_desc, LSE, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready,
               k_empty, v_empty,
               tile_ids, batch_heads, heads, kv_group, seqlen_q, seqlen_k, causal_offset,
               qk_scale, left_offset, tanh_scale, SLOPES, stride_slopes_b, alibi_offset,
               SINK_LOGITS, CU_Q, CU_K, TILES, num_items, tile_group, O, stride_ob,
               stride_os, stride_oh, DESCALE, FLAG, total_q,
               head_dim, dropout_seed, dropout_thresh, dropout_keep,
               CAUSAL: gl.constexpr, CONSUMERS: gl.constexpr, WINDOW: gl.constexpr,
               SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, SINKS: gl.constexpr,
               VARLEN: gl.constexpr, FP8: gl.constexpr, ORDER: gl.constexpr, DYNAMIC: gl.constexpr,
               DROPOUT: gl.constexpr):
    _consumer(o_desc, LSE, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready,
              k_empty, v_empty,
              tile_ids, batch_heads, heads, kv_group, seqlen_q, seqlen_k, causal_offset,
              qk_scale, left_offset, tanh_scale, SLOPES, stride_slopes_b, alibi_offset,
              SINK_LOGITS, CU_Q, CU_K, TILES, num_items, tile_group, O, stride_ob,
              stride_os, stride_oh, DESCALE, FLAG, total_q, head_dim,
              dropout_seed, dropout_thresh, dropout_keep,
              CAUSAL, CONSUMERS, WINDOW, SOFTCAP, ALIBI, SINKS, VARLEN, FP8, ORDER, DYNAMIC,
              0, DROPOUT)  # fmt: skip


@gluon.jit
def _consumer1(o_desc, LSE, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready,
               k_empty, v_empty,
               tile_ids, batch_heads, heads, kv_group, seqlen_q, seqlen_k, causal_offset,
               qk_scale, left_offset, tanh_scale, SLOPES, stride_slopes_b, alibi_offset,
               SINK_LOGITS, CU_Q, CU_K, TILES, num_items, tile_group, O, stride_ob,
               stride_os, stride_oh, DESCALE, FLAG, total_q,
               head_dim, dropout_seed, dropout_thresh, dropout_keep,
               CAUSAL: gl.constexpr, CONSUMERS: gl.constexpr, WINDOW: gl.constexpr,
               SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, SINKS: gl.constexpr,
               VARLEN: gl.constexpr, FP8: gl.constexpr, ORDER: gl.constexpr, DYNAMIC: gl.constexpr,
               DROPOUT: gl.constexpr):
    _consumer(o_desc, LSE, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready,
              k_empty, v_empty,
              tile_ids, batch_heads, heads, kv_group, seqlen_q, seqlen_k, causal_offset,
              qk_scale, left_offset, tanh_scale, SLOPES, stride_slopes_b, alibi_offset,
              SINK_LOGITS, CU_Q, CU_K, TILES, num_items, tile_group, O, stride_ob,
              stride_os, stride_oh, DESCALE, FLAG, total_q, head_dim,
              dropout_seed, dropout_thresh, dropout_keep,
              CAUSAL, CONSUMERS, WINDOW, SOFTCAP, ALIBI, SINKS, VARLEN, FP8, ORDER, DYNAMIC,
              1, DROPOUT)  # fmt: skip


@gluon.jit
def _consumer2(o_desc, LSE, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready,
               k_empty, v_empty,
               tile_ids, batch_heads, heads, kv_group, seqlen_q, seqlen_k, causal_offset,
               qk_scale, left_offset, tanh_scale, SLOPES, stride_slopes_b, alibi_offset,
               SINK_LOGITS, CU_Q, CU_K, TILES, num_items, tile_group, O, stride_ob,
               stride_os, stride_oh, DESCALE, FLAG, total_q,
               head_dim, dropout_seed, dropout_thresh, dropout_keep,
               CAUSAL: gl.constexpr, CONSUMERS: gl.constexpr, WINDOW: gl.constexpr,
               SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, SINKS: gl.constexpr,
               VARLEN: gl.constexpr, FP8: gl.constexpr, ORDER: gl.constexpr, DYNAMIC: gl.constexpr,
               DROPOUT: gl.constexpr):
    _consumer(o_desc, LSE, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready,
              k_empty, v_empty,
              tile_ids, batch_heads, heads, kv_group, seqlen_q, seqlen_k, causal_offset,
              qk_scale, left_offset, tanh_scale, SLOPES, stride_slopes_b, alibi_offset,
              SINK_LOGITS, CU_Q, CU_K, TILES, num_items, tile_group, O, stride_ob,
              stride_os, stride_oh, DESCALE, FLAG, total_q, head_dim,
              dropout_seed, dropout_thresh, dropout_keep,
              CAUSAL, CONSUMERS, WINDOW, SOFTCAP, ALIBI, SINKS, VARLEN, FP8, ORDER, DYNAMIC,
              2, DROPOUT)  # fmt: skip


@gluon.jit
def _attn_fwd_hopper(q_desc, k_desc, v_desc, o_desc, LSE, batch_heads, heads, kv_group, seqlen_q,
                     seqlen_k, causal_offset, qk_scale, left_offset, tanh_scale, SLOPES,
                     stride_slopes_b, alibi_offset, SINK_LOGITS, CU_Q, CU_K, TILES, num_items,
                     tile_group, O,
                     stride_ob, stride_os, stride_oh, DESCALE, total_q, head_dim, COUNTER,
                     run_slot, counter_slot, dropout_seed, dropout_thresh, dropout_keep,
                     CAUSAL: gl.constexpr, CONSUMERS: gl.constexpr, STAGES: gl.constexpr,
                     CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
                     WINDOW: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr,
                     SINKS: gl.constexpr, VARLEN: gl.constexpr, FP8: gl.constexpr,
                     ORDER: gl.constexpr,
                     Q_BUFS: gl.constexpr, DYNAMIC: gl.constexpr,
                     DROPOUT: gl.constexpr = False):
    """Program p runs tiles p, p + grid, p + 2 * grid, ... of the cdiv(seqlen_q, CONSUMERS *
    64) * batch * heads query tiles (a grid of one program per tile is the non-persistent
    launch), or (DYNAMIC) tile p and then those the COUNTER hands out, plus the grid
    (`_loader`). Launched with num_warps=4 (the first consumer); the partitions add 4 warps per
    further consumer and 1 loader warp. Descriptors are 4-D over (batch, heads, seqlen, dim)
    with blocks (1, 1, rows, padded dim)."""
    if run_slot >= 0:  # a frozen-max call's second launch: only if a row was not finite
        if gl.load(COUNTER + run_slot) == 0:
            return
    FLAG = COUNTER + 1  # (ORDER_FROZEN: set where a row came out not finite)
    COUNTER += counter_slot
    dtype: gl.constexpr = q_desc.dtype
    q_bufs = gl.allocate_shared_memory(dtype, [Q_BUFS * CONSUMERS] + q_desc.block_type.shape,
                                       q_desc.layout)  # fmt: skip
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [Q_BUFS * CONSUMERS, 1],
                                        mbarrier.MBarrierLayout())  # fmt: skip
    # (+ one: _o_stored)
    q_empty = gl.allocate_shared_memory(gl.int64, [Q_BUFS * CONSUMERS + 1, 1],
                                        mbarrier.MBarrierLayout())  # fmt: skip
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    # tile_ids[i]: the work item of Q buffer set i (_put_tile / _get_tile)
    tile_ids = gl.allocate_shared_memory(gl.int32, [Q_BUFS, 1],
                                         gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    # k_empty[s] / v_empty[s]: K / V stage s is free. (Triton lowers each arrival to a
    # warpgroup barrier and one thread's arrive, "block-level semantics": two per block per
    # consumer, read in the SASS, 2026-11-24.)
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    # v_raw: packed sequences' last V block lands here for the loader (ORDER_FOREIGN_BY_LOADER)
    v_raw = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(v_raw.index(0), count=1)
    for i in gl.static_range(Q_BUFS * CONSUMERS):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)
    mbarrier.init(q_empty.index(Q_BUFS * CONSUMERS), count=CONSUMERS)  # (_o_stored)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)  # one arrival per consumer
        mbarrier.init(v_empty.index(i), count=CONSUMERS)
    # (Argument tuples are written out in place: bound to a name first, their constexpr
    # members would reach the partitions as run-time values.)
    if CONSUMERS == 3:
        gl.warp_specialize([
            (_consumer0, (o_desc, LSE, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready,
                          k_empty, v_empty, tile_ids, batch_heads, heads, kv_group, seqlen_q,
                          seqlen_k, causal_offset, qk_scale, left_offset, tanh_scale, SLOPES,
                          stride_slopes_b, alibi_offset, SINK_LOGITS, CU_Q, CU_K, TILES,
                          num_items, tile_group, O,
                          stride_ob, stride_os, stride_oh, DESCALE, FLAG, total_q, head_dim,
                          dropout_seed, dropout_thresh, dropout_keep,
                          CAUSAL, CONSUMERS, WINDOW, SOFTCAP, ALIBI, SINKS, VARLEN, FP8, ORDER,
                          DYNAMIC, DROPOUT)),
            (_consumer1, (o_desc, LSE, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready,
                          k_empty, v_empty, tile_ids, batch_heads, heads, kv_group, seqlen_q,
                          seqlen_k, causal_offset, qk_scale, left_offset, tanh_scale, SLOPES,
                          stride_slopes_b, alibi_offset, SINK_LOGITS, CU_Q, CU_K, TILES,
                          num_items, tile_group, O,
                          stride_ob, stride_os, stride_oh, DESCALE, FLAG, total_q, head_dim,
                          dropout_seed, dropout_thresh, dropout_keep,
                          CAUSAL, CONSUMERS, WINDOW, SOFTCAP, ALIBI, SINKS, VARLEN, FP8, ORDER,
                          DYNAMIC, DROPOUT)),
            (_consumer2, (o_desc, LSE, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready,
                          k_empty, v_empty, tile_ids, batch_heads, heads, kv_group, seqlen_q,
                          seqlen_k, causal_offset, qk_scale, left_offset, tanh_scale, SLOPES,
                          stride_slopes_b, alibi_offset, SINK_LOGITS, CU_Q, CU_K, TILES,
                          num_items, tile_group, O,
                          stride_ob, stride_os, stride_oh, DESCALE, FLAG, total_q, head_dim,
                          dropout_seed, dropout_thresh, dropout_keep,
                          CAUSAL, CONSUMERS, WINDOW, SOFTCAP, ALIBI, SINKS, VARLEN, FP8, ORDER,
                          DYNAMIC, DROPOUT)),
            (_loader, (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, q_empty,
                       k_ready, v_ready, k_empty, v_empty, tile_ids, batch_heads, heads, kv_group,
                       seqlen_q, seqlen_k, causal_offset, left_offset, CU_Q, CU_K, TILES,
                       num_items, tile_group, COUNTER, v_raw,
                       CAUSAL, CONSUMERS, WINDOW, VARLEN, FP8, DYNAMIC, ORDER)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, LOADER_REGS])  # fmt: skip
    else:
        gl.warp_specialize([
            (_consumer0, (o_desc, LSE, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready,
                          k_empty, v_empty, tile_ids, batch_heads, heads, kv_group, seqlen_q,
                          seqlen_k, causal_offset, qk_scale, left_offset, tanh_scale, SLOPES,
                          stride_slopes_b, alibi_offset, SINK_LOGITS, CU_Q, CU_K, TILES,
                          num_items, tile_group, O,
                          stride_ob, stride_os, stride_oh, DESCALE, FLAG, total_q, head_dim,
                          dropout_seed, dropout_thresh, dropout_keep,
                          CAUSAL, CONSUMERS, WINDOW, SOFTCAP, ALIBI, SINKS, VARLEN, FP8, ORDER,
                          DYNAMIC, DROPOUT)),
            (_consumer1, (o_desc, LSE, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready,
                          k_empty, v_empty, tile_ids, batch_heads, heads, kv_group, seqlen_q,
                          seqlen_k, causal_offset, qk_scale, left_offset, tanh_scale, SLOPES,
                          stride_slopes_b, alibi_offset, SINK_LOGITS, CU_Q, CU_K, TILES,
                          num_items, tile_group, O,
                          stride_ob, stride_os, stride_oh, DESCALE, FLAG, total_q, head_dim,
                          dropout_seed, dropout_thresh, dropout_keep,
                          CAUSAL, CONSUMERS, WINDOW, SOFTCAP, ALIBI, SINKS, VARLEN, FP8, ORDER,
                          DYNAMIC, DROPOUT)),
            (_loader, (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, q_empty,
                       k_ready, v_ready, k_empty, v_empty, tile_ids, batch_heads, heads, kv_group,
                       seqlen_q, seqlen_k, causal_offset, left_offset, CU_Q, CU_K, TILES,
                       num_items, tile_group, COUNTER, v_raw,
                       CAUSAL, CONSUMERS, WINDOW, VARLEN, FP8, DYNAMIC, ORDER)),
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


@functools.cache
def _smem_layout(block: tuple, dtype: torch.dtype):
    return gl.NVMMASharedLayout.get_default_for(list(block), _SMEM_DTYPES[dtype])


def _desc(t4: torch.Tensor, rows: int, dim: int | None = None) -> GluonDescriptor:
    """A host TMA descriptor of a (batch, heads, seqlen, dim) view, blocks (1, 1, rows, dim:
    the padded head dim unless given). Its fields are set directly: ``supports`` has checked
    TMA's rules (alignment, strides, a contiguous last dim), which the constructor would
    check again on every call (with the layout lookup, ~10 us of the launch path's host
    time)."""
    block = (1, 1, rows, dim or head_dim_pad(t4.shape[3]))
    desc = object.__new__(GluonDescriptor)
    desc.base = t4
    desc.shape = list(t4.shape)
    desc.strides = list(t4.stride())
    desc.block_shape = list(block)
    desc.layout = _smem_layout(block, t4.dtype)
    desc.padding = "zero"
    return desc


# Rows' maxima from each tile's first block only (ORDER_FROZEN), for 16-bit plain attention:
# later blocks run the fixed-max softmax, a flagged call is redone (_launch_call). A one-hot
# row's largest p is no power of 2 there, so its bf16 rounding would stay in O and not in l
# (2^-9 of the value where PyTorch is exact) but for the row sums of the rounded P
# (ROUNDED_SUMS; test_gpu_hopper_frozen_max_when_later_keys_score_higher). H200, bf16, one
# process, 3 interleaved rounds, with the rounded sums (benchmarks/hopper_flag_ab.py --flag
# FROZEN_MAX, benchmarks/results/2026-11-26_h200_fwd-frozen-max-ab*_c1203d2.*), median ms
# running / frozen: d64 1 x 32 x 16k 4.119 / 3.811, causal 2.181 / 2.017, 4 x 4096 1.139 /
# 1.066, causal 0.6495 / 0.6196, 8 x 2048 0.5812 / 0.5556, causal 0.3591 / 0.3561, 16 x 1024
# 0.322 / 0.3249 (slower), the packed mix 4.535 / 4.159, causal 2.678 / 2.543; d128 1 x 16 x
# 16k 3.292 / 3.079, causal 1.69 / 1.618, 4 x 4096 0.8895 / 0.8249, causal 0.478 / 0.4589,
# 8 x 2048 0.457 / 0.4617 (slower), causal 0.2668 / 0.2641, the packed mix 3.486 / 3.336,
# causal 1.871 / 1.813; d256 1 x 8 x 16k 2.956 / 2.997, 4 x 4096 causal 0.4402 / 0.4521
# (slower). Hence the keys (the longest sequence's, packed) from which it runs, per padded
# head dim (none at 256): FROZEN_MIN_KEYS.
# Only for calls whose LSE no one reads (forward_out_only: inference without return_lse):
# the rounded sums put P's 16-bit rounding into l, so the LSE of a row that a few keys
# past the first block dominate is up to 2^-9 of l off (the GPU fuzz: 1.7e-4 relative, its
# bound 1e-4); a call that returns or keeps its LSE runs the running max (hopper_args'
# lse_read, test_varlen_regression_sharp_rows_lse_under_the_frozen_max).
# The environment variable DIYFA_FROZEN_MAX, read at import: "0" turns it off, "always" runs
# it at any length and size of padded head dims 64 and 128 (tests and the GPU fuzz).
FROZEN_MAX = os.environ.get("DIYFA_FROZEN_MAX", "1") != "0"
FROZEN_MIN_KEYS = ((64, 2048), (128, 4096))
FROZEN_DTYPES = (torch.bfloat16, torch.float16)
# ... and from this many (query row, key) pairs: the second launch costs a few microseconds a
# call, whatever its size. fp16, one process, 3 rounds, median ms running / frozen
# (benchmarks/results/2026-11-26_h200_fwd-frozen-max-fp16-ab_95e491e.{txt,jsonl}): the seed
# table's 4 x 8 x 2048 d64 0.0846 / 0.0945 and 4 x 8 x 4096 0.3032 / 0.3066 (2^28.0 and 2^29.0
# pairs: slower); at 2^30 and more, 8 x 32 x 2048 0.5963 / 0.5938, causal 0.3733 / 0.3645,
# 4 x 32 x 4096 1.173 / 1.109, causal 0.6679 / 0.6535, 1 x 32 x 16k 4.255 / 4.189, causal
# 2.278 / 2.142; d128 4 x 16 x 4096 0.902 / 0.8676, causal 0.5023 / 0.4904, 1 x 16 x 16k
# 3.474 / 3.336, causal 1.777 / 1.704. 3 x 2^28, between the two (the cross suite's 1 x 16 x
# 4096 x 15360, 2^29.96, keeps it).
FROZEN_MIN_PAIRS = 3 << 28
if os.environ.get("DIYFA_FROZEN_MAX") == "always":
    FROZEN_MIN_KEYS, FROZEN_MIN_PAIRS = ((64, 0), (128, 0)), 0
# The frozen max with attention sinks (the head's logit starts each row's max, as with the
# running max) and, in bf16, ALiBi (the first block's max moved to the row's nearest key by
# the slope: _softmax_step) and windows (the first block's max over every key the band shows
# a row that sees none of it, left of its window too); rows whose sums come out below
# seqlen_k x 2^-114 are redone (_flag_rows). Not fp16's: with its 8 of headroom a row's
# scores may lie below P's normal range.
# H200, bf16, one process, 3 rounds (benchmarks/hopper_flag_ab.py --flag FROZEN_VARIANTS,
# benchmarks/results/2026-11-26_h200_fwd-frozen-variants-ab*_700732d-wip.*), median ms running
# / frozen, ALiBi's standard slopes: d128 1 x 16 x 8192 causal 0.4986 / 0.4605, not causal
# 0.912 / 0.8355, 4 x 16 x 4096 causal 0.5247 / 0.4998; d64 1 x 32 x 8192 causal 0.6595 /
# 0.6102; sinks d128 causal 0.4625 / 0.4444 and 0.462 / 0.4458, d64 0.3242 / 0.3166; ALiBi and
# sinks 2 x 16 x 8192 1.751 / 1.637, causal 0.4644 / 0.4669 (level). (The ALiBi builds spill
# more with the rounded sums, up to 332 bytes: test_hopper_kernel_compiles_frozen_variants.)
FROZEN_VARIANTS = True
# Row sums of P's rounded bf16 operand wherever the max is fixed (ORDER_ROUNDED_SUMS: the
# frozen max, softcap's fixed max).
ROUNDED_SUMS = True
# Q K^T's A operand (Q) from registers, loaded once a tile (ORDER_Q_REGS), for 16-bit d64
# builds of two consumers (16 registers a thread; 32 at d128, 64 at d256). H200, bf16, one
# process, 3-5 interleaved rounds (benchmarks/hopper_flag_ab.py --flag Q_IN_REGS; the first
# run flipped every build, benchmarks/results/2026-11-26_h200_fwd-q-regs-ab_37db03e-wip.txt,
# the second d64's two-consumer ones, ..._fwd-q-regs-d64-ab_37db03e-wip.txt), median ms
# from shared memory / registers: d64 8 x 32 x 2048 causal 0.3632 / 0.3615, 4 x 32 x 4096
# causal 0.6717 / 0.6710 (first run 0.6708 / 0.6542), 16 x 32 x 1024 0.3293 / 0.3218
# (0.3335 / 0.3257), causal 0.2196 / 0.2186, 1 x 16 x 8192 with a (1023, 0) window 0.1070 /
# 0.1041, 32 x 16 x 512 causal 0.0850 / 0.0843; d128 (two consumers) 1-7% slower everywhere
# (1 x 16 x 16k 3.343 / 3.449, causal 8192 0.4482 / 0.4822); d64 three consumers 36% slower
# (4 x 32 x 4096 1.112 / 1.515: 320 bytes spilled at 160 registers).
Q_IN_REGS = True


def q_in_registers(head_dim_padded: int, cfg: Config, fp8) -> bool:
    """Whether the kernel keeps Q in registers for Q K^T (:data:`Q_IN_REGS`)."""
    return Q_IN_REGS and head_dim_padded == 64 and cfg.consumers == 2 and fp8 is None


def frozen_variants(variants: dict | None, dtype: torch.dtype) -> bool:
    """Whether the frozen max takes a call's ``variants`` (:data:`FROZEN_VARIANTS`): none,
    sinks, and in bf16 ALiBi and windows; not softcap (its own fixed max) or dropout."""
    flags = {name for name in ("WINDOW", "SOFTCAP", "ALIBI", "SINKS", "DROPOUT")
             if (variants or {}).get(name)}  # fmt: skip
    if not flags:
        return True
    allowed = {"SINKS"} | ({"ALIBI", "WINDOW"} if dtype == torch.bfloat16 else set())
    return FROZEN_VARIANTS and flags <= allowed


def frozen_max(dtype: torch.dtype, variants: dict | None, head_dim_padded: int,
               seqlen_k: int, rows: int, lse_read: bool) -> bool:
    """Whether a call runs with ORDER_FROZEN (:data:`FROZEN_MAX`): 16-bit, plain attention or
    the variants :func:`frozen_variants` takes, from :data:`FROZEN_MIN_KEYS` keys and
    ``rows`` (query rows x heads: batch x heads x seqlen_q, or heads x total_q packed) x keys
    of :data:`FROZEN_MIN_PAIRS`, and only where no one reads the LSE (not ``lse_read``).
    ``seqlen_k``: the keys a row sees (a two-sided window's span: :func:`band_keys`)."""
    least = dict(FROZEN_MIN_KEYS).get(head_dim_padded)
    return bool(FROZEN_MAX and not lse_read and dtype in FROZEN_DTYPES
                and frozen_variants(variants, dtype)
                and least is not None and seqlen_k >= least
                and rows * seqlen_k >= FROZEN_MIN_PAIRS)


def _replay_settings() -> tuple:
    """The module settings :func:`frozen_max`, the kernel's sums, the config choice
    (:data:`TRY_CONFIG`), the O stores' order (:data:`DEFER_O_STORE`, :data:`O_IN_V`) and
    Q's place (:data:`Q_IN_REGS`) read: the kept launches' keys (``_REPLAYS``,
    ``_PACKED_REPLAYS``) hold them, so a changed setting is not replayed."""
    return (FROZEN_MAX, FROZEN_MIN_KEYS, FROZEN_MIN_PAIRS, FROZEN_DTYPES, FROZEN_VARIANTS,
            ROUNDED_SUMS, TRY_CONFIG, DEFER_O_STORE, O_IN_V, Q_IN_REGS)  # fmt: skip


def band_keys(seqlen_k: int, causal_offset: int, causal: bool, variants: dict | None) -> int:
    """The most keys a query row sees: a window bounded on both sides (a left window with the
    causal band or a right window) spans at most left + right + 1 keys, else every key. (The
    frozen max's thresholds count these: its gain grows with the blocks a tile visits.
    FROZEN_VARIANTS' A/B: a (4095, 0) window at 4096 keys 0.4883 / 0.4726 ms, (1023, 0) at
    8192 0.1374 / 0.1398, (127, 0) 0.1066 / 0.1211: the frozen max pays from d128's 4096.)"""
    if variants and variants.get("WINDOW") and causal:
        return max(min(seqlen_k, causal_offset - variants["left_offset"] + 1), 0)
    return seqlen_k


def hopper_args(q4, k4, v4, o4, lse2, causal_offset: int, qk_scale: float, causal: bool,
                num_sms: int, config: tuple | None = None, variants: dict | None = None,
                packed: dict | None = None, fp8: dict | None = None, lse_read: bool = False):
    """(grid, kernel arguments, num_warps) for (batch, heads, seqlen, dim) views.
    ``causal_offset`` is the band's upper offset (key j visible from query i iff j <= i +
    causal_offset, with ``causal``: causal or a right window); ``variants`` the kernel's
    variant arguments (:func:`variant_args`), none by default; ``packed`` (packed sequences:
    the views are batch-of-one) their count, longest lengths and kernel arguments
    (:func:`hopper_forward`); ``fp8`` (fp8 q, k, v): V^T and the descales
    (:func:`_fp8_operands`), the bf16 output ``o4`` then stored by the consumers;
    ``lse_read``: the caller returns the LSE or keeps it for a backward (no frozen max: its
    row sums carry P's 16-bit rounding into the LSE, :data:`FROZEN_MAX`)."""
    b, h, sq, d = q4.shape
    sk = k4.shape[2]
    if packed is not None:
        b, sq, sk = packed["batch"], packed["seqlen_q"], packed["seqlen_k"]
    # (the long-keys config for plain attention only: with the variants' registers three
    # consumers spill hundreds of bytes, test_variants)
    # (fp8: two consumers at d64 too; at 160 registers each, three spilled and measured 143
    # against 391 TFLOPS, b4 h32 4096 d64, fp8_hopper_ab)
    if fp8 is not None:
        config = config or fp8_config(head_dim_pad(d))
    # (packed sequences: the longest one's keys)
    static = not (causal or variants or packed is not None)  # (variants: two consumers)
    if (config is None and TRY_CONFIG and fp8 is None and head_dim_pad(d) == TRY_CONFIG[0]
            and TRY_CONFIG[1] == ("plain" if not variants else
                                  "softcap" if variants.get("SOFTCAP") else "other")):
        config = TRY_CONFIG[2:]
    frozen = frozen_max(q4.dtype, variants, head_dim_pad(d),
                        band_keys(sk, causal_offset, causal, variants),
                        h * (packed["args"].get("total_q", b * sq) if packed else b * sq),
                        lse_read)  # fmt: skip
    # (d128's three consumers: with the frozen max, and not for a smaller value head dim,
    # which no GPU test has run with them)
    three_ok = frozen and head_dim_pad(o4.shape[3]) == head_dim_pad(d)
    config = config or default_config(head_dim_pad(d), sk if not variants else 0, causal,
                                      (b * h, sq, num_sms) if static else None,
                                      three_ok)  # fmt: skip
    cfg = Config(*config)
    consumers, block_n = cfg.consumers, cfg.block_n
    args = dict(q_desc=_desc(q4, SUB_M), k_desc=_desc(k4, block_n), v_desc=_desc(v4, block_n),
                o_desc=_desc(o4, SUB_M), LSE=lse2, batch_heads=b * h, heads=h,
                kv_group=h // k4.shape[1], seqlen_q=sq, seqlen_k=sk,
                causal_offset=causal_offset,
                qk_scale=qk_scale, CAUSAL=causal, CONSUMERS=consumers, STAGES=cfg.stages,
                CONSUMER_REGS=cfg.consumer_regs, LOADER_REGS=cfg.loader_regs,
                left_offset=0, tanh_scale=1.0, SLOPES=lse2, stride_slopes_b=0, alibi_offset=0,
                SINK_LOGITS=lse2, WINDOW=False, SOFTCAP=False, ALIBI=False,
                SINKS=False, CU_Q=lse2, CU_K=lse2, TILES=lse2, num_items=0, tile_group=1,
                O=lse2,
                stride_ob=0, stride_os=0, stride_oh=0, DESCALE=lse2, FP8=0,
                total_q=0, head_dim=o4.shape[3], VARLEN=False,
                ORDER=(ORDER_PIN.value * (cfg.pin == 1) + ORDER_PIN_GLOBAL.value * (cfg.pin == 2)
                       + ORDER_PINGPONG.value * bool(cfg.pingpong)
                       + ORDER_LAZY.value * bool(cfg.lazy)
                       + ORDER_DEFER_STORE.value * (DEFER_O_STORE and cfg.consumers == 2)
                       + ORDER_FROZEN.value * frozen
                       + ORDER_Q_REGS.value * q_in_registers(head_dim_pad(d), cfg, fp8)),
                Q_BUFS=cfg.q_bufs, COUNTER=_no_counter(lse2.device), run_slot=-1,
                counter_slot=0, DYNAMIC=False, DROPOUT=False, dropout_seed=0, dropout_thresh=0,
                dropout_keep=1.0)  # fmt: skip
    if variants:
        args.update(variants)
    if ROUNDED_SUMS and (args["ORDER"] & ORDER_FROZEN.value or args["SOFTCAP"] == 2):
        args["ORDER"] += ORDER_ROUNDED_SUMS.value
    if fp8 is not None:
        so = o4.stride()
        args.update(v_desc=_desc(fp8["vt"], head_dim_pad(o4.shape[3]), block_n),
                    DESCALE=fp8["descale"], FP8=fp8_mode(head_dim_pad(d)), O=o4,
                    stride_ob=so[0], stride_oh=so[1], stride_os=so[2])  # fmt: skip
    tiles = cdiv(sq, consumers * SUB_M) * b * h
    if packed is not None:
        args.update(packed["args"])
        if FOREIGN_BY_LOADER and consumers == 3:
            args["ORDER"] += ORDER_FOREIGN_BY_LOADER.value
    # A static round robin only without a band or packed sequences: it gives tiles of very
    # unequal work to the same programs (measured, causal: 454 against 618 TFLOPS at 16k,
    # d128), and an LPT order over every head (heaviest tiles of all heads first, snake
    # order over the programs) lost L2 locality (576 against 622; docs/attention.md).
    # Packed sequences too: their work list (tile_table) is heaviest first, and its tiles
    # are as uneven as the sequences' lengths.
    banded = causal or args["WINDOW"]
    dynamic = bool(cfg.per_sm and cfg.dynamic and (banded or args["VARLEN"]))
    persistent = cfg.per_sm and (dynamic or not (banded or args["VARLEN"]))
    if cfg.chain and persistent and not dynamic and cfg.q_bufs == 2:
        # Chained tiles for the static round robin only: with the tiles handed out by the
        # counter they measured 0-5% slower (the next tile's Q and first K come later there:
        # the loader claims the tile first), 5-9% slower still with the claim a tile ahead.
        args["ORDER"] += ORDER_CHAIN.value
    if dynamic:
        # Persistent programs that take the next tile in the head-major, heaviest-first
        # order from an atomic counter (zeroed per call) as they finish one: the balance and
        # L2 locality of one program per tile, plus the next tile's loads during this one.
        # H200, causal, against one program per tile (same run as LONG_KEYS_CAUSAL): d64
        # 4096 keys 421.6 / 389.9 TFLOPS, 1024 315.3 / 243.2; d128 16k 640.6 / 629.9, 4096
        # 560.1 / 540.9, 1024 413.9 / 364.4; d256 16k 682.3 / 671.8, 4096 577.8 / 568.4.
        args.update(DYNAMIC=True)
    if dynamic or args["ORDER"] & ORDER_FROZEN.value:
        # (zeroed per call: the tile counter; with the frozen max, its flag and the second
        # launch's counter, _launch_call)
        args["COUNTER"] = torch.zeros(counter_size(args), dtype=torch.int32, device=lse2.device)
    if packed is not None:
        # The lengths' values, read and checked here, once everything else is set up (the
        # packed call's host work after this read runs while the GPU waits).
        table, items = tile_table(*host_lengths(packed["cu_host"]), consumers * SUB_M, causal,
                                  lse2.device, VARLEN_BY_SEQUENCE)  # fmt: skip
        group = VARLEN_TILE_GROUP_CAUSAL if causal else VARLEN_TILE_GROUP
        group = items if group is None else min(group, items)
        args.update(TILES=table, num_items=items, tile_group=max(group, 1))
        tiles = items * h
    grid = (min(tiles, num_sms * cfg.per_sm) if persistent else tiles,)
    if not persistent:  # one tile per program: a second Q buffer would never be used
        args["Q_BUFS"] = 1
    if O_IN_V and dynamic and _o_in_v(ORDER_O_IN_V.value, args["Q_BUFS"], args["VARLEN"],
                                      args["FP8"], head_dim_pad(o4.shape[3]), head_dim_pad(d),
                                      block_n, SUB_M, cfg.stages, consumers):  # (the kernel's rule)
        args["ORDER"] += ORDER_O_IN_V.value
    return grid, args, 4


# Packed sequences' work order (tile_table, _tile). VARLEN_BY_SEQUENCE: causal tiles of one
# sequence stay together (sequences by their heaviest tile, then its tiles heaviest first),
# else all tiles heaviest first (without the causal band a sequence's tiles weigh the same:
# together either way); VARLEN_TILE_GROUP(_CAUSAL) tiles at a time for every head in turn
# (None: all of them, the whole list for head 0 first, then head 1...). H200, bf16, the
# varlen suite's 29 sequences (benchmarks/varlen_order_ab.py,
# benchmarks/results/2026-11-24_h200_varlen-order-ab_6ef1185.jsonl), TFLOPS of the old order
# (heaviest first, whole list per head) against by sequence in groups of 32: d128 GQA 16/4
# causal 346.5 / 393.3, not causal 545.2 / 493.2 (groups of 8: 509.7); d64 causal 278.0 /
# 278.1, not causal 394.3 / 380.2. So groups for causal calls only, then. Those timings
# held the host's Python work list (the GPU waited for it: work_table); timed by the kernels
# alone (profiler, 3 rounds, 2026-11-24, benchmarks/results/*_varlen-ab3_6c08dbf.txt),
# groups of 32 lead without the band too: d128 655.4 against 643.3 for the whole list per
# head (groups of 8: 639.0), d64 477.6 against 468.6 (465.7). So 32 for both.
VARLEN_BY_SEQUENCE = True
# Packed sequences on three consumers (d64): the V rows past a sequence's end in its last block
# are zeroed by the loader warp before the stage is marked ready (the kernel's
# ORDER_FOREIGN_BY_LOADER), not by every consumer before its last P V (a branch, a fence and a
# barrier in each consumer's tile end: ptxas spilled 48 bytes in that build with them, none
# without). H200, bf16, the varlen mix, one process, 5 rounds (benchmarks/hopper_flag_ab.py
# --flag FOREIGN_BY_LOADER, benchmarks/results/2026-11-26_h200_fwd-foreign-by-loader-ab_*.txt),
# median ms consumers / loader: d64 4.749 / 4.562, causal 2.678 / 2.660; at d128 (two
# consumers, two stages: the loader's wait for the block shows) 3.454 / 3.634, causal 1.885 /
# 1.900, so two consumers clear as before.
FOREIGN_BY_LOADER = True
# Packed sequences' O: by TMA for a consumer's 64 rows that all lie in the sequence (the
# kernel's VARLEN == 2), a masked store for the rest; False: masked stores only (VARLEN == 1).
VARLEN_O_TMA = True
VARLEN_TILE_GROUP: int | None = 32
VARLEN_TILE_GROUP_CAUSAL: int | None = 32


def tile_table(cu_q, cu_k, block_m: int, causal: bool, device,
               by_sequence: bool = False) -> tuple[torch.Tensor, int]:  # fmt: skip
    """Packed sequences' query tiles as the kernel takes them (``TILES``): int32 (sequence,
    tile) pairs for every tile that holds a query row, the heaviest first (the most keys to
    visit; ties in sequence order), and their count. Launching these and no more leaves out
    the programs a (longest sequence x batch) grid spends on tiles past each sequence's end
    (most of them with lengths as uneven as a packed batch's), and the order starts the long
    tiles first, which finishes a causal batch sooner. ``by_sequence``: sequences in the
    order of their heaviest tile, each one's tiles together, heaviest first (causal tiles of
    one sequence differ in weight: sorted by weight alone, the programs running at once read
    many sequences' keys). Kept per lengths (:func:`work_table`: the layers of a model share
    one batch's lengths)."""
    return work_table("q", tuple(cu_q), tuple(cu_k), block_m, 0, causal, by_sequence, device)


@functools.lru_cache(maxsize=64)
def work_table(kind: str, cu_q: tuple, cu_k: tuple, block_m: int, block_n: int, causal: bool,
               by_sequence: bool, device) -> tuple[torch.Tensor, int]:  # fmt: skip
    """The packed kernels' work lists on ``device``, built with numpy (the Python loops they
    replace took 0.2-0.35 ms per call on the CI machine for 29 sequences, about 2.5x that on
    the H200's host, while the GPU waited: the checks' read of the lengths has drained it)
    and kept for the next call with the same lengths (the kernels only read them). ``kind``
    "q": the forward's query tiles (:func:`tile_table`); "kv": the backward's key blocks
    (``hopper_bwd.kv_table``), weighed by the query blocks they visit, followed by the
    sequences' first rows in its dQ workspace (:func:`dq_rows`)."""
    import numpy as np

    cq, ck = np.asarray(cu_q, dtype=np.int64), np.asarray(cu_k, dtype=np.int64)
    sq, sk = np.diff(cq), np.diff(ck)
    per = -(-(sq if kind == "q" else sk) // (block_m if kind == "q" else block_n))
    b = np.repeat(np.arange(len(per)), per)
    first = np.cumsum(per) - per
    idx = np.arange(len(b)) - np.repeat(first, per)  # tile (or key block) within its sequence
    sqb, skb = sq[b], sk[b]
    if kind == "q":  # keys the tile visits (causal: bottom-right)
        weight = skb
        if causal:
            weight = np.minimum(skb, np.maximum(0, np.minimum((idx + 1) * block_m, sqb)
                                                + skb - sqb))  # fmt: skip
    else:  # query blocks the key block is visited by
        m_lo = np.maximum(idx * block_n - (skb - sqb), 0) // block_m if causal else 0
        weight = np.maximum(-(-sqb // block_m) - m_lo, 0)
    neg = -weight
    if by_sequence:  # sequences by their heaviest tile, a sequence's tiles together
        heaviest = np.zeros(len(per), dtype=np.int64)
        np.minimum.at(heaviest, b, neg)
        order = np.lexsort((idx, neg, b, heaviest[b]))
    else:
        order = np.lexsort((idx, b, neg))
    pairs = np.stack((b[order], idx[order]), axis=1).reshape(-1).astype(np.int32)
    if kind == "kv":  # then each sequence's first row in the atomic dQ workspace (dq_rows)
        pairs = np.concatenate((pairs, dq_rows(cu_q)[0].astype(np.int32)))
    return torch.from_numpy(pairs).to(device), len(order)


@functools.lru_cache(maxsize=64)
def dq_rows(cu_q: tuple) -> tuple:
    """The packed backward's atomic dQ workspace, whose rows are permuted within groups of 8
    (``hopper_bwd.dq_rows_permuted``): each sequence's rows start on a multiple of 8. Returns
    (the sequences' first rows there, batch + 1 of them as read-only numpy int64, the
    workspace's rows); the backward's work list (``work_table``'s "kv") carries the first
    ones after its pairs. Kept per lengths (the work list's and the workspace's size ask for
    the same lengths on every packed backward)."""
    import numpy as np

    cq = np.asarray(cu_q, dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(-(-np.diff(cq) // 8) * 8)))
    starts.setflags(write=False)
    return starts, int(starts[-1])


_NO_COUNTER: dict = {}


def counter_size(args: dict) -> int:
    """The int32s of the COUNTER of a call set up by :func:`hopper_args` (zeroed per call)."""
    return _counter_ints(bool(args["ORDER"] & ORDER_FROZEN.value), bool(args["DYNAMIC"]))


def _counter_ints(frozen: bool, dynamic: bool) -> int:
    """The int32s of a call's COUNTER: none (0: the device's constant), the tile counter of a
    call whose tiles are handed out (``dynamic``: 1), or with the frozen max (ORDER_FROZEN)
    the first launch's counter, the flag it sets and the second launch's counter (3)."""
    return 3 if frozen else int(dynamic)


def _launch_call(grid, args: dict, num_warps: int) -> list:
    """Launch a call set up by :func:`hopper_args`; its launches as Replay.record takes them.
    A frozen-max call (ORDER_FROZEN) launches twice: the frozen build, which flags rows that
    came out not finite (COUNTER[1]), then the running max's build over the same tiles, whose
    programs return at once unless that flag is set (``run_slot``), so a flagged call is
    redone whole."""
    fn = _attn_fwd_hopper
    redo = ahead = None
    if args["ORDER"] & ORDER_FROZEN.value:
        redo = dict(args, ORDER=args["ORDER"] - ORDER_FROZEN.value, run_slot=1, counter_slot=2)
        # (a first call compiles the second build on a worker meanwhile: one compile's wait)
        ahead = prefetch.compile_ahead(fn, grid, redo, num_warps)
    launches = [(fn, launch(fn, grid, args, {}, num_warps, 1), grid, args)]
    if redo is not None:
        prefetch.wait(ahead)
        launches.append((fn, launch(fn, grid, redo, {}, num_warps, 1), grid, redo))
    return launches


def _no_counter(device) -> torch.Tensor:
    """An int32 the kernel takes as COUNTER when it does not hand tiles out (never written)."""
    if device not in _NO_COUNTER:
        _NO_COUNTER[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return _NO_COUNTER[device]


# The fp8 forward's sums (the kernel's FP8 constant, > 0 for fp8 operands): 1 promotes Q K^T's
# into fp32 every 32 products and P V's once per key block (the portable kernel's recipe),
# 2 only P V's, 3 only Q K^T's, 4 neither (the tensor cores' reduced-precision fp8 sums
# throughout), 5 Q K^T as two products over the halves of the head dim added in fp32 after
# their wait (no promotion inside either, none for P V). The environment variable
# DIYFA_FP8_ATTN_SUMS sets it at import. benchmarks/fp8_hopper_ab.py times and checks each.
# On an H200 (2026-11-24, outlier channels,
# benchmarks/results/2026-11-24_h200_fp8-hopper-ab_ce432f3.jsonl): P V's promotion changed
# no error (largest output error 6.2e-2 with or without it at d128) and cost up to 44%
# (d256: 291 against 523 TFLOPS); Q K^T's cut the LSE error 4-10x (1.2e-2 against 4.7e-2 at
# d128) for 3-26% of the speed (d128 16k: 535 against 755). Mode 5 (same run conditions,
# ..._fp8-hopper-ab-halves_5ea81c2.jsonl) came within 2-11% of 4's speed (d128 16k 726
# against 754) with half to two thirds of its LSE error (2.6e-2 against 6.0e-2; at d64, two
# halves of 32 products, exactly 3's errors) and passes the tests' LSE bound
# (tests/test_fp8_attention.py, GPU, 24 cases). 3 keeps the LSE error lowest (1.2e-2); 4 is
# FlashAttention-3's choice, the fastest.
# The default (0, "auto"): mode 4 at head dim 64, mode 5 at 128, mode 3 at 256. At d64 mode 4's
# one product is 64 fp8 products long, as each of mode 5's halves at d128, and with its
# single accumulator it takes 256-key blocks (FP8_CONFIGS_UNPROMOTED): 555 against 398
# TFLOPS (b4 h32 4096; ..._fp8-speed-mode4_847848b.txt, ..._rescale-tau-ab_ba74254.txt),
# and the GPU tests pass with it (a d64 case of 1000 x 1531 added for it). Mode 4 at
# d128 (one product of 128), tried as the default the same day for its speed, broke the
# tests' LSE bound (2^-10 of sum_c |q_c k_c|) by 9-14% on 4 of 24 GPU cases (d128, 1000
# queries x 1531 keys, causal or not; benchmarks/results/*_gpu-tests-fp8-mode4_847848b.txt).
# Mode 5 at d256 (halves of 128 products, as mode 4's one product at d128) broke the same
# bound too: found by the GPU fuzz at 14a9395 (1 x 2 heads, 438 x 5255, causal, outlier
# channels: LSE off by 0.518 against 0.485 allowed), then 6 of 15 cases around it failed in
# mode 5 (up to 0.638 against 0.500), 12 of 15 in mode 4, none in mode 3 (H200, 2026-11-25,
# benchmarks/results/2026-11-25_h200_fp8-d256-sums_58ef716.txt). So d256 runs mode 3 by
# default: Q K^T promoted every 32 products, its LSE error 6.5e-3 against mode 5's 4.6e-2,
# at 0.70-0.78x mode 5's speed and 0.87-0.93x the bf16 forward's (b4 h8 4096: 621.6 against
# 857.5 and 690.2 TFLOPS; b1 h8 16k causal 699.5 / 918.2 / 749.7). DIYFA_FP8_ATTN_SUMS=5
# keeps the speed, with those errors.
def _fp8_sums_from_env() -> int:
    """FP8_PROMOTION's value at import: DIYFA_FP8_ATTN_SUMS (1..5, or "auto": 0, the
    default, :func:`fp8_mode`)."""
    raw = os.environ.get("DIYFA_FP8_ATTN_SUMS", "auto").strip()
    if raw not in ("auto", "1", "2", "3", "4", "5"):
        raise ValueError(f"DIYFA_FP8_ATTN_SUMS must be one of auto, 1, 2, 3, 4, 5 (the fp8 "
                         f"forward's sums, diyfa/attention/hopper_fwd.py), got {raw!r}")
    return 0 if raw == "auto" else int(raw)


FP8_PROMOTION = _fp8_sums_from_env()

# fp8 in mode 4 (DIYFA_FP8_ATTN_SUMS=4, one fp32 accumulator for S): blocks of twice the keys,
# where mode 5's two accumulators would spill kilobytes. H200, 2026-11-24,
# benchmarks/results/2026-11-24_h200_fp8-ab-configs_*.jsonl (TFLOPS with the slow host V^T
# copy of then, mode 4, these against HOPPER_CONFIGS'): d128 4096 638 / 621, 16k 856
# / 795, causal 4096 444 / 446; d256 4096 798 / 691, causal 549 / 496; d64 4096 511 / 424.
# ptxas spills 36 / 560 / 80 bytes (d64 / d128 / d256) and they still win.
FP8_CONFIGS_UNPROMOTED = {
    64: Config(2, 256, 2, 1, 240, 24, 0, q_bufs=2, dynamic=1),
    128: Config(2, 256, 2, 1, 240, 24, 0, q_bufs=2, dynamic=1),
    256: Config(2, 128, 2, 1, 240, 24, 0, q_bufs=1, dynamic=1),
}


FP8_PINS = {64: 0, 128: 1, 256: 0}


def fp8_mode(head_dim_padded: int) -> int:
    """The fp8 sums mode the kernel runs at a padded head dim (FP8_PROMOTION; "auto": 4 at
    d64, 5 at d128, 3 at d256)."""
    if FP8_PROMOTION:
        return FP8_PROMOTION
    return 4 if head_dim_padded <= 64 else 5 if head_dim_padded <= 128 else 3


def fp8_config(head_dim_padded: int) -> Config:
    """The fp8 forward's launch config at a padded head dim (per its sums mode)."""
    if fp8_mode(head_dim_padded) == 4:
        return FP8_CONFIGS_UNPROMOTED[head_dim_padded]
    # (the pins fp8 was measured with: d128's shared-memory store, none at d256)
    return HOPPER_CONFIGS[head_dim_padded]._replace(pin=FP8_PINS[head_dim_padded], chain=0)


@triton.jit
def _transpose_v(V, VT, seqlen, dim, stride_vb, stride_vh, stride_vs, stride_vd, stride_tb,
                 stride_th, stride_td, kv_heads, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """VT[b, h, c, j] = V[b, h, j, c] for a (BLOCK_S keys, BLOCK_D columns) tile: read along
    the head dim, written along the keys (both coalesced; PyTorch's strided copy_ of 1-byte
    elements took 208 us for 32 MB on an H200, 2026-11-24)."""
    pid_s = tl.program_id(1)  # (batch x kv heads on axis 0: past 65535 pairs too)
    off_b = tl.program_id(0) // kv_heads
    off_h = tl.program_id(0) % kv_heads
    offs_s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = (offs_s < seqlen)[:, None] & (offs_d < dim)[None, :]
    base = off_b.to(tl.int64) * stride_vb + off_h.to(tl.int64) * stride_vh
    tile = tl.load(V + base + offs_s.to(tl.int64)[:, None] * stride_vs
                   + offs_d[None, :] * stride_vd, mask=mask)  # fmt: skip
    out = VT + off_b.to(tl.int64) * stride_tb + off_h.to(tl.int64) * stride_th
    tl.store(out + offs_d.to(tl.int64)[:, None] * stride_td + offs_s[None, :], tl.trans(tile),
             mask=tl.trans(mask))  # fmt: skip


def transpose_v(v4: torch.Tensor) -> torch.Tensor:
    """V^T of a (batch, kv heads, seqlen, dim) view: (batch, kv heads, dim, seqlen), its rows
    padded to 16 bytes in memory (TMA's stride rule; the view ends at seqlen, so TMA
    zero-fills past it)."""
    b, hk, sk, d = v4.shape
    vt = torch.empty((b, hk, d, cdiv(sk, 16) * 16), dtype=v4.dtype, device=v4.device)
    if vt.numel():
        grid = (b * hk, cdiv(sk, 64), cdiv(d, 64))
        args = dict(V=v4, VT=vt, seqlen=sk, dim=d, stride_vb=v4.stride(0),
                    stride_vh=v4.stride(1), stride_vs=v4.stride(2), stride_vd=v4.stride(3),
                    stride_tb=vt.stride(0), stride_th=vt.stride(1), stride_td=vt.stride(2),
                    kv_heads=hk, BLOCK_S=64, BLOCK_D=64)  # fmt: skip
        if v4.is_cuda:
            launch(_transpose_v, grid, args, {}, 4, 1)
        else:  # the interpreter
            _transpose_v[grid](**args)
    return vt[..., :sk]


def values_key_major(v_strides: tuple) -> bool:
    """Whether V's (batch, heads, seqlen, dim) strides put its keys next to each other (as
    ``diyfa.key_major_values`` stores it): the fp8 forward then reads V^T from it directly."""
    return v_strides[2] == 1 and v_strides[3] != 1


def _fp8_operands(v: torch.Tensor, p: Problem) -> dict:
    """What the fp8 forward needs besides q, k, v: V^T, (batch, kv heads, dim, seqlen_k) e4m3
    (its rows padded to 16 bytes for TMA), since fp8 wgmma takes only K-major operands and
    P @ V's K is the keys: a transposed copy, or V itself when its keys are contiguous
    (:func:`values_key_major`, no copy); and the descales as one fp32 (2, batch, kv heads)
    tensor, q's times k's then v's (per-tensor ones broadcast)."""
    b, hk = p.batch, p.kv_heads
    v4 = bhsd_view(v, p.layout)
    vt = v4.transpose(2, 3) if values_key_major(p.v_strides) else transpose_v(v4)
    dq_, dk_, dv_ = p.descales
    descale = torch.empty((2, b, hk), dtype=torch.float32, device=v.device)
    descale[0].copy_((dq_ * dk_).expand(b, hk))
    descale[1].copy_(dv_.expand(b, hk))
    return dict(vt=vt, descale=descale)


def _plain(p: Problem) -> bool:
    """No window (causal alone is not one), softcap, ALiBi or sinks."""
    return (p.window_left < 0 and (p.window_right < 0 or p.causal) and p.softcap == 0
            and p.alibi_slopes is None and p.sinks is None)  # fmt: skip


# ALiBi's bias in the kernels (the ALIBI flag: 2, else 1): for a block of keys wholly on one
# side of the diagonal, a per-key and a per-row term (one add per score) instead of the
# distances (four instructions per score); blocks across the diagonal take the distances.
# H200, bf16, 1 x 16 x 8192, kernel TFLOPS split / distances (plain attention), 2026-11-24,
# benchmarks/results/2026-11-24_h200_alibi-split-ab_95d85c4-wip.txt: forward d128 causal
# 520.0 / 487.6 (635.1), not causal 591.7 / 510.4 (705.7); d64 causal 344.7 / 292.3 (418.1),
# not 379.8 / 311.6 (446.2); backward d128 causal 387.7 / 336.7 (480.1), not 455.8 / 449.3
# (539.2); d64 causal 272.2 / 276.3, not 329.8 / 345.4. So the split for the forward at
# padded head dims ALIBI_SPLIT_DIMS and the backward at ALIBI_SPLIT_DIMS_BWD (hopper_bwd);
# d256 keeps the distances (not timed; with the split, its all-variants build spilled 112
# bytes and one GPU test's sink gradient came out one bf16 step past the 3x bound).
ALIBI_SPLIT = True
ALIBI_SPLIT_DIMS = (64, 128)
ALIBI_SPLIT_DIMS_BWD = (128,)


# The forward's split bias with its column term added by the tensor cores (ALIBI 3,
# _alibi_columns): one more K = 16 product per block instead of an FMA per column and an add
# per score. H200, bf16, one process, 3 rounds, TFLOPS with it / the FMAs (2026-11-25,
# benchmarks/results/2026-11-25_h200_alibi-gemm-ab_1980aa5.txt; plain attention alongside):
# d128 8k causal 574.2 / 516.2 (599.6), not causal 623.5 / 561.4 (645.4), 2k causal 440.2 /
# 416.8; d64 8k causal 415.9 / 384.0 (470.0). bf16 only (its pieces hold any slope / scale
# ratio; fp16's overflow past 65504) and not with softcap (the tanh comes before the bias):
# those keep ALIBI 2, as fp8 does (its products take K = 32).
ALIBI_GEMM = True


# The backward of causal calls (every visible key left of its query's diagonal, the rest
# masked) splits ALiBi's bias on every tile, the diagonal's too (ALIBI 4): no distances in the
# kernel at all, and the query term from the tile's first row (one conversion a step, not one
# per column). ptxas, d128 causal, spills atomic 344 -> 104 bytes, deterministic 148 -> 108.
# At d64 (from the distances: ALIBI_SPLIT_DIMS_BWD has no 64) the loop shrinks 868 -> 812
# instructions; H200, bf16, causal, one process, 3 rounds (benchmarks/alibi_bwd_ab.py,
# benchmarks/results/2026-11-25_h200_alibi64-bwd-ab_*.txt), TFLOPS distances / split:
# deterministic 1 x 32 x 8192 275 / 280, 4 x 32 x 4096 288 / 294, 16 x 32 x 1024 187 / 190;
# atomic 349 / 342, 337 / 334, 241 / 239.
ALIBI_CAUSAL_BWD = True
ALIBI_CAUSAL_BWD_DIMS = (64, 128)


def alibi_flag(head_dim_padded: int, backward: bool = False,
               dtype: torch.dtype = torch.bfloat16, softcap: bool = False,
               causal: bool = False) -> int:
    """The kernels' ALIBI value for a padded head dim: 2 (the split bias), 3 (the forward's
    split with the column term by the tensor cores: ALIBI_GEMM, bf16 without softcap), 4 (the
    backward's split on every tile of a ``causal`` call: ALIBI_CAUSAL_BWD) or 1
    (distances)."""
    if backward and causal and ALIBI_CAUSAL_BWD and head_dim_padded in ALIBI_CAUSAL_BWD_DIMS:
        return 4
    dims = ALIBI_SPLIT_DIMS_BWD if backward else ALIBI_SPLIT_DIMS
    if not (ALIBI_SPLIT and head_dim_padded in dims):
        return 1
    gemm = ALIBI_GEMM and not backward and dtype == torch.bfloat16 and not softcap
    return 3 if gemm else 2


def variant_args(p: Problem, backward: bool = False) -> tuple[int, float, bool, dict]:
    """(upper causal offset, qk_scale, CAUSAL flag, variant kernel arguments) of a problem,
    with the portable kernels' conventions: the band i + sk - sq - left <= j <= i + sk - sq +
    right (causal: right 0); softcap folds softcap * log2(e) into qk_scale and scale / softcap
    into tanh_scale; ALiBi's distance is bottom-right aligned whatever the band (its flag's
    value for the forward or, ``backward``, the Gluon backward: :func:`alibi_flag`)."""
    # A side wider than both sequences never binds: dropped, so the offsets stay int32 (a
    # window of 2**40 would turn the kernel's block counters into int64).
    bound = p.seqlen_q + p.seqlen_k
    right = -1 if p.window_right >= bound else p.window_right
    left = -1 if p.window_left >= bound else p.window_left
    upper = p.causal_offset + (0 if p.causal else max(right, 0))
    causal = p.causal or right >= 0
    softcap = p.softcap > 0
    qk_scale = (p.softcap if softcap else p.softmax_scale) * LOG2E
    alibi = p.alibi_slopes is not None
    variants = {}
    if left >= 0:
        variants.update(WINDOW=True, left_offset=p.causal_offset - left)
    if softcap:
        variants.update(SOFTCAP=2 if not backward and softcap_fixed_max(p) else True,
                        tanh_scale=p.softmax_scale / p.softcap)  # fmt: skip
    if alibi:
        variants.update(ALIBI=alibi_flag(head_dim_pad(p.head_dim), backward, p.dtype, softcap,
                                           p.causal),
                        SLOPES=p.alibi_slopes,
                        alibi_offset=p.causal_offset,
                        stride_slopes_b=p.alibi_slopes.stride(0) if p.alibi_slopes.dim() == 2
                        else 0)  # fmt: skip
    if p.sinks is not None:
        variants.update(SINKS=True, SINK_LOGITS=p.sinks)
    variants.update(dropout_args(p))
    return upper, qk_scale, causal, variants


# Softcap bounds every base-2 score by R = softcap * log2(e), so the forward's softmax needs
# no running max: with a fixed m = R - SOFTCAP_HEADROOM every p = 2^(score - m) lies in
# [2^(SOFTCAP_HEADROOM - 2R), 2^SOFTCAP_HEADROOM], which bf16 P and the fp32 sums hold with
# their full precision while SOFTCAP_HEADROOM - 2R >= -120 (R <= SOFTCAP_FIXED_MAX_LIMIT:
# softcap <= 63.7; Gemma 2 uses 50). No row max, no alpha and no O rescale per block.
# fp16's P (normal from 2^-14) and fp8's would lose the small probabilities; ALiBi's bias and
# the sinks' logits are not bounded by the cap: those keep the running max. So does d64
# (padded), where it measured slower: H200, bf16, one process, 3 rounds, TFLOPS fixed /
# running max (2026-11-25, benchmarks/results/2026-11-25_h200_softcap-fixed-max-ab_a3d9347.txt):
# d128 8k causal 506.8 / 468.0, not causal 550.1 / 532.9, 2k causal 420.8 / 396.0; d256 8k
# causal 640.9 / 538.4; d64 8k causal 301.8 / 329.4, 2k causal 267.2 / 280.2 (two consumers
# too; three overran their 160 registers, 344 bytes of spills against 128).
SOFTCAP_FIXED_MAX = True
SOFTCAP_HEADROOM = gl.constexpr(64.0)
SOFTCAP_FIXED_MAX_LIMIT = 92.0


def lse_read_variants(variants: dict, lse_read: bool) -> dict:
    """``variants`` for a call that returns or keeps its LSE (``lse_read``): softcap's fixed max
    (SOFTCAP 2) becomes the running max (SOFTCAP True). The fixed max's row sums add P's
    rounded bf16 values (ROUNDED_SUMS), which puts P's rounding into the LSE (up to 2^-9 of
    l on a row that a few keys dominate), as the frozen max's do; only a call whose LSE no
    one reads (:func:`forward_out_only`) takes it."""
    if lse_read and variants.get("SOFTCAP") == 2:
        return dict(variants, SOFTCAP=True)
    return variants


def softcap_fixed_max(p: Problem) -> bool:
    """Whether the forward runs softcap with the fixed max (SOFTCAP == 2): bf16, a padded
    head dim of 128 or more, softcap * log2(e) <= SOFTCAP_FIXED_MAX_LIMIT, no ALiBi, no
    sinks, no dropout (whose P is dropped in fp32, so its row sums could not add P's rounded
    operand: ROUNDED_SUMS)."""
    return _softcap_fixed_max(p.dtype, p.head_dim, p.softcap,
                              p.alibi_slopes is not None or p.sinks is not None
                              or p.dropout_p > 0)  # fmt: skip


def _softcap_fixed_max(dtype: torch.dtype, head_dim: int, softcap: float, unbounded: bool):
    """:func:`softcap_fixed_max`'s rule (``unbounded``: ALiBi, sinks or dropout)."""
    return (SOFTCAP_FIXED_MAX and dtype == torch.bfloat16 and head_dim_pad(head_dim) >= 128
            and not unbounded and 0 < softcap * LOG2E <= SOFTCAP_FIXED_MAX_LIMIT)  # fmt: skip


def dropout_args(p: Problem) -> dict:
    """The forward's dropout arguments (none without dropout): the portable kernels' mask
    (``portable._keep``: the same seed key and threshold, so either backward regenerates it)
    and the kept probabilities' scale, applied to O / l once per row."""
    if p.dropout_p == 0:
        return {}
    return dict(DROPOUT=True, dropout_seed=portable.dropout_key(p.dropout_seed),
                dropout_thresh=portable.dropout_threshold(p.dropout_p),
                dropout_keep=1.0 - p.dropout_p)


def compile_for_hopper(head_dim: int = 128, dtype: torch.dtype = torch.bfloat16,
                       causal: bool = False, config: tuple | None = None,
                       variants: tuple[str, ...] = (), packed: bool = False,
                       value_dim: int | None = None, fp8: bool = False):
    """Compile the kernel for sm90a without a GPU (Triton bundles ptxas), as ``hopper_args``
    sets it up for a (2, 16, 4096, head_dim) problem; returns Triton's ``CompiledKernel``
    (``.asm["ptx"]``, ``.metadata``); ``variants`` names the flags to set (WINDOW, SOFTCAP,
    ALIBI, SINKS, DROPOUT); ``packed``: the packed-sequence kernel (VARLEN, 4 sequences);
    ``value_dim``: v and the output with that head dim (default head_dim); ``fp8``: e4m3
    q, k, v (V^T blocks, descales, a bf16 output; ``dtype`` is ignored). Run it in
    a process that has not run kernels under the interpreter (which leaves Triton's language
    module patched)."""
    from diyfa._compile import compile_for_sm90

    q = torch.empty(2, 16, 4096, head_dim, dtype=dtype)
    lse = torch.empty(2, 16, 4096, dtype=torch.float32)
    flags = {name: True for name in variants}
    if "WINDOW" in flags:
        flags["left_offset"] = -1000
    # (the flags' values as variant_args gives them, softcap 30)
    kind = torch.float8_e4m3fn if fp8 else dtype
    if "ALIBI" in flags:
        flags["ALIBI"] = alibi_flag(head_dim_pad(head_dim), False, kind, "SOFTCAP" in flags)
    if "SOFTCAP" in flags and _softcap_fixed_max(kind, head_dim, 30.0,
                                                 bool({"ALIBI", "SINKS", "DROPOUT"} & set(flags))):
        flags["SOFTCAP"] = 2
    if "DROPOUT" in flags:
        flags.update(dropout_seed=2**40 + 3, dropout_thresh=portable.dropout_threshold(0.1),
                     dropout_keep=0.9)  # fmt: skip
    pack = None
    if packed:
        q, lse = q[:1], lse[0]
        cu = torch.zeros(5, dtype=torch.int32)
        out = torch.empty(4096, 16, head_dim, dtype=dtype)
        bounds = (0, 1000, 2000, 3000, 4096)
        pack = dict(batch=4, seqlen_q=1096, seqlen_k=1096, cu_host=(bounds, bounds),
                    args=dict(CU_Q=cu, CU_K=cu, O=out, stride_os=out.stride(0),
                              stride_oh=out.stride(1), total_q=4096,
                              VARLEN=2 if VARLEN_O_TMA else 1))  # fmt: skip
    v = q if value_dim is None else torch.empty(2, 16, 4096, value_dim, dtype=dtype)
    o, fp8_args = v, None
    if fp8:
        q = v = torch.empty(2, 16, 4096, head_dim, dtype=torch.float8_e4m3fn)
        o = torch.empty(2, 16, 4096, head_dim, dtype=torch.bfloat16)
        fp8_args = dict(vt=torch.empty(2, 16, head_dim, 4096, dtype=torch.float8_e4m3fn),
                        descale=torch.empty(2, 2, 16))  # fmt: skip
    _, args, num_warps = hopper_args(q, q, v, o, lse, 0, 0.1, causal, 132, config, flags, pack,
                                     fp8_args)  # fmt: skip
    return compile_for_sm90(_attn_fwd_hopper, args, num_warps)


def hopper_forward(q, k, v, problem: Problem, config: tuple | None = None,
                   lse_read: bool = True):
    """(out, lse2) for a problem ``supports`` accepts; lse2 is the base-2 LSE, (batch, heads,
    seqlen_q) fp32, as the portable kernel writes it (its backward reads it). ``lse_read``
    False (:func:`forward_out_only`: no one reads the LSE) allows the frozen max."""
    p = problem
    if p.cu_seqlens_q is not None:
        return _packed_forward(q, k, v, p, config, lse_read)
    shape = (p.batch, p.heads, p.seqlen_q, p.head_dim_v)
    if p.layout == "bshd":
        shape = (p.batch, p.seqlen_q, p.heads, p.head_dim_v)
    out = torch.empty(shape, dtype=p.out_dtype, device=q.device)
    lse2 = torch.empty((p.batch, p.heads, p.seqlen_q), dtype=torch.float32, device=q.device)
    if p.seqlen_k == 0:  # nothing to attend to (but the sinks, which join the LSE)
        return out.zero_(), empty_lse(lse2, p)
    if p.seqlen_q == 0 or p.batch * p.heads == 0:
        return out, lse2
    key = (replay_key("hopper-fwd", q, p, *_replay_settings(), lse_read)
           if config is None else None)
    roles = None
    if key is not None:
        roles = own_roles(dict(q=q, k=k, v=v, out=out, lse=lse2), p)
        kept = _REPLAYS.get(key)
        if kept is not None:
            replay, counter = kept
            if counter:  # (the tile counter of causal calls, the frozen max's flag: zeroed)
                roles["counter"] = torch.zeros(counter, dtype=torch.int32, device=q.device)
            if replay.run(roles):
                return out, lse2
    upper, qk_scale, causal, variants = variant_args(p)  # (plain attention: no flag)
    variants = lse_read_variants(variants, lse_read)
    fp8 = None if p.descales is None else _fp8_operands(v, p)
    grid, args, num_warps = hopper_args(
        bhsd_view(q, p.layout), bhsd_view(k, p.layout), bhsd_view(v, p.layout),
        bhsd_view(out, p.layout), lse2, upper, qk_scale, causal,
        kernel_limits(q.device.index)["sm_count"], config, variants, None, fp8,
        lse_read)  # fmt: skip
    launches = _launch_call(grid, args, num_warps)
    if roles is not None and not compiling_only():
        constants = ()
        counter = counter_size(args)
        if counter:
            roles["counter"] = args["COUNTER"]
        else:
            constants = (args["COUNTER"],)  # never written: one per device
        replay = Replay.record(launches, roles, constants)
        _REPLAYS.put(key, None if replay is None else (replay, counter))
    return out, lse2


_REPLAYS = ReplayCache()  # launches kept per signature (_launcher.Replay)


def cu_host(p: Problem) -> tuple:
    """Packed sequences' cumulative lengths on the host, (cu_q, cu_k): the checks' copy
    (waited for and checked, ``checks.HostLengths``), or read back (one synchronisation)
    for a problem built without it."""
    return packed_lengths(p) or (tuple(p.cu_seqlens_q.tolist()),
                                 tuple(p.cu_seqlens_k.tolist()))  # fmt: skip


def _packed_forward(q, k, v, p: Problem, config: tuple | None = None, lse_read: bool = True):
    """(out, lse2) of packed sequences, (total_q, heads, d) and (heads, total_q): the kernel
    over batch-of-one (1, heads, total, d) views, each tile's rows and keys offset by its
    sequence's cu_seqlens (``VARLEN``); no variants (``supports``)."""
    out = torch.empty((p.total_q, p.heads, p.head_dim_v), dtype=q.dtype, device=q.device)
    lse2 = torch.empty((p.heads, p.total_q), dtype=torch.float32, device=q.device)
    # (max_seqlen_* may exceed every length: test the rows too; TMA takes no empty tensor.)
    # This family reads the lengths late (Family.late_lengths): here before an early return,
    # else in hopper_args once the launch is set up.
    if p.seqlen_k == 0 or k.shape[0] == 0:  # no sequence has a key
        cu_host(p)
        return out.zero_(), empty_lse(lse2, p)
    if p.seqlen_q == 0 or p.total_q == 0 or p.batch * p.heads == 0:
        cu_host(p)
        return out, lse2

    def view(t):  # (total, heads, d) -> (1, heads, total, d)
        return t.unsqueeze(0).transpose(1, 2)

    lengths = cu_host(p) if p.cu_host is None else p.cu_host
    cu_q, cu_k = p.cu_seqlens_q, p.cu_seqlens_k
    roles = key = kept = None
    if (config is None and q.is_cuda and isinstance(lengths, HostLengths)
            and p.dropout_p == 0):  # (dropout: a seed per call)  # fmt: skip
        # A call with the shapes and lengths of one before (the layers of a model share a
        # batch's lengths; so do a benchmark's repetitions) replays that call's launch
        # (_launcher.Replay): after the lengths' read only the replay is left to do.
        roles = dict(q=q, k=k, v=v, out=out, lse=lse2,
                     counter=torch.zeros(_counter_ints(frozen_max(
                         q.dtype, None, head_dim_pad(p.head_dim), p.seqlen_k,
                         p.heads * p.total_q, lse_read), True),
                                         dtype=torch.int32, device=q.device), cu_q=cu_q)
        if cu_k is not cu_q:
            roles["cu_k"] = cu_k
        key = (p.heads, p.kv_heads, p.head_dim, p.head_dim_v, p.dtype, p.causal,
               p.softmax_scale, p.seqlen_q, p.seqlen_k, p.total_q, k.shape[0], p.q_strides,
               p.k_strides, p.v_strides, q.device, cu_k is cu_q, VARLEN_O_TMA,
               VARLEN_BY_SEQUENCE, VARLEN_TILE_GROUP, VARLEN_TILE_GROUP_CAUSAL,
               *_replay_settings(), FOREIGN_BY_LOADER, lse_read)  # fmt: skip
        kept = _PACKED_REPLAYS.get(key)
        if kept is not None and kept.run(roles, lengths):  # (the wait)
            return out, lse2
    packed = dict(batch=p.batch, seqlen_q=p.seqlen_q, seqlen_k=p.seqlen_k, cu_host=lengths,
                  args=dict(CU_Q=cu_q, CU_K=cu_k, O=out, stride_os=out.stride(0),
                            stride_oh=out.stride(1), total_q=p.total_q,
                            VARLEN=2 if VARLEN_O_TMA else 1))  # fmt: skip
    grid, args, num_warps = hopper_args(
        view(q), view(k), view(v), view(out), lse2, 0, p.softmax_scale * LOG2E, p.causal,
        kernel_limits(q.device.index)["sm_count"], config, dropout_args(p) or None,
        packed, lse_read=lse_read)  # fmt: skip
    launches = _launch_call(grid, args, num_warps)
    if roles is not None and args["DYNAMIC"] and not compiling_only():
        roles["counter"] = args["COUNTER"]
        replay = Replay.record(launches, roles, (args["TILES"],))
        if replay is not None:
            if kept is None:
                kept = _ByLengths()
                _PACKED_REPLAYS.put(key, kept)
            kept.put(lengths.values(), replay)
    return out, lse2


class _ByLengths:
    """One shape's packed-call replays, by lengths (the work list, kept by work_table, is a
    constant of each). The one used last is prepared (its arguments filled in) before the
    lengths' wait, so that after the wait, while the GPU idles, a call with the same lengths
    (a model's layers, a benchmark's repetitions) has only its launch left."""

    __slots__ = ("last", "items")
    KEPT = 16

    def __init__(self) -> None:
        self.last = None  # (lengths, replay)
        self.items: dict = {}

    def run(self, roles: dict, lengths: HostLengths) -> bool:
        """Wait for ``lengths`` (checked) and launch their replay; False: none serves."""
        last = self.last
        runs = None if last is None else last[1].prepare(roles)
        values = lengths.values()  # (the wait)
        if runs is not None and values == last[0]:
            last[1].launch(runs)
            return True
        replay = self.items.get(values)
        if replay is not None and replay.run(roles):
            self.last = (values, replay)
            return True
        return False

    def put(self, values: tuple, replay: Replay) -> None:
        if len(self.items) >= self.KEPT:
            self.items.clear()
        self.items[values] = replay
        self.last = (values, replay)


# Packed calls' launches, kept per shapes (_ByLengths: then per lengths).
_PACKED_REPLAYS = ReplayCache()


# --------------------------------------------------------------------------------------------
# The family
# --------------------------------------------------------------------------------------------
def supports(p: Problem) -> str | None:
    """Why this kernel cannot run ``p``; None when it can."""
    if p.cu_seqlens_q is not None and not _plain(p):
        return "it takes packed (varlen) sequences without window, softcap, ALiBi or sinks"
    if p.capability is None or p.capability[0] != 9:
        got = "no CUDA device" if p.capability is None else f"sm{p.capability[0]}{p.capability[1]}"
        return f"it needs a Hopper GPU (sm90), got {got}"
    if p.descales is not None:  # fp8 q, k, v
        if not _plain(p):
            return "its fp8 forward takes no window, softcap, ALiBi or sinks"
        if p.head_dim_v != p.head_dim:
            return "its fp8 forward takes no value head dim other than q's"
    elif p.dtype not in _GL_DTYPES:
        return f"it takes fp16 or bf16, not {str(p.dtype).removeprefix('torch.')}"
    if p.head_dim % 8 or not 64 <= p.head_dim <= 256:
        return f"it takes head dims 64..256 that are multiples of 8, not {p.head_dim}"
    if p.softmax_scale <= 0:
        return f"it takes a positive softmax_scale, not {p.softmax_scale}"
    dv = p.head_dim_v
    if dv != p.head_dim and (dv % 8 or head_dim_pad(dv) > head_dim_pad(p.head_dim)):
        return (f"it takes value head dims that are multiples of 8 and pad to at most q's "
                f"({head_dim_pad(p.head_dim)}), not {dv}")  # fmt: skip
    if not p.aligned16:
        return "q, k and v must start on 16-byte boundaries (TMA)"
    es = p.dtype.itemsize
    for name, strides in (("q", p.q_strides), ("k", p.k_strides), ("v", p.v_strides)):
        if name == "v" and p.descales is not None and values_key_major(strides):
            if any(st % 16 for st in (strides[0], strides[1], strides[3])):  # (1-byte values)
                return f"v's strides {strides} are not multiples of 16 bytes (TMA)"
            continue
        if strides[3] != 1:
            return f"{name}'s head dim is not contiguous (stride {strides[3]})"
        if any(st * es % 16 for st in strides[:3]):
            return f"{name}'s strides {strides} are not multiples of 16 bytes (TMA)"
    return None


def prefer(p: Problem) -> str | None:
    """Where "auto" leaves a problem this kernel can run to the portable one.

    - Head dims <= 64 with the causal band, fewer than 2048 keys and 2^28 scores
      (SHORT_WORK_D64, above), where the portable kernel measured as fast or faster.
      Without the band such calls run here since 2026-11-24 (later): at the seed shape
      (fp16 b4 h8) the two kernels take the same GPU time at 512 and 1024 keys (CUDA graph,
      H200: 9.7 / 10.1 us, 23.8 / 25.0; benchmarks/results/2026-11-24_h200_seed-probe_034a4aa
      .jsonl) and this family's host path became the lighter one (33 against 39 us per call
      on the H200's host, benchmarks/results/2026-11-24_h200_host-ab_034a4aa-wip.jsonl; its
      causal calls zero a tile counter per call): the benchmark, which times the host where
      it outlasts its L2 flush, measured 151 against 71 TFLOPS at 512 keys and 147 against
      139 at 1024 (..._flash_seed-fa4_39e772a.jsonl). Their backward stays portable
      (hopper_bwd.auto_mode). Before the persistent programs
      got two Q buffers and causal calls the
      counter scheduler (2026-11-24), that held up to 4096 keys (H100, 2026-11-23,
      benchmarks/results/2026-11-23_h100_flash_fwd_debc629.jsonl: d64 at 512 / 1024 / 2048
      keys 295 / 370 / 421 TFLOPS against 336 / 393 / 422, causal 161 / 244 / 331 against
      224 / 301 / 349). Since (H200, bf16 / fp16, benchmarks/results/
      2026-11-24_h200_flash_*_babe81a.jsonl, this kernel against the portable one): the
      fp16 seed shape (4 x 8 heads) at 2048 keys 391 against 291; at 1024 keys 400 against
      397 (16 x 32 heads), causal 311 against 288, but 137-154 against 175 on the small
      seed shape and 43-46 against 50 at 512 keys (host-bound sizes).
    Packed sequences run here at every head dim: at d128 (GQA 16/4) this kernel is ahead
    (H200, 29 sequences of 128..7626 tokens, 64k tokens, bf16,
    benchmarks/results/2026-11-23_h200_inference_*.jsonl: 516 / 426 TFLOPS full / causal
    against 462 / 399); at d64 the family keeps them too (its Gluon backward is faster there,
    and since 2026-11-24 its forward: :func:`auto_forward`); above d128 since 2026-11-25, with
    the d256 Gluon backward (H200, the same mix, bf16, benchmarks/untimed_ab.py, one process,
    2 rounds, benchmarks/results/2026-11-25_h200_untimed-ab_e8cd208.txt, ms portable / this
    family, forward and backward: d256 8 / 2 heads 6.16 / 3.12 and 22.0 / 13.9, causal 3.37 /
    1.64 and 11.6 / 7.8; d192 10 / 2 heads 7.30 / 3.83 and 27.1 / 16.5, causal 4.10 / 1.97
    and 14.4 / 9.1). So does a value head dim other than q's since then (its backward is
    portable either way): q/k 192 with v 128, 2 x 16 x 4096, forward 1.230 / 0.608 ms, causal
    0.733 / 0.347; 16 x 16 x 1024 0.755 / 0.356, causal 0.471 / 0.226 (same file; before, it
    passed its GPU test, benchmarks/results/2026-11-23_h200_gpu-tests-hopper-fwd_34dc924.txt,
    untimed).
    The variants (window, softcap, ALiBi, sinks) are taken: measured faster on an H200 (8k
    tokens, d128, causal; ..._flash_variants-fa4_34dc924.jsonl): window 1023 411 against 296
    TFLOPS, softcap 319 / 278, ALiBi 357 / 306, sinks 472 / 372.
    """
    if (head_dim_pad(p.head_dim) == 64 and p.causal and p.seqlen_k < SHORT_KEYS_D64
            and p.batch * p.heads * p.seqlen_q * p.seqlen_k < SHORT_WORK_D64):
        return (f"the portable kernel measured as fast or faster at head dims <= 64 with the "
                f"causal band below {SHORT_KEYS_D64} keys and {SHORT_WORK_D64} "
                "scores")  # fmt: skip
    return None


def forward_out_only(q, k, v, problem: Problem):
    """This family's forward for a call whose LSE no one reads (inference without
    ``return_lse``: ``Family.forward_out_only``): the frozen max where it applies."""
    return hopper_forward(q, k, v, problem, lse_read=False)


def auto_forward(q, k, v, problem: Problem):
    """"auto"'s forward for this family: this kernel. (Packed sequences at head dims <= 64 ran
    the portable forward until 2026-11-24, measured faster then; since the packed kernel
    takes its config by the longest sequence (three consumers from 4096 keys without the
    causal band then, 2048 now) and its work lists by sequence, it leads there too: H200,
    29 sequences of 128..7626 tokens, bf16, kernel TFLOPS Hopper / portable 484.5 / 441.2,
    causal 428.5 / 401.4, benchmarks/results/2026-11-24_h200_varlen-late-lengths_*.txt.)"""
    return hopper_forward(q, k, v, problem)


def backward(do, q, k, v, out, lse2, problem: Problem, delta_out=None):
    """"auto"'s backward for this family: the Gluon backward (hopper_bwd.py) where it measured
    faster (``hopper_bwd.auto_mode``), else the portable one (which reads the same LSE)."""
    from diyfa.attention import hopper_bwd  # it imports this module

    return hopper_bwd.backward(do, q, k, v, out, lse2, problem, forced=False, delta_out=delta_out)


def backward_named(do, q, k, v, out, lse2, problem: Problem, delta_out=None):
    """``backend="hopper"``'s backward: the Gluon backward wherever it applies (head dims up to
    128; atomic dQ unless ``deterministic``), else the portable one."""
    from diyfa.attention import hopper_bwd

    return hopper_bwd.backward(do, q, k, v, out, lse2, problem, forced=True, delta_out=delta_out)


# (late_lengths: packed sequences' lengths are read in _packed_forward, once its launch is
# set up.)
FAMILY = Family("hopper", supports=supports, forward=auto_forward, backward=backward,
                prefer=prefer, late_lengths=True, forward_out_only=forward_out_only,
                named=Family("hopper", supports=supports, forward=hopper_forward,
                             backward=backward_named, late_lengths=True,
                             forward_out_only=forward_out_only))  # fmt: skip
