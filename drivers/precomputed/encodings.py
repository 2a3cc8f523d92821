"""Chunk encodings of neuroglancer precomputed volumes: raw, jpeg, png,
compressed_segmentation and compresso.

A decoded chunk is an array of shape (x, y, z, channel) — the volume's domain
order — viewing a C-ordered (channel, z, y, x) buffer, which is exactly the
raw layout on disk (x varies fastest, channels outermost). Edge chunks have
the clipped shape of :meth:`ScaleMetadata.chunk_shape`. The encodings:

* ``raw``: the little-endian bytes of that buffer, nothing else.
* ``jpeg`` (uint8, 1 or 3 channels) and ``png`` (uint8/uint16, 1..4 channels):
  one image, ``x`` pixels wide and ``y * z`` rows high, channels interleaved
  per pixel (what TensorStore writes; any width x height with the right pixel
  count is read). Through ``imagecodecs`` (libjpeg-turbo, libpng: the same
  libraries TensorStore uses, so JPEG output is byte-identical at equal
  quality; unlike Pillow it keeps 16-bit multi-channel PNG lossless).
* ``compressed_segmentation`` (uint32/uint64): :mod:`.compressed_segmentation`.
* ``compresso`` (unsigned, 1 channel): through the ``compresso`` package.

``imagecodecs`` and ``compresso`` are optional (extra "precomputed"); a chunk
that needs a missing one raises ImportError naming the extra. Image and
compresso headers are checked against the expected chunk before the decoder
runs, so a hostile header cannot make it allocate: any mismatch or decoder
failure is a :class:`DataCorruptionError` naming the chunk key.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from tensorstore_py.core.errors import DataCorruptionError, InvalidArgumentError
from tensorstore_py.core.ranges import Buffer
from tensorstore_py.drivers.precomputed.compressed_segmentation import decode as decode_segmentation
from tensorstore_py.drivers.precomputed.compressed_segmentation import encode as encode_segmentation
from tensorstore_py.drivers.precomputed.metadata import (
    DATA_TYPES,
    ENCODINGS,
    MultiscaleMetadata,
    ScaleMetadata,
    check_encoding,
)

__all__ = ["ChunkCodec"]

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# start-of-frame markers (baseline, progressive, lossless, arithmetic): not C4/C8/CC
_JPEG_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
_COMPRESSO_HEADER = 36
_COMPRESSO_MAX_DIM = 0xFFFF  # the header stores each dimension as a u16


def _optional(name: str) -> ModuleType:
    """``imagecodecs`` (jpeg, png) or ``compresso``, or an ImportError naming the extra."""
    try:
        if name == "imagecodecs":
            import imagecodecs  # optional: only jpeg/png chunks need it
            return imagecodecs
        import compresso  # optional: only compresso chunks need it
        return compresso
    except ImportError as e:
        chunks = "jpeg and png" if name == "imagecodecs" else name
        raise ImportError(f"{chunks} chunks need the {name!r} package: "
                          "pip install 'tensorstore_py[precomputed]'") from e


def _png_size(data: Buffer) -> tuple[int, int] | None:
    """(width, height) from a PNG's IHDR, or None if it is not a PNG."""
    head = bytes(data[:24])
    if len(head) < 24 or head[:8] != _PNG_SIGNATURE or head[12:16] != b"IHDR":
        return None
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def _jpeg_size(data: Buffer) -> tuple[int, int, int] | None:
    """(width, height, components) from a JPEG's start-of-frame, or None if there is none."""
    mv = memoryview(data)
    if bytes(mv[:2]) != b"\xff\xd8":
        return None
    i, n = 2, len(mv)
    while i + 4 <= n:
        if mv[i] != 0xFF:
            return None
        marker = mv[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:  # markers without a length
            i += 2
            continue
        length = int.from_bytes(mv[i + 2:i + 4], "big")
        if marker in _JPEG_SOF:
            if length < 8 or i + 10 > n:
                return None
            height = int.from_bytes(mv[i + 5:i + 7], "big")
            width = int.from_bytes(mv[i + 7:i + 9], "big")
            return width, height, mv[i + 9]
        if marker == 0xDA or length < 2:  # start of scan before any frame header
            return None
        i += 2 + length
    return None


@dataclass(frozen=True)
class ChunkCodec:
    """Encodes and decodes the chunks of one scale.

    ``decode(data, shape)`` takes the chunk's clipped (x, y, z) shape and returns
    an (x, y, z, channel) array (for raw chunks, a read-only view of ``data``);
    ``encode(array)`` takes such an array, of the scale's dtype.
    """

    encoding: str
    data_type: str
    num_channels: int
    compressed_segmentation_block_size: tuple[int, int, int] | None = None
    jpeg_quality: int = 75
    png_level: int | None = None

    def __post_init__(self) -> None:
        if self.encoding not in ENCODINGS or self.data_type not in DATA_TYPES:
            raise InvalidArgumentError(f"unknown encoding {self.encoding!r} or data type {self.data_type!r}")
        check_encoding(self.encoding, self.data_type, self.num_channels, "encoding")
        if self.encoding == "compressed_segmentation" and self.compressed_segmentation_block_size is None:
            raise InvalidArgumentError("compressed_segmentation needs a block size")

    @classmethod
    def for_scale(cls, info: MultiscaleMetadata, scale: ScaleMetadata | int) -> ChunkCodec:
        s = info.scales[scale] if isinstance(scale, int) else scale
        return cls(s.encoding, info.data_type, info.num_channels, s.compressed_segmentation_block_size,
                   s.quality, s.png_level)

    @property
    def dtype(self) -> np.dtype:
        return DATA_TYPES[self.data_type]

    def max_encoded_size(self, shape: Sequence[int]) -> int:
        """An upper bound on a valid encoded chunk of this (x, y, z) shape: the cap for
        undoing a sharded ``gzip`` data encoding."""
        voxels = math.prod(shape)
        nbytes = voxels * self.num_channels * self.dtype.itemsize
        if self.encoding == "raw":
            return nbytes
        block = self.compressed_segmentation_block_size
        if block is not None:  # compressed_segmentation
            blocks = math.prod(-(-s // b) for s, b in zip(shape, block))
            bvol = math.prod(block)
            per_block = 2 + bvol + min(bvol, voxels) * self.dtype.itemsize // 4  # header, values, table
            return 4 * self.num_channels * (1 + blocks * per_block)
        return 4 * nbytes + (1 << 20)  # images and compresso: never near 4x raw, plus headers

    def _shape(self, shape: Sequence[int]) -> tuple[int, int, int, int]:
        if len(shape) != 3 or any(s < 0 for s in shape):
            raise InvalidArgumentError(f"chunk shape must be (x, y, z), got {list(shape)}")
        return int(shape[0]), int(shape[1]), int(shape[2]), self.num_channels

    # -- decoding ---------------------------------------------------------------------------

    def decode(self, data: Buffer, shape: Sequence[int], *, key: str = "",
               region: Sequence[slice] | None = None, out: np.ndarray | None = None) -> np.ndarray:
        """Decode one chunk of (clipped) shape ``shape`` (x, y, z).

        With ``region`` (4 slices, steps >= 1, within the chunk) the result is
        that part of the chunk; compressed_segmentation then decodes only those
        voxels (a plane of a chunk costs a plane, not a chunk). With ``out``
        (the result's shape, any strides) the result is written there.
        """
        full = self._shape(shape)
        if self.encoding == "compressed_segmentation":
            assert self.compressed_segmentation_block_size is not None  # __post_init__
            return decode_segmentation(data, full, self.compressed_segmentation_block_size, self.dtype, key=key,
                                       region=region, out=out)
        if self.encoding == "raw":
            want = math.prod(full) * self.dtype.itemsize
            if len(data) != want:
                raise DataCorruptionError(f"chunk {key!r}: raw chunk of shape {list(full)} should be "
                                          f"{want} bytes, got {len(data)}")
            x, y, z, c = full
            arr = np.frombuffer(data, self.dtype).reshape(c, z, y, x).transpose(3, 2, 1, 0)
        elif self.encoding == "compresso":
            arr = self._decode_compresso(data, full, key)
        else:
            arr = self._decode_image(data, full, key)
        arr = arr if region is None else arr[tuple(region)]
        if out is None:
            return arr
        out[...] = arr
        return out

    def _decode_image(self, data: Buffer, full: tuple[int, int, int, int], key: str) -> np.ndarray:
        x, y, z, c = full
        fmt = self.encoding
        if fmt == "png":
            size = _png_size(data)
            comps = c
        else:
            found = _jpeg_size(data)
            size, comps = (None, 0) if found is None else (found[:2], found[2])
        if size is None:
            raise DataCorruptionError(f"chunk {key!r}: not a {fmt} image")
        if size[0] * size[1] != x * y * z or comps != c:
            raise DataCorruptionError(f"chunk {key!r}: {fmt} image of {size[0]}x{size[1]} pixels "
                                      f"({comps} channels) does not hold a chunk of {list(full)}")
        codecs = _optional("imagecodecs")
        try:
            img = codecs.png_decode(data) if fmt == "png" else codecs.jpeg8_decode(data)
        except Exception as e:  # the codecs raise their own error types
            raise DataCorruptionError(f"chunk {key!r}: undecodable {fmt} image: {e}") from None
        if img.dtype != self.dtype or img.size != x * y * z * c:
            raise DataCorruptionError(f"chunk {key!r}: {fmt} image decodes to {img.dtype} {img.shape}, "
                                      f"expected {self.data_type} with {c} channels")
        return img.reshape(z, y, x, c).transpose(2, 1, 0, 3)

    def _decode_compresso(self, data: Buffer, full: tuple[int, int, int, int], key: str) -> np.ndarray:
        cpso = _optional("compresso")
        data = bytes(data)
        try:
            h = cpso.header(data) if len(data) >= _COMPRESSO_HEADER else None
        except Exception:  # compresso raises IndexError / DecodeError on garbage
            h = None
        if h is None or h.get("magic") != b"cpso":
            raise DataCorruptionError(f"chunk {key!r}: not a compresso stream")
        dims = (h["sx"], h["sy"], h["sz"])
        if dims != full[:3] or h["data_width"] != self.dtype.itemsize:
            raise DataCorruptionError(f"chunk {key!r}: compresso stream of {list(dims)} x {h['data_width']} "
                                      f"bytes does not hold a {self.data_type} chunk of {list(full[:3])}")
        steps = h["xstep"] * h["ystep"] * h["zstep"]
        if not 0 < steps <= 64:
            raise DataCorruptionError(f"chunk {key!r}: compresso window of {steps} voxels")
        window = 1 if steps <= 8 else 2 if steps <= 16 else 4 if steps <= 32 else 8
        sections = (h["data_width"] * (h["id_size"] + h["location_size"]) + window * h["value_size"])
        if _COMPRESSO_HEADER + sections > len(data):
            raise DataCorruptionError(f"chunk {key!r}: compresso sections need more than its {len(data)} bytes")
        try:
            arr = cpso.decompress(data)
        except Exception as e:
            raise DataCorruptionError(f"chunk {key!r}: undecodable compresso stream: {e}") from None
        if arr.shape != full[:3]:
            raise DataCorruptionError(f"chunk {key!r}: compresso stream decodes to {arr.shape}")
        return arr.astype(self.dtype, copy=False)[..., None]

    # -- encoding ---------------------------------------------------------------------------

    def encode(self, array: np.ndarray) -> bytes:
        """Encode an (x, y, z, channel) chunk of the scale's dtype."""
        if (array.ndim != 4 or array.shape[3] != self.num_channels
                or array.dtype.newbyteorder("<") != self.dtype):
            raise InvalidArgumentError(
                f"expected a {self.data_type} chunk of shape (x, y, z, {self.num_channels}), "
                f"got {array.dtype} {array.shape}"
            )
        if self.encoding == "raw":
            return np.ascontiguousarray(array.transpose(3, 2, 1, 0), dtype=self.dtype).tobytes()
        if self.encoding == "compressed_segmentation":
            assert self.compressed_segmentation_block_size is not None  # __post_init__
            return encode_segmentation(array, self.compressed_segmentation_block_size)
        if self.encoding == "compresso":
            if max(array.shape[:3]) > _COMPRESSO_MAX_DIM:
                raise InvalidArgumentError(f"compresso encodes at most {_COMPRESSO_MAX_DIM} voxels per "
                                           f"dimension, got {array.shape[:3]}")
            return bytes(_optional("compresso").compress(np.asfortranarray(array[..., 0])))
        x, y, z, c = array.shape
        img = np.ascontiguousarray(array.transpose(2, 1, 0, 3)).reshape(y * z, x, c)
        if c == 1:
            img = img[..., 0]
        codecs = _optional("imagecodecs")
        if self.encoding == "png":
            return bytes(codecs.png_encode(img, level=self.png_level))
        return bytes(codecs.jpeg8_encode(img, level=self.jpeg_quality))
