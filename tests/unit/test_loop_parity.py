"""One stream, two loops: the daemon (store, HTTP, a Slurm in memory) and the simulated loop of ``artemis
replay --policy`` and the fleet benchmark decide, act and verify alike.

The same window reports and node events go through both: posted to a daemon and run a turn at a time,
and through ``TraceLoop`` (the real analyzer feeding ``sim/loop.py`` over a ``SimSlurm``).  Both run the
one ``control/reconcile.py``; what each incident ends as — its state, its action, every action row in
order with its status, its verdict, and what a person was told — must be the same.  What may differ is
when: the daemon performs a queued action on its next turn and waits for the node check to apply a
correction (done here at once, as the simulation does); the simulated loop does each at once.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from artemisd.config import parse_config_text
from artemisd.sim.policy_replay import TraceLoop
from artemisd.wire import NodeEvent, WindowReport, parse_record
from tests.unit.test_server import HEALTHY, HOT, NODES, SLOW_BUSY, SLOW_CLOCKS, Clock, Harness, cluster, run
from tests.unit.windows import lockstep

Record = WindowReport | NodeEvent
HOT_EVIDENCE = [{"index": 0, "util_pct": 97, "temp_c": 93, "throttle": ["sw_thermal"]}]


def windows(seqs: range, busy: list[float], **kw: Any) -> list[list[Record]]:
    return [list(lockstep(seq, busy, nodes=NODES, **kw)) for seq in seqs]


def node_event(node: str, at: float, **fields: Any) -> list[Record]:
    return [parse_record({"type": "node", "v": 1, "event": "health", "node": node, "time": at, **fields})]


def t1(batch: list[Record]) -> float:
    return max(r.time if isinstance(r, NodeEvent) else r.window.t1 for r in batch)


# --- the two loops ---------------------------------------------------------------------------------------

Approvals = dict[int, bool]  # after batch i: approve (True) or deny the action waiting


def outcome(state: str, action: dict | None, rows: list[tuple[str, str | None, str]], recovered: Any,
            told: list[str]) -> dict[str, Any]:
    return {"state": state, "action": action and {k: action[k] for k in ("kind", "target", "status", "reversible")},
            "rows": rows, "recovered": recovered, "told": told}


def through_daemon(tmp_path, conf: str, batches: list[list[Record]], decisions: Approvals) -> list[dict[str, Any]]:
    async def go() -> list[dict[str, Any]]:
        clock = Clock()
        async with Harness(tmp_path, conf, cluster(), clock) as h:
            for i, batch in enumerate(batches):
                clock.now = max(clock.now, t1(batch))
                payload = [r.model_dump(mode="json", exclude_none=True) for r in batch]
                resp = await h.client.post("/v1/reports", data=json.dumps(payload))
                assert resp.status == 200
                await h.daemon.run_once()
                await apply_corrections(h)
                await h.daemon.run_once()  # what the turn queued (a drain's requeue, an undrain) is done
                if i in decisions:
                    [inc] = await h.incidents()
                    decision = "approve" if decisions[i] else "deny"
                    resp = await h.client.post(f"/v1/incidents/{inc['id']}/{decision}")
                    assert resp.status == 200, await resp.text()
                    await h.daemon.run_once()
            out = []
            for inc in (await (await h.client.get("/v1/incidents?all=1")).json())["incidents"]:
                rows = h.daemon.store.actions_of(inc["id"])
                out.append(outcome(inc["state"], inc.get("action"), [(r.kind, r.target, r.status) for r in rows],
                                   (inc.get("result") or {}).get("recovered"),
                                   [r.params["subject"] for r in rows if r.kind in ("escalate", "notify")]))
            return out
    return run(go)


async def apply_corrections(h: Harness) -> None:
    """The node check applies every queued correction at once (the simulated cluster does too)."""
    for node in {r for r in NODES}:
        queued = (await (await h.client.get(f"/v1/nodes/{node}/corrections")).json())["corrections"]
        for cor in queued:
            resp = await h.client.post(f"/v1/nodes/{node}/corrections/{cor['id']}",
                                       json={"status": "done", "detail": "applied"})
            assert resp.status == 200
            await h.daemon.run_once()


def through_simulation(conf: str, batches: list[list[Record]], decisions: Approvals) -> list[dict[str, Any]]:
    records = [r for batch in batches for r in batch]
    loop = TraceLoop(records, parse_config_text(conf))
    for i, batch in enumerate(batches):
        for rec in batch:
            loop.record(rec)
        if i in decisions:
            [waiting] = [r.incident for r in loop.loop.pending_approvals()]
            if decisions[i]:
                loop.loop.approve(waiting, "uid 0", loop.now)
            else:
                loop.loop.deny(waiting, "uid 0", loop.now)
            loop.loop.tick(loop.now)
    result = loop.finish()
    out = []
    for inc in result.incidents:
        rows = result.loop.actions(inc.id)
        out.append(outcome(inc.state.value, inc.action and inc.action.model_dump(mode="json"),
                           [(r.kind, r.target, r.status) for r in rows],
                           inc.result.recovered if inc.result else None,
                           [r.params["subject"].replace(inc.id, "INC") for r in rows
                            if r.kind in ("escalate", "notify")]))
    return out


def daemon_told(out: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The daemon's incident ids are its own (INC-n); the simulation's the analyzer's: compare the text."""
    import re
    return [{**o, "told": [re.sub(r"INC-\d+", "INC", s) for s in o["told"]]} for o in out]


# --- the streams -------------------------------------------------------------------------------------------

def clocks_corrected() -> list[list[Record]]:
    return windows(range(0, 8), HEALTHY) + windows(range(8, 12), SLOW_BUSY, gpu=SLOW_CLOCKS) \
        + windows(range(12, 18), HEALTHY)


def hot_node() -> list[list[Record]]:
    healthy = windows(range(0, 8), HEALTHY)
    return healthy + [node_event("n1", t1(healthy[-1]) + 0.5, gpus=HOT_EVIDENCE)] \
        + windows(range(8, 16), SLOW_BUSY, gpu=HOT)


def loader_not_helped() -> list[list[Record]]:
    data = [1.0] * len(HEALTHY)
    data[2] = 13.0  # rank 2's input pipeline
    return windows(range(0, 8), HEALTHY, rebalance_opt_in=True) \
        + windows(range(8, 18), SLOW_BUSY, data=data, rebalance_opt_in=True)


SCENARIOS: dict[str, tuple[str, Callable[[], list[list[Record]]], Approvals]] = {
    # Corrected, measured back: resolved, nobody told.
    "clocks corrected": ("PartitionPolicy=DEFAULT Auto=correct,escalate Approve=drain,requeue\n",
                         clocks_corrected, {}),
    # Drained; the requeue needs approval: a person is told the job still runs on the node.
    "hot node drained, restart by a person": (
        "PartitionPolicy=DEFAULT Auto=drain,escalate Approve=requeue MaxDrainFraction=0.5\n", hot_node, {}),
    # The drain waits for a person, who is told; then denied: the next rung, a person again (an update).
    "drain denied": ("PartitionPolicy=DEFAULT Auto=escalate Approve=drain MaxDrainFraction=0.5\n", hot_node,
                     {12: False}),
    # Rebalanced; it does not help: the shares are reset (rolled back) and a person is told.
    "rebalance rolled back": ("PartitionPolicy=DEFAULT Auto=rebalance,escalate\n", loader_not_helped, {}),
    # Approved: drained, and the requeue that is not allowed goes to a person.
    "drain approved": ("PartitionPolicy=DEFAULT Auto=escalate Approve=drain MaxDrainFraction=0.5\n", hot_node,
                       {12: True}),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_the_daemon_and_the_simulated_loop_act_alike(tmp_path, name):
    conf, stream, decisions = SCENARIOS[name]
    batches = stream()
    live = daemon_told(through_daemon(tmp_path, "VerifySeconds=0\n" + conf, batches, decisions))
    simulated = through_simulation("VerifyWindows=2\nVerifySeconds=0\nRetryBackoff=10\n" + conf, batches, decisions)
    assert live and live == simulated
