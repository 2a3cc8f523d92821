"""Crash safety: kill -9 writers at random points of their commits.

Seeded trials (>= 50 across both tests). In each, a forked writer process
commits into a file store and is killed with SIGKILL either at its k-th
base-store write (before or after that write lands, via the fault wrapper) or
after a random delay. After every kill the newest visible version is whole
(every key holds the value of the one counter its commit record names), older
versions still read back, the full verify walk finds nothing, and the next
writer commits on top of whatever was left behind.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from _versioned_workload import (
    all_keys,
    check_version,
    fresh_versioned,
    run_writer,
    sample_versions,
    writes_until_commit_record,
)

from tensorstore_py.kvstore.versioned.verify import verify

T = 60
SINGLE_TRIALS = 30
MULTI_TRIALS = 22
#: base-store writes of one commit are roughly: 2 large values, 1-2 packed
#: objects, 1-2 nodes, the commit record, the hint (+ fragments for multi-writer)
WRITES_PER_COMMIT = {1: 7, 3: 11}


def _trials(root: str, parts: int, trials: int, seed0: int) -> dict[str, int]:
    keys = all_keys(parts)
    outcomes = {"killed": 0, "finished": 0}
    counter = 0
    # a clean first version, so every trial has history below it
    assert run_writer(root, first_counter=counter, commits=1, parts=parts) == 0
    counter += 1
    newest_seen = 1
    for t in range(trials):
        rng = random.Random(seed0 + t)
        commits = rng.randint(1, 3)
        mode = rng.choice(["before", "after", "timed"])
        if mode == "timed":
            code = run_writer(root, first_counter=counter, commits=-1, parts=parts,
                              kill_after=rng.uniform(0.0, 0.25))
        else:
            k = rng.randint(1, commits * WRITES_PER_COMMIT[parts])
            code = run_writer(root, first_counter=counter, commits=commits, parts=parts,
                              kill_at=k, after=mode == "after")
        counter += 1000  # counters of different trials never collide
        assert code in (0, -9), f"trial {t}: writer exited with {code}"
        outcomes["killed" if code == -9 else "finished"] += 1

        kv = fresh_versioned(root)
        newest = kv.newest_version().result(T)
        assert newest >= newest_seen, f"trial {t}: newest went back from {newest_seen} to {newest}"
        for v in sample_versions(newest, rng):
            check_version(kv, v, keys)
        problems = verify(kv).result(T)
        assert problems == [], f"trial {t} ({mode}): " + "\n".join(map(str, problems))
        newest_seen = newest
    # every version ever committed still reads back whole
    kv = fresh_versioned(root)
    newest = kv.newest_version().result(T)
    counters = [check_version(kv, v, keys) for v in range(1, newest + 1)]
    assert len(set(counters)) == len(counters), "two versions claim the same commit"
    # and a writer can still commit on top of everything the kills left behind
    assert run_writer(root, first_counter=counter, commits=1, parts=parts) == 0
    kv = fresh_versioned(root)
    assert kv.newest_version().result(T) == newest + 1
    check_version(kv, newest + 1, keys)
    outcomes["versions"] = newest + 1
    return outcomes


def test_kill_single_writer_at_random_points(tmp_path: Any) -> None:
    out = _trials(str(tmp_path / "store"), 1, SINGLE_TRIALS, seed0=1000)
    print(out)
    assert out["killed"] >= SINGLE_TRIALS // 2, out
    assert out["versions"] > SINGLE_TRIALS // 2, out  # kills landed between and inside commits


def test_kill_multi_writer_commit_at_random_points(tmp_path: Any) -> None:
    out = _trials(str(tmp_path / "store"), 3, MULTI_TRIALS, seed0=2000)
    print(out)
    assert out["killed"] >= MULTI_TRIALS // 2, out
    assert out["versions"] > MULTI_TRIALS // 4, out


@pytest.mark.parametrize("after", [False, True])
def test_kill_at_the_commit_record_write(tmp_path: Any, after: bool) -> None:
    """The linearisation point itself: dying just before or just after
    ``commits/<v>`` lands shows the old or the new version, whole."""
    root = str(tmp_path / "store")
    assert run_writer(root, first_counter=0, commits=1) == 0
    kv = fresh_versioned(root)
    writes_before = writes_until_commit_record(root, str(tmp_path / "scratch"), parts=1)
    code = run_writer(root, first_counter=1, commits=1, kill_at=writes_before, after=after)
    assert code == -9
    kv = fresh_versioned(root)
    assert kv.newest_version().result(T) == (2 if after else 1)
    assert check_version(kv, kv.newest_version().result(T), all_keys(1)) == (1 if after else 0)
    assert verify(kv).result(T) == []
