"""A part of a raw chunk larger than 2 GiB is read by byte ranges: peak RSS of a
subprocess reading a small box stays far below the chunk's size. The chunk is a
sparse file (no disk is spent) with known bytes where the box lies."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tensorstore_py as tsp

N = 40000  # a (N, N) uint16 chunk: 3.0 GiB
BOX = (slice(1000, 1040), slice(30000, 30100))

_READER = r"""
import json, sys
import numpy as np
import tensorstore_py as tsp
from tensorstore_py.testing.rss import peak_rss
spec, box, column = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3] == "1"
arr = tsp.open(spec).result()
got = arr[box[0][0]:box[0][1], box[1][0]:box[1][1]].read().result()
# a column: one element per row of the chunk (one ranged read per row)
plane = arr[:, 7].read().result() if column else np.zeros(1, np.uint16)
print(json.dumps({"rss_mib": peak_rss() / 2**20,
                  "box": got.tolist(), "plane_sum": int(plane.sum(dtype=np.int64)),
                  "plane_nonzero": int(np.count_nonzero(plane))}))
"""


def _expected_box() -> np.ndarray:
    rows = np.arange(BOX[0].start, BOX[0].stop)[:, None]
    cols = np.arange(BOX[1].start, BOX[1].stop)[None, :]
    return ((rows * 7 + cols) % 60000 + 1).astype(np.uint16)


def _sparse_volume(root: Path, driver: str) -> dict:
    arr = tsp.open(f"file://{root}/", create=True, shape=(N, N), dtype="uint16", chunks=(N, N),
                   compression=None, driver=driver).result()
    assert arr.driver._codec.raw  # the bytes codec alone: stored bytes are the C-order bytes
    chunk = root / arr.driver.chunk_key((0, 0))
    chunk.parent.mkdir(parents=True, exist_ok=True)
    box = _expected_box()
    with open(chunk, "wb") as f:
        f.truncate(2 * N * N)  # a hole of 3 GiB
        for i, row in enumerate(box):
            f.seek(2 * ((BOX[0].start + i) * N + BOX[1].start))
            f.write(row.astype("<u2").tobytes())
        for r in (0, 5, N - 1):  # column 7 of three rows
            f.seek(2 * (r * N + 7))
            f.write(np.uint16(r % 200 + 1).astype("<u2").tobytes())
    return {"file": {"driver": driver, "kvstore": f"file://{root}/"},
            "fsspec": {"driver": driver, "kvstore": {"driver": "fsspec", "url": f"file://{root}/"}}}


@pytest.mark.parametrize("store,driver", [("file", "zarr3"), ("fsspec", "zarr3"), ("file", "zarr")])
def test_a_box_of_a_2_gib_raw_chunk_reads_without_the_chunk(tmp_path: Path, store: str, driver: str) -> None:
    spec = _sparse_volume(tmp_path / "v", driver)[store]
    box = [[BOX[0].start, BOX[0].stop], [BOX[1].start, BOX[1].stop]]
    out = subprocess.run([sys.executable, "-c", _READER, json.dumps(spec), json.dumps(box),
                          "1" if store == "file" else "0"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    np.testing.assert_array_equal(np.array(res["box"], np.uint16), _expected_box())
    if store == "file":
        assert res["plane_nonzero"] == 3 and res["plane_sum"] == 1 + 6 + ((N - 1) % 200 + 1)
    print(f"{store}: peak RSS {res['rss_mib']:.0f} MiB")
    assert res["rss_mib"] < 600, f"peak RSS {res['rss_mib']:.0f} MiB for a chunk of {2 * N * N >> 20} MiB"
