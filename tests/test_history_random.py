"""Randomized, seeded histories on one versioned store, checked against a model.

Each history runs on a fresh file store: single-writer read-modify-write
commits, multi-writer commits (processes sharing one txn_id), staged commits
(stagers in their own processes, a pause, one ``commit_staged``, sometimes a
re-run with the same txn_id), Dask in-place increments (``tspd.store(to_dask(ts)
+ 1, ts)``, sometimes re-run with the same txn_id), gc with graces down to 0 s,
retention (``delete_versions``), leased readers (an array view pinned to the
newest version, read again after gc and retention, and pickled into another
process), with short lease TTLs; the nemesis kills operations with SIGKILL at
random times or at a single-writer commit's k-th write, and stops processes
past their lease TTL. :func:`_history.check` then requires: every acknowledged
commit readable at its version (while retained) with its exact bytes, the
newest version exact and ``verify`` clean, no txn_id applied twice, no lost
update without ConflictError, no error for a reader holding a lease, and every
operation of unknown outcome fully present or fully absent.

Default run: the first histories that fit in about 15 s (at least 4). The long form:
``TSP_HISTORIES=500 pytest -m slow tests/test_history_random.py`` (one test per
seed; ``TSP_HISTORY_SEED0`` shifts the seeds; ``TSP_HISTORY_CLUSTER=1`` adds
increments on one LocalCluster for the run, whose workers are killed mid-graph,
re-run with their txn_id when they fail). A failing seed reproduces with
``-k 'seed_long[<seed>]'``; its history is written next to the store.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from _history import category, check
from _history_ops import run_history, start_cluster

DASK = importlib.util.find_spec("dask") is not None
if DASK:
    import dask.array  # noqa: F401  (imported once here, not in every forked operation)

#: seconds the default run spends on histories (it runs at least DEFAULT_MIN of them)
DEFAULT_BUDGET = 15.0
DEFAULT_MIN = 4
SEED0 = int(os.environ.get("TSP_HISTORY_SEED0", "0"))
LONG = range(SEED0, SEED0 + int(os.environ.get("TSP_HISTORIES", "500")))


@pytest.fixture(scope="module")
def cluster() -> Iterator[str | None]:
    """The run's ONE LocalCluster (``TSP_HISTORY_CLUSTER=1``; it costs seconds per
    operation on it), else None."""
    if not DASK or os.environ.get("TSP_HISTORY_CLUSTER") != "1":
        yield None
        return
    pytest.importorskip("distributed")
    proc, address = start_cluster()
    try:
        yield address
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _run_and_check(seed: int, tmp_path: Path, cluster: str | None = None) -> list[str]:
    h = run_history(seed, tmp_path / f"h{seed}", dask_ok=DASK, cluster=cluster)
    anomalies = check(h)
    if anomalies:
        (tmp_path / f"h{seed}.history.json").write_text(h.to_json())
    return anomalies


def test_random_histories_default_subset(tmp_path: Path) -> None:
    t0 = time.monotonic()
    found: dict[int, list[str]] = {}
    seed = SEED0
    while seed - SEED0 < DEFAULT_MIN or time.monotonic() - t0 < DEFAULT_BUDGET:
        anomalies = _run_and_check(seed, tmp_path)
        if anomalies:
            found[seed] = anomalies
        seed += 1
    counts = Counter(category(a) for v in found.values() for a in v)
    assert not found, (
        f"{len(found)} of {seed - SEED0} histories have anomalies ({dict(counts)}); "
        + "; ".join(f"seed {s}: {a[:3]}" for s, a in sorted(found.items())[:5])
    )


@pytest.mark.slow
@pytest.mark.parametrize("seed", LONG)
def test_random_history_seed_long(seed: int, tmp_path: Path, cluster: str | None) -> None:
    anomalies = _run_and_check(seed, tmp_path, cluster)
    assert not anomalies, f"seed {seed}: {len(anomalies)} anomalies: {anomalies[:8]}"


@pytest.mark.skipif(not DASK, reason="needs the dask extra")
def test_txn_id_rerun_after_gc_collected_its_result_commits_once(tmp_path: Path) -> None:
    """Reduced from the histories: an ingest re-run with its txn_id after a collection
    whose grace is shorter than the time since the first run commits a second time."""
    import dask

    import tensorstore_py as tsp
    import tensorstore_py.dask as tspd

    ts = tsp.open(f"versioned+file://{tmp_path}/", create=True, shape=(8,), chunks=(2,),
                  dtype="int64").result()
    with dask.config.set(scheduler="sync"):
        first = tspd.store(tspd.to_dask(ts) + 1, ts, txn_id="ingest-1")
        ts.kvstore.gc(grace=0, dry_run=False).result()
        again = tspd.store(tspd.to_dask(ts) + 1, ts, txn_id="ingest-1")
    assert again.version == first.version
    assert ts.read().result().tolist() == [1] * 8
