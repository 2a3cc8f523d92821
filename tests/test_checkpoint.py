"""Checkpoints of numpy pytrees: round trips, the manager, retention, atomicity."""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import tensorstore_py as tsp
from tensorstore_py.checkpoint import ReadStats, SaveOptions
from tensorstore_py.errors import (
    ChecksumError,
    ConditionFailedError,
    InvalidArgumentError,
    NotFoundError,
)

Pair = collections.namedtuple("Pair", "first second")


@dataclasses.dataclass
class Layer:
    kernel: np.ndarray
    bias: np.ndarray


def _tree() -> dict:
    rng = np.random.default_rng(0)
    return {
        "w": rng.standard_normal((64, 33)).astype(np.float32),
        "bf": rng.standard_normal((7, 5)).astype(ml_dtypes.bfloat16),
        "f8": np.arange(12, dtype=np.float32).reshape(3, 4).astype(ml_dtypes.float8_e4m3fn),
        "big": rng.integers(0, 1 << 30, size=(300, 1000), dtype=np.int64),  # 2.4 MB: own object
        "flags": np.array([True, False, True]),
        "c": np.array([1 + 2j, 3 - 4j], dtype=np.complex64),
        "empty": np.zeros((0, 3), np.float32),
        "zero_d": np.array(2.5, dtype=np.float64),
        "np_scalar": np.int16(-7),
        "py": {"i": 3, "f": 0.1, "b": True, "s": "adam", "big_int": 1 << 70, "none": None},
        "seq": [np.ones(2, np.uint8), (np.zeros(1, np.int32), 4.0)],
        "pair": Pair(np.arange(3), np.arange(4.0)),
    }


def _assert_same(a: object, b: object) -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a) == sorted(b), (a, b)
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) or (hasattr(a, "_fields") and hasattr(b, "_fields")), (a, b)
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape, (a, b)
        assert a.tobytes() == b.tobytes()
    elif isinstance(a, np.generic):
        assert type(a) is type(b) and a == b, (a, b)
    else:
        assert type(a) is type(b) and a == b, (a, b)


def _file_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def test_round_trip_every_leaf_kind(tmp_path: Path) -> None:
    tree = _tree()
    info = tsp.checkpoint.save(f"file://{tmp_path}", tree, step=5).result()
    assert info.step == 5 and info.version == 1
    out = tsp.checkpoint.restore(f"file://{tmp_path}")
    _assert_same(tree, out)
    assert out["pair"].first.tolist() == [0, 1, 2] and type(out["pair"]).__name__ == "Pair"
    assert out["w"].flags.writeable


def test_restore_into_target_keeps_classes_and_casts(tmp_path: Path) -> None:
    tree = {"layer": Layer(np.arange(6.0).reshape(2, 3), np.ones(3)), "n": 1}
    root = tsp.KvStore.open("memory://").result()
    tsp.checkpoint.save(root, tree).result()
    # a dataclass without a target comes back as a dict
    plain = tsp.checkpoint.restore(root)
    assert sorted(plain["layer"]) == ["bias", "kernel"]
    target = {"layer": Layer(np.zeros((2, 3), np.float32), np.zeros(3)), "n": 0}
    out = tsp.checkpoint.restore(root, target=target, cast=True)  # float64 -> float32: asked for
    assert isinstance(out["layer"], Layer)
    assert out["layer"].kernel.dtype == np.float32
    assert out["layer"].kernel.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert out["n"] == 1


def test_errors_name_what_is_wrong(tmp_path: Path) -> None:
    root = f"file://{tmp_path}"
    tsp.checkpoint.save(root, {"a": np.ones(4)}, step=1).result()
    with pytest.raises(ConditionFailedError, match="step 1 already exists"):
        tsp.checkpoint.save(root, {"a": np.ones(4)}, step=1)
    with pytest.raises(NotFoundError, match="step 9"):
        tsp.checkpoint.restore(root, step=9)
    with pytest.raises(NotFoundError, match=r"\['b'\]"):
        tsp.checkpoint.restore(root, target={"b": np.ones(4)})
    with pytest.raises(InvalidArgumentError, match=r"shape \(4,\).*\(5,\)"):
        tsp.checkpoint.restore(root, target={"a": np.ones(5)})
    with pytest.raises(InvalidArgumentError, match="unsupported type object"):
        tsp.checkpoint.save(root, {"x": object()}, step=2)
    with pytest.raises(InvalidArgumentError, match="step must be an int"):
        tsp.checkpoint.save(root, {}, step=-1)
    with pytest.raises(NotFoundError, match="no checkpoint steps"):
        tsp.checkpoint.restore(f"file://{tmp_path}/empty")


def test_save_copies_before_returning(tmp_path: Path) -> None:
    a = np.arange(1 << 20, dtype=np.float32)
    mgr = tsp.CheckpointManager(f"file://{tmp_path}")
    fut = mgr.save(1, {"a": a})
    a[:] = -1  # the caller's array may change as soon as save() returns
    mgr.wait_until_finished()
    assert fut.done()
    assert np.array_equal(mgr.restore(1)["a"], np.arange(1 << 20, dtype=np.float32))


def test_manager_retention_frees_space_now(tmp_path: Path) -> None:
    one = {"w": np.random.default_rng(1).standard_normal(1 << 20)}  # 8 MiB per step
    size = 8 << 20
    mgr = tsp.CheckpointManager(f"file://{tmp_path}", max_to_keep=2)
    for step in (10, 20, 30):
        mgr.save(step, {"w": one["w"] + step})
    mgr.wait_until_finished()
    assert mgr.all_steps() == [20, 30]
    assert mgr.latest_step() == 30
    used = _file_bytes(tmp_path)
    assert 2 * size <= used < 2 * size + (256 << 10), used  # 2 steps + small metadata
    np.testing.assert_array_equal(mgr.restore(20)["w"], one["w"] + 20)
    mgr.delete(20)
    assert mgr.all_steps() == [30]
    assert _file_bytes(tmp_path) < size + (256 << 10)
    with pytest.raises(NotFoundError):
        mgr.restore(20)


def test_keep_best_by_metric_and_intervals(tmp_path: Path) -> None:
    mgr = tsp.CheckpointManager(
        f"file://{tmp_path}", max_to_keep=2, best_metric="loss", best_mode="min",
        save_interval_steps=10,
    )
    losses = {0: 5.0, 10: 1.0, 20: 3.0, 30: 0.5, 40: 4.0}
    for step in range(0, 45, 5):
        fut = mgr.save(step, {"x": np.full(3, step)}, metrics={"loss": losses.get(step, 9.0)})
        if step % 10:
            assert fut.result() is None  # off the interval: skipped
    mgr.wait_until_finished()
    # the 2 best (30, 10) plus always the newest (40)
    assert mgr.all_steps() == [10, 30, 40]
    assert mgr.best_step() == 30
    assert mgr.metrics(30) == {"loss": 0.5}
    assert mgr.should_save(50) and not mgr.should_save(45) and not mgr.should_save(30)
    with pytest.raises(InvalidArgumentError, match="loss"):
        mgr.save(50, {"x": np.ones(1)})


def test_restore_reads_only_the_needed_bytes(tmp_path: Path) -> None:
    x = np.arange(1 << 16, dtype=np.float32)
    tsp.checkpoint.save(
        f"file://{tmp_path}", {"x": x, "small": np.ones(10)}, step=0,
        options=SaveOptions(target_chunk_bytes=64 << 10),
    ).result()
    st = ReadStats()
    out = tsp.checkpoint.restore(f"file://{tmp_path}", stats=st)
    np.testing.assert_array_equal(out["x"], x)
    assert st.bytes_read == st.bytes_needed == x.nbytes + 80
    assert 1 <= st.requests <= 5  # four 64 KiB chunks and the small leaf, batched


def test_versions_and_zarr3_leaves_are_visible_to_the_array_layer(tmp_path: Path) -> None:
    x = np.arange(600 * 500, dtype=np.float32).reshape(600, 500)  # >= 1 MiB: has a zarr.json
    mgr = tsp.CheckpointManager(f"file://{tmp_path}")
    mgr.save(4, {"x": x}).result()
    mgr.save(5, {"x": x + 1}).result()
    kv = tsp.KvStore.open({"driver": "versioned", "base": f"file://{tmp_path}/"}).result()
    assert [v.version for v in kv.versions().result()] == [1, 2]  # one commit per step
    arr = tsp.open(
        {"driver": "zarr3", "kvstore": {"driver": "versioned", "base": f"file://{tmp_path}/",
                                         "path": "000000000005/a/0/"}}
    ).result()
    np.testing.assert_array_equal(arr[10:20, 3:7].read().result(), x[10:20, 3:7] + 1)
    # time travel: the root as of version 1 holds step 4 only
    old = tsp.checkpoint.restore(f"versioned+file://{tmp_path}/@1")
    np.testing.assert_array_equal(old["x"], x)
    assert tsp.CheckpointManager(f"versioned+file://{tmp_path}/@1").all_steps() == [4]
    # a leaf under SaveOptions.zarr_metadata_min_bytes is described by the manifest alone
    mgr.save(6, {"x": x[:40]}).result()  # 80,000 bytes
    assert kv.read("000000000006/a/0/zarr.json").result().state == "missing"
    assert kv.read("000000000006/a/0/c/0/0").result().state == "value"
    # one under packing.PACK_LEAF_BYTES (64 KiB) lies in a pack of the step's small leaves
    mgr.save(7, {"x": x[:2], "y": x[2:3]}).result()  # 4,000 and 2,000 bytes
    assert kv.read("000000000007/a/0/c/0/0").result().state == "missing"
    manifest = json.loads(bytes(kv.read("000000000007/manifest.json").result().value))
    assert manifest["format"] == "tensorstore_py.checkpoint.manifest/3"
    packed = [leaf["packed"] for leaf in manifest["leaves"]]
    assert [(p["key"], p["offset"]) for p in packed] == [("p/0", 0), ("p/0", 4000)]
    pack = bytes(kv.read("000000000007/p/0").result().value)
    assert pack == x[:2].tobytes() + x[2:3].tobytes()


def test_numpy_only_without_jax(tmp_path: Path) -> None:
    code = textwrap.dedent(f"""
        import sys
        sys.modules["jax"] = None  # make "import jax" fail
        import numpy as np
        import tensorstore_py as tsp
        mgr = tsp.CheckpointManager("file://{tmp_path}", max_to_keep=1)
        mgr.save(1, {{"a": np.arange(5), "t": (1, 2.5)}}).result()
        out = mgr.restore()
        assert out["a"].tolist() == [0, 1, 2, 3, 4] and out["t"] == (1, 2.5), out
        assert "jax" not in sys.modules or sys.modules["jax"] is None
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


_RSS_SCRIPT = """
import json, sys, time
import numpy as np
import tensorstore_py as tsp
from tensorstore_py.testing.rss import current_rss, peak_rss
n = int(sys.argv[2])
data = {"a": np.random.default_rng(0).standard_normal(n // 8 // 4).reshape(-1, 1024),
        "b": np.ones(n // 8 * 3 // 4, np.uint8) }
data = {"a": np.full(n // 2 // 8, 1.5), "b": np.full(n // 2, 7, np.uint8)}
mgr = tsp.CheckpointManager("file://" + sys.argv[1])
mgr.save(0, {"warm": np.ones(10)}).result()  # load code paths first
base = current_rss()
t = time.perf_counter()
fut = mgr.save(1, data)
returned = time.perf_counter() - t
fut.result()
after_save = peak_rss()
del data
out = mgr.restore(1)
after_restore = peak_rss()
print(json.dumps({"base": base, "save": after_save, "restore": after_restore,
                  "returned": returned, "total": time.perf_counter() - t}))
"""


def test_peak_host_memory_is_about_one_copy(tmp_path: Path) -> None:
    n = 256 << 20
    r = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, str(tmp_path), str(n)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout)
    # the save adds one host copy (n bytes) and a bounded amount in flight, never a multiple
    assert m["save"] - m["base"] < 1.5 * n + (64 << 20), m
    # the restore holds the restored arrays (n bytes), not a second copy of them
    assert m["restore"] - m["base"] < 1.5 * n + (64 << 20), m


def test_kill_mid_save_leaves_previous_step(tmp_path: Path) -> None:
    # a process that dies after writing data but before its commit publishes nothing
    code = textwrap.dedent(f"""
        import os, numpy as np, tensorstore_py as tsp
        from tensorstore_py.kvstore.file import FileKvStore
        mgr = tsp.CheckpointManager("file://{tmp_path}")
        mgr.save(1, {{"a": np.arange(1 << 18)}}).result()
        real = FileKvStore._write_sync
        def dying(self, path, value, if_equal):
            if "/commits/" in path:
                os._exit(9)  # die right before the commit record: all data is written
            return real(self, path, value, if_equal)
        FileKvStore._write_sync = dying
        mgr.save(2, {{"a": np.arange(1 << 18) + 1}}).result()
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 9, r.stderr
    mgr = tsp.CheckpointManager(f"file://{tmp_path}")
    assert mgr.all_steps() == [1]
    np.testing.assert_array_equal(mgr.restore()["a"], np.arange(1 << 18))
    mgr.save(2, {"a": np.zeros(3)}).result()  # the step number is free again
    assert mgr.all_steps() == [1, 2]


def test_lazy_names() -> None:
    assert tsp.CheckpointManager is tsp.checkpoint.CheckpointManager
    assert callable(tsp.checkpoint.save) and callable(tsp.checkpoint.restore)
    assert os.path.basename(tsp.checkpoint.__file__) == "__init__.py"


def test_manager_on_gcs_emulator(gcs_emulator: object) -> None:
    # the gs:// path of the example, on a real fake-gcs-server on 127.0.0.1
    bucket = gcs_emulator.create_bucket()  # type: ignore[attr-defined]
    spec = gcs_emulator.spec(bucket, path="run1/")  # type: ignore[attr-defined]
    root = tsp.KvStore.open(spec).result(60)
    mgr = tsp.CheckpointManager(root, max_to_keep=1)
    x = np.arange(1 << 16, dtype=np.float32).reshape(256, 256)
    for step in (1, 2):
        mgr.save(step, {"x": x + step, "small": np.ones(3)}).result(60)
    assert mgr.all_steps() == [2]
    out = mgr.restore()
    np.testing.assert_array_equal(out["x"], x + 2)
    # step 1's data objects are gone from the bucket, not just unlisted
    objects = root.list("data/").result(60)
    assert len(objects) <= 2, objects


def test_corrupt_chunk_is_detected(tmp_path: Path) -> None:
    x = np.arange(1 << 18, dtype=np.float32)  # 1 MiB: a data object of its own
    tsp.checkpoint.save(f"file://{tmp_path}", {"x": x}).result()
    biggest = max((p for p in (tmp_path / "data").iterdir() if p.is_file()), key=lambda p: p.stat().st_size)
    raw = bytearray(biggest.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    biggest.write_bytes(bytes(raw))
    with pytest.raises(ChecksumError, match="crc32c mismatch"):
        tsp.checkpoint.restore(f"file://{tmp_path}")


def test_tagged_version_survives_retention(tmp_path: Path) -> None:
    x = np.arange(1 << 17, dtype=np.float64)  # 1 MiB
    mgr = tsp.CheckpointManager(f"file://{tmp_path}", max_to_keep=1)
    info = mgr.save(1, {"x": x}).result()
    kv = tsp.KvStore.open({"driver": "versioned", "base": f"file://{tmp_path}/"}).result()
    kv.tag("first", info.version).result()
    mgr.save(2, {"x": x + 1}).result()
    assert mgr.all_steps() == [2]
    # the tagged version still reads back, bytes and all
    old = tsp.checkpoint.restore(f"versioned+file://{tmp_path}/@first")
    np.testing.assert_array_equal(old["x"], x)


def test_chunk_grid_divides_shards_and_spans_are_minimal() -> None:
    from tensorstore_py.checkpoint.layout import chunk_shape_for, chunks_overlapping, span_in_chunk

    # small shards are one chunk; big ones split along leading axes, always dividing the shard
    assert chunk_shape_for((4, 2), 4) == (4, 2)
    assert chunk_shape_for((16384, 16384), 4) == (1024, 16384)  # 64 MiB
    assert chunk_shape_for((3, 3, 1 << 25), 4) == (1, 1, 1 << 24)
    assert chunk_shape_for((), 4) == ()
    for shard in [(1000, 3000), (7, 1 << 24), (6, 5, 4 << 20)]:
        cs = chunk_shape_for(shard, 2, target_bytes=1 << 20)
        assert all(s % c == 0 for s, c in zip(shard, cs)), (shard, cs)
        assert np.prod(cs) * 2 <= 1 << 20 or cs[:-1] == (1,) * (len(cs) - 1)
    # a region crossing chunk borders touches exactly the chunks it overlaps
    got = chunks_overlapping(((2, 6), (0, 4)), (4, 4))
    assert [g for g, _ in got] == [(0, 0), (1, 0)]
    assert got[0][1] == ((2, 4), (0, 4))
    # rows 1..2 of a 4x8 chunk of float32: one contiguous span of 2 rows
    assert span_in_chunk(((1, 3), (0, 8)), (0, 0), (4, 8), 4) == (32, 96)
    # a column block spans from its first to its last element only
    assert span_in_chunk(((0, 4), (2, 3)), (0, 0), (4, 8), 4) == (8, 108)


def test_open_array_slices_one_leaf_of_a_pinned_step(tmp_path):
    url = f"file://{tmp_path}/"
    w = np.arange(600 * 700, dtype="float32").reshape(600, 700)  # >= 1 MiB: has zarr.json
    tsp.checkpoint.save(url, {"p": {"w": w, "b": np.arange(5)}, "n": 3}, step=1).result()
    tsp.checkpoint.save(url, {"p": {"w": w + 1, "b": np.arange(5) * 2}, "n": 4}, step=2).result()
    assert tsp.checkpoint.leaf_paths(url, step=1).result() == ["['p']['b']", "['p']['w']"]
    a = tsp.checkpoint.open_array(url, "['p']['w']", step=1).result()
    assert a.shape == (600, 700) and a.dtype == np.float32
    np.testing.assert_array_equal(a[17, 3:9].read().result(), w[17, 3:9])
    b = tsp.checkpoint.open_array(url, "['p']['b']").result()  # newest step, manifest-only leaf
    np.testing.assert_array_equal(b[::2].read().result(), np.arange(5)[::2] * 2)
    with pytest.raises(tsp.NotFoundError, match="no array leaf"):
        tsp.checkpoint.open_array(url, "['p']['nope']").result()
