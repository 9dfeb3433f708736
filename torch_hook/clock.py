"""Marks on a timeline and the time between two of them.

On CPU (gloo) a mark is ``time.perf_counter()`` around the blocking call.  On
CUDA/ROCm the host returns long before the device has done the work, so a mark
is a ``torch.cuda.Event(enable_timing=True)`` recorded on the current stream;
``elapsed_ms`` is read only once the later event has completed
(``Event.query()``), so the hot path never synchronizes.  Collectives make the
current stream wait for the communication stream when the caller waits
(``Work.wait()`` / the synchronous form), so an event recorded on the current
stream right after the call completes when the collective has completed: the
pair measures how long the rank's compute stream was held up by that
collective.
"""

from __future__ import annotations

import time
from typing import Any

import torch

Mark = Any  # float (perf_counter seconds) or torch.cuda.Event


def wall_mark() -> float:
    return time.perf_counter()


def device_mark(device: torch.device | None = None) -> Any:
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


def mark_for(tensor: Any) -> Mark:
    """A mark on the timeline that ``tensor``'s collective runs on."""
    if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
        return device_mark(tensor.device)
    return time.perf_counter()


def elapsed_ms(start: Mark, end: Mark) -> float | None:
    """Milliseconds from ``start`` to ``end``; None while a device event is pending."""
    if isinstance(start, float):
        return (end - start) * 1e3 if isinstance(end, float) else None
    if isinstance(end, float) or not end.query():
        return None
    return float(start.elapsed_time(end))
