"""The value types of ``verify``: one :class:`Problem` per thing found wrong."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Problem", "VerifyReport"]


@dataclass(frozen=True)
class Problem:
    """One thing wrong, named as precisely as known.

    ``kind``: ``checksum`` (a crc32c mismatch), ``missing`` (a referenced object
    or a chunk is absent), ``truncated``, ``corrupt`` (an object that does not
    decode), ``decode`` (a chunk that does not decode), ``shape`` (a chunk or
    array that does not have the declared shape/size), ``metadata``,
    ``reference`` (a malformed reference), ``format``, ``stray`` (a key where
    none belongs in a checkpoint leaf's folder: any key of a packed leaf, a key
    that is no chunk of the grid otherwise).
    """

    kind: str
    message: str
    object: str | None = None
    key: str | None = None
    array: str | None = None
    chunk: str | None = None
    version: int | None = None
    expected: Any = None
    found: Any = None

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass
class VerifyReport:
    """What ``verify`` checked and what it found; ``ok`` when nothing is wrong."""

    url: str
    kind: str
    versions: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    arrays: int = 0
    chunks: int = 0
    objects: int = 0
    values: int = 0
    #: bytes read from storage (the store walk, and the chunks read to decode them)
    bytes_read: int = 0
    #: stored bytes checked, each once: against a crc32c (records, index nodes,
    #: values of a versioned store) or by decoding (chunks of plain arrays)
    bytes_verified: int = 0
    seconds: float = 0.0
    problems: list[Problem] = field(default_factory=list)
    #: objects of a versioned store no retained version references (not a
    #: problem: interrupted writes, deleted versions; ``gc`` deletes them)
    unreferenced: int = 0
    unreferenced_bytes: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {
            "url": self.url, "kind": self.kind, "ok": self.ok, "versions": self.versions,
            "steps": self.steps, "arrays": self.arrays, "chunks": self.chunks,
            "objects": self.objects, "values": self.values, "bytes_read": self.bytes_read,
            "bytes_verified": self.bytes_verified, "bytes": self.bytes_verified,
            "seconds": round(self.seconds, 3),
            "problems": [p.to_json() for p in self.problems],
            "unreferenced": {"objects": self.unreferenced, "bytes": self.unreferenced_bytes},
        }
