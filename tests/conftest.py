"""Shared pytest fixtures (keep this file small; per-area fixtures live with their tests)."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Iterator, Mapping

import pytest
from aiohttp import web

from tensorstore_py.kvstore.versioned import leases as _leases

# --- the process environment, module by module ----------------------------------------
# A Dask nanny (a distributed.LocalCluster with worker processes) writes its
# ``distributed.nanny.pre-spawn-environ`` (MALLOC_TRIM_THRESHOLD_, OMP_NUM_THREADS, ...)
# into os.environ of the process that starts it, i.e. this one, and every subprocess a
# later test starts would inherit it (glibc's malloc tunables change what memory
# tests measure). So each test module leaves the environment as it found it.

#: variables a running session-scoped fixture set for the whole run (None: removed
#: for it); the per-module restore leaves them as they are
SESSION_ENV: dict[str, str | None] = {}


def restore_environ(before: Mapping[str, str], keep: Mapping[str, str | None]) -> list[str]:
    """Put os.environ back to ``before``, except the names in ``keep``; the names changed."""
    changed = []
    for name in sorted(set(os.environ) - set(before) - set(keep)):
        del os.environ[name]
        changed.append(name)
    for name, value in before.items():
        if name not in keep and os.environ.get(name) != value:
            os.environ[name] = value
            changed.append(name)
    return changed


@pytest.fixture(scope="module", autouse=True)
def _environment_per_module() -> Iterator[None]:
    """os.environ as it was before each test module, after it (module-scoped fixtures
    such as a module's Dask cluster are torn down first)."""
    before = dict(os.environ)
    yield
    restore_environ(before, SESSION_ENV)


class BackgroundServer:
    """An aiohttp application served on 127.0.0.1 (a free port) by its own thread."""

    def __init__(self, app: web.Application) -> None:
        self.app = app
        self.loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self.port = 0
        started = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(started,), name="test-http-server", daemon=True
        )
        self._thread.start()
        started.wait(30)
        if not self.port:
            raise RuntimeError("test HTTP server did not start")

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)

        async def start() -> None:
            self._runner = web.AppRunner(self.app, access_log=None)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            self.port = self._runner.addresses[0][1]

        self.loop.run_until_complete(start())
        started.set()
        self.loop.run_forever()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        async def stop() -> None:
            if self._runner is not None:
                await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)
        self.loop.close()


@pytest.fixture
def serve_app() -> Iterator[Callable[[web.Application], BackgroundServer]]:
    """``serve_app(app)`` starts ``app`` on a loopback port; stopped at teardown."""
    servers: list[BackgroundServer] = []

    def start(app: web.Application) -> BackgroundServer:
        server = BackgroundServer(app)
        servers.append(server)
        return server

    yield start
    for s in servers:
        s.close()


# --- GCS emulator ------------------------------------------------------------------
# One fake-gcs-server process for the whole pytest run; each test makes its own
# bucket with ``gcs_emulator.create_bucket()``.

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tensorstore_py.testing.gcs_server import GcsEmulator


@pytest.fixture(scope="session")
def gcs_emulator() -> Iterator[GcsEmulator]:
    """A running fake-gcs-server on 127.0.0.1 (skips if the binary is unavailable)."""
    from tensorstore_py.testing.gcs_server import GcsEmulator, find_binary

    try:
        find_binary()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    emulator = GcsEmulator()
    emulator.start()
    try:
        yield emulator
    finally:
        emulator.stop()


# --- S3-compatible server ------------------------------------------------------------
# One moto server process for the whole pytest run; each test makes its own bucket
# with ``s3_server.create_bucket()``. Its fake credentials go into the environment
# for the session (moto accepts any), so requests are SigV4-signed as against AWS
# and subprocesses of tests inherit them.

if TYPE_CHECKING:
    from tensorstore_py.testing.s3_server import S3Server


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """A running moto S3 server on 127.0.0.1 (skips if moto[server] is not installed)."""
    pytest.importorskip("moto.server", reason="moto[server] is a test dependency")
    from tensorstore_py.testing.s3_server import TEST_CREDENTIALS, S3Server

    unset = ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN")
    session_env: dict[str, str | None] = {**TEST_CREDENTIALS, **dict.fromkeys(unset)}
    with pytest.MonkeyPatch.context() as mp:
        for name, value in TEST_CREDENTIALS.items():
            mp.setenv(name, value)
        for name in unset:
            mp.delenv(name, raising=False)
        SESSION_ENV.update(session_env)  # for the run, not for the module that started it
        server = S3Server().start()
        try:
            yield server
        finally:
            server.stop()
            for name in session_env:
                SESSION_ENV.pop(name, None)


@pytest.fixture
def no_writer_linger(monkeypatch: pytest.MonkeyPatch) -> None:
    """Leases of this process drop their ``writing`` claim LINGER after the last
    writer ended, as reader pins do (no WRITER_LINGER): for tests that wait for a
    released writer's lease to go. The linger itself: test_versioned_lease_linger.py."""
    monkeypatch.setattr(_leases, "WRITER_LINGER", 0.0)
