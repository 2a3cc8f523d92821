"""Checkpoints of a numpy pytree, no JAX needed.

    python examples/checkpoint_numpy.py                    # a temporary folder
    python examples/checkpoint_numpy.py --root file:///tmp/np-run/

Saves a few steps of a small "training state" with a CheckpointManager that
keeps the 2 best steps by a metric (plus the newest), lists what is stored,
restores the best step as numpy and into a target tree (casting a leaf to the
target's dtype only when asked to), and shows that every step is one version of
the root's versioned store.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import ml_dtypes
import numpy as np

import tensorstore_py as tsp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", help="checkpoint root URL (default: a temporary folder)")
    args = ap.parse_args()
    tmp = tempfile.TemporaryDirectory()
    root = args.root or f"file://{tmp.name}/ckpt/"
    rng = np.random.default_rng(0)
    state = {
        "params": {
            "embed": rng.standard_normal((1000, 64)).astype(ml_dtypes.bfloat16),
            "dense": {"kernel": rng.standard_normal((64, 64)).astype(np.float32),
                      "bias": np.zeros(64, np.float32)},
        },
        "opt": (np.zeros((1000, 64), np.float32), np.float32(0.9)),
        "step": 0,
    }
    mgr = tsp.CheckpointManager(root, max_to_keep=2, best_metric="loss", best_mode="min")
    losses = [3.0, 1.2, 2.0, 0.7, 1.5]
    for i, loss in enumerate(losses):
        step = (i + 1) * 100
        state["step"] = step
        state["params"]["dense"]["kernel"] += 0.01
        t0 = time.perf_counter()
        mgr.save(step, state, metrics={"loss": loss})
        blocked = time.perf_counter() - t0
        mgr.wait_until_finished()
        print(f"step {step}: loss {loss}  (save blocked {blocked * 1e3:.1f} ms, "
              f"committed after {(time.perf_counter() - t0) * 1e3:.1f} ms)")
    print("kept steps:", mgr.all_steps(), " best:", mgr.best_step(), " latest:", mgr.latest_step())

    best = mgr.restore(mgr.best_step())  # no target: the stored tree, numpy leaves
    print("restored step", best["step"], "embed", best["params"]["embed"].dtype,
          best["params"]["embed"].shape, "opt", type(best["opt"]).__name__)
    # only what the target asks for; its float64 differs from the saved float32, so the
    # conversion is asked for (without cast=True: InvalidArgumentError, nothing read)
    target = {"params": {"dense": {"kernel": np.zeros((64, 64), np.float64)}}}
    try:
        mgr.restore(mgr.latest_step(), target=target)
        raise SystemExit("a target of another dtype was cast silently")
    except tsp.InvalidArgumentError as e:
        print("without cast=True:", str(e).split(";")[0])
    part = mgr.restore(mgr.latest_step(), target=target, cast=True)
    print("kernel restored as", part["params"]["dense"]["kernel"].dtype)
    np.testing.assert_allclose(part["params"]["dense"]["kernel"], state["params"]["dense"]["kernel"])

    kv = tsp.KvStore.open({"driver": "versioned", "base": root}).result()
    for v in kv.versions().result():
        print(f"  version {v.version}: {v.message}")
    print("OK")


if __name__ == "__main__":
    main()
