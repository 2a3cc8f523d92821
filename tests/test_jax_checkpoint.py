"""Real multi-process JAX checkpoints: 2 processes x 4 CPU devices on 127.0.0.1.

Each scenario runs tests/jax_worker.py in fresh processes joined by
``jax.distributed.initialize`` (the coordinator on a free loopback port).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("jax")

import tensorstore_py as tsp
from tensorstore_py.kvstore.file import FileKvStore
from tensorstore_py.kvstore.versioned import VersionedKvStore

WORKER = str(Path(__file__).with_name("jax_worker.py"))
pytestmark = pytest.mark.timeout(180)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _launch(scenario: str, n: int, root: str, tmp: Path) -> tuple[list[subprocess.Popen[bytes]], list[Path]]:
    port = _free_port()
    outs = [tmp / f"{scenario}-{i}.json" for i in range(n)]
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, scenario, str(i), str(n), str(port), root, str(outs[i])],
            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        for i in range(n)
    ]
    return procs, outs


def _run(scenario: str, n: int, root: str, tmp: Path, timeout: float = 120) -> list[dict]:
    procs, outs = _launch(scenario, n, root, tmp)
    logs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        logs.append(out.decode(errors="replace"))
    for p, log in zip(procs, logs):
        assert p.returncode == 0, f"worker failed ({p.returncode}):\n{log[-4000:]}"
    return [json.loads(o.read_text()) for o in outs]


def _file_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def test_two_processes_save_and_restore_any_sharding(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    reports = _run("save_restore", 2, f"file://{root}/", tmp_path)
    for r in reports:
        assert r["devices"] == 8
        assert r["steps"] == [2, 3]  # max_to_keep=2 after 3 saves
        read, need = r["same"]
        assert read <= 1.1 * need, r  # aligned: nothing read twice or in excess
        # fully replicated: every byte once per process, not once per device
        assert r["replicated"][0] == r["replicated"][1]
    # each process needs half of "w" (sharded over both mesh axes) and all of the
    # leaves sharded only within a process or replicated, plus the numpy leaf
    per_process = 16 * 8 * 4 // 2 + 8 * 16 * 2 + 6 * 4 + 12 * 6 * 4 + 9 * 8 + 4
    assert [r["same"][1] for r in reports] == [per_process, per_process]
    # single process, 4 devices, different mesh; and numpy restore without a target
    single = _run("restore_single", 1, f"file://{root}/", tmp_path)[0]
    assert single["steps"] == [2, 3]


def test_two_processes_retention_frees_every_process_share(tmp_path: Path) -> None:
    # the twin of test_checkpoint.py::test_manager_retention_frees_space_now
    root = tmp_path / "ckpt"
    size = 8 << 20
    reports = _run("retention_space", 2, f"file://{root}/", tmp_path)
    assert [r["steps"] for r in reports] == [[20, 30], [20, 30]]
    used = _file_bytes(root)
    assert 2 * size <= used < 2 * size + (256 << 10), used  # 2 steps + small metadata
    g = np.arange(1024 * 2048, dtype=np.float32).reshape(1024, 2048)
    mgr = tsp.CheckpointManager(f"file://{root}/")
    np.testing.assert_array_equal(mgr.restore(20)["w"], g + 20)


def test_two_processes_save_incrementally_each_its_own_shards(tmp_path: Path) -> None:
    # a frozen backbone (8 MiB) and an adapter (512 KiB), both split over the two
    # processes: step 2 writes the adapter only, each process linking its own
    # backbone shards to step 1's
    root = tmp_path / "ckpt"
    reports = _run("incremental", 2, f"file://{root}/", tmp_path)
    for r in reports:
        assert r["restored"], r
    full, after = reports[0]["used"]
    assert full >= 8 << 20
    assert after - full <= 0.12 * full, (full, after)
    kv = VersionedKvStore(FileKvStore(path=str(root)))
    digests = kv.list("000000000002/digests/").result(60)
    assert digests == ["000000000002/digests/000000.json", "000000000002/digests/000001.json"]
    one = {e.key[13:]: e.object for e in kv.entries("000000000001/a/").result(60) if "/c/" in e.key}
    two = {e.key[13:]: e.object for e in kv.entries("000000000002/a/").result(60) if "/c/" in e.key}
    keys = json.loads(bytes(kv.read("000000000002/manifest.json").result(60).value))["leaves"]
    backbone = next(e["key"] for e in keys if e["path"] == "['backbone']")
    linked = [k for k in two if k.startswith(backbone + "/") and two[k] == one.get(k)]
    assert linked and len(linked) == len([k for k in two if k.startswith(backbone + "/")])
    assert not [k for k in two if not k.startswith(backbone + "/") and two[k] == one.get(k)]


def test_kill_one_process_mid_save_never_publishes(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    procs, outs = _launch("kill", 2, f"file://{root}/", tmp_path)
    marker = Path(str(outs[1]) + ".writing")
    deadline = time.time() + 90
    while not marker.exists():
        if time.time() > deadline or procs[1].poll() is not None:
            for p in procs:
                p.kill()
            pytest.fail("process 1 never started writing step 2:\n"
                        + (procs[1].communicate()[0] or b"").decode(errors="replace")[-3000:])
        time.sleep(0.02)
    os.kill(procs[1].pid, signal.SIGKILL)
    procs[1].wait()
    try:
        procs[0].communicate(timeout=60)
    except subprocess.TimeoutExpired:
        procs[0].kill()
        procs[0].communicate()
    mgr = tsp.CheckpointManager(f"file://{root}/")
    assert mgr.all_steps() == [1]
    assert mgr.latest_step() == 1
    out = mgr.restore()
    assert np.array_equal(out["params"]["w"], np.arange(128, dtype=np.float32).reshape(16, 8))
    assert out["step"] == 7
    if outs[0].exists():
        assert json.loads(outs[0].read_text())["step2"].startswith("failed")


def test_coordinator_failure_releases_the_other_process_quickly(tmp_path: Path) -> None:
    reports = _run("fail0", 2, f"file://{tmp_path / 'ckpt'}/", tmp_path)
    for r in reports:
        assert r["result"].startswith("StorageError"), r
        assert "injected failure" in r["result"], r
        assert r["seconds"] < 30, r  # not the 60 s commit timeout
        assert r["steps"] == []


def test_other_process_failure_releases_process_0_quickly(tmp_path: Path) -> None:
    reports = _run("fail1", 2, f"file://{tmp_path / 'ckpt'}/", tmp_path)
    r0, r1 = reports
    assert r1["result"].startswith("StorageError") and "injected failure" in r1["result"], r1
    # process 0 fails with process 1's error, typed, long before the 60 s commit timeout
    assert r0["result"].startswith("ParticipantFailedError"), r0
    assert "process 1 of 2" in r0["result"] and "StorageError" in r0["result"], r0
    assert "injected failure" in r0["result"], r0
    for r in reports:
        assert r["seconds"] < 30, r
        assert r["steps"] == []


@pytest.mark.parametrize("failing", [1, 0])
def test_staging_failure_on_one_process_leaves_later_saves_working(tmp_path: Path, failing: int) -> None:
    reports = _run(f"stage_fail{failing}", 2, f"file://{tmp_path / 'ckpt'}/", tmp_path)
    bad, other = reports[failing], reports[1 - failing]
    assert bad["step1"].startswith("JaxRuntimeError: RESOURCE_EXHAUSTED"), bad
    assert other["step1"].startswith("ParticipantFailedError"), other
    assert f"process {failing} of 2" in other["step1"] and "RESOURCE_EXHAUSTED" in other["step1"], other
    assert other["step1_s"] < 10, other  # not the 20 s commit timeout
    for r in reports:
        assert r["step2"] == "committed", r
        assert r["step2_s"] < 10, r
        assert r["steps"] == [2], r
        assert r["restored"] is True, r


@pytest.mark.slow
def test_exit_with_a_save_in_flight_abandons_it_on_every_process(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    t = time.monotonic()
    procs, outs = _launch("exit_abandon", 2, f"file://{root}/", tmp_path)
    logs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        logs.append(out.decode(errors="replace"))
    elapsed = time.monotonic() - t
    for p, log in zip(procs, logs):
        assert p.returncode == 0, f"worker failed ({p.returncode}):\n{log[-4000:]}"
        # abandoned here, or failed because the other process abandoned it first
        assert "checkpoint step 1" in log, log[-4000:]
        assert ("was abandoned at interpreter exit" in log
                or ("failed while the interpreter exited" in log and "abandoned" in log)), log[-4000:]
    assert elapsed < 45, elapsed  # nobody waited out the 60 s commit timeout
    assert tsp.CheckpointManager(f"file://{root}/").all_steps() == []
    from tensorstore_py.kvstore.versioned.verify import verify

    assert verify(tsp.KvStore.open(f"file://{root}/").result(60)).result(60) == []


_ABANDON_WAIT = """
import sys, threading, time
import jax
jax.distributed.initialize(coordinator_address="127.0.0.1:" + sys.argv[1], num_processes=1, process_id=0)
from jax._src import distributed
from tensorstore_py.checkpoint import coordination
c = coordination.JaxCoordinator(distributed.global_state.client, 0, 1)
threading.Timer(0.5, coordination.ABANDONED.set).start()
t = time.monotonic()
try:
    c.wait_for("never-published", 60.0)
except Exception as e:
    print(type(e).__name__, e)
print("waited", time.monotonic() - t)
"""


def test_coordination_wait_ends_when_saves_are_abandoned_at_exit() -> None:
    # a process whose save is abandoned at exit while it waits for its peers
    # must not hold the exit for the whole commit_timeout
    r = subprocess.run([sys.executable, "-c", _ABANDON_WAIT, str(_free_port())], env=_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "DeadlineExceededError" in r.stdout and "abandoned at interpreter exit" in r.stdout, r.stdout
    assert float(r.stdout.split("waited")[1]) < 5, r.stdout
