"""Authentication against the real munged and job ownership against real Slurm.

The real ``artemisd`` process (tests/cluster/artemis.py) runs with
AuthType=munge on the cluster's munged.  Credentials are made with the
``munge`` command as root and, via setpriv, as the unprivileged ``nobody``.
"""

from __future__ import annotations

import hashlib
import json
import pwd
import subprocess
import urllib.error
import urllib.request

import pytest

from tests.unit.windows import lockstep

from .artemis import ArtemisDaemon
from .slurm import SlurmCluster

pytestmark = pytest.mark.cluster

NOBODY = pwd.getpwnam("nobody")


def credential(cluster: SlurmCluster, body: bytes, user: pwd.struct_passwd | None = None,
               payload: str | None = None) -> str:
    argv = ["munge", "-S", str(cluster.munge_socket), "-s", payload or hashlib.sha256(body).hexdigest()]
    if user is not None:
        argv = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups", *argv]
    return subprocess.run(argv, capture_output=True, text=True, check=True, timeout=10).stdout.strip()


def post(url: str, path: str, body: bytes, cred: str | None) -> tuple[int, dict]:
    req = urllib.request.Request(f"{url}{path}", data=body, method="POST")
    if cred is not None:
        req.add_header("Authorization", f"Munge {cred}")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def reports(job: str, seq: int = 0, node: str = "n1") -> bytes:
    return json.dumps([r.model_dump(mode="json", exclude_none=True)
                       for r in lockstep(seq, [50.0] * 2, job=job, nodes=[node, node])]).encode()


@pytest.fixture(scope="module")
def artemisd(slurm_cluster: SlurmCluster):
    with ArtemisDaemon(slurm_cluster, "JobCacheSeconds=0\n") as daemon:
        yield daemon


@pytest.fixture(scope="module")
def jobs(slurm_cluster: SlurmCluster):
    """One job of root's and one of nobody's, both running."""
    root_job = slurm_cluster.sbatch("#!/bin/sh\nsleep 300\n", "-o", "/dev/null", "-N", "1")
    user_job = slurm_cluster.sbatch("#!/bin/sh\nsleep 300\n", "-o", "/dev/null", "--chdir=/tmp",
                                    f"--uid={NOBODY.pw_uid}", f"--gid={NOBODY.pw_gid}", "-N", "1", "-n", "2")
    for job in (root_job, user_job):
        slurm_cluster.wait_job(job, ("RUNNING",), timeout_s=60)
    yield root_job, user_job
    slurm_cluster.cmd("scancel", root_job, user_job, check=False)


def test_root_credential_is_accepted(artemisd, slurm_cluster, jobs):
    body = reports(jobs[0])
    status, reply = post(artemisd.url, "/v1/reports", body, credential(slurm_cluster, body))
    assert status == 200 and reply["accepted"] == 2


def test_replayed_credential_is_rejected(artemisd, slurm_cluster, jobs):
    body = reports(jobs[0], seq=1)
    cred = credential(slurm_cluster, body)
    assert post(artemisd.url, "/v1/reports", body, cred)[0] == 200
    status, reply = post(artemisd.url, "/v1/reports", body, cred)
    assert status == 401 and "replayed" in reply["error"]


def test_payload_must_be_the_body_digest(artemisd, slurm_cluster, jobs):
    body = reports(jobs[0], seq=2)
    other = reports(jobs[0], seq=3)
    status, reply = post(artemisd.url, "/v1/reports", other, credential(slurm_cluster, body))
    assert status == 401 and "sha256" in reply["error"]


@pytest.mark.parametrize("cred", [None, "", "MUNGE:AwQFAAB0aGlzIGlzIG5vdCBhIGNyZWRlbnRpYWw=:"])
def test_missing_or_forged_credential_is_rejected(artemisd, jobs, cred):
    status, reply = post(artemisd.url, "/v1/reports", reports(jobs[0], seq=4), cred)
    assert status == 401, reply


def test_a_user_reports_only_for_their_own_job(artemisd, slurm_cluster, jobs):
    root_job, user_job = jobs
    [node] = slurm_cluster.cmd("scontrol", "show", "hostnames", slurm_cluster.job(user_job)["NodeList"]).stdout.split()
    mine = json.loads(reports(user_job, seq=0, node=node))
    theirs = json.loads(reports(root_job, seq=5))
    event = [{"type": "node", "v": 1, "event": "health", "node": "n1", "time": 0.0,
              "gpus": [{"index": 0, "throttle": ["hw_thermal"]}]}]
    body = json.dumps(mine + theirs + event).encode()
    status, reply = post(artemisd.url, "/v1/reports", body, credential(slurm_cluster, body, NOBODY))
    assert status == 200
    assert reply["accepted"] == 2
    errors = {r["index"]: r["error"] for r in reply["rejected"]}
    assert set(errors) == {2, 3, 4}
    assert f"not owned by uid {NOBODY.pw_uid}" in errors[2]
    assert "root or SlurmUser" in errors[4]  # a user cannot forge root-side node evidence


def test_admin_and_root_only_endpoints(artemisd, slurm_cluster):
    body = b""
    status, reply = post(artemisd.url, "/v1/incidents/INC-1/approve", body,
                         credential(slurm_cluster, body, NOBODY))
    assert status == 403 and "AdminUids" in reply["error"]
    status, _ = post(artemisd.url, "/v1/incidents/INC-424242/approve", body, credential(slurm_cluster, body))
    assert status == 404
    body = json.dumps({"status": "done"}).encode()
    status, reply = post(artemisd.url, "/v1/nodes/n1/corrections/COR-1", body,
                         credential(slurm_cluster, body, NOBODY))
    assert status == 403


@pytest.mark.parametrize("use_lib", [True, False], ids=["libmunge", "unmunge"])
def test_both_decoders_agree(slurm_cluster, use_lib):
    """libmunge (ctypes) and the unmunge command give the same verdicts."""
    import asyncio

    from artemisd.auth import AuthError, MungeAuth

    auth = MungeAuth(str(slurm_cluster.munge_socket), set(), {1234}, use_lib=use_lib)
    assert (auth.lib is not None) is use_lib
    body = b'[{"x": 1}]'
    cred = credential(slurm_cluster, body, NOBODY)
    principal = asyncio.run(auth.authenticate(f"Munge {cred}", body))
    assert principal.uid == NOBODY.pw_uid and not principal.root_side and not principal.admin
    with pytest.raises(AuthError, match="replayed"):
        asyncio.run(auth.authenticate(f"Munge {cred}", body))
    with pytest.raises(AuthError, match="sha256"):
        asyncio.run(auth.authenticate(f"Munge {credential(slurm_cluster, body)}", b"[]"))
    with pytest.raises(AuthError, match="invalid"):
        asyncio.run(auth.authenticate("Munge MUNGE:AwQFAAB0aGlzIGlzIG5vdA==:", body))
