"""Histories of concurrent operations on one versioned store, and their checker.

A history is what a randomized run did: every operation (a commit of one kind
or another, a gc, a retention sweep, a leased read) with its outcome as the
process that ran it saw it: ``ok`` (acknowledged, with the version), ``fail``
(a typed error: nothing may be visible), ``unknown`` (the process was killed,
or the outcome is reported unknown: fully present or fully absent).

The data model: cells ``cell/<i>`` each hold a value that names the operation
that wrote it and the operation whose value it replaced (a read-modify-write),
so the chain of committed writes of a cell, in version order, must link up:
a write whose ``prev`` is not the write before it is a lost update. An int64
array (zarr3 at the store's root) is only ever incremented as a whole, so at
every version it holds the number of increments committed up to it.

:func:`check` reads the store back and compares it with the model built from
the history and the commit records; it returns the anomalies found (strings,
one per finding, each naming the operation and version).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import tensorstore_py as tsp
from tensorstore_py.kvstore.file import FileKvStore
from tensorstore_py.kvstore.versioned import VersionedKvStore
from tensorstore_py.kvstore.versioned.verify import verify

T = 60
CELLS = 6
#: value sizes: inline, packed, packed, alone (>= 256 KiB)
SIZES = (64, 3000, 40_000, 300_000)
ARRAY_SHAPE = (8,)
ARRAY_CHUNKS = (2,)


def cell_key(i: int) -> str:
    return f"cell/{i}"


def cell_value(op: int, prev: int, cell: int, size: int) -> bytes:
    """The bytes operation ``op`` writes into ``cell`` over ``prev``'s value."""
    head = b"op=%d;prev=%d;cell=%d|" % (op, prev, cell)
    return (head * (size // len(head) + 1))[:size]


def writer_of(value: bytes) -> int:
    """The operation whose value ``value`` is (see :func:`cell_value`)."""
    return int(bytes(value[: value.index(b";")]).split(b"=")[1])


@dataclass
class Op:
    """One operation of a history, as the controller and its process saw it."""

    id: int
    kind: str
    status: str = "unknown"  # ok | fail | unknown
    version: int | None = None
    error: str = ""
    #: cell -> (prev op, size) the operation wrote (its intent, saved before the commit)
    writes: dict[int, tuple[int, int]] = field(default_factory=dict)
    #: an array increment (dask or transaction)
    inc: bool = False
    #: reader: version pinned and what it read (cell -> writer op; "array" -> value)
    pinned: int | None = None
    reads: list[dict[str, int]] = field(default_factory=list)
    paused: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class History:
    seed: int
    root: str
    ops: list[Op] = field(default_factory=list)
    setup_versions: int = 0

    def to_json(self) -> str:
        return json.dumps({"seed": self.seed, "root": self.root, "ops": [o.__dict__ for o in self.ops]},
                          default=str, indent=1)


# -- results that op processes leave behind ----------------------------------------------------
def save_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` atomically (a killed writer leaves none)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def load_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


def collect(op: Op, res: Path) -> None:
    """Fill ``op`` from the files its processes wrote under ``res``."""
    for intent in sorted(res.glob(f"{op.id}.*intent.json")):
        for c, pair in load_json(intent).get("writes", {}).items():
            op.writes[int(c)] = (int(pair[0]), int(pair[1]))
        op.inc = op.inc or bool(load_json(intent).get("inc"))
    out = load_json(res / f"{op.id}.json")
    if out is None:
        return  # killed before it could report: unknown
    op.status = out["status"]
    op.version = out.get("version")
    op.error = out.get("error", "")
    op.pinned = out.get("pinned")
    op.reads = out.get("reads", [])
    op.extra.update(out.get("extra", {}))


# -- the checker -----------------------------------------------------------------------------------
def _records(kv: VersionedKvStore) -> dict[int, Any]:
    newest = kv.newest_version().result(T)
    return {v: kv.commit_details(v).result(T) for v in range(1, newest + 1)}


def check(h: History) -> list[str]:
    """The anomalies of history ``h`` (empty when it is consistent with the model)."""
    out: list[str] = []
    kv = VersionedKvStore(FileKvStore(path=h.root))
    recs = _records(kv)
    newest = max(recs)
    ops = {o.id: o for o in h.ops}

    # which operation each version is; txn ids and operations applied at most once
    by_op: dict[int, list[int]] = {}
    by_txn: dict[str, list[int]] = {}
    for v, r in recs.items():
        if r.kind != "data":
            continue
        if r.txn_id:
            by_txn.setdefault(r.txn_id, []).append(v)
        if "op" in r.metadata:
            by_op.setdefault(int(r.metadata["op"]), []).append(v)
        elif v > h.setup_versions:
            out.append(f"unexplained: version {v}: a data commit no operation of the history made ({r.metadata})")
    for t, vs in by_txn.items():
        if len(vs) > 1:
            out.append(f"applied twice: txn_id {t!r} applied {len(vs)} times: versions {vs}")
    present: dict[int, int] = {}
    #: versions from here on carry a duplicate commit: their content is not modelled
    tainted = newest + 1
    for oid, vs in by_op.items():
        present[oid] = vs[0]
        if len(vs) > 1:
            tainted = min(tainted, vs[1])
            if not any(by_txn.get(t) == vs for t in by_txn):
                out.append(f"applied twice: op {oid} committed {len(vs)} times: versions {vs}")

    for o in h.ops:
        if o.kind in ("gc", "retain", "reader"):
            continue
        got = present.get(o.id)
        if o.status == "ok" and o.version is not None and got != o.version:
            what = f"op {recs[o.version].metadata.get('op')}" if o.version in recs else "missing"
            out.append(f"ack mismatch: op {o.id} ({o.kind}) acknowledged version {o.version}, "
                       f"but that version is {what}")
        again = o.extra.get("rerun_version")
        if o.status == "ok" and again is not None and again != o.version:
            out.append(f"applied twice: op {o.id} ({o.kind}) re-run with its txn_id returned version "
                       f"{again}, not {o.version}")
        if o.status == "ok" and o.extra.get("rerun_error"):
            out.append(f"txn_id re-run refused: op {o.id} ({o.kind}) re-run with its txn_id after it committed "
                       f"version {o.version} failed: {o.extra['rerun_error']}")
        if o.status == "fail" and not o.error.startswith("ConflictError") and not o.paused:
            out.append(f"writer error: op {o.id} ({o.kind}) failed with {o.error}")
        if o.status == "fail" and got is not None:
            out.append(f"failed but present: op {o.id} ({o.kind}) failed with {o.error} but is present at version {got}")
        if got is not None and not o.writes and not o.inc:
            out.append(f"unexplained: op {o.id} ({o.kind}) is present at version {got} without a recorded intent")

    # the model: replay the present operations in version order
    deleted = {v for v, r in recs.items() if r.deleted}
    state: dict[int, int] = {c: 0 for c in range(CELLS)}  # cell -> writer op (0 = setup)
    count = 0
    model: dict[int, tuple[dict[int, int], int]] = {}
    order = sorted((v, oid) for oid, v in present.items())
    it = iter(order)
    nxt = next(it, None)
    for v in range(1, newest + 1):
        while nxt is not None and nxt[0] == v:
            o = ops.get(nxt[1])
            if o is not None:
                for c, (prev, _size) in o.writes.items():
                    if state[c] != prev and v < tainted:
                        out.append(f"lost update: op {o.id} ({o.kind}) committed version {v} over cell {c} "
                                   f"from op {prev}'s value, but op {state[c]} had written it "
                                   f"(no ConflictError)")
                    state[c] = o.id
                count += 1 if o.inc else 0
            nxt = next(it, None)
        model[v] = (dict(state), count)

    sizes = {o.id: {c: s for c, (_p, s) in o.writes.items()} for o in h.ops}
    sizes[0] = {c: SIZES[c % len(SIZES)] for c in range(CELLS)}
    prevs = {o.id: {c: p for c, (p, _s) in o.writes.items()} for o in h.ops}
    prevs[0] = {c: -1 for c in range(CELLS)}

    def expect(c: int, writer: int) -> bytes:
        return cell_value(writer, prevs[writer][c], c, sizes[writer][c])

    # every retained version reads back exactly (the newest included)
    for v in sorted(set(model) - deleted):
        if v < h.setup_versions or v >= tainted:
            continue
        cells, cnt = model[v]
        try:
            snap = kv.snapshot(v)
            for c, writer in cells.items():
                got_b = snap.read(cell_key(c)).result(T)
                if got_b.value is None or bytes(got_b.value) != expect(c, writer):
                    out.append(f"wrong bytes: version {v}: cell {c} should hold op {writer}'s value, read "
                               f"{'nothing' if got_b.value is None else bytes(got_b.value[:40])!r}")
            arr = tsp.open(f"versioned+file://{h.root}/@{v}").result(T).read().result(T)
            if not np.array_equal(arr, np.full(ARRAY_SHAPE, cnt, np.int64)):
                kind = "lost update (array)" if (arr < cnt).all() else "wrong bytes"
                out.append(f"{kind}: version {v}: the array should be {cnt} everywhere (increments committed), read {arr.tolist()}")
            snap.close()
        except Exception as e:  # an acknowledged or retained version that does not read
            made = [f"op {oid} ({ops[oid].kind})" for w, oid in order if w == v and oid in ops]
            out.append(f"unreadable: version {v} ({', '.join(made) or 'no operation'}) "
                       f"does not read: {type(e).__name__}: {e}")

    # readers holding a lease: no spurious error, and they read their version's state
    for o in h.ops:
        if o.kind != "reader":
            continue
        if o.status != "ok" and not (o.paused and "SnapshotExpired" in o.error):
            if o.status == "fail" and o.pinned is not None:  # before its lease, NotFound is fair
                out.append(f"reader error: op {o.id} holding a lease on version {o.pinned} failed: {o.error}")
            continue
        if o.pinned is None or o.pinned not in model or o.pinned >= tainted:
            continue
        cells, cnt = model[o.pinned]
        for r in o.reads:
            want = {str(c): w for c, w in cells.items()} | {"array": cnt}
            bad = {k: (r[k], want.get(k)) for k in r if r[k] != want.get(k)}
            if bad:
                kind = "reader wrong bytes" + (" (array)" if set(bad) == {"array"} else "")
                out.append(f"{kind}: op {o.id} at version {o.pinned} read {bad} (read, expected)")

    problems = verify(kv).result(T)
    for p in problems:
        out.append(f"verify: {p}")
    return out


def category(anomaly: str) -> str:
    """The kind of an anomaly line of :func:`check` (the text before its first colon)."""
    return anomaly.split(":", 1)[0]
