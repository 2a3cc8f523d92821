"""Google Cloud Storage store over the GCS JSON API (aiohttp).

Spec::

    {"driver": "gcs", "bucket": "my-bucket", "path": "some/prefix/",
     "endpoint": "http://127.0.0.1:4443",   # optional; else $STORAGE_EMULATOR_HOST, else GCS
     "concurrency": 32,                     # optional; requests in flight per store
     "credentials": "auto",                 # optional; "auto" | "default" | "anonymous"
     "retries": {"max_attempts": 10, "initial_delay": 0.05, "max_delay": 10.0}}

URL form: ``gs://bucket/path/``.

Guarantees:

* Atomicity: every write is one single-request multipart upload, so an object
  is replaced as a whole. Conditions use GCS preconditions: ``ifGenerationMatch``
  (0 = create-only); a lost condition (HTTP 412) raises
  :class:`~tensorstore_py.errors.ConditionFailedError`. The multipart path is
  also the one on which fake-gcs-server enforces preconditions.
* Durability: GCS acknowledges an upload only once it is durably stored.
* Generation: the object generation (``x-goog-generation``), which changes on
  every write.
* Integrity: uploads carry the value's crc32c, which GCS verifies; whole-object
  reads are checked against ``x-goog-hash`` (mismatch -> ChecksumError).
* Retries: 408/429/5xx answers, connection resets, dropped or truncated
  responses and timeouts are retried with jittered exponential backoff
  (``retries``); 404, 412 and other 4xx answers never are.
* Concurrency: at most ``concurrency`` requests of one store (and its
  ``with_path`` views) are in flight at once.

Retried conditional writes. A conditional write whose response was lost may have
landed; its retry then fails its own precondition (412), which at the HTTP level
looks exactly like a lost race. Each upload therefore carries a unique write-id
in its custom metadata (``tsp-write-id``), and a 412 on a *retry* is resolved by
reading the object's metadata back: if it carries our write-id, the write landed
and its generation is returned. For create-only writes this is exact (nobody
else can have created the object after ours; only an unconditional overwrite or
a delete in between would hide it). For compare-and-swap one window remains: a
lost response followed by another writer's successful swap before our retry; the
call then reports ConditionFailedError although our value was stored (briefly).
Layers that need exactly-once commits stamp their own write-ids into what they
write and read them back, as the transactional store does.

Conditional deletes. fake-gcs-server ignores preconditions on DELETE, so a
conditional delete first reads the object's generation (failing fast with the
found generation in the message), then deletes with ``ifGenerationMatch``; real
GCS enforces that atomically, the emulator does not.

A missing bucket reads as missing keys (GCS answers 404 to both) but makes
``list`` raise NotFoundError.

Credentials (``"auto"``): anonymous when ``STORAGE_EMULATOR_HOST`` is set or the
endpoint is plain ``http://`` (an emulator or test proxy; tokens must not travel
unencrypted); otherwise google-auth's application-default credentials, falling
back to anonymous access (public buckets) with a warning when none are found.
``"default"`` requires those credentials; ``"anonymous"`` never sends any.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import json
import os
import re
import uuid
from collections.abc import Mapping
from typing import Any, Literal, TypedDict
from urllib.parse import quote, urlencode

import crc32c as _crc32c
import yarl

from tensorstore_py.core.errors import (
    ChecksumError,
    ConditionFailedError,
    InvalidSpecError,
    NotFoundError,
    StorageError,
)
from tensorstore_py.core.pools import run_cpu
from tensorstore_py.core.retry import DEFAULT_RETRY_POLICY, RetryPolicy
from tensorstore_py.kvstore._gcs_auth import CredentialsMode, GcsAuth, require_google_auth
from tensorstore_py.kvstore._http import (
    HttpClient,
    Response,
    range_header,
    retries_spec,
    retry_policy,
)
from tensorstore_py.kvstore.base import (
    Buffer,
    ByteRange,
    Generation,
    KeyInfo,
    KvStore,
    ReadResult,
    validate_key,
)
from tensorstore_py.kvstore.registry import register_kvstore

__all__ = ["DEFAULT_CONCURRENCY", "DEFAULT_ENDPOINT", "GcsKvStore", "GcsSpec", "validate_bucket"]

DEFAULT_ENDPOINT = "https://storage.googleapis.com"
DEFAULT_CONCURRENCY = 32
_WRITE_ID = "tsp-write-id"
_BIG = 1 << 20  # values above this are checksummed/assembled off the loop thread


class RetriesSpec(TypedDict, total=False):
    max_attempts: int
    initial_delay: float
    max_delay: float


class GcsSpec(TypedDict, total=False):
    """The JSON spec of a gcs store (``driver`` and ``bucket`` are required)."""

    driver: Literal["gcs"]
    bucket: str
    path: str
    endpoint: str
    concurrency: int
    credentials: CredentialsMode
    retries: RetriesSpec


# Bucket names: https://cloud.google.com/storage/docs/buckets#naming
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$")
_IPV4_RE = re.compile(r"^\d{1,3}(\.\d{1,3}){3}$")


def validate_bucket(bucket: Any) -> str:
    """Return ``bucket`` if it is a valid GCS bucket name, else raise InvalidSpecError."""
    if not isinstance(bucket, str) or not _BUCKET_RE.match(bucket):
        raise InvalidSpecError(
            f"gcs: invalid bucket name {bucket!r}: 3-222 characters of a-z, 0-9, '-', '_', '.', "
            "starting and ending with a letter or digit"
        )
    if any(len(part) > 63 for part in bucket.split(".")) or (".." in bucket):
        raise InvalidSpecError(f"gcs: invalid bucket name {bucket!r}: a dot-separated part is "
                               "empty or longer than 63 characters")
    if "." not in bucket and len(bucket) > 63:
        raise InvalidSpecError(f"gcs: invalid bucket name {bucket!r}: longer than 63 characters")
    if bucket.startswith("goog") or _IPV4_RE.match(bucket):
        raise InvalidSpecError(f"gcs: invalid bucket name {bucket!r}: reserved form")
    return bucket


def _resolve_endpoint(endpoint: str | None) -> tuple[str, bool]:
    """(endpoint URL, whether it came from STORAGE_EMULATOR_HOST)."""
    if endpoint is not None:
        if not isinstance(endpoint, str):
            raise InvalidSpecError(f"gcs: endpoint must be a string, got {endpoint!r}")
        return _normalize_endpoint(endpoint), False
    emulator = os.environ.get("STORAGE_EMULATOR_HOST")
    if emulator:
        return _normalize_endpoint(emulator), True
    return DEFAULT_ENDPOINT, False


def _normalize_endpoint(endpoint: str) -> str:
    endpoint = endpoint.strip().rstrip("/")
    if not endpoint:
        raise InvalidSpecError("gcs: endpoint must not be empty")
    if "://" not in endpoint:  # STORAGE_EMULATOR_HOST is often "host:port"
        endpoint = "http://" + endpoint
    if not endpoint.startswith(("http://", "https://")):
        raise InvalidSpecError(f"gcs: endpoint {endpoint!r} must be an http(s) URL")
    return endpoint


def _message(resp: Response) -> str:
    """The message of a GCS JSON error document (else the start of the body)."""
    try:
        return str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):  # not a JSON error document
        return resp.snippet()


def _generation_of(token: Generation) -> int | None:
    """The numeric GCS generation of ``token``; None if it is not a GCS generation."""
    t = token.token
    return int(t) if t.isdigit() else None


def _write_id(meta: Mapping[str, Any]) -> str | None:
    """The write-id an upload of ours stored in the object's custom metadata."""
    return (meta.get("metadata") or {}).get(_WRITE_ID)


def _show(g: Generation) -> str:
    """A generation as GCS shows it (its number), else its repr."""
    n = _generation_of(g)
    return str(n) if n is not None else repr(g)


def _gen(value: Any) -> Generation:
    return Generation(str(int(value)).encode())


class GcsKvStore(KvStore):
    """Objects in a GCS bucket (or an emulator speaking the GCS JSON API)."""

    driver = "gcs"
    #: objects per list request (GCS allows up to 1000)
    list_page_size: int = 1000

    def __init__(
        self,
        *,
        bucket: str,
        path: str = "",
        endpoint: str | None = None,
        concurrency: int | None = None,
        credentials: CredentialsMode | None = None,
        retries: Mapping[str, Any] | RetryPolicy | None = None,
    ) -> None:
        self.bucket = validate_bucket(bucket)
        if not isinstance(path, str):
            raise InvalidSpecError(f"gcs: path must be a string, got {path!r}")
        if path.strip("/"):
            try:
                validate_key(path.strip("/"))
            except ValueError as e:
                raise InvalidSpecError(f"gcs: invalid path {path!r}: {e}") from None
            path = path.strip("/") + "/"
        else:
            path = ""
        super().__init__(path=path)
        self._endpoint_option = endpoint
        self.endpoint, from_env = _resolve_endpoint(endpoint)
        if concurrency is not None and (
            not isinstance(concurrency, int) or isinstance(concurrency, bool) or concurrency < 1
        ):
            raise InvalidSpecError(f"gcs: concurrency must be an int >= 1, got {concurrency!r}")
        self._concurrency_option = concurrency
        self.concurrency = concurrency or DEFAULT_CONCURRENCY
        mode = credentials or "auto"
        if mode not in ("auto", "default", "anonymous"):
            raise InvalidSpecError(
                f"gcs: credentials must be 'auto', 'default' or 'anonymous', got {credentials!r}"
            )
        self._credentials_option = credentials
        # "auto": no credentials for an emulator, nor over unencrypted http
        anonymous = mode == "anonymous" or (
            mode == "auto" and (from_env or self.endpoint.startswith("http://"))
        )
        if not anonymous:
            require_google_auth()
        self._auth = GcsAuth(mode, anonymous=anonymous)
        self.retry_policy = retry_policy(retries, DEFAULT_RETRY_POLICY)
        self._retries_option = retries_spec(retries)
        # shared with with_path() views (copy.copy keeps the same client)
        self._client = HttpClient(
            concurrency=self.concurrency,
            retries=self.retry_policy,
            auth=self._auth,
        )

    # -- spec ---------------------------------------------------------------------------
    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> GcsKvStore:
        allowed = {"driver", "bucket", "path", "endpoint", "concurrency", "credentials", "retries"}
        unknown = set(spec) - allowed
        if unknown:
            raise InvalidSpecError(
                f"gcs kvstore spec: unknown fields {sorted(unknown)}; allowed: {sorted(allowed)}"
            )
        if "bucket" not in spec:
            raise InvalidSpecError(f"gcs kvstore spec {spec!r}: 'bucket' is required")
        return cls(
            bucket=spec["bucket"],
            path=spec.get("path", ""),
            endpoint=spec.get("endpoint"),
            concurrency=spec.get("concurrency"),
            credentials=spec.get("credentials"),
            retries=spec.get("retries"),
        )

    @classmethod
    def spec_from_url(cls, url: str) -> dict[str, Any]:
        if not url.lower().startswith("gs://"):
            raise InvalidSpecError(f"gcs URL {url!r} must start with gs://")
        rest = url[len("gs://"):]
        if "?" in rest or "#" in rest:
            raise InvalidSpecError(
                f"gcs URL {url!r}: query strings and fragments are not supported"
            )
        bucket, _, path = rest.partition("/")
        if not bucket:
            raise InvalidSpecError(f"gcs URL {url!r} names no bucket: expected gs://bucket/path/")
        validate_bucket(bucket)
        return {"driver": "gcs", "bucket": bucket, "path": path}

    def _spec_fields(self) -> dict[str, Any]:
        d: dict[str, Any] = {"bucket": self.bucket}
        if self._endpoint_option is not None:
            d["endpoint"] = self._endpoint_option
        if self._concurrency_option is not None:
            d["concurrency"] = self._concurrency_option
        if self._credentials_option is not None:
            d["credentials"] = self._credentials_option
        if self._retries_option is not None:
            d["retries"] = self._retries_option
        return d

    def url(self) -> str:
        return f"gs://{self.bucket}/{self.path}"

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickle as the spec (the store holds locks and per-loop state).
        return (GcsKvStore.from_spec, (self.spec(),))

    def __copy__(self) -> GcsKvStore:
        # A plain shallow copy (with_path views share credentials and the request bound);
        # without this, copy.copy would go through __reduce__ and lose both.
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__)
        return other

    def _where(self, key: str) -> str:
        return f"gs://{self.bucket}/{key}" + (
            "" if self.endpoint == DEFAULT_ENDPOINT else f" (endpoint {self.endpoint})"
        )

    # -- HTTP plumbing ----------------------------------------------------------------
    def _object_url(self, key: str, query: Mapping[str, Any]) -> yarl.URL:
        return self._url(f"/storage/v1/b/{quote(self.bucket, safe='')}/o/{quote(key, safe='')}",
                         query)

    def _url(self, path: str, query: Mapping[str, Any]) -> yarl.URL:
        # Build the encoded URL ourselves: object names need '/' escaped as %2F.
        qs = urlencode(query, quote_via=quote) if query else ""
        return yarl.URL(self.endpoint + path + ("?" + qs if qs else ""), encoded=True)

    async def _call(
        self,
        method: str,
        url: yarl.URL,
        *,
        what: str,
        headers: Mapping[str, str] | None = None,
        data: bytes | None = None,
    ) -> Response:
        """One request with retries; returns any non-retryable answer."""
        return await self._client.request(method, url, what=what, headers=headers, data=data)

    def _fail(self, what: str, resp: Response) -> StorageError:
        return StorageError(f"gcs {what}: HTTP {resp.status}: {_message(resp)}")

    async def _stat(self, key: str) -> dict[str, Any] | None:
        """The object's metadata (generation, size, metadata), or None if absent."""
        url = self._object_url(key, {"fields": "generation,size,metadata"})
        resp = await self._call("GET", url, what=f"stat of {self._where(key)}")
        if resp.status == 404:
            return None
        if resp.status != 200:
            raise self._fail(f"stat of {self._where(key)}", resp)
        return resp.json()

    async def _found(self, key: str) -> Generation | None:
        """Current generation of ``key`` for error messages (None if unknown)."""
        try:
            meta = await self._stat(key)
        except (StorageError, ValueError, KeyError):
            return None
        return Generation.NO_VALUE if meta is None else _gen(meta["generation"])

    def _condition_failed(
        self, op: str, key: str, expected: Generation, found: Generation | None
    ) -> ConditionFailedError:
        if expected.is_no_value:
            want = "the key to be absent" if op == "delete" else "create-only: the key to be absent"
        else:
            want = f"generation {_show(expected)}"
        got = "unknown" if found is None else (
            "the key is absent" if found.is_no_value else f"generation {_show(found)}"
        )
        return ConditionFailedError(
            f"gcs conditional {op} of {self._where(key)}: expected {want}, found {got}"
        )

    # -- reads --------------------------------------------------------------------------
    async def _read(
        self, key: str, byte_range: ByteRange | None, if_not_equal: Generation | None
    ) -> ReadResult:
        if byte_range is not None and byte_range.stop is not None \
                and byte_range.stop <= byte_range.start:
            # An empty range can not be expressed as an HTTP Range: ask for metadata only.
            meta = await self._stat(key)
            if meta is None:
                return ReadResult.missing()
            gen = _gen(meta["generation"])
            if if_not_equal is not None and gen == if_not_equal:
                return ReadResult("unchanged", b"", gen)
            return ReadResult("value", b"", gen)

        query: dict[str, Any] = {"alt": "media"}
        if if_not_equal is not None and _generation_of(if_not_equal) is not None:
            query["ifGenerationNotMatch"] = _generation_of(if_not_equal)
        headers = {} if byte_range is None else {"Range": range_header(byte_range)}
        what = f"read of {self._where(key)}"
        resp = await self._call("GET", self._object_url(key, query), what=what, headers=headers)
        if resp.status == 404:
            return ReadResult.missing()
        if resp.status == 304 and if_not_equal is not None:
            return ReadResult("unchanged", b"", if_not_equal)
        if resp.status == 416:
            # The range starts at or past the end: the object exists, the slice is empty.
            g = resp.headers.get("x-goog-generation")
            if g is None:
                meta = await self._stat(key)
                if meta is None:
                    return ReadResult.missing()
                g = meta["generation"]
            gen = _gen(g)
            if if_not_equal is not None and gen == if_not_equal:
                return ReadResult("unchanged", b"", gen)
            return ReadResult("value", b"", gen)
        if resp.status not in (200, 206):
            raise self._fail(what, resp)
        g = resp.headers.get("x-goog-generation")
        if g is None:
            raise StorageError(f"gcs {what}: the answer carries no x-goog-generation header")
        gen = _gen(g)
        # fake-gcs-server ignores ifGenerationNotMatch on media downloads; check here too.
        if if_not_equal is not None and gen == if_not_equal:
            return ReadResult("unchanged", b"", gen)
        value: Buffer = resp.body
        if resp.status == 200:
            await self._verify(key, resp)
            if byte_range is not None:  # a server that ignored Range: slice ourselves
                value = bytes(byte_range.apply(value))
        return ReadResult("value", value, gen)

    async def _verify(self, key: str, resp: Response) -> None:
        """Check a whole-object body against the crc32c GCS reports, if any."""
        for part in resp.headers.get("x-goog-hash", "").split(","):
            name, _, b64 = part.strip().partition("=")
            if name != "crc32c" or not b64:
                continue
            expected = int.from_bytes(base64.b64decode(b64), "big")
            actual = await _checksum(resp.body)
            if actual != expected:
                raise ChecksumError(
                    f"gcs read of {self._where(key)}: crc32c of the {len(resp.body)} bytes "
                    f"received is {actual:08x}, GCS reports {expected:08x}"
                )

    # -- writes -------------------------------------------------------------------------
    async def _write(self, key: str, value: Buffer, if_equal: Generation | None) -> Generation:
        query: dict[str, Any] = {"uploadType": "multipart", "fields": "generation"}
        if if_equal is not None:
            expected = 0 if if_equal.is_no_value else _generation_of(if_equal)
            if expected is None:  # not a GCS generation: it can never match
                raise self._condition_failed("write", key, if_equal, await self._found(key))
            query["ifGenerationMatch"] = expected
        write_id = uuid.uuid4().hex
        body, content_type = await _multipart(key, value, write_id)
        what = f"write of {self._where(key)}"
        url = self._url(f"/upload/storage/v1/b/{quote(self.bucket, safe='')}/o", query)
        resp = await self._call("POST", url, what=what, data=body,
                                headers={"Content-Type": content_type})
        if resp.status == 200:
            return _gen(resp.json()["generation"])
        if resp.status == 412 and if_equal is not None:
            meta = await self._stat(key)
            if resp.attempt > 1 and meta is not None and _write_id(meta) == write_id:
                return _gen(meta["generation"])  # an earlier attempt landed; its answer was lost
            found = Generation.NO_VALUE if meta is None else _gen(meta["generation"])
            raise self._condition_failed("write", key, if_equal, found)
        if resp.status == 404:
            raise NotFoundError(
                f"gcs {what}: bucket {self.bucket!r} does not exist ({_message(resp)})"
            )
        raise self._fail(what, resp)

    async def _delete(self, key: str, if_equal: Generation | None) -> None:
        what = f"delete of {self._where(key)}"
        query: dict[str, Any] = {}
        if if_equal is not None:
            # fake-gcs-server ignores DELETE preconditions; check first (see module doc).
            meta = await self._stat(key)
            found = Generation.NO_VALUE if meta is None else _gen(meta["generation"])
            if found != if_equal:
                raise self._condition_failed("delete", key, if_equal, found)
            if if_equal.is_no_value:
                return  # absent, as required
            query["ifGenerationMatch"] = _generation_of(if_equal)
        resp = await self._call("DELETE", self._object_url(key, query), what=what)
        if resp.status in (200, 204):
            return
        if resp.status == 404:
            if if_equal is None or resp.attempt > 1:
                return  # absent (or our earlier attempt deleted it and its answer was lost)
            raise self._condition_failed("delete", key, if_equal, Generation.NO_VALUE)
        if resp.status == 412 and if_equal is not None:
            raise self._condition_failed("delete", key, if_equal, await self._found(key))
        raise self._fail(what, resp)

    # -- listing ------------------------------------------------------------------------
    async def _list(self, prefix: str) -> list[str]:
        # Names ending in '/' are "folder" placeholders made by other tools, not keys.
        return [n for n in await self._list_names(prefix) if not n.endswith("/")]

    async def _list_names(self, prefix: str) -> list[str]:
        """Every object name starting with ``prefix``, page by page."""
        return [item["name"] for item in await self._list_items(prefix, "name")]

    async def _list_info(self, prefix: str) -> list[KeyInfo]:
        # the listing carries size and last update time (RFC 3339) of every object
        out = []
        for item in await self._list_items(prefix, "name,size,updated"):
            if item["name"].endswith("/"):
                continue
            size = item.get("size")
            updated = item.get("updated")
            mtime = (
                datetime.datetime.fromisoformat(updated).timestamp()
                if isinstance(updated, str) else None
            )
            out.append(KeyInfo(item["name"], None if size is None else int(size), mtime))
        return out

    async def _list_items(self, prefix: str, fields: str) -> list[dict[str, Any]]:
        """The listing items (with ``fields``) of every object starting with ``prefix``."""
        items: list[dict[str, Any]] = []
        token: str | None = None
        what = f"list of {self._where(prefix + '*')}"
        while True:
            query: dict[str, Any] = {
                "prefix": prefix,
                "maxResults": self.list_page_size,
                "fields": f"items({fields}),nextPageToken",
            }
            if token:
                query["pageToken"] = token
            url = self._url(f"/storage/v1/b/{quote(self.bucket, safe='')}/o", query)
            resp = await self._call("GET", url, what=what)
            if resp.status == 404:
                raise NotFoundError(f"gcs {what}: bucket {self.bucket!r} does not exist")
            if resp.status != 200:
                raise self._fail(what, resp)
            page = resp.json()
            items.extend(page.get("items", ()))
            token = page.get("nextPageToken")
            if not token:
                return items

    async def _delete_range(self, prefix: str) -> None:
        """List, then delete concurrently (bounded by ``concurrency``); not atomic."""
        names = await self._list_names(prefix)
        for i in range(0, len(names), 1000):  # keeps the number of pending tasks modest
            await asyncio.gather(*(self._delete(k, None) for k in names[i:i + 1000]))


async def _checksum(data: Buffer) -> int:
    if len(data) > _BIG:
        return await run_cpu(_crc32c.crc32c, data)
    return _crc32c.crc32c(data)


async def _multipart(key: str, value: Buffer, write_id: str) -> tuple[bytes, str]:
    """A multipart/related upload body: JSON metadata, then the value."""
    crc = await _checksum(value)
    meta = {
        "name": key,
        "crc32c": base64.b64encode(crc.to_bytes(4, "big")).decode(),
        "metadata": {_WRITE_ID: write_id},
    }
    # 128 random bits: the chance that the value contains the delimiter is nil.
    boundary = "tsp" + uuid.uuid4().hex
    head = (
        f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n"
        f"{json.dumps(meta)}\r\n--{boundary}\r\nContent-Type: application/octet-stream\r\n\r\n"
    ).encode()
    tail = f"\r\n--{boundary}--\r\n".encode()
    if len(value) > _BIG:
        body = await run_cpu(b"".join, [head, value, tail])
    else:
        body = b"".join([head, value, tail])
    return body, f"multipart/related; boundary={boundary}"


register_kvstore(GcsKvStore, schemes=("gs",))
