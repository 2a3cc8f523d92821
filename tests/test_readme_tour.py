"""The README as a newcomer runs it: the tour and its CLI lines, twice; the main job
and the ``--root`` it recommends; the docs' memory-store example."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tensorstore_py as tsp

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
T = 240


def _block(text: str, after: str, lang: str) -> str:
    """The first fenced ``lang`` block after the line ``after``."""
    rest = text[text.index(after):]
    m = re.search(rf"```{lang}\n(.*?)```", rest, re.S)
    assert m, f"no {lang} block after {after!r}"
    return m.group(1)


def _env(tmp_path: Path) -> dict[str, str]:
    bin_dir = os.path.dirname(sys.executable)  # where the tensorstore-py script is installed
    return {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
            "TMPDIR": str(tmp_path)}


def test_the_tour_and_its_cli_lines_run_twice_as_written(tmp_path: Path) -> None:
    pytest.importorskip("dask")
    pytest.importorskip("zarr")
    # as written, except that /tmp/ is this test's folder (runs of other tests share /tmp)
    here = str(tmp_path) + "/"
    tour = _block(README, "## A tour", "python").replace("/tmp/", here)
    shell = _block(README, "<!-- cli-tour -->", "bash").replace("/tmp/", here)
    assert "tensorstore-py export" in shell
    for run in (1, 2):
        p = subprocess.run([sys.executable, "-c", tour], cwd=tmp_path, env=_env(tmp_path),
                           capture_output=True, text=True, timeout=T, check=False)
        assert p.returncode == 0, f"tour run {run}:\n{p.stdout}\n{p.stderr}"
        p = subprocess.run(["bash", "-e", "-c", shell], cwd=tmp_path, env=_env(tmp_path),
                           capture_output=True, text=True, timeout=T, check=False)
        assert p.returncode == 0, f"CLI lines, run {run}:\n{p.stdout}\n{p.stderr}"
        assert "Traceback" not in p.stderr
    mgr = tsp.CheckpointManager(f"file://{here}ckpt/")
    assert mgr.all_steps() == [1, 2]  # one new step per run
    np.testing.assert_array_equal(mgr.restore(2)["w"], np.arange(10.0))


def test_the_main_job_says_where_its_checkpoints_went_and_resumes_from_a_root(tmp_path: Path) -> None:
    pytest.importorskip("jax")
    script = str(ROOT / "examples" / "checkpoint_jax.py")
    main = _block(README, "<!-- main-command -->", "bash")
    assert "python examples/checkpoint_jax.py" in main
    p = subprocess.run([sys.executable, script], cwd=tmp_path, env=_env(tmp_path),
                       capture_output=True, text=True, timeout=T, check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "temporary folder" in p.stdout and "--root file:///tmp/tsp-run/" in p.stdout
    root = f"file://{tmp_path}/run/"
    outputs = []
    for _ in (1, 2):
        p = subprocess.run([sys.executable, script, "--root", root], cwd=tmp_path, env=_env(tmp_path),
                           capture_output=True, text=True, timeout=T, check=False)
        assert p.returncode == 0, p.stdout + p.stderr
        outputs.append(p.stdout)
    assert f"tensorstore-py ls {root}" in outputs[0] and "resumed" not in outputs[0]
    assert "resumed from step 12" in outputs[1]
    assert tsp.CheckpointManager(root).all_steps() == [20, 24]
    ls = subprocess.run(["tensorstore-py", "ls", root], env=_env(tmp_path), capture_output=True,
                        text=True, timeout=T, check=False)
    assert ls.returncode == 0 and re.search(r"^\s+24\s", ls.stdout, re.M), ls.stdout + ls.stderr


def test_arrays_md_memory_stores_are_shared_per_context() -> None:
    doc = (ROOT / "docs" / "ARRAYS.md").read_text()
    example = _block(doc, "A Context also holds one in-memory store", "python")
    scope: dict[str, object] = {"tsp": tsp}
    exec(compile(example, "docs/ARRAYS.md", "exec"), scope)
    ctx = scope["ctx"]
    again = tsp.open("memory://x/", context=ctx).result()  # type: ignore[arg-type]
    assert again.read().result().tolist() == [1, 2, 3, 4]
    # a versioned store over the Context's memory store, reopened by URL
    v = tsp.open({"driver": "zarr3", "kvstore": "versioned+memory://v/"}, context=ctx,  # type: ignore[arg-type]
                 create=True, dtype="int32", shape=[2]).result()
    v.write(7).result()
    assert tsp.open("versioned+memory://v/", context=ctx).result().read().result().tolist() == [7, 7]  # type: ignore[arg-type]
    # without a context, and with another one, memory:// is a fresh store
    with pytest.raises(tsp.NotFoundError):
        tsp.open("memory://x/").result()
    with pytest.raises(tsp.NotFoundError):
        tsp.open("memory://x/", context=tsp.Context()).result()
