"""The local checkpoint tier: saves, promotions, restores from either tier, kill -9 trials."""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import tensorstore_py as tsp
from tensorstore_py.commands import checks
from tensorstore_py.core.future import run_sync

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from tier_worker import expected

WORKER = str(HERE / "tier_worker.py")
EXAMPLE = HERE.parent / "examples" / "checkpoint_preemption.py"


def _tree(step: int) -> dict[str, object]:
    return {"w": np.arange(3000, dtype=np.float32) + step, "b": {"x": np.full((3, 4), step, np.int16)}, "s": step}


def _check(out: dict[str, object], want: dict[str, object]) -> None:
    assert out["s" if "s" in want else "step"] == want["s" if "s" in want else "step"]
    for k in ("w",):
        np.testing.assert_array_equal(out[k], want[k])


def _urls(tmp_path: Path) -> tuple[str, str]:
    return f"file://{tmp_path}/persistent/", f"file://{tmp_path}/local/"


def test_every_save_is_local_and_every_nth_is_promoted(tmp_path: Path) -> None:
    root, local = _urls(tmp_path)
    with tsp.CheckpointManager(root, local=local, local_max_to_keep=2, persist_interval_steps=3) as mgr:
        for s in range(8):
            mgr.save(s, _tree(s))
        mgr.save(8, _tree(8), persist=True)
        mgr.wait_until_finished()
        assert mgr.all_steps() == [0, 3, 6, 7, 8]
    # the root alone: the promoted steps, whole, byte for byte what was saved
    assert tsp.CheckpointManager(root).all_steps() == [0, 3, 6, 8]
    for s in (0, 3, 6, 8):
        out = tsp.checkpoint.restore(root, step=s)
        np.testing.assert_array_equal(out["w"], _tree(s)["w"])
        np.testing.assert_array_equal(out["b"]["x"], _tree(s)["b"]["x"])
        assert out["s"] == s
    assert tsp.CheckpointManager(local).all_steps() == [7, 8]  # local_max_to_keep=2
    assert run_sync(checks.verify(root)).ok and run_sync(checks.verify(local)).ok


def test_restore_prefers_the_newest_step_of_either_tier(tmp_path: Path) -> None:
    root, local = _urls(tmp_path)
    mgr = tsp.CheckpointManager(root, local=local, persist_interval_steps=2)
    for s in range(4):
        mgr.save(s, _tree(s))
    mgr.close()
    out = mgr.restore()
    assert out["s"] == 3  # the local step, newer than the root's 2
    np.testing.assert_array_equal(out["w"], _tree(3)["w"])
    # the local tier is gone (a replaced node): the root's newest step
    shutil.rmtree(tmp_path / "local")
    mgr2 = tsp.CheckpointManager(root, local=local, persist_interval_steps=2)
    assert mgr2.latest_step() == 2
    out = mgr2.restore()
    assert out["s"] == 2
    np.testing.assert_array_equal(out["w"], _tree(2)["w"])


def test_promotion_copies_the_local_commit_after_the_caller_moved_on(tmp_path: Path) -> None:
    """The persistent copy is the local step's bytes (large chunks land as the same
    objects), even though the caller changed its arrays once save() returned."""
    root, local = _urls(tmp_path)
    mgr = tsp.CheckpointManager(root, local=local)
    mgr.save(1, _tree(1)).result()
    assert mgr.all_steps() == [1] and tsp.CheckpointManager(root).all_steps() == []
    tree = {"big": np.arange(1 << 20, dtype=np.float32), "s": 2}
    mgr.save(2, tree, persist=True)
    tree["big"][:] = -1  # the caller moves on at once
    mgr.close()
    assert tsp.CheckpointManager(root).all_steps() == [2]
    np.testing.assert_array_equal(tsp.checkpoint.restore(root)["big"], np.arange(1 << 20, dtype=np.float32))

    def big(d: Path) -> set[bytes]:
        return {p.read_bytes() for p in d.rglob("*") if p.is_file() and p.stat().st_size >= 1 << 20}

    assert big(tmp_path / "persistent") and big(tmp_path / "persistent") <= big(tmp_path / "local")


def test_a_failed_promotion_leaves_nothing_in_the_root_and_is_reported(tmp_path: Path) -> None:
    from tensorstore_py.kvstore.fault import FaultKvStore

    local = f"file://{tmp_path}/local/"
    base = tsp.KvStore.open(f"file://{tmp_path}/persistent/").result()
    faulty = FaultKvStore(base)
    faulty.inject(op="write", key_pattern="commits/*")  # no commit record ever lands
    mgr = tsp.CheckpointManager(faulty, local=local)
    mgr.save(1, _tree(1), persist=True)
    with pytest.raises(tsp.errors.StorageError):
        mgr.wait_until_finished()
    assert mgr.all_steps() == [1]  # still in the local tier
    assert tsp.CheckpointManager(f"file://{tmp_path}/persistent/").all_steps() == []
    mgr.close()


def _kill_trial(tmp_path: Path, rng: random.Random) -> str:
    """One kill -9 of tests/tier_worker.py at a random time; checks both tiers and
    says what was in flight: "local save", "promotion", "both" or "none"."""
    root, local = _urls(tmp_path)
    proc = subprocess.Popen([sys.executable, WORKER, root, local], stdout=subprocess.PIPE, text=True)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        reader = threading.Thread(target=lambda: lines.extend(proc.stdout or ()), daemon=True)
        reader.start()
        time.sleep(rng.uniform(0.05, 1.5))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    reader.join(10)
    # lines printed from two threads may interleave, the last one may be cut by the kill
    done = {(w, int(n)) for w, n in re.findall(r"(saved|local|promoted) (\d+)\b", "".join(lines))}
    saved = [n for w, n in done if w == "saved"]
    local_in_flight = any(("local", n) not in done for n in saved)
    promotion_in_flight = any(("promoted", n) not in done for n in saved if n % 2 == 0)
    newest: list[int | None] = []
    for url, word in ((local, "local"), (root, "promoted")):
        steps = tsp.CheckpointManager(url).all_steps()
        newest.append(steps[-1] if steps else None)
        # durable: every commit reported before the kill is there (or newer ones)
        reported = [n for w, n in done if w == word]
        if reported:
            assert steps and steps[-1] >= max(reported), (url, steps, reported)
        if steps:
            out = tsp.checkpoint.restore(url, step=steps[-1])
            want = expected(steps[-1])
            assert out["step"] == steps[-1]
            np.testing.assert_array_equal(out["w"], want["w"])
            np.testing.assert_array_equal(out["b"]["v"], want["b"]["v"])  # type: ignore[index]
            report = run_sync(checks.verify(url))
            assert report.ok, report.to_json()
    return {(True, True): "both", (True, False): "local save", (False, True): "promotion"}.get(
        (local_in_flight, promotion_in_flight), "none")


def _kill_trials(tmp_path: Path, n: int) -> Counter[str]:
    rng = random.Random(22)
    seen: Counter[str] = Counter()
    for i in range(n):
        d = tmp_path / f"t{i % 4}"  # later trials resume on earlier roots: kills meet older states
        d.mkdir(exist_ok=True)
        seen[_kill_trial(d, rng)] += 1
    print(f"kill -9 trials: {dict(seen)}")
    # the kills met local saves and promotions in flight
    assert seen["local save"] + seen["both"] > 0 and seen["promotion"] + seen["both"] > 0, seen
    return seen


@pytest.mark.timeout(300)
def test_kill9_during_local_saves_and_promotions_leaves_every_tier_consistent(tmp_path: Path) -> None:
    _kill_trials(tmp_path, 6)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_kill9_200_trials(tmp_path: Path) -> None:
    _kill_trials(tmp_path, 200)


@pytest.mark.timeout(180)
def test_sigterm_saves_and_persists_the_current_step(tmp_path: Path) -> None:
    root, local = _urls(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLE), "--root", root, "--local", local, "--steps", "100000000"],
        stdout=subprocess.PIPE, text=True, env=dict(os.environ, TSP_EXAMPLES_SMALL="1"),
    )
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("saved step") and int(line.split()[-1]) >= 25:
            break
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, "".join(lines) + rest
    assert "(preempted)" in rest
    persisted = tsp.CheckpointManager(root).all_steps()
    last = persisted[-1]
    # the step saved on the notice is off both intervals (5, 20) and persisted
    saved = [int(ln.split()[-1]) for ln in (lines + rest.splitlines()) if ln.startswith("saved step")]
    assert last == saved[-1] and last > 25
    out = tsp.checkpoint.restore(root, step=last)
    assert int(out["step"]) == last
    np.testing.assert_array_equal(out["w"], np.full(1 << 10, last, np.float32))
    assert run_sync(checks.verify(root)).ok


def test_cli_ls_shows_each_steps_tiers_and_verify_checks_both(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from tensorstore_py.cli import main

    root, local = _urls(tmp_path)
    with tsp.CheckpointManager(root, local=local, persist_interval_steps=2, local_max_to_keep=2) as mgr:
        for s in range(4):
            mgr.save(s, _tree(s))
    assert main(["ls", root, "--local", local, "--json"]) == 0
    rows = {r["step"]: r["tiers"] for r in json.loads(capsys.readouterr().out)["steps"]}
    assert rows == {0: ["persistent"], 2: ["local", "persistent"], 3: ["local"]}
    assert main(["ls", root, "--local", local]) == 0
    table = capsys.readouterr().out
    assert "local, persistent" in table and "TIERS" in table
    assert main(["verify", root, "--local", local]) == 0
    capsys.readouterr()
    # a wrong chunk in the local tier's step 3 (committed, so only verify finds it)
    kv = tsp.KvStore.open("versioned+" + local).result()
    manifest = json.loads(bytes(kv.read("000000000003/manifest.json").result().value))
    w = next(leaf for leaf in manifest["leaves"] if leaf["path"] == "['w']")
    # small leaves lie in a pack (manifest format 3), others under their chunk key
    wrong = w["packed"]["key"] if "packed" in w else w["key"] + "/c/0"
    kv.write(f"000000000003/{wrong}", b"\0" * 10).result()
    assert main(["verify", root, "--local", local, "--json"]) == 1
    reports = json.loads(capsys.readouterr().out)
    assert [r["ok"] for r in reports] == [True, False]
    assert any(p["key"] == f"000000000003/{wrong}" for p in reports[1]["problems"]), reports[1]


def test_metrics_and_best_step_cover_both_tiers(tmp_path: Path) -> None:
    root, local = _urls(tmp_path)
    with tsp.CheckpointManager(root, local=local, local_max_to_keep=3, best_metric="loss", best_mode="min",
                               persist_interval_steps=2) as mgr:
        for s, loss in ((1, 0.5), (2, 0.9), (3, 0.1)):
            mgr.save(s, _tree(s), metrics={"loss": loss})
        mgr.wait_until_finished()
        assert mgr.metrics(3) == {"loss": 0.1} and mgr.metrics(2) == {"loss": 0.9}
        assert mgr.best_step() == 3


def test_sigterm_handler_chains_the_previous_one_and_is_put_back(tmp_path: Path) -> None:
    root, local = _urls(tmp_path)
    seen: list[int] = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        mine = signal.getsignal(signal.SIGTERM)
        mgr = tsp.CheckpointManager(root, local=local, save_interval_steps=100, save_on_preemption=True)
        assert not mgr.should_save(7) and not mgr.reached_preemption
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)  # the handler runs in the main thread between bytecodes
        assert seen == [signal.SIGTERM] and not mgr.reached_preemption  # nothing saved since
        assert mgr.should_save(7)  # off the interval, saved because of the notice
        mgr.save(7, _tree(7))
        assert mgr.reached_preemption
        mgr.close()
        assert signal.getsignal(signal.SIGTERM) is mine
        assert tsp.CheckpointManager(root).all_steps() == [7]  # persisted
        np.testing.assert_array_equal(tsp.checkpoint.restore(root)["w"], _tree(7)["w"])
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_notice_between_a_save_and_the_check_waits_for_the_next_save(tmp_path: Path) -> None:
    """The loop stops at a promoted step even when SIGTERM lands right after a
    regular (local only) save, before the loop looks at reached_preemption."""
    root, local = _urls(tmp_path)
    before = signal.getsignal(signal.SIGTERM)
    try:
        mgr = tsp.CheckpointManager(root, local=local, save_interval_steps=5, save_on_preemption=True)
        assert mgr.should_save(5)
        mgr.save(5, _tree(5))
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        assert not mgr.reached_preemption  # step 5 is local only: not a place to stop
        assert mgr.should_save(6)
        mgr.save(6, _tree(6))
        assert mgr.reached_preemption
        mgr.close()
        assert tsp.CheckpointManager(root).all_steps() == [6]
        np.testing.assert_array_equal(tsp.checkpoint.restore(root)["w"], _tree(6)["w"])
    finally:
        signal.signal(signal.SIGTERM, before)


_PROMOTING = """
import sys, tensorstore_py as tsp
from tensorstore_py.kvstore.fault import FaultKvStore
sys.path.insert(0, sys.argv[3])
from tier_worker import expected
root = FaultKvStore(tsp.KvStore.open(sys.argv[1]).result())
root.inject(op="write", key_pattern="commits/*", error=None, latency=60.0)  # the promotion hangs
mgr = tsp.CheckpointManager(root, local=sys.argv[2], local_max_to_keep=2)
for step in (1, 2, 3):
    mgr.save(step, expected(step), persist=step > 1).result()
print("local", flush=True)
while mgr._tiers.promotion is not None and not mgr._tiers.promotion.done():
    pass
"""


@pytest.mark.timeout(120)
def test_a_promotion_cut_by_sigkill_is_finished_by_the_restarted_manager(tmp_path: Path) -> None:
    """Steps 2 and 3 (``persist=True``) are committed locally; the process is
    killed while promoting them. The restarted job restores step 3
    from the local tier and promotes it again; step 2 stays local (the job
    resumes from step 3). Local retention keeps step 3 while it is promoted."""
    root, local = _urls(tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", _PROMOTING, root, local, str(HERE)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "local"
        time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert tsp.CheckpointManager(root).all_steps() == []
    with tsp.CheckpointManager(root, local=local, local_max_to_keep=1) as mgr:
        out = mgr.restore()
        assert out["step"] == 3 and mgr._tiers.restored_from == "local"  # type: ignore[union-attr]
        mgr.save(4, expected(4))  # local retention leaves step 3 while it is promoted
        mgr.wait_until_finished()
    assert tsp.CheckpointManager(root).all_steps() == [3]
    got = tsp.checkpoint.restore(root, step=3)
    np.testing.assert_array_equal(got["w"], expected(3)["w"])
    np.testing.assert_array_equal(got["b"]["v"], expected(3)["b"]["v"])
    assert run_sync(checks.verify(root)).ok


def test_restore_waits_for_the_local_save_in_flight(tmp_path: Path) -> None:
    """A restore right after ``save()`` returned, while the local commit is still
    being written, reads that step (each process lists its own save in flight
    once it landed, so the processes agree on it and none of its parts is
    taken for an abandoned one)."""
    from tensorstore_py.kvstore.fault import FaultKvStore

    root, _ = _urls(tmp_path)
    local = FaultKvStore(tsp.KvStore.open(f"file://{tmp_path}/local/").result())
    with tsp.CheckpointManager(root, local=local) as mgr:
        mgr.save(1, _tree(1))
        mgr.wait_until_finished()
        local.inject(op="write", key_pattern="commits/*", error=None, latency=1.0)
        mgr.save(2, _tree(2))
        out = mgr.restore()
        _check(out, _tree(2))
        assert mgr._tiers.local_steps() == [1, 2]  # type: ignore[union-attr]


def test_a_promoted_step_deleted_at_the_root_is_not_promoted_again_by_a_restore(tmp_path: Path) -> None:
    """Step 1 is promoted, then deleted at the root by another manager (one
    without the local tier): a restore that reads it from the local tier does
    not publish it at the root again."""
    root, local = _urls(tmp_path)
    with tsp.CheckpointManager(root, local=local) as mgr:
        mgr.save(1, _tree(1), persist=True)
        mgr.wait_until_finished()
    assert tsp.CheckpointManager(root).all_steps() == [1]
    tsp.CheckpointManager(root).delete(1)
    with tsp.CheckpointManager(root, local=local) as mgr:
        _check(mgr.restore(), _tree(1))
        mgr.wait_until_finished()
    assert tsp.CheckpointManager(root).all_steps() == []
