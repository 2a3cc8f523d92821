"""Local file store: one file per key under a root directory.

Atomicity: a write goes to a temporary file that is renamed (or, for
create-only, hard-linked) onto the key, so a reader sees the old or the new
bytes, never a mix.

Conditions: a create-only write is ``link(tmp, key)``, which the kernel refuses
atomically when the key exists: no lock is needed. Compare-and-swap, overwrites
and deletes check-and-rename while holding an exclusive ``flock`` on the
directory's lock file; the data is written and fsync'ed *before* the lock is
taken, so the critical section is a stat and a rename. Both are atomic across
threads *and* processes.

Durability (``sync=True``, the default): when ``write`` returns, the data, the
rename and any directories it created have been fsync'ed. ``sync=False`` skips
the fsyncs (scratch data; a crash may then lose recent writes, never tear one).

Generation: (device, inode, mtime_ns, size) of the file. Each write creates a new
file whose mtime is set to ``max(now_ns, previous_mtime + 1)`` (under the lock
for replacing writes), so the stamp changes on every write even when the clock
is coarse.

Housekeeping files (at most one lock file per directory, and temporaries while
a write is in flight) live in a hidden ``.__tsp__`` folder beside the keys;
``list`` never shows them and keys may not name them.
"""

from __future__ import annotations

import fcntl
import os
import stat
import struct
import time
import uuid
from typing import Any, TypeVar

import numpy as np

from tensorstore_py.core.buffers import aligned_empty
from tensorstore_py.core.errors import (
    InvalidKeyError,
    InvalidSpecError,
    StorageError,
)
from tensorstore_py.core.pools import run_io
from tensorstore_py.kvstore.base import (
    Buffer,
    ByteRange,
    Generation,
    KeyInfo,
    KvStore,
    ReadResult,
    condition_failed,
)
from tensorstore_py.kvstore.registry import register_kvstore

__all__ = ["FileKvStore"]

META_DIR = ".__tsp__"
T = TypeVar("T")
_STAMP = struct.Struct("<QQqq")


def _stamp(st: os.stat_result) -> Generation:
    return Generation(_STAMP.pack(st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size))


def _stamp_path(path: str) -> Generation:
    """The key's generation; NO_VALUE when absent or a directory (not a key)."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return Generation.NO_VALUE
    return Generation.NO_VALUE if stat.S_ISDIR(st.st_mode) else _stamp(st)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _makedirs(path: str, sync: bool) -> None:
    """``os.makedirs`` that fsyncs the parent of every directory it creates."""
    if os.path.isdir(path):
        return
    parent = os.path.dirname(path.rstrip("/"))
    if parent and parent != path:
        _makedirs(parent, sync)
    try:
        os.mkdir(path)
    except FileExistsError:
        if not os.path.isdir(path):
            raise
        return
    if sync:
        _fsync_dir(parent)


def _write_all(fd: int, value: Buffer) -> None:
    mv = memoryview(value).cast("B")
    while mv:
        n = os.write(fd, mv)
        mv = mv[n:]


class _DirLock:
    """An exclusive flock on the directory's lock file (threads and processes).

    One lock file per directory (not per key): the critical sections are a stat
    plus a rename or unlink, so sharing the lock costs little and leaves no
    per-key litter behind.
    """

    def __init__(self, meta: str, sync: bool) -> None:
        self.path = os.path.join(meta, "lock")
        self.meta = meta
        self.sync = sync
        self.fd = -1

    def __enter__(self) -> _DirLock:
        _makedirs(self.meta, self.sync)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


class FileKvStore(KvStore):
    """Keys are files under the absolute directory ``path``."""

    driver = "file"

    def __init__(self, *, path: str, sync: bool = True) -> None:
        if not isinstance(path, str) or not path:
            raise InvalidSpecError(f"file kvstore: path must be a non-empty string, got {path!r}")
        if "\x00" in path:
            raise InvalidSpecError(f"file kvstore: path {path!r} contains NUL")
        path = os.path.abspath(path) + "/"
        if path == "//":
            path = "/"
        super().__init__(path=path)
        self.sync = bool(sync)

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> FileKvStore:
        unknown = set(spec) - {"driver", "path", "sync"}
        if unknown:
            raise InvalidSpecError(f"file kvstore spec: unknown fields {sorted(unknown)}")
        if "path" not in spec:
            raise InvalidSpecError("file kvstore spec: 'path' (an absolute directory) is required")
        return cls(path=spec["path"], sync=spec.get("sync", True))

    @classmethod
    def spec_from_url(cls, url: str) -> dict[str, Any]:
        rest = url[len("file://"):]
        if not rest.startswith("/"):
            raise InvalidSpecError(
                f"file URL {url!r} must be absolute: file:///abs/path (three slashes)"
            )
        return {"driver": "file", "path": rest}

    def _spec_fields(self) -> dict[str, Any]:
        return {} if self.sync else {"sync": False}

    def url(self) -> str:
        return "file://" + self.path

    def _full(self, key: str) -> str:
        full = super()._full(key)
        if f"/{META_DIR}/" in f"/{key}/":
            raise InvalidKeyError(f"file kvstore: key {key!r} names the reserved folder {META_DIR!r}")
        return full

    # -- blocking-I/O hooks (KvStore.blocking_io) -------------------------------
    blocking_io = True

    def _read_blocking(
        self, key: str, byte_range: ByteRange | None, if_not_equal: Generation | None
    ) -> ReadResult:
        return self._read_sync(key, byte_range, if_not_equal)

    def _write_blocking(self, key: str, value: Buffer, if_equal: Generation | None) -> Generation:
        return self._write_sync(key, value, if_equal)

    def _delete_blocking(self, key: str, if_equal: Generation | None) -> None:
        self._delete_sync(key, if_equal)

    def _read_into_blocking(self, path: str, dest: np.ndarray) -> int:
        """Read the whole value at ``path`` into ``dest`` when it has exactly
        ``dest.nbytes`` bytes (a lean whole-value ``_read_blocking`` for callers
        that know the size, e.g. raw array chunks: no buffer allocation, no
        generation object, three system calls: open, one read, close).

        Returns the value's size, or -1 when the key is missing (absent, or a
        directory, as in ``_read_sync``). ``dest`` (a C-contiguous uint8 array:
        ml_dtypes arrays export no buffer) holds the value only when the size
        matches; its contents are unspecified otherwise, and the caller handles
        any other size (e.g. with ``_read_blocking``). Raises StorageError if
        the file shrinks while being read, like ``_read_sync``.
        """
        try:
            fd = os.open(path, os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return -1
        except OSError as e:
            raise StorageError(f"file kvstore: reading {path!r}: {e}") from e
        try:
            n = dest.nbytes
            # one byte more than expected: a full read proves the size without fstat
            got = os.preadv(fd, (dest, bytearray(1)), 0)
            if got == n:
                return n
            size = os.fstat(fd).st_size  # another size (or a short read): look
            if size != n:
                return size
            mv = memoryview(dest).cast("B")
            while 0 < got < n:  # a short read: go on until EOF, as _read_sync does
                k = os.preadv(fd, (mv[got:],), got)
                if k == 0:
                    break
                got += k
            if got != n:
                raise StorageError(f"file kvstore: {path!r} shrank while being read")
            return n
        except IsADirectoryError:  # open(O_RDONLY) succeeds on directories
            return -1
        finally:
            os.close(fd)

    # -- reads -----------------------------------------------------------------
    async def _read(
        self, key: str, byte_range: ByteRange | None, if_not_equal: Generation | None
    ) -> ReadResult:
        return await run_io(self._read_sync, key, byte_range, if_not_equal)

    def _read_sync(
        self, path: str, byte_range: ByteRange | None, if_not_equal: Generation | None
    ) -> ReadResult:
        try:
            fd = os.open(path, os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            return ReadResult.missing()
        except IsADirectoryError:
            return ReadResult.missing()
        except OSError as e:
            raise StorageError(f"file kvstore: reading {path!r}: {e}") from e
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):  # open(O_RDONLY) succeeds on directories
                return ReadResult.missing()
            gen = _stamp(st)
            if if_not_equal is not None and if_not_equal == gen:
                return ReadResult("unchanged", b"", gen)
            size = st.st_size
            start, stop = (0, size) if byte_range is None else byte_range.clip(size)
            n = stop - start
            buf = aligned_empty(n)
            mv = memoryview(buf)
            got = 0
            while got < n:
                k = os.preadv(fd, [mv[got:]], start + got)
                if k == 0:
                    break
                got += k
            if got != n:
                raise StorageError(f"file kvstore: {path!r} shrank while being read")
            return ReadResult("value", mv, gen)
        finally:
            os.close(fd)

    # -- writes ----------------------------------------------------------------
    async def _write(self, key: str, value: Buffer, if_equal: Generation | None) -> Generation:
        return await run_io(self._write_sync, key, value, if_equal)

    def _write_sync(self, path: str, value: Buffer, if_equal: Generation | None) -> Generation:
        for attempt in range(3):
            try:
                return self._write_once(path, value, if_equal)
            except StorageError:
                raise
            except FileNotFoundError as e:
                # a concurrent delete_range removed a directory we had made: retry
                if attempt == 2:
                    raise StorageError(f"file kvstore: writing {path!r}: {e}") from e
            except OSError as e:
                raise StorageError(f"file kvstore: writing {path!r}: {e}") from e
        raise AssertionError("unreachable")

    def _write_once(self, path: str, value: Buffer, if_equal: Generation | None) -> Generation:
        d, name = os.path.split(path)
        meta = os.path.join(d, META_DIR)
        _makedirs(meta, self.sync)
        # Data first, outside any lock: the critical section stays tiny.
        tmp = os.path.join(meta, f"{name}.{uuid.uuid4().hex}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                _write_all(fd, value)
                if self.sync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            if if_equal is not None and if_equal.is_no_value:
                new = self._link_create(tmp, path)
            else:
                new = self._replace(tmp, path, meta, if_equal)
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass  # renamed onto the key
        if self.sync:
            _fsync_dir(d)
        return new

    def _link_create(self, tmp: str, path: str) -> Generation:
        """Create-only: ``link`` fails atomically if the key exists."""
        now = time.time_ns()
        os.utime(tmp, ns=(now, now))
        try:
            os.link(tmp, path)
        except FileExistsError:
            cur = _stamp_path(path)
            if os.path.isdir(path):
                raise StorageError(f"file kvstore: {path!r} is a directory, not a key") from None
            raise condition_failed(
                self, path[len(self.path):], Generation.NO_VALUE, cur
            ) from None
        return _stamp(os.stat(tmp))

    def _replace(
        self, tmp: str, path: str, meta: str, if_equal: Generation | None
    ) -> Generation:
        """Overwrite or compare-and-swap: check and rename under the directory lock."""
        with _DirLock(meta, self.sync):
            try:
                cur_st: os.stat_result | None = os.stat(path)
            except (FileNotFoundError, NotADirectoryError):
                cur_st = None
            if cur_st is not None and stat.S_ISDIR(cur_st.st_mode):
                raise StorageError(f"file kvstore: {path!r} is a directory, not a key")
            cur = Generation.NO_VALUE if cur_st is None else _stamp(cur_st)
            if if_equal is not None and cur != if_equal:
                raise condition_failed(self, path[len(self.path):], if_equal, cur)
            now = time.time_ns()
            if cur_st is not None and now <= cur_st.st_mtime_ns:
                now = cur_st.st_mtime_ns + 1
            os.utime(tmp, ns=(now, now))
            new = _stamp(os.stat(tmp))
            os.rename(tmp, path)
        return new

    async def _delete(self, key: str, if_equal: Generation | None) -> None:
        await run_io(self._delete_sync, key, if_equal)

    def _delete_sync(self, path: str, if_equal: Generation | None) -> None:
        d, name = os.path.split(path)
        if not os.path.isdir(d):
            if if_equal is not None and not if_equal.is_no_value:
                raise condition_failed(self, path[len(self.path):], if_equal, Generation.NO_VALUE)
            return
        with _DirLock(os.path.join(d, META_DIR), self.sync):
            cur = _stamp_path(path)
            if if_equal is not None and cur != if_equal:
                raise condition_failed(self, path[len(self.path):], if_equal, cur)
            if cur.is_no_value:
                return  # absent, or a directory (which is not a key)
            try:
                os.unlink(path)
            except FileNotFoundError:
                return
            except OSError as e:
                raise StorageError(f"file kvstore: deleting {path!r}: {e}") from e
        if self.sync:
            _fsync_dir(d)

    # -- listing -----------------------------------------------------------------
    async def _list(self, prefix: str) -> list[str]:
        return await run_io(self._list_sync, prefix)

    def _list_sync(self, prefix: str) -> list[str]:
        # Walk only below the deepest directory the prefix names.
        base = prefix if prefix.endswith("/") else os.path.dirname(prefix) + "/"
        if not os.path.isdir(base):
            return []
        out: list[str] = []
        for dirpath, dirnames, filenames in os.walk(base):
            if META_DIR in dirnames:
                dirnames.remove(META_DIR)
            dp = dirpath.rstrip("/") + "/"
            # prune directories that can not hold matching keys
            dirnames[:] = [
                n for n in dirnames
                if (dp + n + "/").startswith(prefix) or prefix.startswith(dp + n + "/")
                or (dp + n).startswith(prefix)
            ]
            for f in filenames:
                full = dp + f
                if full.startswith(prefix):
                    out.append(full)
        return out

    async def _list_info(self, prefix: str) -> list[KeyInfo]:
        return await run_io(self._list_info_sync, prefix)

    def _list_info_sync(self, prefix: str) -> list[KeyInfo]:
        out = []
        for path in self._list_sync(prefix):
            try:
                st = os.stat(path)
            except (FileNotFoundError, NotADirectoryError):
                continue  # deleted since it was listed
            out.append(KeyInfo(path, st.st_size, st.st_mtime_ns / 1e9))
        return out

    async def _delete_range(self, prefix: str) -> None:
        keys = await self._list(prefix)
        for k in keys:  # bounded: the io pool limits concurrency anyway
            await self._delete(k, None)


register_kvstore(FileKvStore, schemes=("file",))
