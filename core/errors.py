"""The one error tree of tensorstore_py.

Every error raised by the library derives from :class:`TensorStoreError`. Where a
built-in exception has the same meaning, the error also inherits it, so code that
catches ``KeyError`` or ``ValueError`` keeps working::

    TensorStoreError (Exception)
    ├── ConditionFailedError            a create-only / compare-and-swap write lost
    │   └── ConflictError               a transaction's keys were changed since its base
    ├── NotFoundError (KeyError)        a required key / version / step does not exist
    │   └── SnapshotExpiredError        the version a reader pinned was deleted and reclaimed
    ├── InvalidKeyError (ValueError)    a key that is empty, escapes its root, has NUL/".."
    ├── InvalidSpecError (ValueError)   a malformed spec, URL, zarr.json / .zarray
    ├── InvalidArgumentError (ValueError)  bad shapes/dtypes/values passed by the caller
    │   └── OutOfRangeError (IndexError)   an index outside an array's domain
    ├── ReadOnlyError                   a write to a read-only store or snapshot
    ├── UnsupportedError                a store/driver cannot honour the operation
    ├── DataCorruptionError             stored bytes are not what was written
    │   └── ChecksumError               a crc32c / checksum mismatch
    ├── StorageError (OSError)          an I/O failure of the backing store (after retries)
    │   └── CommitOutcomeUnknownError   a conditional write / commit may or may not have landed
    ├── DeadlineExceededError (TimeoutError)  a deadline passed
    ├── ResourceExhaustedError (MemoryError)  a result too large to allocate
    ├── LoopError (RuntimeError)        misuse of the event loop (``.result()`` on the loop)
    └── ParticipantFailedError          another process of a multi-writer commit / save failed

Messages name the key or URL, the store or driver, and what was expected versus
what was found.
"""

from __future__ import annotations

__all__ = [
    "TensorStoreError",
    "ConditionFailedError",
    "ConflictError",
    "NotFoundError",
    "SnapshotExpiredError",
    "InvalidKeyError",
    "InvalidSpecError",
    "InvalidArgumentError",
    "OutOfRangeError",
    "ReadOnlyError",
    "UnsupportedError",
    "DataCorruptionError",
    "ChecksumError",
    "StorageError",
    "CommitOutcomeUnknownError",
    "DeadlineExceededError",
    "ResourceExhaustedError",
    "LoopError",
    "ParticipantFailedError",
]


class TensorStoreError(Exception):
    """Base of every error raised by tensorstore_py."""


class ConditionFailedError(TensorStoreError):
    """A conditional write or delete lost: the key's generation did not match.

    Raised for a create-only write (``if_equal=Generation.NO_VALUE``) of a key that
    exists, and for a compare-and-swap whose expected generation is stale.
    """


class ConflictError(ConditionFailedError):
    """A transaction could not commit: another commit changed keys it also wrote.

    Nothing of the failed transaction is visible; retrying the whole transaction
    (re-reading its inputs) is safe.
    """

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class NotFoundError(TensorStoreError, KeyError):
    """A key, array, version, tag or step that must exist does not."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class SnapshotExpiredError(NotFoundError):
    """A version that a reader pinned was deleted (retention) and its objects
    reclaimed while the reader still used it.

    Nothing is wrong with the store: re-open the newest version (or a retained
    one) and read again.
    """


class InvalidKeyError(TensorStoreError, ValueError):
    """A key is empty, absolute, contains NUL or ``..``, or escapes the store root."""


class InvalidSpecError(TensorStoreError, ValueError):
    """A spec, URL or stored metadata document is malformed or incompatible."""


class InvalidArgumentError(TensorStoreError, ValueError):
    """An argument has the wrong shape, dtype or value."""


class OutOfRangeError(InvalidArgumentError, IndexError):
    """An index or region lies outside an array's domain (numpy raises IndexError)."""


class ReadOnlyError(TensorStoreError):
    """A write or delete was attempted on a read-only store, view or snapshot."""


class UnsupportedError(TensorStoreError):
    """The store or driver cannot honour the requested operation or condition.

    Raised instead of silently weakening a guarantee (e.g. faking a create-only
    write with exists-then-write).
    """


class DataCorruptionError(TensorStoreError):
    """Stored bytes are inconsistent: truncated, undecodable or malformed."""


class ChecksumError(DataCorruptionError):
    """A stored checksum does not match the bytes it protects."""


class StorageError(TensorStoreError, OSError):
    """The backing store failed (after any retries the store performs)."""


class CommitOutcomeUnknownError(StorageError):
    """A conditional write or a commit may or may not have taken effect, and the
    store could not tell which (its response was lost and a later state does not
    reveal it).

    Deliberately not a :class:`ConditionFailedError`: treating it as "not
    applied" and retrying could apply an update twice. ``write_id`` identifies
    the attempt; on the versioned store ``VersionedKvStore.find_write_id`` says
    whether (and as which version) it committed: pass it the error itself, as
    ``kv.find_write_id(err)``. ``key`` names the key or object concerned where
    there is one; ``version`` is the only version a commit record can land
    as, where the attempt had one.
    """

    def __init__(self, message: str, *, write_id: str | None = None, key: str | None = None,
                 version: int | None = None) -> None:
        super().__init__(message)
        self.write_id = write_id
        self.key = key
        self.version = version


class DeadlineExceededError(TensorStoreError, TimeoutError):
    """An operation did not finish before its deadline."""


class ResourceExhaustedError(TensorStoreError, MemoryError):
    """A result can not be allocated: reading a region of an absurd shape (more
    bytes than the address space, or than this machine can give) asks for it.

    Nothing was read or changed; read a smaller region.
    """


class LoopError(TensorStoreError, RuntimeError):
    """The event loop was misused, e.g. blocking on a Future from the loop thread."""


class ParticipantFailedError(TensorStoreError):
    """Another process of a multi-writer transaction (or multi-process checkpoint
    save) failed before delivering its part; nothing was committed. The message
    names the process and its error; ``process_index`` is that process and
    ``cause`` its error's class name."""

    def __init__(self, message: str, *, process_index: int | None = None, cause: str | None = None) -> None:
        super().__init__(message)
        self.process_index = process_index
        self.cause = cause
