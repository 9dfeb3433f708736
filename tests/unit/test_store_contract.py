"""One contract for the state store, run over both backends: SQLite and PostgreSQL.

Every public method of ``StateStore`` is exercised with the same calls and the
same expected answers on ``Store`` (SQLite) and ``PostgresStore`` (a real
PostgreSQL server started by tests/unit/pg.py; skipped with the reason where
none can be started).  Then what only one side has: SQLite files from before
schema versions, the password file, StateURL's checks.
"""

from __future__ import annotations

import itertools
import json
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from artemisd.config import ConfigError, parse_config_text
from artemisd.lease import LEADER, Fenced
from artemisd.store import SCHEMA, SCHEMA_VERSION, SchemaError, StateStore, Store, StoredIncident, open_store
from tests.unit.pg import PASSWORD, PgServer, PgUnavailable

_names = itertools.count(1)


@pytest.fixture(scope="module")
def pg_server() -> Iterator[PgServer]:
    pytest.importorskip("psycopg", reason="psycopg is not installed (the test and postgres extras)")
    try:
        server = PgServer().start()
    except PgUnavailable as err:
        pytest.skip(f"no PostgreSQL server: {err}")
    try:
        yield server
    finally:
        server.stop()


@dataclass
class Backend:
    name: str
    open: Callable[[], StateStore]  # the same database each time (a reopen)
    refused: type[BaseException]  # what a statement the schema forbids raises

    def raw(self, store: StateStore, sql: str) -> list[tuple]:
        return list(store.db.execute(sql).fetchall())  # type: ignore[attr-defined]


@pytest.fixture(params=["sqlite", "postgresql"])
def backend(request, tmp_path) -> Iterator[Backend]:
    if request.param == "sqlite":
        yield Backend("sqlite", lambda: Store(tmp_path / "a.db"), sqlite3.IntegrityError)
        return
    import psycopg

    from artemisd.store.postgres import PostgresStore

    server: PgServer = request.getfixturevalue("pg_server")
    name = f"contract{next(_names)}"
    url = server.create_database(name)
    opened: list[StateStore] = []

    def reopen() -> StateStore:
        opened.append(PostgresStore(url, password=PASSWORD))
        return opened[-1]

    try:
        yield Backend("postgresql", reopen, psycopg.errors.RaiseException)
    finally:
        for store in opened:
            store.close()
        server.drop_database(name)


@pytest.fixture
def store(backend) -> Iterator[StateStore]:
    opened = backend.open()
    yield opened
    opened.close()


def incident(n: int, job: str = "7", state: str = "confirmed", decide: bool = True, created: float = 1.0,
             **body) -> StoredIncident:
    return StoredIncident(f"INC-{n}", job, "0", state, f"{job}|rank|{n}", None, 0, None, None, decide,
                          body or {"id": f"INC-{n}"}, created, created)


# --- schema and ids ---------------------------------------------------------------


def test_ids_count_per_name_and_survive_reopen(backend):
    store = backend.open()
    assert store.schema_version() == SCHEMA_VERSION
    assert [store.next_id("incident", "INC-") for _ in range(3)] == ["INC-1", "INC-2", "INC-3"]
    assert store.next_id("correction", "COR-") == "COR-1"
    store.close()
    store = backend.open()
    assert store.schema_version() == SCHEMA_VERSION  # migrated once, not again
    assert store.next_id("incident", "INC-") == "INC-4"
    store.close()


def test_a_database_from_a_newer_artemisd_is_refused(backend):
    store = backend.open()
    store.db.execute("INSERT INTO schema_version VALUES (%d, 0)" % (SCHEMA_VERSION + 1))  # type: ignore[attr-defined]
    store.close()
    with pytest.raises(SchemaError, match=f"schema version {SCHEMA_VERSION + 1}, newer"):
        backend.open()


# --- records ------------------------------------------------------------------------


def test_records_come_back_byte_for_byte_in_order(store):
    bodies = ['{"b": 1, "a": 2}', '{ "spaced" :  true }', '{"name": "ü\\u00fc ✓"}', '{"x": 1.0000000000000002}']
    rows = [("1", w, "n1", 1e9 + w / 3, 1000 + w, False, body) for w, body in enumerate(bodies)]
    rows.append(("1", None, "n2", 1e9 + 9.25, 0, True, '{"event": "xid"}'))  # a node event of the job
    rows.append((None, None, "n3", 1e9 + 9.5, None, True, "{}"))  # a node event of no job
    seqs = store.add_records(rows)
    assert seqs == list(range(seqs[0], seqs[0] + len(rows)))
    got = list(store.records())
    assert [r.seq for r in got] == seqs
    assert [r.body for r in got] == [row[-1] for row in rows]
    assert [(r.received, r.uid, r.root) for r in got] == [(row[3], row[4], row[5]) for row in rows]
    assert store.record_count() == len(rows)
    assert store.window_records("1") == [json.loads(b) for b in bodies]
    more = store.add_records([("2", 0, "n1", 2e9, None, False, "{}")])
    assert more == [seqs[-1] + 1]
    assert store.add_records([]) == []


def test_records_replay_in_order_past_a_page(store):
    rows = [(str(n % 3), n, "n1", float(n), None, False, json.dumps({"n": n})) for n in range(2500)]
    for chunk in range(0, 2500, 1000):
        store.add_records(rows[chunk:chunk + 1000])
    assert [json.loads(r.body)["n"] for r in store.records()] == list(range(2500))


def test_records_replay_in_order_in_pages_bounded_by_bytes(backend, store, monkeypatch):
    """A batch row holds a window of every rank: PostgreSQL pages by bytes as well as rows (SQLite's cursor
    is lazy row by row), and a row larger than a page is a page of its own."""
    if backend.name == "postgresql":
        import artemisd.store.postgres
        monkeypatch.setattr(artemisd.store.postgres, "_RECORDS_PAGE_BYTES", 200)
    bodies = [batch(w, ranks) for w, ranks in enumerate([1, 2, 12, 1, 1, 1, 30, 2])]
    store.add_records([("1", w, None, float(w), None, False, body, body.count("{")) for w, body in enumerate(bodies)])
    assert [(r.body, r.items) for r in store.records()] == [(b, b.count("{")) for b in bodies]
    assert [r.body for r in store.records(after=next(store.records()).seq + 2)] == bodies[3:]


def test_records_between_two_seqs_less_those_skipped(store):
    seqs = store.add_records([("1", n, "n1", float(n), None, False, json.dumps({"n": n})) for n in range(6)])
    assert [r.seq for r in store.records(after=seqs[0], upto=seqs[4], skip={seqs[2], 10**12})] == \
        [seqs[1], seqs[3], seqs[4]]
    assert [r.seq for r in store.records(after=seqs[3])] == seqs[4:]


@pytest.mark.parametrize("held_rows", [1, 2], ids=["one row", "several rows"])
def test_rows_commit_in_seq_order_across_instances(backend, held_rows):
    """Any instance stores reports and the leader reads what it did not store by "seq above
    the last it read": a row committed after a higher seq is visible would never be read.
    Here one instance's insert is held for a second (a trigger) while another stores a row;
    the second row's seq comes after the first's, and it is not stored before the first.
    One row and several take different statements (the one-row one; the general one)."""
    if backend.name == "sqlite":
        pytest.skip("SQLite has one writer at a time by its own lock")
    slow, fast, reader = backend.open(), backend.open(), backend.open()
    try:
        with slow.db.transaction():  # type: ignore[attr-defined]
            slow.db.execute("CREATE FUNCTION held() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "  # type: ignore[attr-defined]
                            "IF NEW.job = 'slow' THEN PERFORM pg_sleep(1); END IF; RETURN NEW; END $$")
            slow.db.execute("CREATE TRIGGER held BEFORE INSERT ON records FOR EACH ROW EXECUTE FUNCTION held()")  # type: ignore[attr-defined]
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(slow.add_records, [("slow", 0, "n1", 1.0, None, False, "{}"),
                                                   ("also", 0, "n1", 1.0, None, False, "{}")][:held_rows])
            time.sleep(0.3)  # the slow insert has drawn its seq and sleeps in its trigger
            [second] = fast.add_records([("fast", 0, "n2", 2.0, None, False, "{}")])
            seen = [r.seq for r in reader.records()]
            held = first.result()
        assert max(held) < second
        assert seen == [*held, second]  # never the later seq alone
    finally:
        slow.close(), fast.close(), reader.close()


def test_the_analysed_mark_is_the_leaders_and_never_goes_back(backend):
    a, b = backend.open(), backend.open()
    try:
        assert a.analysed_through() == 0
        token_a = a.take_lease(LEADER, "a", ttl=300).token
        a.set_analysed_through(5, token_a)
        a.set_analysed_through(3, token_a)  # a late write of an older mark
        assert b.analysed_through() == 5
        a.release_lease(LEADER, "a")
        token_b = b.take_lease(LEADER, "b", ttl=300).token
        with pytest.raises(Fenced):
            a.set_analysed_through(9, token_a)  # deposed: it cannot say what the new leader analysed
        b.set_analysed_through(7, token_b)
        assert a.analysed_through() == 7
    finally:
        a.close(), b.close()


def test_the_newest_window_rows_up_to_a_number_of_reports(store):
    batch = lambda w, n: (("1", w, None, float(w), None, False,  # noqa: E731
                           json.dumps([{"w": w, "rank": r} for r in range(n)]), n))
    store.add_records([batch(0, 4), ("1", 1, "n1", 1.0, None, False, json.dumps({"w": 1, "rank": 0})),
                       batch(2, 4), ("2", 0, "n1", 2.0, None, False, "{}"), batch(3, 4),
                       ("1", None, "n1", 3.0, None, True, json.dumps({"type": "node"}))])
    rows, left_out, _ = store.recent_window_records("1", 8)  # windows 2 and 3: 8 reports; window 1's would be a 9th
    assert [r["w"] for r in rows] == [2] * 4 + [3] * 4 and left_out == 5
    rows, left_out, _ = store.recent_window_records("1", 9 + 3)  # window 0's four would be 13
    assert [r["w"] for r in rows] == [1] + [2] * 4 + [3] * 4 and left_out == 4
    rows, left_out, _ = store.recent_window_records("1", 9 + 4)
    assert [r["w"] for r in rows] == [0] * 4 + [1] + [2] * 4 + [3] * 4 and left_out == 0
    rows, left_out, _ = store.recent_window_records("1", 2)  # the newest row whatever its size
    assert [r["w"] for r in rows] == [3] * 4 and left_out == 9
    assert store.recent_window_records("nope", 5) == ([], 0, None)
    # Paged, newest first: each page is below the oldest row of the one before it, whole rows.
    seen, before, pages = [], None, 0
    while pages < 10:
        rows, left_out, oldest = store.recent_window_records("1", 5, before=before)
        if not rows:
            break
        seen[:0] = [r["w"] for r in rows]
        pages, before = pages + 1, oldest
        if not left_out:
            break
    assert seen == [0] * 4 + [1] + [2] * 4 + [3] * 4 and pages == 3  # [3], [1, 2], [0]
    assert store.recent_window_records("1", 100, before=0) == ([], 0, None)


def test_jobs_last_seen_and_highest_window(store):
    store.add_records([("1", 5, "n1", 10.0, None, False, "{}"), ("1", 3, "n1", 11.0, None, False, "{}"),
                       ("2", None, "n1", 12.0, 0, True, "{}")])
    store.add_records([("1", None, "n1", 20.0, 0, True, "{}")])  # a node event keeps the last window
    jobs = {j["job"]: j for j in store.jobs()}
    assert (jobs["1"]["first_seen"], jobs["1"]["last_seen"], jobs["1"]["last_window"]) == (11.0, 20.0, 5)
    assert jobs["2"]["last_window"] is None
    assert store.job_last_seen("1") == 20.0 and store.job_last_seen("nope") is None
    assert [j["job"] for j in store.jobs()] == ["1", "2"]  # most recently seen first


def test_job_owner_and_partition(store):
    store.set_job_owner("9", 1001, "gpu")
    store.add_records([("8", 1, "n1", 5.0, None, False, "{}")])
    store.add_records([("9", 1, "n1", 6.0, None, False, "{}")])
    store.set_job_owner("9", 1002, "gpu-large")  # a job moved by a person keeps its history
    assert store.job_partition("9") == "gpu-large" and store.job_partition("8") is None
    assert store.job_partition("nope") is None
    nine = next(j for j in store.jobs() if j["job"] == "9")
    assert (nine["user_id"], nine["partition"], nine["last_seen"], nine["last_window"]) == (1002, "gpu-large", 6.0, 1)
    store.set_job_owner("10", 1003, "cpu")  # known to Slurm, never reported: last of all
    assert [j["job"] for j in store.jobs()] == ["9", "8", "10"]


def test_window_history_is_bounded_per_job(store):
    rows = [(job, seq, "n1", 0.0, None, False, json.dumps({"w": seq})) for job in ("1", "2") for seq in range(100)]
    rows.append(("1", None, "n1", 0.0, 0, True, '{"event": 1}'))
    store.add_records(rows)
    assert store.prune_records("1", keep_windows=10) == 90
    assert store.prune_records("1", keep_windows=10) == 0
    assert store.prune_records("unknown", keep_windows=10) == 0
    assert [w["w"] for w in store.window_records("1")] == list(range(90, 100))
    assert store.record_count() == 10 + 1 + 100  # the node event stays with the job


def test_forget_job_drops_its_records_and_throughput(store):
    store.add_records([("1", 0, "n1", 0.0, None, False, "{}"), ("2", 0, "n1", 0.0, None, False, "{}")])
    store.add_throughput("1", "0", 0, 100.0, 8)
    store.add_throughput("2", "0", 0, 90.0, 8)
    assert store.jobs_with_records(["1", "2", "3"]) == {"1", "2"}
    store.forget_job("1")
    assert store.record_count() == 1 and store.window_records("1") == []
    assert store.jobs_with_records(["1", "2", "3"]) == {"2"} and store.jobs_with_records([]) == set()
    assert store.throughput("1") == [] and store.throughput("2") == [("0", 0, 90.0)]


def test_quarantine_moves_records_out_of_the_replay(store):
    seqs = store.add_records([("1", w, "n1", float(w), 1000, False, json.dumps({"w": w})) for w in range(4)])
    assert store.quarantine([(seqs[1], "bad window"), (seqs[2], "x" * 5000), (10 ** 9, "gone")], now=50.0) == 2
    assert [json.loads(r.body)["w"] for r in store.records()] == [0, 3]
    rows = store.quarantine_rows()
    assert [r["seq"] for r in rows] == [seqs[2], seqs[1]]  # newest first
    assert rows[1] == {"seq": seqs[1], "item": None, "job": "1", "node": "n1", "uid": 1000, "reason": "bad window",
                       "quarantined": 50.0, "body": '{"w": 1}'}
    assert len(rows[0]["reason"]) == 2000
    assert store.quarantine_rows(limit=1)[0]["seq"] == seqs[2]
    assert store.quarantined() == 2
    store.quarantine([(seqs[0], "later")])
    assert store.quarantined() == 3


def batch(window: int, ranks: int = 3) -> str:
    return "[" + ", ".join(json.dumps({"w": window, "rank": r}) for r in range(ranks)) + "]"


def test_a_batch_row_holds_one_windows_reports_as_sent(store):
    rows = [("1", 0, None, 1.0, 1000, False, batch(0), 3), ("1", None, "n1", 2.0, 0, True, '{"event": 1}'),
            ("1", 1, "n2", 3.0, 1000, False, batch(1, 2), 2)]
    seqs = store.add_records(rows)
    got = list(store.records())
    assert [(r.seq, r.body, r.items, r.skipped) for r in got] == [
        (seqs[0], batch(0), 3, frozenset()), (seqs[1], '{"event": 1}', 0, frozenset()),
        (seqs[2], batch(1, 2), 2, frozenset())]
    assert store.record_count() == 6
    assert store.window_records("1") == [{"w": 0, "rank": r} for r in range(3)] + [{"w": 1, "rank": r} for r in range(2)]
    assert store.prune_records("1", 0) == 2  # windows 0 and 1 (the node event stays)
    assert store.record_count() == 1


def test_a_batchs_item_is_quarantined_alone_and_once(store):
    seqs = store.add_records([("1", 0, "n1", 1.0, 1000, False, batch(0), 3),
                              ("1", 1, "n1", 2.0, 1000, False, batch(1), 3)])
    assert store.quarantine_items([(seqs[0], 1, "bad rank"), (seqs[0], 1, "again"), (10 ** 9, 0, "gone"),
                                   (seqs[0], 2, "bad too")], now=7.0) == 2
    assert store.quarantine_items([(seqs[0], 1, "seen by a standby too")]) == 0  # idempotent
    first = next(store.records())
    assert first.body == batch(0) and first.skipped == {1, 2}
    assert store.record_count() == 4 and store.quarantined() == 2
    assert store.window_records("1") == [{"w": 0, "rank": 0}] + [{"w": 1, "rank": r} for r in range(3)]
    assert store.quarantine_rows() == [
        {"seq": seqs[0], "item": 2, "job": "1", "node": "n1", "uid": 1000, "reason": "bad too",
         "quarantined": 7.0, "body": json.dumps({"w": 0, "rank": 2})},
        {"seq": seqs[0], "item": 1, "job": "1", "node": "n1", "uid": 1000, "reason": "bad rank",
         "quarantined": 7.0, "body": json.dumps({"w": 0, "rank": 1})}]
    # The whole row later: its items not skipped yet are what it adds.
    assert store.quarantine([(seqs[0], "unreadable")]) == 1
    assert store.quarantined() == 3 and store.record_count() == 3
    assert [r["item"] for r in store.quarantine_rows()] == [2, 1, None]


def test_postgresql_compresses_batch_bodies_with_lz4(pg_server):
    """A 100k-rank window is ~100 MB of JSON in batch rows; PostgreSQL's default TOAST compression (pglz)
    cost the server 1.7 CPU-s per 100k reports, lz4 0.6 (docs/benchmarks.md)."""
    from artemisd.store.postgres import PostgresStore

    url = pg_server.create_database("lz4")
    store = PostgresStore(url, password=PASSWORD)
    try:
        store.add_records([("1", 0, None, 1.0, 0, True, batch(0, 20_000), 20_000)])
        (method,) = store.db.execute("SELECT attcompression FROM pg_attribute WHERE attrelid = 'records'::regclass "
                                     "AND attname = 'body'").fetchone()
        (used,) = store.db.execute("SELECT pg_column_compression(body) FROM records").fetchone()
        assert (method, used) == ("l", "lz4")
        assert store.window_records("1")[-1] == {"w": 0, "rank": 19_999}
    finally:
        store.close()
        pg_server.drop_database("lz4")


def test_nothing_quarantined_yet(store):
    assert store.quarantined() == 0 and store.quarantine_rows() == []
    assert store.quarantine([]) == 0


def test_throughput_replaces_a_window_and_filters_by_step(store):
    store.add_throughput("1", "0", 2, 100.0, 8)
    store.add_throughput("1", "0", 1, 99.5, 8)
    store.add_throughput("1", "1", 1, 50.0, 4)
    store.add_throughput("1", "0", 2, 101.25, 8)  # the window measured again
    assert store.throughput("1", "0") == [("0", 1, 99.5), ("0", 2, 101.25)]
    assert sorted(store.throughput("1")) == [("0", 1, 99.5), ("0", 2, 101.25), ("1", 1, 50.0)]
    assert [w for _, w, _ in store.throughput("1")] == [1, 1, 2]


# --- incidents ----------------------------------------------------------------------


def test_incident_round_trip_and_update(store):
    inc = StoredIncident("INC-3", "7", "0", "confirmed", "7|rank|2|n2|None|x", "A-1", 0, None, 300.0, True,
                         {"id": "INC-3", "ratio": 1.0000000000000002, "nodes": ["n2"], "ü": None}, 1.5, 1.5)
    store.save_incident(inc)
    got = store.incident("INC-3")
    assert got == inc  # every field, the body decoded, updated as stamped by save_incident
    assert isinstance(got.decide, bool)
    inc.state, inc.plan_step, inc.action_window, inc.decide, inc.step = "acting", 2, 40, False, None
    inc.body = {"id": "INC-3", "state": "acting"}
    store.save_incident(inc)
    got = store.incident("INC-3")
    assert (got.state, got.plan_step, got.action_window, got.decide, got.step, got.body) == (
        "acting", 2, 40, False, None, {"id": "INC-3", "state": "acting"})
    assert got.created == 1.5 and got.updated == inc.updated
    assert store.incident("INC-404") is None


def test_incident_queries_filter_and_order(store):
    for n, (job, state, decide, created) in enumerate([("7", "confirmed", True, 5.0), ("7", "escalated", False, 1.0),
                                                       ("8", "confirmed", False, 5.0)]):
        store.save_incident(incident(n, job, state, decide, created))
    for n in (10, 9):  # same time: by the id's number, not its text
        store.save_incident(incident(n, "9", "resolved", False, 7.0))
    assert [i.id for i in store.incidents()] == ["INC-1", "INC-0", "INC-2", "INC-9", "INC-10"]
    assert [i.id for i in store.incidents(states=["confirmed"], decide=True)] == ["INC-0"]
    assert [i.id for i in store.incidents(states=("confirmed", "escalated"), job="7")] == ["INC-1", "INC-0"]
    assert [i.id for i in store.incidents(decide=False, job="8")] == ["INC-2"]
    assert store.incidents(states=[]) == []
    assert store.incident_counts() == {"confirmed": 2, "escalated": 1, "resolved": 2}


# --- actions ------------------------------------------------------------------------


def test_action_intent_retries_and_params(store):
    aid = store.add_action("INC-3", "drain", "n2", {"node": "n2"}, "queued", now=10.0)
    row = store.action(aid)
    assert (row.incident, row.kind, row.target, row.params, row.status, row.attempts, row.next_try, row.detail) == (
        "INC-3", "drain", "n2", {"node": "n2"}, "queued", 0, 10.0, "")
    store.update_action(aid, "running", attempt=True)
    assert [a.id for a in store.due_actions(now=10.0)] == [aid]  # open intent is re-run after a crash
    assert store.due_actions(now=9.9) == []
    store.update_action(aid, "running", "slurm down", next_try=25.0, attempt=True)
    row = store.action(aid)
    assert (row.attempts, row.next_try, row.detail) == (2, 25.0, "slurm down")
    store.update_action(aid, "running", "slurm down")  # next_try kept when not given
    assert store.action(aid).next_try == 25.0 and store.action(aid).attempts == 2
    store.set_action_params(aid, {"node": "n2", "approved_by": "uid 0", "approved_at": 30.5})
    assert store.action(aid).params == {"node": "n2", "approved_by": "uid 0", "approved_at": 30.5}
    other = store.add_action("INC-4", "escalate", "7", {}, "pending_approval", now=11.0)
    store.update_action(aid, "done", "drained")
    assert store.due_actions(now=100.0) == []  # pending approval is not due, done is not open
    assert [a.id for a in store.actions_of("INC-3")] == [aid] and [a.id for a in store.actions_of("INC-4")] == [other]
    assert store.actions_of("INC-5") == [] and store.action(10 ** 6) is None
    later = store.add_action("INC-3", "requeue", "7", {}, "queued", now=12.0)
    assert later > aid and [a.id for a in store.actions_of("INC-3")] == [aid, later]


def test_an_action_row_moves_only_along_its_life_cycle(store):
    """The action table's NEXT, enforced by the store: a move from the wrong status is not written."""
    waiting = store.add_action("INC-3", "drain", "n2", {"node": "n2"}, "pending_approval", now=10.0)
    assert store.update_action(waiting, "running", "not approved yet") is False
    assert store.update_action(waiting, "done") is False
    assert (store.action(waiting).status, store.action(waiting).detail) == ("pending_approval", "")
    assert store.update_action(waiting, "denied", "denied by uid 0") is True
    assert store.update_action(waiting, "queued", "approved too late") is False  # a denial is final
    assert store.action(waiting).status == "denied"
    ran = store.add_action("INC-3", "drain", "n4", {"node": "n4"}, "queued", now=11.0)
    for status in ("running", "running", "done", "rolled_back"):
        assert store.update_action(ran, status) is True
    for status in ("done", "running", "queued", "failed"):
        assert store.update_action(ran, status) is False  # rolled back stays rolled back
    assert store.action(ran).status == "rolled_back"


def test_drains_counted_toward_budgets(store):
    aid = store.add_action("INC-3", "drain", "n2", {"node": "n2"}, "queued", now=10.0)
    store.update_action(aid, "running", attempt=True)
    assert store.drain_actions() == [(aid, "n2", "running", 10.0)]
    store.update_action(aid, "done", "drained")
    store.update_action(aid, "rolled_back", "undrain queued")
    later = store.add_action("INC-3", "drain", "n4", {"node": "n4", "approved_at": 50.0}, "pending_approval", now=20.0)
    denied = store.add_action("INC-3", "drain", "n5", {"node": "n5"}, "pending_approval", now=30.0)
    store.update_action(denied, "denied")
    store.add_action("INC-3", "requeue", "7", {}, "done", now=31.0)
    # Budgets count rolled-back drains; an approved one from when it was approved; a denied one never.
    assert store.drain_actions() == [(aid, "n2", "rolled_back", 10.0), (later, "n4", "pending_approval", 50.0)]


def test_last_action_on_a_target_by_another_incident(store):
    assert store.last_action_on("n2", "INC-1") is None
    store.add_action("INC-1", "drain", "n2", {}, "done", now=10.0)
    store.add_action("INC-2", "drain", "n2", {}, "queued", now=20.0)
    store.add_action("INC-3", "escalate", "n2", {}, "done", now=30.0)  # telling a person is not acting
    store.add_action("INC-9", "notify", "n2", {}, "done", now=35.0)  # nor is an all-clear
    for n, status in enumerate(("denied", "skipped", "proposed")):
        store.add_action(f"INC-{n + 4}", "drain", "n2", {}, status, now=40.0 + n)
    assert store.last_action_on("n2", "INC-1") == 20.0
    assert store.last_action_on("n2", "INC-2") == 10.0
    assert store.last_action_on("n3", "INC-1") is None


# --- audit --------------------------------------------------------------------------


def test_audit_log_is_append_only(backend, store):
    store.audit("uid 0", "approved drain n2", "budget ok", "ok", incident="INC-1", action=4, now=5.25)
    store.audit("artemisd", "drain n2", incident="INC-2", now=6.0)
    store.audit("artemisd", "started")
    log = store.audit_log()
    assert [a["what"] for a in log] == ["approved drain n2", "drain n2", "started"]
    assert log[0] == {"id": log[0]["id"], "time": 5.25, "incident": "INC-1", "action": 4, "who": "uid 0",
                      "what": "approved drain n2", "why": "budget ok", "result": "ok"}
    assert log[2]["time"] > 1e9 and log[2]["incident"] is None
    assert [a["who"] for a in store.audit_log("INC-1")] == ["uid 0"]
    with pytest.raises(backend.refused, match="append-only"):
        backend.raw(store, "UPDATE audit SET who = 'someone else'")
    with pytest.raises(backend.refused, match="append-only"):
        backend.raw(store, "DELETE FROM audit")
    assert [a["who"] for a in store.audit_log()] == ["uid 0", "artemisd", "artemisd"]


# --- directives ---------------------------------------------------------------------


def test_directives_live_probes_and_the_latest_rebalance(store):
    store.add_directive("PRB-1", "probe", "7", "0", "INC-1", {"id": "PRB-1"}, now=10.0, expires=100.0)
    store.add_directive("PRB-2", "probe", "7", "0", None, {"id": "PRB-2"}, now=20.0, expires=None)
    store.add_directive("RBL-1", "rebalance", "7", "0", "INC-1", {"id": "RBL-1", "w": [1, 2]}, now=30.0, expires=None)
    store.add_directive("RBL-2", "rebalance", "7", "0", "INC-1", {"id": "RBL-2"}, now=30.0, expires=None)
    store.add_directive("PRB-3", "probe", "7", "1", None, {"id": "PRB-3"}, now=20.0, expires=None)
    assert [d["id"] for d in store.directives_for("7", "0", now=50.0)] == ["PRB-1", "PRB-2", "RBL-2"]
    assert [d["id"] for d in store.directives_for("7", "0", now=100.0)] == ["PRB-2", "RBL-2"]  # PRB-1 expired
    assert store.directives_for("8", "0", now=0.0) == []
    # Issued again under the same id: the new one replaces it, as written later than RBL-2.
    store.add_directive("RBL-1", "rebalance", "7", "0", "INC-1", {"id": "RBL-1", "w": [3]}, now=30.0, expires=None)
    assert store.directives_for("7", "0", now=50.0)[-1] == {"id": "RBL-1", "w": [3]}
    assert store.probe_times("7") == [10.0, 20.0, 20.0]


def test_probe_costs_add_up_per_rank(store):
    store.add_directive("PRB-1", "probe", "7", "0", "INC-1", {"id": "PRB-1"}, now=10.0, expires=100.0)
    store.probe_result("PRB-1", 12.5)
    store.probe_result("PRB-1", None)  # a rank that reported no cost
    store.probe_result("PRB-1", 0.25)
    store.probe_result("PRB-404", 1.0)
    assert store.probe_costs() == [{"id": "PRB-1", "job": "7", "step": "0", "incident": "INC-1", "issued": 10.0,
                                    "ranks_reported": 3, "cost_ms": 12.75}]
    # Replacing a directive starts its count again (INSERT OR REPLACE in SQLite).
    store.add_directive("PRB-1", "probe", "7", "0", "INC-1", {"id": "PRB-1"}, now=11.0, expires=100.0)
    assert store.probe_costs()[0]["ranks_reported"] == 0


# --- corrections and node evidence --------------------------------------------------


def test_corrections_pending_then_settled(store):
    store.add_correction("COR-2", "INC-1", "n2", "reset_clocks", 3, now=20.0)
    store.add_correction("COR-1", "INC-1", "n2", "reset_clocks", None, now=10.0)
    store.add_correction("COR-3", "INC-2", "n3", "reset_clocks", 0, now=5.0)
    assert [c["id"] for c in store.corrections("n2")] == ["COR-1", "COR-2"]  # oldest first
    store.set_correction("COR-1", "done", "clocks reset")
    assert [c["id"] for c in store.corrections("n2")] == ["COR-2"]
    assert [c["id"] for c in store.corrections("n2", status=None)] == ["COR-1", "COR-2"]
    assert [c["id"] for c in store.corrections("n2", status="done")] == ["COR-1"]
    assert store.correction("COR-1") == {"id": "COR-1", "incident": "INC-1", "node": "n2", "kind": "reset_clocks",
                                         "gpu": None, "status": "done", "detail": "clocks reset"}
    assert store.correction("COR-2")["gpu"] == 3 and store.correction("COR-404") is None


def test_node_evidence_latest_per_node(store):
    assert store.node_evidence("n2") is None
    store.set_node_evidence("n2", 10.0, 0, '{"gpus": [1]}')
    store.set_node_evidence("n2", 20.5, 64030, '{"gpus": [2]}')
    store.set_node_evidence("n3", 15.0, None, "{}")
    assert store.node_evidence("n2") == (20.5, {"gpus": [2]})
    assert store.node_evidence("n3") == (15.0, {})


# --- SQLite only: files from before schema versions ---------------------------------


def test_a_sqlite_file_from_before_versions_is_version_1_unchanged(tmp_path):
    path = tmp_path / "old.db"
    old = sqlite3.connect(path)
    old.executescript(SCHEMA)  # what every earlier artemisd wrote
    old.execute("INSERT INTO counters VALUES ('incident', 41)")
    old.execute("INSERT INTO audit(time, who, what) VALUES (1.0, 'uid 0', 'approved')")
    old.execute("INSERT INTO records(job, window, node, received, uid, root, body) VALUES ('1', 0, 'n1', 1.0, 0, 1, '{}')")
    old.execute("INSERT INTO quarantine VALUES (7, '1', 0, 'n1', 1.0, 0, 1, '{\"w\": 0}', 'bad', 2.0)")
    old.commit()
    tables = dict(old.execute("SELECT name, sql FROM sqlite_master"))
    old.close()
    store = Store(path)
    assert store.schema_version() == SCHEMA_VERSION
    assert store.next_id("incident", "INC-") == "INC-42"
    assert [a["who"] for a in store.audit_log()] == ["uid 0"]
    after = dict(store.db.execute("SELECT name, sql FROM sqlite_master"))
    # Version 1 left every table as it was; version 2 added the lease and each action's token; version 3
    # batch rows, and the quarantine keyed by row and item (its rows kept, as whole rows).
    changed = {"actions", "records", "quarantine"}
    assert {k: v for k, v in after.items() if k in tables and k not in changed} == \
        {k: v for k, v in tables.items() if k not in changed}
    assert after["actions"].startswith(tables["actions"].rstrip(")"))
    assert "token INTEGER" in after["actions"]
    assert after["records"].startswith(tables["records"].rstrip(")"))
    assert after["records"].endswith("items INTEGER NOT NULL DEFAULT 0, skipped TEXT)")
    assert "PRIMARY KEY (seq, item)" in after["quarantine"]
    assert set(after) - set(tables) == {"schema_version", "leases", "sqlite_autoindex_leases_1",
                                        "instances", "sqlite_autoindex_instances_1",
                                        "sqlite_autoindex_quarantine_1"}
    assert [v for v, _ in store.db.execute("SELECT version, applied FROM schema_version")] == [1, 2, 3, 4]
    # Version 4: every record stored before it was analysed by the leader that stored it.
    assert store.analysed_through() == 1
    assert [(r.body, r.items, r.skipped) for r in store.records()] == [("{}", 0, frozenset())]
    assert store.quarantine_rows() == [{"seq": 7, "item": None, "job": "1", "node": "n1", "uid": 0,
                                        "reason": "bad", "quarantined": 2.0, "body": '{"w": 0}'}]


# --- the leader lease and fencing (artemisd/lease.py) -----------------------------


def test_the_first_to_ask_leads_and_renewing_keeps_the_token(store):
    assert store.lease(LEADER) is None
    first = store.take_lease(LEADER, "a:7600", ttl=30)
    assert (first.holder, first.token) == ("a:7600", 1) and first.expires == pytest.approx(first.acquired + 30)
    again = store.take_lease(LEADER, "a:7600", ttl=30)
    assert (again.holder, again.token, again.acquired) == ("a:7600", 1, first.acquired)
    assert again.renewed >= first.renewed and store.lease(LEADER) == again
    assert store.clock() == pytest.approx(time.time(), abs=5)


def test_another_instance_waits_out_the_lease_then_takes_it_with_the_next_token(backend):
    a, b = backend.open(), backend.open()  # two instances, two connections
    try:
        assert a.take_lease(LEADER, "a", ttl=0.5).token == 1
        held = b.take_lease(LEADER, "b", ttl=0.5)
        assert (held.holder, held.token) == ("a", 1)  # b is a standby
        deadline = time.monotonic() + 5
        while b.take_lease(LEADER, "b", ttl=30).holder != "b":
            assert time.monotonic() < deadline, "the expired lease was never taken over"
            time.sleep(0.1)
        assert b.lease(LEADER).token == 2
        assert a.take_lease(LEADER, "a", ttl=30).holder == "b"  # a woke up: b leads
    finally:
        a.close(), b.close()


def test_a_released_lease_is_free_at_once(store):
    store.take_lease(LEADER, "a", ttl=300)
    store.release_lease(LEADER, "b")  # not b's to give up
    assert store.take_lease(LEADER, "b", ttl=300).holder == "a"
    store.release_lease(LEADER, "a")
    taken = store.take_lease(LEADER, "b", ttl=300)
    assert (taken.holder, taken.token) == ("b", 2)


def test_a_deposed_leader_can_neither_queue_nor_claim_an_action(backend):
    a, b = backend.open(), backend.open()
    try:
        token_a = a.take_lease(LEADER, "a", ttl=300).token
        queued = a.add_action("INC-1", "drain", "n1", {}, "queued", 1.0, fence=token_a)
        a.release_lease(LEADER, "a")  # as if it froze past its expiry
        token_b = b.take_lease(LEADER, "b", ttl=300).token
        assert token_b == token_a + 1
        with pytest.raises(Fenced, match=f"fencing token {token_a} is stale: the lease is at {token_b}"):
            a.update_action(queued, "running", fence=token_a)  # its claim before calling Slurm
        with pytest.raises(Fenced):
            a.add_action("INC-1", "requeue", "7", {}, "queued", 2.0, fence=token_a)
        assert [(r.id, r.status) for r in b.actions_of("INC-1")] == [(queued, "queued")]  # nothing changed
        b.update_action(queued, "running", fence=token_b)  # the new leader resumes it
        assert b.action(queued).status == "running"
        assert backend.raw(b, f"SELECT token FROM actions WHERE id = {queued}") == [(token_b,)]
    finally:
        a.close(), b.close()


def test_unfenced_writes_are_for_a_single_instance(store):
    # No lease at all (SQLite, one daemon): fence=None writes as before; a
    # fenced write without a lease is refused, never let through.
    aid = store.add_action("INC-1", "drain", "n1", {}, "queued", 1.0)
    with pytest.raises(Fenced):
        store.update_action(aid, "running", fence=1)


def test_every_instance_is_listed_by_its_last_turn(store):
    store.heartbeat("b:7600", "standby", "0.9", started=10.0)
    store.heartbeat("a:7600", "standby", "0.9", started=5.0)
    store.heartbeat("a:7600", "leader", "1.0", started=5.0)  # took the lease: one row, updated
    listed = store.instances()
    assert [(i["instance"], i["role"], i["version"], i["started"]) for i in listed] == [
        ("a:7600", "leader", "1.0", 5.0), ("b:7600", "standby", "0.9", 10.0)]
    assert all(0 <= i["seen_s_ago"] < 5 for i in listed)


def test_two_instances_asking_at_once_get_one_leader(backend):
    stores = [backend.open() for _ in range(4)]
    try:
        with ThreadPoolExecutor(len(stores)) as pool:
            leases = list(pool.map(lambda i: stores[i].take_lease(LEADER, f"i{i}", ttl=300), range(len(stores))))
        assert len({(lease.holder, lease.token) for lease in leases}) == 1 and leases[0].token == 1
    finally:
        for s in stores:
            s.close()


# --- choosing the backend: StateURL and StatePasswordFile ---------------------------


def test_state_url_and_password_file_open_postgresql(pg_server, tmp_path):
    name = f"contract{next(_names)}"
    url = pg_server.create_database(name)
    secret = tmp_path / "pw"
    secret.write_text(PASSWORD + "\n")
    secret.chmod(0o600)
    conf = parse_config_text(f"StateURL={url}\nStatePasswordFile={secret}\nStateDir={tmp_path / 'unused'}")
    try:
        store = open_store(conf.daemon)
        assert type(store).__name__ == "PostgresStore" and store.next_id("incident", "INC-") == "INC-1"
        store.close()
        assert not (tmp_path / "unused").exists()
        secret.write_text("not the password\n")
        import psycopg

        with pytest.raises(psycopg.OperationalError, match="password"):
            open_store(conf.daemon)
    finally:
        pg_server.drop_database(name)


def test_state_dir_alone_keeps_sqlite(tmp_path):
    store = open_store(parse_config_text(f"StateDir={tmp_path}").daemon)
    assert isinstance(store, Store) and store.path == tmp_path / "artemis.db"
    store.close()


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644])
def test_a_password_file_others_can_read_is_refused(tmp_path, mode):
    secret = tmp_path / "pw"
    secret.write_text("pw\n")
    secret.chmod(mode)
    conf = parse_config_text(f"StateURL=postgresql://artemis@db1/artemis\nStatePasswordFile={secret}")
    with pytest.raises(ConfigError, match=f"StatePasswordFile: mode {mode:04o} lets group or others read") as err:
        open_store(conf.daemon)
    assert err.value.key == "StatePasswordFile"


def test_a_missing_password_file_is_named(tmp_path):
    conf = parse_config_text(f"StateURL=postgresql://artemis@db1/artemis\nStatePasswordFile={tmp_path / 'none'}")
    with pytest.raises(ConfigError, match="StatePasswordFile: cannot read"):
        open_store(conf.daemon)


@pytest.mark.parametrize("line, reason", [
    ("StateURL=postgresql://artemis:secret@db1/artemis", "must not hold the password"),
    ("StateURL=postgresql://db1/artemis?password=secret", "must not hold the password"),
    ("StateURL=mysql://db1/artemis", "must be postgresql://"),
    ("StateURL=postgresql://db1", "must be postgresql://"),
    ("StatePasswordFile=/etc/artemis/pw", "StateURL, which is not set"),
])
def test_state_url_checks(line, reason):
    with pytest.raises(ConfigError, match=reason):
        parse_config_text(line)
    if "secret" in line and "StateURL" in line:
        with pytest.raises(ConfigError) as refused:
            parse_config_text(line)
        assert "secret" not in str(refused.value) and "***" in str(refused.value)  # refused, not echoed
