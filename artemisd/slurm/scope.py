"""Cancelling a Slurm read nobody waits for: the commands it runs are killed.

Here, not in api.py: the pure core imports api.py's values, and may not import
``subprocess``.
"""

from __future__ import annotations

import contextvars
import subprocess
import threading


class CancelScope:
    """The Slurm commands one read runs; ``cancel`` kills them.

    A thread cannot be stopped from outside, but the command it waits on can:
    the daemon cancels the scope of a read whose requests have all gone away,
    the command is killed, and the worker is free at once instead of after
    SlurmTimeout.  Backends without commands (pyslurm) are bounded by their
    pool instead.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: set[subprocess.Popen] = set()
        self.cancelled = False

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            running = list(self._running)
        for proc in running:
            _kill(proc)

    def started(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._running.add(proc)
            cancelled = self.cancelled
        if cancelled:
            _kill(proc)

    def finished(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._running.discard(proc)


def _kill(proc: subprocess.Popen) -> None:
    try:
        proc.kill()
    except OSError:
        pass  # it ended meanwhile


# The scope of the read the current thread works for (set by the daemon's read pool).
CURRENT_SCOPE: contextvars.ContextVar[CancelScope | None] = contextvars.ContextVar("slurm_scope", default=None)
