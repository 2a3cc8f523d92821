"""The s3 store against a real S3-compatible server (moto's server mode on
127.0.0.1): the conformance suite (plain, versioned, under a path with multipart
uploads), a multi-process CAS race, what the server honours, checksums, specs."""

from __future__ import annotations

import base64
import multiprocessing
import os
import pickle
from collections.abc import Iterator
from typing import Any

import crc32c
import pytest

import tensorstore_py as tsp
from tensorstore_py.core.future import run_sync
from tensorstore_py.errors import (
    ChecksumError,
    ConditionFailedError,
    InvalidSpecError,
    NotFoundError,
    UnsupportedError,
)
from tensorstore_py.kvstore.registry import spec_from_url
from tensorstore_py.kvstore.s3 import S3KvStore
from tensorstore_py.testing.fault_proxy import FaultProxy
from tensorstore_py.testing.kvstore import KvStoreConformance, cas_increment_worker
from tensorstore_py.testing.s3_server import S3Server

T = 60
#: multipart from 1 MiB on, in 5 MiB parts (S3's smallest): the suite's 3 MiB value
#: goes up as a multipart upload
MULTIPART = {"multipart_threshold": 1 << 20, "part_size": 5 << 20}


class TestS3Conformance(KvStoreConformance):
    #: without bucket versioning the generation is the ETag, the content's MD5
    unique_generations = False

    @pytest.fixture
    def store(self, s3_server: S3Server) -> tsp.KvStore:
        return tsp.KvStore.open(s3_server.spec(s3_server.create_bucket())).result(T)


class TestS3VersionedConformance(KvStoreConformance):
    """A versioned bucket: every write gets a new generation (ETag + version id)."""

    @pytest.fixture
    def store(self, s3_server: S3Server) -> tsp.KvStore:
        bucket = s3_server.create_bucket(versioning=True)
        return tsp.KvStore.open(s3_server.spec(bucket)).result(T)


class TestS3MultipartUnderPathConformance(KvStoreConformance):
    """Rooted under a prefix with a neighbour that must survive; large values in parts."""

    unique_generations = False
    race_increments = 10

    @pytest.fixture
    def store(self, s3_server: S3Server) -> Iterator[tsp.KvStore]:
        bucket = s3_server.create_bucket()
        outside = S3KvStore.from_spec(s3_server.spec(bucket))
        outside.write("root/prefix-sibling", b"keep me").result(T)
        yield tsp.KvStore.open(s3_server.spec(bucket, path="root/prefix", extra=MULTIPART)).result(T)
        left = [k for k in outside.list().result(T) if not k.startswith("root/prefix/")]
        assert left == ["root/prefix-sibling"]


@pytest.fixture
def bucket(s3_server: S3Server) -> str:
    return s3_server.create_bucket()


@pytest.fixture
def kv(s3_server: S3Server, bucket: str) -> S3KvStore:
    return S3KvStore.from_spec(s3_server.spec(bucket))


def test_cas_race_across_processes(s3_server: S3Server, bucket: str, kv: S3KvStore) -> None:
    """4 spawned processes x 40 compare-and-swap increments: exactly 160."""
    kv.write("counter", b"0", if_equal=tsp.Generation.NO_VALUE).result(T)
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        lost = pool.starmap(cas_increment_worker, [(kv.spec(), "counter", 40)] * 4)
    assert bytes(kv.read("counter").result(T).value) == b"160"
    print("lost races per process:", lost)


# -- what the server honours (if one of these changes, revisit s3_server.py's notes) -------
def test_what_moto_honours(s3_server: S3Server, bucket: str, kv: S3KvStore) -> None:
    kv.write("k", b"v").result(T)
    put = lambda h: s3_server.request("PUT", f"/{bucket}/k", b"x", h)[0]  # noqa: E731
    assert put({"If-None-Match": "*"}) == 412
    assert put({"If-Match": '"0123"'}) == 412
    assert s3_server.request("PUT", f"/{bucket}/absent", b"x", {"If-Match": '"0123"'})[0] == 404
    assert s3_server.request("DELETE", f"/{bucket}/k", None, {"If-Match": '"0123"'})[0] == 412
    assert s3_server.request("DELETE", f"/{bucket}/absent", None, {"If-Match": '"0123"'})[0] == 404
    # CompleteMultipartUpload: If-None-Match is honoured, If-Match is NOT (hence the
    # spec's multipart_if_match: false for this server)
    for header, expect in (({"If-None-Match": "*"}), 412), (({"If-Match": '"0123"'}), 200):
        status, _, body = s3_server.request("POST", f"/{bucket}/k?uploads", b"")
        upload = body.split(b"<UploadId>")[1].split(b"</UploadId>")[0].decode()
        status, headers, _ = s3_server.request(
            "PUT", f"/{bucket}/k?partNumber=1&uploadId={upload}", b"p" * (5 << 20))
        etag = headers["ETag"]
        xml = (f"<CompleteMultipartUpload><Part><PartNumber>1</PartNumber><ETag>{etag}</ETag>"
               "</Part></CompleteMultipartUpload>").encode()
        status, _, _ = s3_server.request("POST", f"/{bucket}/k?uploadId={upload}", xml,
                                         {**header, "Content-Type": "application/xml"})
        assert status == expect, header


def test_large_values_go_up_in_parts(s3_server: S3Server, bucket: str, kv: S3KvStore) -> None:
    """13 MiB in 5 MiB parts: create + 3 parts + complete; conditions hold on the
    completion (create-only) or through a single PUT (CAS, as moto lacks If-Match
    on CompleteMultipartUpload)."""
    data = os.urandom(13 << 20)
    with FaultProxy(s3_server.endpoint, fault_rate=0.0) as proxy:
        big = S3KvStore.from_spec(s3_server.spec(bucket, extra={
            **MULTIPART, "endpoint_url": proxy.endpoint}))
        g = big.write("big", data, if_equal=tsp.Generation.NO_VALUE).result(T)
        assert proxy.counters()["requests"] == 5
        assert proxy.counters()["bytes_forwarded"] < len(data) + 64 * 1024
        assert g.token.endswith(b"-3")  # a multipart ETag names its part count
        with pytest.raises(ConditionFailedError):
            big.write("big", b"small", if_equal=tsp.Generation.NO_VALUE).result(T)
        g2 = big.write("big", data[::-1], if_equal=g).result(T)  # one PUT: If-Match honoured
        with pytest.raises(ConditionFailedError):
            big.write("big", data, if_equal=g).result(T)
    r = kv.read("big").result(T)
    assert bytes(r.value) == data[::-1] and r.generation == g2


def test_failed_parts_are_resent_alone(s3_server: S3Server, bucket: str, kv: S3KvStore) -> None:
    """A 25 MiB value (5 parts) whose part uploads meet a lost answer, a truncated
    one and a reset: each failed part is resent alone, so the bytes sent upstream
    stay far under one resend of everything per failure."""
    data = os.urandom(25 << 20)
    with FaultProxy(s3_server.endpoint, fault_rate=0.0) as proxy:
        proxy.script([None, "lost_response", "truncate", "reset"])  # create, then 3 parts
        big = S3KvStore.from_spec(s3_server.spec(bucket, extra={
            **MULTIPART, "endpoint_url": proxy.endpoint,
            "retries": {"max_attempts": 25, "initial_delay": 0.002, "max_delay": 0.05}}))
        big.write("big", data, if_equal=tsp.Generation.NO_VALUE).result(T)
        c = proxy.counters()
    assert bytes(kv.read("big").result(T).value) == data
    assert c["faults"] == 3, c
    print("multipart through faults:", c)
    assert c["bytes_forwarded"] < len(data) + 3 * (5 << 20) + (1 << 20), c


# -- checksums ----------------------------------------------------------------------------
def _b64_crc32c(data: bytes) -> str:
    return base64.b64encode(crc32c.crc32c(data).to_bytes(4, "big")).decode()


def test_crc32c_is_sent_and_stored(s3_server: S3Server, bucket: str, kv: S3KvStore) -> None:
    for key, data in (("small", b"hello"), ("multi", os.urandom(6 << 20))):
        store = S3KvStore.from_spec(s3_server.spec(bucket, extra=MULTIPART))
        store.write(key, data).result(T)
        status, headers, body = s3_server.request(
            "GET", f"/{bucket}/{key}", None, {"x-amz-checksum-mode": "ENABLED"})
        assert status == 200 and body == data
        assert headers.get("x-amz-checksum-crc32c") == _b64_crc32c(data), (key, headers)


def test_checksum_mismatch_is_reported(s3_server: S3Server, bucket: str, kv: S3KvStore) -> None:
    """An object whose stored crc32c does not match its bytes (moto does not verify
    what a client sends, so one can be planted): ChecksumError naming the key."""
    status, _, _ = s3_server.request("PUT", f"/{bucket}/bad", b"the stored bytez", {
        "x-amz-sdk-checksum-algorithm": "CRC32C",
        "x-amz-checksum-crc32c": _b64_crc32c(b"the stored bytes")})
    assert status == 200
    with pytest.raises(ChecksumError, match=f"s3://{bucket}/bad"):
        kv.read("bad").result(T)
    # a ranged read can not be checked against the whole-object checksum
    assert bytes(kv.read("bad", byte_range=slice(0, 3)).result(T).value) == b"the"


def test_large_body_checksum_mismatch_is_reported(s3_server: S3Server, bucket: str,
                                                  kv: S3KvStore) -> None:
    """A body of several MiB (it lands in a buffer as it arrives, its crc32c
    computed on the way) that does not match its stored crc32c: ChecksumError."""
    good = os.urandom(3 << 20)
    bad = good[:-1] + bytes([good[-1] ^ 1])
    status, _, _ = s3_server.request("PUT", f"/{bucket}/bad", bad, {
        "x-amz-sdk-checksum-algorithm": "CRC32C", "x-amz-checksum-crc32c": _b64_crc32c(good)})
    assert status == 200
    with pytest.raises(ChecksumError, match=rf"s3://{bucket}/bad.*3145728 bytes"):
        kv.read("bad").result(T)
    kv.write("good", good).result(T)
    assert bytes(kv.read("good").result(T).value) == good
    assert bytes(kv.read("bad", byte_range=slice(5, 1 << 21)).result(T).value) == bad[5: 1 << 21]


def test_crc64nvme(s3_server: S3Server, bucket: str) -> None:
    pytest.importorskip("awscrt")
    from awscrt import checksums

    kv = S3KvStore.from_spec(s3_server.spec(bucket, extra={"checksum": "crc64nvme"}))
    kv.write("k", b"hello").result(T)
    _, headers, _ = s3_server.request("GET", f"/{bucket}/k", None, {"x-amz-checksum-mode": "ENABLED"})
    expected = base64.b64encode(checksums.crc64nvme(b"hello").to_bytes(8, "big")).decode()
    assert headers.get("x-amz-checksum-crc64nvme") == expected
    assert bytes(kv.read("k").result(T).value) == b"hello"


# -- generations --------------------------------------------------------------------------
def test_generations_with_and_without_versioning(s3_server: S3Server) -> None:
    plain = S3KvStore.from_spec(s3_server.spec(s3_server.create_bucket()))
    g1, g2 = (plain.write("k", b"same").result(T) for _ in range(2))
    assert g1 == g2  # the ETag is the content's MD5: documented
    versioned = S3KvStore.from_spec(s3_server.spec(s3_server.create_bucket(versioning=True)))
    v1, v2 = (versioned.write("k", b"same").result(T) for _ in range(2))
    assert v1 != v2 and b"#" in v1.token
    assert versioned.read("k", if_not_equal=v1).result(T).state == "value"
    assert versioned.read("k", if_not_equal=v2).result(T).state == "unchanged"


# -- listing -------------------------------------------------------------------------------
def test_list_paginates(s3_server: S3Server, bucket: str) -> None:
    with FaultProxy(s3_server.endpoint, fault_rate=0.0) as proxy:
        kv = S3KvStore.from_spec(s3_server.spec(bucket, extra={"endpoint_url": proxy.endpoint}))
        kv.list_page_size = 3
        keys = [f"p/{i:02d}" for i in range(10)] + ["q/0", "p/odd key+&=?"]
        for f in [kv.write(k, k.encode()) for k in keys]:
            f.result(T)
        proxy.reset_counters()
        assert kv.list("p/").result(T) == sorted(k for k in keys if k.startswith("p/"))
        assert proxy.counters()["requests"] == 4  # 3 + 3 + 3 + 2
        infos = kv.list_info("q/").result(T)
        assert [(i.key, i.size) for i in infos] == [("q/0", 3)] and infos[0].mtime is not None


# -- specs, URLs, bad input ----------------------------------------------------------------
def test_url_to_spec() -> None:
    assert spec_from_url("s3://my-bucket/a/b/") == {"driver": "s3", "bucket": "my-bucket",
                                                     "path": "a/b/"}


@pytest.mark.parametrize("url", ["s3://", "s3:///p", "s3://Upper/x", "s3://a/x", "s3://ok-bucket/x?y=1"])
def test_bad_urls(url: str) -> None:
    with pytest.raises(InvalidSpecError):
        tsp.KvStore.open(url).result(T)


@pytest.mark.parametrize("extra", [
    {"bucket": "ab"}, {"colour": "red"}, {"concurrency": 0}, {"credentials": "mine"},
    {"retries": {"tries": 3}}, {"endpoint_url": "ftp://x"}, {"endpoint_url": "http://h/p"},
    {"addressing_style": "sideways"}, {"part_size": 1024}, {"multipart_threshold": 0},
    {"checksum": "md5"}, {"multipart_if_match": "yes"}, {"path": "a/../b"}, {"region": ""},
])
def test_bad_specs(extra: dict[str, Any]) -> None:
    spec = {"driver": "s3", "bucket": "fine-bucket", "path": "", "endpoint_url": "http://127.0.0.1:1"}
    spec.update(extra)
    with pytest.raises(InvalidSpecError):
        tsp.KvStore.open(spec).result(T)


def test_spec_round_trip_repr_and_pickle(s3_server: S3Server, bucket: str) -> None:
    spec = s3_server.spec(bucket, path="a/b/", extra={
        "concurrency": 4, "addressing_style": "path", "credentials": "default",
        "retries": {"max_attempts": 3, "initial_delay": 0.01, "max_delay": 0.5}})
    kv = tsp.KvStore.open(spec).result(T)
    assert kv.spec() == spec
    assert repr(kv) == f"KvStore({kv.spec()!r})" and "'concurrency': 4" in repr(kv)
    assert kv.url() == f"s3://{bucket}/a/b/"
    assert tsp.KvStore.open(kv.spec()).result(T) == kv
    kv.write("x", b"1").result(T)
    unpickled = pickle.loads(pickle.dumps(kv.with_path("sub")))
    assert unpickled.spec()["path"] == "a/b/sub/"
    unpickled.write("y", b"2").result(T)
    assert bytes(kv.read("sub/y").result(T).value) == b"2"


def test_addressing_styles() -> None:
    aws = S3KvStore(bucket="my-bucket", region="eu-west-1", credentials="anonymous")
    assert str(aws._url("a b/c")) == "https://my-bucket.s3.eu-west-1.amazonaws.com/a%20b/c"
    dotted = S3KvStore(bucket="my.bucket", region="eu-west-1", credentials="anonymous")
    assert str(dotted._url("k")) == "https://s3.eu-west-1.amazonaws.com/my.bucket/k"
    minio = S3KvStore(bucket="b-1", endpoint_url="http://minio:9000", credentials="anonymous")
    assert str(minio._url(None, {"list-type": 2})) == "http://minio:9000/b-1?list-type=2"
    vhost = S3KvStore(bucket="b-1", endpoint_url="https://r2.example", addressing_style="virtual",
                      credentials="anonymous")
    assert str(vhost._url("k", {"uploads": None})) == "https://b-1.r2.example/k?uploads"


def test_endpoint_from_environment(s3_server: S3Server, bucket: str,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server.endpoint)
    kv = tsp.KvStore.open(f"s3://{bucket}/env/").result(T)
    assert kv.spec() == {"driver": "s3", "bucket": bucket, "path": "env/"}
    kv.write("k", b"via env").result(T)
    direct = S3KvStore.from_spec(s3_server.spec(bucket))
    assert bytes(direct.read("env/k").result(T).value) == b"via env"


def test_missing_bucket(s3_server: S3Server) -> None:
    kv = S3KvStore.from_spec(s3_server.spec("no-such-bucket-here"))
    for op in (lambda: kv.read("k"), lambda: kv.list(), lambda: kv.write("k", b"x")):
        with pytest.raises(NotFoundError, match="no-such-bucket-here"):
            op().result(T)


def test_conditional_delete_can_be_refused_honestly(s3_server: S3Server, bucket: str) -> None:
    kv = S3KvStore.from_spec(s3_server.spec(bucket, extra={"conditional_delete": False}))
    g = kv.write("k", b"v").result(T)
    with pytest.raises(UnsupportedError, match="conditional_delete"):
        kv.delete("k", if_equal=g).result(T)
    assert bytes(kv.read("k").result(T).value) == b"v"
    kv.delete("k").result(T)
    assert kv.read("k").result(T).state == "missing"


def test_compare_and_swap_of_more_than_5_gib_without_multipart_if_match() -> None:
    """Refused before any request (the server is unreachable; no 5 GiB buffer is
    made: an object that only reports its length stands in for the value)."""
    kv = S3KvStore(bucket="b-1", endpoint_url="http://127.0.0.1:1", credentials="anonymous",
                   multipart_if_match=False)
    huge = type("Huge", (), {"__len__": lambda self: (5 << 30) + 1})()
    with pytest.raises(UnsupportedError, match="multipart_if_match"):
        run_sync(kv._write("k", huge, tsp.Generation(b"abc")), T)
