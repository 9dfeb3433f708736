"""MUNGE credentials for requests to artemisd (stdlib only).

The credential's payload binds it to one request, on one line of ASCII::

    artemis-request-v2 <METHOD> <PATH> <SHA256>

(the HTTP method; the request-target as sent: path and ``?query``, byte for
byte; the lowercase hex SHA-256 of the body, of ``b""`` for a GET), so the
daemon refuses it on any other method, path or body (artemisd/auth.py).
``request_payload`` is a copy of ``artemisd.auth.request_payload``: this
package may not import artemisd (it runs inside training ranks, stdlib and
torch only); tests/unit/test_auth.py holds the copies to the same output.

libmunge is used through ctypes when ``libmunge.so.2`` loads; otherwise the
``munge`` command, with a timeout.  ``credential()`` returns None when neither
works (no munged): the caller sends unauthenticated and counts it.
"""

from __future__ import annotations

import ctypes
import hashlib
import re
import shutil
import subprocess

MUNGE_OPT_SOCKET = 8  # munge.h enum munge_opt
_EMUNGE_SUCCESS = 0

REQUEST_PAYLOAD_VERSION = "artemis-request-v2"
_METHOD = re.compile(r"[A-Z]{1,16}")
_PATH = re.compile(r"/[\x21-\x7e]{0,8191}")  # printable ASCII, no space: one field of the payload


def body_digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def request_payload(method: str, path: str, body: bytes) -> str:
    """``artemis-request-v2 METHOD PATH SHA256``: what a credential for this one request signs.

    A copy of ``artemisd.auth.request_payload`` (same checks, same output).
    """
    if not _METHOD.fullmatch(method):
        raise ValueError(f"HTTP method must be upper-case letters, got {method!r}")
    if not _PATH.fullmatch(path):
        raise ValueError(f"request path must start with / and be printable ASCII without spaces, got {path!r}")
    return f"{REQUEST_PAYLOAD_VERSION} {method} {path} {body_digest(body)}"


class MungeSigner:
    """Not thread-safe (a munge context is per thread): one per sender thread."""

    def __init__(self, socket: str | None = None, timeout_s: float = 2.0):
        self.socket = socket
        self.timeout_s = timeout_s
        self.last_error: str | None = None
        self._lib = self._ctx = self._libc = None
        try:
            lib = ctypes.CDLL("libmunge.so.2")
            lib.munge_encode.restype = ctypes.c_int
            lib.munge_encode.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
            lib.munge_ctx_create.restype = ctypes.c_void_p
            lib.munge_ctx_destroy.argtypes = [ctypes.c_void_p]
            lib.munge_strerror.restype = ctypes.c_char_p
            lib.munge_strerror.argtypes = [ctypes.c_int]
            ctx = lib.munge_ctx_create()
            if ctx and socket:
                # munge_ctx_set is variadic: the socket path travels as char*.
                err = lib.munge_ctx_set(ctypes.c_void_p(ctx), ctypes.c_int(MUNGE_OPT_SOCKET), ctypes.c_char_p(socket.encode()))
                if err != _EMUNGE_SUCCESS:
                    raise OSError(f"munge_ctx_set(socket) failed: {err}")
            self._libc = ctypes.CDLL(None)
            self._libc.free.argtypes = [ctypes.c_void_p]
            self._lib, self._ctx = lib, ctx
        except OSError as err:
            self.last_error = f"libmunge: {err}"
        self._binary = shutil.which("munge")

    @property
    def available(self) -> bool:
        return self._lib is not None or self._binary is not None

    def credential(self, method: str, path: str, body: bytes) -> str | None:
        """A credential for ``method`` on ``path`` (path and query, as sent) with ``body``; None: no munge."""
        return self.sign(request_payload(method, path, body))

    def sign(self, text: str) -> str | None:
        """A credential whose payload is ``text`` (ASCII); ``credential`` is what a request needs."""
        payload = text.encode("ascii")
        if self._lib is not None:
            out = ctypes.c_void_p()
            err = self._lib.munge_encode(ctypes.byref(out), self._ctx, payload, len(payload))
            if err == _EMUNGE_SUCCESS and out.value:
                try:
                    return ctypes.string_at(out.value).decode()
                finally:
                    self._libc.free(out)
            self.last_error = f"munge_encode: {self._lib.munge_strerror(err).decode(errors='replace')}"
        if self._binary is not None:
            cmd = [self._binary, "--string", payload.decode()]
            if self.socket:
                cmd += ["--socket", self.socket]
            try:
                done = subprocess.run(cmd, capture_output=True, timeout=self.timeout_s, check=False)
            except (OSError, subprocess.TimeoutExpired) as err:
                self.last_error = f"munge command: {err}"
                return None
            if done.returncode == 0 and done.stdout.strip():
                return done.stdout.decode().strip()
            self.last_error = f"munge command: {done.stderr.decode(errors='replace').strip()}"
        return None

    def close(self) -> None:
        if self._lib is not None and self._ctx:
            self._lib.munge_ctx_destroy(self._ctx)
            self._ctx = None
