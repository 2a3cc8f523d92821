"""A local S3-compatible server (moto's server mode) for tests.

One server process on 127.0.0.1, on a port the OS picks::

    with S3Server() as server:
        bucket = server.create_bucket()                 # a fresh bucket, unique name
        spec = server.spec(bucket, path="x/")           # {"driver": "s3", "endpoint_url": ...}

The process runs moto's WSGI application under werkzeug (``python -m
tensorstore_py.testing.s3_server --port-file F`` writes the port it bound).
moto accepts SigV4-signed requests with any credentials (set
:data:`TEST_CREDENTIALS` in the environment) and anonymous ones.

What moto's server (5.x) implements, checked by tests/test_kvstore_s3.py:
``If-None-Match: *`` and ``If-Match: <etag>`` on PutObject (412 on a lost
condition, 404 for If-Match on a missing key), ``If-None-Match: *`` on
CompleteMultipartUpload, ``If-Match`` on DeleteObject (412 / 404), bucket
versioning with version ids, ``x-amz-checksum-crc32c`` stored and returned
with ``x-amz-checksum-mode: ENABLED``. What it lacks: it ignores ``If-Match``
on CompleteMultipartUpload (hence ``multipart_if_match: False`` in
:meth:`S3Server.spec`), never verifies a checksum a client sends, never
answers 409 ConditionalRequestConflict, and checks a condition and then
writes in two steps with no lock. The last one would let two concurrent
conditional writes both pass, so this server runs every mutating request
(PUT, POST, DELETE) under one lock: its conditions are then atomic, as S3's
are. Reads run concurrently.
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterable, Mapping
from typing import Any, Self

from werkzeug.serving import make_server

from tensorstore_py.testing._process import ServerProcess

__all__ = ["TEST_CREDENTIALS", "S3Server"]

#: credentials for the test server (moto accepts any); tests put them in the environment
TEST_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "tsp-test-key",
    "AWS_SECRET_ACCESS_KEY": "tsp-test-secret",
    "AWS_EC2_METADATA_DISABLED": "true",
}
REGION = "us-east-1"
_counter = itertools.count(1)


class S3Server(ServerProcess):
    """One moto server process on 127.0.0.1 (start/stop or a context manager)."""

    def __init__(self, *, startup_timeout: float = 60.0) -> None:
        self.startup_timeout = startup_timeout
        self.port = 0

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:<port>``."""
        if self._proc is None:
            raise RuntimeError("S3Server is not running")
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Self:
        port_file = self._open_log("moto-s3-") / "port"
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tensorstore_py.testing.s3_server", "--port-file", str(port_file)],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                break
            if port_file.exists() and port_file.read_text().strip():
                self.port = int(port_file.read_text())
                if self._ready():
                    return self
            time.sleep(0.05)
        log = self.log_text()[-2000:]
        self.stop()
        raise RuntimeError(f"the moto S3 server did not start; its log ends with:\n{log}")

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/", timeout=5) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    # -- buckets ---------------------------------------------------------------------------
    def request(
        self, method: str, path: str, data: bytes | None = None,
        headers: Mapping[str, str] | None = None, *, signed: bool = True,
    ) -> tuple[int, dict[str, str], bytes]:
        """One request to the server (status, headers, body), SigV4-signed with
        :data:`TEST_CREDENTIALS` unless ``signed=False`` (moto refuses conditional
        writes that are neither signed nor over https, as S3 does); for fixtures and
        for checking what the server itself does."""
        # (urllib's default Content-Type for a body would send moto to another service)
        hdrs = {"Content-Type": "application/octet-stream", **(headers or {})}
        if signed:
            hdrs = _signed(method, self.endpoint + path, hdrs, data or b"")
        req = urllib.request.Request(self.endpoint + path, data=data, method=method, headers=hdrs)
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, dict(resp.headers), resp.read()
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), e.read()

    def create_bucket(self, name: str | None = None, *, versioning: bool = False) -> str:
        """Create a bucket (a fresh unique name by default), optionally versioned."""
        if name is None:
            name = f"tsp-{os.getpid()}-{next(_counter)}-{uuid.uuid4().hex[:8]}"
        status, _, body = self.request("PUT", f"/{name}", b"")
        if status != 200:
            raise RuntimeError(f"creating bucket {name!r}: HTTP {status}: {body[:200]!r}")
        if versioning:
            xml = (b'<VersioningConfiguration xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
                   b"<Status>Enabled</Status></VersioningConfiguration>")
            status, _, body = self.request("PUT", f"/{name}?versioning", xml,
                                           {"Content-Type": "application/xml"})
            if status != 200:
                raise RuntimeError(f"versioning bucket {name!r}: HTTP {status}: {body[:200]!r}")
        return name

    def spec(
        self, bucket: str, *, path: str = "", extra: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """An s3 kvstore spec for ``bucket`` on this server, plus ``extra`` fields."""
        return {"driver": "s3", "bucket": bucket, "path": path, "endpoint_url": self.endpoint,
                "region": REGION, "multipart_if_match": False, **(extra or {})}

    def __repr__(self) -> str:
        state = f"port {self.port}" if self._proc is not None else "stopped"
        return f"S3Server({state})"


def _signed(method: str, url: str, headers: dict[str, str], data: bytes) -> dict[str, str]:
    # botocore comes with moto (a test dependency): imported only to sign test requests
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest  # (lazy, as above)
    from botocore.credentials import Credentials  # (lazy, as above)

    req = AWSRequest(method=method, url=url, headers=headers, data=data)
    creds = Credentials(TEST_CREDENTIALS["AWS_ACCESS_KEY_ID"], TEST_CREDENTIALS["AWS_SECRET_ACCESS_KEY"])
    S3SigV4Auth(creds, "s3", REGION).add_auth(req)
    return dict(req.headers.items())


# -- the server process ----------------------------------------------------------------------
def _serve(port_file: str) -> None:
    # moto is a test dependency (moto[server]): imported only in the server process
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app

    class Serialized(DomainDispatcherApplication):
        """moto's application with mutating requests one at a time (atomic conditions)."""

        write_lock = threading.Lock()  # (moto uses self.lock itself)

        def __call__(self, environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
            if environ.get("REQUEST_METHOD") in ("GET", "HEAD"):
                return super().__call__(environ, start_response)
            with self.write_lock:
                # the body is built inside the lock (moto answers eagerly)
                return list(super().__call__(environ, start_response))

    app = Serialized(create_backend_app)
    server = make_server("127.0.0.1", 0, app, threaded=True)
    tmp = port_file + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(server.server_port))
    os.replace(tmp, port_file)
    server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="moto's S3 server on 127.0.0.1, port 0")
    parser.add_argument("--port-file", required=True, help="where to write the bound port")
    args = parser.parse_args(argv)
    _serve(args.port_file)


if __name__ == "__main__":
    main()
