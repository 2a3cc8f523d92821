"""Train a small JAX model on 2 processes x 4 CPU devices, checkpoint it, restore it elsewhere.

    python examples/checkpoint_jax.py                 # checkpoints in a temporary folder
    python examples/checkpoint_jax.py --root file:///tmp/run1/ --steps 12 --every 4
    tensorstore-py ls file:///tmp/run1/               # the steps it kept

With ``--root`` the checkpoints stay; running the same command again resumes
training from the newest step there (steps 13..24 the second time).

What happens:

1. This script starts itself twice (process 0 and 1) with 4 CPU devices each,
   joined by ``jax.distributed.initialize`` on 127.0.0.1:<free port>.
2. The processes train a plain-JAX MLP with momentum SGD on a (data=2, model=4)
   mesh (resuming from the root's newest step if it has one); every ``--every``
   steps each process calls ``CheckpointManager.save``:
   each writes only its own shards, and ONE atomic commit publishes the step
   (``max_to_keep=2``).
3. Both processes restore the newest step onto a *different* mesh (model=8,
   the weights' specs transposed) and check it against the trained values.
4. Back in this process (one process, 4 devices) the newest step is restored a
   third time, onto a 2x2 mesh, and as plain numpy; both are checked.
5. One saved weight matrix is opened as a lazy array and sliced in place.

Timings of every save and restore are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

SIZES = {"d_in": 64, "d_hidden": 512, "d_out": 16, "batch": 64}


def _specs(P: Any, transposed: bool = False) -> dict[str, Any]:
    """Partition specs of the params; the restore mesh uses other ones."""
    if transposed:
        return {"w1": P("model", None), "b1": P(), "w2": P(None, "model"), "b2": P("model")}
    return {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P()}


def worker(args: argparse.Namespace) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{args.port}", num_processes=2, process_id=args.process_id
    )
    import jax.numpy as jnp
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import tensorstore_py as tsp

    pid = jax.process_index()
    log = (lambda *a: print(*a, flush=True)) if pid == 0 else (lambda *a: None)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    specs = _specs(P)
    rng = np.random.default_rng(0)
    shapes = {
        "w1": (SIZES["d_in"], SIZES["d_hidden"]), "b1": (SIZES["d_hidden"],),
        "w2": (SIZES["d_hidden"], SIZES["d_out"]), "b2": (SIZES["d_out"],),
    }
    init = {k: (rng.standard_normal(s) * 0.05).astype(np.float32) for k, s in shapes.items()}

    def put(x: np.ndarray, spec: Any) -> Any:
        return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i])

    params = {k: put(v, specs[k]) for k, v in init.items()}
    momentum = {k: put(np.zeros_like(v), specs[k]) for k, v in init.items()}
    true_w = rng.standard_normal((SIZES["d_in"], SIZES["d_out"])).astype(np.float32)

    def loss_fn(p: Any, x: Any, y: Any) -> Any:
        h = jnp.tanh(x @ p["w1"] + p["b1"])
        return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2)

    @jax.jit
    def train_step(p: Any, m: Any, x: Any, y: Any) -> Any:
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        m = jax.tree_util.tree_map(lambda m_, g_: 0.9 * m_ + g_, m, g)
        p = jax.tree_util.tree_map(lambda p_, m_: p_ - 0.05 * m_, p, m)
        return p, m, loss

    def abstract(like: Any, on: Any, spec_of: dict[str, Any]) -> Any:
        return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(on, spec_of[k]))
                for k, v in like.items()}

    mgr = tsp.CheckpointManager(args.root, max_to_keep=2)
    start = mgr.latest_step() or 0
    if start:  # a root with checkpoints: resume from its newest step
        state = mgr.restore(start, target={"params": abstract(params, mesh, specs),
                                           "momentum": abstract(momentum, mesh, specs), "step": 0})
        params, momentum = state["params"], state["momentum"]
        log(f"resumed from step {start} of {args.root}")
    last = start + args.steps
    data_sharding = NamedSharding(mesh, P("data", None))
    for step in range(start + 1, last + 1):
        xb = np.random.default_rng(step).standard_normal((SIZES["batch"], SIZES["d_in"])).astype(np.float32)
        yb = xb @ true_w
        x = jax.make_array_from_callback(xb.shape, data_sharding, lambda i, xb=xb: xb[i])
        y = jax.make_array_from_callback(yb.shape, data_sharding, lambda i, yb=yb: yb[i])
        params, momentum, loss = train_step(params, momentum, x, y)
        if step % args.every == 0:
            t0 = time.perf_counter()
            state = {"params": params, "momentum": momentum, "step": step}
            mgr.save(step, state, metrics={"loss": float(loss)})
            blocked = time.perf_counter() - t0
            mgr.wait_until_finished()
            log(f"step {step:3d}  loss {float(loss):.5f}  save: caller blocked {blocked * 1e3:.1f} ms, "
                f"committed after {(time.perf_counter() - t0) * 1e3:.1f} ms")
    log(f"steps on storage: {mgr.all_steps()}")

    # restore onto another mesh: 1 x 8 devices, the weights' specs transposed
    mesh8 = Mesh(np.array(jax.devices()).reshape(1, 8), ("data", "model"))
    tspecs = _specs(P, transposed=True)
    target = {"params": abstract(params, mesh8, tspecs), "momentum": abstract(momentum, mesh8, tspecs),
              "step": 0}
    t0 = time.perf_counter()
    restored = mgr.restore(mgr.latest_step(), target=target)
    log(f"restore onto a 1x8 mesh (transposed specs): {(time.perf_counter() - t0) * 1e3:.1f} ms")
    want = multihost_utils.process_allgather(params, tiled=True)
    for k, arr in restored["params"].items():
        assert arr.sharding == target["params"][k].sharding
        for shard in arr.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(want[k])[shard.index])
    saved = [s for s in range(start + 1, last + 1) if s % args.every == 0]
    assert restored["step"] == (saved[-1] if saved else start)
    if pid == 0:
        with open(args.out, "w") as f:
            json.dump({k: np.asarray(v).tolist() for k, v in want.items()}, f)
    log("restored values match the trained ones on every process")
    multihost_utils.sync_global_devices("done")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", help="checkpoint root URL (default: a temporary folder)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--process-id", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.process_id is not None:
        worker(args)
        return

    tmp = tempfile.TemporaryDirectory()
    root = args.root or f"file://{tmp.name}/ckpt/"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(tmp.name, "trained.json")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    cmd = [sys.executable, os.path.abspath(__file__), "--root", root, "--steps", str(args.steps),
           "--every", str(args.every), "--port", str(port), "--out", out]
    print(f"checkpoint root: {root}")
    t0 = time.perf_counter()
    procs = [subprocess.Popen(cmd + ["--process-id", str(i)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    noise = ("[Gloo]", "WARNING", "I0000", "W0000")  # collective-library chatter
    assert procs[0].stdout is not None
    for line in procs[0].stdout:  # process 0 reports progress
        if not line.startswith(noise):
            print("  [process 0]", line.rstrip(), flush=True)
    procs[0].wait()
    logs = ["", procs[1].communicate()[0]]  # process 0's lines were printed above
    for i, p in enumerate(procs):
        if p.returncode != 0:
            print("\n".join(ln for ln in logs[i].splitlines() if not ln.startswith(noise)), file=sys.stderr)
            raise SystemExit(f"process {i} failed with exit code {p.returncode}")
    print(f"2 processes trained, saved and restored in {time.perf_counter() - t0:.1f} s")

    # a third restore, in this single process with 4 devices: a 2x2 mesh, and plain numpy
    os.environ.update(XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import tensorstore_py as tsp

    with open(out) as f:
        want = {k: np.asarray(v, np.float32) for k, v in json.load(f).items()}
    mgr = tsp.CheckpointManager(root)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
    specs = _specs(P)
    target = {"params": {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, specs[k]))
                         for k, v in want.items()}}
    t0 = time.perf_counter()
    got = mgr.restore(target=target)
    print(f"restore in 1 process onto a 2x2 mesh: {(time.perf_counter() - t0) * 1e3:.1f} ms")
    t0 = time.perf_counter()
    plain = mgr.restore()
    print(f"restore as numpy (no target): {(time.perf_counter() - t0) * 1e3:.1f} ms")
    for k, v in want.items():
        np.testing.assert_array_equal(np.asarray(got["params"][k]), v)
        np.testing.assert_array_equal(plain["params"][k], v)
    print(f"steps {mgr.all_steps()}, metrics of the newest: {mgr.metrics(mgr.latest_step())}")

    # slice one saved array in place: lazy, reads only the chunks the slice needs
    name = next(k for k in sorted(want) if want[k].ndim == 2)
    path = f"['params']['{name}']"
    arr = tsp.checkpoint.open_array(root, path).result()
    t0 = time.perf_counter()
    row = arr[1, ::2].read().result()
    print(f"slice {path}[1, ::2] of shape {arr.shape} {arr.dtype}: {row.shape} in "
          f"{(time.perf_counter() - t0) * 1e3:.1f} ms")
    np.testing.assert_array_equal(row, want[name][1, ::2])
    print("OK: every restore and the slice match the trained parameters")
    if args.root:
        print(f"the checkpoints stay in {root}: `tensorstore-py ls {root}` lists them, "
              f"`tensorstore-py verify {root}` checks every byte; run this command again to resume "
              f"training from step {mgr.latest_step()}")
    else:
        print(f"the checkpoints were in a temporary folder ({root}), deleted when this script "
              f"exits; to keep them, give a root:\n"
              f"  python examples/checkpoint_jax.py --root file:///tmp/tsp-run/\n"
              f"  tensorstore-py ls file:///tmp/tsp-run/")


if __name__ == "__main__":
    main()
