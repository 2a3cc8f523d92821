"""Peak resident memory of this process image, for memory tests and benchmarks.

On Linux ``getrusage(RUSAGE_SELF).ru_maxrss`` survives ``fork`` and ``execve``: a
subprocess started by a test runner that has grown to 1 GiB reports at least 1 GiB
whatever it does itself, so a bound on it fails for no reason and a difference
against a baseline taken in the child hides the child's own growth. ``VmHWM`` in
``/proc/self/status`` belongs to the address space the process runs in now, and
writing ``5`` to ``/proc/self/clear_refs`` resets it to the current RSS.
"""

from __future__ import annotations

import resource

__all__ = ["PeakRss", "current_rss", "peak_rss"]


def _status(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss() -> int:
    """Peak RSS in bytes of this process image (``VmHWM``; ``ru_maxrss`` where
    ``/proc`` is missing, which may include a parent's peak)."""
    hwm = _status("VmHWM:")
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss() -> int:
    """Resident bytes now (``VmRSS``; the peak where ``/proc`` is missing)."""
    rss = _status("VmRSS:")
    return rss if rss is not None else peak_rss()


class PeakRss:
    """The growth of peak RSS from construction: ``extra()`` is the peak since then
    minus the RSS at construction. The peak is reset where the kernel allows it
    (``clear_refs``); otherwise it is the image's peak so far."""

    def __init__(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
        self.base = current_rss()

    def extra(self) -> int:
        return max(0, peak_rss() - self.base)
