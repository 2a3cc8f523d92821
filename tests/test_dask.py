"""``tsp.dask``: chunk alignment through transforms, lazy reads, writes with ONE commit,
and the staging API under it; Dask's process scheduler and a LocalCluster whose
worker is killed mid-ingest."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import signal
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
from tensorstore_py.errors import (
    ConflictError,
    InvalidArgumentError,
    ReadOnlyError,
)
from tensorstore_py.kvstore.versioned.staging import commit_staged, stage


def voxel(*coords: Any) -> np.ndarray:
    """A deterministic value per position (any rank)."""
    return (sum(c * w for c, w in zip(coords, (131, 7, 3))) % 65521).astype(np.uint16)


def expected(shape: tuple[int, ...]) -> np.ndarray:
    return voxel(*np.meshgrid(*(np.arange(n) for n in shape), indexing="ij", sparse=True))


# -- chunk grids through views ----------------------------------------------------------------------
def _chunk_ids(view: Any) -> list[np.ndarray]:
    """Per view dim, the stored (write) chunk index of every position, the slow way."""
    t, grid = view.transform, view.driver.write_chunk_shape
    out = [np.zeros(n, np.int64) for n in view.shape]
    for b, m in enumerate(t.output):
        if m.input_dimension is not None:
            d = m.input_dimension
            coords = t.domain.inclusive_min[d] + np.arange(view.shape[d])
            out[d] = (m.offset + m.stride * coords) // grid[b]
    return out


def test_storage_chunks_follow_steps_flips_transposes_and_shards(tmp_path: Path) -> None:
    ts = tsp.open(f"file://{tmp_path}/a/", create=True, shape=(50, 61, 7), dtype="uint8",
                  chunks=(5, 4, 7), shards=(10, 12, 7)).result()
    views = [ts, ts[3:47:2, ::-5], ts.T[:, 60:1:-3], ts[7, None, 2:], ts[:, ::13],
             ts.translate_to((-100, 5, 0))[:, 9:30], ts[0:0]]
    for v in views:
        chunks = tspd.storage_chunks(v)
        assert tuple(sum(c) for c in chunks) == v.shape
        for ids, c in zip(_chunk_ids(v), chunks):
            runs = [len(list(g)) for _, g in itertools.groupby(ids.tolist())]
            assert tuple(runs or [0]) == c
    assert tspd.storage_chunks(ts) == ((10,) * 5, (12,) * 5 + (1,), (7,))
    assert tspd.storage_chunks(ts, "read") == ((5,) * 10, (4,) * 15 + (1,), (7,))


# -- reads ---------------------------------------------------------------------------------------------
def test_to_dask_reads_lazily_from_one_pinned_snapshot(tmp_path: Path) -> None:
    data = expected((20, 30, 4))
    ts = tsp.open(f"versioned+file://{tmp_path}/", create=True, shape=data.shape, dtype="uint16",
                  chunks=(4, 6, 4), shards=(8, 12, 4)).result()
    ts.write(data).result()
    view = ts[2:19:3, ::-2].transpose(2, 0, 1)
    arr = tspd.to_dask(view)
    assert arr.chunks == tspd.storage_chunks(view)
    ts.write(np.zeros_like(data)).result()  # after building: the graph reads its snapshot
    np.testing.assert_array_equal(arr.compute(), data[2:19:3, ::-2].transpose(2, 0, 1))
    inner = tspd.to_dask(ts, chunks="read")
    assert inner.chunks == tspd.storage_chunks(ts, "read")
    assert int(inner.sum().compute()) == 0


def test_process_scheduler_reads_and_writes(tmp_path: Path) -> None:
    data = expected((16, 24))
    plain = tsp.open(f"file://{tmp_path}/plain/", create=True, shape=data.shape, dtype="uint16",
                     chunks=(5, 7)).result()
    vers = tsp.open(f"versioned+file://{tmp_path}/v/", create=True, shape=data.shape, dtype="uint16",
                    chunks=(5, 7)).result()
    before = vers.kvstore.newest_version().result()
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(2, mp_context=spawn) as pool, dask.config.set(scheduler="processes", pool=pool):
        assert tspd.store(da.from_array(data, chunks=(8, 8)), plain) is None  # realigned
        info = tspd.store(da.from_array(data, chunks=(5, 14)), vers)
        np.testing.assert_array_equal(tspd.to_dask(vers[::-1]).compute(), data[::-1])
    np.testing.assert_array_equal(plain.read().result(), data)
    np.testing.assert_array_equal(vers.read().result(), data)
    assert info.version == before + 1 == vers.kvstore.newest_version().result()


# -- writes ----------------------------------------------------------------------------------------------
def test_misaligned_blocks_are_realigned_or_refused(tmp_path: Path) -> None:
    ts = tsp.open(f"file://{tmp_path}/a/", create=True, shape=(20, 20), dtype="int32", chunks=(6, 5)).result()
    src = da.arange(400, dtype="int32", chunks=100).reshape(20, 20).rechunk((7, 10))
    # boundaries 7 and 14 move up to the chunk boundaries 12 and 18
    assert tspd._aligned(src, tspd.storage_chunks(ts), True).chunks == ((12, 6, 2), (10, 10))
    with pytest.raises(InvalidArgumentError, match="dimension 0: a dask block boundary at 7 cuts"):
        tspd.store(src, ts, realign=False)
    tspd.store(src, ts)
    np.testing.assert_array_equal(ts.read().result(), np.arange(400, dtype="int32").reshape(20, 20))
    # a strided view: blocks of whole chunks as the view sees them
    tspd.store(da.zeros((10, 20), dtype="int32", chunks=(3, 20)), ts[::2])
    assert (ts[::2].read().result() == 0).all() and (ts[1::2].read().result() != 0).all()


def test_bad_arguments_fail_before_any_task(tmp_path: Path) -> None:
    ts = tsp.open(f"versioned+file://{tmp_path}/", create=True, shape=(8,), dtype="uint8").result()
    v = ts.kvstore.newest_version().result()
    with pytest.raises(InvalidArgumentError, match="shape"):
        tspd.store(da.zeros((9,), dtype="uint8"), ts)
    with pytest.raises(InvalidArgumentError, match="same_kind"):
        tspd.store(da.zeros((8,), dtype="float32"), ts)
    snap = tsp.open({"driver": "zarr3", "kvstore": ts.kvstore.snapshot(v)}).result()
    with pytest.raises(ReadOnlyError):
        tspd.store(da.zeros((8,), dtype="uint8"), snap)
    with pytest.raises(InvalidArgumentError, match="txn_id"):
        tspd.store(da.zeros((8,), dtype="uint8"), ts, txn_id="no spaces allowed")
    assert ts.kvstore.newest_version().result() == v


def _fail_on_block_2(x: np.ndarray, block_info: Any = None) -> np.ndarray:
    if block_info[None]["chunk-location"] == (2,):
        raise RuntimeError("block 2 fails")
    return x + 1


def test_a_failed_graph_commits_nothing(tmp_path: Path) -> None:
    ts = tsp.open(f"versioned+file://{tmp_path}/", create=True, shape=(40,), dtype="uint8", chunks=(5,)).result()
    kv = ts.kvstore
    v = kv.newest_version().result()
    src = da.zeros((40,), dtype="uint8", chunks=5).map_blocks(_fail_on_block_2, dtype="uint8")
    with pytest.raises(RuntimeError, match="block 2 fails"):
        dask.compute(tspd.store(src, ts, compute=False), scheduler="threads")
    assert kv.newest_version().result() == v
    assert (ts.read().result() == 0).all()


def test_delayed_store_commits_once_with_message(tmp_path: Path) -> None:
    ts = tsp.open(f"versioned+file://{tmp_path}/", create=True, shape=(12, 12), dtype="uint16",
                  chunks=(4, 4)).result()
    kv = ts.kvstore
    job = tspd.store(da.ones((12, 12), dtype="uint16", chunks=4), ts, compute=False, txn_id="ingest-1",
                     message="ones", metadata={"source": "test"})
    assert kv.newest_version().result() == 1  # nothing yet
    info = job.compute(scheduler="threads")
    assert info.version == kv.newest_version().result() == 2 and info.txn_id == "ingest-1"
    rec = kv.versions().result()[-1]
    assert rec.message == "ones" and rec.metadata == {"source": "test"}
    assert sorted(kv.changed_keys(2).result()) == sorted(f"c/{i}/{j}" for i in range(3) for j in range(3))


# -- the staging API -----------------------------------------------------------------------------------
def _staged(kv: Any, writes: dict[str, bytes]) -> Any:
    txn = tsp.Transaction()
    bound = kv.with_transaction(txn)
    for k, v in writes.items():
        bound.write(k, v).result()
    return stage(txn, kv).result()


def test_staging_commits_parts_as_one_version(tmp_path: Path) -> None:
    kv = tsp.KvStore.open(f"versioned+file://{tmp_path}/").result()
    a = _staged(kv, {"a": b"1" * 1000, "big": b"x" * 300_000})
    b = _staged(kv.with_path("sub"), {"b": b"2"})
    assert kv.newest_version().result() == 0  # staged: durable, not visible
    closed = tsp.Transaction()
    closed.abort()
    with pytest.raises(InvalidArgumentError, match="no longer open"):
        stage(closed, kv)
    info = commit_staged(kv, [a, b]).result()
    assert info.version == 1 and info.keys_changed == 3
    assert kv.list().result() == ["a", "big", "sub/b"]
    assert bytes(kv.read("big").result().value) == b"x" * 300_000


def test_a_repeated_commit_of_the_same_parts_commits_once(tmp_path: Path) -> None:
    kv = tsp.KvStore.open(f"versioned+file://{tmp_path}/").result()
    parts = [_staged(kv, {"a": b"1"}), _staged(kv, {"b": b"2"})]
    first = commit_staged(kv, parts, txn_id="job-7").result()
    # a retried commit task, and two racing ones: still the one version
    again = commit_staged(kv, parts, txn_id="job-7").result()
    fresh = [_staged(kv, {"a": b"3"})]
    racing = [commit_staged(kv, fresh, txn_id="job-8") for _ in range(2)]
    r1, r2 = (f.result() for f in racing)
    assert first.version == again.version == 1
    assert r1.version == r2.version == 2 == kv.newest_version().result()


def test_staging_refuses_duplicates_conflicts_and_foreign_parts(tmp_path: Path) -> None:
    kv = tsp.KvStore.open(f"versioned+file://{tmp_path}/one/").result()
    other = tsp.KvStore.open(f"versioned+file://{tmp_path}/two/").result()
    a, b = _staged(kv, {"k": b"a"}), _staged(kv, {"k": b"b"})
    with pytest.raises(InvalidArgumentError, match="staged by both part 0 and part 1"):
        commit_staged(kv, [a, b]).result()
    with pytest.raises(InvalidArgumentError, match="another version history"):
        commit_staged(other, [a]).result()
    kv.write("k", b"someone else").result()  # a newer version changes a staged key
    with pytest.raises(ConflictError, match="'k'"):
        commit_staged(kv, [a]).result()
    assert kv.newest_version().result() == 1 and bytes(kv.read("k").result().value) == b"someone else"


# -- a LocalCluster whose worker dies mid-ingest ----------------------------------------------------------
@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=None) as c, distributed.Client(c) as client:
        yield client


def _slow_voxels(x: np.ndarray, block_info: Any = None) -> np.ndarray:
    time.sleep(0.25)
    loc = block_info[None]["array-location"]
    return voxel(*np.meshgrid(*(np.arange(a, b) for a, b in loc), indexing="ij", sparse=True))


def _stage_keys(client: Any) -> dict[str, list[str]]:
    return {w: [k for k in keys if "_stage_block" in str(k)] for w, keys in client.has_what().items()}


@pytest.mark.parametrize("kills", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_killed_worker_still_gives_exactly_one_exact_commit(cluster: Any, tmp_path: Path, kills: int) -> None:
    shape = (8 * kills + 8, 64, 64)
    ts = tsp.open(f"versioned+file://{tmp_path}/", create=True, shape=shape, dtype="uint16",
                  chunks=(2, 32, 32)).result()
    kv = ts.kvstore
    before = kv.newest_version().result()
    src = da.zeros(shape, dtype="uint16", chunks=(2, 32, 32)).map_blocks(_slow_voxels, dtype="uint16")
    job = cluster.compute(tspd.store(src, ts, compute=False, message="ingest"))
    lost = 0
    for _ in range(kills):
        deadline = time.monotonic() + 60
        while True:  # a worker holding staged results (not yet sent to the commit task)
            held = _stage_keys(cluster)
            worker = max(held, key=lambda w: len(held[w]), default=None)
            if worker is not None and len(held[worker]) >= 2:
                break
            assert not job.done() and time.monotonic() < deadline, "the graph ended before a kill"
            time.sleep(0.02)
        pid = cluster.run(os.getpid, workers=[worker])[worker]
        os.kill(pid, signal.SIGKILL)
        lost += len(held[worker])
        time.sleep(0.5)
    info = job.result(timeout=180)

    # exactly one new version, holding exactly the volume
    assert kv.newest_version().result() == before + 1 == info.version
    np.testing.assert_array_equal(ts.read().result(), expected(shape))
    grid = [range(-(-n // c)) for n, c in zip(shape, (2, 32, 32))]
    chunk_keys = {"c/" + "/".join(map(str, cell)) for cell in itertools.product(*grid)}
    assert set(kv.changed_keys(info.version).result()) == chunk_keys
    # the killed worker's staged data exists on disk but nothing references it
    referenced = {e.object for e in kv.entries("c/").result() if e.object}
    on_disk = set(kv.base.list("data/").result())
    assert referenced < on_disk
    assert len(on_disk) - len(referenced) >= lost >= kills * 2


def test_failed_task_on_the_cluster_commits_nothing(cluster: Any, tmp_path: Path) -> None:
    ts = tsp.open(f"versioned+file://{tmp_path}/", create=True, shape=(40,), dtype="uint8", chunks=(5,)).result()
    v = ts.kvstore.newest_version().result()
    src = da.zeros((40,), dtype="uint8", chunks=5).map_blocks(_fail_on_block_2, dtype="uint8")
    with pytest.raises(RuntimeError, match="block 2 fails"):
        cluster.compute(tspd.store(src, ts, compute=False)).result(timeout=60)
    assert ts.kvstore.newest_version().result() == v


# -- downsampled views on every scheduler -------------------------------------------------------------------
def _downsampled(tmp_path: Path) -> tuple[list[Any], list[np.ndarray]]:
    data = expected((18, 26))
    plain = tsp.open(f"file://{tmp_path}/ds/", create=True, shape=data.shape, dtype="uint16",
                     chunks=(6, 8)).result()
    plain.write(data).result()
    vers = tsp.open(f"versioned+file://{tmp_path}/dsv/", create=True, shape=data.shape, dtype="uint16",
                    chunks=(6, 8)).result()
    vers.write(data).result()
    views = [tsp.downsample(plain, [2, 3], "mean"), tsp.downsample(vers, 2, "max")[1:, ::-2],
             tsp.downsample(tsp.downsample(plain[3:], 2, "stride"), [1, 2], "min")]
    want = [v.read().result() for v in views]
    assert want[0].shape == (9, 9) and want[0].any()
    return views, want


@pytest.mark.parametrize("scheduler", ["threads", "sync", "processes"])
def test_downsampled_views_on_local_schedulers(tmp_path: Path, scheduler: str) -> None:
    views, want = _downsampled(tmp_path)
    if scheduler == "processes":
        spawn = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(2, mp_context=spawn) as pool, dask.config.set(scheduler="processes", pool=pool):
            got = [tspd.to_dask(v).compute() for v in views]
    else:
        got = [tspd.to_dask(v).compute(scheduler=scheduler) for v in views]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_downsampled_views_on_a_local_cluster(cluster: Any, tmp_path: Path) -> None:
    views, want = _downsampled(tmp_path)
    for v, w in zip(views, want):
        np.testing.assert_array_equal(cluster.compute(tspd.to_dask(v)).result(), w)
