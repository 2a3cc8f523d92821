"""Page-aligned host buffers.

The kernel copies file data into page-aligned buffers several times faster than
into unaligned ones (measured here: 6.8 vs 1.6 GiB/s from the page cache), and
``jax.device_put`` on CPU aliases such memory instead of copying it (0.2 s
instead of 1.5-3.5 s for 1 GiB).
"""

from __future__ import annotations

import math
from typing import Any, cast

import numpy as np

from tensorstore_py.core.errors import ResourceExhaustedError

__all__ = ["PAGE", "aligned_empty", "new_array"]

#: the alignment of every buffer made here
PAGE = 4096


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


def new_array(shape: tuple[int, ...], dtype: Any, *, what: str, aligned: bool = False) -> np.ndarray:
    """An uninitialised array to hold ``what`` (page-aligned with ``aligned``).

    Raises :class:`ResourceExhaustedError` naming ``what``, its shape and its
    size in bytes when it can not exist (more bytes than the address space) or
    can not be allocated, instead of numpy's ValueError or MemoryError.
    """
    dt = np.dtype(dtype)
    shape_t = tuple(int(s) for s in shape)
    nbytes = math.prod(shape_t) * dt.itemsize
    if nbytes > np.iinfo(np.intp).max - PAGE:
        raise ResourceExhaustedError(
            f"{what}: a {dt} array of shape {shape_t} would take {nbytes} bytes, more than an "
            f"array can hold (at most {np.iinfo(np.intp).max}); read a smaller region"
        )
    try:
        return aligned_empty(shape_t, dt) if aligned else np.empty(shape_t, dt)
    except (MemoryError, ValueError) as e:
        raise ResourceExhaustedError(
            f"{what}: a {dt} array of shape {shape_t} ({nbytes} bytes) can not be allocated "
            f"({type(e).__name__}: {e}); read a smaller region"
        ) from None
