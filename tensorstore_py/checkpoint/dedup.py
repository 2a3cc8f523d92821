"""Incremental saves: a chunk whose bytes equal the previous step's is linked, not written.

Every chunk a save stores gets a content digest (xxh3_128 of its raw C-order
bytes, computed on the write path once the chunk is on the host). Each process
writes the digests of its chunks to ``<step>/digests/<process:06d>.json``::

    {"format": "tensorstore_py.checkpoint.digests/1", "algorithm": "xxh3_128",
     "chunks": {"a/3/c/0/0": "<32 hex digits>", ...},
     "head_bytes": 65536, "heads": {"a/3/c/0/0": "<32 hex digits>", ...}}

``heads`` (chunks larger than ``head_bytes`` only) holds the digest of each
chunk's first ``head_bytes`` raw bytes: a hint, never a reason to link. A
chunk whose head differs from the previous step's is known to have changed
before it is hashed whole, so its write starts at once and its digest is
computed while it is written (as for a chunk with nothing to link to),
instead of its write waiting for the hashing queue -- every other chunk's
digest -- and then for its own. A chunk whose head is equal (or unrecorded:
a step saved by an older version) is hashed whole first and linked only when
the whole digests are equal. A wrong head can therefore only make a save
write a chunk it could have linked, never link one it should have written;
``verify`` checks the ``chunks`` digests, not the heads.

The next save (``SaveOptions(incremental=True)``, the default) reads the
previous step's manifest and digests -- the previous step is the greatest step
below the one being saved, in the version the save's transaction reads -- and
pairs leaves by path: a leaf of the same kind, dtype, shape, chunk shape and
codecs in both steps. A chunk of such a leaf whose digest equals the recorded
one is stored by linking the previous step's value (``kvstore.versioned.links``):
the new step's chunk key names the same data object, no byte is written. Each
process compares only the chunks it writes, so in a multi-process save every
process deduplicates its own shards (whichever process wrote them before).

A leaf that is the very ``jax.Array`` this process saved to the same root last
time (the object itself, still alive and not deleted: jax arrays are immutable,
a donated one is deleted) needs no hashing: its chunks' digests are those of
that save, so a chunk whose remembered digest equals the previous step's is
linked without being copied off the device or read (only weak references to
the arrays are kept between saves).

A manager's local tier saves incrementally too (against this process's
previous local part), and a promotion of a local part to the root takes the
digests the part recorded (:attr:`Incremental.known`): a chunk whose recorded
digest equals the root's previous step's is linked without being read from the
local tier, and no chunk is hashed twice.

Guarantees: a linked chunk is a whole, ordinary key of the new step: restores,
``open_array``, exports and other readers see no difference. The link's
source is checked at commit (a step deleted meanwhile fails the save with
``ConflictError``, nothing visible), so garbage collection and retention keep a
shared data object while any kept step references it. ``verify`` checks a
linked chunk's crc32c like any other, and recomputes every chunk's digest
against the digests file (a wrong digest would let a later save link wrong
bytes).

Why xxh3_128 (``benchmarks/checkpoint.py --incremental``): on the 2-core
machine the save path was measured on, one core hashed xxh3_128 at 10 to 23
GiB/s, sha256 at 0.7 to 1.65 and blake2b at 0.3 to 0.7, while a durable
local-disk save wrote about 1 GiB/s: a cryptographic digest would cost about as
much as the write, xxh3_128 a few percent of it (docs/CHECKPOINTS.md). A chunk
is compared only with the chunk at the same place of the same leaf in the
previous step, never looked up by content among all chunks, so what the digest
must resist is an accidental equality of the old and new bytes of one chunk,
with probability 2^-128 per chunk; it is not meant to resist bytes crafted to
collide (the saved state is the caller's own).
"""

from __future__ import annotations

import asyncio
import json
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from tensorstore_py.checkpoint.storage import list_steps, step_dir
from tensorstore_py.core.errors import DataCorruptionError
from tensorstore_py.core.pools import run_cpu
from tensorstore_py.kvstore.base import KvStore
from tensorstore_py.kvstore.versioned.links import link_value

__all__ = [
    "ALGORITHM", "DIGESTS_DIR", "DIGESTS_FORMAT", "HEAD_BYTES", "Incremental", "chunk_digest", "digests_key",
    "head_digest", "load_previous", "parse_digests", "parse_document",
]

DIGESTS_FORMAT = "tensorstore_py.checkpoint.digests/1"
ALGORITHM = "xxh3_128"
DIGESTS_DIR = "digests"
#: chunks at least this large are hashed on the CPU pool, not on the event loop
_HASH_IN_POOL = 256 << 10
#: the bytes of a chunk's head (module doc); chunks larger than this get one.
#: A few microseconds of hashing on the event loop, while a whole chunk of tens
#: of MiB takes milliseconds of a CPU-pool thread after the chunks queued before it
HEAD_BYTES = 64 << 10

#: per process: (root, leaf path) -> the jax.Array this process last saved there
#: (a weak reference) and the digests of the chunks it stored of it
_LAST: dict[tuple[str, str], tuple[weakref.ref[Any], dict[str, str]]] = {}
_LAST_LOCK = threading.Lock()
#: leaf fields that must be equal for a chunk to be linked to the previous step's
_SAME = ("kind", "dtype", "shape", "chunk_shape", "codecs", "prng")


def digests_key(process_index: int) -> str:
    """The digests document of one process, relative to the step's folder."""
    return f"{DIGESTS_DIR}/{process_index:06d}.json"


def _digest_now(data: np.ndarray) -> str:
    return xxhash.xxh3_128_hexdigest(data.reshape(-1).view(np.uint8).data)


async def chunk_digest(data: np.ndarray) -> str:
    """The digest of a chunk's raw (C-order, little-endian) bytes."""
    if data.nbytes >= _HASH_IN_POOL:
        return await run_cpu(_digest_now, data)
    return _digest_now(data)


def head_digest(data: np.ndarray) -> str | None:
    """The digest of the first :data:`HEAD_BYTES` raw bytes of a chunk larger
    than that (computed here, on the caller's thread); None for a smaller one."""
    if data.nbytes <= HEAD_BYTES:
        return None
    return xxhash.xxh3_128_hexdigest(data.reshape(-1).view(np.uint8).data[:HEAD_BYTES])


def _document(raw: bytes, key: str) -> dict[str, Any]:
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise DataCorruptionError(f"checkpoint digests {key!r} are not valid JSON: {e}") from None
    chunks = doc.get("chunks") if isinstance(doc, dict) else None
    if not isinstance(doc, dict) or doc.get("format") != DIGESTS_FORMAT or not isinstance(chunks, dict):
        raise DataCorruptionError(
            f"checkpoint digests {key!r}: expected format {DIGESTS_FORMAT!r} with a 'chunks' map"
        )
    return doc


def parse_digests(raw: bytes, key: str) -> dict[str, str]:
    """chunk key -> digest from a digests document; DataCorruptionError if malformed,
    empty for an algorithm this version does not compute."""
    return parse_document(raw, key)[0]


def parse_document(raw: bytes, key: str) -> tuple[dict[str, str], dict[str, str]]:
    """A digests document's chunk key -> digest (as :func:`parse_digests`) and
    chunk key -> head digest (module doc). The heads are empty when it records
    none, or none of this version's algorithm and head size; heads are hints,
    so a malformed ``heads`` member counts as none."""
    doc = _document(raw, key)
    if doc.get("algorithm") != ALGORITHM:
        return {}, {}
    digests = {str(k): str(v) for k, v in doc["chunks"].items()}
    heads = doc.get("heads")
    if doc.get("head_bytes") != HEAD_BYTES or not isinstance(heads, dict):
        return digests, {}
    return digests, {str(k): v for k, v in heads.items() if isinstance(v, str)}


@dataclass(slots=True)
class Previous:
    """The previous step's chunks this save may link: new chunk key (relative to
    the new step's folder) -> (its source key relative to the root, digest, head
    digest or None)."""

    step: int
    sources: dict[str, tuple[str, str, str | None]] = field(default_factory=dict)


async def _read_json(view: KvStore, key: str) -> bytes | None:
    res = await view.read(key)
    return bytes(res.value) if res.state == "value" else None


async def load_previous(root: KvStore, step: int, leaves: list[dict[str, Any]]) -> Previous | None:
    """The linkable chunks of the greatest step below ``step`` in ``root`` (a view
    bound to the save's transaction), for a save of ``leaves``; None if there is
    no such step or it has no digests (saved without them, or by an older
    version)."""
    older = [s for s in await list_steps(root) if s < step]
    if not older:
        return None
    prev = older[-1]
    pdir = step_dir(prev)

    async def documents() -> tuple[list[str], list[bytes | None]]:
        names = [k for k in await root.list(f"{pdir}/{DIGESTS_DIR}/") if k.endswith(".json")]
        return names, list(await asyncio.gather(*(_read_json(root, k) for k in names)))

    # the digest documents are read beside the manifest, not after it: on an
    # object store that is one round trip before the chunk writes instead of two
    raw, (names, docs) = await asyncio.gather(_read_json(root, f"{pdir}/manifest.json"), documents())
    if raw is None or not names:
        return None
    try:
        manifest = json.loads(raw)
        old_leaves = {str(e["path"]): e for e in manifest["leaves"] if "key" in e}
    except (ValueError, KeyError, TypeError) as err:
        raise DataCorruptionError(f"checkpoint manifest {pdir}/manifest.json: {err}") from None
    # old leaf key -> new leaf key, for leaves laid out alike in both steps
    renames: dict[str, str] = {}
    for e in leaves:
        old = old_leaves.get(str(e["path"]))
        if "key" in e and old is not None and all(old.get(f) == e.get(f) for f in _SAME):
            renames[str(old["key"])] = str(e["key"])
    out = Previous(prev)
    for name, doc in zip(names, docs):
        if doc is None:
            continue
        digests, heads = parse_document(doc, name)
        for key, digest in digests.items():
            leaf, sep, rest = key.partition("/c/")
            new = renames.get(leaf)
            if new is not None and sep:
                out.sources[f"{new}/c/{rest}"] = (f"{pdir}/{key}", digest, heads.get(key))
    return out


@dataclass(slots=True)
class Incremental:
    """The chunk writer of one process's part of a save: links what the previous
    step holds, writes the rest, and records every chunk's digest."""

    #: the root seen through the save's transaction
    root: KvStore
    step: int
    process_index: int
    previous: Previous | None
    #: names the root among the roots this process saves to (identity shortcut)
    root_id: str = ""
    #: leaf key -> (leaf path, the jax.Array saved there): the identity shortcut
    arrays: dict[str, tuple[str, Any]] = field(default_factory=dict)
    #: chunk key -> its digest, known without hashing: a promotion copies chunks
    #: whose digests the local part recorded when it hashed them (tiers.py)
    known: dict[str, str] = field(default_factory=dict)
    #: chunk key -> its head digest, likewise known (the local part's heads)
    known_heads: dict[str, str] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)
    #: chunk key -> head digest of the chunks this save stored (module doc)
    heads: dict[str, str] = field(default_factory=dict)
    bytes_written: int = 0
    bytes_linked: int = 0
    chunks_linked: int = 0
    #: bytes linked without being copied off the device or hashed (identity)
    bytes_unread: int = 0

    def _known(self, key: str) -> str | None:
        """The digest of chunk ``key`` when its leaf is the very ``jax.Array``
        (alive, not deleted) this process saved to this root last time: its
        bytes are those it hashed then (jax arrays are immutable; a donated
        array is deleted); or when :attr:`known` records it."""
        digest = self.known.get(key)
        if digest is not None:
            return digest
        leaf, _, rest = key.partition("/c/")
        got = self.arrays.get(leaf)
        if got is None:
            return None
        path, arr = got
        with _LAST_LOCK:
            last = _LAST.get((self.root_id, path))
        if last is None:
            return None
        alive: Any = last[0]()
        if alive is None or alive is not arr:
            return None
        try:
            if alive.is_deleted():
                return None
        except Exception:
            return None
        return last[1].get(rest)

    async def link_known(self, keys: list[str], nbytes: int) -> bool:
        """Link every chunk of ``keys`` (``nbytes`` in all) without reading them,
        when each is known by identity or recorded digest (see :meth:`_known`)
        and equal to the previous step's; False, having staged nothing, when
        any is not."""
        if self.previous is None or not (self.arrays or self.known) or not keys:
            return False
        found = []
        for key in keys:
            digest = self._known(key)
            src = self.previous.sources.get(key)
            if digest is None or src is None or src[1] != digest:
                return False
            found.append((key, digest, src))
        for key, digest, src in found:
            if not await link_value(self.root, f"{step_dir(self.step)}/{key}", src[0]):
                return False  # the caller writes them: a key linked already is restaged
            self.digests[key] = digest
            self._linked_head(key, src)
        self.bytes_linked += nbytes
        self.bytes_unread += nbytes
        self.chunks_linked += len(keys)
        return True

    def remember(self) -> None:
        """After the commit: the digests of this save's jax leaves, for the
        identity shortcut of this process's next save to the same root (weak
        references only: the arrays are not kept alive)."""
        by_leaf: dict[str, dict[str, str]] = {}
        for key, digest in self.digests.items():
            leaf, _, rest = key.partition("/c/")
            if leaf in self.arrays:
                by_leaf.setdefault(leaf, {})[rest] = digest
        with _LAST_LOCK:
            for k in [k for k, (ref, _) in _LAST.items() if ref() is None]:
                del _LAST[k]
            for leaf, chunks in by_leaf.items():
                path, arr = self.arrays[leaf]
                try:
                    _LAST[(self.root_id, path)] = (weakref.ref(arr), chunks)
                except TypeError:  # not weakly referenceable: no shortcut
                    pass
        self.arrays = {}

    def _linked_head(self, key: str, src: tuple[str, str, str | None]) -> None:
        """A linked chunk holds its source's bytes, so its head is the source's."""
        if src[2] is not None:
            self.heads[key] = src[2]

    async def put(self, view: KvStore, key: str, data: np.ndarray, encoded: Any) -> None:
        """Store chunk ``key`` (relative to the step's folder, ``view``): linked when
        its digest equals the previous step's, else ``await encoded()`` written.
        Only leaves' chunks (``a/<i>/c/...``) get digests; other values (packs of
        small leaves, packing.py) are written as they are. A chunk whose head
        differs from the previous step's is written at once, hashed while it
        is written (module doc)."""
        if "/c/" not in key:  # not a leaf's chunk (a pack of small leaves): written as it is
            await view.write(key, await encoded())
            self.bytes_written += data.nbytes
            return
        src = self.previous.sources.get(key) if self.previous is not None else None
        known = self.known.get(key)
        head = self.known_heads.get(key) if known is not None else head_digest(data)
        if head is not None:
            self.heads[key] = head
        # a chunk whose head differs from the previous step's has changed: like a
        # chunk with nothing to link to, it is written at once and hashed meanwhile
        changed = src is not None and known is None and head is not None and src[2] is not None and src[2] != head
        if src is None or changed:
            async def write() -> None:
                await view.write(key, await encoded())

            if known is not None:
                await write()
                self.digests[key] = known
            else:
                self.digests[key], _ = await asyncio.gather(chunk_digest(data), write())
            self.bytes_written += data.nbytes
            return
        digest = known if known is not None else await chunk_digest(data)
        self.digests[key] = digest
        if src[1] == digest and await link_value(
            self.root, f"{step_dir(self.step)}/{key}", src[0]
        ):
            self._linked_head(key, src)
            self.bytes_linked += data.nbytes
            self.chunks_linked += 1
            return
        await view.write(key, await encoded())
        self.bytes_written += data.nbytes

    def document(self) -> bytes:
        doc: dict[str, Any] = {
            "format": DIGESTS_FORMAT, "algorithm": ALGORITHM, "chunks": dict(sorted(self.digests.items())),
        }
        heads = {k: h for k, h in self.heads.items() if k in self.digests}
        if heads:
            doc["head_bytes"] = HEAD_BYTES
            doc["heads"] = dict(sorted(heads.items()))
        return json.dumps(doc).encode()
