"""A whole job slowed by its host's load is not a fault: the ranks' wait for a CPU tells them apart.

``data/healthy_ddp_busy_neighbour.jsonl`` is a real trace: tests/probe/job.py's
DDP job, 4 gloo ranks on this 2-core machine, 20 steps per window, healthy
throughout, recorded (``ARTEMIS_ENDPOINT=file:``) beside a neighbour that ran
two busy loops in phases of 15 s (on from about window 50) — recorded by a probe
that reports each rank's run-queue wait (``host.run_wait_ms_per_s``).  Its
step time rose to 1.3-2.2x the healthy windows' and the ranks' wait for a CPU
rose with it, on every rank.  Without that signal the shipped defaults confirm
a job-wide ``unknown`` from it, which pages a person once it lasts (issue 28's
15-minute soak paged four times).
"""

from pathlib import Path

import numpy as np

from artemisd.baseline import JobHistory
from artemisd.config import AnalysisSettings, Config
from artemisd.detect import HOST_WAIT_SHARE, detect_job, summarize
from artemisd.frame import WindowFrame
from artemisd.incident import IncidentKind, IncidentState
from artemisd.replay import replay_records
from artemisd.wire import parse_line
from tests.unit.windows import lockstep

TRACE = Path(__file__).with_name("data") / "healthy_ddp_busy_neighbour.jsonl"
# benchmarks/held_out_stacks.py's DDP control, recorded by artemisd on the test cluster: 3 ranks,
# one per node, windows of ~0.15 s, beside the neighbour, its first 60 windows (the whole job's
# 9 s).  Its steps swing 8-11 ms from window to window, the ranks' wait for a CPU only partly
# with them (a third of the rise is the host_busy bar); from window 28 they ran above its first
# windows' baseline for 2 s.
HELD_OUT_CONTROL = Path(__file__).with_name("data") / "held_out_ddp_control_neighbour.jsonl"
JOB_WIDE = (IncidentKind.JOB, IncidentKind.CHANGE, IncidentKind.LINK, IncidentKind.ISLAND)


def load(strip_run_wait: bool = False, trace: Path = TRACE):
    records = []
    for n, line in enumerate(trace.read_text().splitlines(), 1):
        record = parse_line(line, f"{trace.name}:{n}")
        if strip_run_wait and record.host is not None:
            record = record.model_copy(update={"host": record.host.model_copy(update={"run_wait_ms_per_s": None})})
        records.append(record)
    return records


def confirmed_job_wide(incidents):
    return [i.id for i in incidents if i.kind in JOB_WIDE and i.state is not IncidentState.DISMISSED
            and i.confirmed_window is not None]


def test_a_healthy_job_beside_a_busy_neighbour_confirms_nothing_job_wide():
    incidents = replay_records(load(), include_unconfirmed=True)
    assert confirmed_job_wide(incidents) == []
    assert any(i.kind is IncidentKind.JOB for i in incidents)  # the rise was seen, and judged load


def test_without_the_ranks_wait_for_a_cpu_the_same_windows_confirm_a_job_wide_unknown():
    # At JobConfirmSeconds' 60 s none of this trace's load phases (15 s) lasts long enough either;
    # at the ConfirmSeconds every subject needs, only the ranks' wait tells the load from a fault.
    brief = Config(analysis=AnalysisSettings(job_confirm_seconds=AnalysisSettings().confirm_seconds))
    assert confirmed_job_wide(replay_records(load(), brief)) == []
    assert confirmed_job_wide(replay_records(load(strip_run_wait=True), brief)) != []


def test_a_job_wide_rise_nothing_explains_confirms_only_once_it_lasted_job_confirm_seconds():
    assert confirmed_job_wide(replay_records(load(trace=HELD_OUT_CONTROL))) == []
    brief = Config(analysis=AnalysisSettings(job_confirm_seconds=AnalysisSettings().confirm_seconds))
    [job] = [i for i in replay_records(load(trace=HELD_OUT_CONTROL), brief) if i.confirmed_window is not None]
    assert (job.kind, job.cause, job.onset_window, job.confirmed_window) == (IncidentKind.JOB, "unknown", 28, 40)


SETTINGS = AnalysisSettings()


def _window(busy_ms: float, comm_ms: float, run_wait_per_step: list[float]):
    """One 4-rank window whose ranks waited ``run_wait_per_step`` ms per step for a CPU."""
    step_ms = busy_ms + comm_ms  # lockstep: every rank's window lasts steps × step_ms
    host = {r: {"run_wait_ms_per_s": w * 1000.0 / step_ms} for r, w in enumerate(run_wait_per_step)}
    return summarize(WindowFrame.from_reports(lockstep(0, [busy_ms] * 4, comm_ms=comm_ms, host=host)))


def _history():
    history = JobHistory(depth=10)
    for _ in range(4):
        history.record(_window(100.0, 20.0, [10.0] * 4))
    return history


def test_a_rise_the_ranks_shared_wait_for_a_cpu_explains_is_host_load():
    flag = detect_job(_window(130.0, 40.0, [40.0] * 4), _history(), SETTINGS)  # +50 ms a step, +30 waiting
    assert flag is not None and flag.host_busy
    assert np.isclose(flag.run_wait_rise_ms, 30.0) and np.isclose(flag.run_wait_shared_rise_ms, 30.0)


def test_a_rise_with_no_more_wait_for_a_cpu_is_judged_as_before():
    # A degraded link or a slow collective: every rank waits longer, and no thread wants a CPU meanwhile.
    flag = detect_job(_window(100.0, 70.0, [10.0] * 4), _history(), SETTINGS)
    assert flag is not None and flag.comm_bound and not flag.host_busy
    # A wait that explains less than a third of the rise is not the reason for it.
    assert not detect_job(_window(130.0, 40.0, [25.0] * 4), _history(), SETTINGS).host_busy


def test_one_rank_starved_of_cpu_is_a_straggler_not_host_load():
    # A cgroup quota on one rank's node: its wait alone rose.  The mean over ranks (its quarter of
    # 160 ms) would explain the rise; the median rank's did not rise at all.
    flag = detect_job(_window(100.0, 70.0, [10.0, 10.0, 170.0, 10.0]), _history(), SETTINGS)
    assert flag is not None and flag.run_wait_rise_ms >= HOST_WAIT_SHARE * (flag.step_ms - flag.baseline_step_ms)
    assert not flag.host_busy


def test_without_the_measurement_nothing_is_host_load():
    history = JobHistory(depth=10)
    for _ in range(4):
        history.record(summarize(WindowFrame.from_reports(lockstep(0, [100.0] * 4))))
    flag = detect_job(summarize(WindowFrame.from_reports(lockstep(0, [130.0] * 4, comm_ms=40))), history, SETTINGS)
    assert flag is not None and not flag.host_busy
