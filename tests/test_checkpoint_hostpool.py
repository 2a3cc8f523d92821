"""The host buffer pool of checkpoint saves and restores (checkpoint/hostpool.py).

Slots are bounded, lazily made and reused; a restore reads into them and no
restored array ever views one (a later restore reusing the slots leaves earlier
results unchanged). The host memory this bounds: test_checkpoint_host_memory.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

import tensorstore_py as tsp
from tensorstore_py.checkpoint import SaveOptions
from tensorstore_py.checkpoint.hostpool import SLOT_GRANULE, HostPool, shared_pool, slot_bytes_for

MiB = 1 << 20


def test_slots_are_made_lazily_up_to_the_limit_and_reused() -> None:
    async def run() -> tuple[list[int], int, int]:
        pool = HostPool(3 * MiB, 8 * MiB)  # slots of 3 MiB, two fit in 8 MiB
        made = []
        for _ in range(5):
            a = await pool.acquire()
            b = await pool.acquire()
            a.array((3 * MiB,), np.uint8)[:] = 7
            made.append(pool.made)
            a.release()
            b.release()
        return made, pool.made_total, pool.capacity

    made, total, capacity = asyncio.run(run())
    assert capacity == 2
    assert made == [2, 2, 2, 2, 2] and total == 2  # the same two buffers, five times


def test_a_caller_waits_for_a_free_slot_instead_of_allocating_past_the_limit() -> None:
    async def run() -> list[str]:
        pool = HostPool(MiB, 2 * MiB)
        events: list[str] = []
        a = await pool.acquire()
        b = await pool.acquire()

        async def third() -> None:
            c = await pool.acquire()
            events.append(f"third got a slot, {pool.made} made")
            c.release()

        t = asyncio.ensure_future(third())
        await asyncio.sleep(0.05)
        events.append(f"waiting, {pool.made} made, {pool.held} held")
        a.release()
        await t
        b.release()
        # more than the limit holds: admitted alone, once nothing else is held
        big = await pool.acquire(3)
        events.append(f"alone: {big.count} held, {len(big.buffers)} buffers")
        big.release()
        events.append(f"after: {pool.made} kept")
        return events

    assert asyncio.run(run()) == [
        "waiting, 2 made, 2 held", "third got a slot, 2 made", "alone: 3 held, 3 buffers", "after: 2 kept",
    ]


def test_copies_held_elsewhere_take_the_place_of_free_slots() -> None:
    # a restore leaves two free slots; a save on an accelerator then holds the
    # budget in JAX's pinned copies (accounting-only leases): the free slots go
    # back to the system, so both together stay within the limit
    async def run() -> list[tuple[int, int]]:
        pool = HostPool(MiB, 2 * MiB)
        a, b = await pool.acquire(), await pool.acquire()
        a.release()
        b.release()
        seen = [(pool.made, pool.held)]
        c = await pool.acquire(buffers=False)
        seen.append((pool.made, pool.held))
        d = await pool.acquire(buffers=False)
        seen.append((pool.made, pool.held))
        c.release()
        d.release()
        e = await pool.acquire()
        seen.append((pool.made, pool.held))
        e.release()
        return seen

    assert asyncio.run(run()) == [(2, 0), (1, 1), (0, 2), (1, 1)]


def test_slot_sizes_are_whole_granules_and_one_pool_is_shared_per_size() -> None:
    assert slot_bytes_for(1) == SLOT_GRANULE
    assert slot_bytes_for(8 * MiB) == 8 * MiB
    assert slot_bytes_for(8 * MiB + 1) == 9 * MiB
    p = shared_pool(8 * MiB - 100, 64 * MiB)
    assert shared_pool(8 * MiB, 32 * MiB) is p and p.capacity == 4  # the last caller's budget


jax = pytest.importorskip("jax")
import jax.numpy as jnp


def _values(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("assemble", ["host", "device"])
@pytest.mark.parametrize("compression", [None, "zstd", "zstd-bitshuffle"])
def test_restores_reusing_the_slots_never_change_arrays_restored_before(
    tmp_path: Path, assemble: str, compression: str | None
) -> None:
    # "a_one": a leaf of one 2 MiB chunk, a device block that is the slot's piece
    # itself (on CPU devices device_put would alias the slot: it must be copied);
    # read first, so that the chunks of "b_multi" reuse its slot within the same
    # restore (a restore returns its free slots when it ends); "b_multi": 4 chunks
    # of 2 MiB, restored whole (each chunk lands in a slot and is copied into the
    # block, or put on the device)
    shapes = {"a_one": (512, 1024), "b_multi": (2048, 1024)}
    opts = SaveOptions(target_chunk_bytes=2 * MiB, compression=compression, pack_small_leaves=False)
    mgr = tsp.CheckpointManager(f"file://{tmp_path}/", options=opts)
    dev = jax.devices()[0]
    for step in range(3):
        mgr.save(step, {k: jax.device_put(_values(10 * step + i, s), dev)
                        for i, (k, s) in enumerate(shapes.items())}).result()
    sh = jax.sharding.SingleDeviceSharding(dev)
    target = {k: jax.ShapeDtypeStruct(s, jnp.float32, sharding=sh) for k, s in shapes.items()}
    first = mgr.restore(0, target=target, assemble=assemble, max_bytes_in_flight=4 * MiB)
    kept = {k: np.asarray(v).tobytes() for k, v in first.items()}
    for step in (1, 2):  # the same slots, other bytes
        later = mgr.restore(step, target=target, assemble=assemble, max_bytes_in_flight=4 * MiB)
        for i, (k, s) in enumerate(shapes.items()):
            assert np.asarray(later[k]).tobytes() == _values(10 * step + i, s).tobytes(), (step, k)
    for i, (k, s) in enumerate(shapes.items()):
        assert kept[k] == _values(i, s).tobytes(), k  # computed before the later restores
        assert np.asarray(first[k]).tobytes() == _values(i, s).tobytes(), k
    # the restores returned their free slots to the system when they ended
    assert shared_pool(2 * MiB, 4 * MiB).made == 0
