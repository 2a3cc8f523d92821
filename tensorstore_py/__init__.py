"""tensorstore_py: huge N-d arrays and model checkpoints with real ACID guarantees.

Quick tour::

    import tensorstore_py as tsp
    kv = tsp.KvStore.open("file:///data/x/").result()
    kv.write("a", b"hello", if_equal=tsp.Generation.NO_VALUE).result()   # create-only
    kv.read("a").result().value

Every I/O call returns a :class:`Future`: ``.result()`` blocks, ``await`` awaits.
Every error class of :mod:`tensorstore_py.errors` is also ``tsp.<Name>``.
"""

from __future__ import annotations

import importlib
from typing import Any

from tensorstore_py import errors
from tensorstore_py.core.errors import *  # noqa: F403  (every error class is tsp.<Name>)
from tensorstore_py.core.errors import __all__ as _ERRORS
from tensorstore_py.core.future import Future
from tensorstore_py.kvstore.base import ByteRange, Generation, KvStore, ReadResult

__version__ = "0.1.0"

__all__ = [
    "ByteRange",
    "Future",
    "Generation",
    "KvStore",
    "ReadResult",
    "errors",
    *_ERRORS,
]

# Heavier parts load on first use: name -> (module, attribute).
_LAZY: dict[str, tuple[str, str]] = {
    "Transaction": ("tensorstore_py.kvstore.transaction", "Transaction"),
    "CommitInfo": ("tensorstore_py.kvstore.transaction", "CommitInfo"),
    "VersionInfo": ("tensorstore_py.kvstore.versioned", "VersionInfo"),
    "open": ("tensorstore_py.opening", "open"),
    "TensorStore": ("tensorstore_py.tensorstore", "TensorStore"),
    "downsample": ("tensorstore_py.downsample_view", "downsample"),
    "open_multiscale": ("tensorstore_py.multiscale", "open_multiscale"),
    "Multiscale": ("tensorstore_py.multiscale", "Multiscale"),
    "write_pyramid": ("tensorstore_py.pyramid", "write_pyramid"),
    "open_group": ("tensorstore_py.group", "open_group"),
    "Group": ("tensorstore_py.group", "Group"),
    "Context": ("tensorstore_py.context", "Context"),
    "CheckpointManager": ("tensorstore_py.checkpoint", "CheckpointManager"),
    "checkpoint": ("tensorstore_py.checkpoint", None),  # type: ignore[dict-item]
    "dask": ("tensorstore_py.dask", None),  # type: ignore[dict-item]
    "zarr_store": ("tensorstore_py.zarr_store", "zarr_store"),
}


def __getattr__(name: str) -> Any:
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'tensorstore_py' has no attribute {name!r}") from None
    mod = importlib.import_module(module)
    value = mod if attr is None else getattr(mod, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
