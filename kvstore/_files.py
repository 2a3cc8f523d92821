"""Filesystem primitives of the file store (kvstore/file.py): fsync'ed folder
creation, the per-folder lock, and what makes a file's generation unique --
the random token kept in an extended attribute and the probe of the
filesystem's mtime resolution. See the file store's module docstring.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import struct
import threading
import time
import uuid

from tensorstore_py.core.errors import StorageError
from tensorstore_py.core.ranges import Buffer
from tensorstore_py.kvstore.base import Generation

__all__ = [
    "META_DIR",
    "is_utf8_name",
    "list_folder_sync",
    "NO_XATTRS",
    "TMP_SUFFIX",
    "TOKEN_LEN",
    "TOKEN_XATTR",
    "DirLock",
    "Token",
    "fine_mtime",
    "fsync_dir",
    "generation",
    "get_token",
    "makedirs",
    "open_to_read",
    "probe_fine_mtime",
    "set_token",
    "sweep_temporaries_under",
    "write_all",
]

META_DIR = ".__tsp__"
#: the extended attribute holding a write's random token (see the module docstring)
TOKEN_XATTR = "user.tsp.gen"
TOKEN_LEN = 16
#: suffix of the temporary files in META_DIR (``<name>.<hex32>.tmp``)
TMP_SUFFIX = ".tmp"
_STAMP = struct.Struct("<QQqq")
_HAS_XATTR = hasattr(os, "setxattr")  # Linux; elsewhere generations are stat stamps


class _NoXattrs:
    """The answer of :func:`get_token` on a filesystem without user xattrs."""


NO_XATTRS = _NoXattrs()
#: the token of a file: its bytes, None (xattrs work, the file has none: a
#: file written by another tool) or NO_XATTRS (the filesystem stores none)
Token = bytes | None | _NoXattrs


def set_token(fd: int, token: bytes) -> bool:
    """Store ``token`` with the open file ``fd``; False where the filesystem can not."""
    if not _HAS_XATTR:
        return False
    try:
        os.setxattr(fd, TOKEN_XATTR, token)
    except OSError:  # ENOTSUP, EPERM (some FUSE/NFS), E2BIG ...: no token for this write
        return False
    return True


def get_token(file: int | str) -> Token:
    """The token stored with ``file`` (an open fd or a path)."""
    if not _HAS_XATTR:
        return NO_XATTRS
    try:
        tok = os.getxattr(file, TOKEN_XATTR)
    except OSError as e:
        if e.errno == errno.ENODATA:
            return None
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            raise
        return NO_XATTRS
    return tok if len(tok) == TOKEN_LEN else None  # a foreign value: as if absent


def generation(st: os.stat_result, token: Token) -> Generation:
    stamp = _STAMP.pack(st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
    return Generation(stamp + token if isinstance(token, bytes) else stamp)


# st_dev -> whether the filesystem keeps nanosecond mtimes (probed once each)
_FINE_MTIME: dict[int, bool] = {}
_FINE_MTIME_LOCK = threading.Lock()
# an mtime with digits at every resolution (odd seconds for FAT's 2 s), so any
# truncation shows
_PROBE_NS = 123_456_789


def fine_mtime(meta: str) -> bool:
    """Whether the filesystem of the folder holding ``meta`` keeps nanosecond
    mtimes: :func:`probe_fine_mtime`, once per filesystem (by device)."""
    dev = os.stat(os.path.dirname(meta)).st_dev
    with _FINE_MTIME_LOCK:
        fine = _FINE_MTIME.get(dev)
    if fine is None:
        fine = probe_fine_mtime(meta)
        with _FINE_MTIME_LOCK:
            _FINE_MTIME[dev] = fine
    return fine


def probe_fine_mtime(meta: str) -> bool:
    """Whether the filesystem holding the folder ``meta`` (a ``.__tsp__``
    folder, created if needed) keeps an mtime to the nanosecond: set one on a
    scratch file there and read it back. False where the probe can not be
    written (a read-only mount): nothing proves the timestamps fine."""
    tmp = os.path.join(meta, f"probe.{uuid.uuid4().hex}{TMP_SUFFIX}")
    try:
        makedirs(meta, False)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError:
        return False
    try:
        want = (time.time_ns() // 10**9 | 1) * 10**9 + _PROBE_NS
        os.utime(fd, ns=(want, want))
        return os.fstat(fd).st_mtime_ns == want
    except OSError:
        return False
    finally:
        os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def makedirs(path: str, sync: bool) -> None:
    """``os.makedirs`` that fsyncs the parent of every directory it creates."""
    if os.path.isdir(path):
        return
    parent = os.path.dirname(path.rstrip("/"))
    if parent and parent != path:
        makedirs(parent, sync)
    try:
        os.mkdir(path)
    except FileExistsError:
        if not os.path.isdir(path):
            raise
        return
    if sync:
        fsync_dir(parent)


def write_all(fd: int, value: Buffer) -> None:
    mv = memoryview(value).cast("B")
    while mv:
        n = os.write(fd, mv)
        mv = mv[n:]


class DirLock:
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

    def __enter__(self) -> DirLock:
        makedirs(self.meta, self.sync)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)




def sweep_temporaries_under(root: str, changed_before: float, dry_run: bool) -> list[str]:
    """The temporary files (``*.tmp``) in the ``.__tsp__`` folders under ``root``
    last changed before ``changed_before`` (a ctime), relative to ``root`` and
    sorted; removed unless ``dry_run`` (see ``FileKvStore.sweep_temporaries``)."""
    found: list[str] = []
    for dirpath, dirnames, _files in os.walk(root):
        if META_DIR not in dirnames:
            continue
        dirnames.remove(META_DIR)
        meta = os.path.join(dirpath, META_DIR)
        try:
            entries = list(os.scandir(meta))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for e in entries:
            if not e.name.endswith(TMP_SUFFIX):
                continue
            try:
                st = e.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # finished meanwhile
            if not stat.S_ISREG(st.st_mode) or st.st_ctime > changed_before:
                continue
            found.append(os.path.relpath(e.path, root))
            if not dry_run:
                try:
                    os.unlink(e.path)
                except FileNotFoundError:
                    pass
                except OSError as err:
                    raise StorageError(f"file kvstore: removing {e.path!r}: {err}") from err
    return sorted(found)


def is_utf8_name(name: str) -> bool:
    """Whether a file name read from the OS is valid UTF-8 (names that are not
    come back with lone surrogates, and keys never contain those)."""
    if name.isascii():
        return True
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def list_folder_sync(folder: str) -> tuple[list[str], list[str]]:
    """One read of directory ``folder`` (a path ending in ``/``): its files as
    keys, its directories as folders (``.../name/``); the reserved folder and
    names that can not be keys are skipped."""
    keys: list[str] = []
    folders: list[str] = []
    try:
        with os.scandir(folder) as it:
            for e in it:
                if e.name == META_DIR or not is_utf8_name(e.name):
                    continue
                try:
                    is_dir = e.is_dir()
                except OSError:
                    continue  # deleted since it was listed
                if is_dir:
                    folders.append(folder + e.name + "/")
                else:
                    keys.append(folder + e.name)
    except (FileNotFoundError, NotADirectoryError):
        return [], []
    return keys, folders


def open_to_read(path: str) -> int | None:
    """A read-only descriptor of the file at ``path``, or None when the key is
    missing (no such file, or a path through a non-directory); StorageError
    naming the path for any other failure."""
    try:
        return os.open(path, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    except OSError as e:
        raise StorageError(f"file kvstore: reading {path!r}: {e}") from e
