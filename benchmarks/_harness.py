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

__all__ = ["emit", "fresh", "scratch_dir"]


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
