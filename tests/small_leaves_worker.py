"""Saves small jax leaves of many dtypes and shapes on 4 CPU devices, restores
them into other shardings, devices, numpy and no target, and checks every
restored shard bit-exact (run by tests/test_checkpoint_small_leaves.py in a
fresh process); prints one JSON line."""

from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import tensorstore_py as tsp
from tensorstore_py.checkpoint import ReadStats

DTYPES = [np.float32, np.int8, np.bool_, ml_dtypes.bfloat16, np.complex64, np.uint16, np.int32,
          ml_dtypes.float8_e4m3fn, np.float16, np.uint8]
SHAPES = [(), (1,), (3,), (4, 6), (2, 3, 4), (8, 4), (0,), (4, 0)]


def values() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(11)
    out = {}
    for i in range(160):
        dt = np.dtype(DTYPES[i % len(DTYPES)])
        shape = SHAPES[(i // len(DTYPES) + i) % len(SHAPES)]
        if dt == np.bool_:
            a = rng.integers(0, 2, shape).astype(bool)
        elif dt.kind in "iu":
            a = rng.integers(np.iinfo(dt).min, np.iinfo(dt).max, shape, dtype=dt, endpoint=True)
        elif dt.kind == "c":
            a = (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dt)
        else:
            a = (rng.standard_normal(shape) * 40).astype(dt)
        out[f"l{i:03d}"] = a
    return out


def same(got: object, want: np.ndarray) -> bool:
    """Every addressable shard of ``got`` (a jax.Array) or ``got`` itself (numpy)
    equals ``want`` at its index, byte for byte, with the same dtype and shape."""
    if isinstance(got, jax.Array):
        if got.dtype != want.dtype or got.shape != want.shape:
            return False
        return all(np.asarray(s.data).tobytes() == want[s.index].tobytes() for s in got.addressable_shards)
    a = np.asarray(got)
    return a.dtype == want.dtype and a.shape == want.shape and a.tobytes() == want.tobytes()


def main(root: str) -> None:
    devs = jax.devices()
    mesh = Mesh(np.array(devs), ("x",))
    ref = values()
    # saved from one device each (packed), or replicated over all four (packed:
    # one replica is written), or split over the four devices (not packed)
    saved_on = {}
    for i, (k, v) in enumerate(ref.items()):
        if i % 5 == 3:
            saved_on[k] = NamedSharding(mesh, P())
        elif i % 5 == 4 and v.ndim >= 1 and v.shape[0] % 4 == 0 and v.shape[0] > 0:
            saved_on[k] = NamedSharding(mesh, P("x"))
        else:
            saved_on[k] = SingleDeviceSharding(devs[i % 4])
    state = {k: jax.device_put(v, saved_on[k]) for k, v in ref.items()}
    mgr = tsp.CheckpointManager(f"file://{root}/")
    mgr.save(1, state)
    mgr.wait_until_finished()
    results: dict[str, object] = {}

    def check(name: str, target: object, **kw: object) -> None:
        stats = ReadStats()
        out = mgr.restore(1, target=target, stats=stats, **kw)
        bad = [k for k, v in ref.items() if not same(out[k], v)]
        results[name] = bad
        results[name + "_read_needed"] = [stats.bytes_read, stats.bytes_needed]

    def abstract(sharding_of: object) -> dict[str, object]:
        return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding_of(i, k, v))  # type: ignore[operator]
                for i, (k, v) in enumerate(ref.items())}

    check("as_saved", abstract(lambda i, k, v: saved_on[k]))
    check("other_device", abstract(lambda i, k, v: SingleDeviceSharding(devs[(i + 1) % 4])))
    check("named_one_device", abstract(lambda i, k, v: NamedSharding(Mesh(np.array(devs[2:3]), ("y",)), P())))
    check("replicated", abstract(lambda i, k, v: NamedSharding(mesh, P())))
    check("split", abstract(lambda i, k, v: NamedSharding(
        mesh, P("x") if v.ndim >= 1 and v.shape[0] % 4 == 0 else P())))
    check("device_assembly", abstract(lambda i, k, v: SingleDeviceSharding(devs[3 - i % 4])), assemble="device")
    packed = [e["path"] for e in mgr_manifest(root)["leaves"] if isinstance(e, dict) and "packed" in e]
    # a packed leaf restored to numpy owns its bytes: it neither pins nor shares its pack's read buffer
    out = mgr.restore(1, target={k: np.zeros(v.shape, v.dtype) for k, v in ref.items()})
    results["numpy_owned"] = [p for p in packed if not out[p[2:-2]].flags.owndata]
    check("numpy", {k: np.zeros(v.shape, v.dtype) for k, v in ref.items()})
    out = mgr.restore(1)
    results["no_target"] = [k for k, v in ref.items() if not same(out[k], v)]
    results["no_target_writable"] = [k for k in ref if not out[k].flags.writeable]
    results["no_target_owned"] = [p for p in packed if not out[p[2:-2]].flags.owndata]
    # the restored arrays are their own: a second restore (new buffers) leaves them as they were
    first = mgr.restore(1, target=abstract(lambda i, k, v: SingleDeviceSharding(devs[0])))
    mgr.restore(1, target=abstract(lambda i, k, v: SingleDeviceSharding(devs[0])))
    results["after_second_restore"] = [k for k, v in ref.items() if not same(first[k], v)]
    # cast: another dtype asked for
    f32 = [k for k, v in ref.items() if v.dtype == np.float32]
    cast = mgr.restore(1, target={k: jax.ShapeDtypeStruct(ref[k].shape, ml_dtypes.bfloat16,
                                                          sharding=SingleDeviceSharding(devs[1])) for k in f32},
                       cast=True)
    results["cast"] = [k for k in f32 if not same(cast[k], ref[k].astype(ml_dtypes.bfloat16))]
    results["packed"] = len(packed)
    results["leaves"] = len(ref)
    print(json.dumps(results))


def mgr_manifest(root: str) -> dict[str, object]:
    kv = tsp.KvStore.open(f"versioned+file://{root}/").result()
    return json.loads(bytes(kv.read(f"{1:012d}/manifest.json").result().value))  # type: ignore[no-any-return]


if __name__ == "__main__":
    main(sys.argv[1])
