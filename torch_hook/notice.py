"""One line in the job's stderr when nothing watches it, and one when something does again.

A job under ``--artemis=on`` whose daemon cannot be reached trains normally
(reports are dropped and counted), but the user should know that nobody is
watching: the first failed send prints one line, and the first successful send
after failures prints one more.  Never more than that per outage, whatever the
number of windows: stderr is the user's, not ours.
"""

from __future__ import annotations

import sys
import threading
from typing import TextIO


class Reachability:
    """Tracks whether the daemon answered the last send; speaks only on a change."""

    def __init__(self, endpoint: str | None, rank: int | None = None, stream: TextIO | None = None):
        self.endpoint = endpoint
        self.rank = rank
        self._stream = stream
        self._down = False
        self._dropped_at_down = 0
        self._lock = threading.Lock()

    def _say(self, text: str) -> None:
        who = f"rank {self.rank}" if self.rank is not None else "probe"
        stream = self._stream if self._stream is not None else sys.stderr
        try:
            print(f"artemis ({who}): {text}", file=stream, flush=True)
        except (OSError, ValueError):  # a closed stderr must not break training
            pass

    def failed(self, error: str, dropped_before: int) -> None:
        """A send failed; ``dropped_before``: the cumulative drop count before this batch."""
        with self._lock:
            if self._down:
                return
            self._down, self._dropped_at_down = True, dropped_before
        self._say(f"cannot reach the Artemis daemon at {self.endpoint} ({error}); training goes on unwatched, "
                  f"window reports are dropped and counted until it answers")

    def ok(self, dropped: int) -> None:
        with self._lock:
            if not self._down:
                return
            self._down = False
            lost = dropped - self._dropped_at_down
        self._say(f"the Artemis daemon at {self.endpoint} answers again; {lost} window reports were dropped "
                  f"meanwhile")
