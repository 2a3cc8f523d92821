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
    No device memory: chunks are copied from the caller's arrays into pinned host
    memory one by one, under the bytes-in-flight budget, while earlier chunks are
    written. ``save()`` returns when the last chunk has left the device: after the
    copy at PCIe speed when the budget holds what this process saves, otherwise
    once all but about the last budget's worth has been written.
``"auto"``
    ``"host"`` when every shard is on a CPU device (the zero-copy path).
    Elsewhere ``"device"`` when every local device has room for the copy of its
    shards (``memory_stats()``: the copy must fit in 90% of ``bytes_limit -
    bytes_in_use``), else ``"pinned_host"``. A device that reports no memory
    statistics is taken to have no room (so ``"auto"`` never runs a device out of
    memory), and without a ``pinned_host`` memory kind ``"pinned_host"`` falls
    back to pageable copies chunk by chunk (``np.asarray`` of each chunk).

In the streaming modes host memory holds at most the bytes-in-flight budget of
staged chunks, whatever the size of the checkpoint, and the device-to-host copy
of one chunk overlaps the writes of the chunks before it. Pinned staging memory
comes from JAX's pinned-host allocator, which keeps freed pinned memory for
reuse: since a save never holds more than the budget, the first save pins about
that much once (slow) and later saves reuse it at PCIe speed.

Shards that already live in a host memory kind (``pinned_host`` /
``unpinned_host``: offloaded state) are always staged as ``"host"`` views.
JAX is never imported here: these functions are only reached with jax arrays.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np

from tensorstore_py.checkpoint.jax_adapter import jax_module
from tensorstore_py.checkpoint.layout import host_copy
from tensorstore_py.core.errors import InvalidArgumentError

__all__ = [
    "STAGINGS",
    "Staging",
    "check_choice",
    "check_staging",
    "choose_staging",
    "chunk_fetcher",
    "stage",
]

Staging = Literal["auto", "device", "pinned_host", "host"]
STAGINGS: tuple[str, ...] = ("auto", "device", "pinned_host", "host")

#: "auto" snapshots on a device only when the copy fits in this share of its free memory
DEVICE_ROOM_SHARE = 0.9

_HOST_KINDS = ("pinned_host", "unpinned_host")


def check_choice(what: str, value: str, choices: tuple[str, ...]) -> None:
    """InvalidArgumentError naming ``what`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise InvalidArgumentError(f"{what} must be one of {', '.join(map(repr, choices))}; got {value!r}")


def check_staging(staging: str) -> None:
    """InvalidArgumentError unless ``staging`` is one of :data:`STAGINGS`."""
    check_choice("SaveOptions.staging", staging, STAGINGS)


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


def _room_for(device: Any, need: int) -> bool:
    """Whether ``device`` can hold ``need`` more bytes (False when it can not tell)."""
    try:
        stats = device.memory_stats()
    except Exception:
        stats = None
    if not stats or "bytes_limit" not in stats:
        return False
    free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    return need <= DEVICE_ROOM_SHARE * free


def choose_staging(staging: str, shards: Sequence[Any]) -> str:
    """The mode that ``staging`` means for these single-device shards (see the
    module docstring): ``"auto"`` is resolved; the others are returned as given."""
    check_staging(staging)
    if staging != "auto":
        return staging
    need: dict[Any, int] = {}
    for x in shards:
        if not on_host_memory(x):
            d = _device(x)
            need[d] = need.get(d, 0) + int(x.nbytes)
    if all(d.platform == "cpu" for d in need):
        return "host"
    if all(_room_for(d, n) for d, n in need.items()):
        return "device"
    return "pinned_host"


def stage(shards: list[Any], mode: str) -> list[Any]:
    """What the chunks of each shard are read from, per resolved ``mode``: a host
    array (``"host"``, and shards already in host memory), our device copy
    (``"device"``) or the caller's shard itself (``"pinned_host"``).

    Returns when the caller's arrays are no longer needed, except in
    ``"pinned_host"`` mode, where the chunks still read them.
    """
    out: list[Any] = [None] * len(shards)
    on_device = []
    for i, x in enumerate(shards):
        if mode == "host" or on_host_memory(x):
            out[i] = host_view(x)
        else:
            on_device.append(i)
    if mode == "device" and on_device:
        jax = jax_module()
        xs = [shards[i] for i in on_device]
        try:
            copies = jax.device_put(xs, [x.sharding for x in xs], may_alias=False)
        except TypeError:  # an older JAX without device_put(may_alias=): one copy per shard
            copies = [jax.numpy.array(x, copy=True) for x in xs]
        # wait: the caller may donate or delete its arrays as soon as save() returns
        jax.block_until_ready(copies)
        for i, c in zip(on_device, copies):
            out[i] = c
    else:
        for i in on_device:
            out[i] = shards[i]
    return out


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


def chunk_fetcher(src: Any, index: tuple[tuple[int, int], ...] | None) -> Callable[[], np.ndarray]:
    """A blocking callable that copies ``src[index]`` (a single-device array and a
    box in its coordinates; None: all of it) into pinned host memory and returns
    a zero-copy host view of it (C-ordered). Runs on an I/O thread."""

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
