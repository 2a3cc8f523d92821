"""Chunks stored with a compression suffix, as CloudVolume writes them to local disk.

CloudVolume (through CloudFiles) stores a chunk ``<key>`` written with
compression as ``<key>.gz`` (gzip, its default for the ``raw``,
``compressed_segmentation`` and ``compresso`` encodings), ``<key>.br``
(brotli), ``<key>.zstd``, ``<key>.xz`` or ``<key>.bz2`` on ``file://`` paths
(on object stores it uses ``Content-Encoding`` instead, which those stores'
clients undo). Its reader probes ``<key>`` first, then the suffixes in that
order; the ``info`` file is written plain, and shards only carry a suffix when
the writer asked for whole-shard compression (not read here).

:class:`SuffixedChunks` wraps the store holding a scale's unsharded chunks:

- a read of ``<key>`` returns ``<key>``'s value if it exists, else the
  decompressed value of the first suffixed file found, with that file's
  generation;
- a write stores the plain ``<key>`` and then deletes any suffixed copies (a
  crash in between leaves both, and the plain one is read first, so readers
  never see the older value); a conditional write whose generation is a
  suffixed copy's writes ``<key>`` create-only;
- a delete removes the suffixed copies first, then ``<key>`` (a crash in
  between leaves the newer plain value).

Each chunk therefore stays atomic to readers; what is not atomic is the
replacement of a suffixed copy against a concurrent CloudVolume writer of the
same chunk.
"""

from __future__ import annotations

import bz2
import lzma
import os
import zlib
from typing import Any

from numcodecs import Zstd

from tensorstore_py.core.errors import ConditionFailedError, DataCorruptionError, UnsupportedError
from tensorstore_py.kvstore.base import Buffer, ByteRange, Generation, KvStore, ReadResult

try:  # optional: only CloudVolume's .br chunks need it
    import brotli as _brotli  # type: ignore[import-not-found]
except ImportError:
    _brotli = None

__all__ = ["SUFFIXES", "SuffixedChunks", "has_suffixed_chunks"]

#: CloudFiles' probe order after the plain key, with the compression each names
SUFFIXES: tuple[tuple[str, str], ...] = (
    (".gz", "gzip"), (".br", "brotli"), (".zstd", "zstd"), (".xz", "xz"), (".bz2", "bzip2"),
)
_SCAN_ENTRIES = 1000


def has_suffixed_chunks(kv: KvStore, prefix: str) -> bool:
    """True when ``kv`` is a file store and the folder ``prefix`` (a scale's) holds a
    file with a compression suffix among its first directory entries (a volume
    written by CloudVolume with compression). Reads at most ``_SCAN_ENTRIES``
    entries of one folder."""
    if kv.driver != "file":
        return False
    try:
        with os.scandir(kv.path + prefix) as it:
            for n, entry in enumerate(it):
                if entry.name.endswith(tuple(s for s, _ in SUFFIXES)):
                    return True
                if n >= _SCAN_ENTRIES:
                    break
    except OSError:
        return False
    return False


def _decompress(method: str, data: bytes, key: str) -> bytes:
    try:
        if method == "gzip":
            return zlib.decompress(data, wbits=47)  # gzip or zlib header
        if method == "zstd":
            return bytes(Zstd().decode(data))
        if method == "xz":
            return lzma.decompress(data)
        if method == "bzip2":
            return bz2.decompress(data)
        if _brotli is None:
            raise UnsupportedError(f"{key!r} is brotli-compressed (its .br suffix): install the "
                                   f"'brotli' package to read it")
        return bytes(_brotli.decompress(data))
    except (zlib.error, lzma.LZMAError, OSError, ValueError, RuntimeError) as e:
        raise DataCorruptionError(f"{key!r}: expected {method} data (from its suffix), "
                               f"could not decompress: {e}") from None


class SuffixedChunks(KvStore):
    """``base`` with CloudVolume's suffixed chunk files read as their plain key
    (see the module docstring). Keys pass through unchanged; no blocking I/O."""

    driver = "precomputed_suffixed"

    def __init__(self, base: KvStore) -> None:
        super().__init__(path="")
        self.base = base
        self.read_only = base.read_only

    def spec(self) -> dict[str, Any]:
        return self.base.spec()

    def _spec_fields(self) -> dict[str, Any]:
        return self.base._spec_fields()

    def url(self) -> str:
        return self.base.url()

    def _identity(self) -> Any:
        return ("suffixed", self.base._identity(), self.base.path)

    def __reduce__(self) -> tuple[Any, ...]:
        return (SuffixedChunks, (self.base,))

    async def _read(self, key: str, byte_range: ByteRange | None,
                    if_not_equal: Generation | None) -> ReadResult:
        res = await self.base.read(key, byte_range=byte_range, if_not_equal=if_not_equal)
        if res.state != "missing":
            return res
        for suffix, method in SUFFIXES:
            res = await self.base.read(key + suffix, if_not_equal=if_not_equal)
            if res.state == "unchanged":
                return res
            if res.state == "value":
                data = _decompress(method, bytes(res.value), self.base.url() + key + suffix)
                if byte_range is not None:
                    data = data[slice(byte_range.start, byte_range.stop)]
                return ReadResult("value", data, res.generation)
        return ReadResult.missing()

    async def _sibling_with(self, key: str, gen: Generation) -> str | None:
        for suffix, _method in SUFFIXES:
            res = await self.base.read(key + suffix, if_not_equal=gen)
            if res.state == "unchanged" or (res.state == "value" and res.generation == gen):
                return key + suffix
        return None

    async def _drop_siblings(self, key: str) -> None:
        for suffix, _method in SUFFIXES:
            await self.base.delete(key + suffix)

    async def _write(self, key: str, value: Buffer, if_equal: Generation | None) -> Generation:
        try:
            gen = await self.base.write(key, value, if_equal=if_equal)
        except ConditionFailedError:
            if if_equal is None or if_equal.is_no_value or await self._sibling_with(key, if_equal) is None:
                raise
            gen = await self.base.write(key, value, if_equal=Generation.NO_VALUE)
        await self._drop_siblings(key)
        return gen

    async def _delete(self, key: str, if_equal: Generation | None) -> None:
        if if_equal is not None and not if_equal.is_no_value:
            sibling = await self._sibling_with(key, if_equal)
            if sibling is not None:  # the value read came from a suffixed copy
                await self.base.delete(sibling, if_equal=if_equal)
                await self._drop_siblings(key)
                return
        # copies first: until the plain key goes, it shadows them (a failed
        # condition on it leaves what readers see unchanged)
        await self._drop_siblings(key)
        await self.base.delete(key, if_equal=if_equal)

    async def _list(self, prefix: str) -> list[str]:
        keys = await self.base.list(prefix)
        out = set()
        for k in keys:
            for suffix, _m in SUFFIXES:
                if k.endswith(suffix):
                    k = k[: -len(suffix)]
                    break
            out.add(k)
        return sorted(out)
