"""Hypothesis stateful tests: memory and file stores against a dict model.

The model maps key -> (bytes, generation). Every rule runs one store call and
checks its outcome (value, generation, condition failure) against the model.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import ClassVar

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import tensorstore_py as tsp
from tensorstore_py.kvstore.file import FileKvStore
from tensorstore_py.kvstore.memory import MemoryKvStore

# Leaves only: either top-level "p"/"q" or "<dir>/<name>" under a/ or b/, so a
# key is never also a directory on the file store.
KEYS = st.sampled_from(["p", "q", "a/1", "a/2", "a/3", "b/1", "b/x y"])
PREFIXES = st.sampled_from(["", "a", "a/", "b/", "p", "a/1", "zz/"])
VALUES = st.binary(max_size=64)
RANGES = st.one_of(
    st.tuples(st.integers(0, 80), st.integers(0, 80)).map(lambda t: slice(min(t), max(t))),
    st.integers(0, 80).map(lambda a: slice(a, None)),
    st.integers(1, 80).map(lambda n: slice(-n, None)),
)
T = 30.0


class KvModel(RuleBasedStateMachine):
    """Subclasses define ``make_store``."""

    def __init__(self) -> None:
        super().__init__()
        self.store = self.make_store()
        self.model: dict[str, tuple[bytes, tsp.Generation]] = {}
        self.old_gens: dict[str, list[tsp.Generation]] = {}

    def make_store(self) -> tsp.KvStore:
        raise NotImplementedError

    def _gen(self, key: str) -> tsp.Generation:
        entry = self.model.get(key)
        return tsp.Generation.NO_VALUE if entry is None else entry[1]

    def _record(self, key: str, value: bytes, gen: tsp.Generation) -> None:
        assert not gen.is_no_value
        seen = self.old_gens.setdefault(key, [])
        assert gen not in seen, f"generation {gen!r} of {key!r} was reused"
        if key in self.model:
            seen.append(self.model[key][1])
        self.model[key] = (value, gen)

    # -- writes -------------------------------------------------------------------
    @rule(key=KEYS, value=VALUES)
    def overwrite(self, key: str, value: bytes) -> None:
        self._record(key, value, self.store.write(key, value).result(T))

    @rule(key=KEYS, value=VALUES)
    def create_only(self, key: str, value: bytes) -> None:
        fut = lambda: self.store.write(key, value, if_equal=tsp.Generation.NO_VALUE)  # noqa: E731
        if key in self.model:
            with pytest.raises(tsp.ConditionFailedError):
                fut().result(T)
        else:
            self._record(key, value, fut().result(T))

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data(), value=VALUES)
    def cas_current(self, data: st.DataObject, value: bytes) -> None:
        key = data.draw(st.sampled_from(sorted(self.model)))
        gen = self.store.write(key, value, if_equal=self._gen(key)).result(T)
        self._record(key, value, gen)

    @precondition(lambda self: any(self.old_gens.values()))
    @rule(data=st.data(), value=VALUES)
    def cas_stale(self, data: st.DataObject, value: bytes) -> None:
        key = data.draw(st.sampled_from(sorted(k for k, v in self.old_gens.items() if v)))
        stale = data.draw(st.sampled_from(self.old_gens[key]))
        with pytest.raises(tsp.ConditionFailedError):
            self.store.write(key, value, if_equal=stale).result(T)

    @rule(key=KEYS, conditional=st.booleans())
    def delete(self, key: str, conditional: bool) -> None:
        cond = self._gen(key) if conditional else None
        self.store.delete(key, if_equal=cond).result(T)
        entry = self.model.pop(key, None)
        if entry is not None:
            self.old_gens.setdefault(key, []).append(entry[1])

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def delete_stale(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.model)))
        with pytest.raises(tsp.ConditionFailedError):
            self.store.delete(key, if_equal=tsp.Generation.NO_VALUE).result(T)

    @rule(prefix=PREFIXES)
    def delete_range(self, prefix: str) -> None:
        self.store.delete_range(prefix).result(T)
        for k in [k for k in self.model if k.startswith(prefix)]:
            self.old_gens.setdefault(k, []).append(self.model.pop(k)[1])

    # -- reads --------------------------------------------------------------------
    @rule(key=KEYS)
    def read(self, key: str) -> None:
        r = self.store.read(key).result(T)
        if key in self.model:
            value, gen = self.model[key]
            assert r.state == "value" and bytes(r.value) == value and r.generation == gen
        else:
            assert r.state == "missing" and r.generation.is_no_value

    @rule(key=KEYS, rng=RANGES)
    def read_range(self, key: str, rng: slice) -> None:
        r = self.store.read(key, byte_range=rng).result(T)
        if key in self.model:
            value, gen = self.model[key]
            start = rng.start
            expect = value[max(0, len(value) + start) :] if start < 0 else value[rng]
            assert r.state == "value" and bytes(r.value) == expect and r.generation == gen
        else:
            assert r.state == "missing"

    @rule(key=KEYS, data=st.data())
    def read_if_not_equal(self, key: str, data: st.DataObject) -> None:
        candidates = [g for g in self.old_gens.get(key, [])] + [self._gen(key)]
        cond = data.draw(st.sampled_from(candidates))
        r = self.store.read(key, if_not_equal=cond).result(T)
        if key not in self.model:
            assert r.state == "missing"
        elif cond == self._gen(key):
            assert r.state == "unchanged"
        else:
            assert r.state == "value" and bytes(r.value) == self.model[key][0]

    @rule(key=KEYS, ranges=st.lists(RANGES, min_size=1, max_size=4))
    def read_ranges(self, key: str, ranges: list[slice]) -> None:
        res = self.store.read_ranges(key, ranges).result(T)
        if key not in self.model:
            assert res.state == "missing"
            return
        value, gen = self.model[key]
        expect = [
            value[max(0, len(value) + r.start) :] if r.start < 0 else value[r] for r in ranges
        ]
        assert res.state == "value" and res.generation == gen
        assert [bytes(v) for v in res.values] == expect

    @rule(prefix=PREFIXES)
    def list(self, prefix: str) -> None:
        assert self.store.list(prefix).result(T) == sorted(
            k for k in self.model if k.startswith(prefix)
        )

    @invariant()
    def all_keys_listed(self) -> None:
        assert self.store.list().result(T) == sorted(self.model)


class MemoryModel(KvModel):
    def make_store(self) -> tsp.KvStore:
        return MemoryKvStore()


class FileModel(KvModel):
    #: set per test to its tmp_path (see the autouse fixture below)
    scratch: ClassVar[str] = ""

    def make_store(self) -> tsp.KvStore:
        self.tmp = tempfile.mkdtemp(prefix="example-", dir=self.scratch or None)
        assert self.scratch, "expected the autouse fixture to set scratch"
        return FileKvStore(path=self.tmp, sync=False)

    def teardown(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.fixture(autouse=True)
def _scratch_in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FileModel, "scratch", str(tmp_path))


_settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestMemoryModel = _settings(MemoryModel).TestCase
TestFileModel = _settings(FileModel).TestCase
