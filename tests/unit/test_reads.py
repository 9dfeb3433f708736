"""The read API off the event loop, bounded and private where the site says so (issue 27, item 5).

Reads that decode many rows run in the read pool's threads on connections of their own; while
they are held, ``/v1/health`` and report intake go on; beyond the queue a reader is told to come
back (503), never queued in front of the loop.  With ``ReadAuth=required`` a user reads only the
incidents of the jobs Slurm said they own.
"""

from __future__ import annotations

import asyncio
import threading

from artemisd import reads
from artemisd.auth import Principal
from artemisd.reads import Reader
from artemisd.server import READS
from artemisd.store import Store, StoredIncident
from tests.unit.test_server import HEALTHY, Clock, Harness, body, cluster, hot_gpu_confirmed, run
from tests.unit.windows import lockstep


def test_a_held_read_never_holds_health_or_intake_and_too_many_readers_are_told_to_retry(tmp_path, monkeypatch):
    held = threading.Event()
    release = threading.Event()
    loop_thread: list[threading.Thread] = []
    read_threads: set[str] = set()
    real_page = reads.windows_page

    def slow_page(store, reader, incident_id, limit, before):
        read_threads.add(threading.current_thread().name)
        held.set()
        release.wait(30)  # a read as slow as you like: it holds its worker, not the loop
        return real_page(store, reader, incident_id, limit, before)

    monkeypatch.setattr(reads, "windows_page", slow_page)

    async def scenario():
        async with Harness(tmp_path, "", cluster(), Clock()) as h:
            loop_thread.append(threading.current_thread())
            await hot_gpu_confirmed(h, range(8, 10))
            [inc] = await h.incidents()
            url = f"/v1/incidents/{inc['id']}/windows"
            h.client.server.app[READS].waiting = 4
            readers = [asyncio.create_task(h.client.get(url)) for _ in range(4)]
            while not held.is_set():
                await asyncio.sleep(0.01)
            # Two workers held, two readers waiting: the loop still answers and takes reports.
            health = await asyncio.wait_for(h.client.get("/v1/health"), 10)
            assert health.status == 200 and (await health.json())["ok"]
            h.clock.now += 10
            intake = await asyncio.wait_for(h.client.post("/v1/reports", data=body(lockstep(10, HEALTHY))), 10)
            assert intake.status == 200 and (await intake.json())["accepted"] == 8
            busy = await asyncio.wait_for(h.client.get(url), 10)  # the fifth: beyond READS_WAITING
            assert busy.status == 503 and busy.headers["Retry-After"] and "busy with reads" in (await busy.json())["error"]
            release.set()
            answers = await asyncio.gather(*readers)
            assert [a.status for a in answers] == [200] * 4
            assert len((await answers[0].json())["windows"]) == 11 * 8
    run(scenario)
    assert read_threads and all(name.startswith("read") for name in read_threads)
    assert loop_thread[0].name not in read_threads


def _incident(store: Store, inc_id: str, job: str) -> None:
    store.save_incident(StoredIncident(id=inc_id, job=job, step="0", state="confirmed", subject=f"job {job}",
                                       analyzer_id=None, plan_step=0, action_window=None, baseline=None,
                                       decide=False, body={"id": inc_id, "job": job, "state": "confirmed"},
                                       created=float(inc_id.split("-")[1]), updated=0.0))


def test_with_read_auth_required_a_user_reads_only_their_own_jobs_and_admins_read_all(tmp_path):
    store = Store(tmp_path / "artemis.db")
    try:
        store.set_job_owner("100", 1000, "gpu")
        store.set_job_owner("200", 2000, "gpu")
        for n, job in enumerate(["100", "200", "100", "300"]):  # 300: no user's report, owner not known
            _incident(store, f"INC-{n + 1}", job)
        alice = Reader(Principal(1000, 1000, root_side=False, admin=False), private=True)
        admin = Reader(Principal(1500, 1500, root_side=False, admin=True), private=False)

        def listed(reader, limit=100, offset=0):
            import json
            page = json.loads(reads.incidents_page(store, reader, True, limit, offset))
            return [i["id"] for i in page["incidents"]], page.get("next")

        assert listed(alice) == (["INC-1", "INC-3"], None)
        assert listed(admin) == (["INC-1", "INC-2", "INC-3", "INC-4"], None)
        assert listed(reads.OPEN, limit=3) == (["INC-1", "INC-2", "INC-3"], 3)
        assert listed(reads.OPEN, limit=3, offset=3) == (["INC-4"], None)
        assert reads.incident_detail(store, alice, "INC-3")[1]["incident"]["job"] == "100"
        for other in ("INC-2", "INC-4", "INC-9"):  # another's, an unknown owner's, none: alike
            for view in (lambda i: reads.incident_detail(store, alice, i),
                         lambda i: reads.windows_page(store, alice, i, 10, None)):
                try:
                    view(other)
                except reads.NotFound as err:
                    assert str(err) == f"no incident {other}"
                else:
                    raise AssertionError(f"{other} was shown to uid 1000")
    finally:
        store.close()
