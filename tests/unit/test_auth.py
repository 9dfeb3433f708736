"""Auth without munged: unmunge output parsing, trust levels, header checks, and
what a credential's payload binds (method, path, body: issue 27, item 6).

The credential checks themselves (forged, replayed, made for another request,
job ownership) run against a real munged in tests/cluster/test_daemon_auth.py.
"""

from __future__ import annotations

import asyncio

import pytest

from artemisd.auth import AuthError, MungeAuth, NoAuth, body_digest, parse_unmunge


def test_parse_unmunge_numeric_output():
    out = b"STATUS:          0\nUID:             1000\nGID:             100\n\n" + body_digest(b"x").encode()
    status, uid, gid, payload = parse_unmunge(out)
    assert (status, uid, gid, payload) == (0, 1000, 100, body_digest(b"x").encode())
    assert parse_unmunge(b"STATUS: 17\nUID: 0\nGID: 0\n\nabc")[0] == 17
    assert parse_unmunge(b"garbage")[0] == -1


def test_trust_levels():
    auth = MungeAuth(None, root_uids={64030}, admin_uids={1001})
    assert auth.principal(0, 0).root_side and auth.principal(0, 0).admin
    slurm = auth.principal(64030, 64030)
    assert slurm.root_side and slurm.admin
    admin = auth.principal(1001, 100)
    assert admin.admin and not admin.root_side
    user = auth.principal(1000, 100)
    assert not user.admin and not user.root_side and user.who == "uid 1000"


@pytest.mark.parametrize("header", [None, "", "Bearer abc", "Munge", "Munge   "])
def test_malformed_headers_are_rejected_before_munge_is_asked(header):
    auth = MungeAuth(None, set(), set(), unmunge="/nonexistent/unmunge")
    with pytest.raises(AuthError) as err:
        asyncio.run(auth.authenticate(header, "POST", "/v1/reports", b"[]"))
    assert err.value.status == 401


@pytest.mark.parametrize("use_lib", [True, False])
def test_munge_unreachable_is_a_503_not_a_pass(tmp_path, use_lib):
    auth = MungeAuth(str(tmp_path / "no-munged.socket"), set(), set(), unmunge="/nonexistent/unmunge",
                     use_lib=use_lib)
    with pytest.raises(AuthError) as err:
        asyncio.run(auth.authenticate("Munge MUNGE:abc:", "POST", "/v1/reports", b"[]"))
    assert err.value.status == 503


def test_none_trusts_everyone_local():
    principal = asyncio.run(NoAuth().authenticate(None, "POST", "/v1/incidents/X/deny", b""))
    assert principal.root_side and principal.admin


# --- what a credential is bound to (issue 27, item 6) ---------------------------------------

EMPTY = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"  # sha256 of b""


def _copies():
    """The payload builder's three copies: artemisd, the probe (stdlib + torch), the node programs (stdlib)."""
    import importlib.util
    import sys
    from pathlib import Path

    from artemisd import auth
    from torch_hook import munge

    path = Path(__file__).resolve().parents[2] / "prolog_epilog" / "artemis_node.py"
    spec = importlib.util.spec_from_file_location("artemis_node_payload_copy", path)
    node = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = node  # dataclasses looks the module up while the class is made
    spec.loader.exec_module(node)
    return {"artemisd": auth.request_payload, "torch_hook": munge.request_payload, "artemis_node": node.request_payload}


def test_the_payload_format_is_exact():
    from artemisd.auth import request_payload

    assert request_payload("GET", "/v1/nodes/n1/corrections", b"") == \
        f"artemis-request-v2 GET /v1/nodes/n1/corrections {EMPTY}"
    assert request_payload("POST", "/v1/incidents?all=1", b"[]") == \
        f"artemis-request-v2 POST /v1/incidents?all=1 {body_digest(b'[]')}"


REQUESTS = [("GET", "/v1/nodes/n1/corrections", b""), ("POST", "/v1/reports", b'[{"x":1}]'),
            ("POST", "/v1/incidents/INC-7/deny", b""), ("GET", "/v1/incidents?all=1", b""),
            ("POST", "/prefix/v1/reports", b"\x00\xff" * 100), ("POST", "/v1/nodes/n%201/corrections/COR-1", b"{}"),
            ("GET", "/", b"")]
BAD = [("get", "/v1/reports"), ("POST", "v1/reports"), ("POST", "/v1/has space"), ("POST", "/v1/new\nline"),
       ("POST", "/v1/é"), ("", "/v1/reports"), ("POST", "")]


def test_every_copy_of_the_builder_gives_the_same_payload():
    copies = _copies()
    for method, path, body in REQUESTS:
        made = {name: build(method, path, body) for name, build in copies.items()}
        assert len(set(made.values())) == 1, made
    for method, path in BAD:
        for name, build in copies.items():
            with pytest.raises(ValueError):
                build(method, path, b"")
                pytest.fail(f"{name} built a payload for {method!r} {path!r}")


def test_payload_round_trips_and_legacy_is_recognised():
    from artemisd.auth import parse_payload, request_payload

    signed = parse_payload(request_payload("POST", "/v1/reports?x=1", b"[]").encode())
    assert (signed.method, signed.path, signed.digest, signed.legacy) == \
        ("POST", "/v1/reports?x=1", body_digest(b"[]"), False)
    legacy = parse_payload(body_digest(b"[]").encode())
    assert legacy.legacy and legacy.digest == body_digest(b"[]")
    assert parse_payload(body_digest(b"[]").upper().encode() + b"\n").digest == body_digest(b"[]")  # as before


@pytest.mark.parametrize("payload, says", [
    (b"", "neither"),
    (b"hello", "neither"),
    (("0" * 63).encode(), "neither"),
    (f"artemis-request-v3 POST /v1/reports {EMPTY}".encode(), "version"),
    (f"artemis-request-v2 POST /v1/reports {EMPTY} extra".encode(), "malformed"),
    (f"artemis-request-v2 POST  /v1/reports {EMPTY}".encode(), "malformed"),
    (f"artemis-request-v2 post /v1/reports {EMPTY}".encode(), "malformed"),
    (f"artemis-request-v2 POST v1/reports {EMPTY}".encode(), "malformed"),
    (f"artemis-request-v2 POST /v1/reports {EMPTY.upper()}".encode(), "malformed"),
    (f"artemis-request-v2 POST /v1/reports {EMPTY}\n".encode(), "malformed"),
    (f"artemis-request-v2 POST /v1/reports {EMPTY}".encode() + b"\xff", "ASCII"),
])
def test_malformed_payloads_are_refused(payload, says):
    from artemisd.auth import parse_payload

    with pytest.raises(AuthError, match=says) as err:
        parse_payload(payload)
    assert err.value.status == 401


def root_credential(payload: str | bytes):
    """What ``check`` makes of a credential root minted with ``payload`` (munged said: valid, uid 0)."""
    auth = MungeAuth(None, set(), set(), use_lib=False)
    return auth._judge(0, 0, 0, payload if isinstance(payload, bytes) else payload.encode(), "Success")


def test_roots_credential_for_the_node_checks_get_is_refused_on_deny():
    """The issue's case: both bodies are empty, so a bare body digest could not tell them apart."""
    from artemisd.auth import request_payload

    cred = root_credential(request_payload("GET", "/v1/nodes/n1/corrections", b""))
    assert cred.verify("GET", "/v1/nodes/n1/corrections", EMPTY).admin  # good for what it was made for
    with pytest.raises(AuthError, match="method: made for GET, used for POST") as err:
        cred.bind("POST", "/v1/incidents/X/deny")
    assert err.value.status == 401
    with pytest.raises(AuthError, match="method"):
        cred.verify("POST", "/v1/incidents/X/deny", EMPTY)


@pytest.mark.parametrize("made, used", [
    (("POST", "/v1/incidents/INC-1/approve"), ("POST", "/v1/incidents/INC-2/approve")),
    (("POST", "/v1/incidents/INC-1/approve"), ("POST", "/v1/incidents/INC-1/deny")),
    (("POST", "/v1/nodes/n1/corrections/COR-1"), ("POST", "/v1/nodes/n2/corrections/COR-1")),
    (("POST", "/v1/reports"), ("POST", "/v1/reports?x=1")),
    (("POST", "/v1/reports"), ("POST", "/v1/reports/")),
    (("POST", "/v1/reports"), ("POST", "/v1//reports")),
    (("POST", "/v1/nodes/n%31/corrections/COR-1"), ("POST", "/v1/nodes/n1/corrections/COR-1")),
])
def test_a_credential_for_one_path_is_refused_on_another(made, used):
    from artemisd.auth import request_payload

    cred = root_credential(request_payload(*made, b""))
    with pytest.raises(AuthError, match="path: made for") as err:
        cred.verify(*used, EMPTY)
    assert repr(made[1]) in str(err.value) and repr(used[1]) in str(err.value)


@pytest.mark.parametrize("made, used", [("GET", "POST"), ("POST", "GET"), ("POST", "PUT")])
def test_a_credential_for_one_method_is_refused_on_another(made, used):
    from artemisd.auth import request_payload

    cred = root_credential(request_payload(made, "/v1/nodes/n1/corrections", b""))
    with pytest.raises(AuthError, match=f"method: made for {made}, used for {used}"):
        cred.verify(used, "/v1/nodes/n1/corrections", EMPTY)


def test_a_credential_for_one_body_is_refused_on_another():
    from artemisd.auth import request_payload

    cred = root_credential(request_payload("POST", "/v1/reports", b"[1]"))
    with pytest.raises(AuthError, match="body") as err:
        cred.verify("POST", "/v1/reports", body_digest(b"[2]"))
    assert "sha256" in str(err.value)
    cred.bind("POST", "/v1/reports")  # method and path are fine: only the body differs


def test_a_legacy_payload_is_accepted_on_reports_and_nowhere_else():
    legacy = body_digest(b"")
    ok = root_credential(body_digest(b"[1]"))
    assert ok.legacy and ok.verify("POST", "/v1/reports", body_digest(b"[1]")).root_side
    with pytest.raises(AuthError, match="body"):  # even there, only for the body it signs
        root_credential(body_digest(b"[1]")).verify("POST", "/v1/reports", body_digest(b"[2]"))
    for method, path in [("POST", "/v1/incidents/X/deny"), ("POST", "/v1/incidents/X/approve"),
                         ("GET", "/v1/nodes/n1/corrections"), ("POST", "/v1/nodes/n1/corrections/COR-1"),
                         ("GET", "/v1/reports"), ("POST", "/v1/reports?x=1"), ("POST", "/v1/reports/")]:
        with pytest.raises(AuthError, match="legacy") as err:
            root_credential(legacy).bind(method, path)
        assert err.value.status == 401 and "POST /v1/reports only" in str(err.value), (method, path)


# --- the same through the HTTP server (signed_body), a stand-in for munged ---------------------------


class PayloadAuth(MungeAuth):
    """``Authorization: Munge <uid>:<payload>``: munged's verdict without munged (the payload as decoded)."""

    def __init__(self):
        super().__init__(None, set(), set(), use_lib=False)

    async def check(self, header):
        scheme, _, rest = (header or "").partition(" ")
        if scheme != "Munge" or ":" not in rest:
            raise AuthError("missing Authorization: Munge <credential>")
        uid, _, payload = rest.partition(":")
        return self._judge(0, int(uid), int(uid), payload.encode(), "Success")


def test_the_server_binds_credentials_to_their_request(tmp_path):
    from aiohttp.test_utils import TestClient, TestServer

    from artemisd.auth import request_payload
    from artemisd.config import parse_config_text
    from artemisd.server import make_app
    from artemisd.service import Daemon
    from tests.unit.test_act import MemorySlurm

    event = b'[{"type":"node","v":1,"event":"health","node":"n1","time":1.0}]'

    async def scenario():
        daemon = Daemon(parse_config_text(f"StateDir={tmp_path}\nAuthType=none\n"),
                        MemorySlurm({"n1": "allocated"}))
        client = TestClient(TestServer(make_app(daemon, PayloadAuth()), host="127.0.0.1"))
        await client.start_server()
        try:
            async def call(method, path, body, payload):
                resp = await client.request(method, path, data=body, headers={"Authorization": f"Munge 0:{payload}"})
                return resp.status, (await resp.json()).get("error", "")

            get_corrections = request_payload("GET", "/v1/nodes/n1/corrections", b"")
            assert (await call("GET", "/v1/nodes/n1/corrections", b"", get_corrections))[0] == 200
            status, error = await call("POST", "/v1/incidents/X/deny", b"", get_corrections)
            assert status == 401 and "method" in error
            status, error = await call("POST", "/v1/incidents/X/deny", b"",
                                       request_payload("POST", "/v1/incidents/Y/deny", b""))
            assert status == 401 and "path" in error
            assert (await call("POST", "/v1/incidents/X/deny", b"",
                               request_payload("POST", "/v1/incidents/X/deny", b"")))[0] == 404  # passed auth
            status, error = await call("POST", "/v1/reports?x=1", event, request_payload("POST", "/v1/reports", event))
            assert status == 401 and "path" in error
            status, error = await call("POST", "/v1/reports", event, request_payload("POST", "/v1/reports", b"[]"))
            assert status == 401 and "body" in error
            assert (await call("POST", "/v1/reports", event, request_payload("POST", "/v1/reports", event)))[0] == 200
            # The legacy payload: on reports only.
            assert (await call("POST", "/v1/reports", event, body_digest(event)))[0] == 200
            for method, path in [("POST", "/v1/incidents/X/deny"), ("POST", "/v1/incidents/X/approve"),
                                 ("GET", "/v1/nodes/n1/corrections")]:
                status, error = await call(method, path, b"", EMPTY)
                assert status == 401 and "legacy" in error, (method, path, status, error)
            assert b"artemis_legacy_credentials_total 1.0" in daemon.metrics.render()
        finally:
            await client.close()
            daemon.store.close()

    asyncio.run(scenario())
