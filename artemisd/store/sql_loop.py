"""The shared SQL of the live loop's tables (``LoopSql``, a part of ``SqlStore``): actions and their
fencing, the leader lease and the instances, the audit log, directives, corrections, node evidence.

Written once for both backends, with ``?`` placeholders (store/sql_dialect.py).
"""

from __future__ import annotations

import json
import time
from typing import Any

from artemisd.control import actions
from artemisd.lease import LEADER, Fenced, Lease, next_lease, released
from artemisd.store.base import ActionRow
from artemisd.store.sql_dialect import SqlDialect

_LEASE_COLS = "name, holder, token, acquired, renewed, expires"
_ACTION_COLS = "id, incident, kind, target, params, status, attempts, next_try, detail"
_AUDIT_COLS = ("id", "time", "incident", "action", "who", "what", "why", "result")
_PROBE_COLS = ("id", "job", "step", "incident", "issued", "ranks_reported", "cost_ms")
_CORRECTION_COLS = ("id", "incident", "node", "kind", "gpu", "status", "detail")


class LoopSql(SqlDialect):
    """The ``StateStore`` methods of the live loop's tables, the same SQL on both backends."""

    # --- actions ----------------------------------------------------------

    def add_action(self, incident: str, kind: str, target: str | None, params: dict[str, Any],
                   status: str, now: float, fence: int | None = None) -> int:
        """A new action intent; with ``fence``, only while that is still the leader lease's token."""
        with self._tx():
            self._check_fence(fence)
            return self._insert_id("INSERT INTO actions(incident, kind, target, params, status, next_try, created, "
                                   "updated, token) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                                   (incident, kind, target, json.dumps(params), status, now, now, now, fence))

    def update_action(self, action_id: int, status: str, detail: str = "", next_try: float | None = None,
                      attempt: bool = False, fence: int | None = None) -> bool:
        """Move an action row to ``status``; False (nothing written) where its life cycle does not
        allow it from the status it is in (another writer got there first).

        Action rows move through the action table's life cycle (control/actions.py
        ``NEXT``).  ``running`` means "intent recorded, result not yet": after a
        crash it is re-run through the idempotent path.
        """
        came_from, arg = self._in(actions.came_from(status))
        with self._tx():
            self._check_fence(fence)
            # The casts say a NULL's type, which PostgreSQL cannot tell from COALESCE (a no-op in SQLite).
            cur = self._run("UPDATE actions SET status = ?, detail = ?, updated = ?, "
                            "next_try = COALESCE(CAST(? AS DOUBLE PRECISION), next_try), attempts = attempts + ?, "
                            f"token = COALESCE(CAST(? AS BIGINT), token) WHERE id = ? AND status {came_from}",
                            (status, detail, time.time(), next_try, 1 if attempt else 0, fence, action_id, arg))
            return cur.rowcount > 0

    def _check_fence(self, fence: int | None) -> None:
        """Inside a write: refuse it unless ``fence`` is still the leader lease's token.

        The lease row stays locked (``_SHARE_LOCK``) until this transaction
        ends, so a takeover waits for the write or the write sees the new
        token: never both.
        """
        if fence is None:
            return
        row = self._one(f"SELECT token, holder FROM leases WHERE name = ?{self._SHARE_LOCK}", (LEADER,))
        if row is None or row[0] != fence:
            raise Fenced(fence, row[0] if row else None, row[1] if row else None)

    def set_action_params(self, action_id: int, params: dict[str, Any]) -> None:
        with self._tx():
            self._run("UPDATE actions SET params = ?, updated = ? WHERE id = ?",
                      (json.dumps(params), time.time(), action_id))

    def _action_rows(self, sql: str, args: tuple[Any, ...]) -> list[ActionRow]:
        return [ActionRow(r[0], r[1], r[2], r[3], json.loads(r[4]), r[5], r[6], r[7], r[8])
                for r in self._all(f"SELECT {_ACTION_COLS} FROM actions {sql}", args)]

    def due_actions(self, now: float) -> list[ActionRow]:
        return self._action_rows(f"WHERE status IN {actions.SQL_DUE} AND next_try <= ? ORDER BY id", (now,))

    def actions_of(self, incident: str) -> list[ActionRow]:
        return self._action_rows("WHERE incident = ? ORDER BY id", (incident,))

    def action(self, action_id: int) -> ActionRow | None:
        rows = self._action_rows("WHERE id = ?", (action_id,))
        return rows[0] if rows else None

    def drain_actions(self) -> list[tuple[int, str, str, float]]:
        """(id, node, status, when) of every drain that may count toward a budget.

        ``when`` is when it was approved, else when it was decided: an approval
        given hours after the decision drains the node at approval time.
        """
        rows = self._all("SELECT id, target, status, created, params FROM actions WHERE kind = 'drain' AND "
                         f"status IN {actions.SQL_BUDGETED} ORDER BY id")
        return [(aid, target, status, float(json.loads(params).get("approved_at", created)))
                for aid, target, status, created, params in rows]

    def last_action_on(self, target: str, other_than: str) -> float | None:
        """When another incident last acted on ``target`` (cooldowns are between incidents; telling
        people acts on nothing)."""
        row = self._one("SELECT MAX(created) FROM actions WHERE target = ? AND incident != ? AND "
                        f"kind NOT IN {actions.SQL_TELL} AND status NOT IN {actions.SQL_NEVER_ACTED}",
                        (target, other_than))
        return row[0] if row else None

    # --- the leader lease (artemisd/lease.py) ------------------------------

    def _read_lease(self, name: str, lock: str = "") -> Lease | None:
        # Token 0: PostgreSQL's placeholder row of a lease never taken (_claim_lease); a lease taken has token >= 1.
        row = self._one(f"SELECT {_LEASE_COLS} FROM leases WHERE name = ?{lock}", (name,))
        return None if row is None or row[2] == 0 else Lease(*row)

    def _claim_lease(self, name: str) -> Lease | None:
        """Inside ``take_lease``: the lease as it is, locked until the transaction ends."""
        return self._read_lease(name, self._UPDATE_LOCK)

    def take_lease(self, name: str, holder: str, ttl: float) -> Lease:
        with self._tx():
            current = self._claim_lease(name)
            after = next_lease(current, name, holder, ttl, self.clock())
            if after != current:
                self._run(f"INSERT INTO leases({_LEASE_COLS}) VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT(name) "
                          "DO UPDATE SET holder = excluded.holder, token = excluded.token, "
                          "acquired = excluded.acquired, renewed = excluded.renewed, expires = excluded.expires",
                          (after.name, after.holder, after.token, after.acquired, after.renewed, after.expires))
        return after

    def lease(self, name: str) -> Lease | None:
        return self._read_lease(name)

    def release_lease(self, name: str, holder: str) -> None:
        with self._tx():
            current = self._read_lease(name, self._UPDATE_LOCK)
            after = released(current, holder, self.clock())
            if after is not None and after != current:
                self._run("UPDATE leases SET expires = ? WHERE name = ?", (after.expires, name))

    def heartbeat(self, instance: str, role: str, version: str, started: float) -> None:
        with self._tx():
            seen, now = self._clock_sql()
            self._run(f"INSERT INTO instances(instance, role, version, started, seen) VALUES (?, ?, ?, ?, {seen}) "
                      "ON CONFLICT(instance) DO UPDATE SET role = excluded.role, version = excluded.version, "
                      "started = excluded.started, seen = excluded.seen",
                      (instance, role, version, started, *now))

    def instances(self) -> list[dict[str, Any]]:
        now = self.clock()
        return [{"instance": r[0], "role": r[1], "version": r[2], "started": r[3], "seen_s_ago": round(now - r[4], 1)}
                for r in self._all("SELECT instance, role, version, started, seen FROM instances ORDER BY instance")]

    # --- audit ------------------------------------------------------------

    def audit(self, who: str, what: str, why: str = "", result: str = "", incident: str | None = None,
              action: int | None = None, now: float | None = None) -> None:
        with self._tx():
            self._run("INSERT INTO audit(time, incident, action, who, what, why, result) VALUES (?, ?, ?, ?, ?, ?, ?)",
                      (now if now is not None else time.time(), incident, action, who, what, why, result))

    def audit_log(self, incident: str | None = None) -> list[dict[str, Any]]:
        if incident is None:
            rows = self._all(f"SELECT {', '.join(_AUDIT_COLS)} FROM audit ORDER BY id")
        else:
            rows = self._all(f"SELECT {', '.join(_AUDIT_COLS)} FROM audit WHERE incident = ? ORDER BY id", (incident,))
        return [dict(zip(_AUDIT_COLS, row)) for row in rows]

    # --- directives -------------------------------------------------------

    def add_directive(self, directive_id: str, kind: str, job: str, step: str, incident: str | None,
                      body: dict[str, Any], now: float, expires: float | None) -> None:
        with self._tx():
            # A directive issued again is a new row, after every other (what SQLite's INSERT OR REPLACE
            # did): its columns not given go back to their defaults.
            self._run("DELETE FROM directives WHERE id = ?", (directive_id,))
            self._run("INSERT INTO directives(id, type, job, step, incident, body, issued, expires) "
                      "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                      (directive_id, kind, job, step, incident, json.dumps(body), now, expires))

    def directives_for(self, job: str, step: str, now: float) -> list[dict[str, Any]]:
        """Live directives of a job step: unexpired probes, and the latest rebalance."""
        rows = self._all("SELECT type, body, expires FROM directives WHERE job = ? AND step = ? "
                         f"ORDER BY issued, {self._DIRECTIVE_ORDER}", (job, step))
        out = [json.loads(body) for kind, body, expires in rows
               if kind == "probe" and (expires is None or expires > now)]
        rebalances = [json.loads(body) for kind, body, _ in rows if kind == "rebalance"]
        if rebalances:
            out.append(rebalances[-1])
        return out

    def probe_times(self, job: str) -> list[float]:
        return [t for (t,) in self._all(
            "SELECT issued FROM directives WHERE job = ? AND type = 'probe' ORDER BY issued", (job,))]

    def has_directive(self, directive_id: str) -> bool:
        return self._one("SELECT 1 FROM directives WHERE id = ?", (directive_id,)) is not None

    def probe_result(self, directive_id: str, cost_ms: float | None) -> None:
        with self._tx():
            self._run("UPDATE directives SET ranks_reported = ranks_reported + 1, cost_ms = cost_ms + ? "
                      "WHERE id = ?", (float(cost_ms or 0.0), directive_id))

    def probe_costs(self) -> list[dict[str, Any]]:
        return [dict(zip(_PROBE_COLS, row)) for row in self._all(
            f"SELECT {', '.join(_PROBE_COLS)} FROM directives WHERE type = 'probe' ORDER BY issued")]

    # --- corrections --------------------------------------------------------

    def add_correction(self, correction_id: str, incident: str, node: str, kind: str, gpu: int | None,
                       now: float) -> None:
        with self._tx():
            self._run("INSERT INTO corrections(id, incident, node, kind, gpu, status, created, updated) "
                      "VALUES (?, ?, ?, ?, ?, 'pending', ?, ?)", (correction_id, incident, node, kind, gpu, now, now))

    def corrections(self, node: str, status: str | None = "pending") -> list[dict[str, Any]]:
        sql = f"SELECT {', '.join(_CORRECTION_COLS)} FROM corrections WHERE node = ?"
        args: tuple[Any, ...] = (node,)
        if status is not None:
            sql += " AND status = ?"
            args += (status,)
        return [dict(zip(_CORRECTION_COLS, row)) for row in self._all(sql + " ORDER BY created", args)]

    def correction(self, correction_id: str) -> dict[str, Any] | None:
        row = self._one(f"SELECT {', '.join(_CORRECTION_COLS)} FROM corrections WHERE id = ?", (correction_id,))
        return dict(zip(_CORRECTION_COLS, row)) if row else None

    def set_correction(self, correction_id: str, status: str, detail: str) -> None:
        with self._tx():
            self._run("UPDATE corrections SET status = ?, detail = ?, updated = ? WHERE id = ?",
                      (status, detail, time.time(), correction_id))

    # --- root-side node evidence --------------------------------------------

    def set_node_evidence(self, node: str, received: float, uid: int | None, body: str) -> None:
        with self._tx():
            self._run("INSERT INTO node_evidence VALUES (?, ?, ?, ?) ON CONFLICT(node) DO UPDATE SET "
                      "received = excluded.received, uid = excluded.uid, body = excluded.body",
                      (node, received, uid, body))

    def node_evidence(self, node: str) -> tuple[float, dict[str, Any]] | None:
        row = self._one("SELECT received, body FROM node_evidence WHERE node = ?", (node,))
        return (row[0], json.loads(row[1])) if row else None
