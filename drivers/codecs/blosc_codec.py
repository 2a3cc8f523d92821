"""``blosc`` through numcodecs (C, releases the GIL).

Also decodes the zarr v2 compressor ``blosc``, and is ``compression="blosc"``
(lz4, clevel 5, byte shuffle for types wider than one byte).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import numcodecs.blosc as _blosc
from numcodecs import Blosc

from tensorstore_py.core.errors import DataCorruptionError, InvalidSpecError
from tensorstore_py.drivers.codecs._limits import check_size
from tensorstore_py.drivers.codecs.base import BytesBytesCodec, ChunkSpec
from tensorstore_py.drivers.codecs.registry import (
    Compression,
    V2Param,
    register_codec,
    register_compression,
    register_v2_decoder,
)
from tensorstore_py.kvstore.base import Buffer

_SHUFFLE = {"noshuffle": Blosc.NOSHUFFLE, "shuffle": Blosc.SHUFFLE, "bitshuffle": Blosc.BITSHUFFLE}
_CNAMES = ("blosclz", "lz4", "lz4hc", "zlib", "zstd", "snappy")


T = TypeVar("T")


def own_threads_only(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, a numcodecs blosc call, without c-blosc's own threads.

    numcodecs lets c-blosc decode or encode one buffer on threads of its own
    (behind one process-wide lock) when called from the main thread and
    ``numcodecs.blosc.use_threads`` is None, its default. The engine already
    spreads chunks over its threads, and reads of local files run on the
    caller's thread: there c-blosc's threads only compete with ours (64^3 N5
    crops: 2.60-2.80 ms each without them, 3.54-3.67 ms with them; 2 cores).
    So on the main thread, with that default, the call runs with
    ``use_threads = False``. Other threads see no change (None means False for
    them), and the main thread is busy with this call. A value the user set
    (True or False) is left alone.
    """
    if _blosc.use_threads is None and threading.current_thread() is threading.main_thread():
        _blosc.use_threads = False
        try:
            return fn(*args)
        finally:
            if _blosc.use_threads is False:
                _blosc.use_threads = None
    return fn(*args)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def blosc_decode(b: Blosc, buf: Buffer, *, key: str, size: int | None, limit: int,
                 out: Buffer | None = None) -> Buffer:
    """Decode a blosc buffer after checking the sizes in its header."""
    mv = memoryview(buf).cast("B")
    if len(mv) < 16:
        raise DataCorruptionError(f"chunk {key!r}: {len(mv)} bytes, too short for blosc data")
    nbytes, cbytes, _blocksize = _blosc._cbuffer_sizes(mv)
    if cbytes != len(mv):
        raise DataCorruptionError(
            f"chunk {key!r}: blosc header declares {cbytes} compressed bytes, found {len(mv)}"
        )
    check_size("blosc", key, nbytes, size, limit)
    try:
        if out is not None and len(out) == nbytes:
            return own_threads_only(b.decode, mv, out)
        return own_threads_only(b.decode, mv)
    except Exception as e:
        raise DataCorruptionError(f"chunk {key!r}: invalid blosc data: {e}") from None


@register_codec
class BloscCodec(BytesBytesCodec):
    name = "blosc"
    decodes_into = True

    def __init__(self, *, cname: str = "lz4", clevel: int = 5, shuffle: str = "noshuffle",
                 typesize: int | None = None, blocksize: int = 0) -> None:
        if cname not in _CNAMES:
            raise InvalidSpecError(f"blosc codec: 'cname' must be one of {_CNAMES}, got {cname!r}")
        if not _is_int(clevel) or not 0 <= clevel <= 9:
            raise InvalidSpecError(f"blosc codec: 'clevel' must be 0..9, got {clevel!r}")
        if not isinstance(shuffle, str) or shuffle not in _SHUFFLE:
            raise InvalidSpecError(f"blosc codec: 'shuffle' must be one of {list(_SHUFFLE)}, got {shuffle!r}")
        if typesize is not None and (not _is_int(typesize) or not 1 <= typesize <= 255):
            raise InvalidSpecError(f"blosc codec: 'typesize' must be 1..255, got {typesize!r}")
        if shuffle != "noshuffle" and typesize is None:
            raise InvalidSpecError("blosc codec: 'typesize' (1..255) is required with shuffle")
        if not _is_int(blocksize) or not 0 <= blocksize < 2**31:
            raise InvalidSpecError(f"blosc codec: 'blocksize' must be 0..2^31-1, got {blocksize!r}")
        self.cname, self.clevel, self.shuffle = cname, clevel, shuffle
        self.typesize, self.blocksize = typesize, blocksize
        self._b = Blosc(cname=cname, clevel=clevel, shuffle=_SHUFFLE[shuffle],
                        blocksize=blocksize, typesize=typesize or 1)

    @classmethod
    def from_json(cls, config: dict[str, Any], chunk: ChunkSpec) -> BloscCodec:
        itemsize = chunk.dtype.itemsize
        unknown = set(config) - {"cname", "clevel", "shuffle", "typesize", "blocksize"}
        if unknown:
            raise InvalidSpecError(f"blosc codec: unknown configuration fields {sorted(unknown)}")
        shuffle = config.get("shuffle", "noshuffle" if itemsize == 1 else "shuffle")
        typesize = config.get("typesize", itemsize if shuffle != "noshuffle" else None)
        return cls(cname=config.get("cname", "lz4"), clevel=config.get("clevel", 5),
                   shuffle=shuffle, typesize=typesize, blocksize=config.get("blocksize", 0))

    def to_json(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {"cname": self.cname, "clevel": self.clevel, "shuffle": self.shuffle,
                               "blocksize": self.blocksize}
        if self.typesize is not None:
            cfg["typesize"] = self.typesize
        return {"name": "blosc", "configuration": cfg}

    def encode(self, buf: Buffer) -> Buffer:
        return own_threads_only(self._b.encode, buf)

    def decode(self, buf: Buffer, *, key: str, size: int | None, limit: int,
               out: Buffer | None = None) -> Buffer:
        return blosc_decode(self._b, buf, key=key, size=size, limit=limit, out=out)


register_v2_decoder("blosc", blosc_decode, decodes_into=True, params={
    "cname": V2Param.one_of(*_CNAMES), "clevel": V2Param.integer(0, 9),
    "shuffle": V2Param.one_of(-1, 0, 1, 2), "blocksize": V2Param.integer(0, 2**31 - 1),
    "typesize": V2Param("null or an integer in [1, 255]", lambda v: v is None or (
        isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 255)),
})
register_compression(Compression(
    "blosc", default_level=5,
    zarr3=lambda level, dtype: {"name": "blosc", "configuration": {
        "cname": "lz4", "clevel": level, "shuffle": "noshuffle" if dtype.itemsize == 1 else "shuffle",
        "typesize": dtype.itemsize, "blocksize": 0}},
    # numcodecs' byte shuffle (1) whatever the itemsize, as zarr-python writes it
    zarr2=lambda level, dtype: {"id": "blosc", "cname": "lz4", "clevel": level, "shuffle": 1,
                                "blocksize": 0},
))
