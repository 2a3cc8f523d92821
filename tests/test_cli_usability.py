"""What a new user meets in the ``tensorstore-py`` entry point (real subprocesses):
progress and summaries, counts in ``verify --json``, help text, ``ls`` after
retention, errors that say what to do, resuming an interrupted ``copy``."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tensorstore_py as tsp

T = 120
EXE = shutil.which("tensorstore-py", path=os.path.dirname(sys.executable)) or shutil.which("tensorstore-py")
_SUMMARY = re.compile(r"^(\S[^:\n]*): \d+(\.\d)? (B|KiB|MiB|GiB|objects) in \d+\.\d s( \(.*/s\))?$")


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [EXE, *args] if EXE else [sys.executable, "-m", "tensorstore_py.cli", *args]
    p = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=T,
                       env={**os.environ, **(env or {})})
    assert "Traceback" not in p.stderr, p.stderr
    return p


def tree(step: int) -> dict[str, Any]:
    rng = np.random.default_rng(step)
    return {"w": rng.standard_normal((256, 512)).astype(np.float32),  # 512 KiB: one data object
            "b": np.full(5, step, dtype=np.float64), "n": step}


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    """Steps 1..4 with max_to_keep=2: retention has retired every publishing version."""
    root = tmp_path / "ckpt"
    mgr = tsp.CheckpointManager(f"file://{root}/", max_to_keep=2)
    for s in (1, 2, 3, 4):
        mgr.save(s, tree(s), metrics={"loss": 1.0 / s})
        mgr.wait_until_finished()
    return root


# -- 1. progress ------------------------------------------------------------------------
def test_long_commands_print_one_summary_line_when_stderr_is_not_a_terminal(ckpt: Path, tmp_path: Path) -> None:
    p = cli("verify", str(ckpt))
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("OK ")
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and _SUMMARY.match(lines[0]) and lines[0].startswith("verify: "), p.stderr
    for args, word in ((("copy", str(ckpt), str(tmp_path / "c")), "copy"),
                       (("export", str(ckpt), str(tmp_path / "e")), "export"),
                       (("gc", str(ckpt), "--grace", "0s", "--apply"), "gc --apply")):
        p = cli(*args)
        assert p.returncode == 0, p.stderr
        assert len(p.stderr.splitlines()) == 1 and p.stderr.startswith(word + ": "), p.stderr
        assert _SUMMARY.match(p.stderr.strip()), p.stderr
    # --json: stdout is the JSON, stderr stays empty
    p = cli("verify", str(ckpt), "--json")
    assert p.returncode == 0 and p.stderr == "" and json.loads(p.stdout)["ok"]


def _on_a_terminal(*args: str) -> tuple[int, str]:
    """Run the entry point with stderr on a pseudo-terminal; (exit code, what it drew)."""
    main, sub = pty.openpty()
    cmd = [EXE, *args] if EXE else [sys.executable, "-m", "tensorstore_py.cli", *args]
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=sub,
                         env={**os.environ, "COLUMNS": "120", "TERM": "xterm"})
    os.close(sub)
    drawn = b""
    while True:
        ready, _, _ = select.select([main], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            drawn += chunk
        elif p.poll() is not None:
            break
    os.close(main)
    return p.wait(T), re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", drawn.decode("utf-8", "replace"))


def test_verify_draws_a_bar_with_a_known_total_on_a_terminal(ckpt: Path) -> None:
    pytest.importorskip("rich")
    code, drawn = _on_a_terminal("verify", str(ckpt))
    assert code == 0, drawn
    # "done/total unit": the total is known (the stored objects listed), not "?"
    totals = re.findall(r"(\d+(?:\.\d+)?)/(\d+(?:\.\d+)?) (KiB|MiB|bytes)", drawn)
    assert totals, drawn
    done, total, _unit = totals[-1]
    assert float(total) > 0 and done == total
    assert "verify: " not in drawn  # a bar instead of the summary line


# -- 2. verify counts what it did; one version for both outputs -----------------------------
def test_verify_json_counts_bytes_read_and_verified(ckpt: Path) -> None:
    rep = json.loads(cli("verify", str(ckpt), "--json").stdout)
    on_disk = sum(f.stat().st_size for d in ("data", "nodes", "commits") for f in (ckpt / d).iterdir()
                  if f.is_file())
    kept = 2 * 256 * 512 * 4  # the two kept steps' "w"
    assert rep["bytes_verified"] >= kept and rep["bytes_read"] >= rep["bytes_verified"]
    assert rep["bytes_read"] <= on_disk + 4096
    assert rep["bytes"] == rep["bytes_verified"]
    p = cli("verify", str(ckpt))
    assert re.search(r"\d+\.\d MiB verified, \d+\.\d MiB read", p.stdout), p.stdout


def test_a_shared_object_names_the_same_version_every_time(tmp_path: Path) -> None:
    url = f"versioned+file://{tmp_path}/v/"
    kv = tsp.KvStore.open(url).result(T)
    kv.write("big", np.arange(100_000, dtype=np.float64).tobytes()).result(T)
    for i in range(6):  # six more versions share the big value
        kv.write(f"k{i}", b"x" * 10).result(T)
    big = max((tmp_path / "v" / "data").iterdir(), key=lambda f: f.stat().st_size)
    data = bytearray(big.read_bytes())
    data[100] ^= 1
    big.write_bytes(bytes(data))
    found = set()
    for _ in range(3):
        rep = json.loads(cli("verify", str(tmp_path / "v"), "--json").stdout)
        (problem,) = rep["problems"]
        found.add(problem["version"])
        human = cli("verify", str(tmp_path / "v")).stdout
        assert f"data/{big.name} (version {problem['version']})" in human
    assert found == {1}  # the oldest retained version holding it


# -- 3. help text ------------------------------------------------------------------------
def test_help_is_plain_text_and_every_argument_is_explained(capsys: pytest.CaptureFixture[str]) -> None:
    from tensorstore_py.cli import main

    p = cli("--help")  # the installed entry point; each command's help in this process
    assert p.returncode == 0 and "``" not in p.stdout and "tensorstore-py COMMAND --help" in p.stdout

    def helped_text(*argv: str) -> str:
        assert main(list(argv)) == 0
        return capsys.readouterr().out

    for command in ("ls", "info", "history", "diff", "verify", "gc", "cat", "copy", "export"):
        h = helped_text(command, "--help")
        assert "``" not in h, h
        lines = h.split("positional arguments:", 1)[1].split("options:", 1)[0].strip("\n").splitlines()
        entries = [i for i, ln in enumerate(lines) if re.match(r"  \S", ln)]
        assert entries, h
        for i in entries:  # help on the same line, or indented on the next
            helped = len(lines[i].split()) > 1 or (i + 1 < len(lines) and re.match(r"\s{4,}\S", lines[i + 1]))
            assert helped, f"{command}: {lines[i].strip()!r} has no help"
        assert "--version" not in h, h  # the store version is --at; --version is the program's
    assert "--at N" in helped_text("ls", "--help")
    assert cli("--version").stdout.startswith("tensorstore-py ")


def test_at_picks_a_store_version_and_the_old_spelling_still_works(ckpt: Path) -> None:
    newest = json.loads(cli("ls", str(ckpt), "--json").stdout)["version"]
    for flag in ("--at", "--version"):
        p = cli("ls", str(ckpt), flag, str(newest - 1), "--json")
        assert p.returncode == 0, p.stderr
        assert json.loads(p.stdout)["version"] == newest - 1


# -- 4. ls after retention -----------------------------------------------------------------
def test_ls_after_retention_shows_where_each_step_is_readable(ckpt: Path) -> None:
    data = json.loads(cli("ls", str(ckpt), "--json").stdout)
    hist = {c["version"]: c for c in json.loads(cli("history", str(ckpt), "--json").stdout)["commits"]}
    rows = {s["step"]: s for s in data["steps"]}
    assert sorted(rows) == [3, 4]
    for s, row in rows.items():
        assert row["retired"] and hist[row["version"]]["deleted"]
        assert hist[row["version"]]["step"] == s and row["write_id"] == hist[row["version"]]["write_id"]
        v = row["readable_version"]
        assert not hist[v]["deleted"] and v > row["version"]
        # the version shown really holds the step
        assert cli("cat", str(ckpt), "b", "--step", str(s), "--at", str(v), "--json").returncode == 0
    out = cli("ls", str(ckpt)).stdout
    table = [ln.split() for ln in out.splitlines()[3:5]]
    # TIME, SIZE and ADDED are two words each
    assert all(r[7] != "-" and r[8].endswith("*") for r in table), out
    assert "retired" in out and "--at" in out


# -- 7. errors that say what to do ----------------------------------------------------------
@pytest.mark.parametrize("url,env", [
    ("gs://bucket/run/", {"STORAGE_EMULATOR_HOST": "http://no-such-host.invalid:4443"}),
    ("s3://bucket/run/", {"AWS_ENDPOINT_URL": "http://no-such-host.invalid:9000"}),
])
def test_a_host_that_does_not_resolve_fails_at_once(url: str, env: dict[str, str]) -> None:
    p = cli("ls", url, env=env)
    assert p.returncode == 1
    first = p.stderr.splitlines()[0]
    assert first.startswith("tensorstore-py ls: network error:") and "no-such-host.invalid" in first
    assert "not retried" in first and "access denied" not in p.stderr
    # the credentials the request carried, said once (in the error)
    assert p.stderr.count("credentials:") == 1 and p.stderr.count("no credentials found") <= 1, p.stderr


def test_a_store_without_create_only_is_refused_before_anything_moves(ckpt: Path, tmp_path: Path) -> None:
    dst = tmp_path / "fs"
    p = cli("copy", str(ckpt), f"local://{dst}/")
    assert p.returncode == 1
    assert "create-only" in p.stderr and "file://" in p.stderr and "gs://" in p.stderr
    assert not dst.exists()


# -- 9. an interrupted copy resumes ----------------------------------------------------------
def _files(folder: Path) -> list[Path]:
    """The objects in a file store's folder (not its ``.__tsp__`` housekeeping), by name."""
    return sorted(f for f in folder.iterdir() if f.is_file())


def test_an_interrupted_copy_resumes_when_run_again(ckpt: Path, tmp_path: Path) -> None:
    dst = tmp_path / "copy"
    assert cli("copy", str(ckpt), str(dst)).returncode == 0
    # what an interruption leaves: every object before the commit records, and a
    # prefix of the records (they are written last, oldest first)
    records = _files(dst / "commits")
    for f in records[len(records) // 2:]:
        f.unlink()
    (dst / "latest").unlink()
    _files(dst / "data")[0].unlink()  # not copied yet
    p = cli("copy", str(ckpt), str(dst), "--json")
    assert p.returncode == 0, p.stderr
    assert cli("verify", str(dst), "--all").returncode == 0
    got = tsp.checkpoint.restore(f"file://{dst}/", step=4)
    np.testing.assert_array_equal(got["w"], tree(4)["w"])
    # a finished copy is refused; so is an object with other bytes
    p = cli("copy", str(ckpt), str(dst))
    assert p.returncode == 1 and "finished copy" in p.stderr
    for f in _files(dst / "commits")[1:]:
        f.unlink()
    node = _files(dst / "nodes")[0]
    node.write_bytes(node.read_bytes() + b"x")
    p = cli("copy", str(ckpt), str(dst))
    assert p.returncode == 1 and node.name in p.stderr and "other content" in p.stderr


def test_a_copy_into_a_folder_holding_something_else_writes_nothing(ckpt: Path, tmp_path: Path) -> None:
    dst = tmp_path / "other"
    dst.mkdir()
    (dst / "notes.txt").write_text("mine")
    p = cli("copy", str(ckpt), str(dst))
    assert p.returncode == 1 and "notes.txt" in p.stderr
    assert sorted(f.name for f in dst.iterdir()) == ["notes.txt"]
