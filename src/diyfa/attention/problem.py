"""One attention call, described once: :class:`Problem`.

:func:`diyfa.attention.checks.check_inputs` builds it from q, k, v and the options once they
have passed every check; the dispatcher (``dispatch.py``) asks each kernel family whether it
supports it, and the chosen family's forward and backward read shapes, strides and options
from it rather than from the tensors again.

Building one is on the path of every call, so it is cheap: shape and stride reads and a
compute capability that is queried from the driver once per device and cached.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from diyfa.device import cuda_capability, interpreter_enabled

LAYOUTS = ("bhsd", "bshd")
ALIGNS = ("bottom_right", "top_left")


@dataclass(frozen=True, slots=True)
class Problem:
    """Shapes, dtype, device, layout, masking and scale of one attention call.

    ``heads`` are the query heads, ``kv_heads`` the key/value heads (fewer: GQA/MQA).
    ``causal`` with ``align="bottom_right"`` lets query i see key j iff
    j <= i + seqlen_k - seqlen_q (FlashAttention's convention); ``"top_left"`` uses offset 0
    (PyTorch's ``is_causal``). ``softmax_scale`` is resolved: 1/sqrt(head_dim) unless given.
    Strides are in (batch, heads, seqlen, dim) order whatever the layout. ``capability`` is
    the CUDA device's (major, minor); None on the CPU and under the Triton interpreter.
    ``aligned16``: every data pointer is a multiple of 16 bytes.
    ``deterministic``: the backward must give bitwise-reproducible gradients (no atomics).
    """

    batch: int
    heads: int
    kv_heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    layout: str
    causal: bool
    align: str
    softmax_scale: float
    q_strides: tuple[int, int, int, int]
    k_strides: tuple[int, int, int, int]
    v_strides: tuple[int, int, int, int]
    capability: tuple[int, int] | None
    aligned16: bool  # q, k and v all start on a 16-byte boundary (TMA's rule)
    # Packed sequences (flash_attention_varlen): int32 cumulative lengths (batch + 1,), the
    # total query rows; seqlen_q / seqlen_k are then the longest sequences.
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    total_q: int = 0
    # The backward may not use atomics (bitwise-reproducible gradients): asked for with
    # ``deterministic=True`` or torch.use_deterministic_algorithms(True). The portable
    # backward is deterministic either way; the Hopper backward reads it.
    deterministic: bool = False
    # Variants (issue 14): a band of visible keys, key j visible from query i iff
    # i + causal_offset - window_left <= j <= i + causal_offset + window_right (-1: that side
    # unbounded; causal makes window_right 0); softcap > 0: scores become
    # softcap * tanh(scores / softcap) before the softmax.
    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    # ALiBi: fp32 slopes, (heads,) or (batch, heads): scores get -slope * |i + sk - sq - j|.
    # Attention sinks: (heads,) logits that join each row's softmax denominator (no value).
    alibi_slopes: torch.Tensor | None = None
    sinks: torch.Tensor | None = None
    # v's head dim when it differs from q's and k's (DeepSeek's MLA: 192 / 128); 0: the same.
    value_dim: int = 0
    # Attention dropout: each probability is dropped with dropout_p (the kept ones scaled by
    # 1 / (1 - dropout_p)); the mask is Philox of (dropout_seed, the pair's place), drawn
    # once per call, so the backward regenerates it (reference.dropout_mask).
    dropout_p: float = 0.0
    dropout_seed: int = 0
    # fp8 (issue 18): q, k, v in float8_e4m3fn with fp32 descales (q_descale, k_descale,
    # v_descale), each (1,) (per tensor) or (batch, kv_heads) contiguous: a stored value times
    # its descale is the real one. The output is bf16. Forward only.
    descales: tuple | None = None
    # Packed sequences: the cumulative lengths on their way to the host (checks.HostLengths,
    # whose values() waits for them and checks them; or a (cu_seqlens_q values, cu_seqlens_k
    # values) pair), for the checks and launch planning; None when unknown (tracing).
    cu_host: object | None = None

    @property
    def out_dtype(self) -> torch.dtype:
        """The output's dtype: the inputs', or bf16 for fp8 inputs."""
        return torch.bfloat16 if self.descales is not None else self.dtype

    @property
    def head_dim_v(self) -> int:
        """The head dim of v, the output, dO and dV."""
        return self.value_dim or self.head_dim

    @property
    def kv_group(self) -> int:
        """Query heads per key/value head (1 without GQA)."""
        return self.heads // self.kv_heads

    @property
    def causal_offset(self) -> int:
        """Query i sees key j iff j <= i + causal_offset (when causal)."""
        return self.seqlen_k - self.seqlen_q if self.align == "bottom_right" else 0

    def without_own_tensors(self) -> Problem:
        """This problem without the call's own tensors (sinks, ALiBi slopes): what a cache
        keyed by signature keeps (a Problem holding a tensor compares by it)."""
        if self.sinks is None and self.alibi_slopes is None:
            return self
        return replace(self, sinks=None, alibi_slopes=None)


def bhsd_shape(t: torch.Tensor, layout: str) -> tuple[int, int, int, int]:
    """Shape of ``t`` in (batch, heads, seqlen, dim) order."""
    b, d1, d2, d = t.shape
    return (b, d1, d2, d) if layout == "bhsd" else (b, d2, d1, d)


def bhsd_strides(t: torch.Tensor, layout: str) -> tuple[int, int, int, int]:
    """Strides of ``t`` in (batch, heads, seqlen, dim) order."""
    sb, s1, s2, sd = t.stride()
    return (sb, s1, s2, sd) if layout == "bhsd" else (sb, s2, s1, sd)


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device, cached per device; None for the CPU or when kernels
    run in the Triton interpreter."""
    if device.type != "cuda" or interpreter_enabled():
        return None
    return cuda_capability(device.index)
