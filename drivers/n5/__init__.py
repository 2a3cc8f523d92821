"""The N5 format (Janelia's N5, as N5-Java and TensorStore's ``n5`` driver store it).

This package is the format layer only, free of I/O: an array driver reads
``attributes.json`` and block keys from a kvstore and hands the bytes here.

- :mod:`.metadata`: ``attributes.json`` <-> :class:`N5Metadata` (axis order
  documented there: attributes.json order, first dimension fastest in a block).
- :mod:`.blocks`: block keys, the block header, whole-block decode/encode,
  clipped edge blocks.
- :mod:`.compression`: raw, gzip (and zlib), bzip2, xz, blosc, zstd and lz4
  (lz4-java's framing, :mod:`.lz4block`); every decoder bounded by the block's
  expected size.
"""

from tensorstore_py.drivers.n5.blocks import (
    BlockHeader,
    block_key,
    block_shape,
    decode_block,
    decode_header,
    encode_block,
    encode_header,
    read_block,
)
from tensorstore_py.drivers.n5.compression import COMPRESSIONS, Compression, compression_from_json
from tensorstore_py.drivers.n5.metadata import ATTRIBUTES_KEY, DATA_TYPES, N5Metadata

__all__ = [
    "ATTRIBUTES_KEY",
    "COMPRESSIONS",
    "DATA_TYPES",
    "BlockHeader",
    "Compression",
    "N5Metadata",
    "block_key",
    "block_shape",
    "compression_from_json",
    "decode_block",
    "decode_header",
    "encode_block",
    "encode_header",
    "read_block",
]
