"""Reference attention and matmul in fp32 or fp64, for tests and benchmarks.

Plain PyTorch, materialising the full score matrix: O(seqlen_q x seqlen_k) memory, so only
for checking. Masks follow :mod:`diyfa.flops` (bottom-right causal alignment by default).
A query row that sees no key gives an output of zeros and a log-sum-exp of -inf.
"""

from __future__ import annotations

import math

import torch

from diyfa.flops import ALIGNMENTS, normalize_window


def attention_mask(
    seqlen_q: int,
    seqlen_k: int,
    *,
    causal: bool = False,
    window=None,
    align: str = "bottom_right",
    device=None,
) -> torch.Tensor | None:
    """Boolean (seqlen_q, seqlen_k) mask, True where query i may attend to key j; None if all."""
    if align not in ALIGNMENTS:
        raise ValueError(f"align must be one of {ALIGNMENTS}, got {align!r}")
    left, right = normalize_window(window, causal)
    if left < 0 and right < 0:
        return None
    offset = seqlen_k - seqlen_q if align == "bottom_right" else 0
    i = torch.arange(seqlen_q, device=device)[:, None] + offset
    j = torch.arange(seqlen_k, device=device)[None, :]
    keep = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    return keep


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window=None,
    align: str = "bottom_right",
    layout: str = "bhsd",
    compute_dtype: torch.dtype = torch.float64,
    return_lse: bool = False,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    dropout_mask: torch.Tensor | None = None,
):
    """softmax(Q K^T * scale + mask) V computed in ``compute_dtype``.

    fp64 is the reference; fp32 is a cheaper one for large benchmarks; fp16/bf16 measure
    the error PyTorch itself makes in that precision (the tests' yardstick).

    Layout "bhsd" is (batch, heads, seqlen, dim); "bshd" is (batch, seqlen, heads, dim).
    K/V may have fewer heads than Q (GQA/MQA) if they divide Q's. Returns the output in
    ``compute_dtype`` and layout ``layout``, plus the natural-log LSE (batch, heads, seqlen_q)
    if ``return_lse``. ``softcap`` > 0: scores become softcap * tanh(scores / softcap).
    ``alibi_slopes`` ((heads,) or (batch, heads)): scores get -slope * |i + sk - sq - j|
    (bottom-right, after the softcap). ``sinks`` ((heads,)): one more logit per row in the
    softmax's denominator, with no value (its LSE includes it). ``dropout_mask`` (bool,
    broadcastable to (batch, heads, seqlen_q, seqlen_k), True = kept) with ``dropout_p``:
    the probabilities are masked and the kept ones scaled by 1 / (1 - dropout_p) before
    P @ V (the LSE is the undropped one).
    """
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"layout must be 'bhsd' or 'bshd', got {layout!r}")
    if compute_dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise ValueError(f"compute_dtype must be a torch floating dtype, got {compute_dtype}")
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    q, k, v = (t.to(compute_dtype) for t in (q, k, v))
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % kv_heads:
        raise ValueError(f"q heads ({heads}) must be a multiple of k/v heads ({kv_heads})")
    if kv_heads != heads:
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    if alibi_slopes is not None:
        sq, sk = q.shape[2], k.shape[2]
        dist = (torch.arange(sq, device=q.device)[:, None] + (sk - sq)
                - torch.arange(sk, device=q.device)[None, :]).abs().to(s.dtype)
        slopes = alibi_slopes.to(s.dtype)
        slopes = slopes[None, :, None, None] if slopes.dim() == 1 else slopes[:, :, None, None]
        s = s - slopes * dist
    keep = attention_mask(
        q.shape[2], k.shape[2], causal=causal, window=window, align=align, device=q.device
    )
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    if sinks is not None:  # one more column in the softmax, without a value
        sink_col = sinks.to(s.dtype)[None, :, None, None].expand(*s.shape[:3], 1)
        lse = torch.logsumexp(torch.cat([s, sink_col], dim=-1), dim=-1)
    else:
        lse = torch.logsumexp(s, dim=-1)
    # Rows that see no key: lse = -inf; exp(s - lse) would be NaN, the answer is 0.
    p = torch.exp(s - lse.unsqueeze(-1).masked_fill(torch.isinf(lse).unsqueeze(-1), 0.0))
    if dropout_mask is not None:
        p = torch.where(dropout_mask, p / (1.0 - dropout_p), 0.0)
    out = torch.matmul(p, v)
    if layout == "bshd":
        out = out.transpose(1, 2)
    return (out, lse) if return_lse else out


def dropout_mask(seed: int, bh: int, seqlen_q: int, seqlen_k: int,
                 dropout_p: float) -> torch.Tensor:
    """diyfa's dropout mask, computed on the host: (seqlen_q, seqlen_k) bool, True where
    the pair (query i, key j) of (batch or packed sequence, query head) number ``bh``
    (batch * heads + head) is kept under ``seed`` (the Philox seed the call drew). The
    kernels' scheme (``portable._keep``): one Philox4x32-7 draw per group of eight pairs,
    queries {i, i + 8} x keys {j, j + 1, j + 8, j + 9} (bit 3 of i and j clear, j even);
    counter (key group, query group, bh, 0), the groups (j >> 4) * 4 + ((j >> 1) & 3) and
    (i >> 4) * 8 + (i & 7); key the low and high 32 bits of 2^32 + seed mod (2^62 - 2^32)
    (``portable.dropout_key``); the pair takes the 16 bits (j & 1) of word 2 * (bit 3 of
    i) + (bit 3 of j) and is kept iff they are >= round(dropout_p * 2^16)."""
    import numpy as np

    u = np.uint64
    m32 = u(0xFFFFFFFF)
    qi, kj = np.meshgrid(np.arange(seqlen_q, dtype=u), np.arange(seqlen_k, dtype=u),
                         indexing="ij")  # fmt: skip
    c = [((kj >> u(4)) << u(2)) | ((kj >> u(1)) & u(3)),
         ((qi >> u(4)) << u(3)) | (qi & u(7)), np.full_like(qi, bh), np.zeros_like(qi)]
    key = 2**32 + seed % (2**62 - 2**32)
    k0, k1 = u(key & 0xFFFFFFFF), u(key >> 32)
    for _ in range(7):
        pb, pa = c[2] * u(0xCD9E8D57), c[0] * u(0xD2511F53)  # exact: both factors < 2^32
        c = [(pb >> u(32)) ^ c[1] ^ k0, pb & m32, (pa >> u(32)) ^ c[3] ^ k1, pa & m32]
        k0, k1 = (k0 + u(0x9E3779B9)) & m32, (k1 + u(0xBB67AE85)) & m32
    word = np.choose((2 * ((qi >> u(3)) & u(1)) + ((kj >> u(3)) & u(1))).astype(np.int64), c)
    bits = (word >> (u(16) * (kj & u(1)))) & u(0xFFFF)
    return torch.from_numpy(bits >= u(min(round(dropout_p * 2**16), 2**16 - 1)))


def matmul_ref(
    a: torch.Tensor, b: torch.Tensor, *, compute_dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """A @ B in ``compute_dtype`` (fp64 or fp32), 2-D or batched 3-D."""
    if compute_dtype not in (torch.float32, torch.float64):
        raise ValueError(
            f"compute_dtype must be torch.float32 or torch.float64, got {compute_dtype}"
        )
    return torch.matmul(a.to(compute_dtype), b.to(compute_dtype))
