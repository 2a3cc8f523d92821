"""The versioned kvstore: format, versions, snapshots, tags, corruption, cost."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import msgpack
import pytest
from _versioned_workload import BASES, open_base

import tensorstore_py as tsp
from tensorstore_py.core.future import spawn
from tensorstore_py.errors import (
    ChecksumError,
    ConditionFailedError,
    DataCorruptionError,
    InvalidArgumentError,
    NotFoundError,
    ReadOnlyError,
    StorageError,
)
from tensorstore_py.kvstore.fault import FaultKvStore
from tensorstore_py.kvstore.file import FileKvStore
from tensorstore_py.kvstore.memory import MemoryKvStore
from tensorstore_py.kvstore.registry import spec_from_url
from tensorstore_py.kvstore.versioned import VersionedKvStore, VersionInfo
from tensorstore_py.kvstore.versioned.create import ONCE, create_object
from tensorstore_py.kvstore.versioned.format import InlineEntry, commit_name, frame, new_stamp
from tensorstore_py.kvstore.versioned.root import Plan, get_root
from tensorstore_py.kvstore.versioned.tree import MAX_FANOUT

T = 60


@pytest.fixture(params=BASES)
def base(request: pytest.FixtureRequest, tmp_path: Any) -> tsp.KvStore:
    return open_base(request, tmp_path)


def vopen(base: tsp.KvStore, **kw: Any) -> VersionedKvStore:
    return tsp.KvStore.open({"driver": "versioned", "base": base.spec(), **kw}).result(T)  # type: ignore[return-value]


def test_write_read_list_delete_and_versions(base: tsp.KvStore) -> None:
    kv = vopen(base, path="params/")
    assert kv.read("a").result(T).state == "missing"
    assert kv.newest_version().result(T) == 0
    g1 = kv.write("a", b"1").result(T)
    kv.write("b/c", b"x" * 1000).result(T)       # packed
    kv.write("big", os.urandom(300_000)).result(T)  # alone
    assert kv.read("a").result(T).value == b"1"
    assert kv.read("a").result(T).generation == g1
    assert bytes(kv.read("b/c").result(T).value) == b"x" * 1000
    assert bytes(kv.read("b/c", byte_range=slice(10, 14)).result(T).value) == b"xxxx"
    assert bytes(kv.read("b/c", byte_range=slice(-3, None)).result(T).value) == b"xxx"
    assert kv.list().result(T) == ["a", "b/c", "big"]
    assert kv.list("b/").result(T) == ["b/c"]
    # the path namespaces keys inside one shared history
    whole = vopen(base)
    assert whole.list().result(T) == ["params/a", "params/b/c", "params/big"]
    kv.delete("a").result(T)
    assert kv.read("a").result(T).state == "missing"
    kv.delete_range("b/").result(T)
    assert kv.list().result(T) == ["big"]
    vs = kv.versions().result(T)
    assert [v.version for v in vs] == [1, 2, 3, 4, 5]
    assert all(isinstance(v, VersionInfo) and len(v.write_id) == 32 for v in vs)
    # every old version still reads back
    snap = kv.snapshot(2)
    assert snap.list().result(T) == ["a", "b/c"]
    assert bytes(snap.read("b/c").result(T).value) == b"x" * 1000


def test_conditional_writes_outside_transactions(base: tsp.KvStore) -> None:
    kv = vopen(base)
    g = kv.write("k", b"1", if_equal=tsp.Generation.NO_VALUE).result(T)
    with pytest.raises(ConditionFailedError, match="'k'"):
        kv.write("k", b"2", if_equal=tsp.Generation.NO_VALUE).result(T)
    g2 = kv.write("k", b"2", if_equal=g).result(T)
    with pytest.raises(ConditionFailedError):
        kv.write("k", b"3", if_equal=g).result(T)
    assert kv.read("k").result(T).value == b"2"
    assert kv.read("k", if_not_equal=g2).result(T).state == "unchanged"
    with pytest.raises(ConditionFailedError):
        kv.delete("k", if_equal=g).result(T)
    kv.delete("k", if_equal=g2).result(T)
    assert kv.read("k").result(T).state == "missing"


def test_group_commit_batches_concurrent_writes() -> None:
    base = MemoryKvStore()
    kv = vopen(base)

    async def many() -> None:
        await asyncio.gather(*(kv.write(f"c/{i}", b"v%d" % i) for i in range(256)))

    spawn(many()).result(T)
    n = kv.newest_version().result(T)
    assert n <= 4, f"256 concurrent writes took {n} commits"
    assert kv.list("c/").result(T) == sorted(f"c/{i}" for i in range(256))
    assert kv.read("c/17").result(T).value == b"v17"


def test_group_commit_failed_condition_fails_only_that_write() -> None:
    kv = vopen(MemoryKvStore())
    kv.write("x", b"0").result(T)

    async def both() -> list[Any]:
        return await asyncio.gather(
            kv.write("x", b"1", if_equal=tsp.Generation.NO_VALUE),
            kv.write("y", b"2"),
            return_exceptions=True,
        )

    r = spawn(both()).result(T)
    assert isinstance(r[0], ConditionFailedError)
    assert isinstance(r[1], tsp.Generation)
    assert kv.read("x").result(T).value == b"0"
    assert kv.read("y").result(T).value == b"2"


def test_snapshots_are_read_only_and_url_forms(tmp_path: Any) -> None:
    url = f"versioned+file://{tmp_path}/run/"
    kv = tsp.KvStore.open(url).result(T)
    kv.write("a", b"1").result(T)
    kv.write("a", b"2").result(T)
    snap = tsp.KvStore.open(url + "@1").result(T)
    assert snap.read("a").result(T).value == b"1"
    with pytest.raises(ReadOnlyError):
        snap.write("a", b"3")
    assert spec_from_url(url + "@12") == {"driver": "versioned", "version": 12, "base": f"file://{tmp_path}/run/"}
    assert spec_from_url(url + "@best")["tag"] == "best"
    assert snap.url() == url + "@1"
    assert tsp.KvStore.open(snap.spec()).result(T).read("a").result(T).value == b"1"
    with pytest.raises(NotFoundError, match="version 9"):
        tsp.KvStore.open(url + "@9").result(T)


def test_tags_and_deleted_versions(tmp_path: Any) -> None:
    kv = vopen(FileKvStore(path=str(tmp_path)))
    for i in range(4):
        kv.write("k", b"%d" % i).result(T)
    kv.tag("best", 2).result(T)
    assert kv.tags().result(T) == {"best": 2}
    best = tsp.KvStore.open(f"versioned+file://{tmp_path}/@best").result(T)
    assert best.read("k").result(T).value == b"1"
    with pytest.raises(InvalidArgumentError, match="tagged 'best'"):
        kv.delete_versions([2]).result(T)
    info = kv.delete_versions([1, 3]).result(T)
    assert info.version == 6
    assert [v.version for v in kv.versions().result(T)] == [2, 4, 5, 6]
    with pytest.raises(NotFoundError, match="deleted"):
        vopen(FileKvStore(path=str(tmp_path)), version=3)
    with pytest.raises(InvalidArgumentError, match="newest"):
        kv.delete_versions([6]).result(T)
    kv.delete_tag("best").result(T)
    assert kv.tags().result(T) == {}
    # the retention state is in the newest commit record (for GC)
    rec = get_root(kv.base).records[7]
    assert rec.deleted == [[1, 1], [3, 3]] and rec.kind == "tag"
    assert kv.read("k").result(T).value == b"3"


def test_newest_version_found_without_hint_and_from_stale_hint(tmp_path: Any) -> None:
    path = str(tmp_path)
    kv = vopen(FileKvStore(path=path))
    for i in range(37):
        kv.write("k", b"%d" % i).result(T)
    time.sleep(0.2)  # let a background hint write finish
    if os.path.exists(os.path.join(path, "latest")):
        os.remove(os.path.join(path, "latest"))
    # a fresh process-level root (another "process") finds version 37 by probing
    fresh = VersionedKvStore(FileKvStore(path=path + "/"))
    fresh._root = type(fresh._root)(fresh.base)
    assert fresh.newest_version().result(T) == 37
    assert fresh.read("k").result(T).value == b"36"
    # a stale hint is only a starting point
    FileKvStore(path=path).write("latest", frame(b"TSL1", {"version": 5})).result(T)
    fresh._root = type(fresh._root)(fresh.base)
    assert fresh.newest_version().result(T) == 37


def test_layout_and_commit_record_fields(tmp_path: Any) -> None:
    raw = FileKvStore(path=str(tmp_path))
    kv = vopen(raw, path="p/")
    with tsp.Transaction(message="hello", metadata={"step": 3}) as txn:
        kv.with_transaction(txn).write("a", b"A").result(T)
    deadline = time.monotonic() + 10
    while "latest" not in raw.list().result(T) and time.monotonic() < deadline:
        time.sleep(0.01)  # the hint is written in the background
    names = raw.list().result(T)
    assert commit_name(1) == "commits/00000000000000000001"
    assert "commits/00000000000000000001" in names and "latest" in names
    assert any(n.startswith("nodes/") for n in names)
    data = bytes(raw.read(commit_name(1)).result(T).value)
    assert data[:4] == b"TSC1"
    body = msgpack.unpackb(data[4:-4])
    assert body["version"] == 1 and body["parent"] == 0 and body["message"] == "hello"
    assert body["metadata"] == {"step": 3} and body["changes"] == ["p/a"] and body["count"] == 1
    assert body["write_id"] == txn.write_id and body["root"].startswith("nodes/")
    node = msgpack.unpackb(bytes(raw.read(body["root"]).result(T).value)[4:-4])
    assert node["t"] == "leaf" and node["k"] == ["p/a"] and node["v"][0][1] == b"A"


def test_corrupt_objects_raise_checksum_errors_naming_them(tmp_path: Any) -> None:
    raw = FileKvStore(path=str(tmp_path))
    kv = vopen(raw)
    kv.write("small", b"s" * 1000).result(T)
    names = raw.list().result(T)
    data_obj = next(n for n in names if n.startswith("data/"))
    blob = bytearray(bytes(raw.read(data_obj).result(T).value))
    blob[5] ^= 0xFF
    raw.write(data_obj, bytes(blob)).result(T)
    with pytest.raises(ChecksumError, match=f"'small'.*{data_obj}"):
        kv.read("small").result(T)
    # a truncated commit record, read by a fresh reader
    rec = bytes(raw.read(commit_name(1)).result(T).value)
    raw.write(commit_name(1), rec[:-9]).result(T)
    fresh = VersionedKvStore(raw)
    fresh._root = type(fresh._root)(raw)
    with pytest.raises(ChecksumError, match="commits/00000000000000000001"):
        fresh.read("small").result(T)
    # a corrupt node
    raw.write(commit_name(1), rec).result(T)
    node = next(n for n in names if n.startswith("nodes/"))
    nb = bytearray(bytes(raw.read(node).result(T).value))
    nb[6] ^= 0x01
    raw.write(node, bytes(nb)).result(T)
    fresh._root = type(fresh._root)(raw)
    with pytest.raises(ChecksumError, match=node):
        fresh.read("small").result(T)


def test_reference_out_of_prefix_is_refused() -> None:
    raw = MemoryKvStore()
    raw.write("secret", b"top secret bytes").result(T)
    evil_node = frame(b"TSN1", {"t": "leaf", "k": ["a"], "v": [[new_stamp(), "../secret", 0, 16, 0]]})
    raw.write("nodes/" + "a" * 32, evil_node).result(T)
    from tensorstore_py.kvstore.versioned.format import CommitRecord

    rec = CommitRecord(version=1, parent=0, time=0.0, write_id="w" * 32, root="nodes/" + "a" * 32, changes=["a"])
    raw.write(commit_name(1), rec.encode()).result(T)
    kv = vopen(raw)
    with pytest.raises(DataCorruptionError, match="'../secret'"):
        kv.read("a").result(T)


def _bulk_load(kv: VersionedKvStore, n: int) -> None:
    """Commit ``n`` inline keys in one version through the commit engine."""
    root = kv._root
    changes = [(f"k/{i:07d}", InlineEntry(new_stamp(), b"%d" % i)) for i in range(n)]
    spawn(root.commit(lambda parent: _ready(Plan(changes)))).result(T)


def test_create_object_reads_an_existing_object_as_the_caller_says() -> None:
    mem = MemoryKvStore()
    mem.write("taken", b"theirs").result(T)

    def create(store: tsp.KvStore, name: str, data: bytes, exists: Any, **kw: Any) -> bool:
        return spawn(create_object(store, name, data, exists=exists, **kw)).result(T)

    # found at the first attempt: "ours" trusts a fresh name, the others check
    assert create(mem, "taken", b"mine", "ours")
    assert not create(mem, "taken", b"mine", "compare")
    assert create(mem, "taken", b"theirs", "compare")
    assert not create(mem, "taken", b"theirs", "refuse")
    assert mem.read("taken").result(T).value == b"theirs"  # never overwritten
    # the first write landed but its response was lost: every reading knows it is ours
    for exists in ("ours", "compare", "refuse"):
        lossy = FaultKvStore(mem)
        lossy.inject(op="write", nth=1, after_effect=True)
        assert create(lossy, f"lost-{exists}", b"mine", exists)
        assert mem.read(f"lost-{exists}").result(T).value == b"mine"
    # without retries the I/O error is the answer
    lossy = FaultKvStore(mem)
    lossy.inject(op="write", nth=1)
    with pytest.raises(StorageError):
        create(lossy, "once", b"mine", "refuse", retry=ONCE)
    assert mem.read("once").result(T).state == "missing"


async def _ready(x: Any) -> Any:
    return x


def test_one_key_commit_into_1e5_keys_writes_O_log_n_objects(tmp_path: Any) -> None:
    counted = FaultKvStore(FileKvStore(path=str(tmp_path)))
    kv = VersionedKvStore(counted)
    _bulk_load(kv, 100_000)
    assert kv.read("k/0054321").result(T).value == b"54321"
    counted.reset_counters()
    kv.write("k/0054321", b"new value of about three hundred bytes" * 8).result(T)
    writes = counted.calls["write"]
    # depth 3 at fanout 256 -> 3 nodes, 1 data object, 1 commit record, 1 hint
    assert writes <= 6, f"{writes} objects written for one key"
    assert bytes(kv.read("k/0054321").result(T).value).startswith(b"new value")
    assert len(kv.list("k/").result(T)) == 100_000
    counted.reset_counters()
    assert kv.read("k/0000007").result(T).value == b"7"
    # a read writes nothing (the commit's "latest" hint is refreshed in the
    # background, at most once a second, and may land during it)
    assert counted.keys_called("write") <= {"latest"}, counted.keys_called("write")


def test_bulk_change_and_delete_keep_the_tree_consistent() -> None:
    kv = vopen(MemoryKvStore())
    _bulk_load(kv, 5 * MAX_FANOUT + 3)
    with tsp.Transaction() as txn:
        v = kv.with_transaction(txn)

        async def edit() -> None:
            await asyncio.gather(*(v.delete(f"k/{i:07d}") for i in range(0, 5 * MAX_FANOUT, 2)))
            await asyncio.gather(*(v.write(f"k/{i:07d}x", b"n") for i in range(0, 600, 3)))

        spawn(edit()).result(T)
    keys = kv.list().result(T)
    expect = sorted(
        [f"k/{i:07d}" for i in range(5 * MAX_FANOUT + 3) if i % 2 or i >= 5 * MAX_FANOUT]
        + [f"k/{i:07d}x" for i in range(0, 600, 3)]
    )
    assert keys == expect
    with tsp.Transaction() as txn:
        kv.with_transaction(txn).delete_range("k/").result(T)
    assert kv.list().result(T) == []
    assert get_root(kv.base).records[kv.newest_version().result(T)].root is None


@pytest.mark.parametrize("seed", range(6))
def test_tree_random_changes_match_a_dict_model(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Random batches of puts/deletes on a small-fanout tree (deep trees) against
    a dict; every version stays readable as it was."""
    import random

    from tensorstore_py.kvstore.versioned import tree as tree_mod
    from tensorstore_py.kvstore.versioned.tree import Inner, Leaf

    monkeypatch.setattr(tree_mod, "MAX_FANOUT", 4)
    rng = random.Random(seed)
    kv = VersionedKvStore(MemoryKvStore())
    root = kv._root
    model: dict[str, bytes] = {}
    history: list[dict[str, bytes]] = [{}]
    for step in range(25):
        changes: dict[str, bytes | None] = {}
        for _ in range(rng.choice([1, 3, 20, 60])):
            k = f"k{rng.randrange(120):03d}"
            changes[k] = None if (model and rng.random() < 0.4) else b"%d-%d" % (step, rng.randrange(9))
        plan = [(k, None if v is None else InlineEntry(new_stamp(), v)) for k, v in sorted(changes.items())]
        spawn(root.commit(lambda parent, plan=plan: _ready(Plan(plan)))).result(T)
        for k, v in changes.items():
            if v is None:
                model.pop(k, None)
            else:
                model[k] = v
        history.append(dict(model))
        assert kv.list().result(T) == sorted(model)
        rec = root.records[len(history) - 1]
        assert rec.count == len(model)

        # structural invariants: sorted keys, exact first keys and counts, equal leaf depth
        def check(name: str | None, depth: int, depths: set[int]) -> tuple[str | None, int]:
            if name is None:
                return None, 0
            node = spawn(root.load_node(name)).result(T)
            assert node.keys == sorted(node.keys) and len(node.keys) <= 4
            if isinstance(node, Leaf):
                depths.add(depth)
                return node.keys[0], len(node.keys)
            assert isinstance(node, Inner) and node.children
            total = 0
            for k, c, n in zip(node.keys, node.children, node.counts):
                first, cnt = check(c, depth + 1, depths)
                assert first == k and cnt == n
                total += cnt
            return node.keys[0], total

        depths: set[int] = set()
        _, total = check(rec.root, 0, depths)
        assert total == len(model) and len(depths) <= 1
    for v, expect in enumerate(history):
        if v == 0:
            continue
        snap = kv.snapshot(v)
        assert {k: bytes(snap.read(k).result(T).value) for k in snap.list().result(T)} == expect


@pytest.mark.parametrize("seed", range(4))
def test_random_faults_succeeded_writes_visible_failed_ones_not(seed: int) -> None:
    mem = MemoryKvStore()
    base = FaultKvStore(mem, seed=seed, error_rate=0.3, fail_ops=("write", "read"))
    kv = VersionedKvStore(base)

    async def go() -> list[Any]:
        return await asyncio.gather(
            *(kv.write(f"k{i:03d}", b"v%d" % i * (i % 3 * 200 + 1)) for i in range(100)),
            return_exceptions=True,
        )

    res = spawn(go()).result(T)
    ok = {f"k{i:03d}" for i, r in enumerate(res) if isinstance(r, tsp.Generation)}
    assert all(isinstance(r, (tsp.Generation, OSError)) for r in res), res
    fresh = VersionedKvStore(mem)
    fresh._root = type(fresh._root)(mem)
    assert set(fresh.list().result(T)) == ok
    for k in ok:
        i = int(k[1:])
        assert bytes(fresh.read(k).result(T).value) == b"v%d" % i * (i % 3 * 200 + 1)


def test_a_store_deleted_and_recreated_under_a_process_simply_works(tmp_path) -> None:
    """The process caches the history it read, but checks it before using it: a
    store deleted and recreated at the same place reads as the new store (not
    the cached old one) and its first commit is version 1, never n+1 after a gap."""
    import shutil

    path = tmp_path / "s"
    url = f"versioned+file://{path}/"
    kv = tsp.KvStore.open(url).result()
    for i in range(3):
        kv.write(f"k{i}", b"old").result()
    assert kv.newest_version().result() == 3
    shutil.rmtree(path)
    again = tsp.KvStore.open(url).result()
    assert again.read("k0").result().state == "missing"
    assert again.newest_version().result() == 0
    again.write("fresh", b"x").result()
    assert sorted(p.name for p in (path / "commits").iterdir() if p.is_file()) == ["00000000000000000001"]
    assert again.read("fresh").result().value == b"x"
    assert kv.read("k1").result().state == "missing"  # the old view sees the new store too


def test_a_store_replaced_by_a_longer_history_is_read_as_it_is(tmp_path) -> None:
    """Another process recreates the store and commits past the version this
    process cached: the cached records are dropped (their write-ids differ)."""
    import shutil

    from tensorstore_py.kvstore.versioned.root import VersionedRoot

    path = tmp_path / "s"
    url = f"versioned+file://{path}/"
    kv = tsp.KvStore.open(url).result()
    for i in range(2):
        kv.write(f"k{i}", b"old").result()
    shutil.rmtree(path)
    other = VersionedKvStore(FileKvStore(path=str(path) + "/"))
    other._root = VersionedRoot(other._root.base)  # a process of its own
    for i in range(4):
        other.write(f"k{i % 2}", b"new%d" % i).result()
    assert kv.newest_version().result() == 4
    assert kv.read("k0").result().value == b"new2"
    assert kv.read("k1").result().value == b"new3"
    assert kv.snapshot(2).read("k1").result().value == b"new1"
    kv.write("k0", b"mine").result()
    assert other.read("k0").result().value == b"mine"


def test_multi_writer_commits_on_a_store_recreated_at_the_same_place(tmp_path) -> None:
    """A multi-writer transaction (participants as threads of this process) on a
    folder deleted and recreated after an earlier one committed there."""
    import shutil
    import threading

    path = tmp_path / "s"

    def run(rounds: int, participants: int) -> None:
        kv = VersionedKvStore(FileKvStore(path=str(path) + "/"))
        for r in range(rounds):
            txns = [tsp.Transaction(txn_id=f"mw-{r}", process_index=i, process_count=participants, timeout=60)
                    for i in range(participants)]
            for i, txn in enumerate(txns):
                kv.with_transaction(txn).write(f"r{r}/p{i}", b"%d" % i).result()
            errors: list[BaseException] = []

            def commit(txn: tsp.Transaction, errors: list[BaseException]) -> None:
                try:
                    txn.commit().result(T)
                except BaseException as e:
                    errors.append(e)

            threads = [threading.Thread(target=commit, args=(t, errors)) for t in txns]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            assert not errors, errors
        assert kv.newest_version().result() == rounds
        assert sorted(kv.list().result()) == sorted(f"r{r}/p{i}" for r in range(rounds) for i in range(participants))

    run(3, 2)
    shutil.rmtree(path)
    os.makedirs(path)
    run(2, 3)


def test_a_trailing_hint_rewrite_never_recreates_a_deleted_store(tmp_path) -> None:
    """Commits inside the hint interval schedule one trailing rewrite of the
    ``latest`` hint; when the store was deleted meanwhile it writes nothing (it
    recreated the folder, with a hint naming a version of the old history)."""
    import shutil

    from tensorstore_py.kvstore.versioned.newest import HINT_INTERVAL

    path = tmp_path / "s"
    kv = tsp.KvStore.open(f"versioned+file://{path}/").result()
    for i in range(3):
        kv.write(f"k{i}", b"v").result()
    shutil.rmtree(path)
    time.sleep(HINT_INTERVAL + 0.5)
    assert not path.exists()
    os.makedirs(path)
    again = tsp.KvStore.open(f"versioned+file://{path}/").result()
    again.write("k", b"new").result()
    assert again.newest_version().result() == 1
