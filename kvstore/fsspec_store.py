"""Any fsspec filesystem as a store (az://, hdfs://, sftp://, ...): driver ``"fsspec"``.

It is the registry's fallback: a URL whose scheme no native store registered
opens here when fsspec knows the protocol (``memory://``, ``file://``,
``gs://``, ``s3://`` and ``http(s)://`` stay with the native stores).

Spec: ``{"driver": "fsspec", "url": "az://container/root/", "path": "",
"storage_options": {...}}``. ``url`` is the filesystem root; ``path`` is the key
prefix below it (as for every store); ``storage_options`` go to
``fsspec.filesystem`` and must be JSON-able.

Guarantees, honestly stated:

* Conditional writes and deletes (``if_equal=...``) raise UnsupportedError: a
  generic fsspec filesystem offers no atomic create-only or compare-and-swap,
  and an exists-then-write would only pretend to. Use the native ``file``,
  ``gcs`` or ``s3`` stores (or a filesystem-specific store) when you need them.
  The class says so (``conditional_writes = False``), so what needs them (a
  versioned store, a checkpoint save, ``tensorstore-py copy``) refuses at open,
  before any data moves.
* Atomicity and durability of a plain write are the filesystem's: object stores
  replace a whole object in one PUT; some filesystems write in place.
* Generation = the filesystem's own metadata for the path (ETag / generation /
  version id / mtime / size / inode, whichever it reports). It changes on every
  write only as far as that metadata does: two writes of equal size within one
  mtime tick of a filesystem without ETags can share a generation.
* A read checks the metadata before and after reading and retries if it changed,
  so the bytes and the generation returned belong together.
* Blocking fsspec calls run on the library's I/O thread pool, never on its loop
  (async filesystems run them on fsspec's own loop thread, which survives fork).
"""

from __future__ import annotations

import json
import posixpath
from typing import Any

import fsspec
from fsspec.registry import known_implementations
from fsspec.registry import registry as fsspec_registry

from tensorstore_py.core.errors import InvalidSpecError, StorageError, UnsupportedError
from tensorstore_py.core.pools import run_io
from tensorstore_py.kvstore.base import (
    Buffer,
    ByteRange,
    Generation,
    KvStore,
    ReadResult,
)
from tensorstore_py.kvstore.registry import conditional_schemes, register_kvstore

__all__ = ["FsspecKvStore"]

# metadata fields that identify one stored version, most specific first
_GENERATION_FIELDS = (
    "ETag",
    "etag",
    "generation",
    "version_id",
    "VersionId",
    "md5Hash",
    "crc32c",
    "mtime",
    "LastModified",
    "last_modified",
    "updated",
    "created",
    "size",
    "ino",
)
_READ_ATTEMPTS = 4


def _generation(info: dict[str, Any]) -> Generation:
    fields = {k: str(info[k]) for k in _GENERATION_FIELDS if info.get(k) is not None}
    return Generation(json.dumps(fields, sort_keys=True).encode())


class FsspecKvStore(KvStore):
    """Keys are files below ``url`` on an fsspec filesystem (no conditional writes)."""

    driver = "fsspec"
    #: no create-only or compare-and-swap writes (see the module doc)
    conditional_writes = False

    def __init__(
        self, *, url: str, path: str = "", storage_options: dict[str, Any] | None = None
    ) -> None:
        if not isinstance(url, str) or "://" not in url:
            raise InvalidSpecError(f"fsspec kvstore: url must be protocol://root, got {url!r}")
        options = dict(storage_options or {})
        try:
            json.dumps(options)
        except TypeError as e:
            raise InvalidSpecError(
                f"fsspec kvstore: storage_options must be JSON-able: {e}"
            ) from None
        protocol = url.split("://", 1)[0]
        try:
            fsspec.get_filesystem_class(protocol)
        except ValueError as e:
            raise InvalidSpecError(f"fsspec kvstore: url {url!r}: {e}") from None
        # fsspec's ImportError already names the package to install
        fs, root = fsspec.core.url_to_fs(url, **options)
        if not url.endswith("/"):
            url += "/"
        super().__init__(path=path)
        self.fs = fs
        self.root = root.rstrip("/") + "/"
        self.root_url = url
        self.storage_options = options

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> FsspecKvStore:
        unknown = set(spec) - {"driver", "url", "path", "storage_options"}
        if unknown:
            raise InvalidSpecError(f"fsspec kvstore spec: unknown fields {sorted(unknown)}")
        if "url" not in spec:
            raise InvalidSpecError("fsspec kvstore spec: 'url' (protocol://root/) is required")
        path = spec.get("path", "")
        if not isinstance(path, str) or path.startswith("/"):
            raise InvalidSpecError(f"fsspec kvstore spec: path must be relative, got {path!r}")
        if path and not path.endswith("/"):
            path += "/"
        return cls(url=spec["url"], path=path, storage_options=spec.get("storage_options"))

    @classmethod
    def spec_from_url(cls, url: str) -> dict[str, Any]:
        return {"driver": "fsspec", "url": url, "path": ""}

    def _spec_fields(self) -> dict[str, Any]:
        d: dict[str, Any] = {"url": self.root_url}
        if self.storage_options:
            d["storage_options"] = dict(self.storage_options)
        return d

    def url(self) -> str:
        return self.root_url + self.path

    def _fs_path(self, full_key: str) -> str:
        return self.root + full_key

    def _unsupported(self, op: str, key: str) -> UnsupportedError:
        return UnsupportedError(
            f"{op} of {key!r} on fsspec store {self.root_url!r}: conditional writes "
            f"(if_equal) are not supported by {type(self.fs).__name__}; an "
            f"exists-then-write would not be atomic; stores that can: "
            f"{', '.join(conditional_schemes())}"
        )

    # -- reads -------------------------------------------------------------------------
    async def _read(
        self, key: str, byte_range: ByteRange | None, if_not_equal: Generation | None
    ) -> ReadResult:
        return await run_io(self._read_sync, key, byte_range, if_not_equal)

    def _info(self, p: str) -> dict[str, Any] | None:
        try:
            info = self.fs.info(p)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StorageError(f"fsspec kvstore {self.root_url!r}: info of {p!r}: {e}") from e
        return info if info.get("type", "file") == "file" else None

    def _read_sync(
        self, key: str, byte_range: ByteRange | None, if_not_equal: Generation | None
    ) -> ReadResult:
        p = self._fs_path(key)
        for _ in range(_READ_ATTEMPTS):
            info = self._info(p)
            if info is None:
                return ReadResult.missing()
            gen = _generation(info)
            if if_not_equal is not None and gen == if_not_equal:
                return ReadResult("unchanged", b"", gen)
            size = int(info.get("size") or 0)
            start, stop = (0, size) if byte_range is None else byte_range.clip(size)
            try:
                data = self.fs.cat_file(p, start=start, end=stop) if stop > start else b""
            except FileNotFoundError:
                continue  # deleted while reading: look again
            except OSError as e:
                raise StorageError(f"fsspec kvstore {self.root_url!r}: reading {p!r}: {e}") from e
            after = self._info(p)
            if after is not None and _generation(after) == gen and len(data) == stop - start:
                return ReadResult("value", data, gen)
        raise StorageError(
            f"fsspec kvstore {self.root_url!r}: {key!r} kept changing while being read "
            f"({_READ_ATTEMPTS} attempts)"
        )

    # -- writes ------------------------------------------------------------------------
    async def _write(self, key: str, value: Buffer, if_equal: Generation | None) -> Generation:
        if if_equal is not None:
            raise self._unsupported(
                "create-only write" if if_equal.is_no_value else "compare-and-swap write", key
            )
        return await run_io(self._write_sync, key, bytes(value))

    def _write_sync(self, key: str, value: bytes) -> Generation:
        p = self._fs_path(key)
        try:
            try:
                self.fs.pipe_file(p, value)
            except FileNotFoundError:
                # filesystems with real directories need the parents first
                self.fs.makedirs(posixpath.dirname(p), exist_ok=True)
                self.fs.pipe_file(p, value)
        except OSError as e:
            raise StorageError(f"fsspec kvstore {self.root_url!r}: writing {p!r}: {e}") from e
        info = self._info(p)
        if info is None:
            raise StorageError(
                f"fsspec kvstore {self.root_url!r}: {p!r} vanished right after writing"
            )
        return _generation(info)

    async def _delete(self, key: str, if_equal: Generation | None) -> None:
        if if_equal is not None:
            raise self._unsupported("conditional delete", key)
        await run_io(self._delete_sync, key)

    def _delete_sync(self, key: str) -> None:
        p = self._fs_path(key)
        try:
            self.fs.rm_file(p)
        except FileNotFoundError:
            return
        except IsADirectoryError:
            return  # a directory is not a key
        except OSError as e:
            raise StorageError(f"fsspec kvstore {self.root_url!r}: deleting {p!r}: {e}") from e

    # -- listing -----------------------------------------------------------------------
    async def _list(self, prefix: str) -> list[str]:
        return await run_io(self._list_sync, prefix)

    def _list_sync(self, prefix: str) -> list[str]:
        # list below the deepest directory the prefix names, then filter
        base = prefix if prefix.endswith("/") or not prefix else posixpath.dirname(prefix) + "/"
        if base == "/":
            base = ""
        try:
            found = self.fs.find(self.root + base, withdirs=False)
        except FileNotFoundError:
            return []
        except OSError as e:
            raise StorageError(f"fsspec kvstore {self.root_url!r}: listing {prefix!r}: {e}") from e
        n = len(self.root)
        out = []
        for f in found:
            if not f.startswith(self.root):
                continue
            key = f[n:]
            if key.startswith(prefix):
                out.append(key)
        return out

    lists_folders_natively = True

    async def _list_folder(self, folder: str) -> tuple[list[str], list[str]]:
        return await run_io(self._list_folder_sync, folder)

    def _list_folder_sync(self, folder: str) -> tuple[list[str], list[str]]:
        """One ``fs.ls`` of the folder (filesystems with delimiter listings,
        s3fs and gcsfs among them, ask the server for one level)."""
        try:
            entries = self.fs.ls(self.root + folder, detail=True)
        except FileNotFoundError:
            return [], []
        except OSError as e:
            raise StorageError(f"fsspec kvstore {self.root_url!r}: listing folder {folder!r}: {e}") from e
        n = len(self.root)
        keys: list[str] = []
        folders: list[str] = []
        for entry in entries:
            name = str(entry["name"]).rstrip("/")
            if not name.startswith(self.root) or name[n:] in ("", folder.rstrip("/")):
                continue
            rel = name[n:]
            if entry.get("type") == "directory":
                folders.append(rel + "/")
            else:
                keys.append(rel)
        return keys, folders


def _fsspec_knows(scheme: str) -> bool:
    """True when fsspec has a filesystem for the URL scheme ``scheme``."""
    return scheme in known_implementations or scheme in fsspec_registry


register_kvstore(FsspecKvStore, fallback=_fsspec_knows)
