"""Data types: zarr v3 ``data_type`` and zarr v2 ``dtype`` <-> numpy dtypes, fill values.

zarr v3 names follow the core spec (``bool``, ``int8`` ... ``complex128``) plus the
extension names TensorStore writes for the ml_dtypes types (``bfloat16``,
``float8_e4m3fn``, ``float8_e5m2`` ...) and the extension data types zarr-python 3
writes (fill values in the JSON form zarr-python writes and reads):

==============================================================  ==========================  ===================
zarr3 ``data_type``                                             numpy dtype                 ``fill_value``
==============================================================  ==========================  ===================
``"string"``                                                    ``StringDType()``           a string
``"variable_length_bytes"``                                     ``object`` (bytes elements) base64
``{"name": "numpy.datetime64", "configuration": {"unit":        ``datetime64[<k><unit>]``   an integer or "NaT"
"s", "scale_factor": k}}`` (and ``numpy.timedelta64``)          (``timedelta64``)
``{"name": "fixed_length_utf32", "configuration":               ``<U<n/4>``                 a string
{"length_bytes": n}}``
``{"name": "null_terminated_bytes", ...}``                      ``S<n>``                    base64
``{"name": "raw_bytes", ...}``                                  ``V<n>``                    base64
==============================================================  ==========================  ===================

zarr v2 ``dtype`` strings: numpy's (``"<f4"``, ``"|S5"``, ``"<U5"``, ``"<M8[ns]"``,
``"|V3"``) and ``"|O"``, whose first filter (``vlen-utf8`` or ``vlen-bytes``) says
what the objects are (:func:`v2_object_dtype`).

Variable-length strings read as numpy's ``StringDType`` (numpy >= 2; ``object``
before): every element is a ``str``, comparisons and ``np.strings`` functions are
vectorised, and it is what zarr-python 3 returns. Variable-length bytes have no
numpy dtype of their own: ``object`` arrays of ``bytes``.

Numeric fill values use the v3 JSON forms: numbers, ``"NaN"``, ``"Infinity"``,
``"-Infinity"``, ``"0x..."`` hex bit patterns and ``[re, im]`` pairs for complex types.
A data type this module does not know raises UnsupportedError naming it and listing
the supported ones; a malformed one (wrong JSON type, bad configuration) raises
InvalidSpecError.
"""

from __future__ import annotations

import base64
import binascii
import math
import sys
from typing import Any

import ml_dtypes
import numpy as np

from tensorstore_py.core.errors import InvalidArgumentError, InvalidSpecError, UnsupportedError

__all__ = [
    "BYTES_DTYPE",
    "STRING_DTYPE",
    "as_dtype",
    "as_variable_length",
    "default_fill_value",
    "dtype_from_v2",
    "dtype_from_v3",
    "dtype_to_v2",
    "dtype_to_v3",
    "element_nbytes",
    "fill_from_json",
    "fill_from_v2",
    "fill_key",
    "fill_to_json",
    "fill_to_v2",
    "has_byte_order",
    "is_variable_length",
    "v2_object_codec",
    "v2_object_dtype",
]

#: variable-length UTF-8 strings (zarr3 ``string``, zarr v2 ``|O`` + ``vlen-utf8``)
STRING_DTYPE: np.dtype = (
    np.dtype(np.dtypes.StringDType()) if hasattr(np.dtypes, "StringDType") else np.dtype(object)
)
#: variable-length bytes (zarr3 ``variable_length_bytes``, zarr v2 ``|O`` + ``vlen-bytes``)
BYTES_DTYPE = np.dtype(object)
#: what the byte budget counts per variable-length element besides its itemsize: an
#: estimate (the element's own size is unknown until it is decoded)
VLEN_ELEMENT_BYTES = 64
#: the largest fixed-length string/bytes element (a bigger one is refused before
#: any chunk of it is allocated)
MAX_ITEMSIZE = 1 << 24

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


_V3_VLEN = {"string": STRING_DTYPE, "variable_length_bytes": BYTES_DTYPE}
_V3_TIME = {"numpy.datetime64": "M", "numpy.timedelta64": "m"}
_V3_FIXED = {"fixed_length_utf32": "U", "null_terminated_bytes": "S", "raw_bytes": "V"}
_TIME_UNITS = ("Y", "M", "W", "D", "h", "m", "s", "ms", "us", "μs", "ns", "ps", "fs", "as", "generic")


def _v3_supported() -> str:
    return ", ".join([*sorted(_V3), *_V3_VLEN, *_V3_TIME, *_V3_FIXED])


def _v3_err(msg: str) -> InvalidSpecError:
    return InvalidSpecError(f"zarr3 metadata field 'data_type': {msg}")


def _time_dtype(name: str, cfg: Any) -> np.dtype:
    if not isinstance(cfg, dict) or set(cfg) != {"unit", "scale_factor"}:
        raise _v3_err(f"{name} needs a configuration {{'unit': ..., 'scale_factor': ...}}, got {cfg!r}")
    unit, k = cfg["unit"], cfg["scale_factor"]
    if unit not in _TIME_UNITS:
        raise _v3_err(f"{name} unit must be one of {', '.join(_TIME_UNITS)}, got {unit!r}")
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k < 2**31:
        raise _v3_err(f"{name} scale_factor must be an integer in [1, 2^31), got {k!r}")
    kind = "M8" if _V3_TIME[name] == "M" else "m8"
    return np.dtype(kind if unit == "generic" else f"{kind}[{k}{unit}]")


def _fixed_dtype(name: str, cfg: Any) -> np.dtype:
    n = cfg.get("length_bytes") if isinstance(cfg, dict) and set(cfg) == {"length_bytes"} else None
    kind = _V3_FIXED[name]
    if not isinstance(n, int) or isinstance(n, bool) or n < 1 or (kind == "U" and n % 4):
        raise _v3_err(f"{name} needs a configuration {{'length_bytes': n}} with n >= 1"
                      + (" and a multiple of 4" if kind == "U" else "") + f", got {cfg!r}")
    if n > MAX_ITEMSIZE:
        raise UnsupportedError(f"zarr3 data type {name!r}: elements of {n} bytes exceed the "
                               f"supported maximum of {MAX_ITEMSIZE}")
    return np.dtype(f"<U{n // 4}" if kind == "U" else f"{kind}{n}")


def dtype_from_v3(name: Any) -> np.dtype:
    """The numpy dtype (native byte order) of a zarr v3 ``data_type`` (a name or an
    extension object ``{"name": ..., "configuration": ...}``)."""
    if isinstance(name, str):
        dt = _V3.get(name, _V3_VLEN.get(name))
        if dt is None:
            raise UnsupportedError(
                f"zarr3 data type {name!r} is not supported; supported: {_v3_supported()}"
            )
        return dt
    if not isinstance(name, dict) or not isinstance(name.get("name"), str):
        raise _v3_err(f"expected a name or {{'name': ..., 'configuration': ...}}, got {name!r}")
    if set(name) - {"name", "configuration", "must_understand"}:
        raise _v3_err(f"unknown fields {sorted(set(name) - {'name', 'configuration'})} in {name!r}")
    n = name["name"]
    if n in _V3_TIME:
        return _time_dtype(n, name.get("configuration"))
    if n in _V3_FIXED:
        return _fixed_dtype(n, name.get("configuration"))
    raise UnsupportedError(f"zarr3 data type {n!r} is not supported; supported: {_v3_supported()}")


def dtype_to_v3(dtype: Any) -> Any:
    """The zarr v3 ``data_type`` of a numpy dtype (byte order ignored): a name, or
    an extension object for times and fixed-length strings."""
    dt = as_dtype(dtype)
    name = _V3_BY_DTYPE.get(dt.newbyteorder("=") if dt.byteorder in "<>" else dt) or _V3_BY_DTYPE.get(dt)
    if name is not None:
        return name
    if dt == STRING_DTYPE:
        return "string"
    if dt == BYTES_DTYPE:
        return "variable_length_bytes"
    if dt.kind in "mM":
        unit, k = np.datetime_data(dt)
        return {"name": "numpy.datetime64" if dt.kind == "M" else "numpy.timedelta64",
                "configuration": {"unit": unit, "scale_factor": k}}
    if dt.kind in "USV" and dt.fields is None and dt.subdtype is None and not is_ml_dtype(dt):
        name = {"U": "fixed_length_utf32", "S": "null_terminated_bytes", "V": "raw_bytes"}[dt.kind]
        return {"name": name, "configuration": {"length_bytes": dt.itemsize}}
    raise UnsupportedError(f"numpy dtype {dt} has no zarr3 data type; supported: {_v3_supported()}")


def is_ml_dtype(dt: np.dtype) -> bool:
    return dt.name in _ML_NAMES or dt.name.startswith("float8")


def is_variable_length(dt: np.dtype) -> bool:
    """True for dtypes whose elements have no fixed size (strings, bytes objects):
    their memory cannot be reinterpreted, compared bitwise or sized in advance."""
    return dt.kind in "OT"


def element_nbytes(dt: np.dtype) -> int:
    """Bytes one element costs in memory: the itemsize, plus an estimate
    (VLEN_ELEMENT_BYTES) for the out-of-line data of a variable-length element."""
    return dt.itemsize + (VLEN_ELEMENT_BYTES if is_variable_length(dt) else 0)


def has_byte_order(dt: np.dtype) -> bool:
    """True when an element's stored bytes depend on the endianness (numbers and
    times wider than one byte, UTF-32 strings); False for bytes-like types."""
    if dt.itemsize <= 1 or dt.kind in "bSOT":
        return False
    return dt.kind != "V" or is_ml_dtype(dt)


def as_dtype(x: Any) -> np.dtype:
    """The dtype a caller means by ``x``: ``str`` is variable-length UTF-8
    (:data:`STRING_DTYPE`), ``bytes`` variable-length bytes (:data:`BYTES_DTYPE`);
    sized ``"U5"``/``"S5"`` stay fixed-length; anything else as ``np.dtype(x)``."""
    dt = np.dtype(x)
    if dt.kind in "US" and dt.itemsize == 0:  # np.dtype(str) / np.dtype(bytes)
        return STRING_DTYPE if dt.kind == "U" else BYTES_DTYPE
    return dt


def as_variable_length(value: np.ndarray, dt: np.dtype) -> np.ndarray:
    """``value`` as an array of the variable-length ``dt``, checked before any
    write: strings from ``U``/StringDType arrays or objects that are all ``str``;
    bytes from ``S`` arrays or objects that are all ``bytes``. Anything else
    raises InvalidArgumentError (numpy would turn bytes into "b'..'" strings)."""
    kind = value.dtype.kind
    if dt.kind == "T":
        if kind in "UT":
            return value.astype(dt, copy=False)
        if kind == "O" and all(isinstance(x, str) for x in value.flat):
            return value.astype(dt)
        want = "str"
    else:
        if kind == "S":
            return value.astype(object)
        if kind == "O" and all(isinstance(x, bytes) for x in value.flat):
            return value
        want = "bytes"
    raise InvalidArgumentError(
        f"cannot write a value of dtype {value.dtype} into an array of {dt}: expected {want} elements"
    )


_V2_KINDS = "biufcmMSUV"


def dtype_from_v2(s: Any) -> np.dtype:
    """The numpy dtype of a zarr v2 ``dtype`` string such as ``"<f4"`` or ``"|u1"``.

    The byte order is kept (``>i4`` stays big-endian: chunks are stored in it).
    ``"|O"`` is ``object`` here; :func:`v2_object_dtype` says what its elements are.
    """
    if isinstance(s, list):
        raise UnsupportedError(f"zarr structured dtype {s!r} is not supported")
    if not isinstance(s, str):
        raise InvalidSpecError(f"zarr metadata field 'dtype': expected a string, got {s!r}")
    if s in _V3 and s in _ML_NAMES:  # TensorStore writes "bfloat16" in .zarray
        return _V3[s]
    try:
        dt = np.dtype(s)
    except (TypeError, ValueError):  # numpy's parser raises either
        raise UnsupportedError(f"zarr dtype {s!r} is not supported") from None
    if (dt.kind not in _V2_KINDS + "O" or dt.fields is not None or dt.subdtype is not None
            or dt.kind in "SUV" and dt.itemsize == 0):
        raise UnsupportedError(
            f"zarr dtype {s!r} is not supported (kind {dt.kind!r}); supported: numpy dtype "
            f"strings of kinds {', '.join(_V2_KINDS)} and '|O' with a vlen-utf8 or vlen-bytes filter"
        )
    if dt.itemsize > MAX_ITEMSIZE:
        raise UnsupportedError(f"zarr dtype {s!r}: elements of {dt.itemsize} bytes exceed the "
                               f"supported maximum of {MAX_ITEMSIZE}")
    return dt


_V2_OBJECT_CODECS = {"vlen-utf8": STRING_DTYPE, "vlen-bytes": BYTES_DTYPE}


def v2_object_dtype(codec_id: Any) -> np.dtype:
    """The dtype of a zarr v2 ``"|O"`` array whose first filter is ``codec_id``."""
    dt = _V2_OBJECT_CODECS.get(codec_id) if isinstance(codec_id, str) else None
    if dt is None:
        raise UnsupportedError(
            f"zarr dtype '|O' with object codec {codec_id!r} is not supported; supported: "
            + ", ".join(_V2_OBJECT_CODECS)
        )
    return dt


def v2_object_codec(dt: np.dtype) -> str | None:
    """The object codec (first filter) a zarr v2 array of ``dt`` needs, if any."""
    if not is_variable_length(dt):
        return None
    return "vlen-utf8" if dt == STRING_DTYPE else "vlen-bytes"


def dtype_to_v2(dtype: Any) -> str:
    dt = as_dtype(dtype)
    if dt.name in _ML_NAMES:
        return dt.name
    if is_variable_length(dt):
        return "|O"
    if dt.kind not in _V2_KINDS or dt.fields is not None or dt.subdtype is not None:
        raise UnsupportedError(
            f"numpy dtype {dt} has no zarr v2 dtype string; supported: kinds {', '.join(_V2_KINDS)}, "
            f"{', '.join(_ML_NAMES)}, str and bytes"
        )
    return dt.str


def _is_textual(dt: np.dtype) -> bool:
    """Strings, bytes and times: fill values that are not numbers."""
    return dt.kind in "TOUSmM" or dt.kind == "V" and not is_ml_dtype(dt)


def _b64(v: Any, dt: np.dtype, field: str) -> bytes:
    if not isinstance(v, str):
        raise InvalidSpecError(f"{field}: expected a base64 string for {dt}, got {v!r}")
    try:
        return base64.b64decode(v, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidSpecError(f"{field}: {v!r} is not valid base64 (a fill value for {dt})") from None


def _textual_from_json(v: Any, dt: np.dtype, field: str) -> Any:
    """A string, bytes or time fill value from its JSON (zarr v2 and v3 alike)."""
    k = dt.kind
    if k == "T":  # zarr-python reads a number as its decimal string
        if isinstance(v, str) or isinstance(v, (int, float)) and not isinstance(v, bool):
            return str(v)
    elif k == "U":
        if isinstance(v, str):
            if len(v) > dt.itemsize // 4:
                raise InvalidSpecError(f"{field}: {v!r} is longer than the {dt.itemsize // 4} characters of {dt}")
            return np.str_(v)
    elif k == "O":
        return _b64(v, dt, field)
    elif k in "SV":
        raw = _b64(v, dt, field)
        if len(raw) > dt.itemsize or k == "V" and len(raw) != dt.itemsize:
            raise InvalidSpecError(f"{field}: {len(raw)} bytes do not fit {dt}")
        return np.array(raw, dtype=dt)[()]
    elif v == "NaT":
        return np.array("NaT", dtype=dt)[()]
    elif isinstance(v, int) and not isinstance(v, bool):
        if not -(2**63) <= v < 2**63:
            raise InvalidSpecError(f"{field}: {v!r} is out of range for {dt}")
        return np.int64(v).view(dt)
    raise InvalidSpecError(f"{field}: {v!r} is not a valid fill value for {dt}")


def _textual_to_json(value: Any, dt: np.dtype) -> Any:
    """The JSON of a string, bytes or time fill value, as zarr-python writes it."""
    k = dt.kind
    if k in "TU":
        if not isinstance(value, str) or k == "U" and len(value) > dt.itemsize // 4:
            raise InvalidArgumentError(f"fill value {value!r} is not a string that fits {dt}")
        return str(value)
    if k in "OSV":
        if isinstance(value, np.void):
            value = value.tobytes()
        if not isinstance(value, bytes) or k != "O" and len(value) > dt.itemsize:
            raise InvalidArgumentError(f"fill value {value!r} is not bytes that fit {dt}")
        if k == "S":
            value = bytes(np.array(value, dtype=dt)[()])  # trailing NULs dropped, as numpy does
        elif k == "V":
            value = bytes(value).ljust(dt.itemsize, b"\0")
        return base64.standard_b64encode(value).decode()
    try:
        return int(np.array(value, dtype=dt).view(np.int64))
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(f"fill value {value!r} is not a valid {dt}: {e}") from None


def default_fill_value(dt: np.dtype) -> Any:
    """The fill value of an array whose metadata gives none (zarr v2 ``null``, a
    new array): NaT for times, empty strings/bytes, else zero, as zarr-python."""
    if dt.kind in "mM":
        return np.array("NaT", dtype=dt)[()]
    if dt == STRING_DTYPE:
        return ""
    if dt == BYTES_DTYPE:
        return b""
    return np.zeros((), dtype=dt)[()]


def fill_key(value: Any, dt: np.dtype) -> Any:
    """A comparable form of a decoded fill value (its bytes; the value itself for
    variable-length types, whose memory holds pointers)."""
    if is_variable_length(dt):
        return value
    return np.array(value, dtype=dt).tobytes()


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
    """Decode a zarr v3 JSON fill value into a numpy scalar of ``dt`` (a ``str`` or
    ``bytes`` for variable-length types)."""
    if v is None:
        raise InvalidSpecError(f"{field}: null is not allowed in zarr v3")
    if _is_textual(dt):
        return _textual_from_json(v, dt, field)
    if dt.kind == "c":
        if not (isinstance(v, list) and len(v) == 2):
            raise InvalidSpecError(f"{field}: expected [real, imag] for {dt}, got {v!r}")
        re = float(_scalar_from_json(v[0], dt, field))
        im = float(_scalar_from_json(v[1], dt, field))
        # .flat[0]: the 0-d array's scalar, as [()] gives it (numpy's stubs type [()] as an array)
        return np.array(complex(re, im), dtype=dt).flat[0]
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
    return np.array(s, dtype=dt).flat[0]


def _float_to_json(x: float) -> Any:
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    return float(x)


def fill_to_json(value: Any, dt: np.dtype) -> Any:
    """Encode a fill value as zarr v3 JSON (NaN payloads other than the default as hex)."""
    if _is_textual(dt):
        return _textual_to_json(value, dt)
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
    """A zarr v2 ``fill_value`` as a numpy scalar (``null``: :func:`default_fill_value`).

    Strings, bytes and times have the same JSON forms as in zarr v3 (bytes as
    base64, times as integers or "NaT")."""
    if v is None:
        return default_fill_value(dt)
    if _is_textual(dt):
        return _textual_from_json(v, dt, "zarr metadata field 'fill_value'")
    if isinstance(v, str) and v not in _SPECIAL and dt.kind not in "fc":
        # zarr v2 stores bytes fill values base64-encoded; accept for raw types
        try:
            raw = base64.standard_b64decode(v)
            return np.frombuffer(raw, dtype=dt)[0]
        except Exception:
            raise InvalidSpecError(f"zarr metadata field 'fill_value': {v!r} invalid for {dt}") from None
    return fill_from_json(v, dt, field="zarr metadata field 'fill_value'")


def fill_to_v2(value: Any, dt: np.dtype) -> Any:
    """The zarr v2 JSON of a fill value (None stays ``null``). Fixed-length bytes
    are padded to their size: TensorStore requires it, zarr-python strips the NULs."""
    if value is None:
        return None
    if dt.kind == "S":
        fill_to_json(value, dt)  # checks it
        return base64.standard_b64encode(np.array(value, dtype=dt).tobytes()).decode()
    return fill_to_json(value, dt)
