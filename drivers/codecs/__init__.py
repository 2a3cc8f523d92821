"""zarr v3 codecs, one per module, each registering itself; the chain that runs them.

Modules:

* ``base``          the three codec kinds, ChunkSpec (what a codec's factory sees),
                    ChunkCodec (a whole chunk's encoding, as the engine uses it)
* ``registry``      zarr3 name -> codec class, zarr v2 compressor id -> checked
                    decoder, ``compression=`` alias -> zarr3 codec / v2 compressor
* ``chain``         CodecChain: a zarr3 codec list bound to a chunk shape and dtype
* ``bytes_codec``   ``bytes`` (endianness)
* ``transpose``     ``transpose``
* ``gzip_codec``    ``gzip``; zarr v2 ``gzip``/``zlib``; ``compression="gzip"``
* ``zstd_codec``    ``zstd``; zarr v2 ``zstd``; ``compression="zstd"``
* ``blosc_codec``   ``blosc``; zarr v2 ``blosc``; ``compression="blosc"``
* ``crc32c_codec``  ``crc32c``
* ``lz4_v2``        zarr v2 ``lz4`` (no zarr3 codec)
* ``bz2_lzma``      zarr v2 ``bz2`` and ``lzma``, decoded by bounded streaming decoders
* ``vlen``          ``vlen-utf8``, ``vlen-bytes`` (strings, bytes); the zarr v2
                    object codecs of the same ids
* ``numcodecs_family``  ``numcodecs.*`` (delta, zlib, bz2, shuffle, fletcher32, ...),
                    delegated to numcodecs, decoded through the checked decoders
* ``sharding``      ``sharding_indexed`` (inner chunks plus an index)
* ``_limits``       size checks and the bounded streaming decode shared by the decompressors

A codec name no module registered raises UnsupportedError naming it and listing
the supported ones. Importing this package runs every registration below; adding
a codec is one new module plus one import line here.
"""

from tensorstore_py.drivers.codecs import (  # noqa: F401  (imported to register)
    blosc_codec,
    bytes_codec,
    bz2_lzma,
    crc32c_codec,
    gzip_codec,
    lz4_v2,
    numcodecs_family,
    sharding,
    transpose,
    vlen,
    zstd_codec,
)
from tensorstore_py.drivers.codecs.chain import CodecChain
from tensorstore_py.drivers.codecs.registry import (
    compression_codecs,
    compression_compressor,
    v2_decoder,
)

__all__ = ["CodecChain", "compression_codecs", "compression_compressor", "v2_decoder"]
