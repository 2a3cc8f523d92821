"""Decompression bombs stop at the chunk's size (issue 10 item 14).

Every decoder -- zstd with or without a declared content size, with the chunk's
decoded size known or not, gzip/zlib, bz2, lzma, blosc, lz4 -- raises
DataCorruptionError naming the chunk after at most about one chunk of output,
whatever the data would decode to. Chunks of well-formed streaming writers
(zstd frames without a content size, several frames) still read.
"""

from __future__ import annotations

import bz2
import functools
import json
import lzma
import subprocess
import sys
import tracemalloc
import zlib
from pathlib import Path

import numcodecs
import numpy as np
import pytest
from _bombs import zstd_declaring, zstd_rle_frame

import tensorstore_py as tsp

CHUNK = 1 << 16  # bytes per chunk in every array below


def _zarr3(path: Path, codecs: list) -> tsp.TensorStore:
    return tsp.open({"driver": "zarr3", "kvstore": f"file://{path}", "metadata": {
        "zarr_format": 3, "node_type": "array", "shape": [CHUNK], "data_type": "uint8",
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [CHUNK]}},
        "chunk_key_encoding": {"name": "default"}, "fill_value": 0, "codecs": codecs}},
        create=True).result()


def _zarr2(path: Path, compressor: dict, filters: list | None = None) -> tsp.TensorStore:
    return tsp.open({"driver": "zarr", "kvstore": f"file://{path}", "metadata": {
        "zarr_format": 2, "shape": [CHUNK // 4], "chunks": [CHUNK // 4], "dtype": "<u4",
        "compressor": compressor, "filters": filters, "fill_value": 0, "order": "C"}},
        create=True).result()


def _put(a: tsp.TensorStore, data: bytes) -> None:
    """Store ``data`` as the array's only chunk, as another writer would."""
    key = "c/0" if a.driver.driver == "zarr3" else "0"
    a.kvstore.write(key, data).result()


_ZSTD = [{"name": "bytes"}, {"name": "zstd", "configuration": {"level": 1, "checksum": False}}]
_DELTA = [{"id": "delta", "dtype": "<u4"}]

_CHILD = r"""
import json, resource, sys
# with the unbounded decoders of before, an 8 GiB bomb then fails fast (MemoryError)
# instead of taking the machine's memory
resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))
import tensorstore_py as tsp
from tensorstore_py.testing.rss import peak_rss as peak

out = {}
for name, url in json.loads(sys.argv[1]).items():
    a = tsp.open(url).result()
    before = peak()
    try:
        a.read().result()
        err, msg = "none", ""
    except Exception as e:
        err, msg = type(e).__name__, str(e)
    out[name] = {"error": err, "message": msg, "growth": peak() - before}
print(json.dumps(out))
"""


def test_8_gib_zstd_bombs_stop_at_the_chunk_size(tmp_path: Path) -> None:
    """An 8 GiB zstd bomb (256 KiB stored) in a 64 KiB chunk: whether its frame
    declares no content size (decoded into exactly the chunk's bytes), the
    chunk's size is unknown (zarr v2 filters before zstd: a streaming decoder
    capped at the chunk's limit), or it declares 8 GiB: DataCorruptionError,
    and the reader's peak memory grows by less than 64 MiB (it reached 8 GiB
    before)."""
    bomb = zstd_rle_frame(8 << 30)
    cases = {
        "zarr3-no-content-size": (_zarr3(tmp_path / "a", _ZSTD), bomb),
        "zarr2-filters-no-content-size": (_zarr2(tmp_path / "b", {"id": "zstd", "level": 1}, _DELTA), bomb),
        "zarr2-declares-8GiB": (_zarr2(tmp_path / "c", {"id": "zstd", "level": 1}), zstd_declaring(8 << 30)),
    }
    for a, data in cases.values():
        _put(a, data)
    urls = {name: f"file://{a.kvstore.path}" for name, (a, _) in cases.items()}
    p = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(urls)], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)
    for name in cases:
        assert got[name]["error"] == "DataCorruptionError", (name, got[name])
        assert "'0'" in got[name]["message"] or "'c/0'" in got[name]["message"], got[name]
        assert got[name]["growth"] < 64 << 20, (name, got[name])


@functools.cache
def _bombs_32_mib() -> dict[str, tuple[dict, bytes]]:
    zeros = bytes(32 << 20)
    raw_filters = [{"id": lzma.FILTER_LZMA2, "dict_size": 1 << 20}]
    return {
        "gzip": ({"id": "gzip", "level": 1}, zlib.compress(zeros, 1, wbits=31)),
        "zlib": ({"id": "zlib", "level": 1}, zlib.compress(zeros, 1)),
        "bz2": ({"id": "bz2", "level": 9}, bz2.compress(zeros, 9)),
        "lzma": ({"id": "lzma"}, lzma.compress(zeros, preset=0)),
        # (the decoder's dictionary, 1 MiB here, comes on top of the output)
        "lzma-raw": ({"id": "lzma", "format": lzma.FORMAT_RAW, "filters": raw_filters},
                     lzma.compress(zeros, format=lzma.FORMAT_RAW, filters=raw_filters)),
        "blosc": ({"id": "blosc", "cname": "lz4", "clevel": 1, "shuffle": 0},
                  bytes(numcodecs.Blosc("lz4", 1, 0).encode(zeros))),
        "lz4": ({"id": "lz4"}, bytes(numcodecs.LZ4().encode(zeros))),
        "zstd": ({"id": "zstd", "level": 1}, zstd_rle_frame(32 << 20)),
    }


@pytest.mark.parametrize("filters", [None, _DELTA], ids=["size-known", "size-unknown"])
@pytest.mark.parametrize("name", list(_bombs_32_mib()))
def test_zarr2_compressor_bombs_are_refused_without_allocating(tmp_path: Path, name: str,
                                                               filters: list | None) -> None:
    """32 MiB bombs in 64 KiB zarr v2 chunks: at most the chunk (or, when
    filters hide its size, the chunk's limit) is ever decoded. numcodecs
    decoded bz2 and lzma whole before the size check."""
    compressor, data = _bombs_32_mib()[name]
    a = _zarr2(tmp_path, compressor, filters)
    _put(a, data)
    tracemalloc.start()
    try:
        with pytest.raises(tsp.DataCorruptionError, match="'0'"):
            a.read().result()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"{name}: {peak} bytes at the peak"


def test_zstd_frames_without_content_size_read(tmp_path: Path) -> None:
    """A streaming writer's frames (no content size; several frames) decode to
    the right values, with the chunk's size known or not."""
    want = np.full(CHUNK, 7, np.uint8)
    a = _zarr3(tmp_path / "a", _ZSTD)
    for data in (zstd_rle_frame(CHUNK), zstd_rle_frame(CHUNK // 2) * 2):
        _put(a, data)
        assert np.array_equal(a.read().result(), want)
    for data in (zstd_rle_frame(CHUNK - 1), zstd_rle_frame(CHUNK + 1)):  # short, long
        _put(a, data)
        with pytest.raises(tsp.DataCorruptionError, match="c/0"):
            a.read().result()
    b = _zarr2(tmp_path / "b", {"id": "zstd", "level": 1}, _DELTA)
    raw = np.arange(CHUNK // 4, dtype="<u4")
    delta = numcodecs.Delta("<u4").encode(raw).tobytes()
    for data in (numcodecs.Zstd(1).encode(delta), delta):
        frame = bytes(data)
        if data is delta:  # a frame without content size holding the delta bytes: raw blocks
            frame = (b"\x28\xb5\x2f\xfd\x00\x38" + ((len(delta) << 3) | 1).to_bytes(3, "little") + delta)
        _put(b, frame)
        assert np.array_equal(b.read().result(), raw)


def test_zstd_without_content_size_or_chunk_size_needs_the_extra(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a streaming decoder installed, such a chunk is refused with
    UnsupportedError naming the extra -- never decoded unbounded."""
    monkeypatch.setitem(sys.modules, "compression", None)
    monkeypatch.setitem(sys.modules, "backports", None)
    monkeypatch.setitem(sys.modules, "backports.zstd", None)
    b = _zarr2(tmp_path, {"id": "zstd", "level": 1}, _DELTA)
    _put(b, zstd_rle_frame(8 << 30))
    with pytest.raises(tsp.UnsupportedError, match=r"tensorstore_py\[zstd\]"):
        b.read().result()
