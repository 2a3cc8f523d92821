"""The codec registry: each codec module registers what it provides.

* A zarr v3 codec: its class, under its zarr v3 ``name`` (:func:`register_codec`,
  a class decorator). The chain builds it with ``cls.from_json(configuration,
  chunk)``, where ``chunk`` (:class:`~tensorstore_py.drivers.codecs.base.ChunkSpec`)
  carries the chunk shape, dtype and fill value the codec may need.
* The zarr v2 (numcodecs) compressor ids it decodes (:func:`register_v2_decoder`):
  a decoder that stops at the expected size (bombs, truncation), and what each
  field of the compressor's configuration may hold (checked when the array is
  opened). Other zarr v2 compressors are decoded by numcodecs and checked
  afterwards.
* The ``compression=`` alias of ``tsp.open`` (:func:`register_compression`): its
  default level and the zarr3 codec entry and zarr v2 compressor it stands for.

Importing :mod:`tensorstore_py.drivers.codecs` imports every built-in codec
module, so every lookup sees them all. Adding a codec = one module that
registers itself plus one import line in ``drivers/codecs/__init__.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np

from tensorstore_py.core.errors import InvalidArgumentError, InvalidSpecError, UnsupportedError
from tensorstore_py.drivers.codecs._limits import numcodecs_decode
from tensorstore_py.drivers.codecs.base import ChunkSpec, Codec
from tensorstore_py.kvstore.base import Buffer

__all__ = [
    "Compression",
    "V2Decoder",
    "V2Param",
    "codec_class",
    "codec_from_json",
    "codec_names",
    "compression_codecs",
    "compression_compressor",
    "register_codec",
    "register_compression",
    "register_v2_decoder",
    "v2_decoder",
]

C = TypeVar("C", bound=type[Codec])

_CODECS: dict[str, type[Codec]] = {}


def register_codec(cls: C) -> C:
    """Register the zarr v3 codec class ``cls`` under ``cls.name`` (a class decorator)."""
    other = _CODECS.get(cls.name)
    if not cls.name or other not in (None, cls):
        raise InvalidArgumentError(
            f"codec {cls.__name__}: zarr3 name {cls.name!r} is empty or taken by {other!r}"
        )
    _CODECS[cls.name] = cls
    return cls


def codec_class(name: str) -> type[Codec] | None:
    """The registered codec class for the zarr v3 ``name``, or None."""
    return _CODECS.get(name)


def codec_names() -> list[str]:
    """The registered zarr v3 codec names, sorted."""
    return sorted(_CODECS)


def codec_from_json(name: str, config: dict[str, Any], chunk: ChunkSpec, *, where: str) -> Codec:
    """Build the codec ``name`` from its configuration; UnsupportedError naming
    it and listing the supported ones when no module registered it."""
    cls = _CODECS.get(name)
    if cls is None:
        raise UnsupportedError(
            f"{where}: unsupported zarr3 codec {name!r}; supported: {', '.join(codec_names())}"
        )
    return cls.from_json(config, chunk)


# -- zarr v2 compressors ----------------------------------------------------------
@dataclass(frozen=True, slots=True)
class V2Param:
    """What one field of a zarr v2 compressor's configuration may hold:
    ``ok(value)`` says whether ``value`` is allowed, ``expected`` says what is
    (for the message)."""

    expected: str
    ok: Callable[[Any], bool]

    @staticmethod
    def integer(lo: int, hi: int) -> V2Param:
        return V2Param(f"an integer in [{lo}, {hi}]",
                       lambda v: isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi)

    @staticmethod
    def one_of(*values: Any) -> V2Param:
        return V2Param(f"one of {list(values)}", lambda v: not isinstance(v, bool) and any(
            type(v) is type(x) and v == x for x in values))

    @staticmethod
    def boolean() -> V2Param:
        return V2Param("true or false", lambda v: isinstance(v, bool))


class V2Decode(Protocol):
    # codec and buf positional-only: decoders name their codec after its class (``b: Blosc``)
    def __call__(self, codec: Any, buf: Buffer, /, *, key: str, size: int | None, limit: int,
                 out: Buffer | None) -> Buffer: ...


@dataclass(frozen=True, slots=True)
class V2Decoder:
    """A checked decoder for the numcodecs compressor ``codec_id``.

    ``decode(codec, buf, key=, size=, limit=, out=)`` gets the numcodecs codec
    object, the exact decoded size when known and the most it may produce;
    ``decodes_into``: it may write the result into ``out``.
    """

    codec_id: str
    decode: V2Decode
    decodes_into: bool = False
    #: the configuration fields whose values it checks (see :meth:`check_config`)
    params: Mapping[str, V2Param] = field(default_factory=dict)

    def check_config(self, config: Mapping[str, Any], where: str) -> None:
        """InvalidSpecError naming ``where`` and the field when a field of the
        compressor's configuration holds a value it can not use (numcodecs
        would accept it and fail at the first write)."""
        for name, param in self.params.items():
            if name in config and not param.ok(config[name]):
                raise InvalidSpecError(
                    f"{where}: {self.codec_id} field {name!r}: expected {param.expected}, "
                    f"got {config[name]!r}"
                )


_V2: dict[str, V2Decoder] = {}


def register_v2_decoder(codec_id: str, decode: V2Decode, *, decodes_into: bool = False,
                        params: Mapping[str, V2Param] | None = None) -> None:
    """Register the checked decoder of the numcodecs compressor ``codec_id``
    and what each field of its configuration may hold (``params``)."""
    if codec_id in _V2:
        raise InvalidArgumentError(f"a zarr v2 decoder for {codec_id!r} is already registered")
    _V2[codec_id] = V2Decoder(codec_id, decode, decodes_into, dict(params or {}))


def v2_decoder(codec_id: str) -> V2Decoder:
    """The checked decoder of the numcodecs compressor ``codec_id`` (without a
    registered one: numcodecs decodes, the size is checked afterwards)."""
    return _V2.get(codec_id) or V2Decoder(codec_id, numcodecs_decode)


# -- compression= aliases -----------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Compression:
    """What ``compression=name`` or ``(name, level)`` means in each format.

    ``zarr3(level, dtype)``: the zarr3 codec entry; ``zarr2(level, dtype)``: the
    numcodecs compressor configuration; ``level`` is ``default_level`` when not given.
    """

    name: str
    default_level: int
    zarr3: Callable[[int, np.dtype], dict[str, Any]]
    zarr2: Callable[[int, np.dtype], dict[str, Any]]


_COMPRESSIONS: dict[str, Compression] = {}


def register_compression(c: Compression) -> None:
    """Make ``c.name`` a value of ``compression=``."""
    if c.name in _COMPRESSIONS:
        raise InvalidArgumentError(f"compression {c.name!r} is already registered")
    _COMPRESSIONS[c.name] = c


def _compression(compression: Any) -> tuple[Compression, int]:
    if isinstance(compression, str):
        name, level = compression, None
    else:
        try:
            name, level = compression
        except (TypeError, ValueError):
            name, level = None, None
    c = _COMPRESSIONS.get(name) if isinstance(name, str) else None
    if c is None:
        names = ", ".join(repr(n) for n in sorted(_COMPRESSIONS))
        raise InvalidArgumentError(
            f"compression must be one of {names}, a (name, level) pair, or None; got {compression!r}"
        )
    return c, c.default_level if level is None else level


def compression_codecs(compression: Any, dtype: np.dtype) -> list[dict[str, Any]]:
    """The zarr3 bytes->bytes codec entries for ``compression`` ([] for None)."""
    if compression is None:
        return []
    c, level = _compression(compression)
    return [c.zarr3(level, dtype)]


def compression_compressor(compression: Any, dtype: np.dtype) -> dict[str, Any] | None:
    """The zarr v2 ``compressor`` for ``compression`` (None for None)."""
    if compression is None:
        return None
    c, level = _compression(compression)
    return c.zarr2(level, dtype)
