"""``verify``: read every referenced object, check every checksum, decode every chunk.

What is checked, by kind of URL:

* **checkpoint root / versioned store** — the store's whole history (every
  commit record -- a missing one, a gap or a lost newest record is a problem --,
  every retained version's index tree, every data object and the crc32c of
  every value: :func:`tensorstore_py.kvstore.versioned.verify.audit`), and the
  objects no retained version references (reported, not a problem: left by
  interrupted writes or deleted versions, ``gc`` deletes them);
  then, per step (the newest version's steps, or ``--step N``), the
  manifest, each leaf's ``zarr.json`` (if it has one) against the manifest
  (shape, dtype, chunk shape), and every chunk of every leaf: present, of the declared size
  (raw chunks, known from the index) or decoding to the declared chunk shape;
  and every chunk an incremental save recorded a digest of, hashed again
  against it (``digest_checks.py``).
* **zarr v2 / v3 array or folder of arrays** — metadata parses, and every
  stored chunk is read and decoded (sharded: the shard index's crc32c and
  every inner chunk) to the declared chunk shape. Missing chunks are the fill
  value, not a problem.

Nothing is written. The result is a :class:`VerifyReport`; ``ok`` is False when
anything is wrong, with one :class:`Problem` per finding, and the bytes read
and verified. A :class:`~tensorstore_py.progress.Progress` given as
``progress`` advances with the bytes read; its total is the size of the
objects listed (versioned stores) plus the chunks to decode, where the store
tells sizes.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
from typing import Any

import numpy as np

from tensorstore_py.checkpoint.layout import LeafLayout
from tensorstore_py.checkpoint.leaves import read_pack_leaves
from tensorstore_py.checkpoint.packing import check_leaf
from tensorstore_py.checkpoint.storage import record_key
from tensorstore_py.checkpoint.tiers import PART_KEY
from tensorstore_py.commands import ckpt
from tensorstore_py.commands.digest_checks import check_digests
from tensorstore_py.commands.inspect import METADATA_KEYS, open_array
from tensorstore_py.commands.problems import Problem, VerifyReport
from tensorstore_py.commands.target import Target, key_sizes, list_arrays, open_url, resolve, step_prefix
from tensorstore_py.core.errors import (
    ChecksumError,
    DataCorruptionError,
    InvalidArgumentError,
    InvalidSpecError,
    NotFoundError,
    TensorStoreError,
    UnsupportedError,
)
from tensorstore_py.core.pools import run_cpu
from tensorstore_py.drivers.dtypes import dtype_to_v3
from tensorstore_py.kvstore.base import KvStore
from tensorstore_py.kvstore.registry import open_kvstore
from tensorstore_py.kvstore.versioned.verify import audit as audit_store
from tensorstore_py.progress import Progress

__all__ = ["check_array", "verify"]

#: chunks read and decoded at once per array
CHUNK_CONCURRENCY = 16
#: checkpoint leaves checked at once
LEAF_CONCURRENCY = 16
#: grid positions scheduled at once
CELL_BATCH = 4096


async def verify(
    url: str,
    *,
    step: int | None = None,
    all_versions: bool = False,
    version: int | None = None,
    progress: Progress | None = None,
) -> VerifyReport:
    """Verify what ``url`` holds (see the module docstring).

    ``step``: only that checkpoint step; ``all_versions``: every retained
    version (and every step in them), not only the newest (or ``version``).
    """
    if step is not None and all_versions:
        raise InvalidArgumentError("give --step or --all, not both")
    t0 = time.perf_counter()
    try:
        t = await resolve(url, version=version)
    except DataCorruptionError as e:
        # the store is too damaged to classify (e.g. the newest record or the
        # root node is corrupt): the store walk names every damaged object
        report = await _walk_only(url, e, progress)
        report.seconds = time.perf_counter() - t0
        return report
    report = VerifyReport(url=url, kind=t.kind)
    if t.kind in ("checkpoint", "versioned"):
        try:
            await _verify_versioned(t, report, step=step, all_versions=all_versions,
                                    progress=progress)
        except DataCorruptionError as e:
            if not report.problems:  # otherwise a consequence of what the walk found
                report.problems.append(Problem(_kind(e), str(e)))
    else:
        if step is not None:
            raise InvalidArgumentError(f"{url} is a {t.kind}, not a checkpoint: --step does not apply")
        found = [("", t.array_driver)] if t.kind == "array" else await list_arrays(t.store)
        sizes = await key_sizes(t, "")
        for path, driver in found:
            view = t.store.with_path(path) if path else t.store
            rel = _below(sizes, path)
            await check_array(view, path or url, report, driver=driver, sizes=rel,
                              require_all=False, progress=progress, plain=True)
    report.seconds = time.perf_counter() - t0
    return report


async def _walk_only(url: str, err: DataCorruptionError, progress: Progress | None) -> VerifyReport:
    base = (await open_kvstore(url)).base if url.startswith("versioned+") else await open_url(url)  # type: ignore[attr-defined]
    report = VerifyReport(url=url, kind="versioned")
    _add_audit(report, await audit_store(base, progress=_walk_progress(report, progress)))
    if not report.problems:
        report.problems.append(Problem(_kind(err), str(err)))
    return report


def _walk_progress(report: VerifyReport, progress: Progress | None) -> Any:
    """The store walk's ``progress(what, n)``: counts into ``report``, bytes to the bar."""

    def tick(what: str, n: int) -> None:
        if what == "values":
            report.values += n
        elif what in ("records", "nodes"):
            report.objects += n
        elif progress is not None and what == "bytes":
            progress.advance(n)
        elif progress is not None and what == "listed_bytes":
            progress.add_total(n)

    return tick


def _add_audit(report: VerifyReport, found: Any) -> None:
    """A store audit's problems, unreferenced objects and bytes, into ``report``."""
    for p in found.problems:
        report.problems.append(_from_store(p))
    report.unreferenced = len(found.unreferenced)
    report.unreferenced_bytes = sum(n or 0 for n in found.unreferenced.values())
    report.bytes_read += found.bytes_read
    report.bytes_verified += found.bytes_verified


def _from_store(p: Any) -> Problem:
    """A store-walk problem (kvstore.versioned.verify.Problem) as a CLI problem."""
    at = f" (version {p.version})" if p.version is not None else ""
    return Problem(p.kind, f"{p.object}{at}: {p.message}", object=p.object, version=p.version)


def _below(sizes: dict[str, int] | None, path: str) -> dict[str, int] | None:
    if sizes is None:
        return None
    if not path:
        return sizes
    pre = path.rstrip("/") + "/"
    return {k[len(pre):]: n for k, n in sizes.items() if k.startswith(pre)}


async def _verify_versioned(
    t: Target, report: VerifyReport, *, step: int | None, all_versions: bool,
    progress: Progress | None,
) -> None:
    assert t.head is not None
    # the whole history: every record, every retained version's tree and values
    _add_audit(report, await audit_store(t.head, progress=_walk_progress(report, progress)))
    if t.version is None:  # an empty store: nothing committed
        return
    try:
        retained = await _retained(t)
    except (NotFoundError, DataCorruptionError) as e:
        if not report.problems:  # else a consequence of a record the walk found missing
            report.problems.append(Problem(_kind(e), str(e)))
        return
    report.versions = retained
    if t.kind == "versioned":
        for v in retained if all_versions else [t.version]:
            snap = t.head.snapshot(v)
            vt = Target(t.url, "versioned", t.base, snap, head=t.head, version=v)
            sizes = await key_sizes(vt, "")
            for path, driver in await list_arrays(snap):
                await check_array(snap.with_path(path) if path else snap, path or "/", report,
                                  driver=driver, sizes=_below(sizes, path), require_all=False,
                                  version=v, progress=progress)
        return
    # checkpoint: the steps of the pinned version (a step never changes once
    # saved, so the newest version holding a step shows it as every older one does)
    if step is not None:
        steps = [await ckpt.pick_step(t, step)]
    else:
        steps = await ckpt.list_steps(t.store)
    report.steps = steps
    for s in steps:
        try:
            await _verify_step(t, s, report, progress)
        except DataCorruptionError as e:  # e.g. the manifest's own value is damaged
            report.problems.append(Problem(_kind(e), f"step {s}: {e}"))


async def _retained(t: Target) -> list[int]:
    """Versions not deleted, oldest first, up to the pinned one."""
    assert t.head is not None and t.version is not None
    return [i.version for i in await t.head.versions() if i.version <= t.version]


async def _verify_step(t: Target, s: int, report: VerifyReport, progress: Progress | None) -> None:
    try:
        manifest = await ckpt.read_manifest(t, s)
    except (DataCorruptionError, NotFoundError) as e:
        report.problems.append(Problem(_kind(e), str(e), key=step_prefix(s) + "manifest.json"))
        return
    try:
        if (await t.store.read(record_key(s))).state != "value":
            report.problems.append(Problem("missing", f"step {s}: record {record_key(s)!r} is missing",
                                           key=record_key(s)))
    except DataCorruptionError as e:
        report.problems.append(Problem(_kind(e), f"step {s}: {e}", key=record_key(s)))
    sizes = await key_sizes(t, step_prefix(s))
    rel = _below(sizes, step_prefix(s))
    # a local tier's part of a multi-process step holds its process's regions only
    # (checkpoint/tiers.py): the chunks it has are checked, absent ones are expected
    part = await t.store.read(step_prefix(s) + PART_KEY)
    whole = part.state != "value" or int(json.loads(bytes(part.value)).get("process_count", 1)) <= 1
    step_view = t.store.with_path(step_prefix(s).rstrip("/"))
    sem = asyncio.Semaphore(LEAF_CONCURRENCY)  # leaves at once: latency-bound on remote stores

    async def leaf_check(leaf: dict[str, Any]) -> None:
        key = str(leaf["key"])
        name = f"step {s} {leaf.get('path') or key}"
        expect = {f: leaf.get(f) for f in ("shape", "dtype", "chunk_shape")}
        async with sem:
            await check_array(step_view.with_path(key), name, report, driver="zarr3",
                              sizes=_below(rel, key), require_all=whole, expect=expect,
                              key_prefix=step_prefix(s) + key + "/", leaf=leaf, progress=progress)
        for k in _stray_keys(leaf, _below(rel, key) or {}):
            report.problems.append(Problem(
                "stray", f"array {name}: key {step_prefix(s) + key + '/' + k!r} is no chunk of the "
                f"leaf's grid (expected c/<i>/... within {leaf.get('shape')} by "
                f"{leaf.get('chunk_shape')})", array=name, key=step_prefix(s) + key + "/" + k))

    leaves = ckpt.array_leaves(manifest)
    packed = [leaf for leaf in leaves if leaf.get("packed") is not None]
    await asyncio.gather(*(leaf_check(leaf) for leaf in leaves if leaf.get("packed") is None),
                         _check_packed(step_view, s, packed, rel, report))
    await check_digests(step_view, s, manifest, report)


async def _check_packed(step_view: KvStore, s: int, leaves: list[dict[str, Any]],
                        rel: dict[str, int] | None, report: VerifyReport) -> None:
    """The packed leaves of step ``s`` (checkpoint/packing.py): ONE read per pack
    of the bytes its leaves span, each leaf checked against its crc32c; and a
    packed leaf's folder holds no key (its one chunk lies in the pack), so any
    key found there is a problem named by its key."""
    by_pack: dict[str, list[dict[str, Any]]] = {}
    for leaf in leaves:
        pack = leaf["packed"].get("key") if isinstance(leaf["packed"], dict) else None
        by_pack.setdefault(str(pack), []).append(leaf)
    sem = asyncio.Semaphore(LEAF_CONCURRENCY)

    def name(leaf: dict[str, Any]) -> str:
        return f"step {s} {leaf.get('path') or leaf['key']}"

    async def pack_check(pack: str, members: list[dict[str, Any]]) -> None:
        async with sem:
            try:
                datas = await read_pack_leaves(step_view, members, check=False)
            except (DataCorruptionError, NotFoundError) as e:
                for leaf in members:
                    report.problems.append(Problem(_kind(e), f"array {name(leaf)}: {e}", array=name(leaf),
                                                   key=step_prefix(s) + pack))
                return
        for leaf, data in zip(members, datas):
            layout = LeafLayout.from_json(leaf)  # read_pack_leaves parsed it already
            assert layout.packed is not None
            try:
                check_leaf(layout.packed, layout.key, data)
            except DataCorruptionError as e:
                report.problems.append(Problem(_kind(e), f"array {name(leaf)}: {e}", array=name(leaf),
                                               key=step_prefix(s) + pack))
                continue
            report.arrays += 1

    await asyncio.gather(*(pack_check(p, m) for p, m in by_pack.items()))
    if rel is None:  # no sizes from this store: list the step once
        rel = dict.fromkeys(await step_view.list(""), 0)
    folders = {str(leaf["key"]).strip("/") + "/": leaf for leaf in leaves}
    for k in sorted(rel):
        top = next((f for f in folders if k.startswith(f)), None)
        if top is not None:
            leaf = folders[top]
            report.problems.append(Problem(
                "stray", f"array {name(leaf)}: key {step_prefix(s) + k!r} lies in the folder of a "
                f"packed leaf (its bytes are in a pack; expected no key there)",
                array=name(leaf), key=step_prefix(s) + k))


def _stray_keys(leaf: dict[str, Any], keys: dict[str, int]) -> list[str]:
    """The keys of a (not packed) leaf's folder that are neither its metadata nor
    a chunk of its grid (checkpoint leaves use zarr v3's default key encoding,
    ``c/<i>/<j>``). Empty when the manifest entry is malformed (a metadata
    problem, reported by check_array)."""
    try:
        shape, cshape = [int(n) for n in leaf["shape"]], [int(n) for n in leaf["chunk_shape"]]
        grid = [math.ceil(n / c) if c else 0 for n, c in zip(shape, cshape)]
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return []
    if len(grid) != len(shape):
        return []

    def in_grid(k: str) -> bool:
        parts = k.split("/")
        if parts[0] != "c" or len(parts) != len(grid) + 1:
            return False
        return all(p.isascii() and p.isdigit() and p == str(int(p)) and int(p) < g
                   for p, g in zip(parts[1:], grid))

    return sorted(k for k in keys if k not in METADATA_KEYS and not in_grid(k))


def _kind(e: BaseException) -> str:
    if isinstance(e, ChecksumError):
        return "checksum"
    msg = str(e)
    for word in ("missing", "truncated"):
        if word in msg:
            return word
    return "corrupt" if isinstance(e, DataCorruptionError) else "decode"


async def check_array(
    kv: KvStore,
    name: str,
    report: VerifyReport,
    *,
    driver: str | None,
    sizes: dict[str, int] | None,
    require_all: bool,
    expect: dict[str, Any] | None = None,
    progress: Progress | None = None,
    version: int | None = None,
    key_prefix: str = "",
    leaf: dict[str, Any] | None = None,
    plain: bool = False,
) -> None:
    """Check one array: metadata, then every chunk (see the module docstring).

    ``leaf`` (a checkpoint manifest entry) opens a leaf that may have no
    ``zarr.json``. ``sizes`` (key -> stored size, relative to ``kv``) lets raw chunks be
    checked from the index without reading them (their bytes are checksummed by
    the store check); ``require_all`` makes a missing chunk a problem. ``plain``:
    ``kv`` is not a versioned store, so a decoded chunk's bytes count as verified
    here (a versioned store's values were verified by the store walk).
    """
    problems = report.problems
    try:
        ts = (await ckpt.open_leaf(kv, leaf))[0] if leaf is not None else await open_array(kv, driver)
    except (InvalidSpecError, DataCorruptionError, NotFoundError, UnsupportedError) as e:
        problems.append(Problem("metadata", f"array {name}: {e}", array=name, version=version))
        return
    report.arrays += 1
    drv = ts.driver  # the chunk grid and codec are driver facts, not view facts
    # raw chunks (stored bytes == the C-order array bytes) are checked by size alone
    raw_nbytes = drv.raw_chunk_nbytes
    if progress is not None and sizes is not None and raw_nbytes is None:
        # the chunks this reads (raw chunks with known sizes are checked by size)
        progress.add_total(sum(n for k, n in sizes.items() if k.rsplit("/", 1)[-1] not in METADATA_KEYS))
    if expect:
        found = {"shape": list(ts.shape), "dtype": _v3_name(ts.dtype),
                 "chunk_shape": list(drv.write_chunk_shape)}
        for f, want in expect.items():
            if want is not None and found[f] != want:
                problems.append(Problem(
                    "metadata", f"array {name}: zarr.json {f} is {found[f]!r}, the manifest says {want!r}",
                    array=name, expected=want, found=found[f], version=version))
    grid = [math.ceil(n / c) if c else 0 for n, c in zip(drv.shape, drv.write_chunk_shape)]
    keys: set[str] | None = None
    if sizes is None:
        try:
            keys = set(await kv.list(""))
        except UnsupportedError:
            keys = None  # e.g. HTTP: read every grid position instead
    sem = asyncio.Semaphore(CHUNK_CONCURRENCY)

    async def one(cell: tuple[int, ...]) -> None:
        key = drv.chunk_key(cell)
        present: bool | None = None
        if sizes is not None:
            present = key in sizes
        elif keys is not None:
            present = key in keys
        if present is False:
            if require_all:
                problems.append(Problem("missing", f"array {name}: chunk {key!r} is missing",
                                        array=name, chunk=key, key=key_prefix + key, version=version))
            return
        report.chunks += 1
        if sizes is not None and raw_nbytes is not None:
            n = sizes[key]
            if n != raw_nbytes:
                problems.append(Problem(
                    "shape", f"array {name}: chunk {key!r} has {n} bytes, expected {raw_nbytes} "
                    f"(chunk shape {list(drv.write_chunk_shape)} of {drv.dtype})",
                    array=name, chunk=key, key=key_prefix + key, expected=raw_nbytes, found=n,
                    version=version))
            return
        async with sem:
            try:
                res = await kv.read(key)
                if res.state != "value":
                    if require_all:
                        problems.append(Problem("missing", f"array {name}: chunk {key!r} is missing",
                                                array=name, chunk=key, version=version))
                    return
                nbytes = len(memoryview(res.value).cast("B"))
                arr = await run_cpu(drv.decode_chunk, key, res.value)
            except (TensorStoreError, ValueError, OSError) as e:
                what = str(e) if repr(key) in str(e) else f"chunk {key!r}: {e}"
                kind = _kind(e)
                problems.append(Problem("decode" if kind == "corrupt" else kind,
                                        f"array {name}: {what}", array=name,
                                        chunk=key, key=key_prefix + key, version=version))
                return
            want = tuple(drv.write_chunk_shape)
            if tuple(arr.shape) != want or np.dtype(arr.dtype) != drv.dtype:
                problems.append(Problem(
                    "shape", f"array {name}: chunk {key!r} decodes to {arr.dtype}{list(arr.shape)}, "
                    f"expected {drv.dtype}{list(want)}", array=name, chunk=key,
                    expected=list(want), found=list(arr.shape), version=version))
            report.bytes_read += nbytes
            if plain:
                report.bytes_verified += nbytes
            if progress is not None:
                progress.advance(nbytes)

    # in batches: an array may have millions of chunks, most of them missing
    cells = itertools.product(*(range(g) for g in grid))
    while batch := list(itertools.islice(cells, CELL_BATCH)):
        await asyncio.gather(*(one(c) for c in batch))


def _v3_name(dt: np.dtype) -> str:
    try:
        return str(dtype_to_v3(dt))
    except Exception:
        return str(dt)
