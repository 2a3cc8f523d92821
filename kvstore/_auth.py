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

Credentials are shared per process and per configuration: every store of one
provider and mode whose configuration is the same (what decides what the
provider's chain finds: its environment variables and its credentials files, by
path, size and modification time; see :func:`configuration`) uses ONE set of
credentials: one lookup, one token, one refresh before expiry, for all those
stores and all their concurrent requests, from any thread or event loop. A
401 answer to a token makes the next request of every such store wait for one
new token; an "auto" fallback to anonymous access and its pause are shared
the same way. A lookup that is due (the first, or after the pause) is made
under the configuration of that moment, so a store opened after a variable or
a credentials file changed looks up again. Nothing of this travels in a
pickle: an unpickled store looks up in its own process.

Lookups and refreshes are blocking library calls: they run on the I/O thread
pool, one at a time per configuration (concurrent requests wait for the same
lookup), never on the event loop. A provider subclass says what its
configuration is, how to look up, check and refresh its credentials and how to
put them on a request.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterable, Mapping
from typing import Any, Literal

import yarl

from tensorstore_py.core.errors import InvalidSpecError, StorageError
from tensorstore_py.core.pools import run_io
from tensorstore_py.core.ranges import Buffer

__all__ = ["RELOOKUP_SECONDS", "CachedCredentials", "CredentialsMode", "check_mode",
           "configuration"]

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


FileStamp = tuple[str, int | None, int | None]


def configuration(prefixes: tuple[str, ...], paths: Iterable[str]) -> tuple[Hashable, ...]:
    """What a provider's chain would find, as a key: the environment variables whose
    names start with one of ``prefixes`` (name and value), and each file of ``paths``
    as (path, modification time in ns, size), or (path, None, None) when missing.
    Two equal keys mean the chain finds the same credentials (a few microseconds)."""
    files: list[FileStamp] = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            files.append((path, None, None))
        else:
            files.append((path, st.st_mtime_ns, st.st_size))
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(prefixes)))
    return (env, tuple(files))


class _Shared:
    """The credentials of one (provider, mode, configuration), shared by its stores:
    what the last lookup found, the "auto" pause, and the lock that makes lookups
    and refreshes one at a time."""

    __slots__ = ("__weakref__", "creds", "lock", "none_reason", "none_until")

    def __init__(self) -> None:
        self.creds: Any = None
        self.none_until = 0.0  # auto mode found nothing: anonymous until then
        self.none_reason = ""
        self.lock = threading.Lock()


#: shared credentials by (provider, mode, configuration); stores keep theirs alive
_shared: dict[tuple[Hashable, ...], _Shared] = {}
_shared_lock = threading.Lock()
_MAX_SHARED = 32
_every_shared: weakref.WeakSet[_Shared] = weakref.WeakSet()


def _shared_for(key: tuple[Hashable, ...]) -> _Shared:
    with _shared_lock:
        got = _shared.get(key)
        if got is None:
            if len(_shared) >= _MAX_SHARED:
                _shared.clear()  # configurations that come and go (tests): start over
            got = _shared[key] = _Shared()
            _every_shared.add(got)
        return got


def _after_fork_in_child() -> None:
    global _shared_lock
    _shared_lock = threading.Lock()  # another thread of the parent may have held these
    for shared in list(_every_shared):
        shared.lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


class CachedCredentials(ABC):
    """An :class:`~tensorstore_py.kvstore._http.Auth` over a provider's credentials,
    shared by the stores of one configuration, cached and refreshed off the event
    loop (subclasses implement the provider)."""

    #: the store's name in messages and in the log
    driver: str = ""

    def __init__(self, mode: CredentialsMode, *, anonymous: bool, why_anonymous: str = "") -> None:
        self.mode = mode
        #: True when requests go without credentials for good (mode or endpoint)
        self.anonymous = anonymous
        self._why_anonymous = why_anonymous or mode
        self._state: _Shared | None = None  # found on first use (see _bind)
        self._log = logging.getLogger(f"tensorstore_py.kvstore.{self.driver}")

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_state"] = None  # looked up again where it is unpickled
        del state["_log"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._log = logging.getLogger(f"tensorstore_py.kvstore.{self.driver}")

    # -- what a provider implements ------------------------------------------------------
    @abstractmethod
    def _configuration(self) -> tuple[Hashable, ...]:
        """What decides what :meth:`_lookup` finds (see :func:`configuration`)."""

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
    def _forget(self, creds: Any, sent: Mapping[str, str] | None) -> None:
        """After a 401 to a request that carried ``sent`` (None: unknown): drop what
        ``creds`` cache (a token) so they are refreshed, unless ``sent`` shows that
        the request carried one that was replaced already (called on the event loop,
        concurrently with requests signed by ``creds`` on other threads)."""

    # -- the Auth protocol ----------------------------------------------------------------
    async def headers(
        self, method: str, url: str | yarl.URL, headers: Mapping[str, str], data: Buffer | None
    ) -> dict[str, str]:
        if self.anonymous:
            return {}
        state = self._state or self._bind()
        creds = state.creds
        if creds is None or not self._usable(creds):
            if creds is None and time.monotonic() < state.none_until:
                return {}  # auto mode: anonymous until the next lookup
            creds = await run_io(self._ensure)
            if creds is None:
                return {}
        return await self._sign(creds, method, url, headers, data)

    def invalidate(self, status: int, sent: Mapping[str, str] | None = None) -> bool:
        """After a 401/403 to a request that carried the headers ``sent``: True when one
        retry may succeed (fresh credentials, or a new lookup in auto mode)."""
        if self.anonymous or self._state is None:
            return False
        state = self._state
        creds = state.creds
        if creds is None:
            if state.none_until:  # anonymous by auto fallback: look up again now
                state.none_until = 0.0
                return True
            return False
        if status == 401:
            self._forget(creds, sent)
            return True
        return False  # 403 with credentials: a permission, not an expiry

    def describe(self) -> str:
        if self.anonymous:
            return f"anonymous ({self._why_anonymous})"
        state = self._state
        if state is not None and state.creds is not None:
            return self._describe(state.creds)
        if state is not None and state.none_reason:
            return f"anonymous ({state.none_reason})"
        return f"{self.mode} (not looked up yet)"

    # -- lookup ---------------------------------------------------------------------------
    def _bind(self) -> _Shared:
        """The shared credentials of this provider, mode and the configuration of now."""
        state = self._state = _shared_for((type(self).__qualname__, self.mode,
                                           self._configuration()))
        return state

    def _ensure(self) -> Any:
        """Blocking, one caller at a time per configuration: usable credentials, or
        None (auto mode found none)."""
        state = self._state
        if state is None or (state.creds is None and time.monotonic() >= state.none_until):
            state = self._bind()  # a lookup is due: under the configuration of now
        with state.lock:
            if state.creds is None:
                if time.monotonic() < state.none_until:
                    return None
                creds, reason = self._lookup()
                if creds is None:
                    if self.mode == "default":
                        raise StorageError(f"{self.driver}: no credentials found: {reason}")
                    state.none_until = time.monotonic() + RELOOKUP_SECONDS
                    state.none_reason = f"no credentials found: {reason}"
                    if (self.driver, reason) not in _warned:
                        _warned.add((self.driver, reason))
                        self._log.warning(
                            "%s: no credentials found (%s); using anonymous access, looking "
                            "again in %.0f s or after an access denial",
                            self.driver, reason, RELOOKUP_SECONDS,
                        )
                    return None
                state.creds, state.none_until, state.none_reason = creds, 0.0, ""
            if not self._usable(state.creds):
                self._refresh(state.creds)
            return state.creds
