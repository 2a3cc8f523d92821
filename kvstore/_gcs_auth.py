"""Credentials for the gcs store: google-auth bearer tokens, or none (an
:class:`~tensorstore_py.kvstore._http.Auth` for the store's HTTP client).

google-auth is imported lazily, only for stores that need credentials; a missing
install raises ImportError naming the pip extra. Tokens are fetched and refreshed
on the I/O thread pool (google-auth is blocking), once for all concurrent
requests, and reused until they expire.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any, Literal

import yarl

from tensorstore_py.core.errors import StorageError
from tensorstore_py.core.pools import run_io

__all__ = ["CredentialsMode", "GcsAuth", "require_google_auth"]

log = logging.getLogger("tensorstore_py.kvstore.gcs")

CredentialsMode = Literal["auto", "default", "anonymous"]
_SCOPE = "https://www.googleapis.com/auth/devstorage.read_write"
_INSTALL_HINT = 'pip install "tensorstore_py[gcs]"'


class GcsAuth:
    """Bearer tokens from google-auth, refreshed off the loop thread when stale."""

    def __init__(self, mode: CredentialsMode, *, anonymous: bool) -> None:
        self.mode = mode
        self.anonymous = anonymous
        self._creds: Any = None
        self._lock = threading.Lock()

    async def headers(
        self, method: str, url: str | yarl.URL, headers: Mapping[str, str], data: bytes | None
    ) -> dict[str, str]:
        """The Authorization header (a bearer token does not depend on the request)."""
        if self.anonymous:
            return {}
        creds = self._creds
        if creds is None or not creds.valid:
            await run_io(self._refresh)
            creds = self._creds
            if creds is None:  # auto mode found no credentials: anonymous
                return {}
        return {"Authorization": f"Bearer {creds.token}"}

    def invalidate(self) -> bool:
        """Drop the cached token (after HTTP 401); True when credentials are in use."""
        if self.anonymous:
            return False
        creds = self._creds
        if creds is not None:
            creds.expiry = None
            creds.token = None
        return True

    def _refresh(self) -> None:
        with self._lock:
            if self.anonymous:
                return
            # google-auth is the optional gcs extra: imported only once credentials are used
            import google.auth
            import google.auth.exceptions  # (lazy, as above)
            from google.auth.transport.requests import Request  # (lazy, as above)

            if self._creds is None:
                try:
                    self._creds, _project = google.auth.default(scopes=[_SCOPE])
                except google.auth.exceptions.DefaultCredentialsError as e:
                    if self.mode == "default":
                        raise StorageError(f"gcs: no Google credentials found: {e}") from e
                    log.warning("gcs: no Google credentials found (%s); using anonymous access", e)
                    self.anonymous = True
                    return
            if not self._creds.valid:
                try:
                    self._creds.refresh(Request())
                except google.auth.exceptions.TransportError as e:
                    # the token endpoint was unreachable: transient, so retried
                    raise ConnectionError(f"gcs: token endpoint unreachable: {e}") from e
                except google.auth.exceptions.GoogleAuthError as e:
                    raise StorageError(f"gcs: refreshing Google credentials failed: {e}") from e


def require_google_auth() -> None:
    try:
        # google-auth is optional (the gcs extra): checked here, imported when used
        import google.auth
        import google.auth.transport.requests  # noqa: F401 (lazy, as above)
    except ImportError as e:
        raise ImportError(
            f"the gcs kvstore needs google-auth for credentials ({e.name} is missing); "
            f"install it with: {_INSTALL_HINT}, or use credentials 'anonymous'"
        ) from e
