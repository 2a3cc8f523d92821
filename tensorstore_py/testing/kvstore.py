"""A conformance suite for kvstores: subclass it in a pytest module.

Writable stores::

    from tensorstore_py.testing.kvstore import KvStoreConformance

    class TestMyStore(KvStoreConformance):
        @pytest.fixture
        def store(self, tmp_path):
            return MyStore(...)          # a fresh, empty, writable store

Read-only stores (e.g. HTTP)::

    class TestMyReadOnly(ReadOnlyKvStoreConformance):
        supports_list = False             # HTTP can not list

        @pytest.fixture
        def populated_store(self): ...    # a store that holds exactly ``expected_values``

        @pytest.fixture
        def expected_values(self) -> dict[str, bytes]: ...

The suite calls only the public API (every call, every error, the spec round
trip and a compare-and-swap race of ``race_workers`` threads x
``race_increments`` increments of one counter). Class attributes tune it for
slow or limited stores:

* ``timeout`` (s per Future), ``race_workers``, ``race_increments``,
  ``large_value_size``;
* ``supports_conditional_writes = False``: the store must refuse ``if_equal``
  with UnsupportedError and write nothing (the race is skipped);
* ``unique_generations = False``: rewriting identical bytes may keep the
  generation (stores whose only metadata is mtime + size);
* ``supports_list = False`` (read-only suite): ``list`` must raise UnsupportedError;
* ``picklable = False``: the store can not be reopened in another process and
  must say so with UnsupportedError when pickled (else it must pickle as its
  spec and the unpickled store must read and write the same data).

:func:`cas_increment_worker` is the race body for separate processes (a
picklable module-level function taking a spec).
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from functools import partial
from typing import Any, ClassVar

import pytest

from tensorstore_py.core.errors import (
    ConditionFailedError,
    InvalidArgumentError,
    InvalidKeyError,
    UnsupportedError,
)
from tensorstore_py.kvstore.base import Generation, KvStore
from tensorstore_py.testing.kvstore_common import BAD_KEYS, Conformance, raises_from
from tensorstore_py.testing.kvstore_readonly import ReadOnlyKvStoreConformance

__all__ = [
    "BAD_KEYS",
    "KvStoreConformance",
    "ReadOnlyKvStoreConformance",
    "cas_increment",
    "cas_increment_worker",
]


def _value(n: int, seed: int = 0) -> bytes:
    """``n`` deterministic, non-repeating-looking bytes."""
    return bytes((i * 131 + seed * 17 + (i >> 8)) & 0xFF for i in range(n))


def cas_increment(store: KvStore, key: str, increments: int, *, timeout: float = 60.0) -> int:
    """Increment the decimal counter at ``key`` ``increments`` times by CAS.

    Each increment reads the value and its generation and writes value+1 with
    ``if_equal=generation``, retrying on ConditionFailedError. Returns how many
    attempts lost a race (for the report; correctness is the final count).
    """
    lost = 0
    done = 0
    while done < increments:
        r = store.read(key).result(timeout)
        if r.state != "value":
            raise AssertionError(f"counter {key!r} vanished: state {r.state!r}")
        n = int(bytes(r.value).decode())
        try:
            store.write(key, str(n + 1).encode(), if_equal=r.generation).result(timeout)
        except ConditionFailedError:
            lost += 1
            continue
        done += 1
    return lost


def cas_increment_worker(spec: dict[str, Any], key: str, increments: int) -> int:
    """Open ``spec`` and run :func:`cas_increment` (for multi-process races)."""
    store = KvStore.open(spec).result(60)
    return cas_increment(store, key, increments)


class KvStoreConformance(Conformance):
    """Tests every store must pass. Subclasses provide fixture ``store``:
    a fresh, empty, writable :class:`KvStore` (function-scoped)."""

    #: compare-and-swap race size (threads x increments each)
    race_workers: ClassVar[int] = 4
    race_increments: ClassVar[int] = 25
    #: size of the "large value" test
    large_value_size: ClassVar[int] = 3 * 1024 * 1024 + 17
    #: False for stores that refuse ``if_equal`` (they must raise UnsupportedError
    #: and leave the value untouched); the condition and race tests check that instead
    supports_conditional_writes: ClassVar[bool] = True
    #: False when a rewrite of identical bytes may keep the generation (e.g. fsspec
    #: filesystems whose only metadata is mtime + size)
    unique_generations: ClassVar[bool] = True

    def _check_refuses_conditions(self, store: KvStore) -> None:
        g = self._res(store.write("k", b"v"))
        t = self.timeout
        for cond in (Generation.NO_VALUE, g):
            err = raises_from(UnsupportedError, partial(store.write, "k", b"new", if_equal=cond), t)
            assert "k" in str(err)
            raises_from(UnsupportedError, partial(store.write, "absent", b"new", if_equal=cond), t)
            raises_from(UnsupportedError, partial(store.delete, "k", if_equal=cond), t)
        assert bytes(self._res(store.read("k")).value) == b"v"
        assert self._res(store.read("absent")).state == "missing"

    # -- reads and writes ------------------------------------------------------
    def test_read_missing(self, store: KvStore) -> None:
        r = self._res(store.read("nope"))
        assert r.state == "missing"
        assert bytes(r.value) == b""
        assert r.generation == Generation.NO_VALUE
        assert r.generation.is_no_value

    def test_write_then_read(self, store: KvStore) -> None:
        data = _value(1000)
        g = self._res(store.write("a/b", data))
        assert isinstance(g, Generation) and not g.is_no_value
        r = self._res(store.read("a/b"))
        assert r.state == "value"
        assert bytes(r.value) == data
        assert r.generation == g

    def test_bytes_like_values(self, store: KvStore) -> None:
        self._res(store.write("ba", bytearray(b"bytearray")))
        self._res(store.write("mv", memoryview(b"xxmemoryviewxx")[2:-2]))
        self._res(store.write("empty", b""))
        assert bytes(self._res(store.read("ba")).value) == b"bytearray"
        assert bytes(self._res(store.read("mv")).value) == b"memoryview"
        r = self._res(store.read("empty"))
        assert r.state == "value" and bytes(r.value) == b""
        assert not r.generation.is_no_value

    def test_non_bytes_value_rejected(self, store: KvStore) -> None:
        with pytest.raises(ValueError):
            self._res(store.write("k", "text"))  # type: ignore[arg-type]

    def test_unusual_key_characters(self, store: KvStore) -> None:
        keys = ["sp ace", "ü/ñ", "a-b_c.d", "q?x=1&y", "per%cent", "hash#tag", "c.0.1"]
        for i, k in enumerate(keys):
            self._res(store.write(k, _value(10, i)))
        for i, k in enumerate(keys):
            assert bytes(self._res(store.read(k)).value) == _value(10, i), k
        assert self._res(store.list()) == sorted(keys)

    def test_large_value(self, store: KvStore) -> None:
        data = os.urandom(self.large_value_size)
        self._res(store.write("big", data))
        assert bytes(self._res(store.read("big")).value) == data
        tail = self._res(store.read("big", byte_range=slice(-100, None)))
        assert bytes(tail.value) == data[-100:]

    def test_overwrite_changes_generation(self, store: KvStore) -> None:
        g1 = self._res(store.write("k", b"same"))
        g2 = self._res(store.write("k", b"same"))
        g3 = self._res(store.write("k", b"other"))
        if self.unique_generations:
            assert len({g1, g2, g3}) == 3
        else:
            assert g3 != g2
        r = self._res(store.read("k"))
        assert bytes(r.value) == b"other" and r.generation == g3

    @pytest.mark.parametrize(
        "rng, expect",
        [
            (slice(2, 10), slice(2, 10)),
            (slice(0, 1), slice(0, 1)),
            (slice(5, None), slice(5, None)),
            (slice(-4, None), slice(-4, None)),
            (slice(-1, None), slice(-1, None)),
            (slice(90, 200), slice(90, 100)),  # clipped at the end
            (slice(100, 120), slice(100, 100)),  # starts at the end: empty
            (slice(150, None), slice(100, 100)),  # starts past the end: empty
            (slice(-500, None), slice(0, None)),  # suffix longer than the value
            (slice(7, 7), slice(7, 7)),
            (slice(None, 3), slice(0, 3)),
        ],
    )
    def test_byte_ranges(self, store: KvStore, rng: slice, expect: slice) -> None:
        data = _value(100)
        g = self._res(store.write("r", data))
        r = self._res(store.read("r", byte_range=rng))
        assert r.state == "value"
        assert bytes(r.value) == data[expect]
        assert r.generation == g

    def test_byte_range_of_missing_key(self, store: KvStore) -> None:
        r = self._res(store.read("none", byte_range=slice(0, 10)))
        assert r.state == "missing" and r.generation.is_no_value

    def test_if_not_equal(self, store: KvStore) -> None:
        g1 = self._res(store.write("c", b"v1"))
        r = self._res(store.read("c", if_not_equal=g1))
        assert r.state == "unchanged"
        assert r.generation == g1
        g2 = self._res(store.write("c", b"value two"))
        r = self._res(store.read("c", if_not_equal=g1))
        assert r.state == "value" and bytes(r.value) == b"value two" and r.generation == g2
        r = self._res(store.read("c", if_not_equal=g2, byte_range=slice(0, 1)))
        assert r.state == "unchanged"
        self._res(store.delete("c"))
        assert self._res(store.read("c", if_not_equal=g2)).state == "missing"

    def test_read_ranges(self, store: KvStore) -> None:
        data = _value(5000)
        g = self._res(store.write("rr", data))
        ranges = [
            slice(0, 10),
            slice(20, 30),
            slice(4000, 4100),
            slice(-7, None),
            slice(4990, 6000),
            slice(100, 100),
        ]
        for gap in (0, 1 << 20):
            res = self._res(store.read_ranges("rr", ranges, coalesce_gap=gap))
            assert res.state == "value"
            assert res.generation == g
            assert [bytes(v) for v in res.values] == [
                data[0:10],
                data[20:30],
                data[4000:4100],
                data[-7:],
                data[4990:],
                b"",
            ]
        missing = self._res(store.read_ranges("none", [slice(0, 4)]))
        assert missing.state == "missing" and missing.values == []

    # -- conditions --------------------------------------------------------------
    def test_create_only(self, store: KvStore) -> None:
        if not self.supports_conditional_writes:
            return self._check_refuses_conditions(store)
        g = self._res(store.write("k", b"first", if_equal=Generation.NO_VALUE))
        err = raises_from(
            ConditionFailedError,
            lambda: store.write("k", b"second", if_equal=Generation.NO_VALUE),
            self.timeout,
        )
        assert "k" in str(err)
        r = self._res(store.read("k"))
        assert bytes(r.value) == b"first" and r.generation == g

    def test_compare_and_swap(self, store: KvStore) -> None:
        if not self.supports_conditional_writes:
            return self._check_refuses_conditions(store)
        g1 = self._res(store.write("k", b"v1"))
        g2 = self._res(store.write("k", b"v2", if_equal=g1))
        assert g2 != g1
        raises_from(ConditionFailedError, lambda: store.write("k", b"stale", if_equal=g1), self.timeout)
        r = self._res(store.read("k"))
        assert bytes(r.value) == b"v2" and r.generation == g2
        g3 = self._res(store.write("k", b"v3", if_equal=g2))
        assert bytes(self._res(store.read("k")).value) == b"v3"
        # a generation of an absent key never matches
        self._res(store.delete("k"))
        raises_from(ConditionFailedError, lambda: store.write("k", b"x", if_equal=g3), self.timeout)
        assert self._res(store.read("k")).state == "missing"

    def test_delete(self, store: KvStore) -> None:
        self._res(store.delete("never"))  # deleting a missing key is fine
        self._res(store.write("d", b"x"))
        self._res(store.delete("d"))
        assert self._res(store.read("d")).state == "missing"
        assert self._res(store.list()) == []

    def test_conditional_delete(self, store: KvStore) -> None:
        if not self.supports_conditional_writes:
            return self._check_refuses_conditions(store)
        g1 = self._res(store.write("d", b"1"))
        g2 = self._res(store.write("d", b"2"))
        raises_from(ConditionFailedError, lambda: store.delete("d", if_equal=g1), self.timeout)
        raises_from(
            ConditionFailedError,
            lambda: store.delete("d", if_equal=Generation.NO_VALUE),
            self.timeout,
        )
        assert bytes(self._res(store.read("d")).value) == b"2"
        self._res(store.delete("d", if_equal=g2))
        assert self._res(store.read("d")).state == "missing"
        # NO_VALUE matches an absent key; a stale generation does not
        self._res(store.delete("d", if_equal=Generation.NO_VALUE))
        raises_from(ConditionFailedError, lambda: store.delete("d", if_equal=g2), self.timeout)

    # -- listing -------------------------------------------------------------------
    def _fill(self, store: KvStore, keys: list[str]) -> None:
        futs = [store.write(k, k.encode()) for k in keys]
        for f in futs:
            self._res(f)

    def test_list(self, store: KvStore) -> None:
        assert self._res(store.list()) == []
        keys = ["b", "a/2", "a/1", "ab", "a/x/y", "c/d/e", "a0"]
        self._fill(store, keys)
        assert self._res(store.list()) == sorted(keys)
        assert self._res(store.list("a/")) == ["a/1", "a/2", "a/x/y"]
        assert self._res(store.list("a")) == ["a/1", "a/2", "a/x/y", "a0", "ab"]
        assert self._res(store.list("a/x/")) == ["a/x/y"]
        assert self._res(store.list("c/d")) == ["c/d/e"]
        assert self._res(store.list("zzz/")) == []

    def test_list_folder(self, store: KvStore) -> None:
        empty = self._res(store.list_folder())
        assert (empty.keys, empty.folders) == ([], [])
        self._fill(store, ["b", "a/2", "a/1", "ab", "a/x/y", "a/x/z/w", "c/d/e", "a0", "a/x0"])
        top = self._res(store.list_folder())
        assert (top.keys, top.folders) == (["a0", "ab", "b"], ["a/", "c/"])
        a = self._res(store.list_folder("a/"))
        assert (a.keys, a.folders) == (["a/1", "a/2", "a/x0"], ["a/x/"])
        ax = self._res(store.list_folder("a/x/"))
        assert (ax.keys, ax.folders) == (["a/x/y"], ["a/x/z/"])
        c = self._res(store.list_folder("c/"))
        assert (c.keys, c.folders) == ([], ["c/d/"])
        none = self._res(store.list_folder("zzz/"))
        assert (none.keys, none.folders) == ([], [])
        sub = self._res(store.with_path("a/").list_folder("x/"))
        assert (sub.keys, sub.folders) == (["x/y"], ["x/z/"])
        raises_from(InvalidArgumentError, lambda: store.list_folder("a"), self.timeout)
        raises_from(InvalidKeyError, lambda: store.list_folder("../"), self.timeout)

    def test_delete_range(self, store: KvStore) -> None:
        keys = ["a/1", "a/2", "a/x/y", "ab", "b", "a0"]
        self._fill(store, keys)
        self._res(store.delete_range("a/"))
        assert self._res(store.list()) == ["a0", "ab", "b"]
        assert self._res(store.read("a/1")).state == "missing"
        self._res(store.delete_range("nothing/"))
        self._res(store.delete_range(""))
        assert self._res(store.list()) == []

    # -- identity ----------------------------------------------------------------
    def test_spec_round_trip(self, store: KvStore) -> None:
        g = self._res(store.write("s/k", b"spec"))
        spec = store.spec()
        assert spec["driver"] == store.driver
        assert "path" in spec
        again = json.loads(json.dumps(spec))
        assert again == spec
        reopened = self._res(KvStore.open(again))
        assert type(reopened) is type(store)
        assert reopened.spec() == spec
        r = self._res(reopened.read("s/k"))
        assert bytes(r.value) == b"spec" and r.generation == g
        assert store.driver in repr(store)
        assert repr(store) == repr(reopened)

    def test_pickles_as_its_spec(self, store: KvStore) -> None:
        self._res(store.write("p/k", b"pickled"))
        again = self._check_pickle(store, "p/k", b"pickled")
        if again is not None:
            self._res(again.write("p/k2", b"from the copy"))
            assert bytes(self._res(store.read("p/k2")).value) == b"from the copy"

    def test_with_path(self, store: KvStore) -> None:
        sub = store.with_path("sub/dir")
        assert sub.path.endswith("sub/dir/")
        g = self._res(sub.write("k", b"in view"))
        r = self._res(store.read("sub/dir/k"))
        assert bytes(r.value) == b"in view" and r.generation == g
        self._res(store.write("outside", b"o"))
        assert self._res(sub.list()) == ["k"]
        assert self._res(store.list()) == ["outside", "sub/dir/k"]
        reopened = self._res(KvStore.open(sub.spec()))
        assert bytes(self._res(reopened.read("k")).value) == b"in view"
        raises_from(InvalidKeyError, lambda: sub.read("../outside"), self.timeout)
        self._res(sub.delete_range(""))
        assert self._res(store.list()) == ["outside"]

    # -- errors --------------------------------------------------------------------
    @pytest.mark.parametrize("key", BAD_KEYS)
    def test_invalid_keys(self, store: KvStore, key: str) -> None:
        raises_from(InvalidKeyError, lambda: store.read(key), self.timeout)
        raises_from(InvalidKeyError, lambda: store.write(key, b"x"), self.timeout)
        raises_from(InvalidKeyError, lambda: store.delete(key), self.timeout)
        raises_from(InvalidKeyError, lambda: store.read_ranges(key, [slice(0, 1)]), self.timeout)
        assert self._res(store.list()) == []

    def test_invalid_prefix(self, store: KvStore) -> None:
        raises_from(InvalidKeyError, lambda: store.list("../"), self.timeout)
        raises_from(InvalidKeyError, lambda: store.delete_range("/abs"), self.timeout)

    # -- async use -----------------------------------------------------------------
    def test_await_from_other_loop(self, store: KvStore) -> None:
        async def main() -> bytes:
            await store.write("aw", b"awaited")
            r = await store.read("aw")
            return bytes(r.value)

        assert asyncio.run(main()) == b"awaited"

    def test_concurrent_distinct_keys(self, store: KvStore) -> None:
        futs = {f"p/{i:03d}": store.write(f"p/{i:03d}", _value(50, i)) for i in range(40)}
        gens = {k: self._res(f) for k, f in futs.items()}
        reads = {k: store.read(k) for k in futs}
        for i, (k, f) in enumerate(reads.items()):
            r = self._res(f)
            assert bytes(r.value) == _value(50, i) and r.generation == gens[k]

    # -- the race ------------------------------------------------------------------
    def test_cas_race_threads(self, store: KvStore) -> None:
        if not self.supports_conditional_writes:
            pytest.skip("the store does not support compare-and-swap")
        self._res(store.write("counter", b"0", if_equal=Generation.NO_VALUE))
        errors: list[BaseException] = []
        lost: list[int] = []

        def worker() -> None:
            try:
                lost.append(cas_increment(store, "counter", self.race_increments, timeout=self.timeout))
            except BaseException as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=worker) for _ in range(self.race_workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        final = int(bytes(self._res(store.read("counter")).value).decode())
        assert final == self.race_workers * self.race_increments
