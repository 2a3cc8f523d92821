"""``tsp.open_group`` and :class:`Group`: zarr v3 / v2 (and N5) groups, their
attributes and their members.

::

    root = tsp.open_group("file:///data/ds/", create=True).result()      # zarr v3
    root.update_attrs({"title": "scan 7"}).result()
    t = root.create_array("time", shape=[10], dtype="int64", dimension_names=["time"]).result()
    sub = root.create_group("labels").result()
    root.members().result()          # {"labels": "group", "time": "array"}
    root.open("time").result()       # a TensorStore

The documents are those of drivers/groups.py; zarr-python, xarray and
TensorStore read what this module writes. Guarantees: creating a group is
create-only on its document (two concurrent creators end with one group);
``update_attrs`` / ``set_attrs`` are atomic read-modify-writes of the document
holding the attributes (conditioned on its generation, retried on a lost race),
so concurrent updates of different attributes are never lost.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tensorstore_py.context import Context
from tensorstore_py.core.errors import InvalidArgumentError, InvalidSpecError, NotFoundError
from tensorstore_py.core.future import Future, spawn
from tensorstore_py.drivers.documents import url_of
from tensorstore_py.drivers.groups import (
    ARRAY_DRIVER,
    GroupFormat,
    GroupNode,
    NodeKind,
    create_group,
    list_members,
    node_at,
    update_group_attributes,
)
from tensorstore_py.kvstore.base import KvStore, validate_prefix
from tensorstore_py.kvstore.registry import open_kvstore
from tensorstore_py.opening import open as open_array
from tensorstore_py.tensorstore import TensorStore

__all__ = ["Group", "open_group"]

_ZARR_FORMATS: dict[int, GroupFormat] = {3: "zarr3", 2: "zarr2"}


class Group:
    """An open group: its store, format and attributes (see the module doc)."""

    __slots__ = ("_context", "_kv", "_node")

    def __init__(self, kvstore: KvStore, node: GroupNode, context: Context | None = None) -> None:
        self._kv, self._node, self._context = kvstore, node, context

    @property
    def kvstore(self) -> KvStore:
        return self._kv

    @property
    def format(self) -> GroupFormat:
        """``"zarr3"``, ``"zarr2"`` or ``"n5"``."""
        return self._node.format

    @property
    def zarr_format(self) -> int | None:
        """3 or 2 for zarr groups, None for N5."""
        return {"zarr3": 3, "zarr2": 2}.get(self._node.format)

    @property
    def attrs(self) -> dict[str, Any]:
        """The group's attributes as of opening (or this object's last update); a copy."""
        return dict(self._node.attributes)

    def update_attrs(self, changes: Mapping[str, Any]) -> Future[dict[str, Any]]:
        """Set the attributes in ``changes``, keeping the others (atomic, see
        the module doc). Resolves to the attributes now stored."""
        return spawn(self._update(changes, replace=False))

    def set_attrs(self, attrs: Mapping[str, Any]) -> Future[dict[str, Any]]:
        """Replace all attributes by ``attrs`` (atomic). Resolves to them."""
        return spawn(self._update(attrs, replace=True))

    async def _update(self, changes: Mapping[str, Any], *, replace: bool) -> dict[str, Any]:
        attrs = await update_group_attributes(self._kv, self._node.format, changes, replace=replace)
        self._node = GroupNode(self._node.format, attrs)
        return dict(attrs)

    def members(self) -> Future[dict[str, NodeKind]]:
        """Member name -> ``"array"`` or ``"group"``, sorted by name, found by
        listing the group's folder by delimiter (one directory on a local disk, one
        request per page of children on GCS and S3; no key below a member is visited),
        then reading each child's documents (UnsupportedError on a store that cannot list)."""
        return spawn(list_members(self._kv))

    def open(self, name: str) -> Future[TensorStore | Group]:
        """The member array (a TensorStore) or group at ``name`` (``"a/b"`` for
        a nested one); NotFoundError when there is neither."""
        return spawn(self._open_member(name, self._child(name)))

    async def _open_member(self, name: str, kv: KvStore) -> TensorStore | Group:
        found = await node_at(kv)
        if found is None:
            raise NotFoundError(f"group at {url_of(self._kv)} has no member {name!r}")
        fmt, kind, node = found
        if kind == "group":
            assert node is not None
            return Group(kv, node, self._context)
        # the opened store itself, not its spec: a memory store reopened by spec is another store
        return await open_array({"driver": ARRAY_DRIVER[fmt], "kvstore": kv}, context=self._context)

    def create_group(self, name: str, *, attributes: Mapping[str, Any] | None = None) -> Future[Group]:
        """Create the member group ``name`` in this group's format (or open it if
        it exists; InvalidSpecError if an array is there)."""
        kv = self._child(name)

        async def run() -> Group:
            return Group(kv, await create_group(kv, self._node.format, attributes), self._context)

        return spawn(run())

    def create_array(
        self, name: str, *, shape: Sequence[int], dtype: Any, driver: str | None = None,
        chunks: Sequence[int] | None = None, shards: Sequence[int] | None = None, codecs: Any = None,
        compression: Any = None, fill_value: Any = None,
        dimension_names: Sequence[str | None] | None = None, order: str = "C",
        attributes: Mapping[str, Any] | None = None, delete_existing: bool = False,
    ) -> Future[TensorStore]:
        """Create the member array ``name`` with ``tsp.open(..., create=True)``'s
        options (an existing compatible array is opened). ``driver`` defaults to
        the group's format; ``attributes`` are stored after creation."""
        kv = self._child(name)

        async def run() -> TensorStore:
            ts = await open_array(
                {"driver": driver or ARRAY_DRIVER[self._node.format], "kvstore": kv}, create=True,
                delete_existing=delete_existing, context=self._context, shape=shape, dtype=dtype,
                chunks=chunks, shards=shards, codecs=codecs, compression=compression,
                fill_value=fill_value, dimension_names=dimension_names, order=order)
            if attributes:
                await ts.update_attributes(attributes)
            return ts

        return spawn(run())

    def _child(self, name: str) -> KvStore:
        if not isinstance(name, str) or not name.strip("/") or name.startswith("/"):
            raise InvalidArgumentError(f"member name must be a relative path like 'a' or 'a/b', got {name!r}")
        validate_prefix(name)
        return self._kv.with_path(name.strip("/"))

    def __repr__(self) -> str:
        return f"Group({self._node.format}, {url_of(self._kv)!r}, attrs={self._node.attributes!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickles as its store (and Context): unpickling reopens the group."""
        return (_unpickle_group, (self._kv, self._context))


def _unpickle_group(kv: KvStore, context: Context | None) -> Group:
    return open_group(kv, context=context).result()


def open_group(spec: str | Mapping[str, Any] | KvStore, *, create: bool = False,
               zarr_format: int | None = None, context: Context | None = None) -> Future[Group]:
    """Open the group at ``spec`` (a URL or kvstore spec): zarr v3, zarr v2 or N5,
    whichever is stored there.

    ``create=True`` creates a zarr group when nothing is there (``zarr_format``
    3 by default, or 2); an existing group is opened, and must have
    ``zarr_format`` if one is given. An array there raises InvalidSpecError;
    nothing there without ``create`` raises NotFoundError.
    """
    if zarr_format is not None and zarr_format not in _ZARR_FORMATS:
        raise InvalidArgumentError(f"zarr_format must be 3 or 2, got {zarr_format!r}")

    async def run() -> Group:
        bound = context.bind_kvstore(spec) if context is not None else spec  # memory:// per Context
        kv = bound if isinstance(bound, KvStore) else await open_kvstore(bound)
        found = await node_at(kv)
        if found is None:
            if not create:
                raise NotFoundError(f"open_group: no group at {url_of(kv)} (no zarr.json, .zgroup or "
                                    "attributes.json)")
            return Group(kv, await create_group(kv, _ZARR_FORMATS[zarr_format or 3]), context)
        fmt, kind, node = found
        if kind == "array":
            raise InvalidSpecError(f"open_group: {url_of(kv)} is an array ({fmt}), not a group; open it "
                                   "with tsp.open")
        if zarr_format is not None and fmt != _ZARR_FORMATS[zarr_format]:
            raise InvalidSpecError(f"open_group: the group at {url_of(kv)} is {fmt}, not zarr v{zarr_format}")
        assert node is not None
        return Group(kv, node, context)

    return spawn(run())
