"""How a value written to a view becomes an array of the view's dtype and shape:
numpy ``same_kind`` casting (Python scalars weakly typed, as in NEP 50) and
numpy broadcasting, with InvalidArgumentError before any I/O otherwise."""

from __future__ import annotations

from typing import Any

import numpy as np

from tensorstore_py.core.errors import InvalidArgumentError
from tensorstore_py.drivers.dtypes import as_variable_length, is_variable_length
from tensorstore_py.indexing import IndexDomain

__all__ = ["broadcast_value", "cast_value"]

_WEAK = (bool, int, float, complex)


def cast_value(value: Any, dtype: np.dtype) -> np.ndarray:
    """``value`` as an array of ``dtype`` under numpy ``same_kind`` rules.

    Python scalars and lists are weakly typed (as in numpy's NEP 50): a Python
    int may go into any integer dtype if it fits.
    """
    if is_variable_length(dtype):  # lists as objects: "U"/"S" arrays would drop trailing NULs
        src = value if isinstance(value, np.ndarray) else np.asarray(value, dtype=object)
        return as_variable_length(src, dtype)
    if isinstance(value, np.ndarray) and value.dtype == dtype:
        return value
    weak = isinstance(value, (_WEAK, list, tuple))
    src = np.asarray(value)
    if src.dtype == object:
        raise InvalidArgumentError(f"cannot write a value of {type(value).__name__} (object array)")
    ok = np.can_cast(src.dtype, dtype, "same_kind") or (
        weak and src.dtype.kind in "iu" and dtype.kind in "iu"
    )
    if not ok:
        raise InvalidArgumentError(
            f"cannot cast the value's dtype {src.dtype} to the array dtype {dtype} under "
            f"numpy 'same_kind' rules; cast it explicitly (value.astype(...)) first"
        )
    if src.dtype == dtype:
        return src
    try:
        return np.asarray(value, dtype=dtype) if weak else src.astype(dtype)
    except (OverflowError, ValueError) as e:
        raise InvalidArgumentError(f"value does not fit dtype {dtype}: {e}") from None


def broadcast_value(arr: np.ndarray, shape: tuple[int, ...], domain: IndexDomain) -> np.ndarray:
    # numpy assignment also drops leading length-1 axes of the value.
    while arr.ndim > len(shape) and arr.shape[0] == 1:
        arr = arr[0]
    if arr.shape == shape:
        return arr
    try:
        return np.broadcast_to(arr, shape)
    except ValueError:
        raise InvalidArgumentError(
            f"cannot write a value of shape {arr.shape} to a view of shape {shape} "
            f"(domain {domain}): the shapes do not broadcast"
        ) from None
