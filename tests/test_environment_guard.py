"""Each test module leaves os.environ as it found it (tests/conftest.py), so that what a
Dask nanny writes into the test process does not reach the subprocesses of later modules.

Checked on a pytest run of its own, in a subprocess, with this suite's conftest as a
plugin: a module that starts a LocalCluster with worker processes (as test_dask.py and
test_dask_acid.py do), then a module that looks at its environment and at a child's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("distributed")

TESTS = Path(__file__).resolve().parent
#: what distributed's default ``distributed.nanny.pre-spawn-environ`` sets
NANNY_ENV = ("MALLOC_TRIM_THRESHOLD_", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")

_FIRST = f'''
import os

import distributed
import pytest

import conftest

NANNY_ENV = {NANNY_ENV!r}


@pytest.fixture(scope="session")
def session_variable():
    # as the s3_server fixture does: set for the whole run, registered as such
    session_env = getattr(conftest, "SESSION_ENV", {{}})
    os.environ["TSP_GUARD_SESSION"] = "kept"
    session_env["TSP_GUARD_SESSION"] = "kept"
    yield
    session_env.pop("TSP_GUARD_SESSION")


@pytest.fixture(scope="module")
def cluster():
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                                  dashboard_address=None) as c, distributed.Client(c) as client:
        yield client


def test_the_nanny_writes_into_this_process(cluster, session_variable):
    assert cluster.submit(sum, [1, 2]).result(60) == 3
    assert os.environ.get("MALLOC_TRIM_THRESHOLD_") == "65536"
    assert [n for n in NANNY_ENV if n not in os.environ] == []
    os.environ["TSP_GUARD_MODULE"] = "leaks"  # by hand, no monkeypatch
    os.environ["HOME"] = "/changed"
'''

_SECOND = f'''
import json
import os
import subprocess
import sys

NANNY_ENV = {NANNY_ENV!r}


def test_the_environment_is_the_one_before_the_cluster():
    assert [n for n in NANNY_ENV if n in os.environ] == []
    assert "TSP_GUARD_MODULE" not in os.environ
    assert os.environ.get("HOME") == {{home!r}}
    assert os.environ["TSP_GUARD_SESSION"] == "kept"  # a session fixture's, for the run
    code = "import json, os; print(json.dumps(sorted(os.environ)))"
    child = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                      check=True, timeout=60).stdout)
    assert [n for n in child if n in NANNY_ENV or n == "TSP_GUARD_MODULE"] == []
'''


def test_a_dask_cluster_leaves_no_variables_for_later_modules(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in NANNY_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), *filter(None, [env.get("PYTHONPATH")])])
    (tmp_path / "test_1_cluster.py").write_text(_FIRST)
    (tmp_path / "test_2_after.py").write_text(_SECOND.format(home=env.get("HOME")))
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
         "test_1_cluster.py", "test_2_after.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    assert "2 passed" in p.stdout, p.stdout[-2000:]
