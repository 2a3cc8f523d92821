"""A transaction's staged values are packed into data objects when they pass
the staging limit (16 MiB), during the write that passes it. When that upload
fails, the write raises, and the transaction goes on: the values it had staged
must stay staged as values, never as entries naming a data object that was
never written. On gcs and s3 the writer's lease vouches for its own data
objects at commit (nothing is read back), so such an entry would commit a
version whose values are gone.
"""

from __future__ import annotations

from typing import Any

import pytest

import tensorstore_py as tsp
from tensorstore_py.errors import StorageError
from tensorstore_py.kvstore.fault import FaultKvStore
from tensorstore_py.kvstore.memory import MemoryKvStore
from tensorstore_py.kvstore.versioned import VersionedKvStore
from tensorstore_py.kvstore.versioned.verify import verify
from tensorstore_py.testing.fault_proxy import FaultProxy

T = 120
VALUE = b"v" * 200_000  # staged (packed at commit or at the staging limit), not inline
KEYS = 90  # 18 MB: the staging limit is passed once


class _DataUploadsFail(FaultProxy):
    """Answers 503 to every upload of a data object while ``failing`` is set."""

    failing = False

    async def _serve(self, writer: Any, request: bytes, kind: str | None, release: Any,
                     keep_alive: bool = False) -> bool:
        if self.failing and request.startswith(b"POST") and b"/data/" in request[:4096]:
            kind = "503"
        return await super()._serve(writer, request, kind, release, keep_alive)


def _stage_until_the_flush_fails(view: Any) -> int:
    """Write KEYS values; the index of the write whose flush failed."""
    for i in range(KEYS):
        try:
            view.write(f"a{i:02d}", VALUE).result(T)
        except StorageError:
            return i
    raise AssertionError("no write passed the staging limit")


def _check_committed(reader: Any, failed: int) -> None:
    for i in range(KEYS):
        res = reader.read(f"a{i:02d}").result(T)
        if i < failed:
            assert res.value == VALUE, i
        else:
            assert res.state == "missing", i  # the failed write and those never issued


def test_a_transaction_whose_staging_flush_failed_commits_every_value_it_references(gcs_emulator: Any) -> None:
    bucket = gcs_emulator.create_bucket()
    direct = gcs_emulator.spec(bucket, path="v/")
    with _DataUploadsFail(gcs_emulator.endpoint, fault_rate=0.0) as proxy:
        quick = {"max_attempts": 2, "initial_delay": 0.01, "max_delay": 0.02}  # each upload fails fast
        kv = tsp.KvStore.open({"driver": "versioned",
                               "base": {**direct, "endpoint": proxy.endpoint, "retries": quick}}).result(T)
        kv.write("k", b"old").result(T)
        txn = tsp.Transaction()
        proxy.failing = True
        failed = _stage_until_the_flush_fails(kv.with_transaction(txn))
        proxy.failing = False
        info = txn.commit().result(T)
    reader = tsp.KvStore.open({"driver": "versioned", "base": direct}).result(T)
    assert reader.newest_version().result(T) == 2
    _check_committed(reader, failed)
    assert info.keys_changed == failed
    assert verify(reader).result(T) == []


def test_a_failed_staging_flush_leaves_the_values_staged_and_the_failed_write_undone() -> None:
    mem = MemoryKvStore()
    fault = FaultKvStore(mem)
    kv = VersionedKvStore(fault)
    kv.write("k", b"old").result(T)
    txn = tsp.Transaction()
    view = kv.with_transaction(txn)
    fault.inject(op="write", key_pattern="data/*", times=100)
    failed = _stage_until_the_flush_fails(view)
    fault.clear()
    assert view.read("a00").result(T).value == VALUE  # still staged, still readable
    assert view.read(f"a{failed:02d}").result(T).state == "missing"
    txn.commit().result(T)
    _check_committed(VersionedKvStore(mem), failed)


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_write_whose_flush_failed_leaves_its_key_as_it_was(overwrite: bool) -> None:
    mem = MemoryKvStore()
    fault = FaultKvStore(mem)
    kv = VersionedKvStore(fault)
    txn = tsp.Transaction()
    view = kv.with_transaction(txn)
    if overwrite:
        view.write("last", b"before").result(T)
    for i in range(83):  # 16.6 MB staged: the next write passes the limit (16 MiB)
        view.write(f"a{i:02d}", VALUE).result(T)
    fault.inject(op="write", key_pattern="data/*", times=100)
    with pytest.raises(StorageError):
        view.write("last", VALUE).result(T)
    fault.clear()
    expected = b"before" if overwrite else None
    res = view.read("last").result(T)
    assert (res.value if res.state == "value" else None) == expected
    txn.commit().result(T)
    res = VersionedKvStore(mem).read("last").result(T)
    assert (res.value if res.state == "value" else None) == expected
