"""What the benchmark scripts share: a scratch folder and the ``name: value unit`` lines.

The scripts run as ``python benchmarks/<name>.py``, so this folder is on
``sys.path`` and they import this module as ``_harness``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["emit", "fresh", "runqueue_wait", "scratch_dir"]


@contextmanager
def scratch_dir(prefix: str, parent: str | None = None) -> Iterator[str]:
    """A new temporary folder (under ``parent`` if given), removed afterwards."""
    path = tempfile.mkdtemp(prefix=prefix, dir=parent)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def fresh(path: str) -> str:
    """``path`` as a new, empty folder."""
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path, exist_ok=True)  # a late background write may have made it again
    return path


def emit(name: str, value: float, unit: str = "", *, digits: int = 3) -> None:
    """One result line, ``name: value unit``, with ``digits`` decimals."""
    print(f"{name}: {value:.{digits}f} {unit}".rstrip(), flush=True)


def runqueue_wait() -> float | None:
    """Seconds that this process's threads have spent runnable but waiting for a
    CPU (Linux ``/proc/self/task/*/schedstat``, second field; None elsewhere).

    The difference over a timed step tells load from elsewhere on the machine
    (every thread waits for a CPU) from a library's own stalls (lock or GIL
    waits, I/O: the thread sleeps, which counts here not at all). Threads
    that start or end within the step are missed; the engines' pools are
    started by a warm-up read before any timing.
    """
    total = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # ended meanwhile
    return total / 1e9
