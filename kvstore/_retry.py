"""HTTP plumbing shared by the remote stores (gcs, http): what is transient, sessions.

**Retries** (the loop and policy are :mod:`tensorstore_py.core.retry`): only *transient* failures are retried: HTTP 408/429/5xx answers (raised by the
backend as :class:`TransientHttpError`), connection resets, dropped or truncated
responses and timeouts. Everything else (404, 412, other 4xx, checksum errors,
bad arguments) propagates at once. When the attempts are used up the last
failure is raised as :class:`~tensorstore_py.errors.StorageError`, naming what
was being done, how many attempts were made and the last cause.

Note for callers: a request whose response was lost may still have taken effect
on the server. Retrying is harmless for reads and plain overwrites; a retried
*conditional* write can come back as "precondition failed" although the first
attempt landed. ``with_retries`` passes the attempt number to ``fn`` so the
caller can tell a first-attempt failure from a possibly-landed retry.

**Sessions**: :func:`client_session` gives one shared ``aiohttp.ClientSession``
per event loop, created lazily (a session is bound to its loop; the library's
loop is replaced after fork, and users may await stores from their own loops).
After ``os.fork()`` the child never closes the parent's pooled connections: its
copy of the parent's loop shares the parent's epoll set, and unregistering a
socket there would silently stall the parent's requests on that socket.
"""

from __future__ import annotations

import asyncio
import atexit
import os
from typing import Any

__all__ = [
    "TransientHttpError",
    "client_session",
    "is_retryable_status",
    "is_transient",
]

#: HTTP statuses worth retrying: timeout, too many requests, server errors.
_RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})


def is_retryable_status(status: int) -> bool:
    """True for HTTP statuses that mean "try again later" (408, 429, 5xx)."""
    return status in _RETRYABLE_STATUS or 500 <= status <= 599


class TransientHttpError(Exception):
    """A retryable HTTP answer (408/429/5xx). Raised by backends inside an attempt.

    ``retry_after`` is the server's Retry-After hint in seconds, if it sent one.
    """

    def __init__(self, status: int, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.retry_after = retry_after


def is_transient(exc: BaseException) -> bool:
    """The default retry predicate: transient HTTP answers, connection trouble, timeouts."""
    if isinstance(exc, TransientHttpError):
        return True
    if isinstance(exc, (asyncio.TimeoutError, ConnectionError)):
        return True
    try:
        import aiohttp
    except ImportError:  # pragma: no cover - aiohttp is a core dependency
        return False
    # ClientConnectionError covers refused/reset connections and server disconnects;
    # ClientPayloadError a body cut short. A ClientResponseError (an HTTP status) is
    # decided by the backend, which raises TransientHttpError for retryable ones.
    return isinstance(exc, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError))


# -- one aiohttp session per event loop ---------------------------------------------
_sessions: dict[asyncio.AbstractEventLoop, Any] = {}
_orphans: list[Any] = []  # the parent's sessions, kept (never closed) in a forked child
_REQUEST_TIMEOUT: dict[str, Any] = {"total": None, "sock_connect": 30, "sock_read": 120}


def client_session() -> Any:
    """The ``aiohttp.ClientSession`` of the running loop (created on first use).

    Connections are pooled per loop without a global limit: each store bounds its
    own requests. Responses are not decompressed (stores want the stored bytes).
    Do not close it; it is closed at interpreter exit.
    """
    import aiohttp

    loop = asyncio.get_running_loop()
    s = _sessions.get(loop)
    if s is None or s.closed:
        for old in [lp for lp in _sessions if lp.is_closed()]:
            del _sessions[old]  # sessions of loops that are gone (asyncio.run in user code)
        s = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(**_REQUEST_TIMEOUT),
            auto_decompress=False,
            connector=aiohttp.TCPConnector(limit=0),
        )
        # aiohttp silently resends an idempotent request (GET, DELETE) once when the
        # connection drops. We count attempts ourselves (a resent conditional DELETE
        # that had landed would look like a lost race), so switch that off; the
        # attribute is aiohttp's own (its test utilities set it the same way).
        if hasattr(s, "_retry_connection"):
            s._retry_connection = False
        _sessions[loop] = s
    return s


def _after_fork_in_child() -> None:
    global _sessions
    for s in _sessions.values():
        # Forget the pooled sockets without closing them (see the module docstring);
        # these are aiohttp internals, hence the guard.
        try:
            conn = s.connector
            conns = getattr(conn, "_conns", None)
            if isinstance(conns, dict):
                conns.clear()
            conn._closed = True  # no close attempt, no "unclosed" warning at exit
        except AttributeError:  # another aiohttp layout: keeping the reference suffices
            pass
        _orphans.append(s)
    _sessions = {}


os.register_at_fork(after_in_child=_after_fork_in_child)


def _close_sessions() -> None:
    # Close the sessions whose loops still run, so interpreter exit stays quiet.
    for loop, s in list(_sessions.items()):
        if s.closed or loop.is_closed() or not loop.is_running():
            continue
        try:
            asyncio.run_coroutine_threadsafe(s.close(), loop).result(2)
        except (RuntimeError, TimeoutError, OSError):  # best effort at exit
            pass


atexit.register(_close_sessions)
