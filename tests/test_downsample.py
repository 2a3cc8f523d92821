"""``tsp.downsample`` against TensorStore's downsample driver on the same data: every
method, every class of data type, odd shapes, origins that cut blocks, sub-views."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts

import tensorstore_py as tsp
import tensorstore_py.downsample_view as ds
from tensorstore_py import errors

METHODS = ["mean", "median", "mode", "stride", "min", "max"]
DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
          "float16", "float32", "float64", "complex64", "complex128", ml_dtypes.bfloat16]
# (shape, factors, origin): blocks cut at both edges, factors above the extent, factor 1
GEOMETRIES = [((7, 5, 3), (2, 3, 1), (0, 0, 0)),
              ((9, 10), (4, 3), (-5, 3)),
              ((13,), (5,), (2,)),
              ((3, 4, 6), (5, 1, 4), (1, -7, 3))]


def _data(dtype: Any, shape: tuple[int, ...], rng: np.random.Generator, *, few: bool = False) -> np.ndarray:
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return rng.random(shape) < 0.5
    if few:  # many ties for mode and median
        return rng.integers(0, 3, shape).astype(dt)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, shape, dtype=dt, endpoint=True)
    if dt.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dt)
    return (rng.standard_normal(shape) * 100).astype(dt)


def _stored(data: np.ndarray, origin: tuple[int, ...]) -> tsp.TensorStore:
    a = tsp.open("memory://", create=True, dtype=data.dtype, shape=data.shape, chunks=[3] * data.ndim).result()
    a.write(data).result()
    return a.translate_to(list(origin))


def _equal(got: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_matches_tensorstore(dtype: Any) -> None:
    rng = np.random.default_rng(0)
    for few in (False, True):
        for shape, factors, origin in GEOMETRIES:
            data = _data(dtype, shape, rng, few=few)
            theirs_base = ts.array(data)[ts.d[:].translate_to[origin]]
            ours_base = _stored(data, origin)
            for method in METHODS:
                try:
                    theirs = ts.downsample(theirs_base, factors, method)
                except ValueError:  # not supported by TensorStore for this type: nor by us
                    with pytest.raises(errors.InvalidArgumentError, match=method):
                        tsp.downsample(ours_base, factors, method)
                    continue
                ours = tsp.downsample(ours_base, factors, method)
                assert ours.domain.inclusive_min == tuple(theirs.domain.inclusive_min), (method, shape)
                assert ours.shape == tuple(theirs.domain.shape), (method, shape)
                want = theirs.read().result()
                _equal(ours.read().result(), want)
                # any sub-view reads the same positions: a box, a strided and reversed view
                box = tuple(slice(1, None) for _ in shape)
                _equal(ours[box].read().result(), want[box])
                strided = tuple(slice(None, None, -2) for _ in shape)
                _equal(ours[strided].read().result(), want[strided])


def test_integer_mean_rounds_half_to_even_and_exactly() -> None:
    big = np.iinfo(np.int64).max
    cases = {
        np.int32: [1, 2, 2, 3, -1, -2, -3, -4, 5, 6],
        np.uint8: [200, 255, 1, 2, 254, 255],
        np.int64: [big, big - 1, -big, -big + 1, big, big],
        np.uint64: [2**64 - 1, 2**64 - 2, 2**64 - 1, 2**64 - 1, 1, 2],
    }
    for dtype, values in cases.items():
        data = np.array(values, dtype)
        want = ts.downsample(ts.array(data), [2], "mean").read().result()
        got = tsp.downsample(_stored(data, (0,)), 2, "mean").read().result()
        _equal(got, want)
    assert tsp.downsample(_stored(np.array([1, 2, 2, 3], np.int32), (0,)), 2, "mean").read().result().tolist() == [2, 2]


def test_ties_and_lower_median() -> None:
    data = np.array([4.0, 3.0, 1.0, 2.0, 7.0, 7.0, 5.0, 5.0], np.float32)
    a = _stored(data, (0,))
    assert tsp.downsample(a, 4, "median").read().result().tolist() == [2.0, 5.0]
    assert tsp.downsample(a, 4, "mode").read().result().tolist() == [1.0, 5.0]  # lowest among ties
    flags = _stored(np.array([True, False, True, True, False]), (0,))
    for method in ("mean", "median", "mode"):  # bool: the mode, a tie going to False
        assert tsp.downsample(flags, 2, method).read().result().tolist() == [False, True, False]


def test_domains_follow_tensorstore_rounding() -> None:
    a = _stored(np.arange(10, dtype=np.int32), (4,))  # [4, 14)
    assert tsp.downsample(a, 3, "mean").domain.inclusive_min == (1,)  # floor(4/3)
    assert tsp.downsample(a, 3, "mean").shape == (4,)  # ceil(14/3) = 5
    assert tsp.downsample(a, 3, "stride").domain.inclusive_min == (2,)  # ceil(4/3)
    assert tsp.downsample(a, 3, "stride").read().result().tolist() == [2, 5, 8]  # coordinates 6, 9, 12
    neg = _stored(np.arange(10, dtype=np.int32), (-4,))
    assert tsp.downsample(neg, 3, "mean").domain.inclusive_min == (-2,)
    assert tsp.downsample(neg, 3, "stride").domain.inclusive_min == (-1,)


def test_views_compose_and_are_lazy_and_read_only() -> None:
    data = np.arange(6 * 8 * 4, dtype=np.uint16).reshape(6, 8, 4)
    a = _stored(data, (0, 0, 0)).label("z", "y", "x")
    view = tsp.downsample(a.transpose("x", "z", "y"), [2, 3, 2], "mean")
    want = ts.downsample(ts.array(data.transpose(2, 0, 1)), [2, 3, 2], "mean").read().result()
    _equal(view.read().result(), want)
    assert view.labels == ("x", "z", "y")
    twice = tsp.downsample(tsp.downsample(a, 2, "max"), 2, "max")  # a downsample of a downsample
    _equal(twice.read().result(), ts.downsample(ts.downsample(ts.array(data), [2] * 3, "max"), [2] * 3, "max")
           .read().result())
    with pytest.raises(errors.ReadOnlyError):
        view.write(np.zeros(view.shape, np.uint16)).result()
    spec = view.spec()
    assert spec["driver"] == "downsample" and spec["downsample_factors"] == [2, 3, 2]
    assert spec["downsample_method"] == "mean" and spec["base"]["driver"] == "zarr3"


@pytest.mark.parametrize("factors,method,match", [
    ([2, 2], "mean", "factors"), ([0, 1, 1], "mean", "factors"), ([2, True, 1], "mean", "factors"),
    (2, "average", "method"),
])
def test_bad_arguments_are_refused_before_any_io(factors: Any, method: str, match: str) -> None:
    a = tsp.open("memory://", create=True, dtype="uint8", shape=[4, 4, 4]).result()
    with pytest.raises(errors.InvalidArgumentError, match=match):
        tsp.downsample(a, factors, method)
    c = tsp.open("memory://", create=True, dtype="complex64", shape=[4]).result()
    with pytest.raises(errors.InvalidArgumentError, match="median.*complex64"):
        tsp.downsample(c, 2, "median")


def test_large_reads_go_in_slabs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ds, "_SLAB_BYTES", 1000)  # many slabs, same answer
    data = np.random.default_rng(1).integers(0, 100, (40, 30, 20), dtype=np.uint8)
    got = tsp.downsample(_stored(data, (3, 1, 0)), [3, 2, 4], "median").read().result()
    want = ts.downsample(ts.array(data)[ts.d[:].translate_to[3, 1, 0]], [3, 2, 4], "median").read().result()
    _equal(got, want)


def test_downsampled_views_pickle_as_their_spec(tmp_path: Path) -> None:
    data = np.arange(40 * 30, dtype=np.int32).reshape(40, 30)
    base = tsp.open(f"file://{tmp_path}/a/", create=True, shape=data.shape, dtype="int32", chunks=(7, 9)).result()
    base.write(data).result()
    for view in (tsp.downsample(base, [4, 3], "mean"), tsp.downsample(base[5:], 2, "median")[2:, ::-1],
                 tsp.downsample(tsp.downsample(base.T, 2, "max"), 3, "mode")):
        back = pickle.loads(pickle.dumps(view))
        assert back.spec() == view.spec()
        assert back.spec()["driver"] == "downsample"
        np.testing.assert_array_equal(back.read().result(), view.read().result())
    base.write(np.zeros_like(data)).result()  # the copy reads the stored data, not a snapshot
    assert not pickle.loads(pickle.dumps(tsp.downsample(base, 2, "max"))).read().result().any()
