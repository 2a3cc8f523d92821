"""Orbax checkpoints written by orbax-checkpoint itself, restored by tensorstore_py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("orbax.checkpoint")
pytest.importorskip("tensorstore")

import tensorstore_py as tsp
from tensorstore_py.cli import main
from tensorstore_py.core.errors import UnsupportedError

WORKER = str(Path(__file__).with_name("orbax_worker.py"))
pytestmark = pytest.mark.timeout(300)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(n: int, root: Path) -> list[dict]:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    port = str(_free_port())
    outs = [root / f"out-{i}.json" for i in range(n)]
    procs = [subprocess.Popen([sys.executable, WORKER, str(i), str(n), port, str(root / "ckpt"), str(outs[i])],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for i in range(n)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=240)[0].decode(errors="replace"))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for p, log in zip(procs, logs):
        assert p.returncode == 0, f"worker failed ({p.returncode}):\n{log[-4000:]}"
    return [json.loads(o.read_text()) for o in outs]


def test_single_process_orbax_checkpoints_restore_bit_for_bit(tmp_path: Path) -> None:
    (report,) = _run(1, tmp_path)
    assert report["steps"] == [2, 3]  # CheckpointManager(max_to_keep=2) kept the newest two
    assert report["bytes_needed"] == 16 * 8 * 4 + 8 * 16 * 2 + 24 * 6 * 4 + 9 * 8 + 8
    assert report["st_bytes_read"] == report["st_bytes_needed"] == report["st_bytes_total"]
    # convert the run into a checkpoint root: one commit per step, resumable
    ck = tmp_path / "ckpt"
    assert main(["convert", str(ck / "run"), str(tmp_path / "tsp")]) == 0
    mgr = tsp.CheckpointManager(f"file://{tmp_path}/tsp/")
    assert mgr.all_steps() == [2, 3]
    back = mgr.restore(2)
    plain = tsp.checkpoint.restore(str(ck / "run"), step=2)
    assert back["step"] == plain["step"] == 7
    for a, b in ((back["params"]["w"], plain["params"]["w"]), (back["odd"], plain["odd"]),
                 (back["params"]["e"], plain["params"]["e"])):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    assert main(["convert", str(ck / "run"), str(tmp_path / "tsp"), "--json"]) == 0


@pytest.mark.slow
def test_two_process_orbax_checkpoints_restore_in_another_sharding(tmp_path: Path) -> None:
    reports = _run(2, tmp_path)
    for r in reports:
        assert r["devices"] == 8 and r["steps"] == [2, 3]
        # rows split across the processes: each needs half of each sharded array
        assert r["bytes_needed"] < 16 * 8 * 4 + 8 * 16 * 2 + 24 * 6 * 4 + 9 * 8 + 8
        # safetensors: each process needs, and reads, half of every tensor
        assert r["st_bytes_needed"] * 2 == r["st_bytes_total"]
        assert r["st_bytes_needed"] <= r["st_bytes_read"] <= 1.1 * r["st_bytes_needed"]
    print(reports)


def test_unsupported_orbax_items_are_named(tmp_path: Path) -> None:
    step = tmp_path / "5"
    step.mkdir()
    (step / "_CHECKPOINT_METADATA").write_text(json.dumps(
        {"item_handlers": {"state": "orbax.checkpoint._src.handlers.json_checkpoint_handler.JsonCheckpointHandler"}}))
    with pytest.raises(UnsupportedError, match="item 'state' was written by JsonCheckpointHandler"):
        tsp.checkpoint.restore(str(step))
    with pytest.raises(UnsupportedError, match="JsonCheckpointHandler"):
        tsp.CheckpointManager(str(tmp_path)).restore()
    item = tmp_path / "item"
    item.mkdir()
    (item / "_METADATA").write_text(json.dumps({"tree_metadata": {"('x',)": {
        "key_metadata": [{"key": "x", "key_type": 2}],
        "value_metadata": {"value_type": "my.CustomThing", "skip_deserialize": False}}}, "use_ocdbt": True}))
    with pytest.raises(UnsupportedError, match="leaf x was written by a custom Orbax type handler"):
        tsp.checkpoint.restore(str(item))
    assert np.int64(1) == 1


def test_empty_containers_of_an_orbax_tree_belong_to_the_restored_tree(tmp_path: Path) -> None:
    """Each empty list and dict of an Orbax tree is a new object in each restored tree:
    changing one restored tree changes neither its other leaves nor the next restore."""
    item = tmp_path / "item"
    item.mkdir()
    leaves = {("a",): "List", ("b", "c"): "List", ("d",): "Dict", ("e",): "Dict"}
    (item / "_METADATA").write_text(json.dumps({"tree_metadata": {
        str(keys): {"key_metadata": [{"key": k, "key_type": 2} for k in keys],
                    "value_metadata": {"value_type": vt, "skip_deserialize": False}}
        for keys, vt in leaves.items()}, "use_ocdbt": True}))
    first = tsp.checkpoint.restore(str(item))
    assert first == {"a": [], "b": {"c": []}, "d": {}, "e": {}}
    first["a"].append(1)
    first["d"]["k"] = 2
    assert first == {"a": [1], "b": {"c": []}, "d": {"k": 2}, "e": {}}
    assert tsp.checkpoint.restore(str(item)) == {"a": [], "b": {"c": []}, "d": {}, "e": {}}


def test_cli_lists_describes_and_prints_orbax_steps(tmp_path: Path, capsys) -> None:
    (tmp_path / "x").mkdir()
    script = (
        "import numpy as np, orbax.checkpoint as ocp\n"
        "tree = {'params': {'w': np.arange(12, dtype=np.float32).reshape(3, 4)}, 'n': np.arange(3)}\n"
        f"m = ocp.CheckpointManager({str(tmp_path / 'run')!r})\n"
        "for s in (4, 9):\n"
        "    m.save(s, args=ocp.args.StandardSave(tree))\n"
        "m.wait_until_finished(); m.close()\n"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, capture_output=True, timeout=240)
    run = str(tmp_path / "run")
    capsys.readouterr()
    assert main(["ls", run, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kind"] == "orbax run" and [s["step"] for s in data["steps"]] == [4, 9]
    assert all(s["items"] == ["default"] for s in data["steps"])
    assert main(["info", run, "--step", "4", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["step"] == 4
    assert {(a["path"], tuple(a["shape"]), a["dtype"]) for a in info["arrays"]} == {
        ("['params']['w']", (3, 4), "float32"), ("['n']", (3,), "int64")}
    assert main(["cat", run, "params.w", "--index", "[1:3, 2]", "--out", str(tmp_path / "x" / "w.npy")]) == 0
    np.testing.assert_array_equal(np.load(tmp_path / "x" / "w.npy"), np.array([6.0, 10.0], np.float32))
    assert main(["cat", run, "['params']['nope']"]) == 1
    assert "no Orbax array" in capsys.readouterr().err


def test_orbax_step_on_s3(tmp_path: Path, s3_server) -> None:
    script = (
        "import numpy as np, orbax.checkpoint as ocp\n"
        "c = ocp.StandardCheckpointer()\n"
        f"c.save({str(tmp_path / 'std')!r}, {{'w': np.arange(6, dtype=np.float32), 'k': np.int32(3) * np.ones((2, 2), np.int32)}})\n"
        "c.wait_until_finished()\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"},
                   capture_output=True, timeout=240)
    bucket = s3_server.create_bucket()
    kv = tsp.KvStore.open(s3_server.spec(bucket, path="run/7/")).result()
    for f in (tmp_path / "std").rglob("*"):
        if f.is_file():
            kv.write(str(f.relative_to(tmp_path / "std")), f.read_bytes()).result()
    out = tsp.checkpoint.restore(kv)
    assert out["w"].tobytes() == np.arange(6, dtype=np.float32).tobytes()
    assert out["k"].dtype == np.int32 and out["k"].tolist() == [[3, 3], [3, 3]]
    with pytest.raises(UnsupportedError, match="'memory' store"):
        mem = tsp.KvStore.open("memory://orbax/").result()
        for f in (tmp_path / "std").rglob("*"):
            if f.is_file():
                mem.write(str(f.relative_to(tmp_path / "std")), f.read_bytes()).result()
        tsp.checkpoint.restore(mem)
