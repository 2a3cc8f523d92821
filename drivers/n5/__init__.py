"""The N5 format (Janelia's N5, as N5-Java and TensorStore's ``n5`` driver store it).

This package is the format layer only, free of I/O.

- :mod:`.compression`: raw, gzip (and zlib), bzip2, xz, blosc, zstd and lz4
  (lz4-java's framing, :mod:`.lz4block`); every decoder bounded by the block's
  expected size.
"""

from tensorstore_py.drivers.n5.compression import COMPRESSIONS, Compression, compression_from_json

__all__ = ["COMPRESSIONS", "Compression", "compression_from_json"]
