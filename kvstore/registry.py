"""Open a kvstore from a URL or a JSON spec; each store module registers itself.

A store module calls :func:`register_kvstore` once, at import, with its class,
its URL schemes and whether it is an adapter (``<name>+<base URL>``). The
registry itself only knows :data:`BUILTIN_MODULES`, the modules to import when
a name or scheme is not registered yet, cheap ones first: so ``import
tensorstore_py`` imports no store module, opening ``file://`` imports neither
aiohttp nor fsspec, and only a URL that no native store claims reaches the
fsspec driver (which registers itself as the *fallback* for every protocol
fsspec knows). Adding a store = one new module that registers itself plus one
entry in :data:`BUILTIN_MODULES`.

Third-party drivers register lazily with :func:`register_driver` (module and
class by name); a missing optional dependency then raises ImportError naming
the pip extra to install.

A store class that can not honour create-only and compare-and-swap writes says
so with a class attribute ``conditional_writes = False`` (the fsspec store);
:func:`require_conditional_writes` turns that into an error at open, before any
data moves, for the work that needs them (a versioned store, a checkpoint, a
copy), naming the stores that can.

URL forms::

    memory://[path]            file:///abs/dir/          /abs/dir (a plain path)
    gs://bucket/path/          s3://bucket/path/          http(s)://host/path/
    <adapter>+<base URL>       e.g. versioned+file:///ckpt/@12 (see the adapter)
    any other fsspec URL       e.g. az://..., via the fsspec driver

This module imports no store module at the top (``kvstore.base`` imports it
for ``KvStore.open``), so it recognises an opened store by its shape
(:class:`StoreLike`) rather than by class.
"""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

from tensorstore_py.core.errors import InvalidSpecError, UnsupportedError

__all__ = [
    "BUILTIN_MODULES",
    "StoreLike",
    "driver_class",
    "known_drivers",
    "open_kvstore",
    "conditional_schemes",
    "has_conditional_writes",
    "register_driver",
    "register_kvstore",
    "require_conditional_writes",
    "spec_from_url",
]

#: Store modules that register themselves, imported in this order when a driver
#: name or URL scheme is not registered yet (cheapest first).
BUILTIN_MODULES: tuple[str, ...] = (
    "tensorstore_py.kvstore.memory",
    "tensorstore_py.kvstore.file",
    "tensorstore_py.kvstore.fault",
    "tensorstore_py.kvstore.versioned",
    "tensorstore_py.kvstore.http",
    "tensorstore_py.kvstore.gcs",
    "tensorstore_py.kvstore.s3",
    "tensorstore_py.kvstore.fsspec_store",
)


@runtime_checkable
class StoreLike(Protocol):
    """An opened store (a ``kvstore.base.KvStore``), recognised by its members."""

    path: str

    def spec(self) -> dict[str, Any]: ...

    def with_path(self, sub: str) -> Any: ...

    def read(self, key: str) -> Any: ...

    def write(self, key: str, value: Any) -> Any: ...

    def list(self, prefix: str = "") -> Any: ...


@dataclass(frozen=True)
class _Lazy:
    """A third-party driver registered by name, imported on first use."""

    module: str
    cls: str
    extra: str | None
    adapter: bool


# driver name -> store class (registered by its module) or where to import it from
_DRIVERS: dict[str, type[Any] | _Lazy] = {}
_SCHEMES: dict[str, str] = {}  # URL scheme -> driver name
_ADAPTERS: set[str] = set()  # drivers that open "<name>+<base URL>"
_FALLBACKS: dict[str, Callable[[str], bool]] = {}  # driver -> accepts(scheme), for the rest
_FAILED: dict[str, ImportError] = {}  # builtin module -> why it could not be imported

T = TypeVar("T")


def register_kvstore(
    cls: type[Any],
    *,
    schemes: Iterable[str] = (),
    adapter: bool = False,
    fallback: Callable[[str], bool] | None = None,
) -> None:
    """Register the store class ``cls`` under its ``driver`` name (call at import).

    ``schemes``: URL schemes it opens (``cls.spec_from_url(url)`` turns such a
    URL into a spec). ``adapter``: URLs ``<driver>+<base URL>`` go to
    ``cls.spec_from_url``. ``fallback``: a predicate on the scheme, asked only
    for schemes no store registered. A later registration of a name or scheme
    replaces an earlier one.
    """
    name = getattr(cls, "driver", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_kvstore: {cls!r} has no 'driver' name")
    _DRIVERS[name] = cls
    for scheme in schemes:
        _SCHEMES[scheme.lower()] = name
    if adapter:
        _ADAPTERS.add(name)
    else:
        _ADAPTERS.discard(name)
    if fallback is not None:
        _FALLBACKS[name] = fallback


def register_driver(
    name: str, module: str, cls: str, extra: str | None = None, *, adapter: bool = False
) -> None:
    """Register a third-party kvstore driver, imported lazily by name.

    ``extra`` names the pip extra that provides its dependencies (for the hint
    when they are missing); ``adapter=True`` lets ``<name>+<base URL>`` open it.
    """
    _DRIVERS[name] = _Lazy(module, cls, extra, adapter)
    if adapter:
        _ADAPTERS.add(name)


def _lookup(find: Callable[[], T]) -> T:
    """``find()``, importing builtin store modules one by one until it is not None."""
    hit = find()
    for module in BUILTIN_MODULES:
        if hit is not None:
            return hit
        if module in _FAILED:
            continue
        try:
            importlib.import_module(module)  # a dict lookup once imported
        except ImportError as e:
            _FAILED[module] = e
        hit = find()
    return hit


def known_drivers() -> list[str]:
    """Every driver name (imports all builtin store modules)."""
    _lookup(lambda: None)
    return sorted(_DRIVERS)


def driver_class(name: str) -> type[Any]:
    """The store class registered as driver ``name``."""
    entry = _lookup(lambda: _DRIVERS.get(name))
    if entry is None:
        known = ", ".join(known_drivers())
        if _FAILED:
            first = next(iter(_FAILED.values()))
            raise ImportError(
                f"unknown kvstore driver {name!r} (known: {known}); store modules "
                f"{', '.join(sorted(_FAILED))} could not be imported ({first.name} is missing); "
                "install it with: pip install tensorstore_py"
            ) from first
        raise InvalidSpecError(f"unknown kvstore driver {name!r}; known drivers: {known}")
    if not isinstance(entry, _Lazy):
        return entry
    try:
        mod = importlib.import_module(entry.module)
    except ImportError as e:
        hint = f'pip install "tensorstore_py[{entry.extra}]"' if entry.extra else "pip install tensorstore_py"
        raise ImportError(
            f"kvstore driver {name!r} needs a package that is not installed ({e.name}); "
            f"install it with: {hint}"
        ) from e
    cls: type[Any] = getattr(mod, entry.cls)
    if _DRIVERS.get(name) is entry:  # unless the module registered itself
        _DRIVERS[name] = cls
    return cls


def has_conditional_writes(store: Any) -> bool:
    """False when ``store``, or a store an adapter of it wraps (its ``base``),
    can not do create-only / compare-and-swap writes."""
    while store is not None:
        if not getattr(store, "conditional_writes", True):
            return False
        store = getattr(store, "base", None)
    return True


def conditional_schemes() -> list[str]:
    """URL schemes of the writable stores with real create-only and
    compare-and-swap writes (imports every builtin store module)."""
    known = set(known_drivers())
    out = []
    for scheme, name in sorted(_SCHEMES.items()):
        entry = _DRIVERS.get(name)
        if name in known and isinstance(entry, type) and name not in _ADAPTERS \
                and getattr(entry, "conditional_writes", True) and not getattr(entry, "read_only", False):
            out.append(f"{scheme}://")
    return out


def require_conditional_writes(store: Any, what: str) -> None:
    """UnsupportedError when ``store`` can not do create-only writes, which
    ``what`` (e.g. "checkpoint save to az://c/run/") needs."""
    if has_conditional_writes(store):
        return
    url = store.url() if hasattr(store, "url") else repr(store)
    raise UnsupportedError(
        f"{what}: the store at {url} can not do create-only or compare-and-swap writes "
        f"(a generic fsspec filesystem offers neither atomically), which this needs; use a store "
        f"that can: {', '.join(conditional_schemes())} (or a local path)"
    )


def _scheme_driver(scheme: str) -> str | None:
    """The driver for URL ``scheme``: registered schemes first (of every builtin
    module), then the fallbacks."""
    name = _lookup(lambda: _SCHEMES.get(scheme))
    if name is None:
        name = next((d for d, accepts in _FALLBACKS.items() if accepts(scheme)), None)
    return name


def spec_from_url(url: str) -> dict[str, Any]:
    """Translate a URL (or a plain local path) into a JSON spec."""
    if not isinstance(url, str) or not url:
        raise InvalidSpecError(f"kvstore URL must be a non-empty string, got {url!r}")
    if "://" not in url:
        if ":" in url.split("/")[0]:
            raise InvalidSpecError(
                f"malformed kvstore URL {url!r}: expected scheme://..., e.g. file:///abs/dir/"
            )
        return {"driver": "file", "path": os.path.abspath(url) + ("/" if url.endswith("/") else "")}
    scheme = url.split("://", 1)[0].lower()
    if not scheme or not all(c.isalnum() or c in "+-." for c in scheme):
        raise InvalidSpecError(f"malformed kvstore URL {url!r}: bad scheme {scheme!r}")
    if "+" in scheme:
        adapter = scheme.split("+", 1)[0]
        cls = driver_class(adapter)
        if adapter not in _ADAPTERS:
            raise InvalidSpecError(
                f"kvstore URL {url!r}: {adapter!r} is not an adapter; adapters: "
                f"{', '.join(sorted(_ADAPTERS))} (e.g. versioned+file:///abs/dir/)"
            )
        return cls.spec_from_url(url)  # type: ignore[no-any-return]
    driver = _scheme_driver(scheme)
    if driver is None:
        also = "".join(f" and what the {d} driver accepts" for d in sorted(_FALLBACKS))
        raise InvalidSpecError(
            f"unsupported kvstore URL scheme {scheme!r} in {url!r}; supported: "
            f"{', '.join(sorted(_SCHEMES))}{also}"
        )
    return driver_class(driver).spec_from_url(url)  # type: ignore[no-any-return]


async def open_kvstore(spec: str | Mapping[str, Any] | StoreLike) -> Any:
    """Open a store from a URL or a JSON spec dict; an opened store is returned
    unchanged. The result is a ``kvstore.base.KvStore``."""
    if isinstance(spec, str):
        spec = spec_from_url(spec)
    if not isinstance(spec, Mapping):
        if isinstance(spec, StoreLike):
            return spec
        raise InvalidSpecError(f"kvstore spec must be a URL or a dict, got {type(spec).__name__}")
    spec = dict(spec)
    name = spec.get("driver")
    if not isinstance(name, str):
        raise InvalidSpecError(
            f"kvstore spec {spec!r} has no 'driver'; known drivers: {', '.join(known_drivers())}"
        )
    store = driver_class(name).from_spec(spec)
    if inspect.isawaitable(store):
        store = await store
    return store
