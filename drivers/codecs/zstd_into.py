"""zstd compression of large chunks into recycled buffers.

numcodecs' ``Zstd.encode`` returns a fresh ``bytes`` object per chunk. For
chunks of a few MiB that memory is fresh pages every time (the allocator hands
such blocks back to the kernel when they are freed): a write of 1 GiB of
float32 in 4 MiB zstd-1 chunks took 242,700 minor page faults, one per 4 KiB
of compressed output, and the kernel cleared every one of those pages before
libzstd overwrote it. Compressed into blocks of
:data:`~tensorstore_py.drivers.chunk_buffers.chunk_buffers`, which come back
warm once the value written from them is gone, the same write faults in none
of them.

numcodecs has no API that compresses into a caller's buffer, but its extension
module carries libzstd and exports its symbols. This module calls libzstd's
stable API there through :mod:`ctypes` (``ZSTD_createCCtx``,
``ZSTD_CCtx_setParameter``, ``ZSTD_compress2``, ``ZSTD_compressBound``; stable
since zstd 1.4.0), with the parameters numcodecs sets (level, checksum flag), so
the bytes are numcodecs' own. That is checked once, at first use, against
numcodecs' output; a missing symbol or any difference and :func:`compress_into`
returns None: the caller encodes with numcodecs as before. ctypes releases the
GIL for the call, as numcodecs does. One compression context per thread
(libzstd's advice for repeated compression), freed when the thread ends.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import numcodecs.zstd as _nz
import numpy as np
from numcodecs import Zstd

from tensorstore_py.drivers.chunk_buffers import POOLED_BYTES, chunk_buffer, chunk_buffers
from tensorstore_py.kvstore.base import Buffer

__all__ = ["compress_into"]

#: libzstd's ZSTD_cParameter values (zstd.h, stable API)
_C_COMPRESSION_LEVEL = 100
_C_CHECKSUM_FLAG = 201


class _Lib:
    """libzstd's compression entry points, bound from numcodecs' extension module."""

    def __init__(self) -> None:
        lib = ctypes.CDLL(_nz.__file__)
        size_t, ptr = ctypes.c_size_t, ctypes.c_void_p
        self.create = lib.ZSTD_createCCtx
        self.create.argtypes, self.create.restype = [], ptr
        self.free = lib.ZSTD_freeCCtx
        self.free.argtypes, self.free.restype = [ptr], size_t
        self.set_parameter = lib.ZSTD_CCtx_setParameter
        self.set_parameter.argtypes, self.set_parameter.restype = [ptr, ctypes.c_int, ctypes.c_int], size_t
        self.compress2 = lib.ZSTD_compress2
        self.compress2.argtypes, self.compress2.restype = [ptr, ptr, size_t, ptr, size_t], size_t
        self.bound = lib.ZSTD_compressBound
        self.bound.argtypes, self.bound.restype = [size_t], size_t
        self.is_error = lib.ZSTD_isError
        self.is_error.argtypes, self.is_error.restype = [size_t], ctypes.c_uint


class _Context:
    """One compression context, freed with its holder (a thread's :data:`_local`)."""

    def __init__(self, lib: _Lib) -> None:
        self.ptr = lib.create()
        if not self.ptr:
            raise MemoryError("ZSTD_createCCtx failed")
        self._free = lib.free

    def __del__(self) -> None:
        if self.ptr:
            self._free(self.ptr)


_lock = threading.Lock()
_state: list[Any] = []  # [] unchecked; [_Lib] usable; [None] not usable here
_local = threading.local()  # .context: this thread's _Context, freed when the thread ends


def _usable() -> _Lib | None:
    if not _state:
        with _lock:
            if not _state:
                _state.append(_check())
    return _state[0]  # type: ignore[no-any-return]


def _check() -> _Lib | None:
    """The bound library if it compresses exactly as numcodecs does, else None."""
    try:
        lib = _Lib()
        sample = np.arange(1 << 16, dtype=np.uint32).view(np.uint8)
        for level, checksum in ((1, False), (3, True), (-1, False)):
            got = _compress(lib, sample, level, checksum)
            if got is None or bytes(got) != Zstd(level=level, checksum=checksum).encode(sample):
                return None
    except (OSError, AttributeError, MemoryError):  # no such library or symbol
        return None
    return lib


def _compress(lib: _Lib, src: np.ndarray, level: int, checksum: bool) -> Buffer | None:
    context = getattr(_local, "context", None)
    if context is None:
        context = _local.context = _Context(lib)
    ctx = context.ptr
    if lib.is_error(lib.set_parameter(ctx, _C_COMPRESSION_LEVEL, level)) or lib.is_error(
            lib.set_parameter(ctx, _C_CHECKSUM_FLAG, int(checksum))):
        return None
    bound = lib.bound(src.nbytes)
    out = chunk_buffers.get(bound)
    n = lib.compress2(ctx, out.ctypes.data, bound, src.ctypes.data, src.nbytes)
    if lib.is_error(n):
        return None
    if 2 * n >= len(out):
        return out.data[:n]
    # much smaller than its bound: a block of its own size, not a quarter-full one
    small = chunk_buffer(n)
    if small is None:
        return out[:n].tobytes()
    small[:] = out[:n]
    return small.data


def compress_into(buf: Buffer, level: int, checksum: bool) -> Buffer | None:
    """``buf`` zstd-compressed as numcodecs' ``Zstd(level, checksum)`` would,
    in a recycled block (a memoryview of it; see the module doc); None when
    ``buf`` is smaller than :data:`~tensorstore_py.drivers.chunk_buffers.POOLED_BYTES`,
    not contiguous, or libzstd can not be reached this way (the caller then
    encodes with numcodecs)."""
    try:
        src = np.frombuffer(buf, np.uint8)
    except (ValueError, TypeError, BufferError):
        return None
    if src.nbytes < POOLED_BYTES:
        return None
    lib = _usable()
    return None if lib is None else _compress(lib, src, level, checksum)
