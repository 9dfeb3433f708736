"""Who sent a request: munge credentials, checked against the body they sign.

Every request carries ``Authorization: Munge <credential>`` whose payload is
the lowercase hex sha256 of the request body.  munged decodes it (``unmunge``
against the configured socket) and tells us the sender's uid and gid; it also
refuses a credential it has decoded before (status 17, "Replayed credential")
and one past its time-to-live, so a captured request cannot be sent again.
A payload that is not the body's digest means the body was swapped under a
valid credential: rejected.

Trust levels (``Principal``):

* ``root_side`` uid 0 or the SlurmUser: prolog, epilog and node-check events
  sent with these credentials are evidence a job owner cannot forge;
* ``admin``     root_side, or a uid listed in ``AdminUids``: may approve/deny;
* anyone else may report only for jobs they own (checked with Slurm by the
  caller, ``Daemon.owns``).

With ``AuthType=none`` (allowed only on a loopback Listen address) every
caller is trusted as root_side and admin: it is meant for a single-user test
bed, and the config refuses it anywhere else.
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass

UNMUNGE_TIMEOUT_S = 10.0
STATUS_REPLAYED = 17


class AuthError(Exception):
    """The request's credentials are missing, forged, replayed or not good for it (HTTP 401/403)."""

    def __init__(self, message: str, status: int = 401):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Principal:
    uid: int | None
    gid: int | None
    root_side: bool
    admin: bool

    @property
    def who(self) -> str:
        return "anonymous" if self.uid is None else f"uid {self.uid}"


TRUSTED_LOCAL = Principal(uid=None, gid=None, root_side=True, admin=True)


def body_digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def parse_unmunge(output: bytes) -> tuple[int, int | None, int | None, bytes]:
    """(status, uid, gid, payload) from ``unmunge -N -k STATUS,UID,GID`` output."""
    head, _, payload = output.partition(b"\n\n")
    meta: dict[str, str] = {}
    for line in head.decode("ascii", "replace").splitlines():
        key, _, value = line.partition(":")
        meta[key.strip().upper()] = value.strip()

    def number(key: str) -> int | None:
        value = meta.get(key, "")
        return int(value) if value.lstrip("-").isdigit() else None

    status = number("STATUS")
    return (status if status is not None else -1), number("UID"), number("GID"), payload


class MungeAuth:
    def __init__(self, socket: str | None, root_uids: set[int], admin_uids: set[int],
                 unmunge: str = "unmunge"):
        self.socket = socket
        self.root_uids = root_uids | {0}
        self.admin_uids = admin_uids
        self.unmunge = unmunge

    def principal(self, uid: int, gid: int | None) -> Principal:
        root_side = uid in self.root_uids
        return Principal(uid, gid, root_side, root_side or uid in self.admin_uids)

    async def authenticate(self, header: str | None, body: bytes) -> Principal:
        if not header:
            raise AuthError("missing Authorization: Munge <credential>")
        scheme, _, credential = header.strip().partition(" ")
        if scheme.lower() != "munge" or not credential.strip():
            raise AuthError("Authorization must be 'Munge <credential>'")
        argv = [self.unmunge, "-N", "-k", "STATUS,UID,GID"]
        if self.socket:
            argv += ["-S", self.socket]
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(credential.strip().encode("ascii", "replace")),
                                              UNMUNGE_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError) as exc:
            raise AuthError(f"cannot reach munge to check the credential: {exc}", status=503) from None
        status, uid, gid, payload = parse_unmunge(out)
        if status == STATUS_REPLAYED:
            raise AuthError("replayed munge credential")
        if proc.returncode != 0 or status != 0 or uid is None:
            detail = err.decode("utf-8", "replace").strip().splitlines()
            raise AuthError(f"invalid munge credential: {detail[-1] if detail else f'status {status}'}")
        if payload.strip().decode("ascii", "replace").lower() != body_digest(body):
            raise AuthError("credential payload is not the sha256 of the request body")
        return self.principal(uid, gid)


class NoAuth:
    """AuthType=none: loopback-only test beds; everyone is trusted."""

    async def authenticate(self, header: str | None, body: bytes) -> Principal:
        return TRUSTED_LOCAL
