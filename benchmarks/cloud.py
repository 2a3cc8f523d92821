"""Object stores at cloud latency: tensorstore_py next to TensorStore and zarr-python.

Same run, same server: one fake-gcs-server behind one ShapingProxy
(tensorstore_py/testing/shaping_proxy.py) that holds every request for the
time to first byte of the round (0, 20 and 100 ms); the libraries take turns
repeat by repeat, each against its own prefix of one bucket:

* ``tsp``: the ``gcs`` kvstore, ``endpoint`` = the proxy;
* ``tensorstore``: its ``gcs`` driver, ``TENSORSTORE_GCS_HTTP_URL`` = the proxy;
* ``zarr``: zarr-python 3 on its ``FsspecStore`` over gcsfs (``endpoint_url`` =
  the proxy, anonymous): of its stores the one that reaches GCS (obstore needs
  TLS or a real endpoint).

Cases, one line each per library and latency (``<case>.<lib>.<ms>ms: value unit``)
and ``<case>.ratio_vs_<lib>.<ms>ms: x`` (tsp speed / theirs, higher is better):

* ``vol_write`` / ``vol_read``: a uint8 volume in 64^3 chunks inside 256^3 shards
  (zstd), written and read whole (MiB/s).
* ``crops_1`` / ``crops_16``: random unaligned 64^3 crops of that volume, one at a
  time and 16 in flight at once (crops/s).
* ``f32_write`` / ``f32_read``: float32 in 4 MiB chunks, written and read whole (MiB/s).
* ``ckpt_save``: a checkpoint of 1 GiB in 2,000 float32 leaves (tsp.checkpoint.save)
  next to TensorStore writing the same bytes as 2,000 zarr3 arrays at once (Orbax
  resolves ``gs://`` paths through its own GCS client, which an emulator endpoint
  does not reach); zarr-python likewise (MiB/s).
* ``commit_1key``: a versioned-store commit of one changed key (tsp ``versioned``)
  next to TensorStore's ``ocdbt`` over the same bucket (commits/s).

    python benchmarks/cloud.py --small             # a few minutes on 2 cores
    python benchmarks/cloud.py                     # the issue's sizes (128 MiB, 1 GiB checkpoint)
    python benchmarks/cloud.py --latencies 20 --cases crops_1,vol_read

Needs fake-gcs-server (``pip install -e ".[test]"``), tensorstore, zarr and gcsfs.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

# before gcsfs and tensorstore load: no metadata server, no hierarchical-namespace probe
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
os.environ.setdefault("GCE_METADATA_HOST", "127.0.0.1:1")
os.environ.setdefault("GCE_METADATA_IP", "127.0.0.1:1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorstore_py as tsp
from tensorstore_py.core.pools import available_cpus
from tensorstore_py.testing.gcs_server import GcsEmulator
from tensorstore_py.testing.shaping_proxy import ShapingProxy

CASES = ("vol_write", "crops_1", "crops_16", "vol_read", "f32_write", "f32_read",
         "ckpt_save", "commit_1key")
LIBS = ("tsp", "tensorstore", "zarr")
MiB = 2**20


def emit(name: str, value: float, unit: str) -> None:
    print(f"{name}: {value:.4g} {unit}", flush=True)


class Bench:
    """The server, the proxy and one prefix per (library, case) in one bucket."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.emu = GcsEmulator().start()
        self.bucket = self.emu.create_bucket()
        self.proxy = ShapingProxy(self.emu.endpoint).start()
        os.environ["TENSORSTORE_GCS_HTTP_URL"] = self.proxy.endpoint
        import gcsfs

        self.fs = gcsfs.GCSFileSystem(endpoint_url=self.proxy.endpoint, token="anon",
                                      asynchronous=True, skip_instance_cache=True)
        s = args.small
        self.vol = (256, 256, 256) if s else (512, 512, 512)  # 16 MiB / 128 MiB
        self.f32 = (2048, 4096) if s else (4096, 8192)  # 32 MiB / 128 MiB, 4 MiB chunks
        self.ckpt_leaves, self.ckpt_bytes = (200, 64 * MiB) if s else (2000, 1024 * MiB)
        self.crops = 20 if s else 200
        self.rng = np.random.default_rng(0)
        self.volume = self.rng.integers(0, 8, size=self.vol, dtype=np.uint8)  # compressible
        self.floats = self.rng.standard_normal(self.f32, dtype=np.float32)

    def close(self) -> None:
        self.proxy.stop()
        self.emu.stop()

    # -- opening one array per library -------------------------------------------------
    def prefix(self, lib: str, case: str) -> str:
        return f"{lib}/{case}-{uuid.uuid4().hex[:6]}/"

    def create(self, lib: str, prefix: str, shape: tuple[int, ...], dtype: str,
               chunks: tuple[int, ...], shards: tuple[int, ...] | None, zstd: bool) -> Any:
        if lib == "tsp":
            spec = {**self.emu.spec(self.bucket, path=prefix), "endpoint": self.proxy.endpoint}
            return tsp.open({"kvstore": spec}, create=True, dtype=dtype, shape=shape, chunks=chunks,
                            shards=shards, compression=("zstd", 1) if zstd else None).result()
        if lib == "zarr":
            import zarr
            from zarr.codecs import ZstdCodec
            from zarr.storage import FsspecStore

            store = FsspecStore(self.fs, path=f"{self.bucket}/{prefix}".rstrip("/"))
            return zarr.create_array(store, shape=shape, chunks=chunks, shards=shards, dtype=dtype,
                                     compressors=ZstdCodec(level=1) if zstd else None, fill_value=0)
        import tensorstore as ts

        inner: list[dict[str, Any]] = [{"name": "bytes", "configuration": {"endian": "little"}}]
        if zstd:
            inner.append({"name": "zstd", "configuration": {"level": 1}})
        codecs, grid = inner, chunks
        if shards is not None:
            grid = shards
            codecs = [{"name": "sharding_indexed", "configuration": {
                "chunk_shape": list(chunks), "codecs": inner,
                "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                                 {"name": "crc32c"}]}}]
        return ts.open({
            "driver": "zarr3", "kvstore": f"gs://{self.bucket}/{prefix}",
            "metadata": {"shape": list(shape), "data_type": dtype, "fill_value": 0,
                         "chunk_grid": {"name": "regular",
                                        "configuration": {"chunk_shape": list(grid)}},
                         "codecs": codecs},
        }, create=True).result()

    def reopen(self, lib: str, arr: Any) -> Any:
        """The array opened afresh (no cache of the writer's)."""
        if lib == "tsp":
            return tsp.open({"kvstore": arr.spec()["kvstore"]}).result()
        if lib == "zarr":
            import zarr

            return zarr.open_array(arr.store, mode="r")
        import tensorstore as ts

        return ts.open(arr.spec(retain_context=False)).result()


def write(lib: str, arr: Any, data: np.ndarray) -> None:
    if lib == "zarr":
        arr[...] = data
    else:
        arr.write(data).result()


def read(lib: str, arr: Any, sel: tuple[slice, ...]) -> np.ndarray:
    if lib == "zarr":
        return arr[sel]
    return np.asarray(arr[sel].read().result())


def read_many(lib: str, arr: Any, sels: list[tuple[slice, ...]]) -> list[np.ndarray]:
    """All of ``sels`` in flight at once."""
    if lib == "zarr":
        async def go() -> list[np.ndarray]:
            return list(await asyncio.gather(*(arr._async_array.getitem(s) for s in sels)))

        from zarr.core.sync import sync

        return sync(go())
    futures = [arr[s].read() for s in sels]
    return [np.asarray(f.result()) for f in futures]


def crops(rng: np.random.Generator, shape: tuple[int, ...], n: int) -> list[tuple[slice, ...]]:
    out = []
    for _ in range(n):
        start = [int(rng.integers(0, d - 64)) for d in shape]
        out.append(tuple(slice(s, s + 64) for s in start))
    return out


def turns(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median seconds of each function, the libraries taking turns repeat by repeat."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            gc.collect()
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def report(case: str, ms: int, rates: dict[str, float], unit: str) -> None:
    for lib, r in rates.items():
        emit(f"{case}.{lib}.{ms}ms", r, unit)
    for lib in rates:
        if lib != "tsp" and "tsp" in rates and rates[lib] > 0:
            emit(f"{case}.ratio_vs_{lib}.{ms}ms", rates["tsp"] / rates[lib], "x")


# -- the cases ------------------------------------------------------------------------
def run_volume(b: Bench, libs: list[str], ms: int, cases: set[str]) -> None:
    mib = b.volume.nbytes / MiB
    arrays = {lib: b.create(lib, b.prefix(lib, "vol"), b.vol, "uint8", (64,) * 3, (256,) * 3, True)
              for lib in libs}
    t = turns({lib: (lambda lib=lib: write(lib, arrays[lib], b.volume)) for lib in libs},
              b.args.repeats if "vol_write" in cases else 1)
    if "vol_write" in cases:
        report("vol_write", ms, {lib: mib / t[lib] for lib in libs}, "MiB/s")
    readers = {lib: b.reopen(lib, arrays[lib]) for lib in libs}
    sels = crops(np.random.default_rng(1), b.vol, b.crops)
    want = [b.volume[s] for s in sels[:4]]
    for lib in libs:  # correctness first, and every library's shard indexes alike warm
        got = read_many(lib, readers[lib], sels[:4])
        assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True)), lib
    if "crops_1" in cases:
        for lib in libs:  # requests per crop (indexes cached): what each crop costs
            b.proxy.reset_counters()
            for s in sels[4:8]:
                read(lib, readers[lib], s)
            emit(f"crops_1.{lib}.requests_per_crop.{ms}ms", b.proxy.counters()["requests"] / 4, "")
        t = turns({lib: (lambda lib=lib: [read(lib, readers[lib], s) for s in sels])
                   for lib in libs}, b.args.repeats)
        report("crops_1", ms, {lib: len(sels) / t[lib] for lib in libs}, "crops/s")
    if "crops_16" in cases:
        batches = [sels[i : i + 16] for i in range(0, len(sels), 16)]
        t = turns({lib: (lambda lib=lib: [read_many(lib, readers[lib], bt) for bt in batches])
                   for lib in libs}, b.args.repeats)
        report("crops_16", ms, {lib: len(sels) / t[lib] for lib in libs}, "crops/s")
    if "vol_read" in cases:
        whole = (slice(None),) * 3
        t = turns({lib: (lambda lib=lib: read(lib, b.reopen(lib, arrays[lib]), whole))
                   for lib in libs}, b.args.repeats)
        report("vol_read", ms, {lib: mib / t[lib] for lib in libs}, "MiB/s")


def run_f32(b: Bench, libs: list[str], ms: int, cases: set[str]) -> None:
    mib = b.floats.nbytes / MiB
    arrays = {lib: b.create(lib, b.prefix(lib, "f32"), b.f32, "float32", (1024, 1024), None, False)
              for lib in libs}
    t = turns({lib: (lambda lib=lib: write(lib, arrays[lib], b.floats)) for lib in libs},
              b.args.repeats if "f32_write" in cases else 1)
    if "f32_write" in cases:
        report("f32_write", ms, {lib: mib / t[lib] for lib in libs}, "MiB/s")
    if "f32_read" in cases:
        whole = (slice(None),) * 2
        got = read("tsp" if "tsp" in libs else libs[0], arrays[libs[0]], whole)
        assert np.array_equal(got, b.floats)
        t = turns({lib: (lambda lib=lib: read(lib, b.reopen(lib, arrays[lib]), whole))
                   for lib in libs}, b.args.repeats)
        report("f32_read", ms, {lib: mib / t[lib] for lib in libs}, "MiB/s")


def run_checkpoint(b: Bench, libs: list[str], ms: int) -> None:
    n, total = b.ckpt_leaves, b.ckpt_bytes
    per = total // n // 4  # float32 elements per leaf
    tree = {f"layer{i:04d}": np.full(per, i, dtype=np.float32) for i in range(n)}
    mib = n * per * 4 / MiB

    def tsp_save() -> None:
        spec = {**b.emu.spec(b.bucket, path=b.prefix("tsp", "ckpt")), "endpoint": b.proxy.endpoint}
        tsp.checkpoint.save(spec, tree, step=1).result()

    def ts_save() -> None:
        import tensorstore as ts

        root = b.prefix("tensorstore", "ckpt")
        opened = [ts.open({"driver": "zarr3", "kvstore": f"gs://{b.bucket}/{root}{k}/",
                           "metadata": {"shape": [per], "data_type": "float32",
                                        "chunk_grid": {"name": "regular",
                                                       "configuration": {"chunk_shape": [per]}}}},
                          create=True) for k in tree]
        arrays = [f.result() for f in opened]
        writes = [a.write(v) for a, v in zip(arrays, tree.values(), strict=True)]
        for w in writes:
            w.result()

    def zarr_save() -> None:
        import zarr
        from zarr.storage import FsspecStore

        root = f"{b.bucket}/{b.prefix('zarr', 'ckpt')}"
        with ThreadPoolExecutor(16) as pool:
            def one(kv: tuple[str, np.ndarray]) -> None:
                z = zarr.create_array(FsspecStore(b.fs, path=root + kv[0]), shape=kv[1].shape,
                                      chunks=kv[1].shape, dtype="float32", compressors=None)
                z[...] = kv[1]

            list(pool.map(one, tree.items()))

    fns = {"tsp": tsp_save, "tensorstore": ts_save, "zarr": zarr_save}
    t = turns({lib: fns[lib] for lib in libs}, b.args.repeats)
    report("ckpt_save", ms, {lib: mib / t[lib] for lib in libs}, "MiB/s")


def run_commit(b: Bench, libs: list[str], ms: int) -> None:
    spec = {**b.emu.spec(b.bucket, path=b.prefix("tsp", "versioned")), "endpoint": b.proxy.endpoint}
    store = tsp.KvStore.open({"driver": "versioned", "base": spec}).result()
    for i in range(50):
        store.write(f"key{i:03d}", b"x" * 1000).result()
    fns: dict[str, Callable[[], Any]] = {"tsp": lambda: store.write("key007", os.urandom(1000)).result()}
    if "tensorstore" in libs:
        import tensorstore as ts

        kv = ts.KvStore.open({"driver": "ocdbt",
                              "base": f"gs://{b.bucket}/{b.prefix('tensorstore', 'ocdbt')}"}).result()
        for i in range(50):
            kv.write(f"key{i:03d}", b"x" * 1000).result()
        fns["tensorstore"] = lambda: kv.write("key007", os.urandom(1000)).result()
    reps = max(b.args.repeats, 5)
    t = turns(fns, reps)
    report("commit_1key", ms, {lib: 1 / t[lib] for lib in fns}, "commits/s")
    b.proxy.reset_counters()
    store.write("key008", b"y").result()
    emit(f"commit_1key.tsp.round_trips.{ms}ms",
         b.proxy.sequential_round_trips(until=time.monotonic()), "")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="shrink every size (a few minutes on 2 cores)")
    p.add_argument("--latencies", default="0,20,100", help="times to first byte in ms")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--libs", default=",".join(LIBS))
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    cases = set(args.cases.split(","))
    libs = [x for x in args.libs.split(",") if x]
    if bad := cases - set(CASES):
        sys.exit(f"unknown cases {sorted(bad)}; known: {', '.join(CASES)}")
    print(f"# cpus: {available_cpus()} usable of {os.cpu_count()}; "
          f"{'small' if args.small else 'full'} sizes", flush=True)
    b = Bench(args)
    try:
        for ms in (int(x) for x in args.latencies.split(",")):
            b.proxy.ttfb = ms / 1000
            if cases & {"vol_write", "crops_1", "crops_16", "vol_read"}:
                run_volume(b, libs, ms, cases)
            if cases & {"f32_write", "f32_read"}:
                run_f32(b, libs, ms, cases)
            if "ckpt_save" in cases:
                run_checkpoint(b, libs, ms)
            if "commit_1key" in cases:
                run_commit(b, libs, ms)
    finally:
        b.close()


if __name__ == "__main__":
    main()
