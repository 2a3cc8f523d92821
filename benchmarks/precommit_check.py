"""The cost of the pre-commit presence check (docs/FORMAT.md §9.3), file store.

    python benchmarks/precommit_check.py [--objects 1,64,512] [--reps 5]

A transaction writes ``n`` values of 256 KiB (one data object each, fsync'ed)
and commits; right before its commit record the commit reads one byte of each
data object it adds. Printed per ``n``: the median commit call (check
included), the median check alone (``require_present`` over the same objects)
and its share of the commit call and of the whole transaction.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import tensorstore_py as tsp
from tensorstore_py.core.future import run_sync
from tensorstore_py.kvstore.file import FileKvStore
from tensorstore_py.kvstore.versioned import VersionedKvStore
from tensorstore_py.kvstore.versioned.data import require_present


def case(n: int, reps: int) -> str:
    base = FileKvStore(path=tempfile.mkdtemp(prefix="tsp-precommit-"))
    kv = VersionedKvStore(base)
    commit: list[float] = []
    check: list[float] = []
    total: list[float] = []
    for r in range(reps):
        txn = tsp.Transaction()
        t_start = time.perf_counter()
        view = kv.with_transaction(txn)
        for i in range(n):
            view.write(f"k{r}/{i}", os.urandom(256 * 1024)).result()
        t0 = time.perf_counter()
        txn.commit().result()
        commit.append(time.perf_counter() - t0)
        total.append(time.perf_counter() - t_start)
        names = sorted(base.list("data/").result())[:n]
        t0 = time.perf_counter()
        run_sync(require_present(base, names, "benchmark", "written"))
        check.append(time.perf_counter() - t0)
    c, k, t = (statistics.median(x) for x in (commit, check, total))
    return (f"{n} data objects: commit {c * 1e3:.1f} ms (check included), check alone {k * 1e3:.1f} ms "
            f"({k / c:.0%} of the commit call, {k / t:.1%} of the transaction of {t * 1e3:.0f} ms)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--objects", default="1,64,512")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    for n in (int(x) for x in args.objects.split(",")):
        print(case(n, args.reps), flush=True)


if __name__ == "__main__":
    main()
