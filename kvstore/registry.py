"""Open a kvstore from a URL or a JSON spec; drivers are imported lazily.

A driver module is only imported when a spec names it, so ``import
tensorstore_py`` never pulls in aiohttp, gcsfs or google-auth. A driver whose
optional dependency is missing raises ImportError naming the pip extra.

URL forms::

    memory://[path]            file:///abs/dir/          /abs/dir (a plain path)
    gs://bucket/path/          http(s)://host/path/
    <adapter>+<base URL>       e.g. versioned+file:///ckpt/@12 (see the adapter)
    any other fsspec URL       s3://..., via the fsspec driver
"""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Mapping
from typing import Any

from tensorstore_py.core.errors import InvalidSpecError
from tensorstore_py.kvstore.base import KvStore

__all__ = ["open_kvstore", "spec_from_url", "known_drivers", "register_driver"]

# driver -> (module, class, pip extra needed or None)
_DRIVERS: dict[str, tuple[str, str, str | None]] = {
    "memory": ("tensorstore_py.kvstore.memory", "MemoryKvStore", None),
    "file": ("tensorstore_py.kvstore.file", "FileKvStore", None),
    "gcs": ("tensorstore_py.kvstore.gcs", "GcsKvStore", "gcs"),
    "http": ("tensorstore_py.kvstore.http", "HttpKvStore", None),
    "fsspec": ("tensorstore_py.kvstore.fsspec_store", "FsspecKvStore", None),
    "versioned": ("tensorstore_py.kvstore.versioned", "VersionedKvStore", None),
    "fault": ("tensorstore_py.kvstore.fault", "FaultKvStore", None),
}

_SCHEMES = {"memory": "memory", "file": "file", "gs": "gcs", "http": "http", "https": "http"}


def known_drivers() -> list[str]:
    return sorted(_DRIVERS)


def register_driver(name: str, module: str, cls: str, extra: str | None = None) -> None:
    """Register a third-party kvstore driver (imported lazily by name)."""
    _DRIVERS[name] = (module, cls, extra)


def driver_class(name: str) -> type[KvStore]:
    try:
        module, cls, extra = _DRIVERS[name]
    except KeyError:
        raise InvalidSpecError(
            f"unknown kvstore driver {name!r}; known drivers: {', '.join(known_drivers())}"
        ) from None
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        hint = f'pip install "tensorstore_py[{extra}]"' if extra else "pip install tensorstore_py"
        raise ImportError(
            f"kvstore driver {name!r} needs a package that is not installed ({e.name}); "
            f"install it with: {hint}"
        ) from e
    return getattr(mod, cls)


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
        return cls.spec_from_url(url)  # type: ignore[attr-defined,no-any-return]
    driver = _SCHEMES.get(scheme)
    if driver is None:
        try:
            import fsspec  # noqa: F401
            from fsspec.registry import known_implementations, registry
        except ImportError:  # pragma: no cover - fsspec is a core dependency
            known = {}
            registry = {}
        else:
            known = known_implementations
        if scheme in known or scheme in registry:
            driver = "fsspec"
        else:
            raise InvalidSpecError(
                f"unsupported kvstore URL scheme {scheme!r} in {url!r}; supported: "
                f"{', '.join(sorted(_SCHEMES))} and fsspec protocols"
            )
    return driver_class(driver).spec_from_url(url)  # type: ignore[attr-defined,no-any-return]


async def open_kvstore(spec: str | Mapping[str, Any] | KvStore) -> KvStore:
    """Open a store from a URL, a JSON spec dict, or return a store unchanged."""
    if isinstance(spec, KvStore):
        return spec
    if isinstance(spec, str):
        spec = spec_from_url(spec)
    if not isinstance(spec, Mapping):
        raise InvalidSpecError(f"kvstore spec must be a URL or a dict, got {type(spec).__name__}")
    spec = dict(spec)
    name = spec.get("driver")
    if not isinstance(name, str):
        raise InvalidSpecError(
            f"kvstore spec {spec!r} has no 'driver'; known drivers: {', '.join(known_drivers())}"
        )
    cls = driver_class(name)
    store = cls.from_spec(spec)  # type: ignore[attr-defined]
    if inspect.isawaitable(store):
        store = await store
    return store  # type: ignore[no-any-return]
