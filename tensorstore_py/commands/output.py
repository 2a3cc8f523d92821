"""Output helpers of the CLI: human sizes, aligned tables, JSON.

Human output goes to stdout; progress (:mod:`tensorstore_py.progress`) goes to
stderr, so ``--json`` and ``cat`` output stay clean when piped. Colour is used
only when the stream is a terminal and ``NO_COLOR`` is unset.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from typing import IO, Any

from tensorstore_py.progress import human_size, is_terminal

__all__ = ["dump_json", "format_table", "human_size", "human_time", "style", "use_colour"]


def human_time(t: float | None) -> str:
    """A Unix time as local ``YYYY-MM-DD HH:MM:SS`` ("-" when unknown)."""
    if not t:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def use_colour(stream: IO[str]) -> bool:
    """Colour only on a terminal, and never with ``NO_COLOR`` set (no-color.org)."""
    return not os.environ.get("NO_COLOR") and is_terminal(stream)


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
