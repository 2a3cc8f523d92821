"""Page-aligned host buffers.

The kernel copies file data into page-aligned buffers several times faster than
into unaligned ones (measured here: 6.8 vs 1.6 GiB/s from the page cache), and
``jax.device_put`` on CPU aliases such memory instead of copying it (0.2 s
instead of 1.5-3.5 s for 1 GiB).

:func:`mapped_empty` is for large results made fresh (an array read's result of
32 MiB or more, a restore's blocks): a private anonymous mapping of its own, not a numpy
allocation, so it gets the kernel's 4 KiB pages, as TensorStore's results do.
numpy asks the kernel for transparent huge pages (``madvise(MADV_HUGEPAGE)``)
on every allocation of 4 MiB or more, and the first touch of fresh memory so
advised can cost far more than it saves:

- where the kernel's ``transparent_hugepage/defrag`` is ``madvise`` (a common
  default), it may wait for memory compaction: on a busy machine reading 1 GiB
  from the page cache into such buffers took 3.6x as long as into plain
  mappings (5.5 s vs 1.5 s, medians);
- on a VM whose free memory goes back to the hypervisor (free page reporting
  works on 2 MiB blocks, exactly what a huge page needs, and leaves the 4 KiB
  fragments), each huge page comes back from the host: the first read after a
  write of 1 GiB (4 MiB chunks, 2 cores) took 1.7-1.8 s with 3.1-3.4 s of
  system time into numpy's memory, 0.39-0.40 s into a plain mapping.

The cost of 4 KiB pages where memory is warm (recycled at once, as on a machine
without page reporting): touching 256 MiB of fresh memory took 154 ms against
80 ms with huge pages (``np.copyto`` into a new mapping, medians of 7), and a
second read of that 1 GiB 0.45-0.49 s against 0.32-0.39 s.

A mapping goes back to the system when its last array goes. Buffers that are
allocated and dropped over and over (chunk reads) stay with
:func:`aligned_empty`, whose memory the allocator reuses already touched.
"""

from __future__ import annotations

import errno
import math
import mmap
import os
import threading
from collections.abc import Callable
from typing import Any, cast

import numpy as np

from tensorstore_py.core.errors import ResourceExhaustedError

__all__ = ["MAPPED_BYTES", "PAGE", "RESULT_MAPPED_BYTES", "SCRATCH_BYTES", "aligned_empty", "mapped_empty",
           "new_array", "pread_full", "thread_scratch"]

#: the alignment of every buffer made here
PAGE = 4096
#: :func:`mapped_empty` buffers this large or larger are mappings of their own (see above)
MAPPED_BYTES = 4 << 20
#: :func:`new_array` results this large or larger are :func:`mapped_empty` mappings. Below
#: it glibc's malloc keeps freed memory for the next request (its mmap threshold grows
#: with the blocks freed, up to 32 MiB on 64-bit), so a result made there comes back
#: touched read after read; at or above it every allocation is a fresh mapping anyway,
#: and the only choice left is its page size (see the module doc).
RESULT_MAPPED_BYTES = 32 << 20
#: the largest buffer :func:`thread_scratch` keeps per thread
SCRATCH_BYTES = 2 << 20

_scratch = threading.local()


def aligned_empty(shape: int | tuple[int, ...], dtype: Any = np.uint8) -> np.ndarray:
    """An uninitialised C-order array of ``shape`` starting on a page boundary.

    ``aligned_empty(n)`` is ``n`` bytes (uint8).
    """
    shape_t = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
    dt = np.dtype(dtype)
    n = math.prod(shape_t) * dt.itemsize
    raw = np.empty(n + PAGE, dtype=np.uint8)
    off = (-raw.ctypes.data) % PAGE
    return cast(np.ndarray, raw[off: off + n].view(dt).reshape(shape_t))


def mapped_empty(shape: int | tuple[int, ...], dtype: Any = np.uint8) -> np.ndarray:
    """Like :func:`aligned_empty`, but at :data:`MAPPED_BYTES` or more a private
    anonymous mapping of its own, never advised for huge pages (see above). A
    mapping the kernel refuses raises MemoryError, as numpy's allocations do."""
    shape_t = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
    dt = np.dtype(dtype)
    n = math.prod(shape_t) * dt.itemsize
    if n < MAPPED_BYTES:
        return aligned_empty(shape_t, dt)
    try:
        mem = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # page-aligned
    except OSError as e:
        if e.errno in (errno.ENOMEM, errno.EOVERFLOW):
            raise MemoryError(f"a mapping of {n} bytes: {e.strerror}") from None
        raise
    return cast(np.ndarray, np.frombuffer(mem, dtype=np.uint8).view(dt).reshape(shape_t))


def thread_scratch(nbytes: int) -> np.ndarray | None:
    """A page-aligned uint8 buffer of ``nbytes`` that belongs to the calling
    thread and is handed out again by its next call (None above
    :data:`SCRATCH_BYTES`).

    For bytes that live only until the caller is done with them (a stored
    chunk read to be decoded at once): memory touched a moment ago is warm in
    the caches, where a fresh buffer of a few hundred KiB is not (reading a
    230 KiB file into it took 14 us here, into a fresh one 46 us). The caller
    must be done with the buffer before it calls again on the same thread;
    each thread keeps at most :data:`SCRATCH_BYTES`.
    """
    if nbytes > SCRATCH_BYTES:
        return None
    buf: np.ndarray | None = getattr(_scratch, "buf", None)
    if buf is None or buf.nbytes < nbytes:
        buf = aligned_empty(max(nbytes, 64 << 10))
        _scratch.buf = buf
    return buf[:nbytes]


def pread_full(fd: int, mv: memoryview, offset: int, got: int = 0) -> int:
    """Read file ``fd`` from ``offset`` into the bytes of ``mv`` (whose first
    ``got`` are filled already) until ``mv`` is full or the file ends; returns
    the bytes ``mv`` now holds. A short read (``preadv`` may return less than
    asked) goes on where it stopped."""
    mv = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
    n = mv.nbytes
    while got < n:
        k = os.preadv(fd, (mv[got:],), offset + got)
        if k == 0:
            break
        got += k
    return got


_INTP_MAX = int(np.iinfo(np.intp).max)


def new_array(shape: tuple[int, ...], dtype: Any, *, what: str | Callable[[], str],
              aligned: bool = False) -> np.ndarray:
    """An uninitialised C-order array to hold ``what``: page-aligned with
    ``aligned``, and at :data:`RESULT_MAPPED_BYTES` or more a mapping of its own
    (:func:`mapped_empty`, 4 KiB pages; see the module doc) whatever ``aligned``.

    Raises :class:`ResourceExhaustedError` naming ``what`` (or what it returns:
    the words are made only for the error), its shape and its
    size in bytes when it can not exist (more bytes than the address space) or
    can not be allocated, instead of numpy's ValueError or MemoryError.
    """
    dt = np.dtype(dtype)
    shape_t = tuple(int(s) for s in shape)
    nbytes = math.prod(shape_t) * dt.itemsize
    if nbytes > _INTP_MAX - PAGE:
        raise ResourceExhaustedError(
            f"{_words(what)}: a {dt} array of shape {shape_t} would take {nbytes} bytes, more than an "
            f"array can hold (at most {_INTP_MAX}); read a smaller region"
        )
    try:
        if nbytes >= RESULT_MAPPED_BYTES and not dt.hasobject and dt.kind != "T":  # no pointers in a mapping
            return mapped_empty(shape_t, dt)
        return aligned_empty(shape_t, dt) if aligned else np.empty(shape_t, dt)
    except (MemoryError, ValueError, OverflowError) as e:
        raise ResourceExhaustedError(
            f"{_words(what)}: a {dt} array of shape {shape_t} ({nbytes} bytes) can not be allocated "
            f"({type(e).__name__}: {e}); read a smaller region"
        ) from None


def _words(what: str | Callable[[], str]) -> str:
    return what if isinstance(what, str) else what()
