"""What a user's reports can make artemisd ask Slurm: only job ids in Slurm's syntax, passed as
``--opt=value``; a bounded number per request and per user; in a pool of their own; killed when
nobody waits; and a bounded cache of the jobs Slurm did not know (issue 27, items 1 and 2).

Slurm here is a stand-in on PATH: ``squeue`` and ``sacct`` scripts that log their argv and parse
``--jobs`` as getopt does for an option with an *optional* argument (22.05.8): a separate
"--iterate=1" is an option, and the real squeue then loops until it is killed.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import sys
import textwrap
import time
from pathlib import Path

import pytest

from artemisd import jobs as jobs_module
from artemisd.auth import Principal
from artemisd.config import parse_config_text
from artemisd.jobs import JobCache, SlurmReads
from artemisd.service import Daemon
from artemisd.slurm.api import SlurmError, job_id_problem
from artemisd.slurm.scope import CURRENT_SCOPE, CancelScope
from artemisd.slurm.cli import CliSlurm
from tests.unit.windows import lockstep

USER = Principal(uid=4242, gid=4242, root_side=False, admin=False)
OTHER = Principal(uid=4343, gid=4343, root_side=False, admin=False)

FAKE = textwrap.dedent('''\
    #!{python}
    import json, os, sys, time
    log = os.environ["FAKE_SLURM_LOG"]
    with open(log, "a") as f:
        f.write(json.dumps([os.path.basename(sys.argv[0])] + sys.argv[1:]) + "\\n")
    args = sys.argv[1:]
    jobs = None
    for i, a in enumerate(args):
        if a.startswith("--jobs="):
            jobs = a.split("=", 1)[1]
        elif a == "--jobs":
            # getopt, optional argument: only "--jobs=X" carries a value; a next word is argv of its own
            jobs = ""
        elif a.startswith("--iterate"):
            time.sleep(float(os.environ.get("FAKE_SLURM_LOOP_S", "20")))  # squeue --iterate: until killed
    delay = float(os.environ.get("FAKE_SLURM_DELAY_S", "0"))
    if delay:
        time.sleep(delay)
    known = {{j: int(u) for j, u in (p.split(":") for p in os.environ.get("FAKE_SLURM_JOBS", "").split(",") if p)}}
    if os.path.basename(sys.argv[0]) == "squeue":
        out = [{{"job_id": int(jobs), "user_id": known[jobs], "job_state": "RUNNING", "partition": "gpu",
                "nodes": "n[0-3]", "tasks": 8, "cpus": 8}}] if jobs in known else []
        print(json.dumps({{"jobs": out}}))
    else:
        print("")  # sacct: nothing for a job it does not know
''')


@pytest.fixture
def fake_slurm(tmp_path: Path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("squeue", "sacct"):
        path = bin_dir / name
        path.write_text(FAKE.format(python=sys.executable))
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "slurm.log"
    log.touch()
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_SLURM_LOG": str(log), "SLURM_CONF": "/nonexistent",
           "FAKE_SLURM_JOBS": "100:4242,200:4343"}

    def calls() -> list[list[str]]:
        return [json.loads(line) for line in log.read_text().splitlines()]

    return env, calls


def make_daemon(tmp_path: Path, env: dict[str, str], timeout: float = 30.0) -> Daemon:
    config = parse_config_text(f"StateDir={tmp_path / 'state'}\nAuthType=none\n")
    return Daemon(config, CliSlurm(timeout=timeout, env=env))


def records(job: str, seq: int = 0):
    return list(enumerate(lockstep(seq, [50.0] * 2, job=job, nodes=["n0", "n1"])))


@pytest.mark.parametrize("good", ["1", "4242", "4242_0", "4242_17", "4242+1", "4294967295"])
def test_a_slurm_job_id_is_accepted(good):
    assert job_id_problem(good) is None


@pytest.mark.parametrize("bad", ["--iterate=1", "-i1", "", "0", "0042", "4242 ", " 4242", "4242\n", "42,43",
                                 "4242_[1-3]", "4294967296", "4242_", "4242+", "4242_1+1", "n1", "４２",
                                 "4242;reboot"])
def test_anything_else_is_not_a_job_id(bad):
    assert job_id_problem(bad) is not None


def test_an_option_shaped_job_id_never_reaches_squeue(tmp_path, fake_slurm):
    env, calls = fake_slurm
    slurm = CliSlurm(timeout=30, env=env)
    started = time.monotonic()
    with pytest.raises(SlurmError) as err:
        slurm.job("--iterate=1")
    assert not err.value.transient and "not a Slurm job id" in str(err.value)
    assert calls() == [] and time.monotonic() - started < 1
    assert slurm.job("100").user_id == 4242
    assert calls() == [["squeue", "--json", "--jobs=100"]]


@pytest.mark.parametrize("node", ["n1 n2", "n[1-4]", "n1,n2", "-n1", "n1\nn2", ""])
def test_a_node_name_is_one_node_or_no_command_runs(tmp_path, fake_slurm, node):
    env, calls = fake_slurm
    slurm = CliSlurm(timeout=30, env=env)
    for act in (lambda: slurm.drain(node, "artemis: x"), lambda: slurm.resume(node), lambda: slurm.node(node),
                lambda: slurm.set_excluded_nodes("100", (node,))):
        with pytest.raises(SlurmError, match="not one Slurm node name"):
            act()
    with pytest.raises(SlurmError, match="not a Slurm constraint"):
        slurm.set_features("100", "gpu Partition=debug")
    assert calls() == []


def test_a_users_report_with_an_option_for_a_job_is_refused_by_name_and_slurm_is_not_asked(tmp_path, fake_slurm):
    env, calls = fake_slurm

    async def go():
        daemon = make_daemon(tmp_path, env)
        jobs = await daemon.check_jobs(USER, records("--iterate=1"))
        result = daemon.accept(records("--iterate=1"), USER, jobs)
        return result

    started = time.monotonic()
    result = asyncio.run(go())
    assert result.accepted == 0 and len(result.rejected) == 2
    assert all(r["error"].startswith("job: '--iterate=1' is not a Slurm job id") for r in result.rejected)
    assert calls() == [] and time.monotonic() - started < 5


def test_one_request_naming_many_unknown_jobs_asks_slurm_about_a_few(tmp_path, fake_slurm):
    env, calls = fake_slurm
    named = [str(1000 + n) for n in range(60)]
    recs = [(n, rec) for n, rec in enumerate(r for job in named for _, r in records(job))]

    async def go():
        daemon = make_daemon(tmp_path, env)
        jobs = await daemon.check_jobs(USER, recs)
        return daemon.accept(recs, USER, jobs), daemon

    result, daemon = asyncio.run(go())
    asked = {a.split("=", 1)[1] for c in calls() for a in c if a.startswith("--jobs=")}
    assert len(asked) == jobs_module.NEW_JOBS_PER_REQUEST  # squeue and sacct for each of those, no more
    assert len(calls()) == 2 * jobs_module.NEW_JOBS_PER_REQUEST
    errors = [r["error"] for r in result.rejected]
    assert len(errors) == 120 and result.accepted == 0
    assert sum("is not known to Slurm" in e for e in errors) == 2 * jobs_module.NEW_JOBS_PER_REQUEST
    assert sum(e.startswith("job: not looked up: one request may name at most") for e in errors) == \
        120 - 2 * jobs_module.NEW_JOBS_PER_REQUEST


def test_a_user_who_names_many_unknown_jobs_is_stopped_and_others_are_not(tmp_path, fake_slurm):
    env, calls = fake_slurm
    limit = jobs_module.UNKNOWN_PER_USER

    async def go():
        daemon = make_daemon(tmp_path, env)
        for n in range(limit):
            await daemon.check_jobs(USER, records(str(5000 + n)))
        before = len(calls())
        refused = await daemon.check_jobs(USER, records("6000"))
        after = len(calls())
        theirs = await daemon.check_jobs(OTHER, records("200"))
        mine = await daemon.check_jobs(USER, records("100"))  # a job already known to Slurm? not cached: refused
        return refused, before, after, theirs, mine

    refused, before, after, theirs, mine = asyncio.run(go())
    assert before == 2 * limit and after == before  # the next unknown job was not looked up
    assert "named 32 jobs Slurm does not know" in refused["6000"].reason
    assert theirs["200"].user_id == 4343  # another user is unaffected
    assert "not looked up" in mine["100"].reason  # until the window passes, no new lookups for this uid


def test_slurm_reads_run_in_their_own_pool_and_a_request_that_goes_away_kills_its_command(tmp_path, fake_slurm):
    env, calls = fake_slurm
    env = dict(env, FAKE_SLURM_DELAY_S="20")
    slurm = CliSlurm(timeout=30, env=env)

    async def go():
        reads = SlurmReads(workers=1)
        try:
            asking = [asyncio.create_task(reads.read("100", slurm.job)) for _ in range(3)]  # one read, shared
            await asyncio.sleep(0.5)
            assert reads.in_flight() == 1
            for task in asking:
                task.cancel()
            started = time.monotonic()
            # the one worker is free again at once: the next read is not behind a 20 s command
            fast = CliSlurm(timeout=30, env=dict(env, FAKE_SLURM_DELAY_S="0"))
            info = await asyncio.wait_for(reads.read("200", fast.job), 5)
            return info, time.monotonic() - started, reads.cancelled
        finally:
            reads.close()

    info, took, cancelled = asyncio.run(go())
    assert info.user_id == 4343 and took < 5 and cancelled == 1
    assert [c[0] for c in calls()].count("squeue") == 2  # the three waiters shared one command


def test_a_cancelled_scope_kills_the_command_it_runs(tmp_path, fake_slurm):
    env, _ = fake_slurm
    slurm = CliSlurm(timeout=30, env=dict(env, FAKE_SLURM_DELAY_S="20"))
    scope = CancelScope()

    async def go():
        def in_scope():
            token = CURRENT_SCOPE.set(scope)
            try:
                return slurm.job("100")
            finally:
                CURRENT_SCOPE.reset(token)

        task = asyncio.ensure_future(asyncio.to_thread(in_scope))
        await asyncio.sleep(0.5)
        started = time.monotonic()
        scope.cancel()
        with pytest.raises(SlurmError, match="cancelled"):
            await asyncio.wait_for(task, 5)
        return time.monotonic() - started

    assert asyncio.run(go()) < 3


def test_the_cache_of_unknown_jobs_is_bounded_and_expires_and_never_pushes_known_jobs_out():
    cache = JobCache(known_max=100, unknown_max=1000)
    known = object()
    for n in range(50):
        cache.put(f"k{n}", 0.0, known)  # type: ignore[arg-type]
    for n in range(50_000):
        cache.put(str(100_000 + n), float(n) / 1000, None)
    assert len(cache.unknown) == 1000 and len(cache.known) == 50
    assert cache.get("k0") == (0.0, known)
    cache.expire(now=78.9, ttl=30.0)  # the 1000 kept were read at 49.000-49.999 s
    assert len(cache.unknown) == 1000
    cache.expire(now=79.5, ttl=30.0)
    assert 490 < len(cache.unknown) < 510
    cache.expire(now=100.0, ttl=30.0)
    assert len(cache.unknown) == 0 and len(cache.known) == 50
