"""The action table (artemisd/control/actions.py) is the one place an action kind's nature is written:
everything that reads it agrees with it, and with the incident contract."""

from __future__ import annotations

import typing

import pytest

from artemisd import decide, incident, policy, remedy, verify
from artemisd.config import POLICY_ACTIONS, ConfigError, parse_config_text
from artemisd.control import actions
from artemisd.control.actions import NEXT, TABLE, ActionKind, ActionStatus
from artemisd.incident import Cause, IncidentKind


def test_statuses_are_the_contracts_plus_queued():
    contract = set(typing.get_args(incident.ActionStatus))
    assert {s.value for s in ActionStatus} == contract | {"queued"}
    assert set(NEXT) == set(ActionStatus)


def test_the_rungs_are_contract_kinds_and_the_policy_vocabulary():
    contract = set(typing.get_args(incident.ActionKind))
    assert set(actions.RUNGS) <= contract
    assert POLICY_ACTIONS == actions.RUNGS
    # The daemon's own follow-ups are not rungs a site can name.
    with pytest.raises(ConfigError, match="undrain"):
        parse_config_text("PartitionPolicy=gpu* Auto=undrain\n")


@pytest.mark.parametrize("kind", [k.value for k in ActionKind])
def test_a_kind_is_reversible_in_every_reading_alike(kind):
    """Replay's proposal, the plan's rung and the table say the same (a correction was reversible in
    replay and not in replay --policy)."""
    step = decide.Step(kind=kind, target="n2", mode="auto", why="")
    assert step.reversible is actions.reversible(kind) is TABLE[ActionKind(kind)].reversible


@pytest.mark.parametrize("cause", list(Cause))
def test_the_remedy_for_a_cause_is_a_kind_that_fixes_it_or_a_person(cause):
    proposed = remedy.propose(IncidentKind.RANK, cause, "n2", "7")
    assert proposed.reversible is actions.reversible(proposed.kind)
    if proposed.kind != "escalate":
        assert cause in actions.rule(proposed.kind).fixes


def test_verification_undoes_exactly_the_reversible_kinds():
    from tests.unit.test_verify import RULES, _evidence
    done = [(i, k.value, "n2") for i, k in enumerate(ActionKind)]
    v = verify.verdict("node", "gpu.thermal", _evidence([240.0, 241.0, 239.0, 240.0]), RULES, 1000.0, 3600.0,
                       done, {"n2": None})
    assert v.state == "unresolved" and v.verification.recovered is False
    assert [u.kind for u in v.rollbacks] == [k.value for k in ActionKind if TABLE[k].reversible] \
        == ["rebalance", "drain"]
    assert all(u.undo for u in v.rollbacks) and v.rolled_back


def test_hard_actions_need_corroboration():
    assert actions.HARD == {"drain", "requeue"}
    assert policy.actions is actions  # policy reads the table, it keeps no list of its own


def test_every_status_but_the_planned_ones_is_reachable_from_a_new_row():
    reached = {ActionStatus.PENDING_APPROVAL, ActionStatus.QUEUED}
    frontier = list(reached)
    while frontier:
        for nxt in NEXT[frontier.pop()]:
            if nxt not in reached:
                reached.add(nxt)
                frontier.append(nxt)
    assert set(ActionStatus) - reached == {ActionStatus.PROPOSED, ActionStatus.REFUSED}


def test_changing_one_kind_in_the_table_changes_it_everywhere(monkeypatch):
    """A rebalance made irreversible in the table alone: the plan, replay's proposal and the verdict follow."""
    from dataclasses import replace

    from tests.unit.test_verify import RULES, _evidence
    rebalance = TABLE[ActionKind.REBALANCE]
    assert rebalance.reversible
    monkeypatch.setitem(TABLE, ActionKind.REBALANCE, replace(rebalance, reversible=False, undone_by=None))
    assert decide.Step(kind="rebalance", target="7:2", mode="auto", why="").reversible is False
    assert remedy.propose(IncidentKind.RANK, Cause.INPUT_LOADER, "n1", "7").reversible is False
    v = verify.verdict("rank", "input.loader", _evidence([240.0, 241.0, 239.0, 240.0]), RULES, 1000.0, 3600.0,
                       [(1, "rebalance", "7:2")])
    assert v.state == "unresolved" and v.rollbacks == ()  # kept: nothing says how to undo it any more
