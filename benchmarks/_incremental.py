"""Incremental saves: the hashing cost and a 90%-unchanged save against a full one.

Run through ``python benchmarks/checkpoint.py --incremental [--mib N] [--reps N]
[--changed-last]``.

* ``hash_<algo>_gib_s``: one core hashing a 64 MiB buffer (median of 7), for
  the candidates of checkpoint/dedup.py: sha256 and blake2b (hashlib) and
  xxh3_128 (xxhash), with crc32c (what the store computes anyway) for scale.
* The save cases, on a ``file://`` root in the scratch folder, every save to a
  durable, committed step (``save(...).result()``): a state of 20 float32 leaves
  (``--mib`` in all; ``jax.Array`` on one CPU device when jax is installed --
  host staging is then a zero-copy view --, else numpy leaves, which a save
  copies), saved as step 1 and then as step 2 with 2 of the 20 leaves changed
  (the first two; with ``--changed-last`` the last two, which the save reaches
  after the 18 unchanged ones):

  - ``full_save_s`` / ``full_save_plain_s``: step 1 with incremental saves on
    (every chunk hashed) / off: the difference is what hashing adds to a full
    save (``hash_overhead_pct``);
  - ``incremental_save_s``: step 2, 18 leaves linked (new arrays of the same
    values: every chunk hashed); ``full_save2_plain_s``: the same step 2 with
    incremental saves off (every chunk written);
  - ``incremental_same_arrays_save_s``: step 2 where the 18 unchanged leaves
    are the very arrays saved as step 1 (a frozen backbone held outside the
    train step): linked without being read or hashed (jax only);
  - ``*_bytes``: bytes the save added under ``data/`` (data objects);
  - ``incremental_time_ratio`` / ``incremental_bytes_ratio``: step 2 against
    the full save of step 1 (the goal: at most 0.20 and 0.12; the time
    ratios of every rep, sorted, follow as ``*_time_ratio_reps``);
    ``incremental_vs_full2_time_ratio``: step 2 against the full save of the
    same step 2 (incremental saves off).

Each rep uses fresh roots and runs the cases in a rotated order (the case
that follows another's writes changes every rep); every save starts after
``os.sync()`` (the writeback of earlier saves would otherwise land in its
fsyncs); medians are printed.
"""

from __future__ import annotations

import functools
import hashlib
import os
import statistics
import time
from pathlib import Path
from typing import Any

import crc32c
import numpy as np
import xxhash
from _harness import emit, fresh

LEAVES = 20
CHANGED = 2


def hash_rates() -> dict[str, float]:
    buf = memoryview(np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8))
    algos = {
        "sha256": lambda b: hashlib.sha256(b).digest(),
        "blake2b": lambda b: hashlib.blake2b(b, digest_size=16).digest(),
        "xxh3_128": xxhash.xxh3_128_digest,
        "crc32c": crc32c.crc32c,
    }
    out = {}
    for name, f in algos.items():
        times = []
        for _ in range(7):
            t = time.perf_counter()
            f(buf)
            times.append(time.perf_counter() - t)
        out[name] = len(buf) / statistics.median(times) / 2**30
    return out


def _data_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in (root / "data").rglob("*") if p.is_file())


def _state(mib: float, version: list[int]) -> dict[str, Any]:
    rows = max(1, int(mib * 2**20 / LEAVES / 4 / 1024))
    base = np.arange(rows * 1024, dtype=np.float32).reshape(rows, 1024)
    leaves = {f"layer{i:02d}": base + 1000.0 * i + version[i] for i in range(LEAVES)}
    try:
        import jax  # optional: the CPU-device case (host staging is a zero-copy view)

        return {k: jax.device_put(v) for k, v in leaves.items()}
    except ImportError:
        return leaves


def _timed_save(root: Path, step: int, state: dict[str, Any], incremental: bool) -> tuple[float, int]:
    import tensorstore_py as tsp
    from tensorstore_py.checkpoint import SaveOptions

    mgr = tsp.CheckpointManager(f"file://{root}/", options=SaveOptions(incremental=incremental))
    before = _data_bytes(root) if (root / "data").exists() else 0
    os.sync()  # earlier saves' writeback does not slow this one's fsyncs
    t = time.perf_counter()
    mgr.save(step, state).result(600)
    dt = time.perf_counter() - t
    return dt, _data_bytes(root) - before


def main(scratch: str, mib: float, reps: int, *, changed_last: bool = False) -> None:
    for name, rate in hash_rates().items():
        emit(f"hash_{name}_gib_s", rate, "GiB/s")
    v1 = [0] * LEAVES
    changed = range(LEAVES - CHANGED, LEAVES) if changed_last else range(CHANGED)
    v2 = [1 if i in changed else 0 for i in range(LEAVES)]
    s1, s2 = _state(mib, v1), _state(mib, v2)
    same = {k: (s2[k] if i in changed else s1[k]) for i, k in enumerate(s1)}
    kind = type(next(iter(s1.values()))).__name__
    print(f"# state: {LEAVES} leaves ({kind}), {mib:.0f} MiB; step 2 changes {CHANGED} of them "
          f"(the {'last' if changed_last else 'first'})", flush=True)
    runs: dict[str, list[float]] = {}
    for rep in range(reps):
        a, b = Path(fresh(os.path.join(scratch, "on"))), Path(fresh(os.path.join(scratch, "off")))
        c = Path(fresh(os.path.join(scratch, f"same{rep}")))  # a root of its own: its own identities

        def pair(root: Path, inc: bool) -> None:
            t1, n1 = _timed_save(root, 1, s1, inc)
            t2, n2 = _timed_save(root, 2, s2, inc)
            tag = "" if inc else "_plain"
            runs.setdefault(f"full_save{tag}_s", []).append(t1)
            runs.setdefault(f"full_save{tag}_bytes", []).append(n1)
            runs.setdefault("incremental_save_s" if inc else "full_save2_plain_s", []).append(t2)
            runs.setdefault("incremental_save_bytes" if inc else "full_save2_plain_bytes", []).append(n2)

        def same_arrays(c: Path = c) -> None:
            _timed_save(c, 1, s1, True)
            t3, n3 = _timed_save(c, 2, same, True)
            runs.setdefault("incremental_same_arrays_save_s", []).append(t3)
            runs.setdefault("incremental_same_arrays_save_bytes", []).append(n3)

        cases = [functools.partial(pair, a, True), functools.partial(pair, b, False)]
        cases += [same_arrays] if kind != "ndarray" else []
        # rotate: a busy machine (and a disk still busy with the case before) favours none
        for case in cases[rep % len(cases):] + cases[:rep % len(cases)]:
            case()
        r = runs
        r.setdefault("incremental_vs_full2_time_ratio", []).append(
            r["incremental_save_s"][-1] / r["full_save2_plain_s"][-1])
        if kind != "ndarray":
            r.setdefault("incremental_same_arrays_time_ratio", []).append(
                r["incremental_same_arrays_save_s"][-1] / r["full_save_s"][-1])
        r.setdefault("incremental_time_ratio", []).append(r["incremental_save_s"][-1] / r["full_save_s"][-1])
        r.setdefault("incremental_bytes_ratio", []).append(
            r["incremental_save_bytes"][-1] / r["full_save_bytes"][-1])
        r.setdefault("hash_overhead_pct", []).append(
            100 * (r["full_save_s"][-1] / r["full_save_plain_s"][-1] - 1))
    for name, xs in runs.items():
        unit = "s" if name.endswith("_s") else "bytes" if name.endswith("_bytes") else \
            "%" if name.endswith("_pct") else "x"
        emit(name, statistics.median(xs), unit, digits=0 if unit == "bytes" else 3)
        if name.endswith("_time_ratio"):  # the spread of the reps, not only their median
            print(f"{name}_reps: " + " ".join(f"{x:.3f}" for x in sorted(xs)), flush=True)
