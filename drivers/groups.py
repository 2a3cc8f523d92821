"""Group documents: zarr v3 and v2 groups and N5 groups, and what lies in them.

=========  =======================================  ==============================
format     a group is                               its attributes
=========  =======================================  ==============================
zarr3      ``zarr.json`` with ``node_type: group``  ``zarr.json``'s ``attributes``
zarr2      ``.zgroup`` (``{"zarr_format": 2}``)     ``.zattrs`` (the whole object)
n5         ``attributes.json`` without              every member of
           ``dimensions``                           ``attributes.json``
=========  =======================================  ==============================

Members are found by listing the group's folder (``KvStore.list_folder``: a
delimiter listing on GCS and S3, one directory read on the file store, so no
key below a child, chunks included, is visited): a member is a direct child
folder holding an array or group document (``<name>/zarr.json``,
``<name>/.zarray``, ``<name>/.zgroup``, ``<name>/attributes.json``): one
read of ``zarr.json`` per child, then the other three at once where it is
absent. A store that cannot list cannot enumerate members
(its members still open by name).

Creating a group is create-only on its document: of two concurrent creators
one writes it and the other opens it. Attribute updates are atomic
read-modify-writes of the document (drivers/documents.py).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from tensorstore_py.core.errors import (
    ConditionFailedError,
    InvalidArgumentError,
    InvalidSpecError,
    NotFoundError,
    UnsupportedError,
)
from tensorstore_py.drivers.chunked_metadata import json_object
from tensorstore_py.drivers.documents import check_attributes, update_json, url_of
from tensorstore_py.drivers.n5.metadata import ATTRIBUTES_KEY as N5_KEY
from tensorstore_py.kvstore.base import Generation, KvStore, ReadResult

__all__ = [
    "GroupNode",
    "NodeKind",
    "create_group",
    "list_members",
    "node_at",
    "not_an_array_error",
    "update_group_attributes",
]

ZARR3_KEY, ZARRAY_KEY, ZGROUP_KEY, ZATTRS_KEY = "zarr.json", ".zarray", ".zgroup", ".zattrs"
GroupFormat = Literal["zarr3", "zarr2", "n5"]
NodeKind = Literal["array", "group"]
_DOCUMENTS = (ZARR3_KEY, ZARRAY_KEY, ZGROUP_KEY, N5_KEY)
_FORMAT_NAMES = {"zarr3": "zarr v3", "zarr2": "zarr v2", "n5": "N5"}
#: the array driver a group's new arrays get by default
ARRAY_DRIVER = {"zarr3": "zarr3", "zarr2": "zarr", "n5": "n5"}


@dataclass(frozen=True)
class GroupNode:
    """A group as stored: its format and user attributes."""

    format: GroupFormat
    attributes: dict[str, Any]


def _json(res: ReadResult, key: str) -> dict[str, Any] | None:
    return json_object(res.value, key) if res.state == "value" else None


def _kind(key: str, doc: dict[str, Any] | None) -> tuple[GroupFormat, NodeKind] | None:
    """What the document stored at ``key`` makes its folder (None: nothing)."""
    if doc is None:
        return None
    if key == ZARR3_KEY:
        return "zarr3", "group" if doc.get("node_type") == "group" else "array"
    if key == N5_KEY:
        return "n5", "array" if "dimensions" in doc else "group"
    return "zarr2", "array" if key == ZARRAY_KEY else "group"


async def _read_documents(kv: KvStore) -> dict[str, dict[str, Any] | None]:
    results = await asyncio.gather(*(kv.read(k) for k in _DOCUMENTS))
    return {k: _json(r, k) for k, r in zip(_DOCUMENTS, results)}


async def node_at(kv: KvStore) -> tuple[GroupFormat, NodeKind, GroupNode | None] | None:
    """The node stored at ``kv`` (format, kind and, for a group, its document),
    or None when there is none. zarr v3 wins over zarr v2 over N5 when a folder
    holds several."""
    docs = await _read_documents(kv)
    for key in _DOCUMENTS:
        found = _kind(key, docs[key])
        if found is None:
            continue
        fmt, kind = found
        if kind == "array":
            return fmt, kind, None
        attrs = await _group_attributes(kv, fmt, docs[key])
        return fmt, kind, GroupNode(fmt, attrs)
    return None


async def _group_attributes(kv: KvStore, fmt: GroupFormat, doc: dict[str, Any] | None) -> dict[str, Any]:
    if fmt == "zarr3":
        attrs = (doc or {}).get("attributes", {})
        if not isinstance(attrs, dict):
            raise InvalidSpecError(f"zarr3 group at {url_of(kv)}: 'attributes' must be an object, got {attrs!r}")
        return attrs
    if fmt == "n5":
        return dict(doc or {})
    return _json(await kv.read(ZATTRS_KEY), ZATTRS_KEY) or {}


def _encode(fmt: GroupFormat) -> Any:
    if fmt == "n5":
        return lambda doc: json.dumps(doc, separators=(",", ":")).encode()
    return lambda doc: json.dumps(doc, indent=2 if fmt == "zarr3" else 4).encode()


def _new_document(fmt: GroupFormat, attrs: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    if fmt == "zarr3":
        return ZARR3_KEY, {"zarr_format": 3, "node_type": "group", "attributes": attrs}
    if fmt == "zarr2":
        return ZGROUP_KEY, {"zarr_format": 2}
    return N5_KEY, attrs


async def create_group(kv: KvStore, fmt: GroupFormat, attributes: Mapping[str, Any] | None = None,
                       *, exist_ok: bool = True) -> GroupNode:
    """Create a group of format ``fmt`` at ``kv`` (create-only), or open the
    group already there (``exist_ok``). An array there is an InvalidSpecError."""
    if fmt not in _FORMAT_NAMES:
        raise InvalidArgumentError(f"group format must be one of {list(_FORMAT_NAMES)}, got {fmt!r}")
    attrs = check_attributes(attributes or {}, f"group at {url_of(kv)}")
    key, doc = _new_document(fmt, attrs)
    for _attempt in range(5):
        found = await node_at(kv)
        if found is not None:
            if found[1] == "array":
                raise InvalidSpecError(f"cannot create a group at {url_of(kv)}: a {_FORMAT_NAMES[found[0]]} "
                                       "array is stored there")
            if not exist_ok:
                raise InvalidSpecError(f"a {_FORMAT_NAMES[found[0]]} group already exists at {url_of(kv)}")
            assert found[2] is not None
            return found[2]
        try:
            await kv.write(key, _encode(fmt)(doc), if_equal=Generation.NO_VALUE)
        except ConditionFailedError:
            continue  # created meanwhile: open it
        if fmt == "zarr2" and attrs:
            await update_group_attributes(kv, fmt, attrs)
        return GroupNode(fmt, attrs)
    raise ConditionFailedError(f"group at {url_of(kv)}: its document kept changing while creating it")


async def update_group_attributes(kv: KvStore, fmt: GroupFormat, changes: Mapping[str, Any], *,
                                  replace: bool = False) -> dict[str, Any]:
    """Set ``changes`` in the group's attributes (every other attribute kept,
    unless ``replace``), atomically; returns the attributes now stored."""
    changes = check_attributes(changes, f"group at {url_of(kv)}")
    url = url_of(kv)

    def change(doc: dict[str, Any] | None) -> dict[str, Any]:
        if fmt == "zarr2":
            return {**({} if replace or doc is None else doc), **changes}
        if doc is None or _kind(ZARR3_KEY if fmt == "zarr3" else N5_KEY, doc) != (fmt, "group"):
            raise NotFoundError(f"{_FORMAT_NAMES[fmt]} group at {url} is gone")
        if fmt == "zarr3":
            current = {} if replace else doc.get("attributes", {})
            return {**doc, "attributes": {**current, **changes}}
        if replace:
            return dict(changes)
        return {**doc, **changes}

    key = {"zarr3": ZARR3_KEY, "zarr2": ZATTRS_KEY, "n5": N5_KEY}[fmt]
    if fmt == "n5" and "dimensions" in changes:
        raise InvalidArgumentError(f"N5 group at {url}: the attribute 'dimensions' would make it an array")
    doc, _gen = await update_json(kv, key, change, encode=_encode(fmt))
    return await _group_attributes(kv, fmt, doc) if fmt != "zarr2" else doc


async def list_members(kv: KvStore) -> dict[str, NodeKind]:
    """The members of the group at ``kv``: direct child folders holding an
    array or a group, name -> "array" | "group", sorted by name. One folder
    listing of the group (``kv.list_folder``: no key below a child is visited),
    then each child's documents read concurrently."""
    try:
        listing = await kv.list_folder("")
    except UnsupportedError as e:
        raise UnsupportedError(f"the members of the group at {url_of(kv)} cannot be listed: {e}") from None
    names = [f[:-1] for f in listing.folders]
    found = await asyncio.gather(*(_member_kind(kv.with_path(n)) for n in names))
    return {n: kind for n, kind in zip(names, found) if kind is not None}


async def _member_kind(kv: KvStore) -> NodeKind | None:
    """What the folder at ``kv`` holds (zarr v3 wins over zarr v2 over N5), or None."""
    node = await _kind_of_documents(kv)
    return None if node is None else node[1]


async def _kind_of_documents(kv: KvStore) -> tuple[GroupFormat, NodeKind] | None:
    """zarr.json first (one read for a zarr v3 member), then the others at once."""
    first = _kind(ZARR3_KEY, _json(await kv.read(ZARR3_KEY), ZARR3_KEY))
    if first is not None:
        return first
    rest = _DOCUMENTS[1:]
    docs = {k: _json(r, k) for k, r in zip(rest, await asyncio.gather(*(kv.read(k) for k in rest)))}
    for key in rest:
        found = _kind(key, docs[key])
        if found is not None:
            return found
    return None


async def not_an_array_error(kv: KvStore, what: str) -> InvalidSpecError | None:
    """The error for opening the group at ``kv`` as an array (naming the path and
    listing its member arrays), or None when no group is there."""
    found = await node_at(kv)
    if found is None or found[1] != "group":
        return None
    url = url_of(kv)
    try:
        members = await list_members(kv)
        arrays = [n for n, k in members.items() if k == "array"]
        groups = [n for n, k in members.items() if k == "group"]
        listing = f"its member arrays: {arrays or 'none'}" + (f"; member groups: {groups}" if groups else "")
    except UnsupportedError:
        listing = "its members cannot be listed on this store"
    return InvalidSpecError(
        f"{what} expected at {url}, but it is a {_FORMAT_NAMES[found[0]]} group, not an array "
        f"({listing}); open a member by its path, or the group with tsp.open_group")
