"""A connectomics segmentation served the way public datasets are: neuroglancer precomputed.

Builds a 3-scale *sharded* precomputed segmentation (uint64 labels,
``compressed_segmentation``): scale 0 is written from an EM-like label volume,
scales 1 and 2 are ``tsp.downsample(previous scale, [2, 2, 2, 1], "mode")``
written as new scales of the same volume. Then it serves the folder over HTTP
on 127.0.0.1 (a standard-library server with Range requests, started here),
opens every scale through ``http://`` and slices XY, XZ and YZ planes and a
crop, checking each against the local labels and printing timings. Reads
fetch only the shard and minishard indexes and the chunks they need, by byte
range; TensorStore and neuroglancer read the same volume.

    python examples/connectomics.py                     # 256^3 voxels
    python examples/connectomics.py --size 512
    TSP_EXAMPLES_SMALL=1 python examples/connectomics.py   # tiny (used by the tests)
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

import tensorstore_py as tsp


def em_labels(n: int, cell: int, seed: int = 0) -> np.ndarray:
    """Neuron-like segments: cells of about ``cell`` voxels with wavy boundaries (x, y, z, 1)."""
    rng = np.random.default_rng(seed)
    g = n // cell + 2
    ids = rng.integers(1, 2**50, (g, g, g), dtype=np.uint64)
    ids[rng.random(ids.shape) < 0.1] = 0  # some unlabelled space
    x = np.arange(n)
    gx, gy, gz = np.meshgrid(x, x, x, indexing="ij", sparse=True)
    i = ((gx + 5 * np.sin(gy / 7) + 5) // cell).astype(np.int64)
    j = ((gy + 5 * np.sin(gz / 9) + 5) // cell).astype(np.int64)
    k = ((gz + 5 * np.sin(gx / 11) + 5) // cell).astype(np.int64)
    return ids[i, j, k][..., None]


class RangeHandler(SimpleHTTPRequestHandler):
    """Static files with single ``Range: bytes=...`` requests (206), ETags and quiet logs."""

    protocol_version = "HTTP/1.1"  # keep connections open between requests

    def send_head(self):  # type: ignore[no-untyped-def]
        path = self.translate_path(self.path)
        if not os.path.isfile(path):
            self.send_error(404)
            return None
        st = os.stat(path)
        size = st.st_size
        start, stop, partial_ = 0, size, False
        m = re.fullmatch(r"bytes=(\d*)-(\d*)", self.headers.get("Range", ""))
        if m and m[1]:  # bytes=a- or bytes=a-b
            start, stop, partial_ = int(m[1]), size if not m[2] else min(size, int(m[2]) + 1), True
        elif m and m[2]:  # bytes=-n: the last n bytes
            start, partial_ = max(0, size - int(m[2])), True
        if start >= size and partial_:
            self.send_error(416)
            return None
        f = open(path, "rb")
        f.seek(start)
        self.send_response(206 if partial_ else 200)
        if partial_:
            self.send_header("Content-Range", f"bytes {start}-{stop - 1}/{size}")
        self.send_header("Content-Length", str(stop - start))
        self.send_header("ETag", f'"{st.st_ino:x}-{st.st_mtime_ns:x}-{size:x}"')
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        self.remaining = stop - start
        return f

    def copyfile(self, source, outputfile):  # type: ignore[no-untyped-def]
        outputfile.write(source.read(self.remaining))

    def log_message(self, *args):  # type: ignore[no-untyped-def]
        pass


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # readers open many connections at once: no SYN retries


@contextmanager
def serve(root: str) -> Iterator[str]:
    """Serve ``root`` read-only on 127.0.0.1 (a free port); yields the base URL."""
    server = Server(("127.0.0.1", 0), partial(RangeHandler, directory=root))
    thread = threading.Thread(target=server.serve_forever, name="http-server", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def timed(what: str, fn, want: np.ndarray) -> None:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    got = fn()
    dt = time.perf_counter() - t0
    if not np.array_equal(got, want):
        raise SystemExit(f"{what}: read different labels")
    print(f"  {what:<28} {str(got.shape[:3]):<16} {dt * 1e3:7.1f} ms")


def main() -> None:
    # (volume, chunk, shard) edges in voxels; tiny when run by the tests
    size, chunk, shard = (64, 16, 32) if os.environ.get("TSP_EXAMPLES_SMALL") == "1" else (256, 64, 256)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("size", size), ("chunk", chunk), ("shard", shard)):
        p.add_argument(f"--{name}", type=int, default=default, help=f"{name} edge (voxels)")
    args = p.parse_args()
    n, chunk = args.size, args.chunk

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        labels = em_labels(n, cell=max(8, n // 6))
        url = f"file://{tmp}/seg/"
        scale = tsp.open(url, create=True, driver="neuroglancer_precomputed", dtype="uint64",
                         shape=labels.shape, chunks=[chunk] * 3, shards=[args.shard] * 3,
                         compression="compressed_segmentation").result()
        scale.write(labels).result()
        scales = [labels]
        for level in (1, 2):  # each scale: the mode of 2x2x2 blocks of the one before
            down = tsp.downsample(scale, [2, 2, 2, 1], "mode")
            f = 2 ** level
            scale = tsp.open({"driver": "neuroglancer_precomputed", "kvstore": url, "scale_metadata": {
                "size": list(down.shape[:3]), "voxel_offset": list(down.origin[:3]),
                "resolution": [f, f, f], "chunk_size": [chunk] * 3, "encoding": "compressed_segmentation",
                "compressed_segmentation_block_size": [8, 8, 8],
                "sharding": scale.spec()["scale_metadata"]["sharding"]}}, create=True).result()
            scales.append(down.read().result())
            scale.write(scales[-1]).result()
        files = sum(len(fs) for _, _, fs in os.walk(tmp))
        print(f"built a {n}^3 uint64 segmentation, 3 sharded scales ({files} files) "
              f"in {time.perf_counter() - t0:.2f} s")

        with serve(tmp) as base:
            ms = tsp.open_multiscale(f"{base}/seg/").result()
            print(f"{base}/seg/: {len(ms)} scales {[lv.path for lv in ms.levels]}")
            for level, local in enumerate(scales):
                remote = ms.open(level).result()
                m = remote.shape[0] // 2
                print(f"scale {level}: shape {remote.shape}, chunks {remote.chunks}, shards {remote.shards}")
                timed("XY plane (z = mid)", lambda r=remote, m=m: r[:, :, m].read().result(), local[:, :, m])
                timed("XZ plane (y = mid)", lambda r=remote, m=m: r[:, m, :].read().result(), local[:, m, :])
                timed("YZ plane (x = mid)", lambda r=remote, m=m: r[m, :, :].read().result(), local[m, :, :])
                c = max(1, remote.shape[0] // 4)
                box = (slice(m - c // 2, m + c // 2 + 1),) * 3
                timed(f"crop {c}^3 around the centre", lambda r=remote, b=box: r[b].read().result(), local[box])
    print("ok")


if __name__ == "__main__":
    main()
