"""Typed PRNG key leaves (``jax.random.key(0)``): saved as their key data.

A key array has an extended dtype (``key<fry>``) that no array format stores.
A save stores ``jax.random.key_data(keys)`` (uint32, the key shape plus the
impl's trailing dimensions, with the keys' sharding) as an ordinary leaf, and
records in the leaf's manifest entry ``"prng": {"impl": <name>, "dtype":
<key dtype>, "shape": <key shape>}``. A restore rebuilds the keys with
``jax.random.wrap_key_data`` (placed with the target's sharding when the target
leaf is a key array or a ``ShapeDtypeStruct`` of a key dtype); without JAX
imported, or for a uint32 target, the raw key data is returned. As Orbax does.
JAX is never imported here: these functions are only reached with jax values.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from tensorstore_py.core.errors import InvalidArgumentError

__all__ = ["from_key_data", "is_prng_key", "key_data"]


def is_prng_key(x: Any) -> bool:
    """True for a leaf (or target leaf) whose dtype is a typed PRNG key."""
    jax = sys.modules.get("jax")
    dtype = getattr(x, "dtype", None)
    if jax is None or dtype is None:
        return False
    if isinstance(dtype, np.dtype):  # every plain array: a numpy dtype is never a key type
        return False
    try:
        return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))
    except TypeError:
        return False


def key_data(keys: Any) -> tuple[dict[str, Any], Any]:
    """``(manifest "prng" entry, the uint32 key data)`` of a typed key array."""
    jax = sys.modules["jax"]
    info = {"impl": str(jax.random.key_impl(keys)), "dtype": str(keys.dtype), "shape": list(keys.shape)}
    return info, jax.random.key_data(keys)


def from_key_data(data: np.ndarray, prng: Any, target: Any, where: str) -> Any:
    """The key array of stored ``data`` (see the module docstring). ``target``: the
    restore target's leaf (None: no target). Raises InvalidArgumentError when the
    target asks for keys of another impl or shape."""
    jax = sys.modules.get("jax")
    if not isinstance(prng, dict) or not isinstance(prng.get("impl"), str):
        return data  # not a key leaf after all (a malformed entry reads as its data)
    if jax is None:
        return data
    if target is not None:
        if str(target.dtype) != prng.get("dtype") or list(target.shape) != prng.get("shape"):
            raise InvalidArgumentError(
                f"{where}: stored as PRNG keys {prng.get('dtype')} of shape {tuple(prng.get('shape', ()))}, "
                f"the target asks for {target.dtype} of shape {tuple(target.shape)}"
            )
    keys = jax.random.wrap_key_data(data, impl=prng["impl"])
    sharding = getattr(target, "sharding", None)
    return keys if sharding is None else jax.device_put(keys, sharding)
