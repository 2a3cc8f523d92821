"""Group members by delimiter listing: a group over many chunk keys is listed in a
handful of requests on GCS and S3 (counted at a loopback proxy in front of the real
test servers), not one page per 1,000 keys."""

from __future__ import annotations

from typing import Any

import pytest

import tensorstore_py as tsp
from tensorstore_py.kvstore.base import KvStore
from tensorstore_py.testing.fault_proxy import FaultProxy

T = 120


def _fill_group(kv: KvStore, chunks: int) -> None:
    """A zarr3 group with an array ``img`` of ``chunks`` chunk keys, an empty array
    ``mask``, a subgroup ``sub`` and a folder ``junk/`` that is neither."""
    tsp.open_group(kv, create=True).result(T)
    for name in ("img", "mask"):
        tsp.open({"driver": "zarr3", "kvstore": kv.with_path(name + "/")}, create=True,
                 shape=(chunks, 1), dtype="uint8", chunks=(1, 1)).result(T)
    tsp.open_group(kv.with_path("sub/"), create=True).result(T)
    kv.write("junk/x", b"x").result(T)
    pending = [kv.write(f"img/c/{i}/0", b"\x01") for i in range(chunks)]
    for f in pending:
        f.result(T)


def _members_requests(upstream: str, spec: dict[str, Any], endpoint_field: str, page: int,
                      chunks: int) -> int:
    with FaultProxy(upstream, fault_rate=0.0) as proxy:
        kv = tsp.KvStore.open({**spec, endpoint_field: proxy.endpoint}).result(T)
        kv.list_page_size = page
        group = tsp.open_group(kv).result(T)
        proxy.reset_counters()
        members = group.members().result(T)
        n = proxy.counters()["requests"]
    print(f"members of a group over {chunks} chunk keys: {n} requests")
    assert members == {"img": "array", "mask": "array", "sub": "group"}
    return n


@pytest.mark.parametrize("chunks,page", [(1200, 50), pytest.param(24000, 1000, marks=pytest.mark.slow)])
def test_gcs_group_members_in_a_handful_of_requests(gcs_emulator: Any, chunks: int, page: int) -> None:
    spec = gcs_emulator.spec(gcs_emulator.create_bucket(), path="vol/")
    direct = tsp.KvStore.open(spec).result(T)
    _fill_group(direct, chunks)
    # one delimiter listing, then zarr.json of 4 children and the other documents of junk/
    assert _members_requests(gcs_emulator.endpoint, spec, "endpoint", page, chunks) == 1 + 4 + 3


@pytest.mark.parametrize("chunks,page", [(600, 25), pytest.param(24000, 1000, marks=pytest.mark.slow)])
def test_s3_group_members_in_a_handful_of_requests(s3_server: Any, chunks: int, page: int) -> None:
    spec = s3_server.spec(s3_server.create_bucket(), path="vol/")
    direct = tsp.KvStore.open(spec).result(T)
    _fill_group(direct, chunks)
    assert _members_requests(s3_server.endpoint, spec, "endpoint_url", page, chunks) == 1 + 4 + 3


def test_cli_finds_arrays_without_listing_their_chunks(gcs_emulator: Any, monkeypatch: Any) -> None:
    """What the CLI resolves a folder URL to and the arrays it finds there (inspect,
    verify, copy), by folder listings that never enter an array's folder."""
    import asyncio

    from tensorstore_py.commands.target import list_arrays, resolve
    from tensorstore_py.kvstore.gcs import GcsKvStore

    bucket = gcs_emulator.create_bucket()
    spec = gcs_emulator.spec(bucket, path="vol/")
    _fill_group(tsp.KvStore.open(spec).result(T), 600)
    monkeypatch.setattr(GcsKvStore, "list_page_size", 25)
    with FaultProxy(gcs_emulator.endpoint, fault_rate=0.0) as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.endpoint)

        async def run() -> Any:
            target = await resolve(f"gs://{bucket}/vol/")
            return target.kind, await list_arrays(target.store)

        proxy.reset_counters()
        kind, arrays = asyncio.run(run())
        n = proxy.counters()["requests"]
    print(f"CLI resolve + list_arrays over 600 chunk keys: {n} requests")
    assert kind == "folder"
    assert arrays == [("img", "zarr3"), ("mask", "zarr3")]
    assert n <= 20  # 600 chunk keys at 25 per page would be 24 pages for each listing


def test_versioned_store_and_transactions_list_folders(tmp_path: Any) -> None:
    """Stores without a delimiter listing (the versioned store, a transaction's view)
    group their keys; a transaction sees its own staged keys."""
    kv = tsp.KvStore.open(f"versioned+file://{tmp_path}/v/").result(T)
    for k in ("a/1", "a/b/2", "c", "d/e/f"):
        kv.write(k, b"x").result(T)
    top = kv.list_folder().result(T)
    assert (top.keys, top.folders) == (["c"], ["a/", "d/"])
    txn = tsp.Transaction()
    view = kv.with_transaction(txn)
    view.write("a/new", b"y").result(T)
    view.delete("a/1").result(T)
    a = view.list_folder("a/").result(T)
    assert (a.keys, a.folders) == (["a/new"], ["a/b/"])
    assert kv.list_folder("a/").result(T).keys == ["a/1"]
    _fill_group(kv.with_path("g/"), 20)
    assert tsp.open_group(kv.with_path("g/")).result(T).members().result(T) == {
        "img": "array", "mask": "array", "sub": "group"}
