"""``SaveOptions(compression=...)``: compressed chunks round trip bit-exactly,
take fewer bytes on compressible data, are described in each leaf's zarr v3
metadata (zarr-python reads an exported step), and steps without compression
read as before."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import tensorstore_py as tsp
from tensorstore_py.checkpoint import SaveOptions
from tensorstore_py.errors import InvalidArgumentError

COMPRESSIONS = [None, "zstd", "zstd-bitshuffle"]


def _state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((512, 256)) * 0.02).astype(np.float32)
    return {
        "w": w,  # 512 KiB: own data objects, a zarr.json
        "w_big_chunks": w.copy(),
        "steps": np.arange(4096, dtype=np.int64),  # compressible
        "small": rng.integers(0, 4, size=(40, 3)).astype(np.uint8),  # packed, manifest only
        "scalar": np.float32(1.5),
    }


def _disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_compressed_steps_round_trip_bit_exact(tmp_path: Path, compression: str | None) -> None:
    want = _state()
    opts = SaveOptions(compression=compression, target_chunk_bytes=128 << 10, zarr_metadata_min_bytes=256 << 10)
    mgr = tsp.CheckpointManager(f"file://{tmp_path}/", options=opts)
    mgr.save(1, want).result()
    got = mgr.restore(1)
    for k, v in want.items():
        assert np.asarray(got[k]).dtype == v.dtype and np.asarray(got[k]).tobytes() == v.tobytes(), k
    # part of a leaf through the lazy view (a partial read of a compressed chunk)
    view = tsp.checkpoint.open_array(f"file://{tmp_path}/", "['w']").result()
    assert view[100:300, 7].read().result().tobytes() == want["w"][100:300, 7].tobytes()
    small = tsp.checkpoint.open_array(f"file://{tmp_path}/", "['small']").result()
    assert small.read().result().tobytes() == want["small"].tobytes()


def test_compression_takes_fewer_bytes_and_is_described_in_zarr_json(tmp_path: Path) -> None:
    want = _state()
    sizes = {}
    for c in ("raw", "zstd-bitshuffle"):
        opts = SaveOptions(compression=None if c == "raw" else c, zarr_metadata_min_bytes=256 << 10)
        tsp.checkpoint.save(f"file://{tmp_path}/{c}/", want, options=opts).result()
        sizes[c] = _disk_bytes(tmp_path / c)
    assert sizes["zstd-bitshuffle"] < 0.9 * sizes["raw"], sizes  # random float32 weights: about 0.88
    out = tmp_path / "export"
    from tensorstore_py.commands.export import export_step
    from tensorstore_py.core.future import run_sync

    run_sync(export_step(f"file://{tmp_path}/zstd-bitshuffle/", None, f"file://{out}/"))
    meta = json.loads((out / "w" / "zarr.json").read_text())
    assert [c["name"] for c in meta["codecs"]] == ["bytes", "blosc"]
    assert meta["codecs"][1]["configuration"]["shuffle"] == "bitshuffle"
    zarr = pytest.importorskip("zarr")
    for k in ("w", "steps", "small"):
        arr = zarr.open_array(str(out / k), mode="r")
        assert arr[...].tobytes() == want[k].tobytes(), k


def test_bad_compression_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="compression must be one of None, 'zstd', 'zstd-bitshuffle'; got 'gzip'"):
        SaveOptions(compression="gzip")  # type: ignore[arg-type]


@pytest.mark.parametrize("staging", ["host", "pinned_host", "device"])
def test_compressed_jax_leaves_through_every_staging(tmp_path: Path, staging: str) -> None:
    jax = pytest.importorskip("jax")
    state = {k: jax.numpy.asarray(v) for k, v in _state().items() if k != "scalar"}
    want = {k: np.asarray(v) for k, v in state.items()}  # int64 is int32 in jax by default
    # streamed pinned staging too (a staging limit below the state): shards cut on the host
    opts = SaveOptions(compression="zstd-bitshuffle", staging=staging, target_chunk_bytes=128 << 10,
                       max_bytes_in_flight=512 << 10, max_staging_bytes=64 << 10)
    mgr = tsp.CheckpointManager(f"file://{tmp_path}/", options=opts)
    mgr.save(1, state).result()
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in state.items()}
    for assemble in ("host", "device"):
        got = mgr.restore(1, target=target, assemble=assemble)
        for k, v in want.items():
            assert np.asarray(got[k]).tobytes() == v.tobytes(), (k, assemble)


def test_a_compressed_step_is_manifest_format_2_and_a_raw_one_stays_1(tmp_path: Path) -> None:
    # 1000 float64: small enough to be packed (format 3) unless packing is off;
    # 10000: one chunk of its own
    for c, n, pack, fmt in ((None, 10000, True, 1), ("zstd", 10000, True, 2), ("zstd", 1000, True, 2),
                            (None, 1000, True, 3), (None, 1000, False, 1)):
        root = f"file://{tmp_path}/{c}-{n}-{pack}/"
        options = SaveOptions(compression=c, pack_small_leaves=pack)
        tsp.checkpoint.save(root, {"a": np.arange(float(n))}, options=options).result()
        from tensorstore_py.checkpoint.storage import StepStore
        from tensorstore_py.core.future import run_sync

        _step, manifest, _view = run_sync(StepStore(tsp.KvStore.open(root).result()).open_step(0))
        assert manifest["format"] == f"tensorstore_py.checkpoint.manifest/{fmt}"
        assert tsp.checkpoint.restore(root)["a"].tobytes() == np.arange(float(n)).tobytes()
