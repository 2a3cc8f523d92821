"""File store throughput next to plain ``os`` calls on the same bytes, same run.

    python benchmarks/kvstore.py [--count 64] [--size-mib 4] [--reps 5] [--dir DIR]

Per repetition (fresh files each time, so both sides create new files), value
by value and alternating which side goes first, so that both see the same
conditions on a shared machine:

* ``os_write``: open, write, fsync, close each value (the floor for a durable write).
* ``file_write``: ``FileKvStore.write(key, value).result()`` one after another
  (temp file + fsync + rename + directory fsync + per-key lock).
* ``os_read`` / ``file_read``: read every value back (page cache warm for both).

Also ``file_write_concurrent`` / ``file_read_concurrent``: all values submitted
at once, showing what the async API adds (concurrent reads hold every value at
once, so they pay for fresh memory that the sequential loops reuse; no ratio).

Prints ``name: value unit`` lines (medians over the repetitions) and
``ratio_*: x`` = file store / plain os.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import numpy as np
from _harness import emit, fresh, scratch_dir

from tensorstore_py.kvstore.file import FileKvStore

MiB = 1 << 20


def _timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--count", type=int, default=64, help="values per repetition")
    ap.add_argument("--size-mib", type=float, default=4.0, help="size of each value")
    ap.add_argument("--reps", type=int, default=5, help="repetitions (medians are printed)")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    args = ap.parse_args()

    size = int(args.size_mib * MiB)
    rng = np.random.default_rng(0)
    values = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(args.count)]
    total_mib = size * args.count / MiB
    with scratch_dir("tsp-bench-", args.dir) as scratch:
        times = _run(scratch, keys=[f"v/{i:04d}" for i in range(args.count)], values=values,
                     reps=args.reps)
    rate = {name: total_mib / statistics.median(ts) for name, ts in times.items()}
    print(f"values: {args.count} x {size / MiB:g} MiB, reps: {args.reps} (medians)")
    for name, r in rate.items():
        emit(name, r, "MiB/s", digits=1)
    emit("ratio_write", rate["file_write"] / rate["os_write"], digits=2)
    emit("ratio_read", rate["file_read"] / rate["os_read"], digits=2)


def _run(scratch: str, *, keys: list[str], values: list[bytes], reps: int) -> dict[str, list[float]]:
    """Every repetition's time per contender (seconds for all values)."""
    plain_dir = os.path.join(scratch, "plain")
    store_dir = os.path.join(scratch, "store")
    kv = FileKvStore(path=store_dir)

    def os_write(k: str, v: bytes) -> None:
        fd = os.open(os.path.join(plain_dir, k), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            mv = memoryview(v)
            while mv:
                mv = mv[os.write(fd, mv) :]
            os.fsync(fd)
        finally:
            os.close(fd)

    def os_read(k: str, v: bytes) -> None:
        with open(os.path.join(plain_dir, k), "rb") as f:
            if len(f.read()) != len(v):
                raise RuntimeError("plain read: short read")

    def file_write(k: str, v: bytes) -> None:
        kv.write(k, v).result()

    def file_read(k: str, v: bytes) -> None:
        if len(kv.read(k).result().value) != len(v):
            raise RuntimeError("file store read: short read")

    def interleaved(pairs: list[tuple[str, Callable[[str, bytes], None]]]) -> dict[str, float]:
        """Run the contenders value by value, alternating who goes first, so both
        see the same disk and CPU conditions (the machine may be shared)."""
        total = dict.fromkeys((name for name, _ in pairs), 0.0)
        for i, (k, v) in enumerate(zip(keys, values, strict=True)):
            for name, fn in pairs if i % 2 == 0 else pairs[::-1]:
                total[name] += _timed(lambda fn=fn, k=k, v=v: fn(k, v))
        return total

    def file_write_concurrent() -> None:
        for f in [kv.write(k, v) for k, v in zip(keys, values, strict=True)]:
            f.result()

    def file_read_concurrent() -> None:
        for f in [kv.read(k) for k in keys]:
            f.result()

    times: dict[str, list[float]] = {}
    # check once that the store returns the very bytes
    fresh(store_dir)
    kv.write("check", values[0]).result()
    if bytes(kv.read("check").result().value) != values[0]:
        raise RuntimeError("file store returned different bytes")
    for _ in range(reps):
        for d in (plain_dir, store_dir):
            fresh(d)
        os.makedirs(os.path.join(plain_dir, "v"))
        os.sync()  # start each write phase with no dirty pages queued
        phases = [
            interleaved([("os_write", os_write), ("file_write", file_write)]),
            interleaved([("os_read", os_read), ("file_read", file_read)]),
        ]
        for phase in phases:
            for name, t in phase.items():
                times.setdefault(name, []).append(t)
        fresh(store_dir)
        os.sync()
        times.setdefault("file_write_concurrent", []).append(_timed(file_write_concurrent))
        times.setdefault("file_read_concurrent", []).append(_timed(file_read_concurrent))
    return times


if __name__ == "__main__":
    main()
