"""Autograd for attention: forward and backward through the family chosen for the call.

:func:`run` gives (out, lse2) for a checked problem. It builds an autograd node only when a
gradient is wanted; inference calls the family's forward directly (about 10 us of host time
less per call). Attention sinks (``problem.sinks``) are an input of the node, so their
gradient flows too: :func:`sink_grad`.
"""

from __future__ import annotations

import torch

from diyfa.attention import prefetch
from diyfa.attention.dispatch import Family
from diyfa.attention.problem import Problem

LOG2E = 1.4426950408889634


def sink_grad(do, out, lse2, problem: Problem, delta=None) -> torch.Tensor:
    """dL/dsinks, (heads,), in the sinks' dtype. A sink s_h joins row i's softmax with
    probability P_i = exp(s_h - lse_i) and no value, so dL/ds_h = -sum_i P_i * delta_i with
    delta_i = rowsum(dO_i * O_i), over every row of head h. ``delta``: the backward's own
    (shaped like ``lse2``: a family's ``delta_out``; the sum then by one small kernel,
    ``portable.sink_grad``), else computed here from dO and O."""
    if delta is not None:
        from diyfa.attention import portable  # (a kernel module: imported when first used)

        return portable.sink_grad(lse2, delta, problem.sinks)
    packed = problem.cu_seqlens_q is not None  # packed: (total, heads, d); lse2 (heads, total)
    delta = (do.float() * out.float()).sum(-1)
    if packed:
        delta = delta.transpose(0, 1)
    elif problem.layout == "bshd":
        delta = delta.transpose(1, 2)
    if packed:
        sink2 = problem.sinks.float()[:, None] * LOG2E
        dims = (1,)
    else:
        dims = (0, 2)
        sink2 = problem.sinks.float()[None, :, None] * LOG2E
    return -(torch.exp2(sink2 - lse2) * delta).sum(dims).to(problem.sinks.dtype)


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, problem: Problem, family: Family, compiling=None):
        out, lse2 = family.forward(q, k, v, problem)
        ctx.compiling = compiling  # the prefetch worker's future (prefetch.py), or None
        ctx.set_materialize_grads(False)  # no zeros tensor (one more launch) for lse2's grad
        ctx.save_for_backward(q, k, v, out, lse2)
        ctx.problem = problem
        ctx.family = family
        ctx.mark_non_differentiable(lse2)
        return out, lse2

    @staticmethod
    def backward(ctx, do, _dlse2):
        q, k, v, out, lse2 = ctx.saved_tensors
        prefetch.wait(ctx.compiling)
        ctx.compiling = None
        if not ctx.needs_input_grad[3]:
            dq, dk, dv = ctx.family.backward(do, q, k, v, out, lse2, ctx.problem)
            return dq, dk, dv, None, None, None, None
        # The sinks' gradient takes the backward's delta = rowsum(dO * O) (zeros: rows the
        # kernels skip, which see no key, have O = 0).
        delta = torch.zeros_like(lse2)
        dq, dk, dv = ctx.family.backward(do, q, k, v, out, lse2, ctx.problem, delta_out=delta)
        return dq, dk, dv, sink_grad(do, out, lse2, ctx.problem, delta), None, None, None


def run(q, k, v, problem: Problem, family: Family):
    """(out, lse2) of checked inputs, through autograd only when a gradient is wanted."""
    sinks = problem.sinks
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                    or (sinks is not None and sinks.requires_grad)):
        # The first call of a kind of problem: its backward compiles on a worker thread while
        # the forward compiles here (prefetch.py).
        compiling = prefetch.start(q, k, v, problem, family)
        return _FlashAttention.apply(q, k, v, sinks, problem, family, compiling)
    # Inference: no autograd node to build.
    return family.forward(q, k, v, problem)
