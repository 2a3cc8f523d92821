"""Volumes CloudVolume wrote to a local disk: chunks stored as ``<key>.gz`` (its default
for raw data), ``.zstd``, ``.xz``, ``.bz2``, the ``info`` plain. The files are
written here exactly as CloudVolume's CloudFiles FileInterface writes them: the
info as sorted, indented JSON, each raw chunk as the Fortran-order bytes of its
(x, y, z, channel) block, compressed, under ``<scale key>/<x0>-<x1>_<y0>-<y1>_<z0>-<z1><suffix>``."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import pickle
from pathlib import Path

import numpy as np
import pytest
from numcodecs import Zstd

import tensorstore_py as tsp

COMPRESS = {".gz": lambda b: gzip.compress(b, compresslevel=6), ".zstd": lambda b: Zstd(level=3).encode(b),
            ".xz": lzma.compress, ".bz2": bz2.compress}


def _cloudvolume_write(root: Path, data: np.ndarray, chunk: tuple[int, int, int], suffix: str,
                       offset: tuple[int, int, int] = (0, 0, 0)) -> None:
    """Write ``data`` (x, y, z, channel) as CloudVolume does with compress=<suffix>."""
    size = data.shape[:3]
    info = {"data_type": str(data.dtype), "num_channels": data.shape[3], "type": "image",
            "scales": [{"chunk_sizes": [list(chunk)], "encoding": "raw", "key": "4_4_40",
                        "resolution": [4, 4, 40], "size": list(size), "voxel_offset": list(offset)}]}
    root.mkdir(parents=True, exist_ok=True)
    (root / "info").write_text(json.dumps(info, sort_keys=True, indent=2, separators=(",", ": ")))
    (root / "4_4_40").mkdir()
    for x in range(0, size[0], chunk[0]):
        for y in range(0, size[1], chunk[1]):
            for z in range(0, size[2], chunk[2]):
                block = data[x:x + chunk[0], y:y + chunk[1], z:z + chunk[2]]
                if not block.any():
                    continue  # CloudVolume skips chunks of the background colour too
                hi = [min(a + c, s) for a, c, s in zip((x, y, z), chunk, size)]
                name = "_".join(f"{a + o}-{b + o}" for a, b, o in zip((x, y, z), hi, offset))
                raw = np.asfortranarray(block).tobytes("F")
                (root / "4_4_40" / (name + suffix)).write_bytes(COMPRESS[suffix](raw))


def _volume(dtype: str = "uint16") -> np.ndarray:
    rng = np.random.default_rng(7)
    data = rng.integers(1, 60000, size=(37, 29, 11, 1)).astype(dtype)
    data[:16, :16, :8] = 0  # one chunk absent: reads as 0
    return data


@pytest.mark.parametrize("suffix", [".gz", ".zstd", ".xz", ".bz2"])
def test_cloudvolume_compressed_chunks_read_as_their_values(tmp_path: Path, suffix: str) -> None:
    data = _volume()
    _cloudvolume_write(tmp_path / "vol", data, (16, 16, 8), suffix, offset=(100, 200, 3))
    arr = tsp.open(f"file://{tmp_path}/vol").result()
    assert arr.shape == data.shape
    got = arr.read().result()
    np.testing.assert_array_equal(got, data)
    assert got[20:, 20:].sum() > 0
    # a partial read across chunk borders
    np.testing.assert_array_equal(arr[10:30, 5:20, 1:6].read().result(), data[10:30, 5:20, 1:6])


def test_writes_store_the_plain_key_and_drop_the_suffixed_copy(tmp_path: Path) -> None:
    data = _volume()
    root = tmp_path / "vol"
    _cloudvolume_write(root, data, (16, 16, 8), ".gz")
    arr = tsp.open(f"file://{root}").result()
    arr[0:4, 16:20, 0:2].write(np.full((4, 4, 2, 1), 9, np.uint16)).result()  # partial: read-modify-write
    data[0:4, 16:20, 0:2] = 9
    assert (root / "4_4_40" / "0-16_16-29_0-8").exists()
    assert not (root / "4_4_40" / "0-16_16-29_0-8.gz").exists()
    chunk = np.frombuffer((root / "4_4_40" / "0-16_16-29_0-8").read_bytes(), np.uint16)
    np.testing.assert_array_equal(chunk.reshape((16, 13, 8, 1), order="F"), data[0:16, 16:29, 0:8])
    arr[16:32, 0:16, 0:8].write(np.zeros((16, 16, 8, 1), np.uint16)).result()  # fill value: deleted
    data[16:32, 0:16, 0:8] = 0
    assert not list((root / "4_4_40").glob("16-32_0-16_0-8*"))
    reopened = tsp.open(f"file://{root}").result()
    np.testing.assert_array_equal(reopened.read().result(), data)


def test_a_corrupt_suffixed_chunk_names_the_file(tmp_path: Path) -> None:
    data = _volume()
    root = tmp_path / "vol"
    _cloudvolume_write(root, data, (16, 16, 8), ".gz")
    (root / "4_4_40" / "16-32_0-16_0-8.gz").write_bytes(b"not gzip at all")
    arr = tsp.open(f"file://{root}").result()
    with pytest.raises(tsp.errors.DataCorruptionError, match=r"16-32_0-16_0-8\.gz.*gzip"):
        arr[16:20, 0:4, 0:2].read().result()


def test_a_view_of_a_cloudvolume_volume_pickles(tmp_path: Path) -> None:
    data = _volume()
    _cloudvolume_write(tmp_path / "vol", data, (16, 16, 8), ".gz")
    view = tsp.open(f"file://{tmp_path}/vol").result()[3:30, ::2]
    back = pickle.loads(pickle.dumps(view))
    np.testing.assert_array_equal(back.read().result(), data[3:30, ::2])


def test_a_partial_write_of_zeros_deletes_the_suffixed_chunk(tmp_path: Path) -> None:
    data = np.zeros((32, 16, 8, 1), np.uint16)
    data[1, 2, 3] = 77
    root = tmp_path / "vol"
    _cloudvolume_write(root, data, (16, 16, 8), ".zstd")
    arr = tsp.open(f"file://{root}").result()
    assert arr[1, 2, 3].read().result().tolist() == [77]
    arr[0:4, 0:4, 0:4].write(np.zeros((4, 4, 4, 1), np.uint16)).result()  # read-modify-write to all zeros
    assert not list((root / "4_4_40").glob("0-16_0-16_0-8*"))
    assert not tsp.open(f"file://{root}").result().read().result().any()


def test_brotli_chunks_read_or_name_the_missing_package(tmp_path: Path) -> None:
    try:
        import brotli  # type: ignore[import-not-found]
    except ImportError:
        brotli = None
    data = _volume()
    root = tmp_path / "vol"
    COMPRESS[".br"] = (lambda b: brotli.compress(b)) if brotli is not None else (lambda b: b"\x0b\x02\x80")
    try:
        _cloudvolume_write(root, data, (16, 16, 8), ".br")
    finally:
        del COMPRESS[".br"]
    arr = tsp.open(f"file://{root}").result()
    if brotli is not None:
        np.testing.assert_array_equal(arr.read().result(), data)
    else:
        with pytest.raises(tsp.errors.UnsupportedError, match=r"16-32_0-16_0-8\.br.*'brotli'"):
            arr[16:20, 0:4, 0:2].read().result()
