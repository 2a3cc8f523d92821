"""zarr groups and attributes: ``tsp.open_group`` / :class:`tsp.Group`, array
attributes, zarr v2 dimension names (``_ARRAY_DIMENSIONS``), with zarr-python
and xarray as the oracles (both directions), concurrent attribute updates, and
the error for a group opened as an array.
"""

from __future__ import annotations

import json
import pickle
import threading
from pathlib import Path

import numpy as np
import pytest
import zarr

import tensorstore_py as tsp
from tensorstore_py.core.errors import InvalidArgumentError, InvalidSpecError, NotFoundError


def url(p: Path) -> str:
    return p.as_uri() + "/"


def build_dataset(root: Path, zarr_format: int) -> tsp.Group:
    """A small dataset with coordinates and a data variable, as xarray lays it out."""
    g = tsp.open_group(url(root), create=True, zarr_format=zarr_format).result()
    g.update_attrs({"title": "scan 7", "nested": {"a": [1, 2]}}).result()
    x = g.create_array("x", shape=[5], dtype="float64", dimension_names=["x"]).result()
    x.write(np.linspace(0, 1, 5)).result()
    y = g.create_array("y", shape=[3], dtype="int32", dimension_names=["y"],
                       attributes={"units": "m"}).result()
    y.write([10, 20, 30]).result()
    t = g.create_array("temp", shape=[3, 5], dtype="float32", chunks=[2, 2], dimension_names=["y", "x"],
                       attributes={"long_name": "temperature"}).result()
    t.write(np.arange(15, dtype=np.float32).reshape(3, 5)).result()
    g.create_group("sub", attributes={"k": 1}).result()
    return g


@pytest.mark.parametrize("zarr_format", [3, 2])
def test_zarr_python_reads_what_we_write(tmp_path: Path, zarr_format: int) -> None:
    build_dataset(tmp_path, zarr_format)
    z = zarr.open_group(str(tmp_path), mode="r", zarr_format=zarr_format)
    assert dict(z.attrs) == {"title": "scan 7", "nested": {"a": [1, 2]}}
    assert sorted(z.array_keys()) == ["temp", "x", "y"] and list(z.group_keys()) == ["sub"]
    assert dict(z["sub"].attrs) == {"k": 1}
    temp = z["temp"]
    assert np.array_equal(temp[:], np.arange(15, dtype=np.float32).reshape(3, 5))
    if zarr_format == 3:
        assert dict(temp.attrs) == {"long_name": "temperature"}
        assert temp.metadata.dimension_names == ("y", "x")
    else:
        assert dict(temp.attrs) == {"long_name": "temperature", "_ARRAY_DIMENSIONS": ["y", "x"]}
    assert dict(z["y"].attrs).get("units") == "m"


@pytest.mark.parametrize("zarr_format", [3, 2])
def test_we_read_what_zarr_python_writes(tmp_path: Path, zarr_format: int) -> None:
    root = zarr.open_group(str(tmp_path), mode="w", zarr_format=zarr_format)
    root.attrs.update({"owner": "lab", "n": 3})
    sub = root.create_group("raw")
    sub.attrs["kind"] = "em"
    kw = {"dimension_names": ["z", "y"]} if zarr_format == 3 else {}
    arr = sub.create_array("vol", shape=(4, 6), chunks=(2, 3), dtype="uint16", **kw)
    arr[:] = np.arange(24, dtype=np.uint16).reshape(4, 6)
    arr.attrs["resolution"] = [40, 4]
    if zarr_format == 2:
        arr.attrs["_ARRAY_DIMENSIONS"] = ["z", "y"]
    g = tsp.open_group(url(tmp_path)).result()
    assert g.zarr_format == zarr_format and g.attrs == {"owner": "lab", "n": 3}
    assert g.members().result() == {"raw": "group"}
    raw = g.open("raw").result()
    assert isinstance(raw, tsp.Group) and raw.attrs == {"kind": "em"}
    assert raw.members().result() == {"vol": "array"}
    vol = raw.open("vol").result()
    assert isinstance(vol, tsp.TensorStore)
    assert np.array_equal(vol.read().result(), np.arange(24, dtype=np.uint16).reshape(4, 6))
    assert vol.attributes == {"resolution": [40, 4]}
    assert vol.labels == ("z", "y")
    assert np.array_equal(g.open("raw/vol").result().dims["y"][1].read().result(), [1, 7, 13, 19])


def test_zarr2_dimension_names_are_stored_as_array_dimensions(tmp_path: Path) -> None:
    a = tsp.open(url(tmp_path), driver="zarr", create=True, dtype="int8", shape=[4, 3],
                 dimension_names=["row", "col"]).result()
    assert json.loads((tmp_path / ".zattrs").read_text()) == {"_ARRAY_DIMENSIONS": ["row", "col"]}
    assert ".zattrs" not in (tmp_path / ".zarray").read_text() and a.labels == ("row", "col")
    b = tsp.open(url(tmp_path)).result()
    assert b.labels == ("row", "col") and b.attributes == {}
    b.update_attributes({"x": 1}).result()  # _ARRAY_DIMENSIONS kept
    assert json.loads((tmp_path / ".zattrs").read_text()) == {"_ARRAY_DIMENSIONS": ["row", "col"], "x": 1}
    assert tsp.open(url(tmp_path), dimension_names=["row", "col"]).result().attributes == {"x": 1}
    with pytest.raises(InvalidSpecError, match="dimension_names"):
        tsp.open(url(tmp_path), dimension_names=["a", "b"]).result()
    with pytest.raises(InvalidSpecError, match="every dimension"):
        tsp.open(url(tmp_path / "p"), driver="zarr", create=True, dtype="int8", shape=[4, 3],
                 dimension_names=["row", None]).result()
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("driver, key", [("zarr3", "zarr.json"), ("zarr", ".zattrs")])
def test_array_attributes(tmp_path: Path, driver: str, key: str) -> None:
    a = tsp.open(url(tmp_path), driver=driver, create=True, dtype="float32", shape=[6, 4]).result()
    assert a.attributes == {}
    assert a.update_attributes({"a": 1, "b": [1, 2]}).result() == {"a": 1, "b": [1, 2]}
    assert a.update_attributes({"b": None}).result() == {"a": 1, "b": None}
    assert a.attributes == {"a": 1, "b": None}
    doc = json.loads((tmp_path / key).read_text())
    assert (doc["attributes"] if driver == "zarr3" else doc) == {"a": 1, "b": None}
    assert dict(zarr.open_array(str(tmp_path), mode="r").attrs) == {"a": 1, "b": None}
    assert a.spec()["driver"] == driver and tsp.open(a.spec()).result().attributes == {"a": 1, "b": None}
    with pytest.raises(InvalidArgumentError, match="JSON"):
        a.update_attributes({"bad": object()}).result()


def test_concurrent_attribute_updates_all_land(tmp_path: Path) -> None:
    g = tsp.open_group(url(tmp_path), create=True).result()
    a = g.create_array("a", shape=[4], dtype="uint8").result()
    n = 12

    def work(i: int) -> None:
        # each its own open objects: only the store's conditions keep them apart
        tsp.open_group(url(tmp_path)).result().update_attrs({f"g{i}": i}).result()
        tsp.open(url(tmp_path / "a")).result().update_attributes({f"a{i}": i}).result()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert tsp.open_group(url(tmp_path)).result().attrs == {f"g{i}": i for i in range(n)}
    assert tsp.open(url(tmp_path / "a")).result().attributes == {f"a{i}": i for i in range(n)}
    assert a.attributes == {}  # what this object saw; its next update merges with the stored


def test_group_opened_as_array_names_the_path_and_members(tmp_path: Path) -> None:
    for fmt, driver in ((3, "zarr3"), (2, "zarr")):
        root = tmp_path / f"v{fmt}"
        build_dataset(root, fmt)
        for spec in (url(root), {"driver": driver, "kvstore": url(root)}):
            with pytest.raises(InvalidSpecError) as e:
                tsp.open(spec).result()
            msg = str(e.value)
            assert str(root) in msg and "group" in msg and "['temp', 'x', 'y']" in msg and "sub" in msg
        with pytest.raises(InvalidSpecError, match="is a zarr v.* group"):
            tsp.open(url(root), driver=driver, create=True, shape=[2], dtype="uint8").result()
    with pytest.raises(NotFoundError, match="no array"):
        tsp.open(url(tmp_path / "nothing")).result()


def test_group_errors(tmp_path: Path) -> None:
    tsp.open(url(tmp_path / "arr"), create=True, shape=[2], dtype="uint8").result()
    with pytest.raises(InvalidSpecError, match="is an array"):
        tsp.open_group(url(tmp_path / "arr")).result()
    with pytest.raises(NotFoundError, match="no group"):
        tsp.open_group(url(tmp_path / "none")).result()
    g = tsp.open_group(url(tmp_path / "g"), create=True, zarr_format=2).result()
    with pytest.raises(InvalidSpecError, match="not zarr v3"):
        tsp.open_group(url(tmp_path / "g"), zarr_format=3).result()
    g.create_array("a", shape=[2], dtype="uint8").result()
    with pytest.raises(InvalidSpecError, match="array is stored there"):
        g.create_group("a").result()
    with pytest.raises(NotFoundError, match="no member 'b'"):
        g.open("b").result()
    with pytest.raises(InvalidArgumentError, match="member name"):
        g.open("/abs")
    assert g.set_attrs({"only": 1}).result() == {"only": 1}
    assert g.update_attrs({"more": 2}).result() == {"only": 1, "more": 2}
    assert g.set_attrs({}).result() == {}


def test_n5_groups(tmp_path: Path) -> None:
    (tmp_path / "attributes.json").write_text('{"n5": "4.0.0"}')
    tsp.open(url(tmp_path / "s0"), driver="n5", create=True, dtype="uint8", shape=[4, 4]).result()
    g = tsp.open_group(url(tmp_path)).result()
    assert g.format == "n5" and g.zarr_format is None and g.attrs == {"n5": "4.0.0"}
    assert g.members().result() == {"s0": "array"}
    assert g.update_attrs({"scales": [[1, 1]]}).result() == {"n5": "4.0.0", "scales": [[1, 1]]}
    arr = g.create_array("s1", shape=[2, 2], dtype="uint16").result()
    assert arr.driver.driver == "n5"
    assert g.members().result() == {"s0": "array", "s1": "array"}
    with pytest.raises(InvalidSpecError, match=r"N5 group.*\['s0', 's1'\]"):
        tsp.open(url(tmp_path)).result()


@pytest.mark.parametrize("zarr_format", [3, 2])
def test_xarray_reads_a_dataset_we_write(tmp_path: Path, zarr_format: int) -> None:
    xr = pytest.importorskip("xarray")
    build_dataset(tmp_path, zarr_format)
    ds = xr.open_zarr(str(tmp_path), consolidated=False, zarr_format=zarr_format)
    assert set(ds.data_vars) == {"temp"} and set(ds.coords) == {"x", "y"}
    assert ds["temp"].dims == ("y", "x") and ds["x"].dims == ("x",)
    assert np.array_equal(ds["temp"].values, np.arange(15, dtype=np.float32).reshape(3, 5))
    assert np.array_equal(ds["y"].values, [10, 20, 30])
    assert np.allclose(ds["x"].values, np.linspace(0, 1, 5))
    assert ds.attrs == {"title": "scan 7", "nested": {"a": [1, 2]}}
    assert ds["temp"].attrs["long_name"] == "temperature"
    assert float(ds["temp"].sel(y=20, x=0.25)) == 6.0


def test_groups_on_a_memory_store() -> None:
    g = tsp.open_group("memory://grp/", create=True).result()
    a = g.create_array("a", shape=[3], dtype="int16", attributes={"k": "v"}).result()
    a.write([1, 2, 3]).result()
    sub = g.create_group("s").result()
    sub.create_array("b", shape=[2], dtype="uint8").result()
    assert g.members().result() == {"a": "array", "s": "group"}
    assert np.array_equal(g.open("a").result().read().result(), [1, 2, 3])
    assert g.open("a").result().attributes == {"k": "v"}
    assert isinstance(g.open("s/b").result(), tsp.TensorStore)


def test_group_pickles_as_its_store(tmp_path: Path) -> None:
    g = build_dataset(tmp_path, 3)
    h = pickle.loads(pickle.dumps(g))
    assert h.attrs == g.attrs and h.zarr_format == 3
    assert h.members().result() == {"sub": "group", "temp": "array", "x": "array", "y": "array"}
