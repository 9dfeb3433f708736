"""Who sent a request: munge credentials, checked against the body they sign.

Every request carries ``Authorization: Munge <credential>`` whose payload is
the lowercase hex sha256 of the request body.  The credential travels in the
header so it can be judged before the body is read: ``check`` decodes it and
yields a ``Credential`` (who, and the digest it vouches for); the server then
streams the body against its size limit and ``Credential.verify`` compares the
digest.  A client without a valid credential never gets a byte of its body
buffered.  munged decodes it (``unmunge``
against the configured socket) and tells us the sender's uid and gid; it also
refuses a credential it has decoded before (status 17, "Replayed credential")
and one past its time-to-live, so a captured request cannot be sent again.
A payload that is not the body's digest means the body was swapped under a
valid credential: rejected.  Decoding uses libmunge through ctypes when
``libmunge.so.2`` loads (no fork per request), else the ``unmunge`` command.

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
import ctypes
import hashlib
import threading
from dataclasses import dataclass

UNMUNGE_TIMEOUT_S = 10.0
STATUS_REPLAYED = 17  # EMUNGE_CRED_REPLAYED
STATUS_SOCKET = 6  # EMUNGE_SOCKET: munged not reachable


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


@dataclass(frozen=True)
class Credential:
    """A decoded credential: who sent it and the body digest it was made for.

    ``digest`` None means the auth mode checks no body (``AuthType=none``).
    """

    principal: Principal
    digest: str | None

    def verify(self, digest: str | None) -> Principal:
        """The principal, if ``digest`` (sha256 hex of the body received) is the one signed."""
        if self.digest is not None and self.digest != digest:
            raise AuthError("credential payload is not the sha256 of the request body")
        return self.principal


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


class LibMunge:
    """``munge_decode`` through ctypes: ~0.1 ms a credential instead of an ``unmunge`` fork.

    A munge context is not thread-safe, so each worker thread gets its own.
    """

    MUNGE_OPT_SOCKET = 8  # munge.h enum munge_opt

    def __init__(self, socket: str | None):
        self.socket = socket
        lib = ctypes.CDLL("libmunge.so.2")
        lib.munge_ctx_create.restype = ctypes.c_void_p
        lib.munge_decode.restype = ctypes.c_int
        lib.munge_decode.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                                     ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_uint),
                                     ctypes.POINTER(ctypes.c_uint)]
        lib.munge_strerror.restype = ctypes.c_char_p
        lib.munge_strerror.argtypes = [ctypes.c_int]
        self._lib = lib
        self._libc = ctypes.CDLL(None)
        self._libc.free.argtypes = [ctypes.c_void_p]
        self._local = threading.local()

    def _ctx(self) -> int:
        ctx = getattr(self._local, "ctx", None)
        if ctx is None:
            ctx = self._lib.munge_ctx_create()
            if not ctx:
                raise OSError("munge_ctx_create failed")
            if self.socket:
                # munge_ctx_set is variadic: the socket path travels as char*.
                err = self._lib.munge_ctx_set(ctypes.c_void_p(ctx), ctypes.c_int(self.MUNGE_OPT_SOCKET),
                                              ctypes.c_char_p(self.socket.encode()))
                if err != 0:
                    raise OSError(f"munge_ctx_set(socket) failed: {err}")
            self._local.ctx = ctx
        return ctx

    def decode(self, credential: str) -> tuple[int, int | None, int | None, bytes, str]:
        """(status, uid, gid, payload, message) — status 0 is success, 17 a replay."""
        buf, length = ctypes.c_void_p(), ctypes.c_int()
        uid, gid = ctypes.c_uint(), ctypes.c_uint()
        err = self._lib.munge_decode(credential.encode("ascii", "replace"), self._ctx(), ctypes.byref(buf),
                                     ctypes.byref(length), ctypes.byref(uid), ctypes.byref(gid))
        try:
            payload = ctypes.string_at(buf.value, length.value) if buf.value else b""
        finally:
            if buf.value:
                self._libc.free(buf)
        message = self._lib.munge_strerror(err).decode("utf-8", "replace")
        # On some errors (e.g. a replay) munge still fills in uid/gid; only success counts.
        return err, uid.value, gid.value, payload, message


class MungeAuth:
    def __init__(self, socket: str | None, root_uids: set[int], admin_uids: set[int],
                 unmunge: str = "unmunge", use_lib: bool = True):
        self.socket = socket
        self.root_uids = root_uids | {0}
        self.admin_uids = admin_uids
        self.unmunge = unmunge
        self.lib: LibMunge | None = None
        if use_lib:
            try:
                self.lib = LibMunge(socket)
            except OSError:
                self.lib = None  # no libmunge.so.2: the unmunge command does the same

    def principal(self, uid: int, gid: int | None) -> Principal:
        root_side = uid in self.root_uids
        return Principal(uid, gid, root_side, root_side or uid in self.admin_uids)

    async def authenticate(self, header: str | None, body: bytes) -> Principal:
        return (await self.check(header)).verify(body_digest(body))

    async def check(self, header: str | None) -> Credential:
        """Decode the ``Authorization`` header; the body is checked later with ``Credential.verify``."""
        if not header:
            raise AuthError("missing Authorization: Munge <credential>")
        scheme, _, credential = header.strip().partition(" ")
        if scheme.lower() != "munge" or not credential.strip():
            raise AuthError("Authorization must be 'Munge <credential>'")
        if self.lib is not None:
            try:
                status, uid, gid, payload, message = await asyncio.to_thread(self.lib.decode, credential.strip())
            except OSError as exc:
                raise AuthError(f"cannot reach munge to check the credential: {exc}", status=503) from None
            return self._judge(status, uid, gid, payload, message)
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
        detail = err.decode("utf-8", "replace").strip().splitlines()
        if proc.returncode != 0 and status == 0:
            status = proc.returncode
        return self._judge(status, uid, gid, payload, detail[-1] if detail else f"status {status}")

    def _judge(self, status: int, uid: int | None, gid: int | None, payload: bytes, message: str) -> Credential:
        if status == STATUS_REPLAYED:
            raise AuthError("replayed munge credential")
        if status == STATUS_SOCKET:
            raise AuthError(f"cannot reach munge to check the credential: {message}", status=503)
        if status != 0 or uid is None:
            raise AuthError(f"invalid munge credential: {message}")
        return Credential(self.principal(uid, gid), payload.strip().decode("ascii", "replace").lower())


class NoAuth:
    """AuthType=none: loopback-only test beds; everyone is trusted."""

    async def authenticate(self, header: str | None, body: bytes) -> Principal:
        return TRUSTED_LOCAL

    async def check(self, header: str | None) -> Credential:
        return Credential(TRUSTED_LOCAL, None)
