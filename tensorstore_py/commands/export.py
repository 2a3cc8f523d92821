"""``cat`` (read a slice of one array), ``copy`` (a checkpoint or array to another
store) and ``export`` (a checkpoint step as plain zarr v3 arrays).

``copy`` guarantees:

* every object is checked before it is written: commit records, index nodes
  and changes objects by their crc32c framing, every value in a data object by
  its crc32c, every chunk of a plain array by decoding it to its chunk shape;
  a copy stops at the first problem (exit 1) and names it;
* everything is written create-only, so a copy never overwrites anything at
  the destination: a destination holding keys the source does not have, a
  finished copy (the source's newest commit record, an array's metadata) or
  another versioned store is refused up front;
* order makes a partial copy harmless: a versioned store's data and index
  objects are written before the commit records that reference them (oldest
  first), an array's chunks before its metadata, so an interrupted copy is
  either invisible or shows a prefix of the history;
* running the same command again resumes an interrupted copy: objects already
  at the destination are compared byte for byte and kept (different bytes stop
  the copy with exit 1).

``export`` guarantees:

* DEST becomes a plain zarr v3 hierarchy that zarr-python and TensorStore read
  with no tensorstore_py: one array per array leaf of the step, at the leaf's
  path (``['params']['w']`` -> ``params/w``; ``[0]`` -> ``0``; ``.kernel`` ->
  ``kernel``), a group at every folder above, and the root group's attributes
  ``tensorstore_py`` = ``{"checkpoint_step", "leaves": {array path: leaf path},
  "scalars": {leaf path: value}}`` (Python scalar leaves have no array);
* the stored bytes of every chunk and ``zarr.json`` are copied, never
  re-encoded (a checkpoint leaf already is a zarr v3 array; a small leaf's
  ``zarr.json``, which the checkpoint does not store, is written from its
  manifest entry); every value is read through its crc32c and each chunk's size
  is checked against the chunk grid;
* every object is written create-only, chunks before their array's
  ``zarr.json``, the root group's ``zarr.json`` last (the mark of a finished
  export). So an interrupted export is resumed by running the same command
  again: objects already there are compared byte for byte and kept. A DEST
  holding anything this export would not write, or different bytes under a
  name it writes, is refused before (respectively when) anything is written.
"""

from __future__ import annotations

import ast
import asyncio
import itertools
import json
import math
import os
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from tensorstore_py.checkpoint.layout import zarr3_metadata
from tensorstore_py.checkpoint.leaves import packed_chunk, read_pack_leaves
from tensorstore_py.checkpoint.packing import PACK_BYTES
from tensorstore_py.commands import ckpt
from tensorstore_py.commands.inspect import open_array
from tensorstore_py.commands.target import Target, key_sizes, list_arrays, open_url, resolve, step_prefix
from tensorstore_py.core.budget import DEFAULT_BYTES_IN_FLIGHT, ByteBudget, run_bounded
from tensorstore_py.core.errors import (
    ConditionFailedError,
    DataCorruptionError,
    InvalidArgumentError,
    NotFoundError,
    UnsupportedError,
)
from tensorstore_py.core.pools import run_cpu
from tensorstore_py.drivers.dtypes import dtype_from_v3
from tensorstore_py.kvstore.base import KvStore
from tensorstore_py.kvstore.registry import require_conditional_writes
from tensorstore_py.kvstore.versioned.create import create_object
from tensorstore_py.kvstore.versioned.format import commit_name
from tensorstore_py.kvstore.versioned.replicate import create_copy
from tensorstore_py.progress import Progress

__all__ = ["array_path", "cat", "copy", "export_step", "find_leaf", "parse_index"]


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
async def copy(src: str, dst: str, *, progress: Progress | None = None) -> dict[str, Any]:
    """Copy the checkpoint root, versioned store, array or folder of arrays at
    ``src`` to ``dst``: an empty location, or an interrupted copy of ``src`` to
    resume (see the module docstring). ``progress`` counts the bytes written."""
    t = await resolve(src)
    out = await _open_dest(dst, "copy")
    if t.kind in ("checkpoint", "versioned"):
        await _refuse_finished(t, out, dst)
    sizes = await _source_sizes(t)
    await _refuse_foreign(out, sizes, dst, versioned=t.head is not None)
    if progress is not None and sizes is not None:
        progress.add_total(sum(sizes.values()))
    stats = {"objects": 0, "bytes": 0}

    def count(n: int) -> None:
        stats["objects"] += 1
        stats["bytes"] += n
        if progress is not None:
            progress.advance(n)

    if t.kind in ("checkpoint", "versioned"):
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


async def _open_dest(dest: str, what: str) -> KvStore:
    """The store at ``dest`` (a URL, or a local folder made if missing), refused
    before anything moves when it can not do create-only writes."""
    out = await open_url(dest) if "://" in dest else await open_url(_mkdir(dest))
    require_conditional_writes(out, f"{what} to {dest}")
    return out


async def _source_sizes(t: Target) -> dict[str, int] | None:
    """Key -> size of everything a copy of ``t`` may write (None: the store can
    not tell: it does not list, or lists no sizes)."""
    if t.head is None:
        return await key_sizes(t, "")
    try:
        found = await asyncio.gather(*(t.base.list_info(p) for p in _VERSIONED_PREFIXES))
    except UnsupportedError:
        return None
    infos = [i for part in found for i in part]
    if any(i.size is None for i in infos):
        return None
    return {i.key: int(i.size or 0) for i in infos}


#: where a versioned store keeps what a copy writes (and the 'latest' hint)
_VERSIONED_PREFIXES = ("commits/", "nodes/", "data/", "changes/")
#: what a reader or writer of a versioned store adds besides (leases, clock
#: probes, multi-writer records): not foreign at a copy's destination
_HOUSEKEEPING = ("latest", "leases/", "gc/", "txns/")


async def _refuse_foreign(out: KvStore, sizes: dict[str, int] | None, dst: str, *,
                          versioned: bool) -> None:
    """ConditionFailedError, before anything is written, when ``dst`` holds a key
    the source does not (so it is neither empty nor an interrupted copy of it)."""
    if sizes is None:
        return  # the source can not list: each object is compared as it is written
    try:
        there = await out.list("")
    except UnsupportedError:
        return
    foreign = sorted(k for k in there if k not in sizes
                     and not (versioned and k.startswith(_HOUSEKEEPING)))
    if foreign:
        raise ConditionFailedError(
            f"copy: {dst} holds {len(foreign)} key(s) the source does not have (e.g. "
            f"{foreign[0]!r}); copy into an empty location (or rerun an interrupted copy of "
            f"the same source to resume it)")


async def _refuse_finished(t: Target, out: KvStore, dst: str) -> None:
    """ConditionFailedError when ``dst`` already holds the source's newest version
    (a finished copy) or another versioned store."""
    assert t.head is not None
    newest = await t.head.newest_version()
    if not newest:
        return
    first = await out.read(commit_name(1))
    if first.state != "value":
        return  # empty, or an interrupted copy that wrote no commit record yet
    mine = await t.base.read(commit_name(1))
    if mine.state != "value" or bytes(mine.value) != bytes(first.value):
        raise ConditionFailedError(
            f"copy: {dst} already holds another versioned store; copy into an empty location")
    if (await out.read(commit_name(newest))).state == "value":
        raise ConditionFailedError(
            f"copy: {dst} already holds a finished copy (version {newest}, the source's newest); "
            f"copy into an empty location")


async def _copy_versioned(t: Target, out: KvStore, count: Callable[[int], None]) -> None:
    assert t.head is not None
    await t.head.copy_to(out, on_bytes=count)


async def _copy_array(src: KvStore, dst: KvStore, driver: str | None, count: Callable[[int], None]) -> None:
    ts = await open_array(src, driver)
    drv = ts.driver
    meta_key = drv.metadata_key
    if (await dst.read(meta_key)).state == "value":  # written last: a finished copy
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
            await create_copy(dst, key, res.value)
        count(len(res.value))

    await asyncio.gather(*(one(k) for k in keys))
    res = await src.read(meta_key)
    await create_copy(dst, meta_key, res.value)  # last: the array appears complete or not at all
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


# -- export ------------------------------------------------------------------------------
_SEGMENT = re.compile(r"""\[('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|[^\]]*)\]|\.([^.\[]+)""")
_GROUP = json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}).encode()


def _name(seg: str) -> str:
    """One path segment as a zarr node name: '%' and '/' escaped, never empty, '.' or '..'."""
    seg = seg.replace("%", "%25").replace("/", "%2F")
    return seg.replace(".", "%2E") if seg in ("", ".", "..") else seg


def array_path(leaf_path: str) -> str:
    """The zarr path of a checkpoint leaf: ``['params']['w']`` -> ``params/w``,
    ``[0].kernel`` -> ``0/kernel`` ("" for a tree that is one leaf)."""
    segs: list[str] = []
    pos = 0
    for m in _SEGMENT.finditer(leaf_path):
        if m.start() != pos:
            break
        inner, attr = m.group(1), m.group(2)
        if attr is not None:
            segs.append(attr)
        elif inner[:1] in ("'", '"'):
            segs.append(str(ast.literal_eval(inner)))
        else:
            segs.append(inner)
        pos = m.end()
    if pos != len(leaf_path):  # not a path this library writes: keep it as one name
        return _name(leaf_path)
    return "/".join(_name(s) for s in segs)


def _plan_paths(leaves: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Array path -> leaf, refusing two leaves on one path or an array inside another."""
    out: dict[str, dict[str, Any]] = {}
    for leaf in leaves:
        path = array_path(str(leaf.get("path", "")))
        if path in out:
            raise InvalidArgumentError(
                f"export: leaves {out[path].get('path')!r} and {leaf.get('path')!r} both map to the "
                f"zarr path {path!r}")
        out[path] = leaf
    if "" in out and len(out) > 1:
        raise InvalidArgumentError(
            f"export: the step's root leaf {out[''].get('path')!r} is an array, so it can hold no "
            f"other leaf")
    for path in out:
        for up in itertools.accumulate(path.split("/")[:-1], lambda a, b: f"{a}/{b}"):
            if up in out:
                raise InvalidArgumentError(
                    f"export: leaf {out[path].get('path')!r} would lie inside the array of leaf "
                    f"{out[up].get('path')!r}")
    return out


def _join(path: str, key: str) -> str:
    return f"{path}/{key}" if path else key


async def _read_packs(step: KvStore, leaves: list[dict[str, Any]]) -> dict[str, bytes]:
    """Leaf key -> stored bytes of the packed ``leaves``: ONE read per pack (of
    the byte range its leaves span), each leaf checked against its crc32c."""
    by_pack: dict[str, list[dict[str, Any]]] = {}
    for leaf in leaves:
        pack = leaf["packed"].get("key") if isinstance(leaf["packed"], dict) else None
        by_pack.setdefault(str(pack), []).append(leaf)
    out: dict[str, bytes] = {}

    async def one(members: list[dict[str, Any]]) -> None:
        for leaf, data in zip(members, await read_pack_leaves(step, members)):
            out[str(leaf["key"])] = data

    # a pack holds about packing.PACK_BYTES: memory stays near the budget's bytes in flight
    await run_bounded(list(by_pack.values()), one, budget=ByteBudget(DEFAULT_BYTES_IN_FLIGHT),
                      cost=lambda members: PACK_BYTES, max_tasks=16)
    return out


async def _keys_by_leaf(step: KvStore, leaf_keys: list[str]) -> dict[str, list[str]]:
    """Leaf key -> the keys stored in its folder (relative to it), from ONE
    listing of the step."""
    wanted = set(leaf_keys)
    out: dict[str, list[str]] = {}
    for k in await step.list(""):
        parts = k.split("/")
        for i in range(1, len(parts)):
            folder = "/".join(parts[:i])
            if folder in wanted:
                out.setdefault(folder, []).append("/".join(parts[i:]))
                break
    return out


async def export_step(root: str, step: int | None, dest: str, *,
                      progress: Progress | None = None) -> dict[str, Any]:
    """Write checkpoint ``step`` (default: the latest) of ``root`` to ``dest`` as
    plain zarr v3 arrays (see the module docstring). ``progress`` counts the
    bytes written."""
    t = await resolve(root)
    if t.kind != "checkpoint":
        raise InvalidArgumentError(f"export: {root} is not a checkpoint root (found: {t.kind})")
    s = await ckpt.pick_step(t, step)
    manifest = await ckpt.read_manifest(t, s)
    arrays = _plan_paths(ckpt.array_leaves(manifest))
    scalars = {str(leaf.get("path")): leaf.get("value") for leaf in manifest["leaves"]
               if isinstance(leaf, dict) and "key" not in leaf}
    out = await _open_dest(dest, "export")

    # what goes where: (source store, key) per destination key; metadata documents as bytes
    chunks: dict[str, tuple[KvStore, str, int, bool]] = {}  # (source, key, chunk bytes, stored raw)
    docs: dict[str, bytes | tuple[KvStore, str]] = {}
    step_view = t.store.with_path(step_prefix(s))
    packed = await _read_packs(step_view, [leaf for leaf in arrays.values() if leaf.get("packed") is not None])
    leaf_keys = await _keys_by_leaf(step_view, [str(leaf["key"]) for leaf in arrays.values()])
    for path, leaf in arrays.items():
        src = t.store.with_path(step_prefix(s) + str(leaf["key"]))
        try:
            dtype = dtype_from_v3(leaf["dtype"])
            shape, cshape = tuple(map(int, leaf["shape"])), tuple(map(int, leaf["chunk_shape"]))
        except (KeyError, TypeError, ValueError) as e:
            raise DataCorruptionError(f"export: step {s}: leaf {leaf.get('path')!r}: malformed manifest entry: {e}") from None
        size = math.prod(cshape) * dtype.itemsize
        codecs = list(leaf.get("codecs") or ())  # compressed chunks (SaveOptions.compression)
        if leaf.get("packed") is not None:  # a small leaf packed with others: its one chunk
            docs[_join(path, packed_chunk(leaf))] = packed[str(leaf["key"])]
        keys = leaf_keys.get(str(leaf["key"]), [])
        for k in keys:
            if k != "zarr.json":
                chunks[_join(path, k)] = (src, k, size, not codecs)
        docs[_join(path, "zarr.json")] = (src, "zarr.json") if "zarr.json" in keys else json.dumps(
            zarr3_metadata(dtype, shape, cshape, codecs)).encode()
    # groups: every folder above an array, deepest first, the root last
    groups = sorted({"/".join(p.split("/")[:i]) for p in arrays for i in range(len(p.split("/")))}
                    - set(arrays), key=lambda g: (-g.count("/") - bool(g), g))
    attrs = {"checkpoint_step": s, "leaves": {p: leaf.get("path") for p, leaf in sorted(arrays.items())},
             "scalars": scalars}
    for g in groups:
        docs[_join(g, "zarr.json")] = _GROUP if g else json.dumps(
            {"zarr_format": 3, "node_type": "group", "attributes": {"tensorstore_py": attrs}},
            sort_keys=True).encode()

    try:
        foreign = sorted(set(await out.list("")) - set(chunks) - set(docs))
    except UnsupportedError:
        foreign = []
    if foreign:
        raise ConditionFailedError(
            f"export: {dest} holds {len(foreign)} key(s) this export does not write (e.g. "
            f"{foreign[0]!r}); export into an empty location (or rerun an interrupted export of "
            f"the same step to resume it)")
    if progress is not None:
        progress.add_total(sum(size for _src, _key, size, _raw in chunks.values()))
    stats = {"objects": 0, "bytes": 0}

    async def put(key: str, data: Any) -> None:
        if not await create_object(out, key, data, exists="compare"):
            raise ConditionFailedError(
                f"export: {key!r} already exists at {dest} with other content; export into an "
                f"empty location")
        stats["objects"] += 1
        stats["bytes"] += len(data)
        if progress is not None:
            progress.advance(len(data))

    async def chunk(item: tuple[str, tuple[KvStore, str, int, bool]]) -> None:
        key, (src, src_key, size, raw) = item
        res = await src.read(src_key)  # the versioned store checks the crc32c
        if res.state != "value":
            raise DataCorruptionError(f"export: step {s}: chunk {src_key!r} vanished")
        if raw and len(res.value) != size:
            raise DataCorruptionError(
                f"export: step {s}: chunk {src_key!r} holds {len(res.value)} bytes, the chunk grid "
                f"says {size}")
        await put(key, res.value)

    # memory stays near the bytes in flight, whatever the chunk size
    await run_bounded(chunks.items(), chunk, budget=ByteBudget(DEFAULT_BYTES_IN_FLIGHT),
                      cost=lambda item: item[1][2], max_tasks=16)
    # arrays appear complete or not at all: the chunks of packed leaves, then every
    # array's zarr.json, then the groups, deepest first; the root group, written
    # last, marks a finished export. Each phase's documents are written concurrently.
    async def doc_put(key: str) -> None:
        doc = docs[key]
        if isinstance(doc, tuple):
            res = await doc[0].read(doc[1])
            doc = bytes(res.value)
        await put(key, doc)

    array_docs = {_join(p, "zarr.json") for p in arrays}
    group_docs = [_join(g, "zarr.json") for g in groups]
    phases = [[k for k in docs if k not in array_docs and k not in group_docs], sorted(array_docs)]
    phases += [[k for k in group_docs if k.count("/") == depth]
               for depth in sorted({k.count("/") for k in group_docs if k != "zarr.json"}, reverse=True)]
    if "zarr.json" in group_docs:  # the root group (else the step's root leaf is the one array)
        phases.append(["zarr.json"])
    for phase in phases:
        await run_bounded(phase, doc_put, budget=ByteBudget(DEFAULT_BYTES_IN_FLIGHT), cost=1, max_tasks=16)
    return {"root": root, "step": s, "dest": dest, "arrays": len(arrays), "scalars": len(scalars), **stats}
