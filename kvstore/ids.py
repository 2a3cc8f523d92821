"""Identifiers users choose: transaction ids (and the names built from them).

One rule, shared by the transaction API (``Transaction(txn_id=...)``) and the
versioned store's format, which writes ids into object names: 1 to 128
characters from ``[A-Za-z0-9_.-]``, and not ``.`` or ``..``, so an id is always
a safe single path segment.
"""

from __future__ import annotations

import re

from tensorstore_py.core.errors import InvalidArgumentError

__all__ = ["check_id"]

_ID_RE = re.compile(r"[A-Za-z0-9_.\-]{1,128}\Z")


def check_id(what: str, value: str) -> str:
    """Return ``value`` if it is a valid id, else raise InvalidArgumentError naming ``what``."""
    if not isinstance(value, str) or not _ID_RE.match(value) or value in (".", ".."):
        raise InvalidArgumentError(
            f"{what} {value!r} must be 1 to 128 characters from [A-Za-z0-9_.-]"
        )
    return value
