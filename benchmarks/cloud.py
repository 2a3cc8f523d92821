"""Object stores at cloud latency: tensorstore_py next to TensorStore and zarr-python.

Same run, same server: one fake-gcs-server (``--servers gcs``) or moto's S3
server (``--servers s3``) behind one ShapingProxy
(tensorstore_py/testing/shaping_proxy.py) that holds every request for the
time to first byte of the round (0, 20 and 100 ms); the libraries take turns
repeat by repeat, each against its own prefix of one bucket. The proxy runs in
a process of its own, as the network does: on the benchmark's thread it would
take the GIL from the Python client (tsp, zarr) and not from TensorStore's C++.

* ``tsp``: the ``gcs`` kvstore (``endpoint`` = the proxy) or the ``s3`` kvstore
  (``endpoint_url`` = the proxy);
* ``tensorstore``: its ``gcs`` driver (``TENSORSTORE_GCS_HTTP_URL`` = the
  proxy) or its ``s3`` driver (``endpoint`` = the proxy, ``aws_region``, the
  test credentials in the environment);
* ``zarr``: zarr-python 3 on its ``FsspecStore`` over gcsfs (``endpoint_url`` =
  the proxy, anonymous): of its stores the one that reaches GCS (obstore needs
  TLS or a real endpoint); over s3fs on S3 when s3fs is installed (otherwise
  skipped, with the reason printed).

Cases, one line each per library and latency (``<case>.<lib>.<ms>ms: value unit``)
and ``<case>.ratio_vs_<lib>.<ms>ms: x`` (tsp speed / theirs, higher is better); the
crops and the commit also ``<case>.<lib>.cpu_ms_per_op.<ms>ms``: this process's CPU
time per crop or commit (all its threads; the server and the proxy are processes
of their own), which a machine shared with other work does not blur as it blurs
wall times:

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
    python benchmarks/cloud.py --small --servers gcs,s3    # the S3 rows too (moto)

Needs fake-gcs-server and moto (``pip install -e ".[test]"``), tensorstore, zarr and gcsfs.
Lines of the S3 rounds carry an ``s3.`` prefix.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import multiprocessing
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
from tensorstore_py.testing.s3_server import REGION, TEST_CREDENTIALS, S3Server
from tensorstore_py.testing.shaping_proxy import ShapingProxy

CASES = ("vol_write", "crops_1", "crops_16", "vol_read", "f32_write", "f32_read",
         "ckpt_save", "commit_1key")
LIBS = ("tsp", "tensorstore", "zarr")
SERVERS = ("gcs", "s3")
MiB = 2**20
_TAG = ""  # "s3." during the S3 rounds


def emit(name: str, value: float, unit: str) -> None:
    print(f"{_TAG}{name}: {value:.4g} {unit}", flush=True)


def _proxy_main(upstream: str, conn: Any) -> None:
    """The child process: one ShapingProxy, driven by (name, args) messages."""
    proxy = ShapingProxy(upstream).start()
    conn.send(proxy.endpoint)
    while True:
        name, args = conn.recv()
        if name == "stop":
            proxy.stop()
            conn.send(None)
            return
        if name == "ttfb":
            proxy.ttfb = args[0]
            conn.send(None)
        else:
            conn.send(getattr(proxy, name)(*args))


class ProxyProcess:
    """A ShapingProxy in a process of its own (its relaying never takes the
    benchmark's GIL); ``ttfb``, counters and the request log as ShapingProxy's.
    The log's times are ``time.monotonic()`` of the child, which on Linux is the
    same clock as the parent's."""

    def __init__(self, upstream: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_proxy_main, args=(upstream, child), daemon=True)
        self._proc.start()
        self.endpoint: str = self._conn.recv()

    def _call(self, name: str, *args: Any) -> Any:
        self._conn.send((name, args))
        return self._conn.recv()

    @property
    def ttfb(self) -> float:
        raise AttributeError("write-only")

    @ttfb.setter
    def ttfb(self, seconds: float) -> None:
        self._call("ttfb", seconds)

    def reset_counters(self) -> None:
        self._call("reset_counters")

    def counters(self) -> dict[str, Any]:
        return self._call("counters")

    def sequential_round_trips(self, until: float | None = None) -> int:
        return self._call("sequential_round_trips", until)

    def stop(self) -> None:
        self._call("stop")
        self._proc.join(10)


class Bench:
    """The server, the proxy and one prefix per (library, case) in one bucket."""

    def __init__(self, args: argparse.Namespace, server: str) -> None:
        self.args = args
        self.server = server
        if server == "gcs":
            self.emu: Any = GcsEmulator().start()
        else:
            os.environ.update(TEST_CREDENTIALS)
            os.environ.setdefault("AWS_REGION", REGION)
            self.emu = S3Server().start()
        self.bucket = self.emu.create_bucket()
        self.proxy = ProxyProcess(self.emu.endpoint)
        self.fs: Any = None
        self.no_zarr = ""  # why zarr-python is left out on this server, if it is
        if server == "gcs":
            os.environ["TENSORSTORE_GCS_HTTP_URL"] = self.proxy.endpoint
            import gcsfs

            self.fs = gcsfs.GCSFileSystem(endpoint_url=self.proxy.endpoint, token="anon",
                                          asynchronous=True, skip_instance_cache=True)
        else:
            try:
                import s3fs
            except ImportError:
                self.no_zarr = "s3fs is not installed (zarr-python reaches S3 through it or obstore)"
            else:
                self.fs = s3fs.S3FileSystem(endpoint_url=self.proxy.endpoint, asynchronous=True,
                                            skip_instance_cache=True)
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

    # -- stores of each library ---------------------------------------------------------
    def prefix(self, lib: str, case: str) -> str:
        return f"{lib}/{case}-{uuid.uuid4().hex[:6]}/"

    def tsp_kv(self, prefix: str) -> dict[str, Any]:
        """tsp's store spec for ``prefix``, through the proxy."""
        field = "endpoint" if self.server == "gcs" else "endpoint_url"
        return {**self.emu.spec(self.bucket, path=prefix), field: self.proxy.endpoint}

    def ts_kv(self, prefix: str) -> Any:
        """TensorStore's kvstore spec for ``prefix``, through the proxy."""
        if self.server == "gcs":
            return f"gs://{self.bucket}/{prefix}"
        return {"driver": "s3", "bucket": self.bucket, "path": prefix,
                "endpoint": self.proxy.endpoint, "aws_region": REGION}

    def zarr_store(self, prefix: str) -> Any:
        from zarr.storage import FsspecStore

        return FsspecStore(self.fs, path=f"{self.bucket}/{prefix}".rstrip("/"))

    # -- opening one array per library -------------------------------------------------
    def create(self, lib: str, prefix: str, shape: tuple[int, ...], dtype: str,
               chunks: tuple[int, ...], shards: tuple[int, ...] | None, zstd: bool) -> Any:
        if lib == "tsp":
            return tsp.open({"kvstore": self.tsp_kv(prefix)}, create=True, dtype=dtype, shape=shape,
                            chunks=chunks, shards=shards,
                            compression=("zstd", 1) if zstd else None).result()
        if lib == "zarr":
            import zarr
            from zarr.codecs import ZstdCodec

            return zarr.create_array(self.zarr_store(prefix), shape=shape, chunks=chunks,
                                     shards=shards, dtype=dtype,
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
            "driver": "zarr3", "kvstore": self.ts_kv(prefix),
            "metadata": {"shape": list(shape), "data_type": dtype, "fill_value": 0,
                         "chunk_grid": {"name": "regular",
                                        "configuration": {"chunk_shape": list(grid)}},
                         "codecs": codecs},
        }, create=True).result()

    def reopen(self, lib: str, arr: Any) -> Any:
        """The array opened afresh (no cache of the writer's)."""
        if lib == "tsp":
            # the format named, as TensorStore is told it: no detection reads
            return tsp.open({"driver": "zarr3", "kvstore": arr.spec()["kvstore"]}).result()
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


#: CPU seconds of this process (every thread: TensorStore's C++ threads too) of the last
#: ``turns`` per library, medians; the server and the proxy run in processes of their own
cpu_times: dict[str, float] = {}


def turns(fns: dict[str, Callable[[], Any]], repeats: int,
          before: Callable[[], Any] | None = None) -> dict[str, float]:
    """Median seconds of each function, the libraries taking turns repeat by repeat
    (their median process CPU seconds in :data:`cpu_times`); ``before`` runs
    untimed before each call."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    cpus: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            if before is not None:
                before()
            gc.collect()
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
            cpus[k].append(time.process_time() - c0)
    cpu_times.clear()
    cpu_times.update({k: statistics.median(v) for k, v in cpus.items()})
    return {k: statistics.median(v) for k, v in times.items()}


def report_cpu(case: str, ms: int, ops: int) -> None:
    """``<case>.<lib>.cpu_ms_per_op.<ms>ms``: this process's CPU time per operation in
    the last :func:`turns` (the client's cost; on a loaded machine, what wall times hide)."""
    for lib, sec in cpu_times.items():
        emit(f"{case}.{lib}.cpu_ms_per_op.{ms}ms", sec / ops * 1000, "ms")


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
        report_cpu("crops_1", ms, len(sels))
    if "crops_16" in cases:
        batches = [sels[i : i + 16] for i in range(0, len(sels), 16)]
        for lib in libs:  # requests per crop when 16 are in flight at once
            b.proxy.reset_counters()
            read_many(lib, readers[lib], batches[0])
            emit(f"crops_16.{lib}.requests_per_crop.{ms}ms",
                 b.proxy.counters()["requests"] / len(batches[0]), "")
        t = turns({lib: (lambda lib=lib: [read_many(lib, readers[lib], bt) for bt in batches])
                   for lib in libs}, b.args.repeats)
        report("crops_16", ms, {lib: len(sels) / t[lib] for lib in libs}, "crops/s")
        report_cpu("crops_16", ms, len(sels))
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
        tsp.checkpoint.save(b.tsp_kv(b.prefix("tsp", "ckpt")), tree, step=1).result()

    def ts_save() -> None:
        import tensorstore as ts

        root = b.prefix("tensorstore", "ckpt")
        opened = [ts.open({"driver": "zarr3", "kvstore": b.ts_kv(f"{root}{k}/"),
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
        root = b.prefix("zarr", "ckpt")
        with ThreadPoolExecutor(16) as pool:
            def one(kv: tuple[str, np.ndarray]) -> None:
                z = zarr.create_array(b.zarr_store(root + kv[0]), shape=kv[1].shape,
                                      chunks=kv[1].shape, dtype="float32", compressors=None)
                z[...] = kv[1]

            list(pool.map(one, tree.items()))

    def fresh_bucket() -> None:
        # fake-gcs-server answers slower the more objects a bucket holds (a save of
        # 200 leaves took 0.55-0.61 s in fresh buckets, 0.61-0.82 s as one bucket
        # filled; TensorStore's 400 objects per save suffered more); a cloud bucket
        # does not, and each save writes new objects (moto's buckets alike)
        b.bucket = b.emu.create_bucket()

    fns = {"tsp": tsp_save, "tensorstore": ts_save, "zarr": zarr_save}
    t = turns({lib: fns[lib] for lib in libs}, b.args.repeats, before=fresh_bucket)
    report("ckpt_save", ms, {lib: mib / t[lib] for lib in libs}, "MiB/s")


def run_commit(b: Bench, libs: list[str], ms: int) -> None:
    store = tsp.KvStore.open({"driver": "versioned", "base": b.tsp_kv(b.prefix("tsp", "versioned"))}).result()
    for i in range(50):
        store.write(f"key{i:03d}", b"x" * 1000).result()
    fns: dict[str, Callable[[], Any]] = {"tsp": lambda: store.write("key007", os.urandom(1000)).result()}
    if "tensorstore" in libs:
        import tensorstore as ts

        try:
            kv = ts.KvStore.open({"driver": "ocdbt",
                                  "base": b.ts_kv(b.prefix("tensorstore", "ocdbt"))}).result()
            for i in range(50):
                kv.write(f"key{i:03d}", b"x" * 1000).result()
        except Exception as e:  # e.g. a server without the conditional writes ocdbt needs
            print(f"# commit_1key: tensorstore's ocdbt skipped on {b.server}: {str(e)[:200]}", flush=True)
        else:
            fns["tensorstore"] = lambda: kv.write("key007", os.urandom(1000)).result()
    reps = max(b.args.repeats, 5)
    t = turns(fns, reps)
    report("commit_1key", ms, {lib: 1 / t[lib] for lib in fns}, "commits/s")
    report_cpu("commit_1key", ms, 1)
    time.sleep(1.0)  # the timed commits' trailing work (the ``latest`` hint) done: not this commit's
    b.proxy.reset_counters()
    store.write("key008", os.urandom(1000)).result()  # as timed: a value in a data object
    emit(f"commit_1key.tsp.round_trips.{ms}ms",
         b.proxy.sequential_round_trips(until=time.monotonic()), "")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="shrink every size (a few minutes on 2 cores)")
    p.add_argument("--latencies", default="0,20,100", help="times to first byte in ms")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--libs", default=",".join(LIBS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--servers", default="gcs", help="gcs (fake-gcs-server), s3 (moto) or both")
    args = p.parse_args(argv)
    cases = set(args.cases.split(","))
    libs = [x for x in args.libs.split(",") if x]
    if bad := cases - set(CASES):
        sys.exit(f"unknown cases {sorted(bad)}; known: {', '.join(CASES)}")
    print(f"# cpus: {available_cpus()} usable of {os.cpu_count()}; "
          f"{'small' if args.small else 'full'} sizes", flush=True)
    global _TAG
    for server in args.servers.split(","):
        if server not in SERVERS:
            sys.exit(f"unknown server {server!r}; known: {', '.join(SERVERS)}")
        _TAG = "" if server == "gcs" else f"{server}."
        b = Bench(args, server)
        here = libs
        if "zarr" in libs and b.no_zarr:
            print(f"# {server}: zarr-python skipped: {b.no_zarr}", flush=True)
            here = [lib for lib in libs if lib != "zarr"]
        try:
            for ms in (int(x) for x in args.latencies.split(",")):
                b.proxy.ttfb = ms / 1000
                if cases & {"vol_write", "crops_1", "crops_16", "vol_read"}:
                    run_volume(b, here, ms, cases)
                if cases & {"f32_write", "f32_read"}:
                    run_f32(b, here, ms, cases)
                if "ckpt_save" in cases:
                    run_checkpoint(b, here, ms)
                if "commit_1key" in cases:
                    run_commit(b, here, ms)
        finally:
            b.close()


if __name__ == "__main__":
    main()
