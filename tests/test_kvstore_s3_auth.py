"""Credentials of the object stores: the AWS chain (environment, profile, instance
metadata served by the moto server), SigV4 on the wire, "auto" mode that looks
again instead of staying anonymous, and fail-fast DNS errors naming the
credentials (subprocesses of the real entry points)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tensorstore_py.errors import StorageError
from tensorstore_py.kvstore import _auth
from tensorstore_py.kvstore._gcs_auth import GcsAuth
from tensorstore_py.kvstore._s3_auth import _botocore_signed_headers
from tensorstore_py.kvstore._sigv4 import RESERVED_HEADERS, sigv4_headers
from tensorstore_py.kvstore.base import ByteRange, Generation
from tensorstore_py.kvstore.s3 import S3KvStore
from tensorstore_py.testing.credential_servers import ContainerCredentials
from tensorstore_py.testing.s3_server import S3Server

T = 60
_AWS_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
             "AWS_DEFAULT_PROFILE", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL",
             "AWS_ENDPOINT_URL_S3", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
             "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_WEB_IDENTITY_TOKEN_FILE")


@pytest.fixture
def no_aws(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    """An environment where the AWS chain finds nothing (no keys, files, metadata)."""
    for var in _AWS_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return monkeypatch


def _recorder(serve_app: Any, *, deny_anonymous: bool = False) -> tuple[str, list[dict[str, str]]]:
    """A loopback server that records each request's headers and answers like S3 for
    a missing key (403 to unsigned requests when ``deny_anonymous``)."""
    seen: list[dict[str, str]] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        if deny_anonymous and "Authorization" not in request.headers:
            return web.Response(status=403, body=b"<Error><Code>AccessDenied</Code></Error>")
        return web.Response(status=404, body=b"<Error><Code>NoSuchKey</Code></Error>")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    return serve_app(app).url, seen


def test_environment_credentials_sign_with_sigv4(serve_app: Any, no_aws: pytest.MonkeyPatch) -> None:
    url, seen = _recorder(serve_app)
    no_aws.setenv("AWS_ACCESS_KEY_ID", "AKIDENVIRONMENT")
    no_aws.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    no_aws.setenv("AWS_SESSION_TOKEN", "session-token")
    kv = S3KvStore(bucket="b-1", endpoint_url=url, region="eu-west-1")
    assert kv.read("k").result(T).state == "missing"
    auth = seen[0]["Authorization"]
    assert auth.startswith("AWS4-HMAC-SHA256 Credential=AKIDENVIRONMENT/")
    assert "/eu-west-1/s3/aws4_request" in auth and "SignedHeaders=" in auth
    assert seen[0]["X-Amz-Security-Token"] == "session-token"
    assert seen[0]["X-Amz-Content-SHA256"]  # the payload hash S3 requires
    assert "environment" in kv._auth.describe() or "env" in kv._auth.describe()


def test_profile_credentials_and_region(serve_app: Any, no_aws: pytest.MonkeyPatch,
                                        tmp_path: Path) -> None:
    url, seen = _recorder(serve_app)
    (tmp_path / "credentials").write_text(
        "[ml-team]\naws_access_key_id = AKIDPROFILE\naws_secret_access_key = s\n")
    (tmp_path / "config").write_text("[profile ml-team]\nregion = ap-south-1\n")
    no_aws.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    no_aws.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    kv = S3KvStore(bucket="b-1", endpoint_url=url, profile="ml-team")
    assert kv.region == "ap-south-1" and kv.spec()["profile"] == "ml-team"
    kv.read("k").result(T)
    assert seen[0]["Authorization"].startswith("AWS4-HMAC-SHA256 Credential=AKIDPROFILE/")
    assert "/ap-south-1/s3/" in seen[0]["Authorization"]
    with pytest.raises(StorageError, match="no-such-profile"):
        S3KvStore(bucket="b-1", endpoint_url=url, profile="no-such-profile",
                  credentials="default").read("k").result(T)


def test_stores_share_one_botocore_session_per_configuration(
        serve_app: Any, no_aws: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Stores opened one after another under one AWS configuration build ONE
    botocore session (about 10 ms of CPU each) between them; a changed variable
    or credentials file is seen by the next store opened, as before."""
    import botocore.session

    built: list[str | None] = []

    class CountedSession(botocore.session.Session):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            built.append(kwargs.get("profile"))
            super().__init__(*args, **kwargs)

    no_aws.setattr(botocore.session, "Session", CountedSession)
    url, seen = _recorder(serve_app)
    no_aws.setenv("AWS_ACCESS_KEY_ID", "AKIDFIRST")
    no_aws.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    for _ in range(3):
        assert S3KvStore(bucket="b-1", endpoint_url=url, region="eu-west-1").read("k").result(T).state \
            == "missing"
    assert len(built) == 1
    assert all(h["Authorization"].startswith("AWS4-HMAC-SHA256 Credential=AKIDFIRST/") for h in seen)
    no_aws.setenv("AWS_ACCESS_KEY_ID", "AKIDSECOND")
    S3KvStore(bucket="b-1", endpoint_url=url, region="eu-west-1").read("k").result(T)
    assert seen[-1]["Authorization"].startswith("AWS4-HMAC-SHA256 Credential=AKIDSECOND/")
    for key in ("AKIDTHIRD", "AKIDFOURTH"):  # a credentials file written again (same path)
        no_aws.delenv("AWS_ACCESS_KEY_ID", raising=False)
        no_aws.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
        (tmp_path / "creds").write_text(f"[default]\naws_access_key_id = {key}\naws_secret_access_key = s\n")
        no_aws.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "creds"))
        S3KvStore(bucket="b-1", endpoint_url=url, region="eu-west-1").read("k").result(T)
        assert seen[-1]["Authorization"].startswith(f"AWS4-HMAC-SHA256 Credential={key}/")
    assert len(built) == 4


def test_instance_metadata_credentials(s3_server: S3Server, no_aws: pytest.MonkeyPatch) -> None:
    """EC2 instance metadata (IMDSv2), served by the moto server itself."""
    no_aws.setenv("AWS_EC2_METADATA_DISABLED", "false")
    no_aws.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", s3_server.endpoint + "/")
    kv = S3KvStore.from_spec(s3_server.spec(s3_server.create_bucket(), extra={
        "credentials": "default"}))
    kv.write("k", b"signed by a role").result(T)
    assert bytes(kv.read("k").result(T).value) == b"signed by a role"
    assert "iam-role" in kv._auth.describe(), kv._auth.describe()


def test_stores_share_one_container_credentials_request(s3_server: S3Server,
                                                       no_aws: pytest.MonkeyPatch) -> None:
    """Temporary credentials from the container endpoint (as on ECS/EKS; instance
    metadata and assumed roles alike) are fetched once for every store of the
    configuration and all their concurrent first requests, not once per store."""
    bucket = s3_server.create_bucket()
    with ContainerCredentials(delay=0.3) as source:
        no_aws.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", source.full_uri)
        stores = [S3KvStore.from_spec(s3_server.spec(bucket, extra={"credentials": "default"}))
                  for _ in range(6)]
        writes = [kv.write(f"k{i}", b"v%d" % i) for i, kv in enumerate(stores)]
        for f in writes:
            f.result(T)
        later = S3KvStore.from_spec(s3_server.spec(bucket, extra={"credentials": "default"}))
        assert [bytes(later.read(f"k{i}").result(T).value) for i in range(6)] == \
            [b"v%d" % i for i in range(6)]
        assert source.counters() == {"requests": 1}
        assert "container-role" in later._auth.describe() and "...NER1" in later._auth.describe()
        # a new endpoint is a new configuration: looked up once more
        with ContainerCredentials() as other:
            no_aws.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", other.full_uri)
            for _ in range(2):
                S3KvStore.from_spec(s3_server.spec(bucket, extra={"credentials": "default"})) \
                    .read("k0").result(T)
            assert other.counters() == {"requests": 1}
        assert source.counters() == {"requests": 1}


def test_expiring_container_credentials_are_refreshed_once_for_all_stores(
        s3_server: S3Server, no_aws: pytest.MonkeyPatch) -> None:
    """Keys that come within botocore's refresh margin of their expiry are fetched
    again once, for every store of the configuration."""
    from botocore.credentials import RefreshableCredentials

    margin = 3.0
    bucket = s3_server.create_bucket()
    with ContainerCredentials(expires_in=RefreshableCredentials._advisory_refresh_timeout + margin,
                              delay=0.2) as source:
        no_aws.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", source.full_uri)
        stores = [S3KvStore.from_spec(s3_server.spec(bucket, extra={"credentials": "default"}))
                  for _ in range(4)]
        for i, kv in enumerate(stores):
            kv.write(f"k{i}", b"first").result(T)
        assert source.counters() == {"requests": 1}
        source.expires_in = 3600.0
        time.sleep(margin + 0.5)  # the first keys are within the margin now
        writes = [kv.write(f"k{i}", b"second") for i, kv in enumerate(stores)]
        for f in writes:
            f.result(T)
        assert [bytes(kv.read(f"k{i}").result(T).value) for i, kv in enumerate(stores)] == \
            [b"second"] * 4
        assert source.counters() == {"requests": 2}
        assert "...NER2" in stores[0]._auth.describe()


def test_auto_credentials_look_again_after_a_denial(serve_app: Any,
                                                    no_aws: pytest.MonkeyPatch) -> None:
    """"auto" found no credentials (anonymous); once credentials appear, the next
    access denial makes it look again instead of staying anonymous for good."""
    url, seen = _recorder(serve_app, deny_anonymous=True)
    kv = S3KvStore(bucket="b-1", endpoint_url=url, region="us-east-1")
    with pytest.raises(StorageError, match="403"):
        kv.read("k").result(T)
    assert all("Authorization" not in h for h in seen)
    no_aws.setenv("AWS_ACCESS_KEY_ID", "AKIDLATER")
    no_aws.setenv("AWS_SECRET_ACCESS_KEY", "s")
    assert kv.read("k").result(T).state == "missing"
    assert seen[-1]["Authorization"].startswith("AWS4-HMAC-SHA256 Credential=AKIDLATER/")


def test_gcs_auto_credentials_look_again(serve_app: Any, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The same policy for google-auth: no application-default credentials at
    first, a service-account file later (its token endpoint on loopback)."""
    crypto = pytest.importorskip("cryptography.hazmat.primitives.asymmetric.rsa")
    from cryptography.hazmat.primitives import serialization

    async def token(request: web.Request) -> web.Response:
        return web.json_response({"access_token": "tok", "expires_in": 3600, "token_type": "Bearer"})

    app = web.Application()
    app.router.add_post("/token", token)
    server = serve_app(app)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    monkeypatch.setenv("HOME", str(tmp_path))  # no gcloud configuration either
    monkeypatch.setenv("GCE_METADATA_HOST", "127.0.0.1:1")  # and no metadata server
    monkeypatch.setenv("GCE_METADATA_IP", "127.0.0.1:1")
    auth = GcsAuth("auto", anonymous=False)
    from tensorstore_py.core.future import run_sync

    assert run_sync(auth.headers("GET", "https://x", {}, None), T) == {}
    assert "no credentials found" in auth.describe()
    key = crypto.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption()).decode()
    creds = tmp_path / "sa.json"
    creds.write_text(json.dumps({
        "type": "service_account", "project_id": "p", "private_key_id": "k1", "private_key": pem,
        "client_email": "sa@p.iam.gserviceaccount.com", "client_id": "1",
        "token_uri": f"{server.url}/token"}))
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(creds))
    assert run_sync(auth.headers("GET", "https://x", {}, None), T) == {}  # still within the pause
    assert auth.invalidate(403)  # an access denial: look again now
    assert run_sync(auth.headers("GET", "https://x", {}, None), T) == {"Authorization": "Bearer tok"}
    assert "sa@p.iam.gserviceaccount.com" in auth.describe()


def test_auto_lookup_repeats_after_the_pause(no_aws: pytest.MonkeyPatch) -> None:
    kv = S3KvStore(bucket="b-1", endpoint_url="http://127.0.0.1:1", region="us-east-1")
    assert kv._auth._ensure() is None
    no_aws.setenv("AWS_ACCESS_KEY_ID", "AKIDAFTERPAUSE")
    no_aws.setenv("AWS_SECRET_ACCESS_KEY", "s")
    assert kv._auth._ensure() is None  # within RELOOKUP_SECONDS
    no_aws.setattr(_auth.time, "monotonic", lambda: 1e12)
    assert kv._auth._ensure().access_key == "AKIDAFTERPAUSE"


# -- no network: fail fast, say which credentials ----------------------------------------------
_DNS_SCRIPT = """
import sys, time
import tensorstore_py as tsp
spec = {spec!r}
t = time.monotonic()
try:
    tsp.KvStore.open(spec).result(60).read("k").result(60)
except tsp.errors.StorageError as e:
    print(f"{{time.monotonic() - t:.2f}}")
    print(e)
"""


@pytest.mark.parametrize("spec", [
    {"driver": "gcs", "bucket": "some-bucket", "endpoint": "https://tsp-test.invalid"},
    {"driver": "s3", "bucket": "some-bucket", "endpoint_url": "https://tsp-test.invalid"},
])
def test_an_unresolvable_host_fails_fast(spec: dict[str, Any], tmp_path: Path) -> None:
    """A name that does not exist is not retried (was 10 attempts over ~15 s); the
    error names the host and the credentials in use, once."""
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith(("AWS_", "GOOGLE_"))}
    env.update(HOME=str(tmp_path), AWS_EC2_METADATA_DISABLED="true")
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(_DNS_SCRIPT.format(spec=spec))],
                         capture_output=True, text=True, timeout=120, env=env)
    lines = out.stdout.splitlines()
    assert len(lines) == 2, (out.stdout, out.stderr)
    elapsed, message = float(lines[0]), lines[1]
    assert elapsed < 5, message
    assert "cannot resolve host 'tsp-test.invalid'" in message and "not retried" in message
    assert message.count("credentials:") == 1 and "anonymous" in message, message
    assert out.stderr.count("no credentials found") <= 1, out.stderr


# -- SigV4 computed without botocore on the request path ------------------------------------------
def _botocore_headers(frozen: Any, region: str, method: str, url: str, headers: dict[str, str],
                      payload: str, stamp: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """What botocore's S3SigV4Auth adds to the request at the time ``stamp``."""
    import datetime

    import botocore.auth

    when = datetime.datetime.strptime(stamp, "%Y%m%dT%H%M%SZ")
    monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda: when)
    return _botocore_signed_headers(frozen, region, method, url, headers, payload)


@pytest.mark.parametrize("token", [None, "session/token+="])
@pytest.mark.parametrize(("method", "url", "headers"), [
    ("GET", "http://127.0.0.1:9000/b-1/p/a%20b%2Bc", {"Range": "bytes=3-8"}),
    ("GET", "http://127.0.0.1:80/b-1?list-type=2&prefix=p%2F&delimiter=%2F&continuation-token", {}),
    ("PUT", "https://b-1.s3.eu-west-1.amazonaws.com:443/k/%C3%A9", {
        "If-None-Match": "*", "Content-Type": "application/octet-stream",
        "x-amz-meta-tsp-write-id": "  spaced   out  ", "x-amz-checksum-crc32c": "AAAAAA=="}),
    ("post", "http://[::1]:5000/b-1/k?uploads", {"User-Agent": "unsigned", "content-type": "a",
                                                 "Content-Type": "b"}),
])
def test_sigv4_headers_equal_botocores(monkeypatch: pytest.MonkeyPatch, token: str | None, method: str,
                                       url: str, headers: dict[str, str]) -> None:
    import botocore.credentials

    frozen = botocore.credentials.Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG", token).get_frozen_credentials()
    payload = hashlib.sha256(b"body").hexdigest()
    for now in (1_700_000_000.0, 1_700_086_399.0):  # two days: the cached signing key changes
        ours = sigv4_headers(frozen.access_key, frozen.secret_key, frozen.token, "eu-west-1", method, url,
                             headers, payload, now=now)
        theirs = _botocore_headers(frozen, "eu-west-1", method, url, headers, payload, ours["X-Amz-Date"],
                                   monkeypatch)
        assert ours == theirs


def test_requests_on_the_wire_carry_botocores_signature(serve_app: Any, no_aws: pytest.MonkeyPatch) -> None:
    """Reads (ranged too), conditional writes with metadata, listings and deletes
    as sent: each Authorization equals botocore's for the headers it signs."""
    seen: list[tuple[str, str, dict[str, str], bytes]] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append((request.method, str(request.url), dict(request.headers), await request.read()))
        return web.Response(status=404, body=b"<Error><Code>NoSuchKey</Code></Error>")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    url = serve_app(app).url
    no_aws.setenv("AWS_ACCESS_KEY_ID", "AKIDWIRE")
    no_aws.setenv("AWS_SECRET_ACCESS_KEY", "wire-secret")
    kv = S3KvStore(bucket="b-1", endpoint_url=url, region="eu-west-1")
    assert kv.read("a b+c/é").result(T).state == "missing"
    assert kv.read("k", byte_range=ByteRange(3, 9)).result(T).state == "missing"
    for op in (lambda: kv.write("k", b"value", if_equal=Generation.NO_VALUE),
               lambda: kv.list("p/"), lambda: kv.delete("k")):
        with contextlib.suppress(Exception):
            op().result(T)
    assert len({m for m, _, _, _ in seen}) >= 3, seen
    import botocore.credentials

    frozen = botocore.credentials.Credentials("AKIDWIRE", "wire-secret").get_frozen_credentials()
    for method, full, hdrs, body in seen:
        auth = hdrs["Authorization"]
        names = auth.split("SignedHeaders=")[1].split(",")[0].split(";")
        signed = {k: v for k, v in hdrs.items() if k.lower() in names and k.lower() not in RESERVED_HEADERS}
        assert hdrs["X-Amz-Content-SHA256"] == hashlib.sha256(body).hexdigest()
        theirs = _botocore_headers(frozen, "eu-west-1", method, full, signed, hdrs["X-Amz-Content-SHA256"],
                                   hdrs["X-Amz-Date"], no_aws)
        assert theirs["Authorization"] == auth, (method, full)
