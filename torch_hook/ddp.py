"""DDP gradient-bucket timing.

The reducer launches one all-reduce per bucket as gradients become ready and
blocks at the end of backward until all have completed.  Buckets launch in a
fixed order, the last one when backward compute has finished, so per step:

* comm_wait  = last completion - last launch (the tail backward waits for;
  a straggling peer makes it long on every *other* rank), never negative;
* op time    = sum over buckets of (completion - launch), the all-reduces'
  time in flight, overlapped with compute or not.

Completion is marked in a ``Future.then`` callback: DDP waits on the future
the hook returns, so the mark is always taken before backward returns (an
``add_done_callback`` could run after the waiter woke up).  On CUDA the
callback's current stream is synchronised with the collective, so an event
recorded there completes with it.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from torch_hook.clock import elapsed_ms, mark_for


class _Completed:
    """A bucket's ``Future.then`` callback that counts its own release.

    The thread that completes the all-reduce (a gloo worker) runs the callback
    and afterwards drops it, taking the GIL to do so -- possibly after the
    training thread has moved on.  If the interpreter is finalizing by then,
    that thread is ended inside C++ and the process aborts ("terminate called
    without an active exception").  ``DdpTracker.settle`` waits at exit until
    every callback has been released.
    """

    __slots__ = ("tracker", "marks", "buffer")

    def __init__(self, tracker: DdpTracker, marks: list[Any], buffer: torch.Tensor):
        self.tracker, self.marks, self.buffer = tracker, marks, buffer
        tracker.created += 1

    def __call__(self, done: torch.futures.Future) -> Any:
        try:
            self.marks[1] = mark_for(self.buffer)
        except Exception:  # noqa: BLE001 -- never fail the gradient sync
            pass
        return done.value()  # re-raises a failed all-reduce to DDP unchanged

    def __del__(self) -> None:
        self.tracker.released += 1


class DdpTracker:
    def __init__(self) -> None:
        self._buckets: list[tuple[str, str, float, list[Any]]] = []
        self.created = 0
        self.released = 0

    def bucket(self, op: str, group: str, nbytes: float, launch: Any, buffer: torch.Tensor,
               fut: torch.futures.Future) -> torch.futures.Future:
        marks: list[Any] = [launch, None]
        self._buckets.append((op, group, nbytes, marks))
        return fut.then(_Completed(self, marks, buffer))

    def settle(self, timeout_s: float) -> bool:
        """Wait (sleeping, so the GIL is free) until the workers released every bucket callback.

        The hook's own ``then`` callback (torch's ``allreduce_hook``) is dropped
        right after ours on the same worker thread, so a short grace follows.
        """
        if not self.created:
            return True
        deadline = time.monotonic() + timeout_s
        while self.released < self.created and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(0.01)
        return self.released >= self.created

    def end_step(self, recorder: Any, hooked: set[str] | frozenset[str] = frozenset()) -> None:
        """The step's buckets into ``recorder``; on a ``hooked`` group (NCCL completion
        hooks) only comm_wait and bytes, since the hook counts the calls and their time."""
        buckets, self._buckets = self._buckets, []
        if not buckets:
            return
        op, group = buckets[0][0], buckets[0][1]
        calls, keep = (0, 0.0) if group in hooked else (len(buckets), 1.0)
        nbytes = sum(b[2] for b in buckets)
        marks = [b[3] for b in buckets if b[3][1] is not None]
        if not marks:
            return
        last_launch = marks[-1][0]
        if isinstance(last_launch, float):  # CPU: every mark is a perf_counter value
            wait = max(0.0, max(done for _, done in marks) - last_launch)
            flight = sum(done - launch for launch, done in marks)
            recorder.comm(op, group, nbytes, calls, wait * 1e3, flight * keep * 1e3)
            return

        def resolve() -> tuple[float, float] | None:
            tails, flights = [], []
            for launch, done in marks:
                tail, flight = elapsed_ms(last_launch, done), elapsed_ms(launch, done)
                if tail is None or flight is None:
                    return None
                tails.append(tail)
                flights.append(flight)
            return max(0.0, max(tails)), sum(flights) * keep

        recorder.comm_pending(op, group, nbytes, calls, resolve)
