"""Artemis side by side with the peers: the same jobs, the same faults, one run each.

    .venv/bin/python benchmarks/peers.py --setup     # once: the peers' venv (.venv-peers), pinned
    .venv/bin/python benchmarks/peers.py --quick     # ≤ 5 min on a 2-core machine
    .venv/bin/python benchmarks/peers.py             # longer runs, same shape

Three small CPU/gloo DDP jobs of 4 ranks, each run once:

* ``healthy``: nothing injected; then, in the same ranks, the overhead phase:
  the step time with each tool alone and with none, in alternating blocks
  (the order rotates every round);
* ``slowed``: from a known iteration on, one rank is slowed from *outside* the
  job, by a cgroup CPU quota (the benchmark is the cgroup's writer; where no
  cgroup can be written, a stop/continue duty cycle does the same);
* ``intermittent``: the same rank is stopped and continued (SIGSTOP/SIGCONT)
  in bursts: slowed for a while, then normal, and again.

Every job's detection phase is instrumented by all three tools at once, as a
user would run them:

* **artemis**: the autoload probe (``ARTEMIS_ENABLED=1``, ``torch_hook/autoload``
  on PYTHONPATH, as ``sbatch --artemis=on`` arranges it) writes window
  reports to a ``file:`` trace; ``artemis replay --json`` turns the trace into
  incidents exactly as the daemon would live.  A report is an incident; it
  counts from the end of its ``confirmed_window``.
* **nvrx**: nvidia-resiliency-ext's ``straggler.Detector`` as its usage guide
  shows it: ``initialize(scores_to_compute=[relative, individual],
  gather_on_rank0=True)``, sections ``data_loading`` (profile_cuda=False) and
  ``fwd`` (profile_cuda=True) around the batch and the forward call,
  ``generate_report()`` every ``STRAGGLER_REPORT_INTERVAL`` iterations (here:
  the same number of steps as Artemis's window), ``identify_stragglers()`` on
  rank 0 with its default thresholds (0.75).  On a CPU-only torch two calls
  cannot run and are replaced (see ``NVRX_ON_CPU``); its scoring is untouched.
* **megatron**: megatron-core's ``StragglerDetector`` as its README shows it:
  ``configure(world, rank, enabled=True)``, ``with stimer`` around the
  forward, ``with stimer(bdata=True)`` around the batch, ``report(flops,
  interval)`` every interval.  It cannot run on CPU: ``configure`` checks
  ``torch.cuda.is_available()`` and stays off without CUDA ("No CUDA, No
  Support" in megatron/core/utils.py), and its timers are ``torch.cuda.Event``
  pairs, which a CPU build of torch cannot create.  It is still called, so its
  row shows what a user gets on such a machine: no report, and its cost.

Scores (pure functions below, tested in tests/unit/test_peers_scoring.py):
``latency_steps`` — iterations from the fault's first iteration to the first
report naming the slowed rank (``-`` = never); ``false_blames`` — names of a
rank other than the slowed one in the faulted jobs' reports (each such rank
in each report counts once); ``healthy_flags`` — names of any rank in the
healthy job; ``cause`` — what the first report naming the slowed rank says
caused it (``-`` = nothing); ``overhead_pct`` — median over rounds of a tool's
block step time against the no-tool block of the same round, minus one.

The peers live in their own venv (``--setup``): ``.venv-peers`` sees the
project venv's packages (the CPU torch 2.13.0, Artemis) through a ``.pth``
file and gets the pinned peer wheels with ``--no-deps``, so pip can never
resolve a CUDA torch or nvidia-* CUDA wheels.  Results: a table on stdout and
every raw number in ``OUT/peers.json`` (default ``out/peers``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.peers_score import (Report, format_table, megatron_names, nvrx_names,  # noqa: E402
                                    onset_iteration, score, window_ends, artemis_reports)

VENV = ROOT / ".venv-peers"
SYSTEMS = ("artemis", "nvrx", "megatron")
# Pinned; installed with --no-deps.  nvidia-ml-py, psutil, packaging, numpy
# and torch (2.13.0, CPU) come from the project venv; NVRx asks for pynvml too, but
# nvidia-ml-py already provides that module and the straggler package never imports it.
PINS = ("nvidia-resiliency-ext==0.4.1", "megatron-core==0.16.1", "defusedxml==0.7.1",
        "PyYAML==6.0.4")
NVRX_ON_CPU = (
    "nvrx_cupti_module (NVRx's compiled CUPTI extension) links libcupti.so.12 from the CUDA toolkit "
    "and cannot load without it: Detector.initialize() gets a stand-in that captures no kernels "
    "(the same as CUPTI on a rank that launches none), so GPU scores are NaN and never flag; "
    "Detector.generate_report() calls torch.cuda.synchronize(), which raises on a CPU build: "
    "it is a no-op there (there is no kernel to wait for)")
MEGATRON_ON_CPU = (
    "StragglerDetector.configure() stays off unless torch.cuda.is_available() ('No CUDA, No Support'); "
    "its timers are torch.cuda.Event pairs (a CPU build raises 'Tried to instantiate dummy base class Event') "
    "and report() reads temperature, power, utilization and clocks through torch.cuda/NVML")


# -- inside each rank ------------------------------------------------------------

WIDTH = 256
SETTLE = 3  # steps at the start of a block that are not timed


class Nvrx:
    """NVRx's Detector as its usage guide wires it (CPU stand-ins: NVRX_ON_CPU)."""

    def __init__(self) -> None:
        import torch

        import nvidia_resiliency_ext.straggler as straggler
        from nvidia_resiliency_ext.straggler import straggler as detector_module

        class NoKernels:
            """CuptiManager's interface, capturing nothing: no CUDA kernel runs on this rank."""

            def __init__(self, *args: Any, **kwargs: Any) -> None:
                pass

            def initialize(self) -> None:
                pass

            def shutdown(self) -> None:
                pass

            def start_profiling(self) -> None:
                pass

            def stop_profiling(self) -> None:
                pass

            def get_results(self) -> dict:
                return {}

            def reset_results(self) -> None:
                pass

        class CpuCuda:
            def __getattr__(self, name: str) -> Any:
                return getattr(torch.cuda, name)

            @staticmethod
            def synchronize(*args: Any, **kwargs: Any) -> None:
                pass

        class CpuTorch:
            cuda = CpuCuda()

            def __getattr__(self, name: str) -> Any:
                return getattr(torch, name)

        # Only the detector module's names are replaced; torch itself is untouched.
        detector_module.CuptiManager = NoKernels
        detector_module.torch = CpuTorch()
        self.straggler = straggler
        straggler.Detector.initialize(scores_to_compute=["relative_perf_scores", "individual_perf_scores"],
                                      gather_on_rank0=True)

    def section(self, name: str, profile_cuda: bool) -> Any:
        return self.straggler.Detector.detection_section(name, profile_cuda=profile_cuda)

    def report(self, rank: int) -> dict | None:
        report = self.straggler.Detector.generate_report()
        if rank != 0:
            return None
        found = report.identify_stragglers()  # default thresholds

        def ids(s: Iterable[Any]) -> list[int]:
            return sorted(sid.rank for sid in s)

        plain = {"straggler_gpus_relative": ids(found["straggler_gpus_relative"]),
                 "straggler_gpus_individual": ids(found["straggler_gpus_individual"]),
                 "straggler_sections_relative": {k: ids(v) for k, v in found["straggler_sections_relative"].items()},
                 "straggler_sections_individual": {k: ids(v) for k, v in
                                                   found["straggler_sections_individual"].items()}}
        return {"stragglers": plain,
                "relative": {k: {str(r): s for r, s in v.items()} for k, v in report.section_relative_perf_scores.items()},
                "individual": {k: {str(r): s for r, s in v.items()}
                               for k, v in report.section_individual_perf_scores.items()}}


class Megatron:
    """megatron-core's StragglerDetector as megatron/core/README_STRAGGLER.md wires it."""

    def __init__(self, world: int, rank: int, port: int) -> None:
        import logging

        from megatron.core.utils import StragglerDetector

        self.lines: list[str] = []
        lines = self.lines

        class Keep(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                lines.append(record.getMessage())

        logging.getLogger("megatron.core.utils").addHandler(Keep())
        logging.getLogger("megatron.core.utils").setLevel(logging.INFO)
        self.stimer = StragglerDetector()
        self.stimer.configure(world, rank, enabled=True, port=port)

    def report(self, flops: float, interval: int) -> list[str]:
        before = len(self.lines)
        self.stimer.report(flops, interval)
        return [line for line in self.lines[before:] if "MxRtt/Rnk" in line]


def _mlp() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH),
                               torch.nn.ReLU(), torch.nn.Linear(WIDTH, 1))


def _batch(rank: int, i: int, n: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(1000 * rank + i)
    return torch.randn(n, WIDTH, generator=g), torch.randn(n, 1, generator=g)


def _rank_main(spec: dict) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # the autoload installs Artemis's probe here
    import torch_hook

    rank, world = dist.get_rank(), dist.get_world_size()
    out, W, batch = Path(spec["out"]), spec["window"], spec["batch"]
    nvrx = Nvrx()
    mega = Megatron(world, rank, spec["megatron_port"])
    model = DDP(_mlp())
    params = sum(p.numel() for p in model.parameters())
    flops = 6.0 * params * batch * world * W  # the theoretical flops over one report interval
    result: dict[str, Any] = {"rank": rank, "installed": torch_hook.installed()}

    def train(m: Any, opt: Any, i: int, tools: frozenset[str]) -> None:
        with nvrx.section("data_loading", False) if "nvrx" in tools else contextlib.nullcontext(), \
                mega.stimer(bdata=True) if "megatron" in tools else contextlib.nullcontext():
            x, y = _batch(rank, i, batch)
        with nvrx.section("fwd", True) if "nvrx" in tools else contextlib.nullcontext(), \
                mega.stimer if "megatron" in tools else contextlib.nullcontext():
            out_ = m(x)
        loss = torch.nn.functional.mse_loss(out_, y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    def reports(i: int, tools: frozenset[str], nv: list, mg: list, done: int) -> None:
        if i % W:  # the usage guides' `if training_iter % INTERVAL == 0`
            return
        if "nvrx" in tools:
            got = nvrx.report(rank)
            if got is not None:
                nv.append({"done": done, **got})
        if "megatron" in tools:
            for line in mega.report(flops, W):
                mg.append({"done": done, "line": line})

    # Detection: every tool at once, as a user would run them.
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ends: list[float] = []
    nv: list[dict] = []
    mg: list[dict] = []
    every = frozenset(SYSTEMS)
    for i in range(spec["iterations"]):
        if rank == spec.get("slow_rank") and i == spec.get("fault_at"):
            (out / "at-fault-iteration").write_text(f"{i} {time.time()}\n")
        train(model, opt, i, every)
        ends.append(time.time())
        reports(i, every, nv, mg, i + 1)
    result.update(ends=ends, nvrx=nv, megatron=mg, megatron_enabled=mega.stimer.enabled, probe=torch_hook.stats())
    if spec.get("rounds"):
        # Overhead, in the same processes (a job's start-up is most of this benchmark's
        # time): two identical models, one built under the probe (its buckets go through
        # the probe's comm hook), one without it (DDP's C++ all-reduce).
        probed = model
        torch_hook.uninstall()
        plain = DDP(_mlp())
        opts = {id(probed): torch.optim.SGD(probed.parameters(), lr=1e-4),
                id(plain): torch.optim.SGD(plain.parameters(), lr=1e-4)}
        modes = ("none", "artemis", "nvrx", "megatron")
        rounds: list[dict[str, float]] = []
        for r in range(spec["rounds"]):
            got: dict[str, float] = {}
            for mode in modes[r % 4:] + modes[:r % 4]:
                if mode == "artemis":
                    torch_hook.install()
                m = probed if mode == "artemis" else plain
                tools = frozenset({mode}) & frozenset(SYSTEMS)
                sink: list = []
                for i in range(SETTLE):
                    train(m, opts[id(m)], i, tools)
                t0 = time.perf_counter()
                for i in range(spec["block"]):
                    train(m, opts[id(m)], i, tools)
                    reports(i, tools, sink, sink, i + 1)
                got[mode] = (time.perf_counter() - t0) / spec["block"] * 1e3
                if mode == "artemis":
                    torch_hook.uninstall()  # flushes the sender: outside the timed block
            rounds.append(got)
        result.update(rounds=rounds)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


# -- the faults, applied from outside the job ---------------------------------------


class CpuQuota:
    """A cgroup the benchmark owns, holding one rank; ``limit()`` caps it at
    ``share`` of one CPU (cgroup v1 cpu controller or v2 cpu.max)."""

    def __init__(self, name: str, share: float, period_us: int = 100_000):
        self.share, self.period_us = share, period_us
        v1 = Path("/sys/fs/cgroup/cpu")
        if (v1 / "cpu.cfs_quota_us").exists():
            self.path, self.v2 = v1 / name, False
        elif Path("/sys/fs/cgroup/cgroup.controllers").exists():
            self.path, self.v2 = Path("/sys/fs/cgroup") / name, True
        else:
            raise OSError("no cgroup cpu controller found")
        self.path.mkdir(exist_ok=True)
        if self.v2 and not (self.path / "cpu.max").exists():
            self.close()
            raise OSError("cgroup v2 without the cpu controller delegated here")

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def limit(self) -> None:
        quota = int(self.share * self.period_us)
        if self.v2:
            (self.path / "cpu.max").write_text(f"{quota} {self.period_us}")
        else:
            (self.path / "cpu.cfs_period_us").write_text(str(self.period_us))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))

    def close(self) -> None:
        for _ in range(50):  # the rank's exit empties it a moment later
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def _stop_cont(pid: int, stop_s: float, run_s: float, until: float, stop: threading.Event) -> None:
    """SIGSTOP for stop_s, SIGCONT for run_s, until the monotonic deadline; always continues."""
    try:
        while not stop.is_set() and time.monotonic() < until:
            os.kill(pid, signal.SIGSTOP)
            try:
                stop.wait(stop_s)
            finally:
                os.kill(pid, signal.SIGCONT)
            stop.wait(run_s)
    except ProcessLookupError:
        pass


class Fault:
    """Waits for the slowed rank to reach the fault's iteration, then applies it."""

    def __init__(self, kind: str, out: Path, pid: int, quota: CpuQuota | None, plan: dict):
        self.kind, self.out, self.pid, self.quota, self.plan = kind, out, pid, quota, plan
        self.stop = threading.Event()
        self.t0: float | None = None
        self.mechanism = ""
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        marker = self.out / "at-fault-iteration"
        while not marker.exists():
            if self.stop.wait(0.005):
                return
        p = self.plan
        if self.kind == "slowed" and self.quota is not None:
            self.quota.limit()
            self.t0, self.mechanism = time.time(), f"cgroup cpu quota {self.quota.share:.0%} of one CPU"
            return
        if self.kind == "slowed":  # no writable cgroup: the same slowdown by stop/continue
            self.t0, self.mechanism = time.time(), f"SIGSTOP {p['stop_ms']} ms / SIGCONT {p['run_ms']} ms"
            _stop_cont(self.pid, p["stop_ms"] / 1e3, p["run_ms"] / 1e3, float("inf"), self.stop)
            return
        self.t0 = time.time()
        self.mechanism = (f"bursts of {p['burst_s']} s of SIGSTOP {p['stop_ms']} ms / SIGCONT {p['run_ms']} ms, "
                          f"{p['gap_s']} s apart")
        while not self.stop.is_set():
            _stop_cont(self.pid, p["stop_ms"] / 1e3, p["run_ms"] / 1e3, time.monotonic() + p["burst_s"], self.stop)
            self.stop.wait(p["gap_s"])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGCONT)


# -- the driver ----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(name: str, spec: dict, out: Path, *, world: int, fault: dict | None, timeout_s: float) -> dict:
    """Start ``world`` ranks in the peers' venv under the autoload; apply ``fault``; collect."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*"):
        stale.unlink()
    trace = out / "trace.jsonl"
    spec = {**spec, "out": str(out), "megatron_port": _free_port()}
    port = _free_port()
    started = time.monotonic()
    quota = None
    if fault and fault["kind"] == "slowed":
        try:
            quota = CpuQuota(f"artemis-peers-{os.getpid()}", fault["share"])
        except OSError as err:
            print(f"peers: {err}: the slowed rank is stopped and continued instead", file=sys.stderr)
    procs, logs = [], []
    for rank in range(world):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ARTEMIS_", "SLURM"))}
        env.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
                    "PYTHONPATH": f"{ROOT / 'torch_hook' / 'autoload'}:{ROOT}", "ARTEMIS_ENABLED": "1",
                    "ARTEMIS_ENDPOINT": f"file:{trace}", "ARTEMIS_WINDOW_STEPS": str(spec["window"]),
                    "ARTEMIS_JOB_ID": f"peers-{name}", "ARTEMIS_TELEMETRY": "none",
                    # one rank per emulated node, as on a cluster with one GPU per node
                    "ARTEMIS_NODE": f"n{rank}", "PYTHONFAULTHANDLER": "1"})
        logs.append(open(out / f"rank{rank}.log", "w"))
        procs.append(subprocess.Popen([str(VENV / "bin" / "python"), __file__, "--rank-main", json.dumps(spec)],
                                      env=env, stdout=logs[-1], stderr=subprocess.STDOUT))
    slow = spec.get("slow_rank")
    injector = None
    if fault:
        if quota is not None:
            quota.add(procs[slow].pid)
        injector = Fault(fault["kind"], out, procs[slow].pid, quota, fault)
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        if injector:
            injector.close()
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGABRT)  # faulthandler: the log says where it hung
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        for log in logs:
            log.close()
        if quota is not None:
            quota.close()
    codes = [p.returncode for p in procs]
    if any(codes):
        tails = "\n".join((out / f"rank{r}.log").read_text()[-3000:] for r in range(world))
        raise RuntimeError(f"job {name}: exit codes {codes}\n{tails}")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    job = {"name": name, "spec": spec, "ranks": ranks, "trace": str(trace), "wall_s": time.monotonic() - started}
    if injector:
        if injector.t0 is None:
            raise RuntimeError(f"job {name}: the fault was never applied")
        job.update(fault_t0=injector.t0, mechanism=injector.mechanism)
    return job


def replay(trace: Path) -> list[dict]:
    """``artemis replay TRACE --json``, as a person would run it."""
    done = subprocess.run([sys.executable, "-m", "artemisd.cli", "replay", str(trace), "--json"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"artemis replay {trace}: {done.stderr[-2000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def system_reports(job: dict) -> dict[str, list[Report]]:
    """Each system's reports in one job's detection phase, as plain Reports."""
    trace = Path(job["trace"])
    last = (job["spec"]["iterations"] - 1) // job["spec"]["window"]  # windows of the detection phase
    records = [rec for rec in map(json.loads, filter(str.strip, trace.read_text().splitlines()))
               if rec.get("type") != "window" or rec["window"]["seq"] < last]
    detection = trace.with_name("detection.jsonl")  # without the overhead phase's windows
    detection.write_text("".join(json.dumps(rec) + "\n" for rec in records))
    incidents = replay(detection)
    job["incidents"] = incidents
    rank0 = job["ranks"][0]
    nvrx = [Report("nvrx", r["done"], *nvrx_names(r["stragglers"])) for r in rank0["nvrx"]]
    mega = [Report("megatron", r["done"], megatron_names(r["line"])) for r in rank0["megatron"]]
    return {"artemis": artemis_reports(incidents, window_ends(records)), "nvrx": nvrx, "megatron": mega}


def setup() -> None:
    """Create .venv-peers (idempotent): the pinned peers, with the project venv's CPU torch."""
    if sys.prefix == sys.base_prefix:
        sys.exit("peers: run --setup with the project venv's python (.venv/bin/python)")
    if not (VENV / "bin" / "python").exists():
        subprocess.run([sys._base_executable, "-m", "venv", str(VENV)], check=True)  # type: ignore[attr-defined]
    site = subprocess.run([str(VENV / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    base = sysconfig.get_paths()["purelib"]
    # addsitedir, not a bare path: the project venv's own .pth files (the editable
    # Artemis install) are processed too.
    Path(site, "_artemis_project.pth").write_text(f"import site; site.addsitedir({base!r})\n")
    pip = [str(VENV / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", "--no-deps"]
    have = subprocess.run([str(VENV / "bin" / "pip"), "freeze", "--local", "--disable-pip-version-check"],
                          capture_output=True, text=True).stdout.lower().split()
    missing = [p for p in PINS if p.lower() not in have and p.lower().replace("-", "_") not in have]
    if missing:
        subprocess.run(pip + missing, check=True)
    check = ("import torch, nvidia_resiliency_ext.straggler, megatron.core.utils; "
             "assert torch.__version__.startswith('2.13.0') and torch.version.cuda is None, torch.__version__; "
             "print('peers venv ready: torch', torch.__version__, '(CPU)')")
    subprocess.run([str(VENV / "bin" / "python"), "-W", "ignore", "-c", check], check=True)


def _iqr(values: Sequence[float]) -> tuple[float, float]:
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--setup", action="store_true", help="create .venv-peers with the pinned peers and exit")
    ap.add_argument("--quick", action="store_true", help="short jobs (≤ 5 min on 2 cores)")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--window", type=int, help="steps per Artemis window and per peer report (8; 20 without --quick)")
    ap.add_argument("--healthy-windows", type=int, help="windows before the fault (6; 8 without --quick)")
    ap.add_argument("--faulted-windows", type=int,
                    help="windows after it (8; 16 without --quick); the intermittent job runs 1.5 times as many")
    ap.add_argument("--rounds", type=int, help="overhead rounds of one block per mode (10; 40 without --quick)")
    ap.add_argument("--out", default=str(ROOT / "out" / "peers"))
    ap.add_argument("--rank-main", metavar="SPEC", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank_main:
        _rank_main(json.loads(args.rank_main))
        return 0
    if args.setup:
        setup()
        return 0
    if not (VENV / "bin" / "python").exists():
        sys.exit(f"peers: {VENV} is missing: run `{sys.executable} {__file__} --setup` first")
    W = args.window or (8 if args.quick else 20)
    healthy_w = args.healthy_windows or (6 if args.quick else 8)
    faulted_w = args.faulted_windows or (8 if args.quick else 16)
    rounds_n = args.rounds or (10 if args.quick else 40)
    slow_rank = args.world - 2
    base = {"window": W, "batch": 32}
    fault_at = healthy_w * W + 1
    steps = (healthy_w + faulted_w) * W + 1
    out = Path(args.out)
    t_start = time.monotonic()
    faulted = {"fault_at": fault_at, "slow_rank": slow_rank}
    jobs = {
        # the overhead blocks run after the healthy detection phase, in the same ranks
        "healthy": run_job("healthy", {**base, "iterations": steps, "rounds": rounds_n, "block": 3 * W},
                           out / "healthy", world=args.world, fault=None, timeout_s=300),
        # 15 % of one CPU where the others get about half of one each (4 ranks, 2 cores)
        "slowed": run_job("slowed", {**base, **faulted, "iterations": steps}, out / "slowed", world=args.world,
                          fault={"kind": "slowed", "share": 0.15, "stop_ms": 80, "run_ms": 20}, timeout_s=300),
        "intermittent": run_job("intermittent", {**base, **faulted, "iterations": steps + faulted_w * W // 2},
                                out / "intermittent", world=args.world,
                                fault={"kind": "intermittent", "stop_ms": 60, "run_ms": 40, "burst_s": 1.0,
                                       "gap_s": 2.0}, timeout_s=300),
    }
    rounds = jobs["healthy"]["ranks"][0]["rounds"]
    per_system: dict[str, dict[str, dict]] = {s: {} for s in SYSTEMS}
    for name, job in jobs.items():
        reports = system_reports(job)
        onset = onset_iteration(job["ranks"][slow_rank]["ends"], job["fault_t0"]) if "fault_t0" in job else None
        job["onset"] = onset
        for s in SYSTEMS:
            per_system[s][name] = {"reports": reports[s], "slow_rank": slow_rank if onset is not None else None,
                                   "onset": onset}
    megatron_on = all(j["ranks"][0]["megatron_enabled"] for j in jobs.values())
    rows = [score("artemis", per_system["artemis"], rounds),
            score("nvrx", per_system["nvrx"], rounds, note=NVRX_ON_CPU),
            score("megatron", per_system["megatron"], rounds, ran=megatron_on,
                  note="" if megatron_on else MEGATRON_ON_CPU)]
    elapsed = time.monotonic() - t_start
    spread = {s: _iqr([100 * (r[s] / r["none"] - 1) for r in rounds]) for s in SYSTEMS}
    print(format_table(rows))
    print(f"\n{args.world} ranks, window = report interval = {W} steps, slowed rank {slow_rank}.")
    print(f"slowed: {jobs['slowed']['mechanism']} from iteration {jobs['slowed']['onset']}.")
    print(f"intermittent: {jobs['intermittent']['mechanism']}, from iteration {jobs['intermittent']['onset']}.")
    print(f"overhead: {len(rounds)} rounds of {3 * W}-step blocks, no-tool block "
          f"{statistics.median(r['none'] for r in rounds):.1f} ms/step; interquartile range of the per-round "
          "overhead: " + ", ".join(f"{s} {lo:+.1f}..{hi:+.1f} %" for s, (lo, hi) in spread.items()) + ".")
    walls = {n: j["wall_s"] for n, j in jobs.items()}
    print(f"{elapsed:.0f} s in all (" + ", ".join(f"{n} {w:.0f} s" for n, w in walls.items()) + ").")
    for r in rows:
        if r.note:
            print(f"{r.system}: {r.note}.")
    dump = {"rows": [dataclasses.asdict(r) for r in rows], "elapsed_s": elapsed, "job_wall_s": walls, "window": W,
            "slow_rank": slow_rank, "overhead_rounds": rounds, "overhead_iqr_pct": spread,
            "jobs": {n: {"onset": j.get("onset"), "mechanism": j.get("mechanism"), "fault_t0": j.get("fault_t0"),
                         "incidents": j.get("incidents"),
                         "reports": {s: [dataclasses.asdict(r) for r in per_system[s][n]["reports"]] for s in SYSTEMS},
                         "nvrx_raw": j["ranks"][0]["nvrx"], "probe_stats": [r["probe"] for r in j["ranks"]]}
                     for n, j in jobs.items()}}
    (out / "peers.json").write_text(json.dumps(dump, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
