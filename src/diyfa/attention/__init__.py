"""FlashAttention: the public functions.

A call goes checks -> problem -> dispatch -> family:

    checks.py    ``check_inputs``: every input check; returns the call's ``Problem``
    problem.py   ``Problem``: one frozen description of the call (shapes, strides, dtype,
                 device, layout, masking, resolved scale, compute capability)
    dispatch.py  the kernel families in priority order; ``select`` picks one ("auto" or by
                 name), ``explain`` says which families can run a problem and why not
    function.py  the autograd Function: forward and backward of the chosen family
    hopper_fwd.py  the "hopper" family: a warp-specialised Gluon forward for sm90 (H100/H200)
    portable.py  the "portable" family: the Triton kernels (FlashAttention-2 style) that run
                 on any CUDA GPU and in the Triton interpreter; numerics, masking and limits
                 are described in its docstring

    ops.py       the same path as torch custom operators (fake shapes, autograd), which the
                 public functions call while torch.compile traces them

Importing this package compiles, launches and imports no kernels: a family's module is
imported on the first call that consults it.
"""

from __future__ import annotations

import logging
import math

import torch

from diyfa.attention import ops  # (also registers torch.ops.diyfa.attention_*)
from diyfa.attention.checks import (
    SUPPORTED_DTYPES,
    check_dropout,
    check_flag,
    check_inputs,
    check_varlen_inputs,
    checked_before,
    no_dropout,
    remember_checked,
)
from diyfa.attention.dispatch import select
from diyfa.attention.function import run
from diyfa.device import interpreter_enabled

__all__ = ["flash_attention", "flash_attention_varlen", "flash_attention_with_kvcache",
           "key_major_values",
           "flash_attention_with_lse", "scaled_dot_product_attention"]

LN2 = 0.6931471805599453

log = logging.getLogger(__name__)


def _dropout_seed(dropout_p, generator) -> int:
    """The Philox seed of one call's dropout mask, drawn from ``generator`` (torch's default
    CPU generator when None), so ``torch.manual_seed`` makes a run repeatable, as PyTorch's
    own dropout is. 0 without dropout (nothing drawn)."""
    if no_dropout(dropout_p):
        return 0
    device = generator.device if generator is not None else "cpu"
    return int(torch.randint(0, 2**62, (), generator=generator, device=device))


def _compiled_dropout(dropout_p, generator=None) -> tuple:
    """(dropout_p, seed) for a traced call's custom op: the rate checked, and the mask's seed
    drawn inside the graph from torch's default generator (``ops.dropout_seed``); a
    ``generator`` cannot be traced (Dynamo has no proxy for one) and is refused."""
    dropout_p = check_dropout(dropout_p)
    if dropout_p and generator is not None:
        raise NotImplementedError("generator= under torch.compile is not supported (Dynamo "
                                  "cannot trace a torch.Generator): leave it None to draw the "
                                  "dropout seed from torch's default generator (seeded by "
                                  "torch.manual_seed), or call eagerly")  # fmt: skip
    return dropout_p, ops.dropout_seed(dropout_p)


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    layout: str = "bhsd",
    return_lse: bool = False,
    backend: str = "auto",
    deterministic: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    generator: torch.Generator | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
):
    """FlashAttention: softmax(q k^T * softmax_scale [+ causal mask]) v, differentiable.

    Args:
        q: (batch, heads, seqlen_q, head_dim) for layout="bhsd",
           (batch, seqlen_q, heads, head_dim) for layout="bshd". fp16, bf16 or fp32 (or
           float8_e4m3fn with descales, forward only: see q_descale).
        k, v: the same with kv_heads (dividing heads: GQA/MQA) and seqlen_k.
        causal: mask aligned bottom-right (query i sees keys j <= i + seqlen_k - seqlen_q).
        softmax_scale: default 1/sqrt(head_dim).
        layout: "bhsd" or "bshd"; the output has the same layout.
        return_lse: also return the natural-log log-sum-exp, (batch, heads, seqlen_q) fp32
            (-inf for rows that see no key).
        backend: which kernel family runs the call. "auto" (default): the first family that
            supports the problem (and was not measured slower on it); "hopper": the Gluon
            forward for sm90 GPUs (fp16/bf16, head dims 64..256 that are multiples of 8)
            and, at head dims up to 128, the Gluon backward with its atomic dQ (unless
            ``deterministic``; "auto" runs it where it measured faster:
            ``attention/hopper_bwd.py``);
            "portable": the Triton kernels that run everywhere. A named family that cannot
            run the problem raises ValueError with the reason; so does an unknown name.
            ``diyfa.attention.dispatch.explain`` lists the families and their reasons.
        deterministic: the backward must give bitwise-reproducible gradients (no atomic
            adds). Also on while ``torch.use_deterministic_algorithms(True)`` is. Unset, the
            Hopper backward adds dQ with TMA reduce-adds where that measured faster (head
            dims <= 64; dQ's bits may then vary between runs, dK's and dV's do not), as
            FlashAttention and cuDNN do; at d72..128 its deterministic path measured faster
            and runs anyway. ``backend="hopper"`` accumulates dQ by reduce-adds unless this
            is set.
        window_size: (left, right), FlashAttention's sliding window: query i sees key j iff
            i + sk - sq - left <= j <= i + sk - sq + right; -1 leaves a side unbounded.
            With causal=True right is 0 (a positive right is refused). Blocks outside the
            window are skipped: the cost grows with the window, not the sequence.
        softcap: > 0 caps the scores: softcap * tanh(scores / softcap) before the softmax
            (Gemma 2), gradients through the tanh; 0 (default) is off.
        alibi_slopes: fp32 (heads,) or (batch, heads): ALiBi, scores get
            -slope * |i + sk - sq - j| (BLOOM, MPT); not differentiated.
        sinks: (heads,) logits (fp16/bf16/fp32) that join every row's softmax denominator
            with no value (gpt-oss's attention sinks); differentiable.
        dropout_p: attention dropout in [0, 1) (training): each probability is dropped with
            this probability and the kept ones scaled by 1 / (1 - dropout_p); the mask is
            Philox of a seed drawn from ``generator`` (torch's default one when None: so
            ``torch.manual_seed`` repeats a run) and the pair's position, regenerated by the
            backward, never stored. Pass 0.0 in evaluation.
        q_descale, k_descale, v_descale: for float8_e4m3fn q, k, v (forward only, output
            bf16): fp32 descales, (1,) per tensor or (batch, kv_heads), all one shape; a
            stored value times its descale is the real one. The scores come from fp8 q and k
            in fp32, P is rounded to e4m3 (times 2^8) for P @ V (FlashAttention-3's recipe).
            On H100/H200 plain fp8 attention (causal or not, GQA, head dims 64..256) runs on
            the Hopper kernel, the variants on the portable one; not with gradients or
            dropout. The Hopper kernel reads V transposed: a V stored with its keys
            contiguous (:func:`key_major_values`) saves the copy it otherwise makes.
        Under "auto" on H100/H200, windows, softcap, ALiBi and sinks run on the Hopper
        forward too (docs/attention.md has the measurements); dropout runs on the portable
        kernels only.
    """
    check_flag("return_lse", return_lse)
    if torch.compiler.is_compiling():  # one opaque custom op for the tracer (see ops.py)
        wl, wr = window_size
        out, lse2 = torch.ops.diyfa.attention_fwd(q, k, v, causal, "bottom_right", softmax_scale,
                                                  layout, backend, deterministic, wl, wr,
                                                  float(softcap), alibi_slopes, sinks,
                                                  q_descale, k_descale, v_descale,
                                                  *_compiled_dropout(dropout_p,
                                                                     generator))  # fmt: skip
    else:
        problem = key = None
        if (dropout_p == 0.0 and q_descale is None and k_descale is None
                and v_descale is None):  # no per-call seed or fp8: maybe checked before
            problem, key = checked_before(q, k, v, causal, softmax_scale, layout, deterministic,
                                          window_size, softcap, alibi_slopes, sinks)  # fmt: skip
        if problem is None:
            problem = check_inputs(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                   layout=layout, align="bottom_right",
                                   deterministic=deterministic, window_size=window_size,
                                   softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                                   dropout_p=dropout_p,
                                   dropout_seed=_dropout_seed(dropout_p, generator),
                                   q_descale=q_descale, k_descale=k_descale,
                                   v_descale=v_descale)  # fmt: skip
            remember_checked(key, problem)
        out, lse2 = run(q, k, v, problem, select(problem, backend), return_lse)
    return (out, lse2 * LN2) if return_lse else out  # base-2 LSE -> natural log


def flash_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    backend: str = "auto",
    deterministic: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    generator: torch.Generator | None = None,
):
    """FlashAttention over packed sequences of different lengths (no padding), differentiable.

    Args:
        q: (total_q, heads, head_dim): the query rows of every sequence, one after another.
        k, v: (total_k, kv_heads, head_dim) likewise (kv_heads dividing heads: GQA/MQA).
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,), cumulative lengths starting at 0:
            sequence i is rows [cu[i], cu[i + 1]). Zero-length sequences are allowed.
        max_seqlen_q, max_seqlen_k: ints at least the longest sequence (the grid's extent).
        causal: bottom-right aligned per sequence (query i of a sequence sees its keys
            j <= i + seqlen_k - seqlen_q).
        softmax_scale, backend: as for :func:`flash_attention` (on Hopper, "auto" runs
            packed sequences without variants up to head dim 128 on the Gluon backward, and
            on the Hopper forward at d72..128; docs/attention.md, "Packed sequences").
        return_lse: also return the natural-log LSE, (heads, total_q) fp32.
        deterministic, window_size, softcap, alibi_slopes, sinks, dropout_p, generator: as for
            :func:`flash_attention` (per sequence; alibi_slopes (batch, heads) per sequence;
            the Gluon backward's atomic dQ is the one part that is not deterministic).

    The lengths are copied to the host (one wait per call, for the copy, as late as the
    kernels allow: the host's work before it overlaps the GPU's queue) and checked against
    the tensors before any kernel runs. Programs past a sequence's end exit at once.
    """
    check_flag("return_lse", return_lse)
    if torch.compiler.is_compiling():  # one opaque custom op for the tracer (see ops.py)
        wl, wr = window_size
        out, lse2 = torch.ops.diyfa.attention_varlen_fwd(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
            softmax_scale, backend, deterministic, wl, wr, float(softcap), alibi_slopes, sinks,
            *_compiled_dropout(dropout_p, generator))
    else:
        problem = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                      max_seqlen_k, causal=causal, softmax_scale=softmax_scale,
                                      deterministic=deterministic, window_size=window_size,
                                      softcap=softcap, alibi_slopes=alibi_slopes,
                                      sinks=sinks, dropout_p=dropout_p,
                                      dropout_seed=_dropout_seed(dropout_p,
                                                                 generator))  # fmt: skip
        out, lse2 = run(q, k, v, problem, select(problem, backend), return_lse)
    return (out, lse2 * LN2) if return_lse else out


def flash_attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    *,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None = None,
    causal: bool = True,
    softmax_scale: float | None = None,
    num_splits: int = 0,
    return_lse: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    max_seqlen_k: int | None = None,
):
    """Attention of new query tokens against a KV cache (decoding, chunked prefill). No
    gradients (inference; inputs that require them are refused).

    Args:
        q: (batch, seqlen_q, heads, head_dim): 1..N new tokens per sequence.
        k_cache, v_cache: contiguous (batch, max_len, kv_heads, head_dim), or paged
            (num_blocks, page_size, kv_heads, head_dim) with ``block_table``. Head dims
            1..576 (q and k_cache share it); v_cache's may differ (1..512, e.g. 192 / 128,
            or DeepSeek MLA's decode form, 576 / 512): the output has v_cache's. MLA's one
            latent cache: pass ``v_cache=k_cache[..., :512]`` (and ``v=k[..., :512]``):
            each cache byte is then read once and the append writes the keys only.
        k, v: optional (batch, seqlen_new, kv_heads, head_dim; v: v_cache's head dim),
            written into the cache in place at rows cache_seqlens[b] .. cache_seqlens[b] +
            seqlen_new - 1 (only those rows) before attending. ``cache_seqlens`` itself is
            not updated.
        cache_seqlens: int32 (batch,): the cached tokens of each sequence before the append.
        block_table: int32 (batch, max_blocks): page i of sequence b is
            k_cache[block_table[b, i]].
        causal: new query i sees keys j <= i + seqlen_k - seqlen_q (seqlen_k after the
            append), FlashAttention's bottom-right convention.
        num_splits: how many ranges the keys are cut into (programs that run in parallel
            and are merged); 0 picks it from the problem and the GPU's SM count.
        return_lse: also return the natural-log LSE, (batch, heads, seqlen_q) fp32.
        window_size, softcap, alibi_slopes, sinks: as for :func:`flash_attention`, aligned
            bottom-right against each sequence's cache (a window reads only its keys).
        k_descale, v_descale: an fp8 cache (``torch.float8_e4m3fn`` k_cache and v_cache, half
            the bytes of bf16) with fp32 descales per kv head, (kv_heads,) or (batch,
            kv_heads): a cached value times its descale is the real one. q, k and v stay
            fp16/bf16; k and v are quantised on the append (divided by the descale, clamped
            to +-448, cast).

        max_seqlen_k: a bound on every sequence's cache length after the append (a serving
            loop knows it). Given, the call never waits for the GPU: the lengths and pages
            are checked on the device and a violation stops the stream with a device-side
            assert (a RuntimeError on the CPU) before anything is written, instead of a
            ValueError; the keys are split over [0, max_seqlen_k). Left None, the lengths are
            read back (one synchronisation per call; during a CUDA-graph capture the cache's
            capacity is the bound, as if given).

    Every check (shapes, dtypes, lengths against the cache, pages against the pool) runs
    before anything is written: on an error the cache is untouched. Without
    ``max_seqlen_k`` the lengths are read to the host (one device synchronisation per call)
    and a bad one is a ValueError.
    """
    check_flag("return_lse", return_lse)
    if torch.compiler.is_compiling():  # one opaque custom op for the tracer (see ops.py)
        wl, wr = window_size
        out, lse2 = torch.ops.diyfa.attention_kvcache(q, k_cache, v_cache, k, v, cache_seqlens,
                                                      block_table, causal, softmax_scale,
                                                      num_splits, wl, wr, float(softcap),
                                                      alibi_slopes, sinks, k_descale,
                                                      v_descale, max_seqlen_k)  # fmt: skip
    else:
        from diyfa.attention import decode

        out, lse2 = decode.append_and_attend(q, k_cache, v_cache, k, v, cache_seqlens,
                                             block_table, causal, softmax_scale, num_splits,
                                             window_size, softcap, alibi_slopes, sinks,
                                             k_descale, v_descale, max_seqlen_k)  # fmt: skip
    return (out, lse2 * LN2) if return_lse else out


def key_major_values(v: torch.Tensor, layout: str = "bhsd") -> torch.Tensor:
    """``v`` with its keys next to each other in memory: the same values, shape and layout,
    a view of a new (batch, kv_heads, head_dim, seqlen_k padded to 16 bytes) buffer.

    For fp8 attention on H100/H200: the Hopper kernel multiplies P by V^T (fp8 ``wgmma``
    takes only K-major operands), so every fp8 call with a plain V first copies it
    transposed (~25 us for 32 MB on an H200, a tenth of a 4096-token d128 call); a V stored
    this way is read as it is. Worth it where V is quantised or produced once and read more
    than once (or written in this layout by its producer). Any dtype and either layout
    ("bhsd" or "bshd", as ``flash_attention`` takes it); other kernels read it through its
    strides."""
    from diyfa.attention.hopper_fwd import bhsd_view, transpose_v

    if not isinstance(v, torch.Tensor):
        raise TypeError(f"v must be a torch.Tensor, got {type(v).__name__}")
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"layout must be 'bhsd' or 'bshd', got {layout!r}")
    if v.dim() != 4:
        raise ValueError(f"v must be 4-D ({layout}), got shape {tuple(v.shape)}")
    v4 = bhsd_view(v, layout)
    if v.is_cuda:  # a Triton kernel (PyTorch's strided copy of 1-byte values is slow there)
        vt = transpose_v(v4)
    else:
        b, h, s, d = v4.shape
        step = max(1, 16 // v.element_size())
        vt = torch.empty((b, h, d, -(-s // step) * step), dtype=v.dtype)[..., :s]
        vt.copy_(v4.transpose(2, 3))
    return bhsd_view(vt.transpose(2, 3), layout)  # (batch, heads, seqlen, dim) first


def flash_attention_with_lse(q, k, v, **kwargs):
    """``flash_attention(..., return_lse=True)``: returns (out, lse)."""
    return flash_attention(q, k, v, return_lse=True, **kwargs)


_fallback_logged: set[str] = set()


def _fallback(reason: str, *args, **kwargs):
    if reason not in _fallback_logged:
        _fallback_logged.add(reason)
        log.warning("diyfa.scaled_dot_product_attention: %s; using PyTorch's SDPA", reason)
    return torch.nn.functional.scaled_dot_product_attention(*args, **kwargs)


def scaled_dot_product_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
    enable_gqa=False,
):
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention`` (layout bhsd).

    Runs the diyfa kernel when it can (backend "auto"); falls back to PyTorch's SDPA, with
    one logged warning per reason, for what the kernel does not do: ``attn_mask``, inputs
    that are not 4-D, different q and k head dims, head_dim > 256, and devices other than
    CUDA. ``is_causal`` follows PyTorch: top-left aligned when seqlen_q != seqlen_k.
    ``dropout_p`` > 0 runs on the kernel (its own Philox mask, seeded from torch's default
    generator: not the mask PyTorch would draw).
    """
    args = (query, key, value)
    kwargs = dict(attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                  enable_gqa=enable_gqa)  # fmt: skip
    if attn_mask is not None:
        return _fallback("attn_mask is not supported by the kernel", *args, **kwargs)
    if any(not isinstance(t, torch.Tensor) or t.dim() != 4 for t in args):
        return _fallback("only 4-D (batch, heads, seqlen, dim) inputs run on the kernel",
                         *args, **kwargs)  # fmt: skip
    if query.shape[-1] != key.shape[-1] or max(query.shape[-1], value.shape[-1]) > 256:
        return _fallback("query and key head dims differ, or a head dim exceeds 256", *args,
                         **kwargs)  # fmt: skip
    if any(t.dtype not in SUPPORTED_DTYPES for t in args):
        return _fallback("only float16, bfloat16 and float32 run on the kernel", *args, **kwargs)
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"scale must be a float or None, got {scale!r}")
    if scale is not None and scale < 0:
        return _fallback("negative scales run on PyTorch", *args, **kwargs)
    if scale is not None and not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    if query.device.type != "cuda" and not interpreter_enabled():
        return _fallback(f"device {query.device.type} has no Triton kernel", *args, **kwargs)
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError(
            f"query has {query.shape[1]} heads and key {key.shape[1]}: pass enable_gqa=True "
            "for grouped-query attention"
        )
    if torch.compiler.is_compiling():  # one opaque custom op for the tracer (see ops.py)
        out, _ = torch.ops.diyfa.attention_fwd(query, key, value, bool(is_causal), "top_left",
                                               scale, "bhsd", "auto", False, -1, -1,
                                               0.0, None, None, None, None, None,
                                               *_compiled_dropout(dropout_p))  # fmt: skip
        return out
    problem = check_inputs(query, key, value, causal=bool(is_causal), softmax_scale=scale,
                           layout="bhsd", align="top_left", dropout_p=dropout_p,
                           dropout_seed=_dropout_seed(dropout_p, None))  # fmt: skip
    out, _ = run(query, key, value, problem, select(problem))
    return out
