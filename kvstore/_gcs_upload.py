"""Uploads of the gcs store: one multipart request for small values, a resumable
upload for large ones.

**Multipart** (``uploadType=multipart``): JSON metadata and the value in one
request body; the body is a joined copy of the value, so it is used for values
up to the store's ``resumable_threshold`` only (and for every value on the
emulator, whose resumable uploads are broken: see ``testing/gcs_server.py``).

**Resumable** (``uploadType=resumable``, per the GCS documentation): a POST
with the metadata and the preconditions opens a session; the value goes in
``chunk_size`` slices of the caller's buffer (multiples of 256 KiB, never
copied), each PUT with its ``Content-Range``. GCS answers 308 with the range
it has persisted, and the final chunk with the object. A chunk whose request
fails is not resent blindly: a status query (``Content-Range: bytes */N``)
says how much the server has, and the upload resumes from there, so a
failure costs at most one chunk. A status query that answers with the object
means the upload completed (our session, so our object: exact, no write-id
needed). Preconditions are evaluated when the upload completes (412).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Mapping
from typing import Any, Protocol
from urllib.parse import quote

import crc32c as _crc32c
import yarl

from tensorstore_py.core.errors import StorageError
from tensorstore_py.core.pools import run_cpu
from tensorstore_py.core.retry import RetryPolicy
from tensorstore_py.kvstore._checksums import crc32c_b64, crc32c_value_b64
from tensorstore_py.kvstore._http import HttpClient, Response, RetriesExhaustedError
from tensorstore_py.kvstore._objstore import WRITE_ID
from tensorstore_py.kvstore.base import Buffer

__all__ = ["CHUNK_QUANTUM", "multipart_body", "resumable_upload"]

#: resumable chunks are multiples of this (GCS's rule)
CHUNK_QUANTUM = 256 * 1024
_BIG = 1 << 20
_ONE_ATTEMPT = RetryPolicy(max_attempts=1)
#: fresh sessions after a session expired (404/410) mid-upload
_SESSION_ATTEMPTS = 3


class _Store(Protocol):
    """What an upload uses of the gcs store (kvstore/gcs.py)."""

    bucket: str
    chunk_size: int
    retry_policy: RetryPolicy
    _client: HttpClient

    def _url(self, path: str, query: Mapping[str, Any]) -> yarl.URL: ...

    def _fail(self, what: str, resp: Response) -> StorageError: ...


def _metadata(key: str, crc: str, write_id: str) -> dict[str, Any]:
    return {"name": key, "crc32c": crc, "metadata": {WRITE_ID: write_id}}


async def multipart_body(key: str, value: Buffer, write_id: str) -> tuple[bytes, str]:
    """A multipart/related upload body (JSON metadata, then the value) and its type."""
    # a small value's checksum here (a thread hop costs more than it), a large one's off the loop
    crc = crc32c_value_b64(_crc32c.crc32c(value)) if len(value) <= _BIG else await crc32c_b64(value)
    meta = _metadata(key, crc, write_id)
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


async def resumable_upload(store: _Store, key: str, value: Buffer, query: Mapping[str, Any],
                           write_id: str, what: str) -> Response:
    """Upload ``value`` through a resumable session; the final answer (200 with the
    object, or 412 for the caller to settle). Raises RetriesExhaustedError
    (maybe applied) when the chunks keep failing."""
    view = memoryview(value).cast("B")
    meta = json.dumps(_metadata(key, await crc32c_b64(view), write_id)).encode()
    total = len(view)
    for _session in range(_SESSION_ATTEMPTS):
        url = store._url(f"/upload/storage/v1/b/{quote(store.bucket, safe='')}/o",
                         {**query, "uploadType": "resumable"})
        resp = await store._client.request(
            "POST", url, what=f"{what} (open upload)", data=meta,
            headers={"Content-Type": "application/json; charset=UTF-8",
                     "X-Upload-Content-Type": "application/octet-stream",
                     "X-Upload-Content-Length": str(total)})
        session = resp.headers.get("Location")
        if resp.status != 200 or not session:
            return resp  # a precondition (412), a missing bucket (404), ...: the caller's
        try:
            resp = await _send(store, yarl.URL(session, encoded=True), view, what)
        except RetriesExhaustedError as e:
            # a chunk was sent: the last one may have finalized the object even
            # if only the status queries after it failed (refused outright)
            raise RetriesExhaustedError(str(e), maybe_applied=True) from e
        if resp.status not in (404, 410):
            return resp
    raise StorageError(f"gcs {what}: the upload session expired {_SESSION_ATTEMPTS} times")


async def _send(store: _Store, session: yarl.URL, view: memoryview, what: str) -> Response:
    """Send the chunks of ``view`` from where the server is; the final answer."""
    total, offset, failures = len(view), 0, 0
    while True:
        stop = min(offset + store.chunk_size, total)
        span = f"bytes {offset}-{stop - 1}/{total}" if stop > offset else f"bytes */{total}"
        try:
            resp = await store._client.request(
                "PUT", session, what=f"{what} (bytes {offset}..{stop})", data=view[offset:stop],
                headers={"Content-Range": span}, retries=_ONE_ATTEMPT)
        except RetriesExhaustedError:
            failures += 1
            if failures >= store.retry_policy.max_attempts:
                raise RetriesExhaustedError(
                    f"gcs {what}: {failures} chunk uploads failed", maybe_applied=True) from None
            await asyncio.sleep(store.retry_policy.delay(failures))
            # how much has the server got? (the chunk may have landed; never guess)
            resp = await store._client.request(
                "PUT", session, what=f"{what} (upload status)", data=b"",
                headers={"Content-Range": f"bytes */{total}"})
        if resp.status != 308:
            return resp  # 200/201 with the object, 412, or a failure for the caller
        offset = _persisted(resp.headers.get("Range"), what)


def _persisted(header: str | None, what: str) -> int:
    """The offset after the bytes a 308 answer says are persisted."""
    if not header:
        return 0
    try:
        unit, span = header.split("=", 1)
        first, last = span.split("-", 1)
        if unit.strip() != "bytes" or int(first) != 0:
            raise ValueError(header)
        return int(last) + 1
    except ValueError:
        raise StorageError(f"gcs {what}: bad Range {header!r} in a resumable upload answer") from None
