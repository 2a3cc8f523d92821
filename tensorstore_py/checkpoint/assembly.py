"""Building restored ``jax.Array``s on their devices, piece by piece (``assemble="device"``).

A restore reads, for every block a local device needs, the pieces of the chunks
that overlap it. With ``assemble="host"`` the block is put together in host
memory and handed to ``jax.device_put`` (on CPU devices the aligned host block
becomes the array without a copy). With ``assemble="device"`` each piece goes to
the device as soon as it is read, while the next spans are being read, and is
written into the block there with an in-place ``dynamic_update_slice`` (the
block is donated, so it is never copied); host memory then holds only the read
buffers in flight (the restore's bytes-in-flight budget), never a whole block.
A block that is exactly one chunk is the transferred piece itself.

``"auto"`` is ``"device"`` for a target on a non-CPU device in its default
memory, and ``"host"`` otherwise (CPU devices, where the host path is already
zero-copy, and targets in a host memory kind, where the device can not compute).

JAX is never imported here: these functions are only reached with jax targets.
"""

from __future__ import annotations

import threading
from typing import Any, Literal

import numpy as np

from tensorstore_py.checkpoint.hostpool import device_put_copy
from tensorstore_py.checkpoint.jax_adapter import jax_module
from tensorstore_py.checkpoint.staging import check_choice

__all__ = ["ASSEMBLIES", "Assemble", "DeviceBlock", "assemble_on_device", "check_assemble", "put_whole_blocks"]

Assemble = Literal["auto", "host", "device"]
ASSEMBLIES: tuple[str, ...] = ("auto", "host", "device")


def check_assemble(assemble: str) -> None:
    """InvalidArgumentError unless ``assemble`` is one of :data:`ASSEMBLIES`."""
    check_choice("restore: assemble", assemble, ASSEMBLIES)


def _default_memory(sharding: Any) -> bool:
    kind = getattr(sharding, "memory_kind", None)
    if kind is None:
        return True
    device = next(iter(sharding.device_set))
    try:
        return bool(kind == device.default_memory().kind)
    except Exception:  # a backend without memory kinds
        return True


def assemble_on_device(assemble: str, sharding: Any) -> bool:
    """Whether a target with ``sharding`` is assembled on its devices."""
    if assemble == "host" or not _default_memory(sharding):
        return False
    if assemble == "device":
        return True
    return any(d.platform != "cpu" for d in sharding.device_set)


_update_fn: Any = None


def _update() -> Any:
    """``block[starts...] = piece`` in place (the block is donated); compiled once
    per (block, piece) shape and dtype, the offsets are traced."""
    global _update_fn
    if _update_fn is None:
        jax = jax_module()
        _update_fn = jax.jit(
            lambda block, piece, starts: jax.lax.dynamic_update_slice(block, piece, starts),
            donate_argnums=0,
        )
    return _update_fn


class DeviceBlock:
    """One device's block of a restored leaf, assembled on that device.

    :meth:`put` is blocking and thread-safe (pieces of one block are serialised,
    pieces of different blocks run in parallel); when it returns, the host piece
    is no longer referenced, so its buffer may be reused or freed.
    """

    def __init__(self, device: Any, shape: tuple[int, ...], dtype: np.dtype) -> None:
        self.device = device
        self.shape = shape
        self.dtype = np.dtype(dtype)  # the target's dtype
        self._block: Any = None
        self._lock = threading.Lock()

    def put(self, dst: tuple[slice, ...] | None, piece: np.ndarray, borrowed: bool = False) -> None:
        """Place the host array ``piece`` at ``dst`` of the block (None: it is the
        whole block). ``borrowed``: ``piece`` views memory that is reused once
        this returns (a slot of the host pool), so the block never aliases it."""
        jax = jax_module()
        piece = self._piece(piece)  # the target's dtype; a region across chunk rows: one copy
        if dst is None and borrowed:
            self._block = device_put_copy(piece, self.device)
            return
        placed = jax.device_put(piece, self.device)
        if dst is None:
            placed.block_until_ready()  # the transfer is done: the host buffer is free
            self._block = placed
            return
        starts = tuple(s.start for s in dst)
        with self._lock:
            if self._block is None:
                self._block = jax.numpy.zeros(self.shape, self.dtype, device=self.device)
            self._block = _update()(self._block, placed, starts)
            self._block.block_until_ready()

    def _piece(self, piece: np.ndarray) -> np.ndarray:
        if piece.dtype != self.dtype or not piece.dtype.isnative:
            piece = piece.astype(self.dtype)  # numpy's casting, as the host path
        if not piece.flags.c_contiguous:
            piece = np.ascontiguousarray(piece)
        return piece

    def result(self) -> Any:
        """The assembled block (a single-device ``jax.Array``)."""
        if self._block is None:  # no piece: an empty block
            return jax_module().device_put(np.zeros(self.shape, self.dtype), self.device)
        return self._block

    def to(self, device: Any) -> Any:
        """The block on another local device (replicated regions are read once)."""
        return jax_module().device_put(self.result(), device)


def put_whole_blocks(items: list[tuple[DeviceBlock, np.ndarray]]) -> None:
    """Each host array is its block's whole content: all of them go to their
    devices in ONE batched ``device_put`` (many small leaves: one transfer, not
    one per leaf), waited for. Blocking: runs on an I/O thread; when it returns
    the host arrays are no longer referenced."""
    if not items:
        return
    jax = jax_module()
    placed = jax.device_put([b._piece(p) for b, p in items], [b.device for b, _ in items])
    jax.block_until_ready(placed)
    for (b, _), x in zip(items, placed):
        b._block = x
