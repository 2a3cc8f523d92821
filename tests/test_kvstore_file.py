"""The file store against the kvstore conformance suite, plus file-specific checks."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest

import tensorstore_py as tsp
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
