"""After an outage, the probes' backlogs are the same run of the job, and no loss of throughput.

While the daemon (or its database) could not take reports, every rank's probe
kept its windows and sends them once it is answered again; one rank's backlog
arrives seconds before another's (each waits out its own jittered backoff).  Seen
while writing the PostgreSQL-restart test with a real job (tests/cluster/test_ha_training.py):
the second rank's backlog, far below the first rank's newest window, was taken for a
requeued job's new run, and the windows analysed with one rank's samples read as the
job's throughput halved — a verification running then would undo a correct drain.
"""

from __future__ import annotations

import math
import os
import random

import pytest

from artemisd.auth import TRUSTED_LOCAL
from artemisd.config import parse_config_text
from artemisd.runs import RESTART_GAP, RUN_SEP, RUNS_REMEMBERED, JobRun
from artemisd.service import Daemon
from artemisd.slurm.cli import CliSlurm
from artemisd.wire import WindowReport
from tests.unit.windows import lockstep

WORLD = 2


def test_a_ranks_own_order_tells_a_new_run_from_a_backlog():
    run = JobRun()
    for seq in range(12):
        assert not any(run.take(rank, seq)[1] for rank in range(WORLD))
    assert not any(run.take(0, seq)[1] for seq in range(12, 32))  # rank 0's backlog
    assert not any(run.take(1, seq)[1] for seq in range(12, 32))  # rank 1's, 19 windows below rank 0's newest
    assert not run.take(1, 31)[1]  # a batch sent again (stored, the answer lost): the same run
    assert run.number == 0
    assert run.take(1, 0)[1] and run.number == 1  # requeued: rank 1 starts again from window 0
    assert not run.take(0, 0)[1] and not run.take(0, 1)[1] and run.number == 1  # its peers join that run
    for seq in range(2, 11):
        run.take(0, seq)
    assert not run.take(0, 10 - RESTART_GAP)[1] and run.number == 1  # back by the gap: late, not a restart
    assert run.take(0, 10 - RESTART_GAP - 1)[1] and run.number == 2  # back past it: a restart


def test_a_late_report_of_the_run_before_a_requeue_does_not_start_a_third_run():
    """Rank 1's last window of the first run is posted after rank 0's first window of the second: it
    ended before the second run began, so it is the first run's, and rank 1's own windows of the second
    run, far below it, join that run instead of starting a third."""
    window_s = 10.0
    run = JobRun()
    for seq in range(12):
        for rank in range(WORLD):
            t0 = 1000.0 + seq * window_s
            assert run.take(rank, seq, t0, t0 + window_s) == (0, False)
    requeued = 1000.0 + 12 * window_s + 45.0  # the second run's window 0 begins 45 s after the first's end
    assert run.take(0, 0, requeued, requeued + window_s) == (1, True)
    late_t0 = 1000.0 + 11 * window_s  # rank 1's window 11 of the first run, posted late
    assert run.take(1, 11, late_t0, late_t0 + window_s) == (0, False)
    for seq in range(6):
        t0 = requeued + seq * window_s
        assert run.take(1, seq, t0, t0 + window_s) == (1, False)


WINDOW_S = 10.0


def _windows(run: JobRun, seqs: range, begin: float, ranks: range = range(WORLD)) -> list[tuple[int, bool]]:
    """Each of ``ranks`` sends windows ``seqs`` of a run whose window 0 began at ``begin``, window after window."""
    return [run.take(rank, seq, begin + seq * WINDOW_S, begin + (seq + 1) * WINDOW_S)
            for seq in seqs for rank in ranks]


@pytest.mark.parametrize("crashed_after", [1, 2, 3])
def test_a_restart_within_the_first_windows_is_a_new_run(crashed_after):
    """Issue 28: a torchrun restart (or crash and requeue) a few windows in numbers its windows from 0
    again, less than ``RESTART_GAP`` below the dead attempt's newest.  The new probe's window began after
    the dead one's newest ended: a new run, which every rank joins, even the restart after one window
    (window 0 again)."""
    run = JobRun()
    assert _windows(run, range(crashed_after), 1000.0) == [(0, False)] * WORLD * crashed_after
    restarted = 1000.0 + crashed_after * WINDOW_S + 8.0  # the new attempt's first step, 8 s after
    assert run.take(0, 0, restarted, restarted + WINDOW_S) == (1, True)
    assert _windows(run, range(0, 1), restarted, range(1, WORLD)) == [(1, False)] * (WORLD - 1)
    assert _windows(run, range(1, 6), restarted) == [(1, False)] * WORLD * 5
    assert run.number == 1


def test_a_backlog_after_an_outage_is_one_run_by_the_times_too():
    """After an outage the ranks' backlogs arrive one rank after another, the second far below the
    first's newest and later in time than what the first had sent before; each rank's own windows are
    in order, and a batch sent again carries its own times: one run."""
    run = JobRun()
    assert not any(started for _, started in _windows(run, range(12), 1000.0))
    for rank in range(WORLD):
        assert not any(started for _, started in _windows(run, range(12, 32), 1000.0, range(rank, rank + 1)))
    t0 = 1000.0 + 31 * WINDOW_S
    assert run.take(1, 31, t0, t0 + WINDOW_S) == (0, False)  # sent again, the answer lost
    for seq in range(28, 32):  # a batch of a rank's last windows sent again
        assert run.take(0, seq, 1000.0 + seq * WINDOW_S, 1000.0 + (seq + 1) * WINDOW_S) == (0, False)
    assert run.number == 0


def test_a_late_report_of_a_short_run_stays_in_it_after_a_quick_restart():
    """Restarted after three windows: rank 1's window 2 of the first attempt, posted after the second
    attempt's first windows, ended before that attempt began, so it is the first's; rank 1's own windows
    of the second attempt, below it, join the second run and start no third."""
    run = JobRun()
    _windows(run, range(2), 1000.0)
    run.take(0, 2, 1020.0, 1030.0)
    restarted = 1036.0
    assert run.take(0, 0, restarted, restarted + WINDOW_S) == (1, True)
    assert run.take(1, 2, 1020.0, 1030.0) == (0, False)  # late, of the first attempt
    assert _windows(run, range(0, 4), restarted, range(1, 2)) == [(1, False)] * 4
    assert _windows(run, range(1, 4), restarted, range(0, 1)) == [(1, False)] * 3
    assert run.number == 1


def test_without_times_only_the_gap_starts_a_run():
    """A report whose span is unknown has nothing to show a new probe: going back by the gap stays late."""
    run = JobRun()
    for seq in range(3):
        run.take(0, seq, 1000.0 + seq * WINDOW_S, 1000.0 + (seq + 1) * WINDOW_S)
    assert run.take(0, 0) == (0, False)
    assert run.take(0, 0, 990.0, 1000.0) == (0, False)  # a clock stepped back across the restart: as late


def test_a_run_remembers_the_start_of_a_bounded_number_of_runs():
    run = JobRun()
    for number in range(3 * RUNS_REMEMBERED):
        t0 = 1000.0 + number * 1000.0
        run.take(0, 20, t0, t0 + 10.0)
        run.take(0, 0, t0 + 500.0, t0 + 510.0)
    assert len(run.began) == RUNS_REMEMBERED and run.number == 3 * RUNS_REMEMBERED
    assert run.run_at(1.0) == run.number - RUNS_REMEMBERED  # older than every run it remembers


def _take_one_by_one(run: JobRun, batch: list[tuple[int, int, float, float]]) -> list[int]:
    return [run.take(rank, seq, t0, t1)[0] for rank, seq, t0, t1 in batch]


def test_a_window_taken_together_is_taken_as_report_by_report_or_not_at_all():
    """``take_together`` answers a batch of one window as ``take`` per report does, leaving the same
    state, or declines and leaves the state untouched (the caller then takes it report by report)."""
    rng = random.Random(11)
    declined = taken = 0
    for trial in range(300):
        together, alone = JobRun(), JobRun()
        clock = 1000.0
        for _ in range(rng.randrange(1, 25)):
            seq = rng.choice([rng.randrange(0, 12), rng.randrange(0, 3)])
            clock += rng.choice([10.0, 10.0, 10.0, 200.0, -400.0])
            ranks = rng.sample(range(6), rng.randrange(0, 6)) + rng.choice([[], [0]])  # a retry sends a rank twice
            batch = [(rank, seq, clock + rng.uniform(-3, 3), clock + 10.0 + rng.uniform(-3, 3)) for rank in ranks]
            before = (together.number, dict(together.newest), dict(together.ended), dict(together.began))
            number = together.take_together([b[0] for b in batch], seq, [b[2] for b in batch], [b[3] for b in batch])
            expected = _take_one_by_one(alone, batch)
            if number is None:
                declined += 1
                assert (together.number, together.newest, together.ended, together.began) == before, trial
                assert _take_one_by_one(together, batch) == expected, trial
            else:
                taken += 1
                assert expected == [number] * len(batch), trial
            assert (together.number, together.newest, together.ended, together.began) == (
                alone.number, alone.newest, alone.ended, alone.began), trial
    assert taken > 500 and declined > 500  # both ways were exercised


def test_lockstep_windows_and_their_retries_are_taken_together():
    run = JobRun()
    for seq in range(30):
        t0 = 1000.0 + 10.0 * seq
        for _ in range(2):  # the second: a batch sent again, its answer lost
            assert run.take_together(list(range(64)), seq, [t0] * 64, [t0 + 10.0] * 64) == 0
    t0 = 1000.0 + 10.0 * 40  # requeued: the first report of the new run goes alone, the rest together
    assert run.take(0, 0, t0, t0 + 10.0) == (1, True)
    assert run.take_together(list(range(1, 64)), 0, [t0] * 63, [t0 + 10.0] * 63) == 1


def daemon(state) -> Daemon:
    config = parse_config_text(f"StateDir={state}\nAuthType=none\n")
    return Daemon(config, CliSlurm(timeout=2, env={"SLURM_CONF": "/nonexistent", "PATH": os.environ["PATH"]}))


def healthy_windows(job: str, count: int) -> list[list[WindowReport]]:
    rng = random.Random(7)
    return [lockstep(seq, [50.0 * (1 + rng.gauss(0, 0.02)) for _ in range(WORLD)], job=job, nodes=["a", "b"])
            for seq in range(count)]


def send(d: Daemon, reports: list[WindowReport]) -> None:
    result = d.accept(list(enumerate(reports)), TRUSTED_LOCAL, {}, [])
    assert result.accepted == len(reports) and not result.rejected


def test_a_backlog_after_an_outage_is_analysed_as_the_same_run_without_a_false_slowdown(tmp_path):
    windows = healthy_windows("77", 44)
    d = daemon(tmp_path / "state")
    try:
        for seq in range(12):
            send(d, windows[seq])
        for rank in range(WORLD):  # the outage's backlog, rank after rank
            send(d, [windows[seq][rank] for seq in range(12, 32)])
        for seq in range(32, 44):
            send(d, windows[seq])
        assert d.analyzer.window_shapes("77", f"0{RUN_SEP}1") == []  # no new run was made up
        series = d.analyzer.throughput("77", "0")
        measured = [t for _, t in series if math.isfinite(t)]
        healthy = sorted(measured)[len(measured) // 2]
        assert len(measured) >= 20 and min(measured) > 0.9 * healthy, measured
        assert not d.store.incidents(job="77")
    finally:
        d.store.close()


def shifted(report: WindowReport, by_s: float) -> WindowReport:
    span = report.window
    return report.model_copy(update={"window": span.model_copy(update={"t0": span.t0 + by_s,
                                                                        "t1": span.t1 + by_s})})


def stored_windows(d: Daemon, job: str) -> set[tuple[str, int, int]]:
    """(step key, rank, window) of each window report the daemon stored for ``job``."""
    return {(r["step"], r["rank"], r["window"]["seq"]) for r in d.store.window_records(job)}


@pytest.mark.parametrize("restarted", [False, True], ids=["running", "daemon restarted at the requeue"])
def test_a_requeued_jobs_late_report_of_its_first_run_is_stored_and_analysed_with_that_run(tmp_path, restarted):
    """Through the daemon: the late report is kept under the first run's key, and the second run is
    one run of both ranks from its window 0 (before, the late report made rank 1's window 0 a third run).
    A daemon restarted in between knows when each run began from what it stored."""
    windows = healthy_windows("78", 16)
    later_s = windows[12][0].window.t1 - windows[0][0].window.t0 + 45.0  # requeued 45 s after window 11
    d = daemon(tmp_path / "state")
    try:
        for seq in range(11):
            send(d, windows[seq])
        send(d, [windows[11][0]])
        send(d, [shifted(windows[0][0], later_s)])  # the requeued run's first window, rank 0
        if restarted:
            d.store.close()
            d = daemon(tmp_path / "state")
        send(d, [windows[11][1]])  # rank 1's last window of the first run, late
        send(d, [shifted(windows[0][1], later_s)])
        for seq in range(1, 6):
            send(d, [shifted(r, later_s) for r in windows[seq]])
        assert d.analyzer.window_shapes("78", f"0{RUN_SEP}2") == []  # no third run
        assert len(d.analyzer.window_shapes("78", f"0{RUN_SEP}1")) >= 4
        stored = stored_windows(d, "78")
        assert ("0", 1, 11) in stored and (f"0{RUN_SEP}1", 1, 0) in stored
    finally:
        d.store.close()


def test_an_incident_with_a_window_a_rank_missed_is_still_strict_json(tmp_path):
    """The window's throughput is not measured (NaN inside): the API says null, never the non-JSON NaN."""
    import json

    import pytest

    from tests.unit.test_server import SLOW_BUSY, Clock, Harness, cluster, hot_gpu_confirmed, run

    def refuse(constant):
        pytest.fail(f"{constant} in the body: not JSON")

    async def scenario():
        async with Harness(tmp_path, "", cluster(), Clock()) as h:
            await hot_gpu_confirmed(h)
            await h.post(lockstep(12, SLOW_BUSY, nodes=[f"n{r // 2}" for r in range(len(SLOW_BUSY))])[:-1])
            await h.windows(range(13, 16), SLOW_BUSY)  # the partial window 12 is analysed without its last rank
            [inc] = await h.incidents()
            text = await (await h.client.get(f"/v1/incidents/{inc['id']}")).text()
            throughput = dict(json.loads(text, parse_constant=refuse)["throughput"])
            assert throughput[12] is None and all(v is not None for seq, v in throughput.items() if seq != 12)
    run(scenario)


def test_a_job_restarted_after_two_windows_is_stored_and_analysed_as_its_second_run(tmp_path):
    """Through the daemon, a sender's batch of both ranks at a time: the restarted attempt's windows
    go under the second run's key from its window 0, the dead attempt's stay under the first."""
    windows = healthy_windows("79", 8)
    restarted = [[shifted(r, windows[2][0].window.t0 - windows[0][0].window.t0 + 8.0) for r in window]
                 for window in windows]  # 8 s after window 1 ended
    d = daemon(tmp_path / "state")
    try:
        for window in windows[:2] + restarted:
            send(d, window)
        stored = stored_windows(d, "79")
        assert {("0", rank, seq) for rank in range(WORLD) for seq in range(2)} <= stored
        assert {(f"0{RUN_SEP}1", rank, seq) for rank in range(WORLD) for seq in range(8)} <= stored
        assert len(d.analyzer.window_shapes("79", f"0{RUN_SEP}1")) >= 6
        assert d.analyzer.window_shapes("79", f"0{RUN_SEP}2") == []
    finally:
        d.store.close()
