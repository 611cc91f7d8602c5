"""Autograd for attention: forward and backward through the family chosen for the call.

:func:`run` gives (out, lse2) for a checked problem. It builds an autograd node only when a
gradient is wanted; inference calls the family's forward directly (about 10 us of host time
less per call). Attention sinks (``problem.sinks``) are an input of the node, so their
gradient flows too: :func:`family_backward`.
"""

from __future__ import annotations

import torch

from diyfa.attention import prefetch
from diyfa.attention.dispatch import Family
from diyfa.attention.problem import Problem


def family_backward(family: Family, do, q, k, v, out, lse2, problem: Problem,
                    sinks_grad: bool) -> tuple:
    """(dq, dk, dv, dsinks) through ``family``'s backward; dsinks (``sinks_grad``) is
    dL/dsinks, (heads,) in the sinks' dtype, else None. A sink s_h joins row i's softmax
    with probability P_i = exp(s_h - lse_i) and no value, so dL/ds_h = -sum_i P_i * delta_i
    over every row of head h, with delta_i = rowsum(dO_i * O_i): the family writes it into
    a zeroed ``delta_out`` (rows the kernels skip see no key: O = 0), and one small kernel
    sums (``portable.sink_grad``)."""
    if not sinks_grad:
        return (*family.backward(do, q, k, v, out, lse2, problem), None)
    from diyfa.attention import portable  # (a kernel module: imported when first used)

    delta = torch.zeros_like(lse2)
    dq, dk, dv = family.backward(do, q, k, v, out, lse2, problem, delta_out=delta)
    return dq, dk, dv, portable.sink_grad(lse2, delta, problem.sinks)


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
        grads = family_backward(ctx.family, do, q, k, v, out, lse2, ctx.problem,
                                ctx.needs_input_grad[3])  # fmt: skip
        return *grads, None, None, None


def run(q, k, v, problem: Problem, family: Family, lse_read: bool = True):
    """(out, lse2) of checked inputs, through autograd only when a gradient is wanted.
    ``lse_read`` False (the caller drops the LSE): an inference call takes the family's
    ``forward_out_only`` where it has one (its LSE may be less precise)."""
    sinks = problem.sinks
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                    or (sinks is not None and sinks.requires_grad)):
        # The first call of a kind of problem: its backward compiles on a worker thread while
        # the forward compiles here (prefetch.py).
        compiling = prefetch.start(q, k, v, problem, family)
        return _FlashAttention.apply(q, k, v, sinks, problem, family, compiling)
    # Inference: no autograd node to build.
    if not lse_read and family.forward_out_only is not None:
        return family.forward_out_only(q, k, v, problem)
    return family.forward(q, k, v, problem)
