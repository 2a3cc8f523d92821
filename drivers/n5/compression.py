"""N5 compressions: the ``"compression"`` object of attributes.json and the codec
behind each ``"type"``.

=========  =========================================  ===============================
type       parameters (default)                       bytes
=========  =========================================  ===============================
raw        -                                          the data itself
gzip       level (-1), useZlib (false)                gzip member(s); zlib stream if useZlib
bzip2      blockSize (9)                              one bzip2 stream
xz         preset (6)                                 one .xz stream (CRC64 check)
blosc      cname, clevel, shuffle, blocksize          one blosc1 buffer (typesize = element size)
zstd       level (3)                                  one zstd frame
lz4        blockSize (65536)                          lz4-java LZ4Block frames (see lz4block)
=========  =========================================  ===============================

Defaults are N5-Java's (and its n5-blosc / n5-zstandard plugins'); parameters a
writer added that this module does not use (n5-blosc's ``nthreads``, ...) are
kept and written back unchanged. The legacy (pre-1.0) ``"compressionType": "gzip"``
string names a type with default parameters.

Every decoder is told the exact decoded size (the block header fixes it) and
never allocates more: a stream that would decode to more (a bomb, a lying
header) or to less raises DataCorruptionError naming the block's key, and so
do undecodable bytes. The streaming formats stop after ``size + 1`` output
bytes; blosc, zstd and lz4 check the sizes their headers declare first.
Encoders produce what N5-Java and TensorStore read.
"""

from __future__ import annotations

import bz2
import lzma
import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from numcodecs import Blosc, Zstd
from numcodecs.blosc import list_compressors

from tensorstore_py.core.errors import InvalidSpecError, UnsupportedError
from tensorstore_py.core.ranges import Buffer
from tensorstore_py.drivers.codecs._limits import LZMA_MEMLIMIT, check_size, decompress_bounded
from tensorstore_py.drivers.codecs.blosc_codec import blosc_decode, own_threads_only
from tensorstore_py.drivers.codecs.zstd_codec import zstd_decode
from tensorstore_py.drivers.n5.lz4block import MAX_BLOCK_SIZE, MIN_BLOCK_SIZE
from tensorstore_py.drivers.n5.lz4block import decode as lz4_decode
from tensorstore_py.drivers.n5.lz4block import encode as lz4_encode

__all__ = [
    "COMPRESSIONS",
    "BloscCompression",
    "Bzip2Compression",
    "Compression",
    "GzipCompression",
    "Lz4Compression",
    "RawCompression",
    "XzCompression",
    "ZstdCompression",
    "compression_from_json",
]

_FIELD = "n5 attributes field 'compression"


@dataclass(frozen=True)
class Param:
    """One parameter: its attributes.json name, the attribute holding it, its
    JSON type and its allowed values (an integer range or a list of strings)."""

    name: str
    attr: str
    kind: type
    lo: int | None = None
    hi: int | None = None
    choices: tuple[str, ...] = ()

    def parse(self, config: dict[str, Any], default: Any) -> Any:
        v = config.get(self.name, default)
        ok = isinstance(v, self.kind) and not (self.kind is int and isinstance(v, bool))
        if ok and self.kind is int:
            ok = (self.lo is None or v >= self.lo) and (self.hi is None or v <= self.hi)
        if ok and self.choices:
            ok = v in self.choices
        if not ok:
            expected = (f"one of {list(self.choices)}" if self.choices else
                        f"an integer in [{self.lo}, {self.hi}]" if self.kind is int else f"a {self.kind.__name__}")
            raise InvalidSpecError(f"{_FIELD}.{self.name}': expected {expected}, got {v!r}")
        return v


@dataclass(frozen=True)
class Compression(ABC):
    """One ``"compression"`` object: its parameters and its codec.

    A subclass declares its ``type``, its parameters (dataclass fields with
    N5-Java's defaults, described by ``PARAMS``) and the codec.
    """

    type: ClassVar[str]
    PARAMS: ClassVar[tuple[Param, ...]] = ()
    #: parameters of the stored object this class does not interpret, written back as found
    extra: dict[str, Any] = field(default_factory=dict, kw_only=True, hash=False)

    @classmethod
    def from_json(cls, config: dict[str, Any]) -> Compression:
        """The compression described by ``config`` (the object without ``"type"``)."""
        defaults = {f.name: f.default for f in fields(cls)}
        values = {p.attr: p.parse(config, defaults[p.attr]) for p in cls.PARAMS}
        names = {p.name for p in cls.PARAMS}
        return cls(**values, extra={k: v for k, v in config.items() if k not in names})

    def to_json(self) -> dict[str, Any]:
        return {"type": self.type, **{p.name: getattr(self, p.attr) for p in self.PARAMS}, **self.extra}

    @abstractmethod
    def encode(self, data: Buffer, *, itemsize: int) -> Buffer:
        """Compress a block's big-endian element bytes (``itemsize`` bytes each)."""

    @abstractmethod
    def decode(self, data: Buffer, *, size: int, key: str) -> Buffer:
        """Exactly ``size`` decoded bytes, or DataCorruptionError naming ``key``."""


@dataclass(frozen=True)
class RawCompression(Compression):
    """The block's bytes as they are."""

    type: ClassVar[str] = "raw"

    def encode(self, data: Buffer, *, itemsize: int) -> Buffer:
        return data

    def decode(self, data: Buffer, *, size: int, key: str) -> Buffer:
        check_size("raw", key, memoryview(data).nbytes, size, size)
        return data


@dataclass(frozen=True)
class GzipCompression(Compression):
    """Deflate, in a gzip wrapper (N5-Java: commons-compress) or, with
    ``use_zlib``, a zlib wrapper (``DeflaterOutputStream``). ``level`` -1 is
    zlib's default (6)."""

    type: ClassVar[str] = "gzip"
    PARAMS: ClassVar[tuple[Param, ...]] = (Param("level", "level", int, -1, 9),
                                           Param("useZlib", "use_zlib", bool))
    level: int = -1
    use_zlib: bool = False

    def encode(self, data: Buffer, *, itemsize: int) -> Buffer:
        return zlib.compress(data, self.level, wbits=15 if self.use_zlib else 31)

    def decode(self, data: Buffer, *, size: int, key: str) -> Buffer:
        # wbits 47: either wrapper is accepted (the flag only says which one is written)
        return decompress_bounded(lambda: zlib.decompressobj(47), data, codec=self.type, key=key,
                                  size=size, limit=size, members=not self.use_zlib)


@dataclass(frozen=True)
class Bzip2Compression(Compression):
    """One bzip2 stream (N5-Java: commons-compress); ``blockSize`` in 100 kB units."""

    type: ClassVar[str] = "bzip2"
    PARAMS: ClassVar[tuple[Param, ...]] = (Param("blockSize", "block_size", int, 1, 9),)
    block_size: int = 9

    def encode(self, data: Buffer, *, itemsize: int) -> Buffer:
        return bz2.compress(data, self.block_size)

    def decode(self, data: Buffer, *, size: int, key: str) -> Buffer:
        return decompress_bounded(bz2.BZ2Decompressor, data, codec=self.type, key=key, size=size,
                                  limit=size, members=False)


@dataclass(frozen=True)
class XzCompression(Compression):
    """One .xz stream with a CRC64 check (N5-Java: commons-compress). The
    decoder's own memory is capped too: an .xz header declares its dictionary
    size, and a hostile one could ask for 1.5 GiB."""

    type: ClassVar[str] = "xz"
    PARAMS: ClassVar[tuple[Param, ...]] = (Param("preset", "preset", int, 0, 9),)
    preset: int = 6

    def encode(self, data: Buffer, *, itemsize: int) -> Buffer:
        return lzma.compress(data, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=self.preset)

    def decode(self, data: Buffer, *, size: int, key: str) -> Buffer:
        new = lambda: lzma.LZMADecompressor(lzma.FORMAT_XZ, memlimit=size + LZMA_MEMLIMIT)  # noqa: E731
        return decompress_bounded(new, data, codec=self.type, key=key, size=size, limit=size,
                                  members=False)


@dataclass(frozen=True)
class BloscCompression(Compression):
    """c-blosc 1 (n5-blosc). ``shuffle``: 0 none, 1 byte, 2 bit, -1 auto (bit
    for 1-byte elements, else byte). Blocks are compressed with the element
    size as blosc's typesize (as TensorStore does; n5-blosc passes 1); the
    decoder reads it from the blosc header, so both read back."""

    type: ClassVar[str] = "blosc"
    PARAMS: ClassVar[tuple[Param, ...]] = (
        Param("cname", "cname", str, choices=("blosclz", "lz4", "lz4hc", "snappy", "zlib", "zstd")),
        Param("clevel", "clevel", int, 0, 9), Param("shuffle", "shuffle", int, -1, 2),
        Param("blocksize", "blocksize", int, 0, 2**31 - 1))
    cname: str = "blosclz"
    clevel: int = 6
    shuffle: int = 0
    blocksize: int = 0

    def encode(self, data: Buffer, *, itemsize: int) -> Buffer:
        if self.cname not in _BLOSC_BUILT_IN:
            raise UnsupportedError(f"n5 blosc compression: this blosc build has no {self.cname!r} codec")
        codec = Blosc(cname=self.cname, clevel=self.clevel, shuffle=self.shuffle, blocksize=self.blocksize,
                      typesize=itemsize)
        return own_threads_only(codec.encode, data)

    def decode(self, data: Buffer, *, size: int, key: str) -> Buffer:
        return blosc_decode(_BLOSC_DECODER, data, key=key, size=size, limit=size)


_BLOSC_DECODER = Blosc()  # decoding reads everything it needs from the blosc header
_BLOSC_BUILT_IN = frozenset(list_compressors())  # numcodecs' blosc has no snappy


@dataclass(frozen=True)
class ZstdCompression(Compression):
    """One zstd frame (n5-zstandard; its default level 3)."""

    type: ClassVar[str] = "zstd"
    PARAMS: ClassVar[tuple[Param, ...]] = (Param("level", "level", int, -131072, 22),)
    level: int = 3

    def encode(self, data: Buffer, *, itemsize: int) -> Buffer:
        return Zstd(level=self.level).encode(data)  # one-shot: the frame declares its size

    def decode(self, data: Buffer, *, size: int, key: str) -> Buffer:
        if size == 0:  # numcodecs streams a frame that declares 0 bytes, unbounded
            return b""
        # bounded whether or not the frame declares its size (n5-zstandard's
        # streaming writer does not): see zstd_decode
        return zstd_decode(_ZSTD_DECODER, data, key=key, size=size, limit=size)


_ZSTD_DECODER = Zstd()


@dataclass(frozen=True)
class Lz4Compression(Compression):
    """lz4-java's LZ4Block stream (N5-Java); see :mod:`.lz4block`."""

    type: ClassVar[str] = "lz4"
    PARAMS: ClassVar[tuple[Param, ...]] = (Param("blockSize", "block_size", int, MIN_BLOCK_SIZE, MAX_BLOCK_SIZE),)
    block_size: int = 1 << 16

    def encode(self, data: Buffer, *, itemsize: int) -> Buffer:
        return lz4_encode(data, block_size=self.block_size)

    def decode(self, data: Buffer, *, size: int, key: str) -> Buffer:
        return lz4_decode(data, size=size, key=key)


#: ``"type"`` -> class, for every compression this package reads and writes
COMPRESSIONS: dict[str, type[Compression]] = {
    c.type: c for c in (RawCompression, GzipCompression, Bzip2Compression, XzCompression,
                        BloscCompression, ZstdCompression, Lz4Compression)
}


def compression_from_json(obj: Any) -> Compression:
    """The compression an attributes.json ``"compression"`` object describes
    (absent parameters take their defaults).

    Raises InvalidSpecError for a malformed object or parameter (naming the
    field) and UnsupportedError for a type this package does not know.
    """
    if not isinstance(obj, dict):
        raise InvalidSpecError(f"{_FIELD}': expected an object with a \"type\", got {obj!r}")
    name = obj.get("type")
    if not isinstance(name, str):
        raise InvalidSpecError(f"{_FIELD}.type': expected a string, got {name!r}")
    cls = COMPRESSIONS.get(name)
    if cls is None:
        raise UnsupportedError(
            f"n5 compression {name!r} is not supported; supported: {', '.join(COMPRESSIONS)}")
    return cls.from_json({k: v for k, v in obj.items() if k != "type"})
