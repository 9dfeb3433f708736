"""NCCL completion hooks (torch_hook/completion.py) at their boundary, without a GPU.

torch's ``WorkInfo`` cannot be built from Python and no NCCL group exists on
the CI machine, so the hook is fed objects with WorkInfo's documented
attributes (``op_type``, ``seq``, ``time_started``, ``time_finished``,
``active_duration``), shaped like what ProcessGroupNCCL's hook thread passes,
and a stand-in group with the two methods the probe calls.  On a real gloo
group ``watch`` must register nothing (gloo refuses the hook).
"""

from __future__ import annotations

import datetime
import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from torch_hook.completion import OP_NAMES, CompletionHooks, completed, supported
from torch_hook.window import StepRecorder

OpType = torch._C._distributed_c10d.OpType
T0 = datetime.datetime(2026, 12, 3, 8, 0, 0)


def info(op: str, active_ms: float, wall_ms: float = 0.0, seq: int = 1) -> SimpleNamespace:
    return SimpleNamespace(op_type=getattr(OpType, op), seq=seq, time_started=T0,
                           time_finished=T0 + datetime.timedelta(milliseconds=wall_ms),
                           active_duration=datetime.timedelta(milliseconds=active_ms))


class FakeNcclGroup:
    """The ProcessGroup surface completion.py uses; fires the hook from another thread like NCCL."""

    def __init__(self) -> None:
        self.hooks: list = []
        self.timing = False
        self.waited = 0

    def _get_backend_name(self) -> str:
        return "nccl"

    def _enable_collectives_timing(self) -> None:
        self.timing = True

    def _register_on_completion_hook(self, hook) -> None:
        self.hooks.append(hook)

    def _wait_for_pending_works(self) -> None:
        self.waited += 1

    def complete(self, *infos) -> None:
        def fire():
            for i in infos:
                for hook in self.hooks:
                    hook(i)

        thread = threading.Thread(target=fire)
        thread.start()
        thread.join()


def test_every_op_type_has_a_name():
    names = set(OpType.__members__) - {"UNKNOWN"}
    assert names <= set(OP_NAMES), sorted(names - set(OP_NAMES))


def test_work_info_becomes_plain_data():
    assert completed(info("ALLREDUCE", 2.5), "world") == completed(info("ALLREDUCE", 2.5, wall_ms=9.0), "world")
    got = completed(info("_REDUCE_SCATTER_BASE", 1.25), "ranks:0-3/4")
    assert (got.op, got.group, got.ms) == ("reduce_scatter_single", "ranks:0-3/4", 1.25)
    # timing off: active_duration 0, so the host-side span is used
    assert completed(info("_ALLGATHER_BASE", 0.0, wall_ms=7.0), "world").ms == pytest.approx(7.0)
    broken = SimpleNamespace(op_type=OpType.BARRIER, active_duration=None, time_started=None, time_finished=None)
    assert completed(broken, "world") is None


def test_hooked_group_feeds_the_recorder_at_the_boundary():
    group, hooks = FakeNcclGroup(), CompletionHooks()
    assert supported(group) and hooks.watch(group, "world") and group.timing
    assert hooks.watch(group, "world") and len(group.hooks) == 1  # once per group
    rec = StepRecorder(window_steps=2)
    rec.end_step()  # starts the clock
    group.complete(info("ALLREDUCE", 3.0), info("ALLREDUCE", 1.0), info("_ALLGATHER_BASE", 2.0))
    hooks.drain(rec)
    assert rec.end_step() is None
    window = rec.end_step()
    ops = {(c["op"], c["group"]): c for c in window.report_fields()["collectives"]}
    assert ops[("all_reduce", "world")]["calls"] == 2 and ops[("all_reduce", "world")]["ms"] == pytest.approx(4.0)
    assert ops[("all_gather_single", "world")]["calls"] == 1


def test_close_waits_for_pending_works_and_stops_recording():
    group, hooks = FakeNcclGroup(), CompletionHooks()
    hooks.watch(group, "world")
    hooks.close()
    assert group.waited == 1 and not hooks.active
    group.complete(info("ALLREDUCE", 3.0))  # a hook firing after close records nothing
    rec = StepRecorder(window_steps=1)
    hooks.drain(rec)
    assert rec._ops == {}
    assert not hooks.watch(FakeNcclGroup(), "other")


def test_hook_errors_never_reach_the_hook_thread():
    group, hooks = FakeNcclGroup(), CompletionHooks()
    hooks.watch(group, "world")
    group.complete(object(), SimpleNamespace(op_type=None))
    assert hooks.errors + hooks.dropped == 2


def test_gloo_group_is_not_hooked():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        pg = dist.GroupMember.WORLD
        assert not supported(pg)
        assert not CompletionHooks().watch(pg, "world")
        assert not pg._has_hooks()
    finally:
        dist.destroy_process_group()


def test_wrappers_leave_calls_and_time_to_the_hook_on_a_hooked_group():
    """On a hooked group the Python wrappers add only comm_wait and bytes: no double count."""
    import torch_hook
    from torch_hook.config import ProbeConfig

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert torch_hook.install(ProbeConfig(endpoint=None, job="hook", job_step="0", node="n0"))
        probe = torch_hook._probe
        probe.instrumentation.hooked.add("world")
        dist.all_reduce(torch.ones(8))
        dist.all_reduce(torch.ones(8), async_op=True).wait()
        st = probe.recorder._ops[("all_reduce", "world")]
        assert st.calls == 0 and st.ms == 0.0 and st.bytes == 2 * 8 * 4
        probe.instrumentation.hooked.clear()
        dist.all_reduce(torch.ones(8))
        assert st.calls == 1 and st.ms > 0.0
    finally:
        torch_hook.uninstall()
        dist.destroy_process_group()


def test_exit_waits_until_workers_released_ddp_bucket_callbacks():
    """The bucket callbacks gloo's worker runs are all released before quiesce returns."""
    import torch_hook
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch_hook.config import ProbeConfig

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert torch_hook.install(ProbeConfig(endpoint=None, job="exit", job_step="0", node="n0"))
        probe = torch_hook._probe
        model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)), bucket_cap_mb=1e-4)
        for _ in range(3):
            model(torch.ones(2, 8)).sum().backward()
        assert probe.ddp.created >= 3
        probe.quiesce()
        assert probe.ddp.released == probe.ddp.created
        assert probe.error_count == 0, probe.last_error
    finally:
        torch_hook.uninstall()
        dist.destroy_process_group()
