"""The objects of multi-writer transactions (docs/FORMAT.md §7): names, bodies, checks.

Under ``txns/<txn_id>/``::

    attempts/<k:06d>            an attempt of process 0 (create-only; k = 1, 2, ...)
    <k:06d>-<nonce>/<i:06d>     participant i's fragment for attempt k
    <k:06d>-<nonce>/failed      why attempt k committed nothing
    result                      the commit (written once it is visible; stays)

Everything is framed like every other metadata object (FORMAT.md §4.1) and
validated when decoded, so :mod:`.multiwriter` never touches raw bytes.
"""

from __future__ import annotations

import heapq
import itertools
import json
import re
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from tensorstore_py.core.errors import DataCorruptionError, InvalidArgumentError, ParticipantFailedError
from tensorstore_py.kvstore.versioned.format import (
    FORMAT,
    MAGIC_ATTEMPT,
    MAGIC_FRAGMENT,
    MAGIC_RESULT,
    decode_entry,
    frame,
    unframe,
)
from tensorstore_py.kvstore.versioned.tree import Change

__all__ = [
    "Attempt", "Fragment", "attempt_name", "attempts_prefix", "decode_attempt", "decode_fragment",
    "decode_outcome", "encode_attempt", "encode_fragment", "encode_outcome", "failed_name",
    "fragment_key", "fragment_name", "fragments_prefix", "merge_fragments", "participant_failed",
    "participant_failure", "result_name", "txn_prefix",
]

_NONCE_RE = re.compile(r"[0-9a-f]{32}\Z")


def txn_prefix(txn_id: str) -> str:
    return f"txns/{txn_id}/"


def attempts_prefix(txn_id: str) -> str:
    return f"txns/{txn_id}/attempts/"


def attempt_name(txn_id: str, attempt: int) -> str:
    return f"{attempts_prefix(txn_id)}{attempt:06d}"


def fragments_prefix(txn_id: str, attempt: int, nonce: str) -> str:
    return f"txns/{txn_id}/{attempt:06d}-{nonce}/"


def fragment_name(txn_id: str, attempt: int, nonce: str, index: int) -> str:
    return f"{fragments_prefix(txn_id, attempt, nonce)}{index:06d}"


def failed_name(txn_id: str, attempt: int, nonce: str) -> str:
    return f"{fragments_prefix(txn_id, attempt, nonce)}failed"


def result_name(txn_id: str) -> str:
    return f"txns/{txn_id}/result"


def _bad(name: str, what: str) -> DataCorruptionError:
    return DataCorruptionError(f"versioned store: {name!r} {what}")


@dataclass(frozen=True)
class Attempt:
    """One attempt of a multi-writer transaction, opened by process 0.

    ``since``: no version at or below it commits this transaction (the newest
    version when the transaction's first attempt was opened), so a search for
    its commit record starts above it.
    """

    txn_id: str
    number: int
    nonce: str
    count: int
    since: int
    time: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"txn_id": self.txn_id, "attempt": self.number, "nonce": self.nonce,
                "count": self.count, "since": self.since, "time": self.time}

    @staticmethod
    def from_json(body: Any, name: str) -> Attempt:
        try:
            a = Attempt(str(body["txn_id"]), int(body["attempt"]), str(body["nonce"]),
                        int(body["count"]), int(body["since"]), float(body.get("time") or 0.0))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise _bad(name, f"is not a multi-writer attempt ({e})") from e
        if not _NONCE_RE.match(a.nonce) or a.number < 1 or a.count < 1 or a.since < 0:
            raise _bad(name, f"is not a well-formed attempt: {body!r:.200}")
        return a


def encode_attempt(a: Attempt) -> bytes:
    return frame(MAGIC_ATTEMPT, {"format": FORMAT, **a.to_json()})


def decode_attempt(data: Any, name: str, txn_id: str) -> Attempt:
    a = Attempt.from_json(unframe(MAGIC_ATTEMPT, data, name), name)
    if a.txn_id != txn_id or name != attempt_name(txn_id, a.number):
        raise _bad(name, f"holds attempt {a.number} of transaction {a.txn_id!r}")
    return a


@dataclass(frozen=True)
class Fragment:
    """One participant's part of an attempt: its changes and (serializable) reads."""

    index: int
    base: int
    changes: list[Change]
    reads: list[str] = field(default_factory=list)
    read_prefixes: list[str] = field(default_factory=list)


def encode_fragment(txn_id: str, a: Attempt, write_id: str, f: Fragment) -> bytes:
    return frame(
        MAGIC_FRAGMENT,
        {
            "format": FORMAT,
            "txn_id": txn_id,
            "attempt": a.number,
            "nonce": a.nonce,
            "index": f.index,
            "count": a.count,
            "base": f.base,
            "write_id": write_id,
            "keys": [k for k, _ in f.changes],
            "entries": [None if e is None else e.encode() for _, e in f.changes],
            "reads": sorted(f.reads),
            "read_prefixes": sorted(f.read_prefixes),
        },
    )


def _strings(v: Any) -> TypeGuard[list[str]]:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def decode_fragment(data: Any, name: str, a: Attempt, index: int) -> Fragment:
    """A fragment of participant ``index`` for attempt ``a``, validated (a fragment
    of another attempt, participant or transaction is refused)."""
    body = unframe(MAGIC_FRAGMENT, data, name)
    ident = {"txn_id": a.txn_id, "attempt": a.number, "nonce": a.nonce, "index": index, "count": a.count}
    if not isinstance(body, dict) or any(body.get(k) != v for k, v in ident.items()):
        found = {k: body.get(k) for k in ident} if isinstance(body, dict) else body
        raise _bad(name, f"is not participant {index}'s fragment of attempt {a.number} ({a.nonce}) of "
                         f"transaction {a.txn_id!r} with {a.count} processes (found {found!r:.200})")
    keys, entries, base = body.get("keys"), body.get("entries"), body.get("base")
    reads, prefixes = body.get("reads", []), body.get("read_prefixes", [])
    if (
        not _strings(keys) or not isinstance(entries, list) or len(keys) != len(entries)
        or not isinstance(base, int) or not _strings(reads) or not _strings(prefixes)
    ):
        raise _bad(name, "is a malformed fragment")
    if any(a >= b for a, b in itertools.pairwise(keys)):
        raise _bad(name, "is a fragment whose keys are not sorted")
    where = f"fragment {name!r}"
    changes = [(k, None if e is None else decode_entry(e, where)) for k, e in zip(keys, entries)]
    return Fragment(index, base, changes, reads, prefixes)


def encode_outcome(txn_id: str, a: Attempt | None, outcome: dict[str, Any]) -> bytes:
    """A ``result`` or ``failed`` object: ``outcome`` has version, write_id, time, error, message."""
    return frame(MAGIC_RESULT, outcome_body(txn_id, a, outcome))


def outcome_body(txn_id: str, a: Attempt | None, outcome: dict[str, Any]) -> dict[str, Any]:
    return {"format": FORMAT, "txn_id": txn_id, "attempt": a.number if a else None,
            "nonce": a.nonce if a else None, **outcome}


def decode_outcome(data: Any, name: str) -> dict[str, Any]:
    """A result / failed body (format 1 or 2): a map with ``version`` (int or None) and ``error``."""
    body = unframe(MAGIC_RESULT, data, name)
    if not isinstance(body, dict):
        raise _bad(name, "is a malformed result")
    return check_outcome(body, name)


def fragment_key(txn_id: str, index: int) -> str:
    """The coordination-object key where participant ``index`` announces its fragment
    (the fragment's object name) or its failure (:func:`participant_failure`)."""
    return f"tsp/{txn_id}/fragment/{index}"


def participant_failure(index: int, error: BaseException) -> str:
    """What participant ``index`` publishes under :func:`fragment_key` instead of a
    fragment name when it fails before delivering one (JSON; object names never
    start with ``{``), so that process 0 stops waiting for it."""
    message = str(error) or "abandoned (cancelled)"
    return json.dumps({"failed": {"process": index, "error": type(error).__name__, "message": message}})


def participant_failed(txn_id: str, count: int, value: str) -> ParticipantFailedError | None:
    """The error that a value published under :func:`fragment_key` announces, or
    None when it is a fragment name."""
    if not value.startswith("{"):
        return None
    try:
        body = json.loads(value)["failed"]
        index, error, message = int(body["process"]), str(body["error"]), str(body["message"])
    except (ValueError, KeyError, TypeError):
        raise _bad(f"tsp/{txn_id}/fragment", f"announces a malformed failure: {value!r:.200}") from None
    return ParticipantFailedError(
        f"multi-writer transaction {txn_id!r}: process {index} of {count} failed before delivering "
        f"its part ({error}: {message}); nothing was committed",
        process_index=index, cause=error,
    )


def check_outcome(body: Any, where: str) -> dict[str, Any]:
    """Validate an outcome map (from the store or the coordination object)."""
    version, error = body.get("version") if isinstance(body, dict) else None, None
    if isinstance(body, dict):
        error = body.get("error")
    if (
        not isinstance(body, dict) or (version is None) == (error is None)
        or not (version is None or (isinstance(version, int) and version >= 1))
        or not (error is None or isinstance(error, str))
    ):
        raise _bad(where, f"is not a multi-writer outcome: {body!r:.200}")
    return body


def merge_fragments(parts: list[tuple[int, list[Change]]]) -> list[Change]:
    """Merge sorted fragments into one sorted change list; a key in two -> error.

    ``parts`` are (participant index, changes) pairs.
    """
    merged: list[Change] = []
    owner: list[int] = []
    streams = [[(k, i, e) for k, e in ch] for i, ch in parts]
    for k, i, e in heapq.merge(*streams, key=lambda t: t[0]):
        if merged and merged[-1][0] == k:
            raise InvalidArgumentError(
                f"multi-writer transaction: key {k!r} written by both participant {owner[-1]} and {i}; "
                f"each key must be written by exactly one process"
            )
        merged.append((k, e))
        owner.append(i)
    return merged
