"""diyfa.flash_attn_interface: flash-attn 2's API on diyfa's kernels.

Signatures against flash-attn 2.8's (a literal table), results bitwise equal to diyfa's own
calls and within the 2x / 3x rule of test_attention.py of the float64 reference, arguments
reaching diyfa by name, and every refused option a NotImplementedError before anything runs.
CPU runs use the Triton interpreter on small shapes.
"""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import torch

import diyfa
from diyfa import flash_attn_interface as fai
from diyfa.reference import attention_ref

from .conftest import DEVICE
from .test_attention import _check, _inputs
from .test_varlen import _packed
from .test_varlen import _reference as _varlen_reference

E = inspect.Parameter.empty
# flash-attn 2.8.3, flash_attn/flash_attn_interface.py: (name, default), in order.
FLASH_ATTN_2 = {
    "flash_attn_func": [
        ("q", E), ("k", E), ("v", E), ("dropout_p", 0.0), ("softmax_scale", None),
        ("causal", False), ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None),
        ("deterministic", False), ("return_attn_probs", False)],
    "flash_attn_qkvpacked_func": [
        ("qkv", E), ("dropout_p", 0.0), ("softmax_scale", None), ("causal", False),
        ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None),
        ("deterministic", False), ("return_attn_probs", False)],
    "flash_attn_kvpacked_func": [
        ("q", E), ("kv", E), ("dropout_p", 0.0), ("softmax_scale", None), ("causal", False),
        ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None),
        ("deterministic", False), ("return_attn_probs", False)],
    "flash_attn_varlen_func": [
        ("q", E), ("k", E), ("v", E), ("cu_seqlens_q", E), ("cu_seqlens_k", E),
        ("max_seqlen_q", E), ("max_seqlen_k", E), ("dropout_p", 0.0), ("softmax_scale", None),
        ("causal", False), ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None),
        ("deterministic", False), ("return_attn_probs", False), ("block_table", None)],
    "flash_attn_with_kvcache": [
        ("q", E), ("k_cache", E), ("v_cache", E), ("k", None), ("v", None),
        ("rotary_cos", None), ("rotary_sin", None), ("cache_seqlens", None),
        ("cache_batch_idx", None), ("cache_leftpad", None), ("block_table", None),
        ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
        ("softcap", 0.0), ("rotary_interleaved", True), ("alibi_slopes", None),
        ("num_splits", 0), ("return_softmax_lse", False)],
}  # fmt: skip

F16 = torch.float16


@pytest.mark.parametrize("name", sorted(FLASH_ATTN_2))
def test_signature_is_flash_attn_2s(name):
    params = list(inspect.signature(getattr(fai, name)).parameters.values())
    assert [(p.name, p.default) for p in params] == FLASH_ATTN_2[name]
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params)


def test_module_exports_the_five_functions():
    assert sorted(fai.__all__) == sorted(FLASH_ATTN_2)


def test_importing_loads_neither_torch_nor_kernels():
    code = ("import sys, diyfa.flash_attn_interface; "
            "print(sorted(m for m in sys.modules "
            "if m.startswith(('diyfa.attention', 'diyfa.ops', 'triton', 'torch'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)  # fmt: skip
    assert out.stdout.strip() == "[]"


# --- results: bitwise diyfa's own call, close to the float64 reference ----------------------

def _ref_and_pt(tensors, do, **kw):
    """attention_ref on ``tensors`` (bshd) in float64 and in their own dtype, with the
    gradients of sum(out * do) into copies of the leaves; returns ((ref, leaves), (pt,
    leaves)). ``tensors`` maps the leaves to (q, k, v)."""
    leaves, views = tensors
    results = []
    for dtype in (torch.float64, leaves[0].dtype):
        copies = [t.detach().to(dtype).requires_grad_() for t in leaves]
        out = attention_ref(*views(*copies), layout="bshd", compute_dtype=dtype, **kw)
        (out * do.to(dtype)).sum().backward()
        results.append((out, copies))
    return results


@pytest.mark.parametrize("shape, causal, scale", [
    ((2, 4, 4, 33, 33, 32), False, None),
    ((1, 4, 2, 17, 45, 64), True, None),   # GQA, fewer queries than keys
    ((1, 2, 1, 40, 24, 16), True, 0.3),    # MQA, more queries: the first 16 rows see no key
], ids=["full", "gqa-causal", "mqa-causal-scale"])  # fmt: skip
def test_flash_attn_func(shape, causal, scale):
    b, h, hk, sq, sk, d = shape
    q, k, v = _inputs(b, h, hk, sq, sk, d, F16, layout="bshd")
    out = fai.flash_attn_func(q, k, v, 0.0, scale, causal)  # flash-attn's positional order
    with torch.no_grad():
        ours = diyfa.flash_attention(q, k, v, causal=causal, softmax_scale=scale,
                                     layout="bshd")  # fmt: skip
    assert out.shape == (b, sq, h, d) and torch.equal(out, ours)
    do = torch.randn_like(out)
    out.backward(do)
    (ref, ref_in), (pt, pt_in) = _ref_and_pt(((q, k, v), lambda *t: t), do, causal=causal,
                                             softmax_scale=scale)  # fmt: skip
    _check("out", out, pt, ref, 2, F16)
    for name, t, p, r in zip(("dq", "dk", "dv"), (q, k, v), pt_in, ref_in, strict=True):
        _check(name, t.grad, p.grad, r.grad, 3, F16)


def _leaf(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEVICE, F16).requires_grad_()


def _packed_against_diyfa(ours, leaves, views, causal):
    """``ours(*leaves)`` against diyfa.flash_attention on ``views`` of copies of the leaves:
    bitwise the same output and gradients (into the packed tensors); and against the float64
    reference by the 2x / 3x rule."""
    out = ours(*leaves)
    do = torch.randn_like(out)
    out.backward(do)
    copies = [t.detach().clone().requires_grad_() for t in leaves]
    theirs = diyfa.flash_attention(*views(*copies), causal=causal, layout="bshd")
    theirs.backward(do)
    assert torch.equal(out, theirs)
    for t, c in zip(leaves, copies, strict=True):
        assert t.grad is not None and t.grad.abs().sum() > 0
        assert torch.equal(t.grad, c.grad)
    (ref, ref_in), (pt, pt_in) = _ref_and_pt((leaves, views), do, causal=causal)
    _check("out", out, pt, ref, 2, F16)
    for i, t in enumerate(leaves):
        _check(f"grad {i}", t.grad, pt_in[i].grad, ref_in[i].grad, 3, F16)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flash_attn_qkvpacked_func(causal):
    qkv = _leaf(2, 29, 3, 2, 32)
    _packed_against_diyfa(lambda qkv: fai.flash_attn_qkvpacked_func(qkv, causal=causal),
                          [qkv], lambda qkv: (qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]),
                          causal)  # fmt: skip


def test_flash_attn_kvpacked_func():
    q, kv = _leaf(2, 21, 4, 32, seed=1), _leaf(2, 38, 2, 2, 32, seed=2)  # GQA, sq < sk
    _packed_against_diyfa(lambda q, kv: fai.flash_attn_kvpacked_func(q, kv, causal=True),
                          [q, kv], lambda q, kv: (q, kv[:, :, 0], kv[:, :, 1]), True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flash_attn_varlen_func(causal):
    lens_q, lens_k = [5, 0, 17, 9], [9, 3, 30, 4]
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, 4, 2, 32, F16)
    out = fai.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                     causal=causal)  # fmt: skip
    with torch.no_grad():
        ours = diyfa.flash_attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                            causal=causal)  # fmt: skip
    assert out.shape == q.shape and torch.equal(out, ours)
    do = torch.randn_like(out)
    out.backward(do)
    ref, _, ref_grads = _varlen_reference(q, k, v, cu_q, cu_k, causal, torch.float64, do)
    pt, _, pt_grads = _varlen_reference(q, k, v, cu_q, cu_k, causal, F16, do)
    _check("out", out, pt, ref, 2, F16)
    for name, t, p, r in zip(("dq", "dk", "dv"), (q, k, v), pt_grads, ref_grads, strict=True):
        _check(name, t.grad, p, r, 3, F16)


def _cache(lens, s_new, sq=2, h=4, hk=2, d=32, max_len=48, seed=0):
    """q, a contiguous cache, new k/v (or None) and the cache as it must be after the
    append."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(DEVICE, F16)

    b = len(lens)
    q, k_cache, v_cache = rnd(b, sq, h, d), rnd(b, max_len, hk, d), rnd(b, max_len, hk, d)
    k, v = (rnd(b, s_new, hk, d), rnd(b, s_new, hk, d)) if s_new else (None, None)
    after_k, after_v = k_cache.clone(), v_cache.clone()
    for i, n in enumerate(lens):
        if s_new:
            after_k[i, n:n + s_new], after_v[i, n:n + s_new] = k[i], v[i]
    return q, k_cache, v_cache, k, v, after_k, after_v


def _kvcache_reference(q, k, v, lengths, causal):
    """Per sequence, float64 and q's dtype: [(out, lse)] (out bshd, lse (batch, heads, sq))."""
    results = []
    for dtype in (torch.float64, q.dtype):
        outs, lses = [], []
        for i, n in enumerate(lengths):
            o, lse = attention_ref(q[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n], causal=causal,
                                   layout="bshd", compute_dtype=dtype, return_lse=True)
            outs.append(o)
            lses.append(lse)
        results.append((torch.cat(outs), torch.cat(lses)))
    return results


def test_flash_attn_with_kvcache_appends_and_returns_the_lse():
    lens, s_new = [5, 20], 3
    q, k_cache, v_cache, k, v, after_k, after_v = _cache(lens, s_new)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    kc2, vc2 = k_cache.clone(), v_cache.clone()
    out, lse = fai.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                           causal=True, return_softmax_lse=True)
    theirs, their_lse = diyfa.flash_attention_with_kvcache(
        q, kc2, vc2, k, v, cache_seqlens=seqlens, causal=True, return_lse=True)
    assert torch.equal(out, theirs) and torch.equal(lse, their_lse)
    assert torch.equal(k_cache, after_k) and torch.equal(v_cache, after_v)  # appended in place
    assert out.shape == q.shape and lse.shape == (2, 4, 2) and lse.dtype == torch.float32
    (ref, ref_lse), (pt, _) = _kvcache_reference(q, after_k, after_v,
                                                 [n + s_new for n in lens], True)
    _check("out", out, pt, ref, 2, F16)
    assert (lse.double() - ref_lse).abs().max().item() < 1e-3


def test_flash_attn_with_kvcache_int_seqlens_and_flash_attns_default_not_causal():
    # Two new queries against 11 cached + 2 appended keys: causal would hide the last key
    # from query 0, so the reference (not causal) tells the default apart.
    q, k_cache, v_cache, k, v, after_k, after_v = _cache([11, 11], 2)
    with torch.no_grad():
        out = fai.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=11)
    (ref, _), (pt, _) = _kvcache_reference(q, after_k, after_v, [13, 13], False)
    _check("out", out, pt, ref, 2, F16)
    assert torch.equal(k_cache, after_k) and torch.equal(v_cache, after_v)
    (_, _), (causal_pt, _) = _kvcache_reference(q, after_k, after_v, [13, 13], True)
    assert not torch.allclose(out.float(), causal_pt.float(), atol=1e-2)


def test_flash_attn_with_kvcache_without_seqlens_attends_the_whole_cache():
    q, k_cache, v_cache, *_ = _cache([0, 0], 0, max_len=40)
    out = fai.flash_attn_with_kvcache(q, k_cache, v_cache)
    (ref, _), (pt, _) = _kvcache_reference(q, k_cache, v_cache, [40, 40], False)
    _check("out", out, pt, ref, 2, F16)
    with pytest.raises(ValueError, match="pass cache_seqlens"):
        fai.flash_attn_with_kvcache(q, k_cache, v_cache, k_cache[:, :1], v_cache[:, :1])


# --- arguments reach diyfa by name (no kernel runs) ----------------------------------------

class _Spy:
    def __init__(self):
        self.calls = []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return "out"


@pytest.fixture
def spies(monkeypatch):
    spies = {name: _Spy() for name in ("flash_attention", "flash_attention_varlen",
                                       "flash_attention_with_kvcache")}  # fmt: skip
    for name, spy in spies.items():
        monkeypatch.setattr(diyfa, name, spy)
    return spies


def _same_storage(view, packed, offset):
    return view.untyped_storage().data_ptr() == packed.untyped_storage().data_ptr() and (
        view.data_ptr() == packed.data_ptr() + offset * packed.element_size())


def _same(args, expected):
    return len(args) == len(expected) and all(a is b for a, b in zip(args, expected, strict=True))


def test_positional_arguments_reach_diyfa_by_name(spies):
    q, k, v = (torch.zeros(1, 4, 2, 8) for _ in range(3))
    # flash-attn's positional order: dropout_p, softmax_scale, causal, window_size, softcap,
    # alibi_slopes, deterministic (a list window and an int softcap are flash-attn's "off")
    assert fai.flash_attn_func(q, k, v, 0.0, 0.5, True, [-1, -1], 0, None, True) == "out"
    args, kw = spies["flash_attention"].calls[-1]
    assert _same(args, (q, k, v))
    assert kw == dict(causal=True, softmax_scale=0.5, layout="bshd", deterministic=True,
                      window_size=(-1, 0), softcap=0.0, alibi_slopes=None,
                      dropout_p=0.0)  # fmt: skip

    qkv = torch.zeros(1, 4, 3, 2, 8)
    fai.flash_attn_qkvpacked_func(qkv, 0.0, 0.25, False, (-1, -1), 0.0, None, True)
    args, kw = spies["flash_attention"].calls[-1]
    for i, t in enumerate(args):  # views into qkv, not copies
        assert t.shape == (1, 4, 2, 8) and _same_storage(t, qkv, i * 2 * 8)
    assert kw == dict(causal=False, softmax_scale=0.25, layout="bshd", deterministic=True,
                      window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                      dropout_p=0.0)  # fmt: skip

    kv = torch.zeros(1, 6, 2, 1, 8)
    fai.flash_attn_kvpacked_func(q, kv, 0.0, None, True)
    args, kw = spies["flash_attention"].calls[-1]
    assert args[0] is q and _same_storage(args[1], kv, 0) and _same_storage(args[2], kv, 8)
    assert kw == dict(causal=True, softmax_scale=None, layout="bshd", deterministic=False,
                      window_size=(-1, 0), softcap=0.0, alibi_slopes=None,
                      dropout_p=0.0)  # fmt: skip

    cu_q, cu_k = torch.tensor([0, 4], dtype=torch.int32), torch.tensor([0, 4], dtype=torch.int32)
    fai.flash_attn_varlen_func(q[0], k[0], v[0], cu_q, cu_k, 4, 5, 0.0, 0.125, True, (-1, -1),
                               0.0, None, True, False, None)  # fmt: skip
    args, kw = spies["flash_attention_varlen"].calls[-1]
    assert _same(args[3:], (cu_q, cu_k, 4, 5))
    assert all(torch.equal(a, b[0]) for a, b in zip(args[:3], (q, k, v), strict=True))
    assert kw == dict(causal=True, softmax_scale=0.125, deterministic=True,
                      window_size=(-1, 0), softcap=0.0, alibi_slopes=None,
                      dropout_p=0.0)  # fmt: skip

    seqlens, table = object(), object()
    fai.flash_attn_with_kvcache(q, k, v, "k", "v", None, None, seqlens, None, None, table, 0.5,
                                True, (-1, -1), 0.0, False, None, 3, True)  # fmt: skip
    args, kw = spies["flash_attention_with_kvcache"].calls[-1]
    assert _same(args, (q, k, v, "k", "v"))
    assert kw == dict(cache_seqlens=seqlens, block_table=table, causal=True, softmax_scale=0.5,
                      num_splits=3, return_lse=True, window_size=(-1, 0), softcap=0.0,
                      alibi_slopes=None)  # fmt: skip


def test_kvcache_seqlens_int_or_none_become_int32_tensors(spies):
    q = torch.zeros(3, 1, 2, 8)
    contiguous = torch.zeros(3, 40, 1, 8)
    pages, table = torch.zeros(10, 16, 1, 8), torch.zeros(3, 4, dtype=torch.int32)
    for kwargs, length in ((dict(k_cache=contiguous, v_cache=contiguous, cache_seqlens=7), 7),
                           (dict(k_cache=contiguous, v_cache=contiguous), 40),
                           (dict(k_cache=pages, v_cache=pages, block_table=table), 64)):
        fai.flash_attn_with_kvcache(q, **kwargs)
        _, kw = spies["flash_attention_with_kvcache"].calls[-1]
        seqlens = kw["cache_seqlens"]
        assert seqlens.dtype == torch.int32 and seqlens.device == q.device
        assert seqlens.tolist() == [length] * 3
        assert kw["causal"] is False  # flash-attn's default, not diyfa's


# --- refused options: NotImplementedError naming them, before anything runs ----------------

_COMMON = [("return_attn_probs", True, "return_attn_probs=True")]  # fmt: skip
_KVCACHE = [("rotary_cos", torch.ones(48, 8), "rotary_cos=<Tensor torch.float32 (48, 8)>"),
            ("rotary_sin", torch.ones(48, 8), "rotary_sin=<Tensor torch.float32 (48, 8)>"),
            ("cache_batch_idx", torch.arange(2, dtype=torch.int32),
             "cache_batch_idx=<Tensor torch.int32 (2,)>"),
            ("cache_leftpad", torch.zeros(2, dtype=torch.int32),
             "cache_leftpad=<Tensor torch.int32 (2,)>"),
]  # fmt: skip
REFUSED = ([(f, *row) for f in ("flash_attn_func", "flash_attn_qkvpacked_func",
                                "flash_attn_kvpacked_func", "flash_attn_varlen_func")
            for row in _COMMON]
           + [("flash_attn_varlen_func", "block_table", torch.zeros(2, 3, dtype=torch.int32),
               "block_table=<Tensor torch.int32 (2, 3)>")]
           + [("flash_attn_with_kvcache", *row) for row in _KVCACHE])  # fmt: skip


def _valid_call(function):
    """Arguments that run (no refused option) for ``function``."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 8, 4, 16, generator=g).to(DEVICE, F16) for _ in range(3))
    cu = torch.tensor([0, 3, 8], dtype=torch.int32, device=DEVICE)
    return {
        "flash_attn_func": dict(q=q, k=k, v=v),
        "flash_attn_qkvpacked_func": dict(qkv=torch.stack([q, k, v], dim=2)),
        "flash_attn_kvpacked_func": dict(q=q, kv=torch.stack([k, v], dim=2)),
        "flash_attn_varlen_func": dict(q=q[0], k=k[0], v=v[0], cu_seqlens_q=cu,
                                       cu_seqlens_k=cu, max_seqlen_q=5, max_seqlen_k=5),
        "flash_attn_with_kvcache": dict(q=q[:, :1], k_cache=k.clone(), v_cache=v.clone(),
                                        k=k[:, :1], v=v[:, :1], cache_seqlens=3),
    }[function]


@pytest.mark.parametrize("function, name, value, shown", REFUSED,
                         ids=[f"{r[0].removeprefix('flash_attn_')}-{r[1]}" for r in REFUSED])
def test_unsupported_option_is_refused_before_anything_runs(function, name, value, shown,
                                                            spies):  # fmt: skip
    kwargs = _valid_call(function)
    getattr(fai, function)(**kwargs)  # without the option: it reaches diyfa
    assert sum(len(s.calls) for s in spies.values()) == 1
    with pytest.raises(NotImplementedError) as info:
        getattr(fai, function)(**kwargs, **{name: value})
    message = str(info.value)
    assert message.startswith(f"{function}: {shown} is not supported by diyfa; supported: ")
    assert sum(len(s.calls) for s in spies.values()) == 1  # diyfa was not called again
    if name == "return_attn_probs":
        assert "never materialises the attention probabilities" in message
        assert "return_lse=True" in message


def test_refused_kvcache_call_leaves_the_cache_untouched():
    kwargs = _valid_call("flash_attn_with_kvcache")
    before = kwargs["k_cache"].clone(), kwargs["v_cache"].clone()
    with pytest.raises(NotImplementedError, match="cache_leftpad"):
        fai.flash_attn_with_kvcache(**kwargs, cache_leftpad=torch.zeros(2, dtype=torch.int32))
    assert torch.equal(kwargs["k_cache"], before[0]) and torch.equal(kwargs["v_cache"], before[1])
    with torch.no_grad():  # the same call without the refused option appends (row 3)
        fai.flash_attn_with_kvcache(**kwargs)
    assert torch.equal(kwargs["k_cache"][:, 3], kwargs["k"][:, 0])
    assert not torch.equal(kwargs["k_cache"], before[0])


@pytest.mark.parametrize("window_size, softcap, causal, want_window, want_cap", [
    ((8, 0), 30.0, True, (8, 0), 30.0),
    ((-5, 3), 0.0, False, (-1, 3), 0.0),
    ((4, 7), -1.0, True, (4, 0), 0.0),  # flash-attn: causal drops the right side; cap <= 0 off
    ([6, -2], 2.0, False, (6, -1), 2.0),
], ids=["causal-window-cap", "neg-left", "causal-right-dropped", "list"])
def test_window_and_softcap_follow_flash_attn(window_size, softcap, causal, want_window,
                                              want_cap):  # fmt: skip
    """Windows and softcap reach diyfa with flash-attn's conventions, and the dense and varlen
    results equal diyfa's own call on the same options bitwise."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 40, 2, 16, generator=g).to(DEVICE, F16) for _ in range(3))
    out = fai.flash_attn_func(q, k, v, causal=causal, window_size=window_size, softcap=softcap)
    want = diyfa.flash_attention(q, k, v, causal=causal, layout="bshd",
                                 window_size=want_window, softcap=want_cap)  # fmt: skip
    assert torch.equal(out, want)
    slopes = torch.tensor([0.25, 0.5], device=DEVICE)  # ALiBi passes straight through
    out = fai.flash_attn_func(q, k, v, causal=causal, window_size=window_size, softcap=softcap,
                              alibi_slopes=slopes)  # fmt: skip
    assert torch.equal(out, diyfa.flash_attention(q, k, v, causal=causal, layout="bshd",
                                                  window_size=want_window, softcap=want_cap,
                                                  alibi_slopes=slopes))  # fmt: skip
    cu = torch.tensor([0, 15, 40], dtype=torch.int32, device=DEVICE)
    out = fai.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 25, 25, causal=causal,
                                     window_size=window_size, softcap=softcap)  # fmt: skip
    want = diyfa.flash_attention_varlen(q[0], k[0], v[0], cu, cu, 25, 25, causal=causal,
                                        window_size=want_window, softcap=want_cap)  # fmt: skip
    assert torch.equal(out, want)


@pytest.mark.parametrize("options", [
    dict(softcap=-2.0), dict(window_size=(-3, -2)), dict(window_size=[-1, -1]),
    dict(window_size=(-1, 0), causal=True), dict(window_size=(-1, 5), causal=True),
], ids=["softcap-negative", "window-negative", "window-list", "causal-right-0",
        "causal-right-dropped"])
def test_kvcache_takes_flash_attns_values_that_turn_variants_off(options):
    """flash-attn reads a softcap <= 0 and negative window sides as off (causal drops the
    right side): with_kvcache, which has neither variant, runs those like the plain call."""
    kwargs = _valid_call("flash_attn_with_kvcache")
    kwargs["k_cache"], kwargs["v_cache"] = kwargs["k_cache"].clone(), kwargs["v_cache"].clone()
    plain = dict(kwargs, k_cache=kwargs["k_cache"].clone(), v_cache=kwargs["v_cache"].clone())
    causal = options.get("causal", False)
    with torch.no_grad():
        got = fai.flash_attn_with_kvcache(**kwargs, **options)
        want = fai.flash_attn_with_kvcache(**plain, causal=causal)
    assert torch.equal(got, want)
