"""A training loop with a local checkpoint tier that saves when the job is preempted.

    python examples/checkpoint_preemption.py                       # temporary folders
    python examples/checkpoint_preemption.py --root file:///tmp/run/ --local file:///dev/shm/run/ \\
        --steps 1000000                                            # then: kill -TERM <pid>

Every 5th step is saved to the local tier (a RAM disk is the place for it),
every 20th is also promoted to the persistent root in the background. On
SIGTERM (a scheduler's preemption notice; in a multi-controller JAX job, JAX's
preemption sync point) ``should_save`` says yes at the next step, that step is
saved and persisted, and the loop ends after the promotion is done. A restart
resumes from the newest step either tier holds.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np

import tensorstore_py as tsp


def train_step(state: dict[str, np.ndarray], step: int) -> dict[str, np.ndarray]:
    """A stand-in for a real update: deterministic, so a restore can be checked."""
    return {"w": state["w"] + np.float32(1), "step": np.asarray(step + 1, dtype=np.int64)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", help="persistent root URL (default: a temporary folder)")
    ap.add_argument("--local", help="local tier URL (default: a temporary folder)")
    ap.add_argument("--steps", type=int, default=60, help="steps to train unless preempted")
    args = ap.parse_args()
    tmp = tempfile.TemporaryDirectory()
    root = args.root or f"file://{tmp.name}/persistent/"
    local = args.local or f"file://{tmp.name}/local/"
    n = 1 << 10 if os.environ.get("TSP_EXAMPLES_SMALL") else 1 << 20

    mgr = tsp.CheckpointManager(
        root, local=local, save_interval_steps=5, persist_interval_steps=20, local_max_to_keep=2,
        max_to_keep=3, save_on_preemption=True,
    )
    start = mgr.latest_step()
    if start is None:
        state, start = {"w": np.zeros(n, np.float32), "step": np.asarray(0, dtype=np.int64)}, 0
    else:
        state = mgr.restore(start)
        print(f"resumed from step {start}", flush=True)
    print(f"training (pid {os.getpid()})", flush=True)
    for step in range(start, start + args.steps + 1):
        if mgr.should_save(step):
            mgr.save(step, state)
            print(f"saved step {step}", flush=True)
        if mgr.reached_preemption:
            break
        state = train_step(state, step)
    mgr.close()  # waits for the local save and the promotions in flight
    print(f"stopped at step {step}{' (preempted)' if mgr.reached_preemption else ''}; "
          f"persistent steps {tsp.CheckpointManager(root).all_steps()}, all steps {mgr.all_steps()}", flush=True)
    last = mgr.latest_step()
    assert last is not None
    restored = mgr.restore(last)
    assert int(restored["step"]) == last and np.all(restored["w"] == np.float32(last)), "restore mismatch"
    print(f"step {last} restores exactly", flush=True)


if __name__ == "__main__":
    main()
