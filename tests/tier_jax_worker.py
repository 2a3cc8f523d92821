"""One process of a two-process JAX job with a local checkpoint tier
(run by tests/test_checkpoint_tiers_jax.py).

Usage: python tier_jax_worker.py SCENARIO PROCESS_ID NUM_PROCESSES PORT ROOT LOCAL OUT_JSON

SCENARIO "save": step 1 saved and promoted, step 2 saved to the local tier only.
SCENARIO "preempt": train until JAX's preemption notice (a SIGTERM to any
process), save that step on every process and stop.
SCENARIO "resume": restore the newest step every process can read, then train on
from it, saving every step that ``should_save`` asks for, up to step 2: the
leaf "n" of a step saved here is 100 + the step.
SCENARIO "local_fails": step 1 is saved with persist=True, process 1's local
commit fails (its local tier refuses commit records); OUT_JSON says how each
process's wait_until_finished ended and how long it took.
SCENARIO "exists0": process 0 holds its part of step 1 already; both processes
save step 1 with persist=True: OUT_JSON says how each process's save and
wait_until_finished ended and how long they took.
SCENARIO "restore": restore the newest step every process can read, with the
save's sharding; check every shard. Results go to OUT_JSON.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from jax_worker import check_tree, make_tree, target


def main() -> None:
    scenario, pid, nproc, port, root, local, out_path = sys.argv[1:8]
    import jax

    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=int(nproc),
                               process_id=int(pid))
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    import tensorstore_py as tsp

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    if scenario == "local_fails" and pid == "1":
        from tensorstore_py.kvstore.fault import FaultKvStore

        faulty = FaultKvStore(tsp.KvStore.open(local).result())
        faulty.inject(op="write", key_pattern="*commits/*")
        mgr = tsp.CheckpointManager(root, local=faulty, local_max_to_keep=3)
    else:
        mgr = tsp.CheckpointManager(root, local=local, local_max_to_keep=3)
    if scenario in ("local_fails", "exists0"):
        mgr.options = dataclasses.replace(mgr.options, commit_timeout=90.0)
    report: dict[str, Any] = {"process": int(pid)}
    if scenario == "save":
        for step in (1, 2):
            mgr.save(step, {"t": make_tree(mesh), "n": np.array([step])}, persist=step == 1)
        mgr.close()
        report["local"] = mgr._tiers.local_steps()  # type: ignore[union-attr]
    elif scenario == "preempt":
        mgr.close()
        mgr = tsp.CheckpointManager(root, local=local, save_interval_steps=1000, save_on_preemption=True)
        tree = {"t": make_tree(mesh), "n": np.array([0])}
        print("training", flush=True)
        for step in range(1, 100000):
            if mgr.should_save(step):
                tree["n"] = np.array([step])
                mgr.save(step, tree)
                report["saved"] = step
            if mgr.reached_preemption:
                break
            time.sleep(0.02)
        mgr.close()  # the promotion ends before the process does
    elif scenario == "local_fails":
        start = time.monotonic()
        mgr.save(1, {"t": make_tree(mesh), "n": np.array([1])}, persist=True)
        try:
            mgr.wait_until_finished()
            report["error"] = None
        except Exception as e:
            report["error"] = type(e).__name__
        report["seconds"] = time.monotonic() - start
        mgr.close()
    elif scenario == "exists0":
        from tensorstore_py.checkpoint import SaveOptions
        from tensorstore_py.checkpoint.tiers import LocalTier

        if pid == "0":
            LocalTier(local, process_index=0, process_count=2).save(
                1, {"n": np.array([0])}, metrics={}, options=SaveOptions()).result()
        start = time.monotonic()
        report["errors"] = []
        try:
            mgr.save(1, {"t": make_tree(mesh), "n": np.array([1])}, persist=True)
        except Exception as e:
            report["errors"].append(type(e).__name__)
        try:
            mgr.wait_until_finished()
        except Exception as e:
            report["errors"].append(type(e).__name__)
        report["seconds"] = time.monotonic() - start
        mgr.close()
    elif scenario == "resume":
        specs = {"w": P("a", "b"), "e": P(None, "b"), "r": P(), "odd": P("b", None)}
        like = {"t": target(make_tree(mesh), mesh, specs), "n": np.zeros(1, np.int64)}
        out = mgr.restore(target=like)
        report["from"] = int(out["n"][0])
        report["saved"] = []
        for step in range(report["from"] + 1, 3):
            if mgr.should_save(step):
                mgr.save(step, {"t": make_tree(mesh), "n": np.array([100 + step])})
                report["saved"].append(step)
        mgr.close()
    else:
        specs = {"w": P("a", "b"), "e": P(None, "b"), "r": P(), "odd": P("b", None)}
        like = {"t": target(make_tree(mesh), mesh, specs), "n": np.zeros(1, np.int64)}
        out = mgr.restore(target=like)
        check_tree(out["t"], "restore")
        report["step"] = int(out["n"][0])
        report["tier"] = mgr._tiers.restored_from  # type: ignore[union-attr]
        mgr.close()
    Path(out_path).write_text(json.dumps(report))


if __name__ == "__main__":
    main()
