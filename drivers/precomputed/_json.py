"""Parsing JSON members with errors that name them (shared by ``info`` and ``sharding``)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from tensorstore_py.core.errors import InvalidSpecError

__all__ = ["member", "parse_enum", "parse_int", "spec_error"]


def spec_error(where: str, msg: str) -> InvalidSpecError:
    """InvalidSpecError for member ``where`` (a path such as ``scales[0].size[1]``)."""
    return InvalidSpecError(f"neuroglancer_precomputed {where}: {msg}")


def member(j: Mapping[str, Any], name: str, where: str) -> Any:
    """``j[name]``, or InvalidSpecError saying the member is required."""
    if name not in j:
        raise spec_error(f"{where}.{name}", "is required")
    return j[name]


def parse_int(v: Any, where: str, lo: int, hi: int) -> int:
    """An integer in [lo, hi]; integral floats (``10.0``) are accepted as TensorStore does."""
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise spec_error(where, f"expected an integer in [{lo}, {hi}], got {v!r}")
    return v


def parse_enum(v: Any, where: str, allowed: Collection[str]) -> str:
    if not isinstance(v, str) or v not in allowed:
        raise spec_error(where, f"expected one of {list(allowed)}, got {v!r}")
    return v
