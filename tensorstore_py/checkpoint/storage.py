"""Steps of one checkpoint root: one versioned store, one commit per step.

A checkpoint root is ONE versioned kvstore (docs/FORMAT.md) over the user's
store (``file://``, ``gs://``, ``memory://`` ...). Keys inside it::

    steps/<step:012d>                  the step record (JSON: time, metrics, sizes)
    <step:012d>/manifest.json          tree structure + every leaf's layout
    <step:012d>/a/<leaf>/zarr.json     each array leaf is a zarr v3 array ...
    <step:012d>/a/<leaf>/c/<i>/<j>     ... whose chunks are raw C-order bytes

Guarantees:

* A save is ONE transaction (multi-writer across processes: each process
  writes its own chunks, process 0 merges the fragments) and so ONE commit:
  the step record and every chunk become visible together, or not at all.
  ``list_steps`` and every reader see whole steps only, whichever process dies
  when. The step record is written create-only, so a step can not be saved
  twice.
* Deleting steps is one commit (their keys vanish together). Retention then
  retires every older, untagged version and runs the versioned store's prompt
  reclaim (``kvstore.versioned.gc.reclaim``): every object reachable only from
  deleted versions (the deleted steps' data -- every process's -- and index
  nodes) is deleted at once, so the space comes back right away, at a cost
  that does not grow with the number of saves. Objects of versions still
  tagged are kept, and so are those of a version a reader holds (a restore or
  an ``open_array`` view leases the version it reads, so it keeps reading a
  kept step -- or even a deleted one -- until it is done; the next retention
  frees them). Unreferenced objects of unknown origin (a failed save) are
  deleted after the grace period by a full collection the reclaim runs at
  most once a day; a save in flight is never robbed (its writer lease).
* Deleting is idempotent: steps another process deleted meanwhile are
  skipped, so two managers retaining on one root at once both succeed.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tensorstore_py.core.errors import (
    ConditionFailedError,
    ConflictError,
    DataCorruptionError,
    InvalidArgumentError,
    NotFoundError,
    UnsupportedError,
)
from tensorstore_py.kvstore.base import ByteRange, KvStore
from tensorstore_py.kvstore.transaction import Transaction
from tensorstore_py.kvstore.versioned import VersionedKvStore
from tensorstore_py.kvstore.versioned.gc import DEFAULT_READ_GRACE
from tensorstore_py.kvstore.versioned.gc import reclaim as gc_reclaim
from tensorstore_py.kvstore.versioned.info import copied_into

__all__ = [
    "FORMAT", "STEPS_PREFIX", "StepInfo", "StepStore", "check_step", "checked_metrics", "list_steps", "read_spans",
    "record_key", "step_dir",
]


def check_step(step: Any) -> None:
    """InvalidArgumentError unless ``step`` is an int >= 0 (a bool is not)."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise InvalidArgumentError(f"checkpoint step must be an int >= 0, got {step!r}")


def checked_metrics(step: int, metrics: Mapping[str, Any] | None) -> dict[str, Any]:
    """A copy of ``metrics`` (None: empty); InvalidArgumentError naming the step
    unless it is JSON-able (it goes into the step record)."""
    out = dict(metrics or {})
    try:
        json.dumps(out)
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(f"checkpoint step {step}: metrics must be JSON-able: {e}") from e
    return out

log = logging.getLogger("tensorstore_py.checkpoint")

FORMAT = "tensorstore_py.checkpoint/1"
#: attempts of a step deletion that conflicts with another process deleting too
#: (and of leasing the newest version while retention keeps deleting it)
_ATTEMPTS = 4
_W = 12  # digits of a step in keys (sorted listing == numeric order)
STEPS_PREFIX = "steps/"  # the step records


def step_dir(step: int) -> str:
    return f"{step:0{_W}d}"


def record_key(step: int) -> str:
    return f"{STEPS_PREFIX}{step_dir(step)}"


async def list_steps(view: KvStore) -> list[int]:
    """The steps recorded under ``steps/`` of ``view``, ascending (plain listing:
    works on any store that lists, versioned or not)."""
    out = []
    for k in await view.list(STEPS_PREFIX):
        name = k[len(STEPS_PREFIX):]
        if name.isdigit():
            out.append(int(name))
    return sorted(out)


@dataclass(frozen=True, slots=True)
class StepInfo:
    """The published facts of one step (``version``: the commit that published it,
    when known)."""

    step: int
    time: float
    metrics: dict[str, Any] = field(default_factory=dict)
    process_count: int = 1
    nbytes: int = 0
    version: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "step": self.step, "time": self.time, "metrics": self.metrics,
            "process_count": self.process_count, "nbytes": self.nbytes,
        }

    @staticmethod
    def from_json(j: Mapping[str, Any], key: str) -> StepInfo:
        if not isinstance(j, Mapping) or j.get("format") != FORMAT:
            raise DataCorruptionError(
                f"checkpoint step record {key!r}: format {j.get('format') if isinstance(j, Mapping) else j!r}, "
                f"expected {FORMAT!r}"
            )
        return StepInfo(
            step=int(j["step"]), time=float(j["time"]), metrics=dict(j.get("metrics") or {}),
            process_count=int(j.get("process_count", 1)), nbytes=int(j.get("nbytes", 0)),
        )


def as_versioned(kv: KvStore) -> VersionedKvStore:
    """The versioned store of a root: ``kv`` itself if versioned, else one over it."""
    return kv if isinstance(kv, VersionedKvStore) else VersionedKvStore(kv)


class StepStore:
    """The steps of one checkpoint root (see the module docstring)."""

    def __init__(self, kv: KvStore) -> None:
        self.kv = as_versioned(kv)

    # -- reading ---------------------------------------------------------------
    async def snapshot(self) -> VersionedKvStore:
        """A read-only view pinned at the newest version (what one restore reads).

        The view holds a reader lease on its version (released when the view
        is closed or garbage-collected): retention elsewhere can delete the
        version, but its objects stay until the view is gone.
        """
        if self.kv.read_only:
            return self.kv
        for _ in range(_ATTEMPTS):
            v = await self.kv.newest_version()
            if v == 0:
                return self.kv
            try:
                return await self.kv.open_snapshot(v)
            except NotFoundError:
                continue  # deleted between finding it and leasing it: take the newest again
        raise NotFoundError(f"checkpoint root {self.kv!r}: the newest version keeps being deleted; retry")

    async def unsaved_version(self, step: int) -> int:
        """The newest version, checked not to hold ``step``: a save can read
        (``read_from``) the version its fail-fast check saw.
        ConditionFailedError if the step exists."""
        version, (entry,) = await self.kv.stat_with_version([record_key(step)])
        if entry is not None:
            raise ConditionFailedError(f"checkpoint step {step} already exists at {self.kv!r}")
        return version

    async def list_steps(self, view: KvStore | None = None) -> list[int]:
        """The committed steps (of ``view``, default the live store), ascending."""
        return await list_steps(view or self.kv)

    async def record(self, step: int, view: KvStore | None = None) -> StepInfo:
        view = view or self.kv
        key = record_key(step)
        r = await view.read(key)
        if r.state != "value":
            raise NotFoundError(f"checkpoint step {step} not found at {self.kv!r} (no key {key!r})")
        return StepInfo.from_json(json.loads(bytes(r.value)), key)

    async def manifest(self, step: int, view: KvStore) -> dict[str, Any]:
        key = f"{step_dir(step)}/manifest.json"
        r = await view.read(key)
        if r.state != "value":
            raise DataCorruptionError(
                f"checkpoint step {step}: its record exists but {key!r} is missing at {self.kv!r}"
            )
        manifest = json.loads(bytes(r.value))
        fmt = manifest.get("format") if isinstance(manifest, dict) else None
        if fmt not in MANIFEST_FORMATS:
            raise UnsupportedError(
                f"checkpoint step {step} at {self.kv!r}: manifest format {fmt!r} is not one this "
                f"version reads ({', '.join(MANIFEST_FORMATS)}); it was written by a newer version"
            )
        return manifest  # type: ignore[no-any-return]

    async def open_step(self, step: int | None) -> tuple[int, dict[str, Any], KvStore]:
        """``(step, manifest, view of the step's keys)`` from one pinned snapshot.

        ``step=None`` picks the newest. Raises :class:`NotFoundError` when there
        are no steps or ``step`` is not one of them.
        """
        snap = await self.snapshot()
        if step is None:
            steps = await self.list_steps(snap)
            if not steps:
                raise NotFoundError(f"no checkpoint steps at {self.kv!r}")
            step = steps[-1]
        # the record and the manifest are read together (on an object store one
        # round trip, not two); a missing record is the error to raise
        recorded, read = await asyncio.gather(self.record(step, snap), self.manifest(step, snap),
                                              return_exceptions=True)
        if isinstance(recorded, BaseException):
            raise recorded  # NotFoundError names the step
        if isinstance(read, BaseException):
            raise read
        return step, read, snap.with_path(step_dir(step))

    # -- deleting --------------------------------------------------------------
    async def delete_steps(
        self, steps: list[int], *, reclaim: bool = True, read_grace: float = DEFAULT_READ_GRACE
    ) -> int:
        """Delete ``steps`` in one commit; with ``reclaim``, free their bytes now.

        Idempotent: steps already gone (deleted by another process meanwhile)
        are skipped, and a deletion that conflicts with another one is retried
        against the new state. Reclaiming retires every older untagged version
        (so no retained version still shows the deleted steps) and then runs
        the versioned store's prompt reclaim (``kvstore.versioned.gc.reclaim``):
        objects reachable only from deleted versions go at once, except those of
        versions a reader leases (or committed over less than ``read_grace``
        seconds ago): a later retention takes them. Returns the number of
        objects deleted.
        """
        if not steps:
            return 0
        kv = self.kv
        for attempt in range(1, _ATTEMPTS + 1):
            present = sorted(set(steps) & set(await self.list_steps()))
            if not present:
                break
            txn = Transaction(message=f"delete checkpoint steps {present}",
                              metadata={"checkpoint_delete": present})
            view = kv.with_transaction(txn)
            try:
                for s in present:
                    await view.delete_range(step_dir(s) + "/")
                    await view.delete(record_key(s))
                await txn.commit()
                break
            except ConflictError:
                if txn.state == "open":
                    txn.abort()
                if attempt == _ATTEMPTS:
                    raise
                log.info("deleting checkpoint steps %s at %r conflicted with another commit; "
                         "retrying against the new state", present, kv)
        if not reclaim:
            return 0
        newest = await kv.newest_version()
        tagged = set((await kv.tags()).values())
        old = [v.version for v in await kv.versions() if v.version < newest and v.version not in tagged]
        if old:
            await kv.delete_versions(old, message=f"retire versions holding deleted checkpoint steps {steps}")
        report = await gc_reclaim(kv, read_grace=read_grace)
        return report.deleted_count


#: manifest formats this version reads: 1 (raw chunks), 2 (leaves may name ``codecs``),
#: 3 (small leaves may be ``packed`` together: packing.py)
MANIFEST_FORMATS = (
    "tensorstore_py.checkpoint.manifest/1", "tensorstore_py.checkpoint.manifest/2",
    "tensorstore_py.checkpoint.manifest/3",
)


# -- reading many values at once ---------------------------------------------------------
Span = tuple[str, int, int, bool]  # (key relative to the view, start, stop, covers the whole value)


async def read_spans(
    view: KvStore, spans: list[Span], *, coalesce_gap: int = 4096, whole: bool = False,
    into: list[memoryview | None] | None = None,
) -> list[Any]:
    """The bytes ``[start, stop)`` of each key's value, in order (``whole=True``:
    each value whole, whatever its size, checked against its crc32c where stored:
    compressed chunks).

    On a pinned versioned snapshot this reads as an independent reader of
    docs/FORMAT.md (§6.4) would: it looks every key up in the (cached) index and
    reads the spans of one data object with one coalesced ``read_ranges`` call of
    the base store, so thousands of small values packed into a few objects cost a
    few requests instead of one each. A span covering a whole value is checked
    against the value's crc32c (:class:`ChecksumError` names the key and object).
    Elsewhere each span is one ``read``. A missing key raises DataCorruptionError.

    ``into``: per span a writable byte buffer of its size, or None; a span's
    bytes land in its buffer, which is then its result (on a file store the
    kernel reads into it directly; elsewhere the bytes are copied into it).
    """
    if whole or not (isinstance(view, VersionedKvStore) and view.version is not None):
        got = await asyncio.gather(*(_read_one(view, k, a, b, w or whole) for k, a, b, w in spans))
        return copied_into(got, into) if into is not None else got
    # check the pinned version first (NotFoundError if it was deleted), so that a
    # NotFoundError below can only mean a key the manifest names is gone
    await view.stat([])
    try:
        return await view.read_spans([(k, a, b) for k, a, b, _whole in spans], coalesce_gap=coalesce_gap,
                                     into=into)
    except NotFoundError as e:
        raise DataCorruptionError(f"checkpoint: {e}") from None


async def _read_one(view: KvStore, key: str, a: int, b: int, whole: bool) -> Any:
    # a whole value is read whole, so that the store checks its checksum
    res = await view.read(key, byte_range=None if whole else ByteRange(a, b))
    if res.state != "value":
        raise DataCorruptionError(f"checkpoint key {view.path + key!r} is missing from {view!r}")
    return res.value

