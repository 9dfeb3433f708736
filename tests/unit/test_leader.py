"""Leadership: one artemisd decides and acts, a standby takes over when it dies (issue 12).

The lease itself (artemisd/lease.py) is pure and tested first; then two real
daemons on one real PostgreSQL database (tests/unit/pg.py starts the server),
one emulated Slurm between them: the leader confirms a fault and proposes a
drain, a person approves it through the standby, the leader dies with the
drain queued, the standby takes over and drains once, and the old leader
wakes up to find itself deposed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import pytest

from artemisd.auth import TRUSTED_LOCAL
from artemisd.lease import Lease, next_lease, released
from artemisd.wire import ProbeResult
from tests.unit.test_server import (HEALTHY, HOT, NODES, SLOW_BUSY, Clock, Harness, body, cluster,
                                    hot_gpu_confirmed, run)
from tests.unit.test_store_contract import pg_server  # noqa: F401 - the fixture
from tests.unit.pg import PASSWORD
from tests.unit.windows import lockstep


def password_file(tmp_path):
    """StatePasswordFile as an admin writes it: the server's password, mode 600."""
    secret = tmp_path / "pw"
    secret.write_text(PASSWORD + "\n")
    secret.chmod(0o600)
    return secret


def test_the_first_asker_takes_the_lease_and_renews_it():
    first = next_lease(None, "leader", "a", 15, now=100)
    assert first == Lease("leader", "a", 1, 100, 100, 115)
    assert next_lease(first, "leader", "a", 15, now=110) == Lease("leader", "a", 1, 100, 110, 125)


def test_another_holder_waits_until_expiry_then_gets_the_next_token():
    held = Lease("leader", "a", 4, 100, 110, 125)
    assert next_lease(held, "leader", "b", 15, now=124.9) is held
    assert next_lease(held, "leader", "b", 15, now=125) == Lease("leader", "b", 5, 125, 125, 140)


def test_a_holder_back_after_its_own_expiry_gets_a_new_token():
    # Another instance may have led in between; what it wrote with token 4 must stay refused.
    held = Lease("leader", "a", 4, 100, 110, 125)
    assert next_lease(held, "leader", "a", 15, now=200).token == 5


def test_only_the_holder_releases_and_only_while_it_holds():
    held = Lease("leader", "a", 4, 100, 110, 125)
    assert released(held, "b", now=111) is held
    assert released(held, "a", now=111).expires == 111
    assert released(held, "a", now=130) is held  # expired already: nothing to give up
    assert released(None, "a", now=1) is None


@contextlib.asynccontextmanager
async def leader_and_standby(pg, tmp_path, database: str, lease_time: int = 2):
    """Two daemons on one fresh database and one emulated Slurm: ``a`` started first and leads."""
    url = pg.create_database(database)
    conf = (f"StateURL={url}\nStatePasswordFile={password_file(tmp_path)}\nLeaseTime={lease_time}\n"
            "PartitionPolicy=gpu Auto=escalate Approve=drain,requeue MaxDrainFraction=0.5\n")
    slurm, clock = cluster(), Clock()
    try:
        async with Harness(tmp_path / "a", conf + "Listen=127.0.0.1:7601\n", slurm, clock) as a, \
                Harness(tmp_path / "b", conf + "Listen=127.0.0.1:7602\n", slurm, clock) as b:
            yield a, b, slurm
    finally:
        pg.drop_database(database)


async def takes_over(standby: Harness, limit_s: float = 10.0) -> float:
    """The standby's turns until it leads (the leader takes no more turns): seconds it took."""
    died = time.monotonic()
    while standby.daemon.role != "leader":
        assert time.monotonic() - died < limit_s, "the standby never took over"
        await asyncio.sleep(0.2)
        await standby.daemon.run_once()
    return time.monotonic() - died


def test_a_standby_takes_over_a_dead_leader_and_drains_once(pg_server, tmp_path):  # noqa: F811
    async def scenario():
        async with leader_and_standby(pg_server, tmp_path, "failover") as (a, b, slurm):
            assert (a.daemon.role, b.daemon.role) == ("leader", "standby")
            health = await (await b.client.get("/v1/health")).json()
            assert health["role"] == "standby"
            assert (health["leader"]["instance"], health["leader"]["token"]) == (a.daemon.instance, 1)
            status = await (await b.client.get("/v1/status")).json()
            assert (status["role"], status["leader"]) == ("standby", a.daemon.instance)

            await hot_gpu_confirmed(a, range(8, 12))
            [inc] = await a.incidents()
            assert inc["action"]["status"] == "pending_approval"
            await b.daemon.run_once()  # a standby's turn decides and runs nothing
            # A person approves through the standby: any instance takes CLI requests.
            assert (await b.client.post(f"/v1/incidents/{inc['id']}/approve", data=b"")).status == 200

            # a dies here, the drain queued: it takes no more turns and its lease runs out.
            takeover_s = await takes_over(b)
            assert takeover_s <= 2 + 1.0  # LeaseTime, plus the standby's turns
            assert b.daemon.lease.token == 2
            await b.daemon.run_once()
            drains = [c for c in slurm.calls if c[0] == "drain"]
            assert drains and slurm.nodes["n1"].drained and slurm.jobs["100"].excluded_nodes == ("n1",)

            # a wakes up: its renewal finds b's lease, it stands by and runs nothing.
            calls = len(slurm.calls)
            await a.daemon.run_once()
            assert a.daemon.role == "standby"
            assert [c for c in slurm.calls[calls:] if c[0] not in ("node", "job", "partition_nodes")] == []
            await b.daemon.run_once()
            assert [c for c in slurm.calls if c[0] == "drain"] == drains  # drained once
            tokens = {row.id: tok for row in b.daemon.store.actions_of(inc["id"])
                      for (tok,) in b.daemon.store.db.execute(
                          "SELECT token FROM actions WHERE id = %s", (row.id,)).fetchall()}
            assert 2 in tokens.values()  # the drain was claimed under b's token
            whats = [a["what"] for a in b.daemon.store.audit_log()]
            assert whats.count("leader lease taken") == 2
    run(scenario)


def test_a_leader_waiting_on_a_slow_scontrol_keeps_its_lease(pg_server, tmp_path):  # noqa: F811
    """A Slurm call may outlast LeaseTime (SlurmTimeout is 30 s): the lease is renewed while
    the turn waits for it, so the standby does not take over and drain the node a second time."""
    async def scenario():
        # LeaseTime=4: renewed every 1.3 s, so a loop held up by others' load on this machine is not a takeover.
        async with leader_and_standby(pg_server, tmp_path, "slow_slurm", lease_time=4) as (a, b, slurm):
            await hot_gpu_confirmed(a, range(8, 12))
            [inc] = await a.incidents()
            assert (await a.client.post(f"/v1/incidents/{inc['id']}/approve", data=b"")).status == 200
            lease_time = a.daemon.config.daemon.lease_time
            fast_drain = slurm.drain

            def slow_drain(node, reason):
                time.sleep(2.5 * lease_time)  # slurmctld busy: scontrol outlasts the lease
                fast_drain(node, reason)

            slurm.drain = slow_drain
            stop = asyncio.Event()
            keeper = asyncio.create_task(a.daemon.keep_lease(stop))
            turn = asyncio.create_task(a.daemon.run_once())
            while not turn.done():
                await asyncio.sleep(0.2)
                await b.daemon.run_once()
                assert b.daemon.role == "standby", "the standby took over from a leader waiting on Slurm"
            await turn
            stop.set()
            await keeper
            await b.daemon.run_once()
            assert len([c for c in slurm.calls if c[0] == "drain"]) == 1 and slurm.nodes["n1"].drained
            assert (a.daemon.role, a.daemon.lease.token) == ("leader", 1)
    run(scenario)


def test_a_warm_standby_resumes_a_confirmation_where_the_dead_leader_left_it(pg_server, tmp_path):  # noqa: F811
    """The standby follows the leader's records while it stands by: after a takeover the
    next slow windows confirm the same incident, as the leader itself would have, instead
    of starting the job's history and the confirmation over (one slow window confirms,
    where a standby that had not followed would have nothing to compare it with)."""
    async def scenario():
        async with leader_and_standby(pg_server, tmp_path, "warm") as (a, b, _):
            await a.windows(range(0, 8), HEALTHY)
            await a.node_event("n1", gpus=[{"index": 0, "util_pct": 97, "temp_c": 93, "throttle": ["sw_thermal"]}])
            await a.windows(range(8, 9), SLOW_BUSY, gpu=HOT)
            assert await a.incidents() == []  # flagged once: not confirmed yet
            await b.daemon.run_once()  # a standby's turn: it follows what a stored
            assert b.daemon.role == "standby"
            assert b.daemon.analyzer.throughput("100", "0") == a.daemon.analyzer.throughput("100", "0")

            await takes_over(b)  # a dies: no more turns
            await b.windows(range(9, 10), SLOW_BUSY, gpu=HOT)  # the probes fail over to b
            [confirmed] = await b.incidents()
            assert (confirmed["cause"], confirmed["rank"]) == ("gpu.thermal", 2)
            assert confirmed["onset_window"] == 8  # the window a saw, b never received
    run(scenario)


def test_any_instance_takes_reports_and_the_leader_alone_analyses_them(pg_server, tmp_path):  # noqa: F811
    """The probes of one job send to either instance: the standby stores what it is sent and
    answers, the leader analyses those records on its next turn with its own, and the job
    gets one incident (not one per instance), which the standby's analyzer follows."""
    async def scenario():
        async with leader_and_standby(pg_server, tmp_path, "anyone") as (a, b, _):
            for seq in range(0, 8):  # every other healthy window to the standby
                await (a if seq % 2 else b).windows(range(seq, seq + 1), HEALTHY)
            # The leader took no turn: each batch it was sent had the standby's before it analysed first.
            assert [w for w, _ in a.daemon.analyzer.throughput("100", "0")] == list(range(8))
            await b.node_event("n1", gpus=[{"index": 0, "util_pct": 97, "temp_c": 93, "throttle": ["sw_thermal"]}])
            replies = await b.windows(range(8, 12), SLOW_BUSY, gpu=HOT)
            assert [r["accepted"] for r in replies] == [8, 8, 8, 8]
            assert b.daemon.role == "standby" and await b.incidents() == []  # stored, not analysed
            # What admins see of it: reports stored and not analysed yet, on either instance.
            status = await (await b.client.get("/v1/status")).json()
            assert status["not_analysed"] >= 4 * 8 + 1  # the slow windows and the node check, at least
            for _ in range(2):
                await a.daemon.run_once()  # the leader's turn analyses them
                await b.daemon.run_once()  # the standby's follows what it analysed
            assert (await (await b.client.get("/v1/status")).json())["not_analysed"] == 0
            [inc] = await a.incidents()
            assert (inc["cause"], inc["rank"], inc["node"], inc["onset_window"]) == ("gpu.thermal", 2, "n1", 8)
            assert a.daemon.store.node_evidence("n1") is not None  # the node check's event, kept by the standby
            assert set(b.daemon._bound.values()) == {inc["id"]}  # the standby's analysis is bound to it
            assert b.daemon.analyzer.throughput("100", "0") == a.daemon.analyzer.throughput("100", "0")
            assert len(a.daemon.analyzer.throughput("100", "0")) == 12
            assert b.daemon.store.record_count() == 12 * 8 + 1
    run(scenario)


def test_a_standby_answers_with_the_steps_directives_and_counts_the_probe_results_it_stores(pg_server, tmp_path):  # noqa: F811
    """A standby takes a window's reports as one batch row, not report by report: its reply still
    carries the job step's live directives, and a matched probe's results sent to it are counted
    against the probe, as the leader counts them."""
    async def scenario():
        async with leader_and_standby(pg_server, tmp_path, "standby_replies") as (a, b, _):
            now = a.clock.now
            probe = {"type": "probe", "id": "PRB-40", "job": "100", "step": "0"}
            a.daemon.intake.add_directive("PRB-40", "probe", "100", "0", None, probe, now, now + 600)
            await asyncio.sleep(1.1)  # past DIRECTIVES_FRESH_S: the standby may have read the step before
            [reply] = await b.windows(range(0, 1), HEALTHY)
            assert reply["accepted"] == len(HEALTHY) and reply["directives"] == [probe]
            result = ProbeResult(id="PRB-40", gemm_ms=2.0, cost_ms=3.0)
            answered = [r.model_copy(update={"probe": result}) for r in lockstep(1, HEALTHY, nodes=NODES)]
            reply = await b.post(answered)
            assert reply["accepted"] == len(HEALTHY) and reply["directives"] == [probe]
            [cost] = a.daemon.store.probe_costs()
            assert (cost["id"], cost["ranks_reported"], cost["cost_ms"]) == ("PRB-40", len(HEALTHY), 3.0 * len(HEALTHY))
            assert b.daemon.role == "standby" and b.daemon.store.record_count() == 2 * len(HEALTHY)
    run(scenario)


def test_what_a_standby_stored_before_the_leader_died_is_analysed_by_the_next_leader(pg_server, tmp_path):  # noqa: F811
    """The leader dies before its turn reads what the standby stored: the standby never
    analysed those records (the leader had not), so taking over it analyses them and
    publishes what they show, instead of taking them as already decided."""
    async def scenario():
        async with leader_and_standby(pg_server, tmp_path, "orphans") as (a, b, _):
            await a.windows(range(0, 8), HEALTHY)
            await a.node_event("n1", gpus=[{"index": 0, "util_pct": 97, "temp_c": 93, "throttle": ["sw_thermal"]}])
            await a.daemon.run_once()
            await b.windows(range(8, 12), SLOW_BUSY, gpu=HOT)  # a is dead: no more turns
            assert await b.incidents() == []
            await takes_over(b)
            [inc] = await b.incidents()
            assert (inc["cause"], inc["rank"], inc["onset_window"]) == ("gpu.thermal", 2, 8)
            assert inc["state"] != "suspect"
    run(scenario)


def test_a_store_reconnects_after_the_server_restarts(pg_server):  # noqa: F811
    import psycopg

    from artemisd.store.postgres import PostgresStore

    url = pg_server.create_database("restarted")
    store = PostgresStore(url, password=PASSWORD)
    try:
        assert store.next_id("incident", "INC-") == "INC-1"
        pg_server.restart()
        with pytest.raises(psycopg.OperationalError) as lost:
            store.next_id("incident", "INC-")  # met the cut connection: fails, is not replayed
        assert store.is_unavailable(lost.value)
        assert store.next_id("incident", "INC-") == "INC-2"  # connected again; the failed call never ran
    finally:
        store.close()
        pg_server.drop_database("restarted")


def test_reports_meeting_a_restarted_database_are_refused_for_a_retry_and_lost_by_none(pg_server, tmp_path):  # noqa: F811
    async def scenario():
        url = pg_server.create_database("ingest_restart")
        secret = password_file(tmp_path)
        conf = f"StateURL={url}\nStatePasswordFile={secret}\n"
        try:
            async with Harness(tmp_path / "a", conf, cluster(), Clock()) as h:
                await h.windows(range(0, 3), HEALTHY)
                stored = h.daemon.store.record_count()
                pg_server.restart()
                batch = body(lockstep(3, HEALTHY, nodes=NODES))
                refused = await h.client.post("/v1/reports", data=batch)
                assert refused.status == 503 and refused.headers["Retry-After"] == "5"
                assert "state database unavailable" in (await refused.json())["error"]
                again = await h.client.post("/v1/reports", data=batch)  # the probe's retry
                assert again.status == 200 and (await again.json())["accepted"] == len(HEALTHY)
                assert h.daemon.store.record_count() == stored + len(HEALTHY)  # each record once
                await h.daemon.run_once()
                assert h.daemon.role == "leader" and h.daemon.lease.token == 1  # renewed, not retaken
        finally:
            pg_server.drop_database("ingest_restart")
    run(scenario)


def test_a_users_reports_meeting_a_database_down_are_deferred_not_refused(pg_server, tmp_path):  # noqa: F811
    """Checking a user's job writes what Slurm said of it (owner, partition) to the database:
    with the database down, the request is answered 503 for a retry, never "job not known to
    Slurm" (a 200 that would lose the reports), and the job is read again once it is back."""
    from artemisd.auth import Principal
    from artemisd.ingest import fast_records
    from artemisd.store import StoreUnavailable

    async def scenario():
        async with leader_and_standby(pg_server, tmp_path, "jobcheck") as (_, b, slurm):
            owner = Principal(uid=1000, gid=1000, root_side=False, admin=False)
            records = fast_records(body(lockstep(0, HEALTHY, nodes=NODES)), 100_000)
            with pg_server.down():
                with pytest.raises(StoreUnavailable):
                    await b.daemon.check_jobs(owner, records)
            for _ in range(20):  # the store tries to connect again a third of LeaseTime after a failure
                try:
                    jobs = await b.daemon.check_jobs(owner, records)
                    break
                except StoreUnavailable:
                    await asyncio.sleep(0.2)
            assert jobs["100"].user_id == 1000 and b.daemon.store.job_partition("100") == slurm.jobs["100"].partition
            assert b.daemon.accept(records, owner, jobs).accepted == len(HEALTHY)
    run(scenario)


def test_requests_stored_together_are_refused_together_while_the_database_is_down(pg_server, tmp_path):  # noqa: F811
    """A group (GroupCommit) meeting the database down: every request in it is refused for a retry
    and nothing of any is stored; sent again once the database is back, all are stored, in the
    general statement's one transaction (two rows)."""
    from artemisd.ingest import Submission, fast_records
    from artemisd.server import GROUPS
    from artemisd.store import StoreUnavailable

    async def scenario():
        async with leader_and_standby(pg_server, tmp_path, "groups") as (_, b, _slurm):
            bodies = [body(lockstep(seq, HEALTHY, nodes=NODES)) for seq in (0, 1)]
            subs = [Submission(fast_records(sent, 100_000), TRUSTED_LOCAL, body=sent) for sent in bodies]
            groups = b.client.app[GROUPS]
            with pg_server.down():
                refused = await asyncio.gather(*(groups.accept(sub) for sub in subs), return_exceptions=True)
            assert all(isinstance(outcome, StoreUnavailable) for outcome in refused), refused
            for _ in range(20):  # the store tries to connect again a third of LeaseTime after a failure
                replies = await asyncio.gather(*(groups.accept(sub) for sub in subs), return_exceptions=True)
                if not any(isinstance(reply, StoreUnavailable) for reply in replies):
                    break
                await asyncio.sleep(0.2)
            assert [reply.accepted for reply in replies] == [len(HEALTHY)] * 2
            assert b.daemon.store.record_count() == 2 * len(HEALTHY)
            assert [json.loads(r.body)[0]["window"]["seq"] for r in b.daemon.store.records()] == [0, 1]
    run(scenario)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _health(port: int) -> dict | None:
    import json
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/health", timeout=2) as reply:
            return json.loads(reply.read())
    except OSError:
        return None


def _wait_health(port: int, role: str, proc, timeout_s: float) -> tuple[dict, float]:
    started = time.monotonic()
    while True:
        health = _health(port)
        if health is not None and health["role"] == role:
            return health, time.monotonic() - started
        assert proc.poll() is None, f"artemisd on {port} exited {proc.returncode}"
        assert time.monotonic() - started < timeout_s, f"artemisd on {port} never became {role}: {health}"
        time.sleep(0.1)


def test_two_artemisd_processes_kill_the_leader_and_the_standby_leads(pg_server, tmp_path):  # noqa: F811
    # Real processes, as systemd runs them; the leader is killed with SIGKILL (no release of its lease).
    import signal
    import subprocess
    import sys

    url = pg_server.create_database("processes")
    secret = password_file(tmp_path)
    procs: dict[str, subprocess.Popen] = {}
    ports = {"a": _free_port(), "b": _free_port()}

    def start(name: str) -> subprocess.Popen:
        conf = tmp_path / f"{name}.conf"
        conf.write_text(f"StateURL={url}\nStatePasswordFile={secret}\nStateDir={tmp_path / name}\nAuthType=none\n"
                        f"Listen=127.0.0.1:{ports[name]}\nLeaseTime=3\n")
        log = open(tmp_path / f"{name}.log", "ab")  # noqa: SIM115 - closed when the test ends
        procs[name] = subprocess.Popen([sys.executable, "-m", "artemisd.server", "-c", str(conf)],
                                       stdout=log, stderr=subprocess.STDOUT)
        return procs[name]

    try:
        _wait_health(ports["a"], "leader", start("a"), 60)
        health, _ = _wait_health(ports["b"], "standby", start("b"), 60)
        assert health["leader"]["instance"].endswith(f"127.0.0.1:{ports['a']}") and health["leader"]["token"] == 1
        procs["a"].send_signal(signal.SIGKILL)
        procs["a"].wait(timeout=10)
        health, takeover_s = _wait_health(ports["b"], "leader", procs["b"], 3 + 10)
        assert health["leader"]["token"] == 2
        # The killed daemon restarted: the lease is b's now, so it stands by.
        health, _ = _wait_health(ports["a"], "standby", start("a"), 60)
        assert health["leader"]["instance"].endswith(f"127.0.0.1:{ports['b']}")
        import json
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{ports['a']}/v1/status", timeout=5) as reply:
            listed = {i["instance"].rsplit(":", 1)[1]: i["role"] for i in json.loads(reply.read())["instances"]}
        assert listed == {str(ports["a"]): "standby", str(ports["b"]): "leader"}
        print(f"takeover after SIGKILL: {takeover_s:.1f} s (LeaseTime=3)")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        pg_server.drop_database("processes")


def test_an_ended_job_leaves_the_memory_of_the_leader_and_of_the_standby(pg_server, tmp_path):  # noqa: F811
    """The leader forgets an ended job (its incidents closed) in the store and in memory; the
    standby, following the leader's records, forgets it in memory when it reads the job's end."""
    async def scenario():
        async with leader_and_standby(pg_server, tmp_path, "forgotten") as (a, b, _):
            await a.windows(range(0, 4), HEALTHY, job="200")
            await a.windows(range(0, 4), HEALTHY, job="300")
            await a.daemon.run_once()
            await b.daemon.run_once()
            assert a.daemon.analyzer.jobs() == b.daemon.analyzer.jobs() == {"200", "300"}
            end = [{"type": "node", "v": 1, "event": "job_end", "job": "200", "node": "n0", "time": 0.0}]
            assert (await (await a.client.post("/v1/reports", data=json.dumps(end))).json())["accepted"] == 1
            await a.daemon.run_once()
            await b.daemon.run_once()
            assert a.daemon.analyzer.jobs() == b.daemon.analyzer.jobs() == {"300"}
    run(scenario)
