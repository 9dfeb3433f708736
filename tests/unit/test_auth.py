"""Auth without munged: unmunge output parsing, trust levels, header checks.

The credential checks themselves (forged, replayed, payload != body digest,
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
        asyncio.run(auth.authenticate(header, b"[]"))
    assert err.value.status == 401


@pytest.mark.parametrize("use_lib", [True, False])
def test_munge_unreachable_is_a_503_not_a_pass(tmp_path, use_lib):
    auth = MungeAuth(str(tmp_path / "no-munged.socket"), set(), set(), unmunge="/nonexistent/unmunge",
                     use_lib=use_lib)
    with pytest.raises(AuthError) as err:
        asyncio.run(auth.authenticate("Munge MUNGE:abc:", b"[]"))
    assert err.value.status == 503


def test_none_trusts_everyone_local():
    principal = asyncio.run(NoAuth().authenticate(None, b""))
    assert principal.root_side and principal.admin
