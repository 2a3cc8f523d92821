"""What a URL points at: a checkpoint root, a versioned store, a zarr array or a folder.

:func:`resolve` opens the store behind a URL and classifies it, reading only a
handful of small objects (works on read-only stores such as ``http(s)://``,
which can not list keys):

* **versioned store** — recognised by its layout (docs/FORMAT.md §2), not by a
  readable newest version: ``commits/00000000000000000001`` or a valid
  ``latest`` hint exists at the URL, or (where the store lists) any object
  has a name of the versioned layout (``commits/<20 digits>``,
  ``nodes|data|changes/<32 hex>``, ``txns/...``, ``leases/<32 hex>``,
  ``gc/reclaimed``); or the URL is ``versioned+...``. So a store whose first
  record was deleted, or whose first save died before its commit (data but
  no commits), is still a versioned store -- with problems or orphans;
* **checkpoint root** — a versioned store whose newest version has ``steps/``
  records (tensorstore_py.checkpoint.storage);
* **array** — ``zarr.json`` (zarr v3, ``node_type: array``) or ``.zarray``
  (zarr v2) at the URL;
* **folder** — anything else that lists keys (arrays found below it).

Errors a user can act on: a URL with nothing recognisable raises
:class:`NotFoundError`; a store written by a newer format raises
:class:`UnsupportedError` saying which format and to upgrade.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Literal

from tensorstore_py.checkpoint.storage import STEPS_PREFIX, step_dir
from tensorstore_py.core.errors import (
    DataCorruptionError,
    InvalidArgumentError,
    InvalidSpecError,
    NotFoundError,
    UnsupportedError,
)
from tensorstore_py.kvstore.base import FolderListing, KvStore
from tensorstore_py.kvstore.registry import open_kvstore
from tensorstore_py.kvstore.versioned import VersionedKvStore
from tensorstore_py.kvstore.versioned.gc import is_layout_object
from tensorstore_py.kvstore.versioned.root import read_hint

__all__ = [
    "CHECKPOINT_FORMAT_PREFIX",
    "Kind",
    "Target",
    "key_sizes",
    "list_arrays",
    "open_url",
    "resolve",
    "step_prefix",
]

Kind = Literal["checkpoint", "versioned", "array", "folder"]

#: format strings of checkpoint step records / manifests are ``<prefix><int>``
CHECKPOINT_FORMAT_PREFIX = "tensorstore_py.checkpoint"
_FIRST_COMMIT = "commits/00000000000000000001"


def step_prefix(step: int) -> str:
    """The key prefix of a checkpoint step's files (``000000000012/``)."""
    return step_dir(step) + "/"


@dataclass(frozen=True)
class Target:
    """An opened URL.

    ``base`` is the plain store at the URL; ``store`` is what to read (for the
    versioned kinds a read-only snapshot pinned at ``version``);
    ``head`` is the live versioned store (None for arrays and folders).
    """

    url: str
    kind: Kind
    base: KvStore
    store: KvStore
    head: VersionedKvStore | None = None
    version: int | None = None
    array_driver: str | None = None  # "zarr3" | "zarr" for kind "array"


def _dir_url(url: str) -> str:
    """Directory-like URLs get a trailing '/', so keys land below them."""
    if "://" in url and not url.endswith("/") and not url.rsplit("/", 1)[-1].startswith("@"):
        return url + "/"
    return url


async def open_url(url: str) -> KvStore:
    """Open the plain store at ``url`` (a path without scheme is a local folder)."""
    if "://" not in url:
        if not os.path.exists(url):
            raise NotFoundError(f"{url}: no such file or directory")
        url = "file://" + os.path.abspath(url) + "/"
    return await open_kvstore(_dir_url(url))


async def _check_format(base: KvStore, url: str) -> None:
    """Refuse, with an actionable message, a store written by a newer format."""
    fmt_of = await VersionedKvStore(base).stored_formats()
    for name, fmt in fmt_of.items():
        if fmt > VersionedKvStore.FORMAT:
            raise UnsupportedError(
                f"{url}: versioned store written with format {fmt} ({name}); this tensorstore_py "
                f"reads format {VersionedKvStore.FORMAT}: upgrade tensorstore_py (pip install -U tensorstore_py)"
            )


async def _is_checkpoint(vs: KvStore) -> bool:
    return bool(await vs.list(STEPS_PREFIX))


async def resolve(url: str, *, version: int | None = None) -> Target:
    """Open and classify ``url``; ``version`` pins a versioned store's snapshot."""
    if version is not None and (not isinstance(version, int) or version < 1):
        raise InvalidArgumentError(f"--at must be a version number >= 1, got {version!r}")
    if url.startswith("versioned+"):
        vs = await open_kvstore(_dir_url(url))
        if not isinstance(vs, VersionedKvStore):  # a third-party adapter registered as "versioned"
            raise InvalidSpecError(f"{url}: not a tensorstore_py versioned store")
        await _check_format(vs.base, url)
        if vs.version is not None and version is not None and version != vs.version:
            raise InvalidArgumentError(f"{url} already names version {vs.version}; drop --at")
        head = VersionedKvStore(vs.base, path=vs.path)
        pinned = version or vs.version
        return await _versioned_target(url, vs.base, head, pinned)
    base = await open_url(url)
    await _check_format(base, url)
    if (await base.read(_FIRST_COMMIT)).state == "value" or await read_hint(base) > 0:
        head = VersionedKvStore(base)
        return await _versioned_target(url, base, head, version)
    target = await _plain_target(url, base, version)
    if version is not None and target.head is None:
        raise InvalidArgumentError(f"{url} is not a versioned store: --at does not apply")
    return target


async def _plain_target(url: str, base: KvStore, version: int | None) -> Target:
    """An array, a folder, or a versioned store known by its layout alone."""
    res = await base.read("zarr.json")
    if res.state == "value":
        try:
            meta = json.loads(bytes(res.value))
        except ValueError:
            meta = {}
        if isinstance(meta, dict) and meta.get("node_type") == "array":
            return Target(url, "array", base, base, array_driver="zarr3")
    if (await base.read(".zarray")).state == "value":
        return Target(url, "array", base, base, array_driver="zarr")
    try:
        top = await base.list_folder("")
    except UnsupportedError:
        if res.state == "value":  # a zarr v3 group over HTTP: still a folder
            return Target(url, "folder", base, base)
        raise NotFoundError(
            f"{url}: no checkpoint, versioned store or zarr array here (looked for "
            f"{_FIRST_COMMIT}, zarr.json and .zarray); this store can not list keys, "
            f"so give the URL of the array or checkpoint itself"
        ) from None
    if not top.keys and not top.folders:
        raise NotFoundError(f"{url}: nothing stored here (no keys); check the URL")
    if await _has_layout_objects(base, top):
        return await _versioned_target(url, base, VersionedKvStore(base), version)
    return Target(url, "folder", base, base)


#: the folders holding a versioned store's layout objects one level down (docs/FORMAT.md §2)
_LAYOUT_FOLDERS = ("commits/", "nodes/", "data/", "changes/", "gc/", "leases/")


async def _has_layout_objects(base: KvStore, top: FolderListing) -> bool:
    """Whether the folder listed as ``top`` holds a versioned store's layout object,
    looking only into the layout's own folders (an array's chunks are never listed)."""
    if any(is_layout_object(k) for k in top.keys):
        return True
    present = [f for f in top.folders if f in _LAYOUT_FOLDERS]
    for listing in await asyncio.gather(*(base.list_folder(f) for f in present)):
        if any(is_layout_object(k) for k in listing.keys):
            return True
    return "txns/" in top.folders and any(is_layout_object(k) for k in await base.list("txns/"))


_FORMAT_RE = re.compile(r"commit record '([^']+)' is malformed: format (\d+), expected (\d+)")


async def _versioned_target(
    url: str, base: KvStore, head: VersionedKvStore, version: int | None
) -> Target:
    try:
        return await _versioned_target_unchecked(url, base, head, version)
    except DataCorruptionError as e:
        m = _FORMAT_RE.search(str(e))
        if m and int(m.group(2)) > int(m.group(3)):
            raise UnsupportedError(
                f"{url}: versioned store written with format {m.group(2)} ({m.group(1)}); this "
                f"tensorstore_py reads format {m.group(3)}: upgrade tensorstore_py "
                f"(pip install -U tensorstore_py)"
            ) from None
        raise


async def _versioned_target_unchecked(
    url: str, base: KvStore, head: VersionedKvStore, version: int | None
) -> Target:
    newest = await head.newest_version()
    if version is None:
        version = newest
    elif version > newest:
        raise NotFoundError(f"{url}: version {version} does not exist (newest is {newest})")
    store: KvStore = head
    if version:  # opening checks the version exists and was not deleted (NotFoundError)
        store = await open_kvstore({"driver": "versioned", "base": base, "version": version})
    kind: Kind = "checkpoint" if version and await _is_checkpoint(store) else "versioned"
    return Target(url, kind, base, store, head=head, version=version or None)


async def key_sizes(target: Target, prefix: str) -> dict[str, int] | None:
    """Stored size of every key under ``prefix`` where the listing tells it.

    A versioned store knows value lengths from its index; file, gs and s3
    listings carry sizes. Other stores (http, which can not list; stores whose
    listing has no sizes) return None: sizes would cost a request per key.
    """
    store = target.store
    if isinstance(store, VersionedKvStore):
        return {e.key: e.size for e in await store.entries(prefix)}
    try:
        infos = await store.list_info(prefix)
    except UnsupportedError:
        return None
    if any(i.size is None for i in infos):
        return None
    return {i.key: int(i.size) for i in infos if i.size is not None}


async def list_arrays(store: KvStore, prefix: str = "") -> list[tuple[str, str]]:
    """``(path, driver)`` of every zarr array below ``prefix`` (needs listing). On
    stores that list a folder natively (file, gcs, s3, fsspec) the folders are
    walked level by level and an array's folder is not entered, so its chunks are
    never listed; elsewhere every key below ``prefix`` is listed."""
    if not store.lists_folders_natively or (prefix and not prefix.endswith("/")):
        return [(path, driver) for _k, path, driver in await _arrays_in(store, await store.list(prefix))]
    out: list[tuple[str, str, str]] = []
    level = [prefix]
    while level:
        listings = await asyncio.gather(*(store.list_folder(f) for f in level))
        arrays = await asyncio.gather(*(_arrays_in(store, lst.keys) for lst in listings))
        out.extend(a for found in arrays for a in found)
        level = [sub for lst, found in zip(listings, arrays) if not found for sub in lst.folders]
    return [(path, driver) for _k, path, driver in sorted(out)]


async def _arrays_in(store: KvStore, keys: list[str]) -> list[tuple[str, str, str]]:
    """``(document key, path, driver)`` of the arrays whose documents are among ``keys``."""
    out = []
    for k in sorted(keys):
        name = k.rsplit("/", 1)[-1]
        path = k[: -len(name)].rstrip("/")
        if name == ".zarray":
            out.append((k, path, "zarr"))
        elif name == "zarr.json":
            res = await store.read(k)
            try:
                meta = json.loads(bytes(res.value)) if res.state == "value" else {}
            except ValueError:
                meta = {}
            if isinstance(meta, dict) and meta.get("node_type") == "array":
                out.append((k, path, "zarr3"))
    return out


def checkpoint_format_version(fmt: Any) -> int | None:
    """The integer after the last '/' of a checkpoint format string."""
    if isinstance(fmt, str) and fmt.startswith(CHECKPOINT_FORMAT_PREFIX):
        tail = fmt.rsplit("/", 1)[-1]
        return int(tail) if tail.isdigit() else None
    return None
