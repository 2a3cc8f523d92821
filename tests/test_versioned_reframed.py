"""Objects of a versioned store re-framed with valid framing and checksums but
wrong content (a node that references itself, an absurd version number in the
``latest`` hint or a commit record, ...): open, read, list, write and verify
end within seconds, with a typed error or an answer, never a hang.

The cases run in a subprocess (``tests/_reframed.py``): a descent that spun on
the event loop would otherwise hang the test process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
#: the most one operation of one case may take (each is a few reads in memory)
PER_OP = 2.0


def _run(seed: int, cases: int, timeout: float) -> list[dict]:
    p = subprocess.run([sys.executable, str(HERE / "_reframed.py"), str(seed), str(cases)],
                       capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "PYTHONPATH": str(HERE)})
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    return [r for r in rows if "op" in r]


def _check(rows: list[dict], cases: int) -> None:
    assert len(rows) == 7 * cases, len(rows)
    slow = [r for r in rows if r["seconds"] > PER_OP]
    assert not slow, slow[:5]
    untyped = [r for r in rows if r["error"] and r["error"].startswith("UNTYPED")]
    assert not untyped, untyped[:5]


def test_reframed_objects_fail_typed_and_fast() -> None:
    """The named findings (nodes that reference themselves or their parent, a
    hint or record naming version 10^18, 2^63 - 1, -1, ...) and random
    plausible contents: 120 cases."""
    rows = _run(seed=1, cases=120, timeout=120)
    _check(rows, 120)
    # k/0000 lies below child 0: reads, listings and writes descend into the cycle
    cyc = [r for r in rows if "child 0 of the newest root is the node itself" in r["case"]]
    assert {r["op"]: r["error"] for r in cyc if r["op"] in ("read", "list", "write")} == {
        "read": "DataCorruptionError", "list": "DataCorruptionError", "write": "DataCorruptionError"}


@pytest.mark.slow
def test_reframed_objects_fail_typed_and_fast_long() -> None:
    rows = _run(seed=7, cases=1050, timeout=1500)
    _check(rows, 1050)
