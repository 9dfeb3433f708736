"""Carrying a ``reconcile.Change`` out: one walk over its effects, in order, into a ``Sink``.

The daemon's sink (``acting.LedgerSink``) writes action rows, audit lines and directives through the
ledger and saves the incident last; the simulated loop's (``sim/loop.MemorySink``) keeps rows and notes
in memory and performs what was queued at once against the simulated Slurm.  What a change *means* is
decided in ``reconcile``; where it lands is the sink's; the order it lands in is decided here, once:
the loop's own marks, then every effect as reconcile listed it, then ``finish`` (the incident that
refers to the rows, for the daemon: intent first, so a crash re-decides rather than loses).
"""

from __future__ import annotations

from typing import Protocol

from artemisd.control.reconcile import Approved, Change, Move, Note, Queue, ResetShares, Tell


class Sink(Protocol):
    def marks(self, change: Change) -> None:
        """The loop's own marks on the incident: decide again, ladder step, held / not-back lines,
        acted, reopened."""

    def note(self, note: Note) -> None: ...

    def queue(self, queue: Queue) -> None: ...

    def move(self, move: Move) -> None: ...

    def approved(self, approved: Approved) -> None: ...

    def reset_shares(self, reset: ResetShares) -> None: ...

    def tell(self, tell: Tell) -> None: ...

    def finish(self, change: Change) -> None:
        """After every effect: the daemon saves the incident; the simulation performs what was queued."""


def apply(change: Change, sink: Sink) -> None:
    sink.marks(change)
    for effect in change.effects:
        if isinstance(effect, Note):
            sink.note(effect)
        elif isinstance(effect, Queue):
            sink.queue(effect)
        elif isinstance(effect, Move):
            sink.move(effect)
        elif isinstance(effect, Approved):
            sink.approved(effect)
        elif isinstance(effect, ResetShares):
            sink.reset_shares(effect)
        elif isinstance(effect, Tell):
            sink.tell(effect)
        else:
            raise TypeError(f"not an effect: {effect!r}")
    sink.finish(change)
