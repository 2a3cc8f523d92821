"""A loopback HTTP proxy that makes a local server answer like a cloud store.

:class:`ShapingProxy` is a :class:`~tensorstore_py.testing.fault_proxy.FaultProxy`
that also shapes the traffic it relays, for tests and benchmarks alike:

* ``ttfb`` (seconds): every request waits this long, once its request has been
  read, before it is forwarded; its answer's first byte therefore comes at
  least ``ttfb`` after the request was sent (a cloud store's 10-100 ms).
* ``bandwidth`` (bytes per second, optional): each connection carries at most
  this much in each direction. An upload of ``n`` bytes is held ``n /
  bandwidth`` before it is forwarded; an answer is relayed in 64 KiB slices
  no faster than ``bandwidth``. A connection carries one request at a time,
  so the cap is per request in flight: total throughput grows with the
  requests a client keeps in flight, as with a cloud store.
* ``handshake`` (seconds, ``2 x ttfb`` by default): what a new connection
  costs before its first request (TCP and TLS set-up). Client connections
  stay open for further requests (``keep_alive``, as with a cloud store), so
  a client that reuses its connections pays it once per connection.
* ``fault_rate``, ``kinds``, ``seed`` (as FaultProxy, 0 by default): a
  seeded fraction of requests fails in one of FaultProxy's ways, the same
  requests for the same seed and arrival order; a fault ends its connection.

The request log and :meth:`~FaultProxy.sequential_round_trips` count how many
round trips an operation waits for one after another::

    with ShapingProxy(emulator.endpoint, ttfb=0.02) as proxy:
        store = tsp.KvStore.open({**emulator.spec(bucket), "endpoint": proxy.endpoint}).result()
        proxy.reset_counters()
        store.write("k", b"v").result()
        assert proxy.sequential_round_trips() == 1

It works in front of fake-gcs-server (``endpoint``), moto (``endpoint_url``)
and any HTTP server, and in front of other libraries too (TensorStore through
``TENSORSTORE_GCS_HTTP_URL``, gcsfs through ``endpoint_url``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from tensorstore_py.testing.fault_proxy import FAULT_KINDS, FaultProxy

__all__ = ["ShapingProxy"]

_SLICE = 64 * 1024


class ShapingProxy(FaultProxy):
    """A proxy on 127.0.0.1 that adds a time to first byte, a per-connection
    bandwidth and (optionally) seeded faults to every request it relays."""

    def __init__(
        self,
        upstream: str,
        *,
        ttfb: float = 0.0,
        bandwidth: float | None = None,
        fault_rate: float = 0.0,
        seed: int = 0,
        kinds: Sequence[str] = FAULT_KINDS,
        on_fault: Callable[[str, bytes], None] | None = None,
        handshake: float | None = None,
        keep_alive: bool = True,
    ) -> None:
        if not ttfb >= 0.0:
            raise ValueError(f"ShapingProxy: ttfb must be >= 0 seconds, got {ttfb}")
        if bandwidth is not None and not bandwidth > 0:
            raise ValueError(f"ShapingProxy: bandwidth must be > 0 bytes/s or None, got {bandwidth}")
        if handshake is not None and not handshake >= 0.0:
            raise ValueError(f"ShapingProxy: handshake must be >= 0 seconds, got {handshake}")
        super().__init__(upstream, fault_rate=fault_rate, seed=seed, kinds=kinds, on_fault=on_fault,
                         keep_alive=keep_alive)
        self.ttfb = ttfb
        self._handshake = handshake
        self.bandwidth = bandwidth

    @property
    def handshake(self) -> float:
        """Seconds a new client connection costs before its first request is
        read (TCP and TLS set-up): ``2 x ttfb`` unless given."""
        return 2 * self.ttfb if self._handshake is None else self._handshake

    def __repr__(self) -> str:
        return (
            f"ShapingProxy({self.endpoint} -> {self.upstream_host}:{self.upstream_port}, "
            f"ttfb={self.ttfb}, bandwidth={self.bandwidth}, fault_rate={self.fault_rate})"
        )

    async def _serve(
        self,
        writer: asyncio.StreamWriter,
        request: bytes,
        kind: str | None,
        release: Callable[[], None],
        keep_alive: bool = False,
    ) -> bool:
        delay = self.ttfb
        if self.bandwidth is not None:
            delay += len(request) / self.bandwidth  # the upload at the capped rate
        if delay > 0:
            await asyncio.sleep(delay)
        return await super()._serve(writer, request, kind, release, keep_alive)

    async def _connected(self) -> None:
        if self.handshake > 0:
            await asyncio.sleep(self.handshake)

    async def _send(self, writer: asyncio.StreamWriter, response: bytes) -> None:
        if self.bandwidth is None:
            await super()._send(writer, response)
            return
        start = time.monotonic()
        view = memoryview(response)
        for offset in range(0, len(view), _SLICE):
            piece = view[offset : offset + _SLICE]
            writer.write(piece)
            await writer.drain()
            due = start + (offset + len(piece)) / self.bandwidth
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
