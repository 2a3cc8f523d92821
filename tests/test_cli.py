"""The CLI's command functions and ``main()`` in-process: data, --json shapes, errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tensorstore_py as tsp
from tensorstore_py.cli import main
from tensorstore_py.commands import checks, export, inspect, maintenance
from tensorstore_py.commands.errors import describe
from tensorstore_py.commands.output import format_table, human_size
from tensorstore_py.core.future import spawn
from tensorstore_py.errors import InvalidArgumentError, NotFoundError, StorageError

T = 60


def run(coro: Any) -> Any:
    return spawn(coro).result(T)


def tree(step: int) -> dict[str, Any]:
    return {
        "params": {
            "w": np.arange(64 * 32, dtype=np.float32).reshape(64, 32) * (step + 1),
            "b": np.full(7, step, dtype=np.int16),
        },
        "lr": 0.5,
        # >= 1 MiB: stored with its own zarr.json (smaller leaves live in the manifest only)
        "big": np.full((512, 512), step, dtype=np.float32),
    }


@pytest.fixture
def ckpt(tmp_path: Path) -> str:
    url = f"file://{tmp_path}/ckpt/"
    for s in (1, 2, 3):
        tsp.checkpoint.save(url, tree(s), step=s).result(T)
    return url


def cli_json(capsys: pytest.CaptureFixture[str], *args: str) -> Any:
    code = main([*args, "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out)


# -- formatting --------------------------------------------------------------------------
def test_human_sizes_and_tables() -> None:
    assert human_size(0) == "0 B"
    assert human_size(1023) == "1023 B"
    assert human_size(1536) == "1.5 KiB"
    assert human_size(3 << 30) == "3.0 GiB"
    assert human_size(None) == "-"
    text = format_table(["A", "NUM"], [["x", 1], ["long", 100]], right=[1])
    assert text.splitlines() == ["A     NUM", "----  ---", "x       1", "long  100"]


def test_parse_index_and_duration() -> None:
    assert export.parse_index("[0:10, :, 5]") == (slice(0, 10), slice(None), 5)
    assert export.parse_index("[::2, ..., None, -1]") == (slice(None, None, 2), Ellipsis, None, -1)
    assert export.parse_index("3") == (3,)
    for bad in ("[0:a]", "[__import__('os')]", "[1.5]", "[0:"):
        with pytest.raises(InvalidArgumentError):
            export.parse_index(bad)
    assert maintenance.parse_duration("0s") == 0
    assert maintenance.parse_duration("90") == 90
    assert maintenance.parse_duration("1h30m") == 5400
    assert maintenance.parse_duration("7d") == 7 * 86400
    for bad in ("", "5x", "h", "-1s"):
        with pytest.raises(InvalidArgumentError):
            maintenance.parse_duration(bad)


# -- ls / info / history / diff --------------------------------------------------------------
def test_ls_checkpoint(ckpt: str, capsys: pytest.CaptureFixture[str]) -> None:
    data = run(inspect.ls(ckpt))
    assert data["kind"] == "checkpoint"
    assert [s["step"] for s in data["steps"]] == [1, 2, 3]
    assert [s["version"] for s in data["steps"]] == [1, 2, 3]
    assert all(s["nbytes"] == 64 * 32 * 4 + 7 * 2 + (1 << 20) for s in data["steps"])
    assert all(len(s["write_id"]) == 32 for s in data["steps"])
    assert cli_json(capsys, "ls", ckpt) == json.loads(json.dumps(data))
    assert main(["ls", ckpt]) == 0
    human = capsys.readouterr().out
    assert "STEP" in human and "1.0 MiB" in human and "\x1b[" not in human  # no colour when piped


def test_info_json(ckpt: str, capsys: pytest.CaptureFixture[str]) -> None:
    data = cli_json(capsys, "info", ckpt, "--step", "2")
    assert data["step"] == 2 and data["kind"] == "checkpoint"
    by_path = {a["path"]: a for a in data["arrays"]}
    w = by_path["['params']['w']"]
    assert w["shape"] == [64, 32] and w["dtype"] == "float32" and w["codecs"] == ["bytes"]
    assert w["stored_bytes"] == 64 * 32 * 4 and w["compression_ratio"] == 1.0
    assert by_path["['params']['b']"]["shape"] == [7]
    assert data["scalars"][0]["path"] == "['lr']"
    big = by_path["['big']"]
    assert big["shape"] == [512, 512] and big["stored_bytes"] == 1 << 20
    assert run(checks.verify(ckpt)).ok
    np.testing.assert_array_equal(run(export.cat(ckpt, "big", index="[0:2, 0:2]", step=1)),
                                  np.ones((2, 2), np.float32))
    # the latest step by default
    assert run(inspect.info(ckpt))["step"] == 3


def test_info_plain_arrays(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = tsp.open(f"file://{tmp_path}/vol/em/", create=True, dtype="uint8", shape=(64, 64),
                 chunks=(8, 8), shards=(32, 32), compression="zstd").result(T)
    a.write(np.zeros((64, 64), np.uint8)).result(T)
    b = tsp.open(f"file://{tmp_path}/vol/seg/", create=True, driver="zarr", dtype="<u4",
                 shape=(10, 20), chunks=(5, 5)).result(T)
    b.write(np.arange(200, dtype=np.uint32).reshape(10, 20)).result(T)
    data = cli_json(capsys, "info", str(tmp_path / "vol"))
    assert data["kind"] == "folder"
    by_path = {x["path"]: x for x in data["arrays"]}
    em, seg = by_path["em"], by_path["seg"]
    assert em["shard_shape"] == [32, 32] and em["chunk_shape"] == [8, 8]
    assert em["codecs"] == ["sharding_indexed[bytes,zstd]"]
    assert em["driver"] == "zarr3" and seg["driver"] == "zarr"
    assert seg["shape"] == [10, 20] and seg["dtype"] == "uint32"
    assert seg["stored_bytes"] == 8 * 5 * 5 * 4
    one = cli_json(capsys, "ls", f"file://{tmp_path}/vol/seg")
    assert one["kind"] == "array" and one["arrays"][0]["path"] == ""


def test_history_and_diff(ckpt: str, capsys: pytest.CaptureFixture[str]) -> None:
    h = cli_json(capsys, "history", ckpt)
    assert [c["version"] for c in h["commits"]] == [1, 2, 3]
    assert [c["step"] for c in h["commits"]] == [1, 2, 3]
    d = cli_json(capsys, "diff", ckpt, "1", "2")
    rows = {r["path"]: r for r in d["arrays"]}
    assert rows["['params']['w']"]["status"] == "changed"
    assert rows["['params']['w']"]["chunks_changed"] == ["c/0/0"]
    assert rows["['params']['b']"]["status"] == "changed"
    same = run(inspect.diff(ckpt, 2, 2))
    assert all(r["status"] == "unchanged" for r in same["arrays"])


def test_versioned_store_with_arrays(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = f"file://{tmp_path}/run/"
    kv = {"driver": "versioned", "base": base}
    a = tsp.open({"driver": "zarr3", "kvstore": {**kv, "path": "x/"}}, create=True,
                 dtype="int32", shape=(8, 8), chunks=(4, 4)).result(T)
    head = tsp.KvStore.open(base.replace("file://", "versioned+file://")).result(T)
    a.write(np.arange(64, dtype=np.int32).reshape(8, 8)).result(T)
    v1 = head.newest_version().result(T)
    a[0:4, 0:4] = np.zeros((4, 4), np.int32)
    v2 = head.newest_version().result(T)
    data = cli_json(capsys, "ls", base)
    assert data["kind"] == "versioned"
    assert [v["version"] for v in data["versions"]] == list(range(1, v2 + 1))
    d = run(inspect.diff(base, v1, v2))
    assert d["arrays"] == [{"path": "x", "chunks_added": [], "chunks_removed": ["c/0/0"],
                            "chunks_changed": []}]  # an all-fill chunk is deleted
    old = run(export.cat(f"versioned+{base}@{v1}", "x", index="[0:2, 0:3]"))
    assert old.tolist() == [[0, 1, 2], [8, 9, 10]]
    assert run(export.cat(base, "x", index="[0, 0:3]", version=v2)).tolist() == [0, 0, 0]
    report = run(checks.verify(base))
    assert report.ok and report.arrays == 1 and report.kind == "versioned"


# -- errors ------------------------------------------------------------------------------
def _err(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(list(args))
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def test_errors_are_actionable(ckpt: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _err(capsys, "ls", str(tmp_path / "nope"))
    assert code == 1 and "no such file or directory" in err
    code, err = _err(capsys, "info", ckpt, "--step", "9")
    assert code == 1 and "step 9 not found" in err and "1, 2, 3" in err
    code, err = _err(capsys, "cat", ckpt, "params/w", "--index", "[0:2, x]")
    assert code == 2 and "expected an integer" in err
    code, err = _err(capsys, "cat", ckpt, "params/nope")
    assert code == 1 and "no array 'params/nope'" in err and "['params']['w']" in err
    code, err = _err(capsys, "verify", ckpt, "--step", "1", "--all")
    assert code == 2 and "not allowed with" in err
    code, err = _err(capsys, "ls", "nosuchscheme://x/")
    assert code == 2 and "nosuchscheme" in err and "URLs look like" in err
    code, err = _err(capsys, "frobnicate", ckpt)
    assert code == 2
    code, err = _err(capsys, "cat", ckpt, "params/w", "--index", "[99]")
    assert code == 2 and "99" in err
    (tmp_path / "empty").mkdir()
    code, err = _err(capsys, "ls", str(tmp_path / "empty"))
    assert code == 1 and "nothing stored here" in err


def test_newer_format_is_refused(ckpt: str) -> None:
    import subprocess
    import sys

    from tensorstore_py.kvstore.versioned.format import FORMAT, MAGIC_COMMIT, frame, unframe

    newer = FORMAT + 1
    path = Path(ckpt[len("file://"):]) / "commits" / f"{3:020d}"
    body = unframe(MAGIC_COMMIT, path.read_bytes(), "x")
    body["format"] = newer
    path.write_bytes(frame(MAGIC_COMMIT, body))
    # a fresh process: this one caches the records it wrote
    p = subprocess.run([sys.executable, "-m", "tensorstore_py.cli", "ls", ckpt],
                       check=False, capture_output=True, text=True, timeout=T)
    assert p.returncode == 1, p.stderr
    assert f"format {newer}" in p.stderr and "upgrade tensorstore_py" in p.stderr
    assert "Traceback" not in p.stderr


def test_credentials_message() -> None:
    code, lines = describe(StorageError("gcs read of gs://b/x: HTTP 403: forbidden"))
    assert code == 1 and "access denied" in lines[0] and "gcloud auth" in lines[1]
    code, lines = describe(NotFoundError("x"))
    assert code == 1


def test_http_needing_credentials(serve_app: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from aiohttp import web

    async def deny(request: web.Request) -> web.Response:
        return web.Response(status=401, text="login required")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", deny)
    server = serve_app(app)
    code, err = _err(capsys, "ls", f"{server.url}/ckpt/")
    assert code == 1 and "credentials" in err


# -- cat ------------------------------------------------------------------------------------
def test_cat_checkpoint_leaf(ckpt: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    want = tree(2)["params"]["w"]
    for name in ("['params']['w']", "params/w", "params.w", "a/3"):
        got = run(export.cat(ckpt, name, index="[0:10, 3]", step=2))
        np.testing.assert_array_equal(got, want[0:10, 3])
    out = tmp_path / "x.npy"
    assert main(["cat", ckpt, "params/w", "--index", "[0:10, ::3]", "--out", str(out)]) == 0
    np.testing.assert_array_equal(np.load(out), tree(3)["params"]["w"][0:10, ::3])
    data = cli_json(capsys, "cat", ckpt, "params/b", "--step", "1")
    assert data == {"shape": [7], "dtype": "int16", "values": [1] * 7}


def test_history_marks_tags_and_deleted_versions(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = f"file://{tmp_path}/kv/"
    kv = tsp.KvStore.open(f"versioned+{base}").result(T)
    for i in range(4):
        kv.write(f"k{i}", bytes([i]) * 300).result(T)  # versions 1..4
    kv.tag("best", 2).result(T)  # 5
    kv.delete_versions([1, 3]).result(T)  # 6
    h = cli_json(capsys, "history", base)
    rows = {c["version"]: c for c in h["commits"]}
    assert len(rows) == 6
    assert rows[1]["deleted"] and rows[3]["deleted"] and not rows[2]["deleted"]
    assert rows[2]["tags"] == ["best"] and rows[5]["kind"] == "tag"
    assert rows[6]["kind"] == "delete_versions"
    assert rows[4]["bytes_written"] == 300 and rows[4]["keys"] == 4
    ls = cli_json(capsys, "ls", base)
    assert [v["version"] for v in ls["versions"]] == [2, 4, 5, 6]
    assert ls["tags"] == {"best": 2}
    code, err = _err(capsys, "ls", base, "--version", "3")
    assert code == 1 and "deleted" in err
    assert run(checks.verify(base, all_versions=True)).ok


def test_no_colour_or_progress_when_piped(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import io

    from tensorstore_py.commands.output import style, use_colour
    from tensorstore_py.progress import Progress

    assert not use_colour(io.StringIO())

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert use_colour(Tty())
    monkeypatch.setenv("NO_COLOR", "1")
    assert not use_colour(Tty())
    assert style("x", "red") == "x"
    p = Progress("walking", total=10)
    p.advance(4)
    p.close()
    assert p.done == 4 and capsys.readouterr().err == ""


def test_verify_checks_chunks_against_the_manifest(ckpt: str) -> None:
    kv = tsp.KvStore.open("versioned+" + ckpt).result(T)
    manifest = json.loads(bytes(kv.read("000000000001/manifest.json").result(T).value))
    big = next(leaf for leaf in manifest["leaves"] if leaf["path"] == "['big']")
    b = next(leaf for leaf in manifest["leaves"] if leaf["path"] == "['params']['b']")
    assert b["packed"]["key"] == "p/0"  # small leaves lie in a pack of the step
    kv.write(f"000000000001/{big['key']}/c/0/0", b"\0" * 10).result(T)  # a committed, wrong-size chunk
    kv.delete(f"000000000002/{big['key']}/c/0/0").result(T)
    kv.write("000000000002/p/0", b"\0" * 10).result(T)  # a committed, short pack of small leaves
    report = run(checks.verify(ckpt))
    assert not report.ok
    found = {(p.kind, p.key) for p in report.problems}
    assert found == {("shape", f"000000000001/{big['key']}/c/0/0"),
                     ("missing", f"000000000002/{big['key']}/c/0/0"),
                     ("missing", "000000000002/p/0")}
    shape = next(p for p in report.problems if p.kind == "shape")
    assert shape.expected == 512 * 512 * 4 and shape.found == 10
    only = run(checks.verify(ckpt, step=3))
    assert only.ok and only.steps == [3]


def test_a_root_holding_only_an_attempt_of_a_multi_writer_save_is_a_versioned_store(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A first multi-writer save whose process 0 died after opening its attempt
    (format 2: ``txns/<id>/attempts/<k>``; small values travel inline, so no
    ``data/``) and whose lease expired and was collected: gc and verify still
    see a versioned store with orphans, not a folder."""
    from tensorstore_py.kvstore.versioned.fragments import Attempt, attempt_name, encode_attempt

    nonce = "ab" * 16
    name = attempt_name("step-1", 1)
    (tmp_path / name).parent.mkdir(parents=True)
    (tmp_path / name).write_bytes(encode_attempt(Attempt("step-1", 1, nonce, 2, 0)))
    url = f"file://{tmp_path}/"
    assert cli_json(capsys, "verify", url)["kind"] == "versioned"
    dry = cli_json(capsys, "gc", url, "--grace", "0s")
    assert dry["kind"] == "versioned" and name in dry["objects"]
