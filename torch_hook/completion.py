"""ProcessGroupNCCL completion hooks: every collective of a group, whoever issued it.

On NCCL, torch calls a hook registered with
``ProcessGroup._register_on_completion_hook`` once per completed ``Work`` --
collectives from Python, from DDP's C++ reducer, from compiled graphs and
functional collectives alike -- with a ``WorkInfo``: ``op_type`` (an
``OpType``), ``seq``, ``time_started``, ``time_finished`` (when the watchdog
saw it complete) and ``active_duration`` (CUDA-event time from launch to
completion on the device).  ``active_duration`` needs collective timing on the
group (``TORCH_NCCL_ENABLE_TIMING=1`` before the group exists, or
``ProcessGroup._enable_collectives_timing()`` after); without it NCCL's
``getDuration()`` fails inside the watchdog, so ``watch`` enables timing first
and registers nothing if it cannot.

The hook runs on NCCL's hook thread, not the training thread: it turns the
``WorkInfo`` into a plain ``Completed`` and appends it to a deque; the step
boundary drains the deque into the recorder.  The hook thread must take the
GIL, which is fatal once the interpreter is finalizing (the thread is ended
inside C++ and the process aborts with "terminate called without an active
exception"), so ``close()`` -- at exit and before ``destroy_process_group`` --
stops recording and waits for the groups' pending work first, as
``destroy_process_group`` itself does for hooked groups.

Only this module touches the hook API; no GPU exists on the CI machine, so the
mapping (``completed``) is tested with recorded ``WorkInfo`` values and
``watch`` is tested to register nothing on gloo.
"""

from __future__ import annotations

import collections
import datetime
import functools
import weakref
from dataclasses import dataclass
from typing import Any

# OpType names (c10d's enum) -> the probe's op names (the Python API's names).
OP_NAMES: dict[str, str] = {
    "BROADCAST": "broadcast",
    "ALLREDUCE": "all_reduce",
    "ALLREDUCE_COALESCED": "all_reduce_coalesced",
    "REDUCE": "reduce",
    "ALLGATHER": "all_gather",
    "_ALLGATHER_BASE": "all_gather_single",
    "ALLGATHER_COALESCED": "all_gather_coalesced",
    "GATHER": "gather",
    "SCATTER": "scatter",
    "REDUCE_SCATTER": "reduce_scatter",
    "_REDUCE_SCATTER_BASE": "reduce_scatter_single",
    "REDUCE_SCATTER_TENSOR_COALESCED": "reduce_scatter_tensor_coalesced",
    "ALLTOALL_BASE": "all_to_all_single",
    "ALLTOALL": "all_to_all",
    "SEND": "send",
    "RECV": "recv",
    "RECVANYSOURCE": "recv",
    "BARRIER": "barrier",
    "COALESCED": "coalesced",
    "_ALLREDUCE_SPARSE": "all_reduce_sparse",
}


@dataclass(frozen=True)
class Completed:
    """One completed collective: ``ms`` is its device time (launch to completion)."""

    op: str
    group: str
    ms: float


def _ms(value: Any) -> float | None:
    if isinstance(value, datetime.timedelta):
        return value.total_seconds() * 1e3
    if isinstance(value, int | float):
        return float(value)
    return None


def completed(info: Any, group: str) -> Completed | None:
    """A ``WorkInfo`` as plain data; None when it carries no usable duration.

    ``active_duration`` is preferred; a zero or missing one (timing off) falls
    back to ``time_finished - time_started`` (host clock, includes queueing and
    the watchdog's detection delay).
    """
    op_type = getattr(info, "op_type", None)
    name = getattr(op_type, "name", None) or str(op_type).rsplit(".", 1)[-1]
    op = OP_NAMES.get(name, name.lower() if name else "unknown")
    ms = _ms(getattr(info, "active_duration", None))
    if not ms or ms < 0:
        start, finish = getattr(info, "time_started", None), getattr(info, "time_finished", None)
        ms = _ms(finish - start) if isinstance(start, datetime.datetime) and isinstance(finish, datetime.datetime) else None
    if ms is None or ms < 0:
        return None
    return Completed(op, group, ms)


def supported(group: Any) -> bool:
    """Whether ``group`` is a NCCL process group with the completion-hook API."""
    try:
        return (hasattr(group, "_register_on_completion_hook") and hasattr(group, "_enable_collectives_timing")
                and "nccl" in str(group._get_backend_name()).lower())
    except Exception:  # noqa: BLE001 -- a group without a backend name: not ours to hook
        return False


class CompletionHooks:
    """Hooks on NCCL groups; ``drain()`` hands the completed collectives to the training thread."""

    def __init__(self) -> None:
        self._done: collections.deque[Completed] = collections.deque(maxlen=1 << 16)
        self._groups: list[weakref.ref[Any]] = []
        self._closed = False
        self.errors = 0
        self.dropped = 0  # hook calls without a usable duration

    @property
    def active(self) -> bool:
        return bool(self._groups) and not self._closed

    def watch(self, group: Any, name: str) -> bool:
        """Register on ``group`` (once); True when its collectives now arrive here."""
        if self._closed or not supported(group):
            return False
        if any(ref() is group for ref in self._groups):
            return True
        group._enable_collectives_timing()
        group._register_on_completion_hook(functools.partial(self._on_completion, name))
        self._groups.append(weakref.ref(group))
        return True

    def _on_completion(self, group: str, info: Any) -> None:
        """NCCL's hook thread: plain data onto the deque, nothing else."""
        if self._closed:
            return
        try:
            item = completed(info, group)
            if item is None:
                self.dropped += 1
            else:
                self._done.append(item)
        except Exception:  # noqa: BLE001 -- never into NCCL's thread
            self.errors += 1

    def drain(self, recorder: Any) -> None:
        """Training thread, at a step boundary: completed collectives into the step's ops."""
        done = self._done
        while done:
            item = done.popleft()
            recorder.comm(item.op, item.group, 0.0, 1, 0.0, item.ms)

    def close(self, group: Any = None) -> None:
        """Before a group goes away (or all, at exit): let pending hooks run, then stop recording."""
        for ref in list(self._groups):
            pg = ref()
            if pg is None or (group is not None and pg is not group):
                continue
            try:
                pg._wait_for_pending_works()
            except Exception:  # noqa: BLE001 -- already shut down
                self.errors += 1
            self._groups.remove(ref)
        if group is None:
            self._closed = True
