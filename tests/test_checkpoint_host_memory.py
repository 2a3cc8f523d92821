"""Extra host memory of a streamed save and of a restore: at most 1.25x their budgets.

Subprocesses on CPU devices; the peak RSS is ``testing.rss.PeakRss`` (the peak of
the process image from the measured call on, not ``ru_maxrss``, which a child
inherits across fork and exec). Each measured call comes after a warm-up with
the same shapes (code paths loaded, functions compiled), and the host pool's
free slots are returned to the system first, so the slots the call needs are
counted. On CPU devices a restored array lives in host memory: what a restore
holds is counted beyond the restored arrays.

glibc's malloc runs with a fixed mmap threshold of 1 MiB (``MALLOC_MMAP_THRESHOLD_``),
so every large buffer is a mapping of its own, returned to the system when it
is freed: the peak is then what the call holds at once. With the default
(dynamic) threshold, buffers freed by the warm-up stay in malloc's heap and are
reused unseen, and the same save measured anywhere from 8 to 64 MiB.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tensorstore_py as tsp

pytest.importorskip("jax")

MiB = 1 << 20

_RSS = """
import gc, json, sys
import numpy as np, jax, jax.numpy as jnp
import tensorstore_py as tsp
from tensorstore_py.checkpoint import SaveOptions
from tensorstore_py.testing.rss import PeakRss
op, root, comp, budget, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
comp = None if comp == "none" else comp
dev = jax.devices()[0]
rows = n // 4 // 4 // 1024

def leaf(i):
    w = np.random.default_rng(i).integers(0, 16, size=(rows, 1024), dtype=np.uint8).astype(np.float32)
    w[:, 0] = np.arange(rows) + i
    return w

def pools_trimmed():
    try:  # slots the warm-up made are the measured call's to make again
        from tensorstore_py.checkpoint.hostpool import trim_pools
        trim_pools()
    except ImportError:
        pass
    gc.collect()

out = {}
if op == "save":
    opts = SaveOptions(staging="pinned_host", max_bytes_in_flight=budget, target_chunk_bytes=budget // 4,
                       max_staging_bytes=budget, compression=comp)
    mgr = tsp.CheckpointManager(root, options=opts)
    for step in (0, 1):  # step 0 warms the code paths up with the same shapes
        state = {f"w{i}": jax.device_put(leaf(i + 10 * step), dev) for i in range(4)}
        jax.block_until_ready(state)
        pools_trimmed()
        rss = PeakRss()
        mgr.save(step, state).result()
        out["pinned_host"] = rss.extra()
        del state
    back = mgr.restore(1)
    assert all(back[f"w{i}"].tobytes() == leaf(i + 10).tobytes() for i in range(4))
else:
    sh = jax.sharding.SingleDeviceSharding(dev)
    target = {f"w{i}": jax.ShapeDtypeStruct((rows, 1024), jnp.float32, sharding=sh) for i in range(4)}
    for assemble in ("host", "device"):
        for step in (0, 1):
            pools_trimmed()
            rss = PeakRss()
            got = tsp.checkpoint.restore(root, step=step, target=target, assemble=assemble,
                                         max_bytes_in_flight=budget)
            jax.block_until_ready(got)
            out[assemble] = rss.extra() - n  # beyond the restored arrays (host memory on CPU)
            assert all(np.asarray(got[f"w{i}"]).tobytes() == leaf(i + 10 * step).tobytes() for i in range(4))
            del got
print(json.dumps(out))
"""

_N, _BUDGET = 256 * MiB, 32 * MiB


def _extra_rss(op: str, root: str, compression: str) -> dict[str, int]:
    r = subprocess.run([sys.executable, "-c", _RSS, op, root, compression, str(_BUDGET), str(_N)],
                       capture_output=True, text=True, timeout=300, check=False,
                       env=dict(os.environ, JAX_PLATFORMS="cpu", MALLOC_MMAP_THRESHOLD_=str(MiB)))
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _leaf(i: int, n: int) -> np.ndarray:
    rows = n // 4 // 4 // 1024
    w = np.random.default_rng(i).integers(0, 16, size=(rows, 1024), dtype=np.uint8).astype(np.float32)
    w[:, 0] = np.arange(rows) + i
    return w


_needs_clear_refs = pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK),
                                       reason="needs /proc/self/clear_refs")


@_needs_clear_refs
@pytest.mark.parametrize("compression", ["none", pytest.param("zstd", marks=pytest.mark.slow)])
def test_a_streamed_pinned_save_holds_at_most_1_25x_its_budget(tmp_path: Path, compression: str) -> None:
    # 256 MiB in 4 leaves of 64 MiB, chunks of 8 MiB, a 32 MiB write budget and
    # staging limit: the save streams, and its host copies are the pool's slots
    # (before: the chunk sliced into a device buffer, then copied to pinned
    # memory, 2x the budget)
    extra = _extra_rss("save", f"file://{tmp_path}/", compression)["pinned_host"]
    print(f"streamed pinned save, {compression}: {extra / MiB:.1f} MiB extra on a {_BUDGET // MiB} MiB budget")
    assert extra <= 1.25 * _BUDGET, extra / MiB


@_needs_clear_refs
@pytest.mark.parametrize("compression", [pytest.param("none", marks=pytest.mark.slow), "zstd"])
def test_a_restore_holds_at_most_1_25x_its_budget(tmp_path: Path, compression: str) -> None:
    # the same 256 MiB restored with a 32 MiB budget into single-device targets:
    # each chunk is read (or decoded) into a slot and copied into its block
    # ("host") or put on the device ("device"); a decoded chunk's stored bytes
    # count against the budget beside its slot
    root = f"file://{tmp_path}/"
    comp = None if compression == "none" else compression
    opts = tsp.checkpoint.SaveOptions(target_chunk_bytes=_BUDGET // 4, compression=comp)
    for step in (0, 1):
        tsp.checkpoint.save(root, {f"w{i}": _leaf(i + 10 * step, _N) for i in range(4)}, step=step,
                            options=opts).result()
    for assemble, extra in _extra_rss("restore", root, compression).items():
        print(f"restore, {compression}, assemble={assemble}: {extra / MiB:.1f} MiB extra on a "
              f"{_BUDGET // MiB} MiB budget")
        assert extra <= 1.25 * _BUDGET, (assemble, extra / MiB)
