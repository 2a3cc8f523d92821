"""A two-process JAX job with a local checkpoint tier: 2 processes x 4 CPU devices."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("jax")

import tensorstore_py as tsp
from tensorstore_py.commands import checks
from tensorstore_py.core.future import run_sync

WORKER = str(Path(__file__).with_name("tier_jax_worker.py"))
pytestmark = pytest.mark.timeout(300)


def _launch(scenario: str, root: str, local: str, tmp: Path) -> tuple[list[subprocess.Popen[bytes]], list[Path]]:
    from test_jax_checkpoint import _env, _free_port

    port = _free_port()
    outs = [tmp / f"{scenario}-{i}.json" for i in range(2)]
    procs = [
        subprocess.Popen([sys.executable, WORKER, scenario, str(i), "2", str(port), root, local, str(outs[i])],
                         env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for i in range(2)
    ]
    return procs, outs


def _run(scenario: str, root: str, local: str, tmp: Path) -> list[dict]:
    procs, outs = _launch(scenario, root, local, tmp)
    logs = [p.communicate(timeout=150)[0].decode(errors="replace") for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, f"worker failed ({p.returncode}):\n{log[-4000:]}"
    return [json.loads(o.read_text()) for o in outs]


def test_two_processes_restore_from_local_parts_and_the_persistent_copy(tmp_path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    root, local = f"file://{tmp_path}/persistent/", f"file://{tmp_path}/local/"
    saved = _run("save", root, local, tmp_path)
    assert [r["local"] for r in saved] == [[1, 2], [1, 2]]
    assert tsp.CheckpointManager(root).all_steps() == [1]  # step 2 was not promoted
    for url in (root, f"{local}process_0/", f"{local}process_1/"):
        assert run_sync(checks.verify(url)).ok, url
    # every process holds step 2 locally: the newest, read locally
    got = _run("restore", root, local, tmp_path)
    assert [(r["step"], r["tier"]) for r in got] == [(2, "local"), (2, "local")]
    # process 1's node was replaced: step 2 is incomplete locally; step 1 is
    # read locally by process 0 and from the persistent copy by process 1
    shutil.rmtree(tmp_path / "local" / "process_1")
    got = _run("restore", root, local, tmp_path)
    assert [(r["step"], r["tier"]) for r in got] == [(1, "local"), (1, "persistent")]
    # every local tier gone: the persistent tier alone restores exactly
    shutil.rmtree(tmp_path / "local")
    got = _run("restore", root, local, tmp_path)
    assert [(r["step"], r["tier"]) for r in got] == [(1, "persistent"), (1, "persistent")]




def test_jax_preemption_notice_saves_the_same_step_on_every_process(tmp_path: Path) -> None:
    """SIGTERM to one process of a two-process job: JAX's preemption service tells
    both, both save the same step, and it is persisted whole."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    root, local = f"file://{tmp_path}/persistent/", f"file://{tmp_path}/local/"
    procs, outs = _launch("preempt", root, local, tmp_path)
    try:
        for p in procs:
            assert p.stdout is not None
            while b"training" not in p.stdout.readline():
                assert p.poll() is None, "a worker ended before training"
        time.sleep(1.0)
        procs[1].send_signal(signal.SIGTERM)
        logs = [p.communicate(timeout=150)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, f"worker failed ({p.returncode}):\n{log[-4000:]}"
    saved = [json.loads(o.read_text())["saved"] for o in outs]
    assert saved[0] == saved[1] and saved[0] > 1
    assert tsp.CheckpointManager(root).all_steps() == [saved[0]]
    assert run_sync(checks.verify(root)).ok
    got = _run("restore", root, local, tmp_path)
    assert [(r["step"], r["tier"]) for r in got] == [(saved[0], "local"), (saved[0], "local")]


def test_a_job_resumed_from_an_older_step_after_losing_a_node_saves_and_restores_its_own_steps(
    tmp_path: Path,
) -> None:
    """Process 1's node is replaced: the job resumes from the persistent step 1
    while process 0 still holds its part of step 2 from before. The resumed job
    saves step 2 again on both processes, and the next restore reads that save
    on both (never process 0's part of the abandoned step 2 beside process 1's
    new one)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    root, local = f"file://{tmp_path}/persistent/", f"file://{tmp_path}/local/"
    _run("save", root, local, tmp_path)
    shutil.rmtree(tmp_path / "local" / "process_1")
    resumed = _run("resume", root, local, tmp_path)
    assert [(r["from"], r["saved"]) for r in resumed] == [(1, [2]), (1, [2])]
    got = _run("restore", root, local, tmp_path)
    assert [(r["step"], r["tier"]) for r in got] == [(102, "local"), (102, "local")]
    for url in (root, f"{local}process_0/", f"{local}process_1/"):
        assert run_sync(checks.verify(url)).ok, url


def test_a_local_save_failing_on_one_process_fails_the_promotion_on_every_process_at_once(
    tmp_path: Path,
) -> None:
    """Process 1's local commit of a step to be promoted fails: process 0, whose
    local commit landed, does not wait ``commit_timeout`` (90 s here) for process 1's
    part of the promotion (a preemption save's promotion queued behind it would
    miss the scheduler's grace period): it fails within seconds, and the root
    holds nothing."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    root, local = f"file://{tmp_path}/persistent/", f"file://{tmp_path}/local/"
    got = _run("local_fails", root, local, tmp_path)
    assert got[0]["error"] == "ParticipantFailedError" and got[1]["error"] is not None, got
    assert got[0]["seconds"] < 45, got
    assert tsp.CheckpointManager(root).all_steps() == []


def test_a_local_save_refused_on_one_process_fails_the_promotion_on_every_process_at_once(
    tmp_path: Path,
) -> None:
    """Process 0's ``save`` of a step to be promoted raises at once (its part of
    the step exists): process 1, whose local commit landed, does not wait
    ``commit_timeout`` (90 s here) for process 0's part of the promotion."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    root, local = f"file://{tmp_path}/persistent/", f"file://{tmp_path}/local/"
    got = _run("exists0", root, local, tmp_path)
    assert [r["errors"] for r in got] == [["ConditionFailedError"], ["ParticipantFailedError"]], got
    assert got[1]["seconds"] < 45, got
    assert tsp.CheckpointManager(root).all_steps() == []
