"""A checkable workload for crash and GC tests of the versioned store.

Every commit writes ONE counter value into every key of a key set (values of all
storage kinds: inline, packed, alone) and records the counter in the commit
metadata; a key ``<prefix>extra`` exists exactly when the counter is even. So a
version is *whole* when every key holds the value of one counter, and that
counter is the one its commit record names. Writers run in forked children that
are killed with SIGKILL (optionally at the k-th base-store write, through the
fault wrapper store).
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import threading
import time
from typing import Any

import pytest

import tensorstore_py as tsp
from tensorstore_py.kvstore.base import KvStore
from tensorstore_py.kvstore.fault import FaultKvStore
from tensorstore_py.kvstore.file import FileKvStore
from tensorstore_py.kvstore.memory import MemoryKvStore
from tensorstore_py.kvstore.versioned import VersionedKvStore
from tensorstore_py.kvstore.versioned import root as _root_module

T = 60
#: value sizes by ``j % 4``: inline, packed, alone (>= 256 KiB), packed
SIZES = (16, 2000, 270_000, 40_000)

#: the base stores a versioned test runs over (params of the test files' ``base`` fixtures)
BASES = ["memory", "file", "gcs"]

_fork = multiprocessing.get_context("fork")


def open_base(request: pytest.FixtureRequest, tmp_path: Any) -> KvStore:
    """The base store ``request.param`` names: a memory store, a folder under
    ``tmp_path`` or a fresh bucket of the session's GCS emulator."""
    if request.param == "memory":
        return MemoryKvStore()
    if request.param == "file":
        return FileKvStore(path=str(tmp_path / "root"))
    emu = request.getfixturevalue("gcs_emulator")
    return tsp.KvStore.open(emu.spec(emu.create_bucket())).result(T)


def value(counter: int, key: str) -> bytes:
    """The value of ``key`` written by the commit of ``counter`` (size by the key's number)."""
    head = b"%d:%s;" % (counter, key.encode())
    size = SIZES[int(key.rsplit("/", 1)[1]) % len(SIZES)]
    return (head * (size // len(head) + 1))[:size]


def single_keys(k: int = 8) -> list[str]:
    return [f"k/{j:02d}" for j in range(k)]


def shard_keys(p: int, n: int = 3) -> list[str]:
    return [f"p{p}/{j:02d}" for j in range(n)]


def write_counter(view: KvStore, keys: list[str], counter: int, *, extra: str | None) -> None:
    """Stage the counter's values (and the extra key) through ``view`` (a transaction view)."""
    futs = [view.write(k, value(counter, k)) for k in keys]
    if extra is not None:
        futs.append(view.write(extra, b"even") if counter % 2 == 0 else view.delete(extra))
    for f in futs:
        f.result(T)


def commit_single(kv: KvStore, counter: int, keys: list[str]) -> int:
    with tsp.Transaction(metadata={"counter": counter}) as txn:
        write_counter(kv.with_transaction(txn), keys, counter, extra="extra")
    return counter


def commit_multi(kv: KvStore, counter: int, parts: int) -> None:
    """One multi-writer commit by ``parts`` participants (threads of this process)."""
    errors: list[BaseException] = []

    def run(p: int) -> None:
        try:
            txn = tsp.Transaction(txn_id=f"c{counter}", process_index=p, process_count=parts,
                                  timeout=30, metadata={"counter": counter})
            write_counter(kv.with_transaction(txn), shard_keys(p), counter,
                          extra="extra" if p == 0 else None)
            txn.commit().result(T)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(p,)) for p in range(parts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def all_keys(parts: int) -> list[str]:
    return single_keys() if parts == 1 else [k for p in range(parts) for k in shard_keys(p)]


class _SigKill(BaseException):
    """Raised by the fault store at the programmed write: kills this process instead."""

    def __init__(self, *args: Any) -> None:
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # not reached: SIGKILL to oneself is delivered at once


def _writer(root: str, first_counter: int, commits: int, parts: int, kill_at: int, after: bool,
            ready: Any) -> None:
    base = FaultKvStore(FileKvStore(path=root))
    if kill_at:
        base.inject(op="write", nth=kill_at, error=_SigKill, after_effect=after)
    kv = VersionedKvStore(base)
    ready.set()
    c = first_counter
    while commits < 0 or c < first_counter + commits:
        if parts == 1:
            commit_single(kv, c, single_keys())
        else:
            commit_multi(kv, c, parts)
        c += 1
    os._exit(0)  # skip interpreter teardown in the forked child


def run_writer(
    root: str, *, first_counter: int, commits: int, parts: int = 1,
    kill_at: int = 0, after: bool = False, kill_after: float | None = None,
) -> int:
    """Run a writer in a forked child; return its exit code (-9 when killed).

    ``kill_at=k``: the child kills itself at its k-th base-store write (after the
    write landed when ``after``). ``kill_after=s``: the parent kills it ``s``
    seconds after it is ready (``commits=-1`` means commit until killed).
    """
    ready = _fork.Event()
    p = _fork.Process(target=_writer, args=(root, first_counter, commits, parts, kill_at, after, ready))
    p.start()
    if kill_after is not None:
        if not ready.wait(T):
            p.kill()
            raise RuntimeError("writer child did not start")
        time.sleep(kill_after)
        p.kill()
    p.join(T)
    if p.exitcode is None:
        p.kill()
        p.join(T)
        raise RuntimeError("writer child hung")
    return int(p.exitcode)


def fresh_versioned(root: str) -> VersionedKvStore:
    """A versioned store over ``root`` sharing no cached state with earlier opens."""
    _root_module._roots.clear()  # in-process caches must not hide what is on disk
    return VersionedKvStore(FileKvStore(path=root))


def check_version(kv: VersionedKvStore, version: int, keys: list[str]) -> int:
    """Assert version ``version`` is whole; return its counter."""
    if version == 0:
        return -1
    snap = kv.snapshot(version)
    info = {i.version: i for i in kv.versions().result(T)}[version]
    counter = int(info.metadata["counter"])
    got = [snap.read(k) for k in keys]
    for k, f in zip(keys, got):
        res = f.result(T)
        assert res.state == "value", f"version {version}: key {k!r} missing"
        assert bytes(res.value) == value(counter, k), (
            f"version {version} (counter {counter}): key {k!r} holds {bytes(res.value)[:24]!r}..."
        )
    extra = snap.read("extra").result(T)
    assert (extra.state == "value") == (counter % 2 == 0), f"version {version}: extra key is wrong"
    listed = snap.list().result(T)
    assert listed == sorted(keys + (["extra"] if counter % 2 == 0 else [])), listed
    return counter


def sample_versions(newest: int, rng: random.Random, k: int = 3) -> list[int]:
    """The newest version and a few random older ones."""
    older = list(range(1, newest))
    return sorted({newest} | set(rng.sample(older, min(k, len(older)))))


def writes_until_commit_record(root: str, scratch: str, *, parts: int) -> int:
    """How many base-store writes the next commit makes up to and including its
    commit record: measured by committing on a copy of ``root`` at ``scratch``."""
    import shutil

    order: list[str] = []

    class Recorder(FaultKvStore):
        async def _write(self, key: str, value: Any, if_equal: Any) -> Any:
            order.append(key)
            return await super()._write(key, value, if_equal)

    shutil.copytree(root, scratch)
    _root_module._roots.clear()
    try:
        kv = VersionedKvStore(Recorder(FileKvStore(path=scratch)))
        if parts == 1:
            commit_single(kv, 1, single_keys())
        else:
            commit_multi(kv, 1, parts)
    finally:
        _root_module._roots.clear()
    return 1 + next(i for i, k in enumerate(order) if "commits/" in k)
