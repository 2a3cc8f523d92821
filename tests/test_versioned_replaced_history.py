"""A store deleted and recreated at the same place under a process that still
holds an open transaction on it: the transaction read the old history, so it
must never commit on the new one (its conflict check compares versions above
the one it read, and the new history's changes at or below that number would
be overwritten unchecked: a lost update). Another process recreates the store,
for real, on the file store.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import tensorstore_py as tsp
from tensorstore_py.errors import ConflictError

T = 60

_RECREATE = """
import sys, tensorstore_py as tsp
kv = tsp.KvStore.open(sys.argv[1]).result()
for i in range(int(sys.argv[2])):
    # the counter first: at a version no higher than the one the transaction read
    kv.write("counter" if i == 0 else "other%d" % i, b"100").result()
"""


def _recreate(path: Path, url: str, versions: int) -> None:
    """Delete the store and let another process commit ``versions`` versions into a new one."""
    shutil.rmtree(path)
    subprocess.run([sys.executable, "-c", _RECREATE, url, str(versions)], check=True, timeout=120)


def _store_with_counter(path: Path) -> tuple[str, tsp.KvStore]:
    url = f"versioned+file://{path}/"
    kv = tsp.KvStore.open(url).result(T)
    for i in range(3):
        kv.write("counter", b"%d" % (i + 1)).result(T)  # version 3: counter = 3
    return url, kv


@pytest.mark.parametrize("versions", [1, 3, 4], ids=["shorter", "as-long", "longer"])
def test_a_transaction_that_read_a_deleted_store_never_commits_on_its_replacement(
        tmp_path: Path, versions: int) -> None:
    path = tmp_path / "s"
    url, kv = _store_with_counter(path)
    txn = tsp.Transaction()
    view = kv.with_transaction(txn)
    count = int(view.read("counter").result(T).value)  # pins version 3 of the old store
    assert count == 3
    _recreate(path, url, versions)
    view.write("counter", b"%d" % (count + 1)).result(T)
    with pytest.raises(ConflictError, match=r"version 3, which this transaction read, is no longer"):
        txn.commit().result(T)
    fresh = tsp.KvStore.open(url).result(T)
    assert fresh.newest_version().result(T) == versions  # nothing committed
    assert fresh.read("counter").result(T).value == b"100"
    # the process reads the new store, and a new transaction commits on it
    txn = tsp.Transaction()
    view = kv.with_transaction(txn)
    view.write("counter", b"%d" % (int(view.read("counter").result(T).value) + 1)).result(T)
    txn.commit().result(T)
    assert tsp.KvStore.open(url).result(T).read("counter").result(T).value == b"101"


def test_parts_staged_from_a_deleted_store_are_not_committed_on_its_replacement(tmp_path: Path) -> None:
    # the Dask path: a worker stages what it computed from version 3; the store
    # is replaced before the staged parts are committed
    from tensorstore_py.kvstore.versioned.staging import commit_staged, stage

    path = tmp_path / "s"
    url, kv = _store_with_counter(path)
    txn = tsp.Transaction()
    view = kv.with_transaction(txn)
    view.write("counter", b"%d" % (int(view.read("counter").result(T).value) + 1)).result(T)
    part = stage(txn, kv).result(T)
    _recreate(path, url, 3)
    with pytest.raises(ConflictError, match=r"version 3, which this transaction read, is no longer"):
        commit_staged(kv, [part]).result(T)
    fresh = tsp.KvStore.open(url).result(T)
    assert fresh.newest_version().result(T) == 3
    assert fresh.read("counter").result(T).value == b"100"


def test_a_replaced_store_is_noticed_after_its_newest_record_left_the_record_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the process read many older records since it last looked at the newest
    # one (history browsing), so the newest left the bounded record cache: the
    # next probe must still notice that the store was replaced, or reads of an
    # older version return the deleted store's bytes from the cache
    from tensorstore_py.kvstore.versioned import root as root_module

    monkeypatch.setattr(root_module, "RECORD_CACHE", 4)  # a small cache: 8 versions overflow it
    path = tmp_path / "s"
    url = f"versioned+file://{path}/"
    kv = tsp.KvStore.open(url).result(T)
    for i in range(8):
        kv.write("k", b"old %d" % i).result(T)
    assert kv.snapshot(2).read("k").result(T).value == b"old 1"
    for v in range(8, 0, -1):
        kv.changed_keys(v).result(T)  # the newest record (8) left the cache
    shutil.rmtree(path)
    subprocess.run([sys.executable, "-c", """
import sys, tensorstore_py as tsp
kv = tsp.KvStore.open(sys.argv[1]).result()
for i in range(8):
    kv.write("k", b"new %d" % i).result()
""", url], check=True, timeout=120)
    assert kv.newest_version().result(T) == 8
    assert kv.snapshot(2).read("k").result(T).value == b"new 1"
    assert kv.read("k").result(T).value == b"new 7"
