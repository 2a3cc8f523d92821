"""Incremental checkpoint saves (issue 22, item 2): unchanged chunks are linked, not written.

A step whose leaves mostly equal the previous step's writes only the changed
ones: the unchanged chunks' keys name the previous step's data objects. Those
objects stay while any kept step references them (retention, prompt reclaim,
a full collection with grace 0), ``verify`` checks them and their digests, and
``ls`` shows what each step added. The versioned store's ``link_value`` (what
the save uses) fails a commit whose source was changed meanwhile.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import tensorstore_py as tsp
from tensorstore_py.checkpoint import SaveOptions
from tensorstore_py.commands import checks, inspect
from tensorstore_py.core.errors import ConflictError, InvalidArgumentError, UnsupportedError
from tensorstore_py.core.future import run_sync
from tensorstore_py.kvstore.file import FileKvStore
from tensorstore_py.kvstore.memory import MemoryKvStore
from tensorstore_py.kvstore.transaction import Transaction
from tensorstore_py.kvstore.versioned import VersionedKvStore
from tensorstore_py.kvstore.versioned.links import link_value
from tensorstore_py.kvstore.versioned.staging import stage
from tensorstore_py.kvstore.versioned.verify import verify

T = 60
LEAVES = 10
SHAPE = (64, 1024)  # float32: 256 KiB per leaf, each chunk its own data object


def leaf_value(i: int, version: int) -> np.ndarray:
    return np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE) + 1000.0 * i + 0.5 * version


def tree_at(step: int) -> dict[str, np.ndarray]:
    """Leaf ``i`` last changed at the greatest step ``t <= step`` with ``t % 10 == i``:
    from one step to the next, one leaf in ten changes."""
    out = {}
    for i in range(LEAVES):
        last = max((t for t in range(step + 1) if t % LEAVES == i), default=0)
        out[f"w{i}"] = leaf_value(i, last)
    return out


def data_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in (root / "data").rglob("*") if p.is_file())


def chunk_objects(kv: VersionedKvStore, step: int) -> dict[str, tuple[str | None, int]]:
    """chunk key below the step's folder -> (data object, offset)."""
    pre = f"{step:012d}/"
    return {
        e.key[len(pre):]: (e.object, e.offset) for e in kv.entries(pre).result(T) if "/c/" in e.key
    }


def root_kv(root: Path) -> VersionedKvStore:
    return VersionedKvStore(FileKvStore(path=str(root)))


def leaf_keys(kv: VersionedKvStore, step: int) -> dict[str, str]:
    doc = json.loads(bytes(kv.read(f"{step:012d}/manifest.json").result(T).value))
    return {e["path"]: e["key"] for e in doc["leaves"]}


def verify_ok(url: str) -> None:
    report = run_sync(checks.verify(url))
    assert report.ok, "\n".join(p.message for p in report.problems)


def test_a_step_with_one_leaf_changed_writes_one_leaf(tmp_path: Path) -> None:
    root = tmp_path / "run"
    url = f"file://{root}/"
    mgr = tsp.CheckpointManager(url)
    mgr.save(1, tree_at(1)).result(T)
    full = data_bytes(root)
    assert full >= LEAVES * 256 << 10
    mgr.save(2, tree_at(2)).result(T)  # w2 changed, the other nine equal step 1's
    added = data_bytes(root) - full
    # one leaf's bytes plus the small values (manifest, digests, record) packed together
    assert added <= 0.12 * full, (added, full)
    # the unchanged leaves' chunks name step 1's data objects
    kv = root_kv(root)
    one, two = chunk_objects(kv, 1), chunk_objects(kv, 2)
    k1, k2 = leaf_keys(root_kv(root), 1), leaf_keys(root_kv(root), 2)
    for i in range(LEAVES):
        path = f"['w{i}']"
        c1, c2 = one[f"{k1[path]}/c/0/0"], two[f"{k2[path]}/c/0/0"]
        assert (c1 == c2) == (i != 2), (i, c1, c2)
    for step in (1, 2):
        got = mgr.restore(step)
        for name, want in tree_at(step).items():
            np.testing.assert_array_equal(got[name], want)
    verify_ok(url)
    steps = run_sync(inspect.ls(url))["steps"]
    assert [s["step"] for s in steps] == [1, 2]
    assert steps[0]["bytes_added"] >= LEAVES * 256 << 10
    assert (256 << 10) <= steps[1]["bytes_added"] <= 0.12 * steps[0]["bytes_added"]


def test_without_incremental_every_chunk_is_written(tmp_path: Path) -> None:
    root = tmp_path / "run"
    mgr = tsp.CheckpointManager(f"file://{root}/", options=SaveOptions(incremental=False))
    mgr.save(1, tree_at(1)).result(T)
    full = data_bytes(root)
    mgr.save(2, tree_at(2)).result(T)
    assert data_bytes(root) - full >= LEAVES * 256 << 10
    assert not [k for k in root_kv(root).list("000000000002/").result(T) if "digests" in k]


def test_a_leaf_whose_layout_changed_is_written_and_keys_follow_paths(tmp_path: Path) -> None:
    root = tmp_path / "run"
    url = f"file://{root}/"
    mgr = tsp.CheckpointManager(url)
    base = tree_at(1)
    mgr.save(1, base).result(T)
    full = data_bytes(root)
    # a new leaf sorts first (every leaf's index moves), w3 changes dtype, w4
    # changes shape: the other seven are linked by path, whatever their index
    nxt = {"a_new": np.ones(4, np.float32), **base}
    nxt["w3"] = base["w3"].astype(np.float64)
    nxt["w4"] = base["w4"][:32]
    mgr.save(2, nxt).result(T)
    added = data_bytes(root) - full
    assert (256 << 10) * 2.5 <= added <= (256 << 10) * 3.5, added  # w3 (512 KiB) + w4 (128 KiB) + small
    one, two = chunk_objects(root_kv(root), 1), chunk_objects(root_kv(root), 2)
    k1, k2 = leaf_keys(root_kv(root), 1), leaf_keys(root_kv(root), 2)
    assert k1["['w0']"] != k2["['w0']"]
    assert one[k1["['w0']"] + "/c/0/0"] == two[k2["['w0']"] + "/c/0/0"]
    got = mgr.restore(2)
    for name, want in nxt.items():
        np.testing.assert_array_equal(got[name], want)
        assert got[name].dtype == want.dtype
    verify_ok(url)


def test_retention_and_gc_keep_a_chunk_a_kept_step_references(tmp_path: Path) -> None:
    root = tmp_path / "run"
    url = f"file://{root}/"
    mgr = tsp.CheckpointManager(url, max_to_keep=1)
    mgr.save(1, tree_at(1)).result(T)
    kv = root_kv(root)
    before = chunk_objects(kv, 1)
    for step in (2, 3):  # each deletes the step before it: prompt reclaim runs
        mgr.save(step, tree_at(step)).result(T)
    assert mgr.all_steps() == [3]
    # step 3 still names the objects step 1 wrote of the eight leaves steps 2 and 3 left alone
    shared = set(before.values()) & set(chunk_objects(kv, 3).values())
    assert len(shared) == LEAVES - 2
    report = kv.gc(grace=0, dry_run=False, reclaim_deleted=True).result(T)
    assert report is not None
    fresh = tsp.CheckpointManager(url)
    got = fresh.restore(3)
    for name, want in tree_at(3).items():
        np.testing.assert_array_equal(got[name], want)
    verify_ok(url)
    # and only one step's worth of data is left: the replaced versions of w1, w2 went
    assert data_bytes(root) <= (LEAVES + 1) * (256 << 10), data_bytes(root)


def test_verify_finds_a_digest_that_does_not_describe_the_bytes(tmp_path: Path) -> None:
    root = tmp_path / "run"
    url = f"file://{root}/"
    mgr = tsp.CheckpointManager(url)
    mgr.save(1, tree_at(1)).result(T)
    kv = root_kv(root)
    key = "000000000001/digests/000000.json"
    doc = json.loads(bytes(kv.read(key).result(T).value))
    chunk = sorted(doc["chunks"])[0]
    doc["chunks"][chunk] = "0" * 32
    with Transaction() as txn:
        kv.with_transaction(txn).write(key, json.dumps(doc).encode()).result(T)
    report = run_sync(checks.verify(url))
    assert not report.ok
    bad = [p for p in report.problems if p.kind == "checksum"]
    assert len(bad) == 1 and chunk in bad[0].message and "0" * 32 in bad[0].message, report.problems
    # the next save does not trust it: the chunk is written again, and restores exactly
    mgr.save(2, tree_at(1)).result(T)
    assert chunk_objects(kv, 2)[chunk] != chunk_objects(kv, 1)[chunk]
    np.testing.assert_array_equal(mgr.restore(2)["w0"], tree_at(1)["w0"])


# -- the versioned store's link ---------------------------------------------------------
def _versioned(tmp_path: Path) -> VersionedKvStore:
    return VersionedKvStore(FileKvStore(path=str(tmp_path / "vs")))


def test_link_value_stages_the_same_object_under_a_new_generation(tmp_path: Path) -> None:
    kv = _versioned(tmp_path)
    big = bytes(range(256)) * 2048  # 512 KiB: its own data object
    kv.write("a", big).result(T)
    with Transaction() as txn:
        view = kv.with_transaction(txn)
        assert run_sync(link_value(view, "b", "a")) is True
        assert run_sync(link_value(view, "c", "missing")) is False
    ea, eb = kv.stat(["a", "b"]).result(T)
    assert ea is not None and eb is not None
    assert (ea.object, ea.offset, ea.size, ea.crc32c) == (eb.object, eb.offset, eb.size, eb.crc32c)
    assert ea.generation != eb.generation
    assert bytes(kv.read("b").result(T).value) == big
    assert kv.read("c").result(T).state == "missing"


def test_a_link_whose_source_changed_meanwhile_fails_the_commit(tmp_path: Path) -> None:
    kv = _versioned(tmp_path)
    kv.write("a", b"x" * (300 << 10)).result(T)
    kv.write("keep", b"y" * (300 << 10)).result(T)
    for change in ("delete", "rewrite"):
        txn = Transaction()
        view = kv.with_transaction(txn)
        assert run_sync(link_value(view, f"b-{change}", "keep" if change == "rewrite" else "a")) is True
        if change == "delete":
            kv.delete("a").result(T)
        else:
            kv.write("keep", b"z" * (300 << 10)).result(T)
        with pytest.raises(ConflictError):
            txn.commit().result(T)
        assert kv.read(f"b-{change}").result(T).state == "missing"


def test_gc_keeps_an_object_that_a_link_still_references(tmp_path: Path) -> None:
    kv = _versioned(tmp_path)
    payload = b"q" * (400 << 10)
    kv.write("a", payload).result(T)
    with Transaction() as txn:
        assert run_sync(link_value(kv.with_transaction(txn), "b", "a")) is True
    kv.delete("a").result(T)
    newest = kv.newest_version().result(T)
    kv.delete_versions(list(range(1, newest))).result(T)
    kv.gc(grace=0, dry_run=False, reclaim_deleted=True).result(T)
    assert bytes(kv.read("b").result(T).value) == payload
    assert verify(kv).result(T) == []


def test_link_value_needs_a_versioned_transaction(tmp_path: Path) -> None:
    with Transaction() as txn:
        with pytest.raises(InvalidArgumentError):
            run_sync(link_value(MemoryKvStore().with_transaction(txn), "b", "a"))
    kv = _versioned(tmp_path)
    kv.write("a", b"v").result(T)
    with pytest.raises(InvalidArgumentError):
        run_sync(link_value(kv, "b", "a"))
    txn = Transaction()
    run_sync(link_value(kv.with_transaction(txn), "b", "a"))
    with pytest.raises(UnsupportedError):
        stage(txn, kv).result(T)
    txn.abort()


# -- the identity shortcut: the very jax.Array saved last time ---------------------------
class _Hashed:
    """Counts the bytes the save path hashes (instrumentation of dedup's digest)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from tensorstore_py.checkpoint import dedup

        self.nbytes = 0
        real = dedup._digest_now

        def counted(data: np.ndarray) -> str:
            self.nbytes += data.nbytes
            return real(data)

        monkeypatch.setattr(dedup, "_digest_now", counted)


@pytest.mark.parametrize("staging", ["host", "device", "pinned_host"])
def test_the_same_jax_array_is_linked_without_reading_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, staging: str
) -> None:
    jax = pytest.importorskip("jax")
    hashed = _Hashed(monkeypatch)
    root = tmp_path / "run"
    url = f"file://{root}/"
    frozen = jax.device_put(leaf_value(0, 0))  # 256 KiB, kept as the same object
    mgr = tsp.CheckpointManager(url, options=SaveOptions(staging=staging))
    mgr.save(1, {"frozen": frozen, "adapter": jax.device_put(leaf_value(1, 1))}).result(T)
    assert hashed.nbytes == 2 * (256 << 10)
    hashed.nbytes = 0
    full = data_bytes(root)
    mgr.save(2, {"frozen": frozen, "adapter": jax.device_put(leaf_value(1, 2))}).result(T)
    assert hashed.nbytes == 256 << 10  # the adapter only: the frozen array was not read
    assert data_bytes(root) - full < 300 << 10
    one, two = chunk_objects(root_kv(root), 1), chunk_objects(root_kv(root), 2)
    key = leaf_keys(root_kv(root), 2)["['frozen']"] + "/c/0/0"
    assert one[key] == two[key]
    # a new array of the same values is hashed, then linked
    hashed.nbytes = 0
    again = jax.device_put(np.array(leaf_value(0, 0)))
    mgr.save(3, {"frozen": again, "adapter": jax.device_put(leaf_value(1, 2))}).result(T)
    assert hashed.nbytes == 2 * (256 << 10)
    assert chunk_objects(root_kv(root), 3)[key] == one[key]
    got = mgr.restore(3)
    np.testing.assert_array_equal(got["frozen"], leaf_value(0, 0))
    np.testing.assert_array_equal(got["adapter"], leaf_value(1, 2))
    verify_ok(url)


def test_the_same_jax_array_after_another_writer_changed_the_step_is_written(tmp_path: Path) -> None:
    jax = pytest.importorskip("jax")
    root = tmp_path / "run"
    url = f"file://{root}/"
    x = jax.device_put(leaf_value(0, 0))
    tsp.CheckpointManager(url).save(1, {"w": x}).result(T)
    # another writer's step 2 holds other values under the same path
    other = VersionedKvStore(FileKvStore(path=str(root)))
    tsp.CheckpointManager(other).save(2, {"w": leaf_value(0, 7)}).result(T)
    tsp.CheckpointManager(url).save(3, {"w": x}).result(T)  # x: the very array saved as step 1
    mgr = tsp.CheckpointManager(url)
    np.testing.assert_array_equal(mgr.restore(3)["w"], leaf_value(0, 0))
    np.testing.assert_array_equal(mgr.restore(2)["w"], leaf_value(0, 7))
    verify_ok(url)


def test_a_donated_array_is_never_taken_for_the_saved_one(tmp_path: Path) -> None:
    jax = pytest.importorskip("jax")
    root = tmp_path / "run"
    url = f"file://{root}/"
    x = jax.device_put(leaf_value(0, 0))
    mgr = tsp.CheckpointManager(url)
    mgr.save(1, {"w": x}).result(T)
    y = jax.jit(lambda a: a + 1, donate_argnums=0)(x)  # x's buffer is gone
    mgr.save(2, {"w": y}).result(T)
    np.testing.assert_array_equal(mgr.restore(2)["w"], leaf_value(0, 0) + 1)
    np.testing.assert_array_equal(mgr.restore(1)["w"], leaf_value(0, 0))
