"""Autograd for attention: forward and backward through the family chosen for the call.

:func:`run` gives (out, lse2) for a checked problem. It builds an autograd node only when a
gradient is wanted; inference calls the family's forward directly (about 10 us of host time
less per call).
"""

from __future__ import annotations

import torch

from diyfa.attention.dispatch import Family
from diyfa.attention.problem import Problem


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, problem: Problem, family: Family):
        out, lse2 = family.forward(q, k, v, problem)
        ctx.set_materialize_grads(False)  # no zeros tensor (one more launch) for lse2's grad
        ctx.save_for_backward(q, k, v, out, lse2)
        ctx.problem = problem
        ctx.family = family
        ctx.mark_non_differentiable(lse2)
        return out, lse2

    @staticmethod
    def backward(ctx, do, _dlse2):
        q, k, v, out, lse2 = ctx.saved_tensors
        dq, dk, dv = ctx.family.backward(do, q, k, v, out, lse2, ctx.problem)
        return dq, dk, dv, None, None


def run(q, k, v, problem: Problem, family: Family):
    """(out, lse2) of checked inputs, through autograd only when a gradient is wanted."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _FlashAttention.apply(q, k, v, problem, family)
    # Inference: no autograd node to build.
    return family.forward(q, k, v, problem)
