"""Ingest a volume in parallel with Dask, publish it as ONE commit, slice it back.

Starts a ``dask.distributed.LocalCluster`` with real worker processes, builds a
synthetic uint16 volume as a dask array (each block computed on a worker),
writes it into a sharded zarr3 array on a versioned store with
``tensorstore_py.dask.store`` (each task stages its shards; one final task
commits them all: readers see nothing, then everything), then reads it back
through ``tensorstore_py.dask.to_dask`` and by direct slicing, checking every
value. Prints timings.

    python examples/dask_ingest.py                       # 256 x 512 x 512, 4 workers
    python examples/dask_ingest.py --size 128 --workers 2
    TSP_EXAMPLES_SMALL=1 python examples/dask_ingest.py  # tiny (used by the tests)

Needs the ``dask`` extra: ``pip install "tensorstore_py[dask]"``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import dask.array as da
import numpy as np
from dask.distributed import Client, LocalCluster

import tensorstore_py as tsp
import tensorstore_py.dask as tspd


def voxel(z: np.ndarray, y: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The synthetic volume: a deterministic function of the coordinates."""
    return ((z * 131 + y * 7 + x * 3) % 65521).astype(np.uint16)


def main() -> None:
    small = bool(os.environ.get("TSP_EXAMPLES_SMALL"))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=64 if small else 512, help="y and x extent")
    ap.add_argument("--depth", type=int, default=32 if small else 256, help="z extent")
    ap.add_argument("--workers", type=int, default=2 if small else 4)
    ap.add_argument("--root", default=None, help="directory for the store (default: a temp dir)")
    a = ap.parse_args()
    root = a.root or tempfile.mkdtemp(prefix="dask_ingest_")
    shape = (a.depth, a.size, a.size)
    shard = (16, a.size // 2, a.size // 2)
    inner = (16, a.size // 8, a.size // 8)

    t0 = time.perf_counter()
    with LocalCluster(n_workers=a.workers, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster):
        print(f"cluster: {a.workers} worker processes up in {time.perf_counter() - t0:.2f} s")
        url = f"versioned+file://{os.path.abspath(root)}/"
        vol = tsp.open(url, create=True, shape=shape, dtype="uint16", chunks=inner, shards=shard,
                       dimension_names=["z", "y", "x"]).result()
        kv = vol.kvstore
        before = kv.newest_version().result()

        # the source: computed block by block on the workers, in blocks of whole shards
        src = da.fromfunction(voxel, shape=shape, chunks=tspd.storage_chunks(vol), dtype=np.uint16)
        t = time.perf_counter()
        info = tspd.store(src, vol, message="ingest")
        dt = time.perf_counter() - t
        nbytes = int(np.prod(shape)) * 2
        print(f"ingest: {nbytes / 2**20:.1f} MiB in {dt:.2f} s ({nbytes / 2**20 / dt:.1f} MiB/s), "
              f"{len(src.to_delayed().reshape(-1))} tasks, published as version {info.version} "
              f"({info.keys_changed} keys)")
        assert kv.newest_version().result() == before + 1 == info.version, "expected ONE new version"

        # read back: a dask array over the stored shards (pinned to that version), then slices
        t = time.perf_counter()
        back = tspd.to_dask(vol)
        total = int(back.astype(np.uint64).sum().compute())
        dt = time.perf_counter() - t
        z, y, x = np.meshgrid(*(np.arange(n) for n in shape), indexing="ij", sparse=True)
        expect = voxel(z, y, x)
        assert total == int(expect.astype(np.uint64).sum()), "sum over the volume differs"
        print(f"to_dask sum: {nbytes / 2**20:.1f} MiB in {dt:.2f} s ({len(back.to_delayed().reshape(-1))} tasks)")

    t = time.perf_counter()
    mid = shape[0] // 2
    plane = vol[mid].read().result()
    column = vol[:, shape[1] // 3, ::5].read().result()
    dt = time.perf_counter() - t
    np.testing.assert_array_equal(plane, expect[mid])
    np.testing.assert_array_equal(column, expect[:, shape[1] // 3, ::5])
    print(f"slices: z={mid} plane and one strided column read and checked in {dt * 1000:.1f} ms")
    print(f"ok: {root}")


if __name__ == "__main__":
    main()
