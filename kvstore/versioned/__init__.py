"""The versioned, transactional kvstore adapter (format: docs/FORMAT.md).

``{"driver": "versioned", "base": <spec or URL>, "path": "params/"}`` opens a
multi-version store over any base store with create-only writes; add
``"version": N`` or ``"tag": name`` (URL: ``versioned+file:///run/@12``) for a
read-only snapshot. Transactions: :class:`tensorstore_py.Transaction`.
"""

from tensorstore_py.kvstore.versioned.store import VersionedKvStore, VersionInfo

__all__ = ["VersionInfo", "VersionedKvStore"]
