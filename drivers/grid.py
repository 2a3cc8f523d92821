"""Regular chunk grids: which chunks a strided region touches, and where.

``index`` tuples are normalised (one ``slice`` per dimension with
``0 <= start <= stop`` and ``step >= 1``); see :mod:`tensorstore_py.drivers.base`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["ChunkPart", "DimPart", "chunk_parts", "default_chunks", "dim_parts", "out_shape"]


@dataclass(frozen=True, slots=True)
class DimPart:
    """Along one dimension: chunk ``cell`` supplies ``chunk`` -> ``out``."""

    cell: int
    chunk: slice  # positions inside the chunk (start, stop, step)
    out: slice  # positions in the request's output (step 1)
    full: bool  # the chunk slice covers the whole chunk (within ``extent``)


class ChunkPart(NamedTuple):
    """One chunk's share of a request (a named tuple: a request of many small
    chunks makes one per chunk, and a tuple is built 7x faster than a frozen
    dataclass)."""

    cell: tuple[int, ...]
    chunk: tuple[slice, ...]
    out: tuple[slice, ...]
    full: bool  # covers every in-bounds element of the chunk


def default_chunks(shape: Sequence[int], itemsize: int, *, target_bytes: int = 2 << 20) -> tuple[int, ...]:
    """A chunk shape of about ``target_bytes`` (1-4 MiB), halving the largest
    dimension first so chunks stay close to cubes."""
    chunks = [max(1, int(s)) for s in shape]
    while math.prod(chunks) * itemsize > 2 * target_bytes:
        d = max(range(len(chunks)), key=lambda i: chunks[i])
        if chunks[d] == 1:
            break
        chunks[d] = -(-chunks[d] // 2)
    return tuple(chunks)


def out_shape(index: tuple[slice, ...]) -> tuple[int, ...]:
    return tuple(len(range(s.start, s.stop, s.step)) for s in index)


def dim_parts(s: slice, c: int, extent: int) -> list[DimPart]:
    """Split one normalised slice over chunks of size ``c`` (array ``extent``)."""
    start, stop, step = s.start, s.stop, s.step
    n = len(range(start, stop, step))
    if n == 0:
        return []
    parts: list[DimPart] = []
    last = start + (n - 1) * step
    if step >= c:  # every element lies in its own chunk
        for k in range(n):
            x = start + k * step
            cell, off = divmod(x, c)
            in_bounds = min(c, extent - cell * c)
            parts.append(DimPart(cell, slice(off, off + 1, 1), slice(k, k + 1, 1), in_bounds == 1))
        return parts
    for cell in range(start // c, last // c + 1):
        lo = cell * c
        k0 = max(0, -(-(lo - start) // step))
        k1 = min(n, -(-(lo + c - start) // step))
        if k0 >= k1:
            continue
        a = start + k0 * step - lo
        b = start + (k1 - 1) * step - lo + 1
        in_bounds = min(c, extent - lo)
        full = step == 1 and a == 0 and b >= in_bounds
        parts.append(DimPart(cell, slice(a, b, step), slice(k0, k1, 1), full))
    return parts


def chunk_parts(
    index: tuple[slice, ...], chunk_shape: tuple[int, ...], shape: tuple[int, ...]
) -> Iterator[ChunkPart]:
    """Every chunk the request touches, in C order of the chunk grid."""
    per_dim = [dim_parts(s, c, e) for s, c, e in zip(index, chunk_shape, shape)]
    if not per_dim:  # a 0-d array: one chunk
        yield ChunkPart((), (), (), True)
        return
    # one itertools.product per field, walked in lockstep: the tuples are built
    # in C (small chunks make this a hot loop)
    prod = itertools.product
    fields = zip(
        prod(*[[p.cell for p in d] for d in per_dim]),
        prod(*[[p.chunk for p in d] for d in per_dim]),
        prod(*[[p.out for p in d] for d in per_dim]),
        prod(*[[p.full for p in d] for d in per_dim]),
    )
    new = tuple.__new__  # ChunkPart(...) without its Python-level __new__
    for cell, chunk, out, full in fields:
        yield new(ChunkPart, (cell, chunk, out, False not in full))


def count_chunks(index: tuple[slice, ...], chunk_shape: tuple[int, ...], shape: tuple[int, ...]) -> int:
    total = 1
    for s, c, e in zip(index, chunk_shape, shape):
        total *= len(dim_parts(s, c, e))
    return total
