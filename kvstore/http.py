"""Read-only store over HTTP(S): ``GET`` with ``Range``, ``HEAD``, ETag generations.

Key ``k`` of a store with ``base_url="http://host:port"`` and ``path="/vol/"`` is
the URL ``http://host:port/vol/k`` (the key is percent-encoded).

Guarantees:

* Read-only: ``write``, ``delete`` and ``delete_range`` raise ReadOnlyError.
* ``list`` raises UnsupportedError: HTTP has no way to enumerate keys.
* Byte ranges are requested with a ``Range`` header (``bytes=a-b``, ``bytes=a-``,
  suffix ``bytes=-n``). A server that ignores ``Range`` and answers ``200`` with the
  whole body is handled by slicing locally, so results are the same either way.
* Generation = the ``ETag`` header (else ``Last-Modified``). ``read(...,
  if_not_equal=g)`` sends ``If-None-Match`` and maps ``304`` to ``"unchanged"``.
  A server that sends neither validator gets a fresh generation on every read
  (never "unchanged": correct, just not cacheable).
* ``404``/``410`` are a missing key (a result, not an error).
* Retries: ``408``, ``429``, any ``5xx``, connection resets, truncated bodies and
  timeouts are retried with jittered exponential backoff (honouring
  ``Retry-After`` up to the backoff cap); other statuses raise StorageError
  naming the URL and status at once. The policy is the spec's ``retries``
  (``{"max_attempts": 7, "initial_delay": 0.05, "max_delay": 5.0}`` by default),
  as for the gcs store. The older fields ``max_retries`` (retries after the first
  attempt: ``max_attempts - 1``) and ``backoff_base`` (``initial_delay``) are
  accepted as aliases, not together with ``retries``; a spec keeps the form it
  was given in.
* At most ``max_concurrency`` requests of one store run at a time.

Connections: the shared per-event-loop sessions of :mod:`tensorstore_py.kvstore._http`
(closed at interpreter exit; a forked child gets its own without touching the
parent's sockets).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote, urlsplit

import aiohttp

from tensorstore_py.core.errors import InvalidSpecError, StorageError, UnsupportedError
from tensorstore_py.core.retry import RetryPolicy
from tensorstore_py.kvstore._http import (
    HttpClient,
    Response,
    partial_body,
    range_header,
    retries_spec,
    retry_policy,
)
from tensorstore_py.kvstore.base import (
    Buffer,
    ByteRange,
    Generation,
    KvStore,
    ReadResult,
)
from tensorstore_py.kvstore.registry import register_kvstore

__all__ = ["DEFAULT_RETRIES", "HttpKvStore"]

_MISSING_STATUS = frozenset({404, 410})
#: the retry policy when the spec sets none (7 attempts, backoff capped at 5 s)
DEFAULT_RETRIES = RetryPolicy(max_attempts=7, initial_delay=0.05, max_delay=5.0)


class HttpKvStore(KvStore):
    """A read-only store of the files under ``base_url + path``."""

    driver = "http"
    read_only = True

    def __init__(
        self,
        *,
        base_url: str,
        path: str = "/",
        max_concurrency: int = 32,
        request_timeout: float = 60.0,
        retries: Mapping[str, Any] | RetryPolicy | None = None,
        max_retries: int | None = None,
        backoff_base: float | None = None,
    ) -> None:
        parts = urlsplit(base_url) if isinstance(base_url, str) else None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidSpecError(
                f"http kvstore: base_url must look like http(s)://host[:port], got {base_url!r}"
            )
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise InvalidSpecError(
                f"http kvstore: base_url {base_url!r} must not hold a path, query or "
                "fragment (put the path in 'path')"
            )
        if not isinstance(path, str) or "\x00" in path or "?" in path or "#" in path:
            raise InvalidSpecError(f"http kvstore: bad path {path!r}")
        if not path.startswith("/"):
            path = "/" + path
        if not path.endswith("/"):
            path += "/"
        if not isinstance(max_concurrency, int) or max_concurrency < 1:
            raise InvalidSpecError(
                f"http kvstore: max_concurrency must be an int >= 1, got {max_concurrency!r}"
            )
        if not request_timeout > 0:
            raise InvalidSpecError("http kvstore: request_timeout must be > 0")
        super().__init__(path=path)
        self.base_url = f"{parts.scheme}://{parts.netloc}"
        self.max_concurrency = self.requests_in_flight = max_concurrency
        self.request_timeout = float(request_timeout)
        self.retry_policy = _policy(retries, max_retries, backoff_base)
        self._retries_option = retries_spec(retries)
        self._aliases = {
            k: v
            for k, v in (("max_retries", max_retries), ("backoff_base", backoff_base))
            if v is not None and v != _ALIAS_DEFAULTS[k]
        }
        self._client = HttpClient(
            concurrency=max_concurrency,
            retries=self.retry_policy,
            timeout=aiohttp.ClientTimeout(total=self.request_timeout),
        )

    @property
    def max_retries(self) -> int:
        """Retries after the first attempt (``retry_policy.max_attempts - 1``)."""
        return self.retry_policy.max_attempts - 1

    @property
    def backoff_base(self) -> float:
        """The first retry's backoff window in seconds (``retry_policy.initial_delay``)."""
        return self.retry_policy.initial_delay

    # -- spec -----------------------------------------------------------------------
    _DEFAULTS = {"max_concurrency": 32, "request_timeout": 60.0}

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> HttpKvStore:
        allowed = {"driver", "base_url", "path", "retries", *cls._DEFAULTS, *_ALIAS_DEFAULTS}
        unknown = set(spec) - allowed
        if unknown:
            raise InvalidSpecError(
                f"http kvstore spec: unknown fields {sorted(unknown)}; allowed: {sorted(allowed)}"
            )
        if "base_url" not in spec:
            raise InvalidSpecError(
                "http kvstore spec: 'base_url' (http(s)://host[:port]) is required"
            )
        opts = {k: spec[k] for k in (*cls._DEFAULTS, *_ALIAS_DEFAULTS, "retries") if k in spec}
        return cls(base_url=spec["base_url"], path=spec.get("path", "/"), **opts)

    @classmethod
    def spec_from_url(cls, url: str) -> dict[str, Any]:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidSpecError(
                f"malformed http URL {url!r}: expected http(s)://host[:port]/path"
            )
        if parts.query or parts.fragment:
            raise InvalidSpecError(
                f"http URL {url!r}: query strings and fragments are not supported"
            )
        try:
            parts.port  # noqa: B018 - validates the port
        except ValueError as e:
            raise InvalidSpecError(f"malformed http URL {url!r}: {e}") from None
        return {
            "driver": "http",
            "base_url": f"{parts.scheme}://{parts.netloc}",
            "path": parts.path or "/",
        }

    def _spec_fields(self) -> dict[str, Any]:
        d: dict[str, Any] = {"base_url": self.base_url}
        for k, default in self._DEFAULTS.items():
            if getattr(self, k) != default:
                d[k] = getattr(self, k)
        if self._retries_option is not None:
            d["retries"] = self._retries_option
        d.update(self._aliases)
        return d

    def url(self) -> str:
        return self.base_url + quote(self.path, safe="/")

    def _key_url(self, full_key: str) -> str:
        return self.base_url + quote(full_key, safe="/")

    async def _request(self, method: str, url: str, headers: dict[str, str]) -> Response:
        # identity: byte ranges and ETags address the stored bytes
        return await self._client.request(
            method, url, what=f"http kvstore: {method} {url}",
            headers={"Accept-Encoding": "identity", **headers},
        )

    # -- reads -----------------------------------------------------------------------
    async def _read(
        self, key: str, byte_range: ByteRange | None, if_not_equal: Generation | None
    ) -> ReadResult:
        url = self._key_url(key)
        if (
            byte_range is not None
            and byte_range.stop is not None
            and byte_range.stop <= byte_range.start
        ):
            # HTTP can not ask for zero bytes: check existence with HEAD
            return await self._head_empty(url, if_not_equal)
        headers = _if_none_match(if_not_equal)
        if byte_range is not None:
            headers["Range"] = range_header(byte_range)
        resp = await self._request("GET", url, headers)
        if resp.status in _MISSING_STATUS:
            return ReadResult.missing()
        if resp.status == 304:
            return ReadResult("unchanged", b"", if_not_equal or _generation(resp.headers))
        if resp.status == 416:
            # the range starts at or past the end: an empty read of an existing value
            return await self._head_empty(url, if_not_equal)
        gen = _generation(resp.headers)
        if if_not_equal is not None and gen == if_not_equal:
            return ReadResult("unchanged", b"", gen)  # server ignored If-None-Match
        if resp.status == 200:
            value: Buffer = resp.body
            if byte_range is not None:  # the server ignored Range: slice here
                value = byte_range.apply(memoryview(resp.body))
            return ReadResult("value", value, gen)
        if resp.status == 206 and byte_range is not None:
            return ReadResult("value", partial_body(f"http kvstore: GET {url}", byte_range, resp), gen)
        raise StorageError(
            f"http kvstore: GET {url}: unexpected HTTP {resp.status} "
            f"(expected 200, 206, 304, 404 or 416)"
        )

    async def _head_empty(self, url: str, if_not_equal: Generation | None) -> ReadResult:
        resp = await self._request("HEAD", url, _if_none_match(if_not_equal))
        if resp.status in _MISSING_STATUS:
            return ReadResult.missing()
        if resp.status == 304:
            return ReadResult("unchanged", b"", if_not_equal or _generation(resp.headers))
        if resp.status != 200:
            raise StorageError(f"http kvstore: HEAD {url}: unexpected HTTP {resp.status}")
        gen = _generation(resp.headers)
        if if_not_equal is not None and gen == if_not_equal:
            return ReadResult("unchanged", b"", gen)
        return ReadResult("value", b"", gen)

    # -- everything else ---------------------------------------------------------------
    async def _write(self, key: str, value: Buffer, if_equal: Generation | None) -> Generation:
        raise AssertionError("unreachable: the http store is read-only")  # pragma: no cover

    async def _delete(self, key: str, if_equal: Generation | None) -> None:
        raise AssertionError("unreachable: the http store is read-only")  # pragma: no cover

    async def _list(self, prefix: str) -> list[str]:
        raise UnsupportedError(
            f"list of {prefix!r}: HTTP can not enumerate keys ({self.base_url}{self.path}); "
            "read known keys instead"
        )


def _if_none_match(if_not_equal: Generation | None) -> dict[str, str]:
    """Revalidation headers: only ETag generations ("e:" tokens) can be sent."""
    if if_not_equal is not None and if_not_equal.token.startswith(b"e:"):
        return {"If-None-Match": if_not_equal.token[2:].decode("latin-1")}
    return {}


def _generation(headers: Any) -> Generation:
    etag = headers.get("ETag")
    if etag:
        return Generation(b"e:" + etag.encode("latin-1"))
    lm = headers.get("Last-Modified")
    if lm:
        return Generation(
            b"m:"
            + lm.encode("latin-1")
            + b"/"
            + headers.get("Content-Length", "").encode("latin-1")
        )
    return Generation(b"u:" + uuid.uuid4().bytes)  # no validator: never "unchanged"


_ALIAS_DEFAULTS: dict[str, Any] = {"max_retries": DEFAULT_RETRIES.max_attempts - 1,
                                   "backoff_base": DEFAULT_RETRIES.initial_delay}


def _policy(
    retries: Mapping[str, Any] | RetryPolicy | None, max_retries: int | None, backoff_base: float | None
) -> RetryPolicy:
    """The retry policy from ``retries`` or from the older ``max_retries`` /
    ``backoff_base`` fields (aliases; the backoff cap stays ``DEFAULT_RETRIES``')."""
    if max_retries is None and backoff_base is None:
        return retry_policy(retries, DEFAULT_RETRIES)
    if retries is not None:
        raise InvalidSpecError(
            "http kvstore: give 'retries' or the older 'max_retries'/'backoff_base', not both"
        )
    if max_retries is not None and (not isinstance(max_retries, int) or max_retries < 0):
        raise InvalidSpecError(f"http kvstore: max_retries must be an int >= 0, got {max_retries!r}")
    if backoff_base is not None and not (isinstance(backoff_base, (int, float)) and backoff_base >= 0):
        raise InvalidSpecError(f"http kvstore: backoff_base must be >= 0, got {backoff_base!r}")
    cap = DEFAULT_RETRIES.max_delay
    return RetryPolicy(
        max_attempts=(DEFAULT_RETRIES.max_attempts - 1 if max_retries is None else max_retries) + 1,
        initial_delay=min(cap, DEFAULT_RETRIES.initial_delay if backoff_base is None else backoff_base),
        max_delay=cap,
    )


register_kvstore(HttpKvStore, schemes=("http", "https"))
