"""Pinned staging that blocks for the copy alone, and "auto" that is safe in a
training loop, on CPU devices (which have the ``pinned_host`` memory kind too).

* ``"pinned_host"`` staging copies the whole state off the devices in one
  batched copy when it fits the host staging limit (``max_staging_bytes``,
  separate from the write budget), so ``save()`` returns before slow writes end;
* a state over that limit streams, says why, and never slices a shard on the
  device when the shard fits the write budget;
* ``"auto"`` decides from the room beside the training step's peak;
* a device snapshot that runs out of device memory falls back to pinned staging.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp

import tensorstore_py as tsp
from tensorstore_py.checkpoint import SaveOptions, saving
from tensorstore_py.errors import InvalidArgumentError
from tensorstore_py.kvstore.fault import FaultKvStore, FaultRule

GiB = 1 << 30


def _slow_root(path: Path, latency: float) -> FaultKvStore:
    """The root's base store with every data-object write delayed by ``latency`` s."""
    base = tsp.KvStore.open(f"file://{path}/").result()
    return FaultKvStore(base, schedule=[FaultRule(op="write", key_pattern="data/*", error=None, latency=latency)])


def _state() -> tuple[dict[str, np.ndarray], dict[str, jax.Array]]:
    rng = np.random.default_rng(11)
    want = {f"w{i}": rng.standard_normal((256, 512)).astype(np.float32) for i in range(4)}  # 512 KiB each
    want["bf16"] = want["w0"].astype(jnp.bfloat16)
    return want, {k: jnp.asarray(v) for k, v in want.items()}


def _check(mgr: tsp.CheckpointManager, step: int, want: dict[str, np.ndarray]) -> None:
    got = mgr.restore(step)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].tobytes() == v.tobytes(), k


def test_pinned_staging_blocks_for_the_copy_not_for_the_writes(tmp_path: Path) -> None:
    # 2.25 MiB in 256 KiB chunks (each written to its own data object), a 256 KiB
    # write budget and 0.1 s per data write: the writes take about a second;
    # save() must only wait for the copy
    want, state = _state()
    opts = SaveOptions(staging="pinned_host", target_chunk_bytes=256 << 10, max_bytes_in_flight=256 << 10)
    mgr = tsp.CheckpointManager(_slow_root(tmp_path, 0.1), options=opts)
    t0 = time.perf_counter()
    fut = mgr.save(1, state)
    blocked = time.perf_counter() - t0
    assert not fut.done()
    for k in list(state):  # the caller replaces its arrays at once
        state.pop(k).delete()
    fut.result()
    durable = time.perf_counter() - t0
    assert durable > 0.5, durable
    assert blocked < 0.1 * durable, (blocked, durable)
    _check(mgr, 1, want)


def test_pinned_staging_over_the_host_limit_streams_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    want, state = _state()
    slices = []
    real_slice = jax.lax.slice
    monkeypatch.setattr(jax.lax, "slice", lambda *a, **k: slices.append(a[1]) or real_slice(*a, **k))
    # each 512 KiB shard is 4 chunks and fits the 512 KiB write budget: it leaves the
    # device whole and is cut on the host (no slice on the device, where HBM is short)
    opts = SaveOptions(staging="pinned_host", target_chunk_bytes=128 << 10, max_bytes_in_flight=512 << 10,
                       max_staging_bytes=64 << 10)
    mgr = tsp.CheckpointManager(f"file://{tmp_path}/", options=opts)
    with caplog.at_level(logging.INFO, logger="tensorstore_py.checkpoint"):
        mgr.save(1, state).result()
    assert any("exceed the host staging limit of 65536 bytes" in r.getMessage() for r in caplog.records), caplog.text
    assert slices == []
    _check(mgr, 1, want)
    # a shard larger than the write budget still leaves chunk by chunk (bounded memory);
    # not incremental: the same arrays as step 1 would be linked, not copied at all.
    # On CPU devices each chunk is copied from a host view of the shard into a slot
    # of the host pool: no slice on the device
    opts = SaveOptions(staging="pinned_host", target_chunk_bytes=128 << 10, max_bytes_in_flight=256 << 10,
                       max_staging_bytes=64 << 10, incremental=False)
    tsp.CheckpointManager(f"file://{tmp_path}/", options=opts).save(2, state).result()
    assert slices == []
    _check(mgr, 2, want)
    # on an accelerator (taken here by CPU devices) each chunk is sliced on the device
    monkeypatch.setattr(saving, "fills_on_host", lambda src: False)
    tsp.CheckpointManager(f"file://{tmp_path}/", options=opts).save(3, state).result()
    assert len(slices) == 4 * 4  # the four 512 KiB shards; the 256 KiB bf16 one fits the budget
    _check(mgr, 3, want)


def test_max_staging_bytes_is_checked() -> None:
    for bad in (-1, 1.5, True, "1G"):
        with pytest.raises(InvalidArgumentError, match="max_staging_bytes must be an int >= 0 or None"):
            SaveOptions(max_staging_bytes=bad)  # type: ignore[arg-type]


def test_auto_counts_the_training_steps_peak_not_what_is_in_use_between_steps() -> None:
    from tensorstore_py.checkpoint.staging import room_for_copy

    # an 80 GB device between two steps: 20 GiB in use, but the step peaks at 70 GiB
    stats = {"bytes_limit": 80 * GiB, "bytes_in_use": 20 * GiB, "peak_bytes_in_use": 70 * GiB,
             "largest_free_block_bytes": 60 * GiB}
    assert not room_for_copy(stats, 12 * GiB)  # 60 GiB free now, 10 GiB during the next step
    assert room_for_copy(stats, 8 * GiB)
    # fragmented: the room is bounded by the largest free block
    frag = {"bytes_limit": 80 * GiB, "bytes_in_use": 20 * GiB, "peak_bytes_in_use": 20 * GiB,
            "largest_free_block_bytes": 4 * GiB}
    assert not room_for_copy(frag, 8 * GiB)
    assert room_for_copy(frag, 3 * GiB)
    assert not room_for_copy(None, 1) and not room_for_copy({}, 1)


def test_a_device_out_of_memory_while_staging_falls_back_to_pinned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the device snapshot (a copy into device memory) fails as a full GPU fails it
    want, state = _state()
    real_put = jax.device_put

    def device_put(x, device=None, *, may_alias=None, **kw):  # type: ignore[no-untyped-def]
        if may_alias is False:
            raise jax.errors.JaxRuntimeError(
                "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1310720 bytes."
            )
        return real_put(x, device, may_alias=may_alias, **kw)

    monkeypatch.setattr(jax, "device_put", device_put)
    mgr = tsp.CheckpointManager(f"file://{tmp_path}/", options=SaveOptions(staging="device"))
    with caplog.at_level(logging.WARNING, logger="tensorstore_py.checkpoint"):
        fut = mgr.save(1, state)
    for k in list(state):
        state.pop(k).delete()
    fut.result()
    assert any("staging in pinned host memory instead" in r.getMessage() for r in caplog.records), caplog.text
    _check(mgr, 1, want)


def test_warm_staging_pins_ahead_and_saves_stay_exact(tmp_path: Path) -> None:
    want, state = _state()
    nbytes = sum(v.nbytes for v in want.values())
    mgr = tsp.CheckpointManager(f"file://{tmp_path}/", warm_staging=nbytes,
                                options=SaveOptions(staging="pinned_host"))
    assert mgr.warmed_bytes == nbytes * len(jax.local_devices())
    mgr.save(1, state).result()
    _check(mgr, 1, want)
    for bad in (-1, 1.5, True):
        with pytest.raises(InvalidArgumentError, match="warm_staging must be a number of bytes >= 0"):
            tsp.CheckpointManager(f"file://{tmp_path}/", warm_staging=bad)  # type: ignore[arg-type]
