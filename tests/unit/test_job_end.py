"""Incidents end with their job: once Slurm says a job ended, none of its incidents stays open.

The epilog's job_end is only a hint (a requeued job sends one too); Slurm is
asked, and while it cannot be asked nothing is closed.  A person paged about
an incident is mailed once that it ended with its job; nobody else is.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from artemisd.decide import JobEnd, after_job_end
from artemisd.incident import EndedWithJob, Incident, IncidentState
from artemisd.job_ends import END_RECHECK_S, QUIET_S, QUIET_SWEEP_S
from artemisd.decide import CORROBORATION_WAIT_S
from tests.unit.test_server import (HEALTHY, NODES, SLOW_BUSY, Clock, Harness, cluster, hot_gpu_confirmed, lockstep,
                                    mail_text, run, smtp)  # noqa: F401 - fixture

S = IncidentState
ESCALATING = "PartitionPolicy=gpu Auto=drain,requeue,escalate\n"


def mailing(relay: str) -> str:
    return f"MailRelay={relay}\nMailTo=hpc-admins@example.org\n{ESCALATING}"


async def job_end(h: Harness, job: str = "100") -> None:
    """Every node's epilog says the job ended; the leader's turn follows."""
    end = [{"type": "node", "v": 1, "event": "job_end", "job": job, "node": f"n{i}", "time": h.clock.now}
           for i in range(4)]
    resp = await h.client.post("/v1/reports", data=json.dumps(end))
    assert (await resp.json())["accepted"] == 4
    await h.daemon.run_once()


def slurm_says(h: Harness, state: str, job: str = "100") -> None:
    h.slurm.jobs[job] = replace(h.slurm.jobs[job], state=state)


async def ends(h: Harness, slurm_state: str) -> list[dict]:
    """Slurm has the job in ``slurm_state`` when its epilog says job_end: its incidents after that turn."""
    slurm_says(h, slurm_state)
    await job_end(h)
    return await h.incidents()


async def escalated(h: Harness, box) -> dict:
    """A hot GPU confirmed without the root-side evidence a drain needs: a person is mailed."""
    await hot_gpu_confirmed(h, evidence=False)
    h.clock.now += CORROBORATION_WAIT_S  # the node check never looks: escalated once the drain waited for it
    await h.daemon.run_once()
    [inc] = await h.incidents()
    assert inc["state"] == "escalated" and len(box.messages) == 1
    return inc


# --- the pure rule ------------------------------------------------------------------------------


@pytest.mark.parametrize("state", [S.CONFIRMED, S.ESCALATED, S.UNRESOLVED, S.ACTING, S.VERIFYING])
def test_a_confirmed_incident_ends_unresolved_never_resolved(state):
    assert after_job_end(state, []) == JobEnd(S.UNRESOLVED, tell=False)


def test_a_suspect_is_dismissed_and_a_closed_incident_stays_as_it_is():
    assert after_job_end(S.SUSPECT, []) == JobEnd(S.DISMISSED, tell=False)
    assert after_job_end(S.RESOLVED, []) is None and after_job_end(S.DISMISSED, []) is None


def test_only_an_escalation_that_reached_someone_is_told_and_what_never_began_is_withdrawn():
    actions = [(1, "escalate", "queued", {"comment_done": False, "mail_done": False}),
               (2, "drain", "pending_approval", {}), (3, "undrain", "queued", {}), (4, "requeue", "running", {})]
    assert after_job_end(S.ESCALATED, actions) == JobEnd(S.UNRESOLVED, tell=False, withdrawn=(1, 2))
    sent = [(1, "escalate", "done", {}), (5, "notify", "queued", {})]
    assert after_job_end(S.ESCALATED, sent) == JobEnd(S.UNRESOLVED, tell=True)
    half_sent = [(1, "escalate", "running", {"comment_done": True, "mail_done": False})]
    assert after_job_end(S.UNRESOLVED, half_sent).tell
    # Waiting for a retry, having told nobody: withdrawn, not sent about a closed incident.
    retrying = [(1, "escalate", "running", {"comment_done": False, "mail_done": False})]
    assert after_job_end(S.ESCALATED, retrying) == JobEnd(S.UNRESOLVED, tell=False, withdrawn=(1,))


def test_the_record_of_the_end_is_additive_absent_until_the_job_ends():
    inc = Incident(id="INC-1", job="100", kind="rank", state=S.CONFIRMED)
    assert "ended_with_job" not in inc.contract_dict()
    inc.advance(S.UNRESOLVED)
    inc.ended_with_job = EndedWithJob(at=5.0, state_before=S.CONFIRMED, job_state="COMPLETED")
    again = Incident.model_validate_json(inc.to_json())
    assert again.contract_dict()["ended_with_job"] == {"at": 5.0, "state_before": "confirmed",
                                                       "job_state": "COMPLETED", "person_told": False}


# --- the daemon ---------------------------------------------------------------------------------


def with_daemon(tmp_path, smtp, scenario) -> None:
    """``scenario(h, box)`` against one daemon that mails its escalations to ``box``."""
    box, relay = smtp

    async def go():
        async with Harness(tmp_path, mailing(relay), cluster(), Clock()) as h:
            await scenario(h, box)
    run(go)


def test_a_held_unknown_ends_with_its_job_unmailed_and_the_job_is_forgotten(tmp_path, smtp):
    async def scenario(h: Harness, box) -> None:
        await h.windows(range(0, 8), HEALTHY)
        await h.windows(range(8, 12), SLOW_BUSY)
        [held] = await h.incidents()
        assert (held["state"], held["cause"]) == ("confirmed", "unknown")
        [ended] = await ends(h, "COMPLETED")
        assert ended["state"] == "unresolved"
        assert ended["ended_with_job"] == {"at": h.clock.now, "state_before": "confirmed",
                                           "job_state": "COMPLETED", "person_told": False}
        assert box.messages == []  # nobody was paged about it
        audit = [a for a in h.daemon.store.audit_log(held["id"]) if a["what"].startswith("ended with its job")]
        assert len(audit) == 1 and "was confirmed" in audit[0]["why"] and "COMPLETED" in audit[0]["why"]
        assert not h.daemon.store.incident(held["id"]).decide
        # Closed: the job's history goes as a closed job's does, from the store and from memory.
        assert h.daemon.analyzer.jobs() == set() and h.daemon.store.window_records("100") == []
        for _ in range(3):
            h.clock.now += QUIET_S
            await h.daemon.run_once()
        assert await h.incidents() == [ended]  # never decided, escalated or acted on again
    with_daemon(tmp_path, smtp, scenario)


def test_an_escalated_incident_ends_with_its_job_and_the_person_paged_is_mailed_once(tmp_path, smtp):
    async def scenario(h: Harness, box) -> None:
        inc = await escalated(h, box)
        [ended] = await ends(h, "TIMEOUT")
        assert ended["state"] == "unresolved"
        assert ended["ended_with_job"]["state_before"] == "escalated"
        assert ended["ended_with_job"]["job_state"] == "TIMEOUT" and ended["ended_with_job"]["person_told"]
        assert len(box.messages) == 2
        text = mail_text(box.messages[1])
        assert f"Job 100 ended (Slurm: TIMEOUT) while incident {inc['id']}" in text
        assert "was escalated" in text and "closed as unresolved" in text
        assert "n1 was not drained and may still be at fault" in text
        assert "scontrol update NodeName=n1 State=DRAIN" in text
        # The person may want its plot: the windows stay EndedJobHistory, then go.
        assert h.daemon.store.window_records("100")
        for _ in range(3):
            h.clock.now += QUIET_S + QUIET_SWEEP_S
            await h.daemon.run_once()
        assert len(box.messages) == 2 and h.daemon.store.window_records("100")
        h.clock.now += h.config.daemon.ended_job_history
        await h.daemon.run_once()
        assert h.daemon.store.window_records("100") == [] and await h.incidents() == [ended]
    with_daemon(tmp_path, smtp, scenario)


def test_a_requeued_job_keeps_its_incidents_though_its_epilog_said_job_end(tmp_path, smtp):
    async def scenario(h: Harness, box) -> None:
        before = await escalated(h, box)
        assert await ends(h, "PENDING") == [before] and len(box.messages) == 1  # no second mail
        assert h.daemon.ends.heard == {}  # Slurm answered: not asked again each turn
        assert h.daemon.store.window_records("100")  # ... and its history stays for its next run
    with_daemon(tmp_path, smtp, scenario)


def test_a_job_still_completing_when_its_epilog_says_job_end_is_asked_again_until_it_ended(tmp_path, smtp):
    """The epilogs run while Slurm has the job COMPLETING: that answer says neither ended nor
    requeued, so Slurm is asked again, and the incident ends once the job has."""
    async def scenario(h: Harness, box) -> None:
        await h.windows(range(0, 8), HEALTHY)
        await h.windows(range(8, 12), SLOW_BUSY)
        [held] = await h.incidents()
        assert await ends(h, "COMPLETING") == [held]
        slurm_says(h, "COMPLETED")
        await h.daemon.run_once()
        assert await h.incidents() == [held]  # not asked again at once ...
        h.clock.now += END_RECHECK_S
        await h.daemon.run_once()  # ... but in END_RECHECK_S, not at the quiet sweep
        [ended] = await h.incidents()
        assert ended["state"] == "unresolved" and ended["ended_with_job"]["job_state"] == "COMPLETED"
        assert h.daemon.analyzer.jobs() == set() and h.daemon.ends.heard == {}
    with_daemon(tmp_path, smtp, scenario)


def test_windows_that_arrive_after_the_job_was_forgotten_end_with_it_again(tmp_path, smtp):
    """A rank's last reports may reach the daemon after its node's epilog said job_end: the job
    is held again, and whatever those windows opened ends with it at the next turn."""
    async def scenario(h: Harness, box) -> None:
        await h.windows(range(0, 8), HEALTHY)
        assert await ends(h, "COMPLETED") == [] and h.daemon.analyzer.jobs() == set()
        for seq in range(8, 16):  # delivered together, before the leader's next turn
            h.clock.now += 1
            await h.post(lockstep(seq, SLOW_BUSY, nodes=NODES))
        [opened] = await h.incidents()
        assert opened.get("ended_with_job") is None
        await h.daemon.run_once()
        [ended] = await h.incidents()
        assert ended["ended_with_job"]["job_state"] == "COMPLETED" and ended["state"] in ("dismissed", "unresolved")
        assert h.daemon.analyzer.jobs() == set() and box.messages == []
    with_daemon(tmp_path, smtp, scenario)


def test_while_slurm_cannot_be_asked_nothing_is_closed_and_it_is_asked_again(tmp_path, smtp):
    async def scenario(h: Harness, box) -> None:
        before = await escalated(h, box)
        # The daemon's cache holds Slurm's older answer (RUNNING): no guess is made from it either.
        slurm_says(h, "COMPLETED")
        h.slurm.down = True
        await job_end(h)
        h.clock.now += 60
        await h.daemon.run_once()
        assert await h.incidents() == [before]
        h.slurm.down = False
        h.clock.now += 60
        await h.daemon.run_once()
        [ended] = await h.incidents()
        assert ended["state"] == "unresolved" and ended["ended_with_job"]["job_state"] == "COMPLETED"
        assert len(box.messages) == 2
    with_daemon(tmp_path, smtp, scenario)


def test_a_job_that_ended_without_an_epilog_closes_its_incidents_at_the_quiet_sweep(tmp_path, smtp):
    async def scenario(h: Harness, box) -> None:
        await h.windows(range(0, 8), HEALTHY)
        await h.windows(range(8, 12), SLOW_BUSY)
        slurm_says(h, "CANCELLED")
        h.clock.now += QUIET_S + QUIET_SWEEP_S
        await h.daemon.run_once()
        [ended] = await h.incidents()
        assert ended["state"] == "unresolved" and ended["ended_with_job"]["job_state"] == "CANCELLED"
        assert h.daemon.analyzer.jobs() == set() and box.messages == []
    with_daemon(tmp_path, smtp, scenario)


class Killed(Exception):
    """The daemon dies here."""


def test_a_restarted_daemon_neither_closes_nor_mails_twice(tmp_path, smtp, monkeypatch):
    """The notice is queued before the incident is saved: a daemon that died in between closes the
    incident again after its restart, and finds the notice already there."""
    box, relay = smtp
    slurm = cluster()
    clock = Clock()

    async def first():
        async with Harness(tmp_path, mailing(relay), slurm, clock) as h:
            await escalated(h, box)
            slurm_says(h, "COMPLETED")
            saved = h.daemon.acting._save

            def dies_closing(stored, inc: Incident, reopening: bool = False):
                if inc.ended_with_job is not None:
                    raise Killed
                saved(stored, inc, reopening)

            monkeypatch.setattr(h.daemon.acting, "_save", dies_closing)
            with pytest.raises(Killed):
                await job_end(h)

    async def restarted():
        async with Harness(tmp_path, mailing(relay), slurm, clock) as h:
            [still] = await h.incidents()
            assert still["state"] == "escalated"  # the closing never reached the store
            for _ in range(3):
                clock.now += QUIET_S + QUIET_SWEEP_S
                await h.daemon.run_once()
            [ended] = await h.incidents()
            assert ended["state"] == "unresolved" and ended["ended_with_job"]["person_told"]
        async with Harness(tmp_path, mailing(relay), slurm, clock) as h:
            for _ in range(3):
                clock.now += QUIET_S + QUIET_SWEEP_S
                await h.daemon.run_once()
            assert await h.incidents() == [ended]

    run(first)
    run(restarted)
    firsts = [mail_text(m).splitlines()[0] for m in box.messages]
    assert len(box.messages) == 2, firsts  # the escalation and one notice that the job ended
