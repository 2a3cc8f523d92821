"""Slice an EM-like volume over HTTP: random subvolumes and orthogonal planes.

Builds a sharded uint8 volume on local disk, serves it with a static HTTP
server (aiohttp, on 127.0.0.1 at a free port, in a background thread), opens
it through the http kvstore and reads random cubic crops and one plane along
each axis, checking every read against the local copy and printing throughput.

Only the shard index and the inner chunks a crop needs are fetched (HTTP
Range requests), never whole shards.

    python examples/volume_slicing.py                 # 256^3 volume
    python examples/volume_slicing.py --size 512 --crop 64 --reads 100
    TSP_EXAMPLES_SMALL=1 python examples/volume_slicing.py   # tiny (used by the tests)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
from aiohttp import web

import tensorstore_py as tsp


def em_like_volume(n: int, seed: int = 0) -> np.ndarray:
    """Blobby "cells" with membranes and noise: smooth random field, thresholded edges."""
    rng = np.random.default_rng(seed)
    coarse = rng.random((max(2, n // 16),) * 3).astype(np.float32)
    reps = -(-n // coarse.shape[0])
    field = np.kron(coarse, np.ones((reps,) * 3, np.float32))[:n, :n, :n]
    # membranes where the blocky field changes value, plus texture and noise
    edges = np.zeros_like(field, dtype=bool)
    for ax in range(3):
        edges |= np.abs(np.diff(field, axis=ax, prepend=field.take([0], axis=ax))) > 0.25
    vol = 110 + 90 * field
    vol[edges] = 30
    vol += rng.normal(0, 12, vol.shape).astype(np.float32)
    return np.clip(vol, 0, 255).astype(np.uint8)


@contextmanager
def serve_directory(root: str) -> Iterator[str]:
    """Serve ``root`` read-only over HTTP (Range + ETag) on 127.0.0.1; yields the base URL."""
    loop = asyncio.new_event_loop()
    started = threading.Event()
    state: dict[str, object] = {}

    async def start() -> None:
        app = web.Application()
        app.router.add_static("/", root, show_index=False)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        state["runner"] = runner
        state["port"] = runner.addresses[0][1]

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(start())
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=run, name="http-server", daemon=True)
    thread.start()
    started.wait(10)
    try:
        yield f"http://127.0.0.1:{state['port']}"
    finally:
        asyncio.run_coroutine_threadsafe(state["runner"].cleanup(), loop).result(10)  # type: ignore[attr-defined]
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def mib_per_s(nbytes: int, seconds: float) -> float:
    return nbytes / (1 << 20) / max(seconds, 1e-9)


def main() -> None:
    small = os.environ.get("TSP_EXAMPLES_SMALL") == "1"
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", type=int, default=48 if small else 256, help="volume edge (voxels)")
    p.add_argument("--chunk", type=int, default=16 if small else 32, help="inner chunk edge")
    p.add_argument("--shard", type=int, default=32 if small else 128, help="shard edge")
    p.add_argument("--crop", type=int, default=16 if small else 64, help="random crop edge")
    p.add_argument("--reads", type=int, default=5 if small else 50, help="number of random crops")
    args = p.parse_args()
    n, c = args.size, min(args.crop, args.size)

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        vol = em_like_volume(n)
        local = tsp.open(
            f"file://{tmp}/em/", create=True, dtype="uint8", shape=[n, n, n],
            chunks=[args.chunk] * 3, shards=[args.shard] * 3, compression="zstd",
            dimension_names=["z", "y", "x"],
        ).result()
        local.write(vol).result()
        print(f"built {n}^3 uint8 volume (chunks {args.chunk}^3 in shards {args.shard}^3) "
              f"in {time.perf_counter() - t0:.2f} s")

        with serve_directory(tmp) as base_url:
            remote = tsp.open(f"{base_url}/em/").result()
            print(f"opened {base_url}/em/ : shape {remote.shape}, labels {remote.labels}, "
                  f"chunks {remote.chunks}, shards {remote.shards}")

            rng = np.random.default_rng(1)
            t0 = time.perf_counter()
            nbytes = 0
            for _ in range(args.reads):
                z, y, x = (int(v) for v in rng.integers(0, n - c + 1, 3))
                crop = remote[z:z + c, y:y + c, x:x + c].read().result()
                if not np.array_equal(crop, vol[z:z + c, y:y + c, x:x + c]):
                    raise SystemExit(f"crop at {(z, y, x)} differs from the local volume")
                nbytes += crop.nbytes
            dt = time.perf_counter() - t0
            print(f"random {c}^3 crops: {args.reads / dt:.1f} crops/s, {mib_per_s(nbytes, dt):.1f} MiB/s")

            for label in ("z", "y", "x"):
                mid = n // 2
                t0 = time.perf_counter()
                plane = remote.dims[label][mid].read().result()
                dt = time.perf_counter() - t0
                want = np.take(vol, mid, axis="zyx".index(label))
                if not np.array_equal(plane, want):
                    raise SystemExit(f"plane {label}={mid} differs from the local volume")
                print(f"plane {label}={mid} {plane.shape}: {dt * 1e3:.1f} ms, "
                      f"{mib_per_s(plane.nbytes, dt):.1f} MiB/s")
    print("ok")


if __name__ == "__main__":
    main()
