"""A healthy job on a loaded machine, judged with the shipped defaults: nobody is told, nothing acts.

The daemon runs as the end-to-end tests run it (tests/cluster/scenario.py):
the analysis, probing, confirmation, verification and escalation rules at the
shipped defaults, and the most permissive policy, every rung automatic, so a
wrong conclusion would act at once.  The run lasts 150 s, short of
``UnknownEscalateAfter`` (10 min): the same run past every timer, 15 minutes,
is benchmarks/healthy_soak.py (docs/benchmarks.md has what it measured).

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
  measured that differs -- held, nobody paged (``UnknownEscalateLoss``,
  ``EscalateLoss``).  Job-wide suspects open on windows the load slowed, and
  end the same way;
* every incident has ended with its job: none is left open.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .artemis import ArtemisDaemon, Mailbox
from .healthy import run_healthy_job
from .scenario import DAEMON_CONF, module_daemon
from .slurm import SlurmCluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

TRAIN_S = 150.0


@pytest.fixture(scope="module")
def artemisd(slurm_cluster: SlurmCluster, mailbox: Mailbox) -> Iterator[ArtemisDaemon]:
    with module_daemon(slurm_cluster, DAEMON_CONF, mailbox) as daemon:
        yield daemon


def test_a_healthy_job_under_a_noisy_neighbour_is_left_alone(
        slurm_cluster: SlurmCluster, artemisd: ArtemisDaemon, mailbox: Mailbox) -> None:
    try:
        seen = run_healthy_job(slurm_cluster, artemisd, mailbox, TRAIN_S)
        assert seen.state == "COMPLETED", f"job {seen.job_id} ended {seen.state}"
        assert len({count for _, count in seen.phases}) > 1, seen.phases  # the load did change
        assert not any(seen.acted.values()), "\n".join(
            artemisd.explain(inc) for inc, kinds in seen.acted.items() if kinds)
        assert seen.blamed == [], seen.blamed
        assert seen.mails == []
        assert seen.drained == {}
        assert not seen.admin_comment
        assert seen.left_open == [], seen.left_open
    finally:
        slurm_cluster.reset()
