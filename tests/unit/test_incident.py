"""The incident life cycle is one explicit state machine; illegal moves raise."""

import pytest

from artemisd.incident import TRANSITIONS, IllegalTransition, Incident, IncidentKind, IncidentState

S = IncidentState


def make() -> Incident:
    return Incident(id="INC-1", job="1", kind=IncidentKind.RANK, rank=2)


def test_happy_path_to_resolved():
    incident = make()
    for state in (S.CONFIRMED, S.ACTING, S.VERIFYING, S.RESOLVED):
        incident.advance(state)
    assert incident.state is S.RESOLVED


@pytest.mark.parametrize("state", list(S))
def test_every_state_has_its_transitions_listed(state):
    assert state in TRANSITIONS


@pytest.mark.parametrize(
    ("path", "illegal"),
    [((), S.ACTING), ((), S.RESOLVED), ((S.DISMISSED,), S.CONFIRMED),
     ((S.CONFIRMED, S.ACTING, S.VERIFYING, S.RESOLVED), S.ACTING), ((S.CONFIRMED,), S.SUSPECT)],
)
def test_illegal_transitions_raise(path, illegal):
    incident = make()
    for state in path:
        incident.advance(state)
    with pytest.raises(IllegalTransition, match=f"INC-1: cannot go from {incident.state.value} to {illegal.value}"):
        incident.advance(illegal)


def test_final_states_are_final():
    assert TRANSITIONS[S.RESOLVED] == frozenset() and TRANSITIONS[S.DISMISSED] == frozenset()


def test_contract_fields_exactly():
    fields = set(make().contract_dict())
    assert fields == {"id", "job", "kind", "state", "rank", "node", "island", "link", "onset_window",
                      "flagged_window", "confirmed_window", "ratio", "excess_ms", "loss_pct", "cause",
                      "confidence", "evidence", "action", "result",
                      "measured_loss_pct",  # additive (design.md allows it): the loss the job's samples/s show
                      "recurrences"}  # additive: each time the same fault came back
