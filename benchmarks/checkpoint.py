"""Checkpoint save/restore: tensorstore_py next to Orbax, same run, same disk.

    python benchmarks/checkpoint.py            # the full cases (1 GiB, 2,000 leaves, 2 processes)
    python benchmarks/checkpoint.py --small    # 64 MiB / 200 leaves: a quick check
    python benchmarks/checkpoint.py --cases single_1gib --systems tsp,orbax
    python benchmarks/checkpoint.py --device gpu --gib 8 --reps 3   # a train state on a GPU
    python benchmarks/checkpoint.py --device cpu --gib 0.25         # the same on CPU devices
    python benchmarks/checkpoint.py --incremental --reps 5  # hashing; full vs 90%-unchanged save (1 GiB)

``--device`` runs the accelerator case instead (benchmarks/_train_state.py: a
transformer-shaped train state, tensorstore_py vs Orbax vs the hardware's
floor, blocked / durable / restore seconds, extra RSS, every leaf checked
bit-exact, page cache dropped before restores when running as root). On a
machine with jax + GPU, orbax-checkpoint and tensorstore installed, carry the
wheels it lacks (``pip wheel --no-deps . -w .whl`` for this project, plus
numcodecs and crc32c, downloaded for its Python) and run, as one command from
the repository root::

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \
      && PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 benchmarks/checkpoint.py --device gpu --gib 8 --reps 3

The table with HBM full (``"auto"`` must pin; ``tsp_warm`` pins at manager
creation) next to the device-snapshot path, one command::

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 \
      && python3 benchmarks/checkpoint.py --device gpu --gib 8 --reps 2 --systems tsp,orbax \
      && python3 benchmarks/checkpoint.py --device gpu --gib 8 --reps 2 --hbm-full \
           --systems tsp,tsp_warm,tsp_pinned,orbax,floor

Without ``--device``, the CPU cases:

Cases (JAX arrays on CPU devices, ``file://`` roots in one scratch folder):

* ``single_1gib``: one process, one device, one 1 GiB float32 array.
* ``small_leaves``: one process, 2,000 leaves of 64 KiB each.
* ``tiny_leaves``: one process, 10,000 leaves of 1 KiB each (per-leaf overhead).
* ``two_proc_1gib``: 2 processes x 4 devices (``jax.distributed`` on 127.0.0.1),
  a 1 GiB float32 array sharded over a 2x4 mesh; restored with the save-time
  sharding and, as ``restore_resharded``, into the transposed sharding.

Systems: ``tsp`` (``CheckpointManager.save(...)`` then ``wait_until_finished``;
``restore`` into an abstract target), ``orbax`` (``StandardCheckpointer``, its
defaults), ``orbax_4mib`` (the same with ``SaveArgs(chunk_byte_size=4 MiB)``) and,
for scale, ``floor``: the same bytes written as 64 MiB files by 16 threads with
plain ``os.write`` + ``fsync`` and read back (no format, no checksums, no
commit: what the disk allows).
``tsp`` and the Orbax systems save twice (steps 1 and 2: ``save``/``blocked`` is
the first save, ``save2``/``blocked2`` the second, steady-state one) and
restore step 2. Every (case, system) runs in a fresh process (or pair of processes), so the
reported peak RSS (``ru_maxrss``) is that case's alone ("extra" = the peak minus
the peak once the state was built); save then restore of the same step, page
cache warm for every system alike. With ``--reps N`` each (case, system) runs N
times, systems interleaved in alternating order, and medians are printed. Times are seconds, from the
call to a durable, committed checkpoint (save) and to arrays on devices
(restore). Prints one table and ``ratio_<case>_<op>: orbax / tsp`` lines.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import _incremental  # this folder is on sys.path when run as a script
import _train_state
from _floor import read_files, write_files

MiB = 1 << 20
SYSTEMS = ["tsp", "orbax", "orbax_4mib", "floor"]
CASES = ["single_1gib", "small_leaves", "tiny_leaves", "two_proc_1gib"]


def _sizes(small: bool) -> dict[str, int]:
    return {"big_bytes": (64 if small else 1024) * MiB, "leaves": 200 if small else 2000,
            "leaf_bytes": 64 << 10, "tiny_leaves": 2000 if small else 10000, "tiny_bytes": 1 << 10}


# -- the measured side (runs in a child process) -----------------------------------------
def _values(leaf: int, index: tuple[slice, ...], shape: tuple[int, ...]) -> Any:
    """Pseudo-random float32 values of ``index`` of leaf ``leaf``, a pure function of
    the global position (so any process can check any restored block)."""
    import numpy as np

    rows = np.arange(*index[0].indices(shape[0]), dtype=np.uint64)
    cols = np.arange(*index[1].indices(shape[1]), dtype=np.uint64) * np.uint64(40503)
    out = np.empty((len(rows), len(cols)), np.float32)
    for a in range(0, len(rows), 256):  # in row blocks: temporaries stay small
        r = rows[a:a + 256, None] * np.uint64(2654435761) + np.uint64(leaf * 97)
        h = (r + cols[None, :]) % np.uint64(1 << 32)
        out[a:a + 256] = h / float(1 << 32) - 0.5
    return out



def _child(args: argparse.Namespace) -> None:
    import jax

    if args.nproc > 1:
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{args.port}", num_processes=args.nproc,
            process_id=args.pid,
        )
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    sizes = _sizes(args.small)
    devices = np.array(jax.devices())
    if args.case == "two_proc_1gib":
        mesh = Mesh(devices.reshape(2, 4), ("a", "b"))
        specs = {"x": P("a", "b")}
        resharded = {"x": P("b", "a")}
    else:
        mesh = Mesh(devices[:1].reshape(1, 1), ("a", "b"))
        specs, resharded = None, None
    if args.case in ("small_leaves", "tiny_leaves"):
        tiny = args.case == "tiny_leaves"
        n = sizes["tiny_bytes" if tiny else "leaf_bytes"] // 4
        shapes = {f"leaf_{i:05d}": (n // 128, 128) for i in range(sizes["tiny_leaves" if tiny else "leaves"])}
    else:
        side = int((sizes["big_bytes"] // 4) ** 0.5)
        shapes = {"x": (side, side)}

    def sharding(name: str, spec_map: Any) -> Any:
        spec = spec_map[name] if spec_map else P()
        return NamedSharding(mesh, spec)

    state = {}
    for li, (name, shape) in enumerate(shapes.items()):
        state[name] = jax.make_array_from_callback(
            shape, sharding(name, specs), lambda idx, shape=shape, li=li: _values(li, idx, shape)
        )
    jax.block_until_ready(state)
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def abstract(spec_map: Any) -> Any:
        return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding(k, spec_map))
                for k, v in state.items()}

    root = os.path.join(args.dir, f"{args.case}-{args.system}")
    out: dict[str, Any] = {}
    if args.system == "tsp":
        import tensorstore_py as tsp

        mgr = tsp.CheckpointManager(f"file://{root}/")
        for step in (1, 2):  # the first save, then the steady state of a training run
            t0 = time.perf_counter()
            mgr.save(step, state)
            out["save_blocked" if step == 1 else "save2_blocked"] = time.perf_counter() - t0
            mgr.wait_until_finished()
            out["save" if step == 1 else "save2"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        got = mgr.restore(2, target=abstract(specs))
        jax.block_until_ready(got)
        out["restore"] = time.perf_counter() - t0
        if resharded:
            del got
            t0 = time.perf_counter()
            got = mgr.restore(2, target=abstract(resharded))
            jax.block_until_ready(got)
            out["restore_resharded"] = time.perf_counter() - t0
    elif args.system == "floor":
        out.update(_floor(state, root))
        got = state
    else:
        import orbax.checkpoint as ocp

        ckptr = ocp.StandardCheckpointer()
        for step in (1, 2):
            path = os.path.join(root, str(step))
            t0 = time.perf_counter()
            if args.system == "orbax_4mib":
                save_args = jax.tree_util.tree_map(lambda _: ocp.SaveArgs(chunk_byte_size=4 * MiB), state)
                ckptr.save(path, state, save_args=save_args)
            else:
                ckptr.save(path, state)
            out["save_blocked" if step == 1 else "save2_blocked"] = time.perf_counter() - t0
            ckptr.wait_until_finished()
            out["save" if step == 1 else "save2"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        got = ckptr.restore(path, abstract(specs))
        jax.block_until_ready(got)
        out["restore"] = time.perf_counter() - t0
        if resharded:
            del got
            t0 = time.perf_counter()
            got = ckptr.restore(path, abstract(resharded))
            jax.block_until_ready(got)
            out["restore_resharded"] = time.perf_counter() - t0
        ckptr.close()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out["peak_rss_mib"] = peak / 1024
    # what saving and restoring added on top of the process with its state built
    out["extra_rss_mib"] = (peak - base_rss) / 1024
    # check the last restore against the saved values (a strided sample: a full
    # comparison would allocate more than the restore itself)
    name = next(iter(state))
    for shard in got[name].addressable_shards:
        sample = tuple(slice(sl.start, sl.stop, 97) for sl in shard.index)
        np.testing.assert_array_equal(
            np.asarray(shard.data)[::97, ::97], _values(0, sample, state[name].shape)
        )
    out["data_mib"] = sum(v.nbytes for v in state.values()) / MiB
    if args.pid == 0:
        with open(args.out, "w") as f:
            json.dump(out, f)
    if args.nproc > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("bench-done")


def _floor(state: dict[str, Any], root: str) -> dict[str, float]:
    """The disk's floor: the same bytes this process owns, as 64 MiB files written
    by 16 threads (write + fsync + directory fsync), then read back."""
    import numpy as np

    pieces = []
    for leaf in state.values():
        for shard in leaf.addressable_shards:
            if shard.replica_id == 0:
                flat = np.asarray(shard.data).reshape(-1).view(np.uint8)
                pieces += [flat[i:i + 64 * MiB] for i in range(0, len(flat), 64 * MiB)]
    save = write_files(pieces, root)
    restore = read_files(root, [len(p) for p in pieces])
    return {"save": save, "save_blocked": 0.0, "restore": restore}


# -- the driver ------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(case: str, system: str, scratch: str, small: bool) -> dict[str, Any]:
    nproc = 2 if case == "two_proc_1gib" else 1
    out = os.path.join(scratch, f"{case}-{system}.json")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={4 if nproc > 1 else 1}"
    port = _free_port()
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--case", case, "--system", system,
           "--dir", scratch, "--out", out, "--nproc", str(nproc), "--port", str(port)]
    if small:
        cmd.append("--small")
    procs = [subprocess.Popen(cmd + ["--pid", str(i)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(nproc)]
    logs = [p.communicate(timeout=1800)[0] for p in procs]
    for p, log in zip(procs, logs):
        if p.returncode != 0:
            raise SystemExit(f"{case}/{system} failed:\n{log[-3000:]}")
    shutil.rmtree(os.path.join(scratch, f"{case}-{system}"), ignore_errors=True)
    with open(out) as f:
        return json.load(f)  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="64 MiB and 200 leaves instead of 1 GiB and 2,000")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--dir", help="scratch folder (default: a temporary folder)")
    ap.add_argument("--reps", type=int, default=1,
                    help="repetitions per (case, system), systems interleaved; medians are printed")
    ap.add_argument("--device", choices=["cpu", "gpu"],
                    help="run the train-state case on jax's first device of this kind")
    ap.add_argument("--gib", type=float, help="train-state size in GiB (default: 8 on gpu, 0.25 on cpu)")
    ap.add_argument("--hbm-full", action="store_true",
                    help="with --device: fill device memory before saving, so that staging 'auto' must pin")
    ap.add_argument("--incremental", action="store_true",
                    help="hashing speeds, then a full save against a 90%%-unchanged one (_incremental.py)")
    # 1 GiB: a full save is bound by the disk, as a real state's is, not absorbed by the page
    # cache, and a save's fixed costs (record, previous manifest and digests, commit) weigh
    # what they do in a state of GiBs (docs/CHECKPOINTS.md "Incremental saves")
    ap.add_argument("--mib", type=float, default=1024, help="state size of --incremental (MiB)")
    ap.add_argument("--changed-last", action="store_true",
                    help="--incremental: the changed leaves are the last two, not the first two")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--op", help=argparse.SUPPRESS)
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--system", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--nproc", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--pid", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    gib = args.gib if args.gib is not None else 8.0 if args.device == "gpu" else 0.25
    if args.child and args.device:
        _train_state.run_child(args.op, args.system, gib, args.device, args.dir)
        return
    if args.child:
        _child(args)
        return
    scratch = args.dir or tempfile.mkdtemp(prefix="tsp-ckpt-bench-")
    if args.incremental:
        _incremental.main(scratch, args.mib, max(args.reps, 1), changed_last=args.changed_last)
        if not args.dir:
            shutil.rmtree(scratch, ignore_errors=True)
        return
    if args.device:
        systems = args.systems.split(",") if args.systems != ",".join(SYSTEMS) else _train_state.SYSTEMS
        _train_state.main(args.device, gib, systems, args.reps, scratch, hbm_full=args.hbm_full)
        if not args.dir:
            shutil.rmtree(scratch, ignore_errors=True)
        return
    results: dict[tuple[str, str], dict[str, Any]] = {}
    ops = ["save", "save_blocked", "save2", "save2_blocked", "restore", "restore_resharded"]
    systems = args.systems.split(",")
    print(f"{'case':15s} {'system':11s} {'save s':>8s} {'blocked s':>9s} {'save2 s':>8s} {'blocked2 s':>10s} "
          f"{'restore s':>9s} {'reshard s':>9s} {'peak RSS MiB':>12s} {'extra RSS MiB':>13s} {'data MiB':>8s}",
          flush=True)
    for case in args.cases.split(","):
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
        for rep in range(args.reps):
            # alternate the order so that a busy machine does not favour one system
            for system in systems if rep % 2 == 0 else systems[::-1]:
                runs[system].append(_run(case, system, scratch, args.small))
        for system in systems:
            r = {k: statistics.median(x[k] for x in runs[system]) for k in runs[system][0]}
            results[(case, system)] = r
            print(f"{case:15s} {system:11s} {r['save']:8.2f} {r['save_blocked']:9.3f} "
                  f"{r.get('save2', float('nan')):8.2f} {r.get('save2_blocked', float('nan')):10.3f} "
                  f"{r['restore']:9.2f} {r.get('restore_resharded', float('nan')):9.2f} "
                  f"{r['peak_rss_mib']:12.0f} {r['extra_rss_mib']:13.0f} {r['data_mib']:8.0f}", flush=True)
    for case in args.cases.split(","):
        for other in ("orbax", "orbax_4mib", "floor"):
            if (case, "tsp") not in results or (case, other) not in results:
                continue
            for op in ops:
                a, b = results[(case, other)].get(op), results[(case, "tsp")].get(op)
                if a and b:
                    print(f"ratio_{case}_{op}_vs_{other}: {a / b:.2f}x")
    if not args.dir:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
