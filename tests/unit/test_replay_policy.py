"""``artemis replay --policy``: a simulated trace through the analysis and the closed loop.

Traces come from the fleet simulator (as in test_replay_sim.py), with the
node check's root-side readings added for the faulty GPU's node: a recorded
trace is the admin's, so its node events corroborate hard actions.  The
property test replays random small traces under random policies, with a
person draining and resuming nodes in between, and checks the budgets and
NHC manners against the simulated Slurm after every record.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from artemisd.cli import main
from artemisd.cli.replay import format_table
from artemisd.config import parse_config_text
from artemisd.replay import replay_records
from artemisd.sim import NVIDIA_H100, FaultSpec, Fleet, FleetSpec, JobSpec, NoiseSpec
from artemisd.sim.policy_replay import PARTITION, TraceLoop
from artemisd.wire import parse_record

HOUR = 3600.0
QUIET = NoiseSpec(gc_rate=0, spike_rate=0, comm_spike_rate=0)
# What the node check reads on a GPU under each fault (policy._root_agrees).
SHOWS = {
    "gpu.thermal": {"throttle": ["sw_thermal"], "sm_clock_mhz": 1500},
    "gpu.clocks": {"throttle": ["hw_slowdown"], "sm_clock_mhz": 1200},
    "gpu.power": {"throttle": ["sw_power_cap"], "sm_clock_mhz": 1600, "power_limit_w": 560},
}


def health(node: str, when: float, index: int, cause: str | None) -> dict[str, Any]:
    gpu = {"index": index, "sm_clock_mhz": 1980, "max_sm_clock_mhz": 1980, "util_pct": 97.0, "throttle": [],
           "power_limit_w": 700, "default_power_limit_w": 700, **(SHOWS[cause] if cause else {})}
    return {"type": "node", "v": 1, "event": "health", "node": node, "time": round(when, 3), "gpus": [gpu]}


def make_trace(faults: list[tuple[str, int, int]], windows: int = 24, seed: int = 3,
               starts: list[float] | None = None, shows_until: list[int | None] | None = None) -> list[dict]:
    """One 8-rank job (2 ranks a node) per fault (cause, rank, onset), and the node check's
    readings of the faulty GPU's node every window from the onset (healthy from ``shows_until``)."""
    jobs = tuple(JobSpec(job=str(50 + k), islands=(NVIDIA_H100.model_copy(update={"ranks": 8}),), windows=windows,
                         ranks_per_node=2, noise=QUIET, start_s=(starts or [0.0] * len(faults))[k],
                         faults=(FaultSpec(cause=cause, rank=rank, onset=onset, magnitude=0.25),))
                 for k, (cause, rank, onset) in enumerate(faults))
    out = []
    for rec in Fleet(FleetSpec(seed=seed, jobs=jobs)).records():
        out.append(rec)
        if rec["type"] != "window":
            continue
        k = int(rec["job"]) - 50
        cause, rank, onset = faults[k]
        seq = rec["window"]["seq"]
        if rec["rank"] == rank and seq >= onset:
            until = (shows_until or [None] * len(faults))[k]
            shown = cause if until is None or seq < until else None
            out.append(health(rec["node"], rec["window"]["t1"] + 0.5, rec["device"]["index"], shown))
    return out


def write(tmp_path: Path, records: list[dict], policy: str) -> tuple[str, str]:
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in records))
    conf = tmp_path / "artemis.conf"
    conf.write_text(policy + "\n")
    return str(trace), str(conf)


THREE = [("gpu.thermal", 3, 8), ("gpu.thermal", 5, 10), ("gpu.thermal", 1, 12)]


@pytest.fixture(scope="module")
def three_faults() -> list[dict]:
    return make_trace(THREE)


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["replay", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_budget_refuses_the_second_and_third_drain(tmp_path, capsys, three_faults):
    trace, conf = write(tmp_path, three_faults, "PartitionPolicy=* Auto=drain,requeue,escalate "
                                                "MaxDrainFraction=0.1 MaxDrainsPerHour=5")
    code, out, err = run_cli(capsys, trace, "--policy", conf)
    assert code == 0, err
    assert "policy: PartitionPolicy=* (from" in out and "its 12 node(s) form partition 'replay'" in out
    assert "MaxDrainFraction=0.1 (1 of 12 nodes)" in out
    assert "node events in the trace are taken as root-side evidence" in out
    assert "verification judges the recorded windows" in out
    assert "  INC-1 drain n00001: done (n00001 drained: artemis: INC-1 gpu.thermal rank 3 1.2" in out
    assert "  INC-1 requeue 50: done (job 50 requeued excluding n00001)" in out
    assert "refused by the drain budget: 2" in out
    refused = [line for line in out.splitlines() if "when deciding): drain budget" in line]
    assert [line.split()[0] for line in refused] == ["INC-2", "INC-3"]
    assert all("MaxDrainFraction=0.1 reached: 1 of 12 nodes drained or being drained by Artemis (allows 1)" in line
               for line in refused)
    assert "waiting for approval: none" in out
    assert "artemis replay: 3 incident(s); 0 line(s) rejected" in err


def test_an_approval_only_drain_waits_and_approve_all_gives_it(tmp_path, capsys, three_faults):
    trace, conf = write(tmp_path, three_faults, "PartitionPolicy=* Auto=escalate Approve=drain,requeue "
                                                "MaxDrainFraction=0.1")
    _, out, _ = run_cli(capsys, trace, "--policy", conf)
    assert "approvals: none given; they wait" in out
    assert "waiting for approval: 1\n  INC-1 drain n00001: artemis approve INC-1  (or artemis deny INC-1)" in out
    assert "  INC-1 drain n00001: pending_approval" in out
    # The waiting drain holds the budget's one node: the others are refused while it waits.
    assert "refused by the drain budget: 2" in out
    _, out, _ = run_cli(capsys, trace, "--policy", conf, "--approve-all")
    assert "approvals: every one given (--approve-all)" in out
    assert "approved automatically (--approve-all): 1\n  INC-1 drain n00001: done" in out
    assert "  INC-1 drain n00001: done, approved by approve-all" in out
    assert "waiting for approval: none" in out


def test_json_gives_the_first_action_and_the_plan(tmp_path, capsys, three_faults):
    trace, conf = write(tmp_path, three_faults, "PartitionPolicy=* Auto=escalate Approve=drain,requeue "
                                                "MaxDrainFraction=0.1")
    _, out, _ = run_cli(capsys, trace, "--policy", conf, "--json")
    first, second, third = (json.loads(line) for line in out.splitlines())
    assert (first["action"]["kind"], first["action"]["target"], first["action"]["status"]) == \
        ("drain", "n00001", "pending_approval")
    assert [(s["kind"], s["status"]) for s in first["plan"]] == [("escalate", "proposed")]
    assert (second["action"]["kind"], second["action"]["status"]) == ("drain", "refused")
    assert second["action"]["reason"].startswith("drain budget: MaxDrainFraction=0.1 reached")
    assert second["state"] == "escalated" and third["action"]["status"] == "refused"
    assert [(a["kind"], a["status"]) for a in second["actions"]] == [("escalate", "done")]
    trace, conf = write(tmp_path, three_faults, "PartitionPolicy=* Auto=drain,requeue,escalate MaxDrainFraction=1")
    _, out, _ = run_cli(capsys, trace, "--policy", conf, "--json")
    first = json.loads(out.splitlines()[0])
    assert (first["action"]["kind"], first["action"]["status"]) == ("drain", "proposed")
    assert first["action"]["reversible"] is True
    # Every contract field is there; what the loop did follows as additive fields.
    assert {"id", "job", "kind", "state", "cause", "evidence", "action", "result", "plan", "actions"} <= set(first)


def test_without_a_matching_policy_the_built_in_defaults_apply_and_say_so(tmp_path, capsys, three_faults):
    trace, conf = write(tmp_path, three_faults, "PartitionPolicy=gpu* Auto=drain,requeue,escalate")
    _, out, _ = run_cli(capsys, trace, "--policy", conf)
    assert "no PartitionPolicy in" in out and "matches every partition (* or DEFAULT): the built-in defaults" in out


def test_without_policy_replay_prints_what_it_always_did(tmp_path, capsys, three_faults):
    trace, _ = write(tmp_path, three_faults, "")
    code, out, _ = run_cli(capsys, trace)
    incidents = replay_records(parse_record(r) for r in three_faults)
    assert code == 0 and out == format_table(incidents) + "\n"
    code, _, err = run_cli(capsys, trace, "--approve-all")
    assert code == 2 and "--approve-all needs --policy" in err


# --- the property: budgets and NHC manners hold whatever the trace, the policy and the people do ----


ACTIONS = ("correct", "drain", "requeue", "constrain", "escalate")


@st.composite
def policies(draw) -> str:
    # Each action automatic, approval-only or not allowed; drains allowed more often than not.
    modes = {a: draw(st.sampled_from(["auto", "auto", "auto", "approve", "no"])) for a in ACTIONS}
    auto = [a for a in ACTIONS if modes[a] == "auto"]
    approve = [a for a in ACTIONS if modes[a] == "approve"]
    fraction = draw(st.sampled_from([0.0, 0.1, 0.25, 0.34, 0.5, 1.0, 1.0]))
    per_hour = draw(st.sampled_from([0, 1, 1, 2, 3]))
    cooldown = draw(st.sampled_from([0, 60, 900, 3600]))
    constraint = " Constraint=healthy" if draw(st.booleans()) else ""
    return (f"PartitionPolicy=* Auto={','.join(auto)} Approve={','.join(approve)} "
            f"MaxDrainFraction={fraction} MaxDrainsPerHour={per_hour} Cooldown={cooldown}{constraint}")


faults = st.tuples(st.sampled_from(sorted(SHOWS)), st.integers(0, 7), st.integers(3, 6))


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(faulty=st.lists(faults, min_size=1, max_size=3), policy=policies(), approve_all=st.booleans(),
       starts=st.lists(st.sampled_from([0.0, 1500.0, 3000.0, 4200.0]), min_size=3, max_size=3),
       shows_until=st.lists(st.sampled_from([None, 6, 7, 8, 9, 10]), min_size=3, max_size=3),
       people=st.lists(st.tuples(st.floats(0.0, 1.0), st.integers(0, 11), st.booleans(), st.booleans()),
                       max_size=6),
       seed=st.integers(0, 2**16))
def test_budgets_and_person_drains_hold_at_every_tick(faulty, policy, approve_all, starts, shows_until, people,
                                                       seed):
    config = parse_config_text(policy)
    records = [parse_record(r) for r in make_trace(faulty, windows=14, seed=seed, starts=starts,
                                                   shows_until=shows_until)]
    run = TraceLoop(records, config, approve_all=approve_all)
    slurm, loop, pol = run.slurm, run.loop, run.policy
    names = [n.name for n in slurm.partition_nodes(PARTITION)]
    allowed = int(pol.max_drain_fraction * len(names))
    # A person drains (True) or resumes (False) a node between two records: any node, or a faulty GPU's.
    faulty_nodes = [f"n{4 * k + rank // 2:05d}" for k, (_, rank, _) in enumerate(faulty)]
    at = sorted((int(f * len(records)), faulty_nodes[i % len(faulty)] if on_fault else names[i % len(names)], drain)
                for f, i, drain, on_fault in people)
    by_person: dict[str, str] = {}
    seen_events = 0

    def check() -> None:
        nonlocal seen_events
        nodes = slurm.partition_nodes(PARTITION)
        held = {n.name for n in nodes if n.drained_by_artemis}
        held |= {r.target for r in loop.actions() if r.kind == "drain" and r.status in ("queued", "running")}
        assert len(held) <= allowed, (policy, sorted(held))
        drains = sorted(e.time for e in slurm.events() if e.who == "artemis" and e.what == "drain")
        rows = sorted(d.at for d in loop.drain_records() if d.status in ("done", "rolled_back"))
        for times in (drains, rows):
            for i, start in enumerate(times):
                assert sum(1 for t in times[i:] if t < start + HOUR) <= pol.max_drains_per_hour, (policy, times)
        for node, reason in by_person.items():
            info = slurm.node(node)
            assert info.drained and info.reason == reason, (node, info)
        for event in slurm.events()[seen_events:]:
            assert not (event.who == "artemis" and event.target in by_person), event
        seen_events = len(slurm.events())

    for index, rec in enumerate(records):
        while at and at[0][0] <= index:
            _, node, drain = at.pop(0)
            if drain:
                by_person[node] = f"person {index}"
                slurm.person_drain(node, by_person[node])
            else:
                by_person.pop(node, None)
                slurm.person_resume(node)
            seen_events = len(slurm.events())
        run.record(rec)
        check()
    result = run.finish()
    check()
    assert len(result.incidents) <= len(faulty) * 2
