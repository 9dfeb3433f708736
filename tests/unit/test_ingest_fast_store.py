"""What ``Daemon.accept`` stores for a body the ingest fast path took: each item's own text.

The text is stored as it came (no encoding pass per record) only where the
record was kept as it came; a record re-keyed to a new run (a requeued job's
windows numbered from 0 again) is encoded again, so that a restart replays it
under the run it was analysed in.  Either way the stored body parses back to
the record the daemon analysed, and a restarted daemon restores the same
history.
"""

from __future__ import annotations

import json
import os

from artemisd.auth import TRUSTED_LOCAL
from artemisd.config import parse_config_text
from artemisd.ingest import fast_records
from artemisd.runs import RESTART_GAP, RUN_SEP
from artemisd.service import Daemon
from artemisd.slurm.cli import CliSlurm
from artemisd.wire import parse_record, with_step
from tests.unit.test_ingest_fast import assert_same_record
from tests.unit.windows import lockstep


def daemon(state) -> Daemon:
    # Root-side records: no Slurm lookups; Slurm itself is not what this test is about.
    config = parse_config_text(f"StateDir={state}\nAuthType=none\n")
    return Daemon(config, CliSlurm(timeout=2, env={"SLURM_CONF": "/nonexistent", "PATH": os.environ["PATH"]}))


def window_body(seq: int) -> bytes:
    reports = lockstep(seq, [50.0, 50.0, 51.0, 50.0], job="77", nodes=["a", "a", "b", "b"])
    items = [r.model_dump(mode="json", exclude_none=True) for r in reports]
    items[1]["ms"].pop("busy")  # the sender's own shape: derived on the way in, and again on restore
    return json.dumps(items, indent=1).encode()


def post(d: Daemon, body: bytes):
    texts: list[str] = []
    records = fast_records(body, d.config.daemon.max_world, texts)
    assert records is not None
    result = d.accept(records, TRUSTED_LOCAL, {}, [], texts)
    assert result.accepted == len(records) and not result.rejected
    return records, texts


def test_items_texts_are_stored_as_they_came_and_a_re_keyed_run_is_encoded_again(tmp_path):
    d = daemon(tmp_path / "state")
    sent = []
    for seq in range(RESTART_GAP + 3):
        sent.append(post(d, window_body(seq)))
    restarted, restarted_texts = post(d, window_body(0))  # the job requeued: windows from 0 again
    stored = [rec.body for rec in d.store.records()]
    first_run = [t for _, texts in sent for t in texts]
    assert stored[:len(first_run)] == first_run
    rekeyed = [parse_record(json.loads(b)) for b in stored[len(first_run):]]
    assert [r.step for r in rekeyed] == [f"0{RUN_SEP}1"] * len(restarted)
    for got, (_, rec) in zip(rekeyed, restarted):
        assert_same_record(with_step(rec, f"0{RUN_SEP}1"), got)
    for body, (_, rec) in zip(stored, [pair for records, _ in sent for pair in records]):
        assert_same_record(rec, parse_record(json.loads(body)))
    d.store.close()

    again = daemon(tmp_path / "state")  # restores from what was stored
    assert again.restore_skipped == 0
    assert again.analyzer.window_shapes("77", f"0{RUN_SEP}1") and again.analyzer.window_shapes("77", "0")
    again.store.close()
