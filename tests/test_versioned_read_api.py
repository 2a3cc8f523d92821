"""The versioned store's public read API: snapshots, index entries, commit records, spans."""

from __future__ import annotations

from typing import Any

import pytest

from tensorstore_py.errors import ChecksumError, DataCorruptionError, NotFoundError
from tensorstore_py.kvstore.file import FileKvStore
from tensorstore_py.kvstore.memory import MemoryKvStore
from tensorstore_py.kvstore.versioned import VersionedKvStore
from tensorstore_py.kvstore.versioned.format import crc32c
from tensorstore_py.kvstore.versioned.info import CommitDetails, EntryInfo

T = 30


@pytest.fixture()
def kv(tmp_path: Any) -> VersionedKvStore:
    return VersionedKvStore(FileKvStore(path=str(tmp_path) + "/"))


def test_snapshot_refuses_deleted_version(kv: VersionedKvStore) -> None:
    for i in range(3):
        kv.write("a", b"v%d" % i).result(T)
    assert kv.snapshot(1).read("a").result(T).value == b"v0"
    kv.delete_versions([1]).result(T)
    snap = kv.snapshot(1)  # data not collected yet: still refused
    with pytest.raises(NotFoundError, match="version 1 was deleted"):
        snap.read("a").result(T)
    with pytest.raises(NotFoundError, match="version 1 was deleted"):
        snap.list().result(T)
    with pytest.raises(NotFoundError, match="does not exist"):
        kv.snapshot(9).read("a").result(T)
    assert kv.snapshot(2).read("a").result(T).value == b"v1"


def test_entries_stat_and_details(kv: VersionedKvStore) -> None:
    kv.write("p/small", b"x").result(T)
    big = bytes(range(256)) * 64
    kv.write("p/big", big).result(T)
    view = kv.with_path("p/")
    assert isinstance(view, VersionedKvStore)
    ents = view.entries().result(T)
    assert [e.key for e in ents] == ["big", "small"]
    by = {e.key: e for e in ents}
    assert isinstance(by["big"], EntryInfo)
    assert (by["big"].size, by["big"].crc32c) == (len(big), crc32c(big))
    assert (by["small"].size, by["small"].crc32c) == (1, crc32c(b"x"))
    assert by["big"].generation == view.read("big").result(T).generation
    assert [e.key for e in view.entries(version=1).result(T)] == ["small"]
    st = view.stat(["small", "nope"]).result(T)
    assert st[0] == by["small"] and st[1] is None
    d = kv.commit_details(2).result(T)
    assert isinstance(d, CommitDetails)
    assert (d.version, d.kind, d.key_count, d.deleted) == (2, "data", 2, False)
    assert kv.changed_keys(2).result(T) == ["p/big"]
    assert view.changed_keys(2).result(T) == ["big"]
    with pytest.raises(NotFoundError):
        kv.commit_details(7).result(T)


def test_read_spans_checks_crc(kv: VersionedKvStore, tmp_path: Any) -> None:
    big = bytes(range(256)) * 64
    kv.write("a", big).result(T)
    kv.write("b", b"inline").result(T)
    snap = kv.snapshot(2)
    got = snap.read_spans([("a", 0, len(big)), ("a", 10, 20), ("b", 1, 3)]).result(T)
    assert [bytes(g) for g in got] == [big, big[10:20], b"nl"]
    with pytest.raises(NotFoundError):
        snap.read_spans([("zz", 0, 1)]).result(T)
    obj = snap.stat(["a"]).result(T)[0].object
    assert obj is not None
    path = tmp_path / obj
    raw = bytearray(path.read_bytes())
    raw[raw.index(big[:64]) + 5] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(ChecksumError, match="'a'"):
        snap.read_spans([("a", 0, len(big))]).result(T)


@pytest.mark.parametrize("base", ["file", "memory"])
def test_read_spans_into_caller_buffers(tmp_path: Any, base: str) -> None:
    # the file store reads straight into the buffers; other stores' bytes are copied
    # in; either way each span's result is its buffer, and whole spans are checked
    store = FileKvStore(path=str(tmp_path) + "/") if base == "file" else MemoryKvStore()
    kv = VersionedKvStore(store)
    big = bytes(range(256)) * 4096
    kv.write("a", big).result(T)
    kv.write("b", b"inline").result(T)
    snap = kv.snapshot(2)
    dests = [bytearray(len(big)), bytearray(10), None]
    got = snap.read_spans([("a", 0, len(big)), ("a", 10, 20), ("b", 1, 3)],
                          into=[memoryview(d) if d is not None else None for d in dests]).result(T)
    assert [bytes(g) for g in got] == [big, big[10:20], b"nl"]
    assert bytes(dests[0]) == big and bytes(dests[1]) == big[10:20]  # type: ignore[arg-type]
    assert memoryview(got[0]).obj is dests[0]
    obj = snap.stat(["a"]).result(T)[0].object
    assert obj is not None
    if base == "file":
        path = tmp_path / obj
        raw = bytearray(path.read_bytes())
        raw[raw.index(big[:64]) + 5] ^= 1
        path.write_bytes(bytes(raw))
        with pytest.raises(ChecksumError, match="'a'"):
            snap.read_spans([("a", 0, len(big))], into=[memoryview(bytearray(len(big)))]).result(T)
        path.unlink()
        with pytest.raises(DataCorruptionError, match="missing"):
            snap.read_spans([("a", 0, 10)], into=[memoryview(bytearray(10))]).result(T)


def test_copy_to_and_stored_formats(kv: VersionedKvStore, tmp_path: Any) -> None:
    kv.write("a", bytes(5000)).result(T)
    kv.write("b", b"small").result(T)
    kv.tag("first", 1).result(T)
    assert set(kv.stored_formats().result(T).values()) == {VersionedKvStore.FORMAT}
    dst = FileKvStore(path=str(tmp_path / "copy") + "/")
    seen: list[int] = []
    kv.copy_to(dst, on_bytes=seen.append).result(T)
    assert sum(seen) > 5000
    out = VersionedKvStore(dst)
    assert [v.version for v in out.versions().result(T)] == [1, 2, 3]
    assert out.tags().result(T) == {"first": 1}
    assert out.read("a").result(T).value == bytes(5000)
    assert out.snapshot(1).list().result(T) == ["a"]
