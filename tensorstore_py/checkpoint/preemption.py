"""Noticing that the job is being preempted: SIGTERM, or JAX's preemption sync point.

:class:`PreemptionWatch` answers one question per training step,
``reached(step)``: must this step be saved because the job is going away?

* Single process: a SIGTERM handler (installed only when asked, in the main
  thread) records the notice and calls the handler that was installed before
  it, if that was a Python callable (``SIG_DFL`` is not called: terminating
  at once is what the notice replaces). The next ``reached`` returns True.
* Multi-controller JAX jobs: ``jax.experimental.multihost_utils.
  reached_preemption_sync_point(step)`` is asked at every ``reached`` call
  (when ``jax.distributed`` is initialised with its preemption service); it
  returns True on every process at the same step, so all of them save it.
  JAX's service catches SIGTERM itself, so no Python handler is installed then.

Once noticed, the notice stays: every later ``reached`` returns True (the
loop should save and stop).
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from typing import Any

__all__ = ["PreemptionWatch"]

log = logging.getLogger("tensorstore_py.checkpoint")


def _jax_sync_point() -> Any:
    """``reached_preemption_sync_point`` when this is a multi-controller JAX job with a
    preemption sync manager, else None (JAX only when the program imported it)."""
    jax = sys.modules.get("jax")
    if jax is None:
        return None
    try:
        # JAX is imported already (checked above); its distributed state lives here
        from jax._src import distributed

        # JAX again (imported already): the preemption sync point lives here
        from jax.experimental import multihost_utils
    except ImportError:
        return None
    state = distributed.global_state
    if getattr(state, "client", None) is None or getattr(state, "preemption_sync_manager", None) is None:
        return None
    return multihost_utils.reached_preemption_sync_point


class PreemptionWatch:
    """SIGTERM (``sigterm=True``) and JAX preemption notices (see the module docstring)."""

    def __init__(self, *, sigterm: bool = True) -> None:
        self.notice = threading.Event()
        #: the step ``reached`` first answered True for (None: not yet)
        self.step: int | None = None
        #: a step was saved since the notice (the manager sets it)
        self.saved = False
        self._previous: Any = None
        self._installed = False
        if sigterm and _jax_sync_point() is not None:
            # JAX's preemption service handles SIGTERM itself (and tells every
            # process): a Python handler would replace its own
            sigterm = False
        if sigterm:
            if threading.current_thread() is not threading.main_thread():
                log.warning("save_on_preemption: not in the main thread, so no SIGTERM handler is "
                            "installed (only JAX's preemption sync point is watched)")
            else:
                self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
                self._installed = True

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self.notice.set()
        log.warning("SIGTERM received: the next checkpoint step is saved and persisted")
        prev = self._previous
        if callable(prev):
            prev(signum, frame)

    def reached(self, step: int) -> bool:
        """True when ``step`` must be saved because of a preemption notice."""
        if not self.notice.is_set():
            sync = _jax_sync_point()
            if sync is not None and sync(step):
                self.notice.set()
        if self.notice.is_set() and self.step is None:
            self.step = step
        return self.notice.is_set()

    def close(self) -> None:
        """Put back the SIGTERM handler found at construction (main thread only)."""
        if self._installed and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed = False
