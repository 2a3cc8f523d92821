"""Format 2 code reads format-1 stores exactly as before and commits on top of them.

The format-1 store is built by hand: history written by this code, with every
commit record re-framed as format 1 wrote it (``"format": 1``, no ``txn_nonce``),
plus the multi-writer objects format 1 left behind (``txns/<id>/<i>``
fragments and ``txns/<id>/result``).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from _multiwriter import staged

import tensorstore_py as tsp
from tensorstore_py.errors import InvalidArgumentError
from tensorstore_py.kvstore.file import FileKvStore
from tensorstore_py.kvstore.versioned import VersionedKvStore
from tensorstore_py.kvstore.versioned import root as root_module
from tensorstore_py.kvstore.versioned.format import (
    FORMAT,
    MAGIC_COMMIT,
    MAGIC_FRAGMENT,
    MAGIC_RESULT,
    commit_name,
    frame,
    unframe,
)
from tensorstore_py.kvstore.versioned.gc import gc
from tensorstore_py.kvstore.versioned.verify import verify

T = 60


def _fresh(path: str) -> VersionedKvStore:
    root_module._roots.clear()
    return VersionedKvStore(FileKvStore(path=path))


def _as_format_1(base: FileKvStore) -> None:
    for name in base.list("commits/").result(T):
        body = unframe(MAGIC_COMMIT, base.read(name).result(T).value, name)
        body["format"] = 1
        del body["txn_nonce"]
        base.write(name, frame(MAGIC_COMMIT, body)).result(T)


@pytest.fixture
def v1_store(tmp_path: Any) -> tuple[str, dict[int, dict[str, bytes]]]:
    """A format-1 store: 4 versions (a multi-writer one among them) and what each holds."""
    path = str(tmp_path / "v1")
    kv = _fresh(path)
    kv.write("a", b"1").result(T)
    kv.write("big", bytes(range(256)) * 2000).result(T)  # a data object of its own
    # a multi-writer commit as format 1 recorded it: txn_id in the record, a result
    with tsp.Transaction(txn_id="step-3", message="mw") as txn:
        kv.with_transaction(txn).write("m", b"x" * 1000).result(T)
    kv.delete("a").result(T)
    base = FileKvStore(path=path)
    _as_format_1(base)
    result = {"format": 1, "txn_id": "step-3", "version": 3, "write_id": txn.write_id,
              "time": time.time(), "error": None, "message": ""}
    base.write("txns/step-3/result", frame(MAGIC_RESULT, result)).result(T)
    fragment = {"format": 1, "txn_id": "step-3", "index": 1, "count": 2, "base": 2,
                "write_id": "0" * 32, "keys": [], "entries": []}
    base.write("txns/step-3/000001", frame(MAGIC_FRAGMENT, fragment)).result(T)
    failed = {**result, "txn_id": "step-4", "version": None, "write_id": None,
              "error": "DeadlineExceededError", "message": "participant(s) [1] delivered no fragment"}
    base.write("txns/step-4/result", frame(MAGIC_RESULT, failed)).result(T)
    expect = {
        1: {"a": b"1"},
        2: {"a": b"1", "big": bytes(range(256)) * 2000},
        3: {"a": b"1", "big": bytes(range(256)) * 2000, "m": b"x" * 1000},
        4: {"big": bytes(range(256)) * 2000, "m": b"x" * 1000},
    }
    return path, expect


def _holds(kv: VersionedKvStore, version: int, values: dict[str, bytes]) -> None:
    snap = kv.snapshot(version)
    assert snap.list().result(T) == sorted(values)
    for k, v in values.items():
        assert bytes(snap.read(k).result(T).value) == v


def test_format_1_store_reads_as_before(v1_store: Any) -> None:
    path, expect = v1_store
    kv = _fresh(path)
    assert set(kv.stored_formats().result(T).values()) == {1}
    assert kv.newest_version().result(T) == 4
    for v, values in expect.items():
        _holds(kv, v, values)
    d = kv.commit_details(3).result(T)
    assert d.txn_id == "step-3" and d.message == "mw"
    assert verify(kv).result(T) == []


def test_new_commits_on_a_format_1_store(v1_store: Any) -> None:
    path, expect = v1_store
    kv = _fresh(path)
    kv.write("n", b"new").result(T)
    with tsp.Transaction(isolation="serializable") as txn:
        v = kv.with_transaction(txn)
        assert bytes(v.read("m").result(T).value) == b"x" * 1000
        v.write("m", b"y").result(T)
    kv = _fresh(path)
    formats = kv.stored_formats().result(T)
    assert formats[commit_name(1)] == 1 and FORMAT == 2
    assert kv.commit_details(6).result(T).version == 6
    for v, values in expect.items():  # the old versions are untouched
        _holds(kv, v, values)
    _holds(kv, 6, {**expect[4], "n": b"new", "m": b"y"})
    assert verify(kv).result(T) == []


def test_format_1_multi_writer_objects(v1_store: Any) -> None:
    path, _ = v1_store
    kv = _fresh(path)
    # gc knows format-1 multi-writer objects
    rep = gc(kv, grace=0, dry_run=True).result(T)
    assert {"txns/step-3/000001", "txns/step-4/result"} <= set(rep.deleted)
    assert "txns/step-3/result" not in rep.deleted  # version 3 is retained: its id's answer stays
    # a format-1 success is this transaction id's commit: a retry with its writes gets it back
    f1 = staged(kv, "step-3", 1, 2, {"nothing": None}, timeout=10).commit()
    assert staged(kv, "step-3", 0, 2, {"m": b"x" * 1000}, timeout=10).commit().result(T).version == 3
    assert f1.result(T).version == 3
    # a format-1 failure used the id up
    with pytest.raises(InvalidArgumentError, match="must not be reused"):
        staged(kv, "step-4", 0, 2, {"q": b"1"}, timeout=10).commit().result(T)
    assert kv.newest_version().result(T) == 4
    # the retry cleaned what the format-1 transaction left, but its result
    assert kv.base.list("txns/step-3/").result(T) == ["txns/step-3/result"]
