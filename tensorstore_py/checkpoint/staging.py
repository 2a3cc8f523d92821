"""Getting what a save writes off the devices: the modes of ``SaveOptions.staging``.

``save()`` returns once the caller's arrays are no longer needed (the caller may
then donate, delete or replace them); what stands between the call and that
moment depends on where this process's shards (addressable, ``replica_id == 0``)
are staged:

``"host"``
    Every shard is on the host before ``save()`` returns (``np.asarray``). On
    CPU devices that is a zero-copy view of the immutable jax buffer (nothing is
    copied, and the view keeps XLA from donating the buffer). On accelerators
    it is a device-to-host copy of everything into pageable memory: host memory
    then holds the whole state until it is written.
``"device"``
    A device-side copy of every shard (one batched ``jax.device_put(...,
    may_alias=False)``, waited for), then ``save()`` returns: on a GPU that is
    milliseconds for gigabytes. In the background every chunk is copied from
    that snapshot into pinned host memory (``memory_kind="pinned_host"``), written
    from there (the host array is a zero-copy view of the pinned buffer) and
    dropped; the copy of a shard is freed on the device once its last chunk has
    left it. Needs device memory for a copy of what this process saves.
``"pinned_host"``
    No device memory: every shard is copied into pinned host memory by ONE
    batched ``jax.device_put`` (whole shards, never sliced on the device) and
    ``save()`` returns when that copy is done: PCIe time, not the disk's. The
    writes then read zero-copy views of the pinned buffers. This needs host
    memory for what this process saves: the host staging limit
    (``SaveOptions.max_staging_bytes``; default :func:`default_staging_bytes`,
    half of the host's available RAM when the save starts) is separate from the
    write budget (``max_bytes_in_flight``). When the state exceeds it, the save
    *streams* instead (logged, logger ``tensorstore_py.checkpoint``): shards are
    copied one by one under the write budget while earlier ones are written, a
    shard no larger than that budget as a whole (cut into chunks on the host), a
    larger one chunk by chunk (one chunk-sized slice on the device at a time);
    ``save()`` then returns once all but about the last budget's worth has been
    written.
``"auto"``
    ``"host"`` when every shard is on a CPU device (the zero-copy path).
    Elsewhere ``"device"`` when every local device has room for the copy of its
    shards beside the training step's peak (:func:`room_for_copy`: the copy must
    fit in 90% of ``bytes_limit - peak_bytes_in_use`` and in the largest free
    block), else ``"pinned_host"``. A device that reports no memory statistics
    is taken to have no room (so ``"auto"`` never runs a device out of memory).
    If the device snapshot still runs out of device memory (``"auto"`` or
    ``"device"``: another allocation raced it), the save falls back to
    ``"pinned_host"`` and logs why instead of failing. Without a ``pinned_host``
    memory kind ``"pinned_host"`` makes pageable copies (``np.asarray``).

In the streaming modes host memory holds at most the bytes-in-flight budget of
staged chunks, whatever the size of the checkpoint, and the device-to-host
copy of one piece overlaps the writes of the pieces before it. The host copies
are counted against the shared host pool (hostpool.py): on CPU devices a
streamed ``"pinned_host"`` save copies each chunk from a zero-copy view of its
shard straight into a slot of the pool (:func:`chunk_filler`; no slice on the
device, no second copy); on accelerators JAX's pinned copies hold the pool's
slots' share of the budget without slots of ours. Pinned staging
memory comes from JAX's pinned-host allocator, which keeps freed pinned memory
for reuse: the first save pins its staging memory once (slow: about 1 GiB/s)
and later saves reuse it at PCIe speed. :func:`warm_pinned` (the
``warm_staging`` option of ``CheckpointManager``) pins it ahead, when the
manager is created, so the first save is fast too.

Shards that already live in a host memory kind (``pinned_host`` /
``unpinned_host``: offloaded state) are always staged as ``"host"`` views.
JAX is never imported here: these functions are only reached with jax arrays.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from tensorstore_py.checkpoint.jax_adapter import jax_module
from tensorstore_py.checkpoint.layout import host_copy
from tensorstore_py.core.errors import InvalidArgumentError

__all__ = [
    "STAGINGS",
    "Staged",
    "Staging",
    "check_choice",
    "check_staging",
    "choose_staging",
    "chunk_fetcher",
    "chunk_filler",
    "default_staging_bytes",
    "fills_on_host",
    "host_copies",
    "room_for_copy",
    "shard_fetcher",
    "stage",
    "warm_pinned",
]

log = logging.getLogger("tensorstore_py.checkpoint")

Staging = Literal["auto", "device", "pinned_host", "host"]
STAGINGS: tuple[str, ...] = ("auto", "device", "pinned_host", "host")

#: "auto" snapshots on a device only when the copy fits in this share of its free memory
DEVICE_ROOM_SHARE = 0.9
#: the default host staging limit is this share of the host's available RAM
HOST_STAGING_SHARE = 0.5

_HOST_KINDS = ("pinned_host", "unpinned_host")


def check_choice(what: str, value: str, choices: tuple[str, ...]) -> None:
    """InvalidArgumentError naming ``what`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise InvalidArgumentError(f"{what} must be one of {', '.join(map(repr, choices))}; got {value!r}")


def check_staging(staging: str) -> None:
    """InvalidArgumentError unless ``staging`` is one of :data:`STAGINGS`."""
    check_choice("SaveOptions.staging", staging, STAGINGS)


def available_ram() -> int:
    """Bytes of RAM the host can give without swapping (``MemAvailable`` of
    /proc/meminfo; elsewhere the free physical pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 0


def default_staging_bytes() -> int:
    """The default host staging limit of a save: half of :func:`available_ram`
    when the save starts (the other half is left to the writes' budget, the
    page cache and the program)."""
    return int(HOST_STAGING_SHARE * available_ram())


def _device(x: Any) -> Any:
    return next(iter(x.sharding.device_set))


def on_host_memory(x: Any) -> bool:
    """True for a single-device array in a host memory kind (offloaded state)."""
    return getattr(x.sharding, "memory_kind", None) in _HOST_KINDS


def has_pinned_host(device: Any) -> bool:
    try:
        return any(m.kind == "pinned_host" for m in device.addressable_memories())
    except Exception:  # a backend without memory kinds
        return False


def room_for_copy(stats: Mapping[str, int] | None, need: int) -> bool:
    """Whether a device whose ``memory_stats()`` are ``stats`` can hold a copy of
    ``need`` bytes for the length of a save, beside the training step's peak.

    The room is ``bytes_limit - peak_bytes_in_use`` (what the next step leaves
    free: between steps ``bytes_in_use`` is low, but the snapshot lives while
    the next steps run), bounded by ``largest_free_block_bytes`` where reported;
    the copy must fit in :data:`DEVICE_ROOM_SHARE` of it. No statistics: no room.
    """
    if not stats or "bytes_limit" not in stats:
        return False
    used = max(int(stats.get("peak_bytes_in_use", 0)), int(stats.get("bytes_in_use", 0)))
    room = int(stats["bytes_limit"]) - used
    if "largest_free_block_bytes" in stats:
        room = min(room, int(stats["largest_free_block_bytes"]))
    return need <= DEVICE_ROOM_SHARE * room


def _room_for(device: Any, need: int) -> bool:
    try:
        stats = device.memory_stats()
    except Exception:
        stats = None
    return room_for_copy(stats, need)


def choose_staging(staging: str, shards: Sequence[Any]) -> str:
    """The mode that ``staging`` means for these single-device shards (see the
    module docstring): ``"auto"`` is resolved; the others are returned as given."""
    check_staging(staging)
    if staging != "auto":
        return staging
    on_device = [x for x in shards if not on_host_memory(x)]
    if all(_device(x).platform == "cpu" for x in on_device):
        return "host"
    need: dict[Any, int] = {}
    for x in on_device:
        d = _device(x)
        need[d] = need.get(d, 0) + int(x.nbytes)
    if all(_room_for(d, n) for d, n in need.items()):
        return "device"
    return "pinned_host"


@dataclass(slots=True)
class Staged:
    """What :func:`stage` made of the shards."""

    #: per shard: a host array (staged), or a jax array its chunks are copied from
    #: later (our device snapshot, or the caller's shard when ``streamed``)
    sources: list[Any]
    #: the mode used: the one asked for, or "pinned_host" after a device out of memory
    mode: str
    #: "pinned_host" staging that streams (the state exceeds the staging limit):
    #: the sources still read the caller's arrays
    streamed: bool = False
    #: the pinned jax arrays the host sources view (kept alive with the views)
    keep: list[Any] | None = None


def _is_device_oom(e: BaseException) -> bool:
    text = str(e)
    return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text


def stage(shards: list[Any], mode: str, *, staging_limit: int | None = None) -> Staged:
    """Stage the shards as the resolved ``mode`` says (module docstring).

    Returns when the caller's arrays are no longer needed, except when
    :attr:`Staged.streamed`: then the chunks' fetches still read them.
    ``staging_limit``: the host bytes ``"pinned_host"`` staging may take at
    once (None: :func:`default_staging_bytes`).
    """
    out: list[Any] = [None] * len(shards)
    on_device = []
    for i, x in enumerate(shards):
        if mode == "host" or on_host_memory(x):
            out[i] = host_view(x)
        else:
            on_device.append(i)
    if not on_device:
        return Staged(out, mode)
    xs = [shards[i] for i in on_device]
    if mode == "device":
        try:
            copies = _device_snapshot(xs)
        except Exception as e:
            if not _is_device_oom(e):
                raise
            log.warning("checkpoint save: no device memory for a snapshot of %d bytes (%s); "
                        "staging in pinned host memory instead", sum(int(x.nbytes) for x in xs),
                        str(e).splitlines()[0][:200])
            mode = "pinned_host"
        else:
            for i, c in zip(on_device, copies):
                out[i] = c
            return Staged(out, mode)
    # "pinned_host"
    need = sum(int(x.nbytes) for x in xs)
    limit = default_staging_bytes() if staging_limit is None else staging_limit
    if need > limit:
        log.info("checkpoint save: %d bytes to stage exceed the host staging limit of %d bytes "
                 "(SaveOptions.max_staging_bytes; default: half the available RAM): streaming "
                 "them under the write budget, save() returns once all but the last of them "
                 "are written", need, limit)
        for i in on_device:
            out[i] = shards[i]
        return Staged(out, mode, streamed=True)
    views, pinned = _pinned_copies(xs)
    for i, h in zip(on_device, views):
        out[i] = h
    return Staged(out, mode, keep=pinned)


def _device_snapshot(xs: list[Any]) -> list[Any]:
    jax = jax_module()
    try:
        copies = jax.device_put(xs, [x.sharding for x in xs], may_alias=False)
    except TypeError:  # an older JAX without device_put(may_alias=): one copy per shard
        copies = [jax.numpy.array(x, copy=True) for x in xs]
    # wait: the caller may donate or delete its arrays as soon as save() returns
    jax.block_until_ready(copies)
    return list(copies)


def _pinned_copies(xs: list[Any]) -> tuple[list[np.ndarray], list[Any]]:
    """Host views of pinned copies of ``xs`` and the pinned arrays: ONE batched
    ``device_put`` of every shard that has a pinned_host memory (whole shards),
    waited for; pageable ``np.asarray`` copies of the others."""
    jax = jax_module()
    idx = [i for i, x in enumerate(xs) if _pinned(_device(x)) is not None]
    out: list[Any] = [None] * len(xs)
    pinned: list[Any] = []
    if idx:
        pinned = jax.device_put([xs[i] for i in idx], [_pinned(_device(xs[i])) for i in idx])
        jax.block_until_ready(pinned)
        for i, p in zip(idx, pinned):
            out[i] = host_view(p)  # zero-copy: the view keeps the pinned buffer alive
    for i, x in enumerate(xs):
        if out[i] is None:
            out[i] = host_copy(np.asarray(x))
    return out, list(pinned)


def host_copies(xs: list[Any]) -> list[np.ndarray]:
    """Host arrays of the single-device arrays ``xs`` (C-ordered): ONE batched
    ``device_put`` into pinned host memory for all of them (whole arrays, never
    sliced on the device), zero-copy views of the pinned buffers, which they keep
    alive. Blocking: runs on a copy thread. How many small leaves leave a device
    per transfer (packing.py)."""
    return _pinned_copies(xs)[0]


def warm_pinned(nbytes: int, devices: Sequence[Any] | None = None) -> int:
    """Pin ``nbytes`` of host memory for each device (default: the local
    devices with a ``pinned_host`` memory) once and free it: JAX's pinned
    allocator keeps it, so the next pinned staging of up to that size copies at
    PCIe speed instead of pinning pages first. Returns the bytes pinned."""
    if nbytes <= 0:
        return 0
    jax = jax_module()
    devs = [d for d in (devices if devices is not None else jax.local_devices()) if _pinned(d) is not None]
    src = np.zeros(int(nbytes), np.uint8)
    done = 0
    for d in devs:
        a = jax.device_put(src, _pinned(d))
        jax.block_until_ready(a)
        a.delete()
        done += int(nbytes)
    return done


def host_view(data: Any) -> np.ndarray:
    """A host array of a jax buffer that can not change behind our back.

    On accelerators ``np.asarray`` is the device-to-host copy itself. On CPU it
    is a zero-copy view, which is already a stable snapshot: jax arrays are
    immutable, and the view holds an external reference that keeps the buffer's
    memory alive and stops XLA from donating it (checked: a jit with
    ``donate_argnums`` and ``.delete()`` leave the view's bytes intact). So no
    second copy is made.
    """
    h = np.asarray(data)
    if not h.flags.c_contiguous:
        h = host_copy(h)
    return h


_pinned_shardings: dict[Any, Any] = {}


def _pinned(device: Any) -> Any | None:
    """The pinned-host sharding of ``device`` (None when it has no such memory)."""
    if device not in _pinned_shardings:
        jax = jax_module()
        _pinned_shardings[device] = (
            jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
            if has_pinned_host(device) else None
        )
    return _pinned_shardings[device]


def shard_fetcher(src: Any) -> Callable[[], np.ndarray]:
    """A blocking callable that copies the whole single-device array ``src``
    into pinned host memory (no slicing on the device) and returns a zero-copy
    host view of it (C-ordered). Runs on an I/O thread."""

    def fetch() -> np.ndarray:
        pinned = _pinned(_device(src))
        piece = jax_module().device_put(src, pinned) if pinned is not None else src
        return host_view(piece)  # waits for the copy; zero-copy for pinned memory

    return fetch


def chunk_fetcher(src: Any, index: tuple[tuple[int, int], ...] | None) -> Callable[[], np.ndarray]:
    """A blocking callable that copies ``src[index]`` (a single-device array and a
    box in its coordinates; None: all of it) into pinned host memory and returns
    a zero-copy host view of it (C-ordered). Runs on an I/O thread. A box is
    sliced on the device first (a chunk-sized device buffer)."""

    def fetch() -> np.ndarray:
        jax = jax_module()
        piece = src
        if index is not None:
            piece = jax.lax.slice(src, [a for a, _ in index], [b for _, b in index])
        pinned = _pinned(_device(src))
        if pinned is not None:
            piece = jax.device_put(piece, pinned)
        return host_view(piece)  # waits for the copy; zero-copy for pinned memory

    return fetch


def fills_on_host(src: Any) -> bool:
    """Whether the chunks of the single-device array ``src`` are copied into
    slots of the host pool straight from a zero-copy host view of it (a CPU
    device: its memory is host memory, so no device slice or device-to-host
    transfer is needed; chunk_writes.py)."""
    return bool(_device(src).platform == "cpu")


def chunk_filler(
    src: Any, region: tuple[tuple[int, int], ...], sub: tuple[tuple[int, int], ...], cshape: tuple[int, ...]
) -> Callable[[np.ndarray], np.ndarray]:
    """A blocking callable that copies the chunk covering ``sub`` (global
    coordinates; ``region`` is where ``src``, a single-device array on a CPU
    device, lies) into ``dest`` (the chunk's shape, e.g. a slot of the host
    pool: its old bytes are overwritten, padding at array edges is zeroed) and
    returns ``dest``. Reads a zero-copy view of ``src``: one host copy."""

    def fill(dest: np.ndarray) -> np.ndarray:
        host = host_view(src)
        view = host[tuple(slice(lo - r0, hi - r0) for (lo, hi), (r0, _) in zip(sub, region))]
        if view.shape == tuple(cshape):
            np.copyto(dest, view)
        else:
            dest[...] = 0
            dest[tuple(slice(0, n) for n in view.shape)] = view
        return dest

    return fill
