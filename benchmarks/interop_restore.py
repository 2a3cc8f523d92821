"""Restoring what other tools wrote: tensorstore_py next to the tool itself, same run.

    python benchmarks/interop_restore.py               # 1 GiB each
    python benchmarks/interop_restore.py --mib 128     # a quick check on a shared machine

Cases (4 CPU devices, one process, ``file://`` paths in one scratch folder):

* ``orbax``: a checkpoint of 8 float32 arrays (``--mib`` in all) written by Orbax's
  ``StandardCheckpointer``, rows sharded over the 4 devices; restored by Orbax and by
  ``tsp.checkpoint.restore`` into the same sharded target, and by tensorstore_py into
  a column-sharded one.
* ``two_proc`` (``--processes 2``): 2 processes x 4 devices (``jax.distributed`` on
  127.0.0.1) save the Orbax checkpoint with rows sharded over all 8 devices; each
  process restores into a target whose rows are split between the processes (it
  needs half of every array, aligned with the saved shards) and one whose columns are
  (half of every array, across every saved shard): Orbax and tensorstore_py take
  turns; bytes read per bytes needed are tensorstore_py's (``ReadStats``).
* ``safetensors``: one file of 8 float32 tensors written by ``safetensors.numpy``;
  loaded by ``safetensors.numpy.load_file`` (numpy arrays on the host: the fairest
  reference, as it does the least, no device placement at all), by ``load_file``
  followed by ``jax.device_put`` into the row-sharded target (what a user of the
  library does), and restored by ``tsp.checkpoint.restore_safetensors`` into that
  row-sharded target, a column-sharded one and numpy arrays. ``*_cpu`` lines are the
  process's CPU seconds (user + system) per run: on a shared machine they move less
  than wall times.

``--cases`` picks some of ``orbax,safetensors`` (both by default). In the Orbax
cases the bytes TensorStore's file driver read (its own counter) are also given
for Orbax's restore: both read Orbax's stored chunks.

Each timing is the median of ``--reps`` runs (the files stay in the page cache: this
measures the readers, not the disk). Every restore is checked bit for bit. Lines:
``name: value unit``; ratios > 1 mean tensorstore_py is faster.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np
from _harness import emit, scratch_dir


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _medians(fns: dict, reps: int, check, cpu: dict[str, float] | None = None) -> dict[str, float]:
    """Median seconds of each function, the functions taking turns in every round
    (so page cache and machine load fall on all of them alike); each result checked.
    ``cpu`` receives the median CPU seconds of each."""
    import jax

    times: dict[str, list[float]] = {k: [] for k in fns}
    cpus: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            c0, t0 = _cpu(), time.perf_counter()
            out = fn()
            for leaf in jax.tree_util.tree_leaves(out):
                getattr(leaf, "block_until_ready", lambda: None)()
            times[name].append(time.perf_counter() - t0)
            cpus[name].append(_cpu() - c0)
            check(name, out)
            del out
    if cpu is not None:
        cpu.update({k: statistics.median(v) for k, v in cpus.items()})
    return {k: statistics.median(v) for k, v in times.items()}


def _ts_bytes_read() -> int:
    """Bytes TensorStore's file driver read in this process so far (Orbax reads through it)."""
    import tensorstore as ts

    name = "/tensorstore/kvstore/file/bytes_read"
    return int(sum(v.get("value", 0) for m in ts.experimental_collect_matching_metrics(name)
                   if m.get("name") == name for v in m.get("values", [])))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--processes", type=int, default=1, choices=(1, 2))
    ap.add_argument("--cases", default="orbax,safetensors")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker is not None:
        return _two_proc_worker(a)
    if a.processes == 2:
        return _two_proc(a)
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("x",))
    rows = a.mib * (1 << 20) // 8 // (1024 * 4)
    rows -= rows % 4
    rng = np.random.default_rng(0)
    arrays = {f"layer{i}": rng.standard_normal((rows, 1024), dtype=np.float32) for i in range(8)}
    total = sum(v.nbytes for v in arrays.values())
    emit("size", total / (1 << 20), "MiB", digits=1)
    by_rows, by_cols = NamedSharding(mesh, P("x", None)), NamedSharding(mesh, P(None, "x"))

    def target(sh):
        return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh) for k, v in arrays.items()}

    def check(name, out):
        for k, v in arrays.items():
            if isinstance(out[k], np.ndarray):
                assert out[k].tobytes() == v.tobytes(), (name, k)
                continue
            for s in out[k].addressable_shards:
                assert np.asarray(s.data).tobytes() == v[s.index].tobytes(), (name, k)

    cases = a.cases.split(",")
    with scratch_dir("tsp-interop-") as tmp:
        if "orbax" in cases:
            _orbax_case(a, tmp, arrays, target, check, by_rows, by_cols)
        if "safetensors" in cases:
            _safetensors_case(a, tmp, arrays, target, check, by_rows, by_cols)


def _orbax_case(a, tmp, arrays, target, check, by_rows, by_cols) -> None:
    import jax
    import orbax.checkpoint as ocp

    import tensorstore_py as tsp
    from tensorstore_py.checkpoint import ReadStats

    tree = {k: jax.device_put(v, by_rows) for k, v in arrays.items()}
    ck = ocp.StandardCheckpointer()
    ck.save(f"{tmp}/orbax", tree)
    ck.wait_until_finished()
    del tree
    stats = ReadStats()
    t = _medians({
        "orbax": lambda: ck.restore(f"{tmp}/orbax", target(by_rows)),
        "tsp": lambda: tsp.checkpoint.restore(f"{tmp}/orbax", target=target(by_rows), stats=stats),
        "tsp_cols": lambda: tsp.checkpoint.restore(f"{tmp}/orbax", target=target(by_cols)),
    }, a.reps, check)
    emit("orbax_restore_orbax", t["orbax"], "s")
    emit("orbax_restore_tsp", t["tsp"], "s")
    emit("orbax_restore_tsp_column_sharded", t["tsp_cols"], "s")
    emit("orbax_ratio", t["orbax"] / t["tsp"], "x")
    emit("orbax_bytes_read_per_needed", stats.bytes_read / max(stats.bytes_needed, 1), "x")
    needed = sum(v.nbytes for v in arrays.values())
    for name, sh in (("rows", by_rows), ("columns", by_cols)):
        before = _ts_bytes_read()
        out = ck.restore(f"{tmp}/orbax", target(sh))
        jax.tree_util.tree_map(lambda x: x.block_until_ready(), out)
        del out
        emit(f"orbax_{name}_bytes_read_per_needed_by_orbax", (_ts_bytes_read() - before) / needed, "x")
        stats = ReadStats()
        tsp.checkpoint.restore(f"{tmp}/orbax", target=target(sh), stats=stats)
        emit(f"orbax_{name}_bytes_read_per_needed_by_tsp", stats.bytes_read / max(stats.bytes_needed, 1), "x")


def _safetensors_case(a, tmp, arrays, target, check, by_rows, by_cols) -> None:
    import jax
    from safetensors.numpy import load_file, save_file

    import tensorstore_py as tsp
    from tensorstore_py.checkpoint import ReadStats

    path = f"{tmp}/model.safetensors"
    save_file(arrays, path)
    stats = ReadStats()
    cpu: dict[str, float] = {}
    rows_target = target(by_rows)
    t = _medians({
        "load_file": lambda: load_file(path),
        "load_put": lambda: jax.device_put(load_file(path), by_rows),
        "tsp": lambda: tsp.checkpoint.restore_safetensors(path, target=rows_target, stats=stats),
        "tsp_cols": lambda: tsp.checkpoint.restore_safetensors(path, target=target(by_cols)),
        "tsp_numpy": lambda: tsp.checkpoint.restore_safetensors(path),
    }, a.reps, check, cpu)
    emit("safetensors_load_file", t["load_file"], "s")
    emit("safetensors_load_file_device_put", t["load_put"], "s")
    emit("safetensors_restore_tsp_sharded", t["tsp"], "s")
    emit("safetensors_restore_tsp_column_sharded", t["tsp_cols"], "s")
    emit("safetensors_restore_tsp_numpy", t["tsp_numpy"], "s")
    for k, name in (("load_file", "load_file"), ("load_put", "load_file_device_put"),
                    ("tsp", "restore_tsp_sharded"), ("tsp_cols", "restore_tsp_column_sharded"),
                    ("tsp_numpy", "restore_tsp_numpy")):
        emit(f"safetensors_{name}_cpu", cpu[k], "s")
    emit("safetensors_ratio", t["load_file"] / t["tsp"], "x")
    emit("safetensors_ratio_vs_load_file_device_put", t["load_put"] / t["tsp"], "x")
    emit("safetensors_ratio_numpy", t["load_file"] / t["tsp_numpy"], "x")
    emit("safetensors_bytes_read_per_needed", stats.bytes_read / max(stats.bytes_needed, 1), "x")


def _two_proc(a) -> None:
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with scratch_dir("tsp-interop-2p-") as tmp:
        procs = [subprocess.Popen([sys.executable, __file__, "--mib", str(a.mib), "--reps", str(a.reps),
                                   "--worker", str(i), "--port", str(port), "--dir", tmp],
                                  stderr=subprocess.DEVNULL) for i in range(2)]
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"a worker failed: {codes}")


def _two_proc_worker(a) -> None:
    import jax

    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{a.port}", num_processes=2, process_id=a.worker)
    import orbax.checkpoint as ocp
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import tensorstore_py as tsp
    from tensorstore_py.checkpoint import ReadStats

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    rows = a.mib * (1 << 20) // 8 // (1024 * 4)
    rows -= rows % 8
    shape = (rows, 1024)

    def value(i: int, idx) -> np.ndarray:  # every process computes the same global values
        r0 = idx[0].start or 0
        r1 = idx[0].stop or rows
        base = np.arange(r0, r1, dtype=np.float32)[:, None] * 1024 + np.arange(1024, dtype=np.float32)
        return np.sin(base * (i + 1) / 7)[:, idx[1]]  # hardly compressible, as trained weights

    saved = NamedSharding(mesh, P(("a", "b"), None))
    tree = {f"layer{i}": jax.make_array_from_callback(shape, saved, lambda idx, i=i: value(i, idx))
            for i in range(8)}
    ck = ocp.StandardCheckpointer()
    ck.save(f"{a.dir}/orbax", tree)
    ck.wait_until_finished()
    del tree
    multihost_utils.sync_global_devices("saved")

    def target(spec):
        sh = NamedSharding(mesh, spec)
        return {f"layer{i}": jax.ShapeDtypeStruct(shape, np.float32, sharding=sh) for i in range(8)}

    def check(name, out):
        for k, arr in out.items():
            i = int(k[5:])
            for sh in arr.addressable_shards:
                assert np.asarray(sh.data).tobytes() == value(i, sh.index).tobytes(), (name, k)

    results = {}
    for case, spec in (("rows", P("a", None)), ("cols", P(None, "a"))):
        stats = ReadStats()
        times: dict[str, list[float]] = {"orbax": [], "tsp": []}
        for _ in range(a.reps):
            for who in ("orbax", "tsp"):
                multihost_utils.sync_global_devices(f"{case}-{who}")
                t0 = time.perf_counter()
                if who == "orbax":
                    before = _ts_bytes_read()
                    out = ck.restore(f"{a.dir}/orbax", target(spec))
                    orbax_read = _ts_bytes_read() - before
                else:
                    stats.bytes_read = stats.bytes_needed = 0
                    out = tsp.checkpoint.restore(f"{a.dir}/orbax", target=target(spec), stats=stats)
                jax.tree_util.tree_map(lambda x: x.block_until_ready(), out)
                times[who].append(time.perf_counter() - t0)
                check(who, out)
                del out
        results[case] = ({k: statistics.median(v) for k, v in times.items()}, stats, orbax_read)
    multihost_utils.sync_global_devices("done")
    if a.worker == 0:
        emit("size", 8 * rows * 1024 * 4 / (1 << 20), "MiB", digits=1)
        for case, (t, stats, orbax_read) in results.items():
            emit(f"two_proc_{case}_orbax", t["orbax"], "s")
            emit(f"two_proc_{case}_tsp", t["tsp"], "s")
            emit(f"two_proc_{case}_ratio", t["orbax"] / t["tsp"], "x")
            emit(f"two_proc_{case}_bytes_read_per_needed", stats.bytes_read / max(stats.bytes_needed, 1), "x")
            emit(f"two_proc_{case}_bytes_read_per_needed_by_orbax", orbax_read / max(stats.bytes_needed, 1), "x")


if __name__ == "__main__":
    main()
