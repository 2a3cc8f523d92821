"""The key rules of every kvstore: what a valid key and prefix are, how a path
is extended, and how a listing splits into a folder's keys and subfolders.

Keys are relative to a store's ``path``: no empty key, no absolute key, no
``.``/``..`` segment, no empty segment, no NUL, nothing that is not valid UTF-8
(such as a lone surrogate), so nothing escapes the root and every store can
name the key. Invalid keys raise :class:`~tensorstore_py.errors.InvalidKeyError`
before any I/O.
"""

from __future__ import annotations

from collections.abc import Iterable

from tensorstore_py.core.errors import InvalidKeyError

__all__ = ["join_path", "split_folder", "validate_key", "validate_prefix"]


def split_folder(folder: str, keys: Iterable[str]) -> tuple[list[str], list[str]]:
    """``keys`` (all starting with ``folder``) as the keys directly in it and the
    subfolders (``folder + name + "/"``) holding the others."""
    direct: list[str] = []
    below: set[str] = set()
    n = len(folder)
    for k in keys:
        cut = k.find("/", n)
        if cut < 0:
            direct.append(k)
        else:
            below.add(k[:cut + 1])
    return direct, sorted(below)


def validate_key(key: str) -> str:
    """Return ``key`` if it is a valid relative key, else raise InvalidKeyError."""
    if not isinstance(key, str):
        raise InvalidKeyError(f"key must be a str, got {type(key).__name__}: {key!r}")
    if not key:
        raise InvalidKeyError("key must not be empty")
    if "\x00" in key:
        raise InvalidKeyError(f"key {key!r} contains NUL")
    if not key.isascii():
        try:
            key.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidKeyError(
                f"key {key!r} is not valid Unicode (a lone surrogate at position {e.start}): "
                "keys are stored as UTF-8"
            ) from None
    if key.startswith("/"):
        raise InvalidKeyError(f"key {key!r} is absolute; keys are relative to the store path")
    if key.endswith("/"):
        raise InvalidKeyError(f"key {key!r} ends with '/'")
    for part in key.split("/"):
        if part in ("", ".", ".."):
            raise InvalidKeyError(
                f"key {key!r} has an empty, '.' or '..' segment (it could escape the root)"
            )
    return key


def validate_prefix(prefix: str) -> str:
    """Validate a list/delete prefix: "" or a key-like string (trailing '/' allowed)."""
    if not isinstance(prefix, str):
        raise InvalidKeyError(f"prefix must be a str, got {type(prefix).__name__}")
    if prefix == "":
        return prefix
    validate_key(prefix[:-1] if prefix.endswith("/") else prefix)
    return prefix


def join_path(path: str, sub: str) -> str:
    """``path`` extended by the relative ``sub`` (validated), ending with '/'."""
    sub = sub.strip("/")
    if not sub:
        return path
    validate_key(sub)
    if path and not path.endswith("/"):
        path += "/"
    return path + sub + "/"
