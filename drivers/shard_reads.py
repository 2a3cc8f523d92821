"""Reading part of a shard with as few requests as its needed inner chunks allow.

One algorithm, two I/O paths: :func:`read_part` is a generator that yields
what it needs (:class:`WholeShard`, :class:`IndexBytes`, :class:`InnerRanges`,
:class:`Work`) and receives the answers, so the async engine
(:func:`run_async`: any kvstore, requests concurrent) and the blocking path of
local files (:func:`run_blocking`, called on a pool thread) share every
decision and check.

Requests per partial shard read:

* **Most of the shard needed** (at least :data:`WHOLE_FRACTION` of its inner
  chunks): ONE read of the whole shard; its own index locates the inner chunks.
* Otherwise the index (or a cached one, see below), then the present inner
  chunks needed by byte range, ranges closer than :data:`COALESCE_GAP` merged
  into one request (requests run concurrently); more than :data:`FEW_PARTS`
  raw inner chunks come in ONE span when it holds at most
  :data:`SPAN_OVERREAD` times their bytes (then placed as records). A few
  chunks keep one request per run of neighbours: the 2 x 2 x 2 inner chunks
  of a 64^3 crop fetched as 2 spans of 1.5x the bytes instead of 4 runs were
  20 % slower over loopback HTTP.

**Index cache**: the decoded index of a shard is kept (:class:`ShardIndexCache`,
a few MiB per array) with the generation it was read at. A later read uses it
only together with data ranges read at that SAME generation (every range
request returns the shard's generation and is compared), so a cached index
never locates bytes of another version of the shard: on a mismatch the index
is read again. A read that would need no data request (every needed inner
chunk missing per the cached index) reads the index again, so a chunk
written since is never missed.

**Concurrent reads of one shard** (:class:`ShardRequests`, one per array, async
path): reads of the same shard's index in flight at once share ONE request
(16 crops of a shard whose index is not cached fetch it once), and the inner
chunk ranges that reads of one shard ask for in the same turn of the event
loop go out as ONE :meth:`~KvStore.read_ranges` call: duplicates are fetched
once and neighbours closer than :data:`COALESCE_GAP` merged, across the reads.
Each read still checks the generation it is answered at against its index.
A read alone goes out in the next turn of the loop (nothing waits for company).
Reads of one shard in flight at once also share their decoding
(:class:`DecodedChunks`, one per shard and generation): an encoded inner chunk
that several of them need is decoded once, by whichever needs it first, and
kept only while a read of that shard generation (or an answer for one) is
still in flight, so 16 crops of one shard decode each inner chunk once, not
once per crop, and nothing is kept once they are done. The generation says the
bytes are the same, as it does for the index cache; a crop's reads are charged
a whole shard's bytes in the engine's byte budget, which bounds what they keep.

Assembly: many raw inner chunks (a whole shard, or one span) land with
vectorised numpy copies (``codecs/_cells.py``); others are decoded one by one,
the encoded inner chunks of one partial read in runs of neighbours on the codec
threads at once (:class:`DecodeParts`; one crop's 8 zstd inner chunks on two
threads, not one).
A whole shard the engine reads (:func:`decode_whole`), and most of one read as
a whole shard (:class:`Works`), is decoded in runs of neighbouring inner chunks
on all codec threads at once: one shard read alone keeps every core busy
instead of one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import weakref
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from typing import Any

import numpy as np

from tensorstore_py.core.errors import ConditionFailedError
from tensorstore_py.core.ranges import coalesce
from tensorstore_py.drivers.codecs.sharding import FEW_PARTS, ShardingCodec
from tensorstore_py.drivers.grid import chunk_parts
from tensorstore_py.kvstore.base import ByteRange, Generation, RangesResult, ReadResult

__all__ = [
    "COALESCE_GAP",
    "WHOLE_FRACTION",
    "DecodeParts",
    "DecodedChunks",
    "IndexBytes",
    "InnerRanges",
    "ShardIndexCache",
    "ShardRequests",
    "WholeShard",
    "Work",
    "Works",
    "decode_whole",
    "read_part",
    "run_async",
    "run_blocking",
]

#: read the whole shard in one request when at least this share of its inner chunks is needed
WHOLE_FRACTION = 0.5
#: inner chunks of one shard closer than this are fetched in one request; larger
#: gaps would download data nobody asked for (remote stores run requests concurrently)
COALESCE_GAP = 16 << 10
#: decoding work (bytes of output or of compressed input) done where the answer
#: arrived rather than on a pool: a thread hop costs more (a 64^3 uint8 crop)
INLINE_BYTES = 256 << 10
_ATTEMPTS = 5
#: more raw inner chunks than FEW_PARTS come in one span when it holds at most
#: this many times the bytes they need
SPAN_OVERREAD = 1.5
#: a whole shard of encoded inner chunks is decoded in parts of at least this
#: many output bytes, each on a codec thread of its own (a thread hop costs
#: far less than decoding 1 MiB)
SPLIT_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class WholeShard:
    """Read the whole shard (answer: a ReadResult)."""


@dataclass(frozen=True, slots=True)
class IndexBytes:
    """Read ``range`` of the shard, its index (answer: a ReadResult)."""

    range: ByteRange


@dataclass(frozen=True, slots=True)
class InnerRanges:
    """Read these ranges of the shard at one generation (answer: a RangesResult)."""

    ranges: list[ByteRange]


@dataclass(frozen=True, slots=True)
class Work:
    """Run ``fn(*args)`` (GIL-releasing decoding and copies; ~``cost`` bytes of work);
    what it returns is the answer sent back to the reader."""

    fn: Callable[..., object]
    args: tuple[Any, ...]
    cost: int


@dataclass(frozen=True, slots=True)
class Works:
    """Run these independent :class:`Work` items, all at once where the driver
    can (answer: the list of what they return)."""

    items: list[Work]


@dataclass(frozen=True, slots=True)
class DecodeParts:
    """Decode the encoded inner chunks ``present`` of shard ``key`` (as from
    :meth:`ShardingCodec.present_parts`), read as ``values`` by the last
    :class:`InnerRanges`, into their parts of ``dest`` (answer: None). The async
    driver decodes runs of them on the codec threads at once and shares the
    decoded chunks with the other reads of the shard at that generation in flight."""

    sh: ShardingCodec
    key: str
    present: list[tuple[Any, int, int]]
    values: list[Any]
    dest: np.ndarray


Request = WholeShard | IndexBytes | InnerRanges | Work | Works | DecodeParts


class DecodedChunks:
    """Encoded inner chunks of one shard generation decoded by the reads of it
    in flight (an ``(offset, nbytes)`` names the same bytes for all of them):
    each decoded once, by the first read that needs it; the others take it.
    Kept as long as this object is: :class:`ShardRequests` holds it only weakly,
    the reads and the answers of that generation in flight hold it. Thread-safe:
    a read that needs a chunk another thread is decoding waits for that decode
    (a claim is only ever held by a thread decoding it right now)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: dict[tuple[int, int], concurrent.futures.Future[np.ndarray]] = {}

    def get(self, off: int, n: int, decode: Callable[[], np.ndarray]) -> np.ndarray:
        """The decoded inner chunk at ``[off, off + n)``: ``decode()`` unless another
        read has decoded it (or is decoding it)."""
        slot = (off, n)
        with self._lock:
            fut = self._items.get(slot)
            mine = fut is None
            if fut is None:
                fut = self._items[slot] = concurrent.futures.Future()
        if not mine:
            return fut.result()
        try:
            arr = decode()
        except BaseException as e:
            with self._lock:  # a later read decodes again; those waiting now share this failure
                self._items.pop(slot, None)
            fut.set_exception(e)
            raise
        fut.set_result(arr)
        return arr


class ShardIndexCache:
    """Decoded shard indexes with their generations, at most ``limit`` bytes
    (LRU; an index larger than an eighth of that is not kept). Thread-safe."""

    def __init__(self, limit: int = 8 << 20) -> None:
        self.limit = limit
        self._items: OrderedDict[str, tuple[Generation, np.ndarray]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> tuple[Generation, np.ndarray] | None:
        with self._lock:
            item = self._items.get(key)
            if item is not None:
                self._items.move_to_end(key)
            return item

    def put(self, key: str, generation: Generation, index: np.ndarray) -> None:
        if index.nbytes * 8 > self.limit:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= old[1].nbytes
            self._items[key] = (generation, index)
            self._bytes += index.nbytes
            while self._bytes > self.limit:
                _k, (_g, idx) = self._items.popitem(last=False)
                self._bytes -= idx.nbytes

    def drop(self, key: str) -> None:
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= old[1].nbytes


class ShardRequests:
    """Range reads of shards in flight on one event loop, shared between
    concurrent reads of the same shard (see the module docstring). ``gap``:
    ranges closer than this are merged into one request."""

    def __init__(self, gap: int = COALESCE_GAP) -> None:
        self.gap = gap
        # per loop: key -> the index read in flight; key -> ranges waiting for this turn
        self._index: dict[tuple[asyncio.AbstractEventLoop, str], asyncio.Task[ReadResult]] = {}
        self._pending: dict[tuple[asyncio.AbstractEventLoop, str],
                            tuple[list[ByteRange], asyncio.Future[tuple[RangesResult, DecodedChunks | None]]]] = {}
        # per loop, shard key and generation: the inner chunks its reads in flight decoded
        self._decoded: weakref.WeakValueDictionary[tuple[asyncio.AbstractEventLoop, str, Generation],
                                                   DecodedChunks] = weakref.WeakValueDictionary()
        self._sending: set[asyncio.Task[None]] = set()

    async def index(self, kv: Any, key: str, rng: ByteRange) -> ReadResult:
        """``kv.read(key, byte_range=rng)``, one request for every caller while it is in flight."""
        slot = (asyncio.get_running_loop(), key)
        task = self._index.get(slot)
        if task is None:
            task = asyncio.ensure_future(kv.read(key, byte_range=rng))
            self._index[slot] = task
            task.add_done_callback(lambda t: self._index.pop(slot, None) if self._index.get(slot) is t else None)
            task.add_done_callback(_retrieve)
        return await asyncio.shield(task)

    async def ranges(self, kv: Any, key: str, ranges: list[ByteRange]) -> RangesResult:
        """``ranges`` of ``key`` at one generation, read together with the ranges
        of ``key`` that other callers ask for in this turn of the loop."""
        return (await self.ranges_shared(kv, key, ranges))[0]

    async def ranges_shared(self, kv: Any, key: str,
                            ranges: list[ByteRange]) -> tuple[RangesResult, DecodedChunks | None]:
        """:meth:`ranges`, and the :class:`DecodedChunks` of the shard generation
        they were read at (None when the shard is missing)."""
        loop = asyncio.get_running_loop()
        slot = (loop, key)
        batch = self._pending.get(slot)
        if batch is None:
            batch = self._pending[slot] = ([], loop.create_future())
            loop.call_soon(self._send, kv, key, slot)
        first = len(batch[0])
        batch[0].extend(ranges)
        res, decoded = await asyncio.shield(batch[1])
        if res.state == "missing":
            return res, None
        return RangesResult("value", res.values[first: first + len(ranges)], res.generation), decoded

    def _decoded_at(self, loop: asyncio.AbstractEventLoop, key: str, gen: Generation) -> DecodedChunks:
        """The :class:`DecodedChunks` of shard ``key`` at ``gen`` (made when no read of
        that generation holds one); on the loop thread."""
        slot = (loop, key, gen)
        decoded = self._decoded.get(slot)
        if decoded is None:
            decoded = self._decoded[slot] = DecodedChunks()
        return decoded

    def _send(self, kv: Any, key: str, slot: tuple[asyncio.AbstractEventLoop, str]) -> None:
        ranges, fut = self._pending.pop(slot)

        async def go() -> None:
            try:
                res = await kv.read_ranges(key, ranges, coalesce_gap=self.gap)
            except asyncio.CancelledError:
                fut.cancel()
                raise
            except Exception as e:  # every waiter gets the failure
                if not fut.done():
                    fut.set_exception(e)
            else:
                if not fut.done():  # the answer holds its generation's decoded chunks for its waiters
                    fut.set_result((res, None if res.state == "missing"
                                    else self._decoded_at(slot[0], key, res.generation)))

        task = asyncio.ensure_future(go())
        self._sending.add(task)  # the loop keeps only a weak reference to a task
        task.add_done_callback(self._sending.discard)
        fut.add_done_callback(_retrieve)


def _retrieve(fut: asyncio.Future[Any]) -> None:
    # a failure whose waiters were all cancelled is not "never retrieved"
    if not fut.cancelled():
        fut.exception()


def read_part(sh: ShardingCodec, key: str, region: tuple[slice, ...], dest: np.ndarray,
              cache: ShardIndexCache | None) -> Generator[Request, Any, None]:
    """Fill ``dest`` with ``region`` (normalised slices inside the shard) of the
    shard stored at ``key``; a missing shard or inner chunk reads as the fill
    value. Drive it with :func:`run_async` or :func:`run_blocking`."""
    parts = list(chunk_parts(region, sh.chunk_shape, sh.shard_shape))
    if len(parts) >= WHOLE_FRACTION * len(sh.cells):
        res: ReadResult = yield WholeShard()
        if res.state == "missing":
            dest[...] = sh.fill
            return
        idx = sh.whole_index(res.value, key=key)
        if cache is not None:
            cache.put(key, res.generation, idx)
        if sh.raw_inner:
            yield Work(sh.read_region, (res.value, idx, region, parts, dest, key), _cost(sh, dest, parts))
        else:  # encoded inner chunks: decoded in runs of neighbours, at once where there are threads
            present = sh.present_parts(idx, parts, dest)
            mv = memoryview(res.value).cast("B")
            yield Works([Work(sh.decode_present, (key, run, [mv[o: o + n] for _, o, n in run], dest),
                              len(run) * sh.inner.nbytes) for run in _runs(present, sh.inner.nbytes)])
        return
    for _attempt in range(_ATTEMPTS):
        hit = cache.get(key) if cache is not None else None
        if hit is not None:
            gen, idx = hit
        else:
            ires: ReadResult = yield IndexBytes(sh.index_range())
            if ires.state == "missing":
                dest[...] = sh.fill
                return
            gen, idx = ires.generation, sh.decode_index(ires.value, key=key)
        present = sh.present_parts(idx, parts, dest)
        if not present:
            if hit is None:
                return
            cache.drop(key)  # type: ignore[union-attr]  # no data read confirms it: look again
            continue
        span = _one_span(sh, parts, present)
        ranges = [ByteRange(o, o + n) for _, o, n in present] if span is None else [span]
        rr: RangesResult = yield InnerRanges(ranges)
        if rr.state == "missing" or rr.generation != gen:
            if cache is not None:
                cache.drop(key)
            continue  # the shard changed since its index was read: again
        if hit is None and cache is not None:
            cache.put(key, gen, idx)
        if span is None and not sh.raw_inner:
            yield DecodeParts(sh, key, present, rr.values, dest)
        elif span is None:
            yield Work(sh.decode_present, (key, present, rr.values, dest), _cost(sh, dest, present))
        else:  # many raw inner chunks in one span: placed as records, not one by one
            yield Work(sh.read_region, (rr.values[0], idx, region, parts, dest, key, span.start),
                       _cost(sh, dest, present))
        return
    raise ConditionFailedError(f"shard {key!r} kept changing while being read")


def _one_span(sh: ShardingCodec, parts: list[Any], present: list[tuple[Any, int, int]]) -> ByteRange | None:
    """One range holding every present inner chunk needed, when they are many
    raw ones and it reads at most :data:`SPAN_OVERREAD` times their bytes."""
    if not sh.raw_inner or len(parts) <= FEW_PARTS:
        return None
    lo = min(o for _, o, _n in present)
    hi = max(o + n for _, o, n in present)
    return ByteRange(lo, hi) if hi - lo <= SPAN_OVERREAD * sum(n for _, _, n in present) else None


def _runs(present: list[Any], nbytes: int) -> list[list[Any]]:
    """``present`` in runs of neighbours of at least :data:`SPLIT_BYTES` of
    decoded inner chunks (``nbytes`` each)."""
    ways = max(1, min(len(present), len(present) * nbytes // SPLIT_BYTES))
    bounds = [len(present) * i // ways for i in range(ways + 1)]
    return [present[a:b] for a, b in zip(bounds, bounds[1:])]


def _cost(sh: ShardingCodec, dest: np.ndarray, parts: list[Any]) -> int:
    # raw inner chunks cost a copy of the output; others decompress whole chunks
    return dest.nbytes if sh.raw_inner else len(parts) * sh.inner.nbytes


async def decode_whole(sh: ShardingCodec, buf: Any, key: str, dest: np.ndarray,
                       offload: Callable[..., Awaitable[Any]], threads: int) -> None:
    """Decode the whole stored shard ``buf`` into ``dest`` (shard-shaped).

    Encoded inner chunks are decoded in up to ``threads`` runs of neighbouring
    cells (each at least :data:`SPLIT_BYTES` of output) through ``offload`` at
    once, so that one shard keeps every codec thread busy; raw inner chunks are
    placed by the codec's vectorised copies in one call."""
    n = len(sh.cells)
    ways = 1 if sh.raw_inner else max(1, min(threads, n, dest.nbytes // SPLIT_BYTES))
    if ways == 1:
        if dest.nbytes <= INLINE_BYTES:
            _decode_all(sh, buf, dest, key)
        else:
            await offload(_decode_all, sh, buf, dest, key)
        return
    idx = sh.whole_index(buf, key=key)
    bounds = [n * i // ways for i in range(ways + 1)]
    runs = [offload(_decode_cells, sh, buf, idx, a, b, dest, key) for a, b in zip(bounds, bounds[1:])]
    await asyncio.gather(*runs)


def _decode_all(sh: ShardingCodec, buf: Any, dest: np.ndarray, key: str) -> None:
    sh.decode(buf, dest.shape, dest.dtype, key=key, out=dest)


def _decode_cells(sh: ShardingCodec, buf: Any, idx: np.ndarray, first: int, stop: int,
                  dest: np.ndarray, key: str) -> None:
    sh.decode_cells(buf, idx, first, stop, dest, key=key)


def _step(reader: Generator[Request, Any, None], answer: Any) -> Request | None:
    """The reader's next request after ``answer`` (None: it is done)."""
    try:
        return reader.send(answer)
    except StopIteration:
        return None


async def run_async(reader: Generator[Request, Any, None], kv: Any, key: str,
                    offload: Callable[..., Awaitable[Any]],
                    shared: ShardRequests | None = None) -> None:
    """Drive ``reader`` through ``kv``'s async API; :class:`Work` larger than
    :data:`INLINE_BYTES` runs through ``offload(fn, *args)`` (a pool).
    ``shared``: the array's :class:`ShardRequests` (concurrent reads of one
    shard share their requests)."""
    async def work(w: Work) -> Any:
        return w.fn(*w.args) if w.cost <= INLINE_BYTES else await offload(w.fn, *w.args)

    decoded: DecodedChunks | None = None  # shared with the reads of the last answer's generation
    req = _step(reader, None)
    while req is not None:
        if isinstance(req, Work):
            answer = await work(req)
        elif isinstance(req, Works):
            answer = await asyncio.gather(*(work(w) for w in req.items))
        elif isinstance(req, DecodeParts):
            d, nbytes = req, req.sh.inner.nbytes
            await asyncio.gather(*(work(Work(d.sh.decode_present, (
                d.key, [p for p, _ in run], [v for _, v in run], d.dest, decoded), len(run) * nbytes))
                for run in _runs(list(zip(d.present, d.values, strict=True)), nbytes)))
            answer = None
        elif isinstance(req, InnerRanges):
            if shared is not None:
                answer, decoded = await shared.ranges_shared(kv, key, req.ranges)
            else:
                answer = await kv.read_ranges(key, req.ranges, coalesce_gap=COALESCE_GAP)
        elif isinstance(req, IndexBytes):
            answer = (await shared.index(kv, key, req.range) if shared is not None
                      else await kv.read(key, byte_range=req.range))
        else:
            answer = await kv.read(key)
        req = _step(reader, answer)


def run_blocking(reader: Generator[Request, Any, None], kv: Any, full: str) -> None:
    """Drive ``reader`` through ``kv``'s blocking I/O hooks (``full``: the
    shard's full path), on the calling thread."""
    req = _step(reader, None)
    while req is not None:
        if isinstance(req, Work):
            answer = req.fn(*req.args)
        elif isinstance(req, Works):
            answer = [w.fn(*w.args) for w in req.items]
        elif isinstance(req, DecodeParts):
            req.sh.decode_present(req.key, req.present, req.values, req.dest)
            answer = None
        elif isinstance(req, InnerRanges):
            answer = _ranges_blocking(kv, full, req.ranges)
        elif isinstance(req, IndexBytes):
            answer = kv._read_blocking(full, req.range, None)
        else:
            answer = kv._read_blocking(full, None, None)
        req = _step(reader, answer)


def _ranges_blocking(kv: Any, full: str, ranges: list[ByteRange]) -> RangesResult:
    """The ranges, coalesced as ``KvStore.read_ranges`` does; a shard that
    changed between the requests answers with NO_VALUE as its generation (the
    reader then starts again)."""
    values: list[Any] = [b""] * len(ranges)
    gen: Generation | None = None
    for g, members in coalesce(ranges, COALESCE_GAP):
        res = kv._read_blocking(full, g, None)
        if res.state == "missing":
            return RangesResult("missing", [], Generation.NO_VALUE)
        if gen is not None and res.generation != gen:
            return RangesResult("value", values, Generation.NO_VALUE)
        gen = res.generation
        mv = memoryview(res.value)
        for i in members:
            r = ranges[i]
            values[i] = mv[r.start - g.start: r.stop - g.start]  # type: ignore[operator]
    return RangesResult("value", values, gen or Generation.NO_VALUE)
