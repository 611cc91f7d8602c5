"""Attention as PyTorch custom operators, for ``torch.compile`` (and anything else that traces).

``torch.ops.diyfa.attention_fwd(q, k, v, causal, align, softmax_scale, layout, backend,
    deterministic, window_left, window_right, softcap, alibi_slopes, sinks, q_descale=None,
    k_descale=None, v_descale=None, dropout_p=0.0, dropout_seed=None)`` -> (out, lse2), lse2
    the base-2 log-sum-exp (batch, heads, seqlen_q) fp32 (the descales: fp8 inputs, forward
    only, a bf16 out; ``dropout_seed``: the mask's Philox seed as a 0-dim int64 CPU tensor,
    drawn inside the traced graph, see :func:`dropout_seed`);
``torch.ops.diyfa.attention_bwd(do, q, k, v, out, lse2, <the same options but the
    descales>)`` -> (dq, dk, dv, dsinks) (dsinks empty without sinks);
``torch.ops.diyfa.attention_varlen_fwd`` / ``attention_varlen_bwd``: the same for packed
sequences (cumulative lengths and max lengths after q, k, v);
``torch.ops.diyfa.attention_kvcache``: the KV-cache call, declaring k_cache and v_cache
mutated (the append); no autograd (inference).

Each op runs the eager path on real tensors (checks -> problem -> dispatch -> family), so
the checks, errors and kernel choice are the eager ones. Their fake implementations give
the output shapes and strides from the inputs (after the same shape checks, so a traced
call with bad shapes fails with the eager message, at trace time); the forward op's autograd
formula calls the backward op. Dynamo sees one opaque op per attention call: no graph
breaks from the Triton/Gluon launch code inside.

Eager calls do not go through the ops: ``torch.ops`` dispatch costs ~10 us of host time per
call (measured on the CPU here: 12.9 us for a trivial op against 2.5 us for the plain Python
function), the whole launch path of a small problem. ``flash_attention`` and the SDPA
drop-in call them only while ``torch.compiler.is_compiling()``.
"""

from typing import Optional

import torch

from diyfa.attention.checks import (
    check_bias_tensors,
    check_fp8_cache,
    check_inputs,
    check_kvcache_inputs,
    check_variants,
    check_varlen_inputs,
    no_dropout,
)
from diyfa.attention.dispatch import select
from diyfa.attention.problem import bhsd_shape


def dropout_seed(dropout_p) -> torch.Tensor | None:
    """The Philox seed of a traced call's dropout mask, for the ops: a 0-dim int64 CPU tensor
    drawn by ``torch.randint`` inside the traced graph (each run of the compiled graph draws
    anew; ``torch.manual_seed`` repeats a run), None without dropout. Run as traced
    (``backend="aot_eager"``, or Inductor with ``fallback_random=True``) it is the eager
    path's draw from torch's default generator (``attention._dropout_seed``), so the mask is
    the eager call's; Inductor's own random numbers draw another seed by default."""
    if no_dropout(dropout_p):
        return None
    return torch.randint(0, 2**62, (), device="cpu")


def _seed(dropout_p, dropout_seed: torch.Tensor | None, fake: bool) -> int:
    """The seed's value (a CPU tensor: reading it waits for no GPU); a rate without a seed
    is refused (every call would draw the same mask)."""
    if dropout_seed is None:
        if isinstance(dropout_p, (int, float)) and dropout_p > 0:
            raise ValueError(f"dropout_p={dropout_p} needs dropout_seed (a 0-dim int64 CPU "
                             "tensor, e.g. ops.dropout_seed(dropout_p)), got None")  # fmt: skip
        return 0
    return 0 if fake else int(dropout_seed)


def _problem(q, k, v, causal, align, softmax_scale, layout, deterministic, window_left,
             window_right, softcap, alibi_slopes, sinks, q_descale=None, k_descale=None,
             v_descale=None, dropout_p=0.0, dropout_seed=None, fake=False):
    return check_inputs(q, k, v, causal=causal, softmax_scale=softmax_scale, layout=layout,
                        align=align, fake=fake, deterministic=deterministic,
                        window_size=(window_left, window_right), softcap=softcap,
                        alibi_slopes=alibi_slopes, sinks=sinks, q_descale=q_descale,
                        k_descale=k_descale, v_descale=v_descale, dropout_p=dropout_p,
                        dropout_seed=_seed(dropout_p, dropout_seed, fake))  # fmt: skip


def _family_backward(do, q, k, v, out, lse2, problem, backend):
    """(dq, dk, dv, dsinks) through the family ``backend`` selects, as the eager path's
    (``function.family_backward``); dsinks empty without sinks."""
    from diyfa.attention.function import family_backward

    dq, dk, dv, dsinks = family_backward(select(problem, backend), do, q, k, v, out, lse2,
                                         problem, problem.sinks is not None)  # fmt: skip
    return dq, dk, dv, do.new_empty((0,), dtype=torch.float32) if dsinks is None else dsinks


@torch.library.custom_op("diyfa::attention_fwd", mutates_args=())
def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, align: str,
                  softmax_scale: Optional[float], layout: str,  # noqa: UP045 (schema parser)
                  backend: str, deterministic: bool, window_left: int, window_right: int,
                  softcap: float, alibi_slopes: Optional[torch.Tensor],  # noqa: UP045
                  sinks: Optional[torch.Tensor],  # noqa: UP045 (schema parser)
                  q_descale: Optional[torch.Tensor] = None,  # noqa: UP045
                  k_descale: Optional[torch.Tensor] = None,  # noqa: UP045
                  v_descale: Optional[torch.Tensor] = None,  # noqa: UP045
                  dropout_p: float = 0.0,
                  dropout_seed: Optional[torch.Tensor] = None,  # noqa: UP045
                  ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    problem = _problem(q, k, v, causal, align, softmax_scale, layout, deterministic,
                       window_left, window_right, softcap, alibi_slopes, sinks, q_descale,
                       k_descale, v_descale, dropout_p, dropout_seed)  # fmt: skip
    return select(problem, backend).forward(q, k, v, problem)


@attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, causal, align, softmax_scale, layout, backend, deterministic,
                        window_left, window_right, softcap, alibi_slopes, sinks,
                        q_descale=None, k_descale=None, v_descale=None, dropout_p=0.0,
                        dropout_seed=None):  # fmt: skip
    # The eager errors, now.
    problem = _problem(q, k, v, causal, align, softmax_scale, layout, deterministic,
                       window_left, window_right, softcap, alibi_slopes, sinks, q_descale,
                       k_descale, v_descale, dropout_p, dropout_seed, fake=True)  # fmt: skip
    b, h, sq, _ = bhsd_shape(q, layout)
    # The families return a contiguous output in the call's layout: q's shape with v's head
    # dim (bf16 for fp8 inputs).
    out = torch.empty(q.shape[:-1] + v.shape[-1:], dtype=problem.out_dtype, device=q.device)
    return out, torch.empty((b, h, sq), dtype=torch.float32, device=q.device)


@torch.library.custom_op("diyfa::attention_bwd", mutates_args=())
def attention_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  out: torch.Tensor, lse2: torch.Tensor, causal: bool, align: str,
                  softmax_scale: Optional[float], layout: str,  # noqa: UP045 (schema parser)
                  backend: str, deterministic: bool, window_left: int, window_right: int,
                  softcap: float, alibi_slopes: Optional[torch.Tensor],  # noqa: UP045
                  sinks: Optional[torch.Tensor],  # noqa: UP045 (schema parser)
                  dropout_p: float = 0.0,
                  dropout_seed: Optional[torch.Tensor] = None,  # noqa: UP045
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    problem = _problem(q, k, v, causal, align, softmax_scale, layout, deterministic,
                       window_left, window_right, softcap, alibi_slopes, sinks,
                       dropout_p=dropout_p, dropout_seed=dropout_seed)  # fmt: skip
    return _family_backward(do, q, k, v, out, lse2, problem, backend)


@attention_bwd.register_fake
def _attention_bwd_fake(do, q, k, v, out, lse2, causal, align, softmax_scale, layout,
                        backend, deterministic, window_left, window_right, softcap,
                        alibi_slopes, sinks, dropout_p=0.0, dropout_seed=None):  # fmt: skip
    # The families allocate gradients with empty_like (the inputs' strides).
    dsinks = (torch.empty((0,), dtype=torch.float32, device=q.device) if sinks is None
              else torch.empty_like(sinks))  # fmt: skip
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks


def _setup_context(ctx, inputs, output):
    q, k, v, *options = inputs
    out, lse2 = output
    # The options end with the fp8 descales, which the backward does not take (fp8 is
    # forward only: the checks refuse it with gradients), and dropout's rate and seed,
    # which it does (the seed is saved: the backward draws the same mask).
    *options, dropout_p, seed = options
    ctx.save_for_backward(q, k, v, out, lse2, seed)
    ctx.options = options[:-3]
    ctx.dropout_p = dropout_p
    ctx.mark_non_differentiable(lse2)


def _backward(ctx, do, _dlse2):
    q, k, v, out, lse2, seed = ctx.saved_tensors
    dq, dk, dv, dsinks = torch.ops.diyfa.attention_bwd(do, q, k, v, out, lse2, *ctx.options,
                                                       ctx.dropout_p, seed)  # fmt: skip
    # The backward's options end with (alibi_slopes, sinks): sinks get their gradient; then
    # the three descales and dropout's rate and seed, none.
    grads = (None,) * (len(ctx.options) - 1)
    return ((dq, dk, dv) + grads + (dsinks if ctx.options[-1] is not None else None,)
            + (None,) * 5)  # fmt: skip


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


# ------------------------------------------------------------------------ packed sequences
def _varlen_problem(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, deterministic,
                    window_left, window_right, softcap, alibi_slopes, sinks, dropout_p=0.0,
                    dropout_seed=None, fake=False):  # fmt: skip
    return check_varlen_inputs(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal,
                               softmax_scale=softmax_scale, deterministic=deterministic,
                               window_size=(window_left, window_right), softcap=softcap,
                               fake=fake, alibi_slopes=alibi_slopes, sinks=sinks,
                               dropout_p=dropout_p,
                               dropout_seed=_seed(dropout_p, dropout_seed, fake))  # fmt: skip


@torch.library.custom_op("diyfa::attention_varlen_fwd", mutates_args=())
def attention_varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                         max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                         softmax_scale: Optional[float],  # noqa: UP045 (schema parser)
                         backend: str, deterministic: bool, window_left: int,
                         window_right: int, softcap: float,
                         alibi_slopes: Optional[torch.Tensor],  # noqa: UP045 (schema parser)
                         sinks: Optional[torch.Tensor],  # noqa: UP045 (schema parser)
                         dropout_p: float = 0.0,
                         dropout_seed: Optional[torch.Tensor] = None,  # noqa: UP045
                         ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``flash_attention_varlen`` -> (out (total_q, heads, d), lse2 (heads, total_q))."""
    problem = _varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              causal, softmax_scale, deterministic, window_left, window_right,
                              softcap, alibi_slopes, sinks, dropout_p, dropout_seed)  # fmt: skip
    return select(problem, backend).forward(q, k, v, problem)


@attention_varlen_fwd.register_fake
def _attention_varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               causal, softmax_scale, backend, deterministic, window_left,
                               window_right, softcap, alibi_slopes, sinks, dropout_p=0.0,
                               dropout_seed=None):  # fmt: skip
    # Every check that needs no values of the lengths (those are read when it runs).
    _varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                    softmax_scale, deterministic, window_left, window_right, softcap,
                    alibi_slopes, sinks, dropout_p, dropout_seed, fake=True)  # fmt: skip
    total, h, _ = q.shape
    return (torch.empty((total, h, v.shape[-1]), dtype=q.dtype, device=q.device),
            torch.empty((h, total), dtype=torch.float32, device=q.device))  # fmt: skip


@torch.library.custom_op("diyfa::attention_varlen_bwd", mutates_args=())
def attention_varlen_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         out: torch.Tensor, lse2: torch.Tensor, cu_seqlens_q: torch.Tensor,
                         cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                         causal: bool,
                         softmax_scale: Optional[float],  # noqa: UP045 (schema parser)
                         backend: str, deterministic: bool, window_left: int,
                         window_right: int, softcap: float,
                         alibi_slopes: Optional[torch.Tensor],  # noqa: UP045 (schema parser)
                         sinks: Optional[torch.Tensor],  # noqa: UP045 (schema parser)
                         dropout_p: float = 0.0,
                         dropout_seed: Optional[torch.Tensor] = None,  # noqa: UP045
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                    torch.Tensor]:  # fmt: skip
    problem = _varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              causal, softmax_scale, deterministic, window_left, window_right,
                              softcap, alibi_slopes, sinks, dropout_p, dropout_seed)  # fmt: skip
    return _family_backward(do, q, k, v, out, lse2, problem, backend)


@attention_varlen_bwd.register_fake
def _attention_varlen_bwd_fake(do, q, k, v, out, lse2, cu_seqlens_q, cu_seqlens_k,
                               max_seqlen_q, max_seqlen_k, causal, softmax_scale, backend,
                               deterministic, window_left, window_right, softcap,
                               alibi_slopes, sinks, dropout_p=0.0, dropout_seed=None):  # fmt: skip
    dsinks = (torch.empty((0,), dtype=torch.float32, device=q.device) if sinks is None
              else torch.empty_like(sinks))  # fmt: skip
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, *options, dropout_p, seed = inputs
    out, lse2 = output
    ctx.save_for_backward(q, k, v, out, lse2, cu_q, cu_k, seed)
    ctx.options = options
    ctx.dropout_p = dropout_p
    ctx.mark_non_differentiable(lse2)


def _varlen_backward(ctx, do, _dlse2):
    q, k, v, out, lse2, cu_q, cu_k, seed = ctx.saved_tensors
    dq, dk, dv, dsinks = torch.ops.diyfa.attention_varlen_bwd(
        do, q, k, v, out, lse2, cu_q, cu_k, *ctx.options, ctx.dropout_p, seed)
    grads = (None,) * (len(ctx.options) - 1)
    return (dq, dk, dv, None, None) + grads + (
        dsinks if ctx.options[-1] is not None else None, None, None)


attention_varlen_fwd.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


# -------------------------------------------------------------------------------- KV cache
@torch.library.custom_op("diyfa::attention_kvcache", mutates_args=("k_cache", "v_cache"))
def attention_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      k: Optional[torch.Tensor], v: Optional[torch.Tensor],  # noqa: UP045
                      cache_seqlens: torch.Tensor,
                      block_table: Optional[torch.Tensor],  # noqa: UP045 (schema parser)
                      causal: bool, softmax_scale: Optional[float],  # noqa: UP045
                      num_splits: int, window_left: int, window_right: int, softcap: float,
                      alibi_slopes: Optional[torch.Tensor],  # noqa: UP045 (schema parser)
                      sinks: Optional[torch.Tensor],  # noqa: UP045 (schema parser)
                      k_descale: Optional[torch.Tensor],  # noqa: UP045 (schema parser)
                      v_descale: Optional[torch.Tensor],  # noqa: UP045 (schema parser)
                      max_seqlen_k: Optional[int] = None,  # noqa: UP045 (schema parser)
                      ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``flash_attention_with_kvcache``: appends k/v into the caches in place (declared as
    mutated), then attends -> (out (q's shape, v_cache's head dim), lse2 (batch, heads,
    seqlen_q))."""
    from diyfa.attention import decode

    return decode.append_and_attend(q, k_cache, v_cache, k, v, cache_seqlens, block_table,
                                    causal, softmax_scale, num_splits,
                                    (window_left, window_right), softcap, alibi_slopes, sinks,
                                    k_descale, v_descale, max_seqlen_k)  # fmt: skip


@attention_kvcache.register_fake
def _attention_kvcache_fake(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal,
                            softmax_scale, num_splits, window_left, window_right, softcap,
                            alibi_slopes, sinks, k_descale, v_descale,
                            max_seqlen_k=None):  # fmt: skip
    fp8 = check_fp8_cache(q, k_cache, v_cache, k_descale, v_descale)
    check_kvcache_inputs(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                         block_table=block_table, causal=causal, softmax_scale=softmax_scale,
                         num_splits=num_splits, fp8=fp8, max_seqlen_k=max_seqlen_k)  # fmt: skip
    check_variants((window_left, window_right), softcap, causal)
    check_bias_tensors(alibi_slopes, sinks, q.shape[0], q.shape[2], q.device)
    b, sq, h, _ = q.shape
    return (torch.empty((b, sq, h, v_cache.shape[3]), dtype=q.dtype, device=q.device),
            torch.empty((b, h, sq), dtype=torch.float32, device=q.device))  # fmt: skip
