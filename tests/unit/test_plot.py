"""The incident plot's numbers: the job's windows across a requeue and the loop's marks."""

from __future__ import annotations

from artemisd.cli.admin import job_windows, loop_marks, plot_timeline


def rows(run_start: float, seqs: range, ranks: int, samples: float, seconds: float, run: int = 0) -> list[dict]:
    """Rows as ``GET /v1/incidents/{id}/windows`` gives them (``run`` is the daemon's)."""
    out = []
    for i, seq in enumerate(seqs):
        t0 = run_start + i * seconds
        for rank in range(ranks):
            out.append({"rank": rank, "seq": seq, "run": run, "world": ranks, "node": f"n{rank}", "step": 10.0,
                        "busy": 8.0, "comm_wait": 2.0, "samples": samples, "t0": t0, "t1": t0 + seconds})
    return out


def test_requeued_run_follows_the_first_in_time_with_its_own_throughput():
    first = rows(1000.0, range(0, 6), ranks=4, samples=100.0, seconds=2.0)   # 200 samples/s
    second = rows(1100.0, range(0, 4), ranks=3, samples=100.0, seconds=1.0, run=1)  # 300 samples/s
    jobs = job_windows(second + first)  # arrival order does not matter
    assert [(j["run"], j["seq"]) for j in jobs] == [(0, s) for s in range(6)] + [(1, s) for s in range(4)]
    assert [round(j["throughput"]) for j in jobs] == [200] * 6 + [300] * 4
    assert all(len(j["rows"]) == (4 if j["run"] == 0 else 3) for j in jobs)


def test_runs_are_the_daemons_and_a_window_a_rank_missed_has_no_throughput():
    # After an outage rank 3's backlog arrived last, its windows far below the others'
    # newest: the daemon kept them in run 0 (runs.JobRun), and so does the plot.  A row
    # stored twice (a leader killed between store and reply, the probe resent) counts once.
    first = rows(1000.0, range(0, 6), ranks=4, samples=100.0, seconds=2.0)
    late = [w for w in first if w["rank"] == 3]
    arrived = [w for w in first if w["rank"] != 3] + late + late[:2]
    jobs = job_windows(arrived)
    assert [(j["run"], j["seq"]) for j in jobs] == [(0, s) for s in range(6)]
    assert [round(j["throughput"]) for j in jobs] == [200] * 6
    # Window 5 without rank 3: the job's samples/s is not measured, not 3/4 of it.
    jobs = job_windows([w for w in first if not (w["seq"] == 5 and w["rank"] == 3)])
    assert jobs[-1]["seq"] == 5 and jobs[-1]["throughput"] is None and len(jobs[-1]["rows"]) == 3


def test_marks_place_onset_in_the_run_before_the_action_and_verdict_from_audit():
    jobs = job_windows(rows(1000.0, range(0, 6), 4, 100.0, 2.0) + rows(1100.0, range(0, 6), 4, 100.0, 2.0, run=1))
    incident = {"onset_window": 2, "confirmed_window": 4}
    audit = [{"who": "analyzer", "what": "confirmed", "time": 1010.5, "result": ""},
             {"who": "daemon", "what": "drain n2", "time": 1020.0, "result": "done: drained"},
             {"who": "verify", "what": "resolved", "time": 1111.0, "result": ""}]
    marks = dict(loop_marks(incident, jobs, audit))
    # window 2 of the first run starts at 1004; window 4 ends at 1010 (the
    # second run's windows 2 and 4 come after the action and are not the onset)
    assert marks == {"onset": 1004.0, "confirmed": 1010.0, "action": 1020.0, "resolved": 1111.0}


def test_plot_writes_a_png_with_three_panels(tmp_path):
    windows = rows(1000.0, range(0, 8), 4, 100.0, 2.0)
    incident = {"id": "INC-1", "job": "7", "cause": "gpu.clocks", "rank": 2, "state": "resolved",
                "onset_window": 3, "confirmed_window": 5,
                "result": {"throughput_healthy": 200.0, "throughput_before": 150.0, "throughput_after": 199.0}}
    out = tmp_path / "p.png"
    plot_timeline({"incident": incident, "windows": windows}, str(out), audit=[])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
