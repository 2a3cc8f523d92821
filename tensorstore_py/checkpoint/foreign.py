"""Restoring from a checkpoint written by another tool (Orbax, safetensors) into a target.

A source describes its arrays as :class:`ForeignLeaf` (name, shape, dtype) and reads
regions of them; :func:`restore_foreign` matches the target's leaves to them, checks
shapes and dtypes for every leaf before anything is read, asks the source for only
the regions this process's devices need (one read per distinct region) and places the
blocks like a native restore (``jax.Array`` with the target's sharding, numpy
otherwise).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tensorstore_py.checkpoint.jax_adapter import assemble_all, is_sharded_target, target_regions
from tensorstore_py.checkpoint.layout import Region
from tensorstore_py.checkpoint.pytree import flatten_target
from tensorstore_py.core.errors import InvalidArgumentError, NotFoundError
from tensorstore_py.core.gcpause import gc_paused

__all__ = ["ForeignLeaf", "ReadRegions", "dotted_name", "restore_foreign"]


@dataclass(frozen=True)
class ForeignLeaf:
    """One array of a foreign checkpoint: its name there, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype


#: reads ``[(leaf index, region)]`` and returns one C-order array per request
ReadRegions = Callable[[list[tuple[int, Region]]], list[np.ndarray]]

_SEG = re.compile(r"\[((?:'(?:[^'\\]|\\.)*')|(?:\"(?:[^\"\\]|\\.)*\")|[^\]]*)\]|\.([A-Za-z_][A-Za-z0-9_]*)")


def dotted_name(path: str) -> str:
    """A target leaf's path (``"['params']['w'][0]"``) as a dotted name (``"params.w.0"``),
    the way Orbax names its arrays and Hugging Face names tensors."""
    parts: list[str] = []
    pos = 0
    while pos < len(path):
        m = _SEG.match(path, pos)
        if m is None:
            return path
        if m.group(2) is not None:
            parts.append(m.group(2))
        else:
            text = m.group(1)
            try:
                parts.append(str(ast.literal_eval(text)))
            except (ValueError, SyntaxError):
                parts.append(text)
        pos = m.end()
    return ".".join(parts)


def _full(shape: tuple[int, ...]) -> Region:
    return tuple((0, n) for n in shape)


@gc_paused()
def restore_foreign(
    source: str,
    leaves: Sequence[ForeignLeaf],
    read: ReadRegions,
    target: Any,
    *,
    lookup: Callable[[str], int | None],
    build: Callable[[list[np.ndarray]], Any],
    cast: bool = False,
) -> Any:
    """Restore ``leaves`` of ``source`` (named in errors) into ``target``.

    ``lookup(path)`` maps a target leaf's path to a leaf index (None: not there);
    ``build(arrays)`` makes the result when ``target`` is None from every leaf read
    whole. Raises NotFoundError for a target leaf the source lacks and
    InvalidArgumentError for a shape or dtype mismatch (dtypes convert only with
    ``cast=True``), both before anything is read. Runs with the garbage
    collector paused (core/gcpause.py: a few objects per leaf, thousands of leaves).
    """
    if target is None:
        return build(read([(i, _full(leaf.shape)) for i, leaf in enumerate(leaves)]))
    pairs, rebuild = flatten_target(target)
    requests: list[tuple[int, Region]] = []
    plans: list[tuple[str, Any]] = []
    cache: dict[Any, Any] = {}
    for path, t in pairs:
        i = lookup(path)
        if i is None:
            names = sorted(leaf.name for leaf in leaves)
            raise NotFoundError(
                f"{source}: no array for the target leaf {path or '<root>'} "
                f"(looked for {dotted_name(path)!r}); it has: {names[:10]}{' ...' if len(names) > 10 else ''}"
            )
        leaf = leaves[i]
        tshape = getattr(t, "shape", None)
        if tshape is not None and tuple(tshape) != leaf.shape:
            raise InvalidArgumentError(
                f"{source}: array {leaf.name!r} has shape {leaf.shape}, the target leaf {path} "
                f"expects {tuple(tshape)}"
            )
        tdtype = np.dtype(t.dtype) if hasattr(t, "dtype") else leaf.dtype
        if not cast and tdtype != leaf.dtype:
            raise InvalidArgumentError(
                f"{source}: array {leaf.name!r} is stored as {leaf.dtype}, the target leaf {path} "
                f"asks for {tdtype}; pass cast=True to convert it (numpy astype)"
            )
        if is_sharded_target(t):
            sharding, dev_regions = target_regions(t, cache)
            uniq: dict[Region, int] = {}
            for _d, reg in dev_regions:
                if reg not in uniq:  # several local devices holding one block: one read
                    uniq[reg] = len(requests)
                    requests.append((i, reg))
            plans.append(("jax", (t, sharding, [(d, uniq[reg]) for d, reg in dev_regions], tdtype)))
        else:
            plans.append(("numpy", (len(requests), tdtype, t)))
            requests.append((i, _full(leaf.shape)))
    arrays = read(requests)
    values: list[Any] = []
    to_place: list[tuple[int, Any, Any, list[tuple[Any, np.ndarray]]]] = []
    for kind, p in plans:
        if kind == "numpy":
            k, tdtype, t = p
            a = _as(arrays[k], tdtype)
            if isinstance(t, (bool, int, float, complex)):
                values.append(type(t)(a[()]))
            elif isinstance(t, np.generic):
                values.append(a[()])
            else:
                values.append(a)
        else:
            t, sharding, devs, tdtype = p
            converted: dict[int, np.ndarray] = {}
            for _d, k in devs:
                if k not in converted:
                    converted[k] = _as(arrays[k], tdtype)
            to_place.append((len(values), t, sharding, [(d, converted[k]) for d, k in devs]))
            values.append(None)
    if to_place:
        placed = assemble_all([(t, s, blocks) for _, t, s, blocks in to_place])
        for (slot, *_), arr in zip(to_place, placed):
            values[slot] = arr
    return rebuild(values)


def _as(a: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if not a.dtype.isnative:
        a = a.astype(a.dtype.newbyteorder("="))
    if a.dtype != dtype:
        a = a.astype(dtype)
    return a if a.flags.writeable else a.copy()
