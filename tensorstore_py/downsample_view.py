"""``tsp.downsample(view, factors, method)``: a lazy, read-only downsampled view.

The view behaves as TensorStore's ``downsample`` driver:

* Blocks start at coordinate 0 of ``view``'s domain (not at its origin):
  output position ``i`` stands for ``[i*f, (i+1)*f)``. The output domain along
  a dimension ``[a, b)`` is ``[floor(a/f), ceil(b/f))``, so blocks cut by the
  domain's edges are partial and reduced over the elements present. For
  ``stride`` it is ``[ceil(a/f), floor((b-1)/f) + 1)`` and position ``i`` reads
  ``i*f`` exactly.
* Methods: ``mean``, ``median``, ``mode``, ``stride``, ``min``, ``max``; the
  rules for rounding, ties and data types are in
  :mod:`tensorstore_py.downsample_kernels`. An unsupported method or data type
  raises InvalidArgumentError before any I/O.

Nothing is read until ``read()``; then only the input blocks behind the
requested output positions are read (through ``view``, so a view of a view, a
transposed or translated view all work), in slabs of at most
``_SLAB_BYTES`` of input at a time. Writing raises ReadOnlyError. The view's
``spec()`` is TensorStore's: ``{"driver": "downsample", "base": ...,
"downsample_factors": ..., "downsample_method": ...}``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tensorstore_py.core.buffers import new_array
from tensorstore_py.core.errors import InvalidArgumentError, ReadOnlyError, UnsupportedError
from tensorstore_py.core.pools import run_cpu
from tensorstore_py.downsample_kernels import check_method, reduce_blocks
from tensorstore_py.drivers.base import ArrayDriver, Index
from tensorstore_py.drivers.grid import out_shape
from tensorstore_py.kvstore.base import KvStore
from tensorstore_py.tensorstore import TensorStore

__all__ = ["DownsampleDriver", "downsample"]

# Input bytes read (and reduced) at once by one read of the view.
_SLAB_BYTES = 64 << 20
# Inputs smaller than this are reduced on the loop thread (a pool hop costs more).
_INLINE_BYTES = 256 << 10


def downsample(view: TensorStore, factors: int | Sequence[int], method: str = "mean") -> TensorStore:
    """A lazy, read-only view of ``view`` downsampled by ``factors`` (one per
    dimension, or one int for all) with ``method`` (see the module docstring)."""
    if not isinstance(view, TensorStore):
        raise InvalidArgumentError(f"downsample: expected a TensorStore view, got {type(view).__name__}")
    fs = [factors] * view.ndim if isinstance(factors, (int, np.integer)) else list(factors)
    if len(fs) != view.ndim or any(
            isinstance(f, (bool, np.bool_)) or not isinstance(f, (int, np.integer)) or f < 1 for f in fs):
        raise InvalidArgumentError(f"downsample: factors must be {view.ndim} integers >= 1, got {factors!r}")
    check_method(method, view.dtype)
    return TensorStore(DownsampleDriver(view, tuple(int(f) for f in fs), method), None, view._context)


class DownsampleDriver(ArrayDriver):
    """The array behind a downsampled view: reads reduce blocks of ``base``."""

    driver = "downsample"
    metadata_key = ""

    def __init__(self, base: TensorStore, factors: tuple[int, ...], method: str) -> None:
        self.base = base
        self.factors = factors
        self.method = method
        lo, hi = [], []
        for a, n, f in zip(base.domain.inclusive_min, base.shape, factors):
            b = a + n
            if method == "stride":
                start = -(-a // f)
                stop = max(start, (b - 1) // f + 1) if n else start
            else:
                start = a // f
                stop = -(-b // f) if n else start
            lo.append(start)
            hi.append(stop)
        self._origin = tuple(lo)
        self._shape = tuple(h - lo_ for lo_, h in zip(lo, hi))

    # -- the ArrayDriver contract -----------------------------------------------------------
    @property
    def kvstore(self) -> KvStore:  # type: ignore[override]
        return self.base.kvstore

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def origin(self) -> tuple[int, ...]:
        return self._origin

    @property
    def dtype(self) -> np.dtype:
        return self.base.dtype

    @property
    def fill_value(self) -> Any:
        return self.base.fill_value

    @property
    def dimension_names(self) -> tuple[str | None, ...]:
        return self.base.labels

    @property
    def read_chunk_shape(self) -> tuple[int, ...]:
        return tuple(max(1, c // f) for c, f in zip(self.base.chunk_layout.read_chunk_shape, self.factors))

    @property
    def write_chunk_shape(self) -> tuple[int, ...]:
        return tuple(max(1, c // f) for c, f in zip(self.base.chunk_layout.write_chunk_shape, self.factors))

    @property
    def metadata(self) -> dict[str, Any]:
        return {}

    def spec(self) -> dict[str, Any]:
        return {"driver": "downsample", "base": self.base.spec(),
                "downsample_factors": list(self.factors), "downsample_method": self.method}

    def __repr__(self) -> str:
        return f"DownsampleDriver({self.spec()!r})"

    async def write(self, index: Index, value: np.ndarray) -> None:
        raise ReadOnlyError(f"a downsampled view is read-only ({self.method} of {self.base!r})")

    async def resize(self, new_shape: tuple[int, ...]) -> ArrayDriver:
        raise UnsupportedError("a downsampled view cannot be resized; resize its base")

    def with_kvstore(self, kvstore: KvStore) -> DownsampleDriver:
        base = TensorStore(self.base.driver.with_kvstore(kvstore), self.base.transform, self.base._context)
        return DownsampleDriver(base, self.factors, self.method)

    # -- reading ----------------------------------------------------------------------------
    async def read(self, index: Index, *, out: np.ndarray | None = None) -> np.ndarray:
        shape = out_shape(index)
        if out is None:
            out = new_array(shape, self.dtype, what=f"reading {shape} of a downsampled view")
        if out.size == 0:
            return out
        # output coordinates of the request; strided requests read the span they cover
        first = [o + s.start for o, s in zip(self._origin, index)]
        span = [(n - 1) * s.step + 1 for n, s in zip(shape, index)]
        whole = all(s.step == 1 for s in index)
        dest = out if whole else new_array(tuple(span), self.dtype, what=f"reading {span} of a downsampled view")
        in_row = self.dtype.itemsize * int(np.prod([f * n for f, n in zip(self.factors[1:], span[1:])]))
        rows = max(1, _SLAB_BYTES // max(1, in_row * self.factors[0]))
        for r0 in range(0, span[0], rows):
            r1 = min(span[0], r0 + rows)
            await self._read_box([first[0] + r0, *first[1:]], [r1 - r0, *span[1:]], dest[r0:r1])
        if not whole:
            out[...] = dest[tuple(slice(None, None, s.step) for s in index)]
        return out

    async def _read_box(self, first: list[int], n: list[int], dest: np.ndarray) -> None:
        """Output positions ``first[d] .. first[d] + n[d]`` into ``dest``."""
        base = self.base
        fs = self.factors
        if self.method == "stride":
            view = base.at[tuple(slice(o * f, (o + k - 1) * f + 1, f) for o, k, f in zip(first, n, fs))]
            dest[...] = await view.read()
            return
        lo, hi, heads = [], [], []
        for o, k, f, a, m in zip(first, n, fs, base.domain.inclusive_min, base.shape):
            start, stop = max(a, o * f), min(a + m, (o + k) * f)
            lo.append(start)
            hi.append(stop)
            heads.append((o + 1) * f - start)
        data = await base.at[tuple(slice(s, e) for s, e in zip(lo, hi))].read()
        if data.nbytes <= _INLINE_BYTES:
            reduce_blocks(data, fs, heads, self.method, dest)
        else:
            await run_cpu(reduce_blocks, data, fs, heads, self.method, dest)
