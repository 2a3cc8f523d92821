"""Write one checkpoint step as safetensors files, sharded by size like Hugging Face."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

from tensorstore_py.checkpoint.foreign import dotted_name
from tensorstore_py.checkpoint.layout import LeafLayout
from tensorstore_py.checkpoint.restoring import read_regions
from tensorstore_py.checkpoint.safetensors_format import INDEX_NAME, SINGLE_NAME, encode_header, tag_of
from tensorstore_py.checkpoint.storage import StepStore
from tensorstore_py.core.errors import ConditionFailedError, InvalidArgumentError
from tensorstore_py.core.ranges import ByteRange
from tensorstore_py.kvstore.base import Generation, KvStore

__all__ = ["DEFAULT_SHARD_BYTES", "export_safetensors", "shard_plan"]

#: what ``transformers`` uses (``max_shard_size="5GB"``)
DEFAULT_SHARD_BYTES = 5_000_000_000


def shard_plan(sizes: list[int], max_shard_bytes: int) -> list[list[int]]:
    """Consecutive groups of indices, each at most ``max_shard_bytes`` unless one array
    alone is larger (it then gets a file of its own)."""
    groups: list[list[int]] = []
    acc = 0
    for i, n in enumerate(sizes):
        if not groups or (acc + n > max_shard_bytes and groups[-1]):
            groups.append([])
            acc = 0
        groups[-1].append(i)
        acc += n
    return groups


async def export_safetensors(
    store: StepStore,
    step: int | None,
    dest: KvStore,
    *,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    max_bytes_in_flight: int = 512 << 20,
) -> dict[str, Any]:
    """Write ``step`` (None: the newest) under ``dest`` as ``model.safetensors``, or as
    ``model-0000i-of-0000n.safetensors`` files plus ``model.safetensors.index.json``
    when it exceeds ``max_shard_bytes``. Tensor names are the leaves' dotted paths
    (``['params']['w']`` -> ``params.w``); Python scalars go to ``__metadata__`` as
    JSON. One file at a time: memory peaks near twice the largest file. Each file
    is one whole-value write (atomic on every store); the index is written last, with create-only writes throughout, so
    an existing export is refused (ConditionFailedError) rather than mixed.
    """
    if max_shard_bytes < 1:
        raise InvalidArgumentError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    step, manifest, data = await store.open_step(step)
    arrays: list[tuple[str, LeafLayout]] = []
    metadata: dict[str, str] = {"format": "pt", "tsp.step": str(step)}
    seen: set[str] = set()
    for e in manifest["leaves"]:
        name = dotted_name(e["path"])
        if name in seen:
            raise InvalidArgumentError(f"checkpoint step {step}: two leaves are both named {name!r} in safetensors")
        seen.add(name)
        if e["kind"] == "python":
            metadata[f"tsp.python.{name}"] = json.dumps(e["value"])
            continue
        leaf = LeafLayout.from_json(e)
        tag_of(leaf.dtype, name=name)  # refuse an unstorable dtype before writing anything
        arrays.append((name, leaf))
    sizes = [math.prod(leaf.shape) * leaf.dtype.itemsize for _n, leaf in arrays]
    groups = shard_plan(sizes, max_shard_bytes) or [[]]
    n = len(groups)
    files = [SINGLE_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for f in files + ([INDEX_NAME] if n > 1 else []):
        if (await dest.read(f, byte_range=ByteRange(0, 0))).state == "value":
            raise ConditionFailedError(f"{dest!r}: {f} already exists; export into an empty folder")
    weight_map: dict[str, str] = {}
    for f, group in zip(files, groups):
        leaves = [arrays[i] for i in group]
        header, _offsets = encode_header([(nm, leaf.dtype, leaf.shape) for nm, leaf in leaves], metadata)
        blocks = await read_regions(
            data, [(leaf, tuple((0, k) for k in leaf.shape)) for _nm, leaf in leaves],
            max_bytes_in_flight=max_bytes_in_flight,
        )
        parts = [header]
        for (nm, leaf), a in zip(leaves, blocks):
            assert a is not None
            parts.append(np.ascontiguousarray(a, dtype=leaf.dtype.newbyteorder("<")).tobytes())
            weight_map[nm] = f
        await dest.write(f, b"".join(parts), if_equal=Generation.NO_VALUE)
    if n > 1:
        index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
        await dest.write(INDEX_NAME, json.dumps(index, indent=2).encode(), if_equal=Generation.NO_VALUE)
    return {"step": step, "files": files + ([INDEX_NAME] if n > 1 else []), "tensors": len(arrays),
            "bytes": sum(sizes)}
