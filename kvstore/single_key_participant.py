"""The transaction participant of a store without multi-key atomic commits.

Such a store takes part in a transaction with ONE key: the write is staged and
applied at commit as one conditional write (a compare-and-swap against the
generation the transaction read, or the ``if_equal`` it was given). Reads go
straight to the store.
"""

from __future__ import annotations

import time

from tensorstore_py.core.errors import ConditionFailedError, ConflictError, UnsupportedError
from tensorstore_py.kvstore.base import (
    Buffer,
    ByteRange,
    Generation,
    KvStore,
    ReadResult,
    condition_failed,
)
from tensorstore_py.kvstore.participant import CommitInfo, Participant, TransactionHandle

__all__ = ["SingleKeyParticipant"]


class SingleKeyParticipant(Participant):
    """A transaction on a store without multi-key atomic commits: ONE key.

    The write is staged and applied at commit as a conditional write against
    the generation the transaction read (or the ``if_equal`` it was given), so
    a concurrent change raises ConflictError instead of being overwritten.
    """

    def __init__(self, store: KvStore) -> None:
        self.store = store
        self.key = ("single", store.driver, store._identity())
        self.name = f"{store.driver} store {store.spec().get('path', '')!r}"
        self._read_gens: dict[str, Generation] = {}
        self._listed: list[str] = []  # prefixes listed
        self._key: str | None = None
        self._value: bytes | None = None
        self._condition: Generation | None = None

    @property
    def has_writes(self) -> bool:
        return self._key is not None

    async def read(self, key: str, byte_range: ByteRange | None, if_not_equal: Generation | None) -> ReadResult:
        if key == self._key:
            if self._value is None:
                return ReadResult.missing()
            gen = Generation(b"txn-staged")
            if if_not_equal == gen:
                return ReadResult("unchanged", b"", gen)
            v = self._value if byte_range is None else bytes(byte_range.apply(self._value))
            return ReadResult("value", v, gen)
        res = await self.store._read(key, byte_range, if_not_equal)
        self._read_gens.setdefault(key, res.generation)
        return res

    async def write(self, key: str, value: Buffer | None, if_equal: Generation | None) -> Generation | None:
        if self._key is not None and key != self._key:
            raise UnsupportedError(
                f"write of {self._rel(key)!r}: a transaction on {self.name} (driver "
                f"{self.store.driver!r}) can write only one key atomically and already writes "
                f"{self._rel(self._key)!r}; use a versioned store for multi-key transactions"
            )
        if self._key is None:
            if if_equal is not None and key in self._read_gens and self._read_gens[key] != if_equal:
                raise condition_failed(self.store, self._rel(key), if_equal, self._read_gens[key])
            self._key = key
            self._condition = self._read_gens.get(key, if_equal)
        elif if_equal is not None and if_equal != Generation(b"txn-staged"):
            raise ConditionFailedError(
                f"write of {self._rel(key)!r} in a transaction: generation {if_equal!r} is stale"
            )
        self._value = None if value is None else bytes(value)
        return None if value is None else Generation(b"txn-staged")

    def _rel(self, key: str) -> str:
        return key.removeprefix(self.store.path)

    async def list(self, prefix: str) -> list[str]:
        self._listed.append(prefix)
        keys = set(await self.store._list(prefix))
        if self._key is not None and self._key.startswith(prefix):
            if self._value is None:
                keys.discard(self._key)
            else:
                keys.add(self._key)
        return sorted(keys)

    async def commit(self, txn: TransactionHandle, *, wait: bool) -> CommitInfo:
        assert self._key is not None
        key, cond = self._key, self._condition
        others = sorted(self._rel(k) for k in self._read_gens if k != key)
        if txn.isolation == "serializable" and (others or self._listed):
            what = f"key(s) {others[:5]}" if others else f"prefix(es) {self._listed[:5]}"
            raise UnsupportedError(
                f"serializable transaction on {self.name}: it writes {self._rel(key)!r} after "
                f"reading {what}; a {self.store.driver!r} store can only check the written key "
                f"atomically with the write. Use a versioned store, or isolation='snapshot'"
            )
        try:
            if self._value is None:
                await self.store._delete(key, cond)
            else:
                await self.store._write(key, self._value, cond)
        except ConditionFailedError as e:
            raise ConflictError(
                f"transaction on {self.name}: key {self._rel(key)!r} changed since the transaction "
                f"read it ({e})",
                key=self._rel(key),
            ) from e
        return CommitInfo(version=None, write_id=txn.write_id, time=time.time(), txn_id=txn.txn_id, keys_changed=1)

    def abort(self) -> None:
        self._key = self._value = None

