"""One process of an Orbax interop test (run by tests/test_orbax_interop.py).

Usage: python orbax_worker.py PROCESS_ID NUM_PROCESSES PORT ROOT OUT_JSON

Orbax (StandardCheckpointer, CheckpointManager) writes sharded bf16/f32/int leaves;
tensorstore_py restores them (numpy, and into another sharding) and Orbax restores
them too: every block must match the written values and Orbax's restore bit for bit.
The environment sets XLA_FLAGS=--xla_force_host_platform_device_count=4 and
JAX_PLATFORMS=cpu. Any failed check raises (the exit code tells the test).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np


def expected() -> dict[str, Any]:
    import ml_dtypes

    return {
        "w": np.arange(16 * 8, dtype=np.float32).reshape(16, 8) / 3,
        "e": (np.arange(8 * 16, dtype=np.float32).reshape(8, 16) / 7).astype(ml_dtypes.bfloat16),
        "odd": np.arange(24 * 6, dtype=np.int32).reshape(24, 6) - 50,
        "i": np.arange(9, dtype=np.int64).reshape(3, 3),
    }


def main() -> None:
    pid, nproc, port, root, out_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    import jax

    if nproc > 1:
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=nproc, process_id=pid)
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import tensorstore_py as tsp
    from tensorstore_py.checkpoint import ReadStats

    devices = np.array(jax.devices())
    mesh = Mesh(devices.reshape(2, -1), ("a", "b"))
    ex = expected()

    def put(name: str, spec: Any) -> Any:
        g = ex[name]
        return jax.make_array_from_callback(g.shape, NamedSharding(mesh, spec), lambda i: g[i])

    tree = {"params": {"w": put("w", P("a", "b")), "e": put("e", P(None, "b"))},
            "odd": put("odd", P("b", None)), "i": ex["i"], "step": 7}
    ck = ocp.StandardCheckpointer()
    ck.save(f"{root}/std", tree)
    ck.wait_until_finished()
    mgr = ocp.CheckpointManager(f"{root}/run", options=ocp.CheckpointManagerOptions(max_to_keep=2))
    for s in (1, 2, 3):
        mgr.save(s, args=ocp.args.StandardSave(tree))
    mgr.wait_until_finished()
    mgr.close()
    ck.close()
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices("orbax saved")

    report: dict[str, Any] = {"process": pid, "devices": len(devices)}
    # numpy leaves without a target: the stored tree
    plain = tsp.checkpoint.restore(f"{root}/std")
    assert plain["step"] == 7 and type(plain["step"]) is int
    for name, got in (("w", plain["params"]["w"]), ("e", plain["params"]["e"]), ("odd", plain["odd"]),
                      ("i", plain["i"])):
        assert got.dtype == ex[name].dtype and got.tobytes() == ex[name].tobytes(), name

    # another sharding: rows split across processes (each process needs half of every array)
    other = {"w": P(("a", "b"), None), "e": P("a", None), "odd": P(None, "a")}

    def sds(name: str) -> Any:
        return jax.ShapeDtypeStruct(ex[name].shape, ex[name].dtype, sharding=NamedSharding(mesh, other[name]))

    target = {"params": {"w": sds("w"), "e": sds("e")}, "odd": sds("odd"), "i": np.zeros((3, 3), np.int64),
              "step": 0}
    stats = ReadStats()
    ours = tsp.checkpoint.restore(f"{root}/std", target=target, stats=stats)
    theirs = ocp.StandardCheckpointer().restore(f"{root}/std", target)
    pairs = [("w", ours["params"]["w"], theirs["params"]["w"]), ("e", ours["params"]["e"], theirs["params"]["e"]),
             ("odd", ours["odd"], theirs["odd"])]
    for name, a, b in pairs:
        assert a.sharding.is_equivalent_to(sds(name).sharding, a.ndim)
        assert a.dtype == ex[name].dtype
        for sa, sb in zip(a.addressable_shards, b.addressable_shards):
            want = ex[name][sa.index]
            assert np.asarray(sa.data).tobytes() == want.tobytes(), name
            assert np.asarray(sa.data).tobytes() == np.asarray(sb.data).tobytes(), name
    assert ours["step"] == 7 and ours["i"].tobytes() == ex["i"].tobytes()
    report["bytes_read"] = stats.bytes_read
    report["bytes_needed"] = stats.bytes_needed

    # CheckpointManager over the Orbax run folder: retained steps, newest found
    run = tsp.CheckpointManager(f"{root}/run")
    report["steps"] = run.all_steps()
    assert run.latest_step() == 3
    got = run.restore(target=target)
    assert got["params"]["e"].addressable_shards[0].data.tobytes() == \
        ex["e"][got["params"]["e"].addressable_shards[0].index].tobytes()
    two = tsp.checkpoint.restore(f"{root}/run", step=2)
    assert two["params"]["w"].tobytes() == ex["w"].tobytes()

    # safetensors written by the safetensors library, restored with rows split across
    # processes: each process reads only its half of every tensor
    from safetensors.numpy import save_file

    names = {"w": ex["w"], "odd": ex["odd"]}
    if pid == 0:
        os.makedirs(f"{root}/st", exist_ok=True)
        save_file(names, f"{root}/st/model.safetensors")
    multihost_utils.sync_global_devices("safetensors written")
    rows = NamedSharding(mesh, P("a", None))
    st_target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=rows) for k, v in names.items()}
    st_stats = ReadStats()
    got = tsp.checkpoint.restore(f"{root}/st/model.safetensors", target=st_target, stats=st_stats)
    for k, v in names.items():
        for shard in got[k].addressable_shards:
            assert np.asarray(shard.data).tobytes() == v[shard.index].tobytes(), k
    report["st_bytes_read"] = st_stats.bytes_read
    report["st_bytes_needed"] = st_stats.bytes_needed
    report["st_bytes_total"] = sum(v.nbytes for v in names.values())
    multihost_utils.sync_global_devices("restored")
    with open(out_path, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
