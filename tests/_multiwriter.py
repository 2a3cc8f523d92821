"""Helpers for multi-writer transaction tests: participants as threads of this process."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import tensorstore_py as tsp
from tensorstore_py.kvstore.base import KvStore

T = 60


def in_threads(n: int, body: Callable[[int], Any]) -> list[Any]:
    """Run ``body(i)`` for i in 0..n-1 in n threads; each one's result or exception."""
    out: list[Any] = [None] * n

    def run(i: int) -> None:
        try:
            out[i] = body(i)
        except Exception as e:
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(T)
    return out


def staged(kv: KvStore, txn_id: str, index: int, count: int, writes: dict[str, bytes | None],
           **options: Any) -> tsp.Transaction:
    """Process ``index`` of ``count`` of transaction ``txn_id`` with ``writes``
    staged (None deletes), not committed yet."""
    txn = tsp.Transaction(txn_id=txn_id, process_index=index, process_count=count, **options)
    v = kv.with_transaction(txn)
    for k, value in writes.items():
        (v.delete(k) if value is None else v.write(k, value)).result(T)
    return txn
