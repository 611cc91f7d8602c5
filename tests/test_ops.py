"""Attention and matmul as torch custom operators (diyfa/attention/ops.py, the end of
diyfa/ops/matmul.py): what torch.compile sees.

CPU runs go through the Triton interpreter. The GPU checks (fullgraph compile with Inductor,
CUDA-graph capture) are `gpu`-marked.
"""

from __future__ import annotations

import pytest
import torch

import diyfa
from diyfa.attention import ops  # noqa: F401  (registers torch.ops.diyfa.attention_*)
from diyfa.ops import matmul  # noqa: F401  (registers torch.ops.diyfa.matmul)

from .conftest import DEVICE


def _qkv(b=1, h=4, hk=2, sq=33, sk=47, d=24, layout="bhsd", dtype=torch.float32, grad=True,
         device=DEVICE):  # fmt: skip
    g = torch.Generator(device="cpu").manual_seed(0)

    def make(heads, s):
        shape = (b, heads, s, d) if layout == "bhsd" else (b, s, heads, d)
        return torch.randn(shape, generator=g).to(device, dtype).requires_grad_(grad)

    return make(h, sq), make(hk, sk), make(hk, sk)


@pytest.mark.parametrize("causal, layout, scale", [(False, "bhsd", None), (True, "bshd", 0.3)])
def test_opcheck(causal, layout, scale):
    """torch.library.opcheck: schema, fake implementation (shapes, strides, dtypes), autograd
    registration and the backward op, against real runs."""
    q, k, v = (t.detach() for t in _qkv(layout=layout))
    torch.library.opcheck(torch.ops.diyfa.attention_fwd.default,
                          (q, k, v, causal, "bottom_right", scale, layout, "auto", False, -1, -1,
                           0.0, None, None))  # fmt: skip
    q, k, v = _qkv(layout=layout)
    out, lse2 = torch.ops.diyfa.attention_fwd(q, k, v, causal, "bottom_right", scale, layout,
                                              "auto", False, -1, -1, 0.0, None,
                                              None)  # fmt: skip
    do = torch.randn_like(out)
    torch.library.opcheck(torch.ops.diyfa.attention_bwd.default,
                          (do, q.detach(), k.detach(), v.detach(), out.detach(), lse2, causal,
                           "bottom_right", scale, layout, "auto", False, -1, -1, 0.0, None,
                           None))  # fmt: skip


def _model(q, k, v):
    x = diyfa.flash_attention(q * 1.5, k, v, causal=True)
    y = diyfa.scaled_dot_product_attention(x, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
    return (y.float() ** 2).sum()


def test_compile_fullgraph_has_no_graph_breaks_and_matches_eager():
    """Dynamo traces a function calling flash_attention and the SDPA drop-in into one graph
    (no breaks), and the compiled forward and gradients equal the eager ones bitwise (the
    same kernels run; aot_eager keeps the CPU test free of Inductor's C++ build)."""
    q, k, v = _qkv()
    explain = torch._dynamo.explain(_model)(q, k, v)
    assert explain.graph_break_count == 0 and explain.graph_count == 1
    compiled = torch.compile(_model, fullgraph=True, backend="aot_eager")
    loss = compiled(q, k, v)
    loss.backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    ref = _model(q, k, v)
    ref.backward()
    assert torch.equal(loss, ref)
    for a, t in zip(grads, (q, k, v), strict=True):
        assert torch.equal(a, t.grad)


def test_fake_tensors_get_the_eager_errors_at_trace_time():
    q, k, v = _qkv(grad=False)
    compiled = torch.compile(lambda q, k, v: diyfa.flash_attention(q, k, v), fullgraph=True,
                             backend="aot_eager")  # fmt: skip
    with pytest.raises(Exception, match="q heads \\(4\\) must be a multiple of k/v heads \\(3\\)"):
        compiled(q, torch.randn(1, 3, 47, 24, device=DEVICE),
                 torch.randn(1, 3, 47, 24, device=DEVICE))


def test_eager_calls_do_not_go_through_the_ops(monkeypatch):
    """The custom-op dispatcher costs ~10 us per call: eager calls keep the direct path."""
    calls = []
    real = torch.ops.diyfa.attention_fwd

    class Spy:
        def __call__(self, *args):
            calls.append(args)
            return real(*args)

    monkeypatch.setattr(torch.ops.diyfa, "attention_fwd", Spy())
    q, k, v = _qkv(grad=False)
    diyfa.flash_attention(q, k, v)
    assert calls == []


def _varlen_inputs(grad=True):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(37, 4, 16, generator=g).to(DEVICE).requires_grad_(grad)
    k = torch.randn(52, 2, 16, generator=g).to(DEVICE).requires_grad_(grad)
    v = torch.randn(52, 2, 16, generator=g).to(DEVICE).requires_grad_(grad)
    cu_q = torch.tensor([0, 20, 20, 37], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 30, 41, 52], dtype=torch.int32, device=DEVICE)
    return q, k, v, cu_q, cu_k


def _cache_inputs():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 3, 4, 16, generator=g).to(DEVICE)
    k_cache = torch.randn(2, 40, 2, 16, generator=g).to(DEVICE)
    v_cache = torch.randn(2, 40, 2, 16, generator=g).to(DEVICE)
    k = torch.randn(2, 3, 2, 16, generator=g).to(DEVICE)
    v = torch.randn(2, 3, 2, 16, generator=g).to(DEVICE)
    lens = torch.tensor([5, 30], dtype=torch.int32, device=DEVICE)
    return q, k_cache, v_cache, k, v, lens


def test_opcheck_varlen_kvcache_and_matmul():
    """opcheck (schema, fake shapes and strides, autograd registration, mutation declared
    for the cache append) for the packed-sequence ops, the KV-cache op and the matmul op."""
    q, k, v, cu_q, cu_k = _varlen_inputs(grad=False)
    options = (True, None, "auto", False, 5, 0, 2.0, None, None)
    torch.library.opcheck(torch.ops.diyfa.attention_varlen_fwd.default,
                          (q, k, v, cu_q, cu_k, 20, 30) + options)  # fmt: skip
    q, k, v, cu_q, cu_k = _varlen_inputs()
    out, lse2 = torch.ops.diyfa.attention_varlen_fwd(q, k, v, cu_q, cu_k, 20, 30, *options)
    do = torch.randn_like(out)
    torch.library.opcheck(torch.ops.diyfa.attention_varlen_bwd.default,
                          (do, q.detach(), k.detach(), v.detach(), out.detach(), lse2, cu_q,
                           cu_k, 20, 30) + options)  # fmt: skip
    q, k_cache, v_cache, k, v, lens = _cache_inputs()
    torch.library.opcheck(torch.ops.diyfa.attention_kvcache.default,
                          (q, k_cache, v_cache, k, v, lens, None, True, None, 0, 16, 0, 2.0,
                           None, torch.tensor([0.5, 0.0, -0.5, 1.0], device=DEVICE), None,
                           None))  # fmt: skip
    # A value head dim of its own: the fake output takes v_cache's.
    v_cache8, v8 = v_cache[..., :8].contiguous(), v[..., :8].contiguous()
    torch.library.opcheck(torch.ops.diyfa.attention_kvcache.default,
                          (q, k_cache, v_cache8, k, v8, lens, None, True, None, 0, -1, -1, 0.0,
                           None, None, None, None))  # fmt: skip
    a, b = torch.randn(2, 33, 40).to(DEVICE), torch.randn(2, 40, 24).to(DEVICE)
    torch.library.opcheck(torch.ops.diyfa.matmul.default,
                          (a, b, None, None, None, torch.randn(24).to(DEVICE), "gelu", "ieee",
                           "auto"))  # fmt: skip


def _serving_step(q, k, v, cu_q, cu_k, w, cq, k_cache, v_cache, nk, nv, lens):
    packed = diyfa.flash_attention_varlen(q, k, v, cu_q, cu_k, 20, 30, causal=True,
                                          window_size=(8, 0))  # fmt: skip
    y = diyfa.triton_matmul(packed.reshape(37, 64), w, activation="silu", precision="ieee")
    dec = diyfa.flash_attention_with_kvcache(cq, k_cache, v_cache, nk, nv, cache_seqlens=lens)
    return y, dec


def test_compile_varlen_kvcache_and_matmul_without_graph_breaks():
    """One graph, no breaks, for a function calling the packed-sequence, KV-cache and
    matmul entry points; compiled results (and the cache it appends to) equal eager's
    bitwise; the packed-sequence gradients flow through the backward op."""
    q, k, v, cu_q, cu_k = _varlen_inputs(grad=False)
    w = torch.randn(64, 32, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    cq, k_cache, v_cache, nk, nv, lens = _cache_inputs()
    args = (q, k, v, cu_q, cu_k, w, cq)
    explain = torch._dynamo.explain(_serving_step)(*args, k_cache.clone(), v_cache.clone(), nk,
                                                   nv, lens)  # fmt: skip
    assert explain.graph_break_count == 0 and explain.graph_count == 1
    compiled = torch.compile(_serving_step, fullgraph=True, backend="aot_eager")
    caches = (k_cache.clone(), v_cache.clone())
    y, dec = compiled(*args, *caches, nk, nv, lens)
    y_ref, dec_ref = _serving_step(*args, k_cache, v_cache, nk, nv, lens)
    assert torch.equal(y, y_ref) and torch.equal(dec, dec_ref)
    assert torch.equal(caches[0], k_cache) and torch.equal(caches[1], v_cache)

    q, k, v, cu_q, cu_k = _varlen_inputs()
    f = torch.compile(lambda q, k, v: diyfa.flash_attention_varlen(
        q, k, v, cu_q, cu_k, 20, 30, softcap=3.0).square().sum(), fullgraph=True,
        backend="aot_eager")  # fmt: skip
    f(q, k, v).backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    diyfa.flash_attention_varlen(q, k, v, cu_q, cu_k, 20, 30, softcap=3.0).square().sum(
        ).backward()  # fmt: skip
    for a, t in zip(grads, (q, k, v), strict=True):
        assert torch.equal(a, t.grad)


@pytest.mark.gpu
def test_gpu_compile_inductor_and_cuda_graphs():
    """On the GPU: Inductor compiles a function around the op with no graph break, and
    torch.compile's CUDA graphs ("reduce-overhead") replay it with the eager result."""
    q, k, v = _qkv(b=2, h=8, hk=4, sq=1000, sk=1000, d=128, dtype=torch.bfloat16, grad=False,
                   device="cuda")  # fmt: skip
    f = lambda q, k, v: diyfa.flash_attention(q, k, v, causal=True) * 2  # noqa: E731
    ref = f(q, k, v)
    for mode in (None, "reduce-overhead"):
        compiled = torch.compile(f, fullgraph=True, mode=mode)
        for _ in range(3):  # reduce-overhead records the graph on a later call
            out = compiled(q, k, v)
        assert torch.equal(out, ref)
