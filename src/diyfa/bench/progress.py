"""A progress bar for the long CLI commands (``diyfa bench``, ``diyfa tune``): how many of how
many, the item under way and an ETA, drawn with ``rich`` on stderr.

The bar is for someone watching a terminal: :func:`wanted` says no when ``--no-progress`` was
given or when stdout or stderr is not a terminal (a run piped into a log or a file keeps its
output free of redraws), and without ``rich`` (the ``bench`` extra) every call is a no-op,
so callers never branch on whether a bar is shown.
"""

from __future__ import annotations

import sys


def wanted(no_progress: bool = False) -> bool:
    """Whether a command should draw a bar: not asked off, and both output streams are
    terminals (the bar goes to stderr; a redirected stdout means nobody is watching)."""
    return not no_progress and sys.stdout.isatty() and sys.stderr.isatty()


class Bar:
    """``with Bar(total, "measurements", enabled) as bar: bar.show(label) ... bar.advance()``.

    Columns: the bar, done/total, ``what``, elapsed, ETA, then the current item last (a long
    label is cut at the right edge, never the numbers). ``console``: by default a rich
    console on stderr."""

    def __init__(self, total: int, what: str = "", enabled: bool = True, console=None):
        self._progress = None
        self._task = None
        if not enabled:
            return
        try:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
            from rich.table import Column
        except ImportError:
            return
        self._progress = Progress(
            BarColumn(bar_width=20),
            MofNCompleteColumn(),
            TextColumn(what),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            # the item takes what the numbers leave of the line, cut with an ellipsis
            TextColumn("{task.description}",
                       table_column=Column(no_wrap=True, overflow="ellipsis", ratio=1)),
            console=console or Console(stderr=True),
            expand=True,
        )  # fmt: skip
        self._task = self._progress.add_task("", total=total)

    def __enter__(self) -> Bar:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()

    def show(self, label: str) -> None:
        """Name the item now under way."""
        if self._progress is not None:
            self._progress.update(self._task, description=label)

    def advance(self, n: int = 1) -> None:
        if self._progress is not None:
            self._progress.advance(self._task, n)
