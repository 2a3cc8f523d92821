"""What opening a gcs array with credentials costs: CPU and wall time per ``tsp.open``.

    python benchmarks/gcs_credentials.py [--opens 40] [--rounds 5]

A fake-gcs-server behind an OAuthFront (tensorstore_py/testing/credential_servers.py,
in a process of its own so its CPU is not counted here): a token endpoint on
loopback, and a front that lets through only requests with a bearer token it
issued. google-auth finds a service-account file (``GOOGLE_APPLICATION_CREDENTIALS``)
whose ``token_uri`` is that endpoint, so each token costs what it costs on a
real machine minus the network: the file read, an RSA-signed assertion and one
HTTP exchange. Each round opens the same zarr3 array ``--opens`` times (every
open builds its stores, reads the metadata with the token) and reads one chunk.
Prints ``name: value unit`` lines, medians over the rounds: ``open_cpu_ms`` (this
process's CPU per open), ``open_wall_ms``, ``token_requests_per_open``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import tempfile
import time
from typing import Any

import numpy as np
from _harness import emit

import tensorstore_py as tsp
from tensorstore_py.testing.credential_servers import OAuthFront, service_account_file
from tensorstore_py.testing.gcs_server import GcsEmulator


def _serve_front(upstream: str, conn: Any) -> None:
    """The OAuthFront in a child process: sends its URL, answers "counters" requests."""
    with OAuthFront(upstream) as front:
        conn.send(front.url)
        while conn.recv() == "counters":
            conn.send(front.counters())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--opens", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    emulator = GcsEmulator().start()
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve_front, args=(emulator.endpoint, child), daemon=True)
    proc.start()
    try:
        url = parent.recv()
        with tempfile.TemporaryDirectory() as home:
            adc = service_account_file(os.path.join(home, "adc.json"), f"{url}/token")
            os.environ.update(GOOGLE_APPLICATION_CREDENTIALS=str(adc), HOME=home,
                              GCE_METADATA_HOST="127.0.0.1:1")
            os.environ.pop("STORAGE_EMULATOR_HOST", None)
            bucket = emulator.create_bucket()
            spec = {"kvstore": {"driver": "gcs", "bucket": bucket, "path": "a/", "endpoint": url,
                                "credentials": "default", "emulator_workarounds": True}}
            data = np.arange(64 * 64, dtype=np.int16).reshape(64, 64)
            tsp.open(spec, create=True, dtype="int16", shape=(64, 64), chunks=(32, 32)) \
                .result(60).write(data).result(60)
            cpu_ms: list[float] = []
            wall_ms: list[float] = []
            tokens: list[float] = []
            for _ in range(args.rounds):
                parent.send("counters")
                before = parent.recv().get("token_requests", 0)
                c0, w0 = time.process_time(), time.perf_counter()
                for _ in range(args.opens):
                    arr = tsp.open(spec).result(60)
                c1, w1 = time.process_time(), time.perf_counter()
                np.testing.assert_array_equal(arr[:32, :32].read().result(60), data[:32, :32])
                parent.send("counters")
                after = parent.recv()["token_requests"]
                cpu_ms.append((c1 - c0) * 1e3 / args.opens)
                wall_ms.append((w1 - w0) * 1e3 / args.opens)
                tokens.append((after - before) / args.opens)
        emit("open_cpu_ms", statistics.median(cpu_ms), "ms")
        emit("open_wall_ms", statistics.median(wall_ms), "ms")
        emit("token_requests_per_open", statistics.median(tokens))
    finally:
        parent.send("stop")
        proc.join(30)
        emulator.stop()


if __name__ == "__main__":
    main()
