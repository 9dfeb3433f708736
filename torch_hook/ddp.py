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

from typing import Any

import torch

from torch_hook.clock import elapsed_ms, mark_for


class DdpTracker:
    def __init__(self) -> None:
        self._buckets: list[tuple[str, str, float, list[Any]]] = []

    def bucket(self, op: str, group: str, nbytes: float, launch: Any, buffer: torch.Tensor,
               fut: torch.futures.Future) -> torch.futures.Future:
        marks: list[Any] = [launch, None]
        self._buckets.append((op, group, nbytes, marks))

        def completed(done: torch.futures.Future) -> Any:
            try:
                marks[1] = mark_for(buffer)
            except Exception:  # noqa: BLE001 -- never fail the gradient sync
                pass
            return done.value()  # re-raises a failed all-reduce to DDP unchanged

        return fut.then(completed)

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
