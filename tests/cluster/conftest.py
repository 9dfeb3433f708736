"""Session fixtures for the real Slurm test cluster.

``munged``: a private munged (key and socket in a temp dir).
``slurm_cluster``: munged + MariaDB + slurmdbd + slurmctld + N slurmd, one per
network namespace where namespaces work, else all on 127.0.0.1.  Shared by the
whole session (bring-up takes seconds, but not zero); tests that change cluster
state undo it, or use ``clean_cluster``, which resets after the test.

Knobs (environment): ``ARTEMIS_TEST_NETWORK`` = auto | netns | loopback,
``ARTEMIS_TEST_NODES`` (default 4), ``ARTEMIS_TEST_HEALTH_INTERVAL`` (seconds between
node checks, default 5), ``ARTEMIS_TEST_KEEP=1`` keeps the work dir
(logs, configs) for a post-mortem.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from .artemis import Mailbox
from .munge import Munged
from .slurm import SlurmCluster


def _require_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("the Slurm test cluster needs root (it runs munged, slurmd and "
                    "slurmctld, and creates network namespaces and cgroups)")


@pytest.fixture(scope="session")
def munged() -> Iterator[Munged]:
    _require_root()
    with Munged() as daemon:
        yield daemon


@pytest.fixture(scope="session")
def slurm_cluster(munged: Munged) -> Iterator[SlurmCluster]:
    _require_root()
    cluster = SlurmCluster(
        nodes=int(os.environ.get("ARTEMIS_TEST_NODES", "4")),
        network=os.environ.get("ARTEMIS_TEST_NETWORK", "auto"),
        munged=munged,
        health_interval_s=int(os.environ.get("ARTEMIS_TEST_HEALTH_INTERVAL", "5")),
        keep_workdir=os.environ.get("ARTEMIS_TEST_KEEP") == "1",
    )
    with cluster:
        yield cluster


@pytest.fixture
def clean_cluster(slurm_cluster: SlurmCluster) -> Iterator[SlurmCluster]:
    """The session cluster, reset (jobs cancelled, faults lifted, nodes resumed) after the test."""
    yield slurm_cluster
    slurm_cluster.reset()


@pytest.fixture(scope="module")
def mailbox() -> Iterator[Mailbox]:
    """A loopback SMTP server for one test module's artemisd (``scenario.module_daemon``)."""
    with Mailbox() as box:
        yield box
