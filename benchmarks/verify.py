"""``tensorstore-py verify`` throughput next to a plain full read of the same checkpoint.

    python benchmarks/verify.py [--size-gib 2] [--small] [--reps 3] [--dir DIR]

Saves one checkpoint step of ``--size-gib`` GiB (float32 leaves of 64 MiB
chunks; ``--small``: 128 MiB) on the local file store, then, alternating which
goes first in each repetition so both see the same page-cache state:

* ``plain_read``: ``tsp.checkpoint.restore`` of the whole step into numpy (what
  a training job reads);
* ``raw_read``: every data object read whole through the file kvstore, 8 at a
  time (no decoding, no checks: the I/O floor, for context);
* ``verify``: the ``verify`` command's function (every commit record, index
  node and data object read, every value's crc32c checked, every chunk's size
  checked against its declared shape).

Prints ``name: value unit`` lines (best of the repetitions) and
``ratio_verify_vs_plain_read: x`` (target >= 0.8).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import numpy as np
from _harness import emit, scratch_dir

import tensorstore_py as tsp
from tensorstore_py.commands.checks import verify
from tensorstore_py.core.future import spawn

GiB = 1 << 30
LEAF_BYTES = 256 << 20


def make_tree(nbytes: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    tree = {}
    left, i = nbytes, 0
    while left > 0:
        n = min(LEAF_BYTES, left)
        tree[f"layer{i:03d}"] = rng.random(n // 4 // 1024 * 1024, dtype=np.float32).reshape(-1, 1024)
        left -= n
        i += 1
    return tree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gib", type=float, default=2.0)
    ap.add_argument("--small", action="store_true", help="128 MiB instead of --size-gib")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = ap.parse_args()
    nbytes = (128 << 20) if args.small else int(args.size_gib * GiB)
    with scratch_dir("tsp-verify-bench-", args.dir) as tmp:
        url = f"file://{tmp}/ckpt/"
        tree = make_tree(nbytes)
        total = sum(a.nbytes for a in tree.values())
        t0 = time.perf_counter()
        tsp.checkpoint.save(url, tree, step=0).result()
        save_s = time.perf_counter() - t0
        del tree

        def plain() -> float:
            t = time.perf_counter()
            out = tsp.checkpoint.restore(url, step=0)
            dt = time.perf_counter() - t
            if sum(a.nbytes for a in out.values()) != total:
                raise SystemExit("plain read returned the wrong number of bytes")
            return dt

        def check() -> float:
            t = time.perf_counter()
            rep = spawn(verify(url)).result()
            dt = time.perf_counter() - t
            if not rep.ok:
                raise SystemExit(f"verify found problems: {rep.problems[:3]}")
            return dt

        def raw() -> float:
            t = time.perf_counter()
            n = spawn(_read_all_objects(f"file://{tmp}/ckpt/")).result()
            dt = time.perf_counter() - t
            if n < total:
                raise SystemExit("raw read returned too few bytes")
            return dt

        plain()  # warm the page cache once for all
        times: dict[Any, list[float]] = {plain: [], check: [], raw: []}
        for r in range(args.reps):
            order = (plain, check, raw) if r % 2 == 0 else (check, raw, plain)
            for fn in order:
                times[fn].append(fn())
    best = {fn.__name__: min(ts) for fn, ts in times.items()}
    emit("checkpoint_size", total / GiB, "GiB")
    for name, secs in (("save", save_s), ("plain_read", best["plain"]), ("raw_read", best["raw"]),
                       ("verify", best["check"])):
        emit(f"{name}_throughput", total / GiB / secs, "GiB/s")
    emit("ratio_verify_vs_plain_read", best["plain"] / best["check"], "x", digits=2)
    emit("ratio_verify_vs_raw_read", best["raw"] / best["check"], "x", digits=2)


async def _read_all_objects(url: str) -> int:
    """Every data object of the versioned store at ``url`` read whole, 8 at a time."""
    kv = await tsp.KvStore.open(url)
    names = await kv.list("data/")
    sem = asyncio.Semaphore(8)

    async def one(n: str) -> int:
        async with sem:
            return len((await kv.read(n)).value)

    return sum(await asyncio.gather(*(one(n) for n in names)))


if __name__ == "__main__":
    main()
