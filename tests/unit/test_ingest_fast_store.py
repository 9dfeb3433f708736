"""What ``Daemon.accept`` stores for a body the ingest fast path took: batch rows, as the sender wrote them.

The window reports of one job and window that one request brought are one
row (``items`` n): the body itself where it is all of them (no encoding or
splitting pass per record), else the kept items' own texts joined.  A record
re-keyed to a new run (a requeued job's windows numbered from 0 again) is
encoded again, in a row of its own, so that a restart replays it under the run
it was analysed in.  Either way every stored record parses back to the record
the daemon analysed, a restarted daemon restores the same history, and one bad
item of a batch is quarantined alone.
"""

from __future__ import annotations

import json
import os

from artemisd.auth import Principal, TRUSTED_LOCAL
from artemisd.config import parse_config_text
from artemisd.ingest import fast_records
from artemisd.runs import RESTART_GAP, RUN_SEP
from artemisd.service import Daemon
from artemisd.slurm.api import JobInfo
from artemisd.slurm.cli import CliSlurm
from artemisd.store import batch_items
from artemisd.wire import parse_record, with_step
from tests.unit.test_ingest_fast import assert_same_record
from tests.unit.windows import lockstep


def daemon(state, max_world: int = 65_536) -> Daemon:
    # Root-side records: no Slurm lookups; Slurm itself is not what this test is about.
    config = parse_config_text(f"StateDir={state}\nAuthType=none\nMaxWorld={max_world}\n")
    return Daemon(config, CliSlurm(timeout=2, env={"SLURM_CONF": "/nonexistent", "PATH": os.environ["PATH"]}))


def window_items(seq: int, job: str = "77") -> list[dict]:
    reports = lockstep(seq, [50.0, 50.0, 51.0, 50.0], job=job, nodes=["a", "a", "b", "b"])
    items = [r.model_dump(mode="json", exclude_none=True) for r in reports]
    items[1]["ms"].pop("busy")  # the sender's own shape: derived on the way in, and again on restore
    return items


def body_of(items: list[dict]) -> bytes:
    return json.dumps(items, indent=1).encode()  # the sender's spacing is kept, and harmless


def post(d: Daemon, body: bytes, principal: Principal = TRUSTED_LOCAL, jobs: dict | None = None):
    records = fast_records(body, d.config.daemon.max_world)
    assert records is not None
    return records, d.accept(records, principal, jobs or {}, [], body)


def rows(d: Daemon) -> list[tuple]:
    return d.store.db.execute("SELECT job, window, node, items, skipped, body FROM records ORDER BY seq").fetchall()


def test_a_window_posted_whole_is_one_row_byte_for_byte_and_a_re_keyed_run_is_encoded_again(tmp_path):
    d = daemon(tmp_path / "state")
    sent = []
    for seq in range(RESTART_GAP + 3):
        body = body_of(window_items(seq))
        records, result = post(d, body)
        assert result.accepted == 4 and not result.rejected
        sent.append((body, records))
    restarted, result = post(d, body_of(window_items(0)))  # the job requeued: windows from 0 again
    assert result.accepted == 4
    stored = rows(d)
    assert [row[5] for row in stored[:len(sent)]] == [body.decode() for body, _ in sent]
    assert [(job, window, node, items) for job, window, node, items, _, _ in stored[:len(sent)]] == \
        [("77", seq, None, 4) for seq in range(len(sent))]  # two nodes: no one node names the row
    for body, records in sent:
        for text, (_, rec) in zip(batch_items(body), records):
            assert_same_record(rec, parse_record(json.loads(text)))
    rekeyed = stored[len(sent):]
    assert [(items, node) for _, _, node, items, _, _ in rekeyed] == [(0, "a"), (0, "a"), (0, "b"), (0, "b")]
    for row, (_, rec) in zip(rekeyed, restarted):
        got = parse_record(json.loads(row[5]))
        assert got.step == f"0{RUN_SEP}1"
        assert_same_record(with_step(rec, f"0{RUN_SEP}1"), got)
    assert d.store.record_count() == 4 * (len(sent) + 1)
    shapes = d.analyzer.window_shapes("77", "0")
    d.store.close()

    again = daemon(tmp_path / "state")  # restores from what was stored
    assert again.restore_skipped == 0
    assert again.analyzer.window_shapes("77", "0") == shapes
    assert again.analyzer.window_shapes("77", f"0{RUN_SEP}1")
    again.store.close()


def test_a_body_of_several_windows_and_refused_items_is_stored_as_the_kept_items_own_texts(tmp_path):
    d = daemon(tmp_path / "state")
    items = window_items(0) + window_items(1) + window_items(0, job="88")
    body = body_of(items)
    owner = Principal(uid=1000, gid=1000, root_side=False, admin=False)
    jobs = {"77": JobInfo(job_id="77", user_id=1000, nodes=("a", "b"), state="RUNNING"),
            "88": JobInfo(job_id="88", user_id=1000, nodes=("a",), state="RUNNING")}  # "b" is not job 88's
    records, result = post(d, body, owner, jobs)
    assert result.accepted == 10 and [r["index"] for r in result.rejected] == [10, 11]
    texts = batch_items(body)
    assert [(job, window, node, n, body) for job, window, node, n, _, body in rows(d)] == [
        ("77", 0, None, 4, "[" + ",".join(texts[0:4]) + "]"),
        ("77", 1, None, 4, "[" + ",".join(texts[4:8]) + "]"),
        ("88", 0, "a", 2, "[" + ",".join(texts[8:10]) + "]")]
    assert d.store.window_records("88") == items[8:10]
    d.store.close()


def test_one_item_of_a_batch_that_no_longer_fits_the_bounds_is_quarantined_alone_at_restore(tmp_path):
    d = daemon(tmp_path / "state")
    big = [dict(item, world=8) for item in window_items(0, job="99")]  # a world of 8: beyond a MaxWorld of 4
    big[2]["world"] = 4  # ... but this one of the batch fits it
    for body in (body_of(window_items(0)), body_of(big)):
        _, result = post(d, body)
        assert result.accepted == 4
    d.store.close()

    again = daemon(tmp_path / "state", max_world=4)
    assert again.restore_skipped == 3 and again.store.quarantined() == 3
    assert again.store.record_count() == 5
    quarantined = again.store.quarantine_rows()
    assert [(row["item"], row["job"]) for row in quarantined] == [(3, "99"), (1, "99"), (0, "99")]
    assert all("MaxWorld (4)" in row["reason"] for row in quarantined), quarantined
    assert [json.loads(row["body"]) for row in quarantined] == [big[3], big[1], big[0]]
    (skipped,) = again.store.db.execute("SELECT skipped FROM records WHERE job = '99'").fetchone()
    assert json.loads(skipped) == [0, 1, 3]
    again.store.close()

    third = daemon(tmp_path / "state", max_world=4)  # quarantined items are never replayed
    assert third.restore_skipped == 0 and third.store.record_count() == 5
    third.store.close()
