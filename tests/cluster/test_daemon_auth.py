"""Authentication against the real munged and job ownership against real Slurm.

The real ``artemisd`` process (tests/cluster/artemis.py) runs with
AuthType=munge on the cluster's munged.  Credentials are made with the
``munge`` command as root and, via setpriv, as the unprivileged ``nobody``;
each is bound to one request (method, path, body: ``request_payload``), and a
credential made for one request is refused on any other (issue 27, item 6).
"""

from __future__ import annotations

import hashlib
import json
import pwd
import subprocess
import urllib.error
import urllib.request

import pytest

from artemisd.auth import request_payload
from tests.unit.windows import lockstep

from .artemis import ArtemisDaemon
from .slurm import SlurmCluster

pytestmark = pytest.mark.cluster

NOBODY = pwd.getpwnam("nobody")


def credential(cluster: SlurmCluster, body: bytes, user: pwd.struct_passwd | None = None,
               payload: str | None = None, *, method: str = "POST", path: str = "/v1/reports") -> str:
    """A credential for ``method`` on ``path`` with ``body`` (or with any ``payload``), made by ``user`` (root)."""
    argv = ["munge", "-S", str(cluster.munge_socket), "-s", payload or request_payload(method, path, body)]
    if user is not None:
        argv = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups", *argv]
    return subprocess.run(argv, capture_output=True, text=True, check=True, timeout=10).stdout.strip()


def legacy(body: bytes) -> str:
    """The payload of version 1, still sent by probes of jobs started before the upgrade: the body's sha256."""
    return hashlib.sha256(body).hexdigest()


def post(url: str, path: str, body: bytes, cred: str | None, method: str = "POST") -> tuple[int, dict]:
    req = urllib.request.Request(f"{url}{path}", data=body if method == "POST" else None, method=method)
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
    assert status == 401 and "body" in reply["error"] and "sha256" in reply["error"]
    status, reply = post(artemisd.url, "/v1/reports", other, credential(slurm_cluster, body, payload=legacy(body)))
    assert status == 401 and "body" in reply["error"]


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
    path = "/v1/incidents/INC-1/approve"
    status, reply = post(artemisd.url, path, body, credential(slurm_cluster, body, NOBODY, path=path))
    assert status == 403 and "AdminUids" in reply["error"]
    path = "/v1/incidents/INC-424242/approve"
    status, _ = post(artemisd.url, path, body, credential(slurm_cluster, body, path=path))
    assert status == 404
    body = json.dumps({"status": "done"}).encode()
    path = "/v1/nodes/n1/corrections/COR-1"
    status, reply = post(artemisd.url, path, body, credential(slurm_cluster, body, NOBODY, path=path))
    assert status == 403


# --- a credential is good for the one request it was made for (issue 27, item 6) -------------------

CORRECTIONS = "/v1/nodes/n1/corrections"


def legacy_count(url: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("artemis_legacy_credentials_total"))


def test_roots_credential_for_the_node_checks_get_is_refused_on_deny(artemisd, slurm_cluster):
    """What the node check signs for GET /v1/nodes/n1/corrections (empty body) must not deny an incident.

    The incident does not exist: a credential that passed would get 404 (it did, before
    credentials were bound to their request), a refused one 401."""
    status, reply = post(artemisd.url, CORRECTIONS, b"", credential(slurm_cluster, b"", method="GET", path=CORRECTIONS),
                         method="GET")
    assert status == 200 and "corrections" in reply  # good for the request it was made for
    deny = "/v1/incidents/INC-424242/deny"
    status, reply = post(artemisd.url, deny, b"", credential(slurm_cluster, b"", method="GET", path=CORRECTIONS))
    assert status == 401, reply
    assert "method: made for GET, used for POST" in reply["error"]
    # The same with the method right and the path wrong.
    status, reply = post(artemisd.url, deny, b"", credential(slurm_cluster, b"", path=CORRECTIONS))
    assert status == 401 and "path: made for" in reply["error"] and CORRECTIONS in reply["error"]
    # And what the node check signed before the upgrade (the empty body's sha256 alone).
    status, reply = post(artemisd.url, deny, b"", credential(slurm_cluster, b"", payload=legacy(b"")))
    assert status == 401 and "legacy" in reply["error"]
    # Made for the deny itself, root's credential passes (and the incident is not found).
    assert post(artemisd.url, deny, b"", credential(slurm_cluster, b"", path=deny))[0] == 404


@pytest.mark.parametrize("made, used", [
    ("/v1/incidents/INC-1/approve", "/v1/incidents/INC-2/approve"),
    ("/v1/incidents/INC-1/approve", "/v1/incidents/INC-1/deny"),
    ("/v1/nodes/n2/corrections/COR-1", "/v1/nodes/n1/corrections/COR-1"),
    ("/v1/reports", "/v1/reports?all=1"),
])
def test_a_credential_for_one_path_is_refused_on_another(artemisd, slurm_cluster, jobs, made, used):
    body = reports(jobs[0], seq=50) if made.startswith("/v1/reports") else b""
    status, reply = post(artemisd.url, used, body, credential(slurm_cluster, body, path=made))
    assert status == 401 and "path: made for" in reply["error"] and repr(made) in reply["error"], reply


def test_a_credential_for_a_get_is_refused_on_a_post_and_the_other_way(artemisd, slurm_cluster):
    status, reply = post(artemisd.url, CORRECTIONS, b"",
                         credential(slurm_cluster, b"", method="POST", path=CORRECTIONS), method="GET")
    assert status == 401 and "method: made for POST, used for GET" in reply["error"]
    path = f"{CORRECTIONS}/COR-1"
    body = json.dumps({"status": "done"}).encode()
    status, reply = post(artemisd.url, path, body, credential(slurm_cluster, body, method="GET", path=path))
    assert status == 401 and "method: made for GET, used for POST" in reply["error"]


def test_a_legacy_credential_is_accepted_on_reports_only(artemisd, slurm_cluster, jobs):
    """Probes of jobs started before the upgrade sign the body's sha256 alone: good for /v1/reports
    (where it vouches for that exact body), refused wherever the method and path carry the meaning."""
    before = legacy_count(artemisd.url)
    body = reports(jobs[0], seq=60)
    status, reply = post(artemisd.url, "/v1/reports", body, credential(slurm_cluster, body, payload=legacy(body)))
    assert status == 200 and reply["accepted"] == 2
    done = json.dumps({"status": "done"}).encode()
    for method, path, sent in [("POST", "/v1/incidents/INC-1/approve", b""),
                               ("POST", "/v1/incidents/INC-1/deny", b""),
                               ("GET", CORRECTIONS, b""),
                               ("POST", f"{CORRECTIONS}/COR-1", done),
                               ("POST", "/v1/reports?all=1", body)]:
        status, reply = post(artemisd.url, path, sent, credential(slurm_cluster, sent, payload=legacy(sent)),
                             method=method)
        assert status == 401 and "legacy" in reply["error"] and "POST /v1/reports only" in reply["error"], \
            (method, path, status, reply)
    assert legacy_count(artemisd.url) == before + 1


@pytest.mark.parametrize("use_lib", [True, False], ids=["libmunge", "unmunge"])
def test_both_decoders_agree(slurm_cluster, use_lib):
    """libmunge (ctypes) and the unmunge command give the same verdicts."""
    import asyncio

    from artemisd.auth import AuthError, MungeAuth

    auth = MungeAuth(str(slurm_cluster.munge_socket), set(), {1234}, use_lib=use_lib)
    assert (auth.lib is not None) is use_lib
    body = b'[{"x": 1}]'
    cred = credential(slurm_cluster, body, NOBODY)
    principal = asyncio.run(auth.authenticate(f"Munge {cred}", "POST", "/v1/reports", body))
    assert principal.uid == NOBODY.pw_uid and not principal.root_side and not principal.admin
    with pytest.raises(AuthError, match="replayed"):
        asyncio.run(auth.authenticate(f"Munge {cred}", "POST", "/v1/reports", body))
    with pytest.raises(AuthError, match="sha256"):
        asyncio.run(auth.authenticate(f"Munge {credential(slurm_cluster, body)}", "POST", "/v1/reports", b"[]"))
    with pytest.raises(AuthError, match="path"):
        asyncio.run(auth.authenticate(f"Munge {credential(slurm_cluster, body)}", "POST", "/v1/incidents/X/deny",
                                      body))
    with pytest.raises(AuthError, match="legacy"):
        asyncio.run(auth.authenticate(f"Munge {credential(slurm_cluster, b'', payload=legacy(b''))}", "POST",
                                      "/v1/incidents/X/deny", b""))
    with pytest.raises(AuthError, match="invalid"):
        asyncio.run(auth.authenticate("Munge MUNGE:AwQFAAB0aGlzIGlzIG5vdA==:", "POST", "/v1/reports", body))
