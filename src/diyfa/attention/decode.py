"""Attention against a KV cache (decoding), split over the keys ("flash-decoding"), in Triton.

``flash_attention_with_kvcache`` (diyfa/attention/__init__.py) checks its inputs, appends the
new keys and values to the cache (torch indexing on the device, only the rows being
appended), and calls :func:`kvcache_attention` here.

Work split
    A decode step has few query rows (1..N new tokens) and a long cache. One program per
    (batch x kv head, split) handles every query row of the kv head's GQA group at once: the
    group's ``kv_group * seqlen_q`` rows form one tile, so each K/V byte is read once per
    group, not once per query head. The keys of a sequence are cut into ``num_splits``
    equal ranges of whole blocks; each program writes its partial output and base-2 LSE
    (fp32) to a workspace, and the splits are merged, by the last program of a block of rows
    to finish (``MERGE``: contiguous caches in at most ``MERGE_SPLITS`` splits) or by the
    ``_combine`` kernel: lse = log2(sum_s 2^lse_s), out = sum_s 2^(lse_s - lse) * out_s.

Caches
    Contiguous: (batch, max_len, kv_heads, d). Paged: (num_blocks, page_size, kv_heads, d)
    with an int32 block table (batch, max_blocks): key n of sequence b is row n % page_size
    of page block_table[b, n // page_size]. The kernel gathers each block's rows through
    the table (PAGED is a compile-time flag). fp8 caches on sm90 (contiguous, or paged in
    pages of a power of two >= 16 keys; d64 / d128, <= 16 query rows a kv head, no variants)
    take a Gluon split kernel instead (``hopper_decode``, :func:`_hopper_fp8`), which merges
    its splits itself as MERGE does, or leaves them to the shared combine kernel.

Masking: keys [0, seqlen_k) of each sequence, seqlen_k = cache_seqlens[b] (after the
append); causal aligns the new queries bottom-right (query i sees keys j <= i + seqlen_k -
seqlen_q). A row that sees no key gives zeros and LSE -inf.

Variants, as in the portable kernels (compile-time flags): a sliding window (the split's key
range starts at the window's first key, so a decode step reads only the window), softcap,
ALiBi (per row: the rows of a tile span the group's heads), and attention sinks, which join
the denominator once, in the merge.

Numerics are the portable kernel's: fp32 accumulation, base-2 softmax with the scale
folded in, P rounded to the input dtype before P @ V (fp32 inputs: IEEE dots).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from diyfa import _interpreter
from diyfa._launcher import (
    Replay,
    ReplayCache,
    cdiv,
    compiling_only,
    launch_recorded,
    next_power_of_2,
)
from diyfa.attention import hopper_decode
from diyfa.attention.checks import values_in_keys
from diyfa.attention.portable import _tanh
from diyfa.device import interpreter_enabled, kernel_limits

if interpreter_enabled():
    _interpreter.apply()  # bf16 tl.dot is wrong in Triton 3.6's interpreter without it

LOG2E = 1.4426950408889634
BLOCK_N = 64  # keys per step; splits are whole multiples of it
NUM_WARPS = 4  # the split kernel's warps
PROGRAMS_PER_SM = 2  # pick_splits' aim: about this many split programs per SM
# (BLOCK_N, warps, programs per SM) for contiguous 16-bit caches at head dims <= 128 on a
# GPU; the three above elsewhere (paged and fp8 caches, fp32, wider heads, the interpreter).
# H200, bf16 d128, max_seqlen_k given, GB/s against 64-4-2 (benchmarks/decode_ab.py,
# 2026-11-24): b64 x 4k 3,910 / 3,531, b1 x 128k 3,448 / 2,669, 32 kv heads 4,376 / 3,615,
# b16 x 16k 3,963 / 3,967; paged caches measured best at 64-4-2 (pages of 16 at 16k 3,693
# against 3,398). One such program fills an SM (3 stages of 128-key d128 tiles: ~136 KB of
# shared memory), so its split count fills whole waves of one program per SM: a split
# sweep (..._decode-splits-sweep_9cdfb5b.jsonl) found every shape fastest at the splits
# that just fit one wave (b4 x 64k: 4 splits, 128 programs, 4,174 GB/s; 5 splits, 160
# programs, 3,019) or at one split where the pairs fill waves; against the 4-per-SM aim
# before (..._decode-waves-rule-ab_9cdfb5b-wip.jsonl, GB/s, cuDNN in the same process):
# b1 x 128k 3,869 / 3,647 (cuDNN 3,841), b4 x 64k 4,174 / 4,027 (4,176), b16 x 16k 4,228
# / 4,088 (4,277), b64 x 4k 4,168 / 4,034 (4,208), b8 x 32k 4,151 / 3,901 (4,163).
WIDE = (128, 8, 1)
# ... and the same caches when a program holds more than 16 query rows (the GQA group x the
# new tokens: 32 for 8 tokens of a group of 4). H200, bf16 d128, b16 32/8 16k, 8 new tokens
# (decode_ab.py --multi --tokens 8, ..._decode-ab-multi_27997d6-wip.jsonl, GB/s against a
# 4,224 copy): 3,952 against WIDE's 3,539 (128-4-3-2 3,822, 128-8-3-4 3,574); with 4 new
# tokens (16 rows, WIDE's) the launches were within 3% of each other. Two such programs fit
# an SM, not three (shared memory: 77,824 bytes each at 3 stages), so since 2026-11-25 their
# split count fills whole waves of two: with the merge in the split kernel (MERGE), H200,
# one process, best of 3 (benchmarks/multi_launch_ab.py, benchmarks/results/
# 2026-11-25_h200_decode-multi-launch-ab_45dfb99.{txt,jsonl}), GB/s 64-4-3 (not whole waves)
# / this: b16 x 16k 4,042 / 4,109 (4 -> 2 splits), b64 x 4k 4,170 / 4,163, b4 x 64k 3,535 /
# 4,019 (13 -> 8 splits; 128-key blocks at one per SM 4,068, but 3,963 at b64 x 4k).
WIDE_MULTI = (64, 4, 2)
# ... and short ones (SHORT_KEYS or fewer) with (batch, kv head) pairs for two waves of two
# programs per SM: 64-key blocks, 4 warps, 4 stages, whole waves of 2 per SM. A WIDE
# program of 4-8 blocks spends much of its life filling and draining its pipeline, alone on
# its SM; two smaller ones overlap theirs. H200, bf16 d128, one new token, same process,
# best of 2 interleaved (benchmarks/decode_short_ab.py,
# benchmarks/results/2026-11-24_h200_decode-short-ab_cda48ed-wip.txt,
# GB/s, WIDE / this; cuDNN): b128 x 512 3,251 / 3,441 (3,518), b128 x 768 3,590 / 3,731
# (3,816), b128 x 1024 3,822 / 3,917 (3,978), b64 x 512 2,677 / 2,820 (2,931), b64 x 1024
# 3,350 / 3,422 (3,538); b16 x 1024 (128 pairs) 899 / 829: WIDE there. (Calls of under
# ~40 us, as b16 x 1024's, are bound by the host in that loop, not by the kernels.)
SHORT = (64, 4, 2)
SHORT_STAGES = 4
SHORT_KEYS = 1024
# Paged 16-bit caches at head dims <= 128 on a GPU: 128-key blocks, 4 warps, and the split
# count that fills whole waves of the 2 programs an SM holds (ncu at 32 query rows, 8 new
# tokens: 82 KB of shared memory and 255 registers a program, 2 resident by both). History:
# 64-key blocks at 3 programs per SM had won the paged A/B of 2026-11-24 (decode_ab.py
# --paged; ..._decode-paged-ab_48710d6.jsonl: b16 x 16k pages of 16 3,730 against 3,596 for
# these), and programs of more than 16 query rows (8 new tokens x a group of 4) took these
# already (3,159 against 2,622). Measured again on 2026-11-25, since the kernel reads one
# table entry per page (H200, bf16 d128, one process, best of 2; a scratch version of
# benchmarks/paged_launch_ab.py, benchmarks/results/2026-11-25_h200_paged-launch-ab_7e85611
# .{txt,jsonl}), GB/s (ratio to the contiguous cache in the same process), 64-4-3 / these:
# b16 x 16k pages of 16 4,018 (0.953) / 4,073 (0.966), b64 x 4k 3,943 (0.942) / 4,109
# (0.982), b128 x 512 3,201 (0.941) / 3,232 (0.950), b4 x 64k 4,068 (0.987) / 4,083 (0.991);
# 8 warps lost everywhere (0.62-0.98 of the contiguous cache). With pages of 256 and 16 query
# rows the 64-key launch stayed ahead (same run as below: b16 x 16k 0.915 against 0.967, b1 x
# 128k 0.934 against 0.960; with 8 new tokens 128-key blocks, 0.993), so programs of <= 16
# rows over pages of LARGE_PAGE keys or more kept it at first (PAGED_WAVES_LARGE_PAGES). Then
# pages of 256 once more (..._paged-launch-p256-ab_872fe60.{txt,jsonl}, 64-key / 128-key):
# 2 / 4 new tokens 0.944 / 0.980, 0.942 / 0.983; b128 x 512 0.949 / 0.968, b128 x 4k 0.958 /
# 0.996, b64 x 4k 0.958 / 1.000, but b16 x 16k with one new token 0.972 / 0.918 again: so the
# 64-key launch stays only for one new token over pages of LARGE_PAGE or more where the
# (batch, kv head) pairs do not fill PAGED_WAVES' slots (the keys are split: b16 x 16k, b1 x
# 128k; not understood why 2-4 new tokens do not lose there), and for pages whose size is not
# a power of two. The pages-of-16 rows confirmed in a second process
# (..._paged-launch-ab_3468bf3.{txt,jsonl}, best of 3, these / 64-4-3): pages of 16 b16 x
# 16k 0.974 / 0.959, b64 x 4k 0.982 / 0.947, b128 x 512 0.948 / 0.935, b4 x 64k 0.984 /
# 0.982, 2 / 4 new tokens 0.976 / 0.956, 0.974 / 0.956; 8 new tokens 0.900.
PAGED_WAVES = (128, 4, 2)
PAGED_WAVES_LARGE_PAGES = (64, 4, 3)
LARGE_PAGE = 128
# ... with two pipeline stages, not three, for programs of more than 16 query rows (8 new
# tokens; 255 registers a thread): H200, one process, best of 3 (paged_launch_ab.py,
# ..._paged-launch-t8-stages-ab_30c03ab.{txt,jsonl}), GB/s 3 / 2 / 4 stages: b16 x 16k pages
# of 16 3,661 / 3,671 / 3,659, b64 x 4k 3,614 / 3,746 / 3,614, pages of 256 3,938 / 3,954 /
# 3,956 (one program per SM: 0.52-0.85x of the contiguous cache).
PAGED_MULTI_STAGES = 2
# fp8 (e4m3) caches. H200 (benchmarks/fp8_decode.py --launches, one process each run,
# ..._fp8-decode-launches_b045090.jsonl and ..._fp8-decode_6f68b6b.jsonl), fp8 tokens/s over
# the bf16 cache's: contiguous 0.81-0.91 with 256-key blocks, 1.04-1.08 with WIDE's, 1.07-1.15
# with the defaults above (the run before, whose bf16 numbers were the same): the defaults
# (None); paged 1.01-1.05 with 128-key blocks, 0.57-0.73 with 64-key blocks and 0.57-0.76
# with the defaults.
WIDE_FP8 = None
PAGED_WAVES_FP8 = (128, 4, 3)
# Programmatic dependent launch (sm90+): each kernel of a decode step after the first (the
# device check) is launched while the one before it runs, and waits (``gdc_wait``) only
# where it reads what that one wrote: the append waits for the check, the split kernel for
# the append (without one it reads nothing the check writes and runs alongside it, its
# lengths clamped to the bound and its pages to the pool so that a bad one, which the check
# asserts on, is never read out of bounds), the combine for the splits. It hides the check
# (~1 us) and a kernel boundary per launch. ``DIYFA_DECODE_PDL=0`` turns it off.
PDL = os.environ.get("DIYFA_DECODE_PDL", "1") != "0"
# The splits' merge in the split kernel (MERGE): each program writes its partial output and
# LSE, then counts itself done on its block of rows' counter (an atomic add, the stores
# released with it); the one that counts last merges every split's partials (read from L2)
# and writes the output. No combine kernel: its launch, its wait for the whole split grid and
# its ~4k programs (8 new tokens of b16 x 32 heads) go. The counters (one per (batch x kv
# head, row block)) are zeroed by the device check's kernel, which every call runs first.
# Taken for contiguous caches cut into at most MERGE_SPLITS splits; the combine kernel
# (``_combine``) elsewhere. H200, bf16 d128, 32/8 heads, one process, best of 3 rounds
# (benchmarks/merge_ab.py, benchmarks/results/2026-11-25_h200_merge-ab_9155c2f.{txt,jsonl}),
# GB/s merge / combine: 8 new tokens b16 x 16k (4 splits) 4,036 / 3,916 (1.031; with sinks
# 1.031), one new token b4 x 64k (4) 1.001, b8 x 32k (2) 1.001; but b1 x 128k (16 splits)
# 0.977, pages of 256 (48) 0.926: one program reads the splits in turn, where the combine
# spreads them over the rows' programs; and paged caches at 32 query rows a program (2
# splits) 0.962 / 0.993 over pages of 16 / 256 (the merge's registers: 96 bytes of spills),
# 0.996-1.000 at 16 rows. Value heads wider than 256 (MLA's 512) and output tiles of more
# than MERGE_TILE values keep the combine kernel too: the merge's sum and the split's tile it
# loads spilled (ptxas, sm90a: 768 bytes at 64 rows x 512, 28 at 16 x 512 with two caches).
# MERGE = False: always the combine kernel (the A/B's other side).
MERGE = True
MERGE_SPLITS = 4
MERGE_TILE = 64 * 128
# Head dims above 256 (MLA's decode form: 576 / 512, one latent kv head shared by 16-128
# query heads). Programs of <= 16 query rows (16 heads a GPU at 8-way tensor parallelism):
# 32-key blocks (a 576-wide key tile is 36 KB in bf16), 4 warps, two programs per SM, three
# stages. More rows (128 heads: row blocks of WIDE_HEAD_ROWS = 64, wgmma tiles, whose Q
# operand, 64 x 576, stays in shared memory next to the ring): 64-key blocks, 8 warps, one
# program per SM, two stages (WIDE_HEAD_GROUP; three asked 288 KB); with two caches 32-key
# blocks (WIDE_HEAD_GROUP_TWO: a 64-key K and V pair is 136 KB a stage). H200, bf16, one new
# token, one process, best of 2 rounds (benchmarks/mla_decode.py,
# benchmarks/results/2026-11-25_h200_mla-decode-ab_64a71f6.txt; us, BLOCK_N-warps-rows-
# programs per SM[-stages]): 16 heads b128 x 8k 298 / 301 (95% of the copy) against 782 for
# 32-8-32-1 (this launch before), b16 x 32k 169 (84%) / 247; 128 heads b64 x 4k 64-8-64-1-2
# 284 (257 TFLOPS) against 32-8-64-1 336 and 32-8-32-1 704, pages of 64 312 / 420 / 862.
WIDE_HEAD = (32, 4, 2)
WIDE_HEAD_GROUP = (64, 8, 1)
WIDE_HEAD_GROUP_TWO = (32, 8, 1)
WIDE_HEAD_ROWS = 64
WIDE_HEAD_STAGES = 2
# ... fp32 caches (16 rows): 8 warps (4 spilled 21 KB at 32-key blocks; ptxas, sm90a).
WIDE_HEAD_FP32 = (32, 8, 1)
# GPUs with less shared memory a block than this (A100's 163 KB, the 99 KB of sm86 / sm89)
# run wide heads at 16 rows, fp32 with 16-key blocks: the 64-row tiles keep their 64 x 576 Q
# in shared memory next to the ring (205 KB at one stage), and fp32's 32-key tiles asked
# 104-110 KB (Triton's compiles for sm80 / sm89, 2026-11-25).
WIDE_HEAD_GROUP_SHARED = 200 * 1024
# An H100's / H200's shared memory a block (227 KB): the launch rules' stand-in off the GPU.
SM90_SHARED = 232448
# One latent cache (v_cache = k_cache[..., :dv]): the key tile serves as the value tile
# (V_IN_K) when True; when False the values are loaded again through v_cache's pointer (the
# same rows, from L2).
LATENT_REUSE = True


def wide_head_rows(elem_bytes: int, max_shared: int) -> int:
    """The most query rows a split program takes at head dims above 256: WIDE_HEAD_ROWS for
    16-bit caches on GPUs with WIDE_HEAD_GROUP_SHARED bytes of shared memory a block, else 16
    (an fp8 cache's widened 64-row tiles spilled ~300 bytes; fp32's 64 x 576 Q and key tiles,
    and 16-bit ones on smaller GPUs, would not fit shared memory)."""
    return WIDE_HEAD_ROWS if elem_bytes == 2 and max_shared >= WIDE_HEAD_GROUP_SHARED else 16


def head_chunks(d: int) -> tuple[int, int]:
    """The split kernel's (HEAD_DIM_PAD, HEAD_DIM_TAIL) for q's and k's head dim ``d``: up
    to 256 one power-of-two chunk (at least 16), no tail; above it the largest power of two
    not above ``d`` and a power-of-two tail for the rest (576 -> 512 + 64, 320 -> 256 + 64,
    512 -> 512 + 0), so a 576-wide head is not padded to 1024."""
    if d <= 256:
        return max(16, next_power_of_2(d)), 0
    main = 1 << (d.bit_length() - 1)
    return main, (max(16, next_power_of_2(d - main)) if d > main else 0)


def counters_per_sequence(q: torch.Tensor, k_cache: torch.Tensor) -> int:
    """How many of the split kernel's counters (:data:`MERGE`) a sequence needs at most: one
    per (kv head, row block), row blocks of at least 16 of the group's query rows."""
    kv_heads = k_cache.shape[2]
    return kv_heads * cdiv(q.shape[2] // kv_heads * q.shape[1], 16)


def pdl_on(device: torch.device) -> bool:
    """Whether a decode step on ``device`` chains its kernels by programmatic dependent
    launch (:data:`PDL`, a CUDA GPU of compute capability 9 or more)."""
    return PDL and device.type == "cuda" and kernel_limits(device.index)["capability_major"] >= 9


def launch_config(paged: bool, d_pad: int, dv_pad: int, elem_bytes: int, on_gpu: bool,
                  block_m: int = 16, latent: bool = False, max_shared: int = SM90_SHARED,
                  page: int = 0, split_one_token: bool = False) -> tuple[int, int, int, bool]:
    """(BLOCK_N, warps, programs per SM, whole waves) of a decode call (see WIDE, WIDE_MULTI,
    PAGED_WAVES and PAGED_WAVES_LARGE_PAGES; whole waves: :func:`pick_splits` counts the
    programs per SM as the ones resident and fills whole waves of them). ``block_m``: the
    query rows of a program (the GQA group x new tokens, padded); paged fp8 programs of more
    than 16 rows hold more registers, so at most 2 of them run an SM. ``page``: a paged
    cache's page size; ``split_one_token``: one new token a sequence, and too few (batch, kv
    head) pairs to fill PAGED_WAVES' slots without splitting the keys. Head dims above 256:
    WIDE_HEAD and its group launches (``latent``: one latent cache, the key tile read as the
    value tile; fp32 with 16-key blocks below WIDE_HEAD_GROUP_SHARED bytes of
    ``max_shared``)."""
    narrow = on_gpu and elem_bytes <= 2 and max(d_pad, dv_pad) <= 128
    wide, paged_waves = (WIDE_FP8, PAGED_WAVES_FP8) if elem_bytes == 1 else (WIDE, PAGED_WAVES)
    if max(d_pad, dv_pad) > 256:  # (d_pad: both chunks)
        if elem_bytes == 4:
            block_n, warps, per_sm = WIDE_HEAD_FP32
            return (block_n if max_shared >= WIDE_HEAD_GROUP_SHARED else 16), warps, per_sm, True
        return (*(WIDE_HEAD if block_m <= 16 else WIDE_HEAD_GROUP if latent
                  else WIDE_HEAD_GROUP_TWO), True)  # fmt: skip
    if wide and narrow and not paged:
        return (*wide, True) if block_m <= 16 else (*WIDE_MULTI, True)
    if paged_waves and narrow and paged:
        block_n, warps, per_sm = paged_waves
        if elem_bytes == 2 and block_m <= 16 and (
                (page >= LARGE_PAGE and split_one_token) or page & (page - 1)):
            # (pages whose size is not a power of two too: the kernel reads their table per
            # key, and only the read per page was measured with PAGED_WAVES)
            block_n, warps, per_sm = PAGED_WAVES_LARGE_PAGES
        return block_n, warps, per_sm if block_m <= 16 else min(per_sm, 2), True
    return BLOCK_N, NUM_WARPS, PROGRAMS_PER_SM, False


def short_cache(keys: int, pairs: int, sms: int) -> bool:
    """Whether a call that :func:`launch_config` gives WIDE's launch (a contiguous 16-bit
    cache at head dims <= 128 on a GPU, <= 16 query rows a program) takes SHORT's instead:
    at most SHORT_KEYS keys, and (batch, kv head) pairs for 90% of two waves of SHORT's
    programs on ``sms`` SMs."""
    return keys <= SHORT_KEYS and pairs >= 0.9 * 2 * SHORT[2] * sms


def split_stages(d_pad: int, dv_pad: int, elem_bytes: int, max_shared: int,
                 block_n: int = BLOCK_N, most: int = 3) -> int:
    """The split kernel's pipeline depth: ``most`` (3; SHORT_STAGES for SHORT's launch), or
    fewer where the K and V tiles it keeps in flight would not fit the GPU's shared memory.
    Triton's pipeliner holds ``stages - 1`` of them (plus ~20 KB of other buffers: fp32 at
    padded head dim 256 asked 282,688 bytes at 3 stages, against the H200's 232,448 (found
    by tests/test_fuzz.py))."""
    tile = block_n * (d_pad + dv_pad) * elem_bytes
    for stages in range(most, 1, -1):
        if (stages - 1) * tile + 32 * 1024 <= max_shared:
            return stages
    return 1


@triton.jit
def _decode_split(Q, K, V, BLOCK_TABLE, CACHE_SEQLENS, O_PART, LSE_PART, O, LSE, COUNTERS,
                  SINK_LOGITS,
                  stride_qb, stride_qs, stride_qh, stride_qd,
                  stride_ob, stride_os, stride_oh, stride_od,
                  stride_kb, stride_ks, stride_kh, stride_kd,
                  stride_vb, stride_vs, stride_vh, stride_vd,
                  stride_tb, page_size, pool, max_len,
                  kv_heads, kv_group, seqlen_q, split_len, qk_scale, batch, seqlen_add,
                  window_left, window_right, tanh_scale, SLOPES, stride_slopes_b,
                  K_DESCALE, V_DESCALE, stride_descale_b,
                  HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                  HEAD_DIM_V_PAD: tl.constexpr, CAUSAL: tl.constexpr,
                  PAGED: tl.constexpr, PRECISION: tl.constexpr, WINDOW: tl.constexpr,
                  SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, FP8: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr,
                  PDL: tl.constexpr, PDL_WAIT: tl.constexpr, PAGE: tl.constexpr,
                  HEAD_DIM_TAIL: tl.constexpr = 0, V_IN_K: tl.constexpr = False,
                  MERGE: tl.constexpr = False, SINKS: tl.constexpr = False):
    """Program (batch x kv head, split, row block): the query rows of the kv head's group against
    the split's keys. Rows are (head in group, query) pairs, r -> head r // seqlen_q, query r %
    seqlen_q; one decode step's rows usually fit one block. DIRECT (one split, no sinks): the rows'
    output and LSE go to O and LSE themselves, what :func:`_combine` would make of a single split
    (bitwise), and no combine runs. MERGE (else a combine kernel follows): the last program of a
    block of rows' splits to finish merges them (:func:`_merge_splits`, with the head's sink logit
    when SINKS), counting on COUNTERS[batch + (batch x kv head) * row blocks + row block], which the
    device check zeroed. PDL: launched while the kernel before it runs (see :data:`PDL`); PDL_WAIT:
    that kernel wrote the cache (the append), so the keys are read only once it is done. Lengths are
    clamped to ``max_len`` (the bound) and pages to the pool [0, ``pool``): a no-op for checked
    inputs, and no read out of bounds for bad ones while the device check, which asserts on them,
    runs alongside. PAGE: the page size where it is a power of two (a block then reads one table
    entry per page it covers, not one per key, and divides by shifts), else 0.

    Head dims above 256 (MLA's decode form, 576 / 512: :func:`head_chunks`): q's and k's
    columns are two power-of-two chunks, [0, HEAD_DIM_PAD) and HEAD_DIM_TAIL more after
    it, and the scores are the sum of the two products. V_IN_K: the values are the keys'
    first HEAD_DIM_V (= HEAD_DIM_PAD) columns (v_cache a view of k_cache, MLA's one latent
    cache): the key tile is used as the value tile, so each cache byte is read once."""
    if PDL:
        gdc_launch_dependents()  # the combine may be launched (it waits for this grid)
    off_bhk = tl.program_id(0)
    split = tl.program_id(1)
    off_b = (off_bhk // kv_heads).to(tl.int64)
    off_hk = (off_bhk % kv_heads).to(tl.int64)
    seqlen_k = tl.minimum(tl.load(CACHE_SEQLENS + off_b) + seqlen_add, max_len)  # appended too
    alibi_offset = seqlen_k - seqlen_q  # bottom-right
    causal_offset = alibi_offset + window_right  # key j <= i + causal_offset (CAUSAL)
    left_offset = alibi_offset - window_left  # key j >= i + left_offset (WINDOW)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, seqlen_k)
    if CAUSAL:
        hi = tl.minimum(hi, tl.maximum(seqlen_q + causal_offset, 0))
    if WINDOW:  # query 0 sees nothing left of left_offset: skip those blocks
        lo = tl.maximum(lo, tl.maximum(left_offset, 0) // BLOCK_N * BLOCK_N)

    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    head = off_hk * kv_group + rows // seqlen_q
    qpos = rows % seqlen_q
    row_ok = rows < kv_group * seqlen_q
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)  # the value / output head dim
    dv_ok = offs_dv < HEAD_DIM_V
    q_rows = Q + off_b * stride_qb + qpos[:, None] * stride_qs + head[:, None] * stride_qh
    q = tl.load(q_rows + offs_d[None, :] * stride_qd, mask=row_ok[:, None] & d_ok[None, :],
                other=0.0)  # fmt: skip
    if HEAD_DIM_TAIL:  # the columns past the first chunk (e.g. 512..575)
        offs_t = HEAD_DIM_PAD + tl.arange(0, HEAD_DIM_TAIL)
        t_ok = offs_t < HEAD_DIM
        q_t = tl.load(q_rows + offs_t[None, :] * stride_qd, mask=row_ok[:, None] & t_ok[None, :],
                      other=0.0)  # fmt: skip
    if FP8:  # e4m3 cache: its descales fold into the scores' scale and the output
        k_descale = tl.load(K_DESCALE + off_b * stride_descale_b + off_hk)
        v_descale = tl.load(V_DESCALE + off_b * stride_descale_b + off_hk)
        if not PAGED:
            # Contiguous caches: the dots run in fp16. e4m3 widens to fp16 in one instruction
            # per two values (to bf16 in several on sm90, which left the fp8 cache
            # issue-bound: ncu, 2026-11-24). q goes to fp16 times a power of two that keeps
            # it in range (exact but for values under 2^-24 of its largest), the power back in
            # the scores' scale. (Paged caches measured slower this way, 0.73x against 1.02x
            # the bf16 cache's tokens/s, not yet understood: they widen to q's dtype.)
            q_max = tl.max(tl.max(tl.abs(q.to(tl.float32)), 1), 0)
            if HEAD_DIM_TAIL:
                q_max = tl.maximum(q_max, tl.max(tl.max(tl.abs(q_t.to(tl.float32)), 1), 0))
            q_exp = tl.maximum(tl.math.ceil(tl.math.log2(q_max) - 15.0), 0.0)
            q = (q.to(tl.float32) * tl.math.exp2(-q_exp)).to(tl.float16)
            if HEAD_DIM_TAIL:
                q_t = (q_t.to(tl.float32) * tl.math.exp2(-q_exp)).to(tl.float16)
            k_descale = k_descale * tl.math.exp2(q_exp)
        if SOFTCAP:
            tanh_scale = tanh_scale * k_descale
        else:
            qk_scale = qk_scale * k_descale
    if ALIBI:  # one slope per row (its head), times log2(e)
        slope2 = tl.load(SLOPES + off_b * stride_slopes_b + head, mask=row_ok,
                         other=0.0) * 1.4426950408889634  # fmt: skip

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_V_PAD], dtype=tl.float32)
    if PDL_WAIT:
        gdc_wait()
    for start_n in tl.range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        if PAGED and PAGE >= BLOCK_N:  # the block lies in one page: one table entry
            page = tl.load(BLOCK_TABLE + off_b * stride_tb + start_n // PAGE).to(tl.int64)
            page = tl.minimum(tl.maximum(page, 0), pool - 1)
            within = (start_n % PAGE + tl.arange(0, BLOCK_N)).to(tl.int64)
            k_rows = page * stride_kb + within * stride_ks
            v_rows = page * stride_vb + within * stride_vs
        elif PAGED and PAGE > 0:  # BLOCK_N // PAGE whole pages: their entries, one each
            pages = start_n // PAGE + tl.arange(0, BLOCK_N // PAGE)
            page = tl.load(BLOCK_TABLE + off_b * stride_tb + pages, mask=pages * PAGE < hi,
                           other=0).to(tl.int64)  # fmt: skip
            page = tl.minimum(tl.maximum(page, 0), pool - 1)
            page = tl.reshape(tl.broadcast_to(page[:, None], (BLOCK_N // PAGE, PAGE)),
                              (BLOCK_N,))  # fmt: skip
            within = (tl.arange(0, BLOCK_N) % PAGE).to(tl.int64)
            k_rows = page * stride_kb + within * stride_ks
            v_rows = page * stride_vb + within * stride_vs
        elif PAGED:  # any page size: an entry per key
            page = tl.load(BLOCK_TABLE + off_b * stride_tb + offs_n // page_size, mask=n_ok,
                           other=0).to(tl.int64)  # fmt: skip
            page = tl.minimum(tl.maximum(page, 0), pool - 1)
            k_rows = page * stride_kb + (offs_n % page_size) * stride_ks
            v_rows = page * stride_vb + (offs_n % page_size) * stride_vs
        else:
            k_rows = off_b * stride_kb + offs_n.to(tl.int64) * stride_ks
            v_rows = off_b * stride_vb + offs_n.to(tl.int64) * stride_vs
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(K + k_rows[:, None] + off_hk * stride_kh + offs_d[None, :] * stride_kd,
                    mask=kv_mask, other=0.0)
        if FP8:  # exact in fp16 / bf16 (q's dtype): e4m3 has fewer exponent and mantissa bits
            k = k.to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if HEAD_DIM_TAIL:
            k_t = tl.load(K + k_rows[:, None] + off_hk * stride_kh + offs_t[None, :] * stride_kd,
                          mask=n_ok[:, None] & t_ok[None, :], other=0.0)  # fmt: skip
            if FP8:
                k_t = k_t.to(q.dtype)
            qk = tl.dot(q_t, tl.trans(k_t), qk, input_precision=PRECISION)
        if SOFTCAP:
            qk = _tanh(qk * tanh_scale, PRECISION)
        qk = qk * qk_scale
        if ALIBI:
            qk = qk - slope2[:, None] * tl.abs((qpos + alibi_offset).to(tl.float32)[:, None]
                                               - offs_n.to(tl.float32)[None, :])  # fmt: skip
        keep = n_ok[None, :] & row_ok[:, None]
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= qpos[:, None] + causal_offset)
        if WINDOW:
            keep = keep & (offs_n[None, :] >= qpos[:, None] + left_offset)
        qk = tl.where(keep, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet: no NaN
        p = tl.math.exp2(qk - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_IN_K:  # (k already in q's dtype; keys past hi are zero rows)
            v = k
        else:
            v = tl.load(V + v_rows[:, None] + off_hk * stride_vh + offs_dv[None, :] * stride_vd,
                        mask=n_ok[:, None] & dv_ok[None, :], other=0.0)  # fmt: skip
            if FP8:
                v = v.to(q.dtype)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)  # (log2 of 0 would be -inf, then replaced anyway)
    acc = acc / l_safe[:, None]
    if FP8:
        acc = acc * v_descale
    lse2 = tl.where(empty, float("-inf"), m_i + tl.math.log2(l_safe))
    # The rows' index in LSE (batch, heads, seqlen_q); split s's workspace rows follow
    # s * rows_per_split on.
    heads = kv_heads * kv_group
    row = (off_b * heads + head) * seqlen_q + qpos
    if DIRECT:
        _store_rows(O, LSE, acc, lse2, row, off_b, qpos, head, row_ok, offs_dv, dv_ok,
                    stride_ob, stride_os, stride_oh, stride_od)  # fmt: skip
    else:
        rows_per_split = batch * heads * seqlen_q
        ws_row = split * rows_per_split + row
        tl.store(LSE_PART + ws_row, lse2, mask=row_ok)
        tl.store(O_PART + ws_row[:, None] * HEAD_DIM_V_PAD + offs_dv[None, :], acc,
                 mask=row_ok[:, None])  # fmt: skip
        if MERGE:  # the last of these rows' splits to finish merges them
            if PDL and not PDL_WAIT:
                gdc_wait()  # (the device check zeroes the counters)
            tl.debug_barrier()  # every thread's stores are the CTA's before the count
            slot = off_bhk * tl.num_programs(2) + tl.program_id(2)
            done = tl.atomic_add(COUNTERS + batch + slot, 1, sem="acq_rel", scope="gpu")
            if done == tl.num_programs(1) - 1:
                out, lse = _merge_splits(O_PART, LSE_PART, SINK_LOGITS, row, head, row_ok,
                                         offs_dv, rows_per_split, tl.num_programs(1),
                                         HEAD_DIM_V_PAD, SINKS)  # fmt: skip
                _store_rows(O, LSE, out, lse, row, off_b, qpos, head, row_ok, offs_dv, dv_ok,
                            stride_ob, stride_os, stride_oh, stride_od)  # fmt: skip


@triton.jit
def _store_rows(O, LSE, out, lse2, row, off_b, qpos, head, row_ok, offs_dv, dv_ok,
                stride_ob, stride_os, stride_oh, stride_od):
    """A block of rows' final output (in O's dtype) and base-2 LSE."""
    tl.store(LSE + row, lse2, mask=row_ok)
    tl.store(O + off_b * stride_ob + qpos[:, None] * stride_os + head[:, None] * stride_oh
             + offs_dv[None, :] * stride_od, out.to(O.dtype.element_ty),
             mask=row_ok[:, None] & dv_ok[None, :])  # fmt: skip


@triton.jit
def _merge_splits(O_PART, LSE_PART, SINK_LOGITS, row, head, row_ok, offs_dv, rows_per_split,
                  num_splits, HEAD_DIM_V_PAD: tl.constexpr, SINKS: tl.constexpr):
    """(out, lse2) of a block of rows from every split's partial output and LSE in the
    workspace: lse = log2(sum_s 2^lse_s + 2^sink), out = sum_s 2^(lse_s - lse) * out_s; the
    head's sink logit (SINKS) joins the denominator once, with no value. Rows whose splits
    all saw no key (and no sink): zeros, -inf. The loads bypass L1 (other SMs wrote them)."""
    m = tl.full(row.shape, float("-inf"), dtype=tl.float32)
    for s in range(0, num_splits):
        m = tl.maximum(m, tl.load(LSE_PART + s * rows_per_split + row, mask=row_ok,
                                  other=float("-inf"), cache_modifier=".cg"))  # fmt: skip
    if SINKS:
        sink2 = tl.load(SINK_LOGITS + head, mask=row_ok, other=0.0).to(tl.float32)
        sink2 = sink2 * 1.4426950408889634  # (base 2)
        m = tl.maximum(m, sink2)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    total = tl.zeros(row.shape, dtype=tl.float32)
    out = tl.zeros([row.shape[0], HEAD_DIM_V_PAD], dtype=tl.float32)
    for s in range(0, num_splits):
        ws_row = s * rows_per_split + row
        w = tl.math.exp2(tl.load(LSE_PART + ws_row, mask=row_ok, other=float("-inf"),
                                 cache_modifier=".cg") - m_use)  # fmt: skip
        o_s = tl.load(O_PART + ws_row[:, None] * HEAD_DIM_V_PAD + offs_dv[None, :],
                      mask=row_ok[:, None], other=0.0, cache_modifier=".cg")  # fmt: skip
        total += w
        out += o_s * w[:, None]
    if SINKS:
        total += tl.math.exp2(sink2 - m_use)
    total_safe = tl.where(total == 0.0, 1.0, total)
    lse2 = tl.where(total == 0.0, float("-inf"), m_use + tl.math.log2(total_safe))
    return out / total_safe[:, None], lse2


@triton.jit
def _combine(O_PART, LSE_PART, O, LSE, SINK_LOGITS, rows_per_split, seqlen_q, heads,
             num_splits, stride_ob, stride_os, stride_oh, stride_od,
             NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
             SINKS: tl.constexpr, PDL: tl.constexpr):
    """Program per (batch, head, query) row: merge the ``num_splits`` splits' partial
    outputs (read as NUM_SPLITS, the next power of two: the extra slots count as empty) and
    the head's sink logit, which joins the denominator once, with no value. PDL: launched
    while the split kernel runs; it waits for it before reading."""
    if PDL:
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)  # (b * heads + h) * seqlen_q + s
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    splits = tl.arange(0, NUM_SPLITS)
    s_ok = splits < num_splits
    lse_s = tl.load(LSE_PART + splits * rows_per_split + row, mask=s_ok, other=float("-inf"))
    m = tl.max(lse_s, 0)
    if SINKS:
        sink2 = tl.load(SINK_LOGITS + (row // seqlen_q) % heads).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink2)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(lse_s - m_use)
    total = tl.sum(w, 0)
    if SINKS:
        total += tl.math.exp2(sink2 - m_use)
    o_s = tl.load(O_PART + (splits[:, None] * rows_per_split + row) * HEAD_DIM_PAD
                  + offs_d[None, :], mask=s_ok[:, None], other=0.0)  # fmt: skip
    total_safe = tl.where(total == 0.0, 1.0, total)
    out = tl.sum(o_s * w[:, None], 0) / total_safe
    lse2 = tl.where(total == 0.0, float("-inf"), m_use + tl.math.log2(total_safe))
    tl.store(LSE + row, lse2)
    s = row % seqlen_q
    bh = row // seqlen_q
    o_ptr = O + (bh // heads) * stride_ob + s * stride_os + (bh % heads) * stride_oh
    tl.store(o_ptr + offs_d * stride_od, out.to(O.dtype.element_ty), mask=offs_d < HEAD_DIM)


# The unchecked call's fault, as the status kernel's device-side assert (and the CPU's
# RuntimeError) states it.
ASSERT_MESSAGE = tl.constexpr("flash_attention_with_kvcache: cache_seqlens + the new tokens "
                              "outside [0, max_seqlen_k], or a page outside the pool")


@triton.jit(debug=True)  # its device_assert (ASSERT) is compiled in; nothing else here
def _cache_status(CACHE_SEQLENS, BLOCK_TABLE, STATUS, s_new, limit, stride_tb, max_blocks,
                  page_size, pool, counters, PAGED: tl.constexpr, BLOCK_P: tl.constexpr,
                  ASSERT: tl.constexpr, PDL: tl.constexpr):
    """Program per sequence b: STATUS[b] = its cache length after the append, or -1 when
    that is outside [s_new, limit] (cache_seqlens[b] negative, or the cache too short), or -2
    when (PAGED) one of the pages it uses is outside the pool [0, pool). ASSERT: a fault
    also stops the stream with a device-side assert naming it (the unchecked path). PDL: the
    next kernel (:data:`PDL`) may be launched at once. ``counters``: the split kernel's
    counters per sequence (:data:`MERGE`), after the batch's STATUS entries: zeroed here."""
    if PDL:
        gdc_launch_dependents()
    b = tl.program_id(0)
    n = tl.load(CACHE_SEQLENS + b).to(tl.int64)  # n + s_new never overflows (int32 max + 1)
    status = tl.where((n < 0) | (n > limit - s_new), -1, n + s_new)
    if PAGED:
        used = tl.minimum((tl.maximum(status, 0) + page_size - 1) // page_size, max_blocks)
        bad = tl.zeros([BLOCK_P], dtype=tl.int32)
        for p0 in range(0, used, BLOCK_P):
            offs = p0 + tl.arange(0, BLOCK_P)
            page = tl.load(BLOCK_TABLE + b.to(tl.int64) * stride_tb + offs, mask=offs < used,
                           other=0)  # fmt: skip
            bad += ((page < 0) | (page >= pool)).to(tl.int32)
        status = tl.where((status >= 0) & (tl.sum(bad, 0) > 0), -2, status)
    tl.store(STATUS + b, status.to(tl.int32))  # -2, -1 or a length <= limit
    mine = STATUS + tl.num_programs(0) + b.to(tl.int64) * counters
    for c0 in range(0, counters, BLOCK_P):
        offs = c0 + tl.arange(0, BLOCK_P)
        tl.store(mine + offs, tl.zeros([BLOCK_P], dtype=tl.int32), mask=offs < counters)
    if ASSERT:
        tl.device_assert(status >= 0, ASSERT_MESSAGE)


def cache_status(cache_seqlens: torch.Tensor, block_table: torch.Tensor | None, s_new: int,
                 limit: int, pool: int, page_size: int, asserted: bool = False,
                 launched: list | None = None, counters: int = 0) -> torch.Tensor:
    """Each sequence's cache length after an append of ``s_new`` tokens, checked on the
    device (int32 (batch,); -1: outside [s_new, limit], -2: a used page outside the pool):
    one small kernel, so the checked path reads everything back at once and the unchecked
    one (``max_seqlen_k`` given) can assert without a synchronisation. ``asserted``: a fault
    stops the stream (on a GPU, the kernel's own device-side assert, with its message; on
    the CPU, ``torch._assert_async``, a RuntimeError). ``launched``: a list that gets the GPU
    launch's (fn, kernel, grid, args), for a Replay. ``counters``: that many zeros per
    sequence follow the batch's entries (the split kernel's counters,
    :func:`counters_per_sequence`): the tensor is (batch * (1 + counters),) then."""
    b = cache_seqlens.shape[0]
    status = torch.empty((b * (1 + counters),), dtype=torch.int32, device=cache_seqlens.device)
    if b == 0:
        return status
    paged = block_table is not None
    args = dict(CACHE_SEQLENS=cache_seqlens, BLOCK_TABLE=block_table if paged else cache_seqlens,
                STATUS=status, s_new=s_new, limit=limit,
                stride_tb=block_table.stride(0) if paged else 0,
                max_blocks=block_table.shape[1] if paged else 0, page_size=page_size,
                pool=pool, counters=counters, PAGED=paged, BLOCK_P=1024,
                ASSERT=asserted and cache_seqlens.is_cuda,
                PDL=pdl_on(cache_seqlens.device))  # fmt: skip
    launch_recorded(_cache_status, (b,), args, cache_seqlens.is_cuda, launched)
    if asserted and not cache_seqlens.is_cuda:  # (the interpreter ignores a device_assert)
        torch._assert_async(status[:b].min() >= 0, ASSERT_MESSAGE.value)
    return status


@triton.jit
def _append(K_NEW, V_NEW, K_CACHE, V_CACHE, CACHE_SEQLENS, BLOCK_TABLE, K_DESCALE, V_DESCALE,
            stride_nb, stride_ns, stride_nh, stride_nd, stride_wb, stride_ws, stride_wh, stride_wd,
            stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
            stride_tb, page_size, capacity, kv_heads, stride_descale_b,
            HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_H: tl.constexpr,
            BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PAGED: tl.constexpr,
            FP8: tl.constexpr, PDL: tl.constexpr, WRITE_V: tl.constexpr = True):
    """Program (sequence b, new token t): k_new[b, t] and v_new[b, t] (every kv head) into
    cache row cache_seqlens[b] + t (paged: through the block table), quantised to e4m3 with
    the descales when FP8. Rows outside [0, capacity) are not written (the checks reject
    them before; this keeps a write inside the cache even so). PDL: launched while the
    device check runs; nothing is written before that check is done. WRITE_V off: v_cache
    is k_cache's leading columns (and v k's), which the keys' write fills."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)  # (the new tokens on axis 0: past 65535 of them too)
    b = tl.program_id(1).to(tl.int64)
    pos = tl.load(CACHE_SEQLENS + b) + t
    ok = (pos >= 0) & (pos < capacity)
    pos = tl.where(ok, pos, 0).to(tl.int64)
    if PAGED:
        page = tl.load(BLOCK_TABLE + b * stride_tb + pos // page_size).to(tl.int64)
        k_row = page * stride_kb + (pos % page_size) * stride_ks
        v_row = page * stride_vb + (pos % page_size) * stride_vs
    else:
        k_row = b * stride_kb + pos * stride_ks
        v_row = b * stride_vb + pos * stride_vs
    h = tl.arange(0, BLOCK_H).to(tl.int64)  # h * stride may pass 2^31 (head-major caches)
    h_ok = (h < kv_heads) & ok
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k_mask = h_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    v_mask = h_ok[:, None] & (offs_dv < HEAD_DIM_V)[None, :]
    k = tl.load(K_NEW + b * stride_nb + t * stride_ns + h[:, None] * stride_nh
                + offs_d[None, :] * stride_nd, mask=k_mask)  # fmt: skip
    v = tl.load(V_NEW + b * stride_wb + t * stride_ws + h[:, None] * stride_wh
                + offs_dv[None, :] * stride_wd, mask=v_mask)  # fmt: skip
    if FP8:  # divided by the (sequence's) head's descale, clamped to e4m3's range, cast
        k_scale = tl.load(K_DESCALE + b * stride_descale_b + h, mask=h_ok, other=1.0)
        v_scale = tl.load(V_DESCALE + b * stride_descale_b + h, mask=h_ok, other=1.0)
        # IEEE division (a plain / is approximate on the GPU) and NaN kept, as torch's
        # (x.float() / descale).clamp(-448, 448).to(float8_e4m3fn) does
        k = tl.clamp(tl.math.div_rn(k.to(tl.float32), k_scale[:, None]), -448.0, 448.0,
                     propagate_nan=tl.PropagateNan.ALL)  # fmt: skip
        v = tl.clamp(tl.math.div_rn(v.to(tl.float32), v_scale[:, None]), -448.0, 448.0,
                     propagate_nan=tl.PropagateNan.ALL)  # fmt: skip
    tl.store(K_CACHE + k_row + h[:, None] * stride_kh + offs_d[None, :] * stride_kd,
             k.to(K_CACHE.dtype.element_ty), mask=k_mask)  # fmt: skip
    if WRITE_V:
        tl.store(V_CACHE + v_row + h[:, None] * stride_vh + offs_dv[None, :] * stride_vd,
                 v.to(V_CACHE.dtype.element_ty), mask=v_mask)  # fmt: skip


def append(k, v, k_cache, v_cache, cache_seqlens, block_table, k_descale=None,
           v_descale=None, launched: list | None = None) -> None:
    """Write the new tokens k, v (batch, s_new, kv_heads, d / dv) into the cache at rows
    cache_seqlens[b] .. + s_new - 1, in place: one kernel (the checks have run).
    ``launched``: as for :func:`cache_status`."""
    b, s_new, hk, d = k.shape
    dv = v.shape[3]
    paged = block_table is not None
    fp8 = k_descale is not None
    capacity = k_cache.shape[1] * (block_table.shape[1] if paged else 1)
    sn, sw, sk, sv = k.stride(), v.stride(), k_cache.stride(), v_cache.stride()
    args = dict(K_NEW=k, V_NEW=v, K_CACHE=k_cache, V_CACHE=v_cache,
                CACHE_SEQLENS=cache_seqlens, BLOCK_TABLE=block_table if paged else cache_seqlens,
                K_DESCALE=k_descale if fp8 else cache_seqlens,
                V_DESCALE=v_descale if fp8 else cache_seqlens,
                stride_nb=sn[0], stride_ns=sn[1], stride_nh=sn[2], stride_nd=sn[3],
                stride_wb=sw[0], stride_ws=sw[1], stride_wh=sw[2], stride_wd=sw[3],
                stride_kb=sk[0], stride_ks=sk[1], stride_kh=sk[2], stride_kd=sk[3],
                stride_vb=sv[0], stride_vs=sv[1], stride_vh=sv[2], stride_vd=sv[3],
                stride_tb=block_table.stride(0) if paged else 0,
                page_size=k_cache.shape[1] if paged else 1, capacity=capacity, kv_heads=hk,
                stride_descale_b=k_descale.stride(0) if fp8 and k_descale.dim() == 2 else 0,
                HEAD_DIM=d, HEAD_DIM_V=dv, BLOCK_H=next_power_of_2(hk),
                BLOCK_D=next_power_of_2(d), BLOCK_DV=next_power_of_2(dv), PAGED=paged,
                FP8=fp8, PDL=pdl_on(k.device),
                WRITE_V=not values_in_keys(k_cache, v_cache))  # fmt: skip
    if b * s_new == 0:
        return
    launch_recorded(_append, (s_new, b), args, k.is_cuda, launched,
                    meta={"launch_pdl": args["PDL"]})  # fmt: skip


def pick_splits(batch: int, kv_heads: int, max_seqlen_k: int, device: torch.device,
                block_n: int = BLOCK_N, per_sm: int = PROGRAMS_PER_SM,
                waves: bool = False) -> int:
    """Splits so that about ``per_sm`` programs per SM run: a long cache with few (batch,
    kv head) pairs is cut into more ranges; never ranges shorter than 4 blocks of keys, nor
    more than 64. ``waves``: ``per_sm`` programs fit an SM at once; the fewest splits whose
    last wave uses 90% of the slots, else the best filled."""
    sms = 4 if device.type != "cuda" else kernel_limits(device.index)["sm_count"]
    pairs = max(1, batch * kv_heads)
    most = max(1, min(cdiv(max_seqlen_k, 4 * block_n), 64))
    if not waves:
        return max(1, min(cdiv(per_sm * sms, pairs), most))
    slots = per_sm * sms
    best, best_fill = 1, 0.0
    for n in range(1, most + 1):
        programs = pairs * n
        fill = programs / (cdiv(programs, slots) * slots)
        if fill >= 0.9:
            return n
        if fill > best_fill + 1e-9:
            best, best_fill = n, fill
    return best


def append_and_attend(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal: bool,
                      softmax_scale, num_splits: int, window_size=(-1, -1), softcap=0.0,
                      alibi_slopes=None, sinks=None, k_descale=None, v_descale=None,
                      max_seqlen_k=None):
    """``flash_attention_with_kvcache``'s work, for the eager call and the custom op alike:
    every check first (nothing is written on an error), then k/v appended in place at rows
    cache_seqlens[b].. (:func:`append`, only those rows), then attention. Returns (out,
    lse2) with lse2 base 2. ``max_seqlen_k``: the caller's bound on the lengths after the
    append; the checks then run on the device without a read back (see
    ``check_kvcache_lengths``).

    A call with ``max_seqlen_k`` on a GPU whose signature (:func:`_signature`: everything
    the checks and the launches read but the tensors' addresses and the lengths' and pages'
    values) an earlier call had runs that call's launches again (``_PREPARED``, a
    :class:`~diyfa._launcher.Replay`: the device check, the append, the split and combine
    kernels) with its own tensors, the host checks skipped: they passed for that signature,
    and the values are checked on the device by the replayed check as before."""
    from diyfa.attention.checks import (
        check_bias_tensors,
        check_fp8_cache,
        check_kvcache_inputs,
        check_kvcache_lengths,
        check_tanh_scale,
        check_variants,
    )

    tensors = (q, k_cache, v_cache, k, v, cache_seqlens, block_table, alibi_slopes, sinks,
               k_descale, v_descale)  # fmt: skip
    sig = None
    if max_seqlen_k is not None and isinstance(q, torch.Tensor) and q.is_cuda:
        # (whether v_cache is k_cache's leading columns, v k's, and the descales one
        # tensor: the checks and the kernels differ, and such a pair is one role: _roles)
        sig = _signature(tensors, (causal, softmax_scale, num_splits, window_size, softcap,
                                   max_seqlen_k, values_in_keys(k_cache, v_cache),
                                   values_in_keys(k, v), _one_tensor(k_descale, v_descale)))
        try:
            prepared = None if sig is None else _PREPARED.get(sig)
        except TypeError:  # an unhashable option: the checks will say what is wrong with it
            sig = prepared = None
        if prepared is not None:
            replay, shapes = prepared
            work = tuple(None if shape is None else torch.empty(shape, dtype=dtype,
                                                                device=q.device)
                         for shape, dtype in shapes)  # fmt: skip
            if replay.run(_roles(tensors, work)):
                return work[3], work[4]
    fp8 = check_fp8_cache(q, k_cache, v_cache, k_descale, v_descale)
    scale = check_kvcache_inputs(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                                 block_table=block_table, causal=causal,
                                 softmax_scale=softmax_scale, num_splits=num_splits, fp8=fp8,
                                 max_seqlen_k=max_seqlen_k)  # fmt: skip
    left, right, softcap = check_variants(window_size, softcap, causal)
    check_tanh_scale(scale, softcap)
    check_bias_tensors(alibi_slopes, sinks, q.shape[0], q.shape[2], q.device)
    s_new = 0 if k is None else k.shape[1]
    launched = [] if sig is not None else None
    # Every host check has passed: the lengths and pages on the device, last (the status
    # kernel also zeroes the split kernel's counters).
    max_len, status = check_kvcache_lengths(q, k_cache, cache_seqlens, block_table, s_new,
                                            max_seqlen_k, launched,
                                            counters_per_sequence(q, k_cache))  # fmt: skip
    if s_new:
        append(k, v, k_cache, v_cache, cache_seqlens, block_table, k_descale, v_descale,
               launched)  # fmt: skip
    out, lse2 = kvcache_attention(q, k_cache, v_cache, cache_seqlens, block_table,
                                  causal=causal, softmax_scale=scale, num_splits=num_splits,
                                  max_seqlen_k=max_len, window=(left, right), softcap=softcap,
                                  alibi_slopes=alibi_slopes, sinks=sinks, k_descale=k_descale,
                                  v_descale=v_descale, seqlen_add=s_new, counters=status,
                                  launched=launched)  # fmt: skip
    split = [args for fn, _, _, args in launched or ()
             if fn is _decode_split or fn in hopper_decode.KERNELS]
    if split and not compiling_only() and len(launched) == (
            2 + (s_new > 0) + (not split[0]["DIRECT"]
                               and not split[0].get("MERGE", False))):  # fmt: skip
        o_part, lse_part = ((None, None) if split[0]["DIRECT"] else
                            (split[0]["O_PART"], split[0]["LSE_PART"]))  # fmt: skip
        work = (status, o_part, lse_part, out, lse2)
        replay = Replay.record(launched, _roles(tensors, work))
        if replay is not None:
            _PREPARED.put(sig, (replay, tuple((None, None) if t is None else (t.shape, t.dtype)
                                              for t in work)))  # fmt: skip
    return out, lse2


def _signature(tensors: tuple, options: tuple) -> tuple | None:
    """What a call's checks and launches read, but the tensors' addresses and the values of
    the lengths and pages (checked on the device each call): each tensor's type, shape,
    strides, dtype, device and whether it requires grad; each option's type and value; the
    grad mode. None for a tensor argument that is not a tensor (the checks will say what is
    wrong with it); an unhashable option gives a key that cannot be looked up (TypeError)."""
    if any(t is not None and not isinstance(t, torch.Tensor) for t in tensors):
        return None
    return (torch.is_grad_enabled(),) + tuple(
        None if t is None else (type(t), t.shape, t.stride(), t.dtype, t.device, t.requires_grad)
        for t in tensors) + tuple((type(o), o) for o in options)  # fmt: skip


# signature (_signature) -> the launches of a call with max_seqlen_k (_launcher.Replay: the
# device check, the append, the split and combine kernels) and the shapes and dtypes of the
# tensors it allocates (status, o_part, lse_part, out, lse2; the split workspace's depends on
# the split count). The launch settings above (WIDE, BLOCK_N, ...) are not part of a
# signature: whoever changes them (benchmarks/decode_ab.py, benchmarks/fp8_decode.py) clears
# this (``_PREPARED.clear()``).
_PREPARED = ReplayCache()


def _pow2_page(page_size: int) -> int:
    """The split kernel's PAGE: the page size where it is a power of two (>= 1), else 0."""
    return page_size if page_size & (page_size - 1) == 0 else 0


def kvcache_attention(q, k_cache, v_cache, cache_seqlens, block_table, *, causal: bool,
                      softmax_scale: float, num_splits: int, max_seqlen_k: int,
                      window=(-1, -1), softcap: float = 0.0, alibi_slopes=None, sinks=None,
                      k_descale=None, v_descale=None, seqlen_add: int = 0,
                      counters=None, launched: list | None = None):
    """(out, lse2) for checked inputs, the new keys already appended (each sequence's length
    is cache_seqlens[b] + ``seqlen_add``, the appended tokens): q (batch, seqlen_q,
    heads, d); out (batch, seqlen_q, heads, v_cache's head dim); lse2 base 2, (batch, heads,
    seqlen_q) fp32. ``max_seqlen_k`` bounds every cache length (the longest one, read back by
    the checks, or the caller's bound): the splits cut [0, max_seqlen_k). ``counters``: the
    device check's status tensor, whose entries after the batch's are zeros for the split
    kernel's counters (:data:`MERGE`; None: the separate combine). ``window`` is the
    checked (left, right) pair (right 0 when causal). ``launched``: a list that gets the
    GPU launches' (fn, kernel, grid, args), for a Replay (:func:`append_and_attend`)."""
    b, sq, h, d = q.shape
    hk, dv = k_cache.shape[2], v_cache.shape[3]
    group = h // hk
    out = torch.empty((b, sq, h, dv), dtype=q.dtype, device=q.device)
    lse2 = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    fp8 = k_descale is not None
    if b * h * sq == 0:
        return out, lse2
    d_pad, d_tail = head_chunks(d)
    dv_pad = max(16, next_power_of_2(dv))
    v_in_k = LATENT_REUSE and dv == d_pad and values_in_keys(k_cache, v_cache)
    paged = block_table is not None
    pdl = pdl_on(q.device)
    wide = max(d_pad + d_tail, dv_pad) > 256
    left, right = window
    variants = (left >= 0 or (right >= 0 and not causal) or softcap > 0
                or alibi_slopes is not None or sinks is not None)  # fmt: skip
    if fp8 and hopper_decode.applies(q, k_cache, v_cache, paged, variants, v_in_k):
        return _hopper_fp8(q, k_cache, v_cache, cache_seqlens, block_table, out, lse2,
                           causal=causal, softmax_scale=softmax_scale, num_splits=num_splits,
                           max_seqlen_k=max_seqlen_k, sinks=sinks, k_descale=k_descale,
                           v_descale=v_descale, seqlen_add=seqlen_add, pdl=pdl,
                           counters=counters, launched=launched)  # fmt: skip
    max_shared = kernel_limits(q.device.index)["max_shared_mem"] if q.is_cuda else SM90_SHARED
    most_rows = wide_head_rows(k_cache.element_size(), max_shared) if wide else 64
    block_m = min(most_rows, max(16, next_power_of_2(group * sq)))
    sms = kernel_limits(q.device.index)["sm_count"] if q.is_cuda else 4
    block_n, warps, per_sm, waves = launch_config(paged, d_pad + d_tail, dv_pad,
                                                  k_cache.element_size(), q.is_cuda,
                                                  block_m, v_in_k, max_shared,
                                                  k_cache.shape[1] if paged else 0,
                                                  sq == 1 and b * hk < PAGED_WAVES[2] * sms)
    short = (block_n, warps, per_sm) == WIDE and short_cache(max_seqlen_k, b * hk, sms)
    if short:
        (block_n, warps, per_sm), waves = SHORT, True
    # (wide heads: a group of up to 128 query heads is several row blocks, each a program)
    row_blocks = cdiv(group * sq, block_m) if wide else 1
    splits = num_splits or pick_splits(b * row_blocks, hk, max_seqlen_k, q.device, block_n,
                                       per_sm, waves)  # fmt: skip
    split_len = cdiv(cdiv(max(max_seqlen_k, 1), splits), block_n) * block_n
    rows = b * h * sq
    # One split and no sinks: the split kernel writes the output itself (no workspace, no
    # combine: one launch and two allocations fewer, e.g. a decode step of 128 sequences).
    direct = splits == 1 and sinks is None
    # Otherwise the last split program of a block of rows merges the splits (MERGE), or the
    # combine kernel does.
    merge = (MERGE and not direct and counters is not None and not paged
             and splits <= MERGE_SPLITS and dv_pad <= 256
             and block_m * dv_pad <= MERGE_TILE)  # fmt: skip
    if direct:
        o_part = lse_part = lse2  # (not read: the split kernel's workspace arguments)
    else:
        o_part = torch.empty((splits * rows, dv_pad), dtype=torch.float32, device=q.device)
        lse_part = torch.empty((splits * rows,), dtype=torch.float32, device=q.device)
    table = block_table if paged else cache_seqlens
    qk_scale = softcap * LOG2E if softcap > 0 else softmax_scale * LOG2E
    alibi = alibi_slopes is not None
    sq_, sk_, sv_, so = q.stride(), k_cache.stride(), v_cache.stride(), out.stride()
    split_args = dict(
        Q=q, K=k_cache, V=v_cache, BLOCK_TABLE=table, CACHE_SEQLENS=cache_seqlens,
        O_PART=o_part, LSE_PART=lse_part, O=out, LSE=lse2,
        COUNTERS=counters if merge else lse_part,
        SINK_LOGITS=sinks if merge and sinks is not None else lse_part,
        stride_qb=sq_[0], stride_qs=sq_[1], stride_qh=sq_[2], stride_qd=sq_[3],
        stride_ob=so[0], stride_os=so[1], stride_oh=so[2], stride_od=so[3],
        stride_kb=sk_[0], stride_ks=sk_[1], stride_kh=sk_[2], stride_kd=sk_[3],
        stride_vb=sv_[0], stride_vs=sv_[1], stride_vh=sv_[2], stride_vd=sv_[3],
        stride_tb=block_table.stride(0) if paged else 0,
        page_size=k_cache.shape[1] if paged else 1, pool=k_cache.shape[0] if paged else 1,
        max_len=max_seqlen_k, kv_heads=hk, kv_group=group, seqlen_q=sq, split_len=split_len,
        qk_scale=qk_scale,
        batch=b, seqlen_add=seqlen_add, window_left=max(left, 0),
        window_right=0 if causal else max(right, 0),
        tanh_scale=softmax_scale / softcap if softcap > 0 else 1.0,
        SLOPES=alibi_slopes if alibi else lse_part,
        stride_slopes_b=alibi_slopes.stride(0) if alibi and alibi_slopes.dim() == 2 else 0,
        K_DESCALE=k_descale if fp8 else lse_part, V_DESCALE=v_descale if fp8 else lse_part,
        stride_descale_b=k_descale.stride(0) if fp8 and k_descale.dim() == 2 else 0,
        HEAD_DIM=d, HEAD_DIM_PAD=d_pad, HEAD_DIM_V=dv, HEAD_DIM_V_PAD=dv_pad,
        CAUSAL=causal or right >= 0, PAGED=paged,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", WINDOW=left >= 0,
        SOFTCAP=softcap > 0, ALIBI=alibi, FP8=fp8, BLOCK_M=block_m, BLOCK_N=block_n,
        DIRECT=direct, PDL=pdl, PDL_WAIT=pdl and seqlen_add > 0,
        PAGE=_pow2_page(k_cache.shape[1]) if paged else 0, HEAD_DIM_TAIL=d_tail,
        V_IN_K=v_in_k, MERGE=merge, SINKS=merge and sinks is not None,
    )  # fmt: skip
    split_grid = (b * hk, splits, cdiv(group * sq, block_m))
    # (on a GPU diyfa's launcher: Triton's per-call binding costs tens of microseconds)
    # (the pipeline's most stages, as shared memory allows: split_stages)
    if short:
        most = SHORT_STAGES
    elif wide and block_m > 16:
        most = WIDE_HEAD_STAGES
    elif (paged and block_m > 16 and k_cache.element_size() == 2
          and (block_n, warps) == PAGED_WAVES[:2]):  # (PAGED_WAVES' programs > 16 rows)
        most = PAGED_MULTI_STAGES
    else:
        most = 3
    stages = split_stages(d_pad + d_tail, 0 if v_in_k else dv_pad, k_cache.element_size(),
                          max_shared, block_n, most) if q.is_cuda else 1  # fmt: skip
    launch_recorded(_decode_split, split_grid, split_args, q.is_cuda, launched, warps, stages,
                    {"launch_pdl": pdl})  # fmt: skip
    if not direct and not merge:
        _launch_combine(o_part, lse_part, out, lse2, sinks, splits, dv, dv_pad, pdl, q.is_cuda,
                        launched)  # fmt: skip
    return out, lse2


def _hopper_fp8(q, k_cache, v_cache, cache_seqlens, block_table, out, lse2, *, causal,
                softmax_scale, num_splits, max_seqlen_k, sinks, k_descale, v_descale,
                seqlen_add, pdl, counters, launched):
    """:func:`kvcache_attention` for the calls :func:`hopper_decode.applies` takes: a Gluon
    split kernel (``hopper_decode.split_kernel()``, in ``MMA_CONFIG`` or ``CONFIG``: keys per
    block, stages, programs per SM; its split count fills whole waves of them), then the
    combine kernel unless one split and no sinks (the split kernel writes the output
    itself) or the mma.sync kernel merges its splits itself (:data:`MERGE`'s scheme, at most
    :data:`MERGE_SPLITS` splits, its counters in ``counters``)."""
    b, sq, h, d = q.shape
    hk = k_cache.shape[2]
    mma = hopper_decode.MMA
    if mma:
        (block_n, stages, per_sm), warps = hopper_decode.MMA_CONFIG, 4
    else:
        block_n, stages, per_sm = hopper_decode.CONFIG[:3]
        warps = hopper_decode.launch_warps(d, hopper_decode.CONFIG)
    splits = num_splits or pick_splits(b, hk, max_seqlen_k, q.device, block_n, per_sm, True)
    split_len = cdiv(cdiv(max(max_seqlen_k, 1), splits), block_n) * block_n
    rows = b * h * sq
    direct = splits == 1 and sinks is None
    merge = (MERGE and mma and not direct and sinks is None and counters is not None
             and splits <= MERGE_SPLITS)  # fmt: skip
    if direct:
        o_part = lse_part = lse2  # (not read)
    else:
        o_part = torch.empty((splits * rows, d), dtype=torch.float32, device=q.device)
        lse_part = torch.empty((splits * rows,), dtype=torch.float32, device=q.device)
    sq_, so = q.stride(), out.stride()
    paged = block_table is not None
    split_args = dict(
        Q=q, k_desc=hopper_decode.cache_desc(k_cache, block_n, paged),
        v_desc=hopper_decode.cache_desc(v_cache, block_n, paged), CACHE_SEQLENS=cache_seqlens,
        O_PART=o_part, LSE_PART=lse_part, O=out, LSE=lse2,
        BLOCK_TABLE=block_table if paged else cache_seqlens,
        stride_tb=block_table.stride(0) if paged else 0, pool=k_cache.shape[0],
        K_DESCALE=k_descale, V_DESCALE=v_descale,
        stride_qb=sq_[0], stride_qs=sq_[1], stride_qh=sq_[2], stride_qd=sq_[3],
        stride_ob=so[0], stride_os=so[1], stride_oh=so[2], stride_od=so[3],
        cache_len=k_cache.shape[1], max_len=max_seqlen_k, kv_heads=hk, kv_group=h // hk,
        seqlen_q=sq, split_len=split_len, qk_scale=softmax_scale * LOG2E, batch=b,
        seqlen_add=seqlen_add,
        stride_descale_b=k_descale.stride(0) if k_descale.dim() == 2 else 0,
        HEAD_DIM=d, CAUSAL=causal, BLOCK_N=block_n, STAGES=stages, ROWS=hopper_decode.ROWS,
        DIRECT=direct, PDL=pdl, PDL_WAIT=pdl and seqlen_add > 0,
        MAXNREG=hopper_decode.register_cap(per_sm, warps),
        PAGE=k_cache.shape[1] if paged else 0,
    )  # fmt: skip
    if mma:
        split_args.update(COUNTERS=counters if merge else lse_part, MERGE=merge,
                          EARLY_ISSUE=2 if hopper_decode.EARLY_LENGTHS
                          else int(hopper_decode.EARLY_ISSUE))
    else:
        split_args.update(ONE_TILE=bool(hopper_decode.CONFIG[3]), EARLY_S=hopper_decode.EARLY_S)
    meta = {"launch_pdl": pdl}
    if split_args["MAXNREG"]:
        meta["maxnreg"] = split_args["MAXNREG"]
    launch_recorded(hopper_decode.split_kernel(), (b * hk, splits, 1), split_args, True,
                    launched, warps, 1, meta)  # fmt: skip
    if not direct and not merge:
        _launch_combine(o_part, lse_part, out, lse2, sinks, splits, d, d, pdl, True, launched)
    return out, lse2


def _launch_combine(o_part, lse_part, out, lse2, sinks, splits: int, dv: int, dv_pad: int,
                    pdl: bool, on_gpu: bool, launched):
    """The combine kernel over the split kernel's workspace (``o_part`` rows of ``dv_pad``
    values, ``lse_part``): one program per (batch, head, query) row of ``out``."""
    b, sq, h, _ = out.shape
    rows = b * h * sq
    so = out.stride()
    combine_args = dict(
        O_PART=o_part, LSE_PART=lse_part, O=out, LSE=lse2,
        SINK_LOGITS=sinks if sinks is not None else lse_part, rows_per_split=rows,
        seqlen_q=sq, heads=h, num_splits=splits, stride_ob=so[0], stride_os=so[1],
        stride_oh=so[2], stride_od=so[3], NUM_SPLITS=next_power_of_2(splits), HEAD_DIM=dv,
        HEAD_DIM_PAD=dv_pad, SINKS=sinks is not None, PDL=pdl,
    )  # fmt: skip
    launch_recorded(_combine, (rows,), combine_args, on_gpu, launched, 4, 3,
                    {"launch_pdl": pdl})  # fmt: skip


def _roles(tensors: tuple, work: tuple) -> dict:
    """A call's tensors by name, for its Replay (the absent ones left out: the kernels get
    another tensor of the call in their place, which the recording finds by its address):
    ``tensors`` in :data:`_ROLES`' order, ``work`` (status, o_part, lse_part, out, lse2)."""
    roles = dict(zip(_ROLES, tensors + work, strict=True))
    # One latent cache (v_cache a view of k_cache's leading columns, v of k's: part of the
    # signature) is one role: the values' arguments start at the keys' address.
    if values_in_keys(roles["k_cache"], roles["v_cache"]):
        roles["v_cache"] = None
    if values_in_keys(roles["k"], roles["v"]):
        roles["v"] = None
    if _one_tensor(roles["k_descale"], roles["v_descale"]):
        roles["v_descale"] = None
    return {name: t for name, t in roles.items() if t is not None}


def _one_tensor(a, b) -> bool:
    """Whether ``a`` and ``b`` are tensors at one address (one descale tensor passed twice)."""
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and a.data_ptr() == b.data_ptr())  # fmt: skip


_ROLES = ("q", "k_cache", "v_cache", "k", "v", "seqlens", "table", "slopes", "sinks",
          "k_descale", "v_descale", "status", "o_part", "lse_part", "out", "lse")  # fmt: skip
