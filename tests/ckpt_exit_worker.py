"""A process that starts a checkpoint save and returns from main at once.

Usage: python ckpt_exit_worker.py KIND ROOT_URL [EXIT_TIMEOUT [LATENCY]]

KIND: "numpy", or a ``SaveOptions.staging`` mode ("device", "pinned_host",
"host") for a jax.Array sharded over 4 CPU devices (the environment sets
XLA_FLAGS=--xla_force_host_platform_device_count=4 and JAX_PLATFORMS=cpu).
LATENCY (seconds) delays every call of the root's store (a fault store).
"""

from __future__ import annotations

import sys

import numpy as np


def expected() -> np.ndarray:
    return (np.arange(1 << 21, dtype=np.float32) * 3 + 1).reshape(512, -1)


def main() -> None:
    kind, root = sys.argv[1], sys.argv[2]
    latency = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
    import tensorstore_py as tsp
    from tensorstore_py.checkpoint import SaveOptions
    from tensorstore_py.kvstore.fault import FaultKvStore

    # small chunks and budget: the save is still streaming when main returns
    opts: dict = {"target_chunk_bytes": 64 << 10, "max_bytes_in_flight": 256 << 10}
    if len(sys.argv) > 3:
        opts["exit_timeout"] = float(sys.argv[3])
    if kind == "numpy":
        tree = {"w": expected()}
    else:
        import jax
        from jax.sharding import Mesh, NamedSharding
        from jax.sharding import PartitionSpec as P

        mesh = Mesh(np.array(jax.devices()).reshape(4), ("a",))
        tree = {"w": jax.device_put(expected(), NamedSharding(mesh, P("a")))}
        opts["staging"] = kind
    store = tsp.KvStore.open(root).result()
    if latency:
        store = FaultKvStore(store, latency=(latency, latency))
    tsp.checkpoint.save(store, tree, step=1, options=SaveOptions(**opts))
    print("main returned", flush=True)


if __name__ == "__main__":
    main()
