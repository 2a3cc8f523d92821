"""Restoring what other tools wrote: tensorstore_py next to the tool itself, same run.

    python benchmarks/interop_restore.py               # 1 GiB each
    python benchmarks/interop_restore.py --mib 128     # a quick check on a shared machine

Cases (4 CPU devices, one process, ``file://`` paths in one scratch folder):

* ``orbax``: a checkpoint of 8 float32 arrays (``--mib`` in all) written by Orbax's
  ``StandardCheckpointer``, rows sharded over the 4 devices; restored by Orbax and by
  ``tsp.checkpoint.restore`` into the same sharded target, and by tensorstore_py into
  a column-sharded one.
* ``safetensors``: one file of 8 float32 tensors written by ``safetensors.numpy``;
  loaded by ``safetensors.numpy.load_file`` (numpy arrays on the host) and restored by
  ``tsp.checkpoint.restore_safetensors`` into a row-sharded target of ``jax.Array``s.

Each timing is the median of ``--reps`` runs (the files stay in the page cache: this
measures the readers, not the disk). Every restore is checked bit for bit. Lines:
``name: value unit``; ratios > 1 mean tensorstore_py is faster.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np
from _harness import emit, scratch_dir


def _medians(fns: dict, reps: int, check) -> dict[str, float]:
    """Median seconds of each function, the functions taking turns in every round
    (so page cache and machine load fall on all of them alike); each result checked."""
    import jax

    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            out = fn()
            for leaf in jax.tree_util.tree_leaves(out):
                getattr(leaf, "block_until_ready", lambda: None)()
            times[name].append(time.perf_counter() - t0)
            check(name, out)
            del out
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    import jax
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    from safetensors.numpy import load_file, save_file

    import tensorstore_py as tsp
    from tensorstore_py.checkpoint import ReadStats

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

    with scratch_dir("tsp-interop-") as tmp:
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

        save_file(arrays, f"{tmp}/model.safetensors")
        stats = ReadStats()
        t = _medians({
            "load_file": lambda: load_file(f"{tmp}/model.safetensors"),
            "tsp": lambda: tsp.checkpoint.restore_safetensors(
                f"{tmp}/model.safetensors", target=target(by_rows), stats=stats),
            "tsp_numpy": lambda: tsp.checkpoint.restore_safetensors(f"{tmp}/model.safetensors"),
        }, a.reps, check)
        emit("safetensors_load_file", t["load_file"], "s")
        emit("safetensors_restore_tsp_sharded", t["tsp"], "s")
        emit("safetensors_restore_tsp_numpy", t["tsp_numpy"], "s")
        emit("safetensors_ratio", t["load_file"] / t["tsp"], "x")
        emit("safetensors_bytes_read_per_needed", stats.bytes_read / max(stats.bytes_needed, 1), "x")


if __name__ == "__main__":
    main()
