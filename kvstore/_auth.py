"""Credentials of the object stores: one cache and one "auto" policy for gcs and s3.

A store's credentials mode is one of:

* ``"anonymous"``: requests carry no credentials;
* ``"default"``: the provider's standard chain (google-auth's application
  default credentials; the AWS chain) must find credentials, else every
  request fails with StorageError saying what was looked for;
* ``"auto"``: the standard chain when it finds credentials, else anonymous
  access (public buckets), with one warning. The lookup is not given up for
  good: it is repeated after :data:`RELOOKUP_SECONDS` and after any 401/403
  answer to an anonymous request (the credentials may have appeared since:
  a mounted secret, a metadata server that was slow to start).

Lookups and refreshes are blocking library calls: they run on the I/O thread
pool, one at a time per store (concurrent requests wait for the same lookup),
never on the event loop. A provider subclass says how to look up, check and
refresh its credentials and how to put them on a request.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, Literal

import yarl

from tensorstore_py.core.errors import InvalidSpecError, StorageError
from tensorstore_py.core.pools import run_io
from tensorstore_py.core.ranges import Buffer

__all__ = ["RELOOKUP_SECONDS", "CachedCredentials", "CredentialsMode", "check_mode"]

CredentialsMode = Literal["auto", "default", "anonymous"]
#: how long "auto" mode stays anonymous after a lookup found nothing
RELOOKUP_SECONDS = 60.0
#: (driver, reason) pairs already warned about: one warning per process, not per store
_warned: set[tuple[str, str]] = set()


def check_mode(driver: str, value: Any) -> CredentialsMode:
    """``value`` as a credentials mode (None = "auto"), else InvalidSpecError."""
    if value is None:
        return "auto"
    if value not in ("auto", "default", "anonymous"):
        raise InvalidSpecError(
            f"{driver}: credentials must be 'auto', 'default' or 'anonymous', got {value!r}"
        )
    return value  # type: ignore[no-any-return]


class CachedCredentials(ABC):
    """An :class:`~tensorstore_py.kvstore._http.Auth` over a provider's credentials,
    cached and refreshed off the event loop (subclasses implement the provider)."""

    #: the store's name in messages and in the log
    driver: str = ""

    def __init__(self, mode: CredentialsMode, *, anonymous: bool, why_anonymous: str = "") -> None:
        self.mode = mode
        #: True when requests go without credentials for good (mode or endpoint)
        self.anonymous = anonymous
        self._why_anonymous = why_anonymous or mode
        self._creds: Any = None
        self._none_until = 0.0  # auto mode found nothing: anonymous until then
        self._none_reason = ""
        self._lock = threading.Lock()
        self._log = logging.getLogger(f"tensorstore_py.kvstore.{self.driver}")

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_creds"] = None  # looked up again where it is unpickled
        del state["_lock"], state["_log"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._log = logging.getLogger(f"tensorstore_py.kvstore.{self.driver}")

    # -- what a provider implements ------------------------------------------------------
    @abstractmethod
    def _lookup(self) -> tuple[Any, str]:
        """Blocking: (credentials or None, what was looked for or why none was found)."""

    @abstractmethod
    def _usable(self, creds: Any) -> bool:
        """True when ``creds`` can sign a request now (not expired)."""

    @abstractmethod
    def _refresh(self, creds: Any) -> None:
        """Blocking: make ``creds`` usable; raise ConnectionError when the provider's
        endpoint is unreachable (transient), StorageError when refused."""

    @abstractmethod
    async def _sign(
        self, creds: Any, method: str, url: str | yarl.URL, headers: Mapping[str, str],
        data: Buffer | None,
    ) -> dict[str, str]:
        """Headers that authenticate this request with ``creds``."""

    @abstractmethod
    def _describe(self, creds: Any) -> str:
        """The credentials in words (their source and identity, no secrets)."""

    @abstractmethod
    def _forget(self, creds: Any) -> None:
        """Drop what ``creds`` cache (a token) after a 401, so they are refreshed."""

    # -- the Auth protocol ----------------------------------------------------------------
    async def headers(
        self, method: str, url: str | yarl.URL, headers: Mapping[str, str], data: Buffer | None
    ) -> dict[str, str]:
        if self.anonymous:
            return {}
        creds = self._creds
        if creds is None or not self._usable(creds):
            if creds is None and time.monotonic() < self._none_until:
                return {}  # auto mode: anonymous until the next lookup
            creds = await run_io(self._ensure)
            if creds is None:
                return {}
        return await self._sign(creds, method, url, headers, data)

    def invalidate(self, status: int) -> bool:
        """After a 401/403: True when one retry may succeed (fresh credentials, or a
        new lookup in auto mode)."""
        if self.anonymous:
            return False
        creds = self._creds
        if creds is None:
            if self._none_until:  # anonymous by auto fallback: look up again now
                self._none_until = 0.0
                return True
            return False
        if status == 401:
            self._forget(creds)
            return True
        return False  # 403 with credentials: a permission, not an expiry

    def describe(self) -> str:
        if self.anonymous:
            return f"anonymous ({self._why_anonymous})"
        creds = self._creds
        if creds is not None:
            return self._describe(creds)
        if self._none_reason:
            return f"anonymous ({self._none_reason})"
        return f"{self.mode} (not looked up yet)"

    # -- lookup ---------------------------------------------------------------------------
    def _ensure(self) -> Any:
        """Blocking, one caller at a time: usable credentials, or None (auto mode
        found none)."""
        with self._lock:
            if self._creds is None:
                if time.monotonic() < self._none_until:
                    return None
                creds, reason = self._lookup()
                if creds is None:
                    if self.mode == "default":
                        raise StorageError(f"{self.driver}: no credentials found: {reason}")
                    self._none_until = time.monotonic() + RELOOKUP_SECONDS
                    self._none_reason = f"no credentials found: {reason}"
                    if (self.driver, reason) not in _warned:
                        _warned.add((self.driver, reason))
                        self._log.warning(
                            "%s: no credentials found (%s); using anonymous access, looking "
                            "again in %.0f s or after an access denial",
                            self.driver, reason, RELOOKUP_SECONDS,
                        )
                    return None
                self._creds, self._none_until, self._none_reason = creds, 0.0, ""
            if not self._usable(self._creds):
                self._refresh(self._creds)
            return self._creds
