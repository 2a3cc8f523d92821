"""Every script in examples/ runs to completion with small sizes.

Convention for examples: with the environment variable ``TSP_EXAMPLES_SMALL=1``
a script picks sizes that finish in a few seconds, exits 0 on success and
non-zero when a check fails. New examples are picked up automatically.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.py"))


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(script: Path, tmp_path: Path) -> None:
    env = dict(os.environ, TSP_EXAMPLES_SMALL="1", TMPDIR=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=240, check=False,
    )
    assert proc.returncode == 0, f"{script.name} failed:\n{proc.stdout}\n{proc.stderr}"
    assert proc.stdout.strip(), f"{script.name} printed nothing"


def test_examples_exist() -> None:
    assert EXAMPLES, "no examples found"
