"""Neuroglancer precomputed volumes: the format layer, byte-compatible with
TensorStore's ``neuroglancer_precomputed`` driver.

Modules:

* ``metadata``                 the ``info`` document: scales, validation, domains, chunk keys
* ``spec``                     ``scale_index`` / ``scale_metadata`` / ``multiscale_metadata``:
                               open a scale or create one
* ``encodings``                ChunkCodec: raw, jpeg, png, compressed_segmentation, compresso
* ``compressed_segmentation``  the uint32/uint64 label encoding, vectorised
* ``sharding``                 ``neuroglancer_uint64_sharded_v1``: compressed Morton codes,
                               hashing, shard and minishard indexes, reading and building shards
* ``cseg_kernel``              the compiled compressed_segmentation decoder (numba, optional)
* ``shard_io``                 chunk I/O of sharded scales through a kvstore: ranged reads,
                               cached indexes, whole-shard read-modify-write
* ``driver``                   the ``neuroglancer_precomputed`` array driver (registers itself)

Only ``shard_io`` and ``driver`` do I/O; the others are the format, sans I/O.
"""

from tensorstore_py.drivers.precomputed.encodings import ChunkCodec
from tensorstore_py.drivers.precomputed.metadata import INFO_KEY, Domain, MultiscaleMetadata, ScaleMetadata
from tensorstore_py.drivers.precomputed.sharding import ShardingSpec, compressed_morton_code
from tensorstore_py.drivers.precomputed.spec import (
    MultiscaleConstraints,
    ResolvedScale,
    ScaleConstraints,
    create_scale,
    open_scale,
    resolve_scale,
    scale_spec,
)

__all__ = [
    "INFO_KEY",
    "ChunkCodec",
    "Domain",
    "MultiscaleConstraints",
    "MultiscaleMetadata",
    "ResolvedScale",
    "ScaleConstraints",
    "ScaleMetadata",
    "ShardingSpec",
    "compressed_morton_code",
    "create_scale",
    "open_scale",
    "resolve_scale",
    "scale_spec",
]
