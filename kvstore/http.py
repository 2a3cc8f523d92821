"""Read-only store over HTTP(S): ``GET`` with ``Range``, ``HEAD``, ETag generations.

Key ``k`` of a store with ``base_url="http://host:port"`` and ``path="/vol/"`` is
the URL ``http://host:port/vol/k`` (the key is percent-encoded).

Guarantees:

* Read-only: ``write``, ``delete`` and ``delete_range`` raise ReadOnlyError.
* ``list`` raises UnsupportedError: HTTP has no way to enumerate keys.
* Byte ranges are requested with a ``Range`` header (``bytes=a-b``, ``bytes=a-``,
  suffix ``bytes=-n``). A server that ignores ``Range`` and answers ``200`` with the
  whole body is handled by slicing locally, so results are the same either way.
* Generation = the ``ETag`` header (else ``Last-Modified``). ``read(...,
  if_not_equal=g)`` sends ``If-None-Match`` and maps ``304`` to ``"unchanged"``.
  A server that sends neither validator gets a fresh generation on every read
  (never "unchanged": correct, just not cacheable).
* ``404``/``410`` are a missing key (a result, not an error).
* Retries: ``429``, any ``5xx``, connection resets, truncated bodies and timeouts
  are retried up to ``max_retries`` times with jittered exponential backoff
  (honouring ``Retry-After`` up to the backoff cap); other statuses raise
  StorageError naming the URL and status at once.
* At most ``max_concurrency`` requests of one store run at a time.

Connections: one ``aiohttp.ClientSession`` per event loop, created lazily on the
library's loop and shared by all HTTP stores. It is closed at interpreter exit;
after ``os.fork()`` the child's fresh loop gets a new session and the parent's is
detached without touching the parent's sockets.
"""

from __future__ import annotations

import asyncio
import atexit
import email.utils
import os
import random
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit

import aiohttp

from tensorstore_py.core.errors import InvalidSpecError, StorageError, UnsupportedError
from tensorstore_py.kvstore.base import (
    Buffer,
    ByteRange,
    Generation,
    KvStore,
    ReadResult,
)
from tensorstore_py.kvstore.registry import register_kvstore

__all__ = ["HttpKvStore", "loop_session", "RETRYABLE_STATUS"]

#: statuses retried with backoff (plus every 5xx)
RETRYABLE_STATUS = frozenset({408, 429})
_MISSING_STATUS = frozenset({404, 410})
_BACKOFF_CAP = 5.0


# -- one ClientSession per event loop ------------------------------------------------
@dataclass
class _LoopSession:
    loop: asyncio.AbstractEventLoop
    pid: int
    session: aiohttp.ClientSession


_sessions: dict[str, _LoopSession] = {}
_sessions_lock = threading.Lock()
# Sessions of a parent process, detached in a forked child: kept referenced so
# their destructors never run (and warn) in the child.
_orphans: list[Any] = []


def loop_session(name: str = "http") -> aiohttp.ClientSession:
    """The ClientSession for the running loop (call on the loop), created lazily.

    A session made for another loop is closed on that loop if it still runs in
    this process, else detached (a forked child must not use the parent's
    sockets).
    """
    loop = asyncio.get_running_loop()
    with _sessions_lock:
        cur = _sessions.get(name)
        if cur is not None and cur.loop is loop and cur.pid == os.getpid():
            return cur.session
        if cur is not None:
            _retire(cur)
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),  # stores bound concurrency themselves
            auto_decompress=False,  # byte ranges address the stored bytes
            trust_env=False,
        )
        _sessions[name] = _LoopSession(loop, os.getpid(), session)
        return session


def _retire(entry: _LoopSession) -> None:
    if entry.pid == os.getpid() and not entry.loop.is_closed() and entry.loop.is_running():
        asyncio.run_coroutine_threadsafe(entry.session.close(), entry.loop)
    else:
        connector = entry.session.connector
        entry.session.detach()
        _orphans.append(connector)


def _after_fork_in_child() -> None:
    global _sessions_lock
    _sessions_lock = threading.Lock()
    for entry in _sessions.values():
        _retire(entry)
    _sessions.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


@atexit.register
def _close_sessions() -> None:
    for entry in list(_sessions.values()):
        if entry.pid != os.getpid():
            continue
        if entry.loop.is_running() and not entry.loop.is_closed():
            fut = asyncio.run_coroutine_threadsafe(entry.session.close(), entry.loop)
            try:
                fut.result(5)
            except Exception:  # exiting anyway; nothing useful to do
                pass
    _sessions.clear()


# -- the store -------------------------------------------------------------------
class _Response:
    __slots__ = ("status", "headers", "body")

    def __init__(self, status: int, headers: Any, body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body


class HttpKvStore(KvStore):
    """A read-only store of the files under ``base_url + path``."""

    driver = "http"
    read_only = True

    def __init__(
        self,
        *,
        base_url: str,
        path: str = "/",
        max_concurrency: int = 32,
        max_retries: int = 6,
        request_timeout: float = 60.0,
        backoff_base: float = 0.05,
    ) -> None:
        parts = urlsplit(base_url) if isinstance(base_url, str) else None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidSpecError(
                f"http kvstore: base_url must look like http(s)://host[:port], got {base_url!r}"
            )
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise InvalidSpecError(
                f"http kvstore: base_url {base_url!r} must not hold a path, query or "
                "fragment (put the path in 'path')"
            )
        if not isinstance(path, str) or "\x00" in path or "?" in path or "#" in path:
            raise InvalidSpecError(f"http kvstore: bad path {path!r}")
        if not path.startswith("/"):
            path = "/" + path
        if not path.endswith("/"):
            path += "/"
        for name, v, lo in (
            ("max_concurrency", max_concurrency, 1),
            ("max_retries", max_retries, 0),
        ):
            if not isinstance(v, int) or v < lo:
                raise InvalidSpecError(f"http kvstore: {name} must be an int >= {lo}, got {v!r}")
        if not (request_timeout > 0 and backoff_base >= 0):
            raise InvalidSpecError("http kvstore: request_timeout must be > 0, backoff_base >= 0")
        super().__init__(path=path)
        self.base_url = f"{parts.scheme}://{parts.netloc}"
        self.max_concurrency = max_concurrency
        self.max_retries = max_retries
        self.request_timeout = float(request_timeout)
        self.backoff_base = float(backoff_base)
        self._rng = random.Random()
        # loop -> semaphore; shared by with_path() copies of this store
        self._sems: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )

    # -- spec -----------------------------------------------------------------------
    _DEFAULTS = {
        "max_concurrency": 32,
        "max_retries": 6,
        "request_timeout": 60.0,
        "backoff_base": 0.05,
    }

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> HttpKvStore:
        allowed = {"driver", "base_url", "path", *cls._DEFAULTS}
        unknown = set(spec) - allowed
        if unknown:
            raise InvalidSpecError(
                f"http kvstore spec: unknown fields {sorted(unknown)}; allowed: {sorted(allowed)}"
            )
        if "base_url" not in spec:
            raise InvalidSpecError(
                "http kvstore spec: 'base_url' (http(s)://host[:port]) is required"
            )
        opts = {k: spec[k] for k in cls._DEFAULTS if k in spec}
        return cls(base_url=spec["base_url"], path=spec.get("path", "/"), **opts)

    @classmethod
    def spec_from_url(cls, url: str) -> dict[str, Any]:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidSpecError(
                f"malformed http URL {url!r}: expected http(s)://host[:port]/path"
            )
        if parts.query or parts.fragment:
            raise InvalidSpecError(
                f"http URL {url!r}: query strings and fragments are not supported"
            )
        try:
            parts.port  # noqa: B018 - validates the port
        except ValueError as e:
            raise InvalidSpecError(f"malformed http URL {url!r}: {e}") from None
        return {
            "driver": "http",
            "base_url": f"{parts.scheme}://{parts.netloc}",
            "path": parts.path or "/",
        }

    def _spec_fields(self) -> dict[str, Any]:
        d: dict[str, Any] = {"base_url": self.base_url}
        for k, default in self._DEFAULTS.items():
            if getattr(self, k) != default:
                d[k] = getattr(self, k)
        return d

    def url(self) -> str:
        return self.base_url + quote(self.path, safe="/")

    def _key_url(self, full_key: str) -> str:
        return self.base_url + quote(full_key, safe="/")

    # -- requests with retries ---------------------------------------------------------
    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        sem = self._sems.get(loop)
        if sem is None:
            sem = self._sems[loop] = asyncio.Semaphore(self.max_concurrency)
        return sem

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        cap = min(_BACKOFF_CAP, self.backoff_base * (2**attempt))
        delay = self._rng.uniform(0, cap)  # "full jitter"
        if retry_after is not None:
            delay = max(delay, min(retry_after, _BACKOFF_CAP))
        return delay

    async def _request(self, method: str, url: str, headers: dict[str, str]) -> _Response:
        headers = {"Accept-Encoding": "identity", **headers}
        timeout = aiohttp.ClientTimeout(total=self.request_timeout)
        last = ""
        for attempt in range(self.max_retries + 1):
            retry_after: float | None = None
            try:
                async with self._semaphore():
                    session = loop_session()
                    async with session.request(
                        method, url, headers=headers, timeout=timeout, allow_redirects=True
                    ) as resp:
                        body = await resp.read() if method == "GET" else b""
                        if resp.status < 500 and resp.status not in RETRYABLE_STATUS:
                            return _Response(resp.status, resp.headers, body)
                        last = f"HTTP {resp.status} {resp.reason}"
                        retry_after = _parse_retry_after(resp.headers.get("Retry-After"))
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError) as e:
                last = f"{type(e).__name__}: {e}"
            if attempt < self.max_retries:
                await asyncio.sleep(self._backoff(attempt, retry_after))
        raise StorageError(
            f"http kvstore: {method} {url} failed after {self.max_retries + 1} attempts: {last}"
        )

    # -- reads -----------------------------------------------------------------------
    async def _read(
        self, key: str, byte_range: ByteRange | None, if_not_equal: Generation | None
    ) -> ReadResult:
        url = self._key_url(key)
        if (
            byte_range is not None
            and byte_range.stop is not None
            and byte_range.stop <= byte_range.start
        ):
            # HTTP can not ask for zero bytes: check existence with HEAD
            return await self._head_empty(url, if_not_equal)
        headers = _if_none_match(if_not_equal)
        if byte_range is not None:
            headers["Range"] = _range_header(byte_range)
        resp = await self._request("GET", url, headers)
        if resp.status in _MISSING_STATUS:
            return ReadResult.missing()
        if resp.status == 304:
            return ReadResult("unchanged", b"", if_not_equal or _generation(resp.headers))
        if resp.status == 416:
            # the range starts at or past the end: an empty read of an existing value
            return await self._head_empty(url, if_not_equal)
        gen = _generation(resp.headers)
        if if_not_equal is not None and gen == if_not_equal:
            return ReadResult("unchanged", b"", gen)  # server ignored If-None-Match
        if resp.status == 200:
            value: Buffer = resp.body
            if byte_range is not None:  # the server ignored Range: slice here
                value = byte_range.apply(memoryview(resp.body))
            return ReadResult("value", value, gen)
        if resp.status == 206 and byte_range is not None:
            return ReadResult("value", _check_partial(url, byte_range, resp), gen)
        raise StorageError(
            f"http kvstore: GET {url}: unexpected HTTP {resp.status} "
            f"(expected 200, 206, 304, 404 or 416)"
        )

    async def _head_empty(self, url: str, if_not_equal: Generation | None) -> ReadResult:
        resp = await self._request("HEAD", url, _if_none_match(if_not_equal))
        if resp.status in _MISSING_STATUS:
            return ReadResult.missing()
        if resp.status == 304:
            return ReadResult("unchanged", b"", if_not_equal or _generation(resp.headers))
        if resp.status != 200:
            raise StorageError(f"http kvstore: HEAD {url}: unexpected HTTP {resp.status}")
        gen = _generation(resp.headers)
        if if_not_equal is not None and gen == if_not_equal:
            return ReadResult("unchanged", b"", gen)
        return ReadResult("value", b"", gen)

    # -- everything else ---------------------------------------------------------------
    async def _write(self, key: str, value: Buffer, if_equal: Generation | None) -> Generation:
        raise AssertionError("unreachable: the http store is read-only")  # pragma: no cover

    async def _delete(self, key: str, if_equal: Generation | None) -> None:
        raise AssertionError("unreachable: the http store is read-only")  # pragma: no cover

    async def _list(self, prefix: str) -> list[str]:
        raise UnsupportedError(
            f"list of {prefix!r}: HTTP can not enumerate keys ({self.base_url}{self.path}); "
            "read known keys instead"
        )


def _if_none_match(if_not_equal: Generation | None) -> dict[str, str]:
    """Revalidation headers: only ETag generations ("e:" tokens) can be sent."""
    if if_not_equal is not None and if_not_equal.token.startswith(b"e:"):
        return {"If-None-Match": if_not_equal.token[2:].decode("latin-1")}
    return {}


def _range_header(r: ByteRange) -> str:
    if r.start < 0:
        return f"bytes={r.start}"  # suffix: "bytes=-n"
    if r.stop is None:
        return f"bytes={r.start}-"
    return f"bytes={r.start}-{r.stop - 1}"


def _generation(headers: Any) -> Generation:
    etag = headers.get("ETag")
    if etag:
        return Generation(b"e:" + etag.encode("latin-1"))
    lm = headers.get("Last-Modified")
    if lm:
        return Generation(
            b"m:"
            + lm.encode("latin-1")
            + b"/"
            + headers.get("Content-Length", "").encode("latin-1")
        )
    return Generation(b"u:" + uuid.uuid4().bytes)  # no validator: never "unchanged"


def _check_partial(url: str, r: ByteRange, resp: _Response) -> Buffer:
    """The requested bytes out of a 206 answer, checked against Content-Range."""
    cr = resp.headers.get("Content-Range", "")
    try:
        unit, rest = cr.split(" ", 1)
        span, total_s = rest.split("/", 1)
        first_s, last_s = span.split("-", 1)
        first, last = int(first_s), int(last_s)
        total = None if total_s.strip() == "*" else int(total_s)
        if unit.lower() != "bytes" or last - first + 1 != len(resp.body):
            raise ValueError(cr)
    except ValueError:
        raise StorageError(
            f"http kvstore: GET {url}: bad Content-Range {cr!r} for {len(resp.body)} body bytes"
        ) from None
    if r.start < 0:
        want_start = first if total is None else max(0, total + r.start)
        want_stop = last + 1 if total is None else total
    else:
        want_start = r.start
        want_stop = last + 1 if r.stop is None else r.stop
        if total is not None:
            want_stop = min(want_stop, total)
    if want_start < first or want_stop > last + 1:
        raise StorageError(
            f"http kvstore: GET {url}: asked for bytes {want_start}..{want_stop - 1}, "
            f"server sent {cr!r}"
        )
    mv = memoryview(resp.body)
    return mv[want_start - first : want_stop - first]


def _parse_retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


register_kvstore(HttpKvStore, schemes=("http", "https"))
