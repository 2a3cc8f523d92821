"""Fault injection: a wrapper store that fails, delays and tears calls on purpose.

For our own crash/fault tests and for users testing their pipelines::

    kv = FaultKvStore(base, seed=7, error_rate=0.1, latency=(0.0, 0.01), short_read_rate=0.05)
    kv.inject(op="write", key_pattern="commits/*", after_effect=True)  # lost response
    kv.inject(op="read", nth=3)                                         # 3rd read fails
    kv.calls["write"], kv.faults["write"], kv.events                    # what happened

Two mechanisms, both reproducible:

* Random faults on a *seeded* schedule: whether call number ``n`` of operation
  ``op`` on key ``k`` fails (``error_rate``), is delayed (``latency``) or returns a
  truncated value (``short_read_rate``, reads only) is a pure function of
  ``(seed, op, k, n)`` — independent of how concurrent calls interleave.
* Programmed faults (:class:`FaultRule`, via ``inject`` or ``schedule=``): fail
  the ``nth`` matching call (and the ``times - 1`` after it), or every call whose
  key matches ``key_pattern`` (fnmatch; ``*`` also matches ``/``). With
  ``after_effect=True`` the operation is performed on the base store first and
  the error raised afterwards: the "write landed but the response was lost" case.
  With ``exit_code`` set, the process ends (``os._exit``) right after the
  operation took effect: a crash at exactly that point (e.g. a worker that dies
  once its commit record landed).

Random errors raise :class:`~tensorstore_py.errors.StorageError` before the call
reaches the base store. Spec: ``{"driver": "fault", "base": {...}, "seed": 0,
...}`` with rules as dicts; errors in specs are named by class name from
:mod:`tensorstore_py.errors`. A pickled fault store reopens with the same
settings and rules over its (pickled) base store; counters start afresh in the
receiving process.
"""

from __future__ import annotations

import asyncio
import fnmatch
import os
import random
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from tensorstore_py.core import errors as _errors
from tensorstore_py.core.errors import InvalidSpecError, StorageError
from tensorstore_py.kvstore.base import (
    Buffer,
    ByteRange,
    Generation,
    KvStore,
    ReadResult,
    rebuild,
)
from tensorstore_py.kvstore.registry import register_kvstore, spec_from_url

__all__ = ["FaultEvent", "FaultKvStore", "FaultRule", "OPS"]

Op = Literal["read", "write", "delete", "list", "delete_range"]
OPS: tuple[Op, ...] = ("read", "write", "delete", "list", "delete_range")


@dataclass(frozen=True)
class FaultRule:
    """A programmed fault.

    Matches calls of ``op`` (None = any) whose key (the prefix for list and
    delete_range) matches ``key_pattern`` (None = any). With ``nth`` set, the
    ``nth`` matching call (1-based) and the ``times - 1`` following ones fire;
    without it the first ``times`` matching calls fire (``times=None``: all).
    A firing call waits ``latency`` seconds, then raises ``error`` (an exception
    class, or None for latency only) — after performing the operation when
    ``after_effect`` is True. A rule with ``exit_code`` instead performs the
    operation and then ends the process at once with ``os._exit(exit_code)``
    (no cleanup, no exit handlers: a crash).
    """

    op: Op | None = None
    key_pattern: str | None = None
    nth: int | None = None
    times: int | None = None
    error: type[BaseException] | None = StorageError
    after_effect: bool = False
    latency: float = 0.0
    exit_code: int | None = None

    def __post_init__(self) -> None:
        if self.op is not None and self.op not in OPS:
            raise InvalidSpecError(f"fault rule: op must be one of {OPS} or None, got {self.op!r}")
        if self.nth is not None and (not isinstance(self.nth, int) or self.nth < 1):
            raise InvalidSpecError(f"fault rule: nth must be an int >= 1, got {self.nth!r}")
        if self.times is not None and (not isinstance(self.times, int) or self.times < 1):
            raise InvalidSpecError(f"fault rule: times must be an int >= 1, got {self.times!r}")
        if self.error is not None and not (
            isinstance(self.error, type) and issubclass(self.error, BaseException)
        ):
            raise InvalidSpecError(
                f"fault rule: error must be an exception class, got {self.error!r}"
            )
        if self.latency < 0:
            raise InvalidSpecError(f"fault rule: latency must be >= 0, got {self.latency!r}")
        if self.exit_code is not None and (
            not isinstance(self.exit_code, int) or isinstance(self.exit_code, bool)
            or not 0 <= self.exit_code <= 255
        ):
            raise InvalidSpecError(f"fault rule: exit_code must be an int in [0, 255], got {self.exit_code!r}")

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {}
        for k in ("op", "key_pattern", "nth", "times"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        d["error"] = None if self.error is None else self.error.__name__
        if self.after_effect:
            d["after_effect"] = True
        if self.latency:
            d["latency"] = self.latency
        if self.exit_code is not None:
            d["exit_code"] = self.exit_code
        return d

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> FaultRule:
        if not isinstance(d, Mapping):
            raise InvalidSpecError(f"fault rule must be a dict, got {d!r}")
        unknown = set(d) - {"op", "key_pattern", "nth", "times", "error", "after_effect", "latency",
                         "exit_code"}
        if unknown:
            raise InvalidSpecError(f"fault rule: unknown fields {sorted(unknown)}")
        err: Any = d.get("error", "StorageError")
        if err is not None:
            cls = getattr(_errors, err, None) if isinstance(err, str) else None
            if not (isinstance(cls, type) and issubclass(cls, BaseException)):
                raise InvalidSpecError(
                    f"fault rule: error {err!r} is not an error class of tensorstore_py.errors"
                )
            err = cls
        return FaultRule(
            op=d.get("op"),
            key_pattern=d.get("key_pattern"),
            nth=d.get("nth"),
            times=d.get("times"),
            error=err,
            after_effect=bool(d.get("after_effect", False)),
            latency=float(d.get("latency", 0.0)),
            exit_code=d.get("exit_code"),
        )


@dataclass(frozen=True)
class FaultEvent:
    """One injected fault: the call (``n`` = its number among calls of ``op`` on ``key``,
    1-based) and what was done to it."""

    op: str
    key: str
    n: int
    kind: Literal["error", "error_after_effect", "latency", "short_read"]
    detail: str = ""


@dataclass
class _State:
    """Shared by a store and its with_path views."""

    rules: list[FaultRule] = field(default_factory=list)
    matched: Counter[int] = field(default_factory=Counter)  # rule index -> matching calls
    calls: Counter[str] = field(default_factory=Counter)
    per_key: Counter[tuple[str, str]] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)
    events: list[FaultEvent] = field(default_factory=list)


class FaultKvStore(KvStore):
    """Wraps ``base``; keys pass through unchanged (plus this view's ``path``)."""

    driver = "fault"

    def __init__(
        self,
        base: KvStore,
        *,
        seed: int = 0,
        error_rate: float = 0.0,
        latency: float | tuple[float, float] = 0.0,
        short_read_rate: float = 0.0,
        fail_ops: Iterable[Op] = OPS,
        schedule: Sequence[FaultRule | Mapping[str, Any]] = (),
        path: str = "",
    ) -> None:
        if not isinstance(base, KvStore):
            raise InvalidSpecError(f"fault kvstore: base must be a KvStore, got {base!r}")
        for name, rate in (("error_rate", error_rate), ("short_read_rate", short_read_rate)):
            if not 0.0 <= rate <= 1.0:
                raise InvalidSpecError(f"fault kvstore: {name} must be in [0, 1], got {rate!r}")
        lat = (
            (float(latency), float(latency))
            if isinstance(latency, (int, float))
            else tuple(latency)
        )
        if len(lat) != 2 or not 0 <= lat[0] <= lat[1]:
            raise InvalidSpecError(f"fault kvstore: latency must be s or (lo, hi), got {latency!r}")
        ops = tuple(fail_ops)
        bad = [o for o in ops if o not in OPS]
        if bad:
            raise InvalidSpecError(f"fault kvstore: unknown ops {bad} in fail_ops; known: {OPS}")
        super().__init__(path=path)
        self.base = base
        self.read_only = base.read_only
        self.seed = int(seed)
        self.error_rate = float(error_rate)
        self.latency: tuple[float, float] = (float(lat[0]), float(lat[1]))
        self.short_read_rate = float(short_read_rate)
        self.fail_ops = ops
        self._state = _State()
        for r in schedule:
            self._state.rules.append(r if isinstance(r, FaultRule) else FaultRule.from_json(r))

    # -- programming and counters -------------------------------------------------------
    def inject(
        self,
        *,
        op: Op | None = None,
        key_pattern: str | None = None,
        nth: int | None = None,
        times: int | None = None,
        error: type[BaseException] | None = StorageError,
        after_effect: bool = False,
        latency: float = 0.0,
        exit_code: int | None = None,
    ) -> FaultRule:
        """Add a programmed fault (see :class:`FaultRule`) and return it."""
        rule = FaultRule(
            op=op,
            key_pattern=key_pattern,
            nth=nth,
            times=times,
            error=error,
            after_effect=after_effect,
            latency=latency,
            exit_code=exit_code,
        )
        self._state.rules.append(rule)
        return rule

    def clear(self) -> None:
        """Remove every programmed fault (counters are kept)."""
        self._state.rules.clear()
        self._state.matched.clear()

    def reset_counters(self) -> None:
        s = self._state
        s.calls.clear()
        s.per_key.clear()
        s.faults.clear()
        s.events.clear()

    @property
    def calls(self) -> Counter[str]:
        """Calls per operation seen by this store (and its views)."""
        return self._state.calls

    @property
    def faults(self) -> Counter[str]:
        """Injected faults per operation."""
        return self._state.faults

    def keys_called(self, op: Op) -> set[str]:
        """The keys (prefixes for list) that calls of ``op`` named since the last reset."""
        return {key for (o, key) in self._state.per_key if o == op}

    @property
    def events(self) -> list[FaultEvent]:
        """Every injected fault, in order."""
        return self._state.events

    # -- spec ---------------------------------------------------------------------------
    @classmethod
    async def from_spec(cls, spec: dict[str, Any]) -> FaultKvStore:
        allowed = {
            "driver",
            "base",
            "path",
            "seed",
            "error_rate",
            "latency",
            "short_read_rate",
            "fail_ops",
            "schedule",
        }
        unknown = set(spec) - allowed
        if unknown:
            raise InvalidSpecError(f"fault kvstore spec: unknown fields {sorted(unknown)}")
        if "base" not in spec:
            raise InvalidSpecError(
                "fault kvstore spec: 'base' (the wrapped store's spec) is required"
            )
        base = await KvStore.open(spec["base"])
        lat = spec.get("latency", 0.0)
        return cls(
            base,
            seed=spec.get("seed", 0),
            error_rate=spec.get("error_rate", 0.0),
            latency=tuple(lat) if isinstance(lat, list) else lat,
            short_read_rate=spec.get("short_read_rate", 0.0),
            fail_ops=spec.get("fail_ops", OPS),
            schedule=spec.get("schedule", ()),
            path=spec.get("path", ""),
        )

    @classmethod
    def spec_from_url(cls, url: str) -> dict[str, Any]:
        """``fault+<base URL>``: the base store with no faults configured."""
        return {"driver": "fault", "base": spec_from_url(url.split("+", 1)[1]), "path": ""}

    def _spec_fields(self) -> dict[str, Any]:
        lo, hi = self.latency
        return {
            "base": self.base.spec(),
            "seed": self.seed,
            "error_rate": self.error_rate,
            "latency": lo if lo == hi else [lo, hi],
            "short_read_rate": self.short_read_rate,
            "fail_ops": list(self.fail_ops),
            "schedule": [r.to_json() for r in self._state.rules],
        }

    def _identity(self) -> Any:
        return (id(self._state), self.path)

    def __reduce__(self) -> tuple[Any, ...]:
        # the base travels as an object (its own pickling rules apply); no I/O to reopen
        opts = {k: v for k, v in self._spec_fields().items() if k != "base"}
        opts["latency"] = self.latency
        return (rebuild, (FaultKvStore, (self.base,), {**opts, "path": self.path}))

    # -- the fault machinery ---------------------------------------------------------------
    async def _before(self, op: Op, key: str) -> tuple[FaultRule | None, random.Random, int]:
        """Count the call, apply latency, raise a before-effect fault; return the
        after-effect rule (if any), the call's seeded rng, and its call number."""
        s = self._state
        s.calls[op] += 1
        s.per_key[(op, key)] += 1
        n = s.per_key[(op, key)]
        rng = random.Random(f"{self.seed}/{op}/{key}/{n}")  # str seeds are stable across runs
        fired: FaultRule | None = None
        for i, rule in enumerate(s.rules):
            if rule.op is not None and rule.op != op:
                continue
            if rule.key_pattern is not None and not fnmatch.fnmatchcase(key, rule.key_pattern):
                continue
            s.matched[i] += 1
            m = s.matched[i]
            if rule.nth is None:
                hit = rule.times is None or m <= rule.times
            else:
                hit = rule.nth <= m < rule.nth + (rule.times or 1)
            if hit and fired is None:  # every matching rule counts the call; the first fires
                fired = rule
        delay = rng.uniform(*self.latency) if self.latency[1] > 0 else 0.0
        if fired is not None and fired.latency:
            delay += fired.latency
            if fired.error is None:
                self._event(op, key, n, "latency", f"{fired.latency} s")
        if delay:
            await asyncio.sleep(delay)
        if fired is not None and fired.exit_code is not None:
            return fired, rng, n  # the operation happens, then the process ends
        if fired is not None and fired.error is not None and not fired.after_effect:
            self._event(op, key, n, "error", fired.error.__name__)
            raise self._error(fired.error, op, key, n)
        if op in self.fail_ops and self.error_rate and rng.random() < self.error_rate:
            self._event(op, key, n, "error", "random StorageError")
            raise self._error(StorageError, op, key, n)
        after = fired if fired is not None and fired.error is not None else None
        return after, rng, n

    def _after(self, rule: FaultRule | None, op: str, key: str, n: int) -> None:
        if rule is not None and rule.exit_code is not None:
            os._exit(rule.exit_code)  # a crash right after the effect: nothing runs after it
        if rule is not None and rule.error is not None:
            self._event(op, key, n, "error_after_effect", rule.error.__name__)
            raise self._error(rule.error, op, key, n, after=True)

    def _event(self, op: str, key: str, n: int, kind: Any, detail: str) -> None:
        self._state.faults[op] += 1
        self._state.events.append(FaultEvent(op, key, n, kind, detail))

    def _error(
        self, cls: type[BaseException], op: str, key: str, n: int, after: bool = False
    ) -> BaseException:
        when = "after it took effect" if after else "before it reached the store"
        return cls(
            f"injected fault: {op} #{n} of key {key!r} failed {when} (fault store over "
            f"{self.base.driver})"
        )

    # -- backend hooks ------------------------------------------------------------------------
    async def _read(
        self, key: str, byte_range: ByteRange | None, if_not_equal: Generation | None
    ) -> ReadResult:
        after, rng, n = await self._before("read", key)
        res = await self.base.read(key, byte_range=byte_range, if_not_equal=if_not_equal)
        self._after(after, "read", key, n)
        if (
            self.short_read_rate
            and res.state == "value"
            and len(res.value) > 0
            and rng.random() < self.short_read_rate
        ):
            cut = rng.randrange(len(res.value))
            self._event("read", key, n, "short_read", f"{cut} of {len(res.value)} bytes")
            return ReadResult("value", res.value[:cut], res.generation)
        return res

    async def _write(self, key: str, value: Buffer, if_equal: Generation | None) -> Generation:
        after, _rng, n = await self._before("write", key)
        gen = await self.base.write(key, value, if_equal=if_equal)
        self._after(after, "write", key, n)
        return gen

    async def _delete(self, key: str, if_equal: Generation | None) -> None:
        after, _rng, n = await self._before("delete", key)
        await self.base.delete(key, if_equal=if_equal)
        self._after(after, "delete", key, n)

    async def _list(self, prefix: str) -> list[str]:
        after, _rng, n = await self._before("list", prefix)
        keys = await self.base.list(prefix)
        self._after(after, "list", prefix, n)
        return keys

    async def _list_folder(self, folder: str) -> tuple[list[str], list[str]]:
        after, _rng, n = await self._before("list", folder)
        listing = await self.base.list_folder(folder)
        self._after(after, "list", folder, n)
        return listing.keys, listing.folders

    async def _delete_range(self, prefix: str) -> None:
        after, _rng, n = await self._before("delete_range", prefix)
        await self.base.delete_range(prefix)
        self._after(after, "delete_range", prefix, n)


register_kvstore(FaultKvStore, adapter=True)
