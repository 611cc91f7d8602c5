"""Exact FLOPs and minimum bytes for attention and matmul.

Attention (FlashAttention's convention for what counts): the forward does two matmuls per
unmasked (query, key) pair, S = Q K^T (``head_dim`` multiply-adds) and O = P V
(``head_dim_v`` multiply-adds), so

    forward  = 2 * heads * pairs * (head_dim + head_dim_v)          (= 4 * pairs * d)
    backward = 2 * heads * pairs * (3 * head_dim + 2 * head_dim_v)   (= 2.5 x forward)

summed over the batch. ``pairs`` counts the (query, key) pairs the mask keeps, for every
sequence's own seqlen_q and seqlen_k: never seqlen_q squared (seed 002: q=4096, kv=15360 has
3.75x the FLOPs of the q^2 count). ``convention="published"`` gives the number published
benchmarks use instead: all seqlen_q x seqlen_k pairs, halved when causal. The two differ for
short or unequal causal sequences and for windows.

Masks (shared with :mod:`diyfa.reference`): with ``offset = seqlen_k - seqlen_q`` for
bottom-right alignment (FlashAttention's convention) or 0 for top-left, query ``i`` sees key
``j`` iff ``i + offset - left <= j <= i + offset + right``; causal is ``right = 0``, a side of
-1 is unbounded.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

DTYPE_BYTES = {
    "fp64": 8, "float64": 8,
    "fp32": 4, "float32": 4, "tf32": 4,
    "fp16": 2, "float16": 2, "half": 2,
    "bf16": 2, "bfloat16": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
}  # fmt: skip
MODES = ("fwd", "bwd", "fwd_bwd")
ALIGNMENTS = ("bottom_right", "top_left")


def dtype_bytes(dtype) -> int:
    """Bytes per element of a dtype name ('bf16', 'float16', ...) or a torch dtype."""
    name = str(dtype).removeprefix("torch.").lower()
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; accepted: {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


def _check_positive(**sizes) -> None:
    for name, value in sizes.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} must be an int, got {value!r}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def normalize_window(window, causal: bool) -> tuple[int, int]:
    """Turn ``causal`` and ``window`` into (left, right) with -1 for unbounded.

    ``window`` is None (no window), an int ``w`` (causal only: the last ``w`` keys, the query's
    own position included, i.e. ``(w - 1, 0)``), or a (left, right) pair in keys.
    """
    if window is None:
        return (-1, 0) if causal else (-1, -1)
    if isinstance(window, bool):
        raise TypeError(f"window must be None, an int or a (left, right) pair, got {window!r}")
    if isinstance(window, (int, np.integer)):
        if not causal:
            raise ValueError(
                f"window={window} on a non-causal request is ambiguous: pass window=(left, right)"
                " in keys, or causal=True for the last `window` keys"
            )
        if window < 1:
            raise ValueError(f"window must be >= 1 key, got {window}")
        return (int(window) - 1, 0)
    if not (isinstance(window, Sequence) and len(window) == 2):
        raise TypeError(f"window must be None, an int or a (left, right) pair, got {window!r}")
    left, right = (int(w) for w in window)
    if left < -1 or right < -1:
        raise ValueError(f"window sides must be >= 0 or -1 (unbounded), got {window!r}")
    if causal:
        if right not in (0, -1):
            raise ValueError(
                f"window={window!r} looks ahead {right} keys, which causal=True forbids; "
                "use right=0 (or -1) with causal=True"
            )
        right = 0
    return left, right


def attention_pairs(
    seqlen_q: int,
    seqlen_k: int | None = None,
    *,
    causal: bool = False,
    window=None,
    align: str = "bottom_right",
) -> int:
    """Exact number of (query, key) pairs the mask keeps for one sequence and one head."""
    seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
    _check_positive(seqlen_q=seqlen_q, seqlen_k=seqlen_k)
    if align not in ALIGNMENTS:
        raise ValueError(f"align must be one of {ALIGNMENTS}, got {align!r}")
    left, right = normalize_window(window, causal)
    offset = seqlen_k - seqlen_q if align == "bottom_right" else 0
    i = np.arange(seqlen_q, dtype=np.int64)
    lo = np.zeros_like(i) if left < 0 else np.maximum(0, i + offset - left)
    last = seqlen_k - 1
    hi = np.full_like(i, last) if right < 0 else np.minimum(last, i + offset + right)
    return int(np.maximum(0, hi - lo + 1).sum())


def _seqlens(batch, seqlen_q, seqlen_k, seqlens_q, seqlens_k) -> list[tuple[int, int]]:
    if seqlens_q is not None or seqlens_k is not None:
        sq = list(seqlens_q if seqlens_q is not None else seqlens_k)
        sk = list(seqlens_k if seqlens_k is not None else seqlens_q)
        if len(sq) != len(sk):
            raise ValueError(
                f"seqlens_q and seqlens_k must have one entry per sequence, got {len(sq)} "
                f"and {len(sk)}"
            )
        for a, b in zip(sq, sk, strict=True):
            _check_positive(seqlen_q=a, seqlen_k=b)
        return list(zip(sq, sk, strict=True))
    _check_positive(batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k)
    return [(seqlen_q, seqlen_k if seqlen_k is not None else seqlen_q)] * batch


def attention_flops(
    batch: int = 1,
    heads: int = 1,
    seqlen_q: int | None = None,
    seqlen_k: int | None = None,
    head_dim: int = 64,
    *,
    head_dim_v: int | None = None,
    kv_heads: int | None = None,
    causal: bool = False,
    window=None,
    align: str = "bottom_right",
    mode: str = "fwd",
    convention: str = "exact",
    seqlens_q: Sequence[int] | None = None,
    seqlens_k: Sequence[int] | None = None,
) -> int:
    """Attention FLOPs. ``mode`` in fwd/bwd/fwd_bwd; ``convention`` "exact" or "published".

    ``seqlens_q``/``seqlens_k`` give per-sequence lengths (varlen) instead of batch x seqlen.
    ``kv_heads`` (GQA/MQA) does not change FLOPs: every query head does its own work.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if convention not in ("exact", "published"):
        raise ValueError(f"convention must be 'exact' or 'published', got {convention!r}")
    if seqlen_q is None and seqlens_q is None and seqlens_k is None:
        raise ValueError("give seqlen_q (and optionally seqlen_k), or seqlens_q/seqlens_k")
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    _check_positive(heads=heads, head_dim=head_dim, head_dim_v=head_dim_v, kv_heads=kv_heads)
    if kv_heads is not None and heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    left_right = normalize_window(window, causal)  # validates even for "published"
    total_pairs = 0
    for sq, sk in _seqlens(batch, seqlen_q, seqlen_k, seqlens_q, seqlens_k):
        if convention == "exact":
            total_pairs += attention_pairs(sq, sk, causal=causal, window=left_right, align=align)
        else:
            total_pairs += sq * sk / 2 if causal else sq * sk
    fwd = 2 * heads * total_pairs * (head_dim + head_dim_v)
    bwd = 2 * heads * total_pairs * (3 * head_dim + 2 * head_dim_v)
    result = {"fwd": fwd, "bwd": bwd, "fwd_bwd": fwd + bwd}[mode]
    return int(round(result))


def attention_bytes(
    batch: int,
    heads: int,
    seqlen_q: int,
    seqlen_k: int | None = None,
    head_dim: int = 64,
    *,
    head_dim_v: int | None = None,
    kv_heads: int | None = None,
    dtype="bf16",
    mode: str = "fwd",
) -> int:
    """Fewest bytes attention must move through device memory: each input read once, each
    output written once. Forward: Q, K, V in, O and the fp32 log-sum-exp out. Backward:
    Q, K, V, O, dO, LSE in, dQ, dK, dV out.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    kv_heads = heads if kv_heads is None else kv_heads
    _check_positive(batch=batch, heads=heads, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                    head_dim=head_dim, head_dim_v=head_dim_v, kv_heads=kv_heads)  # fmt: skip
    e = dtype_bytes(dtype)
    q = batch * heads * seqlen_q * head_dim * e
    o = batch * heads * seqlen_q * head_dim_v * e
    k = batch * kv_heads * seqlen_k * head_dim * e
    v = batch * kv_heads * seqlen_k * head_dim_v * e
    lse = batch * heads * seqlen_q * 4
    fwd = q + k + v + o + lse
    bwd = (q + k + v + o + o + lse) + (q + k + v)
    return {"fwd": fwd, "bwd": bwd, "fwd_bwd": fwd + bwd}[mode]


def matmul_flops(m: int, n: int, k: int, batch: int = 1) -> int:
    """FLOPs of C[m, n] = A[m, k] @ B[k, n]: 2 * m * n * k per batch element."""
    _check_positive(m=m, n=n, k=k, batch=batch)
    return 2 * batch * m * n * k


def matmul_bytes(m: int, n: int, k: int, dtype="bf16", out_dtype=None, batch: int = 1) -> int:
    """Fewest bytes a matmul must move: A and B read once, C written once."""
    _check_positive(m=m, n=n, k=k, batch=batch)
    e_in = dtype_bytes(dtype)
    e_out = dtype_bytes(out_dtype if out_dtype is not None else dtype)
    return batch * ((m * k + k * n) * e_in + m * n * e_out)


def arithmetic_intensity(flops: float, nbytes: float) -> float:
    """FLOPs per byte moved."""
    if nbytes <= 0:
        raise ValueError(f"bytes must be > 0, got {nbytes}")
    return flops / nbytes
