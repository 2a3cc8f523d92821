"""Cases of benchmarks/arrays.py about the chunk engine itself: where the time
per chunk goes, a volume filled by two processes at once, and peak memory.

Imported by arrays.py (this folder is on ``sys.path`` when it runs as a script).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import tensorstore as ts

import tensorstore_py as tsp
from tensorstore_py.core.budget import default_bytes_in_flight
from tensorstore_py.drivers import fastpath
from tensorstore_py.drivers.grid import chunk_parts

__all__ = ["bench_chunk_overhead", "bench_peak_rss", "bench_volume_fill"]


def _emit(name: str, value: float, unit: str) -> None:
    print(f"{name}: {value:.4g} {unit}", flush=True)


def _ts_spec(path: Path, shape: list[int], dtype: str, chunks: list[int],
             shards: list[int] | None) -> dict[str, Any]:
    codecs: list[dict[str, Any]] = [{"name": "bytes", "configuration": {"endian": "little"}}]
    grid = chunks
    if shards is not None:
        grid = shards
        codecs = [{"name": "sharding_indexed", "configuration": {
            "chunk_shape": chunks, "codecs": codecs,
            "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]}}]
    return {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path) + "/"},
            "metadata": {"shape": shape, "data_type": dtype, "fill_value": 0, "codecs": codecs,
                         "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": grid}}}}


# -- where the time per chunk goes ---------------------------------------------------------
def bench_chunk_overhead(tmp: Path, n: int, chunk: int, repeats: int) -> None:
    """Per-chunk cost of reading raw chunks from the page cache, taken apart.

    Chunks of ``chunk``^2 float32 (1 KiB for 16x16: the copy is negligible).
    Lines (microseconds per chunk, medians):

    * ``read_wall``: ``TensorStore.read()`` of the whole array, end to end;
      ``tensorstore_read_wall`` the same for TensorStore.
    * ``batch_cpu``: the blocking batch that reads and places chunks
      (``fastpath.read_batch``), on one thread, as thread CPU time;
    * ``syscalls``: open + one read + close per chunk file, nothing else;
    * ``python``: ``batch_cpu - syscalls``, the Python work per chunk (key,
      output view, bookkeeping, copy call) -- the figure the engine must keep
      small, as it holds the GIL;
    * ``parts``: of that, splitting the request into chunk parts.
    """
    path = tmp / "overhead"
    shutil.rmtree(path, ignore_errors=True)
    shape = (n, n)
    a = tsp.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path) + "/", "sync": False}},
                 create=True, dtype="float32", shape=shape, chunks=(chunk, chunk)).result()
    data = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    a.write(data).result()
    t = ts.open(_ts_spec(path, list(shape), "float32", [chunk, chunk], None)).result()
    if not (np.array_equal(a.read().result(), data) and np.array_equal(t.read().result(), data)):
        raise SystemExit("chunk overhead: a library read different data")
    count = (n // chunk) ** 2
    drv, kv = a._driver, a._driver.kvstore
    index = tuple(slice(0, s, 1) for s in shape)
    out = np.empty(shape, np.float32)
    paths = [kv.path + drv.chunk_key(p.cell) for p in chunk_parts(index, drv._chunk_shape, drv._shape)]
    buf = np.empty(chunk * chunk * 4 + 1, np.uint8)

    def batch() -> None:
        fastpath.read_batch(drv, kv, list(chunk_parts(index, drv._chunk_shape, drv._shape)), out)

    def syscalls() -> None:
        for pth in paths:
            fd = os.open(pth, os.O_RDONLY)
            os.preadv(fd, (buf,), 0)
            os.close(fd)

    def parts() -> None:
        list(chunk_parts(index, drv._chunk_shape, drv._shape))

    def per_chunk_us(fn: Any, clock: Any = time.thread_time) -> float:
        times = []
        for _ in range(max(repeats, 5)):
            t0 = clock()
            fn()
            times.append(clock() - t0)
        return statistics.median(times) / count * 1e6

    tag = f"chunk_overhead_{chunk}x{chunk}_f32"
    batch_cpu, sys_cpu = per_chunk_us(batch), per_chunk_us(syscalls)
    _emit(f"{tag}.read_wall", per_chunk_us(lambda: a.read().result(), time.perf_counter), "us/chunk")
    _emit(f"{tag}.tensorstore_read_wall", per_chunk_us(lambda: t.read().result(), time.perf_counter),
          "us/chunk")
    _emit(f"{tag}.batch_cpu", batch_cpu, "us/chunk")
    _emit(f"{tag}.syscalls", sys_cpu, "us/chunk")
    _emit(f"{tag}.python", batch_cpu - sys_cpu, "us/chunk")
    _emit(f"{tag}.parts", per_chunk_us(parts), "us/chunk")
    shutil.rmtree(path, ignore_errors=True)


# -- a volume filled by two processes ------------------------------------------------------
def _fill_worker(lib: str, path: str, shape: list[int], chunks: list[int], shards: list[int],
                 part: int, parts: int, start: Any, done: Any) -> None:
    """Write slab ``part`` of ``parts`` (split along axis 0 on shard boundaries)."""
    if lib == "tsp":
        arr = tsp.open(Path(path).as_uri() + "/").result()
    else:
        arr = ts.open(_ts_spec(Path(path), shape, "uint8", chunks, shards)).result()
    rows = shape[0] // parts
    lo, hi = part * rows, (part + 1) * rows
    slab = _slab(shape, lo, hi)
    start.wait()
    arr[lo:hi].write(slab).result()
    done.put(time.perf_counter())


def _slab(shape: list[int], lo: int, hi: int) -> np.ndarray:
    """Rows ``lo:hi`` of the volume: a pattern any process can regenerate."""
    z = np.arange(lo, hi, dtype=np.uint32)[:, None, None]
    y = np.arange(shape[1], dtype=np.uint32)[None, :, None]
    x = np.arange(shape[2], dtype=np.uint32)[None, None, :]
    return ((z * 7 + y * 3 + x) % 251).astype(np.uint8)


def bench_volume_fill(tmp: Path, shape: list[int], repeats: int, processes: int = 2) -> None:
    """``processes`` processes fill a uint8 volume (64^3 chunks in 512^3 shards,
    each process a slab of whole shards along axis 0) at once; MiB/s of the whole volume, from a
    common start to the last process done (imports and data generation not
    counted)."""
    chunks = [64, 64, 64]
    # 512^3 shards (fewer along axis 0 where a process's slab is thinner)
    shards = [min(512, shape[0] // processes)] + [min(512, s) for s in shape[1:]]
    if shape[0] % (processes * shards[0]) or any(s % c for s, c in zip(shards, chunks)):
        raise SystemExit(f"volume fill: {shape} does not split into whole shards for {processes} processes")
    ctx = mp.get_context("spawn")
    mib = int(np.prod(shape)) / (1 << 20)
    times: dict[str, list[float]] = {"tsp": [], "tensorstore": []}
    for _ in range(repeats):
        for lib in times:
            path = tmp / f"fill-{lib}"
            shutil.rmtree(path, ignore_errors=True)
            if lib == "tsp":
                tsp.open(path.as_uri() + "/", create=True, dtype="uint8", shape=shape, chunks=chunks,
                         shards=shards).result()
            else:
                ts.open(_ts_spec(path, shape, "uint8", chunks, shards), create=True).result()
            start, done = ctx.Barrier(processes + 1), ctx.Queue()
            procs = [ctx.Process(target=_fill_worker, args=(lib, str(path), shape, chunks, shards, i, processes,
                                                            start, done)) for i in range(processes)]
            for p in procs:
                p.start()
            start.wait()
            t0 = time.perf_counter()
            ends = [done.get(timeout=3600) for _ in procs]
            for p in procs:
                p.join()
                if p.exitcode != 0:
                    raise SystemExit(f"volume fill: a {lib} process failed ({p.exitcode})")
            times[lib].append(max(ends) - t0)
            check = tsp.open(path.as_uri() + "/").result()
            rows = shape[0] // processes
            for lo in (0, shape[0] - 64, rows - 32):
                if not np.array_equal(check[lo:lo + 64].read().result(), _slab(shape, lo, lo + 64)):
                    raise SystemExit(f"volume fill: {lib} left different data at rows {lo}..{lo + 64}")
            shutil.rmtree(path, ignore_errors=True)
    rates = {lib: mib / statistics.median(t) for lib, t in times.items()}
    tag = f"volume_fill_{'x'.join(map(str, shape))}_u8_{processes}proc"
    _emit(f"{tag}.tsp", rates["tsp"], "MiB/s")
    _emit(f"{tag}.tensorstore", rates["tensorstore"], "MiB/s")
    _emit(f"{tag}.ratio_vs_tensorstore", rates["tsp"] / rates["tensorstore"], "x")


# -- peak memory ---------------------------------------------------------------------------
_RSS_SCRIPT = """
import sys, numpy as np
lib, path, op = sys.argv[1], sys.argv[2], sys.argv[3]
if lib == "tsp":
    import tensorstore_py as tsp
    a = tsp.open("file://" + path + "/").result()
else:
    import tensorstore as ts
    a = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": path + "/"}}).result()
data = np.ones(a.shape, a.dtype.numpy_dtype if lib != "tsp" else a.dtype) if op == "write" else None
def status(field):  # KiB; VmHWM is this process image's peak (ru_maxrss survives fork + exec)
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(field + ":"))
base = status("VmRSS")  # resident now, against the peak afterwards
if op == "write":
    a.write(data).result()
else:
    out = a.read().result()
print((status("VmHWM") - base) // 1024)
"""


def bench_peak_rss(tmp: Path, shape: tuple[int, ...], chunks: tuple[int, ...]) -> None:
    """Peak RSS growth (MiB, Linux) of a fresh process reading the whole array
    (output included) and writing it (input allocated and touched before),
    beyond the request's own size: what the engine holds in flight."""
    request_mib = int(np.prod(shape)) * 4 >> 20
    for lib in ("tsp", "tensorstore"):
        path = tmp / f"rss-{lib}"
        shutil.rmtree(path, ignore_errors=True)
        if lib == "tsp":
            tsp.open(path.as_uri() + "/", create=True, dtype="float32", shape=shape, chunks=chunks).result()
        else:
            ts.open(_ts_spec(path, list(shape), "float32", list(chunks), None), create=True).result()
        for op in ("write", "read"):
            out = subprocess.run([sys.executable, "-c", textwrap.dedent(_RSS_SCRIPT), lib, str(path), op],
                                 capture_output=True, text=True, timeout=3600)
            if out.returncode != 0:
                raise SystemExit(f"peak rss: {lib} {op} failed: {out.stderr[-2000:]}")
            growth = int(out.stdout.strip())
            extra = growth - (request_mib if op == "read" else 0)
            _emit(f"peak_rss_{op}_{request_mib}MiB.{lib}_beyond_request", extra, "MiB")
        shutil.rmtree(path, ignore_errors=True)
    _emit("peak_rss.bytes_in_flight_default", default_bytes_in_flight() / (1 << 20), "MiB")
