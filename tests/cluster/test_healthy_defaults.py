"""A healthy job on a loaded machine, judged with the shipped analysis defaults: nobody is told, nothing acts.

The end-to-end tests use looser thresholds (tests/cluster/scenario.py says
why); this one does not.  ``artemis.conf`` sets only what the test rig needs
(where to listen, munge, mail, windows of 20 steps so the test is short --
fewer steps a window make every window noisier, never quieter) and the most
permissive policy the e2e tests use: every rung automatic, so a wrong
conclusion would act at once.  MinSlowdown, JobSlowdown, ConfirmWindows,
RobustZ, RecoveryFraction and the escalation rules are the defaults.

While the job trains, the machine is loaded by other work outside the job:
busy processes come and go at seeded random times, so the job's step time
swings up and down as it would with a noisy neighbour.  Afterwards:

* Slurm drained no node and the job completed on its nodes, without an
  AdminComment;
* no incident of the job has an action beyond a matched probe (no correction,
  rebalance, drain, requeue or escalation) and no email was sent;
* no incident names a cause for a rank, node or link: the neighbour does
  slow one rank more than another now and then (preempted on a shared core),
  and such an incident may be confirmed, but only as ``unknown`` with nothing
  measured that differs -- held, nobody paged (``UnknownEscalateAfter``,
  ``UnknownEscalateLoss``).  Job-wide suspects open on windows the load
  slowed, and end the same way.
"""

from __future__ import annotations

import random
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest

from .artemis import ArtemisDaemon, Mailbox
from .procs import wait_until
from .scenario import TrainingJob, module_daemon
from .slurm import SlurmCluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

RIG = """\
WindowSteps=20
PartitionPolicy=main Auto=correct,rebalance,drain,requeue,escalate MaxDrainFraction=0.5 MaxDrainsPerHour=100 Cooldown=1
"""
TRAIN_S = 150.0
PAGING = ("correct", "rebalance", "drain", "requeue", "constrain", "escalate", "notify")


class NoisyNeighbour:
    """Up to two busy processes outside every job, switched on and off at seeded random times.

    Bounded: each on/off phase lasts 2-8 s, and ``__exit__`` kills what runs (by PID).
    """

    def __init__(self, seed: int, max_hogs: int = 2):
        self.rng = random.Random(seed)
        self.max_hogs = max_hogs
        self.hogs: list[subprocess.Popen] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="noisy-neighbour")
        self.phases: list[tuple[float, int]] = []

    def _set(self, count: int) -> None:
        while len(self.hogs) > count:
            hog = self.hogs.pop()
            hog.kill()
            hog.wait(timeout=10)
        while len(self.hogs) < count:
            self.hogs.append(subprocess.Popen(["sh", "-c", "while :; do :; done"]))

    def _run(self) -> None:
        while not self._stop.is_set():
            count = self.rng.randint(0, self.max_hogs)
            self._set(count)
            self.phases.append((time.monotonic(), count))
            self._stop.wait(self.rng.uniform(2.0, 8.0))

    def __enter__(self) -> NoisyNeighbour:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=15)
        self._set(0)


@pytest.fixture(scope="module")
def artemisd(slurm_cluster: SlurmCluster, mailbox: Mailbox) -> Iterator[ArtemisDaemon]:
    with module_daemon(slurm_cluster, RIG, mailbox) as daemon:
        yield daemon


def test_a_healthy_job_under_a_noisy_neighbour_is_left_alone(
        slurm_cluster: SlurmCluster, artemisd: ArtemisDaemon, mailbox: Mailbox) -> None:
    try:
        job = TrainingJob.submit(slurm_cluster, artemisd, seconds=TRAIN_S)
        job.wait_running()
        with NoisyNeighbour(seed=int(job.job_id)) as load:
            # Checked while it runs: a job that ends with no open incident has its history
            # forgotten once its epilog says job_end (a healthy job with no suspect at all).
            wait_until(lambda: artemisd.records_of(job.job_id) > 0, "the job's reports to reach artemisd",
                       timeout_s=TRAIN_S)
            state = slurm_cluster.wait_job(job.job_id, timeout_s=TRAIN_S + 180)
        assert state == "COMPLETED", f"job {job.job_id} ended {state}"
        assert len({count for _, count in load.phases}) > 1, load.phases  # the load did change
        incidents = [i for i in artemisd.incidents(everything=True) if i.get("job") == job.job_id]
        details = {i["id"]: artemisd.get(f"/v1/incidents/{i['id']}") for i in incidents}
        acted = {inc: [(a["kind"], a["status"]) for a in d["actions"] if a["kind"] in PAGING]
                 for inc, d in details.items()}
        assert not any(acted.values()), "\n".join(artemisd.explain(inc) for inc, kinds in acted.items() if kinds)
        blamed = [i for i in incidents if i["state"] not in ("suspect", "dismissed") and i["cause"] != "unknown"]
        assert blamed == [], blamed
        assert mailbox.subjects() == []
        assert slurm_cluster.drain_reasons() == {}
        assert not job.info().get("AdminComment", "").strip()
    finally:
        slurm_cluster.reset()
