"""The daemon end to end over HTTP (aiohttp test client), with a real SQLite file
and a real SMTP server (aiosmtpd on 127.0.0.1).  Slurm is the in-memory model
from test_act.py; the same flows run against real Slurm in tests/cluster.

Time is the daemon's injected clock, so verification windows, rate limits and
backoff are driven by the test, never by sleeping.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from aiosmtpd.controller import Controller

from artemisd import decide
from artemisd.auth import NoAuth
from artemisd.config import parse_config_text
from artemisd.server import make_app
from artemisd.service import Daemon
from tests.unit.test_act import MemorySlurm
from tests.unit.windows import lockstep

WORLD = 8
NODES = [f"n{r // 2}" for r in range(WORLD)]  # two ranks per node
HEALTHY = [50.0] * WORLD
SLOW_RANK = 2  # on n1


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class Mailbox:
    def __init__(self) -> None:
        self.messages: list[Any] = []

    async def handle_DATA(self, server, session, envelope):  # noqa: N802 - aiosmtpd's hook name
        self.messages.append(envelope)
        return "250 OK"


@pytest.fixture
def smtp():
    box = Mailbox()
    with socket.socket() as probe:  # aiosmtpd needs a concrete port to check it is up
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    controller = Controller(box, hostname="127.0.0.1", port=port)
    controller.start()
    try:
        yield box, f"127.0.0.1:{port}"
    finally:
        controller.stop()


def mail_text(envelope) -> str:
    """The body as a mail client shows it (long lines arrive quoted-printable)."""
    import email
    from email import policy

    return email.message_from_bytes(envelope.content, policy=policy.default).get_content()


def body(window: list) -> bytes:
    return json.dumps([r.model_dump(mode="json", exclude_none=True) for r in window]).encode()


class Harness:
    """One daemon on a state dir, driven through HTTP."""

    def __init__(self, tmp: Path, conf: str, slurm: MemorySlurm, clock: Clock):
        text = f"StateDir={tmp}\nAuthType=none\nVerifyWindows=2\nRetryBackoff=10\n{conf}"
        self.config_text = text
        self.config = parse_config_text(text)
        self.daemon = Daemon(self.config, slurm, clock=clock)
        self.slurm = slurm
        self.clock = clock
        self.client: TestClient | None = None

    async def __aenter__(self) -> Harness:
        self.client = TestClient(TestServer(make_app(self.daemon, NoAuth())))
        await self.client.start_server()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.close()
        self.daemon.store.close()

    async def post(self, window: list) -> dict[str, Any]:
        resp = await self.client.post("/v1/reports", data=body(window))
        assert resp.status == 200, await resp.text()
        return await resp.json()

    async def windows(self, seqs: range, busy: list[float], job: str = "100", **kw) -> list[dict[str, Any]]:
        replies = []
        nodes = kw.pop("nodes", NODES)  # every window's, not only the first's
        for seq in seqs:
            self.clock.now += 10
            replies.append(await self.post(lockstep(seq, busy, job=job, nodes=nodes, **kw)))
            await self.daemon.run_once()
        return replies

    async def node_event(self, node: str, **fields) -> None:
        event = {"type": "node", "v": 1, "event": "health", "node": node, "time": self.clock.now, **fields}
        resp = await self.client.post("/v1/reports", data=json.dumps([event]))
        assert (await resp.json())["accepted"] == 1

    async def answer_probe(self, seq: int, probe_id: str, cost_ms: float = 30.0) -> None:
        """Window ``seq`` of the slowed job, each rank's report carrying its matched GEMM's result:
        the slow rank's twice its peers'."""
        payload = []
        for r in lockstep(seq, SLOW_BUSY, nodes=NODES, gpu=SLOW_CLOCKS):
            item = r.model_dump(mode="json", exclude_none=True)
            item["probe"] = {"id": probe_id, "gemm_ms": 20.0 if r.rank == SLOW_RANK else 10.0, "cost_ms": cost_ms}
            payload.append(item)
        resp = await self.client.post("/v1/reports", data=json.dumps(payload))
        assert (await resp.json())["accepted"] == WORLD

    async def incidents(self) -> list[dict[str, Any]]:
        return (await (await self.client.get("/v1/incidents")).json())["incidents"]

    async def show(self, inc: str) -> dict[str, Any]:
        return await (await self.client.get(f"/v1/incidents/{inc}")).json()


async def hot_gpu_confirmed(h: Harness, slow_windows: range = range(8, 12), evidence: bool = True) -> None:
    """Eight healthy windows, a root-side node check seeing the hot GPU on n1, then rank 2 slows down."""
    await h.windows(range(0, 8), HEALTHY)
    if evidence:
        await h.node_event("n1", gpus=[{"index": 0, "util_pct": 97, "temp_c": 93, "throttle": ["sw_thermal"]}])
    await h.windows(slow_windows, SLOW_BUSY, gpu=HOT)


def cluster() -> MemorySlurm:
    slurm = MemorySlurm({f"n{i}": "allocated" for i in range(4)} | {f"spare{i}": "idle" for i in range(12)})
    slurm.add_job("100", 1000, tuple(f"n{i}" for i in range(4)))
    return slurm


def run(coro_fn: Callable[[], Any]) -> Any:
    return asyncio.run(coro_fn())


SLOW_CLOCKS = {SLOW_RANK: {"sm_clock_mhz": 1300, "throttle": ["applications_clocks"]}}
HOT = {SLOW_RANK: {"temp_c": 92, "throttle": ["sw_thermal"]}}
SLOW_BUSY = [62.0 if r == SLOW_RANK else 50.0 for r in range(WORLD)]


def test_correction_round_trip_resolves_with_measured_result(tmp_path):
    async def scenario():
        conf = "PartitionPolicy=gpu Auto=correct,escalate Approve=drain,requeue\n"
        async with Harness(tmp_path, conf, cluster(), Clock()) as h:
            await h.windows(range(0, 8), HEALTHY)
            await h.windows(range(8, 12), SLOW_BUSY, gpu=SLOW_CLOCKS)
            [inc] = await h.incidents()
            assert inc["cause"] == "gpu.clocks" and inc["state"] == "acting"
            assert inc["action"] == {"kind": "correct", "target": "n1", "status": "running", "reversible": False}
            queued = await (await h.client.get("/v1/nodes/n1/corrections")).json()
            [cor] = queued["corrections"]
            assert cor == {"id": "COR-1", "incident": inc["id"], "kind": "reset_clocks", "gpu": 0}
            resp = await h.client.post(f"/v1/nodes/n1/corrections/{cor['id']}",
                                       json={"status": "done", "detail": "nvidia-smi -rac"})
            assert resp.status == 200
            assert (await (await h.client.get("/v1/nodes/n1/corrections")).json())["corrections"] == []
            await h.windows(range(12, 16), HEALTHY)
            [inc] = await h.incidents()
            assert inc["state"] == "resolved"
            assert inc["result"]["recovered"] is True
            assert inc["result"]["throughput_after"] >= 0.95 * inc["result"]["throughput_before"]
            shown = await h.show(inc["id"])
            whats = [a["what"] for a in shown["audit"]]
            assert "confirmed" in whats and "resolved" in whats
            assert h.slurm.calls == [] or all(c[0] in ("job", "partition_nodes") for c in h.slurm.calls)
    run(scenario)


def test_drain_without_root_evidence_is_escalated_not_done(tmp_path, smtp):
    box, relay = smtp

    async def scenario():
        conf = (f"MailRelay={relay}\nMailTo=hpc-admins@example.org\n"
                "PartitionPolicy=gpu Auto=drain,requeue,escalate\n")
        async with Harness(tmp_path, conf, cluster(), Clock()) as h:
            await hot_gpu_confirmed(h, evidence=False)
            # The node check has not looked since the incident opened: the drain waits for it first.
            [inc] = await h.incidents()
            assert inc["state"] == "confirmed" and box.messages == []
            h.clock.now += decide.CORROBORATION_WAIT_S
            await h.daemon.run_once()
            [inc] = await h.incidents()
            assert inc["cause"] == "gpu.thermal"
            assert inc["state"] == "escalated" and inc["action"]["kind"] == "escalate"
            assert inc["action"]["status"] == "done"
            assert not h.slurm.nodes["n1"].drained
            assert inc["id"] in h.slurm.jobs["100"].admin_comment
            assert len(box.messages) == 1
            text = mail_text(box.messages[0])
            assert "root-side corroboration" in text and inc["id"] in text
    run(scenario)


def test_drain_with_root_evidence_requeues_excluding_the_node(tmp_path):
    async def scenario():
        conf = "PartitionPolicy=gpu Auto=drain,requeue,escalate MaxDrainFraction=0.5\n"
        async with Harness(tmp_path, conf, cluster(), Clock()) as h:
            # Confirmed after window 9; drained then, requeued at the next turn: the job leaves.
            await hot_gpu_confirmed(h, range(8, 11))
            [inc] = await h.incidents()
            assert inc["action"]["kind"] == "drain" and inc["state"] == "verifying", inc
            assert h.slurm.nodes["n1"].reason == f"artemis: {inc['id']} gpu.thermal rank 2 {inc['ratio']:.2f}x"
            job = h.slurm.jobs["100"]
            assert job.excluded_nodes == ("n1",) and job.pending and not job.held
            # The requeued job starts again (windows from 0) elsewhere, at full speed; it is
            # judged after its VerifyWarmupWindows (3) warm-up windows, on VerifyWindows (2).
            await h.windows(range(0, 5), HEALTHY, nodes=["n0", "n0", "n4", "n4", "n2", "n2", "n3", "n3"])
            [inc] = await h.incidents()
            assert inc["state"] == "resolved" and inc["result"]["recovered"] is True
            assert h.slurm.nodes["n1"].drained  # a fix that worked is kept
            # The plot's rows name the daemon's own run of each window (additive ``run``, ``world``).
            rows = (await (await h.client.get(f"/v1/incidents/{inc['id']}/windows")).json())["windows"]
            runs = {(w["run"], w["seq"]) for w in rows}
            assert {(0, s) for s in range(11)} | {(1, s) for s in range(5)} == runs
            assert {w["world"] for w in rows} == {8}
            assert {w["node"] for w in rows if w["run"] == 1} == {"n0", "n2", "n3", "n4"}
    run(scenario)


def test_the_windows_a_plot_reads_are_the_newest_paged_and_bounded(tmp_path):
    """A job of 100k ranks keeps millions of reports, so a page holds the newest ``limit`` (whole
    windows), ``left_out`` counts the older ones and ``before`` is where the next older page starts;
    a limit out of range is refused by name."""

    async def scenario():
        async with Harness(tmp_path, "", cluster(), Clock()) as h:
            await hot_gpu_confirmed(h, range(8, 11))
            [inc] = await h.incidents()
            url = f"/v1/incidents/{inc['id']}/windows"
            got = await (await h.client.get(url, params={"limit": 20})).json()  # two and a half windows
            assert sorted({w["seq"] for w in got["windows"]}) == [9, 10] and len(got["windows"]) == 16
            assert got["left_out"] == 9 * 8  # windows 0-8 (the node check's event is not a window report)
            seqs, pages = [w["seq"] for w in got["windows"]], 1
            while "before" in got and pages < 20:
                got = await (await h.client.get(url, params={"limit": 20, "before": got["before"]})).json()
                seqs[:0] = [w["seq"] for w in got["windows"]]
                pages += 1
            assert sorted(set(seqs)) == list(range(11)) and len(seqs) == 11 * 8 and pages == 6
            for bad in ({"limit": 0}, {"limit": 10**9}, {"limit": "x"}, {"before": "-1"}):
                resp = await h.client.get(url, params=bad)
                assert resp.status == 400 and next(iter(bad)) in (await resp.json())["error"]
            resp = await h.client.get("/v1/incidents/INC-999/windows")
            assert resp.status == 404
    run(scenario)


def test_person_drained_node_is_left_alone(tmp_path):
    async def scenario():
        slurm = cluster()
        slurm.drain("n1", "fan replaced, burn-in (jdoe)")
        slurm.calls.clear()
        conf = "PartitionPolicy=gpu Auto=drain,requeue,escalate MaxDrainFraction=0.5\n"
        async with Harness(tmp_path, conf, slurm, Clock()) as h:
            await hot_gpu_confirmed(h, range(8, 13))
            [inc] = await h.incidents()
            assert slurm.nodes["n1"].reason == "fan replaced, burn-in (jdoe)"
            assert inc["state"] == "escalated"
            assert not [c for c in slurm.calls if c[0] in ("drain", "resume", "requeue_hold")]
    run(scenario)


def test_storm_never_drains_more_than_the_budget(tmp_path):
    """Half of 16 nodes report a hot GPU at once; MaxDrainFraction=0.25 allows 4."""
    async def scenario():
        slurm = MemorySlurm({f"n{i}": "allocated" for i in range(16)})
        conf = ("PartitionPolicy=gpu Auto=drain,escalate MaxDrainFraction=0.25 MaxDrainsPerHour=100 "
                "Cooldown=0\n")
        async with Harness(tmp_path, conf, slurm, Clock()) as h:
            for j in range(8):
                slurm.add_job(str(200 + j), 1000, (f"n{2 * j}", f"n{2 * j + 1}"))
            nodes = {j: [f"n{2 * j}"] * 2 + [f"n{2 * j + 1}"] * 2 for j in range(8)}
            hot = {3: {"temp_c": 95, "throttle": ["hw_thermal"]}}
            for j in range(8):
                await h.node_event(f"n{2 * j + 1}", gpus=[{"index": 1, "util_pct": 97, "throttle": ["hw_thermal"]}])
            for seq in range(12):
                h.clock.now += 10
                for j in range(8):
                    busy = [50.0, 50.0, 50.0, 64.0] if seq >= 8 else [50.0] * 4
                    await h.post(lockstep(seq, busy, job=str(200 + j), nodes=nodes[j], gpu=hot if seq >= 8 else None))
                await h.daemon.run_once()
            drained = [n for n, info in slurm.nodes.items() if info.drained]
            assert len(drained) == 4
            incidents = await h.incidents()
            assert len(incidents) == 8
            # Drained ones wait for a person too (no requeue allowed): the job must restart.
            assert sorted(i["action"]["kind"] for i in incidents) == ["drain"] * 4 + ["escalate"] * 4
            budget_notes = [a for i in incidents for a in (await h.show(i["id"]))["audit"] if "budget" in a["why"]]
            assert len(budget_notes) == 4
    run(scenario)


def test_approval_gate(tmp_path):
    async def scenario():
        conf = "PartitionPolicy=gpu Auto=escalate Approve=drain,requeue MaxDrainFraction=0.5\n"
        async with Harness(tmp_path, conf, cluster(), Clock()) as h:
            await hot_gpu_confirmed(h, range(8, 12))
            [inc] = await h.incidents()
            assert inc["state"] == "escalated" and inc["action"]["status"] == "pending_approval"
            assert not h.slurm.nodes["n1"].drained
            resp = await h.client.post(f"/v1/incidents/{inc['id']}/approve", data=b"")
            assert resp.status == 200
            await h.daemon.run_once()
            await h.daemon.run_once()
            assert h.slurm.nodes["n1"].drained
            assert h.slurm.jobs["100"].excluded_nodes == ("n1",)
            again = await h.client.post(f"/v1/incidents/{inc['id']}/deny", data=b"")
            assert again.status == 409
    run(scenario)


@pytest.mark.parametrize("switch", ["DryRun=yes", "Enabled=no"])
def test_dry_run_and_kill_switch_change_nothing_in_slurm(tmp_path, switch):
    async def scenario():
        conf = f"{switch}\nPartitionPolicy=gpu Auto=drain,requeue,escalate,rebalance MaxDrainFraction=0.5\n"
        async with Harness(tmp_path, conf, cluster(), Clock()) as h:
            await h.windows(range(0, 8), HEALTHY)
            await h.node_event("n1", gpus=[{"index": 0, "util_pct": 97, "throttle": ["sw_thermal"]}])
            replies = await h.windows(range(8, 14), SLOW_BUSY, gpu=HOT)
            writes = [c for c in h.slurm.calls if c[0] not in ("job", "node", "partition_nodes")]
            assert writes == []
            assert all(r["directives"] == [] for r in replies)
            [inc] = await h.incidents()
            if switch == "DryRun=yes":
                assert inc["action"] == {"kind": "drain", "target": "n1", "status": "proposed", "reversible": True}
            else:
                assert inc["state"] == "escalated"
    run(scenario)


def test_slurm_unreachable_actions_are_retried_with_backoff_never_lost(tmp_path):
    async def scenario():
        slurm = cluster()
        conf = "PartitionPolicy=gpu Auto=drain,requeue,escalate MaxDrainFraction=0.5\n"
        async with Harness(tmp_path, conf, slurm, Clock()) as h:
            await hot_gpu_confirmed(h, range(8, 9))
            slurm.down = True
            await h.windows(range(9, 12), SLOW_BUSY, gpu=HOT)  # ingest keeps working
            [inc] = await h.incidents()
            assert inc["state"] == "confirmed"  # the decision waits for Slurm, it is not skipped
            slurm.down = False
            slurm.fail_writes = True
            await h.windows(range(12, 14), SLOW_BUSY, gpu=HOT)
            shown = await h.show(inc["id"])
            [drain] = [a for a in shown["actions"] if a["kind"] == "drain"]
            assert drain["status"] == "running" and drain["attempts"] >= 1
            assert "timed out" in drain["detail"]
            assert any("retried" in a["what"] for a in shown["audit"])
            slurm.fail_writes = False
            h.clock.now += 3600
            await h.daemon.run_once()
            await h.daemon.run_once()
            assert slurm.nodes["n1"].drained
            assert slurm.jobs["100"].excluded_nodes == ("n1",)
            metrics = await (await h.client.get("/metrics")).text()
            assert 'artemis_backend_errors_total{backend="slurm"}' in metrics
    run(scenario)


def test_rebalance_directive_and_rollback_when_it_does_not_help(tmp_path):
    async def scenario():
        conf = "PartitionPolicy=gpu Auto=rebalance,escalate\n"
        async with Harness(tmp_path, conf, cluster(), Clock()) as h:
            data = [1.0] * WORLD
            data[SLOW_RANK] = 13.0
            await h.windows(range(0, 8), HEALTHY, rebalance_opt_in=True)  # the job uses the weighted sampler
            replies = await h.windows(range(8, 12), SLOW_BUSY, data=data)
            [inc] = await h.incidents()
            assert inc["cause"] == "input.loader" and inc["action"]["kind"] == "rebalance"
            rebalances = [d for d in replies[-1]["directives"] if d["type"] == "rebalance"]
            assert rebalances and rebalances[-1]["shares"] == {str(SLOW_RANK): round(50.0 / 62.0, 3)}
            # It does not help: the job stays slow; the shares are reset and a person is told.
            replies = await h.windows(range(12, 18), SLOW_BUSY, data=data)
            [inc] = await h.incidents()
            assert inc["state"] == "escalated", inc
            assert inc["result"]["recovered"] is False
            last = [d for d in replies[-1]["directives"] if d["type"] == "rebalance"][-1]
            assert last["shares"] == {}
    run(scenario)


def test_a_job_steps_directives_are_read_once_a_second_and_this_instances_own_at_once(tmp_path):
    """Each reply carries its step's directives; the store is read for them at most once per
    DIRECTIVES_FRESH_S per step (a node's ranks post within moments), except that a directive this
    instance writes is in its very next reply.  One another instance wrote arrives once that second
    has passed."""
    from artemisd.intake import DIRECTIVES_FRESH_S

    async def scenario():
        async with Harness(tmp_path, "PartitionPolicy=gpu Auto=escalate\n", cluster(), Clock()) as h:
            reads = []
            read = h.daemon.store.directives_for
            h.daemon.store.directives_for = lambda *a: reads.append(a) or read(*a)
            window = lockstep(0, HEALTHY, nodes=NODES)
            replies = [await h.post(window[rank:rank + 1]) for rank in range(WORLD)]
            assert len(reads) == 1 and all(r["directives"] == [] for r in replies)

            body = {"type": "probe", "id": "PRB-x", "job": "100", "step": "0"}
            h.daemon.store.add_directive("PRB-x", "probe", "100", "0", None, body, h.clock.now, h.clock.now + 120)
            assert (await h.post(window[:1]))["directives"] == []  # another instance's, within the second
            h.clock.now += DIRECTIVES_FRESH_S
            assert (await h.post(window[:1]))["directives"] == [body]

            mine = {"type": "probe", "id": "PRB-y", "job": "100", "step": "0"}
            h.daemon.intake.add_directive("PRB-y", "probe", "100", "0", None, mine, h.clock.now, h.clock.now + 120)
            assert (await h.post(window[:1]))["directives"] == [body, mine]
            assert len(reads) == 3
            h.clock.now += 121  # both expired: a clock past the read's second reads again
            assert (await h.post(window[:1]))["directives"] == []
    run(scenario)


def test_probe_directive_rate_limited_and_cost_recorded(tmp_path):
    async def scenario():
        conf = "ProbeMinInterval=1h\nPartitionPolicy=gpu Auto=escalate\n"
        async with Harness(tmp_path, conf, cluster(), Clock()) as h:
            await h.windows(range(0, 8), HEALTHY)
            # Asked for at the suspect's second flagged window (pipeline.PROBE_AFTER_FLAGS).
            replies = await h.windows(range(8, 10), SLOW_BUSY, gpu=SLOW_CLOCKS)
            [probe] = [d for r in replies for d in r["directives"] if d["type"] == "probe"]
            assert probe == {"type": "probe", "id": probe["id"], "job": "100", "step": "0"}
            await h.answer_probe(10, probe["id"])
            costs = h.daemon.store.probe_costs()
            assert costs[0]["ranks_reported"] == WORLD and costs[0]["cost_ms"] == 30.0 * WORLD
            # A second rank flagged within the hour: no second probe.
            busy = list(SLOW_BUSY)
            busy[6] = 63.0
            later = await h.windows(range(11, 14), busy, gpu=SLOW_CLOCKS)
            assert not [d for r in later for d in r["directives"] if d["type"] == "probe" and d["id"] != probe["id"]]
            assert any("rate limit" in a["why"] for a in h.daemon.store.audit_log())
            metrics = await (await h.client.get("/metrics")).text()
            assert "artemis_probe_cost_ms_total 240.0" in metrics
    run(scenario)


def test_restart_resumes_incidents_without_duplicates_or_repeats(tmp_path):
    async def scenario():
        slurm = cluster()
        clock = Clock()
        conf = "PartitionPolicy=gpu Auto=drain,requeue,escalate MaxDrainFraction=0.5\n"
        async with Harness(tmp_path, conf, slurm, clock) as h:
            await hot_gpu_confirmed(h, range(8, 11))
            [before] = await h.incidents()
            assert before["state"] == "verifying"
        writes_before = [c for c in slurm.calls if c[0] in ("drain", "requeue_hold", "release")]
        async with Harness(tmp_path, conf, slurm, clock) as h2:
            [after] = await h2.incidents()
            assert after == before
            # The slow windows continue (the job could not move): no second incident, no repeat.
            await h2.windows(range(11, 18), SLOW_BUSY, gpu=HOT)
            incidents = await h2.incidents()
            assert [i["id"] for i in incidents] == [before["id"]]
            assert incidents[0]["state"] in ("unresolved", "escalated", "acting")
        writes_after = [c for c in slurm.calls if c[0] in ("drain", "requeue_hold", "release")]
        assert writes_after[:len(writes_before)] == writes_before
        assert [c for c in writes_after if c[0] == "drain"] == [c for c in writes_before if c[0] == "drain"]
    run(scenario)


def test_rejects_per_item_and_keeps_the_valid_ones(tmp_path):
    async def scenario():
        async with Harness(tmp_path, "", cluster(), Clock()) as h:
            good = [r.model_dump(mode="json", exclude_none=True) for r in lockstep(0, HEALTHY, nodes=NODES)]
            bad = dict(good[0], rank=99)
            payload = "\n".join([json.dumps(good[0]), "{not json", json.dumps(bad), json.dumps(good[1])])
            reply = await (await h.client.post("/v1/reports", data=payload)).json()
            assert reply["accepted"] == 2
            assert [r["index"] for r in reply["rejected"]] == [1, 2]
            assert "not JSON" in reply["rejected"][0]["error"]
            assert "rank" in reply["rejected"][1]["error"]
            assert h.daemon.store.record_count() == 2
            resp = await h.client.post("/v1/reports", data=b"[1, 2")
            assert resp.status == 400
            health = await (await h.client.get("/v1/health")).json()
            assert health["ok"] is True
            status = await (await h.client.get("/v1/status")).json()
            assert status["records"] == 2 and status["auth"] == "none"
    run(scenario)


def test_job_end_forgets_history_only_when_its_incidents_are_closed(tmp_path):
    async def scenario():
        async with Harness(tmp_path, "PartitionPolicy=gpu Auto=escalate\n", cluster(), Clock()) as h:
            await h.windows(range(0, 4), HEALTHY, job="200")
            await hot_gpu_confirmed(h, range(8, 11), evidence=False)
            end = [{"type": "node", "v": 1, "event": "job_end", "job": job, "node": "n0", "time": 0.0}
                   for job in ("100", "200")]
            assert (await (await h.client.post("/v1/reports", data=json.dumps(end))).json())["accepted"] == 2
            rows = dict(h.daemon.store.db.execute("SELECT job, COUNT(*) FROM records GROUP BY job").fetchall())
            assert "200" not in rows  # ended, nothing open: forgotten
            assert rows["100"] > 0  # its incident is still open: kept for restart
            # ... and in memory: a daemon that runs for months must not hold every job it has seen
            assert h.daemon.analyzer.jobs() == {"100"}
            assert not [job for job, _ in h.daemon.memory.runs if job == "200"]
    run(scenario)


def test_a_job_whose_end_never_came_is_forgotten_once_slurm_says_it_ended(tmp_path):
    """No epilog installed (or its job_end lost with the node): a quiet job leaves the store and
    memory once Slurm says it ended, and only then; while Slurm cannot be asked, nothing goes."""
    from dataclasses import replace

    from artemisd.job_ends import QUIET_S, QUIET_SWEEP_S

    async def scenario():
        slurm = cluster()
        slurm.add_job("200", 1000, tuple(f"n{i}" for i in range(4)))
        async with Harness(tmp_path, "PartitionPolicy=gpu Auto=escalate\n", slurm, Clock()) as h:
            await h.windows(range(0, 4), HEALTHY, job="200")
            await h.windows(range(0, 4), HEALTHY)
            h.clock.now += QUIET_S + QUIET_SWEEP_S
            await h.daemon.run_once()
            assert h.daemon.analyzer.jobs() == {"100", "200"}  # quiet, but running: kept
            slurm.jobs["200"] = replace(slurm.jobs["200"], state="COMPLETED")
            await h.daemon.run_once()
            assert h.daemon.analyzer.jobs() == {"100", "200"}  # asked again only after QUIET_SWEEP_S
            slurm.down = True
            h.clock.now += QUIET_SWEEP_S
            await h.daemon.run_once()
            assert h.daemon.analyzer.jobs() == {"100", "200"}  # Slurm cannot say: nothing goes
            slurm.down = False
            h.clock.now += QUIET_SWEEP_S
            await h.daemon.run_once()
            assert h.daemon.analyzer.jobs() == {"100"}
            assert h.daemon.store.window_records("200") == [] and h.daemon.store.window_records("100")
    run(scenario)


def test_an_ended_jobs_history_stays_for_the_person_paged_then_goes(tmp_path):
    """Its incident escalated, the job ends: the incident ends with it, and its windows stay for the
    person paged to look at; Slurm is asked about it once, and after EndedJobHistory the windows
    leave the store and memory; the incident stays, with its numbers and evidence."""
    from dataclasses import replace

    from artemisd.cli.admin import ClientError, plot_timeline
    from artemisd.job_ends import QUIET_S, QUIET_SWEEP_S

    async def scenario():
        slurm = cluster()
        async with Harness(tmp_path, "PartitionPolicy=gpu Auto=escalate\nEndedJobHistory=1d\n", slurm,
                           Clock()) as h:
            await hot_gpu_confirmed(h, range(8, 11), evidence=False)
            h.clock.now += decide.CORROBORATION_WAIT_S  # no node check looks: escalated once it waited
            await h.daemon.run_once()
            [before] = await h.incidents()
            assert before["state"] == "escalated"
            slurm.jobs["100"] = replace(slurm.jobs["100"], state="COMPLETED")

            def asked() -> int:
                return sum(1 for c in slurm.calls if c == ("job", "100"))

            h.clock.now += QUIET_S + QUIET_SWEEP_S
            await h.daemon.run_once()
            assert h.daemon.analyzer.jobs() == {"100"} and h.daemon.store.window_records("100")
            asked_once = asked()
            for _ in range(3):
                h.clock.now += QUIET_SWEEP_S
                await h.daemon.run_once()
            assert asked() == asked_once  # it ended: not asked again each sweep
            assert h.daemon.analyzer.jobs() == {"100"}  # ... and its history is kept meanwhile
            h.clock.now += 86_400
            await h.daemon.run_once()
            assert h.daemon.analyzer.jobs() == set() and h.daemon.store.window_records("100") == []
            assert not [job for job, _ in h.daemon.memory.runs if job == "100"]
            [after] = await h.incidents()
            assert after["state"] == "unresolved" and after["ended_with_job"]["state_before"] == before["state"]
            assert {k: v for k, v in after.items() if k not in ("state", "ended_with_job")} == \
                {k: v for k, v in before.items() if k != "state"}
            windows = await (await h.client.get(f"/v1/incidents/{after['id']}/windows")).json()
            assert windows["windows"] == []
            with pytest.raises(ClientError, match="EndedJobHistory"):  # what `artemis show --plot` says
                plot_timeline(windows, str(tmp_path / "plot.png"))
    run(scenario)


def test_the_quiet_jobs_sweep_stops_at_its_time_budget_and_goes_on_in_turn(tmp_path, monkeypatch):
    """A slow slurmctld must not hold the leader's turn: a sweep stops asking once its budget is
    spent (here at once: one job a sweep), and the next goes on from the job after the last asked."""
    from dataclasses import replace

    import artemisd.job_ends as job_ends

    monkeypatch.setattr(job_ends, "QUIET_SWEEP_BUDGET_S", 0.0)

    async def scenario():
        slurm = cluster()
        async with Harness(tmp_path, "PartitionPolicy=gpu Auto=escalate\n", slurm, Clock()) as h:
            for job in ("201", "202", "203"):
                slurm.add_job(job, 1000, tuple(f"n{i}" for i in range(4)))
                await h.windows(range(0, 2), HEALTHY, job=job)
                slurm.jobs[job] = replace(slurm.jobs[job], state="COMPLETED")
            h.clock.now += job_ends.QUIET_S + job_ends.QUIET_SWEEP_S
            await h.daemon.run_once()
            assert h.daemon.analyzer.jobs() == {"202", "203"}
            for left in ({"203"}, set()):
                h.clock.now += job_ends.QUIET_SWEEP_S
                await h.daemon.run_once()
                assert h.daemon.analyzer.jobs() == left
    run(scenario)


def test_reload_updates_policy_and_admins_and_keeps_old_config_on_error(tmp_path):
    from artemisd.config import load_config
    from artemisd.server import make_auth, reload_config

    conf = tmp_path / "artemis.conf"
    conf.write_text(f"StateDir={tmp_path}\nAdminUids=1001\nPartitionPolicy=gpu Auto=escalate\n")
    config = load_config(conf)
    daemon = Daemon(config, cluster())
    auth = make_auth(config)
    try:
        conf.write_text(f"StateDir={tmp_path}\nAdminUids=1002\nPartitionPolicy=gpu Auto=drain,escalate\n")
        assert reload_config(daemon, str(conf), auth)
        assert auth.admin_uids == {1002} and daemon.config.policy_for("gpu").auto == ("drain", "escalate")
        conf.write_text(f"StateDir={tmp_path}\nAdminUids=nobody\n")
        assert not reload_config(daemon, str(conf), auth)
        assert auth.admin_uids == {1002} and daemon.config.policy_for("gpu").auto == ("drain", "escalate")
    finally:
        daemon.store.close()


def test_a_job_that_goes_silent_while_verifying_is_unresolved_and_escalated(tmp_path):
    async def scenario():
        conf = "PartitionPolicy=gpu Auto=drain,requeue,escalate MaxDrainFraction=0.5\n"
        async with Harness(tmp_path, conf, cluster(), Clock()) as h:
            await hot_gpu_confirmed(h, range(8, 11))
            [inc] = await h.incidents()
            assert inc["state"] == "verifying"
            h.clock.now += 3 * 3600  # the requeued job never reports again
            await h.daemon.run_once()
            await h.daemon.run_once()
            [inc] = await h.incidents()
            assert inc["state"] == "escalated" and inc["result"]["recovered"] is None
            assert any("cannot be measured" in a["why"] for a in (await h.show(inc["id"]))["audit"])
            assert h.slurm.nodes["n1"].drained  # not rolled back: nothing shows the drain was wrong
    run(scenario)


def test_deny_moves_to_the_next_rung(tmp_path):
    async def scenario():
        conf = "PartitionPolicy=gpu Auto=escalate Approve=drain,requeue MaxDrainFraction=0.5\n"
        async with Harness(tmp_path, conf, cluster(), Clock()) as h:
            await hot_gpu_confirmed(h)
            [inc] = await h.incidents()
            assert inc["action"]["status"] == "pending_approval"
            assert (await h.client.post(f"/v1/incidents/{inc['id']}/deny", data=b"")).status == 200
            await h.daemon.run_once()
            [inc] = await h.incidents()
            assert inc["state"] == "escalated" and inc["action"]["kind"] == "escalate"
            assert not h.slurm.nodes["n1"].drained
            whats = [a["what"] for a in (await h.show(inc["id"]))["audit"]]
            assert "denied drain n1" in whats
    run(scenario)


def test_failed_correction_falls_back_to_the_next_rung(tmp_path):
    async def scenario():
        conf = "PartitionPolicy=gpu Auto=correct,drain,requeue,escalate MaxDrainFraction=0.5\n"
        async with Harness(tmp_path, conf, cluster(), Clock()) as h:
            await h.windows(range(0, 8), HEALTHY)
            await h.node_event("n1", gpus=[{"index": 0, "util_pct": 97, "sm_clock_mhz": 1300,
                                            "max_sm_clock_mhz": 1980, "throttle": ["applications_clocks"]}])
            await h.windows(range(8, 11), SLOW_BUSY, gpu=SLOW_CLOCKS)
            [cor] = (await (await h.client.get("/v1/nodes/n1/corrections")).json())["corrections"]
            resp = await h.client.post(f"/v1/nodes/n1/corrections/{cor['id']}",
                                       json={"status": "failed", "detail": "clocks locked by firmware"})
            assert resp.status == 200
            await h.daemon.run_once()
            await h.daemon.run_once()
            [inc] = await h.incidents()
            assert inc["action"]["kind"] == "drain" and inc["state"] == "verifying"
            assert h.slurm.nodes["n1"].drained and h.slurm.jobs["100"].excluded_nodes == ("n1",)
    run(scenario)


def test_each_rung_is_tried_once_then_a_person_is_told(tmp_path):
    """correct is not allowed, drain+requeue runs and does not help: rolled back, then escalated."""
    async def scenario():
        conf = "PartitionPolicy=gpu Auto=drain,requeue,escalate Approve= MaxDrainFraction=0.5\n"
        async with Harness(tmp_path, conf, cluster(), Clock()) as h:
            await h.windows(range(0, 8), HEALTHY)
            await h.node_event("n1", gpus=[{"index": 0, "util_pct": 97, "sm_clock_mhz": 1300,
                                            "max_sm_clock_mhz": 1980}])
            await h.windows(range(8, 11), SLOW_BUSY, gpu=SLOW_CLOCKS)
            [inc] = await h.incidents()
            assert inc["action"]["kind"] == "drain" and inc["state"] == "verifying"
            # The job restarts elsewhere and is still slow: the node was not the cause (and
            # its node check no longer shows slow clocks, so its drain may be undone).
            await h.node_event("n1", gpus=[{"index": 0, "sm_clock_mhz": 1980, "max_sm_clock_mhz": 1980}])
            await h.windows(range(0, 6), SLOW_BUSY, nodes=["n0", "n0", "n4", "n4", "n2", "n2", "n3", "n3"])
            inc, *later = await h.incidents()  # the new run's straggler on n4 is an incident of its own
            assert all(i["node"] != "n1" for i in later)
            assert inc["state"] == "escalated" and inc["action"]["kind"] == "escalate", inc
            assert inc["result"]["recovered"] is False
            assert not h.slurm.nodes["n1"].drained  # our drain, rolled back
            kinds = [a["kind"] for a in (await h.show(inc["id"]))["actions"]]
            assert kinds.count("drain") == 1 and kinds.count("requeue") == 1 and "undrain" in kinds
    run(scenario)


def test_resolved_always_means_recovered(tmp_path):
    """The fix took (the subject is its peers' speed again) but the job's throughput is not back
    (another rank now holds every step back): verification says unresolved, and the subject's
    recovery does not turn that into a resolved incident whose result says not recovered."""
    other_slow = [62.0 if r == 5 else 50.0 for r in range(WORLD)]

    async def scenario():
        conf = "PartitionPolicy=gpu Auto=correct Approve=drain,requeue,escalate\n"
        async with Harness(tmp_path, conf, cluster(), Clock()) as h:
            await h.windows(range(0, 8), HEALTHY)
            await h.windows(range(8, 12), SLOW_BUSY, gpu=SLOW_CLOCKS)
            [cor] = (await (await h.client.get("/v1/nodes/n1/corrections")).json())["corrections"]
            await h.client.post(f"/v1/nodes/n1/corrections/{cor['id']}", json={"status": "done", "detail": "-rac"})
            await h.windows(range(12, 20), other_slow)
            for inc in await h.incidents():
                if inc["state"] == "resolved":
                    assert inc["result"]["recovered"] is True, inc
            first = (await h.incidents())[0]
            assert first["cause"] == "gpu.clocks" and first["state"] != "resolved", first
            assert first["result"]["recovered"] is False
            # The collectives come back: the incident is resolved, on a measured recovery.
            await h.windows(range(20, 26), HEALTHY)
            first = (await h.incidents())[0]
            assert first["state"] == "resolved" and first["result"]["recovered"] is True, first
    run(scenario)


def test_verification_starts_after_the_windows_a_slowed_rank_had_not_reported_yet(tmp_path):
    """A throttled rank's reports arrive windows late: when the correction is done the daemon
    has analysed only up to window 11, while the other ranks have reported 12 and 13, which
    ran under the fault.  Those windows must not judge the correction."""
    async def scenario():
        conf = "PartitionPolicy=gpu Auto=correct,escalate Approve=drain,requeue\n"
        async with Harness(tmp_path, conf, cluster(), Clock()) as h:
            await h.windows(range(0, 8), HEALTHY)
            await h.windows(range(8, 12), SLOW_BUSY, gpu=SLOW_CLOCKS)
            late = {seq: lockstep(seq, SLOW_BUSY, nodes=NODES, gpu=SLOW_CLOCKS) for seq in (12, 13)}
            for seq, window in late.items():  # every rank but the slowed one reports on time
                h.clock.now += 10
                await h.post([r for r in window if r.rank != SLOW_RANK])
                await h.daemon.run_once()
            [cor] = (await (await h.client.get("/v1/nodes/n1/corrections")).json())["corrections"]
            await h.client.post(f"/v1/nodes/n1/corrections/{cor['id']}", json={"status": "done", "detail": "-rac"})
            for window in late.values():  # the slowed rank catches up: slow windows, after the correction
                await h.post([r for r in window if r.rank == SLOW_RANK])
                await h.daemon.run_once()
            # Window 14 straddles the correction; 15 and 16 are the first measured after it.
            await h.windows(range(14, 17), HEALTHY)
            [inc] = [i for i in await h.incidents() if i["cause"] == "gpu.clocks"]
            verdicts = [(a["who"], a["what"], a["why"]) for a in (await h.show(inc["id"]))["audit"]
                        if a["who"] == "verify"]
            assert verdicts[:1] and verdicts[0][1] == "resolved", verdicts
            assert inc["state"] == "resolved" and inc["result"]["recovered"] is True, inc
            healthy_rate = inc["result"]["throughput_healthy"]
            assert inc["result"]["throughput_after"] == pytest.approx(healthy_rate, rel=0.01), inc
    run(scenario)


def test_a_fixed_gpu_on_a_loaded_machine_is_recovered_and_nobody_is_told(tmp_path, smtp):
    """After the correction the subject is its peers' speed again, while the machine got busier:
    every rank's work 10 % slower and the collectives 60 % slower (gloo on a loaded CPU).  A
    healthy job would be as slow; the correction is judged recovered at that pace, and the next
    rung (a drain needing a person) is never reached."""
    loaded = [55.0] * WORLD

    async def scenario():
        conf = (f"PartitionPolicy=gpu Auto=correct,escalate Approve=drain,requeue\n"
                f"MailRelay={smtp[1]}\nMailTo=ops@example.org\n")
        async with Harness(tmp_path, conf, cluster(), Clock()) as h:
            await h.windows(range(0, 8), HEALTHY)
            await h.windows(range(8, 12), SLOW_BUSY, gpu=SLOW_CLOCKS)
            [cor] = (await (await h.client.get("/v1/nodes/n1/corrections")).json())["corrections"]
            await h.client.post(f"/v1/nodes/n1/corrections/{cor['id']}", json={"status": "done", "detail": "-rac"})
            await h.windows(range(12, 18), loaded, comm_ms=32.0)
            [inc] = [i for i in await h.incidents() if i["cause"] == "gpu.clocks"]
            assert inc["state"] == "resolved" and inc["result"]["recovered"] is True, inc
            assert inc["result"]["throughput_after"] < 0.85 * inc["result"]["throughput_healthy"]
            kinds = [a["kind"] for a in (await h.show(inc["id"]))["actions"]]
            assert kinds == ["correct"], kinds
            assert smtp[0].messages == []
    run(scenario)


def test_systemd_is_told_ready_on_its_notify_socket(tmp_path):
    import socket

    from artemisd.server import notify_ready

    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind(str(path))
        listener.settimeout(5)
        assert notify_ready({"NOTIFY_SOCKET": str(path)})
        assert listener.recv(64) == b"READY=1"
    assert not notify_ready({})  # not under systemd: nothing to tell
    assert not notify_ready({"NOTIFY_SOCKET": str(tmp_path / "gone")})  # logged, never fatal


def test_requests_ready_together_are_stored_in_one_statement_and_each_answered_for_its_own_records(tmp_path):
    """GroupCommit: the requests whose records are ready in one turn of the loop go to the store
    together (one ``accept_many``), and each reply counts, refuses and directs its own records only:
    the owner's window, a stranger's copy of it (every item refused as not theirs), and the owner's
    next window with an item validation refused.  A request whose client went away before its group
    ran is neither stored nor answered.  Requests of one job's window are one row in the store."""
    from artemisd.auth import Principal
    from artemisd.ingest import Submission, fast_records
    from artemisd.server import GROUPS

    async def scenario():
        async with Harness(tmp_path, "", cluster(), Clock()) as h:
            owner = Principal(uid=1000, gid=1000, root_side=False, admin=False)
            stranger = Principal(uid=2000, gid=2000, root_side=False, admin=False)
            groups = h.client.app[GROUPS]

            async def submission(principal: Principal, seq: int, refused: list | None = None) -> Submission:
                records = fast_records(body(lockstep(seq, HEALTHY, nodes=NODES)), 100_000)
                return Submission(records, principal, await h.daemon.check_jobs(principal, records), refused or [])

            subs = [await submission(owner, 0), await submission(stranger, 0),
                    await submission(owner, 1, [{"index": 8, "error": "rank: 99 is not below world 8"}])]
            replies = await asyncio.gather(*(groups.accept(sub) for sub in subs))
            assert [reply.accepted for reply in replies] == [WORLD, 0, WORLD]
            assert replies[0].rejected == [] and replies[2].rejected == subs[2].rejected
            assert [r["index"] for r in replies[1].rejected] == list(range(WORLD))
            assert all("not owned by uid 2000" in r["error"] for r in replies[1].rejected)
            assert h.daemon.store.record_count() == 2 * WORLD
            group = h.daemon.metrics.ingest_group
            assert (group._sum.get(), sum(b.get() for b in group._buckets)) == (3, 1)  # one group of three

            # The client of the second request goes away before its group runs.
            tasks = [asyncio.ensure_future(groups.accept(await submission(owner, seq))) for seq in (2, 3, 4)]
            await asyncio.sleep(0)  # each has queued its records; their group runs on the next turn
            tasks[1].cancel()
            done = await asyncio.gather(*tasks, return_exceptions=True)
            assert [getattr(reply, "accepted", reply) for reply in done[::2]] == [WORLD, WORLD]
            assert isinstance(done[1], asyncio.CancelledError)
            stored = h.daemon.store.db.execute('SELECT DISTINCT "window" FROM records').fetchall()
            assert {window for (window,) in stored} == {0, 1, 2, 4}

            # One window's reports in two requests (two nodes' relays): one row, as one body would be.
            window = lockstep(5, HEALTHY, nodes=NODES)
            halves = [body(window[:WORLD // 2]), body(window[WORLD // 2:])]
            subs = []
            for sent in halves:
                records = fast_records(sent, 100_000)
                subs.append(Submission(records, owner, await h.daemon.check_jobs(owner, records), body=sent))
            replies = await asyncio.gather(*(groups.accept(sub) for sub in subs))
            assert [reply.accepted for reply in replies] == [WORLD // 2] * 2
            [(items, text, node)] = h.daemon.store.db.execute(
                'SELECT items, body, node FROM records WHERE "window" = 5').fetchall()
            assert (items, [r["rank"] for r in json.loads(text)], node) == (WORLD, list(range(WORLD)), None)
    run(scenario)


def test_one_requests_unforeseen_failure_refuses_its_own_records_not_its_groups(tmp_path):
    """The last-resort guard per request of a group (a failure injected while one request's rows are
    made): that request's records are refused with the reason, the others of its group are stored
    and answered as if it had not been there."""
    from artemisd.auth import Principal
    from artemisd.ingest import Submission, fast_records
    from artemisd.server import GROUPS

    async def scenario():
        async with Harness(tmp_path, "", cluster(), Clock()) as h:
            root = Principal(uid=0, gid=0, root_side=True, admin=True)
            real = h.daemon.intake._rows

            def failing(kept, *rest):
                if kept and kept[0][1].window.seq == 1:
                    raise KeyError("injected")
                return real(kept, *rest)
            h.daemon.intake._rows = failing
            subs = [Submission(fast_records(body(lockstep(seq, HEALTHY, nodes=NODES)), 100_000), root)
                    for seq in range(3)]
            replies = await asyncio.gather(*(h.client.app[GROUPS].accept(sub) for sub in subs))
            assert [reply.accepted for reply in replies] == [WORLD, 0, WORLD]
            assert [r["index"] for r in replies[1].rejected] == list(range(WORLD))
            assert replies[1].rejected[0]["error"] == "internal error while storing this item (KeyError: 'injected')"
            assert replies[0].rejected == replies[2].rejected == []
            stored = h.daemon.store.db.execute('SELECT DISTINCT "window" FROM records').fetchall()
            assert {window for (window,) in stored} == {0, 2}
    run(scenario)
