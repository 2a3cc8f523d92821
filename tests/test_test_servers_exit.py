"""The test servers that run as subprocesses stop when the script that started
them exits without stopping them (an exception, a forgotten stop())."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tensorstore_py.testing.gcs_server import find_binary

SCRIPT = """
import sys
from tensorstore_py.testing.gcs_server import GcsEmulator
from tensorstore_py.testing.s3_server import S3Server
servers = [GcsEmulator().start(), S3Server().start()]
print(" ".join(str(s._proc.pid) for s in servers), flush=True)
del servers  # dropped without stop()
raise SystemExit("a script that fails before it stops its servers")
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is gone for our purpose (its parent, the script, has exited)
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def test_servers_left_running_by_a_failing_script_stop_when_it_exits() -> None:
    try:
        find_binary()
    except Exception as e:  # pragma: no cover - the gcs extra provides it
        pytest.skip(f"fake-gcs-server is not available: {e}")
    p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr
    pids = [int(x) for x in p.stdout.split()]
    assert len(pids) == 2, p.stdout
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [pid for pid in pids if _alive(pid)]
    for pid in left:  # do not leave them to the next test either
        os.kill(pid, 9)
    assert not left, f"servers still running after their script exited: {left}"
