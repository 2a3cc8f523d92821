"""Reading tensor regions of safetensors files on a local disk (the ``file`` store).

Every block is read straight into its page-aligned output array (which
``jax.device_put`` on CPU then aliases), by ``preadv`` calls on the pool of one
thread per usable CPU: reads from the page cache are memory copies, and more
threads than CPUs only contend. How a tensor is read depends on what this
process needs of it:

* blocks that are runs of whole rows (a row split, a replicated or numpy
  target): one read per block (split into parts of :data:`PART_BYTES` so that
  every CPU copies), no intermediate buffer;
* blocks that together cover the tensor's bytes densely (a column split whose
  every block this process holds): the bounding range once, in windows of whole
  rows of about :data:`WINDOW_BYTES`, each window scattered into every block it
  touches with one strided numpy copy per block;
* sparse blocks (half of every row): row by row, each row (or sub-block whose
  bounding range holds at most 10% more than it) with its own read.

Each file is opened once for the whole restore, so every region comes from the
same file even if it is replaced meanwhile (the file store replaces, never
rewrites in place).
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tensorstore_py.checkpoint.layout import Region, c_strides, region_shape, span_in_chunk
from tensorstore_py.checkpoint.restoring import ReadStats
from tensorstore_py.checkpoint.safetensors_format import TensorEntry
from tensorstore_py.core.buffers import mapped_empty, pread_full
from tensorstore_py.core.errors import DataCorruptionError, NotFoundError, StorageError
from tensorstore_py.core.pools import available_cpus, cpu_pool

__all__ = ["PART_BYTES", "WINDOW_BYTES", "LocalBlock", "pieces", "read_local_blocks"]

#: the most one read of a contiguous block copies (larger blocks are split so all CPUs copy)
PART_BYTES = 32 << 20
#: about how much of a densely needed tensor one window reads (whole rows, at least one)
WINDOW_BYTES = 8 << 20
SLACK = 1.1  # a range may hold at most 10% more bytes than the blocks in it

#: does one read (and its copies) with a worker's scratch buffer; returns the bytes read
Task = Callable[["_Scratch"], int]


@dataclass
class LocalBlock:
    """One region of one tensor of a file, to land in ``out`` (C-order, region-shaped)."""

    path: str  # the file, absolute
    entry: TensorEntry
    region: Region
    out: np.ndarray


def read_local_blocks(blocks: list[LocalBlock], *, where: str, stats: ReadStats) -> None:
    """Fill every block's ``out`` from its file (blocking; reads run on the CPU pool).

    Raises NotFoundError for a missing file and DataCorruptionError naming the
    file and tensor when a file ends before a tensor's bytes do.
    """
    fds: dict[str, int] = {}
    try:
        for b in blocks:
            if b.path not in fds:
                try:
                    fds[b.path] = os.open(b.path, os.O_RDONLY)
                except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
                    raise NotFoundError(f"{where}: safetensors file {b.path!r} disappeared while reading") from None
                except OSError as e:
                    raise StorageError(f"{where}: reading {b.path!r}: {e}") from e
        tasks: list[tuple[int, Task]] = []  # (file offset, task): run in file order
        by_tensor: dict[tuple[str, str], list[LocalBlock]] = {}
        for b in blocks:
            by_tensor.setdefault((b.path, b.entry.name), []).append(b)
        for (path, _name), group in by_tensor.items():
            tasks.extend(_tensor_tasks(fds[path], group, path))
        tasks.sort(key=lambda t: t[0])
        stats.bytes_read += _run(tasks)
        stats.requests += len(tasks)
    finally:
        for fd in fds.values():
            os.close(fd)


def _run(tasks: list[tuple[int, Task]]) -> int:
    """Run ``tasks`` in order on this thread and up to one thread per usable CPU
    less one from the CPU pool, each worker with a scratch buffer of its own
    (dropped at the end); returns the bytes read."""
    it = iter(tasks)
    lock = threading.Lock()
    failed = threading.Event()  # one task failed: the others stop taking tasks

    def worker() -> int:
        scratch = _Scratch()
        total = 0
        while not failed.is_set():
            with lock:
                nxt = next(it, None)
            if nxt is None:
                break
            try:
                total += nxt[1](scratch)
            except BaseException:
                failed.set()
                raise
        return total

    helpers = [cpu_pool().submit(worker) for _ in range(min(available_cpus(), len(tasks)) - 1)]
    try:
        total = worker()
    finally:
        concurrent.futures.wait(helpers)  # the files stay open until no read runs
    return total + sum(f.result() for f in helpers)


class _Scratch:
    """A worker's reused page-aligned buffer for reads that are then scattered."""

    buf: np.ndarray | None = None

    def get(self, n: int) -> np.ndarray:
        if self.buf is None or self.buf.nbytes < n:
            self.buf = mapped_empty(max(n, WINDOW_BYTES))
        return self.buf[:n]


def _contiguous(b: LocalBlock) -> bool:
    a, z = span_in_chunk(b.region, (0,) * len(b.entry.shape), b.entry.shape, b.entry.dtype.itemsize)
    return z - a == b.out.nbytes


def _tensor_tasks(fd: int, group: list[LocalBlock], where: str) -> list[tuple[int, Task]]:
    e = group[0].entry
    shape, item = e.shape, e.dtype.itemsize
    live = [b for b in group if b.out.nbytes]
    if not live:
        return []
    if all(_contiguous(b) for b in live):
        out = []
        for b in live:
            a, _z = span_in_chunk(b.region, (0,) * len(shape), shape, item) if shape else (0, item)
            flat = b.out.reshape(-1).view(np.uint8)
            for p in range(0, flat.nbytes, PART_BYTES):
                out.append((e.start + a + p, _direct(fd, e.start + a + p, flat[p: p + PART_BYTES], e, where)))
        return out
    spans = [span_in_chunk(b.region, (0,) * len(shape), shape, item) for b in live]
    lo, hi = min(s[0] for s in spans), max(s[1] for s in spans)
    if hi - lo <= SLACK * sum(b.out.nbytes for b in live):
        return _window_tasks(fd, live, lo, hi, where)
    out = []
    for b in live:
        out.append((e.start + span_in_chunk(b.region, (0,) * len(shape), shape, item)[0],
                    _sparse(fd, b, where)))
    return out


def _read_exact(fd: int, off: int, buf: np.ndarray, e: TensorEntry, where: str) -> int:
    """``buf.nbytes`` bytes at ``off`` into ``buf`` (uint8, contiguous)."""
    n = buf.nbytes
    got = pread_full(fd, buf.data, off)
    if got != n:
        raise DataCorruptionError(
            f"{where}: tensor {e.name!r} cut short (read {got} bytes of {n}) at byte {off}"
        )
    return n


def _direct(fd: int, off: int, dest: np.ndarray, e: TensorEntry, where: str) -> Task:
    return lambda _scratch: _read_exact(fd, off, dest, e, where)


def _window_tasks(fd: int, live: list[LocalBlock], lo: int, hi: int, where: str) -> list[tuple[int, Task]]:
    e = live[0].entry
    shape, item = e.shape, e.dtype.itemsize
    row = math.prod(shape[1:]) * item  # bytes of one index of the first dimension
    r_lo, r_hi = lo // row, -(-hi // row)
    per = max(1, WINDOW_BYTES // row)

    def task(w0: int, w1: int) -> Task:
        def run(scratch: _Scratch) -> int:
            buf = scratch.get((w1 - w0) * row)
            n = _read_exact(fd, e.start + w0 * row, buf, e, where)
            rows = buf.view(e.dtype).reshape((w1 - w0, *shape[1:]))
            for b in live:
                (b0, b1), rest = b.region[0], b.region[1:]
                a, z = max(b0, w0), min(b1, w1)
                if a < z:
                    b.out[a - b0: z - b0] = rows[(slice(a - w0, z - w0), *(slice(x, y) for x, y in rest))]
            return n
        return run

    return [(e.start + w * row, task(w, min(w + per, r_hi))) for w in range(r_lo, r_hi, per)]


def pieces(region: Region, shape: tuple[int, ...], item: int) -> list[Region]:
    """Sub-blocks of ``region`` whose bounding byte ranges hold at most 10% slack."""
    a, b = span_in_chunk(region, (0,) * len(shape), shape, item)
    if b - a <= SLACK * math.prod(region_shape(region)) * item:
        return [region]
    # split along the first dimension with more than one index (not the last: a
    # block of one row of the last dimension is contiguous, and was returned above)
    d = next(d for d, (lo, hi) in enumerate(region) if hi - lo > 1)
    lo, hi = region[d]
    out: list[Region] = []
    for i in range(lo, hi):
        out.extend(pieces((*region[:d], (i, i + 1), *region[d + 1:]), shape, item))
    return out


def _sparse(fd: int, b: LocalBlock, where: str) -> Task:
    e = b.entry
    shape, item = e.shape, e.dtype.itemsize
    strides = tuple(s * item for s in c_strides(shape))

    def run(scratch: _Scratch) -> int:
        total = 0
        for p in pieces(b.region, shape, item):
            a, z = span_in_chunk(p, (0,) * len(shape), shape, item)
            dst = b.out[tuple(slice(x - r0, y - r0) for (x, y), (r0, _) in zip(p, b.region))]
            if z - a == dst.nbytes and dst.flags.c_contiguous:
                total += _read_exact(fd, e.start + a, dst.reshape(-1).view(np.uint8), e, where)
                continue
            buf = scratch.get(z - a)
            total += _read_exact(fd, e.start + a, buf, e, where)
            dst[...] = np.ndarray(region_shape(p), dtype=e.dtype, buffer=buf, strides=strides)
        return total

    return run
