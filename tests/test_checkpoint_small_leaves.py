"""Many small leaves: packed leaves restored whole (packed_restore.py) into any
target, the batched placement of small blocks (jax_adapter.put_blocks), and the
garbage collector paused around a save's staging and a restore (core/gcpause.py)."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import tensorstore_py as tsp
from tensorstore_py.core.buffers import aligned_empty
from tensorstore_py.core.gcpause import gc_paused
from tensorstore_py.errors import InvalidArgumentError

WORKER = str(Path(__file__).with_name("small_leaves_worker.py"))


def test_small_jax_leaves_restore_bit_exact_into_other_shardings_devices_numpy_and_casts(tmp_path: Path) -> None:
    pytest.importorskip("jax")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    out = subprocess.run([sys.executable, WORKER, str(tmp_path)], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["leaves"] == 160 and res["packed"] >= 100  # the fast path is what is checked
    for name in ("as_saved", "other_device", "named_one_device", "replicated", "split", "device_assembly",
                 "numpy", "no_target", "no_target_writable", "after_second_restore", "cast", "numpy_owned",
                 "no_target_owned"):
        assert res[name] == [], (name, res[name])
    for name in ("as_saved", "other_device", "replicated", "numpy"):
        read, needed = res[name + "_read_needed"]
        assert read == needed > 0, name


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.bool_, np.int8, np.complex64,
                                   np.float64, np.int64, ml_dtypes.float8_e5m2])
@pytest.mark.parametrize("shape", [(), (5,), (3, 4), (2, 1, 3)])
def test_put_blocks_gives_what_device_put_gives_and_never_aliases_the_host_arrays(
    dtype: type, shape: tuple[int, ...]
) -> None:
    jax = pytest.importorskip("jax")
    from tensorstore_py.checkpoint.jax_adapter import put_blocks

    dev = jax.devices()[0]
    mesh = jax.sharding.Mesh(np.array([dev]), ("x",))
    shardings = [jax.sharding.SingleDeviceSharding(dev), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())]
    rng = np.random.default_rng(3)
    blocks, dests, want = [], [], []
    for i in range(12):  # several of one key: the first by device_put, the rest directly
        a = aligned_empty(shape, np.dtype(dtype))  # aligned: what device_put may alias on CPU
        a[...] = (rng.standard_normal(shape) * 20).astype(dtype)
        blocks.append(a)
        dests.append(shardings[i % 2])
        want.append(a.copy())
    ref = [jax.device_put(b, s) for b, s in zip(want, dests)]
    got = put_blocks(blocks, dests, copy=True)
    for b in blocks:
        b[...] = np.ones((), dtype)  # the host buffers are reused: the results must not change
    for g, r, w in zip(got, ref, want):
        assert (g.aval, g.sharding, g.committed, g.dtype, g.shape) == (r.aval, r.sharding, r.committed, r.dtype, r.shape)
        assert np.asarray(g).tobytes() == np.asarray(r).tobytes() == w.astype(r.dtype).tobytes()


def test_put_blocks_takes_strided_blocks_like_device_put() -> None:
    jax = pytest.importorskip("jax")
    from tensorstore_py.checkpoint.jax_adapter import put_blocks

    s = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    big = aligned_empty((3 << 18,), np.dtype(np.float32))  # 3 MiB: device_put's own path
    big[...] = np.arange(big.size, dtype=np.float32)
    blocks = [base.T, base[:, ::2], base, base.T, base[1:3], big]
    want = [b.copy() for b in blocks]
    got = put_blocks(blocks, [s] * len(blocks), copy=True)
    big[...] = -1  # reused: the result must not change
    for g, w in zip(got, want):
        assert g.shape == w.shape and np.array_equal(np.asarray(g), w)


def test_the_garbage_collector_is_back_on_after_saves_and_restores_that_fail(tmp_path: Path) -> None:
    root = f"file://{tmp_path}/"
    tree = {f"l{i}": np.full((3,), i, np.int16) for i in range(50)}
    assert gc.isenabled()
    tsp.checkpoint.save(root, tree, step=1).result()
    assert gc.isenabled()
    out = tsp.checkpoint.restore(root, step=1)
    assert gc.isenabled() and out["l7"].tolist() == [7, 7, 7]
    with pytest.raises(InvalidArgumentError, match="unsupported type"):
        tsp.checkpoint.save(root, {**tree, "bad": object()}, step=2)
    assert gc.isenabled()
    with pytest.raises(InvalidArgumentError, match="stored as int16"):
        tsp.checkpoint.restore(root, step=1, target={"l1": np.zeros(3, np.float32)})
    assert gc.isenabled()
    gc.disable()  # a program that runs without it keeps it off
    try:
        tsp.checkpoint.restore(root, step=1)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_gc_paused_keeps_collection_off_while_any_thread_is_inside() -> None:
    assert gc.isenabled()
    inside, release = threading.Event(), threading.Event()

    def other() -> None:
        with gc_paused():
            inside.set()
            release.wait(10)

    t = threading.Thread(target=other)
    with gc_paused():
        t.start()
        assert inside.wait(10)
        assert not gc.isenabled()
    assert not gc.isenabled()  # the other thread is still inside
    release.set()
    t.join(10)
    assert gc.isenabled()
    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError("boom")
    assert gc.isenabled()


def test_a_tree_flattened_again_by_its_jax_structure_keeps_paths_and_walks_what_jax_does_not(
    tmp_path: Path,
) -> None:
    jax = pytest.importorskip("jax")
    import collections
    import dataclasses

    from tensorstore_py.checkpoint.pytree import flatten

    Pair = collections.namedtuple("Pair", ["lo", "hi"])

    @dataclasses.dataclass
    class Box:  # not registered with JAX: a leaf for JAX, a node for checkpoints
        inner: np.ndarray

    def tree(i: int, b: object) -> dict[object, object]:
        return {"w": jax.numpy.full((2,), i, np.float32), "n": {3: [Pair(np.int8(i), None), "s"], 1: i},
                "b": b, "z": {"y": 1.5 * i}}

    first = flatten(tree(1, np.zeros(2, np.int16)))
    again = flatten(tree(2, np.ones(2, np.int16)))  # the same JAX structure: paths and structure reused
    assert [p for p, _ in again[0]] == [p for p, _ in first[0]] == [
        "['b']", "['n'][1]", "['n'][3][0].lo", "['n'][3][1]", "['w']", "['z']['y']"]
    assert again[1] == first[1]
    assert [np.asarray(v).tolist() if not isinstance(v, str) else v for _, v in again[0]] == [
        [1, 1], 2, 2, "s", [2.0, 2.0], 3.0]
    # the same JAX structure, but a leaf that checkpoints walk into
    walked = flatten(tree(3, Box(np.arange(3))))
    assert [p for p, _ in walked[0]] == [
        "['b'].inner", "['n'][1]", "['n'][3][0].lo", "['n'][3][1]", "['w']", "['z']['y']"]
    root = f"file://{tmp_path}/"
    tsp.checkpoint.save(root, tree(4, np.ones(2, np.int16)), step=1).result()
    tsp.checkpoint.save(root, tree(5, Box(np.arange(3))), step=2).result()
    out = tsp.checkpoint.restore(root, step=2)
    assert out["b"]["inner"].tolist() == [0, 1, 2] and out["w"].tolist() == [5.0, 5.0]
    assert out["n"][3][0].lo == 5 and out["n"][3][1] == "s" and out["n"][1] == 5 and out["z"] == {"y": 7.5}
