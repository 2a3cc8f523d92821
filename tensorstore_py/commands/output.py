"""Output helpers of the CLI: human sizes, aligned tables, JSON, progress bars.

Human output goes to stdout; progress bars go to stderr (so ``--json`` and
``cat`` output stay clean when piped) and only appear on a terminal. Colour is
used only when the stream is a terminal and ``NO_COLOR`` is unset.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import IO, Any

__all__ = [
    "Progress",
    "dump_json",
    "format_table",
    "human_size",
    "human_time",
    "progress",
    "style",
    "use_colour",
]

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_size(n: float | None) -> str:
    """``1536 -> '1.5 KiB'`` (binary units; bytes exact)."""
    if n is None:
        return "-"
    n = float(n)
    if abs(n) < 1024:
        return f"{int(n)} B"
    exp = min(int(math.log(abs(n), 1024)), len(_UNITS) - 1)
    return f"{n / 1024**exp:.1f} {_UNITS[exp]}"


def human_time(t: float | None) -> str:
    """A Unix time as local ``YYYY-MM-DD HH:MM:SS`` ("-" when unknown)."""
    if not t:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def use_colour(stream: IO[str]) -> bool:
    """Colour only on a terminal, and never with ``NO_COLOR`` set (no-color.org)."""
    if os.environ.get("NO_COLOR"):
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


_STYLES = {"bold": "1", "red": "31", "green": "32", "yellow": "33", "dim": "2"}


def style(text: str, name: str, stream: IO[str] | None = None) -> str:
    """``text`` wrapped in an ANSI style when ``stream`` is a colour terminal."""
    if not use_colour(stream or sys.stdout):
        return text
    return f"\x1b[{_STYLES[name]}m{text}\x1b[0m"


def format_table(
    headers: Sequence[str], rows: Sequence[Sequence[Any]], *, right: Sequence[int] = ()
) -> str:
    """An aligned plain-text table; columns in ``right`` are right-aligned."""
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for j, r in enumerate(cells):
        parts = [
            c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(r)
        ]
        lines.append("  ".join(parts).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _default(o: Any) -> Any:
    if hasattr(o, "tolist"):
        return o.tolist()
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    if isinstance(o, bytes):
        return o.hex()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def dump_json(obj: Any) -> str:
    """Stable JSON: sorted keys, 2-space indent."""
    return json.dumps(obj, indent=2, sort_keys=True, default=_default)


class Progress:
    """A progress reporter: ``advance(n)`` units of ``total`` (bytes or items).

    Draws a rich progress bar on stderr when stderr is a terminal; otherwise it
    only counts (no output), so logs and pipes stay clean.
    """

    def __init__(self, description: str, *, total: float | None = None, unit: str = "B",
                 enabled: bool | None = None) -> None:
        self.description = description
        self.total = total
        self.unit = unit
        self.done = 0.0
        self._bar: Any = None
        self._task: Any = None
        if enabled is None:
            enabled = use_colour(sys.stderr)
        if enabled:
            try:
                # rich is optional (the "cli" extra) and slow to import: only for a bar
                import rich.console
                import rich.progress  # optional, as above
            except ImportError:
                return
            rp = rich.progress
            cols: list[Any] = [rp.TextColumn("{task.description}"), rp.BarColumn()]
            cols += [rp.DownloadColumn(), rp.TransferSpeedColumn()] if unit == "B" else [rp.MofNCompleteColumn()]
            cols.append(rp.TimeRemainingColumn())
            self._bar = rp.Progress(*cols, console=rich.console.Console(stderr=True), transient=True)
            self._bar.start()
            self._task = self._bar.add_task(description, total=total)

    def set_total(self, total: float) -> None:
        self.total = total
        if self._bar is not None:
            self._bar.update(self._task, total=total)

    def advance(self, n: float = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(self._task, advance=n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


@contextmanager
def progress(description: str, *, total: float | None = None, unit: str = "B",
             enabled: bool | None = None) -> Iterator[Progress]:
    p = Progress(description, total=total, unit=unit, enabled=enabled)
    try:
        yield p
    finally:
        p.close()


#: a callback ``(units_done) -> None``; the command functions accept one so the
#: CLI can draw a bar while tests pass nothing
OnProgress = Callable[[float], None]
