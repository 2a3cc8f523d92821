"""RecycledBuffers: a block serves again only once nothing refers to it."""

from __future__ import annotations

import threading

import numpy as np

from tensorstore_py.core.recycled import RecycledBuffers


def _address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def test_a_block_serves_again_once_every_view_of_it_is_gone() -> None:
    pool = RecycledBuffers(keep_bytes=64 << 20)
    a = pool.get(3 << 20)
    assert a.nbytes == 3 << 20 and a.dtype == np.uint8 and _address(a) % 4096 == 0
    where = _address(a)
    derived = np.frombuffer(memoryview(a)[1024:], dtype=np.float32)  # a view of a view
    del a
    b = pool.get(3 << 20)
    assert _address(b) != where  # still in use through `derived`
    del derived
    assert pool.kept_bytes >= 3 << 20
    c = pool.get(2 << 20)  # a smaller one fits in the block that came back
    assert _address(c) == where and c.nbytes == 2 << 20
    del b, c


def test_numpy_slices_keep_their_block() -> None:
    """numpy gives a slice of a view the block itself as its base: the block must
    still not serve again while only such a slice (or a reshape, a dtype view) lives."""
    pool = RecycledBuffers(keep_bytes=64 << 20)
    for derive in (lambda a: a[:1000], lambda a: a.reshape(1024, -1)[3:], lambda a: a.view(np.float32)[7:],
                   lambda a: a[::2], lambda a: np.asarray(a)[5:]):
        a = pool.get(2 << 20)
        a[:] = 7
        part = derive(a)
        where = _address(a)
        del a
        b = pool.get(2 << 20)
        assert _address(b) != where and pool.kept_bytes == 0
        b[:] = 1
        assert (part.view(np.uint8) == 7).all()
        del part, b
        pool.clear()


def test_only_blocks_of_a_similar_size_are_reused() -> None:
    pool = RecycledBuffers(keep_bytes=64 << 20)
    big = pool.get(16 << 20)
    where = _address(big)
    del big
    small = pool.get(1 << 20)  # a 16 MiB block is not spent on 1 MiB
    assert _address(small) != where
    assert pool.kept_bytes == 16 << 20


def test_at_most_keep_bytes_are_kept() -> None:
    pool = RecycledBuffers(keep_bytes=5 << 20)
    views = [pool.get(2 << 20) for _ in range(4)]
    del views
    assert pool.kept_bytes == 4 << 20  # two blocks kept, the others went back to the system
    pool.clear()
    assert pool.kept_bytes == 0


def test_views_dropped_on_other_threads() -> None:
    pool = RecycledBuffers(keep_bytes=256 << 20)
    views = [pool.get(1 << 20) for _ in range(64)]
    for i in range(len(views)):
        views[i][:] = i

    def drop(part: list[np.ndarray]) -> None:
        part.clear()

    parts = [views[i::4] for i in range(4)]
    del views
    threads = [threading.Thread(target=drop, args=(p,)) for p in parts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert pool.kept_bytes == 64 << 20
    again = [pool.get(1 << 20) for _ in range(64)]
    assert len({_address(v) for v in again}) == 64  # every block handed out once
    assert pool.kept_bytes == 0
