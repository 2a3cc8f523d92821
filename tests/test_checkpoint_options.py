"""Checkpoint options a newcomer meets: explicit dtype casts, progress, stores
without create-only writes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import tensorstore_py as tsp
from tensorstore_py.errors import InvalidArgumentError, UnsupportedError

T = 120


@pytest.fixture
def root(tmp_path: Path) -> str:
    url = f"file://{tmp_path}/ckpt/"
    w = (np.arange(24, dtype=np.float32).reshape(4, 6) / 7).astype(ml_dtypes.bfloat16)
    tsp.checkpoint.save(url, {"w": w, "n": np.int16(-3)}, step=0).result(T)
    return url


def test_a_target_of_another_dtype_needs_cast(root: str) -> None:
    stored = tsp.checkpoint.restore(root)["w"]
    assert stored.dtype == ml_dtypes.bfloat16
    target = {"w": np.zeros((4, 6), np.float32)}
    with pytest.raises(InvalidArgumentError, match=r"\['w'\].*bfloat16.*float32.*cast=True"):
        tsp.checkpoint.restore(root, target=target)
    got = tsp.checkpoint.restore(root, target=target, cast=True)
    assert got["w"].dtype == np.float32
    np.testing.assert_array_equal(got["w"], stored.astype(np.float32))
    # a scalar leaf too; the same dtype needs nothing
    with pytest.raises(InvalidArgumentError, match="int16.*int64"):
        tsp.checkpoint.restore(root, target={"n": np.int64(0)})
    assert tsp.checkpoint.restore(root, target={"n": np.int16(0)})["n"] == -3
    mgr = tsp.CheckpointManager(root)
    with pytest.raises(InvalidArgumentError):
        mgr.restore(0, target=target)
    assert mgr.restore(0, target=target, cast=True)["w"].dtype == np.float32


def test_a_jax_target_of_another_dtype_needs_cast(root: str) -> None:
    jax = pytest.importorskip("jax")
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = {"w": jax.ShapeDtypeStruct((4, 6), np.float32, sharding=sharding)}
    with pytest.raises(InvalidArgumentError, match="bfloat16"):
        tsp.checkpoint.restore(root, target=target)
    got = tsp.checkpoint.restore(root, target=target, cast=True)["w"]
    assert got.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(got), tsp.checkpoint.restore(root)["w"].astype(np.float32))


def test_progress_callbacks_count_the_bytes_moved(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/p/"
    tree = {"a": np.ones((512, 1024), np.float32), "b": np.arange(10), "s": "text"}
    calls: list[tuple[int, int | None]] = []
    tsp.checkpoint.save(url, tree, step=3, progress=lambda d, t: calls.append((d, t))).result(T)
    assert calls and calls[-1][0] == calls[-1][1] > 512 * 1024 * 4 + 10 * 8  # + a's zarr.json
    assert len({t for _, t in calls}) == 1  # the total is known from the start
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    stats = tsp.checkpoint.ReadStats()
    read: list[tuple[int, int | None]] = []
    out = tsp.checkpoint.restore(url, stats=stats, progress=lambda d, t: read.append((d, t)))
    np.testing.assert_array_equal(out["a"], tree["a"])
    assert read[-1][0] == read[-1][1] == stats.bytes_read
    with pytest.raises(InvalidArgumentError, match="progress"):
        tsp.checkpoint.restore(url, progress="yes")  # type: ignore[arg-type]


def test_progress_true_prints_one_line_when_stderr_is_not_a_terminal(tmp_path: Path) -> None:
    code = textwrap.dedent(f"""
        import numpy as np
        import tensorstore_py as tsp
        mgr = tsp.CheckpointManager("file://{tmp_path}/q/")
        mgr.save(1, {{"a": np.ones((256, 1024), np.float32)}}, progress=True).result()
        mgr.restore(1, progress=True)
        print("done")
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=T,
                       check=False, env=dict(os.environ))
    assert p.returncode == 0, p.stderr
    lines = p.stderr.splitlines()
    assert len(lines) == 2, p.stderr
    assert lines[0].startswith("checkpoint save of step 1: 1.0 MiB in ")
    assert lines[1].startswith("checkpoint restore: 1.0 MiB in ")


def test_a_store_without_create_only_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    pytest.importorskip("fsspec")
    dst = tmp_path / "fs"
    with pytest.raises(UnsupportedError, match="create-only.*file://"):
        tsp.checkpoint.save(f"local://{dst}/", {"a": np.ones(4)}, step=0)
    assert not dst.exists() or not any(dst.rglob("*"))
