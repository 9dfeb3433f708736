"""Probe overhead on a CPU DDP job: step time with and without torch_hook.

    .venv/bin/python benchmarks/overhead.py [--ranks 2] [--pairs 16] [--block 110] [--window 50] [--width 768]

Starts ``--ranks`` gloo ranks on 127.0.0.1.  Each rank builds two identical
DDP models: one while the probe is installed (so DDP's gradient buckets go
through the probe's timed comm hook) and one without it (DDP's built-in C++
all-reduce, exactly as an uninstrumented job runs).  It then alternates
blocks of ``--block`` steps -- probe installed + first model, probe
uninstalled + second model -- in ABBA order so drift cancels, all in one run.
A block's step time is its total time over its steps (after a few settling
steps), so the once-per-window work -- report building, the boundary
agreement -- is included rather than hidden by a median; a block spans at
least two windows.  The result is the median over pairs of (with / without)
- 1.  The probe reports to a ``file:`` endpoint, so serialisation and the
background writes are included.

This is a measurement, not a test: run it on a quiet machine for a number
you can quote.  Rank 0 prints one JSON line and a summary.

    .venv/bin/python benchmarks/overhead.py --micro [--pairs 40] [--block 400]

measures the probe's *absolute* cost per step instead: one rank, a tiny DDP
model (steps of a fraction of a millisecond, so the probe's few tens of
microseconds are not lost in the noise of a shared machine), windows of 50
steps; the result is the median over ABBA pairs of the per-step difference
in microseconds, and what it is as a share of a 20 ms step; it also times
DDP with the default all-reduce registered as a Python comm hook and no
probe, to show how much of the cost is that path (any comm-hook timing pays
it) and how much is the probe's own work.  On a loaded machine both modes
above are noisy; ``--components`` times the pieces directly, in one process,
without ranks:

    .venv/bin/python benchmarks/overhead.py --components

* the step-boundary bookkeeping (``Probe.boundary``), per step;
* ``optimizer.step()`` with and without the probe's global post-hook;
* one window's report: building, submitting, telemetry, JSON, the write --
  paid once per window (W steps), mostly on the sender thread;
* one wrapped ``torch.distributed`` call (a 1-element ``all_reduce`` on a
  one-rank gloo group) with and without the probe: what every collective a
  stack issues from Python pays.

    .venv/bin/python benchmarks/overhead.py --wrappers

times each collective wrapper alone: one process, a gloo group of size 1 (a
HashStore, no sockets), a 16-element tensor, so the call itself is a few
microseconds and the wrapper's share is visible; per API, the cost per call
without the probe, with it, and the difference (min of 5 runs of N calls).

    .venv/bin/python benchmarks/overhead.py --hook [--buckets 64] [--rounds 30] [--block 200]

puts DDP's gradient path side by side, per bucket: one rank, a model of
``--buckets`` small layers with a bucket cap that gives each layer its own
bucket, three identical DDP models trained in rotating order in one run --
DDP's built-in C++ all-reduce (no hook, as an uninstrumented job runs),
the default all-reduce registered as a Python comm hook (no probe), and the
probe's timed hook (probe installed).  The result is the median over rounds
of (step time - C++ step time) / buckets, in microseconds: the CPU cost a
Python hook adds per gradient bucket, and the probe's own share of it.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTLE_STEPS = 5


def _rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import torch_hook

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        w = args.width
        return torch.nn.Sequential(torch.nn.Linear(w, w), torch.nn.ReLU(), torch.nn.Linear(w, w),
                                   torch.nn.ReLU(), torch.nn.Linear(w, 1))

    if args.hook:
        _hook_rounds(args, DDP, default_hooks)
        dist.destroy_process_group()
        return
    if args.micro:
        args.width, args.batch = 16, 4  # the step is almost nothing but the probe's hooks
    plain = DDP(model())
    # DDP with the default all-reduce as a *Python* comm hook, no probe: the
    # micro mode splits the probe's cost into this path (which any comm-hook
    # timing pays) and the probe's own work.
    pyhook = DDP(model())
    pyhook.register_comm_hook(None, default_hooks.allreduce_hook)
    torch_hook.install()
    probed = DDP(model())  # built under the probe: gets the timed comm hook at its first forward
    torch_hook.uninstall()
    opts = {id(m): torch.optim.SGD(m.parameters(), lr=1e-4) for m in (plain, pyhook, probed)}
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, 1)

    def block(m: torch.nn.Module) -> float:
        opt = opts[id(m)]
        for i in range(args.block + SETTLE_STEPS):
            if i == SETTLE_STEPS:
                t0 = time.perf_counter()
            loss = torch.nn.functional.mse_loss(m(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        return (time.perf_counter() - t0) / args.block * 1e3

    block(plain)  # warm-up of both paths, not measured
    torch_hook.install()
    block(probed)
    torch_hook.uninstall()
    ratios, on_ms, off_ms, hook_ms = [], [], [], []
    for pair in range(args.pairs):
        if args.micro:
            hook_ms.append(block(pyhook))
        order = ("on", "off") if pair % 2 == 0 else ("off", "on")
        got = {}
        for mode in order:
            if mode == "on":
                torch_hook.install()
                got[mode] = block(probed)
                stats = torch_hook.stats()
                torch_hook.uninstall()  # flushes the sender; outside the timed block
            else:
                got[mode] = block(plain)
        on_ms.append(got["on"])
        off_ms.append(got["off"])
        ratios.append(got["on"] / got["off"])
    if rank == 0 and args.micro:
        cost_us = statistics.median((a - b) * 1e3 for a, b in zip(on_ms, off_ms))
        own_us = statistics.median((a - b) * 1e3 for a, b in zip(on_ms, hook_ms))
        result = {"mode": "micro", "pairs": args.pairs, "block_steps": args.block, "window_steps": args.window,
                  "step_us_without": round(statistics.median(off_ms) * 1e3, 2),
                  "step_us_python_hook_no_probe": round(statistics.median(hook_ms) * 1e3, 2),
                  "step_us_with": round(statistics.median(on_ms) * 1e3, 2),
                  "probe_cost_us_per_step": round(cost_us, 2),
                  "probe_cost_beyond_python_hook_us": round(own_us, 2),
                  "share_of_20ms_step_pct": round(cost_us / 20_000 * 100, 4),
                  "probe_errors": stats.get("errors"), "windows_last_block": stats.get("windows")}
        print(json.dumps(result))
        print(f"probe cost {cost_us:.1f} us per step = {result['share_of_20ms_step_pct']:.3f} % of a 20 ms step "
              f"({own_us:.1f} us beyond DDP's Python comm-hook path)", file=sys.stderr)
    elif rank == 0:
        overhead = (statistics.median(ratios) - 1) * 100
        result = {"ranks": dist.get_world_size(), "pairs": args.pairs, "block_steps": args.block,
                  "window_steps": args.window,
                  "step_ms_without": round(statistics.median(off_ms), 3),
                  "step_ms_with": round(statistics.median(on_ms), 3),
                  "overhead_pct_median_of_pairs": round(overhead, 3),
                  "overhead_pct_iqr": [round((q - 1) * 100, 3) for q in statistics.quantiles(ratios, n=4)[::2]],
                  "probe_errors": stats.get("errors"), "windows_last_block": stats.get("windows")}
        print(json.dumps(result))
        print(f"step {result['step_ms_without']:.2f} ms without the probe, {result['step_ms_with']:.2f} ms with; "
              f"overhead {overhead:+.3f} % (median of {args.pairs} ABBA pairs)", file=sys.stderr)
    dist.barrier()
    dist.destroy_process_group()


def _per_call_us(fn, n: int) -> float:
    best = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best.append((time.perf_counter() - t0) / n * 1e6)
    return min(best)  # the least disturbed run: a cost, not a noise sample


def _wrappers(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    import torch_hook
    from torch_hook.config import ProbeConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    pg = dist.GroupMember.WORLD
    x, out = torch.ones(16), torch.zeros(16)
    # Each lambda looks its API up at call time, so the same lambda runs the
    # original before install() and the wrapper after it.
    calls = {
        "all_reduce (sync)": lambda: dist.all_reduce(x),
        "all_reduce (async) + Work.wait": lambda: dist.all_reduce(x, async_op=True).wait(),
        "all_gather_single (sync)": lambda: dist.all_gather_single(out, x),
        "reduce_scatter_single (sync)": lambda: dist.reduce_scatter_single(out, x),
        "funcol.all_reduce + wait_tensor": lambda: funcol.all_reduce(x, "sum", pg).wait(),
        "funcol.all_gather_single + wait_tensor": lambda: funcol.all_gather_single(x, 0, pg).wait(),
    }
    n = 1000
    for fn in calls.values():  # warm-up: first-call costs are not per-call costs
        fn()
    config = ProbeConfig(endpoint=None, job="bench", job_step="0", node="n0", window_steps=args.window)
    bare: dict[str, float] = {}
    wrapped: dict[str, float] = {}
    for _ in range(4):  # alternate without/with, keep each one's least disturbed run
        for name, fn in calls.items():
            bare[name] = min(bare.get(name, 1e9), _per_call_us(fn, n))
        torch_hook.install(config)
        for name, fn in calls.items():
            wrapped[name] = min(wrapped.get(name, 1e9), _per_call_us(fn, n))
        torch_hook.uninstall()
    # The wrappers' own work, without the collective: each wrapper around a
    # no-op with the original's signature (what a real call adds, minus noise).
    torch_hook.install(config)
    probe = torch_hook._probe
    inst = probe.instrumentation
    from torch_hook.instrument import COLLECTIVES, _Spec

    def noop_like(original):
        return functools.wraps(original)(lambda *a, **k: None)

    c10d = dist.distributed_c10d
    pending = funcol.AsyncCollectiveTensor(torch.ones(16))
    pure = {
        "all_reduce (sync)": (inst._collective_wrapper(
            _Spec("all_reduce", c10d.all_reduce, COLLECTIVES["all_reduce"]), noop_like(c10d.all_reduce)),
            lambda w: w(x)),
        "all_gather_single (sync)": (inst._collective_wrapper(
            _Spec("all_gather_single", c10d.all_gather_single, COLLECTIVES["all_gather_single"]),
            noop_like(c10d.all_gather_single)), lambda w: w(out, x)),
        "funcol.all_reduce (issue)": (inst._functional_wrapper(
            _Spec("all_reduce", funcol.all_reduce, "self"),
            functools.wraps(funcol.all_reduce)(lambda *a, **k: pending)), lambda w: w(x, "sum", pg)),
        "funcol.wait_tensor": (inst._wait_tensor_wrapper(lambda t: t), lambda w: w(x)),
    }
    pure_us = {}
    for name, (wrapper, call) in pure.items():
        pure_us[name] = round(_per_call_us(lambda: call(wrapper), 20 * n)
                              - _per_call_us(lambda: call(lambda *a, **k: None), 20 * n), 2)
    errors = inst.errors
    torch_hook.uninstall()
    dist.destroy_process_group()
    rows = {name: {"without_us": round(bare[name], 2), "with_us": round(wrapped[name], 2),
                   "added_us": round(wrapped[name] - bare[name], 2)} for name in calls}
    print(json.dumps({"mode": "wrappers", "torch": torch.__version__, "calls_per_run": n,
                      "hook_errors": errors, "per_call": rows, "wrapper_only_us": pure_us}))
    for name, row in rows.items():
        print(f"{name:40s} {row['without_us']:8.2f} us -> {row['with_us']:8.2f} us  ({row['added_us']:+.2f})",
              file=sys.stderr)
    for name, us in pure_us.items():
        print(f"wrapper alone, {name:30s} {us:6.2f} us", file=sys.stderr)


def _hook_rounds(args: argparse.Namespace, DDP, default_hooks) -> None:  # noqa: N803 -- a class
    import torch

    import torch_hook

    width = 32

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(args.buckets)))

    # A layer's weight + bias is 4.2 kB: a 4 kB cap closes a bucket after each layer.
    cap_mb = 4096 / 2**20
    cpp = DDP(model(), bucket_cap_mb=cap_mb)
    pyhook = DDP(model(), bucket_cap_mb=cap_mb)
    pyhook.register_comm_hook(None, default_hooks.allreduce_hook)
    torch_hook.install()
    probed = DDP(model(), bucket_cap_mb=cap_mb)
    torch_hook.uninstall()
    models = {"cpp": cpp, "python_hook": pyhook, "probe": probed}
    opts = {name: torch.optim.SGD(m.parameters(), lr=1e-4) for name, m in models.items()}
    x = torch.randn(4, width)

    def block(name: str) -> float:
        m, opt = models[name], opts[name]
        for i in range(args.block + SETTLE_STEPS):
            if i == SETTLE_STEPS:
                t0 = time.perf_counter()
            loss = m(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return (time.perf_counter() - t0) / args.block * 1e6

    def timed(name: str) -> float:
        if name == "probe":
            torch_hook.install()
            try:
                return block(name)
            finally:
                torch_hook.uninstall()
        return block(name)

    for name in models:
        timed(name)  # warm-up, not measured
    logged = cpp._get_ddp_logging_data()  # buckets are rebuilt after the first step, in gradient order
    buckets = len(str(logged.get("rebuilt_bucket_sizes") or logged.get("bucket_sizes")).split(","))
    steps: dict[str, list[float]] = {name: [] for name in models}
    names = list(models)
    for r in range(args.rounds):
        for name in names[r % 3:] + names[:r % 3]:  # rotate so drift cancels
            steps[name].append(timed(name))
    per_bucket = {name: statistics.median((a - c) / buckets for a, c in zip(steps[name], steps["cpp"]))
                  for name in ("python_hook", "probe")}
    result = {"mode": "hook", "buckets": buckets, "rounds": args.rounds, "block_steps": args.block,
              "step_us_cpp": round(statistics.median(steps["cpp"]), 1),
              "step_us_python_hook": round(statistics.median(steps["python_hook"]), 1),
              "step_us_probe": round(statistics.median(steps["probe"]), 1),
              "python_hook_us_per_bucket": round(per_bucket["python_hook"], 2),
              "probe_hook_us_per_bucket": round(per_bucket["probe"], 2),
              "probe_beyond_python_hook_us_per_bucket": round(per_bucket["probe"] - per_bucket["python_hook"], 2)}
    print(json.dumps(result))
    print(f"per bucket over DDP's C++ all-reduce: Python comm hook {per_bucket['python_hook']:.1f} us, "
          f"probe's timed hook {per_bucket['probe']:.1f} us ({buckets} buckets per step)", file=sys.stderr)


def _components(args: argparse.Namespace) -> None:
    import torch

    import torch_hook

    per_call_us = _per_call_us
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.update({"ARTEMIS_ENDPOINT": f"file:{tmp}/t.jsonl", "ARTEMIS_WINDOW_STEPS": str(args.window)})
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        bare_step = per_call_us(opt.step, 5000)
        torch_hook.install()
        probe = torch_hook._probe
        hooked_step = per_call_us(opt.step, 5000)
        boundary = per_call_us(probe.boundary, 20000)
        recorder = probe.recorder
        for _ in range(args.window):
            recorder.comm("all_reduce", "world", 1e6, 1, 1.0, 2.0)
            window = recorder.end_step()
        while window is None:
            window = recorder.end_step()

        def reports(n: int = 32) -> None:
            # Batches below the queue bound, then wait for the sender: the
            # wall time is the CPU both threads spend per report.
            for _ in range(n):
                probe._submit(window)
            probe.sender.flush(10.0)

        report = per_call_us(reports, 10) / 32
        torch_hook.uninstall()
        # One wrapped collective, on a one-rank gloo group (no peer to wait for).
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        one = torch.ones(1)
        bare_call = per_call_us(lambda: dist.all_reduce(one), 5000)
        torch_hook.install()
        wrapped_call = per_call_us(lambda: dist.all_reduce(one), 5000)
        torch_hook.uninstall()
        dist.destroy_process_group()
    per_step = boundary + (hooked_step - bare_step)
    result = {"mode": "components", "window_steps": args.window,
              "boundary_us_per_step": round(boundary, 2),
              "optimizer_step_us_without": round(bare_step, 2), "optimizer_step_us_with": round(hooked_step, 2),
              "report_us_per_window": round(report, 1),
              "collective_us_without": round(bare_call, 2), "collective_us_with": round(wrapped_call, 2),
              "collective_wrapper_us_per_call": round(wrapped_call - bare_call, 2),
              "share_of_20ms_step_pct": round((per_step + report / args.window) / 20_000 * 100, 4)}
    print(json.dumps(result))
    print(f"per step {per_step:.1f} us, per window {report:.0f} us: "
          f"{result['share_of_20ms_step_pct']:.3f} % of 20 ms steps with W={args.window} "
          f"(DDP's Python comm-hook path not included: see --micro)", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=16)
    parser.add_argument("--block", type=int, default=110, help="measured steps per block (≥ 2 windows)")
    parser.add_argument("--window", type=int, default=50, help="ARTEMIS_WINDOW_STEPS")
    parser.add_argument("--width", type=int, default=768, help="MLP width (sets the step time)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--micro", action="store_true", help="absolute per-step cost on a tiny one-rank step")
    parser.add_argument("--components", action="store_true", help="time the probe's pieces directly, no ranks")
    parser.add_argument("--wrappers", action="store_true", help="time each collective wrapper alone, no ranks")
    parser.add_argument("--hook", action="store_true",
                        help="DDP per bucket: C++ all-reduce vs Python comm hook vs the probe's timed hook")
    parser.add_argument("--buckets", type=int, default=64, help="--hook: gradient buckets per step")
    parser.add_argument("--rounds", type=int, default=30, help="--hook: rotations of the three models")
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.components:
        _components(args)
        return
    if args.wrappers:
        _wrappers(args)
        return
    if args.hook:
        args.ranks = 1
        if "--block" not in sys.argv:
            args.block = 200
    if args.micro:
        args.ranks = 1
        if "--block" not in sys.argv:
            args.block = 400
        if "--pairs" not in sys.argv:
            args.pairs = 40
    if args.block < 2 * args.window:
        parser.error(f"--block {args.block} must cover two windows (--window {args.window})")
    if args.rank_main:
        _rank_main(args)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for rank in range(args.ranks):
            env = {**{k: v for k, v in os.environ.items() if not k.startswith("ARTEMIS_")},
                   "RANK": str(rank), "WORLD_SIZE": str(args.ranks), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "ARTEMIS_JOB_ID": "bench",
                   "ARTEMIS_ENDPOINT": f"file:{tmp}/trace.jsonl", "ARTEMIS_WINDOW_STEPS": str(args.window),
                   "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
            procs.append(subprocess.Popen([sys.executable, __file__, "--rank-main", "--block", str(args.block),
                                           "--pairs", str(args.pairs), *sys.argv[1:]], env=env))
        codes = [p.wait(timeout=1800) for p in procs]
    if any(codes):
        raise SystemExit(f"a rank failed: exit codes {codes}")


if __name__ == "__main__":
    main()
