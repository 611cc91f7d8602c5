"""diyfa.attention's plumbing: check_inputs -> Problem -> dispatch (select, explain, backend=).

The kernels' numerics are tested in test_attention.py; here only which family runs, what the
Problem says and what the errors say. CPU runs use the Triton interpreter.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import subprocess
import sys

import pytest
import torch

import diyfa
from diyfa.attention import dispatch
from diyfa.attention.checks import check_inputs
from diyfa.attention.problem import Problem

from .conftest import DEVICE


def _qkv(b=2, h=4, hk=2, sq=9, sk=13, d=24, layout="bhsd", dtype=torch.float16, grad=False):
    g = torch.Generator(device="cpu").manual_seed(0)

    def make(heads, s):
        shape = (b, heads, s, d) if layout == "bhsd" else (b, s, heads, d)
        t = torch.randn(shape, generator=g).to(device=DEVICE, dtype=dtype)
        return t.requires_grad_() if grad else t

    return make(h, sq), make(hk, sk), make(hk, sk)


def _problem(**kwargs) -> Problem:
    q, k, v = _qkv(**kwargs)
    return check_inputs(q, k, v, causal=False, softmax_scale=None, layout="bhsd",
                        align="bottom_right")  # fmt: skip


def test_check_inputs_describes_a_bhsd_call():
    q, k, v = _qkv(b=2, h=4, hk=2, sq=9, sk=13, d=24)
    p = check_inputs(q, k, v, causal=True, softmax_scale=None, layout="bhsd",
                     align="bottom_right")  # fmt: skip
    assert (p.batch, p.heads, p.kv_heads, p.seqlen_q, p.seqlen_k, p.head_dim) == (
        2, 4, 2, 9, 13, 24)
    assert p.dtype == torch.float16 and p.device == q.device
    assert p.layout == "bhsd" and p.causal is True and p.align == "bottom_right"
    assert isinstance(p.softmax_scale, float) and p.softmax_scale == 1.0 / math.sqrt(24)
    assert p.q_strides == q.stride() and p.k_strides == k.stride() and p.v_strides == v.stride()
    assert p.kv_group == 2 and p.causal_offset == 13 - 9
    if q.device.type == "cpu":
        assert p.capability is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.heads = 8


def test_check_inputs_gives_bshd_strides_in_bhsd_order():
    q, k, v = _qkv(b=1, h=6, hk=3, sq=5, sk=7, d=16, layout="bshd")
    p = check_inputs(q, k, v, causal=False, softmax_scale=2, layout="bshd", align="top_left")
    assert (p.batch, p.heads, p.kv_heads, p.seqlen_q, p.seqlen_k, p.head_dim) == (
        1, 6, 3, 5, 7, 16)
    assert p.layout == "bshd" and p.align == "top_left" and p.causal_offset == 0
    assert isinstance(p.softmax_scale, float) and p.softmax_scale == 2.0
    for t, strides in ((q, p.q_strides), (k, p.k_strides), (v, p.v_strides)):
        sb, ss, sh, sd = t.stride()  # bshd tensor
        assert strides == (sb, sh, ss, sd)
    assert p.q_strides == q.transpose(1, 2).stride()


def test_check_inputs_keeps_the_public_error_messages():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="layout must be one of"):
        check_inputs(q, k, v, causal=False, softmax_scale=None, layout="sbhd",
                     align="bottom_right")  # fmt: skip
    with pytest.raises(TypeError, match="causal must be a bool"):
        check_inputs(q, k, v, causal=1, softmax_scale=None, layout="bhsd", align="bottom_right")


def test_auto_selects_portable():
    family = dispatch.select(_problem())
    assert family.name == "portable"
    assert dispatch.select(_problem(), "portable") is family
    assert dispatch.backend_names() == ("auto", "hopper", "portable")


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU's answer (a GPU may run the Hopper family)")
def test_explain_lists_each_family_with_its_reason():
    assert dispatch.explain(_problem()) == [
        ("hopper", "it needs a Hopper GPU (sm90), got no CUDA device"), ("portable", None)]


def test_unknown_backend_names_the_accepted_ones():
    with pytest.raises(ValueError, match=r"unknown attention backend 'nope'; accepted: "
                                         r"'auto', 'hopper', 'portable'"):  # fmt: skip
        dispatch.select(_problem(), "nope")
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="unknown attention backend 'cudnn'.*'portable'"):
        diyfa.flash_attention(q, k, v, backend="cudnn")


def test_backend_portable_matches_auto_forward_and_backward():
    q, k, v = _qkv(grad=True)
    outs, grads = [], []
    for backend in ("auto", "portable"):
        for t in (q, k, v):
            t.grad = None
        out, lse = diyfa.flash_attention(q, k, v, causal=True, return_lse=True, backend=backend)
        out.backward(torch.ones_like(out))
        outs.append((out.detach(), lse))
        grads.append([t.grad.clone() for t in (q, k, v)])
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_families_are_tried_in_order_and_reasons_surface(monkeypatch, caplog):
    """With a family ahead of "portable" that cannot run the problem: "auto" passes it over
    (logged at DEBUG with the reason), forcing it raises with the reason, explain lists both."""
    portable = dispatch.families()[-1]
    picky = dispatch.Family("picky", supports=lambda p: "needs head_dim 128",
                            forward=portable.forward, backward=portable.backward)  # fmt: skip
    monkeypatch.setattr(dispatch, "families", lambda: (picky, portable))
    problem = _problem()
    with caplog.at_level(logging.DEBUG, logger="diyfa.attention.dispatch"):
        assert dispatch.select(problem) is portable
    assert any("'picky' skipped: needs head_dim 128" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="backend 'picky' cannot run this problem: needs head"):
        dispatch.select(problem, "picky")
    assert dispatch.explain(problem) == [("picky", "needs head_dim 128"), ("portable", None)]
    with pytest.raises(ValueError, match="accepted: 'auto', 'picky', 'portable'"):
        dispatch.select(problem, "nope")


def test_importing_the_package_loads_no_kernel_family():
    code = ("import sys, diyfa.attention; "
            "print(sorted(m for m in sys.modules if m.startswith('diyfa.attention.')), "
            "'triton.experimental.gluon' in sys.modules)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ("['diyfa.attention.checks', 'diyfa.attention.dispatch', "
                                  "'diyfa.attention.function', 'diyfa.attention.ops', "
                                  "'diyfa.attention.prefetch', 'diyfa.attention.problem'] "
                                  "False")  # fmt: skip


def test_portable_spreads_batch_heads_over_two_grid_axes():
    """The portable kernels' (batch, head) pairs go over the grid's second and third axes
    (portable.bh_grid; CUDA allows 65535 programs on each), so 20000 x 4 pairs run; only a
    batch with no divisor that splits it within both limits (a prime past 65535) is refused,
    and "auto" says so instead of a CUDA launch error."""
    from diyfa.attention import portable

    problem = dataclasses.replace(_problem(), batch=20000, heads=4, kv_heads=4)
    assert dict(dispatch.explain(problem))["portable"] is None
    for batch, heads in [(20000, 4), (4100, 16), (100000, 1), (3, 65535), (7, 5), (0, 8)]:
        blocks, y, z = portable.bh_grid(5, batch, heads)
        assert blocks == 5 and y * z == batch * heads and y <= 65535 and z <= 65535
        assert y % heads == 0  # (a pair is program_id(1) + program_id(2) x num_programs(1))
    assert portable.bh_grid(3, 64, 32) == (3, 2048, 1)  # fits: the plain (blocks, b x h) order
    problem = dataclasses.replace(_problem(), batch=65537, heads=2, kv_heads=2)  # 65537: prime
    reason = dict(dispatch.explain(problem))["portable"]
    assert "batch 65537 x heads 2: no split of the pairs over two grid axes" in reason
    with pytest.raises(ValueError, match="no split of the pairs"):
        portable.bh_grid(1, 65537, 2)
    if problem.capability is None:  # no Hopper family on the CPU either
        with pytest.raises(ValueError, match="no attention backend can run this problem"):
            dispatch.select(problem)


def test_forward_out_only_runs_where_no_one_reads_the_lse(monkeypatch):
    """A family's ``forward_out_only`` (the Hopper forward's frozen max, whose LSE carries
    P's 16-bit rounding) runs for inference calls that do not return the LSE, and only
    there: with ``return_lse`` or a gradient wanted (the LSE kept for the backward), and
    for families without one, ``forward``."""
    portable = dispatch.families()[-1]
    calls = []

    def tagged(name, forward):
        def run(*args, **kwargs):
            calls.append(name)
            return forward(*args, **kwargs)
        return run

    both = dispatch.Family("both", supports=lambda p: None,
                           forward=tagged("forward", portable.forward),
                           backward=portable.backward,
                           forward_out_only=tagged("out-only", portable.forward))  # fmt: skip
    monkeypatch.setattr(dispatch, "families", lambda: (both, portable))
    q, k, v = _qkv()
    ref = diyfa.flash_attention(q, k, v, backend="portable")
    assert calls == []
    assert torch.equal(diyfa.flash_attention(q, k, v), ref) and calls == ["out-only"]
    out, lse = diyfa.flash_attention(q, k, v, return_lse=True)
    assert torch.equal(out, ref) and calls == ["out-only", "forward"]
    qg, kg, vg = _qkv(grad=True)
    diyfa.flash_attention(qg, kg, vg).sum().backward()
    assert calls == ["out-only", "forward", "forward"]
    with torch.no_grad():
        diyfa.flash_attention(qg, kg, vg)
    assert calls == ["out-only", "forward", "forward", "out-only"]
