"""The SQLite store: WAL, append-only audit, bounded history, ids across reopen."""

from __future__ import annotations

import json
import sqlite3

import pytest

from artemisd.store import Store, StoredIncident


def test_wal_and_ids_survive_reopen(tmp_path):
    store = Store(tmp_path / "a.db")
    assert store.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert store.next_id("incident", "INC-") == "INC-1"
    store.close()
    store = Store(tmp_path / "a.db")
    assert store.next_id("incident", "INC-") == "INC-2"


def test_audit_log_is_append_only(tmp_path):
    store = Store(tmp_path / "a.db")
    store.audit("uid 0", "approved drain n2", incident="INC-1")
    with pytest.raises(sqlite3.IntegrityError):
        store.db.execute("UPDATE audit SET who = 'someone else'")
    with pytest.raises(sqlite3.IntegrityError):
        store.db.execute("DELETE FROM audit")
    assert [a["who"] for a in store.audit_log("INC-1")] == ["uid 0"]


def test_window_history_is_bounded_per_job(tmp_path):
    store = Store(tmp_path / "a.db")
    rows = [(job, seq, "n1", 0.0, None, False, "{}") for job in ("1", "2") for seq in range(100)]
    rows.append(("1", None, "n1", 0.0, 0, True, "{}"))  # a node event of the job
    store.add_records(rows)
    assert store.prune_records("1", keep_windows=10) == 90
    windows = [w for (w,) in store.db.execute("SELECT window FROM records WHERE job = '1' AND window IS NOT NULL")]
    assert sorted(windows) == list(range(90, 100))
    assert store.db.execute("SELECT COUNT(*) FROM records WHERE job = '1' AND window IS NULL").fetchone()[0] == 1
    assert store.db.execute("SELECT COUNT(*) FROM records WHERE job = '2'").fetchone()[0] == 100


def test_incident_round_trip_and_action_intent(tmp_path):
    store = Store(tmp_path / "a.db")
    inc = StoredIncident("INC-3", "7", "0", "confirmed", "7|rank|2|n2|None|x", "A-1", 0, None, 300.0, True,
                         {"id": "INC-3"}, 1.0, 1.0)
    store.save_incident(inc)
    got = store.incident("INC-3")
    assert got.decide is True and got.baseline == 300.0 and got.body == {"id": "INC-3"}
    aid = store.add_action("INC-3", "drain", "n2", {"node": "n2"}, "queued", now=10.0)
    store.update_action(aid, "running", attempt=True)
    assert [a.id for a in store.due_actions(now=10.0)] == [aid]  # open intent is re-run after a crash
    assert store.drain_actions() == [(aid, "n2", "running", 10.0)]
    store.update_action(aid, "done", "drained")
    store.update_action(aid, "rolled_back", "undrain queued")
    later = store.add_action("INC-3", "drain", "n4", {"node": "n4", "approved_at": 50.0}, "pending_approval", now=20.0)
    denied = store.add_action("INC-3", "drain", "n5", {"node": "n5"}, "pending_approval", now=30.0)
    store.update_action(denied, "denied")
    # Budgets count rolled-back drains; an approved one from when it was approved; a denied one never.
    assert store.drain_actions() == [(aid, "n2", "rolled_back", 10.0), (later, "n4", "pending_approval", 50.0)]


def test_incident_queries_filter_in_sql(tmp_path):
    store = Store(tmp_path / "a.db")
    for n, (job, state, decide) in enumerate([("7", "confirmed", True), ("7", "escalated", False),
                                              ("8", "confirmed", False)]):
        store.save_incident(StoredIncident(f"INC-{n}", job, "0", state, "s", None, 0, None, None, decide,
                                           {}, float(n), float(n)))
    assert [i.id for i in store.incidents(states=["confirmed"], decide=True)] == ["INC-0"]
    assert [i.id for i in store.incidents(job="7")] == ["INC-0", "INC-1"]


def test_batch_rows_of_one_job_window_and_sender_merge_in_order_up_to_the_limit():
    """merge_batch_rows: what GroupCommit stores for requests of one window (a rank's or a node's)."""
    from artemisd.store import merge_batch_rows

    def batch(*ranks: int) -> str:
        return " " + json.dumps([{"rank": r} for r in ranks]) + "\n"  # as a body may come: spaces kept

    rows = [("1", 0, "n0", 5.0, 1000, False, batch(0, 1), 2),
            ("1", None, "n0", 5.0, 0, True, '{"type": "node"}'),  # not a batch: stays alone
            ("1", 0, "n1", 5.0, 1000, False, batch(2, 3), 2),
            ("1", 0, "n2", 5.0, 2000, False, batch(4), 1),  # another sender
            ("1", 1, "n1", 5.0, 1000, False, batch(5), 1),  # another window
            ("1", 0, "n3", 5.0, 1000, False, batch(6), 1)]
    merged, members = merge_batch_rows(rows, [[r] for r in range(len(rows))])
    assert [row[:6] + row[7:] for row in merged] == [("1", 0, None, 5.0, 1000, False, 5),
                                                     ("1", None, "n0", 5.0, 0, True, 0),
                                                     ("1", 0, "n2", 5.0, 2000, False, 1),
                                                     ("1", 1, "n1", 5.0, 1000, False, 1)]
    assert [r["rank"] for r in json.loads(merged[0][6])] == [0, 1, 2, 3, 6]
    assert members == [[0, 2, 5], [1], [3], [4]]
    assert merged[2][6] == batch(4)  # a row merged with nothing is stored as it came

    small, _ = merge_batch_rows(rows[:3], [[0], [1], [2]], limit=len(batch(0, 1)) + 1)
    assert [row[7] for row in small] == [2, 0, 2]  # over the limit: the next row starts its own
