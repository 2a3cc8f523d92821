"""A process that exits while a checkpoint save streams: the save finishes, or is
abandoned with a warning; the process exits 0 and storage stays sound."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tensorstore_py as tsp
from tensorstore_py.kvstore.versioned.verify import verify

WORKER = str(Path(__file__).with_name("ckpt_exit_worker.py"))
sys.path.insert(0, str(Path(__file__).parent))
from ckpt_exit_worker import expected

T = 60


def _exit_run(kind: str, root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.run(
        [sys.executable, WORKER, kind, f"file://{root}/", *args],
        env=env, capture_output=True, text=True, timeout=120,
    )


def _sound(root: Path) -> None:
    assert verify(tsp.KvStore.open(f"file://{root}/").result(T)).result(T) == []


@pytest.mark.parametrize("kind", ["numpy", "device", "pinned_host"])
def test_exit_right_after_save_commits_the_step(tmp_path: Path, kind: str) -> None:
    if kind != "numpy":
        pytest.importorskip("jax")
    root = tmp_path / "ckpt"
    r = _exit_run(kind, root)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "main returned" in r.stdout
    assert "waiting up to 300.0 s" in r.stderr  # the wait at exit is logged
    mgr = tsp.CheckpointManager(f"file://{root}/")
    assert mgr.all_steps() == [1]
    got = mgr.restore(1)["w"]
    assert got.dtype == np.float32 and got.tobytes() == expected().tobytes()
    _sound(root)


@pytest.mark.parametrize("kind", ["numpy", pytest.param("device", marks=pytest.mark.slow)])
def test_exit_abandons_a_save_past_exit_timeout(tmp_path: Path, kind: str) -> None:
    if kind != "numpy":
        pytest.importorskip("jax")
    root = tmp_path / "ckpt"
    r = _exit_run(kind, root, "0.5", "0.2")  # every store call takes 0.2 s: seconds in all
    assert r.returncode == 0, r.stdout + r.stderr
    assert "checkpoint step 1" in r.stderr and "was abandoned at interpreter exit" in r.stderr, r.stderr
    assert "exit_timeout=0.5 s" in r.stderr
    assert tsp.CheckpointManager(f"file://{root}/").all_steps() == []
    _sound(root)
