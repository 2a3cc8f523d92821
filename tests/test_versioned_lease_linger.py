"""The writer linger (docs/FORMAT.md §9.3): a lease that said ``writing`` keeps
saying so, unchanged, for ``WRITER_LINGER`` after the last writer of its process
ended, so that a process committing periodically writes its lease once, not once
per commit; then it is deleted. What the lingering claim protects from a
collector, in this process and in others."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from tensorstore_py.kvstore.base import Buffer, Generation, KvStore
from tensorstore_py.kvstore.fault import FaultKvStore
from tensorstore_py.kvstore.file import FileKvStore
from tensorstore_py.kvstore.versioned import VersionedKvStore
from tensorstore_py.kvstore.versioned import leases as _leases
from tensorstore_py.kvstore.versioned.format import unframe
from tensorstore_py.kvstore.versioned.gc import gc
from tensorstore_py.kvstore.versioned.leases import MAGIC_LEASE
from tensorstore_py.kvstore.versioned.verify import verify

T = 60


def _lease(base: Any) -> tuple[str, Any, dict[str, Any]]:
    """(name, generation, body) of the one lease object on ``base``."""
    (name,) = base.list("leases/").result(T)
    res = base.read(name).result(T)
    assert res.state == "value", name
    return name, res.generation, unframe(MAGIC_LEASE, res.value, name)


def _lease_calls(base: FaultKvStore) -> list[str]:
    """The writes and deletes of lease objects since ``base.reset_counters()``."""
    return sorted(f"{op} {key}" for op in ("write", "delete") for key in base.keys_called(op)
                  if key.startswith("leases/"))


def _wait_until_gone(base: Any, limit: float) -> float:
    """Seconds until no lease object is left (fails after ``limit``)."""
    t0 = time.monotonic()
    while base.list("leases/").result(T):
        assert time.monotonic() - t0 < limit, "the lease was never deleted"
        time.sleep(0.02)
    return time.monotonic() - t0


def _orphan(base: Any, root: Path, age: float) -> str:
    """An unreferenced data object modified ``age`` seconds ago."""
    name = "data/" + os.urandom(16).hex()
    base.write(name, b"orphan").result(T)
    if age:
        then = time.time() - age
        os.utime(root / name, (then, then))
    return name


class _PausedRecord(FaultKvStore):
    """Runs ``hook`` once, right before the next commit record reaches the base store."""

    def __init__(self, base: KvStore) -> None:
        super().__init__(base)
        self.hook: Callable[[], Awaitable[None]] | None = None
        self.fired = False

    async def _write(self, key: str, value: Buffer, if_equal: Generation | None) -> Generation:
        if self.hook is not None and not self.fired and key.startswith("commits/"):
            self.fired = True
            await self.hook()
        return await super()._write(key, value, if_equal)


def test_a_writer_committing_again_within_the_linger_writes_no_lease(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_leases, "LINGER", 0.1)
    monkeypatch.setattr(_leases, "REFRESH", 0.2)  # a refresh is due several times in the linger
    monkeypatch.setattr(_leases, "WRITER_LINGER", 3.0)
    base = FaultKvStore(FileKvStore(path=str(tmp_path)))
    kv = VersionedKvStore(base)
    kv.write("a", b"1").result(T)
    name, gen, body = _lease(base)
    assert body["writing"] is True
    base.reset_counters()
    time.sleep(1.0)  # LINGER, and REFRESH, are long past: the claim lingers, untouched
    assert _lease(base) == (name, gen, body)
    assert _lease_calls(base) == []
    # (a refresh that comes while a writer runs rewrites the lease, as it should:
    # none comes from here on)
    monkeypatch.setattr(_leases, "REFRESH", 1000.0)
    time.sleep(0.3)
    for i in range(3):  # a writer committing every 0.3 s: no lease write, no delete
        kv.write("a", b"%d" % i).result(T)
        time.sleep(0.3)
    assert _lease_calls(base) == []
    assert _lease(base)[:2] == (name, gen)
    assert bytes(kv.read("a").result(T).value) == b"2"
    # ... and once the last commit is WRITER_LINGER behind, the lease goes
    t0 = time.monotonic()
    time.sleep(1.5)
    assert _lease(base)[:2] == (name, gen)  # 1.8 s after the last commit ended: still there
    gone = time.monotonic() - t0 + _wait_until_gone(base, 20)
    assert gone >= 3.0 - 0.3 - 0.1, gone
    assert _lease_calls(base) == [f"delete {name}"]  # deleted, never rewritten


def test_a_claim_lingering_past_half_the_ttl_is_rewritten_in_time_then_deleted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a linger beyond TTL / 2: a writer registering late in it must still find a
    # fresh claim, so the keeper rewrites it (only) when it is getting old
    monkeypatch.setattr(_leases, "TTL", 2.0)
    monkeypatch.setattr(_leases, "REFRESH", 0.25)  # rewritten once older than 0.75 s
    monkeypatch.setattr(_leases, "LINGER", 0.1)
    monkeypatch.setattr(_leases, "WRITER_LINGER", 2.5)
    base = FaultKvStore(FileKvStore(path=str(tmp_path)))
    kv = VersionedKvStore(base)
    kv.write("a", b"1").result(T)
    t0 = time.monotonic()
    name, gen, _ = _lease(base)
    base.reset_counters()
    oldest, bodies = 0.0, []
    while time.monotonic() - t0 < 2.2:  # the linger, by the lease file's age
        try:
            oldest = max(oldest, time.time() - os.stat(tmp_path / name).st_mtime)
            bodies.append(_lease(base)[2])
        except (FileNotFoundError, ValueError):
            break
        time.sleep(0.05)
    assert oldest < 2.0 / 2 + 0.6, oldest  # never near the TTL: live and nearly fresh throughout
    assert bodies and all(b["writing"] for b in bodies), bodies
    # rewritten when it would turn 1 s old before the next refresh, not at each
    # of the 8 or so refreshes due in the linger
    assert 1 <= base.calls["write"] <= 3, base.calls
    assert _lease(base)[1] != gen and bodies[-1]["writing_for"] == 0.0
    gone = time.monotonic() - t0 + _wait_until_gone(base, 20)
    assert gone >= 2.5 - 0.2, gone
    assert _lease_calls(base) == [f"delete {name}", f"write {name}"]


def test_a_pin_released_while_the_claim_lingers_is_rewritten_keeping_the_claim(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_leases, "LINGER", 0.1)
    monkeypatch.setattr(_leases, "WRITER_LINGER", 2.0)
    base = FaultKvStore(FileKvStore(path=str(tmp_path)))
    kv = VersionedKvStore(base)
    kv.write("a", b"1").result(T)
    snap = kv.snapshot(1)
    assert bytes(snap.read("a").result(T).value) == b"1"
    assert _lease(base)[2]["versions"] == [1]
    snap.close()  # the pin goes: the lease is rewritten after LINGER, still ``writing``
    deadline = time.monotonic() + 10
    while _lease(base)[2]["versions"]:
        assert time.monotonic() < deadline, "the pin was never released"
        time.sleep(0.02)
    body = _lease(base)[2]
    assert body["writing"] is True and body["writing_for"] == 0.0
    _wait_until_gone(base, 20)


_LINGERING_WRITER = """
import sys, tensorstore_py as tsp
kv = tsp.KvStore.open(sys.argv[1]).result()
kv.write("a", b"1").result()
print("committed", flush=True)
sys.stdin.readline()
"""


def test_a_lingering_claim_of_another_process_protects_young_objects_not_old_ones(tmp_path: Path) -> None:
    url = f"versioned+file://{tmp_path}/"
    proc = subprocess.Popen([sys.executable, "-c", _LINGERING_WRITER, url], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "committed"
        time.sleep(_leases.LINGER * 2.5)  # its writer ended: the claim lingers
        base = FileKvStore(path=str(tmp_path))
        (lease,) = base.list("leases/").result(T)
        young = _orphan(base, tmp_path, 0)
        old = _orphan(base, tmp_path, 7200)  # modified long before the writer started
        time.sleep(0.05)  # older than the grace of 0 s
        rep = gc(VersionedKvStore(base), grace=0, dry_run=False).result(T)
        assert rep.deleted == (old,) and rep.kept_leased == (young,) and rep.leases == 1, rep.summary()
        assert base.read(young).result(T).state == "value"
    finally:
        proc.communicate("\n", timeout=T)
    assert proc.returncode == 0
    assert base.list("leases/").result(T) == []  # deleted at exit, linger or not
    rep = gc(VersionedKvStore(base), grace=0, dry_run=False).result(T)
    assert rep.deleted == (young,) and rep.leases == 0, rep.summary()
    assert bytes(VersionedKvStore(base).read("a").result(T).value) == b"1"
    assert lease not in base.list("leases/").result(T)


def test_a_writer_registered_in_the_linger_keeps_its_data_from_collectors(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer finds the lingering claim and writes no lease; a collector in
    this process (it reads the running writers in memory) and one of another
    root (it reads the lease object, unchanged since the previous commit) run
    with no grace between its data object and its commit record."""
    monkeypatch.setattr(_leases, "LINGER", 0.1)
    monkeypatch.setattr(_leases, "WRITER_LINGER", 30.0)
    base = _PausedRecord(FileKvStore(path=str(tmp_path)))
    kv = VersionedKvStore(base)
    kv.write("a", b"1").result(T)
    time.sleep(0.5)
    before = set(base.list("data/").result(T))
    base.reset_counters()
    reports = []

    async def collect() -> None:
        await asyncio.sleep(0.05)  # the data object is older than the grace of 0 s
        reports.append(await gc(kv, grace=0, dry_run=False))
        reports.append(await gc(FileKvStore(path=str(tmp_path)), grace=0, dry_run=False))

    base.hook = collect
    big = os.urandom(300_000)
    kv.write("big", big).result(T)
    assert base.fired and len(reports) == 2
    mine = set(base.list("data/").result(T)) - before
    assert len(mine) == 1
    for rep in reports:
        assert not mine & set(rep.deleted), rep.summary()
    assert _lease_calls(base) == []  # registered without a lease write
    assert bytes(kv.read("big").result(T).value) == big
    assert verify(kv).result(T) == []
