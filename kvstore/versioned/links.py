"""Linking a value to a second key inside a transaction, without copying its bytes.

``link_value(view, key, source)`` stages at ``key`` the value that ``source``
holds in the version the transaction reads: the new key's index entry names
the same data object, offset, length and crc32c (docs/FORMAT.md §4.2), under
a fresh generation. Nothing is written but the index entry, and nothing is
read but the index.

Guarantees (see ``VersionedParticipant.link``): the commit fails with
``ConflictError`` when a version committed since the transaction's pinned
version changed or deleted ``source``, so every committed version that holds a
link also holds an object its parent references, the rule garbage collection
relies on (docs/FORMAT.md §9.2, §9.5): a shared object is kept while any kept
version references it under any key. ``verify`` checks a linked value like
any other (its crc32c, under each key that references it).
"""

from __future__ import annotations

from tensorstore_py.core.errors import InvalidArgumentError
from tensorstore_py.kvstore.base import KvStore
from tensorstore_py.kvstore.transactional_view import TransactionalKvStore
from tensorstore_py.kvstore.versioned.txn import VersionedParticipant

__all__ = ["link_value"]


async def link_value(view: KvStore, key: str, source: str) -> bool:
    """Stage ``key`` = the value of ``source`` (both relative to ``view``), in
    ``view``'s transaction on a versioned store; False when ``source`` is absent
    from the version the transaction reads (nothing staged: write the value).

    ``view`` must be a versioned store bound to an open transaction
    (``store.with_transaction(txn)``, or a ``with_path`` of one);
    InvalidArgumentError otherwise. Multi-writer transactions carry the
    source to process 0, which checks it at the merge.
    """
    participant = getattr(view, "_participant", None)
    if not isinstance(view, TransactionalKvStore) or not isinstance(participant, VersionedParticipant):
        raise InvalidArgumentError(
            f"link_value: {view!r} is not a versioned store bound to a transaction; "
            "expected versioned_store.with_transaction(txn)"
        )
    view._check_writable("link", key)
    full, src = view._full(key), view._full(source)
    view.txn._issue(f"link of {key!r}")
    try:
        view.txn._claim_writer(participant, view._rel(full))
        return await participant.link(full, src)
    finally:
        view.txn._unissue()
