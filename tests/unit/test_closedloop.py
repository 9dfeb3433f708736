"""The closed loop at fleet scale (artemisd/sim/closedloop.py): small fleets, numbers that must hold."""
from __future__ import annotations

from collections import deque
from dataclasses import replace

import pytest

from artemisd.sim import closedloop as cl
from artemisd.sim.closedloop import FleetParams, FleetSim, JobSpec, NodeFaultSpec, Scenario, draw_scenario

# A seed whose half day meets heat, clocks, host and input faults (7 hardware faults, requeues).
SMALL = replace(cl.QUICK, seed=8)


@pytest.fixture(scope="module")
def small() -> dict[str, cl.ModeResult]:
    scenario = draw_scenario(SMALL)
    return {mode: FleetSim(scenario, mode).run() for mode in cl.MODES}


def _one_job(nodes: int = 4, job_nodes: int = 2, work_h: float = 10.0, faults: tuple = (), days: float = 1.0,
             **params) -> Scenario:
    """A cluster of ``nodes`` with one long job on its first ``job_nodes`` nodes and the given node faults."""
    p = replace(FleetParams(), nodes=nodes, days=days, tail_days=2.0, **params)
    job = JobSpec("1000", job_nodes, work_h * 3600.0, 2 * work_h * 3600.0, checkpoint_s=1800.0, restart_s=300.0,
                  submit=0.0, opt_in=False)
    return Scenario(p, (job,), tuple(faults))


def test_same_seed_same_result(small):
    again = FleetSim(draw_scenario(SMALL), "artemis").run()
    first, second = small["artemis"].as_json(), again.as_json()
    first.pop("seconds"), second.pop("seconds")
    assert first == second
    other = FleetSim(draw_scenario(replace(SMALL, seed=SMALL.seed + 1)), "artemis").run().as_json()
    other.pop("seconds")
    assert other != first


def test_every_mode_runs_the_same_jobs_to_their_end_and_none_loses_the_most(small):
    none = small["none"]
    assert none.lost_gpu_hours > 0 and none.encounters > 0
    for mode, r in small.items():
        # The same jobs in every mode, each ending exactly once (completed or killed at its limit).
        assert r.jobs_started == none.jobs_started
        assert r.jobs_finished + r.timeouts == r.jobs_started
        assert r.lost_gpu_hours == pytest.approx(r.slow_gpu_hours + r.requeue_gpu_hours + r.timeout_gpu_hours)
        assert sum(r.slow_by_cause.values()) == pytest.approx(r.slow_gpu_hours)
        if mode != "none":
            # On this fleet.  Not a law: acting has a price (a requeue throws work away), and on a
            # fleet whose faults are few and short a person's requeue can cost more than it saves.
            assert r.lost_gpu_hours < none.lost_gpu_hours, mode
    # Nothing acts without a loop: no drains, requeues or corrections.
    assert (none.drains, none.requeues, none.corrections, none.rebalances) == (0, 0, 0, 0)


def test_gpu_hours_held_are_useful_work_plus_what_was_lost():
    """Conservation: every GPU-hour a job held went to useful work, slowed steps, or a requeue."""
    sim = FleetSim(draw_scenario(SMALL), "artemis-auto")
    r = sim.run()
    g = SMALL.gpus_per_node
    useful = sum(j.spec.nodes * g * j.progress for j in sim.jobs.values()) / 3600.0
    assert r.requeues > 0
    assert r.gpu_hours_total == pytest.approx(useful + r.slow_gpu_hours + r.requeue_gpu_hours, rel=0.01)


def test_budgets_are_never_exceeded():
    """Every hardware fault a heat fault: the drain budget binds, and what Slurm shows never exceeds it."""
    p = replace(FleetParams(), nodes=40, days=0.5, hardware_per_node_day=3.0, transient_per_job_hour=0.0,
                false_per_window=0.0, sizes=((4, 0.5), (8, 0.5)))
    base = draw_scenario(p)
    scenario = replace(base, node_faults=tuple(replace(f, cause="gpu.thermal", magnitude=0.3)
                                               for f in base.node_faults))
    sim = FleetSim(scenario, "artemis-auto")
    r = sim.run()
    policy = sim.config.policy_for(cl.PARTITION)
    # Artemis' drains, and every resume (a person's after the repair, or a rollback).
    drains = [e for e in sim.slurm.events() if (e.who == "artemis" and e.what == "drain") or e.what == "resume"]
    assert r.budget_refusals > 0 and len([e for e in drains if e.what == "drain"]) >= policy.max_drains_per_hour
    held: set[str] = set()
    starts = []
    for e in drains:
        if e.what == "drain":
            held.add(e.target)
            starts.append(e.time)
            assert len(held) <= int(policy.max_drain_fraction * p.nodes)
            assert sum(1 for t in starts if e.time - t < 3600.0) <= policy.max_drains_per_hour
        else:
            held.discard(e.target)


def _misnamed_host_faults(decoy: float) -> tuple[FleetSim, cl.ModeResult]:
    """Host contention, often: some of it is named gpu.power (as measured), whose ladder leads to a drain."""
    p = replace(cl.QUICK, seed=3, hardware_per_node_day=0.0, transient_per_job_hour=1.5, false_per_window=0.0,
                decoy_rate=decoy)
    base = draw_scenario(p)
    jobs = tuple(replace(j, transients=tuple(replace(t, cause="host.cpu", duration_s=7200.0) for t in j.transients))
                 for j in base.jobs)
    sim = FleetSim(replace(base, jobs=jobs), "artemis-auto")
    return sim, sim.run()


def test_a_healthy_node_is_never_drained_while_its_node_check_shows_nothing():
    sim, r = _misnamed_host_faults(decoy=0.0)
    refused = [n for n in sim.loop.notes() if n.what.startswith("drain") and "needs root-side corroboration" in n.why]
    # Not vacuous: misnamed host contention reached the drain rung, and corroboration refused it.
    assert refused and all(sim.by_incident[n.incident].fault.cause == "host.cpu" for n in refused)
    assert r.healthy_drains == 0
    assert r.drains == 0


def test_the_benign_power_cap_does_not_corroborate_a_drain():
    """Healthy GPUs report sw_power_cap at their default limit (full load reaches design power).  It was
    the one way the fleet run drained healthy nodes: a gpu.power drain of a node that had nothing wrong,
    corroborated by the decoy on any of its 8 GPUs.  Now it corroborates only a lowered limit."""
    sim, r = _misnamed_host_faults(decoy=1.0)
    refused = [n for n in sim.loop.notes() if n.what.startswith("drain") and "needs root-side corroboration" in n.why]
    assert refused  # not vacuous: misnamed contention reached the drain rung with the decoy everywhere
    assert r.healthy_drains == 0 and r.drains == 0


def test_a_power_cap_under_a_lowered_limit_corroborates_and_one_at_the_default_does_not():
    from artemisd.incident import Cause
    from artemisd.policy import _root_agrees

    def gpu(limit, default=700, throttle=("sw_power_cap",)):
        return {"gpus": [{"index": 0, "util_pct": 98, "throttle": list(throttle), "power_limit_w": limit,
                          "default_power_limit_w": default}]}

    assert _root_agrees(Cause.GPU_POWER, gpu(700), 0)[0] is None
    assert "sw_power_cap" in _root_agrees(Cause.GPU_POWER, gpu(450), 0)[0]
    assert "hw_power_brake" in _root_agrees(Cause.GPU_POWER, gpu(700, throttle=("hw_power_brake",)), 0)[0]
    assert "sw_power_cap" in _root_agrees(Cause.GPU_POWER, gpu(700, default=None), 0)[0]  # cannot tell: counts


def test_a_correction_fixes_clocks_and_power_but_not_heat():
    faults = (NodeFaultSpec(1, 600.0, 0, "gpu.clocks", 0.3, 2), NodeFaultSpec(2, 600.0, 1, "gpu.thermal", 0.2, 5))
    sim = FleetSim(_one_job(faults=faults, false_per_window=0.0), "none")
    sim.run_until(3600.0)
    job = sim.jobs["1000"]
    slowed = job.step_ms
    assert slowed > cl.HEALTHY_STEP_MS
    heat = sim.node_faults[1][0]
    for kind in ("reset_clocks", "restore_power_limit"):
        sim.on_action("correct", "n0001", {"node": "n0001", "kind": kind, "gpu": 5})
    assert heat.active(sim.now) and job.step_ms == slowed
    sim.on_action("correct", "n0000", {"node": "n0000", "kind": "restore_power_limit", "gpu": 2})
    assert sim.node_faults[0][0].active(sim.now)  # the power limit was never the problem
    sim.on_action("correct", "n0000", {"node": "n0000", "kind": "reset_clocks", "gpu": 2})
    assert not sim.node_faults[0][0].active(sim.now) and sim.node_faults[0][0].fixed_by == "correction"
    assert cl.HEALTHY_STEP_MS < job.step_ms < slowed  # the hot GPU still sets the pace


def test_in_the_loop_a_correction_ends_a_clock_fault_and_heat_is_drained():
    faults = (NodeFaultSpec(1, 3600.0, 0, "gpu.clocks", 0.3, 2), NodeFaultSpec(2, 7200.0, 1, "gpu.thermal", 0.3, 5))
    sim = FleetSim(_one_job(faults=faults, false_per_window=0.0), "artemis-auto")
    r = sim.run()
    clocks, heat = (next(e.fault for e in sim.encounters if e.fault is not None and e.fault.cause == c)
                    for c in ("gpu.clocks", "gpu.thermal"))
    assert clocks.fixed_by == "correction"
    assert heat.fixed_by == "repair"  # drained, the job requeued away, a person repaired it
    assert r.corrections == 1 and r.drains == 1 and r.requeues == 1 and r.healthy_drains == 0


def test_a_requeued_job_resumes_on_other_nodes_and_loses_its_work_since_the_last_checkpoint():
    heat = NodeFaultSpec(1, 2 * 3600.0 + 1000.0, 0, "gpu.thermal", 0.3, 3)
    sim = FleetSim(_one_job(faults=(heat,), false_per_window=0.0), "artemis-auto")
    r = sim.run()
    job = sim.jobs["1000"]
    assert len(job.runs) == 2 and r.requeues == 1
    first, second = job.runs
    assert 0 in first.nodes and 0 not in second.nodes and "n0000" in sim.slurm.job("1000").excluded_nodes
    when, done, lost = job.requeue_losses[0]
    # Checkpoints every 1800 s of work: the work since the last one is thrown away, and only that.
    assert 0 <= lost < 1800.0 and lost == pytest.approx(done % 1800.0)
    assert (done - lost) % 1800.0 == pytest.approx(0.0, abs=1e-6)
    gpus = job.spec.nodes * 8
    assert r.requeue_gpu_hours == pytest.approx(gpus * (lost + job.spec.restart_s) / 3600.0)
    # The next run trains again after its restart time, and the job still does all of its work.
    assert second.windows_from == second.start + job.spec.restart_s
    assert job.state == "done" and job.progress >= job.spec.work_s


def test_the_price_keeps_a_job_near_its_end_where_it_is():
    """Heat on a big job that is nearly done: the drain keeps the next jobs off the node, no requeue."""
    p = replace(FleetParams(), nodes=40, days=1.0, tail_days=1.0, false_per_window=0.0)
    job = JobSpec("1000", 32, 3600.0 * 2.2, 3600.0 * 2.5, checkpoint_s=3600.0, restart_s=600.0, submit=0.0,
                  opt_in=False)
    heat = NodeFaultSpec(1, 3600.0 * 2.0, 0, "gpu.thermal", 0.1, 1)
    sim = FleetSim(Scenario(p, (job,), (heat,)), "artemis-auto")
    r = sim.run()
    assert r.drains == 1 and r.requeues == 0 and sum(r.waits.values()) == 1
    assert "waiting is cheaper" in r.wait_examples[0]


def test_the_fleet_cli_prints_every_mode(capsys):
    from artemisd.cli import main

    assert main(["sim", "--fleet", "--nodes", "16", "--days", "0.2", "--seed", "2"]) == 0
    out = capsys.readouterr().out
    for mode in cl.MODES:
        assert f"\n{mode} " in out
    assert main(["sim"]) == 2  # without --fleet a trace is still needed


def test_the_queue_is_first_come_first_served_with_backfill():
    """A big job waiting at the head is not starved by small ones arriving after it."""
    p = replace(FleetParams(), nodes=8, days=1.0, tail_days=2.0, false_per_window=0.0)
    running = JobSpec("1000", 6, 3600.0 * 4, 3600.0 * 5, 1800.0, 300.0, 0.0, False)
    big = JobSpec("1001", 8, 3600.0, 3600.0 * 2, 1800.0, 300.0, 60.0, False)
    small_short = JobSpec("1002", 2, 1800.0, 3600.0, 1800.0, 300.0, 120.0, False)  # ends before the big can start
    small_long = JobSpec("1003", 2, 3600.0 * 10, 3600.0 * 11, 1800.0, 300.0, 180.0, False)
    sim = FleetSim(Scenario(p, (running, big, small_short, small_long), ()), "none")
    sim.run()
    start = {j: sim.jobs[j].runs[0].start for j in ("1000", "1001", "1002", "1003")}
    assert start["1002"] < start["1001"]  # backfilled: it does not delay the big job
    assert start["1003"] >= start["1001"]  # would have delayed it: waits
    assert isinstance(sim.queue, deque) and not sim.queue
