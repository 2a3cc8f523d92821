"""``tsp.dask`` ingests keep their ACID promises where they scale out: staged data
survives a collector in another process, a txn_id commits once even when Dask
recomputes the graph after the commit landed, an in-place update conflicts with a
concurrent change, and leased snapshots read in worker processes."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

dask = pytest.importorskip("dask")
distributed = pytest.importorskip("distributed")

import dask.array as da

import tensorstore_py as tsp
import tensorstore_py.dask as tspd
from tensorstore_py.errors import ConflictError, DataCorruptionError, InvalidArgumentError
from tensorstore_py.kvstore.versioned import leases, staging
from tensorstore_py.kvstore.versioned.format import commit_name
from tensorstore_py.kvstore.versioned.leases import LINGER
from tensorstore_py.kvstore.versioned.staging import commit_staged, stage

# a collector in another process must see only the leases a test means: this
# process's writers drop their claim LINGER after they end (no writer linger)
pytestmark = pytest.mark.usefixtures("no_writer_linger")


def _gc_elsewhere(url: str, *, reclaim: bool = False) -> dict[str, Any]:
    """A collector with no grace at all, in another process (so only leases
    written to the store can stop it); its report."""
    code = (
        "import json, sys, tensorstore_py as tsp\n"
        "kv = tsp.KvStore.open(sys.argv[1]).result()\n"
        f"r = kv.gc(grace=0, read_grace=0, dry_run=False, reclaim_deleted={reclaim}).result()\n"
        "print(json.dumps({'deleted': list(r.deleted), 'leases': r.leases}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, url], check=True, capture_output=True, text=True,
                         timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _settle_leases() -> None:
    time.sleep(LINGER * 2.5)  # released holds are written (deleted) after LINGER


def _no_writer_linger() -> None:
    """(Run in a worker process) as the fixture ``no_writer_linger`` there."""
    leases.WRITER_LINGER = 0.0


def _records(kv: Any) -> list[Any]:
    return [kv.commit_details(v).result() for v in range(1, kv.newest_version().result() + 1)]


# -- 1. staged data is protected until the commit, and checked by it -----------------------------------
def _wait_for(path: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.01)


def test_staged_data_outlives_a_collector_without_grace_until_the_commit(tmp_path: Path) -> None:
    url = f"versioned+file://{tmp_path}/s/"
    n = 4096  # 8 KiB chunks: each task packs its chunk into a data object of its own
    ts = tsp.open(url, create=True, shape=(2 * n,), dtype="uint16", chunks=(n,)).result()
    kv = ts.kvstore
    objects = len(kv.base.list("data/").result())
    go = tmp_path / "go"

    def block(x: np.ndarray, block_info: Any = None) -> np.ndarray:
        lo = block_info[None]["array-location"][0][0]
        if lo:
            _wait_for(go)  # block 1 waits: block 0 is staged and its transaction is over
        return (np.arange(lo, lo + len(x)) % 65521).astype("uint16")

    src = da.zeros((2 * n,), dtype="uint16", chunks=n).map_blocks(block, dtype="uint16")
    result: dict[str, Any] = {}

    def ingest() -> None:
        try:
            result["info"] = tspd.store(src, ts, txn_id="ingest-1")
        except BaseException as e:
            result["error"] = e

    t = threading.Thread(target=ingest)
    with dask.config.set(scheduler="threads", num_workers=2):
        t.start()
        deadline = time.monotonic() + 60
        while len(kv.base.list("data/").result()) == objects:  # block 0's data object is staged
            assert time.monotonic() < deadline and t.is_alive()
            time.sleep(0.01)
        _settle_leases()
        report = _gc_elsewhere(url)
        go.touch()
        t.join(120)
    assert not [n for n in report["deleted"] if n.startswith("data/")]
    assert "error" not in result, result.get("error")
    assert result["info"].version == kv.newest_version().result()
    np.testing.assert_array_equal(ts.read().result(), (np.arange(2 * n) % 65521).astype("uint16"))


def _block_after_go(x: np.ndarray, block_info: Any = None, *, go: str = "") -> np.ndarray:
    lo = block_info[None]["array-location"][0][0]
    if lo:
        _wait_for(Path(go))
    return (np.arange(lo, lo + len(x)) % 65521).astype("uint16")


def test_a_delayed_ingest_on_a_cluster_keeps_its_staged_data_until_the_commit(cluster: Any, tmp_path: Path) -> None:
    url = f"versioned+file://{tmp_path}/s/"
    n = 4096
    ts = tsp.open(url, create=True, shape=(2 * n,), dtype="uint16", chunks=(n,)).result()
    kv = ts.kvstore
    objects = len(kv.base.list("data/").result())
    cluster.run(_no_writer_linger)  # the worker's lease goes before the collector runs
    src = da.zeros((2 * n,), dtype="uint16", chunks=n).map_blocks(
        _block_after_go, dtype="uint16", go=str(tmp_path / "go"))
    job = cluster.compute(tspd.store(src, ts, compute=False, txn_id="ingest-2"))  # the Delayed is gone
    deadline = time.monotonic() + 60
    while len(kv.base.list("data/").result()) == objects:  # block 0 is staged on the worker
        assert time.monotonic() < deadline and not job.done()
        time.sleep(0.01)
    _settle_leases()
    report = _gc_elsewhere(url)
    (tmp_path / "go").touch()
    info = job.result(timeout=120)
    assert not [n for n in report["deleted"] if n.startswith("data/")]
    assert info.version == kv.newest_version().result()
    np.testing.assert_array_equal(ts.read().result(), (np.arange(2 * n) % 65521).astype("uint16"))


def test_commit_staged_refuses_parts_whose_data_was_collected(tmp_path: Path) -> None:
    url = f"versioned+file://{tmp_path}/"
    kv = tsp.KvStore.open(url).result()
    kv.write("old", b"o").result()
    parts = []
    for k in ("a", "b"):
        txn = tsp.Transaction()
        kv.with_transaction(txn).write(k, k.encode() * 200_000).result()  # a data object of its own
        parts.append(stage(txn, kv).result())
    _settle_leases()
    assert kv.base.list("data/").result()
    report = _gc_elsewhere(url)  # nothing protects staged data nobody leases
    assert [n for n in report["deleted"] if n.startswith("data/")]
    with pytest.raises(DataCorruptionError, match="staged parts reference"):
        commit_staged(kv, parts, txn_id="late").result()
    assert kv.newest_version().result() == 1 and kv.list().result() == ["old"]

    # with protect() held from before the first stage, the same sequence commits
    hold = staging.protect(kv).result()
    try:
        txn = tsp.Transaction()
        kv.with_transaction(txn).write("c", b"c" * 200_000).result()
        part = stage(txn, kv).result()
        _settle_leases()
        _gc_elsewhere(url)
        info = commit_staged(kv, [part]).result()
    finally:
        hold.release()
    assert info.version == 2 and bytes(kv.read("c").result().value) == b"c" * 200_000


# -- 2. a txn_id is an idempotency key, whatever the parts' bases -------------------------------------
def _block_once_then_wait(x: np.ndarray, block_info: Any = None, *, marks: str = "") -> np.ndarray:
    """The source of a block; when Dask computes it again (its worker died), it
    first waits for ``marks/go``, so that another writer can commit meanwhile."""
    lo = block_info[None]["array-location"][0][0]
    mark = Path(marks) / f"ran-{lo}"
    if mark.exists():
        _wait_for(Path(marks) / "go")
    mark.touch()
    return np.full(x.shape, 7, dtype="uint16")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    # one worker process: when it dies, every staged result is lost and recomputed
    with distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=True,
                                  dashboard_address=None) as c, distributed.Client(c) as client:
        yield client


def test_a_worker_dying_after_the_commit_landed_does_not_commit_twice(cluster: Any, tmp_path: Path) -> None:
    url = f"versioned+file://{tmp_path}/v/"
    ts = tsp.open(url, create=True, shape=(8,), dtype="uint16", chunks=(4,)).result()
    kv = ts.kvstore
    before = kv.newest_version().result()
    # the same array, through a store whose process dies right after the commit record lands
    crashing = tsp.open({"driver": "zarr3", "kvstore": {"driver": "versioned", "base": {
        "driver": "fault", "base": f"file://{tmp_path}/v/",
        "schedule": [{"op": "write", "key_pattern": commit_name(before + 1), "exit_code": 17}],
    }}}).result()
    src = da.zeros((8,), dtype="uint16", chunks=4).map_blocks(
        _block_once_then_wait, dtype="uint16", marks=str(tmp_path))
    job = cluster.compute(tspd.store(src, crashing, compute=False, txn_id="ingest-7"))
    deadline = time.monotonic() + 120
    while kv.newest_version().result() == before:  # the commit landed; its worker is dead
        assert time.monotonic() < deadline and not job.done()
        time.sleep(0.05)
    ts[0:4].write(np.full(4, 99, dtype="uint16")).result()  # another writer, meanwhile
    (tmp_path / "go").touch()
    info = job.result(timeout=120)

    assert info.version == before + 1
    assert kv.newest_version().result() == before + 2  # ours, then the other writer's: no third
    assert [r.version for r in _records(kv) if r.txn_id == "ingest-7"] == [before + 1]
    np.testing.assert_array_equal(ts.read().result(), [99] * 4 + [7] * 4)


def test_running_the_same_txn_id_again_returns_its_commit(tmp_path: Path) -> None:
    ts = tsp.open(f"versioned+file://{tmp_path}/", create=True, shape=(8,), dtype="uint16",
                  chunks=(4,)).result()
    kv = ts.kvstore
    src = da.full((8,), 7, dtype="uint16", chunks=4)
    with dask.config.set(scheduler="threads"):
        first = tspd.store(src, ts, txn_id="ingest-9")
        ts[0:4].write(np.full(4, 99, dtype="uint16")).result()  # another writer
        again = tspd.store(src, ts, txn_id="ingest-9")  # e.g. re-run after KilledWorker
    assert again.version == first.version == kv.newest_version().result() - 1
    assert [r.version for r in _records(kv) if r.txn_id == "ingest-9"] == [first.version]
    np.testing.assert_array_equal(ts.read().result(), [99] * 4 + [7] * 4)


#: an ingest whose process dies right after its commit record landed (no ``result``
#: written), with short leases so that its lease expires soon after
_DIES_AFTER_COMMIT = r"""
import sys
import dask, dask.array as da
import tensorstore_py as tsp, tensorstore_py.dask as tspd
from tensorstore_py.kvstore.versioned import leases
leases.TTL, leases.REFRESH = 1.5, 0.5
path, record = sys.argv[1:3]
view = tsp.open({"driver": "zarr3", "kvstore": {"driver": "versioned", "base": {
    "driver": "fault", "base": f"file://{path}",
    "schedule": [{"op": "write", "key_pattern": record, "exit_code": 17}]}}}).result()
with dask.config.set(scheduler="sync"):
    tspd.store(da.full((8,), 7, dtype="uint16", chunks=4), view, txn_id="ingest-11")
"""


def test_a_txn_id_outlives_a_collector_when_its_process_died_before_the_result(tmp_path: Path) -> None:
    """The commit record carries the id, the attempt bounds the search for it: a
    collector in another process (no grace, the dead ingest's lease expired) keeps
    that attempt while the version is retained, so a re-run commits nothing."""
    ts = tsp.open(f"versioned+file://{tmp_path}/v/", create=True, shape=(8,), dtype="uint16",
                  chunks=(4,)).result()
    kv = ts.kvstore
    before = kv.newest_version().result()
    run = subprocess.run([sys.executable, "-c", _DIES_AFTER_COMMIT, f"{tmp_path}/v/", commit_name(before + 1)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 17, run.stderr
    assert kv.newest_version().result() == before + 1
    time.sleep(2.0)  # its lease (TTL 1.5 s) expires
    _settle_leases()
    report = _gc_elsewhere(f"versioned+file://{tmp_path}/v/")
    assert not [n for n in report["deleted"] if n.startswith("txns/")], report
    ts[0:4].write(np.full(4, 99, dtype="uint16")).result()  # another writer, meanwhile
    with dask.config.set(scheduler="threads"):
        again = tspd.store(da.full((8,), 7, dtype="uint16", chunks=4), ts, txn_id="ingest-11")
    assert again.version == before + 1
    assert kv.newest_version().result() == before + 2
    assert [r.version for r in _records(kv) if r.txn_id == "ingest-11"] == [before + 1]
    np.testing.assert_array_equal(ts.read().result(), [99] * 4 + [7] * 4)


# -- 6. an in-place update conflicts with a concurrent change -------------------------------------------
def test_an_in_place_update_conflicts_with_a_change_after_its_read(tmp_path: Path) -> None:
    ts = tsp.open(f"versioned+file://{tmp_path}/", create=True, shape=(8,), dtype="uint16",
                  chunks=(4,)).result()
    kv = ts.kvstore
    ts.write(np.arange(8, dtype="uint16")).result()
    with dask.config.set(scheduler="threads"):
        tspd.store(tspd.to_dask(ts) + 1, ts)  # nothing in between: fine
        np.testing.assert_array_equal(ts.read().result(), np.arange(8) + 1)
        plus_one = tspd.to_dask(ts) + 1  # reads the version pinned now
        ts[4:8].write(np.full(4, 50, dtype="uint16")).result()  # a concurrent change
        v = kv.newest_version().result()
        with pytest.raises(ConflictError, match="c/1"):
            tspd.store(plus_one, ts)
    assert kv.newest_version().result() == v
    np.testing.assert_array_equal(ts.read().result(), [1, 2, 3, 4, 50, 50, 50, 50])


def test_an_ingest_never_commits_chunks_over_an_array_recreated_meanwhile(tmp_path: Path) -> None:
    # the tasks encode chunks by the metadata the view carries; another writer
    # replaces the array (other dtype) before the graph runs: nothing committed
    url = f"versioned+file://{tmp_path}/"
    ts = tsp.open(url, create=True, shape=(8,), dtype="int32", chunks=(4,)).result()
    graph = tspd.store(da.arange(8, chunks=4, dtype="int32"), ts, compute=False)
    tsp.open(url, create=True, delete_existing=True, shape=(8,), dtype="float64", chunks=(4,)).result()
    v = ts.kvstore.newest_version().result()
    with dask.config.set(scheduler="threads"), pytest.raises(ConflictError, match="'zarr.json'"):
        graph.compute()
    assert ts.kvstore.newest_version().result() == v
    np.testing.assert_array_equal(tsp.open(url).result().read().result(), np.zeros(8))


def test_an_optimized_in_place_update_still_conflicts(tmp_path: Path) -> None:
    # dask.optimize fuses the to_dask layer into its consumers: only the key of
    # its view says which version the graph reads
    ts = tsp.open(f"versioned+file://{tmp_path}/", create=True, shape=(8,), dtype="uint16",
                  chunks=(4,)).result()
    kv = ts.kvstore
    ts.write(np.arange(8, dtype="uint16")).result()
    (plus_one,) = dask.optimize(tspd.to_dask(ts) + 1)
    ts[0:4].write(np.full(4, 50, dtype="uint16")).result()  # a concurrent change
    v = kv.newest_version().result()
    with dask.config.set(scheduler="threads"), pytest.raises(ConflictError, match="c/0"):
        tspd.store(plus_one, ts)
    assert kv.newest_version().result() == v
    np.testing.assert_array_equal(ts.read().result(), [50] * 4 + [4, 5, 6, 7])


def test_a_persisted_in_place_update_conflicts_given_its_read_version(tmp_path: Path) -> None:
    ts = tsp.open(f"versioned+file://{tmp_path}/", create=True, shape=(8,), dtype="uint16",
                  chunks=(4,)).result()
    kv = ts.kvstore
    ts.write(np.arange(8, dtype="uint16")).result()
    read_at = kv.newest_version().result()
    plus_one = (tspd.to_dask(ts) + 1).persist(scheduler="threads")  # the graph is gone
    ts[4:8].write(np.full(4, 50, dtype="uint16")).result()
    v = kv.newest_version().result()
    with dask.config.set(scheduler="threads"):
        with pytest.raises(ConflictError, match="c/1"):
            tspd.store(plus_one, ts, read_version=read_at)
        assert kv.newest_version().result() == v
        np.testing.assert_array_equal(ts.read().result(), [0, 1, 2, 3] + [50] * 4)
        with pytest.raises(InvalidArgumentError, match="read_version"):
            tspd.store(plus_one, ts, read_version=-1)
        info = tspd.store(plus_one, ts, read_version=v)  # said to be read at v: no conflict
    assert info.version == v + 1
    np.testing.assert_array_equal(ts.read().result(), np.arange(8) + 1)


# -- 7. leased snapshots read in every scheduler ---------------------------------------------------------
def _retire(url: str, kv: Any, version: int) -> None:
    """Retention deletes ``version`` and a collector without grace reclaims what it can."""
    kv.delete_versions([version]).result()
    _gc_elsewhere(url, reclaim=True)


def test_a_leased_snapshot_reads_in_worker_processes_after_its_version_was_deleted(
    cluster: Any, tmp_path: Path
) -> None:
    url = f"versioned+file://{tmp_path}/"
    ts = tsp.open(url, create=True, shape=(8, 8), dtype="uint16", chunks=(4, 4)).result()
    kv = ts.kvstore
    data = np.arange(64, dtype="uint16").reshape(8, 8)
    ts.write(data).result()
    v = kv.newest_version().result()
    snap = tsp.open(f"{url}@{v}").result()  # a pinned view: checked and leased here
    ts.write(data * 0 + 5).result()
    _retire(url, kv, v)
    arr = tspd.to_dask(snap)
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(2, mp_context=spawn) as pool:
        np.testing.assert_array_equal(arr.compute(scheduler="processes", pool=pool), data)
    np.testing.assert_array_equal(cluster.compute(arr).result(timeout=60), data)


def test_to_dask_of_a_live_view_leases_the_version_it_pins(cluster: Any, tmp_path: Path) -> None:
    url = f"versioned+file://{tmp_path}/"
    ts = tsp.open(url, create=True, shape=(8, 8), dtype="uint16", chunks=(4, 4)).result()
    kv = ts.kvstore
    data = np.arange(64, dtype="uint16").reshape(8, 8)
    ts.write(data).result()
    v = kv.newest_version().result()
    arr = tspd.to_dask(ts)  # pins v
    ts.write(data * 0 + 5).result()
    _retire(url, kv, v)
    np.testing.assert_array_equal(cluster.compute(arr).result(timeout=60), data)
    np.testing.assert_array_equal(arr.compute(scheduler="threads"), data)


def test_a_txn_id_reused_for_other_keys_is_refused(tmp_path: Path) -> None:
    kv = tsp.KvStore.open(f"versioned+file://{tmp_path}/").result()

    def part(k: str) -> Any:
        txn = tsp.Transaction()
        kv.with_transaction(txn).write(k, b"v").result()
        return stage(txn, kv).result()

    first = commit_staged(kv, [part("a")], txn_id="job-1").result()
    assert commit_staged(kv, [part("a")], txn_id="job-1").result().version == first.version
    with pytest.raises(InvalidArgumentError, match="must not be reused"):
        commit_staged(kv, [part("b")], txn_id="job-1").result()
    assert kv.newest_version().result() == first.version and kv.list().result() == ["a"]


def test_an_open_array_view_of_a_checkpoint_reads_in_worker_processes(tmp_path: Path) -> None:
    from tensorstore_py.checkpoint.api import leaf_paths, open_array, save

    url = f"versioned+file://{tmp_path}/"
    w = np.arange(128.0 * 128).reshape(128, 128)  # 128 KiB: a leaf of its own, not packed with others
    save(url, {"w": w}, step=1).result()
    view = open_array(url, leaf_paths(url).result()[0]).result()  # leased, described by the manifest
    save(url, {"w": w * 0}, step=2).result()
    kv = tsp.KvStore.open(url).result()
    _retire(url, kv, view.kvstore.version)
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(2, mp_context=spawn) as pool:
        np.testing.assert_array_equal(tspd.to_dask(view[::-1]).compute(scheduler="processes", pool=pool),
                                      w[::-1])
