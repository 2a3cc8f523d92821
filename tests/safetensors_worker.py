"""Restores a safetensors file into sharded targets on 4 CPU devices (run by
tests/test_safetensors_local_reads.py in a fresh process); prints one JSON line."""

from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file

import tensorstore_py as tsp
from tensorstore_py.checkpoint import ReadStats
from tensorstore_py.testing.rss import PeakRss


def main(path: str, spec: str) -> None:
    ref = load_file(path)
    mesh = Mesh(np.array(jax.devices()), ("x",))
    sh = NamedSharding(mesh, P("x", None) if spec == "rows" else P(None, "x"))
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh) for k, v in ref.items()}
    needed = sum(v.nbytes for v in ref.values())
    tsp.checkpoint.restore_safetensors(path, target={"t0": target["t0"]})  # warm up pools and jax
    stats = ReadStats()
    peak = PeakRss()
    out = tsp.checkpoint.restore_safetensors(path, target=target, stats=stats)
    extra = peak.extra()
    same = all(np.asarray(s.data).tobytes() == ref[k][s.index].tobytes()
               for k, arr in out.items() for s in arr.addressable_shards)
    print(json.dumps({"same": same, "extra": extra, "needed": needed, "bytes_read": stats.bytes_read,
                      "bytes_needed": stats.bytes_needed}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
