"""N5 blocks: keys, the block header, element order and edge blocks.

A block is stored under the key ``"i0/i1/..."`` (its grid position, in
attributes.json order; ``"0"`` for a rank-0 dataset, as TensorStore writes)
relative to the dataset, as::

    mode             uint16 BE   0 default, 1 varlength, 2 object
    ndim, shape      uint16 BE, then ndim x uint32 BE       (modes 0 and 1)
    num_elements     uint32 BE                              (modes 1 and 2)
    data             the compressed elements: big-endian, FIRST dimension fastest

Mode 1 ("varlength") gives the element count separately from the shape
(N5-Java uses it for strings and custom types); mode 2 ("object", N5-Java's
``DataType.OBJECT``) has no shape, only the count of serialized bytes. Array
blocks use mode 0; mode 1 reads when the count matches the shape, mode 2
raises UnsupportedError (its bytes are serialized Java objects).

Edge blocks: N5-Java writes a block that extends past the array's end clipped
(header shape = the in-bounds part, data truncated); TensorStore writes it full
size (padded). :func:`decode_block` reads both (any shape up to ``blockSize``;
the rest reads as 0, N5's implicit fill value); :func:`encode_block` writes the
N5-Java form when given the block's grid position.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tensorstore_py.core.errors import (
    DataCorruptionError,
    InvalidArgumentError,
    OutOfRangeError,
    UnsupportedError,
)
from tensorstore_py.core.ranges import Buffer
from tensorstore_py.drivers.copies import copy_into
from tensorstore_py.drivers.n5.metadata import N5Metadata

__all__ = [
    "MODE_DEFAULT",
    "MODE_OBJECT",
    "MODE_VARLENGTH",
    "BlockHeader",
    "block_key",
    "block_shape",
    "decode_block",
    "decode_header",
    "encode_block",
    "encode_header",
    "read_block",
]

MODE_DEFAULT, MODE_VARLENGTH, MODE_OBJECT = 0, 1, 2
_U16, _U32 = struct.Struct(">H"), struct.Struct(">I")


@dataclass(frozen=True)
class BlockHeader:
    """A decoded block header. ``shape`` is empty for mode 2 (object) blocks."""

    mode: int
    shape: tuple[int, ...]
    num_elements: int

    @property
    def size(self) -> int:
        """Length of the header in bytes (where the compressed data starts)."""
        if self.mode == MODE_OBJECT:
            return 2 + 4
        return 4 + 4 * len(self.shape) + (4 if self.mode == MODE_VARLENGTH else 0)


def encode_header(shape: Sequence[int], *, num_elements: int | None = None) -> bytes:
    """A mode 0 header, or mode 1 when ``num_elements`` differs from the shape's
    product (as N5-Java chooses)."""
    shape = tuple(int(s) for s in shape)
    if len(shape) > 0xFFFF or not all(0 <= s <= 0xFFFFFFFF for s in shape):
        raise InvalidArgumentError(f"n5 block shape {shape} does not fit a block header")
    varlength = num_elements is not None and num_elements != math.prod(shape)
    head = struct.pack(f">HH{len(shape)}I", MODE_VARLENGTH if varlength else MODE_DEFAULT, len(shape), *shape)
    return head + _U32.pack(num_elements) if varlength else head


def decode_header(data: Buffer, *, key: str = "") -> BlockHeader:
    """Parse the header at the start of a stored block (DataCorruptionError when
    it is truncated or its mode is not 0, 1 or 2)."""
    mv = memoryview(data).cast("B")

    def truncated() -> DataCorruptionError:
        return DataCorruptionError(f"n5 block {key!r}: {len(mv)} bytes, shorter than its header")

    if len(mv) < 2:
        raise truncated()
    (mode,) = _U16.unpack_from(mv, 0)
    if mode == MODE_OBJECT:
        if len(mv) < 6:
            raise truncated()
        return BlockHeader(mode, (), _U32.unpack_from(mv, 2)[0])
    if mode not in (MODE_DEFAULT, MODE_VARLENGTH):
        raise DataCorruptionError(f"n5 block {key!r}: unknown block mode {mode} (expected 0, 1 or 2)")
    if len(mv) < 4:
        raise truncated()
    (ndim,) = _U16.unpack_from(mv, 2)
    end = 4 + 4 * ndim + (4 if mode == MODE_VARLENGTH else 0)
    if len(mv) < end:
        raise truncated()
    shape = struct.unpack_from(f">{ndim}I", mv, 4)
    count = _U32.unpack_from(mv, end - 4)[0] if mode == MODE_VARLENGTH else math.prod(shape)
    return BlockHeader(mode, shape, count)


def block_key(grid_index: Sequence[int]) -> str:
    """The key of the block at ``grid_index``, relative to the dataset."""
    return "/".join(str(int(i)) for i in grid_index) or "0"


def block_shape(metadata: N5Metadata, grid_index: Sequence[int]) -> tuple[int, ...]:
    """The in-bounds shape of the block at ``grid_index`` (smaller than
    ``blockSize`` at the array's far edges)."""
    grid = metadata.grid_shape
    if len(grid_index) != len(grid) or not all(0 <= int(g) < n for g, n in zip(grid_index, grid)):
        raise OutOfRangeError(f"n5 block grid position {tuple(grid_index)} is outside the grid {grid}")
    return tuple(min(b, d - int(g) * b) for g, b, d in zip(grid_index, metadata.block_size, metadata.dimensions))


def read_block(metadata: N5Metadata, data: Buffer, *, key: str = "") -> tuple[BlockHeader, np.ndarray]:
    """The header and the stored elements of a block, as stored: an array of the
    header's shape (attributes.json order), big-endian, read-only where the
    decoder's output is. No copy beyond decompression.

    Raises DataCorruptionError when the header does not fit the dataset (rank,
    a dimension larger than ``blockSize``) or the data does not decode to
    exactly the header's element count, UnsupportedError for mode 2 blocks and
    for mode 1 blocks whose count differs from their shape.
    """
    header = decode_header(data, key=key)
    if header.mode == MODE_OBJECT:
        raise UnsupportedError(
            f"n5 block {key!r}: mode 2 (object) blocks hold serialized objects, not array elements")
    if len(header.shape) != metadata.rank or any(s > b for s, b in zip(header.shape, metadata.block_size)):
        raise DataCorruptionError(
            f"n5 block {key!r}: header shape {list(header.shape)} does not fit blockSize "
            f"{list(metadata.block_size)}")
    count = math.prod(header.shape)
    if header.num_elements != count:
        raise UnsupportedError(
            f"n5 block {key!r}: varlength block of {header.num_elements} elements for shape "
            f"{list(header.shape)} is not an array block")
    nbytes = count * metadata.dtype.itemsize
    # an empty block has nothing to decode (N5-Java reads no bytes of it)
    raw = metadata.compression.decode(memoryview(data)[header.size:], size=nbytes, key=key) if nbytes else b""
    return header, np.frombuffer(raw, dtype=metadata.stored_dtype).reshape(header.shape, order="F")


def decode_block(metadata: N5Metadata, data: Buffer, *, key: str = "") -> np.ndarray:
    """A whole block (``blockSize`` shape, native byte order, writable) from its
    stored bytes; a block stored clipped reads as 0 beyond its header's shape."""
    header, stored = read_block(metadata, data, key=key)
    if header.shape == metadata.block_size:
        return stored.astype(metadata.dtype)
    out = np.zeros(metadata.block_size, dtype=metadata.dtype, order="F")
    out[tuple(slice(0, n) for n in header.shape)] = stored
    return out


def encode_block(metadata: N5Metadata, array: np.ndarray, *,
                 grid_index: Sequence[int] | None = None) -> bytes:
    """The stored bytes of a block holding ``array`` (dtype = the dataset's).

    With ``grid_index``, ``array`` is the block's in-bounds part or the whole
    ``blockSize`` block, and is written clipped as N5-Java writes edge blocks.
    Without it, ``array``'s shape (at most ``blockSize``) is written as is.
    Raises InvalidArgumentError for another dtype, rank or shape.
    """
    a = np.asarray(array)
    if a.dtype.newbyteorder("=") != metadata.dtype:
        raise InvalidArgumentError(f"n5 block of {metadata.data_type}: got an array of {a.dtype}")
    expected = None if grid_index is None else block_shape(metadata, grid_index)
    if expected is not None and a.shape == metadata.block_size:
        a = a[tuple(slice(0, n) for n in expected) + (...,)]  # (the Ellipsis keeps rank 0 an array)
    if (a.ndim != metadata.rank or any(s > b for s, b in zip(a.shape, metadata.block_size))
            or (expected is not None and a.shape != expected)):
        want = expected if expected is not None else f"at most {metadata.block_size}"
        raise InvalidArgumentError(f"n5 block of shape {want}: got an array of shape {a.shape}")
    stored = np.empty(a.shape, metadata.stored_dtype, order="F")
    copy_into(stored, a)  # one pass, in slabs: byte order and element order
    body = metadata.compression.encode(stored.reshape(-1, order="F").view(np.uint8).data,
                                       itemsize=metadata.dtype.itemsize)
    return b"".join((encode_header(a.shape), body))
