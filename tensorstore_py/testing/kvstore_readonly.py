"""The conformance suite for read-only kvstores (e.g. HTTP); see
:mod:`tensorstore_py.testing.kvstore` for how to use it."""

from __future__ import annotations

import json
from typing import ClassVar

import pytest

from tensorstore_py.core.errors import InvalidKeyError, ReadOnlyError, UnsupportedError
from tensorstore_py.kvstore.base import Generation, KvStore
from tensorstore_py.testing.kvstore_common import BAD_KEYS, Conformance, raises_from

__all__ = ["ReadOnlyKvStoreConformance"]


class ReadOnlyKvStoreConformance(Conformance):
    """Tests for read-only stores. Subclasses provide fixtures ``populated_store``
    (a read-only store holding exactly ``expected_values``) and
    ``expected_values`` (``dict[str, bytes]``; at least one value of >= 16 bytes,
    and at least one key containing '/')."""

    #: False for stores that can not list (they must raise UnsupportedError)
    supports_list: ClassVar[bool] = True

    def _longest(self, expected_values: dict[str, bytes]) -> tuple[str, bytes]:
        key = max(expected_values, key=lambda k: len(expected_values[k]))
        return key, expected_values[key]

    def test_read_all(self, populated_store: KvStore, expected_values: dict[str, bytes]) -> None:
        futs = {k: populated_store.read(k) for k in expected_values}
        for k, f in futs.items():
            r = self._res(f)
            assert r.state == "value", k
            assert bytes(r.value) == expected_values[k], k
            assert not r.generation.is_no_value

    def test_list_folder(self, populated_store: KvStore, expected_values: dict[str, bytes]) -> None:
        if not self.supports_list:
            raises_from(UnsupportedError, lambda: populated_store.list_folder(), self.timeout)
            return
        top = self._res(populated_store.list_folder())
        assert top.keys == sorted(k for k in expected_values if "/" not in k)
        assert top.folders == sorted({k.split("/")[0] + "/" for k in expected_values if "/" in k})

    def test_read_missing(self, populated_store: KvStore) -> None:
        r = self._res(populated_store.read("no/such/key"))
        assert r.state == "missing" and r.generation.is_no_value and bytes(r.value) == b""

    def test_byte_ranges(self, populated_store: KvStore, expected_values: dict[str, bytes]) -> None:
        key, data = self._longest(expected_values)
        n = len(data)
        cases = [
            slice(2, 10),
            slice(5, None),
            slice(-4, None),
            slice(n - 3, n + 50),
            slice(n, n + 5),
            slice(n + 10, None),
            slice(-(n + 10), None),
            slice(0, 1),
        ]
        for rng in cases:
            r = self._res(populated_store.read(key, byte_range=rng))
            start = rng.start
            expect = data[max(0, n + start) :] if start < 0 else data[start : rng.stop]
            assert r.state == "value", rng
            assert bytes(r.value) == expect, rng

    def test_if_not_equal(self, populated_store: KvStore, expected_values: dict[str, bytes]) -> None:
        key, data = self._longest(expected_values)
        g = self._res(populated_store.read(key)).generation
        r = self._res(populated_store.read(key, if_not_equal=g))
        assert r.state == "unchanged" and r.generation == g
        other = Generation(b"not-a-real-generation")
        r = self._res(populated_store.read(key, if_not_equal=other))
        assert r.state == "value" and bytes(r.value) == data

    def test_read_ranges(self, populated_store: KvStore, expected_values: dict[str, bytes]) -> None:
        key, data = self._longest(expected_values)
        ranges = [slice(0, 3), slice(5, 9), slice(-2, None)]
        res = self._res(populated_store.read_ranges(key, ranges))
        assert res.state == "value"
        assert [bytes(v) for v in res.values] == [data[0:3], data[5:9], data[-2:]]

    def test_writes_refused(self, populated_store: KvStore, expected_values: dict[str, bytes]) -> None:
        key = next(iter(expected_values))
        t = self.timeout
        raises_from(ReadOnlyError, lambda: populated_store.write(key, b"x"), t)
        raises_from(ReadOnlyError, lambda: populated_store.write("new", b"x"), t)
        raises_from(
            ReadOnlyError,
            lambda: populated_store.write("new", b"x", if_equal=Generation.NO_VALUE),
            t,
        )
        raises_from(ReadOnlyError, lambda: populated_store.delete(key), t)
        raises_from(ReadOnlyError, lambda: populated_store.delete_range(""), t)
        assert bytes(self._res(populated_store.read(key)).value) == expected_values[key]

    def test_list(self, populated_store: KvStore, expected_values: dict[str, bytes]) -> None:
        if self.supports_list:
            assert self._res(populated_store.list()) == sorted(expected_values)
        else:
            raises_from(UnsupportedError, lambda: populated_store.list(), self.timeout)

    @pytest.mark.parametrize("key", BAD_KEYS)
    def test_invalid_keys(self, populated_store: KvStore, key: str) -> None:
        raises_from(InvalidKeyError, lambda: populated_store.read(key), self.timeout)

    def test_spec_round_trip(self, populated_store: KvStore, expected_values: dict[str, bytes]) -> None:
        spec = json.loads(json.dumps(populated_store.spec()))
        assert spec == populated_store.spec()
        assert spec["driver"] == populated_store.driver
        reopened = self._res(KvStore.open(spec))
        assert reopened.spec() == spec
        assert repr(reopened) == repr(populated_store)
        key, data = self._longest(expected_values)
        assert bytes(self._res(reopened.read(key)).value) == data

    def test_pickles_as_its_spec(self, populated_store: KvStore, expected_values: dict[str, bytes]) -> None:
        key, data = self._longest(expected_values)
        self._check_pickle(populated_store, key, data)

    def test_with_path(self, populated_store: KvStore, expected_values: dict[str, bytes]) -> None:
        key = next(k for k in sorted(expected_values) if "/" in k)
        head, rest = key.split("/", 1)
        view = populated_store.with_path(head)
        assert bytes(self._res(view.read(rest)).value) == expected_values[key]
        raises_from(InvalidKeyError, lambda: view.read("../" + key), self.timeout)
