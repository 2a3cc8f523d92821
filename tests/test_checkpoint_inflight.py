"""The interpreter-exit hook of background saves (checkpoint/inflight.py)."""

from __future__ import annotations

import concurrent.futures
import logging
import threading

import pytest

from tensorstore_py.checkpoint import inflight
from tensorstore_py.core.future import Future


def test_a_save_already_waited_for_is_not_in_flight_at_exit(caplog: pytest.LogCaptureFixture) -> None:
    """A future's done-callbacks run after its waiters wake, so a save that the
    caller has just waited for can still be listed when the interpreter exits: it
    must not be reported (nor waited for) as in flight."""
    cf: concurrent.futures.Future[int] = concurrent.futures.Future()
    release = threading.Event()
    cf.add_done_callback(lambda _f: release.wait(10))  # runs before track's callback
    inflight.track(Future(cf), what="checkpoint step 7", exit_timeout=30.0)
    setter = threading.Thread(target=cf.set_result, args=(1,))
    setter.start()
    try:
        assert cf.result(10) == 1  # the caller's wait is over; track's callback has not run
        with caplog.at_level(logging.WARNING, logger=inflight.log.name):
            inflight.finish_at_exit()
        assert not [r for r in caplog.records if "step 7" in r.getMessage()]
    finally:
        release.set()
        setter.join(10)
    assert not any(e.what == "checkpoint step 7" for e in inflight._inflight.values())


def test_a_save_still_running_at_exit_is_waited_for_and_reported(caplog: pytest.LogCaptureFixture) -> None:
    cf: concurrent.futures.Future[int] = concurrent.futures.Future()
    inflight.track(Future(cf), what="checkpoint step 8", exit_timeout=30.0)
    timer = threading.Timer(0.2, cf.set_result, args=(1,))
    timer.start()
    with caplog.at_level(logging.INFO, logger=inflight.log.name):
        inflight.finish_at_exit()
    timer.join(10)
    messages = [r.getMessage() for r in caplog.records if "step 8" in r.getMessage()]
    assert any("in flight" in m for m in messages), messages
    assert any("finished at interpreter exit" in m for m in messages), messages
    assert cf.done()
