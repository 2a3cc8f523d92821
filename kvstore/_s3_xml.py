"""The XML of the S3 REST API that the s3 store reads and writes.

Parsed with the standard library (``xml.etree``: no external entities, and
expat refuses entity-expansion bombs). Tags are matched by local name, so
answers with or without the S3 namespace both parse.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Sequence
from typing import Any
from xml.sax.saxutils import escape

from tensorstore_py.core.errors import StorageError
from tensorstore_py.core.ranges import Buffer

__all__ = ["common_prefixes", "complete_body", "error_code", "error_message", "find_text", "parse_list_page"]


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def _child(node: ET.Element, name: str) -> ET.Element | None:
    return next((c for c in node if _local(c.tag) == name), None)


def _text(node: ET.Element, name: str) -> str | None:
    c = _child(node, name)
    return None if c is None else (c.text or "")


def _root(body: Buffer) -> ET.Element | None:
    if not isinstance(body, bytes):  # a large answer, read into a buffer of its own
        body = bytes(body)
    if not body.lstrip().startswith(b"<"):
        return None
    try:
        return ET.fromstring(body)
    except ET.ParseError:
        return None


def error_code(body: Buffer) -> str | None:
    """The ``<Code>`` of an ``<Error>`` document (None if the body is not one).

    S3 can answer 200 with an error document (CompleteMultipartUpload): callers
    of those check the body too."""
    root = _root(body)
    if root is None or _local(root.tag) != "Error":
        return None
    return _text(root, "Code")


def error_message(resp: Any) -> str:
    """``Code: Message`` of an error answer, else the start of its body."""
    root = _root(resp.body)
    if root is not None and _local(root.tag) == "Error":
        return f"{_text(root, 'Code')}: {_text(root, 'Message')}"
    return resp.snippet() or resp.reason


def parse_list_page(body: Buffer, what: str) -> tuple[list[tuple[str, int | None, str | None]], str | None]:
    """The (key, size, last-modified) items of a ListObjectsV2 page and the next
    continuation token (None on the last page). Keys are as sent (URL-encoded
    when asked for ``encoding-type=url``)."""
    root = _root(body)
    if root is None or _local(root.tag) != "ListBucketResult":
        raise StorageError(f"s3 {what}: not a ListBucketResult: {bytes(body[:200])!r}")
    items = []
    for node in root:
        if _local(node.tag) != "Contents":
            continue
        key = _text(node, "Key")
        if key is None:
            continue
        size = _text(node, "Size")
        items.append((key, int(size) if size and size.isdigit() else None, _text(node, "LastModified")))
    truncated = (_text(root, "IsTruncated") or "").lower() == "true"
    token = _text(root, "NextContinuationToken") if truncated else None
    if truncated and not token:
        raise StorageError(f"s3 {what}: a truncated listing without a continuation token")
    return items, token


def common_prefixes(body: Buffer) -> list[str]:
    """The ``CommonPrefixes/Prefix`` values of a ListObjectsV2 page asked with a
    delimiter (as sent: URL-encoded when asked for ``encoding-type=url``)."""
    root = _root(body)
    if root is None:
        return []
    return [p for node in root if _local(node.tag) == "CommonPrefixes"
            for p in [_text(node, "Prefix")] if p is not None]


def find_text(body: Buffer, name: str) -> str | None:
    """The text of the top-level element ``name`` of an XML answer (e.g. the UploadId
    of CreateMultipartUpload, the ETag of CompleteMultipartUpload), or None."""
    root = _root(body)
    return None if root is None else _text(root, name)


def complete_body(parts: Sequence[tuple[int, str, str | None]], checksum_tag: str) -> bytes:
    """The CompleteMultipartUpload document of (part number, ETag, checksum) parts;
    ``checksum_tag`` names the checksum element (``ChecksumCRC32C``)."""
    out = ["<CompleteMultipartUpload xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">"]
    for number, etag, checksum in parts:
        out.append(f"<Part><PartNumber>{number}</PartNumber><ETag>{escape(etag)}</ETag>")
        if checksum:
            out.append(f"<{checksum_tag}>{escape(checksum)}</{checksum_tag}>")
        out.append("</Part>")
    out.append("</CompleteMultipartUpload>")
    return "".join(out).encode()
