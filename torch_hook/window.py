"""Per-step accounting and window aggregation (wire contract v1 timings).

A *step* runs from one step boundary (optimizer step, or ``torch_hook.step()``)
to the next.  Within it the recorder adds up:

* ``comm_wait`` -- time the rank was held up by collectives: wall time around
  blocking calls and ``Work.wait()``; for DDP, the tail from the last gradient
  bucket's launch (the end of backward compute) to the last bucket's
  completion; on GPUs the same spans measured with CUDA events.
* ``data`` -- time spent in DataLoader iterators' ``__next__``.
* ``samples`` -- batch sizes seen by the DataLoader wrapper, unless the
  training code reports them itself (``torch_hook.step(samples=n)`` /
  ``add_samples(n)``), which then takes precedence.

``busy = step - comm_wait`` and ``compute = busy - data``, per step (so the
window means satisfy the contract's identity exactly).

Device timings resolve lazily: a span whose end event has not completed stays
pending and is attributed to the step it was issued in when it resolves; a
closed window is *parked* until all its spans resolved (checked at later step
boundaries, never by synchronizing), so reports carry complete numbers.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# A pending device span: returns (comm_wait_ms, collective_ms) once resolved, else None.
Resolver = Callable[[], "tuple[float, float] | None"]

# A parked window whose device spans never resolve (a hung device, a lost
# event) is emitted anyway after this many further steps.
_PARK_LIMIT_STEPS = 200


@dataclass
class _OpStats:
    calls: int = 0
    bytes: float = 0.0
    ms: float = 0.0


@dataclass
class ClosedWindow:
    """Timings of one window; ``report_fields()`` renders the contract's blocks."""

    seq: int
    first_step: int
    t0: float
    t1: float
    step_ms: list[float]
    data_ms: list[float]
    samples: list[float | None]
    comm_ms: dict[int, float]
    ops: dict[tuple[str, str], _OpStats]
    pending: list[tuple[int, str, str, Resolver]] = field(default_factory=list)
    parked_at: int = 0

    def resolve(self) -> bool:
        still = []
        for step, op, group, resolver in self.pending:
            done = resolver()
            if done is None:
                still.append((step, op, group, resolver))
                continue
            wait_ms, coll_ms = done
            self.comm_ms[step] = self.comm_ms.get(step, 0.0) + wait_ms
            self.ops.setdefault((op, group), _OpStats()).ms += coll_ms
        self.pending = still
        return not still

    def report_fields(self) -> dict[str, Any]:
        n = len(self.step_ms)
        comm = [min(self.comm_ms.get(self.first_step + i, 0.0), self.step_ms[i]) for i in range(n)]
        busy = [s - c for s, c in zip(self.step_ms, comm)]
        data = [min(d, b) for d, b in zip(self.data_ms, busy)]
        compute = [b - d for b, d in zip(busy, data)]

        def mean(values: list[float]) -> float:
            return round(sum(values) / n, 4)

        out: dict[str, Any] = {
            "window": {"seq": self.seq, "first_step": self.first_step, "steps": n,
                       "t0": round(self.t0, 6), "t1": round(max(self.t1, self.t0), 6)},
            "ms": {"step": mean(self.step_ms), "busy": mean(busy), "compute": mean(compute),
                   "data": mean(data), "comm_wait": mean(comm)},
            "ms_p50": {"step": round(statistics.median(self.step_ms), 4),
                       "busy": round(statistics.median(busy), 4)},
            "collectives": [
                {"op": op, "group": group, "calls": st.calls, "bytes": st.bytes, "ms": round(st.ms, 4)}
                for (op, group), st in sorted(self.ops.items())
            ],
        }
        known = [s for s in self.samples if s is not None]
        if known:
            out["samples"] = float(sum(known))
        return out


class StepRecorder:
    """Accumulates one rank's steps into windows.  Hot-path methods are tiny.

    Window k normally covers steps [kW, (k+1)W); a recorder that resumes
    (``start_step``, ``start_seq``: a reinstall in the same process) keeps
    counting where the previous one stopped.  ``next_window_steps`` lets
    the probe shorten later windows once all ranks agreed to (time limit), so
    window boundaries stay identical on every rank.
    """

    def __init__(self, window_steps: int, start_step: int = 0, start_seq: int = 0):
        self.window_steps = window_steps
        self._next_len = window_steps
        self._lock = threading.Lock()
        self.started = False
        self.step = start_step  # index of the step in progress
        self.seq = start_seq
        self._window_first = start_step
        # Resuming mid-grid (a reinstall): the first window ends on the grid,
        # so windows stay aligned with ranks that never stopped.
        self._window_end = (start_step // window_steps + 1) * window_steps
        self._t0 = time.time()
        self._step_start = time.perf_counter()
        self._reset_window_lists()
        self._cur_comm = 0.0
        self._cur_data = 0.0
        self._cur_samples: float | None = None
        self.explicit_samples = False
        self.parked: list[ClosedWindow] = []

    def _reset_window_lists(self) -> None:
        self._step_ms: list[float] = []
        self._data_ms: list[float] = []
        self._samples: list[float | None] = []
        self._comm_ms: dict[int, float] = {}
        self._ops: dict[tuple[str, str], _OpStats] = {}
        self._pending: list[tuple[int, str, str, Resolver]] = []

    # -- hot path ---------------------------------------------------------
    def comm(self, op: str, group: str, nbytes: float, calls: int, wait_ms: float, coll_ms: float) -> None:
        """A resolved collective: ``wait_ms`` adds to comm_wait, ``coll_ms`` to the op's time."""
        with self._lock:
            self._cur_comm += wait_ms
            st = self._ops.get((op, group))
            if st is None:
                st = self._ops[(op, group)] = _OpStats()
            st.calls += calls
            st.bytes += nbytes
            st.ms += coll_ms

    def comm_pending(self, op: str, group: str, nbytes: float, calls: int, resolver: Resolver) -> None:
        """A device-timed collective whose events resolve later."""
        with self._lock:
            st = self._ops.get((op, group))
            if st is None:
                st = self._ops[(op, group)] = _OpStats()
            st.calls += calls
            st.bytes += nbytes
            self._pending.append((self.step, op, group, resolver))

    def data(self, ms: float, samples: float | None) -> None:
        self._cur_data += ms
        if samples is not None and not self.explicit_samples:
            self._cur_samples = (self._cur_samples or 0.0) + samples

    def add_samples(self, n: float) -> None:
        if not self.explicit_samples:
            # From now on the training code counts; drop what the loader counted.
            self.explicit_samples = True
            self._cur_samples = None
        self._cur_samples = (self._cur_samples or 0.0) + n

    # -- step boundary ------------------------------------------------------
    def end_step(self) -> ClosedWindow | None:
        """Close the step in progress; return the window it completed, if any.

        The first boundary only starts the clock: time before it (model
        construction, first-iteration warm-up) is not a training step.
        """
        now = time.perf_counter()
        if not self.started:
            self.started = True
            self._step_start = now
            self._t0 = time.time()
            with self._lock:
                self._cur_comm = self._cur_data = 0.0
                self._cur_samples = None
                self._reset_window_lists()
            return None
        with self._lock:
            if self._cur_comm:
                self._comm_ms[self.step] = self._comm_ms.get(self.step, 0.0) + self._cur_comm
            self._step_ms.append((now - self._step_start) * 1e3)
            self._data_ms.append(self._cur_data)
            self._samples.append(self._cur_samples)
            self._cur_comm = self._cur_data = 0.0
            self._cur_samples = None
            self.step += 1
            closed = None
            if self.step >= self._window_end:
                closed = ClosedWindow(
                    seq=self.seq, first_step=self._window_first, t0=self._t0, t1=time.time(),
                    step_ms=self._step_ms, data_ms=self._data_ms, samples=self._samples,
                    comm_ms=self._comm_ms, ops=self._ops, pending=self._pending,
                )
                self.seq += 1
                self._window_first = self.step
                self._window_end = self.step + self._next_len
                self._t0 = time.time()
                self._reset_window_lists()
        self._step_start = now
        return closed

    def restart_step_clock(self) -> None:
        """Exclude probe work done at a boundary (sync, benchmark) from the next step."""
        self._step_start = time.perf_counter()

    def next_window_steps(self, steps: int) -> None:
        """Length of windows after the one in progress (agreed across ranks)."""
        self._next_len = max(1, min(int(steps), self.window_steps))

    def finished(self, closed: ClosedWindow | None) -> list[ClosedWindow]:
        """Windows ready to report: ``closed`` and parked ones whose spans resolved."""
        if closed is not None:
            closed.parked_at = self.step
            self.parked.append(closed)
        ready: list[ClosedWindow] = []
        for window in list(self.parked):
            if window.resolve() or self.step - window.parked_at > _PARK_LIMIT_STEPS:
                self.parked.remove(window)
                ready.append(window)
            else:
                break  # keep reports in window order
        return ready
