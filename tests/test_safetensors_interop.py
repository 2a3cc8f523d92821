"""safetensors in and out, against the safetensors library itself."""

from __future__ import annotations

import json
import math
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

st = pytest.importorskip("safetensors.numpy")

import tensorstore_py as tsp
from tensorstore_py.checkpoint.restoring import ReadStats
from tensorstore_py.cli import main
from tensorstore_py.core.errors import InvalidArgumentError, NotFoundError


def _tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "model.embed.weight": rng.standard_normal((64, 48)).astype(np.float32),
        "model.layers.0.w": rng.standard_normal((16, 8)).astype(ml_dtypes.bfloat16),
        "model.layers.0.h": rng.standard_normal(10).astype(np.float16),
        "ids": np.arange(-5, 7, dtype=np.int64).reshape(3, 4),
        "mask": rng.integers(0, 2, 9).astype(bool),
        "bytes": rng.integers(0, 255, 33).astype(np.uint8),
        "scalar": np.array(3.5, np.float64),
        "empty": np.zeros((0, 4), np.int32),
    }


def _same(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes()


def test_restore_a_file_matches_load_file_bit_for_bit(tmp_path: Path) -> None:
    ref = _tensors()
    st.save_file(ref, str(tmp_path / "m.safetensors"), metadata={"format": "np"})
    loaded = st.load_file(str(tmp_path / "m.safetensors"))
    for url in (str(tmp_path / "m.safetensors"), f"file://{tmp_path}/m.safetensors"):
        out = tsp.checkpoint.restore(url)
        assert sorted(out) == sorted(loaded)
        for k in loaded:
            _same(out[k], loaded[k])


def test_target_tree_key_map_and_checks(tmp_path: Path) -> None:
    ref = _tensors()
    st.save_file(ref, str(tmp_path / "m.safetensors"))
    url = str(tmp_path / "m.safetensors")
    target = {"embed": np.zeros((64, 48), np.float32), "layer0": {"w": np.zeros((16, 8), ml_dtypes.bfloat16)}}
    names = {"embed": "model.embed.weight", "layer0.w": "model.layers.0.w"}
    out = tsp.checkpoint.restore_safetensors(url, target=target, key_map=names)
    _same(out["embed"], ref["model.embed.weight"])
    _same(out["layer0"]["w"], ref["model.layers.0.w"])
    out = tsp.checkpoint.restore_safetensors(url, target={"x": 0.0}, key_map=lambda n: "scalar" if n == "x" else n)
    assert out == {"x": 3.5} and type(out["x"]) is float  # a Python scalar target leaf gets a Python scalar
    with pytest.raises(NotFoundError, match="model.nope"):
        tsp.checkpoint.restore_safetensors(url, target={"model": {"nope": np.zeros(3)}})
    with pytest.raises(InvalidArgumentError, match=r"'ids' has shape \(3, 4\).*expects \(4, 3\)"):
        tsp.checkpoint.restore_safetensors(url, target={"ids": np.zeros((4, 3), np.int64)})
    with pytest.raises(InvalidArgumentError, match="stored as bfloat16.*cast=True"):
        tsp.checkpoint.restore_safetensors(url, target={"model.layers.0.w": np.zeros((16, 8), np.float32)})
    out = tsp.checkpoint.restore_safetensors(
        url, target={"model.layers.0.w": np.zeros((16, 8), np.float32)}, cast=True)
    _same(out["model.layers.0.w"], ref["model.layers.0.w"].astype(np.float32))


def _hf_folder(folder: Path) -> dict[str, np.ndarray]:
    ref = _tensors()
    names = sorted(ref)
    parts = [names[:4], names[4:]]
    folder.mkdir()
    weight_map = {}
    for i, part in enumerate(parts):
        f = f"model-{i + 1:05d}-of-00002.safetensors"
        st.save_file({n: ref[n] for n in part}, str(folder / f))
        weight_map.update({n: f for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return ref


def test_sharded_folder_over_http_reads_only_the_needed_ranges(tmp_path: Path, serve_app) -> None:
    from aiohttp import web

    from tensorstore_py.checkpoint.safetensors_io import open_safetensors, read_tensor_regions
    from tensorstore_py.core.future import run_sync

    ref = _hf_folder(tmp_path / "hf")
    served: list[int] = []

    @web.middleware
    async def count(request, handler):
        resp = await handler(request)
        rng = request.headers.get("Range")
        if rng and rng.startswith("bytes=") and request.path.endswith(".safetensors"):
            a, _, b = rng[6:].partition("-")
            served.append(int(b) - int(a) + 1)
        return resp

    app = web.Application(middlewares=[count])
    app.router.add_static("/", str(tmp_path / "hf"))
    server = serve_app(app)
    url = server.url + "/"
    out = tsp.checkpoint.restore(url)
    for k in ref:
        _same(out[k], ref[k])

    src = run_sync(open_safetensors(url))
    leaves = src.leaves()
    i = [leaf.name for leaf in leaves].index("model.embed.weight")
    for region in (((0, 32), (0, 48)), ((0, 64), (24, 48))):  # half the rows; half the columns
        served.clear()
        stats = ReadStats()
        (block,) = run_sync(read_tensor_regions(src, leaves, [(i, region)], max_bytes_in_flight=1 << 20,
                                                stats=stats))
        want = ref["model.embed.weight"][tuple(slice(a, b) for a, b in region)]
        _same(np.ascontiguousarray(block), want)
        assert stats.bytes_needed == want.nbytes
        assert want.nbytes <= sum(served) <= 1.1 * want.nbytes, (region, served)


def test_export_step_reads_back_with_load_file(tmp_path: Path, capsys) -> None:
    ref = _tensors()
    tree = {"params": {"w": ref["model.embed.weight"], "b": ref["model.layers.0.w"]},
            "ids": [ref["ids"], ref["mask"]], "step": 7}
    tsp.checkpoint.save(f"file://{tmp_path}/ck/", tree, step=3).result()
    # sharded by size: every file at most 8 KiB unless one tensor is larger
    assert main(["export", str(tmp_path / "ck"), str(tmp_path / "out"), "--format", "safetensors",
                 "--max-shard-size", "8192"]) == 0
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == 2 and files[0] == "model-00001-of-00002.safetensors"
    loaded: dict[str, np.ndarray] = {}
    for f in files:
        loaded.update(st.load_file(str(tmp_path / "out" / f)))
    _same(loaded["params.w"], ref["model.embed.weight"])
    _same(loaded["params.b"], ref["model.layers.0.w"])
    _same(loaded["ids.0"], ref["ids"])
    _same(loaded["ids.1"], ref["mask"])
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in loaded.values())
    # one file when it fits; the folder then restores as a whole
    assert main(["export", str(tmp_path / "ck"), str(tmp_path / "one"), "--format", "safetensors"]) == 0
    one = st.load_file(str(tmp_path / "one" / "model.safetensors"))
    assert sorted(one) == sorted(loaded) and all(one[k].tobytes() == loaded[k].tobytes() for k in one)
    back = tsp.checkpoint.restore(f"file://{tmp_path}/out/")
    assert sorted(back) == sorted(loaded)
    # refuses to overwrite an export
    assert main(["export", str(tmp_path / "ck"), str(tmp_path / "one"), "--format", "safetensors"]) != 0
    assert math.prod(one["params.w"].shape) == 64 * 48


@pytest.mark.parametrize("server", ["s3_server", "gcs_emulator"])
def test_object_store_folder_restores_through_our_store(tmp_path: Path, server: str, request) -> None:
    ref = _hf_folder(tmp_path / "hf")
    srv = request.getfixturevalue(server)
    bucket = srv.create_bucket()
    kv = tsp.KvStore.open(srv.spec(bucket, path="models/hf/")).result()
    for f in (tmp_path / "hf").iterdir():
        kv.write(f.name, f.read_bytes()).result()
    out = tsp.checkpoint.restore(kv)
    assert sorted(out) == sorted(ref)
    for k in ref:
        _same(out[k], ref[k])
    stats = ReadStats()
    part = tsp.checkpoint.restore_safetensors(kv, target={"ids": np.zeros((3, 4), np.int64)}, stats=stats)
    _same(part["ids"], ref["ids"])
    assert stats.bytes_read == stats.bytes_needed == ref["ids"].nbytes  # one tensor's bytes, nothing else


def test_cut_or_inconsistent_files_are_data_corruption_naming_the_file(tmp_path: Path) -> None:
    from tensorstore_py.core.errors import DataCorruptionError

    ref = _tensors()
    st.save_file(ref, str(tmp_path / "m.safetensors"))
    raw = (tmp_path / "m.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(raw[:-10])  # the last tensor's bytes cut short
    with pytest.raises(DataCorruptionError, match=r"cut.safetensors: tensor '.*' cut short \(read \d+ bytes of \d+\)"):
        tsp.checkpoint.restore(str(tmp_path / "cut.safetensors"))
    (tmp_path / "head.safetensors").write_bytes(raw[:20])
    with pytest.raises(DataCorruptionError, match="head.safetensors: safetensors header of .* cut short"):
        tsp.checkpoint.restore(str(tmp_path / "head.safetensors"))
    hf = _hf_folder(tmp_path / "hf")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    index["weight_map"]["ghost"] = "model-00001-of-00002.safetensors"
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(DataCorruptionError, match="names 'ghost' in 'model-00001-of-00002.safetensors'"):
        tsp.checkpoint.restore(str(tmp_path / "hf"))
    assert hf
