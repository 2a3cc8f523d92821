"""The Python examples of docs/*.md run as written.

Each page's ```python blocks run in order in one fresh process (later blocks use what earlier
ones defined), with ``numpy as np`` and ``tensorstore_py as tsp`` imported. A block that shows a
fragment (placeholders, a cloud bucket, a multi-host job) says so with the line
``<!-- illustrative -->`` right above its fence, and is not run.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MARK = "<!-- illustrative -->"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
PRELUDE = "import numpy as np\nimport tensorstore_py as tsp\n"


def _runnable(page: Path) -> list[tuple[int, str]]:
    text = page.read_text()
    out = []
    for m in BLOCK.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        if before.strip() != MARK:
            out.append((text[: m.start()].count("\n") + 1, m.group(1)))
    return out


PAGES = sorted((ROOT / "docs").glob("*.md"))


def test_some_examples_run() -> None:
    assert sum(len(_runnable(p)) for p in PAGES) >= 4


@pytest.mark.parametrize("page", [p for p in PAGES if _runnable(p)], ids=lambda p: p.name)
def test_the_examples_of_a_page_run_as_written(page: Path, tmp_path: Path) -> None:
    parts = [PRELUDE]
    for line, code in _runnable(page):
        # each block compiled under its page and line, so a failure names where it is
        parts.append(f"exec(compile({code!r}, {f'docs/{page.name}:{line}'!r}, 'exec'))\n")
    p = subprocess.run([sys.executable, "-c", "".join(parts)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=240, check=False)
    assert p.returncode == 0, p.stderr
