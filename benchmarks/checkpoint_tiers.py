"""A local checkpoint tier on a RAM disk next to a plain save to a file root.

    python benchmarks/checkpoint_tiers.py                      # 1 GiB on CPU devices, 3 reps
    python benchmarks/checkpoint_tiers.py --gib 0.25 --reps 2  # a quick check
    python benchmarks/checkpoint_tiers.py --device gpu --gib 7.55 --reps 3

The state: ``--gib`` GiB of float32 ``jax.Array`` leaves of 64 MiB (the last
one smaller) on device 0 (``--device cpu``: a CPU device; numpy leaves when JAX
is missing), values different at every step. Each rep, in this process:

* ``plain``: ``CheckpointManager(<scratch>/plain/)`` on the scratch disk
  (``--scratch``, default the system temp folder): ``save(step)`` then
  ``wait_until_finished()`` (``save_s``: call to durable commit at the root);
  ``restore(step, target=...)`` (``restore_s``: to arrays on the device).
* ``local``: ``CheckpointManager(<scratch>/persistent/, local=file:///dev/shm/...,
  persist_interval_steps=None)``: ``save(step).result()`` (``save_s``: call to
  the durable local commit on the RAM disk); ``restore(step, target=...)``
  from the local tier (``restore_s``); then ``save(step + 1, persist=True)``
  and ``wait_until_finished()`` (``local_save_and_promote_s``: local commit
  plus the promotion to the root, from the RAM disk's bytes; ``promote_s``:
  the promotion alone, from the local commit to the root's commit).

Every restore is checked bit-exact. Without ``--drop-caches`` the plain
restore reads the page cache the save just filled (as fast as a RAM disk):
pass it (as root) for restores from the disk itself. Prints medians as ``name: value unit``
lines and same-run ratios plain / local. The RAM disk's space and the
restored copies need about 4x the state in free memory.

On a GPU machine (jax with CUDA installed), carry this project's wheel and the
wheels it lacks, then, from the repository root::

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \\
      && PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 benchmarks/checkpoint_tiers.py \\
           --device gpu --gib 7.55 --reps 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import numpy as np

import tensorstore_py as tsp

LEAF_BYTES = 64 << 20


def make_state(gib: float, device: str, step: int) -> dict[str, Any]:
    total = int(gib * (1 << 30))
    sizes = [LEAF_BYTES] * (total // LEAF_BYTES) + ([total % LEAF_BYTES] if total % LEAF_BYTES else [])
    leaves = {}
    for i, nbytes in enumerate(sizes):
        n = nbytes // 4
        a = np.arange(n, dtype=np.float32) + np.float32(step * 1000 + i)
        leaves[f"l{i:03d}"] = a.reshape(-1, 1024) if n % 1024 == 0 else a
    if device == "numpy":
        return leaves
    import jax  # optional: the benchmark runs on numpy leaves without it

    dev = jax.devices(device)[0]
    out = jax.device_put(leaves, dev)
    jax.block_until_ready(out)
    return out  # type: ignore[no-any-return]


def target_of(state: dict[str, Any]) -> Any:
    if all(isinstance(v, np.ndarray) for v in state.values()):
        return None
    import jax  # optional, as above

    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in state.items()}


def check(out: dict[str, Any], gib: float, step: int) -> None:
    want = make_state(gib, "numpy", step)
    for k, v in want.items():
        if not np.array_equal(np.asarray(out[k]), v):
            raise AssertionError(f"leaf {k} of step {step} differs after the restore")


def drop_caches() -> None:
    """Make the plain restore read the disk, not the page cache (the RAM disk's
    pages are its storage and stay)."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", choices=("cpu", "gpu", "numpy"), default="cpu")
    ap.add_argument("--scratch", default=tempfile.gettempdir(), help="folder of the file roots")
    ap.add_argument("--shm", default="/dev/shm", help="the RAM disk of the local tier")
    ap.add_argument("--drop-caches", action="store_true",
                    help="drop the page cache before each plain restore (needs root; slows the whole host)")
    args = ap.parse_args()
    device = args.device
    if device != "numpy":
        try:
            import jax  # optional: numpy leaves without it
        except ImportError:
            device = "numpy"
    scratch = tempfile.mkdtemp(prefix="tsp-tiers-", dir=args.scratch)
    shm = tempfile.mkdtemp(prefix="tsp-tiers-", dir=args.shm)
    res: dict[str, list[float]] = {}

    def note(name: str, value: float) -> None:
        res.setdefault(name, []).append(value)

    def timed_restore(mgr: Any, name: str) -> None:
        t0 = time.perf_counter()
        out = mgr.restore(step, target=target)
        if target is not None:  # jax leaves: jax was imported above
            jax.block_until_ready(out)
        note(name, time.perf_counter() - t0)
        check(out, args.gib, step)

    try:
        for rep in range(args.reps):
            step = 10 * rep + 1
            state = make_state(args.gib, device, step)
            target = target_of(state)
            # plain: one file root
            plain = tsp.CheckpointManager(f"file://{scratch}/plain/", max_to_keep=1)
            t0 = time.perf_counter()
            plain.save(step, state)
            plain.wait_until_finished()
            note("plain_save_s", time.perf_counter() - t0)
            if args.drop_caches:
                drop_caches()
            timed_restore(plain, "plain_restore_s")
            plain.close()
            # local tier on the RAM disk
            mgr = tsp.CheckpointManager(f"file://{scratch}/persistent/", local=f"file://{shm}/local/",
                                        local_max_to_keep=1, max_to_keep=1)
            t0 = time.perf_counter()
            mgr.save(step, state).result()
            note("local_save_s", time.perf_counter() - t0)
            timed_restore(mgr, "local_restore_s")
            t0 = time.perf_counter()
            mgr.save(step + 1, state, persist=True).result()
            t1 = time.perf_counter()
            mgr.wait_until_finished()
            note("local_save_and_promote_s", time.perf_counter() - t0)
            note("promote_s", time.perf_counter() - t1)
            mgr.close()
            del state
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    gib = args.gib
    print(f"state: {gib} GiB on {device}, {args.reps} reps (medians), scratch {args.scratch}, "
          f"RAM disk {args.shm}, {os.cpu_count()} CPUs, plain restores from a "
          f"{'cold' if args.drop_caches else 'warm'} page cache")
    med = {k: statistics.median(v) for k, v in res.items()}
    for k, v in med.items():
        print(f"{k}: {v:.3f} s")
        print(f"{k.removesuffix('_s')}_gib_per_s: {gib / v:.2f} GiB/s")
    print(f"ratio_save_plain_over_local: {med['plain_save_s'] / med['local_save_s']:.2f} x")
    print(f"ratio_restore_plain_over_local: {med['plain_restore_s'] / med['local_restore_s']:.2f} x")


if __name__ == "__main__":
    main()
