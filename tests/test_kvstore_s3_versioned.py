"""The versioned store and checkpoints on s3:// (the moto server): commits,
multi-writer commits, writers killed with SIGKILL mid-commit, and
CheckpointManager save / restore / retention."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time
from typing import Any

import numpy as np
import pytest
from _versioned_workload import all_keys, check_version, commit_multi, commit_single, single_keys

import tensorstore_py as tsp
from tensorstore_py.errors import NotFoundError
from tensorstore_py.kvstore.fault import FaultKvStore
from tensorstore_py.kvstore.s3 import S3KvStore
from tensorstore_py.kvstore.versioned import VersionedKvStore
from tensorstore_py.kvstore.versioned import root as _root_module
from tensorstore_py.kvstore.versioned.verify import verify
from tensorstore_py.testing.s3_server import S3Server

T = 60
_fork = multiprocessing.get_context("fork")


def _fresh(spec: dict[str, Any]) -> VersionedKvStore:
    _root_module._roots.clear()  # in-process caches must not hide what is in the bucket
    return VersionedKvStore(S3KvStore.from_spec(spec))


def test_commits_and_multi_writer_commits(s3_server: S3Server) -> None:
    bucket = s3_server.create_bucket()
    single, multi = s3_server.spec(bucket, path="single/"), s3_server.spec(bucket, path="multi/")
    for c in range(3):
        commit_single(_fresh(single), c, single_keys())
        commit_multi(_fresh(multi), c, parts=3)
    for spec, keys in ((single, single_keys()), (multi, all_keys(3))):
        kv = _fresh(spec)
        assert kv.newest_version().result(T) == 3
        assert [check_version(kv, v, keys) for v in (1, 2, 3)] == [0, 1, 2]
        assert verify(kv).result(T) == []


class _SigKill(BaseException):
    def __init__(self, *args: Any) -> None:
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)


def _writer(spec: dict[str, Any], counter: int, kill_at: int, after: bool, ready: Any) -> None:
    base = FaultKvStore(S3KvStore.from_spec(spec))
    if kill_at:
        base.inject(op="write", nth=kill_at, error=_SigKill, after_effect=after)
    kv = VersionedKvStore(base)
    ready.set()
    while True:
        commit_single(kv, counter, single_keys())
        counter += 1
        if kill_at:
            os._exit(0)  # one commit when killed at a write; else until killed


def test_killed_writers_leave_whole_versions(s3_server: S3Server) -> None:
    """12 seeded trials: a forked writer killed at its k-th write (before or after
    it lands) or after a random delay; the newest version is always whole,
    older ones still read, verify finds nothing, and the next writer commits."""
    spec = s3_server.spec(s3_server.create_bucket())
    commit_single(_fresh(spec), 0, single_keys())
    counter = 1
    killed = 0
    for trial in range(12):
        rng = random.Random(500 + trial)
        ready = _fork.Event()
        mode = rng.choice(["before", "after", "timed"])
        kill_at = 0 if mode == "timed" else rng.randint(1, 8)
        p = _fork.Process(target=_writer, args=(spec, counter, kill_at, mode == "after", ready))
        p.start()
        assert ready.wait(T)
        if mode == "timed":
            time.sleep(rng.uniform(0.05, 0.6))
            p.kill()
        p.join(T)
        assert p.exitcode in (0, -9), p.exitcode
        killed += p.exitcode == -9
        counter += 1000
        kv = _fresh(spec)
        newest = kv.newest_version().result(T)
        check_version(kv, newest, single_keys())
        check_version(kv, 1, single_keys())
        assert verify(kv).result(T) == [], f"trial {trial} ({mode})"
    commit_single(kv, counter, single_keys())
    assert check_version(_fresh(spec), newest + 1, single_keys()) == counter
    assert killed >= 6


def test_checkpoint_manager_on_s3(s3_server: S3Server) -> None:
    spec = s3_server.spec(s3_server.create_bucket(), path="run1/")
    root = tsp.KvStore.open(spec).result(T)
    mgr = tsp.CheckpointManager(root, max_to_keep=2)
    x = np.arange(1 << 16, dtype=np.float32).reshape(256, 256)
    for step in (1, 2, 3):
        mgr.save(step, {"x": x + step, "small": np.ones(3)}).result(T)
    assert mgr.all_steps() == [2, 3]
    np.testing.assert_array_equal(mgr.restore()["x"], x + 3)
    np.testing.assert_array_equal(mgr.restore(2)["x"], x + 2)
    again = tsp.CheckpointManager(tsp.KvStore.open(spec).result(T), max_to_keep=2)
    assert again.all_steps() == [2, 3]
    with pytest.raises(NotFoundError):
        again.restore(1)
