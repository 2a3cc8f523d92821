"""``verify`` of an incremental checkpoint step's digests (checkpoint/dedup.py).

A later save links a chunk whose digest equals the one recorded for the chunk
at the same place of the previous step, so a digest that does not describe
the stored bytes would let it keep wrong data. Per step, every digests document
(``<step>/digests/<process>.json``) is parsed, and every chunk it names is
read, decoded (compressed leaves) and hashed again: a chunk the document names
that the manifest's leaves do not hold, a missing chunk and a digest that
differs are problems. The documents' ``heads`` (digests of each chunk's first
bytes) are not checked: a save links a chunk on its whole digest only, so a
wrong head can make it write a chunk, never keep wrong bytes.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import numpy as np

from tensorstore_py.checkpoint.compression import chunk_codec
from tensorstore_py.checkpoint.dedup import ALGORITHM, DIGESTS_DIR, chunk_digest, parse_digests
from tensorstore_py.commands.problems import Problem, VerifyReport
from tensorstore_py.core.errors import DataCorruptionError, TensorStoreError
from tensorstore_py.core.pools import run_cpu
from tensorstore_py.drivers.dtypes import dtype_from_v3
from tensorstore_py.kvstore.base import KvStore

__all__ = ["check_digests"]

#: chunks read and hashed at once
CONCURRENCY = 16


async def check_digests(
    step_view: KvStore, step: int, manifest: dict[str, Any], report: VerifyReport
) -> None:
    """Append to ``report`` a problem per wrong, dangling or malformed digest of
    ``step`` (``step_view``: the step's folder)."""
    names = [k for k in await step_view.list(f"{DIGESTS_DIR}/") if k.endswith(".json")]
    # a chunk the leaf checks found missing or of the wrong size is not reported twice
    reported = {p.key for p in report.problems if p.key}
    leaves = {str(e["key"]): e for e in manifest.get("leaves", []) if isinstance(e, dict) and "key" in e}
    sem = asyncio.Semaphore(CONCURRENCY)

    def problem(kind: str, msg: str, key: str, **kw: Any) -> None:
        report.problems.append(Problem(kind, f"step {step}: {msg}", key=f"{step:012d}/{key}", **kw))

    async def one(key: str, want: str) -> None:
        if f"{step:012d}/{key}" in reported:
            return
        leaf_key, _, _ = key.partition("/c/")
        leaf = leaves.get(leaf_key)
        if leaf is None:
            problem("reference", f"digest of chunk {key!r}, which no leaf of the manifest holds", key)
            return
        async with sem:
            try:
                res = await step_view.read(key)
                if res.state != "value":
                    problem("missing", f"chunk {key!r} has a digest but is missing", key)
                    return
                dtype = dtype_from_v3(leaf["dtype"])
                cshape = tuple(int(n) for n in leaf["chunk_shape"])
                codec = chunk_codec(leaf.get("codecs"), dtype, cshape, where=f"step {step} leaf {leaf_key}")
                raw: Any = res.value
                if codec is not None:
                    size = math.prod(cshape) * dtype.itemsize
                    raw = await run_cpu(lambda: codec.decode(res.value, key=key, size=size, limit=size))
                found = await chunk_digest(np.frombuffer(memoryview(raw).cast("B"), dtype=np.uint8))
            except (TensorStoreError, ValueError, OSError) as e:
                problem("decode", f"chunk {key!r} could not be hashed: {e}", key)
                return
        if found != want:
            problem("checksum", f"chunk {key!r}: {ALGORITHM} digest {found}, the digests document says {want}",
                    key, expected=want, found=found)

    for name in names:
        res = await step_view.read(name)
        if res.state != "value":
            continue
        try:
            digests = parse_digests(bytes(res.value), name)
        except DataCorruptionError as e:
            problem("corrupt", str(e), name)
            continue
        await asyncio.gather(*(one(k, d) for k, d in digests.items()))
