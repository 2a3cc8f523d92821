"""The arithmetic of downsampling, on numpy arrays (no I/O): TensorStore's rules.

Output position ``i`` along a dimension with factor ``f`` stands for the input
block ``[i*f, (i+1)*f)`` (origin 0), clipped to the input domain, so blocks at
either edge may be partial; every method reduces only the elements present:

* ``mean``: integers are summed exactly (64-bit sums, 128-bit for 64-bit
  integers, done here as two 64-bit halves) and rounded to the nearest integer,
  ties to even; floats are accumulated in their own precision (float32 for
  16-bit floats) in C order of the block, then divided by the count (complex
  numbers part by part); bool takes the mode.
* ``median``: the lower median (element ``(n - 1) // 2`` in sorted order), a
  value present in the block; bool takes the mode.
* ``mode``: the most frequent value; ties go to the lowest value (complex
  numbers ordered by real, then imaginary part).
* ``min`` / ``max``: NaN is skipped.

:func:`reduce_blocks` splits the input into at most 3 runs per dimension
(a partial first block, whole blocks, a partial last block) and reduces each
combination of runs with vectorised numpy, so every partial block is handled
exactly and nothing is padded.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from tensorstore_py.core.errors import InvalidArgumentError

__all__ = ["METHODS", "check_method", "reduce_blocks"]

METHODS = ("stride", "median", "mode", "mean", "min", "max")
_LOW = np.int64(0xFFFFFFFF)


def check_method(method: str, dtype: np.dtype) -> None:
    """InvalidArgumentError unless ``method`` can downsample ``dtype`` (as TensorStore decides)."""
    if method not in METHODS:
        raise InvalidArgumentError(f"downsample: method must be one of {list(METHODS)}, got {method!r}")
    kind = dtype.kind
    numeric = kind in "biufc" or _is_ml_float(dtype)
    ordered = numeric and kind != "c"
    ok = {"stride": True, "mode": True, "mean": numeric, "median": ordered,
          "min": ordered, "max": ordered}[method]
    if not ok:
        raise InvalidArgumentError(f"downsample: method {method!r} does not support data type {dtype}")


def _is_ml_float(dtype: np.dtype) -> bool:
    """bfloat16 / float8 types from ml_dtypes (numpy kind 'V')."""
    return dtype.kind == "V" and dtype.names is None and dtype.itemsize <= 2 and dtype.type.__module__ == "ml_dtypes"


def _runs(n: int, head: int, f: int) -> list[tuple[slice, slice, int]]:
    """(output slice, input slice, block size) runs of one dimension: ``n`` input
    elements whose first block holds ``head`` (1..f) of them."""
    runs: list[tuple[slice, slice, int]] = []
    i = o = 0
    if 0 < head < f and n:
        h = min(head, n)
        runs.append((slice(0, 1), slice(0, h), h))
        i, o = h, 1
    whole = (n - i) // f
    if whole:
        runs.append((slice(o, o + whole), slice(i, i + whole * f), f))
        i, o = i + whole * f, o + whole
    if i < n:
        runs.append((slice(o, o + 1), slice(i, n), n - i))
    return runs


def reduce_blocks(data: np.ndarray, factors: Sequence[int], heads: Sequence[int], method: str,
                  out: np.ndarray) -> None:
    """Downsample ``data`` into ``out`` (not for ``stride``).

    Along dimension ``d`` the first block holds ``heads[d]`` elements of
    ``data`` (fewer than ``factors[d]`` when the input starts inside a block)
    and the others ``factors[d]``, the last one clipped to the data.
    """
    per_dim = [_runs(n, h, f) for n, h, f in zip(data.shape, heads, factors)]
    for combo in itertools.product(*per_dim):
        out_sl = tuple(r[0] for r in combo)
        sub = data[tuple(r[1] for r in combo)]
        block = tuple(r[2] for r in combo)
        out[out_sl] = _reduce(sub, block, method, out.dtype)


def _reduce(sub: np.ndarray, block: tuple[int, ...], method: str, dtype: np.dtype) -> np.ndarray:
    """Reduce ``sub`` (whole blocks of shape ``block``) to one element per block."""
    nb = tuple(s // b for s, b in zip(sub.shape, block))
    n = int(np.prod(block, dtype=np.int64))
    if dtype.kind == "b" and method in ("mean", "median", "mode"):
        return _sum(sub, block, nb, np.int64) * 2 > n  # the mode; a tie goes to False
    if method == "mean":
        if dtype.kind in "iu":
            return _int_mean(sub, block, nb, n, dtype)
        acc = np.dtype(np.float32) if dtype.itemsize < 4 and dtype.kind != "c" else dtype
        total = _sum(sub, block, nb, acc)
        if dtype.kind == "c":  # each part divided by the real count, as TensorStore rounds it
            part = total.real.dtype.type(n)
            mean = np.empty(nb, dtype)
            mean.real, mean.imag = total.real / part, total.imag / part
            return mean
        return (total / acc.type(n)).astype(dtype)
    # gather each block's elements along a last axis
    ax = [v for pair in zip(nb, block) for v in pair]
    rank = len(nb)
    blocks = sub.reshape(ax).transpose(*range(0, 2 * rank, 2), *range(1, 2 * rank, 2)).reshape(*nb, n)
    if method == "min":
        return np.fmin.reduce(blocks, axis=-1)
    if method == "max":
        return np.fmax.reduce(blocks, axis=-1)
    if method == "median":
        k = (n - 1) // 2
        return np.partition(blocks, k, axis=-1)[..., k]
    return _mode(blocks)


def _sum(sub: np.ndarray, block: tuple[int, ...], nb: tuple[int, ...], acc: np.dtype | type) -> np.ndarray:
    """Per-block sums accumulated in ``acc``, adding the block's elements in C order
    (so float sums round exactly as TensorStore's do)."""
    total = np.zeros(nb, acc)
    for off in itertools.product(*(range(b) for b in block)):
        total += sub[tuple(slice(o, None, b) for o, b in zip(off, block))]
    return total


def _int_mean(sub: np.ndarray, block: tuple[int, ...], nb: tuple[int, ...], n: int,
              dtype: np.dtype) -> np.ndarray:
    """Exact integer means, rounded half to even (int64 arithmetic wraps harmlessly:
    the final value is in range)."""
    if dtype.itemsize < 8:
        q, r = np.divmod(_sum(sub, block, nb, np.int64), n)
    else:  # two 32-bit halves: hi * 2**32 + lo, each sum exact in int64
        x = sub.view(np.int64)
        hi = x >> 32 if dtype.kind == "i" else (x >> 32) & _LOW
        q1, r1 = np.divmod(_sum(hi, block, nb, np.int64), n)
        q2, r = np.divmod((r1 << 32) + _sum(x & _LOW, block, nb, np.int64), n)
        q = (q1 << 32) + q2
    up = (2 * r > n) | ((2 * r == n) & (q & 1 == 1))
    return (q + up).astype(dtype)


def _mode(blocks: np.ndarray) -> np.ndarray:
    """The most frequent value along the last axis; the lowest one on a tie."""
    s = np.sort(blocks, axis=-1)
    n = s.shape[-1]
    idx = np.arange(n)
    new = np.ones(s.shape, bool)
    new[..., 1:] = s[..., 1:] != s[..., :-1]
    start = np.maximum.accumulate(np.where(new, idx, 0), axis=-1)
    last = np.ones(s.shape, bool)
    last[..., :-1] = new[..., 1:]
    count = np.where(last, idx - start + 1, 0)
    best = np.argmax(count, axis=-1)  # the first (lowest) value with the highest count
    return np.take_along_axis(s, best[..., None], axis=-1)[..., 0]
