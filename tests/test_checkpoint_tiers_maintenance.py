"""The local tier's upkeep: delete and gc on every tier, promotions from recorded
digests, and parts of another process layout reported, not silently ignored."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest

import tensorstore_py as tsp
from tensorstore_py.checkpoint import SaveOptions
from tensorstore_py.commands import checks
from tensorstore_py.core.future import run_sync
from tensorstore_py.kvstore.fault import FaultKvStore
from tensorstore_py.kvstore.transaction import Transaction


def _urls(tmp_path: Path) -> tuple[str, str]:
    return f"file://{tmp_path}/persistent/", f"file://{tmp_path}/local/"


def _tree(step: int) -> dict[str, object]:
    # leaves of 256 KiB: neither packed nor given a zarr.json; each chunk its own data object
    return {f"w{i}": np.arange(1 << 16, dtype=np.float32) + 100 * i + step for i in range(4)}


def _local_steps(local: str) -> list[int]:
    return tsp.CheckpointManager(local).all_steps()


def _slow_root(tmp_path: Path, seconds: float) -> FaultKvStore:
    """The persistent root, each commit record written ``seconds`` late."""
    faulty = FaultKvStore(tsp.KvStore.open(f"file://{tmp_path}/persistent/").result())
    faulty.inject(op="write", key_pattern="commits/*", error=None, latency=seconds)
    return faulty


def test_delete_removes_the_step_from_the_local_tier_too(tmp_path: Path) -> None:
    root, local = _urls(tmp_path)
    with tsp.CheckpointManager(root, local=local, local_max_to_keep=None) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, _tree(s), persist=s == 2)
        mgr.wait_until_finished()
        mgr.delete(3)  # local only
        mgr.delete(2)  # local and persistent
        assert mgr.all_steps() == [1]
        out = mgr.restore()
        np.testing.assert_array_equal(out["w0"], _tree(1)["w0"])
        with pytest.raises(tsp.errors.NotFoundError, match="local tier"):
            mgr.delete(3)
    assert _local_steps(local) == [1]
    assert tsp.CheckpointManager(root).all_steps() == []
    assert run_sync(checks.verify(root)).ok and run_sync(checks.verify(local)).ok


def test_delete_waits_for_the_steps_promotion_so_it_can_not_come_back(tmp_path: Path) -> None:
    _, local = _urls(tmp_path)
    mgr = tsp.CheckpointManager(_slow_root(tmp_path, 1.0), local=local)
    mgr.save(1, _tree(1)).result()
    mgr.save(2, _tree(2), persist=True)  # the local commit and the promotion in flight
    mgr.delete(2)
    mgr.wait_until_finished()
    mgr.close()
    assert tsp.CheckpointManager(f"file://{tmp_path}/persistent/").all_steps() == []
    assert _local_steps(local) == [1]


def test_gc_catches_up_local_retention_and_collects_each_tier(tmp_path: Path) -> None:
    root, local = _urls(tmp_path)
    mgr = tsp.CheckpointManager(_slow_root(tmp_path, 1.0), local=local, local_max_to_keep=1)
    mgr.save(1, _tree(1), persist=True).result()
    mgr.save(2, _tree(2)).result()  # retention keeps step 1: its promotion has not ended
    mgr.wait_until_finished()
    assert _local_steps(local) == [1, 2]
    # an aborted write leaves an unreferenced data object in the local tier
    kv = mgr._tiers.local.kv  # type: ignore[union-attr]
    txn = Transaction()
    run_sync(kv.with_transaction(txn).write("junk", b"x" * (1 << 20)))
    txn.abort()
    objects = lambda: {p.name for p in (tmp_path / "local" / "data").iterdir()}  # noqa: E731
    before = objects()
    dry = mgr.gc(grace=0.0)
    assert set(dry) == {"persistent", "local"} and dry["local"].dry_run and objects() == before
    reports = mgr.gc(grace=0.0, dry_run=False)
    assert _local_steps(local) == [2]  # step 1 is promoted now: local retention took it
    assert any(name.endswith(tuple(before - objects())) for name in reports["local"].deleted)
    assert len(before - objects()) >= 2  # the junk and step 1's chunks
    mgr.close()
    out = tsp.CheckpointManager(local).restore(2)
    for k, v in _tree(2).items():
        np.testing.assert_array_equal(out[k], v)
    out = tsp.checkpoint.restore(root, step=1)
    np.testing.assert_array_equal(out["w3"], _tree(1)["w3"])
    assert run_sync(checks.verify(root)).ok and run_sync(checks.verify(local)).ok


def test_cli_gc_local_collects_the_root_and_every_local_part(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tensorstore_py.cli import main

    root, local = _urls(tmp_path)
    with tsp.CheckpointManager(root, local=local, persist_interval_steps=2, local_max_to_keep=2) as mgr:
        for s in range(3):
            mgr.save(s, _tree(s))
        mgr.wait_until_finished()
        # an aborted write leaves an unreferenced data object in each tier
        for kv in (mgr._tiers.local.kv, tsp.KvStore.open("versioned+" + root).result()):  # type: ignore[union-attr]
            txn = Transaction()
            run_sync(kv.with_transaction(txn).write("junk", b"x" * (1 << 20)))
            txn.abort()
    objects = lambda tier: {f"data/{p.name}" for p in (tmp_path / tier / "data").iterdir()}  # noqa: E731
    before = {tier: objects(tier) for tier in ("persistent", "local")}
    assert main(["gc", root, "--local", local, "--grace", "0s", "--json"]) == 0
    dry = json.loads(capsys.readouterr().out)
    assert [r["url"] for r in dry] == [root, local] and not any(r["applied"] for r in dry)
    assert all(r["count"] >= 1 for r in dry), dry
    assert {tier: objects(tier) for tier in before} == before  # a dry run deletes nothing
    assert main(["gc", root, "--local", local, "--grace", "0s", "--apply"]) == 0
    text = capsys.readouterr().out
    assert text.index(f"{root}:\n") < text.index(f"{local}:\n"), text
    # the local tier may also hold index nodes of the part.json that each
    # promotion rewrites (its "promoted" mark)
    assert len(re.findall(r"deleted \d+ object\(s\) \(1 data(, \d+ nodes)?\), 1\.0 MiB", text)) == 2, text
    for r, tier in zip(dry, ("persistent", "local")):
        gone = before[tier] - objects(tier)
        assert gone == {name for name in r["objects"] if name.startswith("data/")}, (tier, gone, r["objects"])
        assert gone, tier
    out = tsp.CheckpointManager(local).restore(2)
    for k, v in _tree(2).items():
        np.testing.assert_array_equal(out[k], v)
    np.testing.assert_array_equal(tsp.checkpoint.restore(root, step=2)["w1"], _tree(2)["w1"])
    assert run_sync(checks.verify(root)).ok and run_sync(checks.verify(local)).ok


def test_promotion_links_unchanged_chunks_by_the_local_digests_without_reading_them(tmp_path: Path) -> None:
    root = f"file://{tmp_path}/persistent/"
    local_base = FaultKvStore(tsp.KvStore.open(f"file://{tmp_path}/local/").result())
    mgr = tsp.CheckpointManager(root, local=local_base)
    tree = _tree(1)
    mgr.save(1, tree, persist=True).result()
    mgr.wait_until_finished()
    # from now on every read of a local data object is recorded (a latency-only rule)
    local_base.inject(op="read", key_pattern="data/*", error=None, latency=0.001)
    changed = dict(tree, w3=tree["w3"] + 1)
    mgr.save(2, changed, persist=True).result()
    mgr.wait_until_finished()
    mgr.close()
    read = {e.key for e in local_base.events if e.kind == "latency"}
    chunk_objects = {k for k in read if (tmp_path / "local" / k).stat().st_size >= 1 << 18}
    assert len(chunk_objects) == 1, chunk_objects  # w3's new chunk alone; w0..w2 were linked
    out = tsp.checkpoint.restore(root, step=2)
    for k, v in changed.items():
        np.testing.assert_array_equal(out[k], v)
    assert run_sync(checks.verify(root)).ok


def test_a_promoted_compressed_step_keeps_digests_of_its_raw_bytes(tmp_path: Path) -> None:
    root, local = _urls(tmp_path)
    with tsp.CheckpointManager(root, local=local, options=SaveOptions(compression="zstd")) as mgr:
        for s in (1, 2):
            mgr.save(s, _tree(1), persist=True)
    report = run_sync(checks.verify(root))
    assert report.ok, [p.message for p in report.problems]
    # and the second step linked the first's chunks at the root
    doc = json.loads(bytes(tsp.KvStore.open("versioned+" + root).result()
                           .read("000000000002/digests/000000.json").result().value))
    assert len(doc["chunks"]) == 4


def test_a_promoted_step_records_the_heads_the_local_part_recorded(tmp_path: Path) -> None:
    # the root's next save compares heads (dedup.py): a promotion, which hashes
    # nothing, carries them over with the digests, for written and linked chunks
    root, local = _urls(tmp_path)
    with tsp.CheckpointManager(root, local=local) as mgr:
        mgr.save(1, _tree(1), persist=True)
        mgr.save(2, dict(_tree(1), w3=_tree(2)["w3"]), persist=True)

    def doc(url: str, step: int) -> dict[str, object]:
        kv = tsp.KvStore.open("versioned+" + url).result()
        return json.loads(bytes(kv.read(f"{step:012d}/digests/000000.json").result().value))

    for step in (1, 2):
        at_root, in_local = doc(root, step), doc(local, step)
        assert at_root["chunks"] == in_local["chunks"]
        assert at_root["heads"] == in_local["heads"] and len(in_local["heads"]) == 4, (at_root, in_local)


def test_packed_leaves_keep_their_checksums_in_local_and_promoted_manifests(tmp_path: Path) -> None:
    root, local = _urls(tmp_path)
    tree = {"a": np.arange(10.0), "b": np.ones(5, np.int32)}
    with tsp.CheckpointManager(root, local=local) as mgr:
        mgr.save(1, tree, persist=True)
    for url in (local, root):
        kv = tsp.KvStore.open("versioned+" + url).result()
        leaves = json.loads(bytes(kv.read("000000000001/manifest.json").result().value))["leaves"]
        assert all(isinstance(e["packed"]["crc32c"], int) for e in leaves), (url, leaves)


def test_parts_of_another_process_count_are_reported(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]) -> None:
    from tensorstore_py.checkpoint.tiers import LocalTier
    from tensorstore_py.cli import main

    root, local = _urls(tmp_path)
    tsp.checkpoint.save(root, _tree(0), step=0).result()
    for p in (0, 1):  # a job of 2 processes saved step 1
        LocalTier(local, process_index=p, process_count=2).save(
            1, _tree(1), metrics={}, options=SaveOptions()).result()
    later = LocalTier(local, process_index=0, process_count=4)  # the job again, with 4 processes
    LocalTier(local, process_index=0, process_count=4).save(2, _tree(2), metrics={}, options=SaveOptions()).result()
    with caplog.at_level(logging.WARNING, logger="tensorstore_py.checkpoint"):
        assert run_sync(later.steps()) == [2]
        assert run_sync(later.steps()) == [2]
    warned = [r.getMessage() for r in caplog.records if "another process layout" in r.getMessage()]
    assert len(warned) == 1 and "steps [1] as process 0 of 2" in warned[0], warned
    assert main(["ls", root, "--local", local, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    rows = {r["step"]: r for r in data["steps"]}
    assert rows[1]["tiers"] == ["local"] and rows[1]["local_process_count"] == 2
    assert rows[2]["tiers"] == ["local 1/4"]
    assert any("job of 2 process" in n for n in data["local_notes"])
    assert main(["ls", root, "--local", local]) == 0
    assert "note: a manager restores, promotes and retains only" in capsys.readouterr().out


class _Job:
    """The coordinator of one process of a ``count``-process job whose other
    processes make no call: enough for local saves, which coordinate nothing."""

    def __init__(self, index: int, count: int) -> None:
        self.process_index, self.process_count = index, count
        self._kv: dict[str, str] = {}

    def publish(self, key: str, value: str) -> None:
        self._kv[key] = value

    def wait_for(self, key: str, timeout: float) -> str:
        return self._kv[key]


def test_parts_of_another_process_count_are_neither_counted_by_retention_nor_block_a_save(
        tmp_path: Path) -> None:
    """A job of 2 processes left parts of steps 0 and 3 in process_0/; the job is
    restarted with 4 processes and saves steps 1 to 3: local retention keeps its
    own 2 newest parts (it neither counts nor deletes the old job's), and step 3
    is saved over the old job's part of it, which no process of this job can
    restore."""
    from tensorstore_py.checkpoint.tiers import LocalTier

    root, local = _urls(tmp_path)
    old = LocalTier(local, process_index=0, process_count=2)
    for s in (0, 3):
        old.save(s, _tree(100 + s), metrics={}, options=SaveOptions()).result()
    with tsp.CheckpointManager(root, local=local, local_max_to_keep=2, coordinator=_Job(0, 4)) as mgr:
        for s in (1, 2):
            mgr.save(s, _tree(s))
            mgr.wait_until_finished()
        assert mgr._tiers.local_steps() == [1, 2]  # type: ignore[union-attr]
        assert run_sync(old.steps()) == [0, 3]  # retention left the old job's parts alone
        mgr.save(3, _tree(3))
        mgr.wait_until_finished()
        assert mgr._tiers.local_steps() == [2, 3]  # type: ignore[union-attr]
        got = mgr.restore(3)
    assert all(np.array_equal(got[k], v) for k, v in _tree(3).items())
    assert run_sync(old.steps()) == [0]
    assert run_sync(checks.verify(f"{local}process_0/")).ok
