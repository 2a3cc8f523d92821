"""The JAX edge of checkpoints; JAX is never imported unless the caller did.

Save: a ``jax.Array`` contributes only its *addressable* shards with
``replica_id == 0`` — across all processes each element is written exactly once,
and a replicated leaf is stored once in total. How those shards leave the
devices is staging.py's business.

Restore: for a target leaf with a sharding, every addressable device's index is
turned into a region; identical regions of several local devices are read once;
each device gets its block (put together on the host and transferred with
``jax.device_put`` here, or assembled on the device by assembly.py) and the
global array is built with ``jax.make_array_from_single_device_arrays``.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from tensorstore_py.checkpoint.coordination import JaxCoordinator
from tensorstore_py.checkpoint.layout import Region, region_of_index

__all__ = [
    "assemble_all",
    "distributed_coordinator",
    "global_array",
    "is_jax_array",
    "jax_module",
    "put_blocks",
    "shards_to_save",
    "target_regions",
]


def _jax() -> Any:
    return sys.modules.get("jax")


def jax_module() -> Any:
    """The imported ``jax`` module (callers reach here only with jax values, so
    it is imported already)."""
    return sys.modules["jax"]


def is_jax_array(x: Any) -> bool:
    jax = _jax()
    return jax is not None and isinstance(x, jax.Array)


def is_sharded_target(x: Any) -> bool:
    """A target leaf that asks for a jax.Array: a jax.Array or a ShapeDtypeStruct."""
    jax = _jax()
    return jax is not None and isinstance(x, (jax.Array, jax.ShapeDtypeStruct))


#: sharding -> (one device holds it all and it is addressable here, its JSON):
#: thousands of leaves share a few shardings
_SHARDING_INFO: dict[Any, tuple[bool, dict[str, Any] | None]] = {}


def _sharding_info(s: Any) -> tuple[bool, dict[str, Any] | None]:
    try:
        return _SHARDING_INFO[s]
    except (KeyError, TypeError):  # not seen yet, or not hashable
        pass
    one = len(s.device_set) == 1 and bool(s.is_fully_addressable)
    try:
        sj = _describe_sharding(s)
    except Exception:
        sj = None
    try:
        if len(_SHARDING_INFO) < 1024:
            _SHARDING_INFO[s] = (one, sj)
    except TypeError:
        pass
    return one, sj


def _describe_sharding(s: Any) -> dict[str, Any] | None:
    spec = getattr(s, "spec", None)
    mesh = getattr(s, "mesh", None)
    if spec is None or mesh is None:
        return None
    return {
        "mesh": {str(k): int(v) for k, v in mesh.shape.items()},
        "spec": [list(p) if isinstance(p, tuple) else p for p in spec],
    }


def shards_to_save(
    arr: Any, *, replicas: bool = False,
) -> tuple[tuple[int, ...], np.dtype, tuple[int, ...], list[tuple[Region, Any]], dict[str, Any] | None]:
    """``(shape, dtype, shard_shape, [(region, single-device array)], sharding json)``
    of the shards this process must write (addressable, ``replica_id == 0``;
    ``replicas=True``: every addressable region once, whichever replica it is)."""
    shape = tuple(arr.shape)
    parts: list[tuple[Region, Any]] = []
    one, sj = _sharding_info(arr.sharding)
    if one:
        # one device holds it all (the common case for small leaves): skip the shard walk
        shard_shape = shape
        parts.append((tuple((0, n) for n in shape), arr))
    else:
        shard_shape = tuple(arr.sharding.shard_shape(shape))
        seen: set[Region] = set()
        for s in arr.addressable_shards:
            if s.replica_id == 0 or replicas:
                region = region_of_index(s.index, shape)
                if region not in seen:
                    seen.add(region)
                    parts.append((region, s.data))
    return shape, np.dtype(arr.dtype), shard_shape, parts, sj


def distributed_coordinator() -> JaxCoordinator | None:
    """A coordinator over ``jax.distributed`` if it is initialised with > 1 process."""
    jax = _jax()
    if jax is None:
        return None
    try:
        # JAX is imported already (checked above); its coordination client lives here
        from jax._src import distributed
    except ImportError:
        return None
    client = getattr(distributed.global_state, "client", None)
    if client is None or jax.process_count() <= 1:
        return None
    return JaxCoordinator(client, jax.process_index(), jax.process_count())


def target_sharding(target: Any) -> Any:
    jax = _jax()
    sharding = getattr(target, "sharding", None)
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return sharding


def target_regions(target: Any, cache: dict[Any, Any] | None = None) -> tuple[Any, list[tuple[Any, Region]]]:
    """The target's sharding and ``[(device, region)]`` for this process's devices
    (memoised in ``cache`` by sharding and shape: many leaves share both)."""
    sharding = target_sharding(target)
    shape = tuple(target.shape)
    key = (sharding, shape)
    if cache is not None and key in cache:
        return sharding, cache[key]  # type: ignore[no-any-return]
    idx_map = sharding.addressable_devices_indices_map(shape)
    regions = [(d, region_of_index(idx, shape)) for d, idx in idx_map.items()]
    if cache is not None:
        cache[key] = regions
    return sharding, regions


def assemble_all(items: list[tuple[Any, Any, list[tuple[Any, np.ndarray]]]]) -> list[Any]:
    """Global ``jax.Array``s from ``(target, sharding, [(device, host block)])``
    items: one batched ``device_put`` of every block (into the memory kind of
    its target's sharding), then ``jax.make_array_from_single_device_arrays``
    per array. An array that one device holds whole (most small leaves) is put
    with its target sharding directly and needs no second step."""
    jax = _jax()
    blocks: list[np.ndarray] = []
    dests: list[Any] = []
    whole: list[bool] = []
    for target, sharding, per_dev in items:
        one = len(per_dev) == 1 and len(sharding.device_set) == 1 and per_dev[0][1].shape == tuple(target.shape)
        whole.append(one)
        for d, b in per_dev:
            blocks.append(b)
            dests.append(sharding if one else jax.sharding.SingleDeviceSharding(
                d, memory_kind=getattr(sharding, "memory_kind", None)))
    placed = iter(put_blocks(blocks, dests))
    return [
        next(placed) if one else global_array(target, sharding, [next(placed) for _ in per_dev])
        for (target, sharding, per_dev), one in zip(items, whole)
    ]


def global_array(target: Any, sharding: Any, arrays: list[Any]) -> Any:
    """The global ``jax.Array`` of ``target``'s shape from this process's
    single-device blocks (in ``sharding``'s addressable-device order)."""
    return _jax().make_array_from_single_device_arrays(tuple(target.shape), sharding, arrays)


#: (shape, dtype, sharding) -> the aval of a block put whole into that
#: one-device sharding, or None where :func:`put_blocks` must use ``jax.device_put``
_DIRECT: dict[tuple[Any, ...], Any] = {}
_DIRECT_MAX = 4096
#: larger blocks always take ``jax.device_put``: its Python costs little beside
#: their bytes, and the direct path's first trial put would copy them again
_DIRECT_MAX_BYTES = 1 << 20


def _direct_put() -> Any:
    """jaxlib's one-array transfer (``xla_client.batched_device_put``), or None."""
    lib = sys.modules.get("jax._src.lib")
    return getattr(getattr(lib, "xla_client", None), "batched_device_put", None)


def put_blocks(blocks: list[np.ndarray], shardings: list[Any], *, copy: bool = False) -> list[Any]:
    """``jax.device_put(blocks, shardings)``: each host array put whole into its
    sharding, returned in order. ``copy=True``: no result shares memory with
    its host array (on CPU devices ``device_put`` may otherwise alias an aligned
    one), and the transfers are waited for: when it returns the host arrays are
    no longer needed and their buffers may be reused. Otherwise not waited for.

    ``jax.device_put`` of a list costs about 50-100 us of Python per array (an
    aval built and checked per array): most of the restore of 10,000 small
    leaves. A block of at most 1 MiB that one device holds whole (a one-device
    sharding in its device's default memory) of a dtype JAX keeps as it is goes
    instead through the one call that ``device_put`` ends in for it (jaxlib's
    ``batched_device_put``) with the aval ``device_put`` gave the first block of
    that shape, dtype and sharding: for each such key the first block is put by
    ``jax.device_put`` and one more by the direct call, and only when the two
    arrays agree (aval, sharding, committed) are the others put directly.
    Any other block, or a JAX without that call, takes ``jax.device_put``."""
    jax = _jax()
    out: list[Any] = [None] * len(blocks)
    put = _direct_put()
    slow: list[int] = []
    for i, (b, s) in enumerate(zip(blocks, shardings)):
        if put is None or not b.flags.c_contiguous:
            slow.append(i)
            continue
        key = (b.shape, b.dtype, s)
        try:
            entry = _DIRECT[key]
        except KeyError:
            out[i] = _first_direct(jax, put, key, b, s, copy)
            continue
        except TypeError:  # an unhashable sharding
            entry = None
        if entry is None:
            slow.append(i)
        else:
            out[i] = put(entry[0], s, [b], entry[1], True, copy)
    if slow:
        xs = [blocks[i] for i in slow]
        ss = [shardings[i] for i in slow]
        one = ss[0] if all(x is ss[0] for x in ss) else ss
        placed = _device_put(jax, xs, one, copy)
        for i, y in zip(slow, placed):
            out[i] = y
    if copy:
        jax.block_until_ready(out)
    return out


def _device_put(jax: Any, xs: Any, dest: Any, copy: bool) -> Any:
    """``jax.device_put``; ``copy``: of private copies of the host arrays (on
    CPU devices JAX 0.10 aliases an aligned numpy array even with
    ``may_alias=False``; an alias of a copy that nothing else holds is safe)."""
    if copy and isinstance(xs, list):
        dests = dest if isinstance(dest, list) else [dest] * len(xs)
        xs = [np.array(x) if _on_cpu(d) else x for x, d in zip(xs, dests)]
    elif copy and _on_cpu(dest):
        xs = np.array(xs)
    return jax.device_put(xs, dest)


def _on_cpu(sharding: Any) -> bool:
    """Whether ``sharding`` places on CPU devices (where ``device_put`` may alias
    host memory; elsewhere it always copies)."""
    try:
        return any(d.platform == "cpu" for d in sharding.device_set)
    except Exception:
        return True


def _first_direct(jax: Any, put: Any, key: tuple[Any, ...], block: np.ndarray, sharding: Any, copy: bool) -> Any:
    """The first block of ``key``: put by ``jax.device_put``; decides whether the
    others of ``key`` go directly (see :func:`put_blocks`)."""
    ref = _device_put(jax, block, sharding, copy)
    entry = None
    try:
        devices = list(sharding.device_set)
        default = devices[0].default_memory().kind if len(devices) == 1 else None
        if (
            block.nbytes <= _DIRECT_MAX_BYTES
            and len(devices) == 1 and getattr(sharding, "memory_kind", None) in (None, default)
            and ref.dtype == block.dtype and tuple(ref.shape) == block.shape
        ):
            trial = put(ref.aval, sharding, [block], devices, True, copy)
            if trial.aval == ref.aval and trial.sharding == ref.sharding and trial.committed == ref.committed:
                entry = (ref.aval, devices)
    except Exception:  # another JAX: device_put for every block of this key
        entry = None
    if len(_DIRECT) < _DIRECT_MAX:
        _DIRECT[key] = entry
    return ref
