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

Clock: every write stamps its file's mtime with the *filesystem's* time
(``utimensat`` with ``UTIME_NOW``: the kernel's clock on a local filesystem,
the server's on NFS, which sets it when the client asks for "now"), never
with a time this host computed. Ages that garbage collection measures
(``list_info`` mtimes against a probe object's) therefore come from one clock
on a local or NFS filesystem, whatever the clocks of the hosts that write
(docs/STORES.md "Clocks" lists which clock each store trusts).

Generation: the file's stat stamp (device, inode, mtime_ns, size) followed by
a random 16-byte token that every write of this store stores with the file, in
the extended attribute ``user.tsp.gen`` (set on the temporary file before the
rename or link, so the token arrives atomically with the bytes; the file's
bytes stay exactly the value, which other zarr readers rely on). The token
makes generations unique per write: a stat stamp alone can repeat (ext4 hands
consecutive rewrites of a key two alternating inode numbers, and on
filesystems with coarse timestamps -- NFS exports, Lustre, ext3, HFS+ -- a
same-size rewrite within one clock tick keeps the mtime), and then a
compare-and-swap would succeed against changed data and ``if_not_equal`` would
answer "unchanged". The stamp part still catches in-place changes by other
tools. Files written by other tools (no token) get the stat stamp alone, with
the mtime of our own rewrites set past the previous one's (one ns more when
the filesystem's clock has not advanced).

Where no token can be stored (a filesystem without user extended attributes)
*and* the filesystem's timestamps are coarser than a nanosecond (probed once
per filesystem by setting an mtime with nanosecond digits on a scratch file in
``.__tsp__`` and reading it back), generations can repeat, so compare-and-swap
writes and deletes raise UnsupportedError naming the path instead of
answering wrongly, and ``read(if_not_equal=...)`` always returns the value
(never "unchanged": a cache of decoded chunks or shard indexes re-reads
rather than serving data of an earlier write). Create-only writes stay exact
(``link`` fails on an existing key whatever the generations), and plain
overwrites and reads work everywhere.

Housekeeping files (at most one lock file per directory, and temporaries while
a write is in flight) live in a hidden ``.__tsp__`` folder beside the keys;
``list`` never shows them and keys may not name them. Nor does ``list`` show
files whose names are not valid UTF-8 (other tools may create them; keys are
Unicode). A writer that crashes
leaves its temporary there (and, between the ``link`` of a create-only write
and the ``unlink`` of its temporary, a second hard link to the new key's
file); :meth:`FileKvStore.sweep_temporaries` finds and removes both.
"""

from __future__ import annotations

import os
import stat
import time
import uuid
from typing import Any

import numpy as np

from tensorstore_py.core.buffers import aligned_empty, pread_full
from tensorstore_py.core.errors import (
    InvalidArgumentError,
    InvalidKeyError,
    InvalidSpecError,
    StorageError,
    UnsupportedError,
)
from tensorstore_py.core.future import Future, submit_blocking
from tensorstore_py.core.pools import run_io
from tensorstore_py.kvstore._files import (
    META_DIR,
    NO_XATTRS,
    TMP_SUFFIX,
    TOKEN_LEN,
    TOKEN_XATTR,
    DirLock,
    Token,
    fine_mtime,
    fsync_dir,
    generation,
    get_token,
    list_folder_sync,
    makedirs,
    open_to_read,
    set_token,
    sweep_temporaries_under,
    write_all,
)
from tensorstore_py.kvstore._files import (
    is_utf8_name as _is_utf8,
)
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

__all__ = ["META_DIR", "FileKvStore"]


class FileKvStore(KvStore):
    """Keys are files under the absolute directory ``path``."""

    driver = "file"

    def __init__(self, *, path: str, sync: bool = True) -> None:
        if not isinstance(path, str) or not path:
            raise InvalidSpecError(f"file kvstore: path must be a non-empty string, got {path!r}")
        if "\x00" in path:
            raise InvalidSpecError(f"file kvstore: path {path!r} contains NUL")
        try:
            os.fsencode(path)
        except UnicodeEncodeError:
            raise InvalidSpecError(f"file kvstore: path {path!r} is not valid Unicode") from None
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

    def _read_into_blocking(self, path: str, dest: np.ndarray, *, smaller: bool = False) -> int:
        """Read the whole value at ``path`` into ``dest`` when it has exactly
        ``dest.nbytes`` bytes (a lean whole-value ``_read_blocking`` for callers
        that know the size, e.g. raw array chunks: no buffer allocation, no
        generation object, three system calls: open, one read, close).

        Returns the value's size, or -1 when the key is missing (absent, or a
        directory, as in ``_read_sync``). ``dest`` (a C-contiguous uint8 array:
        ml_dtypes arrays export no buffer) holds the value only when the size
        matches; its contents are unspecified otherwise, and the caller handles
        any other size (e.g. with ``_read_blocking``). With ``smaller`` a
        shorter value is read too (one ``fstat`` more): its bytes are then the
        first ``size`` of ``dest`` (compressed chunks, whose sizes vary). Raises
        StorageError if the file shrinks while being read, like ``_read_sync``.
        """
        fd = open_to_read(path)
        if fd is None:
            return -1
        try:
            n = dest.nbytes
            # one byte more than expected: a full read proves the size without fstat
            got = os.preadv(fd, (dest.data, bytearray(1)), 0)
            if got == n:
                return n
            size = os.fstat(fd).st_size  # another size (or a short read): look
            if size != n and not (smaller and size < n):
                return size
            if got < size:  # a short read: go on until EOF, as _read_sync does
                got = pread_full(fd, dest.data[:size], 0, max(got, 0))
            if got != size:
                raise StorageError(f"file kvstore: {path!r} shrank while being read")
            return size
        except IsADirectoryError:  # open(O_RDONLY) succeeds on directories
            return -1
        finally:
            os.close(fd)

    def _read_range_into_blocking(self, path: str, offset: int, dest: memoryview) -> int:
        """Read the bytes of the file at ``path`` from ``offset`` into ``dest``
        (a writable byte buffer) until it is full or the file ends; returns the
        bytes read, or -1 when the key is missing. No buffer is allocated: the
        kernel copies into ``dest`` itself (what a checkpoint restore's host
        buffer pool relies on). Immutable values only (no generation is taken)."""
        fd = open_to_read(path)
        if fd is None:
            return -1
        try:
            return pread_full(fd, dest, offset)
        except IsADirectoryError:
            return -1
        finally:
            os.close(fd)

    # -- what the filesystem offers (methods, so that a test can stand in for
    # -- a filesystem without xattrs or with coarse timestamps) -----------------
    def _store_token(self, fd: int, token: bytes) -> bool:
        """Store a write's token with its temporary file; False where impossible."""
        return set_token(fd, token)

    def _token(self, file: int | str) -> Token:
        """The token stored with ``file`` (an open fd or a path)."""
        return get_token(file)

    def _fine_mtime(self, meta: str) -> bool:
        """Whether the filesystem of the folder holding ``meta`` keeps
        nanosecond mtimes (probed once per filesystem)."""
        return fine_mtime(meta)

    def _generation_at(self, path: str) -> tuple[Generation, Token]:
        """The key's generation and token; (NO_VALUE, None) when absent or a directory."""
        try:
            st = os.stat(path)
            if stat.S_ISDIR(st.st_mode):
                return Generation.NO_VALUE, None
            token = self._token(path)
        except (FileNotFoundError, NotADirectoryError):
            return Generation.NO_VALUE, None
        return generation(st, token), token

    def _is_exact(self, path: str) -> bool:
        """Whether stat stamps alone tell writes of ``path`` apart (nanosecond
        timestamps), where no token can be stored."""
        return self._fine_mtime(os.path.join(os.path.dirname(path), META_DIR))

    def _check_exact(self, path: str, op: str) -> None:
        """Refuse ``op`` where generations can repeat: no token can be stored
        and the timestamps are coarse (see the module docstring)."""
        if not self._is_exact(path):
            raise UnsupportedError(
                f"file kvstore: {op} of {path!r} is not supported here: the filesystem stores no "
                f"extended attribute {TOKEN_XATTR!r} and its timestamps are coarser than 1 ns, so "
                "generations could repeat and the condition could pass against changed data "
                "(create-only writes and unconditional writes still work)"
            )

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
            token = self._token(fd)
            gen = generation(st, token)
            # "unchanged" only where generations are exact; elsewhere the value
            # is returned (always a correct answer: caches above re-read instead)
            if (if_not_equal is not None and not if_not_equal.is_no_value and if_not_equal == gen
                    and (token is not NO_XATTRS or self._is_exact(path))):
                return ReadResult("unchanged", b"", gen)
            size = st.st_size
            start, stop = (0, size) if byte_range is None else byte_range.clip(size)
            n = stop - start
            buf = aligned_empty(n)
            mv = buf.data
            got = pread_full(fd, mv, start)
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
        d = os.path.dirname(path)
        meta = os.path.join(d, META_DIR)
        makedirs(meta, self.sync)
        # Data first, outside any lock: the critical section stays tiny.
        fd, tmp = self._open_temporary(meta, path)
        try:
            token = self._fill(fd, value)
            if not token and if_equal is not None and not if_equal.is_no_value:
                self._check_exact(path, "compare-and-swap write")
            # the generation comes from ``fd``, never from the name ``tmp``:
            # sweep_temporaries may unlink that name at any time
            if if_equal is not None and if_equal.is_no_value:
                new = self._link_create(fd, tmp, path, token)
            else:
                new = self._replace(fd, tmp, path, meta, if_equal, token)
        finally:
            os.close(fd)
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass  # renamed onto the key
        if self.sync:
            fsync_dir(d)
        return new

    @staticmethod
    def _open_temporary(meta: str, path: str) -> tuple[int, str]:
        """A new temporary file for the value of ``path``: (fd, its name)."""
        tmp = os.path.join(meta, f"{os.path.basename(path)}.{uuid.uuid4().hex}{TMP_SUFFIX}")
        return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), tmp

    def _fill(self, fd: int, value: Buffer) -> bytes:
        """Write ``value`` and a fresh token to the temporary ``fd`` (fsync'ed
        unless ``sync=False``); the token, or b"" where none can be stored."""
        write_all(fd, value)
        token = os.urandom(TOKEN_LEN)
        if not self._store_token(fd, token):
            token = b""
        if self.sync:
            os.fsync(fd)
        return token

    def _link_create(self, fd: int, tmp: str, path: str, token: bytes) -> Generation:
        """Create-only: ``link`` fails atomically if the key exists."""
        os.utime(fd)  # the filesystem's "now" (on NFS the server's), never this host's clock
        try:
            os.link(tmp, path)
        except FileExistsError:
            cur, _ = self._generation_at(path)
            if os.path.isdir(path):
                raise StorageError(f"file kvstore: {path!r} is a directory, not a key") from None
            raise condition_failed(
                self, path[len(self.path):], Generation.NO_VALUE, cur
            ) from None
        return generation(os.fstat(fd), token)

    def _replace(
        self, fd: int, tmp: str, path: str, meta: str, if_equal: Generation | None, token: bytes
    ) -> Generation:
        """Overwrite or compare-and-swap: check and rename under the directory lock."""
        with DirLock(meta, self.sync):
            return self._swap_in(fd, tmp, path, if_equal, token)

    def _swap_in(self, fd: int, tmp: str, path: str, if_equal: Generation | None, token: bytes) -> Generation:
        """Check ``if_equal`` and rename ``tmp`` onto ``path`` (the caller holds the directory lock)."""
        try:
            cur_st: os.stat_result | None = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            cur_st = None
        if cur_st is not None and stat.S_ISDIR(cur_st.st_mode):
            raise StorageError(f"file kvstore: {path!r} is a directory, not a key")
        if if_equal is not None:
            cur = Generation.NO_VALUE if cur_st is None else generation(cur_st, self._token(path))
            if cur != if_equal:
                raise condition_failed(self, path[len(self.path):], if_equal, cur)
        os.utime(fd)  # the filesystem's "now" (on NFS the server's), never this host's clock
        st = os.fstat(fd)
        if cur_st is not None and st.st_mtime_ns <= cur_st.st_mtime_ns:
            # the clock did not advance past the previous write's (a coarse
            # tick): one ns more keeps stamps of files without a token distinct
            bump = cur_st.st_mtime_ns + 1
            os.utime(fd, ns=(st.st_atime_ns, bump))
            st = os.fstat(fd)
        new = generation(st, token)
        os.rename(tmp, path)
        return new

    def _write_many_blocking(self, items: list[tuple[str, Buffer]]) -> None:
        """Unconditional writes, each as atomic and durable as ``_write_blocking``
        (its own temporary file, fsync'ed, renamed onto the key under the folder's
        lock, the folder fsync'ed before this returns), with the values of one
        folder renamed under ONE hold of its lock and made durable by ONE folder
        fsync: small chunks pay one lock and one directory fsync per batch, not
        per chunk."""
        groups: dict[str, list[tuple[str, Buffer]]] = {}
        for path, value in items:
            groups.setdefault(os.path.dirname(path), []).append((path, value))
        for d, group in groups.items():
            if len(group) > 1:
                try:
                    self._write_group(d, group)
                    continue
                except FileNotFoundError:
                    pass  # a concurrent delete_range removed the folder: one by one, with retries
                except StorageError:
                    raise
                except OSError as e:
                    raise StorageError(f"file kvstore: writing {len(group)} keys in {d!r}: {e}") from e
            for path, value in group:
                self._write_sync(path, value, None)

    def _write_group(self, d: str, group: list[tuple[str, Buffer]]) -> None:
        meta = os.path.join(d, META_DIR)
        makedirs(meta, self.sync)
        staged: list[tuple[int, str, str, bytes]] = []  # (fd, temporary, key path, token)
        renamed = 0
        try:
            for path, value in group:  # data first, outside the lock
                fd, tmp = self._open_temporary(meta, path)
                staged.append((fd, tmp, path, b""))  # tracked first: a failing fill is cleaned up
                staged[-1] = (fd, tmp, path, self._fill(fd, value))
            with DirLock(meta, self.sync):
                for fd, tmp, path, token in staged:
                    self._swap_in(fd, tmp, path, None, token)
                    renamed += 1
        finally:
            for i, (fd, tmp, _, _) in enumerate(staged):
                os.close(fd)
                if i >= renamed:
                    try:
                        os.unlink(tmp)
                    except FileNotFoundError:
                        pass  # swept meanwhile
        if self.sync:
            fsync_dir(d)

    async def _delete(self, key: str, if_equal: Generation | None) -> None:
        await run_io(self._delete_sync, key, if_equal)

    def _delete_sync(self, path: str, if_equal: Generation | None) -> None:
        d, name = os.path.split(path)
        if not os.path.isdir(d):
            if if_equal is not None and not if_equal.is_no_value:
                raise condition_failed(self, path[len(self.path):], if_equal, Generation.NO_VALUE)
            return
        with DirLock(os.path.join(d, META_DIR), self.sync):
            cur, token = self._generation_at(path)
            if if_equal is not None and not if_equal.is_no_value and token is NO_XATTRS:
                self._check_exact(path, "conditional delete")
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
            fsync_dir(d)

    # -- housekeeping ------------------------------------------------------------
    def sweep_temporaries(self, older_than: float, *, dry_run: bool = True) -> Future[list[str]]:
        """Find, and unless ``dry_run`` remove, what crashed writers left in the
        hidden ``.__tsp__`` folders under this store's path.

        That is every temporary file (``<name>.<hex32>.tmp``) last changed more
        than ``older_than`` seconds ago, by the store's own clock (the change
        time the filesystem stamps on a fresh file, not this host's clock):
        the temporary of a writer that died before its rename, and the second
        hard link a create-only write leaves when it dies between ``link`` and
        ``unlink`` (the temporary's link count is then 2; removing it frees
        the key's disk space once the key is deleted). The keys' files are
        never touched. Lock files stay.

        Returns the paths found, relative to the store's path, sorted. Removing
        a live writer's temporary is harmless (its rename or link fails and the
        write is retried), but choose ``older_than`` well above the time a
        write takes.
        """
        if (isinstance(older_than, bool) or not isinstance(older_than, (int, float))
                or not older_than >= 0):
            raise InvalidArgumentError(
                f"sweep_temporaries: older_than must be a number of seconds >= 0, got {older_than!r}"
            )
        if not isinstance(dry_run, bool):
            raise InvalidArgumentError(f"sweep_temporaries: dry_run must be a bool, got {dry_run!r}")
        if not dry_run:
            self._check_writable("sweep_temporaries", "")
        return submit_blocking(self._sweep_sync, float(older_than), dry_run)

    def _sweep_sync(self, older_than: float, dry_run: bool) -> list[str]:
        if not os.path.isdir(self.path):
            return []
        return sweep_temporaries_under(self.path, self._store_now() - older_than, dry_run)

    def _store_now(self) -> float:
        """The filesystem's clock: the change time of a fresh scratch file in
        the root's ``.__tsp__`` (on NFS the server's clock, which stamps every
        file's ctime); this host's clock where none can be written."""
        meta = os.path.join(self.path, META_DIR)
        tmp = os.path.join(meta, f"clock.{uuid.uuid4().hex}{TMP_SUFFIX}")
        try:
            makedirs(meta, False)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError:
            return time.time()
        try:
            return os.fstat(fd).st_ctime
        finally:
            os.close(fd)
            os.unlink(tmp)

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
            # prune directories that can not hold matching keys (or no key at
            # all: names that are not UTF-8 can not be keys)
            dirnames[:] = [
                n for n in dirnames
                if ((dp + n + "/").startswith(prefix) or prefix.startswith(dp + n + "/")
                    or (dp + n).startswith(prefix)) and _is_utf8(n)
            ]
            for f in filenames:
                full = dp + f
                if full.startswith(prefix) and _is_utf8(f):
                    out.append(full)
        return out

    lists_folders_natively = True

    async def _list_folder(self, folder: str) -> tuple[list[str], list[str]]:
        return await run_io(list_folder_sync, folder)

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
