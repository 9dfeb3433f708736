"""Which run of a job step a window report belongs to: the daemon's one rule.  Pure.

A requeued job numbers its windows from 0 again.  The daemon analyses and
stores each run under its own step key, ``STEP~RUN`` (``0~1``: job step 0,
its second run); the first run keeps the plain step name.  The analyzer,
verification, restore from the store and ``artemis plot`` all read runs
from that key, so none of them re-derives a restart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

RUN_SEP = "~"
RESTART_GAP = 4  # a window this far below the rank's own newest starts a new run


@lru_cache(maxsize=4096)  # called per report; a job has a handful of step keys (and the cache is bounded)
def split_run(step: str) -> tuple[str, int]:
    """``"0~1"`` -> ``("0", 1)``; a plain step name is its first run."""
    base, _, run = step.partition(RUN_SEP)
    return base, int(run) if run.isdigit() else 0


def run_key(base: str, number: int) -> str:
    """The step key a run is analysed and stored under (inverse of ``split_run``)."""
    return base if number == 0 else f"{base}{RUN_SEP}{number}"


@dataclass
class JobRun:
    """The latest run of a job step, told from each rank's own order of windows.

    What tells a new run from reports that are merely late is each rank's own
    order: one rank's probe sends its windows in order, so a rank going back
    more than ``RESTART_GAP`` windows below its own newest has started again.
    The job's highest window is not enough: after an outage (the daemon, or its
    database, unreachable) every probe sends its backlog, one rank's seconds
    before another's, and the second rank's windows are far below the first's
    newest.
    """

    number: int = 0
    newest: dict[int, int] = field(default_factory=dict)  # rank -> its newest window in this run

    def place(self, rank: int, seq: int) -> bool:
        """Take a report of ``rank`` for window ``seq``; True when it starts a new run."""
        own = self.newest.get(rank)
        if own is not None and own - seq > RESTART_GAP:
            self.number += 1
            self.newest = {rank: seq}
            return True
        self.newest[rank] = seq if own is None else max(own, seq)
        return False
