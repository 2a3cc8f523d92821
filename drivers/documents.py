"""JSON documents that hold attributes: the one read-modify-write, and the
array side of attributes.

Attributes live in a JSON document: zarr v3 ``zarr.json`` (its ``"attributes"``
member, arrays and groups alike), zarr v2 ``.zattrs`` (the whole document, next
to ``.zarray`` / ``.zgroup``), N5 ``attributes.json`` (every member that is not a
dataset field). :func:`update_json` is how any of them changes: read it, change
it, write it back on condition that its generation is unchanged (create-only
when it was missing), and on a lost race read and change it again. So
concurrent updates of different attributes never lose each other, and a
document rewritten meanwhile by someone else (a resize) keeps their change.
"""

from __future__ import annotations

import asyncio
import json
from abc import abstractmethod
from collections.abc import Callable, Mapping
from typing import Any

from tensorstore_py.core.errors import ConditionFailedError, InvalidArgumentError
from tensorstore_py.drivers.chunked_metadata import json_object
from tensorstore_py.drivers.rmw import RMW_RETRY
from tensorstore_py.kvstore.base import Generation, KvStore

__all__ = ["AttributedArray", "check_attributes", "update_json", "url_of"]


def url_of(kv: KvStore) -> str:
    """The store's URL for messages (its repr where it has no URL form)."""
    try:
        return kv.url()
    except Exception:
        return repr(kv)


def check_attributes(attrs: Any, where: str) -> dict[str, Any]:
    """``attrs`` as a fresh JSON object: a mapping with string keys whose values
    JSON can encode (InvalidArgumentError naming ``where`` otherwise)."""
    if not isinstance(attrs, Mapping) or not all(isinstance(k, str) for k in attrs):
        raise InvalidArgumentError(f"{where}: attributes must be a dict with str keys, got {attrs!r}")
    try:
        return json.loads(json.dumps(dict(attrs), allow_nan=True))
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(f"{where}: attributes are not JSON-encodable: {e}") from None


async def update_json(
    kv: KvStore, key: str, change: Callable[[dict[str, Any] | None], dict[str, Any]], *,
    encode: Callable[[dict[str, Any]], bytes],
) -> tuple[dict[str, Any], Generation]:
    """Read-modify-write of the JSON object stored at ``key``.

    ``change(doc)`` gets the stored object (None when the key is missing) and
    returns the new one (it may raise to refuse, e.g. NotFoundError); ``encode``
    gives its bytes. The write is conditioned on the generation read (create-only
    for a missing key) and retried on a lost race, so it is atomic: the stored
    document is exactly ``change`` applied to a value nobody changed in between.
    Returns the new document and its generation.
    """
    for attempt in range(1, RMW_RETRY.max_attempts + 1):
        res = await kv.read(key)
        doc = json_object(res.value, key) if res.state == "value" else None
        new = change(doc)
        try:
            gen = await kv.write(key, encode(new), if_equal=res.generation)
        except ConditionFailedError:
            await asyncio.sleep(RMW_RETRY.delay(attempt))  # someone else changed it: again
            continue
        return new, gen
    raise ConditionFailedError(f"{key!r}: update lost the race {RMW_RETRY.max_attempts} times")


class AttributedArray:
    """Array attributes for a chunked array format (a mixin of ``ChunkedArray``
    subclasses).

    A format says where its attributes live (``attributes_key``: None for the
    metadata document itself) and how to take them from and put them into that
    document (:meth:`attributes_in`, :meth:`with_attributes`). Reading them is
    free: they are those of the documents the array was opened with (or last
    updated through it). :meth:`update_attributes` is an atomic
    read-modify-write of the stored document (see :func:`update_json`).
    """

    driver: str
    kvstore: KvStore
    metadata_key: str
    _metadata: dict[str, Any]
    #: the document holding the attributes (None: the metadata document)
    attributes_key: str | None = None
    #: the stored attributes document when it is not the metadata document
    _attributes_doc: dict[str, Any] | None = None

    @staticmethod
    @abstractmethod
    def attributes_in(doc: dict[str, Any] | None) -> dict[str, Any]:
        """The user attributes held by the stored document ``doc`` (None: missing)."""

    @staticmethod
    @abstractmethod
    def with_attributes(doc: dict[str, Any] | None, attrs: dict[str, Any], *, key: str) -> dict[str, Any]:
        """``doc`` holding ``attrs`` as its user attributes (everything else kept);
        NotFoundError naming ``key`` where the document must exist but does not."""

    @staticmethod
    def encode_attributes(doc: dict[str, Any]) -> bytes:
        """The stored bytes of a separate attributes document."""
        return json.dumps(doc, indent=4, sort_keys=True).encode()

    @property
    def attributes(self) -> dict[str, Any]:
        """The user attributes, as of opening (or this array's last update); a copy."""
        doc = self._metadata if self.attributes_key is None else self._attributes_doc
        return json.loads(json.dumps(self.attributes_in(doc)))

    async def update_attributes(self, changes: Mapping[str, Any], *, replace: bool = False) -> dict[str, Any]:
        """Set the attributes in ``changes`` (all others kept, unless ``replace``),
        atomically (see :func:`update_json`); returns the attributes now stored."""
        key = self.attributes_key or self.metadata_key
        changes = check_attributes(changes, f"{self.driver} array at {key!r}")

        def change(doc: dict[str, Any] | None) -> dict[str, Any]:
            current = {} if replace else self.attributes_in(doc)
            return self.with_attributes(doc, {**current, **changes}, key=key)

        if self.attributes_key is None:
            doc, _gen = await update_json(self.kvstore, key, change, encode=self.encode_metadata)  # type: ignore[attr-defined]
            # the rest of our metadata stays as opened (a concurrent resize is not ours to see)
            self._metadata = self.with_attributes(self._metadata, self.attributes_in(doc), key=key)
        else:
            doc, _gen = await update_json(self.kvstore, key, change, encode=self.encode_attributes)
            self._attributes_doc = doc
        return self.attributes
