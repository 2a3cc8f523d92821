"""Dask ingest and read-back: tsp.dask next to dask + zarr-python, same cluster, same run.

    python benchmarks/dask_ingest.py [--depth 128] [--size 512] [--workers 2] [--reps 3] [--small]

One ``dask.distributed.LocalCluster`` (worker processes, one thread each) runs
every case on the same uint16 volume, computed block by block on the workers
(blocks of ``--chunk`` voxels, raw chunks, no compression), into a fresh
directory per repetition:

* ``tsp_versioned_store``: ``tsp.dask.store`` into a zarr3 array on a versioned
  store (each task stages, ONE commit at the end);
* ``tsp_file_store``: ``tsp.dask.store`` into a zarr3 array on a plain file store;
* ``zarr_python_store``: ``dask.array.to_zarr`` (zarr-python 3, zarr v3 format);
* ``*_read``: the sum of the volume, read through ``tsp.dask.to_dask`` /
  ``dask.array.from_zarr``.

Prints ``name: value unit`` lines (medians) and ``ratio_*: x`` = tsp / zarr-python.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import dask.array as da
import numpy as np
from _harness import emit, fresh, scratch_dir
from dask.distributed import Client, LocalCluster

import tensorstore_py as tsp
import tensorstore_py.dask as tspd

MiB = 1 << 20


def voxel(z: np.ndarray, y: np.ndarray, x: np.ndarray) -> np.ndarray:
    return ((z * 131 + y * 7 + x * 3) % 65521).astype(np.uint16)


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depth", type=int, default=128)
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--chunk", type=int, nargs=3, default=[16, 128, 128])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--small", action="store_true", help="32 x 128 x 128, 1 repetition")
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    if a.small:
        a.depth, a.size, a.reps, a.chunk = 32, 128, 1, [8, 64, 64]
    shape, chunks = (a.depth, a.size, a.size), tuple(a.chunk)
    mib = np.prod(shape) * 2 / MiB
    src = da.fromfunction(voxel, shape=shape, chunks=chunks, dtype=np.uint16)
    times: dict[str, list[float]] = {}
    with LocalCluster(n_workers=a.workers, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as client, \
            scratch_dir("tsp-bench-dask-", a.dir) as scratch:
        for module in ("tensorstore_py.dask", "zarr"):  # imports are not what is measured
            client.run(importlib.import_module, module)
        expect = int(src.astype(np.uint64).sum().compute())
        for rep in range(a.reps):
            # a new folder per repetition: a process keeps what it learnt of a versioned
            # store's history (cached commit records), so never recreate one in place
            for name, url in (("tsp_versioned", "versioned+file://{}/"), ("tsp_file", "file://{}/")):
                path = fresh(f"{scratch}/{name}-{rep}")
                ts = tsp.open(url.format(path), create=True, shape=shape, dtype="uint16",
                              chunks=chunks, compression=None).result()
                times.setdefault(f"{name}_store", []).append(_timed(lambda ts=ts: tspd.store(src, ts)))
                back = tspd.to_dask(ts).astype(np.uint64).sum()
                t = _timed(lambda back=back: times.setdefault("_sum", []).append(back.compute()))
                times.setdefault(f"{name}_read", []).append(t)
            path = fresh(f"{scratch}/zarr_python-{rep}")
            times.setdefault("zarr_python_store", []).append(
                _timed(lambda p=path: src.to_zarr(p, zarr_format=3, compressors=None)))
            back = da.from_zarr(path).astype(np.uint64).sum()
            times.setdefault("zarr_python_read", []).append(
                _timed(lambda back=back: times.setdefault("_sum", []).append(back.compute())))
    assert all(int(s) == expect for s in times.pop("_sum")), "a read-back sum differs"
    med = {k: statistics.median(v) for k, v in times.items()}
    emit("volume", mib, "MiB", digits=1)
    emit("tasks", float(np.prod([len(c) for c in src.chunks])), "", digits=0)
    for k, v in med.items():
        emit(k, v, "s")
        emit(k.replace("_store", "_store_throughput").replace("_read", "_read_throughput"), mib / v, "MiB/s")
    for name in ("tsp_versioned", "tsp_file"):
        emit(f"ratio_{name}_store_vs_zarr_python", med[f"{name}_store"] / med["zarr_python_store"], "x")
        emit(f"ratio_{name}_read_vs_zarr_python", med[f"{name}_read"] / med["zarr_python_read"], "x")


if __name__ == "__main__":
    main()
