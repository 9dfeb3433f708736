"""The daemon's side of an intermittent fault: one incident, reopened at each recurrence, to a person once
the fix does not hold (RecurEscalate)."""

from __future__ import annotations

from tests.unit.test_server import HEALTHY, SLOW_BUSY, SLOW_CLOCKS, Clock, Harness, cluster, run


async def all_incidents(h: Harness) -> list[dict]:
    return (await (await h.client.get("/v1/incidents?all=1")).json())["incidents"]


async def corrected(h: Harness) -> None:
    """The node check applies every queued correction of n1."""
    queued = (await (await h.client.get("/v1/nodes/n1/corrections")).json())["corrections"]
    for cor in queued:
        resp = await h.client.post(f"/v1/nodes/n1/corrections/{cor['id']}",
                                   json={"status": "done", "detail": "nvidia-smi -rac"})
        assert resp.status == 200


def test_a_clock_fault_that_keeps_coming_back_is_one_incident_then_a_person(tmp_path):
    async def scenario():
        conf = "RecurEscalate=2\nPartitionPolicy=gpu Auto=correct,escalate Approve=drain,requeue Cooldown=0\n"
        async with Harness(tmp_path, conf, cluster(), Clock()) as h:
            await h.windows(range(0, 8), HEALTHY)
            seq, states = 8, []
            for _ in range(3):
                await h.windows(range(seq, seq + 4), SLOW_BUSY, gpu=SLOW_CLOCKS)
                await corrected(h)
                await h.windows(range(seq + 4, seq + 10), HEALTHY)
                seq += 10
                [inc] = await all_incidents(h)
                states.append((len(inc["recurrences"]), inc["state"], inc["action"]["kind"]))
            # Corrected and resolved, then reopened and corrected again, then a person: the correction does not hold.
            assert states[0] == (0, "resolved", "correct")
            assert states[1] == (1, "resolved", "correct")
            assert states[2][0] == 2 and states[2][2] == "escalate"
            audit = (await h.show(inc["id"]))["audit"]
            whats = [a["what"] for a in audit]
            assert whats.count("recurred") == 2
            assert "escalated: keeps coming back" in whats
            assert len(h.daemon.store.actions_of(inc["id"])) >= 3  # two corrections, one escalation
    run(scenario)
