"""Credentials for the gcs store: google-auth bearer tokens (a
:class:`~tensorstore_py.kvstore._auth.CachedCredentials` provider).

google-auth is imported lazily, only for stores that need credentials; a missing
install raises ImportError naming the pip extra. Tokens are fetched and refreshed
on the I/O thread pool (google-auth is blocking), once for all concurrent
requests, and reused until they expire.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yarl

from tensorstore_py.core.errors import StorageError
from tensorstore_py.core.ranges import Buffer
from tensorstore_py.kvstore._auth import CachedCredentials, CredentialsMode

__all__ = ["CredentialsMode", "GcsAuth", "require_google_auth"]

_SCOPE = "https://www.googleapis.com/auth/devstorage.read_write"
_INSTALL_HINT = 'pip install "tensorstore_py[gcs]"'


class GcsAuth(CachedCredentials):
    """Bearer tokens from google-auth's application-default credentials."""

    driver = "gcs"

    def _lookup(self) -> tuple[Any, str]:
        # google-auth is the optional gcs extra: imported only once credentials are used
        import google.auth
        import google.auth.exceptions  # (lazy, as above)

        try:
            creds, _project = google.auth.default(scopes=[_SCOPE])
        except google.auth.exceptions.DefaultCredentialsError as e:
            return None, f"google-auth application-default credentials ({e})"
        return creds, ""

    def _usable(self, creds: Any) -> bool:
        return bool(creds.valid)

    def _refresh(self, creds: Any) -> None:
        # google-auth is the optional gcs extra (see _lookup)
        import google.auth.exceptions
        from google.auth.transport.requests import Request  # (lazy, as above)

        try:
            creds.refresh(Request())
        except google.auth.exceptions.TransportError as e:
            # the token endpoint was unreachable: transient, so retried
            raise ConnectionError(f"gcs: token endpoint unreachable: {e}") from e
        except google.auth.exceptions.GoogleAuthError as e:
            raise StorageError(f"gcs: refreshing Google credentials failed: {e}") from e

    async def _sign(
        self, creds: Any, method: str, url: str | yarl.URL, headers: Mapping[str, str],
        data: Buffer | None,
    ) -> dict[str, str]:
        return {"Authorization": f"Bearer {creds.token}"}  # the same for every request

    def _forget(self, creds: Any) -> None:
        creds.expiry = None
        creds.token = None

    def _describe(self, creds: Any) -> str:
        who = getattr(creds, "service_account_email", None) or getattr(creds, "signer_email", None)
        kind = type(creds).__module__.rsplit(".", 1)[-1]
        return f"google-auth application-default credentials ({kind}{', ' + who if who else ''})"


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
