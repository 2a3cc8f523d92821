"""Shared resources of opened arrays: the chunk cache pool, the I/O byte budget and threads, memory stores.

A :class:`Context` is passed to :func:`tensorstore_py.open` (``context=``) or
named in a spec (``"context": {...}``). Every array opened with the *same*
Context object shares its resources: one cache pool (so repeated small reads
of several arrays hit one byte-limited LRU), the bytes-in-flight limit that
bounds each array's concurrent chunk I/O, and one in-memory store: every
``memory://`` URL (or memory spec without a ``name``) opened with it opens the
same store (paths are prefixes in it), as TensorStore's
``memory_key_value_store`` resource does. It lives as long as the Context or a
store opened from it. Without a context (the process-wide default) each open
of ``memory://`` gets a fresh store, as with TensorStore's default of a new
context per open.

JSON form (every field optional)::

    {"cache_pool": {"total_bytes_limit": 0},      # bytes; 0 = no cache (default)
     "bytes_in_flight": {"limit": null},          # bytes; null = max(256 MiB, 16 MiB x CPUs)
     "data_copy_concurrency": {"limit": null},    # codec threads; null = CPUs
     "file_io_concurrency": {"limit": null}}      # blocking I/O threads; null = max(32, 4 x CPUs)

"CPUs" are those this process may run on (``os.sched_getaffinity``: a
container's or ``taskset``'s limit, not the machine's core count). The names of
the two thread limits are TensorStore's. Arrays whose Contexts ask for the same
thread count share one pool of that size.

The cache is off by default: a cache only helps repeated reads of the same
chunks, and it holds memory. Turn it on for interactive slicing of a volume.

Resources are per process. A Context pickles as its settings plus an identity:
in the receiving process every copy of one Context (sent with many views, or
many tasks) unpickles to ONE Context there, with its own cache pool and
budgets; the process-wide default context unpickles to the receiver's default.
Nothing cached travels.
"""

from __future__ import annotations

import threading
import uuid
import weakref
from collections.abc import Mapping
from typing import Any

from tensorstore_py.core.errors import InvalidSpecError
from tensorstore_py.core.pools import Concurrency
from tensorstore_py.drivers.cache import CachePool
from tensorstore_py.kvstore.memory import MemoryKvStore
from tensorstore_py.kvstore.registry import spec_from_url

__all__ = ["Context"]

_KNOWN = {"cache_pool": {"total_bytes_limit"}, "bytes_in_flight": {"limit"},
          "data_copy_concurrency": {"limit"}, "file_io_concurrency": {"limit"}}


def _nonneg_int(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidSpecError(f"context: {field} must be a non-negative integer, got {value!r}")
    return value


def _positive_or_none(value: Any, field: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidSpecError(f"context: {field} must be a positive integer (or null), got {value!r}")
    return value


class Context:
    """Resources shared by the arrays opened with it.

    ``Context()`` has no cache and the driver's default byte budget;
    ``Context({"cache_pool": {"total_bytes_limit": 1 << 30}})`` shares a
    1 GiB cache among its arrays. A Context is cheap; its cache pool is
    created on first use and lives as long as the Context or an array using it.
    """

    __slots__ = ("__weakref__", "_bytes_in_flight", "_cache_limit", "_copy_threads", "_io_threads",
                 "_lock", "_memory", "_pool", "_token")

    def __init__(
        self,
        spec: Mapping[str, Any] | None = None,
        *,
        cache_pool_bytes: int | None = None,
        bytes_in_flight: int | None = None,
    ) -> None:
        spec = dict(spec or {})
        for name, fields in spec.items():
            if name not in _KNOWN:
                raise InvalidSpecError(
                    f"context: unknown resource {name!r}; known: {', '.join(sorted(_KNOWN))}"
                )
            if not isinstance(fields, Mapping) or set(fields) - _KNOWN[name]:
                raise InvalidSpecError(
                    f"context: resource {name!r} takes an object with fields "
                    f"{sorted(_KNOWN[name])}, got {fields!r}"
                )
        limit = spec.get("cache_pool", {}).get("total_bytes_limit", 0)
        if cache_pool_bytes is not None:
            limit = cache_pool_bytes
        self._cache_limit = _nonneg_int(limit, "cache_pool.total_bytes_limit")
        bif = spec.get("bytes_in_flight", {}).get("limit")
        if bytes_in_flight is not None:
            bif = bytes_in_flight
        self._bytes_in_flight = None if bif is None else _nonneg_int(bif, "bytes_in_flight.limit")
        if self._bytes_in_flight == 0:
            raise InvalidSpecError("context: bytes_in_flight.limit must be > 0 (or null)")
        self._copy_threads = _positive_or_none(
            spec.get("data_copy_concurrency", {}).get("limit"), "data_copy_concurrency.limit")
        self._io_threads = _positive_or_none(
            spec.get("file_io_concurrency", {}).get("limit"), "file_io_concurrency.limit")
        self._pool: Any = None
        self._memory: MemoryKvStore | None = None
        self._lock = threading.Lock()
        self._token = uuid.uuid4().hex  # identifies this Context across pickling

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle as the settings and an identity (see the module doc); no resources travel."""
        token = _DEFAULT_TOKEN if self is _default else self._token
        if token != _DEFAULT_TOKEN:
            with _by_token_lock:
                _by_token.setdefault(token, self)
        return (_context_for, (self.spec(), token))

    @property
    def cache_pool_bytes(self) -> int:
        """The cache pool's byte limit (0 = caching off)."""
        return self._cache_limit

    @property
    def bytes_in_flight(self) -> int | None:
        """The byte budget for concurrent chunk I/O (None = driver default)."""
        return self._bytes_in_flight

    @property
    def concurrency(self) -> Concurrency:
        """The threads the arrays of this Context use for codec work (``cpu``) and
        blocking I/O (``io``): the given limits, else the defaults derived from
        the CPUs this process may use."""
        return Concurrency.default(cpu=self._copy_threads, io=self._io_threads)

    @property
    def cache_pool(self) -> CachePool | None:
        """The shared ``drivers.cache.CachePool``, or None when caching is off."""
        if self._cache_limit == 0:
            return None
        with self._lock:
            if self._pool is None:
                self._pool = CachePool(self._cache_limit)
            return self._pool

    @property
    def memory_store(self) -> MemoryKvStore:
        """The in-memory store that ``memory://`` URLs opened with this Context share
        (named after the Context's identity, so a pickled view reopens the receiving
        process's store of the same Context)."""
        with self._lock:
            if self._memory is None:
                self._memory = MemoryKvStore(name=f"context-{self._token}")
            return self._memory

    def bind_kvstore(self, kv: Any) -> Any:
        """``kv`` (a URL, a JSON spec or an open store) with every memory store in it
        that names no ``name`` (an adapter's ``base`` too: ``versioned+memory://``)
        bound to :attr:`memory_store`; unchanged for the default context and for
        other stores."""
        if self is _default:
            return kv
        if isinstance(kv, str):
            if "memory://" not in kv:
                return kv
            kv = spec_from_url(kv)
        if not isinstance(kv, Mapping):
            return kv  # an opened store keeps its own data
        out = dict(kv)
        if out.get("driver") == "memory" and out.get("name") is None:
            out["name"] = self.memory_store.name
        if "base" in out:
            out["base"] = self.bind_kvstore(out["base"])
        return out

    def spec(self) -> dict[str, Any]:
        """The JSON form; ``Context(ctx.spec())`` has the same settings (not the same pool)."""
        return {
            "cache_pool": {"total_bytes_limit": self._cache_limit},
            "bytes_in_flight": {"limit": self._bytes_in_flight},
            "data_copy_concurrency": {"limit": self._copy_threads},
            "file_io_concurrency": {"limit": self._io_threads},
        }

    def __repr__(self) -> str:
        return f"Context({self.spec()!r})"


_default: Context | None = None
_default_lock = threading.Lock()
_DEFAULT_TOKEN = "default"
# token -> the Context of this process that stands for it (the original in the
# process that created it; the first one unpickled elsewhere)
_by_token: weakref.WeakValueDictionary[str, Context] = weakref.WeakValueDictionary()
_by_token_lock = threading.Lock()


def _context_for(spec: dict[str, Any], token: str) -> Context:
    """The Context of this process for a pickled one (what unpickling calls)."""
    if token == _DEFAULT_TOKEN:
        return default_context()
    with _by_token_lock:
        ctx = _by_token.get(token)
        if ctx is None:
            ctx = Context(spec)
            ctx._token = token
            _by_token[token] = ctx
        return ctx


def default_context() -> Context:
    """The process-wide Context used when none is given (no cache)."""
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                _default = Context()
    return _default
