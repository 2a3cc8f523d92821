"""Data types: zarr v3 names and zarr v2 type strings <-> numpy dtypes, fill values.

zarr v3 names follow the core spec (``bool``, ``int8`` ... ``complex128``) plus the
extension names TensorStore writes for the ml_dtypes types (``bfloat16``,
``float8_e4m3fn``, ``float8_e5m2`` ...). Fill values use the v3 JSON forms:
numbers, ``"NaN"``, ``"Infinity"``, ``"-Infinity"``, ``"0x..."`` hex bit patterns
and ``[re, im]`` pairs for complex types.
"""

from __future__ import annotations

import base64
import math
import sys
from typing import Any

import ml_dtypes
import numpy as np

from tensorstore_py.core.errors import InvalidSpecError, UnsupportedError

__all__ = [
    "dtype_from_v2",
    "dtype_from_v3",
    "dtype_to_v2",
    "dtype_to_v3",
    "fill_from_json",
    "fill_from_v2",
    "fill_to_json",
    "fill_to_v2",
]

_V3_CORE = {
    "bool": np.dtype(bool),
    "int8": np.dtype("int8"),
    "int16": np.dtype("int16"),
    "int32": np.dtype("int32"),
    "int64": np.dtype("int64"),
    "uint8": np.dtype("uint8"),
    "uint16": np.dtype("uint16"),
    "uint32": np.dtype("uint32"),
    "uint64": np.dtype("uint64"),
    "float16": np.dtype("float16"),
    "float32": np.dtype("float32"),
    "float64": np.dtype("float64"),
    "complex64": np.dtype("complex64"),
    "complex128": np.dtype("complex128"),
}
_ML_NAMES = [
    "bfloat16",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e4m3b11fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
]
_V3: dict[str, np.dtype] = dict(_V3_CORE)
for _n in _ML_NAMES:
    if hasattr(ml_dtypes, _n):
        _V3[_n] = np.dtype(getattr(ml_dtypes, _n))
_V3_BY_DTYPE = {dt: name for name, dt in _V3.items()}


def dtype_from_v3(name: Any) -> np.dtype:
    """The numpy dtype (native byte order) of a zarr v3 ``data_type``."""
    if not isinstance(name, str):
        raise InvalidSpecError(f"zarr3 metadata field 'data_type': expected a string, got {name!r}")
    try:
        return _V3[name]
    except KeyError:
        raise UnsupportedError(
            f"zarr3 data type {name!r} is not supported; supported: {', '.join(sorted(_V3))}"
        ) from None


def dtype_to_v3(dtype: Any) -> str:
    """The zarr v3 ``data_type`` name of a numpy dtype (byte order ignored)."""
    dt = np.dtype(dtype)
    name = _V3_BY_DTYPE.get(dt.newbyteorder("=")) or _V3_BY_DTYPE.get(dt)
    if name is None:
        raise UnsupportedError(f"numpy dtype {dt} has no zarr3 data type")
    return name


def is_ml_dtype(dt: np.dtype) -> bool:
    return dt.name in _ML_NAMES or dt.name.startswith("float8")


def dtype_from_v2(s: Any) -> np.dtype:
    """The numpy dtype of a zarr v2 ``dtype`` string such as ``"<f4"`` or ``"|u1"``.

    The byte order is kept (``>i4`` stays big-endian: chunks are stored in it).
    """
    if not isinstance(s, str):
        raise InvalidSpecError(f"zarr metadata field 'dtype': expected a string, got {s!r}")
    if s in _V3 and s in _ML_NAMES:  # TensorStore writes "bfloat16" in .zarray
        return _V3[s]
    try:
        dt = np.dtype(s)
    except (TypeError, ValueError):  # numpy's parser raises either
        raise UnsupportedError(f"zarr dtype {s!r} is not supported") from None
    if dt.kind not in "biufc" or dt.fields is not None or dt.subdtype is not None:
        raise UnsupportedError(f"zarr dtype {s!r} is not supported (kind {dt.kind!r})")
    return dt


def dtype_to_v2(dtype: Any) -> str:
    dt = np.dtype(dtype)
    if dt.name in _ML_NAMES:
        return dt.name
    if dt.kind not in "biufc":
        raise UnsupportedError(f"numpy dtype {dt} has no zarr v2 dtype string")
    return dt.str


_SPECIAL = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _scalar_from_json(v: Any, dt: np.dtype, field: str) -> Any:
    if isinstance(v, str):
        if v in _SPECIAL and dt.kind in "fc" or (v in _SPECIAL and is_ml_dtype(dt)):
            return _SPECIAL[v]
        if v.startswith("0x"):
            bits = int(v, 16)
            nbytes = dt.itemsize if dt.kind != "c" else dt.itemsize // 2
            raw = bits.to_bytes(nbytes, "big")
            sub = dt if dt.kind != "c" else np.dtype(f"f{nbytes}")
            return np.frombuffer(raw[::-1] if sys.byteorder == "little" else raw, dtype=sub)[0]
        raise InvalidSpecError(f"{field}: string {v!r} is not a valid fill value for {dt}")
    if isinstance(v, bool) and dt.kind != "b":
        raise InvalidSpecError(f"{field}: boolean {v!r} is not a valid fill value for {dt}")
    if not isinstance(v, (int, float)):
        raise InvalidSpecError(f"{field}: {v!r} is not a valid fill value for {dt}")
    return v


def fill_from_json(v: Any, dt: np.dtype, *, field: str = "zarr3 metadata field 'fill_value'") -> np.generic:
    """Decode a zarr v3 JSON fill value into a numpy scalar of ``dt``."""
    if v is None:
        raise InvalidSpecError(f"{field}: null is not allowed in zarr v3")
    if dt.kind == "c":
        if not (isinstance(v, list) and len(v) == 2):
            raise InvalidSpecError(f"{field}: expected [real, imag] for {dt}, got {v!r}")
        re = float(_scalar_from_json(v[0], dt, field))
        im = float(_scalar_from_json(v[1], dt, field))
        return np.array(complex(re, im), dtype=dt)[()]
    if dt.kind == "b":
        if not isinstance(v, bool):
            if v in (0, 1):
                return np.bool_(bool(v))
            raise InvalidSpecError(f"{field}: expected true/false for bool, got {v!r}")
        return np.bool_(v)
    s = _scalar_from_json(v, dt, field)
    if isinstance(s, np.generic):
        return s.astype(dt) if s.dtype.itemsize != dt.itemsize else s.view(dt)
    if dt.kind in "iu":
        if isinstance(s, float):
            if not s.is_integer():
                raise InvalidSpecError(f"{field}: {v!r} is not an integer for {dt}")
            s = int(s)
        info = np.iinfo(dt)
        if not info.min <= s <= info.max:
            raise InvalidSpecError(f"{field}: {v!r} is out of range for {dt}")
    return np.array(s, dtype=dt)[()]


def _float_to_json(x: float) -> Any:
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    return float(x)


def fill_to_json(value: Any, dt: np.dtype) -> Any:
    """Encode a fill value as zarr v3 JSON (NaN payloads other than the default as hex)."""
    if dt.kind == "c" and isinstance(value, (list, tuple)) and len(value) == 2:
        value = complex(fill_from_json(value[0], np.dtype(f"f{dt.itemsize // 2}"), field="fill_value"),
                        fill_from_json(value[1], np.dtype(f"f{dt.itemsize // 2}"), field="fill_value"))
    a = np.array(value, dtype=dt)[()]
    if dt.kind == "b":
        return bool(a)
    if dt.kind in "iu":
        return int(a)
    if dt.kind == "c":
        return [_float_to_json(float(a.real)), _float_to_json(float(a.imag))]
    x = float(a)
    if math.isnan(x):
        raw = np.array(a, dtype=dt).tobytes()
        if raw != np.array(np.nan, dtype=dt).tobytes():  # a NaN payload: keep its bits
            return "0x" + (raw[::-1] if sys.byteorder == "little" else raw).hex()
    return _float_to_json(x)


def fill_from_v2(v: Any, dt: np.dtype) -> np.generic:
    """A zarr v2 ``fill_value`` (``null`` reads as 0) as a numpy scalar."""
    if v is None:
        return np.zeros((), dtype=dt)[()]
    if isinstance(v, str) and v not in _SPECIAL and dt.kind not in "fc":
        # zarr v2 stores bytes fill values base64-encoded; accept for raw types
        try:
            raw = base64.standard_b64decode(v)
            return np.frombuffer(raw, dtype=dt)[0]
        except Exception:
            raise InvalidSpecError(f"zarr metadata field 'fill_value': {v!r} invalid for {dt}") from None
    return fill_from_json(v, dt, field="zarr metadata field 'fill_value'")


def fill_to_v2(value: Any, dt: np.dtype) -> Any:
    if value is None:
        return None
    return fill_to_json(value, dt)
