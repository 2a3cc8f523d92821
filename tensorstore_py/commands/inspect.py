"""``ls``, ``info``, ``history`` and ``diff``: read-only views of what is stored.

Each function returns plain JSON-able data (the documented ``--json`` output,
docs/CLI.md); the CLI's printers only format it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np

from tensorstore_py.checkpoint.layout import LeafLayout, zarr3_metadata
from tensorstore_py.checkpoint.leaves import packed_chunk
from tensorstore_py.commands import ckpt
from tensorstore_py.commands.target import Target, key_sizes, list_arrays, resolve, step_prefix
from tensorstore_py.core.errors import (
    DataCorruptionError,
    InvalidArgumentError,
    NotFoundError,
    UnsupportedError,
)
from tensorstore_py.kvstore.base import KvStore
from tensorstore_py.kvstore.versioned import VersionedKvStore
from tensorstore_py.kvstore.versioned.info import CommitDetails
from tensorstore_py.opening import open as ts_open

__all__ = ["METADATA_KEYS", "codec_names", "diff", "history", "info", "ls", "open_array"]

#: metadata documents: not counted in an array's stored (chunk) bytes
METADATA_KEYS = ("zarr.json", ".zarray", ".zattrs", ".zgroup")


async def open_array(kv: KvStore, driver: str | None = None) -> Any:
    """Open the zarr array stored at ``kv`` (read-only use) as a TensorStore."""
    spec: dict[str, Any] = {"kvstore": kv}
    if driver:
        spec["driver"] = driver
    return await ts_open(spec)


def codec_names(meta: dict[str, Any]) -> list[str]:
    """Codec names of a zarr v3 or v2 metadata document (sharding: outer then inner)."""
    if meta.get("zarr_format") == 2:
        out = [f.get("id", "?") for f in meta.get("filters") or [] if isinstance(f, dict)]
        comp = meta.get("compressor")
        if isinstance(comp, dict):
            out.append(str(comp.get("id", "?")))
        return out
    out = []
    for c in meta.get("codecs") or []:
        if not isinstance(c, dict):
            continue
        name = str(c.get("name"))
        if name == "sharding_indexed":
            inner = codec_names({"codecs": (c.get("configuration") or {}).get("codecs") or []})
            out.append(f"sharding_indexed[{','.join(inner)}]")
        else:
            out.append(name)
    return out


def _dtype_name(dt: np.dtype) -> str:
    return str(dt)


async def _describe(kv: KvStore, path: str, driver: str | None, sizes: dict[str, int] | None,
                    extra: dict[str, Any] | None = None, leaf: dict[str, Any] | None = None
                    ) -> dict[str, Any]:
    view = kv.with_path(path) if path else kv
    ts = (await ckpt.open_leaf(view, leaf))[0] if leaf is not None else await open_array(view, driver)
    meta = ts.spec().get("metadata") or {}
    nbytes = int(ts.nbytes)
    row: dict[str, Any] = {
        "path": path,
        "driver": "zarr3" if meta.get("zarr_format") == 3 else "zarr",
        "shape": list(ts.shape),
        "dtype": _dtype_name(ts.dtype),
        "chunk_shape": list(ts.chunks),
        "shard_shape": list(ts.shards) if ts.shards is not None else None,
        "codecs": codec_names(meta),
        "nbytes": nbytes,
        "stored_bytes": None,
        "compression_ratio": None,
    }
    if sizes is not None:
        pre = path + "/" if path else ""
        stored = sum(n for k, n in sizes.items()
                     if k.startswith(pre) and k.rsplit("/", 1)[-1] not in METADATA_KEYS)
        if leaf is not None and leaf.get("packed") is not None:
            stored = nbytes  # its raw bytes lie in a pack of the step (checkpoint/packing.py)
        row["stored_bytes"] = stored
        row["compression_ratio"] = round(nbytes / stored, 3) if stored else None
    if extra:
        row.update(extra)
    return row


def _describe_packed(leaf: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """The row of a packed leaf (checkpoint/packing.py), from its manifest entry
    alone: it is one raw chunk whose bytes lie in a pack, so its stored bytes are
    its bytes. :class:`DataCorruptionError` for a malformed entry."""
    try:
        layout = LeafLayout.from_json(leaf)  # a malformed "packed": DataCorruptionError
    except (KeyError, TypeError, ValueError) as e:
        raise DataCorruptionError(f"checkpoint leaf {leaf.get('path')!r}: malformed manifest entry: {e}") from None
    meta = zarr3_metadata(layout.dtype, layout.shape, layout.chunk_shape, [])
    row: dict[str, Any] = {
        "path": str(leaf["key"]), "driver": "zarr3", "shape": list(layout.shape),
        "dtype": _dtype_name(layout.dtype), "chunk_shape": list(layout.chunk_shape),
        "shard_shape": None, "codecs": codec_names(meta), "nbytes": layout.nbytes,
        "stored_bytes": layout.nbytes, "compression_ratio": 1.0 if layout.nbytes else None,
    }
    row.update(extra)
    return row


# -- ls ---------------------------------------------------------------------------
async def ls(url: str, *, version: int | None = None) -> dict[str, Any]:
    """Steps of a checkpoint, versions of a versioned store, or arrays under a folder."""
    t = await resolve(url, version=version)
    out: dict[str, Any] = {"url": url, "kind": t.kind, "version": t.version}
    if t.kind == "checkpoint":
        rows = await ckpt.step_records(t)
        out["steps"] = [
            {"step": r.step, "time": r.time, "nbytes": r.nbytes, "version": r.version,
             "write_id": r.write_id, "message": r.message, "metrics": r.metrics,
             "process_count": r.process_count, "readable_version": r.readable_version,
             "retired": r.retired, "bytes_added": r.bytes_added}
            for r in rows
        ]
        return out
    if t.kind == "versioned":
        assert t.head is not None
        out["versions"] = await _version_rows(t, retained_only=True)
        out["tags"] = await t.head.tags()
        return out
    out["arrays"] = await _arrays(t)
    return out


async def _arrays(t: Target) -> list[dict[str, Any]]:
    if t.kind == "array":
        found: Sequence[tuple[str, str | None]] = [("", t.array_driver)]
    else:
        try:
            found = await list_arrays(t.store)
        except UnsupportedError as e:
            raise UnsupportedError(f"{t.url}: {e}; give the URL of one array instead") from None
    sizes = await key_sizes(t, "")
    return list(await asyncio.gather(*(_describe(t.store, p, d, sizes) for p, d in found)))


async def _version_rows(t: Target, *, retained_only: bool) -> list[dict[str, Any]]:
    """One row per commit record (retained ones, or all of them with a 'deleted' flag)."""
    assert isinstance(t.head, VersionedKvStore)
    head = t.head
    newest = await head.newest_version()
    last = t.version or newest
    retained = {i.version for i in await head.versions()}
    tags_by_v: dict[int, list[str]] = {}
    for name, v in (await head.tags()).items():
        tags_by_v.setdefault(v, []).append(name)

    def is_deleted(v: int) -> bool:
        return v not in retained

    versions = [v for v in range(1, last + 1) if not (retained_only and is_deleted(v))]
    sem = asyncio.Semaphore(32)

    async def row(v: int) -> dict[str, Any]:
        async with sem:
            rec = await head.commit_details(v)
            written = await _bytes_written(head, rec) if not is_deleted(v) else None
        return {
            "version": v, "time": rec.time, "write_id": rec.write_id, "message": rec.message,
            "kind": rec.kind, "keys": rec.key_count, "keys_changed": rec.changed_count,
            "bytes_written": written, "tags": sorted(tags_by_v.get(v, [])),
            "deleted": is_deleted(v), "txn_id": rec.txn_id, "metadata": rec.metadata,
        }

    return list(await asyncio.gather(*(row(v) for v in versions)))


async def _bytes_written(head: VersionedKvStore, rec: CommitDetails) -> int | None:
    """Bytes of the values this commit wrote (deletes count 0)."""
    if rec.kind != "data":
        return 0
    keys = await head.changed_keys(rec.version)
    if len(keys) > 4096:
        return None  # too costly for a listing; ``info`` gives sizes
    return sum(e.size for e in await head.stat(keys, version=rec.version) if e is not None)


# -- info ---------------------------------------------------------------------------
async def info(url: str, *, step: int | None = None, version: int | None = None) -> dict[str, Any]:
    """The arrays stored at ``url`` (a step of a checkpoint: its leaves)."""
    t = await resolve(url, version=version)
    out: dict[str, Any] = {"url": url, "kind": t.kind, "version": t.version, "step": None}
    if step is not None and t.kind != "checkpoint":
        raise InvalidArgumentError(f"{url} is a {t.kind}, not a checkpoint: --step does not apply")
    if t.kind != "checkpoint":
        out["arrays"] = await _arrays(t)
        return out
    s = await ckpt.pick_step(t, step)
    out["step"] = s
    manifest = await ckpt.read_manifest(t, s)
    sizes = await key_sizes(t, step_prefix(s))
    view = t.store.with_path(step_prefix(s).rstrip("/"))
    leaves = ckpt.array_leaves(manifest)
    rel = None if sizes is None else {k[len(step_prefix(s)):]: n for k, n in sizes.items()}

    async def one(leaf: dict[str, Any]) -> dict[str, Any]:
        extra = {"key": leaf["key"], "sharding": leaf.get("sharding")}
        if leaf.get("packed") is not None:  # described by its manifest entry: nothing is read
            row = _describe_packed(leaf, extra)
        else:
            row = await _describe(view, str(leaf["key"]), "zarr3", rel, extra, leaf=leaf)
        row["key"], row["path"] = row["path"], leaf.get("path", "")
        return row

    out["arrays"] = list(await asyncio.gather(*(one(leaf) for leaf in leaves)))
    out["scalars"] = [
        {"path": leaf.get("path", ""), "value": leaf.get("value")}
        for leaf in manifest["leaves"] if isinstance(leaf, dict) and "key" not in leaf
    ]
    return out


# -- history -------------------------------------------------------------------------
async def history(url: str) -> dict[str, Any]:
    """Every commit of a versioned store / checkpoint root, oldest first."""
    t = await resolve(url)
    if t.head is None:
        raise InvalidArgumentError(f"{url} is a {t.kind}: only versioned stores and checkpoints have history")
    rows = await _version_rows(t, retained_only=False)
    for r in rows:
        s = r["metadata"].get("checkpoint_step") if isinstance(r["metadata"], dict) else None
        r["step"] = s if isinstance(s, int) else None
    return {"url": url, "kind": t.kind, "commits": rows}


# -- diff ------------------------------------------------------------------------------
async def _entries(vs: VersionedKvStore, version: int, prefix: str) -> dict[str, tuple[int, int]]:
    """key -> (length, crc32c) at ``version`` under ``prefix``."""
    n = len(prefix)
    return {e.key[n:]: (e.size, e.crc32c) for e in await vs.entries(prefix, version=version)}


def _compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, list[str]]:
    return {
        "added": sorted(set(b) - set(a)),
        "removed": sorted(set(a) - set(b)),
        "changed": sorted(k for k in set(a) & set(b) if a[k] != b[k]),
    }


def _group(keys: dict[str, list[str]], arrays: list[str]) -> tuple[list[dict[str, Any]], dict[str, list[str]]]:
    """Split key changes into per-array chunk changes and other keys."""
    per: dict[str, dict[str, list[str]]] = {}
    other: dict[str, list[str]] = {"added": [], "removed": [], "changed": []}
    by_len = sorted(arrays, key=len, reverse=True)
    for what, ks in keys.items():
        for k in ks:
            arr = next((p for p in by_len if p == "" or k.startswith(p + "/")), None)
            if arr is None:
                other[what].append(k)
                continue
            rel = k[len(arr) + 1:] if arr else k
            d = per.setdefault(arr, {"added": [], "removed": [], "changed": []})
            d[what].append(rel)
    rows = [
        {"path": p, "chunks_added": d["added"], "chunks_removed": d["removed"],
         "chunks_changed": d["changed"]}
        for p, d in sorted(per.items())
    ]
    return rows, other


def _leaf_chunks(leaf: dict[str, Any], entries: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """A leaf's chunk key (in its folder) -> (length, crc32c), from the step's
    index entries; a packed leaf's one chunk from its manifest entry (the crc32c
    of the same bytes a chunk of its own would hold, so packing alone is no change)."""
    if leaf.get("packed") is not None:
        layout = LeafLayout.from_json(leaf)
        return {packed_chunk(leaf): (layout.nbytes, leaf["packed"].get("crc32c"))}
    pre = str(leaf["key"]) + "/"
    return {k[len(pre):]: x for k, x in entries.items() if k.startswith(pre)}


async def diff(url: str, a: int, b: int) -> dict[str, Any]:
    """What changed from ``a`` to ``b``: steps of a checkpoint, versions otherwise.

    Values are compared by length and crc32c (no data is read).
    """
    t = await resolve(url)
    if t.head is None:
        raise InvalidArgumentError(f"{url} is a {t.kind}: diff needs a versioned store or checkpoint")
    vs = t.head
    out: dict[str, Any] = {"url": url, "kind": t.kind, "a": a, "b": b}
    if t.kind == "checkpoint":
        sa, sb = await ckpt.pick_step(t, a), await ckpt.pick_step(t, b)
        ma, mb = await ckpt.read_manifest(t, sa), await ckpt.read_manifest(t, sb)
        la = {leaf.get("path", ""): leaf for leaf in ckpt.array_leaves(ma)}
        lb = {leaf.get("path", ""): leaf for leaf in ckpt.array_leaves(mb)}
        v = t.version or await vs.newest_version()
        ea, eb = await asyncio.gather(_entries(vs, v, step_prefix(sa)), _entries(vs, v, step_prefix(sb)))
        rows = []
        for path in sorted(set(la) | set(lb)):
            if path not in la or path not in lb:
                rows.append({"path": path, "status": "added" if path not in la else "removed"})
                continue
            ca, cb = _leaf_chunks(la[path], ea), _leaf_chunks(lb[path], eb)
            ch = _compare(ca, cb)
            meta = any(la[path].get(f) != lb[path].get(f) for f in ("shape", "dtype", "chunk_shape"))
            rows.append({
                "path": path, "status": "changed" if meta or any(ch.values()) else "unchanged",
                "metadata_changed": meta, "chunks_added": ch["added"],
                "chunks_removed": ch["removed"], "chunks_changed": ch["changed"],
            })
        out["arrays"] = rows
        return out
    newest = await vs.newest_version()
    for v in (a, b):
        if not 0 <= v <= newest:
            raise NotFoundError(f"{url}: version {v} does not exist (newest is {newest})")
    ea, eb = await asyncio.gather(_entries(vs, a, ""), _entries(vs, b, ""))
    ch = _compare(ea, eb)
    arrays = sorted({k.rsplit("/", 1)[0] if "/" in k else "" for k in (set(ea) | set(eb))
                     if k.rsplit("/", 1)[-1] in ("zarr.json", ".zarray")})
    rows, other = _group(ch, arrays)
    out["arrays"] = rows
    out["keys"] = other
    return out
