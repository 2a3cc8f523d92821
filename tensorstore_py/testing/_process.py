"""What the test servers that run as subprocesses share: a temporary directory
with the server's log, and stopping (terminate, then kill), at the latest when
the interpreter exits: a script that fails between ``start()`` and ``stop()``
leaves no server running behind it."""

from __future__ import annotations

import atexit
import subprocess
import tempfile
from pathlib import Path
from typing import IO, Self

__all__ = ["ServerProcess"]

#: servers started and not yet stopped (held here, so that one whose object was
#: dropped without stop() is still stopped at interpreter exit)
_running: set[ServerProcess] = set()


@atexit.register
def _stop_all() -> None:
    for server in list(_running):
        server.stop()


class ServerProcess:
    """A server subprocess (``_proc``) with a temporary directory (``_tmp``) that
    holds its log; subclasses implement ``start()``."""

    _proc: subprocess.Popen[bytes] | None = None
    _tmp: tempfile.TemporaryDirectory[str] | None = None
    _log: IO[bytes] | None = None

    def _open_log(self, prefix: str) -> Path:
        """Make the temporary directory and open the log file; the directory."""
        self._tmp = tempfile.TemporaryDirectory(prefix=prefix)
        _running.add(self)  # every start() begins here
        # stays open for the server's lifetime; closed in stop()
        self._log = open(Path(self._tmp.name, "server.log"), "wb")
        return Path(self._tmp.name)

    def start(self) -> Self:
        raise NotImplementedError

    def _terminate(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def stop(self) -> None:
        """Stop the server and delete its temporary directory."""
        _running.discard(self)
        self._terminate()
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def log_text(self) -> str:
        """The server's log so far (for failure messages)."""
        if self._tmp is None:
            return ""
        try:
            return Path(self._tmp.name, "server.log").read_text(errors="replace")
        except OSError:
            return ""

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
