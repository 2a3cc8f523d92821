"""Google Cloud Storage store over the GCS JSON API (aiohttp).

Spec::

    {"driver": "gcs", "bucket": "my-bucket", "path": "some/prefix/",
     "endpoint": "http://127.0.0.1:4443",   # optional; else $STORAGE_EMULATOR_HOST, else GCS
     "concurrency": 32,                     # optional; requests in flight per store
     "credentials": "auto",                 # optional; "auto" | "default" | "anonymous"
     "retries": {"max_attempts": 10, "initial_delay": 0.05, "max_delay": 10.0},
     "emulator_workarounds": false}         # optional; for fake-gcs-server (see below)

URL form: ``gs://bucket/path/``.

Guarantees:

* Atomicity: an object is replaced as a whole: values up to
  ``resumable_threshold`` (16 MiB) in one multipart upload request, larger ones
  in a resumable upload that sends ``chunk_size`` slices of the caller's buffer
  (bounded memory: no joined copy) and, after a failed chunk, asks the server
  how much it has and resumes from there (:mod:`~tensorstore_py.kvstore._gcs_upload`).
  Conditions use GCS preconditions: ``ifGenerationMatch`` (0 = create-only); a
  lost condition (HTTP 412) raises
  :class:`~tensorstore_py.errors.ConditionFailedError`. With
  ``emulator_workarounds`` every write is a multipart request (fake-gcs-server
  enforces preconditions only there).
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

Lost answers. Each upload carries a write-id in its custom metadata
(``tsp-write-id``); a 412 after an attempt that may have landed is resolved by
reading it back: ours -> success; a compare-and-swap that finds another
writer's generation -> CommitOutcomeUnknownError with the write-id, never
ConditionFailedError (:mod:`~tensorstore_py.kvstore._objstore`). Conditional
deletes send ``ifGenerationMatch`` (atomic on GCS, no read first); a 404 or 412
after an attempt that may have landed is an unknown outcome too, not success.
``emulator_workarounds`` (the test fixture's, for fake-gcs-server, which
ignores DELETE preconditions) reads the generation first: two steps, not one.

A missing bucket reads as missing keys (GCS answers 404 to both) but makes
``list`` raise NotFoundError.

Credentials (``"auto"``): anonymous when ``STORAGE_EMULATOR_HOST`` is set or the
endpoint is plain ``http://`` (an emulator or test proxy; tokens must not travel
unencrypted); otherwise google-auth's application-default credentials, falling
back to anonymous access (public buckets) with one warning when none are found,
and looking again after a minute or an access denial
(:mod:`~tensorstore_py.kvstore._auth`). ``"default"`` requires those
credentials; ``"anonymous"`` never sends any. The stores of one configuration
(google-auth's environment variables and credentials files) share one token per
process: looked up, fetched and refreshed once for all of them.
"""

from __future__ import annotations

import base64
import datetime
import os
import re
from collections.abc import Mapping
from typing import Any, Literal, TypedDict
from urllib.parse import quote, urlencode

import yarl

from tensorstore_py.core.errors import (
    ChecksumError,
    InvalidSpecError,
    NotFoundError,
    StorageError,
)
from tensorstore_py.core.retry import DEFAULT_RETRY_POLICY, RetryPolicy
from tensorstore_py.kvstore._auth import check_mode
from tensorstore_py.kvstore._checksums import crc32c_b64
from tensorstore_py.kvstore._gcs_auth import CredentialsMode, GcsAuth, require_google_auth
from tensorstore_py.kvstore._gcs_upload import multipart_body, resumable_upload
from tensorstore_py.kvstore._http import (
    HttpClient,
    Response,
    RetriesExhaustedError,
    RetriesSpec,
    range_header,
    retries_spec,
    retry_policy,
)
from tensorstore_py.kvstore._objstore import (
    WRITE_ID,
    ObjectKvStore,
    ObjectState,
    delete_all,
    new_write_id,
)
from tensorstore_py.kvstore.base import (
    Buffer,
    ByteRange,
    Generation,
    KeyInfo,
    ReadResult,
)
from tensorstore_py.kvstore.registry import register_kvstore

__all__ = ["DEFAULT_CONCURRENCY", "DEFAULT_ENDPOINT", "GcsKvStore", "GcsSpec", "validate_bucket"]

DEFAULT_ENDPOINT = "https://storage.googleapis.com"
DEFAULT_CONCURRENCY = 32


class GcsSpec(TypedDict, total=False):
    """The JSON spec of a gcs store (``driver`` and ``bucket`` are required)."""

    driver: Literal["gcs"]
    bucket: str
    path: str
    endpoint: str
    concurrency: int
    credentials: CredentialsMode
    retries: RetriesSpec
    emulator_workarounds: bool


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


def _state(meta: Mapping[str, Any]) -> ObjectState:
    """Generation and write-id (from the custom metadata) of an object resource."""
    return ObjectState(_gen(meta["generation"]), (meta.get("metadata") or {}).get(WRITE_ID))




def _gen(value: Any) -> Generation:
    return Generation(str(int(value)).encode())


class GcsKvStore(ObjectKvStore):
    """Objects in a GCS bucket (or an emulator speaking the GCS JSON API)."""

    driver = "gcs"
    single_clock = True  # modification times: the server's (``updated``)
    #: objects per list request (GCS allows up to 1000)
    list_page_size: int = 1000
    #: values above this go up in a resumable upload (bounded memory, resumed on failure)
    resumable_threshold: int = 16 << 20
    #: bytes per resumable chunk (a multiple of 256 KiB)
    chunk_size: int = 8 << 20

    def __init__(
        self,
        *,
        bucket: str,
        path: str = "",
        endpoint: str | None = None,
        concurrency: int | None = None,
        credentials: CredentialsMode | None = None,
        retries: Mapping[str, Any] | RetryPolicy | None = None,
        emulator_workarounds: bool = False,
    ) -> None:
        self.bucket = validate_bucket(bucket)
        super().__init__(path=path)
        self._endpoint_option = endpoint
        self.endpoint, from_env = _resolve_endpoint(endpoint)
        if concurrency is not None and (
            not isinstance(concurrency, int) or isinstance(concurrency, bool) or concurrency < 1
        ):
            raise InvalidSpecError(f"gcs: concurrency must be an int >= 1, got {concurrency!r}")
        self._concurrency_option = concurrency
        self.concurrency = self.requests_in_flight = concurrency or DEFAULT_CONCURRENCY
        mode = check_mode("gcs", credentials)
        self._credentials_option = credentials
        # "auto": no credentials for an emulator, nor over unencrypted http
        why = "credentials 'anonymous'" if mode == "anonymous" else (
            "auto: STORAGE_EMULATOR_HOST is set" if from_env else "auto: the endpoint is plain http")
        anonymous = mode == "anonymous" or (
            mode == "auto" and (from_env or self.endpoint.startswith("http://"))
        )
        if not anonymous:
            require_google_auth()
        self._auth = GcsAuth(mode, anonymous=anonymous, why_anonymous=why)
        if not isinstance(emulator_workarounds, bool):
            raise InvalidSpecError(
                f"gcs: emulator_workarounds must be true or false, got {emulator_workarounds!r}")
        self.emulator_workarounds = emulator_workarounds
        # the URL of the bucket's objects, encoded once (a request adds the quoted name)
        self._objects = f"{self.endpoint}/storage/v1/b/{quote(self.bucket, safe='')}/o"
        self._uploads = f"{self.endpoint}/upload/storage/v1/b/{quote(self.bucket, safe='')}/o"
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
        allowed = {"driver", "bucket", "path", "endpoint", "concurrency", "credentials", "retries",
                   "emulator_workarounds"}
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
            emulator_workarounds=spec.get("emulator_workarounds", False),
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
        if self.emulator_workarounds:
            d["emulator_workarounds"] = True
        return d

    def url(self) -> str:
        return f"gs://{self.bucket}/{self.path}"

    def _show(self, g: Generation) -> str:
        """A generation as GCS shows it (its number), else its repr."""
        n = _generation_of(g)
        return str(n) if n is not None else repr(g)

    def _where(self, key: str) -> str:
        return f"gs://{self.bucket}/{key}" + (
            "" if self.endpoint == DEFAULT_ENDPOINT else f" (endpoint {self.endpoint})"
        )

    # -- HTTP plumbing ----------------------------------------------------------------
    def _object_url(self, key: str, query: Mapping[str, Any] | str) -> yarl.URL:
        """The URL of object ``key`` with ``query`` (a mapping, or a query string
        already encoded)."""
        qs = query if isinstance(query, str) else urlencode(query, quote_via=quote)
        # Object names need '/' escaped as %2F: the URL is encoded here, not by yarl.
        return yarl.URL(f"{self._objects}/{quote(key, safe='')}{'?' if qs else ''}{qs}", encoded=True)

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
        crc32c: bool = False,
    ) -> Response:
        """One request with retries; returns any non-retryable answer (with the
        CRC-32C of its body when ``crc32c``)."""
        return await self._client.request(method, url, what=what, headers=headers, data=data,
                                          crc32c=crc32c)

    def _fail(self, what: str, resp: Response) -> StorageError:
        return StorageError(f"gcs {what}: HTTP {resp.status}: {_message(resp)}")

    async def _stat(self, key: str) -> dict[str, Any] | None:
        """The object's metadata (generation, size, metadata), or None if absent."""
        url = self._object_url(key, "fields=generation%2Csize%2Cmetadata")
        resp = await self._call("GET", url, what=f"stat of {self._where(key)}")
        if resp.status == 404:
            return None
        if resp.status != 200:
            raise self._fail(f"stat of {self._where(key)}", resp)
        return resp.json()

    async def _object_state(self, key: str) -> ObjectState | None:
        meta = await self._stat(key)
        return None if meta is None else _state(meta)

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

        query = "alt=media"
        not_gen = None if if_not_equal is None else _generation_of(if_not_equal)
        if not_gen is not None:
            query += f"&ifGenerationNotMatch={not_gen}"
        headers = None if byte_range is None else {"Range": range_header(byte_range)}
        what = f"read of {self._where(key)}"
        # a whole object's CRC-32C is computed while its body arrives (checked in _verify)
        resp = await self._client.request("GET", self._object_url(key, query), what=what,
                                          headers=headers, crc32c=byte_range is None)
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
            expected = base64.b64decode(b64).hex()
            found = resp.body_crc32c
            if found is None:
                actual = base64.b64decode(await crc32c_b64(resp.body)).hex()
            else:  # computed as the body arrived: 4 big-endian bytes, as GCS sends them
                actual = found.to_bytes(4, "big").hex()
            if actual != expected:
                raise ChecksumError(
                    f"gcs read of {self._where(key)}: crc32c of the {len(resp.body)} bytes "
                    f"received is {actual}, GCS reports {expected}"
                )

    # -- writes -------------------------------------------------------------------------
    async def _write(self, key: str, value: Buffer, if_equal: Generation | None) -> Generation:
        query: dict[str, Any] = {"uploadType": "multipart", "fields": "generation"}
        condition = ""  # the same precondition in the multipart request's query string
        if if_equal is not None:
            expected = 0 if if_equal.is_no_value else _generation_of(if_equal)
            if expected is None:  # not a GCS generation: it can never match
                raise self._condition_failed("write", key, if_equal, await self._found(key))
            query["ifGenerationMatch"] = expected
            condition = f"&ifGenerationMatch={expected}"
        write_id = new_write_id()
        what = f"write of {self._where(key)}"
        try:
            if len(value) > self.resumable_threshold and not self.emulator_workarounds:
                resp = await resumable_upload(self, key, value, query, write_id, what)
            else:
                body, content_type = await multipart_body(key, value, write_id)
                url = yarl.URL(f"{self._uploads}?uploadType=multipart&fields=generation{condition}",
                               encoded=True)
                resp = await self._call("POST", url, what=what, data=body,
                                        headers={"Content-Type": content_type})
        except RetriesExhaustedError as e:
            if not e.maybe_applied:
                raise
            if if_equal is None:
                return await self._settle_overwrite(key, write_id, what, f"every attempt failed ({e})")
            return await self._settle_write(key, write_id, if_equal, what, refused=False,
                                      maybe_applied=True)
        if resp.status in (200, 201):
            return _gen(resp.json()["generation"])
        if resp.status == 412 and if_equal is not None:
            return await self._settle_write(key, write_id, if_equal, what, refused=True,
                                      maybe_applied=resp.maybe_applied)
        if resp.status == 404:
            raise NotFoundError(
                f"gcs {what}: bucket {self.bucket!r} does not exist ({_message(resp)})"
            )
        raise self._fail(what, resp)

    async def _delete(self, key: str, if_equal: Generation | None) -> None:
        what = f"delete of {self._where(key)}"
        query: dict[str, Any] = {}
        if if_equal is not None:
            expected = None if if_equal.is_no_value else _generation_of(if_equal)
            if expected is None or self.emulator_workarounds:
                # "delete if absent", a foreign generation (never matches), or an emulator
                # that ignores DELETE preconditions: compare with the generation found
                found = await self._object_state(key)
                if (found.generation if found else Generation.NO_VALUE) != if_equal:
                    raise self._condition_failed("delete", key, if_equal, found)
                if if_equal.is_no_value:
                    return  # absent, as required
            query["ifGenerationMatch"] = expected
        resp = await self._send_delete(key, if_equal, what, lambda: self._call(
            "DELETE", self._object_url(key, query), what=what))
        if resp.status in (200, 204):
            return
        if resp.status == 404 and if_equal is None:
            return  # absent (or our earlier attempt deleted it and its answer was lost)
        if resp.status in (404, 412) and if_equal is not None:
            await self._refused_delete(key, if_equal, what, resp)
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

    lists_folders_natively = True

    async def _list_folder(self, folder: str) -> tuple[list[str], list[str]]:
        """One listing with ``delimiter=/``: the objects directly in ``folder`` and
        the server's ``prefixes`` (one page per ``list_page_size`` children)."""
        keys: list[str] = []
        folders: list[str] = []
        token: str | None = None
        what = f"list of {self._where(folder + '*')} by folder"
        while True:
            query: dict[str, Any] = {"prefix": folder, "delimiter": "/", "maxResults": self.list_page_size,
                                     "fields": "items(name),prefixes,nextPageToken"}
            if token:
                query["pageToken"] = token
            resp = await self._call("GET", self._url(f"/storage/v1/b/{quote(self.bucket, safe='')}/o", query),
                                    what=what)
            if resp.status == 404:
                raise NotFoundError(f"gcs {what}: bucket {self.bucket!r} does not exist")
            if resp.status != 200:
                raise self._fail(what, resp)
            page = resp.json()
            keys.extend(i["name"] for i in page.get("items", ()) if not i["name"].endswith("/"))
            folders.extend(page.get("prefixes", ()))
            token = page.get("nextPageToken")
            if not token:
                return keys, folders

    async def _delete_range(self, prefix: str) -> None:
        """List, then delete concurrently (bounded by ``concurrency``); not atomic."""
        await delete_all(await self._list_names(prefix), lambda k: self._delete(k, None))


register_kvstore(GcsKvStore, schemes=("gs",))
