"""Reports rendered from results files only (never re-measured): Markdown + HTML with plots.

``diyfa report [files...]`` -> ``report/report.md``, ``report/plots/*.png`` and
``report/report.html`` (self-contained: the plots are embedded as base64 PNGs).
"""

from __future__ import annotations


def render(paths, out_dir="report") -> dict:
    """Render ``paths`` (results .jsonl files) into ``out_dir``; see :mod:`diyfa.report.builder`."""
    from diyfa.report.builder import render as _render

    return _render(paths, out_dir)


__all__ = ["render"]
