"""``cat`` (read a slice of one array) and ``copy`` (a checkpoint or array to another store).

``copy`` guarantees:

* every object is checked before it is written: commit records, index nodes
  and changes objects by their crc32c framing, every value in a data object by
  its crc32c, every chunk of a plain array by decoding it to its chunk shape;
  a copy stops at the first problem (exit 1) and names it;
* everything is written create-only, so a copy never overwrites anything at
  the destination (a non-empty destination is refused up front);
* order makes a partial copy harmless: a versioned store's data and index
  objects are written before the commit records that reference them (oldest
  first), an array's chunks before its metadata, so an interrupted copy is
  either invisible or shows a prefix of the history.
"""

from __future__ import annotations

import ast
import asyncio
import itertools
import math
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from tensorstore_py.commands import ckpt
from tensorstore_py.commands.inspect import open_array
from tensorstore_py.commands.target import Target, list_arrays, open_url, resolve, step_prefix
from tensorstore_py.core.errors import (
    ConditionFailedError,
    DataCorruptionError,
    InvalidArgumentError,
    NotFoundError,
    UnsupportedError,
)
from tensorstore_py.core.pools import run_cpu
from tensorstore_py.kvstore.base import Generation, KvStore

__all__ = ["cat", "copy", "find_leaf", "parse_index"]


# -- index expressions ---------------------------------------------------------------
def _int(node: ast.AST, text: str) -> int:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_int(node.operand, text)
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    raise InvalidArgumentError(f"--index {text!r}: expected an integer, got {ast.unparse(node)!r}")


def _item(node: ast.AST, text: str) -> Any:
    if isinstance(node, ast.Slice):
        parts = [None if p is None else _int(p, text) for p in (node.lower, node.upper, node.step)]
        return slice(*parts)
    if isinstance(node, ast.Constant) and node.value is Ellipsis:
        return Ellipsis
    if isinstance(node, ast.Constant) and node.value is None:
        return None
    return _int(node, text)


def parse_index(text: str) -> tuple[Any, ...]:
    """``"[0:10, :, 5]"`` -> ``(slice(0, 10), slice(None), 5)`` (numpy basic indexing:
    ints, slices with steps, ``...`` and ``None``; brackets optional). No code is run."""
    s = text.strip()
    if s.startswith("[") and s.endswith("]"):
        s = s[1:-1]
    if not s.strip():
        return ()
    try:
        tree = ast.parse(f"x[{s}]", mode="eval")
    except SyntaxError:
        raise InvalidArgumentError(
            f"--index {text!r} is not an index expression; example: \"[0:10, :, 5]\""
        ) from None
    sub = tree.body
    assert isinstance(sub, ast.Subscript)
    elts = sub.slice.elts if isinstance(sub.slice, ast.Tuple) else [sub.slice]
    return tuple(_item(e, text) for e in elts)


# -- cat -------------------------------------------------------------------------------
def _norm_path(p: str) -> str:
    """``"['params']['w']"`` / ``"params.w"`` / ``"params/w"`` -> ``"params/w"``."""
    out = p.replace("']['", "/").replace("][", "/").replace(".", "/")
    for ch in "[]'\"":
        out = out.replace(ch, "")
    return out.strip("/")


def find_leaf(manifest: dict[str, Any], name: str) -> dict[str, Any]:
    """The array leaf of a manifest by path (any spelling) or by key (``a/3``)."""
    leaves = ckpt.array_leaves(manifest)
    for leaf in leaves:
        if name in (leaf.get("path"), leaf.get("key")):
            return leaf
    want = _norm_path(name)
    for leaf in leaves:
        if _norm_path(str(leaf.get("path", ""))) == want:
            return leaf
    names = ", ".join(str(leaf.get("path") or leaf.get("key")) for leaf in leaves[:20])
    raise NotFoundError(f"no array {name!r} in this checkpoint step; arrays: {names}")


async def _array_store(t: Target, name: str, step: int | None) -> tuple[KvStore, Any, str]:
    """The store of the array called ``name`` in ``t``, its driver name (or its
    checkpoint manifest entry) and a display name."""
    if t.kind == "checkpoint":
        s = await ckpt.pick_step(t, step)
        leaf = find_leaf(await ckpt.read_manifest(t, s), name)
        return t.store.with_path(step_prefix(s) + str(leaf["key"])), leaf, f"step {s} {leaf.get('path')}"
    if step is not None:
        raise InvalidArgumentError(f"{t.url} is a {t.kind}, not a checkpoint: --step does not apply")
    if t.kind == "array":
        if name not in ("", ".", "/"):
            raise InvalidArgumentError(f"{t.url} is itself an array; drop ARRAY_PATH ({name!r})")
        return t.store, t.array_driver, t.url
    path = name.strip("/")
    if not path:
        raise InvalidArgumentError(f"{t.url} is a {t.kind}: give the ARRAY_PATH of one array in it")
    return t.store.with_path(path), None, path


async def cat(url: str, array: str = "", *, index: str | None = None, step: int | None = None,
              version: int | None = None) -> np.ndarray:
    """The values of ``array`` (a leaf path of a checkpoint step, or a path below
    ``url``) selected by ``index``, as a numpy array."""
    idx = parse_index(index) if index else ()
    t = await resolve(url, version=version)
    kv, how, _ = await _array_store(t, array, step)
    ts = (await ckpt.open_leaf(kv, how))[0] if isinstance(how, dict) else await open_array(kv, how)
    view = ts[idx] if idx else ts
    return await view.read()


# -- copy ----------------------------------------------------------------------------
async def _create(dst: KvStore, name: str, data: Any) -> None:
    try:
        await dst.write(name, data, if_equal=Generation.NO_VALUE)
    except ConditionFailedError:
        raise ConditionFailedError(
            f"copy: {name!r} already exists at the destination {dst!r}; copy into an empty location"
        ) from None


async def copy(src: str, dst: str, *, on_bytes: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Copy the checkpoint root, versioned store, array or folder of arrays at
    ``src`` to the empty location ``dst`` (see the module docstring)."""
    t = await resolve(src)
    out = await open_url(dst) if "://" in dst else await open_url(_mkdir(dst))
    stats = {"objects": 0, "bytes": 0}

    def count(n: int) -> None:
        stats["objects"] += 1
        stats["bytes"] += n
        if on_bytes is not None:
            on_bytes(n)

    if t.kind in ("checkpoint", "versioned"):
        if (await out.read("commits/00000000000000000001")).state == "value":
            raise ConditionFailedError(f"copy: {dst} already holds a versioned store; copy into an empty location")
        await _copy_versioned(t, out, count)
    else:
        found = [("", t.array_driver)] if t.kind == "array" else await list_arrays(t.store)
        for path, driver in found:
            await _copy_array(t.store.with_path(path) if path else t.store,
                              out.with_path(path) if path else out, driver, count)
    return {"src": src, "dst": dst, "kind": t.kind, **stats}


def _mkdir(path: str) -> str:
    os.makedirs(path, exist_ok=True)
    return path


async def _copy_versioned(t: Target, out: KvStore, count: Callable[[int], None]) -> None:
    assert t.head is not None
    await t.head.copy_to(out, on_bytes=count)


async def _copy_array(src: KvStore, dst: KvStore, driver: str | None, count: Callable[[int], None]) -> None:
    ts = await open_array(src, driver)
    drv = ts.driver
    meta_key = drv.metadata_key
    for k in (meta_key,):
        if (await dst.read(k)).state == "value":
            raise ConditionFailedError(f"copy: an array already exists at {dst!r}")
    try:
        keys = [k for k in await src.list("") if k != meta_key]
    except UnsupportedError:  # e.g. HTTP: every grid position
        grid = [math.ceil(n / c) for n, c in zip(drv.shape, drv.write_chunk_shape)]
        keys = [drv.chunk_key(c) for c in itertools.product(*(range(g) for g in grid))]
    chunk_keys = {drv.chunk_key(c) for c in _cells_for(drv, keys)}
    sem = asyncio.Semaphore(16)

    async def one(key: str) -> None:
        async with sem:
            res = await src.read(key)
            if res.state != "value":
                return
            if key in chunk_keys:
                arr = await run_cpu(drv.decode_chunk, key, res.value)
                if tuple(arr.shape) != tuple(drv.write_chunk_shape):
                    raise DataCorruptionError(
                        f"copy: chunk {key!r} decodes to shape {arr.shape}, expected {drv.write_chunk_shape}")
            await _create(dst, key, res.value)
        count(len(res.value))

    await asyncio.gather(*(one(k) for k in keys))
    res = await src.read(meta_key)
    await _create(dst, meta_key, res.value)  # last: the array appears complete or not at all
    count(len(res.value))


def _cells_for(drv: Any, keys: list[str]) -> list[tuple[int, ...]]:
    """Grid cells whose chunk key is among ``keys`` (other keys are copied as they are)."""
    wanted = set(keys)
    grid = [math.ceil(n / c) for n, c in zip(drv.shape, drv.write_chunk_shape)]
    total = math.prod(grid)
    if total > 4 * len(keys) + 1024:  # sparse: parse keys instead of walking the grid
        out = []
        for k in keys:
            parts = k.replace("c/", "", 1).replace(".", "/").split("/")
            if all(p.isdigit() for p in parts) and len(parts) == len(grid):
                cell = tuple(int(p) for p in parts)
                if drv.chunk_key(cell) == k:
                    out.append(cell)
        return out
    return [c for c in itertools.product(*(range(g) for g in grid)) if drv.chunk_key(c) in wanted]
