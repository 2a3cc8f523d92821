"""One process of a multi-process JAX checkpoint test (run by tests/test_jax_checkpoint.py).

Usage: python jax_worker.py SCENARIO PROCESS_ID NUM_PROCESSES PORT ROOT OUT_JSON

The environment must set XLA_FLAGS=--xla_force_host_platform_device_count=4 and
JAX_PLATFORMS=cpu. Results (checks and byte counts) go to OUT_JSON; any failed
check raises, so the exit code tells the test.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import numpy as np


def expected() -> dict[str, np.ndarray]:
    import ml_dtypes

    return {
        "w": np.arange(16 * 8, dtype=np.float32).reshape(16, 8),
        "e": (np.arange(8 * 16, dtype=np.float32).reshape(8, 16) / 7).astype(ml_dtypes.bfloat16),
        "r": np.linspace(0, 1, 6, dtype=np.float32),
        "odd": np.arange(12 * 6, dtype=np.int32).reshape(12, 6),
    }


def make_tree(mesh: Any) -> dict[str, Any]:
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    ex = expected()

    def put(name: str, spec: Any) -> Any:
        g = ex[name]
        return jax.make_array_from_callback(g.shape, NamedSharding(mesh, spec), lambda i: g[i])

    return {
        "params": {"w": put("w", P("a", "b")), "e": put("e", P(None, "b"))},
        "r": put("r", P()),
        "odd": put("odd", P("b", None)),  # 3-row shards
        "np": np.arange(9, dtype=np.int64).reshape(3, 3),
        "step": 7,
        "count": jax.numpy.int32(5),  # a process-local jax scalar: written once, by process 0
    }


def target(tree_like: dict[str, Any], mesh: Any, specs: dict[str, Any]) -> dict[str, Any]:
    import jax
    from jax.sharding import NamedSharding

    def sds(name: str, arr: Any) -> Any:
        return jax.ShapeDtypeStruct(arr.shape, arr.dtype, sharding=NamedSharding(mesh, specs[name]))

    ex = expected()
    return {
        "params": {"w": sds("w", ex["w"]), "e": sds("e", ex["e"])},
        "r": sds("r", ex["r"]),
        "odd": sds("odd", ex["odd"]),
        "np": np.zeros((3, 3), np.int64),
        "step": 0,
        "count": np.int32(0),
    }


def check_tree(out: dict[str, Any], where: str) -> None:
    import jax

    ex = expected()
    got = {"w": out["params"]["w"], "e": out["params"]["e"], "r": out["r"], "odd": out["odd"]}
    for name, arr in got.items():
        if isinstance(arr, jax.Array):
            for sh in arr.addressable_shards:
                want = ex[name][sh.index]
                if not np.array_equal(np.asarray(sh.data), want):
                    raise AssertionError(f"{where}: leaf {name} shard {sh.index} differs")
        elif not np.array_equal(np.asarray(arr), ex[name]):
            raise AssertionError(f"{where}: leaf {name} differs")
    if not np.array_equal(out["np"], np.arange(9).reshape(3, 3)) or out["step"] != 7 or out["count"] != 5:
        raise AssertionError(f"{where}: numpy / python leaves differ")


def main() -> None:
    scenario, pid, nproc, port, root, out_path = sys.argv[1:7]
    pid_i, nproc_i = int(pid), int(nproc)
    import jax

    if nproc_i > 1:
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{port}", num_processes=nproc_i, process_id=pid_i
        )
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    import tensorstore_py as tsp
    from tensorstore_py.checkpoint import ReadStats, SaveOptions

    devices = np.array(jax.devices())
    report: dict[str, Any] = {"process": pid_i, "devices": len(devices)}
    if scenario == "save_restore":
        mesh = Mesh(devices.reshape(2, 4), ("a", "b"))
        tree = make_tree(mesh)
        mgr = tsp.CheckpointManager(root, max_to_keep=2)
        t0 = time.perf_counter()
        for step in (1, 2, 3):
            mgr.save(step, tree, metrics={"loss": 1.0 / step})
        mgr.wait_until_finished()
        report["save_s"] = time.perf_counter() - t0
        report["steps"] = mgr.all_steps()
        # 1. the save-time sharding: aligned, bytes read must equal bytes needed
        specs = {"w": P("a", "b"), "e": P(None, "b"), "r": P(), "odd": P("b", None)}
        st = ReadStats()
        check_tree(mgr.restore(target=target(tree, mesh, specs), stats=st), "same sharding")
        report["same"] = [st.bytes_read, st.bytes_needed]
        # 2. transposed specs
        specs_t = {"w": P("b", "a"), "e": P("b", None), "r": P("a"), "odd": P(None, "a")}
        st = ReadStats()
        check_tree(mgr.restore(target=target(tree, mesh, specs_t), stats=st), "transposed")
        report["transposed"] = [st.bytes_read, st.bytes_needed]
        # 3. a 1-D mesh of 8 devices
        mesh8 = Mesh(devices.reshape(8), ("x",))
        specs_8 = {"w": P("x"), "e": P(None, "x"), "r": P(), "odd": P()}
        st = ReadStats()
        check_tree(mgr.restore(target=target(tree, mesh8, specs_8), stats=st), "1-D mesh")
        report["mesh8"] = [st.bytes_read, st.bytes_needed]
        # 4. fully replicated: each process reads everything once (not once per device)
        specs_r = {"w": P(), "e": P(), "r": P(), "odd": P()}
        st = ReadStats()
        check_tree(mgr.restore(target=target(tree, mesh, specs_r), stats=st), "replicated")
        report["replicated"] = [st.bytes_read, st.bytes_needed]
    elif scenario == "staging":
        # every staging mode, restored with every assembly into several shardings
        mesh = Mesh(devices.reshape(2, len(devices) // 2), ("a", "b"))
        tree = make_tree(mesh)
        specs = {"w": P("a", "b"), "e": P(None, "b"), "r": P(), "odd": P("b", None)}
        transposed = {"w": P("b", "a"), "e": P("b", None), "r": P("a"), "odd": P(None, "a")}
        for mode in ("device", "pinned_host", "host"):
            # tiny chunks and budget: many chunks, streamed a few at a time
            opts = SaveOptions(staging=mode, target_chunk_bytes=64, max_bytes_in_flight=256)
            mgr = tsp.CheckpointManager(f"{root}{mode}/", options=opts)
            mgr.save(1, tree).result()
            for assemble in ("host", "device"):
                st = ReadStats()
                out = mgr.restore(target=target(tree, mesh, specs), stats=st, assemble=assemble)
                check_tree(out, f"{mode}/{assemble}")
                report[f"{mode}/{assemble}"] = [st.bytes_read, st.bytes_needed]
                check_tree(mgr.restore(target=target(tree, mesh, transposed), assemble=assemble),
                           f"{mode}/{assemble}/transposed")
    elif scenario == "retention_space":
        # 3 saves of an 8 MiB array whose 1 MiB shards are split over both
        # processes, max_to_keep=2: every process's share of step 10 must go
        from jax.sharding import NamedSharding

        mesh = Mesh(devices.reshape(2, 4), ("a", "b"))
        g = np.arange(1024 * 2048, dtype=np.float32).reshape(1024, 2048)
        mgr = tsp.CheckpointManager(root, max_to_keep=2)
        for step in (10, 20, 30):
            x = jax.make_array_from_callback(g.shape, NamedSharding(mesh, P("a", "b")),
                                             lambda i, s=step: g[i] + s)
            mgr.save(step, {"w": x})
        mgr.wait_until_finished()
        report["steps"] = mgr.all_steps()
    elif scenario == "restore_single":
        mesh = Mesh(devices.reshape(2, 2), ("a", "b"))
        specs = {"w": P("b", "a"), "e": P(), "r": P("a"), "odd": P("a")}
        mgr = tsp.CheckpointManager(root)
        report["steps"] = mgr.all_steps()
        st = ReadStats()
        check_tree(mgr.restore(target=target({}, mesh, specs), stats=st), "single process")
        report["single"] = [st.bytes_read, st.bytes_needed]
        out = mgr.restore()  # no target: numpy
        check_tree(out, "numpy")
    elif scenario == "kill":
        mesh = Mesh(devices.reshape(2, 4), ("a", "b"))
        tree = make_tree(mesh)
        mgr = tsp.CheckpointManager(root)
        mgr.save(1, tree).result()
        # step 2 writes its data objects slowly; the test kills process 1 while
        # it is writing them (before its fragment exists)
        slow = SlowStore(tsp.KvStore.open(root).result(), marker=out_path + ".writing")
        mgr2 = tsp.CheckpointManager(slow, options=SaveOptions(commit_timeout=4.0))
        from jax.sharding import NamedSharding

        g = np.ones((1024, 1024), np.float32)  # 512 KiB shards: each its own data object
        big = {"big": jax.make_array_from_callback(g.shape, NamedSharding(mesh, P("a", "b")), lambda i: g[i])}
        try:
            mgr2.save(2, big).result()
            report["step2"] = "committed"
        except Exception as e:
            report["step2"] = f"failed: {type(e).__name__}: {e}"
        with open(out_path, "w") as f:
            json.dump(report, f)
        os._exit(3)  # the peer is gone: skip jax.distributed's shutdown barrier
    elif scenario == "fail0":
        # process 0's data writes fail: every process's save must fail fast
        mesh = Mesh(devices.reshape(2, 4), ("a", "b"))
        from jax.sharding import NamedSharding

        g = np.ones((1024, 1024), np.float32)
        big = {"big": jax.make_array_from_callback(g.shape, NamedSharding(mesh, P("a", "b")), lambda i: g[i])}
        base = tsp.KvStore.open(root).result()
        store = FailingStore(base) if pid_i == 0 else base
        mgr = tsp.CheckpointManager(store, options=SaveOptions(commit_timeout=60.0))
        t0 = time.perf_counter()
        try:
            mgr.save(1, big).result()
            report["result"] = "committed"
        except Exception as e:
            report["result"] = f"{type(e).__name__}: {e}"
        report["seconds"] = time.perf_counter() - t0
        report["steps"] = mgr.all_steps()
    elif scenario == "fail1":
        # process 1's data writes fail: process 0 must not wait for its part
        mesh = Mesh(devices.reshape(2, 4), ("a", "b"))
        from jax.sharding import NamedSharding

        g = np.ones((1024, 1024), np.float32)
        big = {"big": jax.make_array_from_callback(g.shape, NamedSharding(mesh, P("a", "b")), lambda i: g[i])}
        base = tsp.KvStore.open(root).result()
        store = FailingStore(base) if pid_i == 1 else base
        mgr = tsp.CheckpointManager(store, options=SaveOptions(commit_timeout=60.0))
        t0 = time.perf_counter()
        try:
            mgr.save(1, big).result()
            report["result"] = "committed"
        except Exception as e:
            report["result"] = f"{type(e).__name__}: {e}"
        report["seconds"] = time.perf_counter() - t0
        report["steps"] = mgr.all_steps()
    elif scenario in ("stage_fail0", "stage_fail1"):
        # process 0's or 1's device runs out of memory while staging step 1 (on CPU
        # devices nothing runs out: the error jax raises is injected into the
        # staging call); the next save, step 2, must commit on both processes
        from jax.sharding import NamedSharding

        from tensorstore_py.checkpoint import saving

        mesh = Mesh(devices.reshape(2, 4), ("a", "b"))
        g = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
        tree = {"w": jax.make_array_from_callback(g.shape, NamedSharding(mesh, P("a", "b")), lambda i: g[i])}
        real_stage = saving.stage
        calls = {"n": 0}

        def stage(shards: Any, mode: str, **kw: Any) -> Any:
            calls["n"] += 1
            if pid_i == int(scenario[-1]) and calls["n"] == 1:
                raise jax.errors.JaxRuntimeError(
                    "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 16.00GiB (injected)")
            return real_stage(shards, mode, **kw)

        saving.stage = stage
        mgr = tsp.CheckpointManager(root, options=SaveOptions(commit_timeout=20.0, staging="device"))
        t0 = time.perf_counter()
        try:
            mgr.save(1, tree)
            mgr.wait_until_finished()  # raises step 1's error, once
            report["step1"] = "committed"
        except Exception as e:
            report["step1"] = f"{type(e).__name__}: {e}"
        report["step1_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        try:
            mgr.save(2, tree).result()
            report["step2"] = "committed"
        except Exception as e:
            report["step2"] = f"{type(e).__name__}: {e}"
        report["step2_s"] = time.perf_counter() - t0
        report["steps"] = mgr.all_steps()
        if report["step2"] == "committed":
            out = mgr.restore(2)
            report["restored"] = bool(np.array_equal(out["w"], g))
    elif scenario == "exit_abandon":
        # both processes return from main while step 1 is in flight; process 0's
        # data writes are slow, so the save outlives exit_timeout on both: each
        # abandons it and exits 0, process 1 without waiting out commit_timeout
        from jax.sharding import NamedSharding

        mesh = Mesh(devices.reshape(2, 4), ("a", "b"))
        g = np.ones((1024, 1024), np.float32)
        big = {"big": jax.make_array_from_callback(g.shape, NamedSharding(mesh, P("a", "b")), lambda i: g[i])}
        base = tsp.KvStore.open(root).result()
        store = SlowStore(base, marker=os.devnull) if pid_i == 0 else base
        opts = SaveOptions(commit_timeout=60.0, exit_timeout=2.0)
        tsp.checkpoint.save(store, big, step=1, options=opts)
        report["returned"] = True
    elif scenario == "incremental":
        # a fine-tune: a frozen 8 MiB backbone and a 512 KiB adapter, both split over
        # both processes; step 2 makes the backbone anew (a new jax.Array holding the
        # same values) and changes the adapter: each process links its backbone shards
        from pathlib import Path

        from jax.sharding import NamedSharding

        mesh = Mesh(devices.reshape(2, 4), ("a", "b"))
        g = np.arange(1024 * 2048, dtype=np.float32).reshape(1024, 2048)
        a = np.arange(256 * 512, dtype=np.float32).reshape(256, 512)

        def state(step: int) -> dict[str, Any]:
            sharding = NamedSharding(mesh, P("a", "b"))
            return {"backbone": jax.make_array_from_callback(g.shape, sharding, lambda i: g[i]),
                    "adapter": jax.make_array_from_callback(a.shape, sharding, lambda i: a[i] + step)}

        folder = Path(root.removeprefix("file://"))
        mgr = tsp.CheckpointManager(root)
        used = []
        for step in (1, 2):
            mgr.save(step, state(step)).result(120)
            used.append(sum(f.stat().st_size for f in (folder / "data").rglob("*") if f.is_file()))
        out = mgr.restore(2)
        report["used"] = used
        report["restored"] = bool(np.array_equal(out["backbone"], g) and np.array_equal(out["adapter"], a + 2))
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    with open(out_path, "w") as f:
        json.dump(report, f)


def SlowStore(base: Any, *, marker: str) -> Any:
    """A wrapper store whose data-object writes take 2 s (announced by ``marker``)."""
    import asyncio

    from tensorstore_py.kvstore.base import KvStore

    class Slow(KvStore):
        driver = "slow"

        def __init__(self) -> None:
            super().__init__(path="")
            self.base = base

        def _spec_fields(self) -> dict[str, Any]:
            return {"base": base.spec()}

        async def _read(self, key: str, byte_range: Any, if_not_equal: Any) -> Any:
            return await base.read(key, byte_range=byte_range, if_not_equal=if_not_equal)

        async def _write(self, key: str, value: Any, if_equal: Any) -> Any:
            if key.startswith("data/"):
                open(marker, "w").close()
                await asyncio.sleep(2.0)
            return await base.write(key, value, if_equal=if_equal)

        async def _delete(self, key: str, if_equal: Any) -> None:
            await base.delete(key, if_equal=if_equal)

        async def _list(self, prefix: str) -> list[str]:
            return list(await base.list(prefix))

    return Slow()


def FailingStore(base: Any) -> Any:
    """A wrapper store whose data-object writes fail."""
    from tensorstore_py.errors import StorageError

    class Failing(type(SlowStore(base, marker=os.devnull))):  # type: ignore[misc]
        driver = "failing"

        async def _write(self, key: str, value: Any, if_equal: Any) -> Any:
            if key.startswith("data/"):
                raise StorageError(f"injected failure writing {key!r}")
            return await base.write(key, value, if_equal=if_equal)

    return Failing()


if __name__ == "__main__":
    main()
