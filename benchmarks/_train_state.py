"""The accelerator case of ``benchmarks/checkpoint.py --device gpu|cpu --gib N``.

A transformer-shaped train state on device 0: 24 layers x (qkv, out, up, down,
2 norms) plus an embedding, parameters in bfloat16 and Adam's ``mu`` and ``nu``
in float32 (random normal values), and an int32 step counter: 436 leaves,
``--gib`` GiB in all. Systems, each in fresh processes (one that builds the
state and saves it twice, reporting the second, steady-state save; one that
restores it into the same device sharding and checks every leaf bit-exact):

* ``tsp``: ``CheckpointManager(root).save(step, state)`` (default options,
  ``staging="auto"``), ``wait_until_finished()``; ``restore(step, target=...)``.
* ``tsp_pinned`` / ``tsp_device`` / ``tsp_host``: the same with
  ``SaveOptions(staging=...)`` forced (and, for the first two,
  ``restore(assemble="device")``): the other staging paths, measured.
* ``tsp_warm``: ``tsp`` with ``CheckpointManager(warm_staging=<state bytes>)``:
  pinned staging memory pinned when the manager is created (its first save).
* ``orbax``: ``ocp.StandardCheckpointer()`` with its defaults.
* ``floor``: what the hardware allows, measured in the same run: the on-device
  copy of every leaf, device->host into pinned memory (first and warm),
  ``jax.device_get`` into pageable memory, host->device from pinned memory, the
  disk written by 16 threads as 64 MiB files with write + fsync, read back cold
  by 16 threads, and read cold + ``device_put`` (16 threads). Its save is the
  warm pinned D2H plus the disk write; its restore the cold read + device_put.

``--hbm-full`` fills the device's memory before every save (a ballast array
raising ``bytes_limit - peak_bytes_in_use`` above all but half the state's
size, as a training step that uses all of HBM does), so that ``"auto"`` must
choose pinned staging; every system saves beside the same ballast. Each save
process reports its first save (``first_*``: pinning, compiling) and its second,
steady-state one.

Before every restore (and the floor's cold reads) the page cache is dropped
(``sync; echo 3 > /proc/sys/vm/drop_caches``) when this process may write that
file (root); otherwise the output says the restores read a warm cache.
"Extra RSS" is the peak RSS during the save (or the restore) over the RSS just
before it (``/proc/self/clear_refs`` resets the peak; where it can not,
``ru_maxrss``). On CPU devices a restore's extra RSS includes the restored
arrays themselves (device memory is host memory there).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

from _floor import read_files, write_files

from tensorstore_py.testing.rss import PeakRss

MiB = 1 << 20
GiB = 1 << 30
LAYERS = 24
SYSTEMS = ["tsp", "tsp_pinned", "orbax", "floor"]
_FORCED = {"tsp_pinned": "pinned_host", "tsp_device": "device", "tsp_host": "host"}
HBM_FULL = False  # set by --hbm-full (main, and the children through the environment)
_PIECE = 64 * MiB  # the floor's file size


# -- the state ---------------------------------------------------------------------------
def hidden_size(gib: float) -> int:
    """The model width whose train state is about ``gib`` GiB: per layer 12 h^2 + 2 h
    parameters, an embedding of 8 h x h, 10 bytes per parameter (bf16 + 2 x f32)."""
    h = math.sqrt(gib * GiB / 10 / (LAYERS * 12 + 8))
    return max(64, int(round(h / 64)) * 64)


def leaf_specs(gib: float) -> list[tuple[tuple[Any, ...], tuple[int, ...], str]]:
    """``[(tree path, shape, dtype name)]`` of every leaf, in a fixed order."""
    h = hidden_size(gib)
    layer = {"qkv": (h, 3 * h), "out": (h, h), "up": (h, 4 * h), "down": (4 * h, h),
             "norm1": (h,), "norm2": (h,)}
    out: list[tuple[tuple[Any, ...], tuple[int, ...], str]] = []
    for group, dtype in (("params", "bfloat16"), ("mu", "float32"), ("nu", "float32")):
        out.append(((group, "embed"), (8 * h, h), dtype))
        for i in range(LAYERS):
            for name, shape in layer.items():
                out.append(((group, "layers", i, name), shape, dtype))
    out.append((("step",), (), "int32"))
    return out


def _insert(tree: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    node: Any = tree
    for k, nxt in zip(path[:-1], path[1:]):
        if isinstance(node, list):
            while len(node) <= k:
                node.append({})
            node = node[k]
        else:
            node = node.setdefault(k, [] if isinstance(nxt, int) else {})
    if isinstance(node, list):
        while len(node) <= path[-1]:
            node.append(None)
    node[path[-1]] = value


def _leaf(i: int, shape: tuple[int, ...], dtype: str, device: Any) -> Any:
    import jax
    import jax.numpy as jnp

    if dtype == "int32":
        return jax.device_put(jnp.int32(1000 + i), device)
    key = jax.random.fold_in(jax.random.key(0), i)
    with jax.default_device(device):
        return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def make_state(gib: float, device: Any) -> dict[str, Any]:
    import jax

    tree: dict[str, Any] = {}
    for i, (path, shape, dtype) in enumerate(leaf_specs(gib)):
        _insert(tree, path, _leaf(i, shape, dtype, device))
    jax.block_until_ready(tree)
    return tree


def abstract_state(gib: float, device: Any) -> dict[str, Any]:
    import jax

    sharding = jax.sharding.SingleDeviceSharding(device)
    tree: dict[str, Any] = {}
    for path, shape, dtype in leaf_specs(gib):
        _insert(tree, path, jax.ShapeDtypeStruct(shape, dtype, sharding=sharding))
    return tree


def check_state(got: dict[str, Any], gib: float, device: Any) -> int:
    """Compare every leaf's bits with the state regenerated on the device; the
    number of leaves checked (AssertionError on any difference)."""
    import jax
    import jax.numpy as jnp

    specs = leaf_specs(gib)
    n = len(jax.tree_util.tree_leaves(got))
    if n != len(specs):
        raise AssertionError(f"restored {n} leaves, expected {len(specs)}")
    for i, (path, shape, dtype) in enumerate(specs):
        a, b = _at(got, path), _leaf(i, shape, dtype, device)
        if a.dtype != b.dtype or a.shape != b.shape:
            raise AssertionError(f"leaf {path}: {a.dtype}{a.shape}, expected {b.dtype}{b.shape}")
        bits = {2: jnp.uint16, 4: jnp.uint32}[b.dtype.itemsize]
        if not bool(jnp.all(jax.lax.bitcast_convert_type(a, bits) == jax.lax.bitcast_convert_type(b, bits))):
            raise AssertionError(f"leaf {path} differs from what was saved")
    return len(specs)


def _at(tree: Any, path: tuple[Any, ...]) -> Any:
    for k in path:
        tree = tree[k]
    return tree


# -- memory and the page cache -------------------------------------------------------------
# peak RSS over the RSS at creation (VmHWM, reset through clear_refs where allowed)
Peak = PeakRss


def drop_caches() -> bool:
    """Drop the page cache (True) if this process may; else False."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


def _disk_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)


# -- the children ------------------------------------------------------------------------
def _device(kind: str) -> Any:
    import jax

    dev = jax.devices()[0]
    want = "cpu" if kind == "cpu" else "gpu"
    if dev.platform != want:
        raise SystemExit(f"--device {kind}: jax's first device is {dev} ({dev.platform})")
    return dev


def fill_hbm(dev: Any, need: int) -> list[Any]:
    """Ballast on ``dev`` leaving less than half of ``need`` bytes of room beside
    the peak (``bytes_limit - peak_bytes_in_use``): a device a training step
    fills. Nothing where the device reports no memory statistics (CPU)."""
    import jax.numpy as jnp

    ballast: list[Any] = []
    while True:
        stats = dev.memory_stats() or {}
        if "bytes_limit" not in stats:
            return ballast
        room = stats["bytes_limit"] - max(stats.get("peak_bytes_in_use", 0), stats.get("bytes_in_use", 0))
        if room < need // 2:
            return ballast
        n = min(GiB, room - need // 2 + MiB)
        try:
            ballast.append(jnp.zeros((n,), jnp.uint8, device=dev).block_until_ready())
        except Exception:  # out of memory: full enough
            return ballast


def child_save(system: str, gib: float, kind: str, root: str) -> dict[str, Any]:
    import jax

    dev = _device(kind)
    state = make_state(gib, dev)
    nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(state))
    out: dict[str, Any] = {"leaves": len(jax.tree_util.tree_leaves(state)), "data_gib": nbytes / GiB}
    ballast = fill_hbm(dev, nbytes) if HBM_FULL else []
    out["ballast_gib"] = sum(b.nbytes for b in ballast) / GiB
    if system.startswith("tsp"):
        import tensorstore_py as tsp
        from tensorstore_py.checkpoint.jax_adapter import shards_to_save
        from tensorstore_py.checkpoint.staging import choose_staging

        staging = _FORCED.get(system, "auto")
        t0 = time.perf_counter()
        mgr = tsp.CheckpointManager(f"file://{root}/", options=tsp.checkpoint.SaveOptions(staging=staging),
                                    warm_staging=nbytes if system == "tsp_warm" else 0)
        out["manager_s"] = time.perf_counter() - t0
        shards = [p for x in jax.tree_util.tree_leaves(state) for _, p in shards_to_save(x)[3]]
        out["staging"] = choose_staging(staging, shards)
        out["save_budget_mib"] = _save_budget(mgr, out["staging"], nbytes) / MiB

        def save(step: int) -> tuple[float, float]:
            t0 = time.perf_counter()
            mgr.save(step, state)
            blocked = time.perf_counter() - t0
            mgr.wait_until_finished()
            return blocked, time.perf_counter() - t0
    else:
        import orbax.checkpoint as ocp

        ckptr = ocp.StandardCheckpointer()

        def save(step: int) -> tuple[float, float]:
            t0 = time.perf_counter()
            ckptr.save(os.path.join(root, str(step)), state)
            blocked = time.perf_counter() - t0
            ckptr.wait_until_finished()
            return blocked, time.perf_counter() - t0
    for step in (1, 2):  # the second save is the steady state of a training run
        peak = Peak()
        blocked, durable = save(step)
        prefix = "first_" if step == 1 else ""
        out[prefix + "blocked"], out[prefix + "durable"] = blocked, durable
        out[prefix + "save_extra_rss_mib"] = peak.extra() / MiB
    out["disk_gib"] = _disk_bytes(root) / 2 / GiB
    del ballast
    return out


def _save_budget(mgr: Any, staging: str, nbytes: int) -> int:
    """The host memory a save is configured to hold: the write budget, plus the
    staged state where it is staged whole in host memory ("pinned_host" within
    the host staging limit, "host")."""
    from tensorstore_py.checkpoint.staging import default_staging_bytes

    opts = mgr.options
    limit = opts.max_staging_bytes if opts.max_staging_bytes is not None else default_staging_bytes()
    staged = staging == "host" or (staging == "pinned_host" and nbytes <= limit)
    return int(opts.max_bytes_in_flight + (nbytes if staged else 0))


#: the restore's read budget (``restore(max_bytes_in_flight=)``, its default)
RESTORE_BUDGET = 512 * MiB


def child_restore(system: str, gib: float, kind: str, root: str) -> dict[str, Any]:
    import jax

    dev = _device(kind)
    target = abstract_state(gib, dev)
    if system.startswith("tsp"):
        import tensorstore_py as tsp

        mgr = tsp.CheckpointManager(f"file://{root}/")
        assemble = "device" if system in ("tsp_pinned", "tsp_device") else "auto"

        def restore() -> Any:
            return mgr.restore(2, target=target, assemble=assemble, max_bytes_in_flight=RESTORE_BUDGET)
    else:
        import orbax.checkpoint as ocp

        ckptr = ocp.StandardCheckpointer()

        def restore() -> Any:
            return ckptr.restore(os.path.join(root, "2"), target)
    peak = Peak()
    t0 = time.perf_counter()
    got = jax.block_until_ready(restore())
    out: dict[str, Any] = {"restore": time.perf_counter() - t0, "restore_extra_rss_mib": peak.extra() / MiB}
    if system.startswith("tsp"):
        out["restore_budget_mib"] = RESTORE_BUDGET / MiB
    out["checked_leaves"] = check_state(got, gib, dev)
    return out


def child_floor(gib: float, kind: str, root: str) -> dict[str, Any]:
    import jax
    import numpy as np

    dev = _device(kind)
    state = make_state(gib, dev)
    leaves = jax.tree_util.tree_leaves(state)
    nbytes = sum(x.nbytes for x in leaves)
    out: dict[str, Any] = {"data_gib": nbytes / GiB}
    pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    on_dev = jax.sharding.SingleDeviceSharding(dev)

    def timed(fn: Any) -> tuple[float, Any]:
        t0 = time.perf_counter()
        r = jax.block_until_ready(fn())
        return time.perf_counter() - t0, r

    for i in range(2):  # the second is warm
        t, copies = timed(lambda: jax.device_put(leaves, [on_dev] * len(leaves), may_alias=False))
        del copies
        out["device_copy_first" if i == 0 else "device_copy"] = t
    for i in range(2):
        t, host = timed(lambda: jax.device_put(leaves, [pinned] * len(leaves)))
        out["d2h_pinned_first" if i == 0 else "d2h_pinned"] = t
        if i == 0:
            del host
    t, _ = timed(lambda: jax.device_put(host, [on_dev] * len(host)))
    out["h2d_pinned"] = t
    t0 = time.perf_counter()
    pageable = jax.device_get(leaves)  # on CPU devices: views, no copy
    out["d2h_pageable"] = time.perf_counter() - t0
    del pageable
    views = [np.asarray(x).reshape(-1).view(np.uint8) for x in host]
    pieces = [v[i:i + _PIECE] for v in views for i in range(0, len(v), _PIECE)]
    out["disk_write"] = write_files(pieces, root)
    sizes = [len(p) for p in pieces]
    out["page_cache_dropped"] = drop_caches()
    out["disk_read_cold"] = read_files(root, sizes)
    out["page_cache_dropped"] = drop_caches() and out["page_cache_dropped"]
    out["read_cold_device_put"] = read_files(root, sizes, then=lambda b: jax.device_put(b, dev).block_until_ready())
    out["blocked"] = out["device_copy"]
    out["durable"] = out["d2h_pinned"] + out["disk_write"]
    out["restore"] = out["read_cold_device_put"]
    return out


# -- the driver ----------------------------------------------------------------------------
def _child(op: str, kind: str, gib: float, system: str, root: str) -> dict[str, Any]:
    env = dict(os.environ)
    if HBM_FULL:
        env["TSP_BENCH_HBM_FULL"] = "1"
    if kind == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
    args = ["--child", "--op", op, "--device", kind, "--gib", str(gib), "--system", system, "--dir", root]
    r = subprocess.run([sys.executable, os.path.abspath(sys.argv[0]), *args], env=env,
                       capture_output=True, text=True, timeout=3600, check=False)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def run_child(op: str, system: str, gib: float, kind: str, root: str) -> None:
    """The child's entry point (``--child OP``): prints one JSON line."""
    global HBM_FULL
    HBM_FULL = os.environ.get("TSP_BENCH_HBM_FULL") == "1"
    if op == "save":
        out = child_save(system, gib, kind, root)
    elif op == "restore":
        out = child_restore(system, gib, kind, root)
    else:
        out = child_floor(gib, kind, root)
    print(json.dumps(out), flush=True)


def main(kind: str, gib: float, systems: list[str], reps: int, scratch: str, hbm_full: bool = False) -> None:
    global HBM_FULL
    HBM_FULL = hbm_full
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    dropped = True
    for rep in range(reps):
        for system in systems if rep % 2 == 0 else systems[::-1]:
            root = os.path.join(scratch, f"train-state-{system}")
            shutil.rmtree(root, ignore_errors=True)
            if system == "floor":
                r = _child("floor", kind, gib, system, root)
                dropped = dropped and r.pop("page_cache_dropped")
            else:
                r = _child("save", kind, gib, system, root)
                dropped = drop_caches() and dropped
                r.update(_child("restore", kind, gib, system, root))
            shutil.rmtree(root, ignore_errors=True)
            runs[system].append(r)
    res = {s: {k: statistics.median(x[k] for x in rs) if isinstance(rs[0][k], (int, float)) else rs[0][k]
               for k in rs[0]} for s, rs in runs.items() if rs}
    data = next(iter(res.values()))["data_gib"]
    print(f"train state: {data:.2f} GiB, {len(leaf_specs(gib))} leaves, hidden size {hidden_size(gib)}, "
          f"device {kind}, medians of {reps} run(s); page cache "
          + ("dropped before every restore" if dropped else
             "NOT dropped (no permission to write /proc/sys/vm/drop_caches): restores read a warm cache")
          + ("; HBM filled before saves (--hbm-full)" if hbm_full else ""))
    print(f"{'system':10s} {'1st blocked':>11s} {'1st durable':>11s} {'blocked s':>9s} {'durable s':>9s} "
          f"{'restore s':>9s} {'save +RSS MiB':>13s} {'restore +RSS MiB':>16s} {'on disk GiB':>11s}  note")
    for s, r in res.items():
        note = f"staging={r['staging']}" if "staging" in r else ""
        if r.get("ballast_gib"):
            note += f" ballast={r['ballast_gib']:.1f}GiB"
        if "checked_leaves" in r:
            note += f" {r['checked_leaves']} leaves bit-exact"
        print(f"{s:10s} {r.get('first_blocked', float('nan')):11.3f} {r.get('first_durable', float('nan')):11.2f} "
              f"{r['blocked']:9.3f} {r['durable']:9.2f} {r['restore']:9.2f} "
              f"{r.get('save_extra_rss_mib', float('nan')):13.0f} "
              f"{r.get('restore_extra_rss_mib', float('nan')):16.0f} "
              f"{r.get('disk_gib', data):11.2f}  {note.strip()}")
    print(f"train_state_gib: {data:.3f} GiB")
    for s, r in res.items():
        for k in ("blocked", "durable", "restore", "first_blocked", "first_durable"):
            if k in r:
                print(f"{s}_{k}: {r[k]:.3f} s")
        for k in ("save_extra_rss_mib", "restore_extra_rss_mib"):
            if k in r:
                print(f"{s}_{k[:-4]}: {r[k]:.0f} MiB")
        for op in ("save", "restore"):  # the goal: at most 1.25x the configured budgets
            if f"{op}_budget_mib" in r and f"{op}_extra_rss_mib" in r:
                print(f"{s}_{op}_rss_over_budget: {r[f'{op}_extra_rss_mib'] / r[f'{op}_budget_mib']:.2f}x "
                      f"(budget {r[f'{op}_budget_mib']:.0f} MiB)")
    if "floor" in res:
        f = res["floor"]
        for k in ("device_copy", "d2h_pinned_first", "d2h_pinned", "d2h_pageable", "h2d_pinned",
                  "disk_write", "disk_read_cold", "read_cold_device_put"):
            print(f"floor_{k}: {data / f[k]:.2f} GiB/s ({f[k]:.3f} s)")
    for mine in [s for s in res if s.startswith("tsp")]:
        t = res[mine]
        for other in ("orbax", "floor"):
            if other in res:
                for op in ("blocked", "durable", "restore"):
                    print(f"ratio_{op}_{other}_over_{mine}: {res[other][op] / t[op]:.2f}x")
