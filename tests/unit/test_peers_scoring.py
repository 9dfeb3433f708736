"""benchmarks/peers_score.py: the peer comparison's scoring, on data recorded from a real run.

tests/unit/data/peers_recorded.json is the raw output of one
``benchmarks/peers.py --quick`` run (4 gloo ranks, window = report interval
= 8 steps, rank 2 slowed): each job's window boundaries from the probe's
trace, the incidents ``artemis replay --json`` found in it, NVRx's
``identify_stragglers()`` on rank 0 at each report, and for the faulted jobs
the slowed rank's iteration end times and the moment the fault was applied.
The expected numbers below were read off that data by hand.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.peers_score import (Report, artemis_reports, false_blames, first_cause, format_table,
                                    healthy_flags, latency_steps, megatron_names, nvrx_names, onset_iteration,
                                    overhead_pct, score, window_ends)

RECORDED = json.loads((Path(__file__).parent / "data" / "peers_recorded.json").read_text())
SLOW = RECORDED["slow_rank"]


def _runs(system: str) -> dict[str, dict]:
    runs = {}
    for name, job in RECORDED["jobs"].items():
        if system == "artemis":
            reports = artemis_reports(job["incidents"], window_ends(job["windows"]))
        else:
            reports = [Report("nvrx", r["done"], *nvrx_names(r["stragglers"])) for r in job["nvrx"]]
        onset = onset_iteration(job["slow_rank_ends"], job["fault_t0"]) if "fault_t0" in job else None
        runs[name] = {"reports": reports, "slow_rank": SLOW if onset is not None else None, "onset": onset}
    return runs


def test_window_ends_count_the_probes_first_boundary():
    # probe step p is iteration p + 1: window 9 (steps 72..79) closes when iteration 80 ends, 81 done
    ends = window_ends(RECORDED["jobs"]["slowed"]["windows"])
    assert ends[0] == 9 and ends[9] == 81


def test_onset_is_the_first_iteration_ending_after_the_fault():
    for name in ("slowed", "intermittent"):
        job = RECORDED["jobs"][name]
        onset = onset_iteration(job["slow_rank_ends"], job["fault_t0"])
        assert onset == 49  # the rank wrote its marker at iteration 49 (6 windows * 8 + 1)
        assert job["slow_rank_ends"][onset - 1] <= job["fault_t0"] < job["slow_rank_ends"][onset]
    with pytest.raises(ValueError, match="after the last iteration"):
        onset_iteration([1.0, 2.0], 3.0)


def test_artemis_row_from_the_recorded_run():
    row = score("artemis", _runs("artemis"), RECORDED["overhead_rounds"])
    assert row.latency_steps == 81 - 49  # INC-4 on rank 2 confirmed in window 9
    assert row.latency_intermittent == 153 - 49  # rank 2 only confirmed in window 18
    assert row.false_blames == 3  # ranks 1, 0 and 3 in the intermittent job
    assert row.healthy_flags == 1  # rank 2 in window 5 of the healthy job
    assert row.cause == "host.cpu"
    assert row.overhead_pct == pytest.approx(3.61, abs=0.01)  # median of 6 round ratios: (0.927 + 1.145) / 2


def test_nvrx_row_from_the_recorded_run():
    row = score("nvrx", _runs("nvrx"), RECORDED["overhead_rounds"])
    assert row.latency_steps == 73 - 49 and row.latency_intermittent == 73 - 49
    assert row.false_blames == 16 + 9  # slowed job + intermittent job, one per rank per report
    assert row.healthy_flags == 12
    assert row.cause is None  # it names a section, not a cause


def test_latency_ignores_names_from_before_the_fault():
    reports = [Report("x", 10, (2,)), Report("x", 30, (1,)), Report("x", 40, (2,), "host.cpu"),
               Report("x", 50, (2,), "other")]
    assert latency_steps(reports, 2, onset=20) == 20
    assert first_cause(reports, 2, onset=20) == "host.cpu"
    assert latency_steps(reports, 3, onset=20) is None
    assert first_cause(reports, 3, onset=20) is None
    # a report available at the onset iteration itself saw none of the fault
    assert latency_steps([Report("x", 20, (2,))], 2, onset=20) is None


def test_blames_and_flags_count_each_rank_in_each_report():
    reports = [Report("x", 8, (0, 2, 3)), Report("x", 16, ()), Report("x", 24, (2,))]
    assert false_blames(reports, 2) == 2
    assert healthy_flags(reports) == 4


def test_artemis_incidents_name_ranks_by_rank_node_or_link():
    ends = {3: 33, 4: 41}
    got = artemis_reports([
        {"id": "INC-1", "rank": 1, "node": "n1", "confirmed_window": 3, "cause": "host.cpu"},
        {"id": "INC-2", "rank": None, "node": "n3", "confirmed_window": 4, "cause": "unknown"},
        {"id": "INC-3", "rank": None, "node": None, "link": "n0-n2", "confirmed_window": 4, "cause": "comm.link"},
        {"id": "INC-4", "kind": "job", "rank": None, "node": None, "confirmed_window": None, "flagged_window": 3},
    ], ends)
    assert [(r.done, r.ranks, r.cause) for r in got] == [
        (33, (1,), "host.cpu"), (41, (3,), None), (41, (0, 2), "comm.link"), (33, (), None)]
    with pytest.raises(ValueError, match="INC-9"):
        artemis_reports([{"id": "INC-9", "rank": 1, "confirmed_window": 7}], ends)


def test_nvrx_and_megatron_names():
    assert nvrx_names({"straggler_gpus_relative": [], "straggler_sections_relative": {"fwd": [3, 1]},
                       "straggler_sections_individual": {"data_loading": [1]}}) == ((1, 3), None)
    line = "[2026-12-03 11:00:00] | MnRtt/Rnk: 3.10ms/0 | MxRtt/Rnk: 12.30ms/2 | MnPwr/Rnk: 0.00W/0"
    assert megatron_names(line) == (2,)
    assert megatron_names("nothing here") == ()


def test_overhead_is_the_median_ratio_against_the_same_rounds_baseline():
    blocks = [{"none": 10.0, "a": 11.0}, {"none": 20.0, "a": 20.0}, {"none": 10.0, "a": 10.5}, {"none": 10.0}]
    assert overhead_pct(blocks, "a") == pytest.approx(5.0)
    with pytest.raises(ValueError, match="'b'"):
        overhead_pct(blocks, "b")


def test_table_has_one_row_per_system_and_says_off_for_a_tool_that_never_ran():
    rows = [score("artemis", _runs("artemis"), RECORDED["overhead_rounds"]),
            score("megatron", {n: {**r, "reports": []} for n, r in _runs("nvrx").items()},
                  RECORDED["overhead_rounds"], ran=False)]
    lines = format_table(rows).splitlines()
    assert lines[0].split()[:6] == ["system", "latency_steps", "false_blames", "healthy_flags", "cause",
                                    "overhead_pct"]
    assert lines[1].split()[:5] == ["artemis", "32", "3", "1", "host.cpu"]
    cells = lines[2].split()
    assert cells[0] == "megatron" and cells[1:5] == ["off"] * 4 and cells[5].startswith(("+", "-"))
