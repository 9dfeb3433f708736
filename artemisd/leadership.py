"""Which of the daemons sharing one state database leads: the leader lease, taken, renewed and given up.

Only the leader analyses, decides and acts; a standby stores what it is sent and follows the
leader's analysis.  Every instance asks for the lease every turn: the holder renews it, the others
learn who holds it.  The lease's token is the fence every ledger write carries (``Ledger.fence``),
so a leader deposed between renewing and writing writes nothing more (``lease.Fenced``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog

from artemisd import __version__
from artemisd.lease import LEADER, Lease
from artemisd.ledger import Ledger
from artemisd.metrics import Metrics
from artemisd.store import StateStore

log = structlog.get_logger("artemisd")


class Leadership:
    def __init__(self, store: StateStore, ledger: Ledger, metrics: Metrics, instance: str,
                 lease_time: Callable[[], float]):
        self.store = store
        self.ledger = ledger
        self.metrics = metrics
        # An instance is its host and listen address: two live processes cannot both listen there, and a
        # daemon restarted after kill -9 renews its own lease instead of waiting it out.
        self.instance = instance
        self.lease: Lease | None = None
        self.store_down = False  # the last lease request met an unreachable database (logged once)
        self.started = time.time()
        self._lease_time = lease_time  # the configuration's LeaseTime, as reloaded

    @property
    def leading(self) -> bool:
        return self.ledger.fence is not None

    @property
    def role(self) -> str:
        return "leader" if self.leading else "standby"

    def lead(self) -> bool:
        """Take or renew the leader lease; True while this instance leads.

        A database that cannot be reached makes this instance a standby until it can: it cannot prove
        it still leads.
        """
        was = self.ledger.fence
        try:
            lease = self.store.take_lease(LEADER, self.instance, self._lease_time())
        except Exception as err:  # noqa: BLE001 - any database failure: not provably the leader
            if was is not None:
                log.warning("leader lease not renewed: standing by", instance=self.instance, error=str(err))
            elif not self.store_down:
                log.warning("state database unreachable: standing by until it answers", instance=self.instance,
                            error=str(err))
            self.store_down = True
            self.stand_by()
            return False
        if self.store_down:
            log.info("state database reachable again", instance=self.instance)
            self.store_down = False
        # take_lease renews or takes it for this holder whenever it can, and
        # otherwise returns another's unexpired lease: the holder alone says.
        leading = lease.holder == self.instance
        self.lease = lease
        self.ledger.fence = lease.token if leading else None
        self.metrics.leader.set(1 if leading else 0)
        try:
            self.store.heartbeat(self.instance, self.role, __version__, self.started)
        except Exception as err:  # noqa: BLE001 - only `artemis status` misses this turn
            log.warning("heartbeat not recorded", error=str(err))
        if self.ledger.fence != was:
            if leading:
                log.info("leading", instance=self.instance, token=lease.token)
                self.ledger.audit(None, "daemon", "leader lease taken", f"instance {self.instance}",
                                  f"token {lease.token}")
            else:
                log.info("standing by", instance=self.instance, leader=lease.holder, token=lease.token)
        return leading

    def stand_by(self) -> None:
        """Not the leader (any more): nothing is written under the old token."""
        self.ledger.fence = None
        self.metrics.leader.set(0)

    def give_up(self) -> None:
        """A clean stop: the lease is released so a standby need not wait it out."""
        if not self.leading:
            return
        try:
            self.store.release_lease(LEADER, self.instance)
        except Exception as err:  # noqa: BLE001 - the lease expires on its own
            log.warning("leader lease not released", error=str(err))
        self.ledger.fence = None

    async def keep(self, stop: asyncio.Event) -> None:
        """While leading, renew the lease every LeaseTime/3 between turns too.

        A turn waits for its Slurm calls (threads, each up to SlurmTimeout, which may be longer than
        LeaseTime): renewed only once per turn, the lease of a leader waiting on a slow scontrol would
        run out and a standby would start the same action again.  This only renews while leading;
        taking the lease over is the turn's, which first follows the records another leader stored.
        """
        interval = max(0.2, self._lease_time() / 3)
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), interval)
            except asyncio.TimeoutError:
                pass
            if self.leading and not stop.is_set():
                self.lead()
