"""The http store against real aiohttp servers on 127.0.0.1 (free ports).

* ``web.static`` (Range, ETag, If-None-Match): the read-only conformance suite.
* a server that ignores Range and always answers 200: the same suite passes.
* servers that fail requests (503, 429, resets, truncated bodies, stalls): retried.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import pickle
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
from aiohttp import web

import tensorstore_py as tsp
from tensorstore_py.core.retry import RetryPolicy
from tensorstore_py.errors import InvalidSpecError, StorageError
from tensorstore_py.kvstore.http import DEFAULT_RETRIES, HttpKvStore
from tensorstore_py.testing.kvstore import ReadOnlyKvStoreConformance

FILES: dict[str, bytes] = {
    "a.bin": bytes(range(256)) * 40,
    "dir/b.txt": b"hello, http kvstore",
    "dir/sub/c": os.urandom(3000),
    "sp ace/\u00fc.bin": b"percent-encoded name",
    "empty": b"",
}


def _populate(root: Path) -> None:
    for k, v in FILES.items():
        p = root / k
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(v)


@pytest.fixture
def static_server(tmp_path: Path, serve_app: Callable) -> str:
    root = tmp_path / "www"
    _populate(root)
    app = web.Application()
    app.router.add_static("/vol/", root)
    return serve_app(app).url


class TestHttpStaticConformance(ReadOnlyKvStoreConformance):
    supports_list = False

    @pytest.fixture
    def expected_values(self) -> dict[str, bytes]:
        return dict(FILES)

    @pytest.fixture
    def populated_store(self, static_server: str) -> tsp.KvStore:
        return tsp.KvStore.open(f"{static_server}/vol/").result()


class _IgnoresRange:
    """Serves files from a dict; ignores Range (always 200) but honours ETag."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files
        self.range_requests = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        key = request.match_info["key"]
        if key not in self.files:
            raise web.HTTPNotFound()
        if "Range" in request.headers:
            self.range_requests += 1
        etag = f'"v{hash(self.files[key]) & 0xFFFFFF:x}"'
        if request.headers.get("If-None-Match") == etag:
            return web.Response(status=304, headers={"ETag": etag})
        body = self.files[key] if request.method == "GET" else None
        resp = web.Response(body=body, headers={"ETag": etag})
        if body is None:
            resp.content_length = len(self.files[key])
        return resp


@pytest.fixture
def ignoring_server(serve_app: Callable) -> tuple[str, _IgnoresRange]:
    handler = _IgnoresRange(dict(FILES))
    app = web.Application()
    app.router.add_route("GET", "/vol/{key:.+}", handler.handle)
    app.router.add_route(
        "HEAD",
        "/vol/{key:.+}",
        handler.handle,
    )
    return serve_app(app).url, handler


class TestHttpIgnoresRangeConformance(ReadOnlyKvStoreConformance):
    supports_list = False

    @pytest.fixture
    def expected_values(self) -> dict[str, bytes]:
        return dict(FILES)

    @pytest.fixture
    def populated_store(self, ignoring_server: tuple[str, _IgnoresRange]) -> tsp.KvStore:
        return tsp.KvStore.open(f"{ignoring_server[0]}/vol/").result()


def test_ignored_range_is_sliced_locally(ignoring_server: tuple[str, _IgnoresRange]) -> None:
    url, handler = ignoring_server
    kv = tsp.KvStore.open(f"{url}/vol").result()
    data = FILES["a.bin"]
    assert bytes(kv.read("a.bin", byte_range=slice(100, 110)).result().value) == data[100:110]
    assert bytes(kv.read("a.bin", byte_range=slice(-3, None)).result().value) == data[-3:]
    assert handler.range_requests == 2


# -- faults -----------------------------------------------------------------------------
class _Flaky:
    """Fails the first ``n`` requests in the given way, then serves FILES."""

    def __init__(self, n: int, mode: str) -> None:
        self.n = n
        self.mode = mode
        self.calls = 0
        self.in_flight = 0
        self.max_in_flight = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.calls += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            key = request.match_info["key"]
            if self.calls <= self.n:
                if self.mode in ("503", "429", "500", "403"):
                    return web.Response(status=int(self.mode), headers={"Retry-After": "0"})
                if self.mode == "reset":
                    assert request.transport is not None
                    request.transport.abort()
                    return web.Response()
                if self.mode == "truncate":
                    resp = web.StreamResponse(headers={"Content-Length": "100000"})
                    await resp.prepare(request)
                    await resp.write(b"x" * 10)
                    assert request.transport is not None
                    request.transport.abort()
                    return resp
                if self.mode == "stall":
                    await asyncio.sleep(3)
            if self.mode == "slow":
                await asyncio.sleep(0.05)
            if key not in FILES:
                raise web.HTTPNotFound()
            return web.Response(body=FILES[key], headers={"ETag": '"e1"'})
        finally:
            self.in_flight -= 1


def _flaky_store(
    serve_app: Callable, n: int, mode: str, **opts: object
) -> tuple[HttpKvStore, _Flaky]:
    flaky = _Flaky(n, mode)
    app = web.Application()
    app.router.add_get("/vol/{key:.+}", flaky.handle)
    url = serve_app(app).url
    spec = {"driver": "http", "base_url": url, "path": "/vol/", "backoff_base": 0.01, **opts}
    return tsp.KvStore.open(spec).result(), flaky


@pytest.mark.parametrize("mode", ["503", "429", "500", "reset", "truncate"])
def test_retries_transient_failures(serve_app: Callable, mode: str) -> None:
    kv, flaky = _flaky_store(serve_app, 3, mode)
    r = kv.read("dir/sub/c").result(30)
    assert bytes(r.value) == FILES["dir/sub/c"]
    assert flaky.calls == 4


def test_retries_timeouts(serve_app: Callable) -> None:
    kv, flaky = _flaky_store(serve_app, 1, "stall", request_timeout=0.5)
    assert bytes(kv.read("a.bin").result(30).value) == FILES["a.bin"]
    assert flaky.calls == 2


def test_gives_up_after_max_retries(serve_app: Callable) -> None:
    kv, flaky = _flaky_store(serve_app, 100, "503", max_retries=2)
    with pytest.raises(StorageError) as info:
        kv.read("a.bin").result(30)
    assert "503" in str(info.value) and "/vol/a.bin" in str(info.value)
    assert flaky.calls == 3


def test_retries_spec_like_gcs(serve_app: Callable) -> None:
    retries = {"max_attempts": 3, "initial_delay": 0.001, "max_delay": 0.01}
    kv, flaky = _flaky_store(serve_app, 100, "503", retries=retries, backoff_base=None)
    assert kv.spec()["retries"] == retries and "max_retries" not in kv.spec()
    assert tsp.KvStore.open(kv.spec()).result() == kv
    with pytest.raises(StorageError, match="after 3 attempt"):
        kv.read("a.bin").result(30)
    assert flaky.calls == 3


def test_old_retry_fields_are_aliases_of_the_policy() -> None:
    old = HttpKvStore(base_url="http://h", max_retries=2, backoff_base=0.5)
    assert old.retry_policy == RetryPolicy(max_attempts=3, initial_delay=0.5, max_delay=5.0)
    assert (old.max_retries, old.backoff_base) == (2, 0.5)
    assert old.spec() == {"driver": "http", "base_url": "http://h", "path": "/",
                          "max_retries": 2, "backoff_base": 0.5}
    assert tsp.KvStore.open(old.spec()).result().retry_policy == old.retry_policy
    assert HttpKvStore(base_url="http://h").retry_policy == DEFAULT_RETRIES
    partial = HttpKvStore(base_url="http://h", retries={"max_attempts": 2})
    assert partial.retry_policy == RetryPolicy(2, DEFAULT_RETRIES.initial_delay, DEFAULT_RETRIES.max_delay)
    with pytest.raises(InvalidSpecError, match="not both"):
        tsp.KvStore.open({"driver": "http", "base_url": "http://h", "max_retries": 1,
                          "retries": {"max_attempts": 2}}).result()


def test_store_pickles_as_its_settings(static_server: str) -> None:
    kv = tsp.KvStore.open({"driver": "http", "base_url": static_server, "path": "/vol/",
                           "retries": {"max_attempts": 2}}).result()
    kv.read("dir/b.txt").result()
    again = pickle.loads(pickle.dumps(kv))
    assert again == kv and again.retry_policy == kv.retry_policy
    assert bytes(again.read("dir/b.txt").result().value) == FILES["dir/b.txt"]


def test_client_errors_are_not_retried(serve_app: Callable) -> None:
    kv, flaky = _flaky_store(serve_app, 100, "403")
    with pytest.raises(StorageError, match="403"):
        kv.read("a.bin").result(30)
    assert flaky.calls == 1


def test_bounded_concurrency(serve_app: Callable) -> None:
    kv, flaky = _flaky_store(serve_app, 0, "slow", max_concurrency=3)
    futs = [kv.read("dir/b.txt") for _ in range(20)]
    assert all(bytes(f.result(30).value) == FILES["dir/b.txt"] for f in futs)
    assert flaky.max_in_flight == 3


# -- protocol details ---------------------------------------------------------------------
def test_if_none_match_revalidation(static_server: str) -> None:
    kv = tsp.KvStore.open(f"{static_server}/vol/").result()
    r = kv.read("dir/b.txt").result()
    assert r.generation.token.startswith(b"e:")
    again = kv.read("dir/b.txt", if_not_equal=r.generation).result()
    assert again.state == "unchanged" and bytes(again.value) == b""


def test_changed_file_has_new_generation(tmp_path: Path, serve_app: Callable) -> None:
    (tmp_path / "k").write_bytes(b"one")
    app = web.Application()
    app.router.add_static("/", tmp_path)
    kv = tsp.KvStore.open(serve_app(app).url + "/").result()
    g1 = kv.read("k").result().generation
    (tmp_path / "k").write_bytes(b"second")
    os.utime(tmp_path / "k", ns=(1, 10**18))
    r = kv.read("k", if_not_equal=g1).result()
    assert r.state == "value" and bytes(r.value) == b"second" and r.generation != g1


def test_writes_and_list_refused(static_server: str) -> None:
    kv = tsp.KvStore.open(f"{static_server}/vol/").result()
    with pytest.raises(tsp.ReadOnlyError, match="read-only"):
        kv.write("x", b"1")
    with pytest.raises(tsp.UnsupportedError, match="HTTP can not enumerate"):
        kv.list().result()


def test_spec_and_url_forms(static_server: str) -> None:
    kv = tsp.KvStore.open(f"{static_server}/vol/").result()
    assert kv.spec() == {"driver": "http", "base_url": static_server, "path": "/vol/"}
    assert kv.url() == f"{static_server}/vol/"
    same = tsp.KvStore.open({"driver": "http", "base_url": static_server, "path": "vol"}).result()
    assert same.spec() == kv.spec()
    sub = kv.with_path("dir")
    assert sub.spec()["path"] == "/vol/dir/"
    assert bytes(sub.read("b.txt").result().value) == FILES["dir/b.txt"]
    tuned = tsp.KvStore.open({**kv.spec(), "max_retries": 1, "max_concurrency": 4}).result()
    assert tuned.spec()["max_retries"] == 1
    assert tsp.KvStore.open(tuned.spec()).result() == tuned
    assert "https" in repr(tsp.KvStore.open("https://example.invalid:8443/x/").result())


@pytest.mark.parametrize(
    "url",
    ["http://", "http:///path", "http://host:notaport/", "http://h/p?q=1", "http://h/p#frag"],
)
def test_malformed_urls(url: str) -> None:
    with pytest.raises(InvalidSpecError):
        tsp.KvStore.open(url).result()


@pytest.mark.parametrize(
    "spec",
    [
        {"driver": "http"},
        {"driver": "http", "base_url": "ftp://h"},
        {"driver": "http", "base_url": "http://h/with/path"},
        {"driver": "http", "base_url": "http://h", "max_retries": -1},
        {"driver": "http", "base_url": "http://h", "retries": {"max_attempts": 0}},
        {"driver": "http", "base_url": "http://h", "retries": {"bogus": 1}},
        {"driver": "http", "base_url": "http://h", "bogus": 1},
    ],
)
def test_bad_specs(spec: dict) -> None:
    with pytest.raises(InvalidSpecError):
        tsp.KvStore.open(spec).result()


def _child_read(url: str, q: multiprocessing.Queue) -> None:
    kv = tsp.KvStore.open(url).result(30)
    q.put(bytes(kv.read("dir/b.txt").result(30).value))


def test_fork_child_gets_own_session(static_server: str) -> None:
    kv = tsp.KvStore.open(f"{static_server}/vol/").result()
    assert bytes(kv.read("dir/b.txt").result().value) == FILES["dir/b.txt"]  # parent session
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_read, args=(f"{static_server}/vol/", q))
    p.start()
    got = q.get(timeout=60)
    p.join(60)
    assert p.exitcode == 0 and got == FILES["dir/b.txt"]
    assert bytes(kv.read("dir/b.txt").result().value) == FILES["dir/b.txt"]  # parent still fine


def test_no_unclosed_session_warning_at_exit(static_server: str) -> None:
    code = textwrap.dedent(
        f"""
        import gc, warnings
        warnings.simplefilter("always")
        import tensorstore_py as tsp
        kv = tsp.KvStore.open("{static_server}/vol/").result()
        assert kv.read("dir/b.txt").result().value == {FILES["dir/b.txt"]!r}
        print("ok")
        """
    )
    out = subprocess.run(
        [sys.executable, "-X", "dev", "-c", code], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
    assert "Unclosed" not in out.stderr, out.stderr
