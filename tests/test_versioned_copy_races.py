"""A copy of a versioned store (``copy_to``) racing a collector on its destination.

The copy is a writer of the destination: it holds a writer lease there while it
copies, and checks right before its first commit record that every object it
copied is still there (docs/FORMAT.md §9.3). Races are driven as in
``test_versioned_gc_races``: a wrapper store runs a hook right before the copy
writes its first commit record.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest
from test_versioned_gc_races import Paused

from tensorstore_py.errors import DataCorruptionError, StorageError
from tensorstore_py.kvstore.fault import FaultKvStore
from tensorstore_py.kvstore.file import FileKvStore
from tensorstore_py.kvstore.memory import MemoryKvStore
from tensorstore_py.kvstore.versioned import VersionedKvStore
from tensorstore_py.kvstore.versioned.gc import gc
from tensorstore_py.kvstore.versioned.verify import verify

T = 60


def _source(tmp_path: Path) -> tuple[VersionedKvStore, dict[str, bytes]]:
    kv = VersionedKvStore(FileKvStore(path=str(tmp_path / "src")))
    values = {"big": os.urandom(300_000), "other": os.urandom(400_000), "small": b"s"}
    for k, v in values.items():
        kv.write(k, v).result(T)
    kv.tag("first", 1).result(T)
    return kv, values


def test_a_collector_on_the_destination_keeps_what_the_copy_wrote(tmp_path: Path) -> None:
    """A collector with grace 0 runs on the destination after every object was
    copied and before the first commit record: the copy's lease protects them,
    the copy commits, and every version reads back exactly."""
    src, values = _source(tmp_path)
    inner = FileKvStore(path=str(tmp_path / "dst"))
    dst = Paused(inner)
    reports = []

    async def collect() -> None:
        assert await inner.list("data/"), "the copy wrote no data object before its records"
        # another root over the same folder: it knows the copy's lease only from the store
        reports.append(await gc(FileKvStore(path=str(tmp_path / "dst")), grace=0, dry_run=False))

    dst.pause("write", "commits/*", collect)
    src.copy_to(dst).result(T)
    assert dst.fired and reports
    assert reports[0].deleted == (), reports[0].summary()
    out = VersionedKvStore(FileKvStore(path=str(tmp_path / "dst")))
    assert [v.version for v in out.versions().result(T)] == [1, 2, 3, 4]
    assert out.tags().result(T) == {"first": 1}
    for k, v in values.items():
        assert bytes(out.read(k).result(T).value) == v
    assert bytes(out.snapshot(1).read("big").result(T).value) == values["big"]
    assert verify(out).result(T) == []


def test_a_collector_in_another_process_keeps_what_the_copy_wrote(tmp_path: Path) -> None:
    """The same race with a real second process: ``tensorstore-py gc --grace 0s
    --apply`` on the destination, between the copy's last object and its first record."""
    src, values = _source(tmp_path)
    inner = FileKvStore(path=str(tmp_path / "dst"))
    dst = Paused(inner)
    runs: list[tuple[int | None, bytes, bytes]] = []

    async def collect() -> None:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tensorstore_py.cli", "gc", f"file://{tmp_path}/dst/", "--grace", "0s",
            "--apply", "--json", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await proc.communicate()
        runs.append((proc.returncode, out, err))

    dst.pause("write", "commits/*", collect)
    src.copy_to(dst).result(T)
    assert dst.fired and runs
    code, out, err = runs[0]
    assert code == 0, err.decode()
    report = json.loads(out)
    assert report["applied"] and report["count"] == 0 and report["kept_leased"] >= 5, report
    dst_kv = VersionedKvStore(FileKvStore(path=str(tmp_path / "dst")))
    for k, v in values.items():
        assert bytes(dst_kv.read(k).result(T).value) == v
    assert verify(dst_kv).result(T) == []


def test_a_copy_whose_objects_a_collector_took_is_refused(tmp_path: Path) -> None:
    """A collector that ignores the copy's lease deletes the copied data objects
    after the last one landed, before the first commit record (here: right
    before the copy's check reads them back): the copy is refused, the
    destination shows no version, and running the copy again completes it exactly."""
    src, values = _source(tmp_path)
    inner = FileKvStore(path=str(tmp_path / "dst"))
    dst = Paused(inner)
    taken: list[str] = []

    async def collector_without_lease() -> None:
        for name in await inner.list("data/"):
            await inner.delete(name)
            taken.append(name)

    dst.pause("read", "data/*", collector_without_lease)
    with pytest.raises(DataCorruptionError, match=r"copy to .*the copy wrote or kept are gone.*nothing was committed"):
        src.copy_to(dst).result(T)
    assert dst.fired and taken
    assert inner.list("commits/").result(T) == []
    out = VersionedKvStore(FileKvStore(path=str(tmp_path / "dst")))
    assert out.newest_version().result(T) == 0
    src.copy_to(inner).result(T)  # resumed: the objects taken are copied again
    for k, v in values.items():
        assert bytes(out.read(k).result(T).value) == v
    assert verify(out).result(T) == []


class OneClockPaused(Paused):
    """The race wrapper over a memory store: modification times are still one clock's."""

    single_clock = True


def test_a_resumed_copy_checks_the_objects_it_found(tmp_path: Path) -> None:
    """On a store stamped by one clock the copy's lease vouches for what it
    wrote itself, not for objects an interrupted copy left: those are read back
    before the first record, and one that is gone refuses the copy."""
    src, values = _source(tmp_path)
    inner = MemoryKvStore()
    first = FaultKvStore(inner)
    first.inject(op="write", key_pattern="commits/*", error=StorageError)
    with pytest.raises(StorageError):
        src.copy_to(first).result(T)
    left = sorted(inner.list("nodes/").result(T))
    assert left and inner.list("data/").result(T) and inner.list("commits/").result(T) == []
    again = OneClockPaused(inner)
    taken: list[str] = []

    async def take_one() -> None:  # every node was copied (kept) by now
        await inner.delete(left[0])
        taken.append(left[0])

    again.pause("read", "data/*", take_one)
    with pytest.raises(DataCorruptionError, match="are gone"):
        src.copy_to(again).result(T)
    assert taken and inner.list("commits/").result(T) == []
    src.copy_to(OneClockPaused(inner)).result(T)
    out = VersionedKvStore(inner)
    for k, v in values.items():
        assert bytes(out.read(k).result(T).value) == v
    assert verify(out).result(T) == []


def test_a_fresh_copy_on_one_clock_reads_nothing_back(tmp_path: Path) -> None:
    """Its lease vouches for every object it wrote: no read of the destination's data."""
    src, values = _source(tmp_path)
    inner = MemoryKvStore()
    dst = OneClockPaused(inner)
    src.copy_to(dst).result(T)
    assert dst.keys_called("read") == set()
    out = VersionedKvStore(inner)
    assert bytes(out.read("big").result(T).value) == values["big"]
