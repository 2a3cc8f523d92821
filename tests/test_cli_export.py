"""``tensorstore-py export ROOT --step N DEST``: a checkpoint step as plain zarr v3,
read back by zarr-python and TensorStore; bytes copied as stored; resumable."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tensorstore_py as tsp
from tensorstore_py.cli import main
from tensorstore_py.commands.export import array_path
from tensorstore_py.drivers.dtypes import dtype_from_v3
from tensorstore_py.kvstore.file import META_DIR

zarr = pytest.importorskip("zarr")
ts_oracle = pytest.importorskip("tensorstore")


def tree(step: int) -> dict[str, Any]:
    return {
        "params": {"w": np.arange(40 * 30, dtype=np.float32).reshape(40, 30) * (step + 1),
                   "b": np.full(7, step, dtype=np.int16)},
        "layers": [np.eye(3, dtype=np.float64) * step],
        "big": np.full((512, 520), step, dtype=np.uint16),  # >= 1 MiB: its zarr.json is stored
        "lr": 0.25,
        "name": "run",
    }


@pytest.fixture
def root(tmp_path: Path) -> str:
    url = f"file://{tmp_path}/ckpt/"
    opts = tsp.checkpoint.SaveOptions(target_chunk_bytes=100_000)  # several chunks per large leaf
    for step in (1, 2):
        tsp.checkpoint.save(url, tree(step), step=step, options=opts).result()
    return url


def _files(dest: Path) -> dict[str, bytes]:
    """The stored objects under ``dest`` (not the file store's own lock and temp files)."""
    return {str(p.relative_to(dest)): p.read_bytes() for p in dest.rglob("*")
            if p.is_file() and META_DIR not in p.relative_to(dest).parts}


def test_leaf_paths_map_to_zarr_paths() -> None:
    assert array_path("['params']['w']") == "params/w"
    assert array_path("[0].kernel") == "0/kernel"
    assert array_path("['a/b']['..']") == "a%2Fb/%2E%2E"
    assert array_path("") == ""


def test_export_is_read_by_zarr_python_and_tensorstore(root: str, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    dest = tmp_path / "out"
    assert main(["export", root, "--step", "1", str(dest), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["step"] == 1 and report["arrays"] == 4 and report["scalars"] == 2
    want = tree(1)
    g = zarr.open_group(str(dest), mode="r")
    attrs = g.attrs["tensorstore_py"]
    assert attrs["checkpoint_step"] == 1 and set(attrs["scalars"]) == {"['lr']", "['name']"}
    assert attrs["leaves"]["params/w"] == "['params']['w']"
    for path, value in [("params/w", want["params"]["w"]), ("params/b", want["params"]["b"]),
                        ("layers/0", want["layers"][0]), ("big", want["big"])]:
        np.testing.assert_array_equal(zarr.open_array(str(dest), path=path, mode="r")[...], value)
        t = ts_oracle.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(dest / path)}},
                           read=True).result()
        np.testing.assert_array_equal(t.read().result(), value)
        assert t.dtype.numpy_dtype == value.dtype


def test_export_copies_the_stored_bytes(root: str, tmp_path: Path) -> None:
    dest = tmp_path / "out"
    assert main(["export", root, "--step", "2", str(dest)]) == 0
    snap = tsp.KvStore.open(f"versioned+{root}").result()
    manifest = json.loads(bytes(snap.read("000000000002/manifest.json").result().value))
    files = _files(dest)
    compared = 0
    for leaf in manifest["leaves"]:
        if "key" not in leaf:
            continue
        prefix = f"000000000002/{leaf['key']}/"
        if "packed" in leaf:  # a small leaf packed with others: its one chunk, from its pack
            pack = bytes(snap.read("000000000002/" + leaf["packed"]["key"]).result().value)
            at = leaf["packed"]["offset"]
            nbytes = math.prod(leaf["shape"]) * dtype_from_v3(leaf["dtype"]).itemsize
            chunk = files[array_path(leaf["path"]) + "/c" + "/0" * len(leaf["shape"])]
            assert chunk == pack[at:at + nbytes]
            compared += 1
        for key in snap.list(prefix).result():
            assert files[array_path(leaf["path"]) + "/" + key[len(prefix):]] == bytes(snap.read(key).result().value)
            compared += 1
    assert compared > 8


def test_an_interrupted_export_resumes_and_foreign_content_is_refused(
        root: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dest = tmp_path / "out"
    assert main(["export", root, "--step", "1", str(dest)]) == 0
    complete = _files(dest)
    # as if interrupted: the root group (written last), one array's metadata and a chunk are missing
    os.remove(dest / "zarr.json")
    os.remove(dest / "big" / "zarr.json")
    chunk = next(p for p in (dest / "big" / "c").rglob("*") if p.is_file())
    os.remove(chunk)
    assert main(["export", root, "--step", "1", str(dest)]) == 0
    assert _files(dest) == complete
    capsys.readouterr()
    # another step into the same place: its chunks differ from what is there
    assert main(["export", root, "--step", "2", str(dest)]) == 1
    assert "already exists" in capsys.readouterr().err
    assert _files(dest) == complete
    # a folder holding something else
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert main(["export", root, "--step", "1", str(other)]) == 1
    err = capsys.readouterr().err
    assert "does not write" in err and "notes.txt" in err
    assert _files(other) == {"notes.txt": b"mine"}


def test_export_needs_a_checkpoint_and_an_existing_step(root: str, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", root, "--step", "9", str(tmp_path / "x")]) == 1
    assert "step 9 not found" in capsys.readouterr().err
    arr = f"file://{tmp_path}/arr/"
    tsp.open(arr, create=True, shape=(4,), dtype="uint8").result()
    assert main(["export", arr, str(tmp_path / "y")]) == 2  # a usage error
    assert "not a checkpoint root" in capsys.readouterr().err
