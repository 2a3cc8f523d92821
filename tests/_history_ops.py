"""The randomized workload of :mod:`_history`: operations in real processes, and the nemesis.

Each operation runs in its own forked process group (multi-writer and staged
commits fork one more process per participant or stager), so a history costs
forks, not interpreters: the parent has imported everything once. The nemesis
kills an operation's processes with SIGKILL at a random time, kills a
single-writer commit at its k-th base-store write (before or after the write
lands), or stops a process for longer than the lease TTL (lease expiry).

Every operation saves its *intent* (the cells it will write and the values it
replaced) before it commits, and its outcome after: a process killed between
the two leaves an ``unknown`` operation that must be fully present or absent.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from _history import (
    ARRAY_CHUNKS,
    ARRAY_SHAPE,
    CELLS,
    SIZES,
    History,
    Op,
    cell_key,
    cell_value,
    collect,
    save_json,
    writer_of,
)

import tensorstore_py as tsp
from tensorstore_py.core.errors import CommitOutcomeUnknownError, TensorStoreError
from tensorstore_py.kvstore.fault import FaultKvStore
from tensorstore_py.kvstore.file import FileKvStore
from tensorstore_py.kvstore.transaction import Transaction
from tensorstore_py.kvstore.versioned import VersionedKvStore
from tensorstore_py.kvstore.versioned import leases as _leases
from tensorstore_py.kvstore.versioned.staging import commit_staged, protect, stage

T = 60
#: lease TTL and refresh in the operation processes (short, so stops expire leases)
LEASE_TTL = 1.5
LEASE_REFRESH = 0.4
#: gc grace (seconds) in histories that re-run a txn_id (longer than a history)
RERUN_GRACE = 60.0
#: weights of the operation kinds
KINDS = {"rmw": 5, "multi": 2, "staged": 2, "dask": 2, "cluster": 2, "gc": 3, "retain": 2, "reader": 3}
#: parts of the workload switched off, to tell anomalies apart: operation kinds and
#: "rerun" (same txn_id again), "pickle" (readers' hand-off), "kill", "stop"
OFF = set(filter(None, os.environ.get("TSP_HISTORY_OFF", "").split(",")))


class _SigKill(BaseException):
    """Raised by the fault store at the programmed write: kills this process instead."""

    def __init__(self, *args: Any) -> None:
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)


def _outcome(e: BaseException) -> dict[str, Any]:
    status = "unknown" if isinstance(e, CommitOutcomeUnknownError) else "fail"
    return {"status": status, "error": f"{type(e).__name__}: {e}"[:400]}


def _rmw_cells(view: Any, op: int, cells: list[int], rng: random.Random) -> dict[int, tuple[int, int]]:
    """Read ``cells`` through ``view`` and write op's values over them; return the intent."""
    writes: dict[int, tuple[int, int]] = {}
    for c in cells:
        r = view.read(cell_key(c)).result(T)
        prev = writer_of(bytes(r.value)) if r.value is not None else -1
        size = SIZES[rng.randrange(len(SIZES) - 1)] if rng.random() < 0.85 else SIZES[-1]
        writes[c] = (prev, size)
    return writes


def _write_cells(view: Any, op: int, writes: dict[int, tuple[int, int]]) -> None:
    futs = [view.write(cell_key(c), cell_value(op, p, c, s)) for c, (p, s) in writes.items()]
    for f in futs:
        f.result(T)


def _intent(res: Path, name: str, writes: dict[int, tuple[int, int]], inc: bool = False) -> None:
    save_json(res / f"{name}.intent.json", {"writes": {str(c): list(w) for c, w in writes.items()}, "inc": inc})


# -- the operations (each runs in a forked process; returns its outcome) ---------------------------
def op_rmw(root: str, res: Path, op: int, rng: random.Random, spec: dict[str, Any]) -> dict[str, Any]:
    base: Any = FileKvStore(path=root)
    if spec.get("kill_at"):
        base = FaultKvStore(base)
        base.inject(op="write", nth=spec["kill_at"], error=_SigKill, after_effect=spec["after"])
    kv = VersionedKvStore(base)
    cells = rng.sample(range(CELLS), rng.randint(1, 3))
    txn = Transaction(metadata={"op": op})
    view = kv.with_transaction(txn)
    writes = _rmw_cells(view, op, cells, rng)
    time.sleep(rng.random() * 0.3)  # a stale base is what conflicts are for
    _write_cells(view, op, writes)
    _intent(res, str(op), writes)
    info = txn.commit().result(T)
    return {"status": "ok", "version": info.version}


def _participant(root: str, res: Path, op: int, p: int, n: int, cells: list[int], seed: int) -> dict[str, Any]:
    kv = VersionedKvStore(FileKvStore(path=root))
    txn = Transaction(txn_id=f"h{op}", process_index=p, process_count=n, timeout=15, metadata={"op": op})
    view = kv.with_transaction(txn)
    writes = _rmw_cells(view, op, cells, random.Random(seed))
    _write_cells(view, op, writes)
    _intent(res, f"{op}.p{p}", writes)
    info = txn.commit().result(T)
    return {"status": "ok", "version": info.version}


def _fork(fn: Any, *args: Any) -> int:
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            fn(*args)
        except BaseException:
            code = 1
        os._exit(code)
    return pid


def _wait(pids: list[int]) -> list[int]:
    return [os.waitpid(pid, 0)[1] for pid in pids]


def op_multi(root: str, res: Path, op: int, rng: random.Random, spec: dict[str, Any]) -> dict[str, Any]:
    n = rng.randint(2, 3)
    cells = rng.sample(range(CELLS), n)
    pids = [_fork(_participant, root, res, op, p, n, [cells[p]], rng.randrange(1 << 30)) for p in range(1, n)]
    try:
        out = _participant(root, res, op, 0, n, [cells[0]], rng.randrange(1 << 30))
    finally:
        _wait(pids)
    return out


def _rerun(fn: Any) -> dict[str, Any]:
    """Run again what committed (same txn_id): the version it returns, or its error."""
    try:
        return {"rerun_version": fn().version}
    except TensorStoreError as e:
        return {"rerun_error": f"{type(e).__name__}: {e}"[:300]}


def _stager(root: str, res: Path, op: int, p: int, cells: list[int], seed: int) -> None:
    kv = VersionedKvStore(FileKvStore(path=root))
    txn = Transaction()
    view = kv.with_transaction(txn)
    writes = _rmw_cells(view, op, cells, random.Random(seed))
    _write_cells(view, op, writes)
    part = stage(txn, kv).result(T)
    (res / f"{op}.s{p}.pkl.tmp").write_bytes(pickle.dumps((part, writes)))
    os.replace(res / f"{op}.s{p}.pkl.tmp", res / f"{op}.s{p}.pkl")


def _stage_all(root: str, res: Path, op: int, rng: random.Random, cells: list[int]) -> tuple[list[Any], dict[int, Any]]:
    pids = [_fork(_stager, root, res, op, p, [c], rng.randrange(1 << 30)) for p, c in enumerate(cells)]
    _wait(pids)
    parts, writes = [], {}
    for p in range(len(cells)):
        part, w = pickle.loads((res / f"{op}.s{p}.pkl").read_bytes())
        (res / f"{op}.s{p}.pkl").unlink()
        parts.append(part)
        writes.update(w)
    return parts, writes


def op_staged(root: str, res: Path, op: int, rng: random.Random, spec: dict[str, Any]) -> dict[str, Any]:
    """Under the driving process's lease (``protect``): stagers in their own processes; a
    pause (a long ingest); ONE commit; maybe a re-run of the whole thing with the same
    txn_id (a user re-running after KilledWorker)."""
    kv = VersionedKvStore(FileKvStore(path=root))
    cells = rng.sample(range(CELLS), rng.randint(1, 3))
    hold = protect(kv).result(T)  # the driving process's lease over the staged data
    try:
        parts, writes = _stage_all(root, res, op, rng, cells)
        time.sleep(spec["ingest"])
        _intent(res, str(op), writes)
        info = commit_staged(kv, parts, txn_id=f"h{op}", metadata={"op": op}).result(T)
        out: dict[str, Any] = {"status": "ok", "version": info.version}
        if spec.get("rerun"):
            parts, _ = _stage_all(root, res, op, rng, cells)
            out["extra"] = _rerun(lambda: commit_staged(kv, parts, txn_id=f"h{op}", metadata={"op": op}).result(T))
    finally:
        hold.release()
    return out


def _slow(block: np.ndarray, delay: float) -> np.ndarray:
    time.sleep(delay)
    return block


def op_dask(root: str, res: Path, op: int, rng: random.Random, spec: dict[str, Any]) -> dict[str, Any]:
    """``tspd.store(to_dask(ts) + 1, ts)``: an in-place increment of the whole array."""
    import dask  # optional dependency of the dask edge

    import tensorstore_py.dask as tspd

    ts = tsp.open(f"versioned+file://{root}/").result(T)
    src = (tspd.to_dask(ts) + 1).map_blocks(_slow, spec["ingest"] / 4, dtype=np.int64)
    save_json(res / f"{op}.intent.json", {"writes": {}, "inc": True})
    # Dask's process scheduler, its pool forked from this process: every stage task
    # runs in a process of its own that unpickled the view
    with dask.config.set({"scheduler": "processes", "num_workers": 2, "multiprocessing.context": "fork"}):
        info = tspd.store(src, ts, txn_id=f"h{op}", metadata={"op": op})
        out: dict[str, Any] = {"status": "ok", "version": info.version}
        if spec.get("rerun"):
            out["extra"] = _rerun(lambda: tspd.store(tspd.to_dask(ts) + 1, ts, txn_id=f"h{op}",
                                                     metadata={"op": op}))
    return out


def op_cluster(root: str, res: Path, op: int, rng: random.Random, spec: dict[str, Any]) -> dict[str, Any]:
    """The in-place increment on the run's LocalCluster; a worker may be killed mid-graph
    (Dask recomputes what it lost); a run that failed is re-run with its txn_id, as a user
    would after KilledWorker."""
    import distributed  # optional dependency of the dask edge

    import tensorstore_py.dask as tspd

    ts = tsp.open(f"versioned+file://{root}/").result(T)
    save_json(res / f"{op}.intent.json", {"writes": {}, "inc": True})
    with distributed.Client(spec["cluster"], timeout=30, set_as_default=True) as client:
        src = (tspd.to_dask(ts) + 1).map_blocks(_slow, spec["ingest"] / 4, dtype=np.int64)
        fut = client.compute(tspd.store(src, ts, txn_id=f"h{op}", metadata={"op": op}, compute=False))
        if spec["kill_worker"] is not None:
            time.sleep(spec["kill_worker"])
            # no worker to kill while the cluster restarts one killed earlier
            with contextlib.suppress(Exception):
                os.kill(rng.choice(sorted(client.run(os.getpid).values())), signal.SIGKILL)
        try:
            info = fut.result(timeout=40)
            out: dict[str, Any] = {"status": "ok", "version": info.version}
        except Exception as e:
            if isinstance(e, TensorStoreError):
                raise
            again = tspd.store(tspd.to_dask(ts) + 1, ts, txn_id=f"h{op}", metadata={"op": op})
            return {"status": "ok", "version": again.version, "extra": {"first_run": repr(e)[:200]}}
        if spec.get("rerun"):
            out["extra"] = _rerun(lambda: tspd.store(tspd.to_dask(ts) + 1, ts, txn_id=f"h{op}",
                                                     metadata={"op": op}))
    return out


def start_cluster() -> tuple[subprocess.Popen[str], str]:
    """A LocalCluster (2 worker processes) in a process of its own, for a whole run:
    returns the process (it lives until its stdin closes) and the scheduler's address."""
    code = ("import sys; from distributed import LocalCluster; "
            "c = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None); "
            "print(c.scheduler_address, flush=True); sys.stdin.read(); c.close()")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def op_gc(root: str, res: Path, op: int, rng: random.Random, spec: dict[str, Any]) -> dict[str, Any]:
    kv = VersionedKvStore(FileKvStore(path=root))
    rep = kv.gc(grace=spec["grace"], dry_run=False, reclaim_deleted=rng.random() < 0.7).result(T)
    return {"status": "ok", "extra": {"deleted": rep.deleted_count}}


def op_retain(root: str, res: Path, op: int, rng: random.Random, spec: dict[str, Any]) -> dict[str, Any]:
    kv = VersionedKvStore(FileKvStore(path=root))
    newest = kv.newest_version().result(T)
    alive = [v for v in range(1, newest) if not kv.commit_details(v).result(T).deleted]
    doomed = rng.sample(alive, len(alive) // 2) if alive else []
    if doomed:
        kv.delete_versions(doomed).result(T)
    return {"status": "ok", "extra": {"deleted_versions": doomed}}


def _read_state(ts: Any) -> dict[str, int]:
    """What the leased array view ``ts`` (at the store's root) reads: cell -> writer, array."""
    got: dict[str, int] = {}
    for c in range(CELLS):
        r = ts.kvstore.read(cell_key(c)).result(T)
        got[str(c)] = writer_of(bytes(r.value)) if r.value is not None else -1
    arr = ts.read().result(T)
    got["array"] = int(arr[0]) if (arr == arr[0]).all() else -1
    return got


def _pickled_reader(blob: bytes, res: Path, op: int) -> None:
    try:
        save_json(res / f"{op}.child.json", {"reads": _read_state(pickle.loads(blob))})
    except TensorStoreError as e:
        save_json(res / f"{op}.child.json", {"error": f"{type(e).__name__}: {e}"[:400]})


def op_reader(root: str, res: Path, op: int, rng: random.Random, spec: dict[str, Any]) -> dict[str, Any]:
    """Open the newest version as an array view (a reader lease), read, wait while gc and
    retention run, read again here and in a process the pickled view was handed to."""
    kv = VersionedKvStore(FileKvStore(path=root))
    v = kv.newest_version().result(T)
    ts = tsp.open(f"versioned+file://{root}/@{v}").result(T)
    save_json(res / f"{op}.pin.json", {"pinned": v})
    out: dict[str, Any] = {"status": "ok", "pinned": v, "reads": [_read_state(ts)]}
    try:
        time.sleep(spec["hold"])
        if spec["pickle"]:
            _wait([_fork(_pickled_reader, pickle.dumps(ts), res, op)])
        out["reads"].append(_read_state(ts))
        if spec["pickle"]:
            child = json.loads((res / f"{op}.child.json").read_text())
            if "error" in child:
                return {**out, "status": "fail", "error": "pickled view: " + child["error"]}
            out["reads"].append(child["reads"])
    except TensorStoreError as e:
        return {**out, **_outcome(e)}
    return out


OPS = {"rmw": op_rmw, "multi": op_multi, "staged": op_staged, "dask": op_dask, "cluster": op_cluster,
       "gc": op_gc, "retain": op_retain, "reader": op_reader}


def _run_op(root: str, res: Path, o: Op, seed: int, spec: dict[str, Any]) -> None:
    """Body of an operation's process: short leases, run, save the outcome."""
    os.setpgid(0, 0)
    _leases.TTL, _leases.REFRESH = LEASE_TTL, LEASE_REFRESH
    try:
        out = OPS[o.kind](root, res, o.id, random.Random(seed), spec)
    except BaseException as e:
        out = _outcome(e)
        with contextlib.suppress(Exception):
            pin = (res / f"{o.id}.pin.json")
            if pin.exists():
                out["pinned"] = json.loads(pin.read_text())["pinned"]
    save_json(res / f"{o.id}.json", out)


# -- a history ----------------------------------------------------------------------------------------
def setup_store(root: str) -> int:
    """Version 1: every cell (written by "op 0"); version 2: the array. Returns 2."""
    kv = VersionedKvStore(FileKvStore(path=root))
    txn = Transaction(metadata={"setup": 1})
    view = kv.with_transaction(txn)
    for c in range(CELLS):
        view.write(cell_key(c), cell_value(0, -1, c, SIZES[c % len(SIZES)])).result(T)
    txn.commit().result(T)
    tsp.open(f"versioned+file://{root}/", create=True, shape=ARRAY_SHAPE, chunks=ARRAY_CHUNKS,
             dtype="int64").result(T)
    return kv.newest_version().result(T)


def plan(seed: int, dask_ok: bool, cluster: str | None = None) -> list[tuple[Op, float, dict[str, Any]]]:
    """The operations of history ``seed``: (op, start offset in seconds, its parameters);
    ``cluster``: the address of the run's LocalCluster (none: no operations on it)."""
    rng = random.Random(seed)
    kinds = [k for k in KINDS if k not in OFF and (dask_ok or k != "dask") and (cluster or k != "cluster")]
    out = []
    for i in range(1, rng.randint(6, 11) + 1):
        kind = rng.choices(kinds, [KINDS[k] for k in kinds])[0]
        spec: dict[str, Any] = {
            "seed": rng.randrange(1 << 30),
            "ingest": rng.choice([0.0, 0.3, 1.2]),
            "rerun": rng.random() < 0.3 and "rerun" not in OFF,
            "grace": rng.choice([0.0, 0.2, 1.0]),
            "hold": rng.uniform(0.3, 1.0),
            "kill_after": rng.uniform(0.05, 1.5) if rng.random() < 0.2 and "kill" not in OFF else None,
            "stop": (rng.uniform(LEASE_TTL + 0.3, LEASE_TTL + 1.0)
                     if rng.random() < 0.06 and "stop" not in OFF else None),
            "pickle": "pickle" not in OFF,
            "cluster": cluster,
            "kill_worker": rng.uniform(0.1, 1.0) if rng.random() < 0.5 and "kill" not in OFF else None,
        }
        if kind == "rmw" and rng.random() < 0.2 and "kill" not in OFF:
            spec["kill_at"], spec["after"] = rng.randint(1, 8), rng.random() < 0.5
        out.append((Op(i, kind), rng.uniform(0, 1.2), spec))
    if any(spec["rerun"] for o, _, spec in out if o.kind in ("staged", "dask", "cluster")):
        # a txn_id is remembered until gc ages out its result object (docs: staging):
        # a history that re-runs ids collects with graces longer than itself
        for o, _, spec in out:
            spec["grace"] = max(spec["grace"], RERUN_GRACE) if o.kind == "gc" else spec["grace"]
    return out


def run_history(seed: int, root: Path, *, dask_ok: bool = True, cluster: str | None = None,
                deadline: float = 30.0) -> History:
    """Run history ``seed`` on a fresh store at ``root`` and collect it (not yet checked)."""
    root.mkdir(parents=True)
    res = root.parent / (root.name + "-res")
    res.mkdir()
    h = History(seed, str(root))
    h.setup_versions = setup_store(str(root))
    steps = plan(seed, dask_ok, cluster)
    h.ops = [o for o, _, _ in steps]
    t0 = time.monotonic()
    pending = sorted(steps, key=lambda s: s[1])
    running: dict[int, tuple[Op, dict[str, Any], float]] = {}
    stopped: dict[int, float] = {}
    while pending or running:
        now = time.monotonic() - t0
        while pending and pending[0][1] <= now:
            o, _, spec = pending.pop(0)
            pid = os.fork()
            if pid == 0:
                try:
                    _run_op(str(root), res, o, spec["seed"], spec)
                finally:
                    os._exit(0)
            running[pid] = (o, spec, now)
        for pid, (o, spec, start) in list(running.items()):
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                del running[pid]
                continue
            age = now - start
            if spec["kill_after"] is not None and age > spec["kill_after"] or now > deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
                o.extra["killed"] = round(age, 3)
                spec["kill_after"] = None
            elif spec["stop"] is not None and pid not in stopped and age > 0.2:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGSTOP)
                stopped[pid] = now + spec["stop"]
                o.paused = True
            elif pid in stopped and now > stopped[pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGCONT)
                stopped[pid] = float("inf")
        time.sleep(0.01)
    for o in h.ops:
        collect(o, res)
    return h
