"""The Future type, the background loop, and their behaviour across fork."""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
import os
import threading
import time
from pathlib import Path

import pytest

import tensorstore_py as tsp
from tensorstore_py.core.future import Future, get_loop, in_loop_thread, ready, run_sync, spawn
from tensorstore_py.core.pools import run_cpu, run_io
from tensorstore_py.errors import DeadlineExceededError, LoopError


async def _value(v: object, delay: float = 0.0) -> object:
    await asyncio.sleep(delay)
    return v


async def _fail(exc: BaseException) -> None:
    await asyncio.sleep(0)
    raise exc


def test_result_and_done() -> None:
    f = spawn(_value(41, 0.05))
    assert isinstance(f, Future)
    assert not f.done()
    assert f.result(10) == 41
    assert f.done() and not f.cancelled()
    assert f.exception() is None
    assert "done" in repr(f)


def test_errors_propagate_with_their_type() -> None:
    f = spawn(_fail(tsp.ConditionFailedError("lost")))
    with pytest.raises(tsp.ConditionFailedError, match="lost"):
        f.result(10)
    assert isinstance(f.exception(), tsp.ConditionFailedError)
    assert "ConditionFailedError" in repr(f)


def test_await_from_another_event_loop() -> None:
    async def main() -> list[object]:
        a = spawn(_value("a", 0.02))
        b = spawn(_value("b"))
        return [await a, await b, await ready("c")]

    assert asyncio.run(main()) == ["a", "b", "c"]


def test_await_on_the_library_loop() -> None:
    async def outer() -> tuple[bool, object]:
        inner = spawn(_value(7))  # spawned from the loop thread: a task, no thread hop
        return in_loop_thread(), await inner

    assert spawn(outer()).result(10) == (True, 7)


def test_add_done_callback() -> None:
    seen: list[tuple[object, bool]] = []
    done = threading.Event()
    f = spawn(_value(5, 0.02))

    def cb(fut: Future[object]) -> None:
        seen.append((fut.result(), fut is f))
        done.set()

    f.add_done_callback(cb)
    assert done.wait(10)
    assert seen == [(5, True)]
    # a callback added after completion runs at once
    late: list[object] = []
    f.add_done_callback(lambda fut: late.append(fut.result()))
    assert late == [5]


def test_cancel_pending_operation() -> None:
    started = threading.Event()
    finished = threading.Event()

    async def slow() -> None:
        started.set()
        await asyncio.sleep(30)
        finished.set()

    f = spawn(slow())
    assert started.wait(10)
    assert f.cancel() is True
    with pytest.raises(concurrent.futures.CancelledError):
        f.result(10)
    assert f.cancelled() and f.done()
    assert not finished.is_set()
    assert spawn(_value(1)).cancel() in (True, False)  # racing completion is fine
    g = spawn(_value(2))
    g.result(10)
    assert g.cancel() is False


def test_cancel_from_the_loop_thread() -> None:
    async def outer() -> bool:
        inner = spawn(_value(1, 30))
        inner.cancel()
        try:
            await inner
        except asyncio.CancelledError:
            return True
        return False

    assert spawn(outer()).result(10) is True


def test_result_on_the_loop_thread_raises_instead_of_deadlocking() -> None:
    async def misuse() -> str:
        pending = spawn(_value(1, 0.5))
        try:
            pending.result()
        except LoopError as e:
            return str(e)
        return "no error"

    msg = spawn(misuse()).result(10)
    assert "await" in msg and "deadlock" in msg

    # a finished Future may be read anywhere
    async def fine() -> object:
        f = ready(3)
        return f.result()

    assert spawn(fine()).result(10) == 3


def test_timeout_raises_deadline_exceeded_and_work_continues() -> None:
    f = spawn(_value("late", 0.3))
    t0 = time.perf_counter()
    with pytest.raises(DeadlineExceededError) as info:
        f.result(timeout=0.05)
    assert isinstance(info.value, TimeoutError)
    assert time.perf_counter() - t0 < 0.3
    assert f.result(10) == "late"


def test_run_io_and_run_cpu_leave_the_loop_thread() -> None:
    loop_thread: list[threading.Thread] = []

    async def main() -> tuple[bool, bool]:
        loop_thread.append(threading.current_thread())
        a = await run_io(lambda: threading.current_thread() is not loop_thread[0])
        b = await run_cpu(lambda: threading.current_thread() is not loop_thread[0])
        return a, b

    assert spawn(main()).result(10) == (True, True)
    assert run_sync(_value(9), 10) == 9


def test_many_threads_share_one_loop() -> None:
    loop = get_loop()
    results: list[object] = []

    def worker(i: int) -> None:
        results.append(spawn(_value(i)).result(10))
        assert get_loop() is loop

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == list(range(16))  # type: ignore[type-var]


# -- fork -------------------------------------------------------------------------
def _child_uses_file_store(root: str, q: multiprocessing.Queue) -> None:
    kv = tsp.KvStore.open(f"file://{root}/").result(30)
    g = kv.write("child", f"from {os.getpid()}".encode()).result(30)
    r = kv.read("parent").result(30)
    q.put(
        (
            bytes(r.value),
            bytes(kv.read("child").result(30).value),
            g.token.hex(),
            spawn(_value("loop ok")).result(30),
        )
    )


def test_fork_child_gets_a_fresh_loop(tmp_path: Path) -> None:
    kv = tsp.KvStore.open(f"file://{tmp_path}/").result()
    kv.write("parent", b"written before fork").result()
    pending = spawn(_value("still pending", 1.0))  # the loop is busy while we fork
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_child_uses_file_store, args=(str(tmp_path), q)) for _ in range(2)]
    for p in procs:
        p.start()
    got = [q.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    for parent_value, child_value, _gen, loop_ok in got:
        assert parent_value == b"written before fork"
        assert child_value.startswith(b"from ")
        assert loop_ok == "loop ok"
    assert pending.result(10) == "still pending"
    assert kv.read("child").result().state == "value"


def test_raw_os_fork(tmp_path: Path) -> None:
    get_loop()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: must not deadlock on the parent's loop
        try:
            kv = tsp.KvStore.open(f"file://{tmp_path}/").result(20)
            kv.write("k", b"child").result(20)
            os.write(w, bytes(kv.read("k").result(20).value))
        finally:
            os._exit(0)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    data = os.read(r, 100)
    os.close(r)
    assert os.waitstatus_to_exitcode(status) == 0
    assert data == b"child"
