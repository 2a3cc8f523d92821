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

import tensorstore_py as tsp
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
    with ShapingProxy(server.url, ttfb=0.1) as proxy:
        for _ in range(3):
            t0 = time.monotonic()
            status, body = _get(proxy.endpoint + "/blob")
            assert time.monotonic() - t0 >= 0.1
            assert (status, body) == (200, BLOB)
        # requests in flight together each wait once, not one after another
        proxy.reset_counters()
        t0 = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(_get, [proxy.endpoint + "/blob"] * 8))
        assert results == [(200, BLOB)] * 8
        assert time.monotonic() - t0 < 0.8
        assert proxy.counters()["requests"] == 8
        assert proxy.sequential_round_trips() == 1


def test_bandwidth_caps_each_connection(serve_app: Callable[..., Any]) -> None:
    server = serve_app(_app())
    with ShapingProxy(server.url, bandwidth=4 * 2**20) as proxy:  # 4 MiB/s
        t0 = time.monotonic()
        assert _get(proxy.endpoint + "/blob") == (200, BLOB)
        assert time.monotonic() - t0 >= 0.25 * 0.95  # 1 MiB at 4 MiB/s
        # an upload is held for its size at the same rate, and arrives whole
        req = urllib.request.Request(proxy.endpoint + "/echo", data=BLOB, method="PUT")
        t0 = time.monotonic()
        with urllib.request.urlopen(req, timeout=T) as r:
            assert r.read() == BLOB
        assert time.monotonic() - t0 >= 0.5 * 0.95  # up and down again
        # the cap is per connection: 4 at once take about as long as one
        t0 = time.monotonic()
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(_get, [proxy.endpoint + "/blob"] * 4)) == [(200, BLOB)] * 4
        assert time.monotonic() - t0 < 0.9


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


# -- round trips through the proxy -------------------------------------------------------
def _rounds(proxy: ShapingProxy, op: Callable[[], Any]) -> tuple[int, int]:
    """(sequential round trips, requests) of ``op`` up to the moment it returned."""
    proxy.reset_counters()
    op()
    done = time.monotonic()
    log = [r for r in proxy.request_log() if r[1] < done]
    return proxy.sequential_round_trips(until=done), len(log)


@pytest.mark.parametrize("size", [10, 300_000])
def test_versioned_commit_of_one_key_takes_at_most_4_round_trips(gcs_emulator: Any, size: int) -> None:
    bucket = gcs_emulator.create_bucket()
    with ShapingProxy(gcs_emulator.endpoint, ttfb=0.05) as proxy:
        base = {**gcs_emulator.spec(bucket, path="v/"), "endpoint": proxy.endpoint}
        store = tsp.KvStore.open({"driver": "versioned", "base": base}).result(T)
        for i in range(20):
            store.write(f"k{i:02d}", b"old %d" % i).result(T)  # a warm cache
        value = bytes(range(256)) * (size // 256) + b"!" * (size % 256)
        rounds, _ = _rounds(proxy, lambda: store.write("k07", value).result(T))
        assert rounds <= 4
        reader = tsp.KvStore.open({"driver": "versioned", "base": gcs_emulator.spec(bucket, path="v/")}).result(T)
        assert reader.read("k07").result(T).value == value
        assert reader.read("k08").result(T).value == b"old 8"


def test_gcs_conditional_write_is_one_request(gcs_emulator: Any) -> None:
    bucket = gcs_emulator.create_bucket()
    with ShapingProxy(gcs_emulator.endpoint, ttfb=0.02) as proxy:
        store = tsp.KvStore.open({**gcs_emulator.spec(bucket), "endpoint": proxy.endpoint}).result(T)
        assert _rounds(proxy, lambda: store.write("a", b"1", if_equal=tsp.Generation.NO_VALUE).result(T)) == (1, 1)
        gen = store.read("a").result(T).generation
        assert _rounds(proxy, lambda: store.write("a", b"2", if_equal=gen).result(T)) == (1, 1)
        assert store.read("a").result(T).value == b"2"


def test_s3_conditional_write_is_one_request(s3_server: Any) -> None:
    bucket = s3_server.create_bucket()
    with ShapingProxy(s3_server.endpoint, ttfb=0.02) as proxy:
        store = tsp.KvStore.open({**s3_server.spec(bucket), "endpoint_url": proxy.endpoint}).result(T)
        assert _rounds(proxy, lambda: store.write("a", b"1", if_equal=tsp.Generation.NO_VALUE).result(T)) == (1, 1)
        gen = store.read("a").result(T).generation
        assert _rounds(proxy, lambda: store.write("a", b"2", if_equal=gen).result(T)) == (1, 1)
        assert store.read("a").result(T).value == b"2"
