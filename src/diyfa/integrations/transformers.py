"""diyfa as an attention backend of Hugging Face transformers: ``attn_implementation="diyfa"``.

Importing this module registers it (transformers is an optional dependency: ``pip install
diy-flash-attention[transformers]``, pinned to the version the GPU machine runs)::

    import diyfa.integrations.transformers  # noqa: F401  (registers "diyfa")
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="diyfa")

What it registers, under the name "diyfa":
- the attention function (transformers' ``AttentionInterface``): q, k, v arrive as
  (batch, heads, seqlen, head_dim), k/v with the model's kv heads (GQA runs natively, no
  repeat) and, during generation, the whole cache; it returns (batch, seqlen, heads,
  head_dim) as the other backends do;
- the mask function (``AttentionMaskInterface``): transformers' own flash-attention one,
  which hands over ``None`` when no token is padding, else the 2-D (batch, kv_len) padding
  mask (sliced to the window for sliding-window layers).

How a call runs: without padding, one ``diyfa.flash_attention`` call, causal bottom-right
(so a prefill, a chunk of new tokens against a cache, and one-token decoding are all the
same call); with padding, the real tokens are packed and run through
``diyfa.flash_attention_varlen`` (no work on padding; padded query rows come out as
zeros), then scattered back; the unpadding is worked out once per padding mask (every layer
gets the same tensor) and kept while the mask is unchanged, so only the first layer waits
for the GPU. Model options: ``scaling``, ``sliding_window`` (a window of W
tokens, the query's own included: window_size (W - 1, 0), as transformers' flash-attention
path passes it), ``softcap`` (Gemma 2's logit softcapping), ``s_aux`` (gpt-oss's attention
sinks, differentiable), ``dropout`` while the module trains (diyfa's Philox dropout).
Refused with ``NotImplementedError``: ``output_attentions``, a 4-D custom mask.

Not yet: ``torch.compile(fullgraph=True)`` over a padded batch (the varlen path reads the
lengths on the host), static caches.
"""

from __future__ import annotations

import torch

import diyfa
from diyfa.attention import checks

NAME = "diyfa"


def _unpad(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` of (batch, seqlen, heads, dim) ``x`` flattened over (batch, seqlen)."""
    return x.reshape(-1, *x.shape[2:]).index_select(0, index)


def _cu_seqlens(mask: torch.Tensor) -> tuple[torch.Tensor, int]:
    lengths = mask.sum(1, dtype=torch.int32)
    cu = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    return cu, int(lengths.max().item()) if lengths.numel() else 0


def _unpadding(attention_mask: torch.Tensor, sq: int, sk: int) -> tuple:
    """(query rows, key rows, cu_seqlens_q, max_seqlen_q, cu_seqlens_k, max_seqlen_k) of the
    real tokens under a (batch, kv_len) padding mask, for ``sq`` queries (the last ones) and
    ``sk`` keys. Every layer of a forward gets the same mask tensor: its unpadding (with
    four host reads, which wait for the GPU) is kept by the tensor and its version counter
    (``checks.keep``), so the layers after the first reuse it, and diyfa then finds their
    cu_seqlens tensors already read (no copy, no wait at all)."""
    stamp = checks.version_stamp(attention_mask)
    kept = checks.recall(attention_mask, stamp, ("unpadding", sq, sk))
    if kept is not None:
        return kept
    mask_k = attention_mask[:, -sk:].bool()
    mask_q = mask_k[:, -sq:]
    index_q = mask_q.flatten().nonzero().flatten()
    index_k = mask_k.flatten().nonzero().flatten()
    cu_q, max_q = _cu_seqlens(mask_q)
    cu_k, max_k = _cu_seqlens(mask_k)
    unpadding = (index_q, index_k, cu_q, max(max_q, 1), cu_k, max(max_k, 1))
    checks.keep(attention_mask, stamp, unpadding, ("unpadding", sq, sk))
    return unpadding


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None,
                      dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, softcap: float | None = None,
                      is_causal: bool | None = None, s_aux: torch.Tensor | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:  # fmt: skip
    """transformers' attention-function contract (see the module docstring)."""
    if kwargs.get("output_attentions", False):
        raise NotImplementedError("attn_implementation='diyfa' never materialises the "
                                  "attention weights: output_attentions=True needs 'eager'")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    b, h, sq, d = query.shape
    sk = key.shape[2]
    window = (-1, -1)
    if sliding_window is not None and sk > sliding_window:
        window = (sliding_window - 1, 0 if causal else sliding_window - 1)
    options = dict(causal=causal, softmax_scale=scaling, window_size=window,
                   softcap=float(softcap or 0.0), sinks=s_aux,
                   dropout_p=float(dropout) if module.training else 0.0)  # fmt: skip
    if attention_mask is None:
        out = diyfa.flash_attention(query, key, value, **options)
        return out.transpose(1, 2).contiguous(), None
    if attention_mask.dim() != 2 or attention_mask.shape[0] != b or attention_mask.shape[1] < sk:
        raise NotImplementedError(
            f"attn_implementation='diyfa' takes a 2-D (batch, kv_len) padding mask (from its "
            f"registered mask function), got shape {tuple(attention_mask.shape)} for batch {b} "
            f"and {sk} keys (custom 4-D masks and static caches are not supported)")
    index_q, index_k, cu_q, max_q, cu_k, max_k = _unpadding(attention_mask, sq, sk)
    q = _unpad(query.transpose(1, 2), index_q)
    k = _unpad(key.transpose(1, 2), index_k)
    v = _unpad(value.transpose(1, 2), index_k)
    packed = diyfa.flash_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **options)
    dv = packed.shape[-1]  # the value head dim (MLA-style models: not q's)
    out = packed.new_zeros(b * sq, h, dv).index_copy(0, index_q, packed)
    return out.view(b, sq, h, dv), None


def register(name: str = NAME) -> None:
    """Register the attention and mask functions under ``name`` (done on import as "diyfa")."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)


register()
