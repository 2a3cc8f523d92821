"""Round trips of object-store operations, counted through the shaping proxy.

The GCS emulator and moto behind a ShapingProxy with a time to first byte, so
that requests in flight together overlap: ``sequential_round_trips`` is then
the number of answers an operation waited for one after another.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import tensorstore_py as tsp
from tensorstore_py.core.future import get_loop
from tensorstore_py.kvstore.versioned import newest as versioned_newest
from tensorstore_py.kvstore.versioned.leases import LINGER
from tensorstore_py.testing.shaping_proxy import ShapingProxy

T = 60


def _rounds(proxy: ShapingProxy, op: Callable[[], Any]) -> tuple[int, int]:
    """(sequential round trips, requests) of ``op`` up to the moment it returned."""
    proxy.reset_counters()
    op()
    done = time.monotonic()
    log = [r for r in proxy.request_log() if r[1] < done]
    return proxy.sequential_round_trips(until=done), len(log)


def _commit_rounds(proxy: ShapingProxy, op: Callable[[], Any]) -> tuple[int, list[str]]:
    """(sequential round trips, request lines) of a versioned-store commit ``op``
    at a time to first byte of 100 ms (long enough that requests the client sends
    together overlap on a loaded machine too), leaving out the ``latest`` hint,
    which a commit writes in the background after it returned."""
    proxy.ttfb = 0.1
    proxy.reset_counters()
    op()
    done = time.monotonic()
    log = [r for r in proxy.request_log() if r[1] < done and "latest" not in r[0]]
    chain, last_end = 0, float("-inf")
    for _, start, end in sorted(log, key=lambda r: r[2]):  # as ShapingProxy.sequential_round_trips
        if start >= last_end:
            chain, last_end = chain + 1, end
    return chain, [line for line, _, _ in log]


def _data_reads(lines: list[str]) -> list[str]:
    """The reads of data objects among ``lines`` (gcs: ``v%2Fdata%2F``, s3: ``/v/data/``)."""
    return [line for line in lines if line.startswith("GET") and ("v%2Fdata%2F" in line or "/v/data/" in line)]


def _record_reads(lines: list[str]) -> list[str]:
    """The reads of commit records among ``lines`` (gcs: ``v%2Fcommits%2F``, s3: ``/v/commits/``)."""
    return [line for line in lines
            if line.startswith("GET") and ("v%2Fcommits%2F" in line or "/v/commits/" in line)]


def _parent_read_once(reads: list[str], parent: int) -> None:
    """The parent's commit record is read once, and no other: that read proves
    it is still on the store (FORMAT.md §5.1), and the record's create-only
    write, not a read, finds a version above it (root.start_probe)."""
    keys = [line.split()[1].split("?")[0] for line in reads]
    assert len(keys) == 1 and keys[0].endswith(f"commits%2F{parent:020d}" if "%2F" in keys[0] else f"commits/{parent:020d}"), reads


def _lease_generations(spec: dict[str, Any]) -> dict[str, Any]:
    """Each lease object of a versioned store's base (read directly, not through
    the proxy: a GCS upload names its object in the body) -> its generation."""
    plain = tsp.KvStore.open(spec).result(T)
    return {name: plain.read(name).result(T).generation for name in plain.list("leases/").result(T)}


def _read_at_once(proxy: ShapingProxy, arr: Any, sels: list[Any], data: np.ndarray) -> tuple[int, int]:
    """(sequential round trips, requests) of reading every selection of ``arr`` at
    once (all in flight together), each checked against ``data``."""

    async def together() -> list[Any]:
        return list(await asyncio.gather(*(arr[s].read() for s in sels)))

    got: list[Any] = []
    rounds, requests = _rounds(proxy, lambda: got.extend(
        asyncio.run_coroutine_threadsafe(together(), get_loop()).result(T)))
    for s, g in zip(sels, got, strict=True):
        np.testing.assert_array_equal(g, data[s])
    return rounds, requests


@pytest.mark.parametrize(("server", "size", "idle"),
                         [("gcs", 10, False), ("gcs", 1000, False), ("s3", 1000, False),
                          ("gcs", 300_000, False), ("s3", 300_000, False), ("gcs", 300_000, True)])
def test_versioned_commit_of_one_key_takes_2_round_trips(
        request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
        server: str, size: int, idle: bool) -> None:
    # with a warm cache: (data object | probe for the newest version | tree node
    # planned against the cached newest version), then the commit record; the
    # writer's lease vouches for the data object (no pre-commit read of it,
    # docs/FORMAT.md §9.3). A small value is inline in the node (10 bytes), a
    # middling one packed into a data object by the group commit (1000), a large
    # one uploaded to its own object beside the commit (300 kB).
    # ``idle``: the last commit is past LINGER; the lease still says ``writing``
    # (WRITER_LINGER), so the commit writes no lease first.
    # The trailing rewrite of the ``latest`` hint re-reads a commit record first;
    # it must not fire inside the measured commit (it is not on the commit's path)
    monkeypatch.setattr(versioned_newest, "HINT_INTERVAL", 3600.0)
    srv = request.getfixturevalue("gcs_emulator" if server == "gcs" else "s3_server")
    field = "endpoint" if server == "gcs" else "endpoint_url"
    bucket = srv.create_bucket()
    with ShapingProxy(srv.endpoint, handshake=0.0) as proxy:  # connections: another test
        base = {**srv.spec(bucket, path="v/"), field: proxy.endpoint}
        store = tsp.KvStore.open({"driver": "versioned", "base": base}).result(T)
        for i in range(20):
            store.write(f"k{i:02d}", b"old %d" % i).result(T)  # a warm cache
        if idle:
            time.sleep(LINGER * 2.5)
        value = bytes(range(256)) * (size // 256) + b"!" * (size % 256)
        held = _lease_generations(srv.spec(bucket, path="v/"))
        rounds, lines = _commit_rounds(proxy, lambda: store.write("k07", value).result(T))
        assert _data_reads(lines) == []  # no pre-commit read of the data object
        _parent_read_once(_record_reads(lines), parent=20)
        assert held and _lease_generations(srv.spec(bucket, path="v/")) == held  # no lease written
        assert rounds <= 2, lines
        reader = tsp.KvStore.open({"driver": "versioned", "base": srv.spec(bucket, path="v/")}).result(T)
        assert reader.read("k07").result(T).value == value
        assert reader.read("k08").result(T).value == b"old 8"


def test_gcs_conditional_write_is_one_request(gcs_emulator: Any) -> None:
    bucket = gcs_emulator.create_bucket()
    with ShapingProxy(gcs_emulator.endpoint, ttfb=0.02) as proxy:
        store = tsp.KvStore.open({**gcs_emulator.spec(bucket), "endpoint": proxy.endpoint}).result(T)
        assert _rounds(proxy, lambda: store.write("a", b"1", if_equal=tsp.Generation.NO_VALUE).result(T)) == (1, 1)
        gen = store.read("a").result(T).generation
        assert _rounds(proxy, lambda: store.write("a", b"2", if_equal=gen).result(T)) == (1, 1)
        assert store.read("a").result(T).value == b"2"


def test_s3_conditional_write_is_one_request(s3_server: Any) -> None:
    bucket = s3_server.create_bucket()
    with ShapingProxy(s3_server.endpoint, ttfb=0.02) as proxy:
        store = tsp.KvStore.open({**s3_server.spec(bucket), "endpoint_url": proxy.endpoint}).result(T)
        assert _rounds(proxy, lambda: store.write("a", b"1", if_equal=tsp.Generation.NO_VALUE).result(T)) == (1, 1)
        gen = store.read("a").result(T).generation
        assert _rounds(proxy, lambda: store.write("a", b"2", if_equal=gen).result(T)) == (1, 1)
        assert store.read("a").result(T).value == b"2"


@pytest.mark.parametrize("driver", [None, "zarr3", "zarr"])
def test_opening_an_array_reads_its_metadata_once(gcs_emulator: Any, driver: str | None) -> None:
    bucket = gcs_emulator.create_bucket()
    with ShapingProxy(gcs_emulator.endpoint, ttfb=0.03) as proxy:
        kv = {**gcs_emulator.spec(bucket, path="a/"), "endpoint": proxy.endpoint}
        spec = {"kvstore": kv} if driver is None else {"driver": driver, "kvstore": kv}
        data = np.arange(64 * 64, dtype=np.int16).reshape(64, 64)
        tsp.open(spec, create=True, dtype="int16", shape=(64, 64), chunks=(32, 32)).result(T).write(data).result(T)
        opened: list[Any] = []
        rounds, _ = _rounds(proxy, lambda: opened.append(tsp.open(spec).result(T)))
        assert rounds == 1  # format detection and the open share one read of the document
        key = "zarr.json" if driver != "zarr" else ".zarray"
        reads = [line for line, _, _ in proxy.request_log() if f"a%2F{key}" in line]
        assert len(reads) == 1
        np.testing.assert_array_equal(opened[0].read().result(T), data)


def test_versioned_transaction_of_written_keys_commits_in_2_round_trips(gcs_emulator: Any) -> None:
    bucket = gcs_emulator.create_bucket()
    with ShapingProxy(gcs_emulator.endpoint, handshake=0.0) as proxy:
        base = {**gcs_emulator.spec(bucket, path="v/"), "endpoint": proxy.endpoint}
        store = tsp.KvStore.open({"driver": "versioned", "base": base}).result(T)
        for i in range(20):
            store.write(f"k{i:02d}", b"old %d" % i).result(T)  # a warm cache
        txn = tsp.Transaction()
        view = store.with_transaction(txn)
        view.write("k03", b"a" * 5000).result(T)  # packed into a data object at commit
        view.write("k04", b"b" * 10).result(T)  # inline
        # the data object, the probe for the newest version and the tree node
        # together, then the record (the lease vouches for the data object: no read of it)
        rounds, lines = _commit_rounds(proxy, lambda: txn.commit().result(T))
        assert _data_reads(lines) == []
        _parent_read_once(_record_reads(lines), parent=20)
        assert rounds <= 2, lines
        assert store.read("k03").result(T).value == b"a" * 5000
        assert store.read("k04").result(T).value == b"b" * 10
        assert store.read("k05").result(T).value == b"old 5"


def _until(proxy: ShapingProxy, done: float) -> tuple[int, list[str]]:
    """(sequential round trips, request lines) of the requests sent before ``done``
    since the last ``reset_counters``."""
    log = [r for r in proxy.request_log() if r[1] < done]
    chain, last_end = 0, float("-inf")
    for _, start, end in sorted(log, key=lambda r: r[2]):
        if start >= last_end:
            chain, last_end = chain + 1, end
    return chain, [line for line, _, _ in log]


@pytest.mark.parametrize("server", ["gcs", "s3"])
def test_a_checkpoint_save_blocks_for_one_round_trip_and_commits_in_four(
        request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, server: str) -> None:
    # save() waits for the staging and, asked meanwhile, whether the step exists
    # (an empty store: the hint and commits/1 together; later: the cached newest
    # record and the one above it) and the writer lease: one round trip. Then
    # the chunks (all at once), the probe with the tree nodes planned against
    # the version the check saw (an empty store too) and the manifest's data
    # object, then the record: 4 in all for a fresh root. The next step reads
    # the previous one's manifest and digests first (one round trip, both at
    # once: the incremental save's links), and writes no lease (the linger): 5.
    # A fresh root took 8: the check's hint and probe, the transaction's own
    # probe and the lease one after another, the nodes after the probe; a later
    # step also read the digests after the manifest.
    # (no ``latest`` hint is written after the commits: the measured save reads
    # it, and another's background rewrite would be counted with it)
    monkeypatch.setattr(versioned_newest.HintWriter, "note", lambda self, version: None)
    srv = request.getfixturevalue("gcs_emulator" if server == "gcs" else "s3_server")
    field = "endpoint" if server == "gcs" else "endpoint_url"
    bucket = srv.create_bucket()
    tree = {"w": np.arange(3 * 100_000, dtype=np.float32).reshape(3, -1), "b": np.ones(16, np.int32), "n": 3}
    with ShapingProxy(srv.endpoint, ttfb=0.1, handshake=0.0) as proxy:
        root = {**srv.spec(bucket, path="ck/"), field: proxy.endpoint}
        for step in (1, 2):
            tree["w"] += 1
            proxy.reset_counters()
            fut = tsp.checkpoint.save(root, tree, step=step)
            blocked, lines = _until(proxy, time.monotonic())
            assert blocked <= 1, lines
            assert fut.result(T).step == step
            rounds, lines = _until(proxy, time.monotonic())
            assert rounds <= 3 + step, lines
            assert _data_reads(lines) == []
        got = tsp.checkpoint.restore(srv.spec(bucket, path="ck/"))
        np.testing.assert_array_equal(got["w"], tree["w"])
        np.testing.assert_array_equal(got["b"], tree["b"])
        assert got["n"] == 3
        with pytest.raises(tsp.errors.ConditionFailedError, match="step 2 already exists"):
            tsp.checkpoint.save(root, tree, step=2)


def test_a_checkpoint_restore_reads_the_step_record_and_manifest_together(
        gcs_emulator: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # the newest version (1), the reader lease and the check after it that the
    # version is not deleted (2, 3: in this order, FORMAT.md §9.5), the step's
    # record and manifest together (4), the chunks (5). It was 6: the manifest
    # after the record.
    monkeypatch.setattr(versioned_newest.HintWriter, "note", lambda self, version: None)
    bucket = gcs_emulator.create_bucket()
    tree = {f"w{i}": np.full(70_000, i, dtype=np.float32) for i in range(4)}
    with ShapingProxy(gcs_emulator.endpoint, ttfb=0.1, handshake=0.0) as proxy:
        root = {**gcs_emulator.spec(bucket, path="ck/"), "endpoint": proxy.endpoint}
        tsp.checkpoint.save(root, tree, step=1).result(T)
        got: dict[str, Any] = {}
        rounds, lines = _rounds(proxy, lambda: got.update(tsp.checkpoint.restore(root)))
        assert rounds <= 5, lines
        for k, v in tree.items():
            np.testing.assert_array_equal(got[k], v)


def test_a_checkpoint_save_of_an_existing_step_fails_before_returning(gcs_emulator: Any) -> None:
    # the check runs beside the staging, and save() still raises, with nothing written
    bucket = gcs_emulator.create_bucket()
    with ShapingProxy(gcs_emulator.endpoint, ttfb=0.05) as proxy:
        root = {**gcs_emulator.spec(bucket, path="ck/"), "endpoint": proxy.endpoint}
        tsp.checkpoint.save(root, {"a": np.zeros(4)}, step=1).result(T)
        plain = tsp.KvStore.open(gcs_emulator.spec(bucket, path="ck/")).result(T)
        time.sleep(0.3)  # the trailing ``latest`` hint
        before = sorted(plain.list("").result(T))
        with pytest.raises(tsp.errors.ConditionFailedError, match="step 1 already exists"):
            tsp.checkpoint.save(root, {"a": np.ones(4)}, step=1)
        time.sleep(0.3)  # anything the failed save might have left in flight
        assert sorted(plain.list("").result(T)) == before
    # read directly (a restore's reader lease is released after the proxy is gone)
    np.testing.assert_array_equal(
        tsp.checkpoint.restore(gcs_emulator.spec(bucket, path="ck/"), step=1)["a"], np.zeros(4))


def test_a_whole_read_keeps_every_request_slot_of_the_store_busy(gcs_emulator: Any) -> None:
    # 12 chunks of 4 MiB on a store with 32 request slots: all 12 in flight at once
    # (bytes in flight over the round trip is the throughput), not a count from CPUs
    bucket = gcs_emulator.create_bucket()
    ctx = tsp.Context({"data_copy_concurrency": {"limit": 2}})
    with ShapingProxy(gcs_emulator.endpoint, ttfb=0.05) as proxy:
        spec = {"kvstore": {**gcs_emulator.spec(bucket, path="a/"), "endpoint": proxy.endpoint}}
        data = np.arange(2048 * 2048 * 12, dtype=np.uint32).astype(np.uint8).reshape(2048, -1)
        tsp.open(spec, create=True, dtype="uint8", shape=data.shape, chunks=(2048, 2048),
                 context=ctx).result(T).write(data).result(T)
        arr = tsp.open(spec, context=ctx).result(T)
        proxy.reset_counters()
        np.testing.assert_array_equal(arr.read().result(T), data)
        assert proxy.counters()["requests"] == 12
        assert proxy.counters()["max_in_flight"] == 12
        assert proxy.sequential_round_trips() == 1


@pytest.mark.parametrize("server", ["gcs", "s3"])
def test_requests_one_after_another_reuse_one_connection(
    request: pytest.FixtureRequest, server: str,
) -> None:
    srv = request.getfixturevalue("gcs_emulator" if server == "gcs" else "s3_server")
    bucket = srv.create_bucket()
    with ShapingProxy(srv.endpoint, ttfb=0.01, handshake=0.05) as proxy:
        field = "endpoint" if server == "gcs" else "endpoint_url"
        store = tsp.KvStore.open({**srv.spec(bucket), field: proxy.endpoint}).result(T)
        for i in range(5):
            store.write(f"k{i}", b"%d" % i).result(T)
        assert [store.read(f"k{i}").result(T).value for i in range(5)] == [b"%d" % i for i in range(5)]
        assert proxy.counters()["requests"] == 10
        assert proxy.counters()["connections"] == 1  # no connection set-up after the first


def test_concurrent_crops_of_one_shard_share_its_index_and_range_requests(gcs_emulator: Any) -> None:
    # 16 crops of one shard, none of its index cached, all in flight at once: ONE
    # read of the index, then the inner chunks they need (the same 2 x 2 x 2) by
    # range, each fetched once; 4 crops of a shard never written: one index read
    bucket = gcs_emulator.create_bucket()
    rng = np.random.default_rng(3)
    data = np.zeros((256, 128, 128), dtype=np.uint8)
    data[:128] = rng.integers(0, 8, size=(128, 128, 128), dtype=np.uint8)
    with ShapingProxy(gcs_emulator.endpoint, ttfb=0.03) as proxy:
        spec = {"kvstore": {**gcs_emulator.spec(bucket, path="a/"), "endpoint": proxy.endpoint}}
        tsp.open(spec, create=True, dtype="uint8", shape=data.shape, chunks=(32, 32, 32),
                 shards=(128, 128, 128), compression=("zstd", 1)).result(T)[:128].write(data[:128]).result(T)
        arr = tsp.open(spec).result(T)  # a fresh open: no shard index cached
        sels = [tuple(slice(int(s), int(s) + 32) for s in rng.integers(1, 32, size=3)) for _ in range(16)]
        sels += [tuple(slice(int(s) + o, int(s) + o + 32) for s, o in zip(rng.integers(1, 32, size=3), (128, 0, 0)))
                 for _ in range(4)]
        rounds, requests = _read_at_once(proxy, arr, sels, data)
        # shard 0: its index + the 4 runs of 2 neighbouring inner chunks (or fewer,
        # merged); shard 1: its index (missing). Each crop alone: 20 indexes + 64 runs
        assert requests <= 1 + 4 + 1
        # index, then ranges: 2; a loaded machine may start the missing shard's index
        # read only after shard 0's came back, one more link in the chain
        assert rounds <= 3


def test_concurrent_reads_of_one_precomputed_shard_share_their_requests(gcs_emulator: Any) -> None:
    # a sharded neuroglancer precomputed scale: 8 chunks of one shard read at once,
    # no index cached: the shard index entries of their minishards in ONE request,
    # the minishard indexes in one, the chunks in one
    bucket = gcs_emulator.create_bucket()
    data = np.random.default_rng(5).integers(1, 255, size=(64, 64, 64, 1), dtype=np.uint8)
    sharding = {"@type": "neuroglancer_uint64_sharded_v1", "preshift_bits": 0, "hash": "identity",
                "minishard_bits": 1, "shard_bits": 0, "minishard_index_encoding": "raw",
                "data_encoding": "raw"}
    with ShapingProxy(gcs_emulator.endpoint, ttfb=0.03) as proxy:
        spec = {"driver": "neuroglancer_precomputed",
                "kvstore": {**gcs_emulator.spec(bucket, path="v/"), "endpoint": proxy.endpoint}}
        tsp.open({**spec, "multiscale_metadata": {"type": "image", "data_type": "uint8", "num_channels": 1},
                  "scale_metadata": {"size": [64, 64, 64], "chunk_size": [32, 32, 32], "encoding": "raw",
                                     "resolution": [1, 1, 1], "sharding": sharding}},
                 create=True).result(T).write(data).result(T)
        arr = tsp.open(spec).result(T)  # a fresh open: no index cached
        sels = [(slice(x, x + 32), slice(y, y + 32), slice(z, z + 32))
                for x in (0, 32) for y in (0, 32) for z in (0, 32)]
        rounds, requests = _read_at_once(proxy, arr, sels, data)
        # the index entries, the minishard indexes, the chunks (each read alone: 3
        # requests, 24 in all), and at most one more for chunks located in a later turn
        assert requests <= 4
        assert rounds <= 4
