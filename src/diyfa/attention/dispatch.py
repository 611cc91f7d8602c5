"""Kernel families and the choice among them.

A *family* is one implementation of attention (its kernels and launch code), described by a
:class:`Family`: its ``name``, ``supports(problem)`` (None when it can run the problem, else
the reason it cannot, in words), ``forward(q, k, v, problem) -> (out, lse2)`` and
``backward(do, q, k, v, out, lse2, problem, delta_out=None) -> (dq, dk, dv)`` (``delta_out``:
an fp32 tensor shaped like ``lse2`` that gets rowsum(dO * O) for every row the kernels
visit, for the sinks' gradient); optionally
``prefer(problem)``: None, or why "auto" should pass over a problem the family can run
(a family measured slower there than the ones below it); a named backend ignores it; and
``named``: the Family that runs when the family is asked for by name, where that differs
from what "auto" runs (a kernel not yet measured or run on a GPU stays out of "auto" while
tests and benchmarks can still force it); and ``forward_out_only(q, k, v, problem)``: the
forward of a call whose LSE no one reads (inference without ``return_lse``), which may
compute its LSE less precisely (the Hopper forward's frozen max: None, ``forward``).
Packed sequences' lengths reach the host without a wait (``checks.HostLengths``); a
family's forward and backward read and check them on entry, before anything runs, unless
the family says ``late_lengths``: its forward then reads them itself before its first
launch and before any early return (the Hopper forward, to set its launch up while the
copy waits behind the GPU's queue).
``lse2`` is the base-2 log-sum-exp per query row, (batch, heads, seqlen_q) fp32, -inf for a
row that sees no key.

:data:`FAMILY_MODULES` lists the families in priority order. ``select(problem)`` ("auto")
takes the first that supports the problem and does not ``prefer`` to pass it over;
``select(problem, name)`` forces one.

Adding a family: write ``diyfa/attention/<name>.py`` with its kernels and a module-level
``FAMILY = Family(...)``, and put ``"diyfa.attention.<name>"`` in :data:`FAMILY_MODULES`
above the families it should win over. Family modules are imported on the first call that
consults them, never by ``import diyfa.attention``: a family's Triton or Gluon code costs
nothing until attention runs.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from diyfa.attention.problem import Problem

log = logging.getLogger(__name__)

# Kernel families, best first: each module defines FAMILY. "portable" runs every problem
# that passes the input checks, so it stays last.
FAMILY_MODULES = (
    "diyfa.attention.hopper_fwd",
    "diyfa.attention.portable",
)


@dataclass(frozen=True)
class Family:
    """One kernel family (see the module docstring for the contract of each callable)."""

    name: str
    supports: Callable[[Problem], str | None]
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    prefer: Callable[[Problem], str | None] | None = None
    named: Family | None = None
    late_lengths: bool = False
    forward_out_only: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None

    def __post_init__(self):
        # Packed lengths are read and checked on entry (see the module docstring).
        if not self.late_lengths:
            object.__setattr__(self, "forward", _lengths_first(self.forward, 3))
            if self.forward_out_only is not None:
                object.__setattr__(self, "forward_out_only",
                                   _lengths_first(self.forward_out_only, 3))
        object.__setattr__(self, "backward", _lengths_first(self.backward, 6))

    def auto_reason(self, problem: Problem) -> str | None:
        """Why "auto" passes this family over for ``problem`` (None: it takes it)."""
        reason = self.supports(problem)
        if reason is None and self.prefer is not None:
            reason = self.prefer(problem)
        return reason


def _lengths_first(fn: Callable, at: int) -> Callable:
    """``fn`` (whose problem is positional argument ``at``) after reading and checking a
    packed problem's lengths (checks.packed_lengths: ValueError for lengths that do not fit
    the tensors)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        problem = args[at] if len(args) > at else kwargs["problem"]
        if problem.cu_host is not None:
            from diyfa.attention.checks import packed_lengths

            packed_lengths(problem)
        return fn(*args, **kwargs)

    return run


@functools.cache
def families() -> tuple[Family, ...]:
    """The families of :data:`FAMILY_MODULES`, in priority order (imported on first use)."""
    return tuple(importlib.import_module(m).FAMILY for m in FAMILY_MODULES)


def backend_names() -> tuple[str, ...]:
    """What ``backend=`` accepts: "auto" and each family's name."""
    return ("auto",) + tuple(f.name for f in families())


def select(problem: Problem, backend: str = "auto") -> Family:
    """The family that runs ``problem``.

    "auto": the first family that supports it; each one passed over is logged at DEBUG
    level with its reason. A family's name: that family (its ``named`` variant if it has
    one), or ValueError with the reason it cannot run the problem. Anything else:
    ValueError listing the accepted names.
    """
    fams = families()
    if backend == "auto":
        for family in fams:
            reason = family.auto_reason(problem)
            if reason is None:
                return family
            log.debug("attention backend %r skipped: %s", family.name, reason)
        raise ValueError(  # unreachable while "portable" (which supports everything) is listed
            "no attention backend can run this problem: "
            + "; ".join(f"{name}: {why}" for name, why in explain(problem))
        )
    for family in fams:
        if family.name == backend:
            reason = family.supports(problem)
            if reason is not None:
                raise ValueError(f"attention backend {backend!r} cannot run this problem: "
                                 f"{reason}")  # fmt: skip
            return family.named or family
    raise ValueError(
        f"unknown attention backend {backend!r}; accepted: "
        + ", ".join(repr(n) for n in backend_names())
    )


def explain(problem: Problem) -> list[tuple[str, str | None]]:
    """Each family's name, in priority order, with the reason "auto" would not pick it for
    ``problem`` (it cannot run it, or was measured slower there); None: it would."""
    return [(family.name, family.auto_reason(problem)) for family in families()]
