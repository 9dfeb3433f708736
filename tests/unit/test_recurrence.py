"""An intermittent fault on one device is one incident that records each time it came back.

The intermittent faults here are written as a row of steady bursts on one rank
(4 windows on, 3 off): each burst is confirmed and each pause is long enough
(RecoverWindows) for the subject to recover, which is what turned one faulty
GPU into an incident per burst.
"""

from __future__ import annotations

from artemisd.config import AnalysisSettings, Config
from artemisd.incident import Incident, IncidentKind, IncidentState, Recurrence
from artemisd.pipeline import Analyzer
from artemisd.replay import replay_records
from artemisd.sim import NVIDIA_H100, FaultSpec, Fleet, FleetSpec, JobSpec
from artemisd.wire import WindowReport, parse_record

ON, OFF = 4, 3


def bursts(first: int, count: int, rank: int = 5, on: int = ON, off: int = OFF,
           cause: str = "gpu.thermal") -> tuple[FaultSpec, ...]:
    return tuple(FaultSpec(cause=cause, rank=rank, onset=first + k * (on + off), duration=on, magnitude=0.2)
                 for k in range(count))


def records(faults: tuple[FaultSpec, ...], windows: int = 50, seed: int = 0):
    job = JobSpec(job="70", islands=(NVIDIA_H100.model_copy(update={"ranks": 32}),), windows=windows,
                  faults=faults)
    return [parse_record(r) for r in Fleet(FleetSpec(seed=seed, jobs=(job,))).records()]


def replay(faults: tuple[FaultSpec, ...], windows: int = 50, seed: int = 0, **analysis) -> list[Incident]:
    return replay_records(records(faults, windows, seed), Config(analysis=AnalysisSettings(**analysis)))


def listing(incidents: list[Incident]) -> list:
    return [(i.id, i.kind.value, i.rank, i.node, i.cause.value, i.onset_window, i.confirmed_window,
             [(r.onset_window, r.confirmed_window) for r in i.recurrences]) for i in incidents]


def test_an_intermittent_thermal_fault_is_one_incident_with_each_burst_a_recurrence():
    incidents = replay(bursts(10, 4))
    [incident] = incidents
    assert (incident.kind, incident.rank, incident.cause.value) == (IncidentKind.RANK, 5, "gpu.thermal"), \
        listing(incidents)
    # The first burst is the incident's onset; the three after it are recurrences.
    assert incident.onset_window == 10 and incident.confirmed_window == 11
    assert [r.onset_window for r in incident.recurrences] == [17, 24, 31]
    for recurrence, onset in zip(incident.recurrences, (17, 24, 31)):
        assert onset < recurrence.confirmed_window <= onset + 2
        assert recurrence.ratio > 1.1 and recurrence.loss_pct > 0
    assert incident.ratio == incident.recurrences[-1].ratio
    assert incident.loss_pct == incident.recurrences[-1].loss_pct
    assert any(e.signal == "throttle" for e in incident.evidence)


def test_without_a_recurrence_horizon_each_burst_is_its_own_incident():
    incidents = replay(bursts(10, 4), recur_windows=0)
    assert [(i.rank, i.onset_window, i.recurrences) for i in incidents] == \
        [(5, 10, []), (5, 17, []), (5, 24, []), (5, 31, [])], listing(incidents)


def test_a_steady_fault_is_one_incident_with_no_recurrence():
    # (seed 1: with seed 0 a neighbour's noise spike grows it into a node incident, recurrence or not)
    [incident] = replay((FaultSpec(cause="gpu.thermal", rank=5, onset=10, magnitude=0.2),), windows=30, seed=1)
    assert (incident.rank, incident.onset_window, incident.recurrences) == (5, 10, [])


def test_two_ranks_faulted_at_different_times_are_two_incidents():
    incidents = replay(bursts(10, 1, rank=5, on=5) + bursts(22, 1, rank=20, on=5), windows=36)
    assert [(i.rank, i.onset_window, i.recurrences) for i in incidents] == [(5, 10, []), (20, 22, [])], \
        listing(incidents)
    assert incidents[0].id != incidents[1].id


def test_a_fault_back_after_the_horizon_is_a_new_incident():
    faults = bursts(10, 2, on=4, off=36)  # last flagged in window 13, back in window 50
    late = replay(faults, windows=60)
    assert [(i.rank, i.onset_window, i.recurrences) for i in late] == [(5, 10, []), (5, 50, [])], listing(late)
    [within] = replay(faults, windows=60, recur_windows=40)
    assert [r.onset_window for r in within.recurrences] == [50]


def test_a_flag_that_never_confirms_is_no_recurrence():
    # One slow window after the incident ended: flagged, never confirmed.
    incidents = replay(bursts(10, 1) + (FaultSpec(cause="gpu.thermal", rank=5, onset=20, duration=1,
                                                 magnitude=0.2),), windows=30)
    [incident] = incidents
    assert incident.recurrences == [] and incident.state is IncidentState.CONFIRMED, listing(incidents)


def test_the_daemon_is_told_the_incident_recurred_and_its_subject_is_active_again():
    analyzer = Analyzer()
    states: list[tuple[int, str, int]] = []  # (window, state, recurrences) of each update
    active: dict[int, bool] = {}
    incident_id = None
    for record in records(bursts(10, 2), windows=30):
        for update in analyzer.ingest(record):
            incident_id = incident_id or update.id
            assert update.id == incident_id  # one incident, never a second one, not even a suspect
            states.append((record.window.seq, update.state.value, len(update.recurrences)))
        if incident_id is not None and isinstance(record, WindowReport):
            active[record.window.seq] = analyzer.subject_active(incident_id)
    analyzer.flush()
    confirmed = [(state, count) for _, state, count in states if state == "confirmed"]
    assert confirmed == [("confirmed", 0), ("confirmed", 1)], states
    # Ended during the pause (3 healthy windows), active again once the second burst confirmed.
    assert not active[16] and active[19], active
    assert not analyzer.subject_active(incident_id)  # and ended again after it


def test_an_incident_without_recurrences_still_parses_and_the_field_is_additive():
    body = {"id": "INC-3", "job": "1", "kind": "rank", "state": "resolved", "rank": 2}
    incident = Incident.model_validate(body)
    assert incident.recurrences == []
    incident.recurrences.append(Recurrence(onset_window=20, confirmed_window=21, ratio=1.2, loss_pct=9.5))
    out = Incident.model_validate_json(incident.to_json()).contract_dict()
    assert out["recurrences"] == [{"onset_window": 20, "confirmed_window": 21, "ratio": 1.2, "loss_pct": 9.5}]
    assert {k: out[k] for k in body} == body
