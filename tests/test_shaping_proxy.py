"""The network-shaping proxy, and round trips of object-store operations counted through it.

A real aiohttp server (and the GCS emulator, moto) on 127.0.0.1 behind a
ShapingProxy: a time to first byte per request, a per-connection bandwidth,
seeded faults, and the longest chain of sequential requests an operation waits for.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from aiohttp import web

from tensorstore_py.testing.shaping_proxy import ShapingProxy

T = 60
BLOB = bytes(range(256)) * 4096  # 1 MiB


def _app() -> web.Application:
    async def blob(request: web.Request) -> web.Response:
        return web.Response(body=BLOB)

    async def echo(request: web.Request) -> web.Response:
        return web.Response(body=await request.read())

    app = web.Application()
    app.router.add_get("/blob", blob)
    app.router.add_put("/echo", echo)
    return app


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=T) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_every_request_waits_at_least_the_ttfb(serve_app: Callable[..., Any]) -> None:
    server = serve_app(_app())
    with ShapingProxy(server.url, ttfb=0.2) as proxy:
        for _ in range(3):
            t0 = time.monotonic()
            status, body = _get(proxy.endpoint + "/blob")
            assert time.monotonic() - t0 >= 0.2
            assert (status, body) == (200, BLOB)
        # requests in flight together each wait once, not one after another
        proxy.reset_counters()
        t0 = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(_get, [proxy.endpoint + "/blob"] * 8))
        assert results == [(200, BLOB)] * 8
        assert time.monotonic() - t0 < 1.2  # one after another: 1.6 s
        assert proxy.counters()["requests"] == 8
        assert proxy.sequential_round_trips() == 1


def test_bandwidth_caps_each_connection(serve_app: Callable[..., Any]) -> None:
    server = serve_app(_app())
    with ShapingProxy(server.url, bandwidth=2 * 2**20) as proxy:  # 2 MiB/s
        t0 = time.monotonic()
        assert _get(proxy.endpoint + "/blob") == (200, BLOB)
        assert time.monotonic() - t0 >= 0.5 * 0.95  # 1 MiB at 2 MiB/s
        # an upload is held for its size at the same rate, and arrives whole
        req = urllib.request.Request(proxy.endpoint + "/echo", data=BLOB, method="PUT")
        t0 = time.monotonic()
        with urllib.request.urlopen(req, timeout=T) as r:
            assert r.read() == BLOB
        assert time.monotonic() - t0 >= 1.0 * 0.95  # up and down again
        # the cap is per connection: 4 at once take about as long as one
        t0 = time.monotonic()
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(_get, [proxy.endpoint + "/blob"] * 4)) == [(200, BLOB)] * 4
        assert time.monotonic() - t0 < 1.5  # one after another: 2 s


def test_faults_at_the_given_rate_are_reproducible_with_a_seed(
    serve_app: Callable[..., Any],
) -> None:
    server = serve_app(_app())

    def statuses(seed: int) -> list[int]:
        with ShapingProxy(server.url, ttfb=0.001, fault_rate=0.3, seed=seed,
                          kinds=("503", "429")) as proxy:
            out = [_get(proxy.endpoint + "/blob")[0] for _ in range(60)]
            assert proxy.counters()["faults"] == sum(s != 200 for s in out)
            return out

    first = statuses(7)
    assert first == statuses(7)
    assert first != statuses(8)
    faults = sum(s != 200 for s in first)
    assert 8 <= faults <= 30  # 30% of 60, give or take
    assert set(first) == {200, 503, 429}


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="ttfb"):
        ShapingProxy("http://127.0.0.1:1", ttfb=-1)
    with pytest.raises(ValueError, match="bandwidth"):
        ShapingProxy("http://127.0.0.1:1", bandwidth=0)


def test_a_kept_connection_pays_the_handshake_once(serve_app: Callable[..., Any]) -> None:
    import http.client

    server = serve_app(_app())
    with ShapingProxy(server.url, ttfb=0.05, handshake=0.3) as proxy:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=T)
        t0 = time.monotonic()
        for _ in range(4):
            conn.request("GET", "/blob")
            resp = conn.getresponse()
            assert (resp.status, resp.read()) == (200, BLOB)
        elapsed = time.monotonic() - t0
        conn.close()
        assert 0.3 + 4 * 0.05 <= elapsed < 2 * 0.3 + 4 * 0.05
        assert proxy.counters()["connections"] == 1
        # a connection per request pays it every time
        t0 = time.monotonic()
        for _ in range(2):
            assert _get(proxy.endpoint + "/blob") == (200, BLOB)
        assert time.monotonic() - t0 >= 2 * (0.3 + 0.05)
        assert proxy.counters()["connections"] == 3
