"""10,000 hostile bodies against the real ``artemisd`` process (issue 9).

Each body mixes good window reports of one 4-rank job with hostile items made
from what was found against the daemon: integers at and past int64, NaN and
Infinity tokens, lone surrogate escapes, invalid UTF-8, overlong strings,
nesting past the limit (5,000 deep, in an item and as a whole line), brackets
left open, worlds and ranks out of range, wrong types, arbitrary JSON,
truncated lines; in JSON Lines any of them may be the first line.  Properties, for every body:

* the reply is 200 (never a 5xx, never a lost body);
* every good item is accepted, every other item is accounted for with a
  reason;

and over the run the daemon's memory is bounded: its RSS high-water mark
after all bodies stays within a few MiB of where it was after the first
thousand.  Hypothesis is derandomized (the same bodies on every run).
"""

from __future__ import annotations

import http.client
import itertools
import json
import os
import random
import re
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.unit.test_cli_admin import Artemisd
from tests.unit.windows import lockstep

BODIES = 10_000
WARM = 1_000  # bodies before the memory baseline is taken
JOB = "fz"
MIB = 1024  # /proc reports KiB

TEMPLATE = lockstep(0, [50.0] * 4, job=JOB, nodes=["a", "a", "b", "b"])[0].model_dump(
    mode="json", exclude_none=True)
TEMPLATE["env"] = {"driver": "550.54.15", "comm_lib": "nccl 2.21.5"}
TEMPLATE["ms_p50"] = {"step": 70.0, "busy": 50.0}

# Where a hostile value goes: every block and most leaves of the window report.
PATHS = ["type", "v", "job", "step", "rank", "world", "node", "island", "samples", "dropped_reports",
         "window", "window.seq", "window.first_step", "window.steps", "window.t0", "window.t1",
         "ms", "ms.step", "ms.busy", "ms.comm_wait", "ms.data", "ms_p50", "ms_p50.step",
         "device", "device.vendor", "device.model", "device.index",
         "gpu", "gpu.temp_c", "gpu.sm_clock_mhz", "gpu.throttle", "gpu.ecc_uncorrected",
         "host", "host.cpu_pct", "env", "env.driver", "collectives", "collectives.0.calls", "collectives.0.op",
         "probe", "probe.id", "probe.p2p", "unknown_field"]

NAN, INF, NINF = "__NaN__", "__Infinity__", "__-Infinity__"  # written as the bare JSON tokens


def nested(depth: int) -> list:
    out: list = []
    for _ in range(depth):
        out = [out]
    return out


# Values known to have hurt (or to sit on a bound), inserted into the JSON text
# precomputed (see ``dumps``), beside the integers, floats and text hypothesis generates.
HOSTILE = [2**63, 2**63 - 1, -(2**63) - 1, 2**64, 10**18, 10**30, 10**400, -1, 0, 65_536, 65_537,
           NAN, INF, NINF, 1e308, -0.0, 5e-324,
           "\ud800", "a\udfffb", "\udc80", "x" * 10 + "\udbff", "", " ", "x" * 256, "x" * 3000, "\x00",
           nested(100), nested(190), list(range(2000)), [{}] * 1100, {"k" * 40: 1.0},
           {str(i): 1.0 for i in range(40)}, None, True, [], {}, [None], {"step": NAN}, {"seq": 2**63},
           [{"op": "x" * 300, "calls": -1, "ms": INF}]]
_TOKENS = {f"__H{i}__": json.dumps(v) for i, v in enumerate(HOSTILE)}
_TOKENS.update({f'"{NAN}"': "NaN", f'"{INF}"': "Infinity", f'"{NINF}"': "-Infinity"})
_TOKEN = re.compile("|".join(re.escape(f'"{k}"' if k.startswith("__H") else k) for k in _TOKENS))
generated = st.one_of(st.integers(-(2**80), 2**80), st.floats(), st.text(max_size=8))


def dumps(item) -> bytes:
    return _TOKEN.sub(lambda m: _TOKENS[m.group(0).strip('"')] if m.group(0).startswith('"__H')
                      else _TOKENS[m.group(0)], json.dumps(item)).encode()


def put(item: dict, path: str, value) -> None:
    *parents, last = path.split(".")
    target = item
    for key in parents:
        if isinstance(target, list) and key.isdigit() and int(key) < len(target):
            target = target[int(key)]
        elif isinstance(target, dict) and isinstance(target.get(key), (dict, list)):
            target = target[key]
        else:
            return
    if isinstance(target, dict):
        target[last] = value
    elif isinstance(target, list) and last.isdigit() and int(last) < len(target):
        target[int(last)] = value


KINDS = ["field", "field", "field", "drop", "world", "value", "utf8", "truncate", "deep", "deep_array", "unclosed"]
# Not valid JSON text, or (deep_array) an element that ends an array's reading: JSON Lines bodies only.
RAW = {"utf8", "truncate", "deep", "deep_array", "unclosed"}
BAD_BYTES = [b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80"]
TEMPLATE_TEXT = json.dumps(TEMPLATE)


def hostile(kind: str, seed: int, value) -> bytes:
    """One hostile item as JSON text.

    ``seed`` picks the fields and which ``HOSTILE`` values; ``value`` is the
    value hypothesis generated for this body.
    """
    rng = random.Random(seed)

    def pick():
        return value if rng.random() < 0.4 else f"__H{rng.randrange(len(HOSTILE))}__"
    if kind == "value":  # not a report at all
        return dumps(pick())
    if kind == "deep":
        depth = rng.choice([201, 250, 1000, 5000])
        return b'{"type": "window", "x": ' + b"[" * depth + b"]" * depth + b"}"
    if kind == "deep_array":  # issue 27: as a first line, it took every good line after it
        depth = rng.choice([201, 1000, 5000])
        return b"[" * depth + b"]" * depth
    if kind == "unclosed":
        return b"[" * rng.choice([1, 3, 201, 5000]) + rng.choice([b"", b'{"type": "window"', b'"x'])
    item = json.loads(TEMPLATE_TEXT)
    item["rank"] = rng.randrange(4)
    if kind == "drop":
        for path in rng.sample(PATHS, rng.randint(1, 3)):
            *parents, last = path.split(".")
            holder = item.get(parents[0]) if parents else item
            if isinstance(holder, dict):
                holder.pop(last, None)
        return dumps(item)
    if kind == "world":
        item["world"] = world = rng.choice([0, -1, 1, 2**31, 65_537, 10**18, 2**63])
        item["rank"] = rng.choice([0, world, max(world - 1, 0), 2**62])
        return dumps(item)
    for _ in range(rng.randint(1, 3)):
        put(item, rng.choice(PATHS), pick())
    text = dumps(item)
    if kind == "utf8":
        at = rng.randrange(1, len(text))
        return text[:at] + rng.choice(BAD_BYTES) + text[at:]
    if kind == "truncate":
        return text[:rng.randrange(1, len(text))]
    return text


GOOD = [dumps(r.model_dump(mode="json", exclude_none=True))
        for r in lockstep(0, [50.0] * 4, job=JOB, nodes=["a", "a", "b", "b"])]


def good(n: int) -> list[bytes]:
    """Body n's two good reports: ranks 0-1 or 2-3 of window n // 2 (complete every second body)."""
    seq = n // 2
    return [text.replace(b'"seq": 0, "first_step": 0', b'"seq": %d, "first_step": %d' % (seq, 50 * seq))
            for text in GOOD[2 * (n % 2):][:2]]


SEQ = itertools.count()


def body(as_lines: bool, seed: int, value) -> tuple[bytes, int, set[int]]:
    """(body, items, indices of the good items): two good reports, 1-4 hostile items in between.

    ``seed`` picks the body's shape (kinds, positions, fields, which
    ``HOSTILE`` values); ``value`` is a generated value its hostile items use.
    """
    rng = random.Random(seed)
    goods = good(next(SEQ))
    items = list(goods)
    for _ in range(rng.randint(1, 4)):
        kind = rng.choice(KINDS)
        if kind in RAW and not as_lines:
            kind = "field"
        items.insert(rng.randint(0, len(items)), hostile(kind, rng.getrandbits(32), value))
    good_at = {i for i, item in enumerate(items) if item in goods}
    text = b"\n".join(items) if as_lines else b"[" + b", ".join(items) + b"]"
    return text, len(items), good_at


# Hypothesis' own cost is per example, so one example is a run of bodies: per body
# it draws the format, a seed and a generated value.
PER_EXAMPLE = 5
runs = st.lists(st.tuples(st.booleans(), st.integers(0, 2**32 - 1), generated),
                min_size=PER_EXAMPLE, max_size=PER_EXAMPLE)


def proc_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1])
    raise KeyError(key)


def test_10000_hostile_bodies_no_5xx_good_items_kept_memory_bounded(tmp_path):
    daemon = Artemisd(tmp_path).start()
    conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=60)
    seen = {"bodies": 0, "items": 0, "refused": 0, "statuses": {}}
    memory: dict[str, int] = {}

    @settings(max_examples=BODIES // PER_EXAMPLE, derandomize=True, database=None, deadline=None,
              phases=(Phase.explicit, Phase.generate), suppress_health_check=list(HealthCheck))
    @given(run=runs)
    def post_run(run):
        for as_lines, seed, value in run:
            post(*body(as_lines, seed, value))

    def post(body: bytes, count: int, good_at: set[int]) -> None:
        conn.request("POST", "/v1/reports", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        text = resp.read()
        seen["statuses"][resp.status] = seen["statuses"].get(resp.status, 0) + 1
        assert resp.status == 200, (resp.status, text[:500], body[:500])
        reply = json.loads(text)
        refused = {r["index"]: r["error"] for r in reply["rejected"]}
        assert not good_at & set(refused), (refused, body[:500])
        assert reply["accepted"] + len(refused) == count and len(refused) == len(reply["rejected"])
        assert all(isinstance(e, str) and e for e in refused.values())
        seen["bodies"] += 1
        seen["items"] += count
        seen["refused"] += len(refused)
        if seen["bodies"] == WARM:
            memory["warm_rss"] = proc_kib(daemon.proc.pid, "VmRSS")

    try:
        post_run()
        memory["hwm"] = proc_kib(daemon.proc.pid, "VmHWM")
        memory["rss"] = proc_kib(daemon.proc.pid, "VmRSS")
        status = daemon.get("/v1/status")
        fields = Path(f"/proc/{daemon.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        server_cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    finally:
        conn.close()
        daemon.stop()
    print(f"\nfuzz: {seen['bodies']} bodies, {seen['items']} items, {seen['refused']} refused, "
          f"statuses {seen['statuses']}; RSS after {WARM}: {memory['warm_rss'] / MIB:.1f} MiB, "
          f"high-water after all: {memory['hwm'] / MIB:.1f} MiB, quarantined {status['quarantined']}, "
          f"server CPU {server_cpu:.1f} s")
    assert seen["bodies"] >= BODIES
    assert status["quarantined"] == 0  # nothing reached analysis that analysis could not use
    # Per-job state is capped and the history pruned: 9,000 more bodies may not grow the daemon.
    assert memory["hwm"] - memory["warm_rss"] < 48 * MIB, memory
