"""flash-attn 2's Python API on diyfa's kernels.

Code written for flash-attn 2 (``flash_attn.flash_attn_interface``) runs on diyfa by changing
one import::

    from flash_attn import flash_attn_func                     # before
    from diyfa.flash_attn_interface import flash_attn_func     # after

The five functions here keep flash-attn 2.8's names, argument order and defaults, its layouts
(q, k, v as (batch, seqlen, nheads, headdim); packed (total, nheads, headdim) for varlen),
its bottom-right causal mask, GQA/MQA (fewer k/v heads dividing q's) and its return values,
and call diyfa's public functions (``diyfa.flash_attention`` with layout "bshd",
``diyfa.flash_attention_varlen``, ``diyfa.flash_attention_with_kvcache``), which check
every input. The packed variants pass views of ``qkv`` / ``kv`` (no copies); gradients flow
back into the packed tensor.

What diyfa does not implement (yet) is refused with ``NotImplementedError`` naming the
argument, the value given and what is supported, before any kernel runs or any cache row is
written, never silently computed differently: ``return_attn_probs=True`` (diyfa never
materialises the attention probabilities; its log-sum-exp comes from ``return_lse=True`` on
diyfa's own functions),
and in ``flash_attn_with_kvcache`` rotary embedding (``rotary_cos`` / ``rotary_sin``),
``cache_batch_idx`` and ``cache_leftpad``;
``block_table`` in ``flash_attn_varlen_func`` (paged caches run through
``flash_attn_with_kvcache``). Every refusal is a row of ``_UNSUPPORTED`` below: supporting
an option means deleting its row and passing it on.

Sliding windows (``window_size``), softcap, ALiBi (``alibi_slopes``, fp32 (nheads,) or
(batch, nheads)) and dropout (``dropout_p``: diyfa's own Philox mask, seeded from torch's
default generator; not flash-attn's mask; not in the cache call) run with flash-attn's
conventions: a negative window side is unbounded, causal makes the right side 0, a softcap
<= 0 is off.

Importing this module imports neither torch nor a kernel: diyfa's functions load on the
first call.
"""

from __future__ import annotations

import diyfa

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func",
           "flash_attn_varlen_func", "flash_attn_with_kvcache"]

# The flash-attn options diyfa does not implement: name -> (is this value the supported
# one?, what is supported and why). "{lse}" is the calling function's way to the LSE.
_UNSUPPORTED = {
    "return_attn_probs": (lambda r: not r,
                          "False only: diyfa never materialises the attention probabilities; "
                          "for the softmax log-sum-exp call {lse}"),
    "rotary_cos": (lambda t: t is None,
                   "None only: diyfa applies no rotary embedding (rotate q and k before the "
                   "call)"),
    "rotary_sin": (lambda t: t is None,
                   "None only: diyfa applies no rotary embedding (rotate q and k before the "
                   "call)"),
    "cache_batch_idx": (lambda t: t is None,
                        "None only: sequence b of q reads row b of the cache"),
    "cache_leftpad": (lambda t: t is None,
                      "None only: every sequence's cache starts at row 0"),
    "block_table": (lambda t: t is None,
                    "None only in flash_attn_varlen_func: paged keys and values run through "
                    "flash_attn_with_kvcache(..., block_table=...)"),
}

_DENSE_LSE = "diyfa.flash_attention(q, k, v, layout='bshd', return_lse=True)"
_VARLEN_LSE = "diyfa.flash_attention_varlen(q, k, v, cu_seqlens_q, ..., return_lse=True)"


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _variants(window_size, softcap, causal) -> dict:
    """flash-attn's window and softcap conventions onto diyfa's: a negative window side is
    unbounded (-1), causal makes the right side 0 (flash-attn drops a positive one; diyfa's
    own function refuses it), a softcap <= 0 is off. Values that are not a pair of ints or
    a number pass unchanged, so that diyfa's checks refuse them by name (a NaN softcap too,
    rather than turning it off)."""
    if isinstance(window_size, (tuple, list)) and len(window_size) == 2 and all(
            _is_int(w) for w in window_size):  # fmt: skip
        left, right = window_size
        left = -1 if left < 0 else left
        right = 0 if causal is True else (-1 if right < 0 else right)
        window_size = (left, right)
    if isinstance(softcap, (int, float)) and not isinstance(softcap, bool) and softcap <= 0:
        softcap = 0.0
    return dict(window_size=window_size, softcap=softcap)


def _unpack(name: str, packed, count: int, layout: str) -> tuple:
    """The ``count`` views along axis 2 of a packed ``qkv`` / ``kv`` tensor, after checking
    its shape (ValueError naming it, rather than an IndexError or extra entries ignored)."""
    shape = getattr(packed, "shape", None)
    if shape is None:
        raise TypeError(f"{name} must be a torch.Tensor, got {type(packed).__name__}")
    if len(shape) != 5 or shape[2] != count:
        raise ValueError(f"{name} must be 5-D {layout}, got shape {tuple(shape)}")
    return tuple(packed[:, :, i] for i in range(count))


def _show(value) -> str:
    shape = getattr(value, "shape", None)
    if shape is not None:  # a tensor: its kind, not its values
        return f"<{type(value).__name__} {getattr(value, 'dtype', '')} {tuple(shape)}>"
    return repr(value)


def _refuse_unsupported(function: str, lse: str = "", **options) -> None:
    """Raise NotImplementedError for the first option whose value diyfa does not support."""
    for name, value in options.items():
        supported, what = _UNSUPPORTED[name]
        if not supported(value):
            raise NotImplementedError(
                f"{function}: {name}={_show(value)} is not supported by diyfa; supported: "
                + what.format(lse=lse)
            )


def _no_fp8(function: str, t) -> None:
    """flash-attn 2's functions take no descales: fp8 inputs are refused by name."""
    if str(getattr(t, "dtype", "")) == "torch.float8_e4m3fn":
        raise TypeError(f"{function} takes float16, bfloat16 or float32 tensors, got "
                        "float8_e4m3fn (fp8 attention: diyfa.flash_attention with q_descale, "
                        "k_descale, v_descale)")  # fmt: skip


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False):  # fmt: skip
    """flash-attn's ``flash_attn_func``: q (batch, seqlen_q, nheads, headdim), k and v
    (batch, seqlen_k, nheads_k, headdim), nheads_k dividing nheads. Returns out, shaped like
    q. Runs ``diyfa.flash_attention(..., layout="bshd")``: differentiable, causal aligned
    bottom-right. Refused options: see the module docstring."""
    _refuse_unsupported("flash_attn_func", _DENSE_LSE,
                        return_attn_probs=return_attn_probs)  # fmt: skip
    _no_fp8("flash_attn_func", q)
    return diyfa.flash_attention(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                 layout="bshd", deterministic=deterministic,
                                 **_variants(window_size, softcap, causal),
                                 alibi_slopes=alibi_slopes, dropout_p=dropout_p)  # fmt: skip


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False):  # fmt: skip
    """flash-attn's ``flash_attn_qkvpacked_func``: qkv (batch, seqlen, 3, nheads, headdim).
    Returns out (batch, seqlen, nheads, headdim); gradients flow into qkv (q, k, v are
    views of it, not copies)."""
    _refuse_unsupported("flash_attn_qkvpacked_func", _DENSE_LSE,
                        return_attn_probs=return_attn_probs)  # fmt: skip
    _no_fp8("flash_attn_qkvpacked_func", qkv)
    q, k, v = _unpack("qkv", qkv, 3, "(batch, seqlen, 3, nheads, headdim)")
    return diyfa.flash_attention(q, k, v, causal=causal,
                                 softmax_scale=softmax_scale, layout="bshd",
                                 deterministic=deterministic,
                                 **_variants(window_size, softcap, causal),
                                 alibi_slopes=alibi_slopes, dropout_p=dropout_p)  # fmt: skip


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False):  # fmt: skip
    """flash-attn's ``flash_attn_kvpacked_func``: q (batch, seqlen_q, nheads, headdim), kv
    (batch, seqlen_k, 2, nheads_k, headdim). Returns out shaped like q; gradients flow into
    q and kv (k, v are views of kv)."""
    _refuse_unsupported("flash_attn_kvpacked_func", _DENSE_LSE,
                        return_attn_probs=return_attn_probs)  # fmt: skip
    _no_fp8("flash_attn_kvpacked_func", q)
    k, v = _unpack("kv", kv, 2, "(batch, seqlen_k, 2, nheads_k, headdim)")
    return diyfa.flash_attention(q, k, v, causal=causal,
                                 softmax_scale=softmax_scale, layout="bshd",
                                 deterministic=deterministic,
                                 **_variants(window_size, softcap, causal),
                                 alibi_slopes=alibi_slopes, dropout_p=dropout_p)  # fmt: skip


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False,
                           block_table=None):  # fmt: skip
    """flash-attn's ``flash_attn_varlen_func``: packed sequences without padding. q
    (total_q, nheads, headdim), k and v (total_k, nheads_k, headdim), int32 cumulative
    lengths (batch + 1,) starting at 0. Returns out (total_q, nheads, headdim);
    differentiable; causal aligned bottom-right per sequence."""
    _refuse_unsupported("flash_attn_varlen_func", _VARLEN_LSE,
                        return_attn_probs=return_attn_probs, block_table=block_table)
    return diyfa.flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                        max_seqlen_k, causal=causal,
                                        softmax_scale=softmax_scale,
                                        deterministic=deterministic,
                                        **_variants(window_size, softcap, causal),
                                        alibi_slopes=alibi_slopes, dropout_p=dropout_p)  # fmt: skip


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False):  # fmt: skip
    """flash-attn's ``flash_attn_with_kvcache`` (inference, no backward): q (batch, seqlen_q,
    nheads, headdim) against a contiguous (batch, seqlen_cache, nheads_k, headdim) or paged
    (num_blocks, page_block_size, nheads_k, headdim) cache with ``block_table``. k and v,
    when given, are written into the cache in place at rows cache_seqlens[b]... first.
    ``cache_seqlens``: an int32 (batch,) tensor, an int (the same length for every
    sequence) or None (every sequence fills the whole cache; then k and v cannot be
    appended). ``causal`` defaults to False, as in flash-attn (diyfa's own function
    defaults to True). Returns out, or (out, softmax_lse (batch, nheads, seqlen_q)) with
    ``return_softmax_lse``. ``rotary_interleaved`` only matters with rotary embedding,
    which is refused."""
    _refuse_unsupported("flash_attn_with_kvcache", rotary_cos=rotary_cos,
                        rotary_sin=rotary_sin, cache_batch_idx=cache_batch_idx,
                        cache_leftpad=cache_leftpad)  # fmt: skip
    import torch

    if not isinstance(return_softmax_lse, bool):
        raise TypeError(f"return_softmax_lse must be a bool, got {return_softmax_lse!r}")
    tensors = isinstance(q, torch.Tensor) and isinstance(k_cache, torch.Tensor) and (
        block_table is None or isinstance(block_table, torch.Tensor)
        and block_table.dim() == 2)  # else diyfa's checks name what is wrong
    if tensors and (cache_seqlens is None or _is_int(cache_seqlens)):
        if cache_seqlens is None:  # flash-attn: every sequence is the whole cache
            if k is not None:
                raise ValueError("flash_attn_with_kvcache: k and v are appended at "
                                 "cache_seqlens, got cache_seqlens=None: pass "
                                 "cache_seqlens with them")  # fmt: skip
            cache_seqlens = k_cache.shape[1] * (1 if block_table is None
                                                else block_table.shape[1])  # fmt: skip
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32,
                                   device=q.device)  # fmt: skip
    return diyfa.flash_attention_with_kvcache(q, k_cache, v_cache, k, v,
                                              cache_seqlens=cache_seqlens,
                                              block_table=block_table, causal=causal,
                                              softmax_scale=softmax_scale,
                                              num_splits=num_splits,
                                              return_lse=return_softmax_lse,
                                              **_variants(window_size, softcap, causal),
                                              alibi_slopes=alibi_slopes)  # fmt: skip
