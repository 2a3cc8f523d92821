"""Large commits: many deletes in one transaction rebalance the tree correctly.

The tree writer merges underfull nodes it emitted in the same commit; those are
not on storage yet, so it must read them from its own table, never through the
bounded node cache shared by the root (which may have evicted them).
"""

from __future__ import annotations

from typing import Any

import pytest

import tensorstore_py as tsp
from tensorstore_py.kvstore.memory import MemoryKvStore
from tensorstore_py.kvstore.versioned import VersionedKvStore
from tensorstore_py.kvstore.versioned.verify import verify

T = 300


def _load(kv: VersionedKvStore, n: int) -> None:
    with tsp.Transaction() as txn:
        v = kv.with_transaction(txn)
        for f in [v.write(f"k{i:07d}", b"%d" % i) for i in range(n)]:
            f.result(T)


def _delete_90_percent(kv: VersionedKvStore, n: int) -> None:
    with tsp.Transaction() as txn:
        v = kv.with_transaction(txn)
        for f in [v.delete(f"k{i:07d}") for i in range(n) if i % 10]:
            f.result(T)


def _check(kv: VersionedKvStore, n: int) -> None:
    keep = [f"k{i:07d}" for i in range(0, n, 10)]
    assert kv.list().result(T) == keep
    for i in (0, 10, n // 2 - n // 2 % 10, n - 10):
        assert kv.read(f"k{i:07d}").result(T).value == b"%d" % i
    assert kv.read("k0000001").result(T).state == "missing"
    assert verify(kv).result(T) == []


def test_deleting_90_percent_in_one_transaction_with_a_small_node_cache() -> None:
    """12k keys (~47 full leaves) and a node cache smaller than the nodes one
    commit emits: the rebalance of emitted-but-unwritten nodes used to reload
    evicted ones from storage and fail with "index node ... is missing"."""
    n = 12_000
    kv = VersionedKvStore(MemoryKvStore())
    kv._root.cache.capacity = 8
    _load(kv, n)
    _delete_90_percent(kv, n)
    _check(kv, n)


@pytest.mark.slow
def test_deleting_90_percent_of_400k_keys_in_one_transaction(tmp_path: Any) -> None:
    """The size of the report: 400k keys, the default 1024-node cache."""
    n = 400_000
    kv = VersionedKvStore(MemoryKvStore())
    _load(kv, n)
    _delete_90_percent(kv, n)
    _check(kv, n)
