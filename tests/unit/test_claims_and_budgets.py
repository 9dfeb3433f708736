"""Issue 9, findings 2 and 3, over HTTP with the in-memory Slurm (test_act.MemorySlurm).

Finding 2: a job owner named a node outside their job (n31) and n31's own idle
node check "corroborated" a clock fault: n31 got a correction, then a drain.
Finding 3: with Approve=drain, 10 drains waiting for approval were all
approved and performed, past MaxDrainFraction and MaxDrainsPerHour.
The same flows against the real slurmctld: tests/cluster/test_claims_budgets_slurm.py.
"""

from __future__ import annotations

from dataclasses import replace

from aiohttp.test_utils import TestClient, TestServer

from artemisd import decide, policy, verify
from artemisd.auth import TRUSTED_LOCAL, Credential, Principal
from artemisd.config import parse_config_text
from artemisd.control import reconcile
from artemisd.incident import Incident
from artemisd.server import make_app
from tests.unit.test_act import MemorySlurm
from tests.unit.test_server import Clock, Harness, body, run
from tests.unit.windows import lockstep

USER = Principal(uid=1000, gid=1000, root_side=False, admin=False)
IDLE_GPU = {"index": 0, "util_pct": 0, "sm_clock_mhz": 345, "max_sm_clock_mhz": 1980, "throttle": ["idle"]}
SLOW_CLOCKS = {3: {"sm_clock_mhz": 1300, "throttle": []}}
SLOW = [50.0, 50.0, 50.0, 62.0]
ON_N1_N2 = ["n1", "n1", "n2", "n2"]


class HeaderAuth:
    """``Authorization: user`` is job owner uid 1000; anything else is root-side."""

    async def check(self, header: str | None) -> Credential:
        return Credential(USER if header == "user" else TRUSTED_LOCAL, None)


class UserHarness(Harness):
    async def __aenter__(self) -> UserHarness:
        self.client = TestClient(TestServer(make_app(self.daemon, HeaderAuth())))
        await self.client.start_server()
        return self

    async def as_user(self, records: list) -> dict:
        resp = await self.client.post("/v1/reports", data=body(records), headers={"Authorization": "user"})
        assert resp.status == 200, await resp.text()
        return await resp.json()

    async def accepted(self, seq: int, nodes: list[str]) -> int:
        """One healthy window of job 300 sent by its owner: how many of its reports were kept."""
        return (await self.as_user(lockstep(seq, [50.0] * 4, job="300", nodes=nodes)))["accepted"]

    async def user_windows(self, seqs: range, busy: list[float], nodes: list[str], job: str = "300",
                           **kw) -> list[dict]:
        replies = []
        for seq in seqs:
            self.clock.now += 10
            replies.append(await self.as_user(lockstep(seq, busy, job=job, nodes=nodes, **kw)))
            await self.daemon.run_once()
        return replies


def small_cluster() -> MemorySlurm:
    slurm = MemorySlurm({"n1": "allocated", "n2": "allocated", "n31": "idle"})
    slurm.add_job("300", 1000, ("n1", "n2"), tasks=4, cpus=4)
    return slurm


def slurm_writes(slurm: MemorySlurm) -> list[tuple]:
    return [c for c in slurm.calls if c[0] not in ("node", "job", "partition_nodes")]


CLAIM_CONF = "PartitionPolicy=gpu Auto=correct,drain,requeue,escalate MaxDrainFraction=0.5 Cooldown=0\n"


def test_finding_2_a_rank_claimed_on_a_node_outside_the_job_changes_nothing_there(tmp_path):
    """Job 300 runs on n[1-2]; its owner reports rank 3 on n31, slow, and n31's idle node check agrees."""
    async def scenario():
        slurm = small_cluster()
        async with UserHarness(tmp_path, CLAIM_CONF, slurm, Clock()) as h:
            nodes = ["n1", "n1", "n2", "n31"]
            replies = await h.user_windows(range(0, 8), [50.0] * 4, nodes)
            await h.node_event("n31", gpus=[IDLE_GPU])
            replies += await h.user_windows(range(8, 14), SLOW, nodes, gpu=SLOW_CLOCKS)
            for reply in replies:  # each window: ranks 0-2 kept, rank 3 refused on its own, naming the field
                assert reply["accepted"] == 3
                [refused] = reply["rejected"]
                assert refused["index"] == 3
                assert refused["error"] == "node: n31 is not in job 300's allocation n[1-2]"
            for _ in range(3):
                h.clock.now += 60
                await h.daemon.run_once()
            assert not [i for i in await h.incidents() if i["node"] == "n31"]
            assert (await (await h.client.get("/v1/nodes/n31/corrections")).json())["corrections"] == []
            # Nothing on any node; at most a note on the sender's own job (it did slow down).
            assert [c for c in slurm_writes(slurm) if c[0] != "set_admin_comment" or c[1] != "300"] == []
            assert not slurm.nodes["n31"].drained
            stored = h.daemon.store.db.execute("SELECT COUNT(*) FROM records WHERE node = 'n31' AND root = 0")
            assert stored.fetchone()[0] == 0
    run(scenario)


def test_an_idle_node_check_never_corroborates_a_drain(tmp_path):
    """The slow rank is really on n2, but n2's node check saw an idle GPU: no drain, a person is told why."""
    async def scenario():
        slurm = small_cluster()
        conf = "PartitionPolicy=gpu Auto=drain,requeue,escalate Approve= MaxDrainFraction=0.5 Cooldown=0\n"
        async with UserHarness(tmp_path, conf, slurm, Clock()) as h:
            nodes = ["n1", "n1", "n2", "n2"]
            await h.user_windows(range(0, 8), [50.0] * 4, nodes)
            await h.node_event("n2", gpus=[dict(IDLE_GPU, index=1)])
            await h.user_windows(range(8, 12), SLOW, nodes, gpu=SLOW_CLOCKS)
            [inc] = await h.incidents()
            assert inc["cause"] == "gpu.clocks" and inc["node"] == "n2", inc
            assert inc["state"] == "escalated" and not slurm.nodes["n2"].drained
            why = [a["why"] for a in (await h.show(inc["id"]))["audit"] if a["what"].startswith("drain n2")]
            assert why and "does not show gpu.clocks under load: gpu 1 idle (throttle reason idle)" in why[0]
    run(scenario)


def test_a_node_check_under_load_does_corroborate(tmp_path):
    async def scenario():
        slurm = small_cluster()
        conf = "PartitionPolicy=gpu Auto=drain,requeue,escalate Approve= MaxDrainFraction=0.5 Cooldown=0\n"
        async with UserHarness(tmp_path, conf, slurm, Clock()) as h:
            nodes = ["n1", "n1", "n2", "n2"]
            await h.user_windows(range(0, 8), [50.0] * 4, nodes)
            await h.node_event("n2", gpus=[{"index": 1, "util_pct": 98, "sm_clock_mhz": 1300,
                                            "max_sm_clock_mhz": 1980, "throttle": []}])
            await h.user_windows(range(8, 12), SLOW, nodes, gpu=SLOW_CLOCKS)
            [inc] = await h.incidents()
            assert inc["action"]["kind"] == "drain" and slurm.nodes["n2"].drained, inc
    run(scenario)


def test_world_beyond_the_job_s_size_in_slurm_is_refused(tmp_path):
    async def scenario():
        slurm = small_cluster()
        async with UserHarness(tmp_path, CLAIM_CONF, slurm, Clock()) as h:
            reports = lockstep(0, [50.0] * 4, job="300", nodes=["n1", "n1", "n2", "n2"])
            big = [r.model_copy(update={"world": 1000}) for r in reports[:1]]  # within MaxWorld
            reply = await h.as_user(big + reports[1:])
            assert reply["accepted"] == 3
            [refused] = reply["rejected"]
            assert refused["index"] == 0
            assert refused["error"] == "world: 1000 is more ranks than job 300 can run (4 tasks, 4 CPUs in Slurm)"
    run(scenario)


def test_slurm_unreachable_refuses_unchecked_reports_and_says_so(tmp_path):
    async def scenario():
        slurm = small_cluster()
        async with UserHarness(tmp_path, CLAIM_CONF + "JobCacheSeconds=30\n", slurm, Clock()) as h:
            slurm.down = True
            reply = await h.as_user(lockstep(0, [50.0] * 4, job="300", nodes=ON_N1_N2))
            assert reply["accepted"] == 0 and len(reply["rejected"]) == 4
            assert all("Slurm could not be reached to check job 300" in r["error"] and "send it again" in r["error"]
                       for r in reply["rejected"])
            assert h.daemon.store.db.execute("SELECT COUNT(*) FROM records").fetchone()[0] == 0
            slurm.down = False
            assert await h.accepted(1, ["n1", "n1", "n2", "n2"]) == 4
            # Down again, inside JobCacheSeconds: checked against the allocation read a moment ago.
            slurm.down = True
            h.clock.now += 10
            reply = await h.as_user(lockstep(2, [50.0] * 4, job="300", nodes=["n1", "n1", "n2", "n31"]))
            assert reply["accepted"] == 3 and "not in job 300's allocation" in reply["rejected"][0]["error"]
    run(scenario)


def test_a_requeued_job_s_new_nodes_are_read_again_from_slurm(tmp_path):
    async def scenario():
        slurm = small_cluster()
        slurm.nodes["n4"] = replace(slurm.nodes["n1"], name="n4")
        async with UserHarness(tmp_path, CLAIM_CONF + "JobCacheSeconds=600\n", slurm, Clock()) as h:
            assert await h.accepted(0, ["n1", "n1", "n2", "n2"]) == 4
            slurm.jobs["300"] = replace(slurm.jobs["300"], nodes=("n2", "n4"))  # requeued elsewhere
            h.clock.now += 1  # a wrong claim right after a read does not cost another Slurm call
            calls = len(slurm.calls)
            assert await h.accepted(0, ["n4", "n4", "n2", "n2"]) == 2
            assert len(slurm.calls) == calls
            h.clock.now += 10
            assert await h.accepted(1, ["n4", "n4", "n2", "n2"]) == 4
    run(scenario)


# --- finding 3: budgets ------------------------------------------------------------------------

def big_partition() -> MemorySlurm:
    """40 nodes; ten 2-node jobs on n0..n19, each with a hot GPU on its second node."""
    slurm = MemorySlurm({f"n{i}": "allocated" for i in range(40)})
    for j in range(10):
        slurm.add_job(str(200 + j), 1000, (f"n{2 * j}", f"n{2 * j + 1}"), tasks=4)
    return slurm


async def ten_hot_jobs(h: Harness) -> None:
    hot = {3: {"temp_c": 95, "throttle": ["hw_thermal"]}}
    for j in range(10):
        await h.node_event(f"n{2 * j + 1}", gpus=[{"index": 1, "util_pct": 99, "throttle": ["hw_thermal"]}])
    for seq in range(12):
        h.clock.now += 10
        for j in range(10):
            busy = [50.0, 50.0, 50.0, 64.0] if seq >= 8 else [50.0] * 4
            nodes = [f"n{2 * j}"] * 2 + [f"n{2 * j + 1}"] * 2
            await h.post(lockstep(seq, busy, job=str(200 + j), nodes=nodes, gpu=hot if seq >= 8 else None))
        await h.daemon.run_once()


BUDGET_CONF = ("PartitionPolicy=gpu Auto=escalate Approve=drain,requeue MaxDrainFraction=0.1 "
               "MaxDrainsPerHour=3 Cooldown=0\n")


def drain_budget(h: Harness, pol, nodes) -> tuple[bool, str]:
    """The partition's drain budget as the daemon decides it: Slurm's nodes and the daemon's own drains."""
    drains = tuple(policy.DrainRecord(*row) for row in h.daemon.store.drain_actions())
    return decide.drain_budget(pol, decide.Facts(now=h.clock.now, partition="gpu", nodes=nodes, drains=drains))


def drained(slurm: MemorySlurm) -> list[str]:
    return sorted(n for n, info in slurm.nodes.items() if info.drained_by_artemis)


async def approve_all(h: Harness) -> list[int]:
    statuses = []
    for inc in await h.incidents():
        resp = await h.client.post(f"/v1/incidents/{inc['id']}/approve", data=b"")
        statuses.append(resp.status)
        await h.daemon.run_once()
    for _ in range(3):
        await h.daemon.run_once()
    return statuses


def test_finding_3_approving_every_waiting_drain_stays_within_max_drains_per_hour(tmp_path):
    async def scenario():
        slurm = big_partition()
        async with Harness(tmp_path, BUDGET_CONF, slurm, Clock()) as h:
            await ten_hot_jobs(h)
            incidents = await h.incidents()
            assert len(incidents) == 10
            waiting = [i for i in incidents if i["action"]["status"] == "pending_approval"]
            assert len(waiting) == 3  # waiting drains count: the 4th decision already sees 3
            refused = [a["why"] for i in incidents for a in (await h.show(i["id"]))["audit"]
                       if a["what"].startswith("drain") and "budget" in a["why"]]
            assert len(refused) == 7 and all("MaxDrainsPerHour=3 reached: 3 drains in the last hour" in w
                                             for w in refused)
            statuses = await approve_all(h)
            assert statuses.count(200) == 3 and statuses.count(409) == 7  # 7 had no drain waiting
            assert len(drained(slurm)) == 3
    run(scenario)


def test_approve_re_checks_the_budget_and_names_it(tmp_path):
    """Three drains wait; the site lowers MaxDrainsPerHour to 1 (SIGHUP): the second approval is refused."""
    async def scenario():
        slurm = big_partition()
        async with Harness(tmp_path, BUDGET_CONF, slurm, Clock()) as h:
            await ten_hot_jobs(h)
            waiting = [i["id"] for i in await h.incidents() if i["action"]["status"] == "pending_approval"]
            h.daemon.reload(parse_config_text(h.config_text.replace("MaxDrainsPerHour=3", "MaxDrainsPerHour=1")))
            first = await h.client.post(f"/v1/incidents/{waiting[0]}/approve", data=b"")
            assert first.status == 200
            await h.daemon.run_once()
            second = await h.client.post(f"/v1/incidents/{waiting[1]}/approve", data=b"")
            assert second.status == 409
            error = (await second.json())["error"]
            assert "MaxDrainsPerHour=1 reached: 1 drain in the last hour" in error and "still waits" in error
            assert len(drained(slurm)) == 1
            # Still waiting: a person may approve it once the budget allows.
            [row] = [a for a in (await h.show(waiting[1]))["actions"] if a["kind"] == "drain"]
            assert row["status"] == "pending_approval"
            # An hour later the rate allows it, but MaxDrainFraction=0.02 of 40 nodes (0) does not.
            h.clock.now += 3600
            lowered = h.config_text.replace("MaxDrainFraction=0.1", "MaxDrainFraction=0.02")
            h.daemon.reload(parse_config_text(lowered))
            third = await h.client.post(f"/v1/incidents/{waiting[1]}/approve", data=b"")
            assert third.status == 409
            assert "MaxDrainFraction=0.02 reached: 1 of 40 nodes" in (await third.json())["error"]
            h.daemon.reload(parse_config_text(h.config_text))
            fourth = await h.client.post(f"/v1/incidents/{waiting[1]}/approve", data=b"")
            assert fourth.status == 200
    run(scenario)


def test_rolled_back_drains_keep_counting_for_the_hour(tmp_path):
    """A drain that did not help is undone, but it happened: MaxDrainsPerHour=1 allows no second one."""
    async def scenario():
        slurm = big_partition()
        conf = "PartitionPolicy=gpu Auto=drain,escalate MaxDrainFraction=0.5 MaxDrainsPerHour=1 Cooldown=0\n"
        async with Harness(tmp_path, conf, slurm, Clock()) as h:
            await ten_hot_jobs(h)
            [first] = [i for i in await h.incidents() if i["action"]["kind"] == "drain"]
            [row] = [a for a in (await h.show(first["id"]))["actions"] if a["kind"] == "drain"]
            # The node is healthy again (or the drain would be kept), and verify found no recovery.
            await h.node_event(first["node"], gpus=[{"index": 1, "util_pct": 99, "throttle": []}])
            stored = h.daemon.store.incident(first["id"])
            # What verify does when throughput did not come back and the node no longer shows the fault.
            undo = verify.Undo(row["id"], "drain", first["node"], True, "no recovery")
            rows = h.daemon.store.actions_of(first["id"])
            h.daemon.acting.apply(stored, reconcile.Change(Incident.model_validate(stored.body),
                                                           reconcile.rollbacks([undo], rows), saved=False),
                                  h.clock.now)
            await h.daemon.run_once()  # the undrain
            assert drained(slurm) == []
            ok, why = drain_budget(h, h.daemon.config.policy_for("gpu"), slurm.partition_nodes("gpu"))
            assert not ok and "MaxDrainsPerHour=1 reached: 1 drain in the last hour" in why
            h.clock.now += 3600
            assert drain_budget(h, h.daemon.config.policy_for("gpu"), slurm.partition_nodes("gpu"))[0]
    run(scenario)


def test_a_person_s_resume_frees_the_fraction_at_once(tmp_path):
    async def scenario():
        slurm = big_partition()
        conf = "PartitionPolicy=gpu Auto=drain,escalate MaxDrainFraction=0.05 MaxDrainsPerHour=10 Cooldown=0\n"
        async with Harness(tmp_path, conf, slurm, Clock()) as h:
            await ten_hot_jobs(h)
            assert len(drained(slurm)) == 2  # 0.05 x 40
            pol = h.daemon.config.policy_for("gpu")
            assert not drain_budget(h, pol, slurm.partition_nodes("gpu"))[0]
            slurm.resume(drained(slurm)[0])  # scontrol update State=RESUME, by a person
            assert drain_budget(h, pol, slurm.partition_nodes("gpu"))[0]
            # A node a person drained for their own reasons uses none of Artemis' budget.
            slurm.drain("n39", "PSU swap (ops ticket 88)")
            assert drain_budget(h, pol, slurm.partition_nodes("gpu"))[0]
    run(scenario)
