"""JAX leaves and pytrees in one process (any number of local CPU devices)."""

from __future__ import annotations

import collections
import dataclasses
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import tensorstore_py as tsp
from tensorstore_py.checkpoint import ReadStats

Opt = collections.namedtuple("Opt", "mu nu count")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Dense:
    kernel: jax.Array
    bias: jax.Array


def _state() -> dict:
    k = jnp.arange(48, dtype=jnp.float32).reshape(8, 6)
    return {
        "dense": Dense(k, jnp.ones(6, jnp.bfloat16)),
        "opt": Opt(jnp.zeros((8, 6)), jnp.full((8, 6), 0.5, jnp.float8_e4m3fn), jnp.int32(3)),
        "scalar": jnp.float32(1.25),
        "host": np.arange(4),
        "lr": 1e-3,
    }


def test_jax_leaves_round_trip_as_numpy_and_as_jax(tmp_path: Path) -> None:
    state = _state()
    mgr = tsp.CheckpointManager(f"file://{tmp_path}")
    mgr.save(1, state).result()
    plain = mgr.restore(1)  # no target: numpy, dataclass as dict, namedtuple as namedtuple
    np.testing.assert_array_equal(plain["dense"]["kernel"], np.asarray(state["dense"].kernel))
    assert plain["dense"]["bias"].dtype == jnp.bfloat16
    assert plain["opt"].nu.dtype == jnp.float8_e4m3fn and plain["opt"].count.shape == ()
    assert plain["lr"] == 1e-3
    # into an abstract target: jax arrays with the target's sharding, the target's classes
    dev = jax.local_devices()[0]
    target = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=SingleDeviceSharding(dev))
        if isinstance(x, jax.Array) else x,
        state,
    )
    out = mgr.restore(1, target=target)
    assert isinstance(out["dense"], Dense) and isinstance(out["opt"], Opt)
    assert isinstance(out["dense"].kernel, jax.Array)
    assert out["dense"].kernel.sharding == SingleDeviceSharding(dev)
    for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(out)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_sharded_save_writes_each_element_once(tmp_path: Path) -> None:
    devices = np.array(jax.local_devices())
    mesh = jax.sharding.Mesh(devices.reshape(-1, 1), ("x", "y"))
    n = len(devices)
    g = np.arange(n * 4 * 6, dtype=np.float32).reshape(n * 4, 6)
    sharded = jax.make_array_from_callback(g.shape, NamedSharding(mesh, P("x")), lambda i: g[i])
    replicated = jax.device_put(g, NamedSharding(mesh, P()))
    tsp.checkpoint.save(f"file://{tmp_path}", {"s": sharded, "r": replicated}).result()
    st = ReadStats()
    out = tsp.checkpoint.restore(f"file://{tmp_path}", stats=st)
    np.testing.assert_array_equal(out["s"], g)
    np.testing.assert_array_equal(out["r"], g)
    assert st.bytes_read == 2 * g.nbytes  # the replicated leaf was stored once
    # restoring the replicated leaf onto every local device reads it once
    st = ReadStats()
    t = {"r": jax.ShapeDtypeStruct(g.shape, g.dtype, sharding=NamedSharding(mesh, P()))}
    got = tsp.checkpoint.restore(f"file://{tmp_path}", target=t, stats=st)
    assert st.bytes_read == g.nbytes
    assert len(got["r"].addressable_shards) == n


def test_donating_or_deleting_after_save_returns_is_safe(tmp_path: Path) -> None:
    x = jnp.arange(1 << 20, dtype=jnp.float32) + 0
    y = jnp.arange(1 << 20, dtype=jnp.float32) + 1
    mgr = tsp.CheckpointManager(f"file://{tmp_path}")
    fut = mgr.save(1, {"x": x, "y": y})
    # the caller moves on at once: donates one buffer, deletes the other
    out = jax.jit(lambda a: a * 0 - 7, donate_argnums=0)(x)
    y.delete()
    junk = [jnp.full(1 << 20, 5.0) + i for i in range(4)]  # reuse freed memory
    jax.block_until_ready((out, junk))
    fut.result()
    got = mgr.restore(1)
    np.testing.assert_array_equal(got["x"], np.arange(1 << 20, dtype=np.float32))
    np.testing.assert_array_equal(got["y"], np.arange(1 << 20, dtype=np.float32) + 1)
