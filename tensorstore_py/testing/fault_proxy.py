"""A loopback HTTP proxy that injects real network faults, for retry tests.

It sits in front of an HTTP server (e.g. the GCS emulator) and, for a seeded
fraction of requests, misbehaves in one of these ways::

    "503"            answer 503 Service Unavailable (request not forwarded)
    "429"            answer 429 Too Many Requests (request not forwarded)
    "reset"          drop the connection without answering (request not forwarded)
    "lost_response"  forward the request, then drop the connection: the server
                     acted on it but the client never hears back
    "truncate"       forward, then send the head and half of the body, then drop
    "no_such_upload" (scripted only) answer 404 with S3's NoSuchUpload error
                     document, not forwarded: what S3 may answer the retried
                     completion of a multipart upload that already completed

Everything else is relayed byte for byte. Each connection carries one request
(the proxy asks upstream for ``Connection: close`` and relays that), so a
dropped connection never poisons a pooled one; with ``keep_alive=True`` a
client connection carries requests one after another as a cloud store's does
(each still goes upstream on a connection of its own; a fault or an answer
without a length ends the client's connection). Decisions come from
``random.Random(seed)`` in arrival order, after those of :meth:`script` (exact
decisions for the next requests, for deterministic tests); ``on_fault(kind,
request_head)`` runs (on a worker thread) when a fault is injected, after a
forwarded request got its answer and before the client learns anything: a test
can make another writer act exactly in that window. :attr:`counters` tells how
many requests arrived, were forwarded (and their bytes), and which faults were
injected::

    with FaultProxy(emulator.endpoint, fault_rate=0.3, seed=1) as proxy:
        spec = {..., "endpoint": proxy.endpoint}
        ...
        assert proxy.counters()["faults"] > 0

The proxy runs its own event loop on a background thread, separate from the
library's loop, so it keeps serving while test code blocks on Futures.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Self
from urllib.parse import urlsplit

__all__ = ["FAULT_KINDS", "SCRIPT_KINDS", "FaultProxy"]

FAULT_KINDS: tuple[str, ...] = ("503", "429", "reset", "lost_response", "truncate")
#: what :meth:`FaultProxy.script` takes besides FAULT_KINDS (never drawn at random)
SCRIPT_KINDS: tuple[str, ...] = FAULT_KINDS + ("no_such_upload",)
_HOP_HEADERS = {b"connection", b"keep-alive", b"proxy-connection"}


class FaultProxy:
    """A fault-injecting HTTP/1.1 proxy on 127.0.0.1 (port chosen by the OS)."""

    def __init__(
        self,
        upstream: str,
        *,
        fault_rate: float = 0.3,
        seed: int = 0,
        kinds: Sequence[str] = FAULT_KINDS,
        on_fault: Callable[[str, bytes], None] | None = None,
        keep_alive: bool = False,
    ) -> None:
        parts = urlsplit(upstream if "://" in upstream else "http://" + upstream)
        if parts.scheme != "http" or not parts.hostname or not parts.port:
            raise ValueError(f"FaultProxy: upstream must be http://host:port, got {upstream!r}")
        bad = set(kinds) - set(FAULT_KINDS)
        if bad or not kinds:
            raise ValueError(f"FaultProxy: unknown fault kinds {sorted(bad)}; known: {FAULT_KINDS}")
        if not 0.0 <= fault_rate <= 1.0:
            raise ValueError(f"FaultProxy: fault_rate must be in [0, 1], got {fault_rate}")
        self.upstream_host = parts.hostname
        self.upstream_port = parts.port
        self.fault_rate = fault_rate
        self.kinds = tuple(kinds)
        self._rng = random.Random(seed)
        self._script: list[str | None] = []
        self.on_fault = on_fault
        self.keep_alive = keep_alive
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._in_flight = 0
        self._log: list[list[Any]] = []  # [request line, arrived, answered]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    # -- lifecycle ---------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Self:
        loop = asyncio.new_event_loop()
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                self._server = loop.run_until_complete(
                    asyncio.start_server(self._handle, "127.0.0.1", 0)
                )
                self.port = self._server.sockets[0].getsockname()[1]
            except BaseException as e:
                failure.append(e)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

        self._loop = loop
        self._thread = threading.Thread(target=run, name="fault-proxy", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            raise failure[0]
        return self

    def stop(self) -> None:
        loop, server = self._loop, self._server
        if loop is None or self._thread is None:
            return

        async def shutdown() -> None:
            if server is not None:
                server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(shutdown(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(5)
        self._loop = self._thread = self._server = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- counters ------------------------------------------------------------------------
    def counters(self) -> dict[str, Any]:
        """``{"requests", "connections", "forwarded", "bytes_forwarded", "faults",
        "by_kind": {kind: n}, "max_in_flight"}``.

        ``bytes_forwarded`` counts the request bytes (head and body) sent upstream;
        ``max_in_flight`` is the most requests the proxy held open at once.
        """
        with self._lock:
            by_kind = {k: self._counts[k] for k in self.kinds}
            return {
                "requests": self._counts["requests"],
                "connections": self._counts["connections"],
                "forwarded": self._counts["forwarded"],
                "bytes_forwarded": self._counts["bytes_forwarded"],
                "faults": sum(by_kind.values()),
                "by_kind": by_kind,
                "max_in_flight": self._counts["max_in_flight"],
            }

    def reset_counters(self) -> None:
        """Zero the counters and forget the request log."""
        with self._lock:
            self._counts.clear()
            self._log.clear()

    def request_log(self) -> list[tuple[str, float, float]]:
        """``(request line, arrived, answered)`` per request since the last
        :meth:`reset_counters`, in arrival order (``time.monotonic()`` seconds:
        arrived = its whole request was read, answered = its answer was sent)."""
        with self._lock:
            return sorted(((r[0], r[1], r[2]) for r in self._log), key=lambda r: r[1])

    def sequential_round_trips(self, until: float | None = None) -> int:
        """The longest chain of requests each of which arrived after the one
        before it was answered: how many round trips the client waited for one
        after another (requests in flight together count once). Exact when
        concurrent requests overlap, which a time to first byte ensures.
        ``until`` (a ``time.monotonic()`` instant): count only requests that
        arrived before it, e.g. leave out what an operation sends after it
        returned."""
        log = [r for r in self.request_log() if until is None or r[1] < until]
        chain, last_end = 0, float("-inf")
        for _, start, end in sorted(log, key=lambda r: r[2]):
            if start >= last_end:  # greedy by end time: the longest such chain
                chain, last_end = chain + 1, end
        return chain

    def script(self, decisions: Sequence[str | None]) -> None:
        """Decide the next requests exactly: a fault kind, or None to relay one
        untouched; random decisions resume once these are used up."""
        bad = {d for d in decisions if d is not None} - set(SCRIPT_KINDS)
        if bad:
            raise ValueError(f"FaultProxy: unknown fault kinds {sorted(bad)}; known: {SCRIPT_KINDS}")
        with self._lock:
            self._script.extend(decisions)

    def _decide(self) -> str | None:
        with self._lock:
            self._counts["requests"] += 1
            if self._script:
                kind = self._script.pop(0)
                if kind is not None:
                    self._counts[kind] += 1
                return kind
            if self._rng.random() < self.fault_rate:
                kind = self._rng.choice(self.kinds)
                self._counts[kind] += 1
                return kind
            return None

    # -- connections and requests ------------------------------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            with self._lock:
                self._counts["connections"] += 1
            await self._connected()
            while True:
                got = await _read_request(reader)
                if got is None:
                    return
                request, client_close = got
                if not await self._one(writer, request, self.keep_alive and not client_close):
                    return
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass  # the client went away; nothing to relay
        except asyncio.CancelledError:
            pass  # stop() with a kept connection waiting for its next request
        finally:
            if not writer.transport.is_closing():
                writer.close()

    async def _connected(self) -> None:
        """A client connection was accepted (a subclass may make it cost time)."""

    async def _one(self, writer: asyncio.StreamWriter, request: bytes, keep_alive: bool) -> bool:
        """Serve one request; True when the connection may carry another."""
        arrived = time.monotonic()
        kind = self._decide()
        with self._lock:
            self._in_flight += 1
            self._counts["max_in_flight"] = max(self._counts["max_in_flight"], self._in_flight)
        released = False
        entry = [request.partition(b"\r\n")[0].decode("latin-1"), arrived, arrived]

        def release() -> None:
            # Called before the client can learn the outcome, so a client that
            # bounds its requests never shows more than its bound here, and
            # the request is in the log before its client can go on.
            nonlocal released
            if not released:
                released = True
                with self._lock:
                    self._in_flight -= 1
                    entry[2] = time.monotonic()
                    self._log.append(entry)

        try:
            return await self._serve(writer, request, kind, release, keep_alive)
        finally:
            release()
            with self._lock:
                entry[2] = time.monotonic()  # answered: the whole answer was sent

    async def _serve(
        self,
        writer: asyncio.StreamWriter,
        request: bytes,
        kind: str | None,
        release: Callable[[], None],
        keep_alive: bool = False,
    ) -> bool:
        """Answer one request (``kind``: the fault to inject, or None); True when
        the client's connection stays open (``keep_alive`` asked for it)."""
        if kind in ("503", "429", "reset", "no_such_upload"):
            await self._notify(kind, request)
            release()
            if kind == "reset":
                writer.transport.abort()
            elif kind == "no_such_upload":
                await _answer_no_such_upload(writer)
            else:
                await _answer(writer, int(kind), head_only=request.startswith(b"HEAD "))
            return False
        with self._lock:
            self._counts["forwarded"] += 1
            self._counts["bytes_forwarded"] += len(request)
        response = await self._forward(request)
        if kind is not None:
            await self._notify(kind, request)
        release()
        if kind == "lost_response":
            writer.transport.abort()
            return False
        if kind == "truncate":
            head, sep, body = response.partition(b"\r\n\r\n")
            writer.write(head + sep + body[: len(body) // 2])
            await writer.drain()
            writer.transport.abort()
            return False
        keep = False
        if keep_alive:
            response, keep = _kept_alive(response)
        await self._send(writer, response)
        return keep

    async def _send(self, writer: asyncio.StreamWriter, response: bytes) -> None:
        """Relay an upstream answer to the client (a subclass may pace it)."""
        writer.write(response)
        await writer.drain()

    async def _notify(self, kind: str, request: bytes) -> None:
        if self.on_fault is not None:
            head = request.partition(b"\r\n\r\n")[0]
            await asyncio.get_running_loop().run_in_executor(None, self.on_fault, kind, head)

    async def _forward(self, request: bytes) -> bytes:
        up_reader, up_writer = await asyncio.open_connection(self.upstream_host, self.upstream_port)
        try:
            up_writer.write(request)
            await up_writer.drain()
            return await up_reader.read()  # until EOF: we asked for Connection: close
        finally:
            up_writer.close()


async def _read_request(reader: asyncio.StreamReader) -> tuple[bytes, bool] | None:
    """One request (head rewritten to ``Connection: close``, body as sent) and
    whether its client asked to close the connection after it; None at EOF."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    lines = head[:-4].split(b"\r\n")
    kept = [lines[0]]
    length = 0
    chunked = False
    client_close = False
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        lname = name.strip().lower()
        if lname in _HOP_HEADERS:
            client_close = client_close or (lname == b"connection" and b"close" in value.lower())
            continue
        if lname == b"content-length":
            length = int(value.strip())
        elif lname == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
        kept.append(line)
    kept.append(b"Connection: close")  # to upstream (one request per upstream connection)
    out = b"\r\n".join(kept) + b"\r\n\r\n"
    if chunked:
        body = bytearray()
        while True:
            size_line = await reader.readuntil(b"\r\n")
            body += size_line
            size = int(size_line.split(b";")[0].strip(), 16)
            if size == 0:
                # trailers, then an empty line
                while True:
                    line = await reader.readuntil(b"\r\n")
                    body += line
                    if line == b"\r\n":
                        break
                break
            body += await reader.readexactly(size + 2)
        return out + bytes(body), client_close
    return out + (await reader.readexactly(length) if length else b""), client_close


async def _answer(writer: asyncio.StreamWriter, status: int, *, head_only: bool = False) -> None:
    reason = {503: "Service Unavailable", 429: "Too Many Requests"}[status]
    body = (
        f'{{"error": {{"code": {status}, "message": "injected fault: {reason}"}}}}'
    ).encode()
    writer.write(
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nRetry-After: 0\r\nConnection: close\r\n\r\n".encode()
        + (b"" if head_only else body)  # an answer to HEAD has no body
    )
    await writer.drain()


async def _answer_no_such_upload(writer: asyncio.StreamWriter) -> None:
    body = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>NoSuchUpload</Code>'
            b"<Message>The specified upload does not exist. The upload ID may be invalid, or the "
            b"upload may have been aborted or completed. (injected)</Message></Error>")
    writer.write(
        f"HTTP/1.1 404 Not Found\r\nContent-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body
    )
    await writer.drain()


def _kept_alive(response: bytes) -> tuple[bytes, bool]:
    """``response`` for a client connection that stays open (its ``Connection``
    headers dropped), and whether it can: its body must carry its own length."""
    head, sep, body = response.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    kept = [lines[0]]
    framed = False
    for line in lines[1:]:
        lname = line.partition(b":")[0].strip().lower()
        if lname in _HOP_HEADERS:
            continue
        framed = framed or lname == b"content-length" or (
            lname == b"transfer-encoding" and b"chunked" in line.lower())
        kept.append(line)
    status = lines[0].split(b" ", 2)[1:2]
    if not framed and status not in ([b"204"], [b"304"]) and not status[0].startswith(b"1"):
        return response, False  # its end is the end of the connection
    return b"\r\n".join(kept) + sep + body, True
