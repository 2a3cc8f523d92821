"""The CLI over packed small leaves (checkpoint/packing.py): ``export`` and
``verify`` read each pack once, ``info`` describes packed leaves from the
manifest alone, ``verify`` names a key planted in a packed leaf's folder.

Requests are counted by the fault store wrapped around the checkpoint's base
store (``fault+file://``): the store the CLI opens is the real one, only
seen through the counting wrapper."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tensorstore_py as tsp
from tensorstore_py.cli import main
from tensorstore_py.commands import target as target_mod
from tensorstore_py.kvstore.fault import FaultKvStore

N_LEAVES = 400


def _tree(n: int = N_LEAVES) -> dict[str, Any]:
    rng = np.random.default_rng(3)
    return {f"l{i:04d}": rng.integers(0, 1 << 30, size=(64,), dtype=np.int32) for i in range(n)}


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[FaultKvStore]:
    """The fault stores the CLI opens (``fault+`` URLs), to read their counters."""
    opened: list[FaultKvStore] = []
    real = target_mod.open_url

    async def open_url(url: str) -> Any:
        kv = await real(url)
        if isinstance(kv, FaultKvStore):
            opened.append(kv)
        return kv

    monkeypatch.setattr(target_mod, "open_url", open_url)
    return opened


def _saved(tmp_path: Path, tree: dict[str, Any]) -> str:
    root = f"file://{tmp_path}/ckpt/"
    tsp.checkpoint.save(root, tree, step=5).result()
    keys = tsp.KvStore.open(f"versioned+{root}").result().list("000000000005/").result()
    assert not [k for k in keys if k.startswith("000000000005/a/")]  # every leaf is packed
    return root


def test_export_reads_each_pack_once_not_each_leaf(tmp_path: Path, counted: list[FaultKvStore]) -> None:
    tree = _tree()
    root = _saved(tmp_path, tree)
    dest = tmp_path / "out"
    assert main(["export", f"fault+{root}", "--step", "5", str(dest)]) == 0
    (kv,) = counted
    assert kv.calls["read"] < 40, kv.calls  # per-leaf reads: > N_LEAVES
    assert kv.calls["list"] < 10, kv.calls
    zarr = pytest.importorskip("zarr")
    for name in ("l0000", "l0123", f"l{N_LEAVES - 1:04d}"):
        np.testing.assert_array_equal(zarr.open_array(str(dest), path=name, mode="r")[...], tree[name])
        assert (dest / name / "c" / "0").read_bytes() == tree[name].astype("<i4").tobytes()


def test_info_describes_packed_leaves_reading_nothing_per_leaf(
    tmp_path: Path, counted: list[FaultKvStore], capsys: pytest.CaptureFixture[str]
) -> None:
    root = _saved(tmp_path, _tree())
    assert main(["info", f"fault+{root}", "--json"]) == 0
    (kv,) = counted
    assert kv.calls["read"] < 30, kv.calls  # per-leaf: one pack read (and zarr.json probes) each
    rows = {r["path"]: r for r in json.loads(capsys.readouterr().out)["arrays"]}
    assert len(rows) == N_LEAVES
    row = rows["['l0007']"]
    assert (row["shape"], row["dtype"], row["chunk_shape"], row["nbytes"], row["stored_bytes"]) == (
        [64], "int32", [64], 256, 256)
    assert row["codecs"] == ["bytes"] and row["shard_shape"] is None and row["key"] == "a/7"


def test_info_of_a_packed_leaf_matches_the_opened_array(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the row from the manifest says what opening the leaf shows
    tree = {"w": np.arange(20, dtype=np.float32).reshape(4, 5), "b": np.int16(-3)}
    root = _saved(tmp_path, tree)
    assert main(["info", root, "--json"]) == 0
    rows = {r["path"]: r for r in json.loads(capsys.readouterr().out)["arrays"]}
    for path, want in tree.items():
        ts = tsp.checkpoint.open_array(root, f"['{path}']").result()
        row = rows[f"['{path}']"]
        assert row["shape"] == list(ts.shape) == list(np.shape(want))
        assert row["dtype"] == str(ts.dtype) and row["chunk_shape"] == list(ts.chunks)
        assert row["nbytes"] == ts.nbytes == row["stored_bytes"] and row["compression_ratio"] == 1.0


def test_verify_reads_each_pack_once(tmp_path: Path, counted: list[FaultKvStore],
                                     capsys: pytest.CaptureFixture[str]) -> None:
    root = _saved(tmp_path, _tree())
    assert main(["verify", f"fault+{root}", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["problems"] == [] and report["arrays"] == N_LEAVES
    (kv,) = counted
    # the store walk reads every object once; the packed leaves add one read per pack
    walk = report["objects"]
    assert kv.calls["read"] < walk + 40, (kv.calls, walk)


def test_verify_names_a_stray_chunk_key_under_a_packed_leaf(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tree = {"a": np.arange(10, dtype=np.int64), "b": np.arange(10, 20, dtype=np.int64)}
    root = _saved(tmp_path, tree)
    # a leaf's chunk key (as if written by a save with packing off) in packed leaf b's folder
    vs = tsp.KvStore.open(f"versioned+{root}").result()
    stray = "000000000005/a/1/c/0"
    vs.write(stray, np.arange(10, dtype=np.int64).tobytes()).result()
    assert main(["verify", root, "--json"]) != 0
    report = json.loads(capsys.readouterr().out)
    found = [p for p in report["problems"] if p.get("key") == stray]
    assert len(found) == 1 and found[0]["kind"] == "stray", report["problems"]
    assert stray in found[0]["message"] and "['b']" in found[0]["message"]
    assert len(report["problems"]) == 1, report["problems"]
    # the packed leaves themselves still read back exactly
    np.testing.assert_array_equal(tsp.checkpoint.restore(root, step=5)["b"], tree["b"])
    assert main(["verify", root]) != 0
    assert stray in capsys.readouterr().out


def test_verify_names_keys_outside_the_grid_of_a_leaf_with_chunks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the sibling of a stray key under a packed leaf: a leaf with chunk keys of its own
    # (100 KB: not packed) holds a key beyond its grid and one that is no chunk key
    tree = {"big": np.arange(25_000, dtype=np.float32), "small": np.arange(4, dtype=np.int8)}
    root = _saved_with_chunks(tmp_path, tree)
    assert main(["verify", root, "--json"]) == 0
    capsys.readouterr()
    vs = tsp.KvStore.open(f"versioned+{root}").result()
    leaf_keys = [k for k in vs.list("000000000005/a/").result()]
    assert leaf_keys == ["000000000005/a/0/c/0"], leaf_keys  # big is leaf 0, one chunk
    planted = ["000000000005/a/0/c/1", "000000000005/a/0/notes.txt"]
    for k in planted:
        vs.write(k, b"\0" * 100_000).result()
    assert main(["verify", root, "--json"]) != 0
    problems = json.loads(capsys.readouterr().out)["problems"]
    assert sorted(p["key"] for p in problems) == planted, problems
    assert all(p["kind"] == "stray" and "['big']" in p["message"] and p["key"] in p["message"]
               for p in problems), problems
    np.testing.assert_array_equal(tsp.checkpoint.restore(root, step=5)["big"], tree["big"])


def _saved_with_chunks(tmp_path: Path, tree: dict[str, Any]) -> str:
    root = f"file://{tmp_path}/ckpt/"
    tsp.checkpoint.save(root, tree, step=5).result()
    return root
