"""The disk's floor, shared by the checkpoint benchmarks: the same bytes as plain
files written by many threads (write + fsync each, then the folder) and read back
(no format, no checksums, no commit: what the disk allows)."""

from __future__ import annotations

import concurrent.futures
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["read_files", "write_files"]


def write_files(pieces: list[Any], root: str, *, threads: int = 16) -> float:
    """Write each buffer of ``pieces`` as file ``root/<i>`` with ``threads``
    threads, fsync each file and then ``root``; the seconds it took."""
    os.makedirs(root, exist_ok=True)

    def write(i: int) -> None:
        fd = os.open(os.path.join(root, str(i)), os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            mv = memoryview(pieces[i]).cast("B")
            while mv:
                mv = mv[os.write(fd, mv):]
            os.fsync(fd)
        finally:
            os.close(fd)

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(write, range(len(pieces))))
    dfd = os.open(root, os.O_RDONLY)
    os.fsync(dfd)
    os.close(dfd)
    return time.perf_counter() - t0


def read_files(
    root: str, sizes: list[int], *, threads: int = 16, then: Callable[[np.ndarray], Any] | None = None
) -> float:
    """Read files ``root/<i>`` (of ``sizes[i]`` bytes) into fresh buffers with
    ``threads`` threads, calling ``then(buffer)`` on each in its thread; the seconds
    it took."""

    def read(i: int) -> None:
        buf = np.empty(sizes[i], np.uint8)
        fd = os.open(os.path.join(root, str(i)), os.O_RDONLY)
        try:
            os.preadv(fd, [memoryview(buf)], 0)
        finally:
            os.close(fd)
        if then is not None:
            then(buf)

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(read, range(len(sizes))))
    return time.perf_counter() - t0
