"""The HTTP client layer under the remote stores (gcs, http; the base for more).

What a store built on it gets:

**Sessions** (:func:`client_session`): one shared ``aiohttp.ClientSession`` per
event loop, created lazily (a session is bound to its loop; the library's loop
is replaced after fork, and users may await stores from their own loops).
Responses are not decompressed (byte ranges address the stored bytes) and
aiohttp's silent resend of idempotent requests is off, so every attempt is
counted here. Sessions whose loops still run are closed at interpreter exit.
Fork safety: a forked child never closes nor reuses the parent's pooled
connections. Its copy of the parent's loop shares the parent's epoll set, so
closing a socket there would unregister it for the parent too and silently
stall the parent's request on it; the child drops them from the pool and marks
them closed without touching them, and makes a fresh session on its own loop.

**Requests with retries** (:class:`HttpClient`): at most ``concurrency``
requests of one store (and its ``with_path`` views) in flight per event loop;
only *transient* failures are retried, with full-jitter exponential backoff
(:class:`~tensorstore_py.core.retry.RetryPolicy`; a server's ``Retry-After``
is honoured up to the policy's ``max_delay``): HTTP 408/429/5xx answers
(raised inside an attempt as :class:`TransientHttpError`), connection resets,
dropped or truncated responses and timeouts. Every other answer is returned
to the store, which maps it to a result or a typed error. When the attempts
are used up, :class:`~tensorstore_py.errors.StorageError` names what was being
done, how many attempts were made and the last cause. Credentials come from
an :class:`Auth` object, asked on every attempt (a token refresh or a request
signature is always current); a 401 on the first attempt drops them and
retries once.

A request whose response was lost may still have taken effect on the server:
retrying is harmless for reads and plain overwrites, but a retried
*conditional* write can come back as "precondition failed" although the first
attempt landed. :attr:`Response.maybe_applied` says whether an earlier attempt
may have reached the server and taken effect (a dropped connection, a
truncated answer, a timeout, a 500/502/504); an attempt that the server
refused outright (408, 429, 503, or a status the store names in
``retry_statuses``) did not. :mod:`~tensorstore_py.kvstore._objstore` turns
that into a result: the write-id read back, or
:class:`~tensorstore_py.errors.CommitOutcomeUnknownError`.

A host name that does not resolve (``EAI_NONAME``: no network, or a wrong
endpoint) is not transient: it fails at once with a StorageError that names
the host and the credentials in use. A temporary resolver failure
(``EAI_AGAIN``) is retried like any connection error.

**Bodies**: an answer of :data:`DIRECT_BODY_BYTES` or more (by its
``Content-Length``) lands piece by piece, as it arrives, in one page-aligned
buffer of that size (:attr:`Response.body` is then a memoryview of it): no list
of pieces joined into a second copy once the last one is in. The buffers are
reused (:class:`~tensorstore_py.core.recycled.RecycledBuffers`, at most
:data:`BODY_BYTES_KEPT` idle): a block serves a later answer only once the
value read into it, and everything made from it, is gone, and memory touched
a moment ago spares the kernel faulting in and clearing fresh pages. A request may ask
for the CRC-32C of its answer (``crc32c=True``): it is computed over each piece
while it is fresh in the caches (:attr:`Response.body_crc32c`), so a store
verifying a whole object against its stored checksum needs no second pass over
the bytes and no thread hop. A body shorter or longer than its
``Content-Length`` is a truncated answer (retried like a dropped connection).

**Ranged reads**: :func:`range_header` and :func:`partial_body` (checks a
``206`` answer against its ``Content-Range``).
"""

from __future__ import annotations

import asyncio
import atexit
import email.utils
import json
import os
import socket
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypedDict

import aiohttp
import crc32c as _crc32c
import yarl

from tensorstore_py.core.errors import StorageError
from tensorstore_py.core.ranges import Buffer, ByteRange
from tensorstore_py.core.recycled import RecycledBuffers
from tensorstore_py.core.retry import RetryPolicy, with_retries

__all__ = [
    "DIRECT_BODY_BYTES",
    "NOT_APPLIED_STATUS",
    "Auth",
    "HttpClient",
    "Response",
    "RetriesExhaustedError",
    "RetriesSpec",
    "TransientHttpError",
    "client_session",
    "is_retryable_status",
    "is_transient",
    "parse_retry_after",
    "partial_body",
    "range_header",
    "retries_spec",
    "retry_policy",
    "unresolvable_host",
]

#: answers this large (by Content-Length) land in one buffer as they arrive (see the module doc)
DIRECT_BODY_BYTES = 1 << 20
#: where those answers land: blocks reused once a value and everything made from it
#: is gone; at most this many idle bytes are kept for the next answers
BODY_BYTES_KEPT = 64 << 20
_bodies = RecycledBuffers(keep_bytes=BODY_BYTES_KEPT)
#: HTTP statuses worth retrying: timeout, too many requests, server errors.
_RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
#: retryable answers that say the request was not carried out (the server refused
#: it before acting); 500/502/504 may come after the request took effect
NOT_APPLIED_STATUS = frozenset({408, 429, 503})
#: getaddrinfo errors that mean "this name does not exist" (retrying will not help)
_PERMANENT_DNS_ERRORS = frozenset(
    getattr(socket, name) for name in ("EAI_NONAME", "EAI_NODATA", "EAI_SERVICE")
    if hasattr(socket, name)
)


def is_retryable_status(status: int) -> bool:
    """True for HTTP statuses that mean "try again later" (408, 429, 5xx)."""
    return status in _RETRYABLE_STATUS or 500 <= status <= 599


class TransientHttpError(Exception):
    """A retryable HTTP answer (408/429/5xx), raised inside an attempt.

    ``retry_after`` is the server's Retry-After hint in seconds, if it sent one.
    """

    def __init__(
        self, status: int, message: str, *, retry_after: float | None = None,
        applied: bool | None = None,
    ) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.retry_after = retry_after
        #: False when the server refused the request without acting on it
        self.not_applied = status in NOT_APPLIED_STATUS if applied is None else not applied


class RetriesExhaustedError(StorageError):
    """Every attempt of a request failed transiently. ``maybe_applied``: one of them
    may have taken effect on the server all the same."""

    def __init__(self, message: str, *, maybe_applied: bool) -> None:
        super().__init__(message)
        self.maybe_applied = maybe_applied


def unresolvable_host(exc: BaseException) -> str | None:
    """The host name of a DNS failure that retrying will not fix (the name does not
    exist), else None. A temporary resolver failure is not one."""
    if not isinstance(exc, aiohttp.ClientConnectorError):
        return None
    cause = exc.os_error
    if isinstance(cause, socket.gaierror) and cause.errno in _PERMANENT_DNS_ERRORS:
        return str(exc.host)
    return None


def is_transient(exc: BaseException) -> bool:
    """The retry predicate: transient HTTP answers, connection trouble, timeouts
    (not a host name that does not exist)."""
    if unresolvable_host(exc) is not None:
        return False
    # ClientConnectionError covers refused/reset connections and server disconnects;
    # ClientPayloadError a body cut short; ConnectionError e.g. an unreachable token
    # endpoint. An HTTP status is classified where the answer is read (TransientHttpError).
    return isinstance(
        exc,
        (
            TransientHttpError,
            asyncio.TimeoutError,
            ConnectionError,
            aiohttp.ClientConnectionError,
            aiohttp.ClientPayloadError,
        ),
    )


def parse_retry_after(value: str | None) -> float | None:
    """A ``Retry-After`` header in seconds (delta-seconds or an HTTP date); None if absent or bad."""
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


class RetriesSpec(TypedDict, total=False):
    """The ``retries`` field of a remote store's spec (each field optional)."""

    max_attempts: int
    initial_delay: float
    max_delay: float


def retry_policy(value: Mapping[str, Any] | RetryPolicy | None, default: RetryPolicy) -> RetryPolicy:
    """The policy of a ``retries`` spec field (``{"max_attempts", "initial_delay",
    "max_delay"}``, each optional): missing fields come from the store's ``default``."""
    if value is None:
        return default
    if isinstance(value, RetryPolicy):
        return value
    RetryPolicy.from_json(value)  # validates: a mapping of known fields with sane values
    initial = value.get("initial_delay", default.initial_delay)
    return RetryPolicy(
        max_attempts=value.get("max_attempts", default.max_attempts),
        initial_delay=initial,
        max_delay=value.get("max_delay", max(default.max_delay, initial)),
    )


def retries_spec(value: Mapping[str, Any] | RetryPolicy | None) -> dict[str, Any] | None:
    """A ``retries`` option as given, for a store's ``spec()`` (None when not given)."""
    if value is None:
        return None
    return value.to_json() if isinstance(value, RetryPolicy) else dict(value)


# -- one aiohttp session per event loop -------------------------------------------------
_sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}
_sessions_lock = threading.Lock()
_orphans: list[aiohttp.ClientSession] = []  # a parent's sessions, kept (never closed) in a forked child
_SESSION_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=120)


def client_session() -> aiohttp.ClientSession:
    """The ``aiohttp.ClientSession`` of the running loop (created on first use).

    Connections are pooled per loop without a global limit: each store bounds its
    own requests. Do not close it; it is closed at interpreter exit.
    """
    loop = asyncio.get_running_loop()
    with _sessions_lock:
        s = _sessions.get(loop)
        if s is None or s.closed:
            for old in [lp for lp in _sessions if lp.is_closed()]:
                # a loop that is gone (asyncio.run in user code): nothing can run on it
                _abandon(_sessions.pop(old))
            s = aiohttp.ClientSession(
                timeout=_SESSION_TIMEOUT,
                auto_decompress=False,
                connector=aiohttp.TCPConnector(limit=0),
            )
            # aiohttp silently resends an idempotent request (GET, DELETE) once when a
            # pooled connection drops. Attempts are counted here (a resent conditional
            # DELETE that had landed would look like a lost race), so switch that off;
            # the attribute is aiohttp's own (its test utilities set it the same way).
            if hasattr(s, "_retry_connection"):
                s._retry_connection = False
            _sessions[loop] = s
        return s


def _abandon(session: aiohttp.ClientSession) -> None:
    """Forget ``session`` without closing anything through its loop: its pooled
    connections leave the pool untouched and the connector counts as closed (no
    close attempt, no "unclosed" warning). These are aiohttp internals, hence
    the guard; on another layout keeping a reference (``_orphans``) suffices."""
    try:
        connector = session.connector
        conns = getattr(connector, "_conns", None)
        if isinstance(conns, dict):
            conns.clear()
        connector._closed = True  # type: ignore[union-attr]
    except AttributeError:
        pass


def _after_fork_in_child() -> None:
    global _sessions_lock
    _sessions_lock = threading.Lock()
    _bodies.after_fork_in_child()
    for s in _sessions.values():
        _abandon(s)
        _orphans.append(s)  # never finalized here: nothing of the parent's is touched
    _sessions.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


@atexit.register
def _close_sessions() -> None:
    # Close the sessions whose loops still run, so interpreter exit stays quiet.
    for loop, s in list(_sessions.items()):
        if s.closed or loop.is_closed() or not loop.is_running():
            continue
        try:
            asyncio.run_coroutine_threadsafe(s.close(), loop).result(2)
        except Exception:  # best effort: the process is exiting anyway
            pass


# -- requests ----------------------------------------------------------------------------
class _Timeout(TypedDict, total=False):
    """The ``timeout`` of a request, when the store sets one (aiohttp's default otherwise)."""

    timeout: aiohttp.ClientTimeout


class Auth(Protocol):
    """Credentials of a store's requests (e.g. a bearer token, a request signature)."""

    async def headers(
        self, method: str, url: str | yarl.URL, headers: Mapping[str, str], data: Buffer | None
    ) -> Mapping[str, str]:
        """Headers to add to this attempt of the request (asked on every attempt)."""
        ...

    def invalidate(self, status: int, sent: Mapping[str, str] | None = None) -> bool:
        """Drop cached credentials after an HTTP 401/403 answer (``status``) to a
        request that carried the headers ``sent`` (credentials replaced since are
        kept); True when one retry with fresh ones may succeed."""
        ...

    def describe(self) -> str:
        """Which credentials the requests carry, for error messages (no secrets)."""
        ...


@dataclass(frozen=True, slots=True)
class Response:
    """A non-retryable answer. ``attempt`` > 1 when earlier attempts failed;
    ``maybe_applied`` when one of those may have taken effect on the server (a
    conditional write may then have landed already). ``body``: bytes, or a
    memoryview of one buffer for answers of :data:`DIRECT_BODY_BYTES` or more;
    ``body_crc32c``: the CRC-32C of ``body`` when the request asked for it."""

    status: int
    reason: str
    headers: Mapping[str, str]
    body: Buffer
    attempt: int
    maybe_applied: bool = False
    body_crc32c: int | None = None

    def json(self) -> Any:
        return json.loads(self.body if isinstance(self.body, bytes) else bytes(self.body))

    def snippet(self, n: int = 200) -> str:
        """The start of the body as text, for error messages."""
        return bytes(self.body[:n]).decode("utf-8", "replace")


class HttpClient:
    """One store's requests: bounded concurrency, retries, credentials.

    Shared by a store's ``with_path`` views (a shallow copy keeps it). Pickles
    as its settings.
    """

    def __init__(
        self,
        *,
        concurrency: int,
        retries: RetryPolicy,
        timeout: aiohttp.ClientTimeout | None = None,
        auth: Auth | None = None,
    ) -> None:
        self.concurrency = concurrency
        self.retries = retries
        self.timeout = timeout  # None: the session's (connect 30 s, read 120 s)
        self.auth = auth
        self._sems: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )

    @property
    def _signs(self) -> bool:
        """Whether requests carry credentials at all (not for good anonymous)."""
        return self.auth is not None and not getattr(self.auth, "anonymous", False)

    def _semaphore(self, loop: asyncio.AbstractEventLoop) -> asyncio.Semaphore:
        sem = self._sems.get(loop)
        if sem is None:
            sem = self._sems[loop] = asyncio.Semaphore(self.concurrency)
        return sem

    async def request(
        self,
        method: str,
        url: str | yarl.URL,
        *,
        what: str,
        headers: Mapping[str, str] | None = None,
        data: Buffer | None = None,
        retry_statuses: frozenset[int] = frozenset(),
        retries: RetryPolicy | None = None,
        crc32c: bool = False,
    ) -> Response:
        """Send the request, retrying transient failures; returns the first
        non-retryable answer. ``what`` names the operation in errors.

        ``retry_statuses``: further statuses that mean "not carried out, try
        again" for this request (e.g. S3's 409 ConditionalRequestConflict).
        ``retries`` overrides the client's policy for this request.
        ``crc32c``: compute the CRC-32C of the answer's body as it arrives
        (:attr:`Response.body_crc32c`).
        """
        # The first attempt is awaited directly: a request that succeeds at once
        # (nearly all) costs no retry closure and no retry loop.
        try:
            return await self._attempt(method, url, 1, headers, data, retry_statuses, False, crc32c)
        except Exception as e:
            first = e
        maybe_applied = self._failed(first, what, False)

        async def attempt(n: int) -> Response:
            nonlocal maybe_applied
            try:
                return await self._attempt(method, url, n, headers, data, retry_statuses,
                                           maybe_applied, crc32c)
            except Exception as e:
                maybe_applied = self._failed(e, what, maybe_applied)
                raise

        try:
            return await with_retries(
                attempt, what=what, policy=retries or self.retries, retry_on=is_transient,
                failed=first,
            )
        except StorageError as e:
            if type(e) is not StorageError or not isinstance(e.__cause__, Exception) \
                    or not is_transient(e.__cause__):
                raise  # not the "attempts used up" error of with_retries
            raise RetriesExhaustedError(str(e), maybe_applied=maybe_applied) from e.__cause__

    def _failed(self, e: Exception, what: str, maybe_applied: bool) -> bool:
        """After attempt failure ``e``: whether an attempt so far may have taken
        effect; a host name that does not exist raises StorageError (not retried)."""
        if isinstance(e, TransientHttpError):
            return maybe_applied or not e.not_applied
        host = unresolvable_host(e)
        if host is not None and isinstance(e, aiohttp.ClientConnectorError):
            raise StorageError(
                f"{what}: cannot resolve host {host!r} ({e.os_error}); not retried "
                f"(no network, or a wrong endpoint?); credentials: {self.describe_auth()}"
            ) from e
        # a transient failure: the request may have reached the server
        return maybe_applied or is_transient(e)

    def describe_auth(self) -> str:
        """The credentials of this client's requests, in words."""
        return "none" if self.auth is None else self.auth.describe()

    async def _attempt(
        self,
        method: str,
        url: str | yarl.URL,
        n: int,
        headers: Mapping[str, str] | None,
        data: Buffer | None,
        retry_statuses: frozenset[int],
        maybe_applied: bool,
        crc32c: bool,
    ) -> Response:
        async with self._semaphore(asyncio.get_running_loop()):
            hdrs = headers
            if self._signs:
                hdrs = dict(headers or {})
                hdrs.update(await self.auth.headers(method, url, hdrs, data))  # type: ignore[union-attr]
            timeout: _Timeout = {} if self.timeout is None else {"timeout": self.timeout}
            async with client_session().request(
                method, url, headers=hdrs, data=data, **timeout
            ) as resp:
                body, crc = (b"", None) if method == "HEAD" else await _read_body(resp, crc32c)
                status, reason = resp.status, resp.reason or ""
                if status in (401, 403) and n == 1 and self.auth is not None \
                        and self.auth.invalidate(status, hdrs):
                    raise TransientHttpError(status, "unauthorized; refreshing credentials",
                                             applied=False)
                if is_retryable_status(status) or status in retry_statuses:
                    text = bytes(body[:200]).decode("utf-8", "replace").strip()
                    raise TransientHttpError(
                        status,
                        f"{reason}: {text}" if text else reason,
                        retry_after=parse_retry_after(resp.headers.get("Retry-After")),
                        applied=False if status in retry_statuses else None,
                    )
                return Response(status, reason, resp.headers, body, n, maybe_applied, crc)


async def _read_body(resp: aiohttp.ClientResponse, crc32c: bool) -> tuple[Buffer, int | None]:
    """The answer's body and, when asked for, its CRC-32C (see the module doc)."""
    n = resp.content_length
    if n is None or n < DIRECT_BODY_BYTES:
        body = await resp.read()
        return body, _crc32c.crc32c(body) if crc32c else None
    buf = memoryview(_bodies.get(n).data)
    got, crc = 0, 0
    while piece := await resp.content.readany():
        end = got + len(piece)
        if end > n:
            raise aiohttp.ClientPayloadError(
                f"{resp.method} {resp.url}: more than the {n} bytes of its Content-Length")
        buf[got:end] = piece
        if crc32c:
            crc = _crc32c.crc32c(piece, crc)
        got = end
    if got != n:
        raise aiohttp.ClientPayloadError(
            f"{resp.method} {resp.url}: {got} of the {n} bytes of its Content-Length")
    return buf, crc if crc32c else None


# -- ranged reads ------------------------------------------------------------------------
def range_header(r: ByteRange) -> str:
    """The ``Range`` header value of a byte range (suffix ranges too)."""
    if r.start < 0:
        return f"bytes=-{-r.start}"
    if r.stop is None:
        return f"bytes={r.start}-"
    return f"bytes={r.start}-{r.stop - 1}"


def partial_body(what: str, r: ByteRange, resp: Response) -> Buffer:
    """The bytes of ``r`` out of a ``206`` answer, checked against its Content-Range."""
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
            f"{what}: bad Content-Range {cr!r} for {len(resp.body)} body bytes"
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
            f"{what}: asked for bytes {want_start}..{want_stop - 1}, server sent {cr!r}"
        )
    return memoryview(resp.body)[want_start - first : want_stop - first]
