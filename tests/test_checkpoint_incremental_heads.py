"""Incremental saves: a chunk whose head changed is written without waiting for hashing.

Each chunk larger than 64 KiB gets, besides its digest, the digest of its first
64 KiB (its head) in the step's digests document. A save of new arrays compares
heads first: a chunk whose head differs from the previous step's is written at
once, not after the hashing queue (every other chunk's whole digest) and its own
digest; a chunk whose head is equal is hashed whole and linked only when the
whole digests are equal (a head is a hint, never a reason to link).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import xxhash

import tensorstore_py as tsp
from tensorstore_py.commands import checks
from tensorstore_py.core.future import run_sync
from tensorstore_py.core.pools import Concurrency, cpu_pool
from tensorstore_py.kvstore.file import FileKvStore
from tensorstore_py.kvstore.versioned import VersionedKvStore

T = 60
SHAPE = (256, 1024)  # float32: 1 MiB per leaf, one chunk, hashed on the CPU pool
LEAVES = 6


def leaf(i: int, version: int = 0) -> np.ndarray:
    return np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE) + 1000.0 * i + 0.5 * version


def chunk_objects(kv: VersionedKvStore, step: int) -> dict[str, str | None]:
    pre = f"{step:012d}/"
    return {e.key[len(pre):]: e.object for e in kv.entries(pre).result(T) if "/c/" in e.key}


def digests_doc(kv: VersionedKvStore, step: int) -> dict:
    return json.loads(bytes(kv.read(f"{step:012d}/digests/000000.json").result(T).value))


def leaf_keys(kv: VersionedKvStore, step: int) -> dict[str, str]:
    doc = json.loads(bytes(kv.read(f"{step:012d}/manifest.json").result(T).value))
    return {e["path"]: e["key"] for e in doc["leaves"]}


def chunk(keys: dict[str, str], name: str) -> str:
    """The key of leaf ``name``'s one chunk (relative to its step)."""
    return keys[f"['{name}']"] + "/c/0/0"


def verify_ok(url: str) -> None:
    report = run_sync(checks.verify(url))
    assert report.ok, "\n".join(p.message for p in report.problems)


class BlockedCpuPool:
    """Every thread of the CPU pool (where whole chunks are hashed) busy until released."""

    def __enter__(self) -> BlockedCpuPool:
        n = Concurrency.default().cpu
        self.release = threading.Event()
        started = threading.Barrier(n + 1)

        def hold() -> None:
            started.wait()
            self.release.wait(T)

        self.futures = [cpu_pool().submit(hold) for _ in range(n)]
        started.wait(T)
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        for f in self.futures:
            f.result(T)


def data_objects(root: Path) -> set[str]:
    """The versioned store's data objects on disk (its housekeeping folder left out)."""
    return {f"data/{p.name}" for p in (root / "data").iterdir() if p.is_file()}


def test_a_chunk_whose_head_changed_is_written_while_hashing_waits(tmp_path: Path) -> None:
    root = tmp_path / "run"
    mgr = tsp.CheckpointManager(f"file://{root}/")
    mgr.save(1, {f"w{i}": leaf(i) for i in range(LEAVES)}).result(T)
    before = data_objects(root)
    # step 2: new arrays; the last leaf changed, the others equal step 1's values
    state = {f"w{i}": leaf(i, version=int(i == LEAVES - 1)) for i in range(LEAVES)}
    with BlockedCpuPool():
        fut = mgr.save(2, state)
        deadline = time.monotonic() + 5
        while not data_objects(root) - before:
            assert time.monotonic() < deadline, "the changed chunk waited for the hashing of the others"
            time.sleep(0.01)
        written_early = sorted(data_objects(root) - before)
        assert not fut.done()  # the unchanged chunks are still to be hashed
    fut.result(T)
    # the changed chunk's object, then the commit's small values (manifest, digests, record)
    written = sorted(data_objects(root) - before)
    assert len(written_early) == 1 and len(written) == 2, written
    kv = VersionedKvStore(FileKvStore(path=str(root)))
    one, two = chunk_objects(kv, 1), chunk_objects(kv, 2)
    k1, k2 = leaf_keys(kv, 1), leaf_keys(kv, 2)
    changed = chunk(k2, f"w{LEAVES - 1}")
    assert two[changed] == written_early[0]
    for i in range(LEAVES - 1):
        assert two[chunk(k2, f"w{i}")] == one[chunk(k1, f"w{i}")]  # linked
    # the digests document: every chunk's digest and head, of the bytes stored
    doc = digests_doc(kv, 2)
    assert doc["head_bytes"] == 64 << 10
    for i in range(LEAVES):
        raw = state[f"w{i}"].tobytes()
        key = chunk(k2, f"w{i}")
        assert doc["chunks"][key] == xxhash.xxh3_128_hexdigest(raw)
        assert doc["heads"][key] == xxhash.xxh3_128_hexdigest(raw[: 64 << 10])
    got = mgr.restore(2)
    for name, want in state.items():
        np.testing.assert_array_equal(got[name], want)
    verify_ok(f"file://{root}/")


def test_a_chunk_changed_past_its_head_is_written_not_linked(tmp_path: Path) -> None:
    # equal heads never link: the whole digest decides
    root = tmp_path / "run"
    url = f"file://{root}/"
    mgr = tsp.CheckpointManager(url)
    mgr.save(1, {"a": leaf(0), "b": leaf(1)}).result(T)
    b = leaf(1)
    b[-1, -1] += 1.0  # the last bytes: the head (first 64 KiB) is unchanged
    mgr.save(2, {"a": leaf(0), "b": b}).result(T)
    kv = VersionedKvStore(FileKvStore(path=str(root)))
    one, two = chunk_objects(kv, 1), chunk_objects(kv, 2)
    k1, k2 = leaf_keys(kv, 1), leaf_keys(kv, 2)
    assert two[chunk(k2, "a")] == one[chunk(k1, "a")]
    assert two[chunk(k2, "b")] != one[chunk(k1, "b")]
    d1, d2 = digests_doc(kv, 1), digests_doc(kv, 2)
    bkey = chunk(k2, "b")
    assert d2["heads"][bkey] == d1["heads"][chunk(k1, "b")]
    assert d2["chunks"][bkey] == xxhash.xxh3_128_hexdigest(b.tobytes()) != d1["chunks"][chunk(k1, "b")]
    got = mgr.restore(2)
    np.testing.assert_array_equal(got["a"], leaf(0))
    np.testing.assert_array_equal(got["b"], b)
    verify_ok(url)


def test_wrong_heads_only_cost_writes(tmp_path: Path) -> None:
    # a previous step whose recorded heads are all wrong: every chunk is written
    # (none is linked on a head), and the step restores exactly
    root = tmp_path / "run"
    url = f"file://{root}/"
    mgr = tsp.CheckpointManager(url)
    mgr.save(1, {"a": leaf(0), "b": leaf(1)}).result(T)
    kv = VersionedKvStore(FileKvStore(path=str(root)))
    doc = digests_doc(kv, 1)
    doc["heads"] = {k: "0" * 32 for k in doc["heads"]}
    kv.write(f"{1:012d}/digests/000000.json", json.dumps(doc).encode()).result(T)
    state = {"a": leaf(0), "b": leaf(1, version=1)}
    mgr.save(2, state).result(T)
    kv = VersionedKvStore(FileKvStore(path=str(root)))
    one, two = chunk_objects(kv, 1), chunk_objects(kv, 2)
    assert not set(one.values()) & set(two.values())
    got = mgr.restore(2)
    for name, want in state.items():
        np.testing.assert_array_equal(got[name], want)
    head = digests_doc(kv, 2)["heads"][chunk(leaf_keys(kv, 2), "a")]
    assert head == xxhash.xxh3_128_hexdigest(leaf(0).tobytes()[: 64 << 10])
