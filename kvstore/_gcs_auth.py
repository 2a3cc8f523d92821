"""Credentials for the gcs store: google-auth bearer tokens (a
:class:`~tensorstore_py.kvstore._auth.CachedCredentials` provider).

google-auth is imported lazily, only for stores that need credentials; a missing
install raises ImportError naming the pip extra. Tokens are fetched and refreshed
on the I/O thread pool (google-auth is blocking), once for all concurrent
requests of every store of one configuration, and reused until they expire.

The configuration (what ``google.auth.default()`` would find): the variables
``GOOGLE_*`` (``GOOGLE_APPLICATION_CREDENTIALS``, the project), ``CLOUDSDK_*``
(gcloud's configuration folder), ``GCE_*`` and ``NO_GCE_CHECK`` (the metadata
server), ``HOME``/``APPDATA`` (where gcloud keeps its files); the credentials
file named by ``GOOGLE_APPLICATION_CREDENTIALS`` and gcloud's
``application_default_credentials.json``, by path, size and modification time.
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Mapping
from typing import Any

import yarl

from tensorstore_py.core.errors import StorageError
from tensorstore_py.core.ranges import Buffer
from tensorstore_py.kvstore._auth import CachedCredentials, CredentialsMode, configuration

__all__ = ["CredentialsMode", "GcsAuth", "require_google_auth"]

_SCOPE = "https://www.googleapis.com/auth/devstorage.read_write"
_INSTALL_HINT = 'pip install "tensorstore_py[gcs]"'
_ENV_PREFIXES = ("GOOGLE_", "CLOUDSDK_", "GCE_", "NO_GCE_CHECK", "HOME", "APPDATA")
#: the attribute that marks the token a 401 refused on google-auth's credentials
_REFUSED = "_tsp_refused_token"


class GcsAuth(CachedCredentials):
    """Bearer tokens from google-auth's application-default credentials."""

    driver = "gcs"

    def _configuration(self) -> tuple[Hashable, ...]:
        files = [os.path.join(_gcloud_folder(), "application_default_credentials.json")]
        if os.environ.get("GOOGLE_APPLICATION_CREDENTIALS"):
            files.append(os.environ["GOOGLE_APPLICATION_CREDENTIALS"])
        return configuration(_ENV_PREFIXES, files)

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
        return bool(creds.valid) and creds.token != getattr(creds, _REFUSED, None)

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
        setattr(creds, _REFUSED, None)  # whatever token came back is to be tried

    async def _sign(
        self, creds: Any, method: str, url: str | yarl.URL, headers: Mapping[str, str],
        data: Buffer | None,
    ) -> dict[str, str]:
        return {"Authorization": f"Bearer {creds.token}"}  # the same for every request

    def _forget(self, creds: Any, sent: Mapping[str, str] | None) -> None:
        # The refused token is marked, not cleared: requests in flight on other
        # threads still sign with it, and a refresh that already replaced it (a
        # request that carried an older one) leaves the new token usable.
        auth = (sent or {}).get("Authorization", "")
        refused = auth[len("Bearer "):] if auth.startswith("Bearer ") else creds.token
        setattr(creds, _REFUSED, refused)

    def _describe(self, creds: Any) -> str:
        who = getattr(creds, "service_account_email", None) or getattr(creds, "signer_email", None)
        kind = type(creds).__module__.rsplit(".", 1)[-1]
        return f"google-auth application-default credentials ({kind}{', ' + who if who else ''})"


def _gcloud_folder() -> str:
    """Where gcloud keeps its configuration (google-auth's rule: ``CLOUDSDK_CONFIG``,
    else ``%APPDATA%\\gcloud`` on Windows, else ``~/.config/gcloud``)."""
    if os.environ.get("CLOUDSDK_CONFIG"):
        return os.environ["CLOUDSDK_CONFIG"]
    if os.name == "nt" and os.environ.get("APPDATA"):
        return os.path.join(os.environ["APPDATA"], "gcloud")
    return os.path.join(os.path.expanduser("~"), ".config", "gcloud")


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
