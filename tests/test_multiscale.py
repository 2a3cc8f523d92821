"""Multiscale images: NGFF 0.4 / 0.5 documents built by hand from the spec (arrays
written by zarr-python) are read; ``tsp.write_pyramid`` writes OME-Zarr that
zarr-python reads as the spec says, and precomputed scales TensorStore reads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorstore as ts
import zarr
from _precomputed import label_volume

import tensorstore_py as tsp
from tensorstore_py import errors
from tensorstore_py.multiscale import Axis


def _levels(n: int = 3) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    base = rng.integers(0, 1000, (2, 12, 20, 16), dtype=np.uint16)
    return [base[:, :: 2 ** i, :: 2 ** i, :: 2 ** i].copy() for i in range(n)]


AXES_04 = [{"name": "c", "type": "channel"}, {"name": "z", "type": "space", "unit": "micrometer"},
           {"name": "y", "type": "space", "unit": "micrometer"}, {"name": "x", "type": "space", "unit": "micrometer"}]


def _datasets(n: int, translation: bool = True) -> list[dict[str, Any]]:
    out = []
    for i in range(n):
        t: list[dict[str, Any]] = [{"type": "scale", "scale": [1.0, 0.5 * 2 ** i, 0.25 * 2 ** i, 0.25 * 2 ** i]}]
        if translation and i:
            t.append({"type": "translation", "translation": [0, 0.25 * (2 ** i - 1), 0, 0]})
        out.append({"path": f"s{i}", "coordinateTransformations": t})
    return out


def _ngff_04(root: Path) -> list[np.ndarray]:
    """An NGFF 0.4 image: a zarr v2 group (written by zarr-python) with hand-written
    ``multiscales`` in ``.zattrs``, as the 0.4 spec's example lays it out."""
    levels = _levels()
    group = zarr.open_group(str(root), mode="w", zarr_format=2)
    for i, lv in enumerate(levels):
        arr = group.create_array(f"s{i}", shape=lv.shape, dtype=lv.dtype, chunks=(1, 4, 8, 8),
                                 chunk_key_encoding={"name": "v2", "separator": "/"})
        arr[...] = lv
    group.attrs["multiscales"] = [{
        "version": "0.4", "name": "example", "axes": AXES_04, "datasets": _datasets(3),
        "coordinateTransformations": [{"type": "scale", "scale": [1.0, 2.0, 1.0, 1.0]}],
        "type": "gaussian", "metadata": {"description": "hand-built"}}]
    return levels


def _ngff_05(root: Path) -> list[np.ndarray]:
    """An NGFF 0.5 image: a zarr v3 group with ``attributes.ome``."""
    levels = _levels()
    group = zarr.open_group(str(root), mode="w", zarr_format=3)
    for i, lv in enumerate(levels):
        arr = group.create_array(f"s{i}", shape=lv.shape, dtype=lv.dtype, chunks=(1, 4, 8, 8),
                                 dimension_names=["c", "z", "y", "x"])
        arr[...] = lv
    group.attrs["ome"] = {"version": "0.5", "multiscales": [
        {"name": "example", "axes": AXES_04, "datasets": _datasets(3)}]}
    return levels


def test_reads_ngff_04(tmp_path: Path) -> None:
    levels = _ngff_04(tmp_path)
    ms = tsp.open_multiscale(tmp_path.as_uri() + "/").result()
    assert ms.format == "ome-zarr" and ms.version == "0.4" and ms.name == "example" and len(ms) == 3
    assert ms.axes == (Axis("c", "channel"), Axis("z", "space", "micrometer"),
                       Axis("y", "space", "micrometer"), Axis("x", "space", "micrometer"))
    # the entry's scale applies after each dataset's transformations
    assert ms.levels[1].scale == (1.0, 2.0, 0.5, 0.5)
    assert ms.levels[1].translation == (0.0, 0.5, 0.0, 0.0)
    for i, lv in enumerate(levels):
        np.testing.assert_array_equal(ms.open(i).result().read().result(), lv)
    np.testing.assert_array_equal(ms.open(-1).result().read().result(), levels[-1])


def test_reads_ngff_05(tmp_path: Path) -> None:
    levels = _ngff_05(tmp_path)
    ms = tsp.open_multiscale(tmp_path.as_uri() + "/").result()
    assert ms.version == "0.5" and [lv.path for lv in ms.levels] == ["s0", "s1", "s2"]
    assert ms.levels[2].scale == (1.0, 2.0, 1.0, 1.0) and ms.levels[2].translation == (0.0, 0.75, 0.0, 0.0)
    for i, lv in enumerate(levels):
        a = ms.open(i).result()
        assert a.labels == ("c", "z", "y", "x")
        np.testing.assert_array_equal(a.read().result(), lv)


def test_reads_older_versions_and_picks_a_multiscale(tmp_path: Path) -> None:
    levels = _ngff_04(tmp_path)
    attrs = json.loads((tmp_path / ".zattrs").read_text())
    old = {"version": "0.3", "axes": ["c", "z", "y", "x"], "datasets": [{"path": "s1"}, {"path": "s2"}]}
    oldest = {"version": "0.1", "datasets": [{"path": "s2"}]}
    attrs["multiscales"] += [old, oldest]
    (tmp_path / ".zattrs").write_text(json.dumps(attrs))
    ms = tsp.open_multiscale(tmp_path.as_uri() + "/", index=1).result()
    assert ms.version == "0.3" and [a.type for a in ms.axes] == ["channel", "space", "space", "space"]
    assert ms.levels[0].scale == (1.0,) * 4
    np.testing.assert_array_equal(ms.open(1).result().read().result(), levels[2])
    with pytest.raises(errors.InvalidSpecError, match="axes"):  # 0.1: no axes, rank from nothing
        tsp.open_multiscale(tmp_path.as_uri() + "/", index=2).result()
    with pytest.raises(errors.NotFoundError, match="multiscale 3"):
        tsp.open_multiscale(tmp_path.as_uri() + "/", index=3).result()


@pytest.mark.parametrize("mutate,error,names", [
    (lambda m: m.pop("datasets"), errors.InvalidSpecError, "datasets"),
    (lambda m: m["datasets"][1].pop("coordinateTransformations"), errors.InvalidSpecError,
     "datasets[1].coordinateTransformations"),
    (lambda m: m["datasets"][0]["coordinateTransformations"][0].update(scale=[1, 2]), errors.InvalidSpecError,
     "datasets[0].coordinateTransformations[0].scale"),
    (lambda m: m["datasets"][1]["coordinateTransformations"].reverse(), errors.InvalidSpecError,
     "datasets[1].coordinateTransformations"),
    (lambda m: m["axes"].append({"name": "x"}), errors.InvalidSpecError, "axes"),
    (lambda m: m["axes"][0].update(name=3), errors.InvalidSpecError, "axes[0]"),
    (lambda m: m.update(version="0.9"), errors.UnsupportedError, "0.9"),
    (lambda m: m["datasets"][0]["coordinateTransformations"].__setitem__(0, {"type": "scale", "path": "s.bin"}),
     errors.UnsupportedError, "s.bin"),
    (lambda m: m["datasets"][0].update(path=""), errors.InvalidSpecError, "datasets[0].path"),
])
def test_malformed_documents_name_the_member(tmp_path: Path, mutate: Any, error: type, names: str) -> None:
    _ngff_04(tmp_path)
    attrs = json.loads((tmp_path / ".zattrs").read_text())
    mutate(attrs["multiscales"][0])
    (tmp_path / ".zattrs").write_text(json.dumps(attrs))
    with pytest.raises(error) as e:
        tsp.open_multiscale(tmp_path.as_uri() + "/").result()
    assert names in str(e.value)


def test_no_multiscale_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(errors.NotFoundError):
        tsp.open_multiscale(tmp_path.as_uri() + "/").result()
    zarr.open_group(str(tmp_path / "g"), mode="w", zarr_format=3)
    with pytest.raises(errors.NotFoundError, match="multiscales"):
        tsp.open_multiscale((tmp_path / "g").as_uri() + "/").result()


# -- writing ----------------------------------------------------------------------------------

@pytest.mark.parametrize("zarr_format", [3, 2])
def test_write_pyramid_ome_zarr(tmp_path: Path, zarr_format: int) -> None:
    data = np.random.default_rng(1).integers(0, 255, (3, 19, 30, 21), dtype=np.uint8)
    base = tsp.open("memory://", create=True, dtype="uint8", shape=data.shape).result()
    base.write(data).result()
    url = tmp_path.as_uri() + "/img/"
    ms = tsp.write_pyramid(base, url, levels=3, zarr_format=zarr_format, chunks=[1, 8, 8, 8],
                           voxel_size=[1, 0.5, 0.2, 0.2], name="em").result()
    assert ms.version == ("0.5" if zarr_format == 3 else "0.4") and len(ms) == 3
    assert ms.levels[2].scale == (1.0, 2.0, 0.8, 0.8)
    # zarr-python reads the group and its levels; the metadata is where the spec puts it
    group = zarr.open_group(str(tmp_path / "img"), mode="r")
    attrs = dict(group.attrs)
    entry = attrs["ome"]["multiscales"][0] if zarr_format == 3 else attrs["multiscales"][0]
    if zarr_format == 3:
        assert attrs["ome"]["version"] == "0.5" and "version" not in entry
    else:
        assert entry["version"] == "0.4"
    assert [a["name"] for a in entry["axes"]] == ["c", "z", "y", "x"]
    assert entry["axes"][0]["type"] == "channel" and entry["axes"][1]["type"] == "space"
    assert [d["path"] for d in entry["datasets"]] == ["0", "1", "2"]
    assert entry["datasets"][1]["coordinateTransformations"] == [{"type": "scale", "scale": [1.0, 1.0, 0.4, 0.4]}]
    previous = data
    for i in range(3):
        stored = group[str(i)][...]
        want = previous if i == 0 else ts.downsample(ts.array(previous), [1, 2, 2, 2], "mean").read().result()
        np.testing.assert_array_equal(stored, want)
        np.testing.assert_array_equal(ms.open(i).result().read().result(), want)
        previous = stored
    if zarr_format == 3:
        assert group["1"].metadata.dimension_names == ("c", "z", "y", "x")
    with pytest.raises(errors.InvalidSpecError, match="exists"):  # levels are never overwritten silently
        tsp.write_pyramid(base, url, levels=2, zarr_format=zarr_format).result()
    again = tsp.write_pyramid(base, url, levels=2, zarr_format=zarr_format, overwrite=True).result()
    assert len(again) == 2


def test_write_pyramid_keeps_other_group_attributes_and_translates_origins(tmp_path: Path) -> None:
    group = zarr.open_group(str(tmp_path / "img"), mode="w", zarr_format=3)
    group.attrs["owner"] = "lab"
    data = np.arange(10 * 12, dtype=np.float32).reshape(10, 12)
    base = tsp.open("memory://", create=True, dtype="float32", shape=data.shape).result()
    base.write(data).result()
    ms = tsp.write_pyramid(base.translate_to([5, 3]), (tmp_path / "img").as_uri() + "/", levels=2).result()
    attrs = json.loads((tmp_path / "img" / "zarr.json").read_text())["attributes"]
    assert attrs["owner"] == "lab" and "ome" in attrs
    assert ms.levels[0].translation == (5.0, 3.0) and ms.levels[1].translation == (4.0, 2.0)  # floor(5/2), floor(3/2)
    want = ts.downsample(ts.array(data)[ts.d[:].translate_to[5, 3]], [2, 2], "mean").read().result()
    np.testing.assert_array_equal(ms.open(1).result().read().result(), want)


def test_write_pyramid_precomputed_volume_and_added_scales(tmp_path: Path) -> None:
    seg = label_volume((33, 26, 12, 1), "uint64", np.random.default_rng(2))
    base = tsp.open("memory://", create=True, dtype="uint64", shape=seg.shape).result()
    base.write(seg).result()
    url = tmp_path.as_uri() + "/seg/"
    ms = tsp.write_pyramid(base.translate_to([4, 6, 2, 0]), url, format="neuroglancer_precomputed", levels=2,
                           chunks=[8, 8, 4], shards=[16, 16, 8], compression="compressed_segmentation",
                           voxel_size=[8, 8, 40]).result()
    info = json.loads((tmp_path / "seg" / "info").read_text())
    assert info["type"] == "segmentation" and [s["key"] for s in info["scales"]] == ["8_8_40", "16_16_80"]
    assert info["scales"][1]["voxel_offset"] == [2, 3, 1] and info["scales"][1]["size"] == [17, 13, 6]
    assert info["scales"][1]["sharding"]["hash"] == "identity"
    # level 1 is the mode of 2x2x2 blocks, read back by TensorStore
    want = ts.downsample(ts.array(seg)[ts.d[:].translate_to[4, 6, 2, 0]], [2, 2, 2, 1], "mode").read().result()
    t1 = ts.open({"driver": "neuroglancer_precomputed", "kvstore": {"driver": "file", "path": str(tmp_path / "seg")},
                  "scale_index": 1}).result()
    np.testing.assert_array_equal(t1.read().result(), want)
    assert tuple(t1.domain.inclusive_min) == (2, 3, 1, 0)
    # more scales added to the volume from its coarsest scale
    top = ms.open(1).result()
    more = tsp.write_pyramid(top, None, format="neuroglancer_precomputed", levels=3).result()
    assert [lv.path for lv in more.levels] == ["8_8_40", "16_16_80", "32_32_160", "64_64_320"]
    assert more.levels[3].scale == (64.0, 64.0, 320.0, 1.0)
    t3 = ts.open({"driver": "neuroglancer_precomputed", "kvstore": {"driver": "file", "path": str(tmp_path / "seg")},
                  "scale_index": 3}).result()
    np.testing.assert_array_equal(t3.read().result(), more.open(3).result().read().result())
