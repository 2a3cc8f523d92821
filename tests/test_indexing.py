"""The view layer's index transforms, checked against numpy and TensorStore.

The views run over a small in-test ArrayDriver backed by a numpy array (a test
double of our own driver contract) that checks every box it is asked for is
normalised, and counts I/O calls.
"""

from __future__ import annotations

import json
import random
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts

from tensorstore_py.drivers.base import ArrayDriver
from tensorstore_py.errors import InvalidArgumentError, OutOfRangeError, UnsupportedError
from tensorstore_py.indexing import IndexTransform
from tensorstore_py.kvstore.memory import MemoryKvStore
from tensorstore_py.tensorstore import TensorStore


class NumpyDriver(ArrayDriver):
    """An ArrayDriver over a numpy array that validates the boxes it gets."""

    driver = "zarr3"

    def __init__(self, data: np.ndarray, names: tuple[str | None, ...] | None = None) -> None:
        self.data = data
        self.names = names or (None,) * data.ndim
        self.kvstore = MemoryKvStore()
        self.reads: list[tuple[slice, ...]] = []
        self.writes: list[tuple[slice, ...]] = []

    shape = property(lambda self: self.data.shape)
    dtype = property(lambda self: self.data.dtype)
    fill_value = property(lambda self: self.data.dtype.type(0))
    dimension_names = property(lambda self: self.names)
    read_chunk_shape = property(lambda self: tuple(max(1, s // 2) for s in self.data.shape))
    write_chunk_shape = property(lambda self: tuple(max(1, s) for s in self.data.shape))
    metadata = property(lambda self: {"shape": list(self.data.shape)})

    def spec(self) -> dict[str, Any]:
        return {"driver": "zarr3", "kvstore": {"driver": "memory", "path": ""},
                "metadata": self.metadata}

    def _check(self, index: tuple[slice, ...]) -> None:
        assert len(index) == self.data.ndim
        for s, n in zip(index, self.data.shape):
            assert isinstance(s, slice) and s.step >= 1 and 0 <= s.start <= s.stop <= n, (index, n)

    async def read(self, index, *, out=None):
        self._check(index)
        self.reads.append(index)
        return self.data[index].copy()

    async def write(self, index, value):
        self._check(index)
        want = tuple(len(range(s.start, s.stop, s.step)) for s in index)
        assert value.shape == want and value.dtype == self.data.dtype
        self.writes.append(index)
        self.data[index] = value

    async def resize(self, new_shape):
        new = np.zeros(new_shape, self.data.dtype)
        common = tuple(slice(0, min(a, b)) for a, b in zip(new_shape, self.data.shape))
        new[common] = self.data[common]
        return NumpyDriver(new, self.names)

    def with_kvstore(self, kvstore):
        return self


def make(shape=(6, 7, 8), dtype=np.int32, names=None):
    data = np.arange(int(np.prod(shape))).astype(dtype).reshape(shape)
    drv = NumpyDriver(data, names)
    return TensorStore(drv), drv


KEYS = [
    (), 3, -1, slice(None), slice(1, 5), slice(None, None, -1), slice(5, 1, -2), slice(-3, None),
    (1, 2, 3), (-1, -2, -3), (Ellipsis, 2), (2, Ellipsis), (None, 1), (slice(None), None, 4),
    (np.newaxis, Ellipsis, np.newaxis), (slice(1, 100), slice(-100, 3)), (slice(4, 2),),
    (slice(None, None, 3), slice(6, None, -4), slice(None, None, -1)), (np.int64(2), np.int8(-1)),
    (None, None, 0, None, slice(2, 3), None), (Ellipsis,), (slice(10, 20),),
]


@pytest.mark.parametrize("key", KEYS, ids=repr)
def test_read_matches_numpy(key):
    a, drv = make()
    view = a[key]
    assert drv.reads == []  # lazy
    want = drv.data[key]
    assert view.shape == want.shape
    got = view.read().result()
    np.testing.assert_array_equal(got, want)
    assert np.asarray(view).shape == want.shape
    assert len(drv.reads) <= 2


@pytest.mark.parametrize("key", KEYS, ids=repr)
def test_write_matches_numpy(key):
    a, drv = make()
    ref = drv.data.copy()
    value = -np.arange(int(np.prod(ref[key].shape)), dtype=np.int32).reshape(ref[key].shape) - 1
    a[key].write(value).result()
    ref[key] = value
    np.testing.assert_array_equal(drv.data, ref)


def _random_key(rng: random.Random, shape: tuple[int, ...]) -> tuple:
    key: list[Any] = []
    for n in shape:
        r = rng.random()
        if r < 0.2 and n:
            key.append(rng.randrange(-n, n))
        elif r < 0.3:
            key.append(None)
            key.append(slice(None))
        else:
            step = rng.choice([None, 1, 2, 3, -1, -2])
            lo = rng.choice([None, rng.randrange(-n - 2, n + 3)])
            hi = rng.choice([None, rng.randrange(-n - 2, n + 3)])
            key.append(slice(lo, hi, step))
    if rng.random() < 0.3 and key:
        i = rng.randrange(len(key))
        key[i:] = [Ellipsis]  # the rest of the dims
    return tuple(key)


@pytest.mark.parametrize("seed", range(60))
def test_random_view_chains_match_numpy(seed):
    rng = random.Random(seed)
    a, drv = make((5, 6, 7, 4))
    ops: list[tuple[str, Any]] = []
    shape = drv.data.shape
    view = a
    for _ in range(rng.randrange(1, 5)):
        op = rng.random()
        if op < 0.6:
            key = _random_key(rng, shape)
            ops.append(("index", key))
            view = view[key]
        elif op < 0.8:
            perm = list(range(len(shape)))
            rng.shuffle(perm)
            ops.append(("transpose", perm))
            view = view.transpose(perm)
        else:
            view = view.translate_to([rng.randrange(-50, 50) for _ in shape])
        shape = _replay(np.empty(drv.data.shape), ops).shape
        assert view.shape == shape
    assert drv.reads == []
    np.testing.assert_array_equal(view.read().result(), _replay(drv.data, ops))
    # write through the view; numpy basic indexing gives views, so replaying the
    # ops on a copy of the base and assigning is the model
    model = drv.data.copy()
    value = (rng.randrange(1000) - np.arange(int(np.prod(shape)))).astype(np.int32).reshape(shape)
    view.write(value).result()
    _replay(model, ops)[...] = value
    np.testing.assert_array_equal(drv.data, model)


def _replay(arr: np.ndarray, ops: list[tuple[str, Any]]) -> np.ndarray:
    for kind, arg in ops:
        arr = arr[arg] if kind == "index" else arr.transpose(arg)
    return arr


def test_lazy_views_compose_without_io():
    a, drv = make((10, 10, 10))
    v = a[2:9, ::-1][1:, ..., ::3][None, 0].T.translate_to(5)
    assert drv.reads == [] and drv.writes == []
    np.testing.assert_array_equal(v.read().result(), drv.data[2:9, ::-1][1:, ..., ::3][None, 0].T)
    assert len(drv.reads) == 1


def test_one_normalised_box_per_read():
    a, drv = make((10, 12))
    a[8:1:-3, 1:11:2].read().result()
    (box,) = drv.reads
    assert box == (slice(2, 9, 3), slice(1, 10, 2))


@pytest.mark.parametrize("key", [10, -11, (0, 12), (0, 0, 0, 0), (Ellipsis, 8)])
def test_out_of_bounds_integer_is_index_error(key):
    a, _ = make((10, 12, 8))
    with pytest.raises(IndexError):
        a[key]
    with pytest.raises(OutOfRangeError):
        a[key]


@pytest.mark.parametrize(
    "key", [[1, 2], np.array([1, 2]), np.zeros(3, bool), True, 1.5, "x", slice(0, 5, 0), (..., ...)]
)
def test_unsupported_index_is_clear_error(key):
    a, _ = make((10, 12))
    with pytest.raises(InvalidArgumentError):
        a[key]


def test_write_shape_mismatch_raises_before_io():
    a, drv = make((4, 5))
    with pytest.raises(ValueError, match=r"shape \(3,\).*\(4, 5\)"):
        a.write(np.zeros(3, np.int32))
    with pytest.raises(InvalidArgumentError):
        a[:2].write(np.zeros((3, 5), np.int32))
    assert drv.writes == [] and drv.reads == []


def test_write_broadcasts_scalars_and_rows():
    a, drv = make((4, 5))
    a[1:3].write(7).result()
    a[:, 0].write([1, 2, 3, 4]).result()
    a[3].write(np.array([[9, 9, 9, 9, 9]], np.int32)).result()  # leading 1 dropped like numpy
    ref = np.arange(20, dtype=np.int32).reshape(4, 5)
    ref[1:3] = 7
    ref[:, 0] = [1, 2, 3, 4]
    ref[3] = 9
    np.testing.assert_array_equal(drv.data, ref)
    a[...] = 0  # __setitem__
    assert not drv.data.any()


def test_dtype_cast_same_kind():
    a, drv = make((3,), np.uint8)
    a.write(255).result()  # a Python int fits
    a.write(np.array([1, 2, 3], np.uint16)).result()
    np.testing.assert_array_equal(drv.data, [1, 2, 3])
    with pytest.raises(InvalidArgumentError, match="same_kind"):
        a.write(1.5)
    with pytest.raises(InvalidArgumentError, match="fit"):
        a.write(300)
    with pytest.raises(ValueError):
        a.write(np.array([1.0, 2.0, 3.0]))
    f, fdrv = make((2,), ml_dtypes.bfloat16)
    f.write(np.array([1.5, -2.0], np.float32)).result()
    f.write(3).result()
    np.testing.assert_array_equal(fdrv.data.astype(np.float32), [3.0, 3.0])
    b, bdrv = make((2,), np.bool_)
    b.write(True).result()
    assert bdrv.data.all()
    with pytest.raises(InvalidArgumentError):
        b.write(2)


def test_write_from_other_tensorstore():
    a, drv = make((4, 4))
    b, _ = make((4,))
    a[2].write(b[::-1]).result()
    np.testing.assert_array_equal(drv.data[2], [3, 2, 1, 0])


def test_labels_dims_and_transpose():
    a, drv = make((4, 5, 6), names=("z", "y", "x"))
    assert a.labels == ("z", "y", "x") and a.dimension_names == a.labels
    v = a.dims["y"][1:3]
    assert v.shape == (4, 2, 6) and v.labels == ("z", "y", "x")
    np.testing.assert_array_equal(v.read().result(), drv.data[:, 1:3])
    v = a.dims["x", "z"][-1, 1:3]
    assert v.shape == (2, 5) and v.labels == ("z", "y")
    np.testing.assert_array_equal(v.read().result(), drv.data[1:3, :, -1])
    t = a.transpose("x", "z", "y")
    assert t.labels == ("x", "z", "y") and t.shape == (6, 4, 5)
    np.testing.assert_array_equal(t.read().result(), drv.data.transpose(2, 0, 1))
    np.testing.assert_array_equal(a.T.read().result(), drv.data.T)
    assert a.T.labels == ("x", "y", "z")
    r = a.label("a", None, "c")
    assert r.labels == ("a", None, "c")
    assert a.dims[1].label("q").labels == ("z", "q", "x")
    assert a[None].labels == (None, "z", "y", "x")
    assert a.dims[1:][0, 2].shape == (4,) and a.dims[-1, 0][1, 2].labels == ("y",)
    with pytest.raises(InvalidArgumentError, match="unique"):
        a.label("a", "a", "b")
    with pytest.raises(InvalidArgumentError, match="labelled 'w'"):
        a.dims["w"]
    with pytest.raises(InvalidArgumentError):
        a.transpose("x", "y")


def test_translate_and_coordinate_indexing():
    a, drv = make((10, 8), names=("y", "x"))
    t = a.translate_to([100, -4])
    assert t.origin == (100, -4) and t.domain.exclusive_max == (110, 4) and t.shape == (10, 8)
    assert repr(t.domain) == '{ "y": [100, 110), "x": [-4, 4) }'
    # [] stays positional; .at uses coordinates
    np.testing.assert_array_equal(t[0].read().result(), drv.data[0])
    np.testing.assert_array_equal(t.at[100, -4:0].read().result(), drv.data[0, :4])
    np.testing.assert_array_equal(t.at[105:107, -1].read().result(), drv.data[5:7, 3])
    np.testing.assert_array_equal(t.dims["x"].at[-4].read().result(), drv.data[:, 0])
    assert t.at[102:105].origin == (102, -4)  # step 1 keeps coordinates
    with pytest.raises(IndexError):
        t.at[99]
    with pytest.raises(IndexError):
        t.at[0]
    with pytest.raises(IndexError, match="does not clip"):
        t.at[100:111]
    u = t.translate_by([1, None])
    assert u.origin == (101, -4)
    assert t.dims["x"].translate_by(2).origin == (100, -2)
    assert t.dims["x"].translate_to(0).origin == (100, 0)
    t.at[109, 3] = -1
    assert drv.data[9, 7] == -1


def _ts_oracle(data: np.ndarray, origin) -> Any:
    arr = ts.array(data)
    return arr[ts.d[:].translate_to[tuple(origin)]]


@pytest.mark.parametrize("seed", range(40))
def test_coordinate_indexing_matches_tensorstore(seed):
    rng = random.Random(seed)
    data = np.arange(9 * 7).reshape(9, 7)
    origin = [rng.randrange(-20, 20), rng.randrange(-20, 20)]
    ours = make(data.shape)[0].translate_to(origin)
    theirs = _ts_oracle(data, origin)
    for _ in range(2):
        key = []
        for o, n in zip(ours.origin, ours.shape):
            if n == 0 or rng.random() < 0.2:
                key.append(slice(None))
                continue
            step = rng.choice([1, 1, 2, 3, -1, -2])
            a, b = sorted(rng.randrange(o, o + n + 1) for _ in range(2))
            if step < 0:
                a, b = b - 1, a - 1
            key.append(slice(a, b, step))
        key = tuple(key)
        ours, theirs = ours.at[key], theirs[key]
        assert ours.origin == tuple(theirs.domain.inclusive_min), key
        assert ours.shape == tuple(theirs.domain.shape), key
    np.testing.assert_array_equal(ours.read().result(), theirs.read().result())


@pytest.mark.parametrize("key", [slice(1, 10, 2), slice(9, None, -1), slice(8, None, -3), slice(3, 7)])
def test_positional_strided_domain_matches_tensorstore(key):
    a, _ = make((10,))
    assert a[key].domain.inclusive_min == tuple(ts.array(np.arange(10))[key].domain.inclusive_min)


def test_transform_json_is_tensorstore_compatible_and_round_trips():
    data = np.arange(6 * 7 * 8).reshape(6, 7, 8)
    a, _ = make(data.shape, names=("z", "y", "x"))
    v = a[1:5, ::-2, 3][None].translate_by([0, 10, -3]).transpose(2, 0, 1)
    j = v.transform.to_json()
    json.dumps(j)
    theirs = ts.array(data)[ts.IndexTransform(json=j)]
    np.testing.assert_array_equal(v.read().result(), theirs.read().result())
    assert tuple(theirs.domain.inclusive_min) == v.origin
    again = IndexTransform.from_json(j, 3)
    assert again == v.transform
    assert v.spec()["transform"] == j


def test_resize_keeps_labels_and_origin():
    a, drv = make((4, 4), names=("y", "x"))
    t = a.translate_to([10, 20])
    b = t.resize([6, 2]).result()
    assert b.shape == (6, 2) and b.origin == (10, 20) and b.labels == ("y", "x")
    np.testing.assert_array_equal(b.at[10:14, 20:22].read().result(), drv.data[:, :2])
    with pytest.raises(UnsupportedError):
        a[1:].resize([2, 2])
    # a stale view reaching outside the shrunk array fails clearly
    stale = TensorStore(b._driver, a[:, 3].transform)
    with pytest.raises(IndexError, match="resized"):
        stale.read()


def test_empty_views_do_no_io():
    a, drv = make((4, 5))
    v = a[3:1]
    assert v.shape == (0, 5)
    assert v.read().result().shape == (0, 5)
    v.write(1).result()
    v.write(np.zeros((0, 5), np.int32)).result()
    assert drv.reads == [] and drv.writes == []


def test_chunk_layout_follows_view():
    a, _ = make((8, 6))
    assert a.chunks == (4, 3) and a.shards == (8, 6)
    assert a.T.chunks == (3, 4)
    assert a[::2, None].chunk_layout.read_chunk_shape == (2, 1, 3)
