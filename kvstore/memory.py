"""In-memory store: per instance, optionally shared by name within a process.

Durability: none (the data lives as long as some store object refers to it).
Atomicity: every operation runs on the library's loop thread, so each one is
atomic and conditions are exact.
"""

from __future__ import annotations

import itertools
import time
import weakref
from collections.abc import Mapping
from typing import Any

from tensorstore_py.core.errors import InvalidSpecError
from tensorstore_py.kvstore.base import (
    Buffer,
    ByteRange,
    Generation,
    KeyInfo,
    KvStore,
    ReadResult,
    condition_failed,
    not_picklable,
)
from tensorstore_py.kvstore.registry import register_kvstore

__all__ = ["MemoryKvStore"]

_counter = itertools.count(1)
_names = itertools.count(1)


class _Data:
    """The shared state of one memory store (all views and reopened specs)."""

    __slots__ = ("values", "mtimes", "__weakref__")

    def __init__(self) -> None:
        self.values: dict[str, tuple[bytes, Generation]] = {}
        self.mtimes: dict[str, float] = {}  # key -> time of its last write (list_info)


# Named stores stay reachable by spec while any store object refers to them.
_by_name: weakref.WeakValueDictionary[str, _Data] = weakref.WeakValueDictionary()


class MemoryKvStore(KvStore):
    """A dict of bytes. ``MemoryKvStore()`` is a fresh, empty store.

    Its spec carries a process-unique ``name``; reopening that spec while the
    store is alive gives the same data (so ``open(store.spec())`` round-trips).

    Pickling: a store opened with a ``name`` pickles as its spec and reopens, in
    the receiving process, *that process's* store of that name (data is never
    copied between processes). A store without a given name refuses to pickle
    (UnsupportedError): its generated name means nothing elsewhere. A store made
    by :meth:`frozen` is read-only for good and pickles with its contents.
    """

    driver = "memory"
    single_clock = True  # modification times: this process's clock

    def __init__(self, *, path: str = "", name: str | None = None) -> None:
        super().__init__(path=path)
        self._named = name is not None
        if name is None:
            name = f"memory-{next(_names)}"
            while name in _by_name:
                name = f"memory-{next(_names)}"
        data = _by_name.get(name)
        if data is None:
            data = _Data()
            _by_name[name] = data
        self._data = data
        self.name = name
        self._frozen = False

    @classmethod
    def frozen(cls, items: Mapping[str, Buffer], *, path: str = "") -> MemoryKvStore:
        """A read-only store of ``items`` (key -> bytes), fixed for good: it pickles
        by value (its contents travel with it, so keep them small), and the
        receiving process gets a frozen store of the same keys and bytes."""
        store = cls(path=path)
        for key, value in items.items():
            store._data.values[key] = (bytes(value), Generation(next(_counter).to_bytes(8, "big")))
            store._data.mtimes[key] = time.time()
        store.read_only = True
        store._frozen = True
        return store

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> MemoryKvStore:
        unknown = set(spec) - {"driver", "path", "name"}
        if unknown:
            raise InvalidSpecError(f"memory kvstore spec: unknown fields {sorted(unknown)}")
        return cls(path=spec.get("path", ""), name=spec.get("name"))

    @classmethod
    def spec_from_url(cls, url: str) -> dict[str, Any]:
        rest = url[len("memory://"):]
        return {"driver": "memory", "path": rest}

    def _spec_fields(self) -> dict[str, Any]:
        return {"name": self.name}

    def url(self) -> str:
        return f"memory://{self.path}"

    def _identity(self) -> Any:
        return (self.name, self.path)

    def __reduce__(self) -> tuple[Any, ...]:
        if self._frozen:
            items = {key: value for key, (value, _gen) in self._data.values.items()}
            return (_unpickle_frozen, (items, self.path))
        if not self._named:
            raise not_picklable(
                self, "a memory store without a name lives in this process only; open it with "
                "{'driver': 'memory', 'name': ...} to reopen that name in the receiving process, "
                "or use a file:// or object store"
            )
        return super().__reduce__()

    async def _read(
        self, key: str, byte_range: ByteRange | None, if_not_equal: Generation | None
    ) -> ReadResult:
        entry = self._data.values.get(key)
        if entry is None:
            return ReadResult.missing()
        value, gen = entry
        if if_not_equal is not None and if_not_equal == gen:
            return ReadResult("unchanged", b"", gen)
        if byte_range is not None:
            value = bytes(byte_range.apply(value))
        return ReadResult("value", value, gen)

    def _current(self, key: str) -> Generation:
        entry = self._data.values.get(key)
        return Generation.NO_VALUE if entry is None else entry[1]

    async def _write(self, key: str, value: Buffer, if_equal: Generation | None) -> Generation:
        if if_equal is not None and self._current(key) != if_equal:
            raise condition_failed(self, key, if_equal, self._current(key))
        gen = Generation(next(_counter).to_bytes(8, "big"))
        self._data.values[key] = (bytes(value), gen)
        self._data.mtimes[key] = time.time()
        return gen

    async def _delete(self, key: str, if_equal: Generation | None) -> None:
        if if_equal is not None and self._current(key) != if_equal:
            raise condition_failed(self, key, if_equal, self._current(key))
        self._data.values.pop(key, None)
        self._data.mtimes.pop(key, None)

    async def _list(self, prefix: str) -> list[str]:
        return [k for k in self._data.values if k.startswith(prefix)]

    async def _list_info(self, prefix: str) -> list[KeyInfo]:
        d = self._data
        return [KeyInfo(k, len(v[0]), d.mtimes.get(k)) for k, v in d.values.items() if k.startswith(prefix)]

    async def _delete_range(self, prefix: str) -> None:
        for k in [k for k in self._data.values if k.startswith(prefix)]:
            del self._data.values[k]
            self._data.mtimes.pop(k, None)


register_kvstore(MemoryKvStore, schemes=("memory",))


def _unpickle_frozen(items: dict[str, bytes], path: str) -> MemoryKvStore:
    return MemoryKvStore.frozen(items, path=path)
