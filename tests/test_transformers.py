"""attn_implementation="diyfa" in Hugging Face transformers (diyfa/integrations/transformers.py).

Three model families, random-init from small configs (no downloads), fp32 under the Triton
interpreter: Llama (GQA), Mistral (sliding window) and Gemma 2 (logit softcap, alternating
sliding-window layers, its own query scale). For each, on a padded batch: logits and
every parameter's gradient against the same model in float64 by the 2x / 3x rule, PyTorch's
own backend in fp32 ("sdpa"; "eager" for Gemma 2, whose softcap SDPA
cannot take) as the yardstick; greedy generation with the KV cache from a left-padded batch
gives the same tokens.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import diyfa  # noqa: E402
import diyfa.integrations.transformers  # noqa: E402,F401  (registers "diyfa")

from .conftest import DEVICE  # noqa: E402

FLOOR = 1e-6


def _config(family: str):
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  initializer_range=0.2)  # fmt: skip
    if family == "llama":
        return transformers.LlamaConfig(**common), "sdpa"
    if family == "mistral":
        return transformers.MistralConfig(**common, sliding_window=7), "sdpa"
    return transformers.Gemma2Config(**common, head_dim=16, sliding_window=6,
                                     attn_logit_softcapping=5.0, final_logit_softcapping=None,
                                     query_pre_attn_scalar=24), "eager"  # fmt: skip


def _batch(left: bool):
    """Three sequences of 19, 15 and 8 tokens, padded on the left (as generation pads) or on
    the right (as training batches are; the float64 eager reference turns the fully masked
    rows of left padding into NaN, so the gradient check pads right)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 96, (3, 19), generator=g).to(DEVICE)
    mask = torch.ones_like(ids)
    for row, pad in ((1, 4), (2, 11)):
        if left:
            mask[row, :pad] = 0
        else:
            mask[row, -pad:] = 0
    return ids, mask


def _run(model, impl, ids, mask):
    """Logits and parameter gradients of a causal-LM loss over the real tokens."""
    model.set_attn_implementation(impl)
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, attention_mask=mask).logits
    keep = mask.bool()
    loss = torch.nn.functional.cross_entropy(logits[:, :-1][keep[:, 1:]].float(),
                                             ids[:, 1:][keep[:, 1:]])  # fmt: skip
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return logits.detach()[keep], grads


def _err(a, b):
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2"])
def test_logits_gradients_and_generation_match(family):
    config, baseline = _config(family)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="diyfa",
                                                          dtype=torch.float32).to(DEVICE)
    ids, mask = _batch(left=False)
    # The float64 reference runs the baseline backend too. transformers' eager attention in
    # float64 turns padded batches into NaN (its mask), so Gemma 2 (eager: SDPA cannot take
    # the softcap) is checked on the unpadded batch; generation below covers its padding.
    if baseline == "eager":
        mask = torch.ones_like(mask)
    ref_model = copy.deepcopy(model).double()
    ref_logits, ref_grads = _run(ref_model, baseline, ids, mask)
    base_logits, base_grads = _run(model, baseline, ids, mask)
    ours_logits, ours_grads = _run(model, "diyfa", ids, mask)
    assert _err(ours_logits, ref_logits) <= 2 * _err(base_logits, ref_logits) + FLOOR
    for name, ref in ref_grads.items():
        bound = 3 * _err(base_grads[name], ref) + FLOOR
        assert _err(ours_grads[name], ref) <= bound, name

    ids, mask = _batch(left=True)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False)
    model.set_attn_implementation("diyfa")
    ours = model.generate(ids, **kw)
    model.set_attn_implementation(baseline)
    theirs = model.generate(ids, **kw)
    assert torch.equal(ours, theirs)


def test_refusals_are_clear():
    from diyfa.integrations.transformers import attention_forward

    q = torch.randn(1, 2, 4, 16, device=DEVICE)
    module = torch.nn.Module()
    with pytest.raises(NotImplementedError, match="output_attentions=True needs 'eager'"):
        attention_forward(module, q, q, q, None, output_attentions=True)
    module.eval()  # evaluation: the model's dropout is off
    out, _ = attention_forward(module, q, q, q, None, dropout=0.5)
    assert torch.equal(out, attention_forward(module, q, q, q, None)[0])
    module.train()  # training: diyfa's dropout runs
    assert not torch.equal(attention_forward(module, q, q, q, None, dropout=0.5)[0], out)
    with pytest.raises(NotImplementedError, match="2-D \\(batch, kv_len\\) padding mask"):
        attention_forward(module, q, q, q, torch.ones(1, 1, 4, 4, device=DEVICE))


def test_sinks_pass_through():
    """gpt-oss's per-head sink logits (s_aux) reach diyfa's sinks, padded batch or not."""
    from diyfa.integrations.transformers import attention_forward

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 16, generator=g).to(DEVICE)
    k, v = (torch.randn(2, 2, 6, 16, generator=g).to(DEVICE) for _ in range(2))
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], device=DEVICE)
    module = torch.nn.Module()
    out, _ = attention_forward(module, q, k, v, None, s_aux=sinks)
    want = diyfa.flash_attention(q, k, v, causal=True, sinks=sinks).transpose(1, 2)
    assert torch.equal(out, want)
    mask = torch.ones(2, 6, dtype=torch.bool, device=DEVICE)
    mask[1, :2] = False
    out, _ = attention_forward(module, q, k, v, mask, s_aux=sinks)
    assert torch.allclose(out[0], want[0], atol=1e-6) and (out[1, :2] == 0).all()
    tail = diyfa.flash_attention(q[1:, :, 2:], k[1:, :, 2:], v[1:, :, 2:], causal=True,
                                 sinks=sinks).transpose(1, 2)  # fmt: skip
    assert torch.allclose(out[1, 2:], tail[0], atol=1e-6)


def test_padding_mask_unpadded_once_per_mask(monkeypatch):
    """Every layer gets the same padding mask: its unpadding (indices, cumulative lengths) is
    computed once and reused while the mask is unchanged (by its version counter), and the
    cu_seqlens tensors reused are then not read back again; an in-place change of the mask
    is seen (the output follows it)."""
    from diyfa.attention import checks
    from diyfa.integrations import transformers as tf

    calls = []
    cu_seqlens = tf._cu_seqlens
    monkeypatch.setattr(tf, "_cu_seqlens", lambda m: calls.append(1) or cu_seqlens(m))
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 6, 16, generator=g).to(DEVICE)
    k, v = (torch.randn(2, 2, 6, 16, generator=g).to(DEVICE) for _ in range(2))
    mask = torch.ones(2, 6, dtype=torch.bool, device=DEVICE)
    mask[1, :2] = False
    module = torch.nn.Module()
    first = tf.attention_forward(module, q, k, v, mask)[0]
    assert len(calls) == 2  # (queries, keys)
    fresh = []
    init = checks.HostLengths.__init__

    def spy(self, reads):
        init(self, reads)
        fresh.append(self)

    monkeypatch.setattr(checks.HostLengths, "__init__", spy)
    again = tf.attention_forward(module, q, k, v, mask)[0]
    assert len(calls) == 2 and torch.equal(again, first)
    assert fresh and fresh[-1]._fresh == []  # the kept cu_seqlens: nothing copied
    mask[1, :2] = True  # in place: unpadded afresh
    whole = tf.attention_forward(module, q, k, v, mask)[0]
    assert len(calls) == 4
    assert torch.equal(whole, tf.attention_forward(module, q, k, v, None)[0])
