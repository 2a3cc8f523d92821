"""The real ``tensorstore-py`` entry point in subprocesses: corruption, export, HTTP, copy."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tensorstore_py as tsp
from tensorstore_py.core.future import run_sync
from tensorstore_py.kvstore.file import FileKvStore
from tensorstore_py.kvstore.versioned.format import MAGIC_COMMIT, unframe
from tensorstore_py.kvstore.versioned.root import read_hint

T = 120


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(
        [sys.executable, "-m", "tensorstore_py.cli", *args],
        check=False, capture_output=True, text=True, timeout=T, env={**os.environ, **(env or {})},
    )
    assert "Traceback" not in p.stderr, p.stderr
    return p


def tree(step: int) -> dict[str, Any]:
    rng = np.random.default_rng(step)
    return {
        # 512 KiB: stored alone in its own data object
        "w": rng.standard_normal((256, 512)).astype(np.float32),
        "emb": np.arange(6 * 8 * 10, dtype=np.int32).reshape(6, 8, 10) * step,
        "b": np.full(5, step, dtype=np.float64),
    }


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    for s in (1, 2):
        tsp.checkpoint.save(f"file://{root}/", tree(s), step=s).result(T)
    return root


def _newest_root_node(root: Path) -> str:
    name = max((root / "commits").iterdir())
    return str(unframe(MAGIC_COMMIT, name.read_bytes(), name.name)["root"])


def test_entry_point_script(ckpt: Path) -> None:
    exe = shutil.which("tensorstore-py")
    if exe is None:
        pytest.skip("the tensorstore-py console script is not on PATH")
    p = subprocess.run([exe, "verify", str(ckpt)], check=False, capture_output=True, text=True, timeout=T)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.startswith("OK ")
    assert subprocess.run([exe, "verify"], check=False, capture_output=True, timeout=T).returncode == 2


def test_verify_clean_then_flipped_byte(ckpt: Path) -> None:
    p = cli("verify", str(ckpt), "--json")
    assert p.returncode == 0, p.stdout
    rep = json.loads(p.stdout)
    assert rep["ok"] and rep["steps"] == [1, 2] and rep["arrays"] == 6 and rep["problems"] == []
    big = [f for f in (ckpt / "data").iterdir() if f.stat().st_size == 256 * 512 * 4]
    assert len(big) == 2
    victim = big[0]
    data = bytearray(victim.read_bytes())
    data[12345] ^= 0x10
    victim.write_bytes(bytes(data))
    p = cli("verify", str(ckpt))
    assert p.returncode == 1
    assert f"data/{victim.name}" in p.stdout and "crc32c mismatch" in p.stdout
    assert "/a/2/c/0/0" in p.stdout  # the chunk key of leaf "w" (leaves sort: b, emb, w)
    rep = json.loads(cli("verify", str(ckpt), "--json").stdout)
    assert not rep["ok"]
    assert {pr["object"] for pr in rep["problems"] if "object" in pr} == {f"data/{victim.name}"}
    assert rep["problems"][0]["kind"] == "checksum"


def test_verify_deleted_object(ckpt: Path) -> None:
    victim = next(f for f in (ckpt / "data").iterdir() if f.stat().st_size == 256 * 512 * 4)
    victim.unlink()
    p = cli("verify", str(ckpt))
    assert p.returncode == 1
    assert "missing" in p.stdout and f"data/{victim.name}" in p.stdout


def test_verify_truncated_index_node(ckpt: Path) -> None:
    node = ckpt / _newest_root_node(ckpt)
    node.write_bytes(node.read_bytes()[: node.stat().st_size // 2])
    p = cli("verify", str(ckpt))
    assert p.returncode == 1
    assert node.name in p.stdout and "FAILED" in p.stdout


@pytest.mark.parametrize("driver,compression,victim", [
    ("zarr3", "zstd", "c/1/2"), ("zarr", "blosc", "1.2"), ("zarr3", None, "c/1/0"),
])
def test_verify_plain_arrays(tmp_path: Path, driver: str, compression: str | None, victim: str) -> None:
    url = f"file://{tmp_path}/arr/"
    shards = (20, 20) if compression is None else None  # the raw case is sharded
    a = tsp.open(url, create=True, driver=driver, dtype="int32", shape=(40, 60), chunks=(10, 10),
                 shards=shards, compression=compression).result(T)
    a.write(np.arange(2400, dtype=np.int32).reshape(40, 60)).result(T)
    p = cli("verify", url)
    assert p.returncode == 0, p.stdout + p.stderr
    path = tmp_path / "arr" / victim
    path.write_bytes(path.read_bytes()[:-7])
    p = cli("verify", url, "--json")
    assert p.returncode == 1
    rep = json.loads(p.stdout)
    assert [pr["chunk"] for pr in rep["problems"]] == [victim]


def test_cat_exports_exact_values(ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "x.npy"
    p = cli("cat", str(ckpt), "emb", "--index", "[0:10, :, 5]", "--out", str(out), "--step", "1")
    assert p.returncode == 0, p.stderr
    want = tree(1)["emb"][0:10, :, 5]
    got = np.load(out)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)
    p = cli("cat", str(ckpt), "w", "--index", "[3, 0:4]")
    assert p.returncode == 0
    assert "float32 [4]" in p.stdout


def test_read_only_commands_over_http(ckpt: Path, tmp_path: Path, serve_app: Any) -> None:
    from aiohttp import web

    arr = tsp.open(f"file://{tmp_path}/plain/", create=True, dtype="uint16", shape=(30, 30),
                   chunks=(10, 10), compression="zstd").result(T)
    arr.write(np.arange(900, dtype=np.uint16).reshape(30, 30)).result(T)
    app = web.Application()
    app.router.add_static("/data/", tmp_path)
    url = f"{serve_app(app).url}/data/ckpt/"
    ls = json.loads(cli("ls", url, "--json").stdout)
    assert ls["kind"] == "checkpoint" and [s["step"] for s in ls["steps"]] == [1, 2]
    info = json.loads(cli("info", url, "--json").stdout)
    assert {a["path"]: a["shape"] for a in info["arrays"]}["['w']"] == [256, 512]
    p = cli("verify", url, "--all")
    assert p.returncode == 0, p.stdout + p.stderr
    out = tmp_path / "h.npy"
    assert cli("cat", url, "b", "--out", str(out), "--step", "2").returncode == 0
    np.testing.assert_array_equal(np.load(out), tree(2)["b"])
    plain = url.replace("/ckpt/", "/plain/")
    assert cli("verify", plain).returncode == 0
    p = cli("gc", url, "--apply")
    assert p.returncode in (1, 2) and "read-only" in p.stderr


def test_copy_file_to_file(ckpt: Path, tmp_path: Path) -> None:
    dst = tmp_path / "copy"
    p = cli("copy", str(ckpt), str(dst), "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["kind"] == "checkpoint"
    assert cli("verify", str(dst), "--all").returncode == 0
    got = tsp.checkpoint.restore(f"file://{dst}/", step=1)
    np.testing.assert_array_equal(got["w"], tree(1)["w"])
    # never overwrites
    p = cli("copy", str(ckpt), str(dst))
    assert p.returncode == 1 and "already" in p.stderr
    # a corrupt source stops the copy, naming the object
    victim = next(f for f in (ckpt / "data").iterdir() if f.stat().st_size == 256 * 512 * 4)
    data = bytearray(victim.read_bytes())
    data[7] ^= 1
    victim.write_bytes(bytes(data))
    p = cli("copy", str(ckpt), str(tmp_path / "copy2"))
    assert p.returncode == 1 and victim.name in p.stderr


def test_copy_file_to_gcs(ckpt: Path, tmp_path: Path, gcs_emulator: Any) -> None:
    bucket = gcs_emulator.create_bucket()
    env = {"STORAGE_EMULATOR_HOST": gcs_emulator.endpoint}
    dst = f"gs://{bucket}/run1/"
    p = cli("copy", str(ckpt), dst, env=env)
    assert p.returncode == 0, p.stderr
    p = cli("verify", dst, "--json", env=env)
    assert p.returncode == 0, p.stdout
    assert json.loads(p.stdout)["steps"] == [1, 2]
    out = tmp_path / "g.npy"
    assert cli("cat", dst, "w", "--step", "2", "--out", str(out), env=env).returncode == 0
    np.testing.assert_array_equal(np.load(out), tree(2)["w"])
    # a plain array too
    arr = tsp.open(f"file://{tmp_path}/plain/", create=True, driver="zarr", dtype="<f4",
                   shape=(20, 20), chunks=(10, 10), compression="zstd").result(T)
    arr.write(np.ones((20, 20), np.float32)).result(T)
    p = cli("copy", str(tmp_path / "plain"), f"gs://{bucket}/plain/", env=env)
    assert p.returncode == 0, p.stderr
    assert cli("verify", f"gs://{bucket}/plain/", env=env).returncode == 0


_KILLED_WRITER = """
import os, signal, sys
import numpy as np
import tensorstore_py as tsp
from tensorstore_py.kvstore import transaction

def die(self, *a, **k):  # the process dies after writing its data, before the commit point
    os.kill(os.getpid(), signal.SIGKILL)

transaction.Transaction.commit = die
tree = {"x": np.ones((256, 512), np.float32), "y": np.zeros((256, 512), np.float32)}
tsp.checkpoint.save(sys.argv[1], tree, step=3).result(60)
"""


# before ckpt: the claim of its saves would keep the killed writer's young orphans
@pytest.mark.usefixtures("no_writer_linger")
def test_gc_removes_a_killed_writers_orphans(ckpt: Path) -> None:
    before = {f.name for f in (ckpt / "data").iterdir()}
    p = subprocess.run([sys.executable, "-c", _KILLED_WRITER, f"file://{ckpt}/"],
                       check=False, capture_output=True, timeout=T)
    assert p.returncode == -9, p.stderr
    orphans = {f.name for f in (ckpt / "data").iterdir()} - before
    assert len(orphans) >= 2  # the two 512 KiB chunks were written, never committed
    assert json.loads(cli("ls", str(ckpt), "--json").stdout)["steps"][-1]["step"] == 2

    young = json.loads(cli("gc", str(ckpt), "--json").stdout)  # default grace: kept
    assert young["count"] == 0 and young["kept_young"] >= 2 and not young["applied"]
    dry = cli("gc", str(ckpt), "--grace", "0s", "--json")
    assert dry.returncode == 0, dry.stderr
    listed = json.loads(dry.stdout)
    assert {f"data/{n}" for n in orphans} <= set(listed["objects"])
    assert listed["bytes"] >= 2 * 256 * 512 * 4 and not listed["applied"]
    assert orphans <= {f.name for f in (ckpt / "data").iterdir()}  # a dry run deletes nothing
    human = cli("gc", str(ckpt), "--grace", "0s")
    assert "would delete" in human.stdout and "--apply" in human.stdout

    p = cli("gc", str(ckpt), "--grace", "0s", "--apply", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["applied"]
    assert not orphans & {f.name for f in (ckpt / "data").iterdir()}
    assert cli("verify", str(ckpt), "--all").returncode == 0
    for s in (1, 2):
        got = tsp.checkpoint.restore(f"file://{ckpt}/", step=s)
        for k, v in tree(s).items():
            np.testing.assert_array_equal(got[k], v)
    assert json.loads(cli("gc", str(ckpt), "--grace", "0s", "--json").stdout)["count"] == 0
    assert cli("gc", str(ckpt), "--grace", "soon").returncode == 2


_JAX_SAVE = """
import sys
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import tensorstore_py as tsp

mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("x", "y"))
w = jax.device_put(np.arange(8 * 6, dtype=np.float32).reshape(8, 6), NamedSharding(mesh, P("x", None)))
tsp.checkpoint.save(sys.argv[1], {"w": w}, step=7).result(60)
"""


def test_info_shows_saved_sharding(tmp_path: Path) -> None:
    pytest.importorskip("jax")
    url = f"file://{tmp_path}/jx/"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
           "JAX_PLATFORMS": "cpu"}
    p = subprocess.run([sys.executable, "-c", _JAX_SAVE, url], check=False, capture_output=True,
                       text=True, timeout=T, env=env)
    assert p.returncode == 0, p.stderr
    info = json.loads(cli("info", url, "--json").stdout)
    (w,) = info["arrays"]
    assert w["shape"] == [8, 6] and w["chunk_shape"] == [4, 6]  # chunks follow the shards
    assert w["sharding"] == {"mesh": {"x": 2, "y": 2}, "spec": ["x", None]}
    human = cli("info", url).stdout
    assert "P('x', None) on x=2,y=2" in human
    assert cli("verify", url).returncode == 0


# -- verify and gc tell the truth (issue 10, items 11 to 13) ----------------------------------
def _wait_for_hint(root: Path, version: int) -> None:
    """Let the writer's trailing rewrite of the ``latest`` hint land (<= 1 s)."""
    deadline = time.time() + 5
    while time.time() < deadline:
        if run_sync(read_hint(FileKvStore(path=str(root)))) >= version:
            return
        time.sleep(0.05)


def test_verify_fails_when_the_first_or_the_newest_commit_record_is_gone(ckpt: Path, tmp_path: Path) -> None:
    _wait_for_hint(ckpt, 2)
    first, newest = tmp_path / "first", tmp_path / "newest"
    shutil.copytree(ckpt, first)
    shutil.copytree(ckpt, newest)
    (first / "commits" / "00000000000000000001").unlink()
    (newest / "commits" / "00000000000000000002").unlink()  # readers now see version 1 only

    p = cli("verify", str(first))
    assert p.returncode == 1, p.stdout
    assert "commits/00000000000000000001" in p.stdout and "missing" in p.stdout
    rep = json.loads(cli("verify", str(first), "--json").stdout)
    assert rep["kind"] in ("versioned", "checkpoint") and not rep["ok"]
    assert [pr["object"] for pr in rep["problems"]] == ["commits/00000000000000000001"]

    p = cli("verify", str(newest))
    assert p.returncode == 1, p.stdout
    assert "commits/00000000000000000002" in p.stdout and "latest" in p.stdout

    # gc refuses a store with a lost record: everything after it would look unreferenced
    data = {f.name for f in (first / "data").iterdir()}
    p = cli("gc", str(first), "--grace", "0s", "--apply")
    assert p.returncode == 1 and "refusing" in p.stderr, p.stderr
    assert {f.name for f in (first / "data").iterdir()} == data


def test_an_interrupted_first_save_is_a_versioned_store_with_orphans(tmp_path: Path) -> None:
    root = tmp_path / "run"
    p = subprocess.run([sys.executable, "-c", _KILLED_WRITER, f"file://{root}/"],
                       check=False, capture_output=True, timeout=T)
    assert p.returncode == -9, p.stderr
    assert not (root / "commits").exists()
    orphans = {f"data/{f.name}" for f in (root / "data").iterdir() if f.is_file()}
    assert len(orphans) >= 2  # the two 512 KiB chunks

    p = cli("verify", str(root), "--json")
    assert p.returncode == 0, p.stdout + p.stderr  # orphans are not corruption ...
    rep = json.loads(p.stdout)
    assert rep["kind"] == "versioned" and rep["ok"]
    assert rep["unreferenced"]["objects"] >= 2 and rep["unreferenced"]["bytes"] >= 2 * 256 * 512 * 4
    human = cli("verify", str(root))
    assert "no retained version references" in human.stdout  # ... but verify says they are there

    dry = json.loads(cli("gc", str(root), "--grace", "0s", "--json").stdout)
    assert dry["kind"] == "versioned" and dry["newest"] == 0 and not dry["applied"]
    assert orphans <= set(dry["objects"])
    young = json.loads(cli("gc", str(root), "--json").stdout)  # default grace: kept
    assert young["count"] == 0 and young["kept_young"] >= 2
    p = cli("gc", str(root), "--grace", "0s", "--apply", "--json")
    assert p.returncode == 0, p.stderr
    assert orphans <= set(json.loads(p.stdout)["objects"])
    assert not [f for f in (root / "data").iterdir() if f.is_file()]
    # and the root takes its first save now
    tsp.checkpoint.save(f"file://{root}/", tree(1), step=1).result(T)
    assert cli("verify", str(root)).returncode == 0


@pytest.mark.skipif(not hasattr(FileKvStore, "sweep_temporaries"),
                    reason="FileKvStore.sweep_temporaries(older_than, *, dry_run) not in this tree yet")
# before ckpt: the claim of its saves ends LINGER after them
@pytest.mark.usefixtures("no_writer_linger")
def test_gc_lists_and_removes_temporaries_of_crashed_writers(ckpt: Path) -> None:
    meta = ckpt / "data" / ".__tsp__"
    meta.mkdir(exist_ok=True)
    crashed = meta / f"{'ab' * 16}.{'cd' * 16}.tmp"  # a writer died before its rename
    crashed.write_bytes(b"x" * 1000)
    # This process's lease claims a writer until LINGER after its saves (a live
    # writer may own a temporary younger than its start; no WRITER_LINGER here):
    # until then gc keeps it.
    deadline = time.monotonic() + 30
    while True:
        dry = json.loads(cli("gc", str(ckpt), "--grace", "0s", "--json").stdout)
        if [t for t in dry["temporaries"] if crashed.name in t] or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert [t for t in dry["temporaries"] if crashed.name in t], dry["temporaries"]
    assert crashed.exists()
    human = cli("gc", str(ckpt), "--grace", "0s")
    assert "temporary file(s) of crashed writers" in human.stdout
    p = cli("gc", str(ckpt), "--grace", "0s", "--apply", "--json")
    assert p.returncode == 0, p.stderr
    assert not crashed.exists()
    assert cli("verify", str(ckpt), "--all").returncode == 0
