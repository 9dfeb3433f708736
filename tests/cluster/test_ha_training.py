"""A real training job through a PostgreSQL restart and the leader's death (issue 12).

Two artemisd share one real PostgreSQL; the nodes and the job's probes know both
(``Endpoint=a,b``, the SPANK plugin's ``endpoint=a,b``).  A real 2-rank DDP job
under ``sbatch --artemis=on`` trains while

1. PostgreSQL is stopped for several windows: the leader cannot store (the
   reports are answered 503, the probes keep them and retry) and cannot renew
   its lease (it stands down); the job trains on, unblocked;
2. PostgreSQL is back, then the leader is SIGKILLed: the probes pass their
   reports to the other instance, which takes over.

Then every window each rank finished is stored, none twice apart from the one
batch a killed leader may have stored without answering; the probes dropped
nothing; and the healthy job was never acted on, by either leader.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest

from tests.unit.test_store_contract import pg_server  # noqa: F401 - the fixture

from .ha import LEASE_TIME_S, TAKEOVER_BOUND_S, Pair, actions_of, health, kill, wait_role
from .procs import wait_until
from .scenario import DAEMON_CONF, TrainingJob
from .slurm import SlurmCluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

# Longer than LeaseTime: the lease expires while the database is down.
OUTAGE_S = 1.5 * LEASE_TIME_S
# Windows of about a second on this machine (the cluster's 20 steps take a quarter of one
# when it is idle): a probe's queue of 64 windows then holds a minute, more than an outage
# and a takeover.  A real job's windows (50 steps, 100 ms to 1 s each) hold far longer.
WINDOW_STEPS = 80


def window_records(pair: Pair, job: str) -> list[dict]:
    """``job``'s stored window reports; the test's own connection did not live through the restart."""
    import psycopg

    try:
        return pair.db.window_records(job)
    except psycopg.OperationalError:
        return pair.db.window_records(job)  # reconnected


def stored_windows(pair: Pair, job: str) -> Counter[tuple[int, int]]:
    """How many times each (rank, window seq) of ``job`` is stored in the shared database."""
    return Counter((r["rank"], r["window"]["seq"]) for r in window_records(pair, job))


def newest_stored(pair: Pair, job: str) -> list[dict]:
    """Each rank's newest stored window report."""
    newest: dict[int, dict] = {}
    for r in window_records(pair, job):
        if r["rank"] not in newest or r["window"]["seq"] > newest[r["rank"]]["window"]["seq"]:
            newest[r["rank"]] = r
    return [newest[rank] for rank in sorted(newest)]


def contiguous_through(stored: Counter[tuple[int, int]], rank: int) -> int:
    """The newest window ``w`` of ``rank`` such that its windows 0..w are all stored (-1: not window 0)."""
    seq = 0
    while (rank, seq) in stored:
        seq += 1
    return seq - 1


def wait_all_stored(pair: Pair, job: str, beyond: int, after: str, daemon) -> float:
    """Until windows newer than ``beyond`` are stored and every window of both ranks below the newest
    is too (each probe sends its windows in order; the newest may still be on its way).  Seconds waited."""
    since = time.monotonic()

    def caught_up() -> bool:
        stored = stored_windows(pair, job)
        newest = max(seq for _, seq in stored)
        return newest > beyond and min(contiguous_through(stored, rank) for rank in range(2)) >= newest - 1

    try:
        wait_until(caught_up, f"every window of both ranks stored {after}", timeout_s=180, interval_s=0.5,
                   daemon=daemon)
    except Exception:
        stored = stored_windows(pair, job)
        print(f"stored through: {[contiguous_through(stored, rank) for rank in range(2)]}; "
              f"newest: {newest_stored(pair, job)}")
        raise
    return time.monotonic() - since


def test_a_training_job_rides_out_a_database_restart_and_the_leaders_death(
        clean_cluster: SlurmCluster, pg_server, tmp_path):  # noqa: F811
    cluster = clean_cluster
    pair = Pair(cluster, pg_server, tmp_path, "ha_training", policy=DAEMON_CONF)
    with pair.running(), cluster.endpoints([pair.a.url, pair.b.url], window_steps=WINDOW_STEPS):
        job = TrainingJob.submit(cluster, pair.a, nodes=2, seconds=300)
        job.wait_running()
        wait_until(lambda: len({seq for _, seq in stored_windows(pair, job.job_id)}) >= 3,
                   "the job's first windows stored", timeout_s=120, daemon=pair.a.daemon)

        # 1. PostgreSQL stopped under the job's reports, longer than the lease: no instance can lead.
        before = max(seq for _, seq in stored_windows(pair, job.job_id))
        with pg_server.down():
            cut, trained = time.monotonic(), job.steps()
            stood_down_s = wait_role(pair.a, "standby", cut)
            wait_until(lambda: time.monotonic() - cut > OUTAGE_S, "the outage", timeout_s=OUTAGE_S + 5)
            down_s, trained_down = time.monotonic() - cut, job.steps() - trained
            assert (health(pair.b) or {}).get("role") == "standby"
        back = time.monotonic()
        wait_until(lambda: pair.leader() is not None, "an instance to lead again", timeout_s=TAKEOVER_BOUND_S)
        leader = pair.leader()
        assert leader is not None
        led_s = time.monotonic() - back
        stored_s = wait_all_stored(pair, job.job_id, before + 2, "after the outage", leader.daemon)
        print(f"\nPostgreSQL down {down_s:.1f} s: the leader stood down after {stood_down_s:.1f} s, the job "
              f"trained {trained_down} steps meanwhile (its own count); {leader.name} led {led_s:.1f} s "
              f"after it was back, every held window stored {stored_s:.1f} s later")
        assert trained_down > 0  # never blocked

        # 2. The leader killed; the probes pass their reports on to the other instance.
        other = pair.b if leader is pair.a else pair.a
        at_kill = max(seq for _, seq in stored_windows(pair, job.job_id))
        died, trained = kill(leader), job.steps()
        takeover_s = wait_role(other, "leader", died)
        stored_s = wait_all_stored(pair, job.job_id, at_kill + 2, "after the takeover", other.daemon)
        print(f"leader {leader.name} SIGKILLed: {other.name} led after {takeover_s:.1f} s, every held window "
              f"stored {stored_s:.1f} s later; the job trained {job.steps() - trained} steps meanwhile")
        assert takeover_s < TAKEOVER_BOUND_S

        stored = stored_windows(pair, job.job_id)
        twice = sorted(key for key, n in stored.items() if n > 1)
        print(f"{len(stored)} windows stored, {len(twice)} of them twice: {twice}")
        # A report is stored twice only when it was stored and its answer lost (a leader killed,
        # a connection cut mid-commit): the probe sends that batch again, once.
        assert all(n <= 2 for n in stored.values()), twice
        assert [r["dropped_reports"] for r in newest_stored(pair, job.job_id)] == [0, 0]
        # One run of the job: a rank's backlog, far below the other rank's newest window, is not a requeue.
        assert {r["step"] for r in window_records(pair, job.job_id)} == {"0"}

        # A healthy job: neither leader acted on it.
        incidents = other.incidents(job=job.job_id, everything=True)
        acted = [row for inc in incidents for row in actions_of(pair.db, inc["id"])]
        assert acted == [], (incidents, acted)
        assert not cluster.drain_reasons()
        assert (health(other) or {}).get("role") == "leader"
