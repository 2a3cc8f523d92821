"""Encoding of the versioned store's objects (docs/FORMAT.md, format 2; format 1 reads).

Every metadata object is framed as ``magic(4) | msgpack body | crc32c(magic+body)``
(little-endian uint32). This module holds the framing, the object names, the
entry encoding and strict validation of everything decoded, so the rest of the
package never touches raw bytes of metadata.
"""

from __future__ import annotations

import os
import re
import struct
import uuid
from dataclasses import dataclass, field
from typing import Any

import crc32c as _crc32c
import msgpack

from tensorstore_py.core.errors import ChecksumError, DataCorruptionError
from tensorstore_py.kvstore.ids import check_id as check_id  # re-export (the rule lives in kvstore.ids)

__all__ = [
    "FORMAT",
    "READABLE_FORMATS",
    "CommitRecord",
    "Entry",
    "InlineEntry",
    "RefEntry",
    "check_ref",
    "commit_name",
    "crc32c",
    "frame",
    "new_name",
    "new_stamp",
    "new_write_id",
    "unframe",
]

#: the format this code writes (docs/FORMAT.md)
FORMAT = 2
#: the formats this code reads: a format-1 store reads exactly as before, and
#: new commits on it are format 2 (nothing of format 1 is rewritten)
READABLE_FORMATS = (1, 2)

MAGIC_NODE = b"TSN1"
MAGIC_COMMIT = b"TSC1"
MAGIC_CHANGES = b"TSK1"
MAGIC_FRAGMENT = b"TSF1"
MAGIC_RESULT = b"TSR1"
MAGIC_HINT = b"TSL1"
MAGIC_ATTEMPT = b"TSA1"

HINT_NAME = "latest"
COMMITS_PREFIX = "commits/"
VERSION_DIGITS = 20
STAMP_LEN = 12
#: commits changing more keys than this keep their key list in a changes object
MAX_INLINE_CHANGES = 1024

_CRC = struct.Struct("<I")
_REF_RE = {
    "data": re.compile(r"data/[0-9a-f]{32}\Z"),
    "nodes": re.compile(r"nodes/[0-9a-f]{32}\Z"),
    "changes": re.compile(r"changes/[0-9a-f]{32}\Z"),
}


def crc32c(data: Any) -> int:
    """crc32c (Castagnoli) of a bytes-like object, as an unsigned int."""
    return int(_crc32c.crc32c(data))


def frame(magic: bytes, body: Any) -> bytes:
    """``magic | msgpack(body) | crc32c`` (see FORMAT.md §4.1)."""
    payload = magic + msgpack.packb(body, use_bin_type=True)
    return payload + _CRC.pack(crc32c(payload))


def unframe(magic: bytes, data: Any, name: str) -> Any:
    """Verify and decode a framed object; errors name the object ``name``."""
    mv = memoryview(data).cast("B")
    if len(mv) < 8:
        raise ChecksumError(
            f"versioned store: object {name!r} is truncated ({len(mv)} bytes, expected >= 8)"
        )
    if bytes(mv[:4]) != magic:
        raise ChecksumError(
            f"versioned store: object {name!r} has magic {bytes(mv[:4])!r}, expected {magic!r}"
        )
    (stored,) = _CRC.unpack(mv[-4:])
    actual = crc32c(mv[:-4])
    if stored != actual:
        raise ChecksumError(
            f"versioned store: object {name!r}: crc32c mismatch "
            f"(stored {stored:#010x}, computed {actual:#010x})"
        )
    try:
        return msgpack.unpackb(mv[4:-4], raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types
        raise DataCorruptionError(f"versioned store: object {name!r} does not decode: {e}") from e


def commit_name(version: int) -> str:
    return f"{COMMITS_PREFIX}{version:0{VERSION_DIGITS}d}"


def new_name(kind: str) -> str:
    """A fresh unique object name ``<kind>/<hex32>``."""
    return f"{kind}/{uuid.uuid4().hex}"


def new_write_id() -> str:
    return uuid.uuid4().hex


def new_stamp() -> bytes:
    return os.urandom(STAMP_LEN)


def check_ref(kind: str, ref: Any, where: str) -> str:
    """Return ``ref`` if it is a well-formed ``<kind>/<hex32>`` name, else raise."""
    if not isinstance(ref, str) or not _REF_RE[kind].match(ref):
        raise DataCorruptionError(
            f"versioned store: {where} references {ref!r}, expected a '{kind}/<32 hex>' object"
        )
    return ref


# -- entries --------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class InlineEntry:
    """A value stored inside the index node."""

    stamp: bytes
    value: bytes

    def encode(self) -> list[Any]:
        return [self.stamp, self.value]


@dataclass(frozen=True, slots=True)
class RefEntry:
    """A value stored in a data object at ``[offset, offset + length)``."""

    stamp: bytes
    object: str
    offset: int
    length: int
    crc: int

    def encode(self) -> list[Any]:
        return [self.stamp, self.object, self.offset, self.length, self.crc]


Entry = InlineEntry | RefEntry


def decode_entry(raw: Any, where: str) -> Entry:
    """Decode and validate one entry (FORMAT.md §4.2)."""
    if isinstance(raw, list) and len(raw) == 2:
        stamp, value = raw
        if isinstance(stamp, bytes) and isinstance(value, bytes):
            return InlineEntry(stamp, value)
    elif isinstance(raw, list) and len(raw) == 5:
        stamp, obj, off, length, crc = raw
        if (
            isinstance(stamp, bytes)
            and all(isinstance(x, int) and not isinstance(x, bool) for x in (off, length, crc))
            and off >= 0 and length >= 0 and 0 <= crc < 2**32
        ):
            return RefEntry(stamp, check_ref("data", obj, where), off, length, crc)
    raise DataCorruptionError(f"versioned store: {where}: malformed entry {raw!r:.200}")


# -- commit records -------------------------------------------------------------
@dataclass(frozen=True)
class CommitRecord:
    """The decoded body of ``commits/<version>`` (FORMAT.md §5.1)."""

    version: int
    parent: int
    time: float
    write_id: str
    message: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    root: str | None = None
    count: int = 0
    changes: list[str] | None = field(default_factory=list)
    changes_ref: str | None = None
    kind: str = "data"
    tags: dict[str, int] = field(default_factory=dict)
    deleted: list[list[int]] = field(default_factory=list)
    txn_id: str | None = None
    #: the multi-writer attempt that committed (format 2; None otherwise)
    txn_nonce: str | None = None

    def encode(self) -> bytes:
        return frame(
            MAGIC_COMMIT,
            {
                "format": FORMAT,
                "version": self.version,
                "parent": self.parent,
                "time": self.time,
                "write_id": self.write_id,
                "message": self.message,
                "metadata": self.metadata,
                "root": self.root,
                "count": self.count,
                "changes": self.changes,
                "changes_ref": self.changes_ref,
                "kind": self.kind,
                "tags": self.tags,
                "deleted": self.deleted,
                "txn_id": self.txn_id,
                "txn_nonce": self.txn_nonce,
            },
        )

    @staticmethod
    def decode(data: Any, name: str) -> CommitRecord:
        """The record stored as ``data``; DataCorruptionError naming ``name``
        for anything but the documented fields with their documented types."""
        body = unframe(MAGIC_COMMIT, data, name)

        def get(field: str, kind: type | tuple[type, ...], default: Any = None, *,
                required: bool = False) -> Any:
            """``body[field]`` if of ``kind`` (never a bool for numbers), else TypeError."""
            v = body.get(field)
            if v is None:
                if required:
                    raise KeyError(field)
                return default
            if not isinstance(v, kind) or (isinstance(v, bool) and bool not in (
                    kind if isinstance(kind, tuple) else (kind,))):
                raise TypeError(f"field {field!r} is {v!r:.100}, not of type {kind}")
            return v

        try:
            if not isinstance(body, dict):
                raise TypeError("body is not a map")
            if body.get("format") not in READABLE_FORMATS or isinstance(body.get("format"), bool):
                raise ValueError(
                    f"format {body.get('format')!r}, expected {FORMAT} at most (this code reads "
                    f"formats {list(READABLE_FORMATS)})"
                )
            tags = get("tags", dict, {})
            if not all(isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
                       for k, v in tags.items()):
                raise TypeError(f"field 'tags' is {tags!r:.100}, not a map of tag -> version")
            deleted = get("deleted", list, [])
            if not all(isinstance(r, list) and len(r) == 2 and all(
                    isinstance(x, int) and not isinstance(x, bool) for x in r) for r in deleted):
                raise TypeError(f"field 'deleted' is {deleted!r:.100}, not a list of [first, last]")
            rec = CommitRecord(
                version=get("version", int, required=True),
                parent=get("parent", int, required=True),
                time=float(get("time", (int, float), required=True)),
                write_id=get("write_id", str, required=True),
                message=get("message", str, ""),
                metadata=get("metadata", dict, {}),
                root=get("root", str),
                count=get("count", int, 0),
                changes=get("changes", list),
                changes_ref=get("changes_ref", str),
                kind=get("kind", str, "data"),
                tags=dict(tags),
                deleted=[list(r) for r in deleted],
                txn_id=get("txn_id", str),
                txn_nonce=get("txn_nonce", str),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise DataCorruptionError(
                f"versioned store: commit record {name!r} is malformed: {e}"
            ) from e
        if rec.root is not None:
            check_ref("nodes", rec.root, f"commit record {name!r}")
        if rec.changes_ref is not None:
            check_ref("changes", rec.changes_ref, f"commit record {name!r}")
        elif not isinstance(rec.changes, list) or not all(isinstance(k, str) for k in rec.changes):
            raise DataCorruptionError(
                f"versioned store: commit record {name!r}: 'changes' must be a list of keys"
            )
        if name.startswith(COMMITS_PREFIX) and commit_name(rec.version) != name:
            raise DataCorruptionError(
                f"versioned store: commit record {name!r} says version {rec.version}"
            )
        return rec


# -- deleted-version ranges ------------------------------------------------------
def ranges_contain(ranges: list[list[int]], v: int) -> bool:
    return any(a <= v <= b for a, b in ranges)


def ranges_add(ranges: list[list[int]], versions: list[int]) -> list[list[int]]:
    """``ranges`` plus ``versions``, normalised (sorted, disjoint, non-adjacent)."""
    points = sorted(set(versions))
    allr = sorted([list(r) for r in ranges] + [[v, v] for v in points])
    out: list[list[int]] = []
    for a, b in allr:
        if out and a <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out
