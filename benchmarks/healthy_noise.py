"""False alarms on healthy jobs under host noise: how often the shipped defaults name somebody.

    .venv/bin/python benchmarks/healthy_noise.py                 # 100 runs per noise level
    .venv/bin/python benchmarks/healthy_noise.py --runs 300 --windows 60 --window-s 1

The base is a real healthy trace (tests/unit/data/healthy_ddp_pinned_hog.jsonl:
4 gloo ranks of plain DDP on the 2-core test bed, 10 windows), reduced to its
job-wide load swings: every rank of a window starts from that window's median
busy time (the trace's own one-rank episodes are the unit test's business).
Each run tiles it to ``--windows`` windows, stretches every window to
``--window-s`` seconds of wall time, and multiplies each rank's busy time in
each window by an independent log-normal factor (sigma 0.1, 0.2, 0.3: the
±10-30 % window-to-window swings of one process on a shared host), taking
the extra time out of that rank's wait so the job stays in lockstep.  Nothing is slow, so every incident that
names a rank, node or link is a false alarm.  Printed per noise level: the
share of runs with a named incident and the windows where they began.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from collections import Counter
from pathlib import Path

from artemisd.replay import replay_records
from artemisd.wire import WindowReport, parse_record

BASE = Path(__file__).resolve().parents[1] / "tests" / "unit" / "data" / "healthy_ddp_pinned_hog.jsonl"


def noisy_run(base: list[dict], windows: int, window_s: float, sigma: float, seed: int) -> list[WindowReport]:
    rng = random.Random(seed)
    per_window = 1 + max(r["window"]["seq"] for r in base)
    median_busy = {seq: statistics.median(r["ms"]["busy"] for r in base if r["window"]["seq"] == seq)
                   for seq in range(per_window)}
    out = []
    for seq in range(windows):
        for record in (r for r in base if r["window"]["seq"] == seq % per_window):
            d = json.loads(json.dumps(record))
            ms, steps = d["ms"], d["window"]["steps"]
            factor = rng.lognormvariate(0.0, sigma) * median_busy[seq % per_window] / ms["busy"]
            ms["busy"] *= factor
            ms["compute"] *= factor
            d["ms_p50"]["busy"] *= factor
            ms["comm_wait"] = max(0.0, ms["step"] - ms["busy"])
            ms["step"] = ms["busy"] + ms["comm_wait"]
            d["window"].update(seq=seq, first_step=seq * steps, t0=1.0e9 + seq * window_s,
                               t1=1.0e9 + (seq + 1) * window_s)
            out.append(parse_record(d, f"run {seed} window {seq}"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--windows", type=int, default=30)
    parser.add_argument("--window-s", type=float, default=1.0)
    parser.add_argument("--sigmas", default="0.1,0.2,0.3")
    args = parser.parse_args()
    base = [json.loads(line) for line in BASE.read_text().splitlines() if line.strip()]
    print(f"{args.runs} healthy 4-rank runs of {args.windows} windows of {args.window_s:g} s per noise level")
    print("sigma  runs_with_named  share   onsets (window: count)")
    for sigma in (float(s) for s in args.sigmas.split(",")):
        onsets: Counter[int] = Counter()
        runs_named = 0
        for seed in range(args.runs):
            incidents = replay_records(noisy_run(base, args.windows, args.window_s, sigma, seed))
            named = [i for i in incidents if i.rank is not None or i.node is not None or i.link is not None]
            runs_named += bool(named)
            onsets.update(i.onset_window for i in named)
        print(f"{sigma:<5}  {runs_named:<15}  {runs_named / args.runs:5.1%}   {dict(sorted(onsets.items()))}")


if __name__ == "__main__":
    main()
