"""Who sent a request: munge credentials, bound to the one request they were made for.

Every request that changes something carries ``Authorization: Munge <credential>``
whose payload names the request it was made for, on one line of ASCII::

    artemis-request-v2 <METHOD> <PATH> <SHA256>

* ``artemis-request-v2``: the format's version (a later format gets a new one);
* ``<METHOD>``: the HTTP method as sent, upper case (``GET``, ``POST``);
* ``<PATH>``: the request-target as sent on the request line: the path and,
  if any, ``?`` and the query, byte for byte (aiohttp's ``request.raw_path``):
  not decoded, not normalised, no trailing slash added or taken away;
* ``<SHA256>``: the lowercase hex sha256 of the body as sent (a GET signs the
  empty body, ``e3b0c442…b855``);

the fields separated by single spaces, no newline at the end.  ``request_payload``
builds it, and every signer goes through it (torch_hook and the node programs,
which may not import artemisd, carry a copy of the same few lines; a unit test
holds the copies to the same output).  So a credential vouches for one method
on one path with one body: root's credential for the node check's
``GET /v1/nodes/n1/corrections`` is not good for ``POST /v1/incidents/X/deny``,
though both bodies are empty.  The version 1 payload, the body's sha256
alone, bound nothing else, and that is what issue 27 (item 6) was.

The credential travels in the header so it can be judged before the body is
read: ``check`` decodes it and yields a ``Credential`` (who, and the request
it vouches for); the server compares method and path at once
(``Credential.bind``, before a byte of the body is buffered), then streams the
body against its size limit and compares the digest (``Credential.verify``).
A mismatch is a 401 naming what differed: method, path or body.  munged
decodes the credential (``unmunge`` against the configured socket) and tells
us the sender's uid and gid; it also refuses a credential it has decoded
before (status 17, "Replayed credential") and one past its time-to-live, so a
captured request cannot be sent again to the same munged.  Decoding uses
libmunge through ctypes when ``libmunge.so.2`` loads (no fork per request),
else the ``unmunge`` command.

Legacy payloads (rolling upgrade).  A probe inside a job that started before
the upgrade keeps its old code until the job ends, and signs the body's sha256
alone.  Such a payload is still accepted on ``POST /v1/reports`` and nowhere
else (``LEGACY_ROUTES``).  That is safe because:

* it vouches for that exact body, so nothing but that body can be sent with it;
* anyone able to mint it (its signer: munge proves the uid) could send that
  body to ``POST /v1/reports`` under a v2 credential anyway, with the same
  uid, judged by the same rules (a user only for their own jobs, root-side
  evidence only from root or SlurmUser);
* a legacy credential captured from another request (the old node check's
  ``GET .../corrections`` or a correction acknowledgement, an old
  ``artemis approve``) carries that request's body: the empty body or a
  ``{"status": ...}`` object, which ``/v1/reports`` refuses as a batch, so it
  stores nothing;
* munge's replay cache and time-to-live stop its re-use, as for any credential.

What it does not give: a legacy payload is refused on approve/deny and on the
corrections endpoints, the requests whose meaning is in their method and
path, not their body.  The allowance can be removed once every job that
started before the nodes got the new torch_hook has ended (the partitions'
``MaxTime`` after the last node was upgraded); ``artemis_legacy_credentials_total``
in ``/metrics`` counts what it still lets in, and staying at zero for that
long says it is no longer used.

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
import re
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


REQUEST_PAYLOAD_VERSION = "artemis-request-v2"
# Where a legacy payload (the body's sha256 alone, what probes of jobs started
# before the upgrade still send) is accepted: (method, path) exactly.  See the
# module's docstring for why this one is safe and when it can go.
LEGACY_ROUTES: frozenset[tuple[str, str]] = frozenset({("POST", "/v1/reports")})

_METHOD = re.compile(r"[A-Z]{1,16}")
_PATH = re.compile(r"/[\x21-\x7e]{0,8191}")  # printable ASCII, no space: one field of the payload
_DIGEST = re.compile(r"[0-9a-f]{64}")
_SHOWN = 120  # characters of a signed path quoted back in an error


def body_digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def payload_for_digest(method: str, path: str, digest: str) -> str:
    """``artemis-request-v2 METHOD PATH SHA256`` for a body whose sha256 hex is ``digest``."""
    if not _METHOD.fullmatch(method):
        raise ValueError(f"HTTP method must be upper-case letters, got {method!r}")
    if not _PATH.fullmatch(path):
        raise ValueError(f"request path must start with / and be printable ASCII without spaces, got {path!r}")
    if not _DIGEST.fullmatch(digest):
        raise ValueError(f"body digest must be 64 lowercase hex digits, got {digest!r}")
    return f"{REQUEST_PAYLOAD_VERSION} {method} {path} {digest}"


def request_payload(method: str, path: str, body: bytes) -> str:
    """The munge payload that binds a credential to one request: the one builder every signer uses.

    ``path`` is the request-target exactly as it goes on the request line
    (path, and ``?query`` if any); ``body`` the bytes sent (``b""`` for a GET).
    Copies for code that may not import artemisd: ``torch_hook.munge`` and
    ``prolog_epilog/artemis_node.py`` (held equal by tests/unit/test_auth.py).
    """
    return payload_for_digest(method, path, body_digest(body))


@dataclass(frozen=True)
class SignedRequest:
    """What a credential's payload vouches for.  ``method``/``path`` None: a legacy payload (body only)."""

    method: str | None
    path: str | None
    digest: str

    @property
    def legacy(self) -> bool:
        return self.method is None


def _shown(text: str) -> str:
    return repr(text if len(text) <= _SHOWN else text[:_SHOWN] + "...")


def parse_payload(payload: bytes) -> SignedRequest:
    """The request a decoded credential's payload names; ``AuthError`` for anything else."""
    try:
        text = payload.decode("ascii")
    except UnicodeDecodeError:
        raise AuthError("credential payload is not ASCII: expected "
                        f"'{REQUEST_PAYLOAD_VERSION} METHOD PATH SHA256'") from None
    legacy = text.strip().lower()
    if _DIGEST.fullmatch(legacy):
        return SignedRequest(None, None, legacy)
    fields = text.split(" ")
    if fields[0] != REQUEST_PAYLOAD_VERSION:
        if fields[0].startswith("artemis-request-"):
            raise AuthError(f"credential payload version {_shown(fields[0])} is not {REQUEST_PAYLOAD_VERSION}")
        raise AuthError(f"credential payload is neither '{REQUEST_PAYLOAD_VERSION} METHOD PATH SHA256' "
                        "nor a body sha256")
    if (len(fields) != 4 or not _METHOD.fullmatch(fields[1]) or not _PATH.fullmatch(fields[2])
            or not _DIGEST.fullmatch(fields[3])):
        raise AuthError(f"malformed credential payload: expected '{REQUEST_PAYLOAD_VERSION} METHOD PATH SHA256'")
    return SignedRequest(fields[1], fields[2], fields[3])


def judge_request(signed: SignedRequest, method: str, path: str) -> None:
    """Refuse (``AuthError``) a credential made for another method or path; the body is judged apart."""
    if signed.legacy:
        if (method, path) not in LEGACY_ROUTES:
            allowed = ", ".join(f"{m} {p}" for m, p in sorted(LEGACY_ROUTES))
            raise AuthError(f"credential payload is a bare body sha256 (legacy), accepted on {allowed} only, "
                            f"not on {method} {_shown(path)}: sign "
                            f"'{REQUEST_PAYLOAD_VERSION} METHOD PATH SHA256'")
        return
    if signed.method != method:
        raise AuthError(f"credential does not match the request's method: made for {signed.method}, "
                        f"used for {method}")
    if signed.path != path:
        raise AuthError(f"credential does not match the request's path: made for {_shown(signed.path or '')}, "
                        f"used for {_shown(path)}")


def judge_body(signed: SignedRequest, digest: str | None) -> None:
    if signed.digest != digest:
        raise AuthError("credential does not match the request's body: the sha256 it signs is not "
                        "the sha256 of the body received")


@dataclass(frozen=True)
class Credential:
    """A decoded credential: who sent it and the request it was made for.

    ``signed`` None means the auth mode checks nothing (``AuthType=none``).
    """

    principal: Principal
    signed: SignedRequest | None

    @property
    def legacy(self) -> bool:
        return self.signed is not None and self.signed.legacy

    def bind(self, method: str, path: str) -> None:
        """Refuse now a credential made for another method or path: before the body is read."""
        if self.signed is not None:
            judge_request(self.signed, method, path)

    def verify(self, method: str, path: str, digest: str | None) -> Principal:
        """The principal, if the credential was made for this method, path and body (sha256 hex ``digest``)."""
        if self.signed is not None:
            judge_request(self.signed, method, path)
            judge_body(self.signed, digest)
        return self.principal


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

    async def authenticate(self, header: str | None, method: str, path: str, body: bytes) -> Principal:
        """The sender of a whole request (``check``, then ``Credential.verify``)."""
        return (await self.check(header)).verify(method, path, body_digest(body))

    async def check(self, header: str | None) -> Credential:
        """Decode the ``Authorization`` header; the request is judged later with ``Credential.bind``/``verify``."""
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
        return Credential(self.principal(uid, gid), parse_payload(payload))


class NoAuth:
    """AuthType=none: loopback-only test beds; everyone is trusted."""

    async def authenticate(self, header: str | None, method: str, path: str, body: bytes) -> Principal:
        return TRUSTED_LOCAL

    async def check(self, header: str | None) -> Credential:
        return Credential(TRUSTED_LOCAL, None)
