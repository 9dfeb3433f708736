"""An ordinary cluster user against the real artemisd, real munge and real Slurm (issue 27).

What a user can make the daemon ask Slurm, and who reads what: a job id shaped like an option
never reaches squeue; a request that goes away takes its Slurm read with it (the command is
killed, not left to run out SlurmTimeout); with ``ReadAuth=required`` an unsigned read is refused
and a credential made for one read is refused on another.
"""

from __future__ import annotations

import os
import socket
import stat
import sys
import textwrap
from pathlib import Path

import pytest

from .artemis import ArtemisDaemon
from .procs import wait_until
from .slurm import SlurmCluster, free_port
from .test_daemon_auth import NOBODY, credential, post, reports

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def artemisd(slurm_cluster: SlurmCluster):
    with ArtemisDaemon(slurm_cluster, "JobCacheSeconds=0\n", name="artemisd-trust", port=free_port()) as daemon:
        yield daemon


def test_a_job_id_shaped_like_an_option_is_refused_by_name_and_never_reaches_squeue(artemisd, slurm_cluster):
    """``squeue --jobs --iterate=1`` loops until killed (--jobs takes an optional argument); the
    daemon holds the id to Slurm's syntax first, so the user is told which field, at once."""
    body = reports("--iterate=1")
    status, reply = post(artemisd.url, "/v1/reports", body, credential(slurm_cluster, body, NOBODY))
    assert status == 200 and reply["accepted"] == 0, reply
    assert [r["error"] for r in reply["rejected"]] == \
        ["job: '--iterate=1' is not a Slurm job id (digits, with _N for an array task or +N for a het component)"] * 2
    # The real squeue reads the same id, passed the way the daemon passes ids, as a job id it refuses:
    done = slurm_cluster.cmd("squeue", "--json", "--jobs=--iterate=1", check=False)
    assert done.returncode != 0 and "invalid" in (done.stderr + done.stdout).lower()


SLOW_SQUEUE = textwrap.dedent("""\
    #!{python}
    import os, sys, time
    with open(os.path.join({dir!r}, "squeue.%d.pid" % os.getpid()), "w") as f:
        f.write(" ".join(sys.argv))
    time.sleep(60)  # slurmctld that does not answer
    """)


def test_a_request_that_goes_away_takes_its_slurm_read_with_it(slurm_cluster, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    squeue = bin_dir / "squeue"
    squeue.write_text(SLOW_SQUEUE.format(python=sys.executable, dir=str(tmp_path)))
    squeue.chmod(squeue.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    env = dict(slurm_cluster.env, PATH=f"{bin_dir}:{os.environ['PATH']}")
    with ArtemisDaemon(slurm_cluster, "SlurmTimeout=60\n", name="artemisd-cancel", port=free_port(),
                       env=env) as daemon:
        body = reports("987654")
        cred = credential(slurm_cluster, body, NOBODY)
        host, port = daemon.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"POST /v1/reports HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Authorization: Munge " + cred.encode() + b"\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
            wait_until(lambda: list(tmp_path.glob("squeue.*.pid")), "the daemon to ask squeue", timeout_s=20)
        # The client hung up: its read is cancelled and squeue killed, not left to run its 60 s.
        [pid_file] = tmp_path.glob("squeue.*.pid")
        pid = int(pid_file.name.split(".")[1])
        assert "--jobs=987654" in pid_file.read_text()

        def gone() -> bool:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
        wait_until(gone, "the abandoned squeue to be killed", timeout_s=20, interval_s=0.2)


@pytest.fixture(scope="module")
def private(slurm_cluster: SlurmCluster):
    with ArtemisDaemon(slurm_cluster, "ReadAuth=required\n", name="artemisd-private", port=free_port()) as daemon:
        yield daemon


def get(url: str, path: str, cred: str | None) -> tuple[int, dict]:
    return post(url, path, b"", cred, method="GET")


def test_with_read_auth_required_reads_are_signed_and_bound_to_their_path(private, slurm_cluster):
    def signed(path: str, user=None) -> str:
        return credential(slurm_cluster, b"", user, method="GET", path=path)

    assert get(private.url, "/v1/health", None)[0] == 200  # liveness stays open, for load balancers
    for path in ("/v1/incidents", "/v1/status", "/v1/incidents/INC-1", "/v1/incidents/INC-1/windows"):
        status, reply = get(private.url, path, None)
        assert status == 401 and "Authorization" in reply["error"], (path, reply)
    status, reply = get(private.url, "/v1/incidents", signed("/v1/incidents", NOBODY))
    assert status == 200 and reply["incidents"] == []
    status, reply = get(private.url, "/v1/status", signed("/v1/status", NOBODY))
    assert status == 200 and reply["jobs"] == []  # job ids and owners are private too
    status, reply = get(private.url, "/v1/status", signed("/v1/status"))
    assert status == 200 and "jobs" in reply
    status, reply = get(private.url, "/v1/status", signed("/v1/incidents"))  # made for another read
    assert status == 401
