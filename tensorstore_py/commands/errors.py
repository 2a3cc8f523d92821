"""Turn an exception into an exit code and a message a user can act on."""

from __future__ import annotations

from tensorstore_py.core.errors import (
    ConditionFailedError,
    DataCorruptionError,
    DeadlineExceededError,
    InvalidArgumentError,
    InvalidKeyError,
    InvalidSpecError,
    NotFoundError,
    ReadOnlyError,
    StorageError,
    UnsupportedError,
)

__all__ = ["describe"]

EXIT_FAILED = 1
EXIT_USAGE = 2

_CREDENTIALS_HINT = (
    "the store needs credentials: for gs:// run `gcloud auth application-default login` or set "
    "GOOGLE_APPLICATION_CREDENTIALS to a service-account key file; check that the account may read "
    "the bucket"
)


_URL_HINT = (
    "URLs look like file:///abs/dir/, gs://bucket/dir/, https://host/dir/, "
    "versioned+file:///run/@12, or a local path"
)
_LS_HINT = "check the URL (and --step / --at); `tensorstore-py ls URL` lists what is there"
_READ_ONLY_HINT = (
    "this store is read-only (http(s):// stores and @version snapshots are); use a writable URL"
)
_RETRY_HINT = "check the URL and your network; requests that still fail after retries end up here"
_DNS_HINT = (
    "the host name does not resolve: check your network (DNS) and the URL; for an emulator or "
    "a private endpoint set STORAGE_EMULATOR_HOST (gs://) or AWS_ENDPOINT_URL (s3://)"
)


def _needs_credentials(msg: str) -> bool:
    m = msg.lower()
    return any(s in m for s in ("http 401", "http 403", "credentials", "unauthorized", "forbidden",
                                "permission denied"))


def describe(e: BaseException) -> tuple[int, list[str]]:
    """(exit code, message lines): the first line is the error, the rest are hints."""
    msg = str(e) or type(e).__name__
    if isinstance(e, (InvalidArgumentError, InvalidSpecError, InvalidKeyError)):
        hint = []
        if isinstance(e, InvalidSpecError):
            hint = [_URL_HINT]
        return EXIT_USAGE, [msg, *hint]
    if isinstance(e, NotFoundError):
        return EXIT_FAILED, [msg, _LS_HINT]
    if isinstance(e, UnsupportedError):
        return EXIT_FAILED, [msg]
    if isinstance(e, DataCorruptionError):
        return EXIT_FAILED, [f"corrupt data: {msg}", "run `tensorstore-py verify URL` for a full report"]
    if isinstance(e, ReadOnlyError):
        return EXIT_FAILED, [msg, _READ_ONLY_HINT]
    if isinstance(e, ConditionFailedError):
        return EXIT_FAILED, [msg]
    if isinstance(e, DeadlineExceededError):
        return EXIT_FAILED, [f"timed out: {msg}"]
    if isinstance(e, (StorageError, OSError)):
        if "cannot resolve host" in msg:  # not retried: no network, or a wrong endpoint
            return EXIT_FAILED, [f"network error: {msg}", _DNS_HINT]
        if _needs_credentials(msg):
            return EXIT_FAILED, [f"access denied: {msg}", _CREDENTIALS_HINT]
        return EXIT_FAILED, [f"storage error: {msg}", _RETRY_HINT]
    if isinstance(e, ImportError):
        return EXIT_FAILED, [msg]
    if isinstance(e, (ValueError, IndexError, KeyError)):
        return EXIT_USAGE, [msg]
    if _needs_credentials(msg):
        return EXIT_FAILED, [f"access denied: {msg}", _CREDENTIALS_HINT]
    return EXIT_FAILED, [f"unexpected error ({type(e).__name__}): {msg}",
                         "set TSP_DEBUG=1 for a traceback and please report it"]
