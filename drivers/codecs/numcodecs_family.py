"""The zarr3 ``numcodecs.*`` codecs zarr-python 3 writes, delegated to numcodecs.

zarr-python 3 stores a numcodecs codec as ``{"name": "numcodecs.<id>",
"configuration": {<its numcodecs config without "id">}}``. Each id below is
registered under that name, of the kind numcodecs' semantics give it (as
zarr-python classifies them):

* array->array: ``delta``, ``fixedscaleoffset``, ``quantize``, ``bitround``,
  ``packbits``, ``astype``. Their input is the exact array of the stage before
  (a decoded chunk's size is checked by the array->bytes codec), so their output
  is bounded by it; it is checked against the chunk's shape.
* bytes->bytes compressors: ``zlib``, ``gzip``, ``bz2``, ``lzma``, ``lz4``,
  ``zstd``, ``blosc``. numcodecs encodes; decoding goes through the checked
  decoder registered for the numcodecs id (drivers/codecs/registry.py: a cap on
  the output, header sizes checked before decompressing), never through an
  unbounded numcodecs ``decode``.
* bytes->bytes filters and checksums: ``shuffle``, ``crc32``, ``crc32c``,
  ``adler32``, ``fletcher32``, ``jenkins_lookup3``: numcodecs decodes (the output
  is never larger than the input; a checksum mismatch is a DataCorruptionError).

Defaults are filled in as zarr-python fills them from the array: ``shuffle``'s
``elementsize``, ``fixedscaleoffset``'s and ``quantize``'s ``dtype``, ``astype``'s
``decode_dtype`` (from the dtype the codec sees). Chunks are handed to numcodecs
in C order. numcodecs ids not listed (``pcodec``, ``zfpy``, ...) are unsupported.
"""

from __future__ import annotations

import math
from typing import Any

import numcodecs
import numpy as np

from tensorstore_py.core.errors import DataCorruptionError, InvalidSpecError
from tensorstore_py.drivers.codecs.base import ArrayArrayCodec, BytesBytesCodec, ChunkSpec
from tensorstore_py.drivers.codecs.registry import register_codec, v2_decoder
from tensorstore_py.kvstore.base import Buffer

__all__ = ["ARRAY_TO_ARRAY", "CHECKSUMS", "COMPRESSORS", "FILTERS", "PREFIX"]

PREFIX = "numcodecs."
ARRAY_TO_ARRAY = ("delta", "fixedscaleoffset", "quantize", "bitround", "packbits", "astype")
COMPRESSORS = ("zlib", "gzip", "bz2", "lzma", "lz4", "zstd", "blosc")
FILTERS = ("shuffle",)
#: checksums that append 4 bytes
CHECKSUMS = ("crc32", "crc32c", "adler32", "fletcher32", "jenkins_lookup3")

# zarr-python fills these configuration fields from the array's dtype when absent
_FROM_DTYPE = {"shuffle": ("elementsize", lambda dt: dt.itemsize),
               "fixedscaleoffset": ("dtype", lambda dt: dt.str),
               "quantize": ("dtype", lambda dt: dt.str),
               "astype": ("decode_dtype", lambda dt: dt.str)}
# mantissa bits per float itemsize (bitround keeps at most that many)
_MANTISSA = {2: 10, 4: 23, 8: 52}


def _numcodec(cls: type[_NumcodecsBytesBytes | _NumcodecsArrayArray], config: dict[str, Any], chunk: ChunkSpec) -> Any:
    """The numcodecs codec for ``config`` (defaults filled as zarr-python fills them)."""
    cid = cls.codec_id
    if config.get("id", cid) != cid:
        raise InvalidSpecError(f"{cls.name} codec: configuration 'id' {config['id']!r} is not {cid!r}")
    cfg = {**config, "id": cid}
    if cid in COMPRESSORS:  # values numcodecs takes now and fails on at the first write
        v2_decoder(cid).check_config(cfg, f"{cls.name} codec")
    if cid in _FROM_DTYPE:
        field, default = _FROM_DTYPE[cid]
        if cfg.get(field) is None:
            cfg[field] = default(chunk.dtype)
    try:
        return numcodecs.get_codec(cfg)
    except (TypeError, ValueError) as e:
        raise InvalidSpecError(f"{cls.name} codec: bad configuration {config!r}: {e}") from None


def _config_json(codec: Any) -> dict[str, Any]:
    cfg = dict(codec.get_config())
    cfg.pop("id", None)
    return cfg


class _NumcodecsBytesBytes(BytesBytesCodec):
    """A numcodecs bytes->bytes codec; decoding through the checked decoder
    registered for its id (an unbounded numcodecs decode only for codecs whose
    output is no larger than their input)."""

    codec_id = ""

    def __init__(self, codec: Any) -> None:
        self._c = codec
        self._decoder = v2_decoder(self.codec_id)
        self.decodes_into = self._decoder.decodes_into

    @classmethod
    def from_json(cls, config: dict[str, Any], chunk: ChunkSpec) -> _NumcodecsBytesBytes:
        return cls(_numcodec(cls, config, chunk))

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "configuration": _config_json(self._c)}

    def encode(self, buf: Buffer) -> Buffer:
        out = self._c.encode(buf)
        return np.ascontiguousarray(out).data.cast("B") if isinstance(out, np.ndarray) else out

    def decode(self, buf: Buffer, *, key: str, size: int | None, limit: int,
               out: Buffer | None = None) -> Buffer:
        return self._decoder.decode(self._c, buf, key=key, size=size, limit=limit, out=out)

    def encoded_size(self, size: int | None) -> int | None:
        if size is None:
            return None
        if self.codec_id in FILTERS:
            return size
        if self.codec_id in CHECKSUMS and not getattr(self._c, "prefix", None):
            return size + 4
        return None


def _reshaped(a: Any, shape: tuple[int, ...], dtype: np.dtype, what: str) -> np.ndarray:
    """``a`` as an array of exactly ``shape``/``dtype`` (numcodecs returns flat
    arrays, and some of an equal-sized dtype, e.g. bitround's integers)."""
    a = np.asarray(a)
    n = math.prod(shape)
    if a.size != n:
        raise DataCorruptionError(f"{what}: {a.size} elements, expected {n}")
    if a.dtype != dtype:
        a = a.view(dtype) if a.dtype.itemsize == dtype.itemsize else a.astype(dtype)
    return a.reshape(shape)


class _NumcodecsArrayArray(ArrayArrayCodec):
    """A numcodecs array->array codec over C-order chunks of ``shape``/``dtype``."""

    codec_id = ""

    def __init__(self, codec: Any, shape: tuple[int, ...], dtype: np.dtype) -> None:
        self._c = codec
        self.in_shape, self.in_dtype = shape, dtype
        self.out_shape, self.out_dtype = self.resolve(shape, dtype)

    @classmethod
    def from_json(cls, config: dict[str, Any], chunk: ChunkSpec) -> _NumcodecsArrayArray:
        codec = _numcodec(cls, config, chunk)
        _check_input(cls.name, codec, chunk.dtype)
        return cls(codec, tuple(chunk.shape), chunk.dtype)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "configuration": _config_json(self._c)}

    def resolve(self, shape: tuple[int, ...], dtype: np.dtype) -> tuple[tuple[int, ...], np.dtype]:
        cfg = self._c.get_config()
        cid = self.codec_id
        if cid == "packbits":  # one byte saying how many bits of the last are padding
            return (1 + -(-math.prod(shape) // 8),), np.dtype("uint8")
        if cid == "bitround":
            return shape, dtype
        out = cfg["encode_dtype"] if cid == "astype" else cfg.get("astype") or cfg["dtype"]
        return shape, np.dtype(out)

    def encode(self, a: np.ndarray) -> np.ndarray:
        out = self._c.encode(np.ascontiguousarray(a))
        return _reshaped(out, self.out_shape, self.out_dtype, f"{self.name} codec")

    def decode(self, a: np.ndarray) -> np.ndarray:
        try:
            out = self._c.decode(np.ascontiguousarray(a))
        except (ValueError, TypeError) as e:
            raise DataCorruptionError(f"{self.name} codec: cannot decode: {e}") from None
        return _reshaped(out, self.in_shape, self.in_dtype, f"{self.name} codec: decoded chunk")


def _check_input(name: str, codec: Any, dtype: np.dtype) -> None:
    """The chunk dtype must be one the codec's numcodecs class accepts (it
    reinterprets its input as its configured dtype: the sizes must agree)."""
    cid = codec.codec_id
    if cid == "packbits":
        if dtype != np.dtype(bool):
            raise InvalidSpecError(f"{name} codec: encodes bool arrays, not {dtype}")
        return
    if cid == "bitround":
        if dtype.kind != "f" or dtype.itemsize not in _MANTISSA:
            raise InvalidSpecError(f"{name} codec: encodes float16/32/64 arrays, not {dtype}")
        if codec.keepbits > _MANTISSA[dtype.itemsize]:
            raise InvalidSpecError(
                f"{name} codec: keepbits {codec.keepbits} exceeds the {_MANTISSA[dtype.itemsize]} "
                f"mantissa bits of {dtype}"
            )
        return
    field = "decode_dtype" if cid == "astype" else "dtype"
    want = np.dtype(codec.get_config()[field])
    if want.itemsize != dtype.itemsize or want.kind not in "iufc" or dtype.kind not in "iufcbmM":
        raise InvalidSpecError(f"{name} codec: its {field} {want} does not fit the array's {dtype}")


# One registered class per numcodecs id (the registry maps a zarr3 name to a class).
for _cid in ARRAY_TO_ARRAY:
    register_codec(type(f"Numcodecs_{_cid}", (_NumcodecsArrayArray,),
                        {"name": PREFIX + _cid, "codec_id": _cid, "__module__": __name__}))
for _cid in (*COMPRESSORS, *FILTERS, *CHECKSUMS):
    register_codec(type(f"Numcodecs_{_cid}", (_NumcodecsBytesBytes,),
                        {"name": PREFIX + _cid, "codec_id": _cid, "__module__": __name__}))
