"""Bad input to the kvstore layer gets a clear, typed error and loses nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

import tensorstore_py as tsp
from tensorstore_py.errors import InvalidArgumentError, InvalidKeyError, InvalidSpecError
from tensorstore_py.kvstore import registry
from tensorstore_py.kvstore.file import FileKvStore
from tensorstore_py.kvstore.memory import MemoryKvStore

TRAVERSAL = ["../x", "a/../../x", "..", "a/..", "./a", "a/./b", "/etc/passwd", "//x"]
MALFORMED = ["", "a", "a/b"]


@pytest.fixture(params=["memory", "file"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> tsp.KvStore:
    if request.param == "memory":
        return MemoryKvStore()
    return FileKvStore(path=str(tmp_path / "root"))


@pytest.mark.parametrize("key", TRAVERSAL)
def test_traversal_keys_are_refused(store: tsp.KvStore, key: str, tmp_path: Path) -> None:
    with pytest.raises(InvalidKeyError) as info:
        store.write(key, b"evil")
    assert repr(key) in str(info.value) or "absolute" in str(info.value)
    assert isinstance(info.value, ValueError)
    with pytest.raises(InvalidKeyError):
        store.read(key)
    with pytest.raises(InvalidKeyError):
        store.delete(key)
    assert store.list().result() == []
    # nothing escaped next to the root either
    assert sorted(p.name for p in tmp_path.iterdir()) in ([], ["root"])


@pytest.mark.parametrize("key", ["", "a\x00b", "a//b", "a/", 5, None, b"bytes"])
def test_empty_and_malformed_keys(store: tsp.KvStore, key: object) -> None:
    with pytest.raises(InvalidKeyError):
        store.read(key)  # type: ignore[arg-type]
    with pytest.raises(InvalidKeyError):
        store.write(key, b"x")  # type: ignore[arg-type]


@pytest.mark.parametrize("key", ["a\ud800", "\udfff/b", "dir/x\udc80y"])
def test_keys_with_lone_surrogates(store: tsp.KvStore, key: str) -> None:
    """A str that is not valid Unicode can not name a file (or a GCS object):
    InvalidKeyError naming it, for every operation, not a UnicodeEncodeError."""
    for call in (lambda: store.write(key, b"x"), lambda: store.read(key), lambda: store.delete(key),
                 lambda: store.list(key), lambda: store.delete_range(key + "/"),
                 lambda: store.with_path(key)):
        with pytest.raises(InvalidKeyError, match="surrogate"):
            call()
    assert store.list().result() == []


def test_file_names_that_are_not_utf8_are_not_listed(tmp_path: Path) -> None:
    """A file another tool named with bytes that are not UTF-8 can not be a key
    (reading it would raise InvalidKeyError), so list does not show it."""
    import os

    os.makedirs(os.fsencode(tmp_path) + b"/dir\xff")
    for name in (b"ok", b"bad\x80", b"dir\xff/inner"):
        with open(os.fsencode(tmp_path) + b"/" + name, "wb") as f:
            f.write(b"x")
    kv = FileKvStore(path=str(tmp_path))
    assert kv.list().result() == ["ok"]
    assert [i.key for i in kv.list_info().result()] == ["ok"]


def test_file_store_path_with_lone_surrogate(tmp_path: Path) -> None:
    with pytest.raises(InvalidSpecError, match="Unicode"):
        FileKvStore(path=str(tmp_path) + "/bad\ud800")


@pytest.mark.parametrize("rng", [slice(5, 2), slice(-3, 10), slice(0, 10, 2), slice(0, -1), "0-10"])
def test_bad_byte_ranges(store: tsp.KvStore, rng: object) -> None:
    store.write("k", b"0123456789").result()
    with pytest.raises(InvalidArgumentError):
        store.read("k", byte_range=rng).result()  # type: ignore[arg-type]


def test_bad_values(store: tsp.KvStore) -> None:
    for v in ("text", 5, None, [1, 2]):
        with pytest.raises(InvalidArgumentError, match="bytes-like"):
            store.write("k", v)  # type: ignore[arg-type]
    assert store.read("k").result().state == "missing"


def test_unknown_driver_names_the_known_ones() -> None:
    with pytest.raises(InvalidSpecError) as info:
        tsp.KvStore.open({"driver": "nosuch", "path": "x"}).result()
    msg = str(info.value)
    assert "'nosuch'" in msg
    for name in ("memory", "file", "gcs", "http", "fsspec", "fault"):
        assert name in msg
    with pytest.raises(InvalidSpecError, match="known drivers"):
        tsp.KvStore.open({"path": "x"}).result()


@pytest.mark.parametrize(
    "url",
    [
        "",
        "file:relative/x",
        "file://relative/x",
        "1nvalid://x",
        "ht tp://x",
        "nosuchscheme://x/",
        "c:stuff",
        "http://",
        "https://host:99999999/",
    ],
)
def test_malformed_urls(url: str) -> None:
    with pytest.raises(InvalidSpecError):
        tsp.KvStore.open(url).result()


def test_file_url_must_be_absolute() -> None:
    with pytest.raises(InvalidSpecError, match="absolute"):
        tsp.KvStore.open("file://data/x/").result()


@pytest.mark.parametrize(
    "spec",
    [
        42,
        ["driver", "file"],
        {"driver": "file"},
        {"driver": "file", "path": ""},
        {"driver": "file", "path": "/tmp/x", "unknown_option": 1},
        {"driver": "memory", "colour": "blue"},
    ],
)
def test_malformed_specs(spec: object) -> None:
    with pytest.raises(InvalidSpecError):
        tsp.KvStore.open(spec).result()  # type: ignore[arg-type]


def test_missing_optional_dependency_names_the_extra() -> None:
    registry.register_driver(
        "needs_extra", "tensorstore_py.kvstore._no_such_module_", "NoStore", extra="gcs"
    )
    try:
        with pytest.raises(ImportError) as info:
            tsp.KvStore.open({"driver": "needs_extra"}).result()
        msg = str(info.value)
        assert "needs_extra" in msg
        assert 'pip install "tensorstore_py[gcs]"' in msg
    finally:
        registry._DRIVERS.pop("needs_extra", None)


def test_read_only_store_refuses_every_mutation(tmp_path: Path) -> None:
    from tensorstore_py.kvstore.fault import FaultKvStore

    ro = FaultKvStore(MemoryKvStore())
    ro.read_only = True
    for call in (lambda: ro.write("k", b"v"), lambda: ro.delete("k"), lambda: ro.delete_range("")):
        with pytest.raises(tsp.ReadOnlyError, match="read-only"):
            call()


def test_every_error_class_is_tsp_name() -> None:
    """``tsp.<Name>`` is the class ``tsp.errors.<Name>`` for every error of the tree."""
    import tensorstore_py.errors as errors_mod

    assert errors_mod.__all__
    for name in errors_mod.__all__:
        cls = getattr(errors_mod, name)
        assert issubclass(cls, tsp.TensorStoreError)
        assert getattr(tsp, name) is cls, name
        assert name in tsp.__all__
    assert tsp.OutOfRangeError is errors_mod.OutOfRangeError
    assert issubclass(tsp.OutOfRangeError, IndexError)


@pytest.mark.parametrize("bounds", [(1.5, 3), (0, 2.0), ("1", 3), (0, "9"), (True, 3), (0, None, "x")])
def test_byte_ranges_with_non_integer_bounds_are_refused(store: tsp.KvStore, bounds: tuple) -> None:
    """A float, string or bool bound is the caller's mistake: InvalidArgumentError
    naming the range, never a raw TypeError/ValueError nor a silently truncated range."""
    store.write("k", b"0123456789").result()
    start, stop = bounds[0], bounds[1]
    if len(bounds) == 2:
        with pytest.raises(InvalidArgumentError, match="must be an integer"):
            tsp.ByteRange(start, stop)
    with pytest.raises(InvalidArgumentError):
        store.read("k", byte_range=slice(start, stop, *bounds[2:])).result()
    with pytest.raises(InvalidArgumentError):
        store.read_ranges("k", [slice(0, 2), slice(start, stop, *bounds[2:])]).result()
    # numpy integers are integers
    np = pytest.importorskip("numpy")
    assert bytes(store.read("k", byte_range=tsp.ByteRange(np.int64(2), np.uint8(4))).result().value) == b"23"
    got = store.read_ranges("k", [slice(np.int32(1), np.int64(3))]).result()
    assert [bytes(v) for v in got.values] == [b"12"]


@pytest.mark.parametrize("ranges", [None, 5, slice(0, 2), "0:2", [(0, 2)]])
def test_read_ranges_with_malformed_ranges_is_refused(store: tsp.KvStore, ranges: object) -> None:
    store.write("k", b"0123456789").result()
    with pytest.raises(InvalidArgumentError):
        store.read_ranges("k", ranges).result()  # type: ignore[arg-type]
