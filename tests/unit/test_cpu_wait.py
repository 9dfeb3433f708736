"""A rank held off a CPU inside its collectives: its run-queue wait names it, and its quota counter confirms it.

``data/cpu_quota_rank_in_gloo.jsonl`` is a real trace: benchmarks/peers.py's
``slowed`` job (``--quick``), 4 gloo ranks of DDP on this 2-core machine, 8
steps per window, rank 2 put in a cgroup capped at 15 % of one CPU from
window 6 on.  Its step time went from 11-15 ms to 26-48 ms; its busy time
stayed at its peers' 2-4 ms in half the windows — the throttling landed in
gloo's collective, where every rank waited for it — while its run-queue wait
rose from 4-6 to 30-86 ms per step (all threads) and its quota ran out in
100 % of the periods.  Issue 28: busy alone named nobody; NVRx named the rank
after 16 steps.  The wait counts as the rank's own time only beside its quota
counter: alone it is what a shared host's scheduler does to some rank.
"""

import json
from pathlib import Path

import numpy as np

from artemisd.config import AnalysisSettings
from artemisd.detect import own_cpu_wait, with_own_cpu_wait
from artemisd.frame import WindowFrame
from artemisd.incident import Cause
from artemisd.replay import replay_records
from artemisd.wire import parse_record
from tests.unit.windows import lockstep

TRACE = Path(__file__).with_name("data") / "cpu_quota_rank_in_gloo.jsonl"
SETTINGS = AnalysisSettings()


def load(*drop: str):
    records = []
    for n, line in enumerate(TRACE.read_text().splitlines(), 1):
        d = json.loads(line)
        for name in drop:
            d.get("host", {}).pop(name, None)
        records.append(parse_record(d, f"{TRACE.name}:{n}"))
    return records


def test_the_rank_whose_quota_ran_out_is_named_two_windows_after_the_onset():
    [incident] = replay_records(load())
    assert (incident.rank, incident.cause) == (2, Cause.HOST_CPU)
    assert (incident.onset_window, incident.confirmed_window) == (6, 7)  # ConfirmWindows=2, the counter says why
    signals = {e.signal: (e.value, e.peers) for e in incident.evidence}
    assert signals["cpu_throttled_pct"] == (100.0, 0.0)
    wait, peer_wait = signals["run_wait_ms"]
    assert wait > 4 * peer_wait
    # Its excess is the time the others waited for it: ~24 ms of a ~39 ms step, as the step rose from ~13 ms.
    assert 15.0 <= incident.excess_ms <= 35.0 and 40.0 <= incident.loss_pct <= 80.0


def test_the_run_queue_wait_alone_names_nobody():
    # Without the quota counter the wait is what a shared host's scheduler does to some rank for seconds
    # at a time (benchmarks/healthy_soak.py paged 12 times when it was enough): not a fault by itself.
    assert [i for i in replay_records(load("cpu_throttled_pct")) if i.rank is not None] == []


def test_without_the_run_queue_wait_busy_alone_names_nobody():
    assert [i for i in replay_records(load("run_wait_ms_per_s")) if i.rank is not None] == []


def _frame(busy, comm, waits, throttled=(0.0, 0.0, 100.0, 0.0)):
    """A 4-rank window (lockstep, 50 steps) whose ranks waited ``waits`` ms per step for a CPU."""
    step = max(busy) + comm  # lockstep: each rank's window lasts 50 steps of this
    host = {r: {"run_wait_ms_per_s": w * 1000.0 / step, "cpu_throttled_pct": t}
            for r, (w, t) in enumerate(zip(waits, throttled))}
    return WindowFrame.from_reports(lockstep(0, busy, comm_ms=comm, host=host))


def test_only_the_wait_its_busy_does_not_show_moves_and_never_more_than_it_waited_beyond_the_collective():
    frame = _frame([3.0, 3.0, 3.0, 3.0], 35.0, [8.0, 7.0, 60.0, 9.0])
    extra = own_cpu_wait(frame, SETTINGS, usual_comm_wait=10.0)
    assert extra[[0, 1, 3]].tolist() == [0.0, 0.0, 0.0]
    assert extra[2] == 35.0 - 10.0  # capped: 60 - 8.5 ms of waits summed over threads, 25 ms beyond the collective
    moved = with_own_cpu_wait(frame, extra)
    assert np.allclose(moved.busy + moved.comm_wait, frame.step) and moved.busy[2] == 28.0
    # A rank whose busy already shows its wait (it was held off a CPU while computing) keeps its busy.
    computing = _frame([3.0, 3.0, 30.0, 3.0], 10.0, [8.0, 7.0, 35.0, 9.0])
    assert own_cpu_wait(computing, SETTINGS, usual_comm_wait=10.0)[2] == 0.0


def test_ordinary_differences_in_the_wait_move_nothing():
    frame = _frame([3.0, 3.0, 3.0, 3.0], 35.0, [8.0, 7.0, 9.5, 9.0])  # under MinSlowdown of the step's spread
    assert not own_cpu_wait(frame, SETTINGS, usual_comm_wait=10.0).any()
    # However long the wait, without its quota running out it is the scheduler's doing on a shared host.
    unthrottled = _frame([3.0, 3.0, 3.0, 3.0], 35.0, [8.0, 7.0, 60.0, 9.0], throttled=(0.0,) * 4)
    assert not own_cpu_wait(unthrottled, SETTINGS, usual_comm_wait=10.0).any()
    unmeasured = WindowFrame.from_reports(lockstep(0, [3.0] * 4, comm_ms=35.0))
    assert not own_cpu_wait(unmeasured, SETTINGS, usual_comm_wait=10.0).any()
