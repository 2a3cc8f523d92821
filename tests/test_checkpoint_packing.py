"""Small leaves packed together (checkpoint/packing.py): few values per step, one
read per pack on restore, every leaf checked against its own crc32c, and every
reader of a step (restore, open_array, the CLI's cat / verify / export) reading
packed leaves as it reads the others."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import tensorstore_py as tsp
from tensorstore_py.checkpoint import ReadStats, SaveOptions
from tensorstore_py.cli import main
from tensorstore_py.errors import ChecksumError, DataCorruptionError


def _tree(n: int = 300) -> dict[str, Any]:
    rng = np.random.default_rng(7)
    leaves: dict[str, Any] = {}
    dtypes = [np.float32, np.int8, np.float64, np.bool_, np.complex64, ml_dtypes.bfloat16, np.uint16]
    for i in range(n):
        dt = np.dtype(dtypes[i % len(dtypes)])
        shape = [(), (3,), (5, 7), (1, 2, 3)][i % 4]
        leaves[f"l{i:04d}"] = (rng.standard_normal(shape) * 50).astype(dt)
    leaves["big_endian"] = np.arange(12, dtype=">i4").reshape(3, 4)
    leaves["large"] = np.arange(40_000, dtype=np.float32)  # 160 KB: a chunk of its own
    leaves["scalar"] = np.float32(2.5)
    leaves["lr"] = 0.125
    return leaves


def _step_keys(root: str, step: int) -> list[str]:
    kv = tsp.KvStore.open(f"versioned+{root}").result()
    return sorted(kv.list(f"{step:012d}/").result())


def test_small_leaves_are_written_as_a_few_packs_and_restored_bit_exact(tmp_path: Path) -> None:
    root = f"file://{tmp_path}/"
    tree = _tree()
    tsp.checkpoint.save(root, tree, step=3).result()
    keys = _step_keys(root, 3)
    # the 302 small array leaves lie in one pack; the large one has its chunk
    assert keys == ["000000000003/a/301/c/0", "000000000003/digests/000000.json", "000000000003/manifest.json",
                    "000000000003/p/0"]
    stats = ReadStats()
    out = tsp.checkpoint.restore(root, stats=stats)
    assert set(out) == set(tree)
    for k, v in tree.items():
        if isinstance(v, float):
            assert out[k] == v
            continue
        got = out[k]
        assert got.dtype == np.asarray(v).dtype.newbyteorder("=") and got.shape == np.shape(v), k
        assert np.asarray(got).tobytes() == np.asarray(v).astype(got.dtype).tobytes(), k
        assert isinstance(got, np.generic) or got.flags.writeable
    assert isinstance(out["scalar"], np.float32)
    assert stats.bytes_read == stats.bytes_needed  # padding between leaves is not counted as read
    assert stats.requests == 2  # one read for the pack, one for the large leaf's chunk


def test_packs_are_split_at_about_four_mib_and_many_leaves_take_few_keys(tmp_path: Path) -> None:
    root = f"file://{tmp_path}/"
    tree = {f"w{i:05d}": np.full((16, 16), i, np.float32) for i in range(5000)}  # 1 KiB each: 5 MB
    tsp.checkpoint.save(root, tree).result()
    keys = _step_keys(root, 0)
    assert keys == ["000000000000/manifest.json", "000000000000/p/0", "000000000000/p/1"]  # no chunk: no digests
    kv = tsp.KvStore.open(f"versioned+{root}").result()
    manifest = json.loads(bytes(kv.read("000000000000/manifest.json").result().value))
    assert manifest["format"] == "tensorstore_py.checkpoint.manifest/3"
    packs = [leaf["packed"] for leaf in manifest["leaves"]]
    assert packs[0] == {"key": "p/0", "offset": 0, "crc32c": packs[0]["crc32c"]}
    assert packs[4095]["key"] == "p/0" and packs[4096] == {"key": "p/1", "offset": 0,
                                                            "crc32c": packs[4096]["crc32c"]}
    out = tsp.checkpoint.restore(root)
    for i in (0, 4095, 4096, 4999):
        np.testing.assert_array_equal(out[f"w{i:05d}"], tree[f"w{i:05d}"])


def test_packing_off_keeps_one_chunk_key_per_leaf_and_format_1(tmp_path: Path) -> None:
    root = f"file://{tmp_path}/"
    tree = {"a": np.arange(6, dtype=np.int16), "b": np.ones((2, 2))}
    tsp.checkpoint.save(root, tree, options=SaveOptions(pack_small_leaves=False)).result()
    assert _step_keys(root, 0) == ["000000000000/a/0/c/0", "000000000000/a/1/c/0/0",
                                   "000000000000/digests/000000.json", "000000000000/manifest.json"]
    out = tsp.checkpoint.restore(root)
    np.testing.assert_array_equal(out["a"], tree["a"])
    np.testing.assert_array_equal(out["b"], tree["b"])


def _flip_in_data_objects(root: Path, needle: bytes) -> None:
    """Flip one byte of ``needle`` where it is stored under the versioned store's data/."""
    for f in sorted((root / "data").rglob("*")):
        if f.is_file():
            body = f.read_bytes()
            at = body.find(needle)
            if at >= 0:
                f.write_bytes(body[:at] + bytes([body[at] ^ 0xFF]) + body[at + 1:])
                return
    raise AssertionError("bytes not found in any data object")


def test_a_corrupt_packed_leaf_is_reported_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = f"file://{tmp_path}/"
    tree = {"a": np.arange(100, dtype=np.int64), "b": np.arange(100, 200, dtype=np.int64)}
    tsp.checkpoint.save(root, tree).result()
    _flip_in_data_objects(tmp_path, tree["b"][10:14].tobytes())
    with pytest.raises(DataCorruptionError):
        tsp.checkpoint.restore(root)  # the pack as a whole, or leaf b, fails its crc32c
    # a single leaf read by byte range: leaf b's own crc32c catches it, a stays readable
    np.testing.assert_array_equal(tsp.checkpoint.open_array(root, "['a']").result().read().result(), tree["a"])
    with pytest.raises(ChecksumError, match=r"a/1.*packed in 'p/0'.*crc32c"):
        tsp.checkpoint.open_array(root, "['b']").result()
    assert main(["verify", root, "--json"]) != 0
    report = json.loads(capsys.readouterr().out)
    assert any(p["kind"] == "checksum" and "['b']" in p["message"] for p in report["problems"]), report


def test_packed_leaves_read_through_open_array_cat_verify_and_export(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = f"file://{tmp_path}/ckpt/"
    tree = {"params": {"w": np.arange(20, dtype=np.float32).reshape(4, 5), "b": np.int16(-3)}, "n": 7}
    tsp.checkpoint.save(root, tree, step=1).result()
    view = tsp.checkpoint.open_array(root, "['params']['w']").result()
    np.testing.assert_array_equal(view[1:3, 2:].read().result(), tree["params"]["w"][1:3, 2:])
    assert main(["verify", root, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["problems"] == [] and report["arrays"] == 2
    assert main(["info", root, "--json"]) == 0
    rows = {r["path"]: r for r in json.loads(capsys.readouterr().out)["arrays"]}
    assert rows["['params']['w']"]["stored_bytes"] == 80 and rows["['params']['w']"]["shape"] == [4, 5]
    assert main(["cat", root, "['params']['w']", "--index", "[2]", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["values"] == tree["params"]["w"][2].tolist()
    dest = tmp_path / "out"
    assert main(["export", root, "--step", "1", str(dest)]) == 0
    zarr = pytest.importorskip("zarr")
    np.testing.assert_array_equal(zarr.open_array(str(dest), path="params/w", mode="r")[...], tree["params"]["w"])
    assert zarr.open_array(str(dest), path="params/b", mode="r")[...] == -3


@pytest.mark.parametrize("assemble", ["host", "device"])
@pytest.mark.parametrize("staging", ["host", "device", "pinned_host"])
def test_small_jax_leaves_round_trip_through_every_staging_and_assembly(
    tmp_path: Path, staging: str, assemble: str
) -> None:
    jax = pytest.importorskip("jax")
    dev = jax.devices()[0]
    sh = jax.sharding.SingleDeviceSharding(dev)
    values = {f"p{i:03d}": (np.arange(i, i + 24, dtype=np.float32) * 0.5).reshape(4, 6) for i in range(200)}
    values["bf"] = np.linspace(-2, 2, 10).astype(ml_dtypes.bfloat16)
    values["count"] = np.int32(7)
    state = {k: jax.device_put(v, sh) for k, v in values.items()}
    root = f"file://{tmp_path}/"
    tsp.checkpoint.save(root, state, options=SaveOptions(staging=staging)).result()  # type: ignore[arg-type]
    assert _step_keys(root, 0) == ["000000000000/manifest.json", "000000000000/p/0"]
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh) for k, v in state.items()}
    out = tsp.checkpoint.restore(root, target=target, assemble=assemble)  # type: ignore[arg-type]
    for k, v in values.items():
        assert isinstance(out[k], jax.Array) and out[k].sharding.device_set == {dev}, k
        assert np.asarray(out[k]).tobytes() == np.asarray(v).tobytes(), k


def test_an_open_array_view_of_a_packed_leaf_reads_in_worker_processes(tmp_path: Path) -> None:
    """A packed leaf's view holds its few bytes and pickles with them: Dask's
    process scheduler reads it (a view over an unnamed memory store could not
    leave the process)."""
    import multiprocessing
    import pickle
    from concurrent.futures import ProcessPoolExecutor

    import tensorstore_py.dask as tspd
    from tensorstore_py.checkpoint.api import leaf_paths, open_array, save

    url = f"file://{tmp_path}/"
    w = np.arange(64.0).reshape(8, 8)
    save(url, {"w": w}, step=1).result()
    view = open_array(url, leaf_paths(url).result()[0]).result()
    np.testing.assert_array_equal(pickle.loads(pickle.dumps(view[2:4])).read().result(), w[2:4])
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        got = tspd.to_dask(view[::-1]).compute(scheduler="processes", pool=pool)
    np.testing.assert_array_equal(got, w[::-1])
