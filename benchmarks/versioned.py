"""The versioned store's costs, on the file store (durable: fsync on).

    python benchmarks/versioned.py [--sizes 1000,10000,100000,1000000] [--reps 15]
                                   [--fragments 1000] [--versions 10000]
                                   [--array-mib 128] [--full] [--dir DIR]

* ``commit_1key_<n>``: median latency of committing ONE changed key into a store
  of ``n`` keys (``kv.write(key, value).result()``: probe the newest version,
  rewrite the O(log n) nodes on the key's path, create the commit record). The
  ``n``-key store is built by one bulk commit through the commit engine
  (``build_<n>``), which is how a large checkpoint lands as well.
* ``merge_<N>_fragments``: a coordinator merging ``N`` simulated multi-writer
  fragments (8 keys each) into one commit, timed from the last fragment landing.
* ``multiwriter_commit_<P>procs``: median latency of a multi-writer commit of
  ``P`` participants (threads polling the store, 4 small keys each): attempt,
  fragments, merge, commit record, result and cleanup.
* ``reclaim_after_save_<n>_versions``: a store with ``n`` versions (``--versions``,
  each writing one 2 KiB value: a data object and an index leaf), all but the
  newest two deleted and reclaimed; then one more save, the deletion of every
  version before it and the prompt reclaim a checkpoint retention runs
  (``kvstore.versioned.gc.reclaim``), from a process with cold caches. Prints
  its seconds and the objects it read (base-store reads, and listings).
* ``zarr3_write`` / ``zarr3_read`` on ``file`` and on ``versioned`` over the same
  file store (``--array-mib`` MiB of float32, 4 MiB chunks; ``--full``: 1 GiB),
  the versioned write as one transaction; ``ratio_*`` = versioned / file.
  ``wrapped``: the file store behind a pass-through wrapper (the fault store with
  no faults), which takes the array driver's generic async I/O path like the
  versioned store does, while the bare file store gets the driver's batched
  blocking fast path; ``ratio_*_vs_wrapped`` isolates the versioned store's cost.

Prints ``name: value unit`` lines and ``ratio_*: x`` lines.
Targets: ``commit_1key_1000000`` < 50 ms; ``merge_1000_fragments`` < 5 s;
``ratio_zarr3_*`` <= 1.15; ``reclaim_after_save_10000_versions`` reads a number
of objects that does not grow with ``n``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import threading
import time
from typing import Any

import numpy as np
from _harness import emit, fresh, scratch_dir

import tensorstore_py as tsp
from tensorstore_py.core.future import spawn
from tensorstore_py.kvstore.fault import FaultKvStore
from tensorstore_py.kvstore.file import FileKvStore
from tensorstore_py.kvstore.versioned import VersionedKvStore
from tensorstore_py.kvstore.versioned import root as versioned_root
from tensorstore_py.kvstore.versioned.format import InlineEntry, RefEntry, new_stamp
from tensorstore_py.kvstore.versioned.fragments import (
    Fragment,
    attempt_name,
    decode_attempt,
    encode_fragment,
    fragment_name,
)
from tensorstore_py.kvstore.versioned.gc import reclaim
from tensorstore_py.kvstore.versioned.root import Plan

MiB = 1 << 20


def _key(i: int) -> str:
    return f"params/layer{i // 1000:04d}/w{i % 1000:03d}"


def bench_commit(root: str, n: int, reps: int) -> tuple[float, float]:
    """(seconds to build n keys in one commit, median seconds of a 1-key commit)."""
    kv = VersionedKvStore(FileKvStore(path=fresh(root)))
    changes = [(_key(i), InlineEntry(new_stamp(), b"%d" % i)) for i in range(n)]

    async def plan(parent: Any) -> Plan:
        return Plan(changes, message=f"bulk load of {n} keys")

    t0 = time.perf_counter()
    spawn(kv._root.commit(plan)).result()
    build = time.perf_counter() - t0
    rng = np.random.default_rng(n)
    kv.write(_key(0), b"warm").result()  # first commit of this process reads the path
    times = []
    for r in range(reps):
        key = _key(int(rng.integers(n)))
        t0 = time.perf_counter()
        kv.write(key, b"new %d" % r).result()
        times.append(time.perf_counter() - t0)
    assert kv.newest_version().result() == reps + 2
    return build, statistics.median(times)


def bench_merge(root: str, count: int) -> float:
    """Seconds from the last of ``count`` fragments landing to the coordinator's
    commit of all of them (merge, tree, commit record, cleanup)."""
    path = fresh(root)
    scratch = FileKvStore(path=path, sync=False)  # setup only: fragments of "other" processes
    obj = "data/" + "0" * 32
    scratch.write(obj, bytes(80)).result()  # the commit checks that referenced data exists
    txn_id = "bench"
    kv = VersionedKvStore(FileKvStore(path=path))
    coord = tsp.Transaction(txn_id=txn_id, process_index=0, process_count=count + 1, timeout=120)
    kv.with_transaction(coord).write("p/00000/0", b"coordinator").result()  # opens attempt 1
    fut = coord.commit()
    name = attempt_name(txn_id, 1)
    while scratch.read(name).result().state != "value":
        time.sleep(0.005)
    attempt = decode_attempt(scratch.read(name).result().value, name, txn_id)

    async def write_fragments() -> None:
        sem = asyncio.Semaphore(64)

        async def one(i: int) -> None:
            changes: list[Any] = [
                (f"p/{i:05d}/{j}", RefEntry(new_stamp(), obj, j * 10, 10, 0) if j % 2
                 else InlineEntry(new_stamp(), b"v"))
                for j in range(8)
            ]
            data = encode_fragment(txn_id, attempt, "0" * 32, Fragment(i, 0, changes))
            async with sem:
                await scratch.write(fragment_name(txn_id, 1, attempt.nonce, i), data)

        await asyncio.gather(*(one(i) for i in range(1, count + 1)))

    spawn(write_fragments()).result()
    t0 = time.perf_counter()
    info = fut.result()
    dt = time.perf_counter() - t0
    assert info.version == 1 and info.keys_changed == count * 8 + 1, info
    return dt


def bench_reclaim(root: str, n: int) -> tuple[float, int, int]:
    """(seconds, base-store reads, listings) of the reclaim after one more save."""
    path = fresh(root)
    kv = VersionedKvStore(FileKvStore(path=path, sync=False))  # setup speed: no fsync
    rng = np.random.default_rng(n)
    for i in range(n):
        kv.write(f"params/w{i % 3}", rng.bytes(2048)).result()
    kv.delete_versions(list(range(1, n - 1))).result()
    reclaim(kv).result()  # the history's deleted versions: reclaimed once, as retention goes
    kv.write("params/w0", rng.bytes(2048)).result()  # the save
    newest = kv.newest_version().result()
    older = [v.version for v in kv.versions().result() if v.version < newest]
    kv.delete_versions(older).result()  # its retention retires every older version
    versioned_root._roots.clear()  # cold caches: every object read counts
    counted = FaultKvStore(FileKvStore(path=path, sync=False))
    t0 = time.perf_counter()
    rep = reclaim(VersionedKvStore(counted)).result()
    dt = time.perf_counter() - t0
    assert rep.reclaimed, rep
    return dt, counted.calls["read"], counted.calls["list"]


def bench_multiwriter(root: str, processes: int, reps: int) -> float:
    """Median seconds of one multi-writer commit of ``processes`` participants
    (threads of this process, polling the store; 4 small keys each), from the
    first ``commit()`` call to the last one returning."""
    kv = VersionedKvStore(FileKvStore(path=fresh(root)))
    times = []
    errors: list[BaseException] = []
    for r in range(reps):
        txns = [tsp.Transaction(txn_id=f"mw-{r}", process_index=i, process_count=processes, timeout=60)
                for i in range(processes)]
        for i, txn in enumerate(txns):
            v = kv.with_transaction(txn)
            for j in range(4):
                v.write(f"r{r}/p{i}/{j}", b"x" * 1000).result()

        def run(txn: tsp.Transaction) -> None:
            try:
                txn.commit().result()
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=run, args=(t,)) for t in txns]
        t0 = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        times.append(time.perf_counter() - t0)
        assert not errors, errors
    return statistics.median(times)


def bench_zarr3(root: str, mib: int, reps: int) -> dict[str, float]:
    """Median seconds of a whole-array write and read, plain file vs versioned."""
    side = int(np.sqrt(mib * MiB / 4)) // 1024 * 1024 or 1024
    rows = max(1024, mib * MiB // 4 // side // 1024 * 1024)
    shape, chunks = (rows, side), (1024, 1024)  # 4 MiB float32 chunks
    data = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    kinds = ["file", "versioned", "wrapped"]
    out: dict[str, list[float]] = {f"{k}_{op}": [] for k in kinds for op in ("write", "read")}
    for r in range(reps):
        for kind in (kinds if r % 2 == 0 else kinds[::-1]):
            # a new directory each time: the process caches what it knows of a store
            path = fresh(os.path.join(root, f"{kind}{r}"))
            kvspec: Any = "file://" + path + "/"
            if kind == "versioned":
                kvspec = {"driver": "versioned", "base": kvspec}
            elif kind == "wrapped":  # a plain wrapper: the driver's generic (async) I/O path
                kvspec = {"driver": "fault", "base": {"driver": "file", "path": path + "/"}}
            arr = tsp.open({"driver": "zarr3", "kvstore": kvspec}, create=True, dtype="float32",
                           shape=shape, chunks=chunks).result()
            t0 = time.perf_counter()
            if kind == "versioned":
                with tsp.Transaction() as txn:
                    arr.with_transaction(txn).write(data).result()
            else:
                arr.write(data).result()
            out[f"{kind}_write"].append(time.perf_counter() - t0)
            arr = tsp.open({"driver": "zarr3", "kvstore": kvspec}).result()
            t0 = time.perf_counter()
            back = arr.read().result()
            out[f"{kind}_read"].append(time.perf_counter() - t0)
            assert np.array_equal(back, data)
            del back
            # best effort: the lease this process held lingers (the writer
            # linger) and a rewrite or its delete may land while the folder is removed
            shutil.rmtree(path, ignore_errors=True)
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1000,10000,100000,1000000", help="store sizes (keys)")
    ap.add_argument("--reps", type=int, default=15, help="1-key commits per size (median printed)")
    ap.add_argument("--fragments", type=int, default=1000, help="simulated multi-writer fragments")
    ap.add_argument("--versions", type=int, default=10000, help="history length of the reclaim case")
    ap.add_argument("--array-mib", type=int, default=128, help="zarr3 array size in MiB")
    ap.add_argument("--array-reps", type=int, default=3, help="zarr3 repetitions (median printed)")
    ap.add_argument("--full", action="store_true", help="1 GiB zarr3 array")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: commit,merge,multiwriter,reclaim,zarr3")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    with scratch_dir("tsp-bench-versioned-", args.dir) as base:
        if "commit" not in skip:
            for n in (int(s) for s in args.sizes.split(",") if s):
                build, commit = bench_commit(os.path.join(base, "commit"), n, args.reps)
                emit(f"build_{n}", build, "s")
                emit(f"commit_1key_{n}", commit * 1e3, "ms", digits=2)
        if "merge" not in skip:
            dt = bench_merge(os.path.join(base, "merge"), args.fragments)
            emit(f"merge_{args.fragments}_fragments", dt, "s")
        if "multiwriter" not in skip:
            for n in (2, 8):
                dt = bench_multiwriter(os.path.join(base, "multiwriter"), n, args.reps)
                emit(f"multiwriter_commit_{n}procs", dt * 1e3, "ms", digits=1)
        if "reclaim" not in skip:
            dt, reads, lists = bench_reclaim(os.path.join(base, "reclaim"), args.versions)
            emit(f"reclaim_after_save_{args.versions}_versions", dt * 1e3, "ms", digits=1)
            emit(f"reclaim_after_save_{args.versions}_versions_reads", reads, "objects", digits=0)
            emit(f"reclaim_after_save_{args.versions}_versions_listings", lists, "listings", digits=0)
        if "zarr3" not in skip:
            mib = 1024 if args.full else args.array_mib
            res = bench_zarr3(os.path.join(base, "zarr3"), mib, args.array_reps)
            for k, v in res.items():
                emit(f"zarr3_{k}_{mib}MiB", v, f"s ({mib / v:.0f} MiB/s)")
            # against the file store, and against the same I/O path as the versioned
            # store takes (the wrapped file store): what the versioned store itself costs
            for op in ("write", "read"):
                emit(f"ratio_zarr3_{op}", res[f"versioned_{op}"] / res[f"file_{op}"])
            for op in ("write", "read"):
                emit(f"ratio_zarr3_{op}_vs_wrapped", res[f"versioned_{op}"] / res[f"wrapped_{op}"])


if __name__ == "__main__":
    main()
