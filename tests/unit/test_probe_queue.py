"""A probe request the rate limit refuses waits and is asked again; the budget goes to the request
most worth it (issue 28: a degraded link's request, refused after a start-up suspect's probe, was
dropped while its incident kept waiting for it, and the link was never named)."""

from __future__ import annotations

from artemisd.pipeline import ProbeRequest
from artemisd.probes import ProbeQueue
from tests.unit.test_server import HEALTHY, SLOW_BUSY, SLOW_CLOCKS, Clock, Harness, cluster, run


def request(n: int, job: str = "7", incident: str | None = None) -> ProbeRequest:
    return ProbeRequest(f"PRB-{n}", job, "0", (0, 1), f"reason {n}", incident or f"A-{n}")


def test_the_queue_orders_each_jobs_requests_by_worth_and_forgets_what_nobody_waits_for():
    queue = ProbeQueue()
    queue.add([request(1), request(2), request(3, job="8")], now=10.0)
    queue.add([request(4)], now=20.0)
    worth = {"PRB-1": 1.0, "PRB-2": 30.0, "PRB-3": 5.0, "PRB-4": 30.0}
    waiting = queue.by_job(lambda incident: True, lambda req: worth[req.id])
    assert {job: [w.request.id for w in ws] for job, ws in waiting.items()} == \
        {"7": ["PRB-2", "PRB-4", "PRB-1"], "8": ["PRB-3"]}  # most worth first, then the oldest
    queue.add([request(5, incident="A-2")], now=30.0)  # a newer question about A-2 replaces PRB-2
    waiting = queue.by_job(lambda incident: incident != "A-1", lambda req: 1.0)  # A-1 recovered
    assert [w.request.id for w in waiting["7"]] == ["PRB-4", "PRB-5"]
    queue.sent(waiting["7"][0].request)
    queue.forget_job("8")
    assert len(queue) == 1


def test_a_rate_limited_probe_waits_and_goes_out_when_the_limit_allows(tmp_path):
    async def scenario():
        conf = "ProbeMinInterval=1h\nProbeMaxPerHour=10\nPartitionPolicy=gpu Auto=escalate\n"
        async with Harness(tmp_path, conf, cluster(), Clock()) as h:
            await h.windows(range(0, 8), HEALTHY)
            replies = await h.windows(range(8, 10), SLOW_BUSY, gpu=SLOW_CLOCKS)
            [first] = [d for r in replies for d in r["directives"] if d["type"] == "probe"]
            await h.answer_probe(10, first["id"])  # rank 2's probe answers; then rank 6 slows down too
            busy = list(SLOW_BUSY)
            busy[6] = 63.0
            later = await h.windows(range(11, 15), busy, gpu=SLOW_CLOCKS)
            assert not [d for r in later for d in r["directives"] if d["type"] == "probe" and d["id"] != first["id"]]
            refused = [a for a in h.daemon.store.audit_log() if a["what"].endswith("not sent")]
            assert len(refused) == 1 and "asked again when the limit allows" in refused[0]["why"]  # audited once
            h.clock.now += 3600
            await h.daemon.run_once()  # no report needed: the leader's turn asks again
            issued = [a for a in h.daemon.store.audit_log() if a["what"].endswith("requested")]
            assert len(issued) == 2 and "waited" in issued[1]["why"], issued
            second = issued[1]["what"].split()[1]
            assert second != first["id"] and h.daemon.store.has_directive(second)
            replies = await h.windows(range(15, 16), busy, gpu=SLOW_CLOCKS)
            assert [d["id"] for d in replies[0]["directives"] if d["type"] == "probe"] == [second]
    run(scenario)
