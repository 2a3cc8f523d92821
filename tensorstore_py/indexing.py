"""Index transforms: how a lazy view maps onto the stored (base) array.

A view is an :class:`IndexTransform`: an input :class:`IndexDomain` (one
interval and one optional label per view dimension) plus one
:class:`OutputMap` per base dimension. An output map is either a constant
(the base dimension was fixed by an integer index) or
``base_index = offset + stride * input_coordinate`` for one input dimension
(stride may be negative). Input dimensions no output map refers to are new
axes. This is TensorStore's transform model restricted to what basic indexing,
transpose and translate produce; :meth:`IndexTransform.to_json` writes
TensorStore's JSON form.

Two indexers build new transforms, both without I/O:

* :meth:`IndexTransform.index` (``view[...]``) follows numpy: integers and
  slice bounds are *positions* (0 = the first element of the view, negative
  counts from the end), slices clip, out-of-bounds integers raise
  :class:`~tensorstore_py.errors.OutOfRangeError` (an ``IndexError``).
* ``coords=True`` (``view.at[...]``) follows TensorStore: integers and slice
  bounds are *coordinates* of the domain (negative numbers are coordinates too)
  and everything outside the domain raises OutOfRangeError.

Either way a slice ``start:stop:step`` yields the dimension whose origin is the
coordinate of its first element divided by ``step`` rounded toward zero
(TensorStore's rule; for ``step == 1`` coordinates are preserved).

:meth:`IndexTransform.plan` turns a transform into one normalised strided box
per base dimension (``step >= 1``) plus the numpy view operations (flips,
dropped axes, transpose, new axes) that turn the box into the view's layout.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tensorstore_py.core.errors import (
    InvalidArgumentError,
    InvalidSpecError,
    OutOfRangeError,
    UnsupportedError,
)

__all__ = ["DimSelector", "IndexDomain", "IndexTransform", "OutputMap", "Plan"]

#: a dimension selector: a position (negative counts from the end) or a label
DimSelector = int | str


def _as_int(x: Any, what: str) -> int:
    # bool is an int subclass but as an index it means a boolean mask in numpy.
    if isinstance(x, (bool, np.bool_)):
        raise InvalidArgumentError(
            f"{what}: boolean indices (masks) are not supported; got {x!r}"
        )
    try:
        return operator.index(x)
    except TypeError:
        raise InvalidArgumentError(
            f"{what}: expected an integer, got {type(x).__name__} {x!r}"
        ) from None


def _trunc_div(a: int, b: int) -> int:
    """``a / b`` rounded toward zero, in exact integer arithmetic."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b > 0) else -q


@dataclass(frozen=True, slots=True)
class IndexDomain:
    """The box of coordinates a view is indexed by: ``[inclusive_min, exclusive_max)``."""

    inclusive_min: tuple[int, ...]
    shape: tuple[int, ...]
    labels: tuple[str | None, ...]

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def exclusive_max(self) -> tuple[int, ...]:
        return tuple(o + n for o, n in zip(self.inclusive_min, self.shape))

    @property
    def origin(self) -> tuple[int, ...]:
        return self.inclusive_min

    def __repr__(self) -> str:
        parts = []
        for o, n, lab in zip(self.inclusive_min, self.shape, self.labels):
            iv = f"[{o}, {o + n})"
            parts.append(f'"{lab}": {iv}' if lab else iv)
        return "{ " + ", ".join(parts) + " }"

    def to_json(self) -> dict[str, Any]:
        return {
            "inclusive_min": list(self.inclusive_min),
            "exclusive_max": list(self.exclusive_max),
            "labels": ["" if lab is None else lab for lab in self.labels],
        }


@dataclass(frozen=True, slots=True)
class OutputMap:
    """One base dimension: ``offset`` alone (constant) or ``offset + stride * x[input_dimension]``."""

    offset: int
    stride: int = 0
    input_dimension: int | None = None

    @property
    def is_constant(self) -> bool:
        return self.input_dimension is None

    def to_json(self) -> dict[str, int]:
        if self.input_dimension is None:
            return {"offset": self.offset}
        return {"offset": self.offset, "stride": self.stride, "input_dimension": self.input_dimension}


@dataclass(frozen=True, slots=True)
class Plan:
    """How one view is read from / written to the base array.

    ``index`` is the normalised box per base dimension (``step >= 1``), as
    :class:`~tensorstore_py.drivers.base.ArrayDriver` takes it. ``box_shape``
    is its shape. From a box array the view is
    ``box[box_key].transpose(perm)`` followed by inserting ``new_axes``
    (positions in the view) and broadcasting to ``shape``. ``identity`` means
    the box *is* the view (no copy, no view ops).
    """

    index: tuple[slice, ...]
    box_shape: tuple[int, ...]
    box_key: tuple[slice | int, ...]
    perm: tuple[int, ...]
    new_axes: tuple[int, ...]
    shape: tuple[int, ...]
    empty: bool
    identity: bool

    def to_view(self, box: np.ndarray) -> np.ndarray:
        """The view's array from the box array (a numpy view where possible)."""
        if self.identity:
            return box
        arr = box[self.box_key + (Ellipsis,)]  # the Ellipsis keeps a 0-d result an array view
        if self.perm != tuple(range(len(self.perm))):
            arr = arr.transpose(self.perm)
        if self.new_axes:
            arr = np.expand_dims(arr, self.new_axes)
            if arr.shape != self.shape:  # new axes wider than 1 (from a JSON transform)
                arr = np.broadcast_to(arr, self.shape).copy()
        return arr

    def to_box(self, value: np.ndarray) -> np.ndarray:
        """The inverse of :meth:`to_view`: ``value`` (view shape) laid out as the box."""
        if self.identity:
            return value
        arr = value
        if self.new_axes:
            arr = arr[tuple(0 if d in self.new_axes else slice(None) for d in range(arr.ndim))]
        if self.perm != tuple(range(len(self.perm))):
            arr = arr.transpose(np.argsort(self.perm))
        # Re-insert the axes fixed by integers, then undo flips (a flip is its own inverse).
        fixed = tuple(i for i, k in enumerate(self.box_key) if isinstance(k, int))
        if fixed:
            arr = np.expand_dims(arr, fixed)
        flips = tuple(slice(None, None, -1) if k == slice(None, None, -1) else slice(None)
                      for k in self.box_key)
        if any(f.step == -1 for f in flips):
            arr = arr[flips]
        return arr


@dataclass(frozen=True, slots=True)
class IndexTransform:
    """A view's domain and its map onto the base array (see the module docstring)."""

    domain: IndexDomain
    output: tuple[OutputMap, ...]

    # -- construction ---------------------------------------------------------
    @staticmethod
    def identity(shape: Sequence[int], labels: Sequence[str | None] | None = None) -> IndexTransform:
        n = len(shape)
        labs = tuple(labels) if labels is not None else (None,) * n
        return IndexTransform(
            IndexDomain((0,) * n, tuple(int(s) for s in shape), labs),
            tuple(OutputMap(0, 1, d) for d in range(n)),
        )

    @property
    def rank(self) -> int:
        return self.domain.rank

    @property
    def base_rank(self) -> int:
        return len(self.output)

    def is_identity(self) -> bool:
        """True when the view is the whole base array, unpermuted and untranslated."""
        return self.domain.inclusive_min == (0,) * self.rank and self.rank == self.base_rank and all(
            m.input_dimension == d and m.stride == 1 and m.offset == 0
            for d, m in enumerate(self.output)
        )

    # -- dimension selection ----------------------------------------------------
    def resolve_dims(self, selectors: Sequence[DimSelector]) -> list[int]:
        """Positions of the selected dimensions (labels or positions, no duplicates)."""
        out: list[int] = []
        for s in selectors:
            if isinstance(s, str):
                try:
                    d = self.domain.labels.index(s)
                except ValueError:
                    raise InvalidArgumentError(
                        f"no dimension labelled {s!r}; labels are {list(self.domain.labels)}"
                    ) from None
            else:
                d = _as_int(s, "dimension selector")
                if not -self.rank <= d < self.rank:
                    raise OutOfRangeError(f"dimension {d} is out of range for rank {self.rank}")
                d %= self.rank
            if d in out:
                raise InvalidArgumentError(f"dimension {s!r} selected twice")
            out.append(d)
        return out

    # -- indexing ---------------------------------------------------------------
    def index(self, key: Any, *, coords: bool = False, dims: Sequence[int] | None = None) -> IndexTransform:
        """The transform of ``view[key]`` (``coords=True``: of ``view.at[key]``).

        ``dims`` restricts ``key`` to those dimensions, in that order (``view.dims[...]``);
        ``None`` and ``Ellipsis`` are then not allowed.
        """
        items = key if isinstance(key, tuple) else (key,)
        for k in items:
            if type(k) in _BASIC:
                continue
            if isinstance(k, (list, np.ndarray)) or (
                hasattr(k, "__array__") and not isinstance(k, (int, np.integer))
            ):
                raise InvalidArgumentError(
                    "advanced (array) indexing is not supported on a lazy view; use basic "
                    "indexing (integers, slices, ..., None) or read() and index the numpy array"
                )
        if dims is not None:
            if any(k is None or k is Ellipsis for k in items):
                raise InvalidArgumentError("None and ... are not allowed when indexing selected dims")
            if len(items) > len(dims):
                raise OutOfRangeError(
                    f"too many indices: {len(items)} for {len(dims)} selected dimension(s)"
                )
            full: list[Any] = [slice(None)] * self.rank
            for d, k in zip(dims, items):
                full[d] = k
            items = tuple(full)
        n_ell = sum(1 for k in items if k is Ellipsis)
        if n_ell > 1:
            raise InvalidArgumentError("an index can only have a single ellipsis ('...')")
        n_real = sum(1 for k in items if k is not None and k is not Ellipsis)
        if n_real > self.rank:
            raise OutOfRangeError(
                f"too many indices: {n_real} for a view of rank {self.rank} (domain {self.domain})"
            )
        if n_ell == 0:
            items = items + (Ellipsis,)
        expanded: list[Any] = []
        for k in items:
            if k is Ellipsis:
                expanded.extend([slice(None)] * (self.rank - n_real))
            else:
                expanded.append(k)

        dom = self.domain
        # Per new input dim: (source input dim or None for a new axis, origin, size,
        # old-coordinate of element 0, step); plus source dims fixed to a coordinate.
        new_dims: list[tuple[int | None, int, int, int, int, str | None]] = []
        fixed: dict[int, int] = {}
        d = 0
        for k in expanded:
            if k is None:
                new_dims.append((None, 0, 1, 0, 1, None))
                continue
            o, n, lab = dom.inclusive_min[d], dom.shape[d], dom.labels[d]
            if isinstance(k, slice):
                c0, step, count = _slice(k, o, n, coords, d, dom)
                origin = c0 if step == 1 else _trunc_div(c0, step)
                new_dims.append((d, origin, count, c0, step, lab))
            else:
                i = _as_int(k, f"index for dimension {d}")
                c = i if coords else (i + n if i < 0 else i) + o
                if not o <= c < o + n:
                    where = "coordinate" if coords else "index"
                    raise OutOfRangeError(
                        f"{where} {i} is out of bounds for dimension {d} with domain "
                        f"[{o}, {o + n}) (view domain {dom})"
                    )
                fixed[d] = c
            d += 1

        src_to_new = {src: j for j, (src, *_r) in enumerate(new_dims) if src is not None}
        outputs: list[OutputMap] = []
        for m in self.output:
            src = m.input_dimension
            if src is None:
                outputs.append(m)
            elif src in fixed:
                outputs.append(OutputMap(m.offset + m.stride * fixed[src]))
            else:
                j = src_to_new[src]
                _s, origin, _n, c0, step, _l = new_dims[j]
                # old coord = c0 + (x - origin) * step
                outputs.append(
                    OutputMap(m.offset + m.stride * (c0 - origin * step), m.stride * step, j)
                )
        domain = IndexDomain(
            tuple(nd[1] for nd in new_dims),
            tuple(nd[2] for nd in new_dims),
            tuple(nd[5] for nd in new_dims),
        )
        return IndexTransform(domain, tuple(outputs))

    # -- dimension operations -------------------------------------------------
    def translate_by(self, offsets: Mapping[int, int]) -> IndexTransform:
        """Shift the coordinates of dims ``d`` by ``offsets[d]`` (same elements)."""
        mins = list(self.domain.inclusive_min)
        for d, k in offsets.items():
            mins[d] += k
        outputs = tuple(
            m if m.input_dimension is None or m.input_dimension not in offsets
            else OutputMap(m.offset - m.stride * offsets[m.input_dimension], m.stride, m.input_dimension)
            for m in self.output
        )
        return IndexTransform(
            IndexDomain(tuple(mins), self.domain.shape, self.domain.labels), outputs
        )

    def transpose(self, order: Sequence[int]) -> IndexTransform:
        """Reorder the view's dims: new dim ``i`` is old dim ``order[i]``."""
        if sorted(order) != list(range(self.rank)):
            raise InvalidArgumentError(
                f"transpose order {list(order)} is not a permutation of 0..{self.rank - 1}"
            )
        inv = {old: new for new, old in enumerate(order)}
        dom = self.domain
        domain = IndexDomain(
            tuple(dom.inclusive_min[o] for o in order),
            tuple(dom.shape[o] for o in order),
            tuple(dom.labels[o] for o in order),
        )
        outputs = tuple(
            m if m.input_dimension is None
            else OutputMap(m.offset, m.stride, inv[m.input_dimension])
            for m in self.output
        )
        return IndexTransform(domain, outputs)

    def with_labels(self, labels: Mapping[int, str | None]) -> IndexTransform:
        """Relabel dims; labels must stay unique (None = unlabelled)."""
        labs = list(self.domain.labels)
        for d, lab in labels.items():
            if lab is not None and not isinstance(lab, str):
                raise InvalidArgumentError(f"a label must be a str or None, got {lab!r}")
            labs[d] = lab or None
        named = [lab for lab in labs if lab is not None]
        if len(named) != len(set(named)):
            raise InvalidArgumentError(f"dimension labels must be unique, got {labs}")
        return IndexTransform(
            IndexDomain(self.domain.inclusive_min, self.domain.shape, tuple(labs)), self.output
        )

    # -- I/O plan -------------------------------------------------------------
    def plan(self, base_shape: Sequence[int]) -> Plan:
        """The box to read/write and the numpy ops between box and view.

        Raises OutOfRangeError if the view reaches outside ``base_shape`` (a view
        taken before the array was shrunk by ``resize``).
        """
        return _plan(self, tuple(base_shape))

    # -- JSON -----------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """TensorStore's index transform JSON."""
        d: dict[str, Any] = {
            "input_inclusive_min": list(self.domain.inclusive_min),
            "input_exclusive_max": list(self.domain.exclusive_max),
        }
        if any(self.domain.labels):
            d["input_labels"] = ["" if lab is None else lab for lab in self.domain.labels]
        d["output"] = [m.to_json() for m in self.output]
        return d

    @staticmethod
    def from_json(j: Mapping[str, Any], base_rank: int) -> IndexTransform:
        """Parse TensorStore's transform JSON (single-dimension and constant maps only)."""
        try:
            lo = [int(x) for x in j["input_inclusive_min"]]
            if "input_exclusive_max" in j:
                shape = [int(h) - lo_ for h, lo_ in zip(j["input_exclusive_max"], lo, strict=True)]
            else:
                shape = [int(s) for s in j["input_shape"]]
            labels = [lab or None for lab in j.get("input_labels", [""] * len(lo))]
            out_j = j.get("output")
            if out_j is None:
                out_j = [{"offset": 0, "stride": 1, "input_dimension": d} for d in range(len(lo))]
            outputs = []
            for m in out_j:
                if "index_array" in m:
                    raise UnsupportedError("transform: index_array output maps are not supported")
                if "input_dimension" in m:
                    outputs.append(OutputMap(int(m.get("offset", 0)), int(m.get("stride", 1)),
                                             int(m["input_dimension"])))
                else:
                    outputs.append(OutputMap(int(m.get("offset", 0))))
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidSpecError(f"malformed transform {dict(j)!r}: {e}") from None
        if len(shape) != len(lo) or len(labels) != len(lo) or any(s < 0 for s in shape):
            raise InvalidSpecError(f"malformed transform domain in {dict(j)!r}")
        if len(outputs) != base_rank:
            raise InvalidSpecError(
                f"transform has {len(outputs)} output dims, the array has rank {base_rank}"
            )
        used = [m.input_dimension for m in outputs if m.input_dimension is not None]
        if len(used) != len(set(used)) or any(not 0 <= u < len(lo) for u in used):
            raise UnsupportedError(
                "transform: each input dimension may drive at most one output dimension"
            )
        if any(m.input_dimension is not None and m.stride == 0 for m in outputs):
            raise UnsupportedError("transform: stride 0 output maps are not supported")
        return IndexTransform(IndexDomain(tuple(lo), tuple(shape), tuple(labels)), tuple(outputs))


_BASIC = frozenset({int, slice, type(None), type(Ellipsis)})


def _slice(k: slice, o: int, n: int, coords: bool, d: int, dom: IndexDomain) -> tuple[int, int, int]:
    """(coordinate of the first element, step, element count) of slice ``k`` on one dim."""
    if not coords:
        try:  # fast path; errors are re-diagnosed below with a clear message
            start_p, stop_p, step = k.indices(n)
        except (TypeError, ValueError):
            pass
        else:
            if not isinstance(k.start, bool) and not isinstance(k.stop, bool):
                m = len(range(start_p, stop_p, step))
                return o + start_p, step, m
    step = 1 if k.step is None else _as_int(k.step, f"slice step for dimension {d}")
    if step == 0:
        raise InvalidArgumentError(f"slice step cannot be zero (dimension {d})")
    if not coords:
        start_p, stop_p, step = slice(
            None if k.start is None else _as_int(k.start, f"slice start for dimension {d}"),
            None if k.stop is None else _as_int(k.stop, f"slice stop for dimension {d}"),
            step,
        ).indices(n)
        m = len(range(start_p, stop_p, step))
        return o + start_p, step, m
    # Coordinates: no wrap-around, no clipping (TensorStore semantics).
    hi = o + n
    if step > 0:
        start = o if k.start is None else _as_int(k.start, f"slice start for dimension {d}")
        stop = hi if k.stop is None else _as_int(k.stop, f"slice stop for dimension {d}")
        ok = o <= start <= hi and o <= stop <= hi
    else:
        start = hi - 1 if k.start is None else _as_int(k.start, f"slice start for dimension {d}")
        stop = o - 1 if k.stop is None else _as_int(k.stop, f"slice stop for dimension {d}")
        ok = o - 1 <= start < hi and o - 1 <= stop < hi
    if not ok:
        raise OutOfRangeError(
            f"slice {start}:{stop}:{step} is outside dimension {d} with domain [{o}, {hi}) "
            f"(view domain {dom}); .at[] uses coordinates and does not clip"
        )
    m = len(range(start, stop, step))
    return start, step, m


def _plan(t: IndexTransform, base_shape: tuple[int, ...]) -> Plan:
    dom = t.domain
    shape = dom.shape
    empty = 0 in shape
    index: list[slice] = []
    box_key: list[slice | int] = []
    axis_dims: list[int] = []  # input dim of each kept box axis, in base order
    flip = slice(None, None, -1)
    for b, m in enumerate(t.output):
        if m.input_dimension is None:
            p = m.offset
            if not empty and not 0 <= p < base_shape[b]:
                raise OutOfRangeError(
                    f"view fixes base dimension {b} at {p}, outside the array shape {base_shape} "
                    "(was the array resized?)"
                )
            index.append(slice(p, p + 1, 1))
            box_key.append(0)
            continue
        d = m.input_dimension
        o, n = dom.inclusive_min[d], shape[d]
        first = m.offset + m.stride * o
        last = first + m.stride * (n - 1)
        lo, hi = (first, last) if m.stride > 0 else (last, first)
        if n and not empty and not (0 <= lo and hi < base_shape[b]):
            raise OutOfRangeError(
                f"view reaches [{lo}, {hi}] on base dimension {b}, outside the array shape "
                f"{base_shape} (was the array resized?)"
            )
        step = abs(m.stride)
        index.append(slice(lo, hi + 1, step) if n else slice(0, 0, 1))
        box_key.append(slice(None) if m.stride > 0 else flip)
        axis_dims.append(d)
    if empty:
        index = [slice(0, 0, 1)] * len(t.output)
    box_shape = tuple(len(range(s.start, s.stop, s.step)) for s in index)
    perm = tuple(sorted(range(len(axis_dims)), key=axis_dims.__getitem__))
    new_axes = tuple(sorted(set(range(dom.rank)) - set(axis_dims)))
    identity = (
        not new_axes
        and all(k == slice(None) for k in box_key)
        and perm == tuple(range(len(perm)))
    )
    return Plan(tuple(index), box_shape, tuple(box_key), perm, new_axes, shape, empty, identity)
