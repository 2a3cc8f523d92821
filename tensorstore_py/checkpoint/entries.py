"""What a checkpoint leaf is stored as: Python scalars as JSON in the manifest,
arrays of the dtypes that can be stored as raw chunks (checked before anything
is copied)."""

from __future__ import annotations

from typing import Any

import numpy as np

from tensorstore_py.core.errors import DataCorruptionError, InvalidArgumentError
from tensorstore_py.drivers.dtypes import dtype_to_v3, is_variable_length

__all__ = ["check_storable", "scalar_json", "scalar_value"]


def scalar_json(x: Any) -> dict[str, Any]:
    if isinstance(x, bool):
        return {"py": "bool", "v": x}
    if isinstance(x, int):
        return {"py": "int", "v": str(x)}  # str: JSON readers lose big ints
    if isinstance(x, float):
        return {"py": "float", "v": repr(x)}
    if isinstance(x, complex):
        return {"py": "complex", "v": [repr(x.real), repr(x.imag)]}
    if isinstance(x, str):
        return {"py": "str", "v": x}
    return {"py": "bytes", "v": bytes(x).hex()}


def scalar_value(j: dict[str, Any]) -> Any:
    """The Python scalar that :func:`scalar_json` described (DataCorruptionError for an unknown type)."""
    t, v = j["py"], j["v"]
    if t == "bool":
        return bool(v)
    if t == "int":
        return int(v)
    if t == "float":
        return float(v)
    if t == "complex":
        return complex(float(v[0]), float(v[1]))
    if t == "str":
        return str(v)
    if t == "bytes":
        return bytes.fromhex(v)
    raise DataCorruptionError(f"checkpoint manifest: unknown python scalar type {t!r}")


_STORABLE: dict[np.dtype, str] = {}  # dtype -> its zarr v3 name, for the dtypes checked once


def check_storable(path: str, dtype: Any) -> str:
    """The zarr v3 name of ``dtype``; InvalidArgumentError unless leaves of
    ``dtype`` can be stored as raw chunks."""
    dtype = np.dtype(dtype)
    name = _STORABLE.get(dtype)
    if name is not None:
        return name
    try:
        name = dtype_to_v3(dtype)
        ok = not is_variable_length(dtype)  # raw bytes: no strings or objects (pointers)
    except Exception:
        ok = False
    if ok and name is not None:
        _STORABLE[dtype] = name
        return name
    raise InvalidArgumentError(
        f"checkpoint leaf {path}: dtype {dtype} can not be stored (expected bool, "
        "integer, float, complex, bfloat16, float8, datetime64/timedelta64 or fixed-size "
        "U/S/V)"
    )
