"""Array throughput: tensorstore_py vs TensorStore vs zarr-python, same run, same machine.

One command gives every figure (about 15 minutes and ~6 GiB of disk on a
16-core host; TensorStore and zarr-python installed, e.g. ``pip install -e
".[test]"``)::

    python benchmarks/arrays.py --full-fill

The first line names the CPUs it ran with (this process's affinity, which
sizes the engine's threads and budgets) and the machine's core count.

Cases (``--small`` shrinks every size for a quick run):

* 1 GiB float32 in 4 MiB chunks, raw and zstd level 1: full write and full read (MiB/s).
* 256 MiB float32 in 64x64 chunks, plain and inside 1024x1024 shards: write and
  read (chunks/s).
* each of these reads twice after its write: ``_read_after_write`` is the first
  read (the written array still held, so the result lands in memory the process
  has not used yet), ``_read`` the second (its result may reuse the first's).
* random 64^3 crops from a sharded uint8 volume served over HTTP by a separate
  server process (crops/s).
* a uint8 volume (64^3 chunks in 512^3 shards) filled by 2 processes at once,
  each writing whole shards: 1024x1024x256 by default, 2048x2048x512 with
  ``--full-fill`` (MiB/s).
* where the time per chunk goes on the read path (raw 16x16 float32 chunks:
  system calls vs Python work, microseconds per chunk) and peak RSS of a whole
  read and write beyond the request's own size (see _engine_cases.py).
* neuroglancer precomputed, sharded, ``compressed_segmentation`` uint64 labels
  written by TensorStore: XY, XZ and YZ planes through the middle and random
  64^3 crops (reads/s), tensorstore_py and TensorStore reading the same files.
* N5 (vs TensorStore's ``n5`` driver only; zarr-python has no N5): a uint8
  volume in 64^3 blocks with N5's default compression (blosc lz4): full write
  (MiB/s), then XY, XZ and YZ planes (planes/s) and unaligned 64^3 crops
  (crops/s) read by both libraries from the same dataset, taking turns rep by
  rep; also the CPU time per read of each (``.cpu_ratio_vs_tensorstore``:
  theirs over ours, higher is better for us) and, on Linux, the time per read
  that its threads spent runnable but waiting for a CPU, summed over the
  threads (``.cpu_wait_per_read``: load from elsewhere on a shared machine;
  a library's own lock or GIL waits are sleeps and do not count there).

Every figure is the median of ``--repeats`` runs, the libraries taking turns
run by run (so that load from elsewhere falls on all alike). Output lines are
``name: value unit``; ``<case>.ratio_vs_tensorstore`` / ``.ratio_vs_zarr`` are
ours divided by theirs (higher is better for us). Reads come from the page
cache for every library alike.

    python benchmarks/arrays.py            # the issue's sizes, volume fill scaled down
    python benchmarks/arrays.py --small    # a minute
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np
import tensorstore as ts
import zarr
from _engine_cases import bench_chunk_overhead, bench_peak_rss, bench_volume_fill  # this folder
from _harness import runqueue_wait  # this folder
from zarr.codecs import ZstdCodec
from zarr.storage import FsspecStore, LocalStore

import tensorstore_py as tsp
from tensorstore_py.core.pools import available_cpus

LIBS = ("tsp", "tensorstore", "zarr")


def emit(name: str, value: float, unit: str) -> None:
    print(f"{name}: {value:.4g} {unit}", flush=True)


def median_time(fn: Callable[[], Any], repeats: int, setup: Callable[[], Any] | None = None) -> float:
    times = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        gc.collect()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved_median_times(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median seconds of each function, run in turns (a, b, a, b, ...) so that the
    load of a shared machine weighs on every library alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            gc.collect()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts_) for name, ts_ in times.items()}


def report(case: str, rates: dict[str, float], unit: str) -> None:
    for lib in LIBS:
        if lib in rates:
            emit(f"{case}.{lib}", rates[lib], unit)
    if "tensorstore" in rates:
        emit(f"{case}.ratio_vs_tensorstore", rates["tsp"] / rates["tensorstore"], "x")
    if "zarr" in rates:
        emit(f"{case}.ratio_vs_zarr", rates["tsp"] / rates["zarr"], "x")


# -- per-library open/create ---------------------------------------------------------
def create(lib: str, path: Path, data_shape: tuple[int, ...], dtype: str, chunks: tuple[int, ...],
           shards: tuple[int, ...] | None, zstd: bool) -> Any:
    if path.exists():
        shutil.rmtree(path)
    if lib == "tsp":
        return tsp.open(path.as_uri() + "/", create=True, dtype=dtype, shape=data_shape,
                        chunks=chunks, shards=shards, compression=("zstd", 1) if zstd else None).result()
    if lib == "zarr":
        return zarr.create_array(LocalStore(path), shape=data_shape, chunks=chunks, shards=shards,
                                 dtype=dtype, compressors=ZstdCodec(level=1) if zstd else None,
                                 fill_value=0)
    inner = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if zstd:
        inner.append({"name": "zstd", "configuration": {"level": 1}})
    codecs = inner
    grid = chunks
    if shards is not None:
        grid = shards
        codecs = [{"name": "sharding_indexed", "configuration": {
            "chunk_shape": list(chunks), "codecs": inner,
            "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                             {"name": "crc32c"}]}}]
    return ts.open({
        "driver": "zarr3", "kvstore": {"driver": "file", "path": str(path) + "/"},
        "metadata": {"shape": list(data_shape), "data_type": dtype, "fill_value": 0,
                     "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(grid)}},
                     "codecs": codecs},
    }, create=True, delete_existing=True).result()


def write(lib: str, arr: Any, data: np.ndarray) -> None:
    if lib == "zarr":
        arr[...] = data
    else:
        arr.write(data).result()


def read(lib: str, arr: Any) -> np.ndarray:
    return arr[...] if lib == "zarr" else arr.read().result()


def bench_dense(tmp: Path, name: str, shape: tuple[int, ...], chunks: tuple[int, ...],
                shards: tuple[int, ...] | None, zstd: bool, repeats: int, per_chunk: bool) -> None:
    data = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    n_chunks = int(np.prod([-(-s // c) for s, c in zip(shape, chunks)]))
    amount, unit = (n_chunks, "chunks/s") if per_chunk else (data.nbytes / (1 << 20), "MiB/s")
    w_times: dict[str, list[float]] = {lib: [] for lib in LIBS}
    first_times: dict[str, list[float]] = {lib: [] for lib in LIBS}
    r_times: dict[str, list[float]] = {lib: [] for lib in LIBS}
    for rep in range(repeats):
        for lib in LIBS:  # in turns, run by run
            path = tmp / f"{name}-{lib}"
            arr = create(lib, path, shape, "float32", chunks, shards, zstd)
            gc.collect()
            t0 = time.perf_counter()
            write(lib, arr, data)
            w_times[lib].append(time.perf_counter() - t0)
            # the first read after the write (the written array still held), then a second
            gc.collect()
            t0 = time.perf_counter()
            got = read(lib, arr)
            first_times[lib].append(time.perf_counter() - t0)
            if rep == 0 and not np.array_equal(np.asarray(got), data):
                raise SystemExit(f"{name}: {lib} read back different data")
            del got
            gc.collect()
            t0 = time.perf_counter()
            read(lib, arr)
            r_times[lib].append(time.perf_counter() - t0)
            del arr
            shutil.rmtree(path)
    report(f"{name}_write", {lib: amount / statistics.median(t) for lib, t in w_times.items()}, unit)
    report(f"{name}_read_after_write", {lib: amount / statistics.median(t) for lib, t in first_times.items()},
           unit)
    report(f"{name}_read", {lib: amount / statistics.median(t) for lib, t in r_times.items()}, unit)


# -- HTTP crops ------------------------------------------------------------------
_SERVER = """
import sys
from aiohttp import web
app = web.Application()
app.router.add_static("/", sys.argv[1])
runner = web.AppRunner(app, access_log=None)
import asyncio
async def main():
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    print(runner.addresses[0][1], flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


def bench_http_crops(tmp: Path, n: int, crop: int, n_crops: int, repeats: int) -> None:
    root = tmp / "http"
    rng = np.random.default_rng(0)
    vol = rng.integers(0, 256, (n, n, n), dtype=np.uint8)
    a = tsp.open((root / "vol").as_uri() + "/", create=True, dtype="uint8", shape=[n, n, n],
                 chunks=[64] * 3, shards=[min(n, 256)] * 3).result()
    a.write(vol).result()
    server = subprocess.Popen([sys.executable, "-c", _SERVER, str(root)], stdout=subprocess.PIPE,
                              text=True)
    try:
        port = int(server.stdout.readline())  # type: ignore[union-attr]
        url = f"http://127.0.0.1:{port}/vol/"
        opened = {
            "tsp": tsp.open(url).result(),
            "tensorstore": ts.open({"driver": "zarr3", "kvstore": {
                "driver": "http", "base_url": f"http://127.0.0.1:{port}", "path": "/vol/"}}).result(),
            "zarr": zarr.open_array(FsspecStore.from_url(url, read_only=True), mode="r"),
        }
        corners = [tuple(int(v) for v in rng.integers(0, n - crop + 1, 3)) for _ in range(n_crops)]
        for lib, arr in opened.items():  # warm-up + correctness
            z, y, x = corners[0]
            got = read(lib, arr[z:z + crop, y:y + crop, x:x + crop])
            if not np.array_equal(np.asarray(got), vol[z:z + crop, y:y + crop, x:x + crop]):
                raise SystemExit(f"http crops: {lib} read different data")
        runs = {lib: (lambda lib=lib, arr=arr: [read(lib, arr[z:z + crop, y:y + crop, x:x + crop])
                                                for z, y, x in corners]) for lib, arr in opened.items()}
        rates = {lib: n_crops / t for lib, t in interleaved_median_times(runs, repeats).items()}
        report(f"http_crops_{crop}", rates, "crops/s")
    finally:
        server.terminate()
        server.wait(10)


# -- neuroglancer precomputed, sharded ----------------------------------------------------
def segment_labels(n: int, cell: int, seed: int = 0) -> np.ndarray:
    """Segments of about ``cell`` voxels whose boundaries wander (x, y, z, 1) uint64."""
    rng = np.random.default_rng(seed)
    g = n // cell + 2
    ids = rng.integers(1, 2**50, (g, g, g), dtype=np.uint64)
    coords = np.arange(n)
    jitter = [rng.integers(0, cell // 2, n) for _ in range(3)]  # per-plane offsets of the boundaries
    i = (coords[:, None, None] + jitter[0][None, :, None]) // cell
    j = (coords[None, :, None] + jitter[1][None, None, :]) // cell
    k = (coords[None, None, :] + jitter[2][:, None, None]) // cell
    return ids[i, j, k][..., None]


def bench_precomputed(tmp: Path, n: int, n_crops: int, repeats: int) -> None:
    """Planes and 64^3 crops of a sharded compressed_segmentation volume (64^3 chunks,
    gzip'd minishard indexes) that TensorStore wrote; both libraries read the same files."""
    root = tmp / "precomputed"
    labels = segment_labels(n, cell=48)
    shard_bits = max(0, 3 * (n // 64 - 1).bit_length() - 9)  # shards of 8x8x8 chunks
    spec = {"driver": "neuroglancer_precomputed", "kvstore": {"driver": "file", "path": str(root) + "/"},
            "multiscale_metadata": {"type": "segmentation", "data_type": "uint64", "num_channels": 1},
            "scale_metadata": {
                "size": [n] * 3, "chunk_size": [64] * 3, "resolution": [8, 8, 40],
                "encoding": "compressed_segmentation", "compressed_segmentation_block_size": [8, 8, 8],
                "sharding": {"@type": "neuroglancer_uint64_sharded_v1", "preshift_bits": 6, "hash": "identity",
                             "minishard_bits": 3, "shard_bits": shard_bits,
                             "minishard_index_encoding": "gzip", "data_encoding": "gzip"}}}
    ts.open(spec, create=True, delete_existing=True).result().write(labels).result()
    opened = {"tsp": tsp.open(root.as_uri() + "/").result(),
              "tensorstore": ts.open({"driver": "neuroglancer_precomputed", "kvstore": spec["kvstore"],
                                      "scale_index": 0}).result()}
    rng = np.random.default_rng(3)
    corners = [tuple(int(v) for v in rng.integers(0, n - 64 + 1, 3)) for _ in range(n_crops)]
    mid = n // 2 + 5  # not on a chunk boundary
    cases: dict[str, Any] = {
        "xy_plane": (np.s_[:, :, mid], 1),
        "xz_plane": (np.s_[:, mid, :], 1),
        "yz_plane": (np.s_[mid, :, :], 1),
        "crop_64": ([np.s_[x:x + 64, y:y + 64, z:z + 64] for x, y, z in corners], n_crops),
    }
    for case, (where, count) in cases.items():
        boxes = where if isinstance(where, list) else [where]
        for lib, arr in opened.items():  # warm-up (indexes cached by both) + correctness
            if not np.array_equal(np.asarray(read(lib, arr[boxes[0]])), labels[boxes[0]]):
                raise SystemExit(f"precomputed {case}: {lib} read different labels")
        runs = {lib: (lambda arr=arr, lib=lib, boxes=boxes: [read(lib, arr[b]) for b in boxes])
                for lib, arr in opened.items()}
        times = interleaved_median_times(runs, repeats)
        report(f"precomputed_sharded_cseg_{case}", {lib: count / t for lib, t in times.items()}, "reads/s")
    shutil.rmtree(root)


# -- N5 ----------------------------------------------------------------------------
def bench_n5(tmp: Path, n: int, block: int, n_reads: int, repeats: int) -> None:
    rng = np.random.default_rng(0)
    # EM-like: smooth structure plus noise, so blosc compresses it a little
    vol = (np.add.outer(np.arange(n), np.arange(n))[None] // 8 + rng.integers(0, 40, (n, n, n))).astype(np.uint8)
    shape, chunks = [n, n, n], [block] * 3

    def create(lib: str, path: Path) -> Any:
        shutil.rmtree(path, ignore_errors=True)
        if lib == "tsp":
            return tsp.open(path.as_uri() + "/", driver="n5", create=True, dtype="uint8", shape=shape,
                            chunks=chunks).result()
        return ts.open({"driver": "n5", "kvstore": {"driver": "file", "path": str(path) + "/"},
                        "metadata": {"dimensions": shape, "blockSize": chunks, "dataType": "uint8"}},
                       create=True, delete_existing=True).result()

    w_rates: dict[str, float] = {}
    for lib in ("tsp", "tensorstore"):
        holder: dict[str, Any] = {}

        def setup(lib: str = lib, holder: dict[str, Any] = holder) -> None:
            holder["a"] = create(lib, tmp / f"n5-{lib}")

        w_rates[lib] = vol.nbytes / (1 << 20) / median_time(lambda h=holder: h["a"].write(vol).result(),
                                                           repeats, setup)
    report("n5_u8_write", w_rates, "MiB/s")
    # both read the same dataset (ours); each library checks it first
    path = tmp / "n5-tsp"
    opened = {"tsp": tsp.open(path.as_uri() + "/").result(),
              "tensorstore": ts.open({"driver": "n5", "kvstore": {"driver": "file", "path": str(path) + "/"}},
                                     read=True).result()}
    for lib, arr in opened.items():
        if not np.array_equal(np.asarray(arr.read().result()), vol):
            raise SystemExit(f"n5: {lib} read different data")
    at = [int(v) for v in rng.integers(0, n, n_reads)]
    corners = [tuple(int(v) for v in rng.integers(0, n - 64 + 1, 3)) for _ in range(n_reads)]
    selections: dict[str, Callable[[Any], list[Any]]] = {
        "xy_planes": lambda a: [a[i, :, :] for i in at],
        "xz_planes": lambda a: [a[:, i, :] for i in at],
        "yz_planes": lambda a: [a[:, :, i] for i in at],
        "crops_64": lambda a: [a[z:z + 64, y:y + 64, x:x + 64] for z, y, x in corners],
    }
    for name, select in selections.items():
        # the two libraries take turns, rep by rep, so that load from elsewhere
        # on a shared machine falls on both alike; the process CPU time of each
        # rep (every thread) is reported too: it depends far less on that load
        views = {lib: select(arr) for lib, arr in opened.items()}
        times: dict[str, list[float]] = {lib: [] for lib in opened}
        cpu: dict[str, list[float]] = {lib: [] for lib in opened}
        waits: dict[str, list[float]] = {lib: [] for lib in opened}
        for _ in range(repeats):
            for lib in opened:
                gc.collect()
                q0, c0, t0 = runqueue_wait(), time.process_time(), time.perf_counter()
                for v in views[lib]:
                    v.read().result()
                times[lib].append(time.perf_counter() - t0)
                cpu[lib].append(time.process_time() - c0)
                q1 = runqueue_wait()
                if q0 is not None and q1 is not None:
                    waits[lib].append(q1 - q0)
        rates = {lib: len(views[lib]) / statistics.median(t) for lib, t in times.items()}
        report(f"n5_u8_{name}", rates, "planes/s" if "planes" in name else "crops/s")
        per_read = {lib: 1000 * statistics.median(c) / len(views[lib]) for lib, c in cpu.items()}
        for lib, ms in per_read.items():
            emit(f"n5_u8_{name}.cpu_per_read.{lib}", ms, "ms")
        emit(f"n5_u8_{name}.cpu_ratio_vs_tensorstore", per_read["tensorstore"] / per_read["tsp"], "x")
        for lib, w in waits.items():  # waiting for a CPU: load from elsewhere, not the library
            if w:
                emit(f"n5_u8_{name}.cpu_wait_per_read.{lib}", 1000 * statistics.median(w) / len(views[lib]), "ms")
    shutil.rmtree(tmp / "n5-tensorstore", ignore_errors=True)
    shutil.rmtree(path, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description="array throughput vs TensorStore and zarr-python")
    p.add_argument("--small", action="store_true", help="small sizes for a quick run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--only", default="",
                   help="comma-separated case prefixes (large,small,http,precomputed,n5,fill,overhead,rss)")
    p.add_argument("--full-fill", action="store_true",
                   help="fill the issue's 2048x2048x512 volume (default 1024x1024x256)")
    p.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    args = p.parse_args()
    only = set(filter(None, args.only.split(",")))
    big = (2048, 2048) if args.small else (16384, 16384)         # 16 MiB / 1 GiB float32
    big_chunks = (512, 512) if args.small else (1024, 1024)      # 1 MiB / 4 MiB
    small_shape = (1024, 1024) if args.small else (8192, 8192)   # 4 MiB / 256 MiB float32
    tmp = Path(tempfile.mkdtemp(prefix="tsp-bench-", dir=args.dir))
    print(f"# {sys.platform}, {available_cpus()} cpus usable ({os.cpu_count()} on the machine), "
          f"tensorstore {version('tensorstore')}, zarr {zarr.__version__}, repeats {args.repeats}", flush=True)
    try:
        if not only or "large" in only:
            mib = big[0] * big[1] * 4 >> 20
            for zstd in (False, True):
                tag = "zstd1" if zstd else "raw"
                bench_dense(tmp, f"f32_{mib}MiB_{tag}", big, big_chunks, None, zstd, args.repeats,
                            per_chunk=False)
        if not only or "small" in only:
            mib = small_shape[0] * small_shape[1] * 4 >> 20
            bench_dense(tmp, f"f32_{mib}MiB_64x64", small_shape, (64, 64), None, False,
                        args.repeats, per_chunk=True)
            bench_dense(tmp, f"f32_{mib}MiB_64x64_in_1024x1024_shards", small_shape, (64, 64),
                        (1024, 1024), False, args.repeats, per_chunk=True)
        if not only or "http" in only:
            n = 128 if args.small else 512
            bench_http_crops(tmp, n, 64, 10 if args.small else 40, args.repeats)
        if not only or "precomputed" in only:
            bench_precomputed(tmp, 128 if args.small else 512, 5 if args.small else 20, max(args.repeats, 9))
        if not only or "n5" in only:
            bench_n5(tmp, 128 if args.small else 512, 64, 8 if args.small else 16, args.repeats)
        if not only or "fill" in only:
            fill = [256, 256, 128] if args.small else [2048, 2048, 512] if args.full_fill else [1024, 1024, 256]
            bench_volume_fill(tmp, fill, args.repeats)
        if not only or "overhead" in only:
            bench_chunk_overhead(tmp, 512 if args.small else 1024, 16, args.repeats)
        if not only or "rss" in only:
            bench_peak_rss(tmp, (4096, 4096) if args.small else (16384, 16384),
                           (512, 512) if args.small else (1024, 1024))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
