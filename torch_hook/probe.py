"""The per-rank probe: ties the recorder, the patches, the sender and the
directives together.  One instance per process, made by ``torch_hook.install``.

Window boundaries are also where the ranks *agree*.  A directive reaches each
rank's sender thread at a different moment, but a matched probe is a sequence
of collectives that every rank must enter at the same step, and a new set of
work shares must be applied at the same step for samplers to stay consistent.
So at each window boundary -- once every W steps -- the ranks all-reduce one
tiny int64 tensor (MAX) carrying, per pending directive, its hash and the
negated hash (so MAX yields both the largest and the smallest hash), plus the
negated window length each rank proposes.  A directive runs when every rank
holds the same one; windows get the shortest proposed length.  The all-reduce
is asynchronous and read one boundary later, so it never stalls a step; it
travels on a gloo group (the default group when it is gloo, else one created
once), so it never touches a GPU stream.  Its cost on the training thread is
measured (``stats()["sync_ms"]``); boundary work (and the probe's own
benchmark) is excluded from step times.
"""

from __future__ import annotations

import atexit
import datetime
import hashlib
import math
import os
import platform
import sys
import threading
import time
import zlib
from typing import Any

import torch
import torch.distributed as dist

from torch_hook import bench
from torch_hook.clock import device_mark, wall_mark
from torch_hook.completion import CompletionHooks
from torch_hook.config import ProbeConfig
from torch_hook.ddp import DdpTracker
from torch_hook.instrument import Instrumentation, _local
from torch_hook.telemetry.host import HostSampler
from torch_hook.relay import NodeRelay
from torch_hook.transport import Sender
from torch_hook.window import ClosedWindow, StepRecorder

# torch releases the probe is written and tested against; outside the range it
# installs what exists and says so (``coverage_line``).
SUPPORTED_TORCH = ((2, 4), (2, 13))
# How long shutdown waits for the probe's own pending collective (the last
# boundary agreement) before the group goes away.
_QUIESCE_WAIT_S = 10.0
# How long exit waits for gloo's workers to release DDP bucket callbacks
# (microseconds in practice; bounded so a wedged group cannot hold exit).
_SETTLE_S = 2.0

_CONFIG_PREFIXES = ("NCCL_", "RCCL_", "GLOO_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "UCX_", "FI_", "HSA_", "MIOPEN_")
_CONFIG_NAMES = ("OMP_NUM_THREADS", "CUDA_DEVICE_MAX_CONNECTIONS", "PYTORCH_CUDA_ALLOC_CONF")


def directive_hash(key: str) -> int:
    """A positive 31-bit tag for a directive (0 means "none pending")."""
    return (zlib.crc32(key.encode()) & 0x7FFFFFFF) | 1


def config_fingerprint(env: dict[str, str]) -> str:
    """sha256 over the communication-relevant environment (sorted NAME=value lines)."""
    items = sorted((k, v) for k, v in env.items() if k.startswith(_CONFIG_PREFIXES) or k in _CONFIG_NAMES)
    return "sha256:" + hashlib.sha256("\n".join(f"{k}={v}" for k, v in items).encode()).hexdigest()


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


class Probe:
    def __init__(self, config: ProbeConfig, resume: tuple[int, int] = (0, 0)):
        self.config = config
        self.active = False
        self.recorder = StepRecorder(config.window_steps, *resume)
        self.ddp = DdpTracker()
        self.instrumentation = Instrumentation(self)
        self.instrumentation.on_new_group = self._new_group
        self.completion = CompletionHooks()
        self.device_mode = False
        self.coverage = ""
        self.error_count = 0
        self.last_error: str | None = None
        self.sync_ms: list[float] = []
        self.probes_run: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._pending_probe: str | None = None
        self._pending_shares: tuple[str, dict[int, float]] | None = None
        self._done_ids: set[str] = set()
        self._shares: dict[int, float] = {}
        # The job reads its work shares (WeightedDistributedSampler, work_share()):
        # only then can a rebalance directive change anything, and the daemon may send one.
        self.rebalance_opt_in = False
        self._probe_result: dict[str, Any] | None = None
        self._control: Any = None
        self._agreement: tuple[Any, torch.Tensor, str | None, Any] | None = None
        self._meta: tuple[list[str], Any] | None = None
        self._device_index: int | None = None
        self._comm_lib: str | None = None
        self._telemetry: Any = None
        self._telemetry_opened = False
        self._telemetry_lock = threading.Lock()
        self._host = HostSampler()
        posts = bool(config.endpoint and config.endpoint.startswith("http"))
        relay = NodeRelay.for_rank(config.job, config.job_step, config.node, config.local_rank) \
            if config.relay and posts else None
        # The relay holds its siblings' reports through an outage too: as many windows as each rank would.
        relays = relay is not None and relay.is_relay
        queue_size = config.queue_size * ((config.local_world or 8) if relays else 1)
        self.sender = Sender(config.endpoint, queue_size=queue_size, timeout_s=config.http_timeout_s,
                             munge_socket=config.munge_socket, enrich=self._enrich, on_reply=self._on_reply,
                             relay=relay)

    # -- life cycle ----------------------------------------------------------
    def install(self) -> None:
        self.instrumentation.install()
        self.active = True
        atexit.register(self._at_exit)
        try:
            self.coverage = coverage_line(torch.__version__, self._backend_name(),
                                          self.instrumentation.wrapped, self._hooks_state())
            if self.rank_world()[0] == 0:
                print(self.coverage, file=sys.stderr, flush=True)
        except Exception as err:  # noqa: BLE001
            self._fail("install", err)

    def _backend_name(self) -> str:
        return str(dist.get_backend()) if dist.is_available() and dist.is_initialized() else "backend not yet known"

    def _hooks_state(self) -> str:
        from torch_hook.completion import supported

        if not self.config.completion_hooks:
            return "off (ARTEMIS_COMPLETION_HOOKS=0)"
        if dist.is_available() and dist.is_initialized() and "nccl" in self._backend_name():
            return "on, collective timing enabled" if supported(dist.GroupMember.WORLD) else "not in this torch"
        return "n/a"

    def uninstall(self) -> None:
        self.quiesce()
        self.active = False
        self.instrumentation.uninstall()
        atexit.unregister(self._at_exit)
        self.sender.close(timeout_s=3.0)
        if self._telemetry is not None:
            self._telemetry.close()

    def _at_exit(self) -> None:
        self.quiesce()
        self.active = False
        self.sender.close(timeout_s=3.0)

    def quiesce(self, group: Any = None) -> None:
        """Leave nothing of the probe's in flight on ``group`` (None: every group).

        Runs before ``destroy_process_group`` and at exit.  The last window
        boundary's agreement all-reduce is never read by a later boundary; left
        pending, it may still run on gloo's worker threads while the group is
        shut down or the interpreter finalizes.  NCCL completion hooks must
        have fired before the interpreter goes (see completion.py).  Nothing
        here raises.
        """
        try:
            world = group is None or group is dist.GroupMember.WORLD
            if self._agreement is not None and (world or group is self._control):
                work, self._agreement = self._agreement[0], None
                _local.inside = True
                try:
                    work.wait(datetime.timedelta(seconds=_QUIESCE_WAIT_S))
                finally:
                    _local.inside = False
            self.completion.close(None if world and group is None else group)
            if world and not self.ddp.settle(_SETTLE_S):
                self._fail("shutdown", RuntimeError("DDP bucket callbacks still held by the process group"))
            if world:
                self._control = None
                self._meta = None
                self.instrumentation.forget_groups()
        except Exception as err:  # noqa: BLE001 -- a peer already gone: nothing left to wait for
            self._fail("shutdown", err)

    def _new_group(self, group: Any, name: str) -> None:
        """A process group seen for the first time: on NCCL, its completion hook takes over timing."""
        if self.config.completion_hooks and self.completion.watch(group, name):
            self.instrumentation.hooked.add(name)

    def _fail(self, where: str, err: BaseException) -> None:
        self.error_count += 1
        self.last_error = f"{where}: {err!r}"

    # -- identity ------------------------------------------------------------
    def rank_world(self) -> tuple[int, int]:
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))

    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def timeline_mark(self) -> Any:
        return device_mark() if self.device_mode else wall_mark()

    def _learn_device(self) -> None:
        backend = str(dist.get_backend()) if dist.is_available() and dist.is_initialized() else "none"
        self.device_mode = torch.cuda.is_available() and ("nccl" in backend or "rccl" in backend)
        if self.device_mode:
            self._device_index = torch.cuda.current_device()
            if torch.version.hip:
                self._comm_lib = "rccl " + ".".join(map(str, torch.cuda.nccl.version()))
            else:
                self._comm_lib = "nccl " + ".".join(map(str, torch.cuda.nccl.version()))
            self._new_group(dist.GroupMember.WORLD, "world")
        else:
            self._device_index = self.config.local_rank or 0
            self._comm_lib = backend if backend != "none" else None

    # -- the step boundary (training thread) ---------------------------------
    def step(self, samples: float | None = None) -> None:
        self.instrumentation.explicit_steps = True
        if samples is not None:
            self.recorder.add_samples(samples)
        self.boundary()

    def boundary(self) -> None:
        if not self.active:
            return
        try:
            if self._device_index is None:
                self._learn_device()
            self.completion.drain(self.recorder)
            self.ddp.end_step(self.recorder, self.instrumentation.hooked)
            closed = self.recorder.end_step()
            if closed is not None:
                self._window_boundary(closed)
            if closed is not None or self.recorder.parked:
                for window in self.recorder.finished(closed):
                    self._submit(window)
        except Exception as err:  # noqa: BLE001 -- never into training code
            self._fail("boundary", err)

    def _window_boundary(self, closed: ClosedWindow) -> None:
        mean_s = sum(closed.step_ms) / len(closed.step_ms) / 1e3
        propose = self.config.window_steps
        if mean_s > 0:
            propose = max(1, min(propose, math.floor(self.config.window_seconds / mean_s)))
        with self._lock:
            probe_id = self._pending_probe
            shares = self._pending_shares
        run_probe: str | None = None
        apply: tuple[str, dict[int, float]] | None = None
        steps: int | None = None
        if not self._distributed():
            run_probe, apply, steps = probe_id, shares, propose
        elif not self.config.boundary_sync:
            apply = shares  # an unagreed probe could deadlock the job: never run one
        else:
            t0 = time.perf_counter()
            decided = self._collect_agreement()
            if decided is not None:
                run_probe, apply, steps = decided
            # What was just decided is not proposed again.
            self._issue_agreement(None if probe_id == run_probe else probe_id,
                                  None if apply is not None and shares is not None and shares[0] == apply[0] else shares,
                                  propose)
            self.sync_ms.append((time.perf_counter() - t0) * 1e3)
        if steps is not None:
            self.recorder.next_window_steps(steps)
        if apply is not None:
            with self._lock:
                self._shares = dict(apply[1])
                self._done_ids.add(apply[0])
                if self._pending_shares is apply:
                    self._pending_shares = None
        if run_probe is not None:
            self._run_probe(run_probe)
        self.recorder.restart_step_clock()

    def _control_group(self) -> Any:
        if self._control is None:
            backend = str(dist.get_backend())
            # A CPU tensor all-reduce needs gloo; on NCCL-only jobs make a gloo
            # group once (all ranks reach their first boundary together).
            self._control = dist.GroupMember.WORLD if "gloo" in backend else dist.new_group(backend="gloo")
        return self._control

    def _issue_agreement(self, probe_id: str | None, shares: tuple[str, dict[int, float]] | None,
                         propose: int) -> None:
        """Start this boundary's agreement; it is read at the next boundary.

        Pipelining by one window keeps the all-reduce off the step's critical
        path (it runs on gloo's worker thread while training goes on); every
        rank still acts on the same result at the same boundary.
        """
        hp = directive_hash(probe_id) if probe_id else 0
        hs = directive_hash(shares[0]) if shares else 0
        tensor = torch.tensor([hp, -hp, hs, -hs, -propose], dtype=torch.int64)
        _local.inside = True
        try:
            work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self._control_group(), async_op=True)
        finally:
            _local.inside = False
        self._agreement = (work, tensor, probe_id, shares)

    def _collect_agreement(self) -> tuple[str | None, tuple[str, dict[int, float]] | None, int] | None:
        """Result of the previous boundary's agreement: (probe to run, shares to apply, window length)."""
        if self._agreement is None:
            return None
        work, tensor, probe_id, shares = self._agreement
        self._agreement = None
        _local.inside = True
        try:
            work.wait()  # issued a whole window ago: already complete in practice
        finally:
            _local.inside = False
        top_p, low_p, top_s, low_s, steps = (int(v) for v in tensor.tolist())
        hp = directive_hash(probe_id) if probe_id else 0
        hs = directive_hash(shares[0]) if shares else 0
        run = probe_id if hp and top_p == -low_p == hp else None
        apply = shares if hs and top_s == -low_s == hs else None
        return run, apply, max(1, -steps)

    def _run_probe(self, probe_id: str) -> None:
        rank, world = self.rank_world()
        errors: list[str] = []
        _local.inside = True
        try:
            nodes, island_group = self._probe_meta() if world > 1 else ([self.config.node], None)
            device = torch.device("cuda", self._device_index) if self.device_mode else torch.device("cpu")
            result = bench.run(probe_id, rank=rank, world=world, device=device,
                               island_group=island_group, nodes=nodes, errors=errors)
        except Exception as err:  # noqa: BLE001
            self._fail("probe", err)
            result = None
        finally:
            _local.inside = False
        if errors:
            self._fail("probe", RuntimeError("; ".join(errors)))
        with self._lock:
            self._done_ids.add(probe_id)
            if self._pending_probe == probe_id:
                self._pending_probe = None
            if result is not None:
                self._probe_result = result
                self.probes_run.append(result)

    def _probe_meta(self) -> tuple[list[str], Any]:
        """Nodes of all ranks and this rank's island group (made once, collectively)."""
        if self._meta is None:
            mine = (self.config.node, self._island())
            table: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(table, mine, group=self._control_group())
            islands = sorted({row[1] for row in table})
            group = None
            if len(islands) > 1:
                for island in islands:  # every rank creates every group, in one order
                    ranks = [r for r, row in enumerate(table) if row[1] == island]
                    made = dist.new_group(ranks)
                    if island == mine[1]:
                        group = made
            self._meta = ([row[0] for row in table], group)
        return self._meta

    # -- reports ---------------------------------------------------------------
    def _submit(self, window: ClosedWindow) -> None:
        try:
            rank, world = self.rank_world()
            report: dict[str, Any] = {"type": "window", "v": 1, "job": self.config.job,
                                      "step": self.config.job_step, "rank": rank, "world": world,
                                      "node": self.config.node}
            report.update(window.report_fields())
            report["env"] = {"torch": torch.__version__, "config": config_fingerprint(dict(os.environ))}
            if self._comm_lib:
                report["env"]["comm_lib"] = self._comm_lib
            with self._lock:
                if self._probe_result is not None:
                    report["probe"] = self._probe_result
                    self._probe_result = None
            report["_device_index"] = self._device_index
            self.sender.submit(report)
        except Exception as err:  # noqa: BLE001
            self._fail("report", err)

    def _backend(self) -> Any:
        with self._telemetry_lock:  # opened by whichever thread needs it first
            if not self._telemetry_opened:
                self._telemetry_opened = True
                from torch_hook.telemetry import open_backend

                try:
                    self._telemetry = open_backend(node=self.config.node)
                except Exception as err:  # noqa: BLE001 -- explicit backend that cannot run
                    self._fail("telemetry", err)
            return self._telemetry

    def _island(self) -> str:
        backend = self._backend()
        index = self._device_index or 0
        device = backend.device(index) if backend is not None else None
        if device:
            return f"{device['vendor']}:{device['model']}"
        return f"cpu:{_cpu_model()}"

    def _enrich(self, report: dict[str, Any]) -> None:
        """Sender thread: device, island, telemetry and driver (off the training path)."""
        index = report.pop("_device_index", None) or 0
        backend = self._backend()
        device = backend.device(index) if backend is not None else None
        report["device"] = device or {"vendor": "cpu", "model": _cpu_model()}
        report["island"] = f"{report['device']['vendor']}:{report['device']['model']}"
        if self.rebalance_opt_in:
            report["rebalance_opt_in"] = True
        if backend is not None:
            gpu = backend.sample(index)
            if gpu:
                report["gpu"] = gpu
            driver = backend.driver()
            if driver:
                report["env"]["driver"] = driver
        host = self._host.sample()
        if host:
            report["host"] = host

    # -- directives (sender thread) ------------------------------------------
    def _on_reply(self, reply: dict[str, Any]) -> None:
        # Sender thread: plain data only.  A daemon thread inside torch when
        # the interpreter finalizes aborts the process (see completion.py).
        for directive in reply.get("directives") or ():
            if not isinstance(directive, dict):
                continue
            if str(directive.get("job")) != self.config.job or str(directive.get("step", "0")) != self.config.job_step:
                continue
            ident = directive.get("id")
            if not isinstance(ident, str) or not ident:
                continue
            with self._lock:
                if ident in self._done_ids:
                    continue
                if directive.get("type") == "probe":
                    self._pending_probe = ident
                elif directive.get("type") == "rebalance":
                    shares = parse_shares(directive.get("shares"))
                    if shares is not None:
                        self._pending_shares = (ident, shares)

    # -- work share ------------------------------------------------------------
    def work_shares(self) -> dict[int, float]:
        """The agreed work shares; the job reads them to apply them, which opts it in to rebalancing."""
        self.rebalance_opt_in = True
        return self._current_shares()

    def _current_shares(self) -> dict[int, float]:
        with self._lock:
            return dict(self._shares)

    def stats(self) -> dict[str, Any]:
        s = self.sender
        return {"steps": self.recorder.step, "windows": self.recorder.seq, "errors": self.error_count,
                "hook_errors": self.instrumentation.errors, "hook_error": self.instrumentation.last_error, "last_error": self.last_error,
                "sent": s.sent, "dropped": s.dropped, "deferred": s.deferred, "bad_replies": s.bad_replies,
                "relayed": s.relayed, "relay_dropped": s.relay_dropped, "handed_over": s.handed_over,
                "unauthenticated": s.unauthenticated, "sender_error": s.last_error,
                "sync_ms": list(self.sync_ms), "probes": list(self.probes_run),
                # Shown, not read to apply them: looking at the counters opts nothing in.
                "shares": self._current_shares()}


def coverage_line(version: str, backend: str, wrapped: list[str], hooks: str) -> str:
    """The one log line that says what this probe sees on this torch."""
    try:
        release = tuple(int(part) for part in version.split("+")[0].split(".")[:2])
    except ValueError:
        release = (0, 0)
    low, high = SUPPORTED_TORCH
    note = "" if low <= release <= high else (
        f" (outside the tested range {low[0]}.{low[1]}-{high[0]}.{high[1]}: wrapping what exists)")
    c10d = sum(1 for name in wrapped if name.startswith("torch.distributed."))
    funcol = sum(1 for name in wrapped if name.startswith("funcol.") and name != "funcol.wait_tensor")
    waits = "wait_tensor" if "funcol.wait_tensor" in wrapped else "no wait_tensor"
    return (f"artemis probe: torch {version}{note}, {backend}: python wrappers for {c10d} torch.distributed ops"
            f" + {funcol} functional collectives ({waits}) + Work.wait + DDP comm hook; nccl completion hooks: {hooks}")


def parse_shares(raw: Any) -> dict[int, float] | None:
    """``{"2": 0.8}`` -> ``{2: 0.8}``; None if malformed (the directive is ignored)."""
    if not isinstance(raw, dict):
        return None
    out: dict[int, float] = {}
    for key, value in raw.items():
        try:
            rank, share = int(key), float(value)
        except (TypeError, ValueError):
            return None
        if rank < 0 or not (share > 0 and math.isfinite(share)):
            return None
        out[rank] = share
    return out
