"""zarr v3 codecs, one per module, and :class:`CodecChain` that runs them.

Supported: ``bytes``, ``transpose``, ``gzip``, ``zstd``, ``blosc``, ``crc32c``,
``sharding_indexed``. Anything else raises UnsupportedError naming the codec.
"""

from tensorstore_py.drivers.codecs.chain import CodecChain

__all__ = ["CodecChain"]
