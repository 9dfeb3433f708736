"""Scoring incidents against simulator truth, and the scenario suites it runs on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from artemisd.sim.scenarios import SuiteSpec, draw_suite, load_suite
from artemisd.sim.score import combine, score

SCENARIOS = Path(__file__).resolve().parents[2] / "benchmarks" / "scenarios"


def _fault(**kw):
    base = {"id": "1/F1", "job": "1", "kind": "rank", "cause": "gpu.thermal", "rank": 5, "ranks": [5],
            "node": "n00000", "link": None, "island": None, "onset_window": 10, "end_window": 20,
            "visible_window": 10, "magnitude": 0.2, "effective_magnitude": 0.2, "pattern": "steady"}
    return {**base, **kw}


def _inc(id, **kw):
    base = {"id": id, "job": "1", "kind": "rank", "state": "confirmed", "rank": 5, "node": "n00000",
            "link": None, "confirmed_window": 12, "cause": "gpu.thermal"}
    return {**base, **kw}


def _truth(*faults, healthy=(), transients=()):
    return {"faults": list(faults), "healthy_slow": list(healthy), "transients": list(transients)}


def test_a_matching_incident_counts_with_its_latency_and_cause():
    s = score(_truth(_fault()), [_inc("A")])
    assert (s.recall, s.precision, s.cause_accuracy, s.duplicates, s.median_latency) == (1.0, 1.0, 1.0, 0, 2.0)


def test_suspects_and_dismissed_are_not_reported():
    s = score(_truth(_fault()), [_inc("A", state="suspect", confirmed_window=None),
                                 _inc("B", state="dismissed", confirmed_window=None)])
    assert s.recall == 0.0 and s.incidents == [] and len(s.misses) == 1


def test_wrong_rank_wrong_job_or_outside_the_window_do_not_match():
    incidents = [_inc("A", rank=6), _inc("B", job="2"), _inc("C", confirmed_window=9),
                 _inc("D", confirmed_window=26)]
    s = score(_truth(_fault()), incidents)
    assert s.recall == 0.0 and s.precision == 0.0 and len(s.false_positives) == 4
    # Within the grace period after the last window still counts.
    assert score(_truth(_fault()), [_inc("E", confirmed_window=25)]).recall == 1.0


def test_two_incidents_for_one_fault_are_a_duplicate():
    node_fault = _fault(kind="node", rank=None, ranks=[4, 5], cause="host.cpu")
    s = score(_truth(node_fault), [_inc("A", kind="node", rank=None, cause="host.cpu"),
                                   _inc("B", rank=4, confirmed_window=14, cause="host.cpu")])
    assert s.recall == 1.0 and s.precision == 1.0 and s.duplicates == 1
    assert s.outcomes[0].first["id"] == "A"


def test_job_wide_faults_match_job_wide_incidents():
    link = _fault(kind="link", rank=None, ranks=[], cause="comm.link", node="n00003", link="n00003:uplink")
    s = score(_truth(link), [_inc("A", kind="link", rank=None, node="n00003", cause="comm.link")])
    assert s.recall == 1.0 and s.outcomes[0].localized
    s = score(_truth(link), [_inc("A", kind="job", rank=None, node=None, cause="unknown")])
    assert s.recall == 1.0 and s.cause_accuracy == 0.0 and not s.outcomes[0].localized
    s = score(_truth(link), [_inc("A")])  # a rank incident is not a link fault
    assert s.recall == 0.0


def test_false_positives_are_explained():
    truth = _truth(healthy=[{"job": "1", "rank": 7, "node": "n00000", "ratio": 1.025}],
                   transients=[{"job": "1", "kind": "gc", "window": 30, "rank": 2, "rise": 0.05}])
    s = score(truth, [_inc("A", rank=7), _inc("B", rank=2, confirmed_window=31), _inc("C", rank=3)])
    why = [w for _, w in s.false_positives]
    assert why[0].startswith("healthy-slow") and why[1] == "near transient gc" and why[2] == ""
    assert s.precision == 0.0 and s.recall != s.recall  # no faults: recall undefined (NaN)


def test_latency_ignores_small_slowdowns_and_uses_the_visible_window():
    small = _fault(effective_magnitude=0.03)
    ramp = _fault(id="1/F2", rank=9, ranks=[9], pattern="ramp", visible_window=13)
    s = score(_truth(small, ramp), [_inc("A"), _inc("B", rank=9, confirmed_window=15)])
    assert [o.latency for o in s.outcomes] == [None, 2]


def test_combine_and_per_cause():
    a = score(_truth(_fault()), [_inc("A")])
    b = score(_truth(_fault(id="2/F1", job="2", cause="input.loader")), [_inc("B", job="2", cause="gpu.clocks")])
    s = combine([a, b])
    assert s.recall == 1.0 and s.cause_accuracy == 0.5
    per = s.by_cause()
    assert per["gpu.thermal"].cause_accuracy == 1.0 and per["input.loader"].cause_accuracy == 0.0


def test_suite_files_load_and_draw_deterministically():
    paths = sorted(SCENARIOS.glob("*.json"))
    names = {load_suite(p).name for p in paths}
    assert "tuning" in names and any(n.startswith("heldout") for n in names)
    suites = {load_suite(p).name: load_suite(p) for p in paths}
    tuning = suites["tuning"]
    for name, suite in suites.items():
        if name != "tuning":
            assert suite.seed != tuning.seed and set(suite.world).isdisjoint(tuning.world)
    first, again = draw_suite(tuning), draw_suite(tuning)
    assert first == again
    jobs = [j for fleet in first for j in fleet.jobs]
    assert len({j.job for j in jobs}) == len(jobs)
    causes = [f.cause for j in jobs for f in j.faults]
    assert all(causes.count(c) == tuning.faults_per_cause for c in tuning.causes)
    assert sum(not j.faults for j in jobs) >= tuning.healthy_jobs


def test_change_pairs_share_a_trace_and_nodes_and_start_after_the_reference():
    suite = SuiteSpec(name="t", seed=5, faults_per_cause=1, causes=("change.config",), healthy_jobs=0,
                      benign_changes=1, world=(16,), windows=(20, 20))
    fleets = draw_suite(suite)
    pairs = [f for f in fleets if len(f.jobs) >= 2]
    jobs = [j for f in fleets for j in f.jobs]
    assert len(jobs) == 4 and len(pairs) == len(fleets)
    for fleet in fleets:
        by_node: dict = {}
        for job in fleet.jobs:
            by_node.setdefault(job.first_node, []).append(job)
        for ref, new in (v for v in by_node.values() if len(v) == 2):
            assert ref.env != new.env and new.start_s > ref.start_s + ref.windows * 20


def test_a_bad_suite_file_names_the_field(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "x", "seed": 1, "faults_per_cause": -1}))
    with pytest.raises(ValueError, match="faults_per_cause"):
        load_suite(bad)
    bad.write_text("{")
    with pytest.raises(ValueError, match="bad.json:1: not JSON"):
        load_suite(bad)
