"""kill -9 during incremental checkpoint saves (issue 22, item 4).

A real process saves steps in which one leaf in ten changes (the other nine
are linked to the previous step's chunks), with ``max_to_keep=3``, and is
killed with SIGKILL: at its k-th base-store write (before or after that write
lands, through the fault wrapper) or after a random delay. The next run
resumes after the newest step. After every kill, the newest committed step
and every older kept step restore exactly and ``verify`` (digests included)
passes; at the end a full collection with grace 0 deletes the killed saves'
leftovers and never a chunk a kept step references (every kept step restores
exactly again). The default run has a few seeded trials; ``-m slow`` runs 40.
"""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from test_checkpoint_incremental import tree_at

import tensorstore_py as tsp
from tensorstore_py.commands import checks, inspect
from tensorstore_py.core.future import run_sync
from tensorstore_py.kvstore.file import FileKvStore
from tensorstore_py.kvstore.versioned import VersionedKvStore

T = 120
#: base-store writes of one incremental save with retention: the changed leaf's
#: data object, packed small values, index nodes, the commit record, the hint,
#: the retention commit, the reclaim watermark, lease refreshes
WRITES_PER_SAVE = 14

_CHILD = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, sys.argv[1])
    from test_checkpoint_incremental import tree_at
    import tensorstore_py as tsp
    from tensorstore_py.kvstore.fault import FaultKvStore
    from tensorstore_py.kvstore.file import FileKvStore

    root, kill_at, after, saves = sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1", int(sys.argv[5])

    class SigKill(BaseException):
        def __init__(self, *args):
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)

    base = FaultKvStore(FileKvStore(path=root))
    mgr = tsp.CheckpointManager(base, max_to_keep=3)
    step = (mgr.latest_step() or 0) + 1
    mgr.save(step, tree_at(step)).result(120)  # a previous step to link to
    if kill_at:
        base.inject(op="write", nth=kill_at, error=SigKill, after_effect=after)
    print("ready", flush=True)
    for step in range(step + 1, step + 1 + saves):
        mgr.save(step, tree_at(step)).result(120)
        print("saved", step, flush=True)
""")


def _run_child(root: Path, rng: random.Random) -> tuple[int, str]:
    mode = rng.choice(["before", "after", "timed"])
    kill_at = 0 if mode == "timed" else rng.randint(1, 2 * WRITES_PER_SAVE)
    tests = str(Path(__file__).parent)
    p = subprocess.Popen(
        [sys.executable, "-c", _CHILD, tests, str(root), str(kill_at), "1" if mode == "after" else "0",
         "3" if mode != "timed" else "1000"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    assert p.stdout is not None
    lines = []
    for line in p.stdout:
        lines.append(line)
        if line.startswith("ready"):
            break
    if mode == "timed":
        try:
            p.wait(timeout=rng.uniform(0.05, 0.6))
        except subprocess.TimeoutExpired:
            p.kill()  # SIGKILL
    rest, _ = p.communicate(timeout=T)
    return p.wait(), f"{mode} kill_at={kill_at}\n" + "".join(lines) + rest


def _check_kept_steps(url: str, where: str) -> list[int]:
    mgr = tsp.CheckpointManager(url)
    steps = mgr.all_steps()
    assert steps, where
    for s in steps:
        got = mgr.restore(s)
        for name, want in tree_at(s).items():
            assert np.array_equal(got[name], want), f"{where}: step {s} leaf {name} differs"
    report = run_sync(checks.verify(url))
    assert report.ok, f"{where}: " + "\n".join(p.message for p in report.problems)
    return steps


def _trials(tmp_path: Path, trials: int, seed0: int) -> dict[str, int]:
    root = tmp_path / "run"
    url = f"file://{root}/"
    outcomes = {"killed": 0, "finished": 0}
    newest_seen = 0
    for t in range(trials):
        rng = random.Random(seed0 + t)
        code, log = _run_child(root, rng)
        assert code in (0, -9), f"trial {t}: child exited with {code}:\n{log[-3000:]}"
        outcomes["killed" if code == -9 else "finished"] += 1
        steps = _check_kept_steps(url, f"trial {t} ({log.splitlines()[0]})")
        # max_to_keep=3, plus the one step a kill between a commit and its
        # retention leaves (the next save's retention deletes it)
        assert steps[-1] >= newest_seen and len(steps) <= 4, (steps, newest_seen)
        newest_seen = steps[-1]
    # a full collection with grace 0 takes the killed saves' leftovers, and no
    # chunk a kept step references
    kv = VersionedKvStore(FileKvStore(path=str(root)))
    kv.gc(grace=0, dry_run=False, reclaim_deleted=True).result(T)
    steps = _check_kept_steps(url, "after gc")
    audit = run_sync(checks.verify(url))
    assert audit.ok
    # the kept steps share chunks: each later step added about one leaf in ten
    rows = {r["step"]: r for r in run_sync(inspect.ls(url))["steps"]}
    for s in steps[1:]:
        assert rows[s]["bytes_added"] <= 0.12 * rows[steps[0]]["bytes_added"] + (64 << 10), rows[s]
    outcomes["steps"] = steps[-1]
    return outcomes


def test_kill_during_incremental_saves(tmp_path: Path) -> None:
    out = _trials(tmp_path, 4, seed0=2200)
    print(out)
    assert out["killed"] >= 2, out


@pytest.mark.slow
def test_kill_during_incremental_saves_many_times(tmp_path: Path) -> None:
    out = _trials(tmp_path, 40, seed0=22000)
    print(out)
    assert out["killed"] >= 25, out
