"""Retention against readers and other managers (issue 10, items 5 and 6).

A reader of a kept step keeps reading while the trainer's retention deletes
older steps (its lease keeps the version it pinned); two managers retaining on
one root at once both report their committed saves as saved.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tensorstore_py as tsp
from tensorstore_py.checkpoint import SaveOptions
from tensorstore_py.kvstore.base import KvStore
from tensorstore_py.kvstore.fault import FaultKvStore
from tensorstore_py.kvstore.file import FileKvStore
from tensorstore_py.kvstore.versioned.verify import verify

T = 120

_READER = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    import tensorstore_py as tsp
    root, ready, go, out = sys.argv[1:5]
    a = tsp.checkpoint.open_array(root, "['w']", step=2).result(60)
    first = a[0:2].read().result(60)          # one chunk: one index leaf of the step
    open(ready, "w").close()
    while not os.path.exists(go):
        time.sleep(0.02)
    try:
        np.save(out, a[:].read().result(60))  # every chunk: every index leaf of the version
    except Exception as e:
        print(f"{type(e).__name__}: {e}")
        sys.exit(3)
""")


def _tree(step: int) -> dict[str, Any]:
    # 2048 x 512 float32 in 4 KiB chunks: 1024 chunk keys per step, so a step's
    # index spans several leaves and a reader loads them as it goes
    return {"w": np.arange(2048 * 512, dtype=np.float32).reshape(2048, 512) + step}


def _file_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def test_a_reader_of_a_kept_step_keeps_reading_through_retention(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    url = f"file://{root}/"
    opts = SaveOptions(target_chunk_bytes=4 << 10)
    mgr = tsp.CheckpointManager(url, max_to_keep=2, options=opts)
    for step in (1, 2):
        mgr.save(step, _tree(step)).result(T)
    ready, go, out = tmp_path / "ready", tmp_path / "go", tmp_path / "out.npy"
    reader = subprocess.Popen([sys.executable, "-c", _READER, url, str(ready), str(go), str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + T
        while not ready.exists():
            assert reader.poll() is None and time.time() < deadline, reader.communicate()[0]
            time.sleep(0.02)
        mgr.save(3, _tree(3)).result(T)  # retention: step 1 goes, every older version is retired
        assert mgr.all_steps() == [2, 3]
        go.touch()
        log, _ = reader.communicate(timeout=T)
    finally:
        if reader.poll() is None:
            reader.kill()
    assert reader.returncode == 0, log.decode(errors="replace")
    np.testing.assert_array_equal(np.load(out), _tree(2)["w"])
    # the reader is gone (its lease with it): the next retention frees what it held
    mgr.save(4, _tree(4)).result(T)
    assert mgr.all_steps() == [3, 4]
    step_bytes = 2048 * 512 * 4
    assert _file_bytes(root) < 2 * step_bytes + (512 << 10), _file_bytes(root)
    np.testing.assert_array_equal(mgr.restore(3)["w"], _tree(3)["w"])
    assert verify(tsp.KvStore.open(url).result(T)).result(T) == []


class _GatedCommits(FaultKvStore):
    """Holds the ``nth`` commit-record write made after :meth:`arm` until
    :attr:`release` is set (another process's manager, paused mid-retention)."""

    def __init__(self, base: KvStore, seed: int) -> None:
        super().__init__(base, seed=seed)  # the seed makes its spec, and so its root, its own
        self.nth = 0
        self.count = 0
        self.reached = threading.Event()
        self.release = threading.Event()

    def arm(self, nth: int) -> None:
        self.nth, self.count = nth, 0

    async def _write(self, key: str, value: Any, if_equal: Any) -> Any:
        if key.startswith("commits/") and self.nth:
            self.count += 1
            if self.count == self.nth:
                self.reached.set()
                while not self.release.is_set():
                    await asyncio.sleep(0.01)
        return await super()._write(key, value, if_equal)


def test_two_managers_retaining_at_once_both_report_their_saves(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    file = FileKvStore(path=str(tmp_path / "ckpt"))
    x = np.arange(1 << 16, dtype=np.float32)
    tsp.checkpoint.save(file, {"x": x + 1}, step=1).result(T)
    gated = _GatedCommits(file, seed=1)
    a = tsp.CheckpointManager(gated, max_to_keep=1)
    b = tsp.CheckpointManager(FaultKvStore(file, seed=2), max_to_keep=1)
    gated.arm(2)  # a's save commits; its retention's delete commit waits
    fut = a.save(2, {"x": x + 2})
    assert gated.reached.wait(T)
    assert b.save(3, {"x": x + 3}).result(T).step == 3  # b deletes steps 1 and 2
    gated.release.set()
    with caplog.at_level(logging.INFO, logger="tensorstore_py.checkpoint"):
        info = fut.result(T)  # a's retention lost the race: its committed save still succeeds
    assert info is not None and info.step == 2 and info.version is not None
    assert a.all_steps() == b.all_steps() == [3]
    np.testing.assert_array_equal(a.restore()["x"], x + 3)
    assert verify(file).result(T) == []
    # later saves on either manager keep retaining normally
    a.save(4, {"x": x + 4}).result(T)
    assert b.all_steps() == [4]


def test_retention_failure_is_logged_and_the_next_save_catches_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tensorstore_py.checkpoint.storage import StepStore
    from tensorstore_py.errors import StorageError

    mgr = tsp.CheckpointManager(f"file://{tmp_path}/", max_to_keep=1)
    x = np.arange(1 << 18, dtype=np.float32)  # 1 MiB
    mgr.save(1, {"x": x}).result(T)
    real = StepStore.delete_steps

    async def failing(self: StepStore, steps: list[int], **kw: Any) -> int:
        raise StorageError("injected: the store is unreachable")

    monkeypatch.setattr(StepStore, "delete_steps", failing)
    with caplog.at_level(logging.WARNING, logger="tensorstore_py.checkpoint"):
        assert mgr.save(2, {"x": x + 1}).result(T).step == 2  # committed: success
    assert "retention failed" in caplog.text and "injected" in caplog.text
    assert mgr.all_steps() == [1, 2]
    monkeypatch.setattr(StepStore, "delete_steps", real)
    mgr.save(3, {"x": x + 2}).result(T)
    assert mgr.all_steps() == [3]
    assert _file_bytes(tmp_path) < (1 << 20) + (256 << 10)
