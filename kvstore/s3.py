"""Amazon S3 and S3-compatible stores (MinIO, R2, Ceph, moto) over the REST API.

Spec::

    {"driver": "s3", "bucket": "my-bucket", "path": "some/prefix/",
     "endpoint_url": "http://127.0.0.1:9000",  # optional; else $AWS_ENDPOINT_URL_S3,
                                               # $AWS_ENDPOINT_URL, else AWS in ``region``
     "region": "eu-west-1",                    # optional; else the AWS config, else us-east-1
     "addressing_style": "auto",               # "auto" | "path" | "virtual"
     "profile": "name",                        # optional; a profile of the AWS config files
     "credentials": "auto",                    # "auto" | "default" | "anonymous"
     "concurrency": 32,                        # requests in flight per store
     "retries": {"max_attempts": 10, "initial_delay": 0.05, "max_delay": 10.0},
     "checksum": "crc32c",                     # "crc32c" | "crc64nvme"
     "multipart_threshold": 67108864,          # values above go up in parts
     "part_size": 16777216,
     "multipart_if_match": true,               # the server honours If-Match on CompleteMultipartUpload
     "conditional_delete": true}               # the server honours If-Match on DeleteObject

URL form: ``s3://bucket/path/``. Only fields that differ from their defaults
appear in ``spec()``.

Guarantees:

* Atomicity: an object is replaced as a whole (one PUT, or one
  CompleteMultipartUpload). Create-only writes send ``If-None-Match: *``;
  compare-and-swap sends ``If-Match: <etag>``; S3 evaluates both atomically.
  A lost condition raises ConditionFailedError; a 409
  ConditionalRequestConflict (a concurrent conditional request) is retried
  as the S3 documentation says: a PUT is resent, a multipart upload starts
  again from CreateMultipartUpload.
* Generation: the ETag, plus the version id where bucket versioning is on.
  Without versioning, rewriting identical bytes keeps the ETag (it is the
  content's MD5): ``if_not_equal`` then answers "unchanged" and a
  compare-and-swap against it succeeds, which is right for the bytes. With
  versioning every write gets a new generation; S3 still compares ETags only.
* Durability: S3 acknowledges a write once it is durably stored.
* Integrity: every body carries ``x-amz-checksum-crc32c`` (or
  ``-crc64nvme``), which S3 verifies before storing; whole-object reads ask for
  the stored checksum (``x-amz-checksum-mode: ENABLED``) and check it
  (mismatch -> ChecksumError).
* Large values: above ``multipart_threshold`` a multipart upload sends
  ``part_size`` slices of the caller's buffer (no copy), concurrently within
  ``concurrency``; a failed part is retried alone. The condition goes on the
  CompleteMultipartUpload. A server that ignores ``If-Match`` there (moto:
  ``multipart_if_match: false``) gets compare-and-swaps as one PUT instead
  (up to 5 GiB, S3's single-PUT limit; above, UnsupportedError).
* Conditional deletes send ``If-Match: <etag>`` (412: the value changed; 404:
  it is gone). ``conditional_delete: false`` (servers that ignore it) makes
  them raise UnsupportedError instead of deleting unconditionally.
* Lost responses: every upload carries a write-id in its metadata
  (``x-amz-meta-tsp-write-id``); a conditional write refused on a retry is
  resolved by reading it back, and an unknowable outcome raises
  CommitOutcomeUnknownError (see :mod:`~tensorstore_py.kvstore._objstore`).
* Retries, concurrency, credentials: :mod:`~tensorstore_py.kvstore._http`
  (transient answers and connection trouble retried with jittered backoff) and
  :mod:`~tensorstore_py.kvstore._s3_auth` (botocore's credential chain and
  SigV4). ``"auto"`` credentials fall back to anonymous requests (public
  buckets) when the chain has none, and look again later. The stores of one
  profile and AWS configuration share one set of credentials per process
  (looked up and refreshed once for all of them).

A missing bucket raises NotFoundError (reads included: S3 tells a missing
bucket from a missing key).
"""

from __future__ import annotations

import datetime
import os
import re
from collections.abc import Mapping
from typing import Any, Literal, TypedDict
from urllib.parse import quote, unquote, urlsplit

import yarl

from tensorstore_py.core.errors import (
    ChecksumError,
    InvalidSpecError,
    NotFoundError,
    StorageError,
    TensorStoreError,
    UnsupportedError,
)
from tensorstore_py.core.retry import DEFAULT_RETRY_POLICY
from tensorstore_py.kvstore import _s3_multipart
from tensorstore_py.kvstore._auth import CredentialsMode, check_mode
from tensorstore_py.kvstore._checksums import ALGORITHMS, check_algorithm, checksum_b64, crc32c_value_b64
from tensorstore_py.kvstore._http import (
    HttpClient,
    Response,
    RetriesExhaustedError,
    RetriesSpec,
    partial_body,
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
from tensorstore_py.kvstore._s3_auth import S3Auth, default_region, require_botocore
from tensorstore_py.kvstore._s3_xml import common_prefixes, error_code, error_message, parse_list_page
from tensorstore_py.kvstore.base import (
    Buffer,
    ByteRange,
    Generation,
    KeyInfo,
    ReadResult,
)
from tensorstore_py.kvstore.registry import register_kvstore

__all__ = ["DEFAULTS", "S3KvStore", "S3Spec", "validate_bucket"]

AddressingStyle = Literal["auto", "path", "virtual"]
#: 5 GiB: the largest single PUT S3 accepts
MAX_PUT = 5 << 30
#: 5 MiB: the smallest part S3 accepts (except the last)
MIN_PART = 5 << 20
#: the options that a spec shows only when they differ from these
DEFAULTS: dict[str, Any] = {
    "addressing_style": "auto",
    "concurrency": 32,
    "checksum": "crc32c",
    "multipart_threshold": 64 << 20,
    "part_size": 16 << 20,
    "multipart_if_match": True,
    "conditional_delete": True,
}
_OPTIONS = ("endpoint_url", "region", "profile", "credentials", "retries", *DEFAULTS)
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
#: statuses S3 answers for "a concurrent conditional request won; try again"
_CONFLICT = frozenset({409})


class S3Spec(TypedDict, total=False):
    """The JSON spec of an s3 store (``driver`` and ``bucket`` are required)."""

    driver: Literal["s3"]
    bucket: str
    path: str
    endpoint_url: str
    region: str
    addressing_style: AddressingStyle
    profile: str
    credentials: CredentialsMode
    concurrency: int
    retries: RetriesSpec
    checksum: Literal["crc32c", "crc64nvme"]
    multipart_threshold: int
    part_size: int
    multipart_if_match: bool
    conditional_delete: bool


def validate_bucket(bucket: Any) -> str:
    """``bucket`` if it is a valid S3 bucket name, else InvalidSpecError."""
    if not isinstance(bucket, str) or not _BUCKET_RE.match(bucket) or ".." in bucket:
        raise InvalidSpecError(
            f"s3: invalid bucket name {bucket!r}: 3-63 characters of a-z, 0-9, '.', '-', "
            "starting and ending with a letter or digit"
        )
    return bucket


def _endpoint(value: Any) -> tuple[str | None, bool]:
    """(endpoint URL or None for AWS, whether it came from the environment)."""
    from_env = False
    if value is None:
        value = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        from_env = value is not None
        if value is None:
            return None, False
    parts = urlsplit(value) if isinstance(value, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname \
            or parts.query or parts.fragment or parts.path not in ("", "/"):
        raise InvalidSpecError(f"s3: endpoint_url must look like http(s)://host[:port], got {value!r}")
    return f"{parts.scheme}://{parts.netloc}", from_env


def _gen(headers: Mapping[str, str]) -> Generation:
    etag = headers.get("ETag")
    if not etag:
        raise StorageError("s3: the answer carries no ETag")
    token = etag.strip().strip('"')
    vid = headers.get("x-amz-version-id")
    if vid and vid != "null":
        token += "#" + vid
    return Generation(token.encode())


def _etag(g: Generation) -> str | None:
    """The quoted ETag of a generation of ours (None if it is not one)."""
    token = g.token.decode("latin-1").split("#", 1)[0]
    return f'"{token}"' if token and '"' not in token else None


def _int_option(name: str, value: Any, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise InvalidSpecError(f"s3: {name} must be an int >= {minimum}, got {value!r}")
    return value


class S3KvStore(ObjectKvStore):
    """Objects in an S3 bucket (or an S3-compatible server)."""

    driver = "s3"
    single_clock = True  # modification times: the server's (``LastModified``)
    #: objects per list request (S3 allows up to 1000)
    list_page_size: int = 1000

    def __init__(self, *, bucket: str, path: str = "", **options: Any) -> None:
        unknown = set(options) - set(_OPTIONS)
        if unknown:
            raise InvalidSpecError(f"s3: unknown options {sorted(unknown)}; allowed: {sorted(_OPTIONS)}")
        self.bucket = validate_bucket(bucket)
        super().__init__(path=path)
        self._options = {k: v for k, v in options.items() if v is not None}
        opt = {**DEFAULTS, **self._options}
        self.endpoint_url, endpoint_from_env = _endpoint(opt.get("endpoint_url"))
        for name in ("region", "profile"):
            if name in opt and not (isinstance(opt[name], str) and opt[name]):
                raise InvalidSpecError(f"s3: {name} must be a non-empty string, got {opt[name]!r}")
        self.profile: str | None = opt.get("profile")
        self.region: str = opt.get("region") or default_region(self.profile)
        style = opt["addressing_style"]
        if style not in ("auto", "path", "virtual"):
            raise InvalidSpecError(f"s3: addressing_style must be 'auto', 'path' or 'virtual', got {style!r}")
        if style == "auto":
            style = "path" if self.endpoint_url or "." in self.bucket else "virtual"
        self.addressing_style: AddressingStyle = style
        self.concurrency = self.requests_in_flight = _int_option("concurrency", opt["concurrency"], 1)
        self.checksum = check_algorithm("s3", opt["checksum"])
        self.part_size = _int_option("part_size", opt["part_size"], MIN_PART)
        self.multipart_threshold = _int_option("multipart_threshold", opt["multipart_threshold"], 1)
        for name in ("multipart_if_match", "conditional_delete"):
            if not isinstance(opt[name], bool):
                raise InvalidSpecError(f"s3: {name} must be true or false, got {opt[name]!r}")
        self.multipart_if_match: bool = opt["multipart_if_match"]
        self.conditional_delete: bool = opt["conditional_delete"]
        mode = check_mode("s3", opt.get("credentials"))
        if mode != "anonymous":
            require_botocore()
        self._auth = S3Auth(mode, anonymous=mode == "anonymous", region=self.region,
                            profile=self.profile)
        self.retry_policy = retry_policy(opt.get("retries"), DEFAULT_RETRY_POLICY)
        if "retries" in self._options:
            self._options["retries"] = retries_spec(self._options["retries"])
        self._client = HttpClient(concurrency=self.concurrency, retries=self.retry_policy,
                                  auth=self._auth)
        base = self.endpoint_url or f"https://s3.{self.region}.amazonaws.com"
        if self.addressing_style == "path":
            self._base = f"{base}/{quote(self.bucket, safe='')}"
        else:
            scheme, host = base.split("://", 1)
            self._base = f"{scheme}://{self.bucket}.{host}"
        self._endpoint_from_env = endpoint_from_env

    # -- spec ---------------------------------------------------------------------------
    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> S3KvStore:
        unknown = set(spec) - {"driver", "bucket", "path", *_OPTIONS}
        if unknown:
            raise InvalidSpecError(
                f"s3 kvstore spec: unknown fields {sorted(unknown)}; allowed: "
                f"{sorted({'driver', 'bucket', 'path', *_OPTIONS})}"
            )
        if "bucket" not in spec:
            raise InvalidSpecError(f"s3 kvstore spec {spec!r}: 'bucket' is required")
        return cls(bucket=spec["bucket"], path=spec.get("path", ""),
                   **{k: spec[k] for k in _OPTIONS if k in spec})

    @classmethod
    def spec_from_url(cls, url: str) -> dict[str, Any]:
        if not url.lower().startswith("s3://"):
            raise InvalidSpecError(f"s3 URL {url!r} must start with s3://")
        rest = url[len("s3://"):]
        if "?" in rest or "#" in rest:
            raise InvalidSpecError(f"s3 URL {url!r}: query strings and fragments are not supported")
        bucket, _, path = rest.partition("/")
        if not bucket:
            raise InvalidSpecError(f"s3 URL {url!r} names no bucket: expected s3://bucket/path/")
        validate_bucket(bucket)
        return {"driver": "s3", "bucket": bucket, "path": path}

    def _spec_fields(self) -> dict[str, Any]:
        d: dict[str, Any] = {"bucket": self.bucket}
        for k in _OPTIONS:
            if k in self._options and self._options[k] != DEFAULTS.get(k, object()):
                d[k] = self._options[k]
        return d

    def url(self) -> str:
        return f"s3://{self.bucket}/{self.path}"

    def _where(self, key: str) -> str:
        at = f" (endpoint {self.endpoint_url})" if self.endpoint_url else ""
        return f"s3://{self.bucket}/{key}{at}"

    # -- HTTP plumbing ----------------------------------------------------------------
    def _url(self, key: str | None, query: Mapping[str, Any] | None = None) -> yarl.URL:
        """The URL of object ``key`` (None: the bucket) with ``query`` (a None value
        makes a bare flag such as ``?uploads``), encoded as SigV4 signs it."""
        qs = "&".join(k if v is None else f"{quote(k, safe='')}={quote(str(v), safe='')}"
                      for k, v in sorted((query or {}).items()))
        if key is None:
            path = "" if self.addressing_style == "path" else "/"
        else:
            path = "/" + quote(key, safe="/")
        return yarl.URL(self._base + path + (f"?{qs}" if qs else ""), encoded=True)

    async def _call(self, method: str, url: yarl.URL, *, what: str,
                    headers: Mapping[str, str] | None = None, data: Buffer | None = None,
                    retry_statuses: frozenset[int] = frozenset(), crc32c: bool = False) -> Response:
        return await self._client.request(method, url, what=what, headers=headers, data=data,
                                          retry_statuses=retry_statuses, crc32c=crc32c)

    def _fail(self, what: str, resp: Response) -> TensorStoreError:
        code = error_code(resp.body)
        if code == "NoSuchBucket":
            return NotFoundError(f"s3 {what}: bucket {self.bucket!r} does not exist")
        if resp.status == 501 or code == "NotImplemented":
            return UnsupportedError(f"s3 {what}: the server does not implement this: "
                                    f"{error_message(resp)}")
        if resp.status in (401, 403):
            return StorageError(f"s3 {what}: HTTP {resp.status} {code or ''}: {error_message(resp)}; "
                                f"credentials: {self._auth.describe()}")
        return StorageError(f"s3 {what}: HTTP {resp.status}: {error_message(resp)}")

    async def _stat(self, key: str) -> tuple[ObjectState, Mapping[str, str]] | None:
        """The object's state and headers (HEAD), or None if absent."""
        what = f"stat of {self._where(key)}"
        resp = await self._call("HEAD", self._url(key), what=what)
        if resp.status == 404:
            return None
        if resp.status != 200:
            raise self._fail(what, resp)
        return ObjectState(_gen(resp.headers), resp.headers.get(f"x-amz-meta-{WRITE_ID}")), resp.headers

    async def _object_state(self, key: str) -> ObjectState | None:
        st = await self._stat(key)
        return None if st is None else st[0]

    # -- reads --------------------------------------------------------------------------
    async def _read(self, key: str, byte_range: ByteRange | None,
                    if_not_equal: Generation | None) -> ReadResult:
        if byte_range is not None and byte_range.stop is not None \
                and byte_range.stop <= byte_range.start:
            return await self._empty_read(key, if_not_equal)  # no Range for zero bytes
        what = f"read of {self._where(key)}"
        headers: dict[str, str] = {}
        if byte_range is not None:
            headers["Range"] = range_header(byte_range)
        else:
            headers["x-amz-checksum-mode"] = "ENABLED"
        etag = None if if_not_equal is None else _etag(if_not_equal)
        if etag is not None:
            headers["If-None-Match"] = etag
        # a whole object's CRC-32C is computed while its body arrives (checked in _verify)
        whole = byte_range is None
        resp = await self._call("GET", self._url(key), what=what, headers=headers, crc32c=whole)
        if resp.status == 304 and if_not_equal is not None:
            vid = resp.headers.get("x-amz-version-id")
            if b"#" not in if_not_equal.token or (vid and _gen({"ETag": etag or "",
                                                                "x-amz-version-id": vid}) == if_not_equal):
                return ReadResult("unchanged", b"", if_not_equal)
            headers.pop("If-None-Match")  # same bytes, maybe another version: read it
            resp = await self._call("GET", self._url(key), what=what, headers=headers, crc32c=whole)
        if resp.status == 404:
            if error_code(resp.body) == "NoSuchBucket":
                raise self._fail(what, resp)
            return ReadResult.missing()
        if resp.status == 416:
            return await self._empty_read(key, if_not_equal)  # the range starts past the end
        if resp.status not in (200, 206):
            raise self._fail(what, resp)
        gen = _gen(resp.headers)
        if if_not_equal is not None and gen == if_not_equal:
            return ReadResult("unchanged", b"", gen)
        value: Buffer = resp.body
        if resp.status == 206 and byte_range is not None:
            value = partial_body(f"s3 {what}", byte_range, resp)
        elif byte_range is not None:  # a server that ignored Range: slice here
            value = bytes(byte_range.apply(memoryview(resp.body)))
        else:
            await self._verify(key, resp)
        return ReadResult("value", value, gen)

    async def _empty_read(self, key: str, if_not_equal: Generation | None) -> ReadResult:
        st = await self._stat(key)
        if st is None:
            return ReadResult.missing()
        gen = st[0].generation
        return ReadResult("unchanged" if gen == if_not_equal else "value", b"", gen)

    async def _verify(self, key: str, resp: Response) -> None:
        """Check a whole-object body against the full-object checksum S3 stored."""
        if resp.headers.get("x-amz-checksum-type", "FULL_OBJECT").upper() != "FULL_OBJECT":
            return  # a composite (per-part) checksum says nothing about the whole body
        for alg in ALGORITHMS:
            sent = resp.headers.get(f"x-amz-checksum-{alg}")
            if not sent or "-" in sent:
                continue
            actual = crc32c_value_b64(resp.body_crc32c) \
                if alg == "crc32c" and resp.body_crc32c is not None \
                else await checksum_b64(alg, resp.body, required=False)
            if actual is not None and actual != sent:
                raise ChecksumError(
                    f"s3 read of {self._where(key)}: {alg} of the {len(resp.body)} bytes received "
                    f"is {actual}, S3 stored {sent}")

    # -- writes -------------------------------------------------------------------------
    def _condition_headers(self, key: str, if_equal: Generation | None) -> dict[str, str]:
        if if_equal is None:
            return {}
        if if_equal.is_no_value:
            return {"If-None-Match": "*"}
        etag = _etag(if_equal)
        if etag is None:  # not an S3 generation: it can never match
            raise self._condition_failed("write", key, if_equal, None)
        return {"If-Match": etag}

    async def _write(self, key: str, value: Buffer, if_equal: Generation | None) -> Generation:
        cond = self._condition_headers(key, if_equal)
        write_id = new_write_id()
        what = f"write of {self._where(key)}"
        multipart = len(value) > self.multipart_threshold and (
            "If-Match" not in cond or self.multipart_if_match)
        if not multipart and len(value) > MAX_PUT:
            raise UnsupportedError(
                f"s3 {what}: a compare-and-swap of {len(value)} bytes needs a multipart upload "
                "with If-Match on CompleteMultipartUpload, which this server lacks "
                "(multipart_if_match: false); a single PUT takes at most 5 GiB")
        try:
            if multipart:
                resp = await _s3_multipart.upload(self, key, value, cond, write_id, what)
            else:
                resp = await self._call("PUT", self._url(key), what=what, data=value,
                                        headers={**cond, **await self._put_headers(value, write_id)},
                                        retry_statuses=_CONFLICT)
        except RetriesExhaustedError as e:
            if not e.maybe_applied:
                raise
            if if_equal is None:
                return await self._settle_overwrite(key, write_id, what, f"every attempt failed ({e})")
            return await self._settle_write(key, write_id, if_equal, what, refused=False, maybe_applied=True)
        if resp.status == 200 and not (multipart and error_code(resp.body)):
            return _gen(resp.headers)
        code = error_code(resp.body)
        if if_equal is not None and (resp.status == 412 or code == "NoSuchKey"
                                     or (multipart and code == "NoSuchUpload")):
            return await self._settle_write(key, write_id, if_equal, what, refused=True,
                                      maybe_applied=resp.maybe_applied)
        if if_equal is None and multipart and code == "NoSuchUpload" and resp.maybe_applied:
            # the completion whose answer was lost completed the upload (or it was aborted)
            return await self._settle_overwrite(
                key, write_id, what, "a retried completion found the upload gone (NoSuchUpload)")
        raise self._fail(what, resp)

    async def _put_headers(self, value: Buffer, write_id: str) -> dict[str, str]:
        alg = self.checksum
        return {
            "Content-Type": "application/octet-stream",
            f"x-amz-meta-{WRITE_ID}": write_id,
            "x-amz-sdk-checksum-algorithm": alg.upper(),
            f"x-amz-checksum-{alg}": str(await checksum_b64(alg, value)),
        }

    async def _delete(self, key: str, if_equal: Generation | None) -> None:
        what = f"delete of {self._where(key)}"
        if if_equal is not None and if_equal.is_no_value:
            state = await self._object_state(key)  # "delete if absent" deletes nothing
            if state is not None:
                raise self._condition_failed("delete", key, if_equal, state)
            return
        headers: dict[str, str] = {}
        if if_equal is not None:
            if not self.conditional_delete:
                raise UnsupportedError(
                    f"s3 conditional delete of {self._where(key)}: this server does not honour "
                    "If-Match on DeleteObject (conditional_delete: false)")
            etag = _etag(if_equal)
            if etag is None:
                raise self._condition_failed("delete", key, if_equal, await self._object_state(key))
            headers["If-Match"] = etag
        resp = await self._send_delete(key, if_equal, what, lambda: self._call(
            "DELETE", self._url(key), what=what, headers=headers, retry_statuses=_CONFLICT))
        if resp.status in (200, 204) or (resp.status == 404 and if_equal is None
                                         and error_code(resp.body) != "NoSuchBucket"):
            return
        if if_equal is not None and resp.status in (404, 412) \
                and error_code(resp.body) != "NoSuchBucket":
            await self._refused_delete(key, if_equal, what, resp)
        raise self._fail(what, resp)

    # -- listing ------------------------------------------------------------------------
    async def _list(self, prefix: str) -> list[str]:
        return [i.key for i in await self._list_info(prefix)]

    async def _list_info(self, prefix: str) -> list[KeyInfo]:
        """ListObjectsV2, page by page; "folder/" placeholders are not keys."""
        out: list[KeyInfo] = []
        token: str | None = None
        what = f"list of {self._where(prefix + '*')}"
        while True:
            query: dict[str, Any] = {"list-type": 2, "prefix": prefix, "encoding-type": "url",
                                     "max-keys": self.list_page_size}
            if token:
                query["continuation-token"] = token
            resp = await self._call("GET", self._url(None, query), what=what)
            if resp.status != 200:
                raise self._fail(what, resp)
            items, token = parse_list_page(resp.body, what)
            for name, size, modified in items:
                name = unquote(name)
                if name.endswith("/"):
                    continue
                mtime = None if modified is None else \
                    datetime.datetime.fromisoformat(modified.replace("Z", "+00:00")).timestamp()
                out.append(KeyInfo(name, size, mtime))
            if not token:
                return out

    lists_folders_natively = True

    async def _list_folder(self, folder: str) -> tuple[list[str], list[str]]:
        """ListObjectsV2 with ``delimiter=/``: the objects directly in ``folder`` and
        the ``CommonPrefixes`` (one page per ``list_page_size`` children)."""
        keys: list[str] = []
        folders: list[str] = []
        token: str | None = None
        what = f"list of {self._where(folder + '*')} by folder"
        while True:
            query: dict[str, Any] = {"list-type": 2, "prefix": folder, "delimiter": "/",
                                     "encoding-type": "url", "max-keys": self.list_page_size}
            if token:
                query["continuation-token"] = token
            resp = await self._call("GET", self._url(None, query), what=what)
            if resp.status != 200:
                raise self._fail(what, resp)
            items, token = parse_list_page(resp.body, what)
            keys.extend(k for k in (unquote(i[0]) for i in items) if not k.endswith("/"))
            folders.extend(unquote(p) for p in common_prefixes(resp.body))
            if not token:
                return keys, folders

    async def _delete_range(self, prefix: str) -> None:
        """List, then delete concurrently (bounded by ``concurrency``); not atomic."""
        names = [i.key for i in await self._list_info(prefix)]
        await delete_all(names, lambda k: self._delete(k, None))


register_kvstore(S3KvStore, schemes=("s3",))
