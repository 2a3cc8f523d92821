"""Hypothesis stateful test: the versioned store against a dict-of-versions model.

Random interleavings of up to three open transactions (reads, writes, deletes,
read-your-writes, commits that must succeed, rebase or raise ConflictError,
aborts), plain writes outside transactions, and snapshot reads of old versions.
The model: ``versions[v]`` is the full key -> value map of version ``v`` and
``changed[v]`` the keys its commit wrote or deleted; a transaction pinned at
``b`` conflicts iff one of its keys is in ``changed[b+1..newest]``.
"""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import tensorstore_py as tsp
from tensorstore_py.errors import ConflictError
from tensorstore_py.kvstore.memory import MemoryKvStore
from tensorstore_py.kvstore.versioned import VersionedKvStore
from tensorstore_py.kvstore.versioned.verify import verify

T = 30
KEYS = st.sampled_from(["a", "b", "c", "d/e", "d/f"])
# inline (<= 128 bytes), packed, and one size near the large-value threshold's scale
VALUES = st.builds(
    lambda n, b: bytes([b]) * n, st.sampled_from([0, 1, 100, 129, 5000]), st.integers(0, 255)
)

def _open(self: Any) -> bool:
    return any(t is not None for t in self.txns)


class _Txn:
    def __init__(self, kv: VersionedKvStore, base: int) -> None:
        self.txn = tsp.Transaction()
        self.view = kv.with_transaction(self.txn)
        self.base = base
        self.staged: dict[str, bytes | None] = {}


class VersionedMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.base = MemoryKvStore()
        self.kv = VersionedKvStore(self.base)
        self.versions: list[dict[str, bytes]] = [{}]
        self.changed: list[set[str]] = [set()]
        self.txns: list[_Txn | None] = [None, None, None]

    @property
    def newest(self) -> int:
        return len(self.versions) - 1

    def _commit_model(self, changes: dict[str, bytes | None]) -> int:
        new = dict(self.versions[-1])
        for k, v in changes.items():
            if v is None:
                new.pop(k, None)
            else:
                new[k] = v
        self.versions.append(new)
        self.changed.append(set(changes))
        return self.newest

    # -- transactions --------------------------------------------------------------
    def _pick(self, data: Any) -> int:
        return data.draw(st.sampled_from([i for i, t in enumerate(self.txns) if t is not None]))

    @precondition(lambda self: None in self.txns)
    @rule(key=KEYS)
    def begin(self, key: str) -> None:
        slot = self.txns.index(None)
        t = _Txn(self.kv, self.newest)
        # the first read pins the transaction to the newest version
        res = t.view.read(key).result(T)
        expect = self.versions[t.base].get(key)
        assert (bytes(res.value) if res.state == "value" else None) == expect
        self.txns[slot] = t

    @precondition(_open)
    @rule(data=st.data(), key=KEYS, value=VALUES)
    def txn_write(self, data: Any, key: str, value: bytes) -> None:
        slot = self._pick(data)
        t = self.txns[slot]
        assert t is not None
        t.view.write(key, value).result(T)
        t.staged[key] = value

    @precondition(_open)
    @rule(data=st.data(), key=KEYS)
    def txn_delete(self, data: Any, key: str) -> None:
        slot = self._pick(data)
        t = self.txns[slot]
        assert t is not None
        t.view.delete(key).result(T)
        t.staged[key] = None

    @precondition(_open)
    @rule(data=st.data(), key=KEYS)
    def txn_read(self, data: Any, key: str) -> None:
        slot = self._pick(data)
        t = self.txns[slot]
        assert t is not None
        res = t.view.read(key).result(T)
        expect = t.staged[key] if key in t.staged else self.versions[t.base].get(key)
        assert (bytes(res.value) if res.state == "value" else None) == expect, (key, t.base)

    @precondition(_open)
    @rule(data=st.data())
    def txn_list(self, data: Any) -> None:
        slot = self._pick(data)
        t = self.txns[slot]
        assert t is not None
        view = dict(self.versions[t.base])
        for k, v in t.staged.items():
            if v is None:
                view.pop(k, None)
            else:
                view[k] = v
        assert t.view.list().result(T) == sorted(view)

    @precondition(_open)
    @rule(data=st.data())
    def commit(self, data: Any) -> None:
        slot = self._pick(data)
        t = self.txns[slot]
        assert t is not None
        self.txns[slot] = None
        since = set().union(*self.changed[t.base + 1:]) if t.base < self.newest else set()
        clash = sorted(since & set(t.staged))
        try:
            info = t.txn.commit().result(T)
        except ConflictError as e:
            assert clash, f"false conflict: {e}"
            assert any(repr(k) in str(e) for k in clash), str(e)
            event("commit: conflict")
            return
        assert not clash, f"missed conflict on {clash}"
        if t.staged:
            event("commit: rebased" if t.base < self.newest else "commit: on the newest")
            assert info.version == self._commit_model(t.staged)

    @precondition(_open)
    @rule(data=st.data())
    def abort(self, data: Any) -> None:
        slot = self._pick(data)
        t = self.txns[slot]
        assert t is not None
        self.txns[slot] = None
        t.txn.abort()

    # -- outside transactions ----------------------------------------------------------
    @rule(key=KEYS, value=VALUES)
    def plain_write(self, key: str, value: bytes) -> None:
        self.kv.write(key, value).result(T)
        self._commit_model({key: value})

    @rule(key=KEYS)
    def plain_delete(self, key: str) -> None:
        self.kv.delete(key).result(T)
        self._commit_model({key: None})

    @precondition(lambda self: self.newest > 0)
    @rule(data=st.data(), key=KEYS)
    def snapshot_read(self, data: Any, key: str) -> None:
        v = data.draw(st.integers(1, self.newest))
        snap = self.kv.snapshot(v)
        res = snap.read(key).result(T)
        assert (bytes(res.value) if res.state == "value" else None) == self.versions[v].get(key)
        assert snap.list().result(T) == sorted(self.versions[v])

    @invariant()
    def newest_matches(self) -> None:
        assert self.kv.newest_version().result(T) == self.newest

    def teardown(self) -> None:
        for t in self.txns:
            if t is not None:
                t.txn.abort()
        assert verify(self.kv).result(T) == []


VersionedMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestVersionedStateful = VersionedMachine.TestCase
