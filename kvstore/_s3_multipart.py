"""Multipart uploads of the s3 store: large values in parts, one conditional commit.

``CreateMultipartUpload`` (with the write-id and the checksum algorithm), the
parts (slices of the caller's buffer, never copied; concurrently, within the
store's request bound; each retried alone on failure, with its own checksum),
then ``CompleteMultipartUpload`` carrying the condition (``If-None-Match: *``
or ``If-Match``) and the full-object checksum. A 409
ConditionalRequestConflict on the completion means, per the S3 documentation,
starting again from CreateMultipartUpload; S3's "200 with an error document"
answer to a completion is retried. An upload that does not complete is
aborted (best effort; a bucket lifecycle rule cleans up what a crash leaves).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol

import yarl

from tensorstore_py.core.errors import StorageError, TensorStoreError
from tensorstore_py.core.retry import RetryPolicy
from tensorstore_py.kvstore._checksums import checksum_b64
from tensorstore_py.kvstore._http import Response
from tensorstore_py.kvstore._objstore import WRITE_ID, part_ranges
from tensorstore_py.kvstore._s3_xml import complete_body, error_code, find_text
from tensorstore_py.kvstore.base import Buffer

__all__ = ["upload"]


class S3KvStore(Protocol):
    """What an upload uses of the s3 store (kvstore/s3.py)."""

    checksum: Any
    part_size: int
    retry_policy: RetryPolicy

    async def _call(self, method: str, url: yarl.URL, *, what: str,
                    headers: Mapping[str, str] | None = None, data: Buffer | None = None,
                    retry_statuses: frozenset[int] = frozenset()) -> Response: ...

    def _url(self, key: str | None, query: Mapping[str, Any] | None = None) -> yarl.URL: ...

    def _fail(self, what: str, resp: Response) -> TensorStoreError: ...

    def _where(self, key: str) -> str: ...

#: fresh multipart uploads after 409 ConditionalRequestConflict answers
CONFLICT_ATTEMPTS = 5
#: retries of a completion answered "200 with an error document"
_COMPLETE_ATTEMPTS = 5
_RETRYABLE_CODES = frozenset({"InternalError", "SlowDown", "ServiceUnavailable"})


async def upload(store: S3KvStore, key: str, value: Buffer, cond: Mapping[str, str],
                 write_id: str, what: str) -> Response:
    """Upload ``value`` to ``key`` in parts; the answer to the completion (with the
    object's ETag as a header, as a PUT answers). 412/404 answers are returned
    for the caller to settle; other failures raise."""
    view = memoryview(value).cast("B") if not isinstance(value, bytes) else memoryview(value)
    full = await checksum_b64(store.checksum, view)
    for conflict in range(1, CONFLICT_ATTEMPTS + 1):
        upload_id = await _create(store, key, write_id, what)
        try:
            resp = await _parts_and_complete(store, key, view, cond, upload_id, full, what)
        except BaseException:
            await _abort(store, key, upload_id)
            raise
        if resp.status == 409 and conflict < CONFLICT_ATTEMPTS:
            await _abort(store, key, upload_id)
            await asyncio.sleep(store.retry_policy.delay(conflict))
            continue
        if resp.status != 200:
            await _abort(store, key, upload_id)
        return resp
    raise AssertionError("unreachable")  # pragma: no cover


async def _create(store: S3KvStore, key: str, write_id: str, what: str) -> str:
    alg = store.checksum
    resp = await store._call("POST", store._url(key, {"uploads": None}), what=f"{what} (create upload)",
                             headers={"Content-Type": "application/octet-stream",
                                      f"x-amz-meta-{WRITE_ID}": write_id,
                                      "x-amz-checksum-algorithm": alg.upper(),
                                      "x-amz-checksum-type": "FULL_OBJECT"})
    if resp.status != 200:
        raise store._fail(f"{what} (create upload)", resp)
    upload_id = find_text(resp.body, "UploadId")
    if not upload_id:
        raise StorageError(f"s3 {what}: no UploadId in the answer: {bytes(resp.body[:200])!r}")
    return upload_id


async def _parts_and_complete(store: S3KvStore, key: str, view: memoryview,
                              cond: Mapping[str, str], upload_id: str, full: str | None,
                              what: str) -> Response:
    alg = store.checksum

    async def part(number: int, start: int, stop: int) -> tuple[int, str, str | None]:
        data = view[start:stop]
        crc = await checksum_b64(alg, data)
        url = store._url(key, {"partNumber": number, "uploadId": upload_id})
        resp = await store._call("PUT", url, what=f"{what} (part {number})", data=data,
                                 headers={"x-amz-sdk-checksum-algorithm": alg.upper(),
                                          f"x-amz-checksum-{alg}": str(crc)})
        etag = resp.headers.get("ETag")
        if resp.status != 200 or not etag:
            raise store._fail(f"{what} (part {number})", resp)
        return number, etag, crc

    parts = await asyncio.gather(*(part(i + 1, a, b) for i, (a, b)
                                   in enumerate(part_ranges(len(view), store.part_size))))
    body = complete_body(parts, f"Checksum{alg.upper()}")
    headers = {**cond, "Content-Type": "application/xml", "x-amz-checksum-type": "FULL_OBJECT"}
    if full:
        headers[f"x-amz-checksum-{alg}"] = full
    url = store._url(key, {"uploadId": upload_id})
    for attempt in range(1, _COMPLETE_ATTEMPTS + 1):
        resp = await store._call("POST", url, what=f"{what} (complete upload)", data=body,
                                 headers=headers, retry_statuses=frozenset())
        code = error_code(resp.body) if resp.status == 200 else None
        if code in _RETRYABLE_CODES and attempt < _COMPLETE_ATTEMPTS:
            await asyncio.sleep(store.retry_policy.delay(attempt))
            continue
        if resp.status == 200 and code is None:
            etag = find_text(resp.body, "ETag")
            if etag is None:
                raise StorageError(f"s3 {what}: the completion carries no ETag: {bytes(resp.body[:200])!r}")
            return dataclasses.replace(resp, headers={**resp.headers, "ETag": etag})
        return resp
    raise AssertionError("unreachable")  # pragma: no cover


async def _abort(store: S3KvStore, key: str, upload_id: str) -> None:
    try:
        await store._call("DELETE", store._url(key, {"uploadId": upload_id}),
                          what=f"abort of an upload to {store._where(key)}")
    except (StorageError, OSError):
        pass  # best effort: an unfinished upload costs storage, not correctness
