"""Reads of local files run on the caller's thread when it waits at once, yet
still start without anyone waiting, and run side by side when started together
(tensorstore.py::read, core/future.py::submit_blocking); blosc decodes there run
without c-blosc's own threads and leave numcodecs' setting as it was."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numcodecs.blosc
import numpy as np
import pytest

import tensorstore_py as tsp
import tensorstore_py.drivers.fastpath as fastpath
from tensorstore_py.drivers.codecs.blosc_codec import own_threads_only


def _blosc_array(tmp_path: Path) -> tuple[tsp.TensorStore, np.ndarray]:
    data = np.random.default_rng(3).integers(0, 40, (128, 128, 128), dtype=np.uint8)
    a = tsp.open((tmp_path / "n5").as_uri() + "/", driver="n5", create=True, dtype="uint8",
                 shape=data.shape, chunks=(64, 64, 64)).result()
    a.write(data).result()
    return a, data


def test_a_read_waited_on_at_once_runs_on_the_callers_thread(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    a, data = _blosc_array(tmp_path)
    threads: list[threading.Thread] = []
    real = fastpath.read_blocking

    def spy(*args: object, **kw: object) -> None:
        threads.append(threading.current_thread())
        real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(fastpath, "read_blocking", spy)
    for i in range(20):
        assert np.array_equal(a[i, :, 5:70].read().result(), data[i, :, 5:70])
    # a pool thread may win the odd race for the job; the caller takes nearly all
    assert sum(t is threading.current_thread() for t in threads) >= 15, threads


def test_a_read_nobody_waits_for_still_runs(tmp_path: Path) -> None:
    a, data = _blosc_array(tmp_path)
    f = a[3:90, 7:100].read()
    deadline = time.monotonic() + 30
    while not f.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert f.done()
    assert np.array_equal(f.result(), data[3:90, 7:100])


def test_reads_started_together_all_finish_exact(tmp_path: Path) -> None:
    a, data = _blosc_array(tmp_path)
    boxes = [np.s_[i:i + 40, 2 * i:2 * i + 50, 5:128] for i in range(0, 80, 8)]
    futures = [a[b].read() for b in boxes]
    for f, b in zip(futures, boxes, strict=True):
        assert np.array_equal(f.result(), data[b])


@pytest.mark.parametrize("setting", [None, True, False])
def test_blosc_on_the_main_thread_runs_without_its_own_threads(tmp_path: Path, setting: bool | None,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    assert threading.current_thread() is threading.main_thread()
    monkeypatch.setattr(numcodecs.blosc, "use_threads", setting)
    seen: list[object] = []

    def probe() -> int:
        seen.append(numcodecs.blosc.use_threads)
        return 7

    assert own_threads_only(probe) == 7
    assert seen == [False if setting is None else setting]  # a value the user set is left alone
    assert numcodecs.blosc.use_threads is setting
    a, data = _blosc_array(tmp_path)
    assert np.array_equal(a[5:100, 64, :].read().result(), data[5:100, 64, :])
    assert numcodecs.blosc.use_threads is setting


def test_blosc_off_the_main_thread_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(numcodecs.blosc, "use_threads", None)
    seen: list[object] = []
    t = threading.Thread(target=lambda: own_threads_only(lambda: seen.append(numcodecs.blosc.use_threads)))
    t.start()
    t.join()
    assert seen == [None]
