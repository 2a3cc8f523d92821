"""Multi-writer attempts: restarts with the same txn id, fragments of dead runs,
commits whose announcement was lost, idempotent retries (real subprocesses)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import pytest
from _multiwriter import staged

import tensorstore_py as tsp
from tensorstore_py.errors import DeadlineExceededError, InvalidArgumentError
from tensorstore_py.kvstore.file import FileKvStore
from tensorstore_py.kvstore.memory import MemoryKvStore
from tensorstore_py.kvstore.versioned import VersionedKvStore
from tensorstore_py.kvstore.versioned import root as root_module

T = 120

#: one process of a multi-writer save: writes shard<index>/<j> (inline, packed and
#: large values, tagged with ``tag``) and commits; ``mode`` makes it SIGKILL itself
#: at its first write of a commit record or of the transaction's result, or ``wait:<path>``
#: commit only once ``path`` exists
WORKER = r"""
import json, os, signal, sys, time
import tensorstore_py as tsp
from tensorstore_py.kvstore.fault import FaultKvStore
from tensorstore_py.kvstore.file import FileKvStore
from tensorstore_py.kvstore.versioned import VersionedKvStore

root, index, count, txn_id, timeout, tag, mode = sys.argv[1:8]
index, count, timeout = int(index), int(count), float(timeout)

class Die(BaseException):
    def __init__(self, *args):
        os.kill(os.getpid(), signal.SIGKILL)

base = FaultKvStore(FileKvStore(path=root))
if mode == "die-at-commit":
    base.inject(op="write", key_pattern="commits/*", error=Die)
elif mode == "die-at-result":
    base.inject(op="write", key_pattern="txns/*/result", error=Die)
kv = VersionedKvStore(base).with_path("params/")
txn = tsp.Transaction(txn_id=txn_id, process_index=index, process_count=count, timeout=timeout)
v = kv.with_transaction(txn)
for j, size in enumerate((40, 3000, 300_000)):
    head = b"%s-%d-%d;" % (tag.encode(), index, j)
    v.write(f"shard{index}/{j}", (head * (size // len(head) + 1))[:size]).result()
if mode.startswith("wait:"):  # a slow process: its data is written, its commit comes late
    while not os.path.exists(mode[5:]):
        time.sleep(0.01)
try:
    info = txn.commit().result()
    print(json.dumps({"version": info.version, "write_id": info.write_id}))
except Exception as e:
    print(json.dumps({"error": type(e).__name__, "message": str(e)}))
"""


def value(tag: str, index: int, j: int) -> bytes:
    size = (40, 3000, 300_000)[j]
    head = b"%s-%d-%d;" % (tag.encode(), index, j)
    return (head * (size // len(head) + 1))[:size]


def start(root: str, index: int, count: int, txn_id: str, timeout: float, tag: str,
          mode: str = "go") -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", WORKER, root, str(index), str(count), txn_id, str(timeout), tag, mode],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def outcome(p: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = p.communicate(timeout=T)
    assert p.returncode == 0, err
    return json.loads(out)  # type: ignore[no-any-return]


def fresh(root: str) -> VersionedKvStore:
    root_module._roots.clear()  # what is on disk, not what this process cached
    return VersionedKvStore(FileKvStore(path=root)).with_path("params/")  # type: ignore[return-value]


def holds(kv: VersionedKvStore, tag: str, indices: range) -> bool:
    keys = [f"shard{i}/{j}" for i in indices for j in range(3)]
    if kv.list().result(T) != sorted(keys):
        return False
    return all(bytes(kv.read(f"shard{i}/{j}").result(T).value) == value(tag, i, j)
               for i in indices for j in range(3))


def txns_objects(root: str) -> list[str]:
    return sorted(FileKvStore(path=root).list("txns/").result(T))


def test_restart_never_merges_a_fragment_of_the_dead_run(tmp_path: Any) -> None:
    """The scenario of the report: participant 1 delivers its fragment, process 0
    dies before committing, the job restarts with the same txn id."""
    root = str(tmp_path / "run") + "/"
    p0 = start(root, 0, 2, "step-100", 60, "OLD", "die-at-commit")
    p1 = start(root, 1, 2, "step-100", 60, "OLD")
    p0.communicate(timeout=T)
    assert p0.returncode == -9  # died at its commit record: after merging participant 1's fragment
    p1.kill()
    p1.communicate(timeout=T)
    assert any(n.endswith("/000001") for n in txns_objects(root))  # the dead run's fragment is there
    assert fresh(root).newest_version().result(T) == 0

    # only process 0 restarts: participant 1's old fragment is not of its attempt
    alone = outcome(start(root, 0, 2, "step-100", 3, "NEW"))
    assert alone["error"] == "DeadlineExceededError" and "participant(s) [1]" in alone["message"], alone
    assert fresh(root).newest_version().result(T) == 0  # nothing visible

    # process 0 and a new participant 1 with new data: exactly the new data
    procs = [start(root, i, 2, "step-100", 60, "NEW") for i in range(2)]
    res = [outcome(p) for p in procs]
    assert [r.get("version") for r in res] == [1, 1], res
    kv = fresh(root)
    assert kv.newest_version().result(T) == 1
    assert holds(kv, "NEW", range(2))
    # merged fragments and attempts are gone; the small result stays
    assert txns_objects(root) == ["txns/step-100/result"]


def test_a_participant_follows_a_restarted_coordinator_to_its_new_attempt() -> None:
    """In-process twin: a process-0 transaction abandoned after participant 1
    delivered; participant 1 keeps waiting and re-delivers to the next attempt."""
    kv = VersionedKvStore(MemoryKvStore())
    old0 = tsp.Transaction(txn_id="t", process_index=0, process_count=2, timeout=30)
    kv.with_transaction(old0).write("a", b"old").result(T)  # opens attempt 1
    t1 = tsp.Transaction(txn_id="t", process_index=1, process_count=2, timeout=60)
    kv.with_transaction(t1).write("b", b"new").result(T)
    fut1 = t1.commit()
    while not [n for n in kv.base.list("txns/t/").result(T) if n.endswith("/000001")]:
        time.sleep(0.01)  # participant 1 delivered to attempt 1
    old0.abort()  # process 0 dies
    new0 = tsp.Transaction(txn_id="t", process_index=0, process_count=2, timeout=30)
    kv.with_transaction(new0).write("a", b"new").result(T)
    assert new0.commit().result(T).version == 1
    assert fut1.result(T).version == 1
    assert kv.read("a").result(T).value == b"new" and kv.read("b").result(T).value == b"new"
    assert kv.base.list("txns/").result(T) == ["txns/t/result"]


def test_a_participant_of_a_failed_run_never_joins_the_next(tmp_path: Any) -> None:
    """Participant 1 of run 1 is slow: process 0 gives up (its attempt's failure
    is recorded), the job runs again, and only then does the old participant 1
    commit. It must fail with its run, not deliver its old data into run 2."""
    root = str(tmp_path / "run") + "/"
    go = tmp_path / "go"
    slow = start(root, 1, 2, "step-9", 60, "OLD", f"wait:{go}")
    first = outcome(start(root, 0, 2, "step-9", 2, "OLD"))
    assert first["error"] == "DeadlineExceededError" and "participant(s) [1]" in first["message"], first
    p0 = start(root, 0, 2, "step-9", 60, "NEW")
    deadline = time.monotonic() + T
    while "txns/step-9/attempts/000002" not in txns_objects(root):  # run 2's process 0 began
        assert time.monotonic() < deadline and p0.poll() is None
        time.sleep(0.01)
    go.touch()  # the old participant commits now
    while slow.poll() is None and not any(n.startswith("txns/step-9/000002-") for n in txns_objects(root)):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    p1 = start(root, 1, 2, "step-9", 60, "NEW")
    old = outcome(slow)
    assert old.get("error") == "DeadlineExceededError" and "participant(s) [1]" in old["message"], old
    assert [outcome(p).get("version") for p in (p0, p1)] == [1, 1]
    kv = fresh(root)
    assert kv.newest_version().result(T) == 1
    assert holds(kv, "NEW", range(2))  # exactly run 2's data


def test_a_participant_of_a_failed_run_never_joins_the_next_in_process() -> None:
    kv = VersionedKvStore(MemoryKvStore())
    old1 = tsp.Transaction(txn_id="f", process_index=1, process_count=2, timeout=30)
    kv.with_transaction(old1).write("b", b"OLD").result(T)  # run 1's participant 1 begins
    old0 = tsp.Transaction(txn_id="f", process_index=0, process_count=2, timeout=0.3)
    kv.with_transaction(old0).write("a", b"OLD").result(T)
    with pytest.raises(DeadlineExceededError, match=r"participant\(s\) \[1\]"):
        old0.commit().result(T)  # its failure is recorded
    new0 = tsp.Transaction(txn_id="f", process_index=0, process_count=2, timeout=30)
    kv.with_transaction(new0).write("a", b"NEW").result(T)  # run 2 opens attempt 2
    fut0 = new0.commit()
    late = old1.commit()  # run 1's participant 1 arrives late
    while not late.done() and not [n for n in kv.base.list("txns/f/").result(T) if n.startswith("txns/f/000002-")]:
        time.sleep(0.01)
    new1 = tsp.Transaction(txn_id="f", process_index=1, process_count=2, timeout=30)
    kv.with_transaction(new1).write("b", b"NEW").result(T)
    assert new1.commit().result(T).version == fut0.result(T).version == 1
    with pytest.raises(DeadlineExceededError, match="failed at the coordinator"):
        late.result(T)
    assert [bytes(kv.read(k).result(T).value) for k in ("a", "b")] == [b"NEW", b"NEW"]


def test_stale_fragment_alone_never_commits() -> None:
    kv = VersionedKvStore(MemoryKvStore())
    old0 = tsp.Transaction(txn_id="s", process_index=0, process_count=2, timeout=30)
    kv.with_transaction(old0).write("a", b"old").result(T)
    t1 = tsp.Transaction(txn_id="s", process_index=1, process_count=2, timeout=30)
    kv.with_transaction(t1).write("b", b"OLD").result(T)
    assert t1.commit(wait=False).result(T).version is None  # delivered to attempt 1
    old0.abort()
    new0 = tsp.Transaction(txn_id="s", process_index=0, process_count=2, timeout=1.0)
    kv.with_transaction(new0).write("a", b"new").result(T)
    with pytest.raises(DeadlineExceededError, match=r"participant\(s\) \[1\]"):
        new0.commit().result(T)
    assert kv.newest_version().result(T) == 0 and kv.list().result(T) == []


def test_coordinator_dies_after_committing_and_retries_are_idempotent(tmp_path: Any) -> None:
    root = str(tmp_path / "run") + "/"
    before = fresh(root)
    before.write("before", b"b").result(T)
    # process 0 commits and dies as it writes the result: participant 1 finds the
    # commit record (it carries the txn id and the attempt's nonce)
    p0 = start(root, 0, 2, "step-7", 60, "A", "die-at-result")
    p1 = start(root, 1, 2, "step-7", 60, "A")
    t = time.monotonic()
    res1 = outcome(p1)
    p0.communicate(timeout=T)
    assert p0.returncode == -9
    assert res1.get("version") == 2, res1
    assert time.monotonic() - t < 45  # found while polling, not at the 60 s deadline
    kv = fresh(root)
    assert kv.newest_version().result(T) == 2
    write_id = kv.commit_details(2).result(T).write_id
    assert res1["write_id"] == write_id

    # the job restarts with the same txn id and the same data: the same commit, nothing new
    res = [outcome(p) for p in [start(root, i, 2, "step-7", 60, "A") for i in range(2)]]
    assert [(r.get("version"), r.get("write_id")) for r in res] == [(2, write_id)] * 2, res
    kv = fresh(root)
    assert kv.newest_version().result(T) == 2
    assert txns_objects(root) == ["txns/step-7/result"]  # repaired, and the rest cleaned
    # ... and it is still reported once everything but the result is gone
    res = [outcome(p) for p in [start(root, i, 2, "step-7", 60, "A") for i in range(2)]]
    assert [r.get("version") for r in res] == [2, 2], res

    # other data under the same id is refused: the id is not reusable
    res = [outcome(p) for p in [start(root, i, 2, "step-7", 30, "B") for i in range(2)]]
    assert all(r.get("error") == "InvalidArgumentError" and "must not be reused" in r["message"]
               for r in res), res
    kv = fresh(root)
    assert kv.newest_version().result(T) == 2
    assert kv.read("shard1/0").result(T).value == value("A", 1, 0)


def test_process_0_retrying_after_its_commit_gets_the_same_commit_info() -> None:
    kv = VersionedKvStore(MemoryKvStore())

    def save(i: int, data: bytes) -> tsp.Transaction:
        return staged(kv, "r", i, 2, {f"p{i}": data}, timeout=30)

    t1 = save(1, b"1")
    fut1 = t1.commit()
    first = save(0, b"0").commit().result(T)
    assert fut1.result(T).version == first.version == 1
    again = save(0, b"0").commit().result(T)  # the same writes: the same commit
    assert (again.version, again.write_id) == (first.version, first.write_id)
    with pytest.raises(InvalidArgumentError, match="must not be reused"):
        save(0, b"other").commit().result(T)
    assert kv.newest_version().result(T) == 1
