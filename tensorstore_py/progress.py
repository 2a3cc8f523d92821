"""Progress of long work: a bar with a total and an ETA on a terminal, one summary line elsewhere.

The CLI's long commands (``verify``, ``copy``, ``export``, ``gc --apply``) and
the library's long calls (:func:`tensorstore_py.checkpoint.save` and
``restore`` with ``progress=``) report through one :class:`Progress`:

* on a terminal (the stream is a tty), a ``rich`` bar (the ``cli`` extra) with
  the amount done, the total as far as it is known, the rate and the time
  left; it disappears when the work ends;
* anywhere else (a log file, a pipe, CI), nothing while the work runs and one
  line at the end: ``verify: 2.1 GiB in 3.2 s (670.2 MiB/s)``;
* a callable ``progress(done, total)`` instead (library calls): called as the
  work advances, ``total`` None while unknown.

Bars and summary lines go to stderr, so stdout (tables, ``--json``, data) stays
clean.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any, Union

from tensorstore_py.core.errors import InvalidArgumentError

__all__ = ["Progress", "ProgressArg", "ProgressCallback", "human_size", "is_terminal", "reporter"]

#: ``callback(done, total)``: units done so far, the total (None while unknown)
ProgressCallback = Callable[[int, Union[int, None]], None]  # noqa: UP007 (a runtime alias)
#: what a library call's ``progress=`` takes: True (a bar / summary line on
#: stderr), a :data:`ProgressCallback`, or None / False (nothing)
ProgressArg = Union[bool, ProgressCallback, None]  # noqa: UP007 (a runtime alias)

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_size(n: float | None) -> str:
    """``1536 -> '1.5 KiB'`` (binary units; bytes exact; None -> '-')."""
    if n is None:
        return "-"
    n = float(n)
    if abs(n) < 1024:
        return f"{int(n)} B"
    exp = min(int(math.log(abs(n), 1024)), len(_UNITS) - 1)
    return f"{n / 1024**exp:.1f} {_UNITS[exp]}"


def is_terminal(stream: IO[str]) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


class Progress:
    """Counts units of work (``unit="B"``: bytes, else items) and shows them.

    ``bar``: True draws a bar, False never, None (default) when ``stream``
    (stderr) is a terminal and ``rich`` is installed. ``summary``: print one
    line when the work ends if no bar was drawn (off by default). ``callback(done, total)`` is
    called on every change. Safe to advance from several threads.
    """

    def __init__(
        self, description: str, *, unit: str = "B", total: int | None = None,
        bar: bool | None = None, summary: bool = False, callback: ProgressCallback | None = None,
        stream: IO[str] | None = None,
    ) -> None:
        self.description = description
        self.unit = unit
        self.total = total
        self.done = 0
        self.callback = callback
        self.stream = stream if stream is not None else sys.stderr
        self._summary = summary
        self._lock = threading.Lock()
        self._started = time.perf_counter()
        self._bar: Any = None
        self._task: Any = None
        if bar is None:
            bar = is_terminal(self.stream)
        if bar:
            self._start_bar()

    def _start_bar(self) -> None:
        try:
            # rich is optional (the "cli" extra) and slow to import: only for a bar
            import rich.console
            import rich.progress  # optional, as above
        except ImportError:
            return
        rp = rich.progress
        cols: list[Any] = [rp.TextColumn("{task.description}"), rp.BarColumn()]
        if self.unit == "B":
            cols += [rp.DownloadColumn(binary_units=True), rp.TransferSpeedColumn()]
        else:
            cols += [rp.MofNCompleteColumn(), rp.TextColumn(self.unit)]
        cols.append(rp.TimeRemainingColumn())
        console = rich.console.Console(file=self.stream, no_color=bool(os.environ.get("NO_COLOR")))
        self._bar = rp.Progress(*cols, console=console, transient=True)
        self._bar.start()
        self._task = self._bar.add_task(self.description, total=self.total)

    def _changed(self) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, total=self.total)
        if self.callback is not None:
            self.callback(self.done, self.total)

    def set_total(self, total: int | None) -> None:
        """The total is now ``total`` units (None: unknown)."""
        with self._lock:
            self.total = total
            self._changed()

    def add_total(self, n: int) -> None:
        """``n`` more units to do (the total becomes known if it was not)."""
        with self._lock:
            self.total = (self.total or 0) + int(n)
            self._changed()

    def advance(self, n: int = 1) -> None:
        """``n`` more units done."""
        with self._lock:
            self.done += int(n)
            if self.total is not None and self.done > self.total:
                self.total = self.done  # an estimate that fell short
            self._changed()

    def summary_line(self) -> str:
        """``"verify: 2.1 GiB in 3.2 s (670.2 MiB/s)"``."""
        secs = time.perf_counter() - self._started
        if self.unit == "B":
            amount = human_size(self.done)
            rate = f" ({human_size(self.done / secs)}/s)" if secs > 0 and self.done else ""
        else:
            amount = f"{self.done} {self.unit}"
            rate = f" ({self.done / secs:.0f} {self.unit}/s)" if secs > 0 and self.done else ""
        return f"{self.description}: {amount} in {secs:.1f} s{rate}"

    def close(self, *, failed: bool = False) -> None:
        """End the display: remove the bar, or print the summary line (not when
        ``failed``: the error message says what happened)."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        elif self._summary and not failed:
            try:
                self.stream.write(self.summary_line() + "\n")
                self.stream.flush()
            except (OSError, ValueError):  # a closed pipe: the summary is a courtesy
                pass
        self._summary = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        self.close(failed=exc_type is not None)


def reporter(progress: ProgressArg, description: str, *, unit: str = "B") -> Progress | None:
    """The :class:`Progress` a library call's ``progress=`` asks for: True -> a
    bar on a terminal, else a summary line on stderr; a callable -> called with
    ``(done, total)``; None / False -> None."""
    if progress is None or progress is False:
        return None
    if progress is True:
        return Progress(description, unit=unit, summary=True)
    if callable(progress):
        return Progress(description, unit=unit, bar=False, summary=False, callback=progress)
    raise InvalidArgumentError(
        f"progress must be True, False, None or a callable(done, total), got {progress!r}"
    )
