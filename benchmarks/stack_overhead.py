"""The probe's cost per training stack, from its measured pieces and what each stack issues.

    .venv/bin/python benchmarks/overhead.py --components > comp.json
    .venv/bin/python benchmarks/overhead.py --hook > hook.json
    .venv/bin/python -m pytest tests/probe/test_stacks.py -m probe --basetemp=/tmp/matrix
    .venv/bin/python benchmarks/stack_overhead.py comp.json hook.json /tmp/matrix

The stack matrix leaves one trace per stack (``<stack>-<world>ranks0/trace.jsonl``
under the basetemp).  From its healthy windows this counts, per step, the
collective calls the probe wrapped and -- for the DDP stacks -- the gradient
buckets that went through its timed comm hook, then prices them with the
pieces ``overhead.py`` timed alone:

    per step   = boundary + optimizer hook + calls x wrapped call + buckets x timed hook
    per window = one report

Every count and price is printed, so the sum can be checked by hand.  It is
an estimate built from measurements, not a timing of the stack itself (that
is the whole-job ratio, which needs a quiet machine: ``overhead.py``).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

# Stacks whose gradients go through DDP's reducer (and so the probe's comm hook);
# their all_reduce calls in the reports are the buckets.
DDP_STACKS = {"ddp", "compiled", "hf", "lightning"}
HEALTHY_WINDOWS = range(1, 6)  # test_stacks: windows 0-5 healthy, window 0 holds the warm-up


def _last_json(path: Path) -> dict:
    lines = [line for line in path.read_text().splitlines() if line.startswith("{")]
    if not lines:
        raise SystemExit(f"{path}: no JSON line (expected overhead.py's output)")
    return json.loads(lines[-1])


def calls_per_step(trace: Path) -> dict[str, float]:
    """Mean calls per step and rank of each op over the healthy windows."""
    calls: dict[str, float] = defaultdict(float)
    steps = 0
    for line in trace.read_text().splitlines():
        report = json.loads(line)
        if report.get("type") != "window" or report["window"]["seq"] not in HEALTHY_WINDOWS:
            continue
        steps += report["window"]["steps"]
        for c in report.get("collectives", []):
            calls[c["op"]] += c["calls"]
    if not steps:
        raise SystemExit(f"{trace}: no healthy windows")
    return {op: n / steps for op, n in sorted(calls.items())}


def main() -> None:
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    comp, hook, matrix = _last_json(Path(sys.argv[1])), _last_json(Path(sys.argv[2])), Path(sys.argv[3])
    fixed = comp["boundary_us_per_step"] + comp["optimizer_step_us_with"] - comp["optimizer_step_us_without"]
    per_call, per_bucket = comp["collective_wrapper_us_per_call"], hook["probe_hook_us_per_bucket"]
    print(f"boundary + optimizer hook {fixed:.1f} us/step; wrapped call {per_call:.1f} us; "
          f"timed DDP bucket {per_bucket:.1f} us over C++; report {comp['report_us_per_window']:.0f} us/window")
    print("| stack | calls per step (op: n) | buckets per step | µs per step | µs per window |")
    print("|---|---|---|---|---|")
    for trace in sorted(matrix.glob("*/trace.jsonl")):
        if trace.parent.is_symlink():
            continue  # pytest's "<name>current" link to the newest run
        stack, _, ranks = trace.parent.name.rpartition("-")
        if not ranks.startswith("4ranks"):
            continue  # the 4-rank jobs; the 2-rank DDP job costs the same per rank
        ops = calls_per_step(trace)
        buckets = ops.get("all_reduce", 0.0) if stack in DDP_STACKS else 0.0
        wrapped = sum(ops.values()) - buckets
        us = fixed + wrapped * per_call + buckets * per_bucket
        shown = ", ".join(f"{op}: {n:g}" for op, n in ops.items()) or "none"
        print(f"| {stack} | {shown} | {buckets:g} | {us:.0f} | {comp['report_us_per_window']:.0f} |")


if __name__ == "__main__":
    main()
