"""Which run of a job step a window report belongs to: the daemon's one rule.  Pure.

A requeued job numbers its windows from 0 again.  The daemon analyses and
stores each run under its own step key, ``STEP~RUN`` (``0~1``: job step 0,
its second run); the first run keeps the plain step name.  The analyzer,
verification, restore from the store and ``artemis plot`` all read runs
from that key, so none of them re-derives a restart.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

RUN_SEP = "~"
RESTART_GAP = 4  # a window this far below the rank's own newest starts a new run, whatever its times say
RUNS_REMEMBERED = 8  # the runs whose start a late report is matched against
_NEVER = float("-inf")
_UNKNOWN_END = float("inf")  # no window is known to have begun after it


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
    order: one rank's probe numbers its windows upward, one after the other in
    time, so a rank whose window goes back to or below its own newest — even by
    none — *and began after that newest window ended* comes from a new probe:
    the job started again (a torchrun restart, a crash and requeue).  One probe
    cannot send such a window: its lower windows all ended before its newest
    began, and a batch sent again (stored, the answer lost) carries the same
    times.  Without the times to tell (a report's span unknown, a node's clock
    stepped back across the restart), a rank going back more than
    ``RESTART_GAP`` windows has started again.  Each rank is compared with its
    own past only: the job's highest window is not enough, since after an
    outage (the daemon, or its database, unreachable) every probe sends its
    backlog, one rank's seconds before another's, and the second rank's windows
    are far below the first's newest.  (Issue 28: with the gap alone, a restart
    within the first five windows joined the crashed attempt's run, and the
    analysis compared the new attempt with the dead one.)

    A rank's order is not enough either once the job has started again: a
    report of the old run that arrives late (a rank's last windows, posted
    after the requeue's first) would join the new run as that rank's newest,
    and the rank's next window of the new run, far below it, would start a
    third run that never happened.  So each run also remembers when it began
    (``began``: the earliest start its windows imply, the first window's t0
    less the windows before it), and a window that had ended by then belongs
    to an earlier run (``run_at``).  Clocks decide only across a requeue,
    where seconds separate the runs; within a run the order rule alone does.
    """

    number: int = 0
    newest: dict[int, int] = field(default_factory=dict)  # rank -> its newest window in this run
    ended: dict[int, float] = field(default_factory=dict)  # rank -> when its newest window ended, where known
    began: dict[int, float] = field(default_factory=dict)  # run number -> when its window 0 began

    def take(self, rank: int, seq: int, t0: float | None = None, t1: float | None = None) -> tuple[int, bool]:
        """A report of ``rank`` for window ``seq`` (spanning ``t0``..``t1``, where known): the run it
        belongs to, and whether it starts a new one.  One call per report, on the ingest path."""
        number = self.number
        if number and t1 is not None and t1 <= self.began.get(number, _NEVER):
            return self.run_at(t1), False  # an earlier run's, late: this run's order is not touched
        own = self.newest.get(rank)
        started = own is not None and (own - seq > RESTART_GAP or (
            seq <= own and t0 is not None and t0 > self.ended.get(rank, _UNKNOWN_END)))
        if started:
            self.number = number = number + 1
            self.newest, self.ended = {rank: seq}, {}
        if started or own is None or seq > own:
            self.newest[rank] = seq
            if t1 is not None:
                self.ended[rank] = t1
        self.saw_window(number, seq, t0, t1)
        return number, started

    def take_together(self, ranks: Sequence[int], seq: int, t0s: Sequence[float], t1s: Sequence[float]
                      ) -> int | None:
        """Reports of ``ranks`` (in order, one each) for one window ``seq``, the i-th spanning
        ``t0s[i]``..``t1s[i]``: the run every one of them belongs to, exactly as ``take`` one report at a
        time would say, in one pass over plain lists.  None, with nothing taken, where one of them may
        need ``take``'s rule of its own: a rank already past ``seq`` in this run (a late report, or
        one that starts a run), one at ``seq`` whose window began after its newest ended (a new probe),
        or a window that may have ended before this run began.

        A job's ranks end a window together, so a sender's batch is one window of many ranks: the
        ingest path calls this once per batch rather than ``take`` per report.
        """
        number = self.number
        starts = [t0 - seq * (t1 - t0 if t1 > t0 else 0.0) for t0, t1 in zip(t0s, t1s)]
        if not starts:
            return number
        if number:
            # ``take`` compares each window's end with the run's start as it stands at that report.
            # The start only moves down as reports arrive, from where it is (or, unknown yet, from
            # the first report's): a window that ends after that needs no other rule.
            began = self.began.get(number)
            if min(t1s) <= (starts[0] if began is None else began):
                return None
        newest, ended = self.newest, self.ended
        if any(own >= seq for own in map(newest.get, ranks) if own is not None):
            # A batch sent again (stored, the answer lost) changes no rank's order: every rank at ``seq``
            # already and none of them begun after its window ended.  Anything else goes report by report.
            if not all(newest.get(rank) == seq and t0 <= ended.get(rank, _UNKNOWN_END)
                       for rank, t0 in zip(ranks, t0s)):
                return None
        elif len(set(ranks)) < len(ranks):
            return None  # a rank twice in one batch: its second report is judged against its first
        else:
            newest.update(dict.fromkeys(ranks, seq))
            ended.update(zip(ranks, t1s))
        self._began_by(number, min(starts))
        return number

    def run_at(self, t1: float) -> int:
        """The run a window that ended at ``t1`` belongs to: the newest one that had begun by then.  The
        current run unless it is known to have begun after ``t1`` (a window of a run older than every
        run remembered goes to the one before the oldest: its analysis has long closed)."""
        if self.number == 0 or t1 > self.began.get(self.number, _NEVER):
            return self.number
        for number in sorted(self.began, reverse=True):
            if self.began[number] < t1:
                return number
        return max(min(self.began) - 1, 0)

    def saw_window(self, number: int, seq: int, t0: float | None, t1: float | None) -> None:
        """Run ``number`` had window ``seq`` span ``t0``..``t1``: it began no later than ``seq`` such
        windows before ``t0``."""
        if t0 is None or t1 is None:
            return
        self._began_by(number, t0 - seq * (t1 - t0 if t1 > t0 else 0.0))

    def _began_by(self, number: int, start: float) -> None:
        known = self.began.get(number)
        if known is None:
            self.began[number] = start
            while len(self.began) > RUNS_REMEMBERED:
                del self.began[min(self.began)]
        elif start < known:
            self.began[number] = start
