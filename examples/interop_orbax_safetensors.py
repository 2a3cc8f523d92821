"""Come from Orbax and safetensors, go to safetensors: restores into a sharded target.

    python examples/interop_orbax_safetensors.py

On 4 CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count=4`` unless
set): Orbax's ``StandardCheckpointer`` writes a checkpoint, which
``tsp.checkpoint.restore`` reads into a column-sharded target (each process reads
only its devices' parts); the ``safetensors`` library writes a file, restored
into a row-sharded target with renamed keys; a tensorstore_py checkpoint step is
exported as Hugging Face safetensors files that ``safetensors.numpy.load_file``
reads bit for bit. Needs ``pip install tensorstore_py[orbax] safetensors``.
"""

from __future__ import annotations

import json
import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

import tensorstore_py as tsp
from tensorstore_py.checkpoint import ReadStats
from tensorstore_py.cli import main as cli


def _check(out: dict, ref: dict) -> None:
    for k, arr in out.items():
        for s in arr.addressable_shards:
            assert np.asarray(s.data).tobytes() == ref[k][s.index].tobytes(), k


def main() -> None:
    small = os.environ.get("TSP_EXAMPLES_SMALL") == "1"
    rows = 256 if small else 4096
    tmpdir = tempfile.TemporaryDirectory()
    tmp = tmpdir.name
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    by_rows, by_cols = NamedSharding(mesh, P("x", None)), NamedSharding(mesh, P(None, "x"))
    rng = np.random.default_rng(0)
    ref = {"embed": rng.standard_normal((rows, 64), dtype=np.float32),
           "head": rng.standard_normal((rows, 32), dtype=np.float32).astype(jax.numpy.bfloat16)}

    # 1. an Orbax checkpoint, restored into another sharding
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(f"{tmp}/orbax/100", {k: jax.device_put(v, by_rows) for k, v in ref.items()})
    ckptr.wait_until_finished()
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=by_cols) for k, v in ref.items()}
    stats = ReadStats()
    out = tsp.checkpoint.restore(f"{tmp}/orbax/100", target=target, stats=stats)
    _check(out, ref)
    print(f"orbax -> column-sharded: {stats.bytes_needed} bytes needed, {stats.bytes_read} read")

    # 2. a safetensors file (Hugging Face names), restored with renamed keys
    save_file({"model.embed_tokens.weight": ref["embed"], "lm_head.weight": ref["head"]},
              f"{tmp}/model.safetensors")
    names = {"embed": "model.embed_tokens.weight", "head": "lm_head.weight"}
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=by_rows) for k, v in ref.items()}
    stats = ReadStats()
    out = tsp.checkpoint.restore_safetensors(f"{tmp}/model.safetensors", target=target, key_map=names,
                                             stats=stats)
    _check(out, ref)
    print(f"safetensors -> row-sharded: {stats.bytes_read} bytes read of {stats.bytes_needed} needed")

    # 3. a tensorstore_py checkpoint step exported as Hugging Face safetensors files
    tsp.checkpoint.save(f"file://{tmp}/ckpt/", {"params": ref}, step=1).result()
    assert cli(["export", f"{tmp}/ckpt", f"{tmp}/hf", "--format", "safetensors",
                "--max-shard-size", str(ref["embed"].nbytes)]) == 0
    index = json.load(open(f"{tmp}/hf/model.safetensors.index.json"))
    loaded: dict[str, np.ndarray] = {}
    for f in sorted(set(index["weight_map"].values())):
        loaded.update(load_file(f"{tmp}/hf/{f}"))
    for k, v in ref.items():
        assert loaded[f"params.{k}"].tobytes() == v.tobytes(), k
    back = tsp.checkpoint.restore(f"{tmp}/hf")  # the folder restores as a whole again
    assert all(back[k].tobytes() == loaded[k].tobytes() for k in loaded)
    print(f"exported step 1 as {len(set(index['weight_map'].values()))} safetensors files; load_file agrees")
    tmpdir.cleanup()


if __name__ == "__main__":
    main()
