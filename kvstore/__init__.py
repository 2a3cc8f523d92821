"""Key-value stores: bytes by key with honest conditional writes.

Backends (one module each, registering itself; the registry imports them only
when a spec or URL needs one): ``memory``, ``file``, ``gcs``, ``s3``, ``http``,
``fsspec`` (the fallback for other fsspec URLs); adapters: ``versioned``
(transactional, multi-version), ``fault`` (fault injection for tests). The
remote stores share one client layer (``_http``: sessions, retries, bounded
concurrency, ranges; ``_objstore``: write-ids and unknown outcomes; ``_auth``:
credentials). docs/STORES.md compares what each store guarantees.
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
