"""Key-value stores: bytes by key with honest conditional writes.

Backends (one module each, imported lazily by the registry): ``memory``,
``file``, ``gcs``, ``http``, ``fsspec``; adapters: ``versioned`` (transactional,
multi-version), ``fault`` (fault injection for tests).
"""

from tensorstore_py.kvstore.base import (
    Buffer,
    ByteRange,
    Generation,
    KvStore,
    RangesResult,
    ReadResult,
)

__all__ = ["Buffer", "ByteRange", "Generation", "KvStore", "RangesResult", "ReadResult"]
