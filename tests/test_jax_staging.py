"""Staging of saves and device assembly of restores, on CPU devices.

CI has no accelerator, but JAX's CPU backend has the same memory kinds
(``device``, ``pinned_host``), so every staging mode and both assemblies run
here on the same code path as on a GPU: round trips are bit-exact, arrays
donated or deleted right after ``save()`` returns do not reach the checkpoint,
host memory of a restore stays at the budget, and a process killed in the
middle of a streamed save publishes nothing partial.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_jax_checkpoint import _run

import tensorstore_py as tsp
from tensorstore_py.checkpoint import ReadStats, SaveOptions
from tensorstore_py.errors import InvalidArgumentError
from tensorstore_py.kvstore.fault import FaultKvStore, FaultRule

STAGINGS = ["auto", "host", "device", "pinned_host"]


def _leaves() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    f32 = rng.standard_normal((96, 40)).astype(np.float32)
    return {
        "f32": f32,
        "bf16": f32.astype(jnp.bfloat16),
        "i32": rng.integers(-(1 << 31), 1 << 31, size=(33, 7), dtype=np.int32),
        "u8": rng.integers(0, 256, size=(1000,), dtype=np.uint8),
        "flags": rng.integers(0, 2, size=(5, 5)).astype(bool),
        "zero_d": np.array(-2.5, np.float32),
    }


def _state(values: dict[str, np.ndarray]) -> dict:
    devices = jax.local_devices()
    # a leaf sharded over every local device (one device in the default test run)
    mesh = jax.sharding.Mesh(np.array(devices), ("x",))
    out = {k: jax.device_put(v, devices[0]) for k, v in values.items()}
    out["sharded"] = jax.device_put(values["f32"], NamedSharding(mesh, P("x")))
    return out


def _target(state: dict) -> dict:
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in state.items()}


def _check(out: dict, values: dict[str, np.ndarray]) -> None:
    for k, want in {**values, "sharded": values["f32"]}.items():
        got = out[k]
        assert isinstance(got, jax.Array), k
        assert got.dtype == want.dtype and got.shape == want.shape, k
        assert np.asarray(got).tobytes() == want.tobytes(), k


@pytest.mark.parametrize("staging", STAGINGS)
def test_round_trips_are_bit_exact_through_every_staging_and_assembly(tmp_path: Path, staging: str) -> None:
    values = _leaves()
    state = _state(values)
    # small chunks and budget: leaves split into many chunks, a few in flight at a time
    opts = SaveOptions(staging=staging, target_chunk_bytes=1024, max_bytes_in_flight=4096)
    mgr = tsp.CheckpointManager(f"file://{tmp_path}", options=opts)
    mgr.save(1, state).result()
    for assemble in ("auto", "host", "device"):
        st = ReadStats()
        out = mgr.restore(1, target=_target(state), assemble=assemble, stats=st, max_bytes_in_flight=8192)
        _check(out, values)
        assert st.bytes_read == st.bytes_needed  # aligned: every byte read once
    numpy_out = mgr.restore(1)  # no target: numpy leaves, same bytes
    assert numpy_out["bf16"].tobytes() == values["bf16"].tobytes()


def test_device_assembly_casts_like_the_host_path(tmp_path: Path) -> None:
    values = _leaves()
    tsp.checkpoint.save(f"file://{tmp_path}", {"f32": jnp.asarray(values["f32"])},
                        options=SaveOptions(target_chunk_bytes=1024)).result()
    target = {"f32": jax.ShapeDtypeStruct((96, 40), jnp.bfloat16, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))}
    host = tsp.checkpoint.restore(f"file://{tmp_path}", target=target, assemble="host", cast=True)
    dev = tsp.checkpoint.restore(f"file://{tmp_path}", target=target, assemble="device", cast=True)
    assert dev["f32"].dtype == jnp.bfloat16
    assert np.asarray(dev["f32"]).tobytes() == np.asarray(host["f32"]).tobytes()
    assert np.asarray(dev["f32"]).tobytes() == values["f32"].astype(jnp.bfloat16).tobytes()


def test_bad_staging_and_assembly_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="staging must be one of .*'pinned_host'.*got 'gpu'"):
        SaveOptions(staging="gpu")  # type: ignore[arg-type]
    tsp.checkpoint.save(f"file://{tmp_path}", {"a": np.ones(3)}).result()
    with pytest.raises(InvalidArgumentError, match="assemble must be one of .*got 'disk'"):
        tsp.checkpoint.restore(f"file://{tmp_path}", assemble="disk")  # type: ignore[arg-type]


def _slow_root(path: Path, latency: float) -> FaultKvStore:
    """The root's base store with every data-object write delayed by ``latency`` s."""
    base = tsp.KvStore.open(f"file://{path}/").result()
    return FaultKvStore(base, schedule=[FaultRule(op="write", key_pattern="data/*", error=None, latency=latency)])


@pytest.mark.parametrize("staging", ["device", "pinned_host"])
def test_arrays_donated_or_deleted_right_after_save_do_not_change_the_checkpoint(
    tmp_path: Path, staging: str
) -> None:
    rng = np.random.default_rng(5)
    want = {k: rng.standard_normal((256, 256)).astype(np.float32) for k in ("donated", "deleted", "kept")}
    state = {k: jnp.asarray(v) for k, v in want.items()}
    # 64 KiB chunks, 128 KiB in flight and slow writes: most chunks are still to be
    # written (and, with "device" staging, still on the device) when save() returns
    opts = SaveOptions(staging=staging, target_chunk_bytes=64 << 10, max_bytes_in_flight=128 << 10)
    mgr = tsp.CheckpointManager(_slow_root(tmp_path, 0.05), options=opts)
    fut = mgr.save(1, state)
    assert not fut.done()
    # the donated buffer is reused by the output (nothing else references it) ...
    overwrite = jax.jit(lambda x: -x - 1.0, donate_argnums=0)
    ptr = state["donated"].unsafe_buffer_pointer()
    out = overwrite(state.pop("donated"))
    assert out.unsafe_buffer_pointer() == ptr
    state.pop("deleted").delete()
    fut.result()
    # ... and the checkpoint still holds what was saved
    got = tsp.CheckpointManager(f"file://{tmp_path}/").restore(1)
    for k, v in want.items():
        assert got[k].tobytes() == v.tobytes(), k


def test_pinned_host_staging_returns_before_the_writes_end(tmp_path: Path) -> None:
    # the whole state fits in the budget: save() waits for the copies only
    state = {"x": jnp.arange(1 << 18, dtype=jnp.float32)}
    opts = SaveOptions(staging="pinned_host", target_chunk_bytes=64 << 10)
    mgr = tsp.CheckpointManager(_slow_root(tmp_path, 0.3), options=opts)
    t0 = time.perf_counter()
    fut = mgr.save(1, state)
    blocked = time.perf_counter() - t0
    fut.result()
    total = time.perf_counter() - t0
    assert blocked < total - 0.25, (blocked, total)  # returned before the first slow write ended
    assert mgr.restore(1)["x"].tobytes() == np.arange(1 << 18, dtype=np.float32).tobytes()


def _every_staging(tmp_path: Path, n: int) -> None:
    reports = _run("staging", n, f"file://{tmp_path}/", tmp_path)
    for r in reports:
        for key in ("device", "pinned_host", "host"):
            for assemble in ("host", "device"):
                read, need = r[f"{key}/{assemble}"]
                assert read <= 1.1 * need, (key, assemble, r)


def test_every_staging_in_two_processes(tmp_path: Path) -> None:
    # each process stages and writes its own shards, then restores onto the same
    # and a transposed mesh, assembled on the host and on the devices
    _every_staging(tmp_path, 2)


@pytest.mark.slow
def test_every_staging_in_one_process_of_four_devices(tmp_path: Path) -> None:
    _every_staging(tmp_path, 1)


_RESTORE_RSS = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
import tensorstore_py as tsp
root, n, assemble, budget = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
dev = jax.devices()[0]
target = {"w": jax.ShapeDtypeStruct((n // 4 // 1024, 1024), jnp.float32,
                                    sharding=jax.sharding.SingleDeviceSharding(dev))}
# warm up the code paths (and the device-side update) on step 0, a small leaf
small = {"w": jax.ShapeDtypeStruct((256, 1024), jnp.float32, sharding=target["w"].sharding)}
tsp.checkpoint.restore(root, step=0, target=small, assemble=assemble)

from tensorstore_py.testing.rss import PeakRss
rss = PeakRss()  # the peak from here (reset where the kernel allows), over the RSS now
out = tsp.checkpoint.restore(root, step=1, target=target, assemble=assemble, max_bytes_in_flight=budget)
jax.block_until_ready(out)
top = rss.base + rss.extra()
w = np.asarray(out["w"])
ok = bool((w[:, 0] == np.arange(w.shape[0], dtype=np.float32)).all() and (w[:, 1:] == 1.5).all())
print(json.dumps({"base": rss.base, "peak": top, "ok": ok}))
"""

_SAVE_LEAF = """
import sys, numpy as np, tensorstore_py as tsp
root, n = sys.argv[1], int(sys.argv[2])
w = np.full((n // 4 // 1024, 1024), 1.5, np.float32)
w[:, 0] = np.arange(w.shape[0])
tsp.checkpoint.save(root, {"w": w[:256]}, step=0).result()
tsp.checkpoint.save(root, {"w": w}, step=1).result()
"""


def _restore_extra_rss(tmp_path: Path, n: int, budget: int) -> None:
    root = f"file://{tmp_path}/"
    r = subprocess.run([sys.executable, "-c", _SAVE_LEAF, root, str(n)], capture_output=True,
                       text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    for assemble in ("host", "device"):
        r = subprocess.run([sys.executable, "-c", _RESTORE_RSS, root, str(n), assemble, str(budget)],
                           capture_output=True, text=True, timeout=300, check=False, env=env)
        assert r.returncode == 0, r.stderr
        m = json.loads(r.stdout.strip().splitlines()[-1])
        assert m["ok"], m
        # beyond the restored array itself (on CPU it lives in host memory)
        extra = m["peak"] - m["base"] - n
        assert extra <= (256 << 20) + budget, (assemble, extra / 2**20, m)


def test_restore_host_memory_is_the_array_plus_the_budget(tmp_path: Path) -> None:
    _restore_extra_rss(tmp_path, 256 << 20, 64 << 20)


@pytest.mark.slow
def test_restore_of_a_1gib_leaf_holds_at_most_the_budget_beyond_it(tmp_path: Path) -> None:
    _restore_extra_rss(tmp_path, 1 << 30, 512 << 20)


_SAVE_RSS = """
import json, sys
import jax, jax.numpy as jnp
import tensorstore_py as tsp
from tensorstore_py.checkpoint import SaveOptions
root, n, budget = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
limit = None if sys.argv[4] == "default" else int(sys.argv[4])
burst = int(sys.argv[5])
if burst:
    # a burst of concurrent blocking reads (what a restore does): the I/O pool grows
    kv = tsp.KvStore.open(sys.argv[6]).result()
    for f in [kv.write(f"k{i}", bytes(1 << 20)) for i in range(burst)]:
        f.result()
    for f in [kv.read(f"k{i}") for i in range(burst)]:
        assert len(f.result().value) == 1 << 20
state = {f"w{i}": jnp.full((n // 4 // 4 // 1024, 1024), float(i), jnp.float32) for i in range(4)}
jax.block_until_ready(state)
opts = SaveOptions(staging="pinned_host", max_bytes_in_flight=budget, target_chunk_bytes=budget // 4,
                   max_staging_bytes=limit)
mgr = tsp.CheckpointManager(root, options=opts)
mgr.save(0, state).result()  # load the code paths (and compile the slices) first

from tensorstore_py.testing.rss import PeakRss
rss = PeakRss()
mgr.save(1, state).result()
import threading
print(json.dumps({"extra": rss.extra(), "threads": threading.active_count()}))
"""


def _save_rss(tmp_path: Path, n: int, budget: int, limit: str, burst: int = 0) -> dict[str, int]:
    r = subprocess.run([sys.executable, "-c", _SAVE_RSS, f"file://{tmp_path}/ckpt/", str(n), str(budget), limit,
                        str(burst), f"file://{tmp_path}/burst/"],
                       capture_output=True, text=True, timeout=300, check=False,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def _save_extra_rss(tmp_path: Path, n: int, budget: int, limit: str) -> int:
    return int(_save_rss(tmp_path, n, budget, limit)["extra"])


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs /proc/self/clear_refs")
def test_a_streamed_save_holds_the_budget_not_the_state(tmp_path: Path) -> None:
    # "pinned_host" staging on CPU devices with a host staging limit below the
    # state: it streams; host memory grows by the chunks in flight, not by the
    # state. (Each 64 MiB shard is larger than the 32 MiB budget, so it leaves
    # chunk by chunk; on CPU a chunk cut from a shard is first sliced into a
    # device buffer, which is host memory there: up to twice the budget; on an
    # accelerator that slice is on the device.)
    n, budget = 256 << 20, 32 << 20
    extra = _save_extra_rss(tmp_path, n, budget, str(budget))
    assert extra < 2 * budget + (48 << 20), extra / 2**20


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs /proc/self/clear_refs")
def test_a_streamed_save_holds_the_budget_however_many_io_threads_exist(tmp_path: Path) -> None:
    # the same streamed save after a burst of concurrent reads has grown the I/O
    # pool to dozens of threads: the chunks still leave the devices on the few
    # threads of the copy pool, so the host memory of freed chunks is reused
    # instead of being kept by one allocator arena per I/O thread (before, the
    # save grew by 120-250 MiB here, up to the whole state)
    n, budget = 256 << 20, 32 << 20
    got = _save_rss(tmp_path, n, budget, str(budget), burst=64)
    assert got["threads"] >= 24, got  # the burst did grow the I/O pool
    assert got["extra"] < 2 * budget + (48 << 20), got["extra"] / 2**20


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs /proc/self/clear_refs")
def test_a_staged_save_holds_the_state_once(tmp_path: Path) -> None:
    # the default staging limit (half the available RAM) holds the 256 MiB state:
    # one batched copy into pinned memory, then writes from views of it. Host
    # memory grows by the staged state once (within 1.25x), not by a second copy
    n, budget = 256 << 20, 32 << 20
    extra = _save_extra_rss(tmp_path, n, budget, "default")
    assert extra <= 1.25 * n + (16 << 20), extra / 2**20


_KILLED_SAVE = """
import sys, jax, jax.numpy as jnp, numpy as np
import tensorstore_py as tsp
from tensorstore_py.checkpoint import SaveOptions
from tensorstore_py.kvstore.fault import FaultKvStore, FaultRule
path, staging = sys.argv[1], sys.argv[2]
tsp.CheckpointManager(f"file://{path}/").save(1, {"w": jnp.zeros((512, 512))}).result()
base = tsp.KvStore.open(f"file://{path}/").result()
slow = FaultKvStore(base, schedule=[FaultRule(op="write", key_pattern="data/*", error=None, latency=0.05)])
opts = SaveOptions(staging=staging, target_chunk_bytes=64 << 10, max_bytes_in_flight=256 << 10)
mgr = tsp.CheckpointManager(slow, options=opts)
w = jnp.arange(512 * 512, dtype=jnp.float32).reshape(512, 512)
fut = mgr.save(2, {"w": w})
print("staged", flush=True)
fut.result()
print("committed", flush=True)
"""


def _kill_mid_save(tmp_path: Path, staging: str, delay: float) -> None:
    path = tmp_path / f"{staging}-{delay}"
    p = subprocess.Popen([sys.executable, "-c", _KILLED_SAVE, str(path), staging],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line.strip() == "staged", line + p.communicate()[1]
    time.sleep(delay)
    os.kill(p.pid, signal.SIGKILL)
    p.communicate()
    mgr = tsp.CheckpointManager(f"file://{path}/")
    steps = mgr.all_steps()
    assert steps in ([1], [1, 2]), steps
    assert mgr.restore(1)["w"].tobytes() == np.zeros((512, 512), np.float32).tobytes()
    if steps == [1, 2]:  # the commit happened before the kill: then it is whole
        assert mgr.restore(2)["w"].tobytes() == np.arange(512 * 512, dtype=np.float32).tobytes()


def test_kill_during_a_streamed_save_publishes_nothing_partial(tmp_path: Path) -> None:
    # 16 chunks of 64 KiB, 4 in flight, each write 50 ms: killed while writing
    _kill_mid_save(tmp_path, "device", 0.1)
    assert tsp.CheckpointManager(f"file://{tmp_path}/device-0.1/").all_steps() == [1]


@pytest.mark.slow
@pytest.mark.parametrize("staging", ["device", "pinned_host"])
def test_kill_at_many_points_of_a_streamed_save(tmp_path: Path, staging: str) -> None:
    for delay in (0.0, 0.05, 0.12, 0.2, 0.3, 0.5):
        _kill_mid_save(tmp_path, staging, delay)


@pytest.mark.slow
def test_the_accelerator_benchmark_runs_on_cpu_devices(tmp_path: Path) -> None:
    # the case meant for a GPU (benchmarks/checkpoint.py --device gpu) on CPU devices,
    # tiny: every system in its own processes, every leaf checked bit-exact
    script = Path(__file__).parent.parent / "benchmarks" / "checkpoint.py"
    r = subprocess.run(
        [sys.executable, str(script), "--device", "cpu", "--gib", "0.01", "--systems", "tsp,tsp_pinned,floor",
         "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("436 leaves bit-exact") == 2, r.stdout
    for line in ("tsp_blocked:", "tsp_pinned_durable:", "floor_d2h_pinned:", "ratio_restore_floor_over_tsp:"):
        assert line in r.stdout, r.stdout
