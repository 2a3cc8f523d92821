"""The file store against the kvstore conformance suite, plus file-specific checks."""

from __future__ import annotations

import functools
import multiprocessing
import os
from pathlib import Path

import numpy as np
import pytest
from test_driver_helpers import open_sync, read, write

import tensorstore_py as tsp
import tensorstore_py.kvstore._files as file_mod
from tensorstore_py.drivers.cache import CachePool
from tensorstore_py.drivers.open import build_metadata
from tensorstore_py.kvstore.base import KvStore
from tensorstore_py.kvstore.file import META_DIR, FileKvStore
from tensorstore_py.testing.kvstore import KvStoreConformance, cas_increment_worker


class TestFileConformance(KvStoreConformance):
    @pytest.fixture
    def store(self, tmp_path: Path) -> FileKvStore:
        return FileKvStore(path=str(tmp_path / "root"))


class TestFileNoSyncConformance(KvStoreConformance):
    race_increments = 10

    @pytest.fixture
    def store(self, tmp_path: Path) -> FileKvStore:
        return FileKvStore(path=str(tmp_path / "root"), sync=False)


def test_cas_race_across_processes(tmp_path: Path) -> None:
    """4 processes x 25 compare-and-swap increments end at exactly 100."""
    kv = FileKvStore(path=str(tmp_path / "race"))
    kv.write("counter", b"0", if_equal=tsp.Generation.NO_VALUE).result()
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(4) as pool:
        lost = pool.starmap(cas_increment_worker, [(kv.spec(), "counter", 25)] * 4)
    assert len(lost) == 4
    assert bytes(kv.read("counter").result().value) == b"100"


def test_create_only_race_across_processes(tmp_path: Path) -> None:
    """Of several processes creating one key, exactly one wins."""
    kv = FileKvStore(path=str(tmp_path / "create"))
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(4) as pool:
        won = pool.starmap(_try_create, [(kv.spec(), "k", i) for i in range(8)])
    assert sum(won) == 1
    winner = won.index(True)
    assert bytes(kv.read("k").result().value) == f"writer {winner}".encode()


def _try_create(spec: dict, key: str, i: int) -> bool:
    store = tsp.KvStore.open(spec).result(60)
    try:
        store.write(key, f"writer {i}".encode(), if_equal=tsp.Generation.NO_VALUE).result(60)
    except tsp.ConditionFailedError:
        return False
    return True


def test_layout_on_disk(tmp_path: Path) -> None:
    kv = FileKvStore(path=str(tmp_path))
    kv.write("a/b/c", b"bytes").result()
    assert (tmp_path / "a" / "b" / "c").read_bytes() == b"bytes"
    # housekeeping never shows up as keys and leaves no temporaries behind
    assert kv.list().result() == ["a/b/c"]
    meta = tmp_path / "a" / "b" / META_DIR
    assert not [p for p in os.listdir(meta) if p.endswith(".tmp")]


def test_files_written_outside_are_keys(tmp_path: Path) -> None:
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "y").write_bytes(b"external")
    kv = FileKvStore(path=str(tmp_path))
    r = kv.read("x/y").result()
    assert bytes(r.value) == b"external"
    assert kv.list().result() == ["x/y"]
    # a directory is not a key
    assert kv.read("x").result().state == "missing"


def test_reserved_folder_is_not_a_key(tmp_path: Path) -> None:
    kv = FileKvStore(path=str(tmp_path))
    with pytest.raises(tsp.InvalidKeyError):
        kv.read(f"a/{META_DIR}/x.lock").result()
    with pytest.raises(tsp.InvalidKeyError):
        kv.write(META_DIR, b"x").result()


def test_generation_changes_within_clock_tick(tmp_path: Path) -> None:
    kv = FileKvStore(path=str(tmp_path), sync=False)
    gens = [kv.write("k", b"same").result() for _ in range(50)]
    assert len(set(gens)) == 50


def test_external_change_is_detected(tmp_path: Path) -> None:
    kv = FileKvStore(path=str(tmp_path))
    g = kv.write("k", b"ours").result()
    tmp = tmp_path / "k.new"
    tmp.write_bytes(b"theirs")
    os.replace(tmp, tmp_path / "k")
    r = kv.read("k", if_not_equal=g).result()
    assert r.state == "value" and bytes(r.value) == b"theirs"
    with pytest.raises(tsp.ConditionFailedError):
        kv.write("k", b"lost", if_equal=g).result()
    assert (tmp_path / "k").read_bytes() == b"theirs"


def test_url_and_spec(tmp_path: Path) -> None:
    kv = tsp.KvStore.open(f"file://{tmp_path}/d/").result()
    assert isinstance(kv, FileKvStore)
    assert kv.spec() == {"driver": "file", "path": f"{tmp_path}/d/"}
    assert kv.url() == f"file://{tmp_path}/d/"
    plain = tsp.KvStore.open(str(tmp_path / "d")).result()
    assert plain == kv
    scratch = tsp.KvStore.open({"driver": "file", "path": str(tmp_path), "sync": False}).result()
    assert scratch.spec() == {"driver": "file", "sync": False, "path": f"{tmp_path}/"}
    assert "sync" in repr(scratch)


def test_symlinked_root_is_followed_but_keys_cannot_escape(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "secret").write_bytes(b"secret")
    os.symlink(real, tmp_path / "link")
    kv = FileKvStore(path=str(tmp_path / "link"))
    kv.write("k", b"v").result()
    assert (real / "k").read_bytes() == b"v"
    for bad in ("../secret", "a/../../secret", "/etc/passwd"):
        with pytest.raises(tsp.InvalidKeyError):
            kv.read(bad).result()


def test_directories_are_not_keys(tmp_path: Path) -> None:
    kv = FileKvStore(path=str(tmp_path))
    kv.write("d/inner", b"x").result()
    kv.delete("d").result()  # deleting a directory name is deleting a missing key
    assert bytes(kv.read("d/inner").result().value) == b"x"
    with pytest.raises(tsp.ConditionFailedError):
        kv.delete("d", if_equal=kv.read("d/inner").result().generation).result()
    with pytest.raises(tsp.errors.StorageError, match="directory"):
        kv.write("d", b"over a directory").result()
    # a key that is also a file on the way to another key
    kv.write("f", b"file").result()
    with pytest.raises(tsp.errors.StorageError):
        kv.write("f/child", b"x").result()
    assert bytes(kv.read("f").result().value) == b"file"


def test_futures_from_every_waiting_style(tmp_path: Path) -> None:
    """read/write Futures work blocked on (with and without timeout), awaited from
    another loop and from the library's loop, and through callbacks."""
    import asyncio
    import threading

    from tensorstore_py.core.future import spawn

    kv = FileKvStore(path=str(tmp_path), sync=False)
    assert not kv.write("a", b"1").result(timeout=10).is_no_value
    assert bytes(kv.read("a").result().value) == b"1"

    async def on_other_loop() -> bytes:
        await kv.write("b", b"2")
        return bytes((await kv.read("b")).value)

    assert asyncio.run(on_other_loop()) == b"2"

    async def on_library_loop() -> bytes:
        await kv.write("c", b"3")
        return bytes((await kv.read("c")).value)

    assert spawn(on_library_loop()).result(10) == b"3"
    done = threading.Event()
    fut = kv.read("c")
    fut.add_done_callback(lambda f: done.set())
    assert done.wait(10) and bytes(fut.result().value) == b"3"
    # many writes in flight at once, then waited for in reverse order
    futs = [kv.write(f"m/{i}", bytes([i])) for i in range(50)]
    gens = [f.result() for f in reversed(futs)]
    assert len(set(gens)) == 50
    assert [bytes(kv.read(f"m/{i}").result().value) for i in range(50)] == [
        bytes([i]) for i in range(50)
    ]


# -- generations are unique per write (issue 10 item 4) --------------------------------
class _NoXattrStore(FileKvStore):
    """The file store on a filesystem that keeps no extended attributes."""

    def _store_token(self, fd: int, token: bytes) -> bool:
        return False

    def _token(self, file: int | str) -> file_mod.Token:
        return file_mod.NO_XATTRS

    def __reduce__(self) -> tuple:  # its spec would reopen a plain file store
        return (functools.partial(type(self), path=self.path, sync=self.sync), ())


class _CoarseNoXattrStore(_NoXattrStore):
    """... whose timestamps are also coarse (NFS exports, Lustre, ext3, HFS+)."""

    def _fine_mtime(self, meta: str) -> bool:
        return False


class TestFileNoXattrConformance(KvStoreConformance):
    """Without xattrs but with nanosecond timestamps the stat stamp alone serves."""

    race_increments = 10

    @pytest.fixture
    def store(self, tmp_path: Path) -> FileKvStore:
        return _NoXattrStore(path=str(tmp_path / "root"))

    def test_spec_round_trip(self, store: KvStore) -> None:
        # a stand-in class has no driver of its own: the spec reopens a plain file store
        assert tsp.KvStore.open(store.spec()).result() == FileKvStore(path=store.path)


def _same_stamp_rewrite(kv: FileKvStore, root: Path, key: str, g1_stat: os.stat_result) -> None:
    """Rewrite ``key`` with other bytes of the same size until its file has the
    inode of ``g1_stat`` again (ext4 alternates two), then give it the old
    mtime: what a filesystem whose clock did not tick in between leaves."""
    fast = type(kv)(path=kv.path, sync=False)  # same store class and files, no fsyncs
    for i in range(500):  # two tries when no other process takes the freed inode first
        fast.write(key, b"v%03d" % (i % 1000)).result()
        st = os.stat(root / key)
        if st.st_ino == g1_stat.st_ino:
            os.utime(root / key, ns=(g1_stat.st_mtime_ns, g1_stat.st_mtime_ns))
            return
    pytest.skip("this filesystem never reuses the inode: stat stamps can not repeat here")


def test_same_stamp_rewrite_fails_compare_and_swap(tmp_path: Path) -> None:
    """A rewrite with the same (dev, inode, mtime, size) -- one clock tick on a
    coarse filesystem -- used to keep the generation: a compare-and-swap against
    the old generation passed and if_not_equal answered "unchanged". The token
    stored with each write tells them apart."""
    kv = FileKvStore(path=str(tmp_path))
    g1 = kv.write("k", b"orig").result()
    st1 = os.stat(tmp_path / "k")
    _same_stamp_rewrite(kv, tmp_path, "k", st1)
    st = os.stat(tmp_path / "k")
    assert (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size) == (
        st1.st_dev, st1.st_ino, st1.st_mtime_ns, st1.st_size)
    changed = (tmp_path / "k").read_bytes()
    assert changed != b"orig"
    with pytest.raises(tsp.ConditionFailedError):
        kv.write("k", b"lost", if_equal=g1).result()
    with pytest.raises(tsp.ConditionFailedError):
        kv.delete("k", if_equal=g1).result()
    r = kv.read("k", if_not_equal=g1).result()
    assert r.state == "value" and bytes(r.value) == changed
    assert (tmp_path / "k").read_bytes() == changed
    # the file holds exactly the value (the token lives in an xattr) ...
    assert os.getxattr(tmp_path / "k", file_mod.TOKEN_XATTR) == r.generation.token[-16:]
    # ... and the current generation still works
    kv.write("k", b"next", if_equal=r.generation).result()
    assert (tmp_path / "k").read_bytes() == b"next"


def test_coarse_filesystem_without_xattrs_refuses_conditions(tmp_path: Path) -> None:
    """Where no token can be stored and timestamps are coarse, generations can
    repeat: compare-and-swap and conditional deletes raise UnsupportedError
    naming the path instead of passing against changed data, if_not_equal
    returns the value (never "unchanged"); create-only writes (link) and plain
    writes and reads still work."""
    kv = _CoarseNoXattrStore(path=str(tmp_path))
    g1 = kv.write("k", b"orig").result()
    st1 = os.stat(tmp_path / "k")
    _same_stamp_rewrite(kv, tmp_path, "k", st1)
    changed = (tmp_path / "k").read_bytes()
    # the stamps are equal: without the refusal this CAS would pass (it did on main)
    assert kv.read("k").result().generation == g1
    for call in (lambda: kv.write("k", b"lost", if_equal=g1),
                 lambda: kv.delete("k", if_equal=g1)):
        with pytest.raises(tsp.UnsupportedError, match=str(tmp_path / "k")):
            call().result()
    assert (tmp_path / "k").read_bytes() == changed
    r = kv.read("k", if_not_equal=g1).result()
    assert r.state == "value" and bytes(r.value) == changed
    kv.write("new", b"1", if_equal=tsp.Generation.NO_VALUE).result()
    with pytest.raises(tsp.ConditionFailedError):
        kv.write("new", b"2", if_equal=tsp.Generation.NO_VALUE).result()
    kv.write("k", b"plain").result()
    assert bytes(kv.read("k").result().value) == b"plain"
    assert kv.read("absent", if_not_equal=g1).result().state == "missing"


def test_chunk_cache_on_a_coarse_filesystem_without_xattrs_reads_the_new_bytes(tmp_path: Path) -> None:
    """An array with a cache of decoded chunks on such a filesystem: a chunk
    rewritten with the same stat stamp is read anew (the cache can not be
    told "unchanged"), neither served stale nor refused."""
    kv = _CoarseNoXattrStore(path=str(tmp_path / "arr"))
    m = build_metadata("zarr3", shape=[1], dtype="float32", chunks=[1])
    a = open_sync({"driver": "zarr3", "kvstore": kv, "metadata": m}, create=True,
                  cache_pool=CachePool(1 << 20))
    write(a, np.array([1.5], np.float32))
    assert read(a).tolist() == [1.5]  # now in the cache
    st1 = os.stat(tmp_path / "arr" / "c" / "0")
    _same_stamp_rewrite(kv, tmp_path / "arr", "c/0", st1)
    new = np.frombuffer((tmp_path / "arr" / "c" / "0").read_bytes(), np.float32)
    assert new.tolist() != [1.5]
    assert read(a).tobytes() == new.tobytes()


def test_mtime_probe_on_this_filesystem(tmp_path: Path) -> None:
    """The probe sets an mtime with nanosecond digits and reads it back (ext4,
    tmpfs, xfs keep it), and leaves no scratch file behind."""
    meta = tmp_path / META_DIR
    assert file_mod.probe_fine_mtime(str(meta)) is True
    assert os.listdir(meta) == []
    # a folder that can not be written proves nothing: treated as coarse
    (tmp_path / "file").write_bytes(b"")
    assert file_mod.probe_fine_mtime(str(tmp_path / "file" / META_DIR)) is False


def test_files_of_other_tools_use_the_stat_stamp(tmp_path: Path) -> None:
    """A file without our token (written by zarr-python, cp, ...) has the stat
    stamp as generation; compare-and-swap against it works and tags the file."""
    (tmp_path / "ext").write_bytes(b"external")
    kv = FileKvStore(path=str(tmp_path))
    g = kv.read("ext").result().generation
    assert len(g.token) == 32
    assert kv.read("ext", if_not_equal=g).result().state == "unchanged"
    g2 = kv.write("ext", b"ours", if_equal=g).result()
    assert len(g2.token) == 32 + 16
    assert (tmp_path / "ext").read_bytes() == b"ours"


# -- temporaries of crashed writers (issue 10 item 13, file side) ----------------------
_CRASH_CHILD = """
import os, signal, sys
import tensorstore_py as tsp
from tensorstore_py.kvstore.file import FileKvStore
root, mode = sys.argv[1], sys.argv[2]
kv = FileKvStore(path=root)
real_unlink, real_rename = os.unlink, os.rename
def die(*a, **k):
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "after-link":      # the key is linked, its temporary not yet unlinked
    os.unlink = lambda p, *a, **k: die() if p.endswith(".tmp") else real_unlink(p, *a, **k)
    kv.write("d/created", b"x" * 100_000, if_equal=tsp.Generation.NO_VALUE).result()
else:                          # the temporary is written, not yet renamed
    os.rename = die
    kv.write("d/existing", b"never lands").result()
"""


def _crash(root: Path, mode: str) -> None:
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", _CRASH_CHILD, str(root), mode], timeout=120)
    assert p.returncode == -9


def test_sweep_temporaries_of_crashed_writers(tmp_path: Path) -> None:
    import time

    kv = FileKvStore(path=str(tmp_path))
    kv.write("d/existing", b"committed").result()
    _crash(tmp_path, "after-link")
    _crash(tmp_path, "before-rename")
    created = tmp_path / "d" / "created"
    assert created.read_bytes() == b"x" * 100_000
    assert os.stat(created).st_nlink == 2  # the crash left a second link in .__tsp__
    temps = sorted(f"d/{META_DIR}/{n}" for n in os.listdir(tmp_path / "d" / META_DIR) if n.endswith(".tmp"))
    assert len(temps) == 2
    assert kv.list().result() == ["d/created", "d/existing"]  # hidden from list

    time.sleep(0.3)
    assert kv.sweep_temporaries(3600).result() == []  # younger than the grace
    assert kv.sweep_temporaries(0.2).result() == temps  # dry run: found, kept
    assert len(os.listdir(tmp_path / "d" / META_DIR)) == 3  # + the lock file
    assert kv.sweep_temporaries(0.2, dry_run=False).result() == temps
    assert sorted(os.listdir(tmp_path / "d" / META_DIR)) == ["lock"]
    assert os.stat(created).st_nlink == 1
    assert created.read_bytes() == b"x" * 100_000
    assert bytes(kv.read("d/existing").result().value) == b"committed"
    assert kv.sweep_temporaries(0, dry_run=False).result() == []
    assert FileKvStore(path=str(tmp_path / "nowhere")).sweep_temporaries(0).result() == []


def test_sweep_temporaries_arguments(tmp_path: Path) -> None:
    kv = FileKvStore(path=str(tmp_path))
    for bad in (-1, float("nan"), "1h", None, True):
        with pytest.raises(tsp.errors.InvalidArgumentError, match="older_than"):
            kv.sweep_temporaries(bad)  # type: ignore[arg-type]
    with pytest.raises(tsp.errors.InvalidArgumentError, match="dry_run"):
        kv.sweep_temporaries(1, dry_run="no")  # type: ignore[arg-type]


# -- batched unconditional writes (many small chunks) -----------------------------------
def test_write_many_lands_every_value_with_a_generation_of_its_own(tmp_path: Path) -> None:
    kv = FileKvStore(path=str(tmp_path))
    first = {f"d/{i}": bytes([i]) * 100 for i in range(8)} | {"e/x": b"e"}
    kv._write_many_blocking([(kv.path + k, v) for k, v in first.items()])
    got = {k: kv.read(k).result() for k in first}
    assert {k: bytes(r.value) for k, r in got.items()} == first
    assert len({r.generation for r in got.values()}) == len(first)
    assert sorted(os.listdir(tmp_path / "d" / META_DIR)) == ["lock"]  # no temporary left
    kv._write_many_blocking([(kv.path + k, v + b"!") for k, v in first.items()])  # overwrite
    for k, r in got.items():
        assert bytes(kv.read(k).result().value) == first[k] + b"!"
        with pytest.raises(tsp.ConditionFailedError):  # a new generation for every key
            kv.write(k, b"lost", if_equal=r.generation).result()


def test_write_many_stops_at_a_folder_where_a_key_should_be(tmp_path: Path) -> None:
    kv = FileKvStore(path=str(tmp_path))
    (tmp_path / "d" / "3").mkdir(parents=True)
    with pytest.raises(tsp.StorageError, match="'.*d/3' is a directory"):
        kv._write_many_blocking([(kv.path + f"d/{i}", b"v%d" % i) for i in range(6)])
    assert [(tmp_path / "d" / str(i)).read_bytes() for i in range(3)] == [b"v0", b"v1", b"v2"]
    assert not (tmp_path / "d" / "4").exists() and not (tmp_path / "d" / "5").exists()
    assert sorted(os.listdir(tmp_path / "d" / META_DIR)) == ["lock"]  # the unrenamed ones removed


class _FolderVanishesOnce(FileKvStore):
    """A concurrent delete_range removes the folder during the first batch."""

    vanished = False

    def _write_group(self, d: str, group: list) -> None:
        if not self.vanished:
            type(self).vanished = True
            raise FileNotFoundError(2, "No such file or directory", d)
        super()._write_group(d, group)


def test_write_many_falls_back_to_one_by_one_when_the_folder_vanishes(tmp_path: Path) -> None:
    kv = _FolderVanishesOnce(path=str(tmp_path))
    kv._write_many_blocking([(kv.path + f"d/{i}", b"v%d" % i) for i in range(4)])
    assert kv.vanished and [bytes(kv.read(f"d/{i}").result().value) for i in range(4)] == [
        b"v0", b"v1", b"v2", b"v3"]


_BATCH_WRITER = """
import sys, numpy as np, tensorstore_py as tsp
a = tsp.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": sys.argv[1], "sync": False}},
             create=True, dtype="uint32", shape=(512, 512), chunks=(32, 32)).result()
print("ready", flush=True)
r = 1
while True:
    a.write(np.full((512, 512), r, np.uint32)).result()
    r += 1
"""


def test_a_writer_killed_during_batched_writes_leaves_only_whole_chunks(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys
    import time

    import numpy as np

    p = subprocess.Popen([sys.executable, "-c", _BATCH_WRITER, str(tmp_path) + "/"], stdout=subprocess.PIPE)
    try:
        assert p.stdout is not None and p.stdout.readline() == b"ready\n"
        time.sleep(1.5)
        p.send_signal(signal.SIGKILL)
    finally:
        p.wait(timeout=60)
    chunks = [f for f in (tmp_path / "c").rglob("*") if f.is_file() and META_DIR not in f.parts]
    assert len(chunks) == 256
    rounds = set()
    for f in chunks:
        v = np.frombuffer(f.read_bytes(), np.uint32)
        assert v.size == 32 * 32 and (v == v[0]).all(), f  # every chunk whole, from one round
        rounds.add(int(v[0]))
    assert len(rounds) <= 2 and min(rounds) >= 1  # the round in flight and the one before
    kv = FileKvStore(path=str(tmp_path))
    kv.sweep_temporaries(0, dry_run=False).result()
    assert not [f for f in (tmp_path / "c").rglob("*.tmp")]
