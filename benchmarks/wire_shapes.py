"""What the window reports' bytes cost the daemon's decode, and whether a node's batch would cut it.

    .venv/bin/python benchmarks/wire_shapes.py                # 100,000 reports, best of 3

The ingest target of issue 12 (a 100k-rank window read, validated and stored
in <= 1 CPU-s) is not met on the 2-core machine, and the read is most of it.
This asks where the read's time goes, on one window of probe-shaped reports
(``benchmarks/scale.py``'s), CPU seconds in this process (pinned to one CPU,
``tune_gc`` as the daemon):

* **fast_records**: what ``POST /v1/reports`` does, every bound and the
  cross-field rules;
* **decode**: msgspec's decode into the Structs alone, every per-field bound;
* **decode, no bounds**: the same Structs with the ``Meta`` bounds left out;
* **split only**: the body cut into its items (``msgspec.Raw``), the JSON
  tokenized and nothing built: the floor of any decoder that reads the bytes;
* **node batch** (8 ranks per node, not a wire format: a shape to measure):
  what the ranks of a node share stated once (job, step, world, node,
  island, host, environment), decoded into Structs of the shared and per-rank
  fields (**node batch, decode**), then each rank's record built from the two
  (**node batch, merge**), which the daemon would need since its analysis
  reads a record's fields by attribute.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
import types
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgspec  # noqa: E402
from msgspec import Meta  # noqa: E402

from artemisd import ingest  # noqa: E402
from artemisd.ingest import FastReport, _Fast  # noqa: E402
from artemisd.server import tune_gc  # noqa: E402
from benchmarks.scale import GPUS_PER_NODE, window  # noqa: E402

SHARED = ("job", "step", "world", "node", "island", "host", "env")


def _part(name: str, keep) -> type:
    """A Struct of ``FastReport``'s fields that ``keep`` takes, with their types, bounds and defaults."""
    fields = [(f.name, f.type) if f.required else (f.name, f.type, f.default)
              for f in msgspec.structs.fields(FastReport) if keep(f.name)]
    return msgspec.defstruct(name, fields, bases=(_Fast,), kw_only=True)


_Shared = _part("_Shared", lambda name: name in SHARED)
_PerRank = _part("_PerRank", lambda name: name not in SHARED + ("type", "v"))


class _NodeBatch(_Fast):
    type: Literal["windows"]
    v: Literal[1]
    shared: _Shared  # type: ignore[valid-type]
    reports: list[_PerRank]  # type: ignore[valid-type]


def _unbounded_decoder() -> msgspec.json.Decoder:
    """The fast path's Structs with every ``Meta`` bound dropped (what the bounds cost)."""
    source = Path(ingest.__file__).read_text().split("# --- the fast path", 1)[1].split("\n", 1)[1]
    source = source.split("\n_FAST_BATCH", 1)[0].replace("Meta(", "_no_bounds(")
    module = types.ModuleType("unbounded_fast_path")  # msgspec resolves annotations in the class's module
    sys.modules[module.__name__] = module
    module.__dict__["_no_bounds"] = lambda *a, **k: Meta()
    exec("from __future__ import annotations\nfrom artemisd.ingest import *\n"  # noqa: S102
         "from artemisd.ingest import _BUSY_SLACK_MS\nfrom artemisd.wire import *\n"
         "from typing import Annotated, Literal\nimport sys, msgspec\nfrom msgspec import Meta\n" + source,
         module.__dict__)
    return msgspec.json.Decoder(list[module.FastReport])


def best(fn, rounds: int) -> float:
    out = float("inf")
    for _ in range(rounds):
        start = time.process_time()
        fn()
        out = min(out, time.process_time() - start)
    return out


def main() -> int:
    ranks, rounds = 100_000, 3
    os.sched_setaffinity(0, {0})
    tune_gc()
    reports = window(0, ranks, random.Random(1))
    body = json.dumps(reports, separators=(",", ":")).encode()
    nodes = []
    for i in range(0, ranks, GPUS_PER_NODE):
        group = reports[i:i + GPUS_PER_NODE]
        nodes.append({"type": "windows", "v": 1, "shared": {k: group[0][k] for k in SHARED},
                      "reports": [{k: v for k, v in r.items() if k not in SHARED + ("type", "v")} for r in group]})
    node_body = json.dumps(nodes, separators=(",", ":")).encode()
    node_decoder = msgspec.json.Decoder(list[_NodeBatch])
    batches = node_decoder.decode(node_body)

    def merge() -> list[FastReport]:
        return [FastReport(type="window", v=1, job=b.shared.job, step=b.shared.step, rank=p.rank,
                           world=b.shared.world, node=b.shared.node, device=p.device, island=b.shared.island,
                           window=p.window, ms=p.ms, ms_p50=p.ms_p50, samples=p.samples,
                           collectives=p.collectives, gpu=p.gpu, host=b.shared.host, env=b.shared.env,
                           probe=p.probe, dropped_reports=p.dropped_reports)
                for b in batches for p in b.reports]

    unbounded = _unbounded_decoder()
    raw = msgspec.json.Decoder(list[msgspec.Raw])
    print(f"{ranks:,} reports: {len(body) / ranks:.0f} bytes each; as node batches of {GPUS_PER_NODE}: "
          f"{len(node_body) / ranks:.0f}")
    print(f"{'CPU-s per 100,000 reports (best of ' + str(rounds) + ')':44}")
    scale = 100_000 / ranks
    for name, fn in (("fast_records (every bound, cross-field)", lambda: ingest.fast_records(body, ranks)),
                     ("decode", lambda: ingest._FAST_BATCH.decode(body)),
                     ("decode, no bounds", lambda: unbounded.decode(body)),
                     ("split only", lambda: raw.decode(body)),
                     ("node batch, decode", lambda: node_decoder.decode(node_body)),
                     ("node batch, merge into records", merge)):
        print(f"  {name:42} {best(fn, rounds) * scale:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
