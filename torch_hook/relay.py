"""A node's ranks send their window reports in one request: the first local rank relays its siblings'.

A request costs artemisd far more than the report in it (1.75 ms of CPU
against ~0.03 ms on the 2-core development machine, docs/benchmarks.md
"Scale"), so a cluster's ranks each posting their own report every window
is most of what they cost the daemons; a node's 8 in one request cost 6x
less.  On each node, the probe of local rank 0 (``LOCAL_RANK``, else
``SLURM_LOCALID``) binds a Unix datagram socket of its user, job step and
node; the other local ranks hand it their reports, one datagram per batch,
never waiting.  No relay listening, its socket full, or a batch too large:
the sibling posts the batch itself, as every rank did before.  The relay's
sender posts its own reports and its siblings' together and hands each
sibling the daemon's reply (its directives) on the sibling's own socket.

Trust.  The sockets live in a directory only their user can enter (0700,
owned by the user, checked with ``lstat`` so a symlink is never followed),
and the kernel's ``SCM_CREDENTIALS`` name every datagram's sender: only a
process of the same user is relayed or heard from.  Relayed reports of
another job or step are dropped.  The daemon checks a relayed report as any
other: the relay's munge credential names the same user, and Slurm must say
that user owns the job and that the report's node is in its allocation.

Linux only (``SO_PASSCRED``); elsewhere, and with ``ARTEMIS_RELAY=0``, every
rank posts its own reports.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import select
import socket
import stat
import struct
import tempfile
from pathlib import Path
from typing import Any

MAX_DATAGRAM = 256 << 10  # a batch larger than this is posted by its own rank
_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid
_CMSG_SPACE = socket.CMSG_SPACE(_CREDENTIALS.size) if hasattr(socket, "CMSG_SPACE") else 0
_IDENT = re.compile(r"[0-9]{1,10}\.[0-9]{1,6}")  # a sibling's "<pid>.<local rank>", part of a path
_GONE = (errno.ENOENT, errno.ECONNREFUSED, errno.EAGAIN, errno.EWOULDBLOCK, errno.ENOBUFS, errno.EMSGSIZE,
         errno.EACCES, errno.EPERM, errno.ENOTDIR)


def readable(sock: socket.socket, timeout_s: float) -> bool:
    """Something to read on ``sock`` within ``timeout_s``.  poll, not select: a training process may
    hold over FD_SETSIZE (1,024) descriptors, and select() refuses a higher one (ValueError)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(timeout_s * 1000))


def private_directory(uid: int, base: str | None = None) -> Path | None:
    """``<tmp>/artemis-<uid>``, created 0700; None unless it is a real directory of ``uid`` that no one
    else may enter."""
    try:
        path = Path(base or tempfile.gettempdir()) / f"artemis-{uid}"
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return None
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or st.st_mode & 0o077:
        return None
    return path


def sweep_abandoned(directory: Path, most: int = 1024) -> int:
    """Remove the sockets in ``directory`` that no process listens on any more; how many went.

    A rank killed by a signal (``scancel``, the OOM killer, a launcher tearing down its ranks) never
    removes its socket, and ``$TMPDIR`` may outlive the job.  A bound socket accepts ``connect()``; a
    socket file whose process has gone refuses it, and only that is removed.  The inode is compared
    before and after, so a path that a new run binds again in between is left alone.  Bounded: a
    directory of thousands is swept a part at a time, at each relay's start."""
    removed = 0
    try:
        entries = os.scandir(directory)
    except OSError:
        return 0
    with entries, socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as probe:
        for count, entry in enumerate(entries):
            if count >= most:
                break
            try:
                before = entry.stat(follow_symlinks=False)
                if not stat.S_ISSOCK(before.st_mode):
                    continue
                probe.connect(entry.path)
            except ConnectionRefusedError:
                try:
                    after = os.lstat(entry.path)
                    if (after.st_ino, after.st_dev) == (before.st_ino, before.st_dev):
                        os.unlink(entry.path)
                        removed += 1
                except OSError:
                    pass
            except OSError:  # listening (connected), another user's, or gone already
                pass
    return removed


class NodeRelay:
    """One rank's end of its node's relay (of its job step on its node): the relay itself (local rank
    0) or a sibling."""

    def __init__(self, directory: Path, job: str, job_step: str, node: str, local_rank: int):
        self.uid = os.getuid()
        self._pid = os.getpid()  # a forked child that exits must not remove this process's socket
        self.local_rank = local_rank
        self.job, self.job_step = job, job_step
        # Every local rank of the job step names the same relay; short: a socket path has ~100 bytes.
        stem = hashlib.sha256(f"{job}\0{job_step}\0{node}".encode()).hexdigest()[:20]
        self._stem = str(directory / stem)
        self.relay_path = f"{self._stem}.relay"
        # A sibling's socket is named for its process and local rank: local ranks can repeat on a
        # node (several torchrun under one srun), and a second bind would take the first's replies.
        self.ident = f"{os.getpid()}.{local_rank}"
        self.own_path = self.relay_path if local_rank == 0 else f"{self._stem}.{self.ident}"
        self._sock: socket.socket | None = None
        self.refused = 0  # datagrams from another user, or not a batch of this job step: dropped
        self.last_error: str | None = None

    @classmethod
    def for_rank(cls, job: str, job_step: str, node: str, local_rank: int | None,
                 base: str | None = None) -> NodeRelay | None:
        """The relay end of a rank, or None where relaying cannot be trusted or is not known to help."""
        if local_rank is None or local_rank < 0 or not hasattr(socket, "SO_PASSCRED") or not _CMSG_SPACE:
            return None
        directory = private_directory(os.getuid(), base)
        if directory is None:
            return None
        return cls(directory, job, job_step, node, local_rank)

    @property
    def is_relay(self) -> bool:
        return self.local_rank == 0

    def open(self) -> bool:
        """Bind this end's socket (a stale one of an earlier run is replaced); False: it cannot be."""
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        except OSError as err:  # out of descriptors, say: this rank posts its own reports
            self.last_error = f"relay socket: {err}"
            return False
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            self._unlink_stale(self.own_path)
            if self.is_relay:
                sweep_abandoned(Path(self.own_path).parent)
            sock.bind(self.own_path)
            os.chmod(self.own_path, 0o600)
            # Non-blocking: with a timeout, CPython polls before every call, so even a
            # MSG_DONTWAIT receive would wait it out.
            sock.setblocking(False)
        except OSError as err:
            sock.close()
            self.last_error = f"relay socket {self.own_path}: {err}"
            return False
        self._sock = sock
        return True

    @staticmethod
    def _unlink_stale(path: str) -> None:
        try:
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                os.unlink(path)
        except FileNotFoundError:
            pass

    def stop_listening(self) -> None:
        """No new datagram can reach this end (its path is gone); what already did is still read."""
        if os.getpid() != self._pid:
            return
        try:
            os.unlink(self.own_path)
        except OSError:
            pass

    def close(self) -> None:
        self.stop_listening()
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    # -- receiving (both ends) ----------------------------------------------
    def receive(self, wait: bool = True) -> bytes | None:
        """The next datagram of this user (waiting up to 0.5 s, or not at all); None: none came.
        Another user's datagram is dropped and counted (``refused``)."""
        sock = self._sock
        if sock is None:
            return None
        while True:
            try:
                if wait and not readable(sock, 0.5):
                    return None
                data, ancillary, _, _ = sock.recvmsg(MAX_DATAGRAM, _CMSG_SPACE)
            except (BlockingIOError, InterruptedError):
                return None
            except OSError as err:
                self.last_error = f"relay receive: {err}"
                return None
            if self._sender_uid(ancillary) == self.uid:
                return data
            self.refused += 1

    @staticmethod
    def _sender_uid(ancillary: list[tuple[int, int, bytes]]) -> int | None:
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(payload) >= _CREDENTIALS.size:
                return _CREDENTIALS.unpack_from(payload)[1]
        return None

    # -- the relay ------------------------------------------------------------
    def handed(self, data: bytes) -> tuple[str, list[dict[str, Any]]] | None:
        """A sibling's datagram -> (its ``ident``, its reports), or None (counted) if it is not a batch
        of window reports of this job step."""
        try:
            message = json.loads(data)
            sibling, reports = message["from"], message["reports"]
            if not (isinstance(sibling, str) and _IDENT.fullmatch(sibling)) or not isinstance(reports, list) \
                    or not reports:
                raise ValueError("not a batch")
            for report in reports:
                if not (isinstance(report, dict) and str(report.get("job")) == self.job
                        and str(report.get("step", "0")) == self.job_step):
                    raise ValueError("a report of another job step")
        except (ValueError, KeyError, TypeError):
            self.refused += 1
            return None
        return sibling, reports

    def answer(self, siblings: set[str], reply: bytes) -> None:
        """The daemon's reply to the siblings (their ``ident``) whose reports went with it; one that is
        gone misses it."""
        sock = self._sock
        if sock is None or len(reply) > MAX_DATAGRAM:
            return
        for sibling in sorted(siblings):
            path = f"{self._stem}.{sibling}"
            try:
                sock.sendto(reply, path)
            except OSError:
                pass

    # -- a sibling ------------------------------------------------------------
    def hand_over(self, reports: list[dict[str, Any]]) -> bool:
        """Give the relay a batch, never waiting; False: the caller posts it itself."""
        sock = self._sock
        if sock is None:
            return False
        data = json.dumps({"from": self.ident, "reports": reports}, separators=(",", ":")).encode()
        if len(data) > MAX_DATAGRAM:
            return False
        try:
            sock.sendto(data, self.relay_path)
        except OSError as err:
            if err.errno not in _GONE:
                self.last_error = f"relay hand-over: {err}"
            return False
        return True
