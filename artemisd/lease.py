"""Leadership: which artemisd decides and acts, as a lease in the shared database.

Several artemisd may share one PostgreSQL database (issue 12); exactly one of
them decides and acts at a time.  Like a Kubernetes ``Lease`` or Airflow's
scheduler heartbeat, leadership is a row: a holder, an expiry, and a
*fencing token* that grows by one every time the lease changes hands.  The
holder renews it every turn; when it stops renewing (killed, host lost, cut
off from the database) the lease expires and the next instance to ask takes
it, with the next token.

The token is what keeps a deposed leader from acting: every action intent is
written with the writer's token, in the same transaction that checks it is
still the lease's (``Fenced`` otherwise), and an action is claimed the same
way before anything is asked of Slurm.  A leader that froze past its expiry
and wakes up finds its token stale on its first write and stops; the new
leader resumes from the intents and Slurm's own node state, as after a
restart.

This module is the pure part: given the lease as stored (or none) and who asks
when, the lease afterwards.  The store applies it in one locked transaction;
times are the database server's clock where there is one (PostgreSQL), so
hosts' clocks need not agree.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

LEADER = "leader"  # the one lease the daemon takes


class Fenced(RuntimeError):
    """A write carried a fencing token that is no longer the lease's: the writer was deposed."""

    def __init__(self, token: int, current: int | None, holder: str | None):
        self.token, self.current, self.holder = token, current, holder
        super().__init__(f"fencing token {token} is stale: the lease is at {current} (held by {holder}); "
                         f"this instance is no longer the leader")


@dataclass(frozen=True)
class Lease:
    name: str
    holder: str
    token: int
    acquired: float  # when this holder took it
    renewed: float
    expires: float

    def held_by(self, holder: str, now: float) -> bool:
        return self.holder == holder and now < self.expires

    def age(self, now: float) -> float:
        """Seconds since the holder last renewed it."""
        return max(0.0, now - self.renewed)


def next_lease(current: Lease | None, name: str, holder: str, ttl: float, now: float) -> Lease:
    """The lease after ``holder`` asks for it at ``now``.

    Free (never taken, expired, or released): ``holder`` takes it with the next
    token, even if it held it before (it may have been deposed in between, and
    whatever it wrote with the old token must stay refused).  Held by
    ``holder``: renewed, same token.  Held by another and not expired:
    unchanged.
    """
    if current is None:
        return Lease(name, holder, 1, now, now, now + ttl)
    if now >= current.expires:
        return Lease(name, holder, current.token + 1, now, now, now + ttl)
    if current.holder == holder:
        return replace(current, renewed=now, expires=now + ttl)
    return current


def released(current: Lease | None, holder: str, now: float) -> Lease | None:
    """The lease after ``holder`` gives it up (a clean stop: a standby need not wait out the TTL)."""
    if current is None or not current.held_by(holder, now):
        return current
    return replace(current, expires=now)
