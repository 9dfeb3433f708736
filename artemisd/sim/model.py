"""The lockstep model of one training job.

Every step, each rank computes (``busy`` = compute + data), then all ranks wait
for the slowest at the collective::

    step[s]         = max_r busy[r, s] + comm[s]
    comm_wait[r, s] = step[s] - busy[r, s]

Mixed jobs (several islands) reduce hierarchically: each island finishes an
intra-island stage when its slowest rank arrives plus the stage's own time,
then the world stage starts when the last island is done.  A rank's
``collectives`` entries split its waiting into those two stages.

The model works on (ranks × steps) numpy arrays per window and reduces them to
the per-step means and medians of the wire contract, so the straggler tax of
noise (the max of many noisy ranks exceeds their mean) emerges as it does on
real clusters rather than being assumed.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from artemisd.frame import THROTTLE_BIT
from artemisd.sim.faults import ActiveFault, JobWideEffects, Telemetry, apply_telemetry, apply_timing
from artemisd.sim.spec import FaultSpec, JobSpec


@dataclass(frozen=True)
class Layout:
    """Where each rank runs: node and island, both as indices."""

    world: int
    ranks_per_node: int
    node_of: np.ndarray
    local_rank: np.ndarray
    island_of: np.ndarray
    island_names: list[str]
    node_names: list[str]

    @property
    def nodes(self) -> int:
        return len(self.node_names)

    def node_ranks(self, node: int) -> np.ndarray:
        return np.flatnonzero(self.node_of == node)

    @classmethod
    def of(cls, spec: JobSpec, first_node: int) -> Layout:
        world, rpn = spec.world, spec.ranks_per_node
        ranks = np.arange(world)
        island_of = np.repeat(np.arange(len(spec.islands)), [i.ranks for i in spec.islands])
        return cls(
            world=world,
            ranks_per_node=rpn,
            node_of=ranks // rpn,
            local_rank=ranks % rpn,
            island_of=island_of,
            island_names=[i.name for i in spec.islands],
            node_names=[f"n{first_node + i:05d}" for i in range(spec.nodes)],
        )


@dataclass
class ProbeColumns:
    """A matched-probe block every rank reports in this window (``wire.ProbeResult``)."""

    id: str
    gemm_ms: np.ndarray
    allreduce_ms: np.ndarray
    p2p_peer: np.ndarray
    p2p_ms: np.ndarray


@dataclass
class WindowColumns:
    """One window of one job: per-rank wire values as columns (ms are per-step means)."""

    seq: int
    first_step: int
    steps: int
    t0: float
    t1: float
    step: np.ndarray
    busy: np.ndarray
    compute: np.ndarray
    data: np.ndarray
    comm_wait: np.ndarray
    step_p50: np.ndarray
    busy_p50: np.ndarray
    world_coll_ms: np.ndarray  # window totals
    island_coll_ms: np.ndarray | None
    samples: np.ndarray
    telemetry: Telemetry
    arrival: np.ndarray  # seconds after t1 each rank's report arrives
    probe: ProbeColumns | None = None


@dataclass(frozen=True)
class Transient:
    """A disturbance that is not a fault (for explaining false positives)."""

    kind: str  # gc | spike | comm_spike | checkpoint
    window: int
    rank: int | None  # None: every rank
    rise: float  # estimated rise of the window mean (rank busy, or job step), relative


class JobModel:
    """Simulates one job window by window; deterministic for a given generator."""

    def __init__(self, spec: JobSpec, rng: np.random.Generator, first_node: int, t_start: float):
        self.spec = spec
        self.rng = rng
        self.t = t_start
        self.layout = layout = Layout.of(spec, first_node)
        noise = spec.noise
        world = layout.world
        base = np.array([i.compute_ms for i in spec.islands])[layout.island_of]
        self.speed = 1.0 + rng.normal(0.0, noise.gpu_spread, world)
        self.healthy_slow: dict[int, float] = {}
        if noise.healthy_slow:
            chosen = rng.choice(world, size=noise.healthy_slow, replace=False)
            for r in chosen:
                self.speed[r] = float(rng.uniform(1.02, 1.03))
                self.healthy_slow[int(r)] = self.speed[r]
        self.base_compute = base * self.speed
        self.nominal_busy = base + spec.data_ms
        self.faults = [self._resolve(i, f) for i, f in enumerate(spec.faults)]
        self.transients: list[Transient] = []
        # Per-GPU and per-node telemetry baselines that persist across windows.
        isl = spec.islands
        self.max_clock = np.array([i.max_sm_clock_mhz for i in isl])[layout.island_of]
        self.default_limit = np.array([i.power_limit_w for i in isl])[layout.island_of]
        self.gpu_temp = rng.uniform(52.0, 70.0, world)
        self.gpu_power_share = rng.uniform(0.72, 0.9, world)
        n = layout.nodes
        self.node_cpu = rng.uniform(25.0, 50.0, n)
        self.node_ctx = rng.uniform(8.0, 40.0, n)
        self.node_iowait = rng.uniform(0.0, 0.6, n)
        self.node_retrans = rng.uniform(0.0, 2.0, n)

    # --- faults ------------------------------------------------------------

    def _resolve(self, index: int, f: FaultSpec) -> ActiveFault:
        """Pick the fault's targets (drawn when the spec leaves them out)."""
        layout, rng = self.layout, self.rng
        end = self.spec.windows - 1 if f.duration is None else min(self.spec.windows - 1, f.onset + f.duration - 1)
        ranks = np.empty(0, dtype=np.int64)
        node = island = None
        variant = f.variant
        if f.scope == "rank":
            rank = f.rank if f.rank is not None else int(rng.integers(layout.world))
            ranks = np.array([rank])
            node = int(layout.node_of[rank])
        elif f.scope == "node":
            node = f.node if f.node is not None else int(rng.integers(layout.nodes))
            on_node = layout.node_ranks(node)
            count = min(f.node_ranks or len(on_node), len(on_node))
            ranks = np.sort(rng.choice(on_node, size=count, replace=False)) if count < len(on_node) else on_node
        elif f.scope == "link":
            node = f.node if f.node is not None else int(rng.integers(layout.nodes))
        elif f.scope == "island":
            names = layout.island_names
            island = names.index(f.island) if f.island is not None else int(rng.integers(len(names)))
        if variant is None and f.cause == "host.cpu":
            variant = "steal" if rng.random() < 0.4 else "contention"
        if variant is None and f.cause == "gpu.thermal":
            variant = "hw" if f.magnitude >= 0.25 else "sw"
        return ActiveFault(
            id=f"{self.spec.job}/F{index + 1}", spec=f, ranks=np.asarray(ranks, dtype=np.int64),
            node=node, island=island, onset=f.onset, end=end, window_steps=self.spec.window_steps,
            variant=variant,
        )

    # --- the model ---------------------------------------------------------

    def windows(self) -> Iterator[WindowColumns]:
        for seq in range(self.spec.windows):
            yield self.window(seq)

    def window(self, seq: int) -> WindowColumns:
        spec, layout, rng, noise = self.spec, self.layout, self.rng, self.spec.noise
        world, steps, n_isl = layout.world, spec.window_steps, len(spec.islands)

        common = rng.normal(0.0, noise.common, steps)
        jitter = rng.standard_normal((world, steps), dtype=np.float32)
        jitter *= noise.step
        jitter += common[None, :].astype(np.float32) + 1.0
        np.maximum(jitter, 0.5, out=jitter)  # a step never runs at less than half its work
        compute = jitter.astype(np.float64) * self.base_compute[:, None]
        data = spec.data_ms * rng.lognormal(0.0, 0.3, (world, steps))
        self._add_transients(seq, compute)

        comm = spec.comm_ms * np.maximum(0.0, 1.0 + rng.normal(0.0, noise.comm, steps))
        if rng.random() < noise.comm_spike_rate:
            start, length = int(rng.integers(steps)), int(rng.integers(3, 15))
            factor = float(rng.uniform(0.5, 1.5))
            comm[start:start + length] *= 1.0 + factor
            rise = factor * spec.comm_ms * length / (steps * float(self.nominal_busy.mean()))
            self.transients.append(Transient("comm_spike", seq, None, rise))
        island_comm = np.zeros((n_isl, steps))
        if n_isl > 1:
            island_comm = spec.island_comm_ms * np.maximum(0.0, 1.0 + rng.normal(0.0, noise.comm, (n_isl, steps)))

        job = JobWideEffects(np.zeros(steps), np.zeros((n_isl, steps)), np.zeros(steps))
        intensities = []
        for fault in self.faults:
            inten = fault.intensity(seq, rng)
            intensities.append(float(inten.mean()))
            if inten.any():
                apply_timing(fault, inten, compute, data, self.nominal_busy, job)
        if job.any():
            # Job-wide faults are sized against this window's healthy step time.
            slowest = (compute + data).max(axis=0)
            healthy_step = float(np.median(slowest + island_comm.max(axis=0) + comm))
            if job.compute_rel.any():
                compute *= 1.0 + job.compute_rel[None, :] * (healthy_step / float(np.median(slowest)))
            comm += job.comm_rel * healthy_step
            if job.island_comm_rel.any():
                # A faster island has slack before the slowest island is done;
                # its stage must first use that up before the job slows, so
                # the slack is added too and the step still rises by m.
                done = self._island_done(compute + data, island_comm)
                slack = np.median(done.max(axis=0)[None, :] - done, axis=1)
                island_comm += job.island_comm_rel * healthy_step + (job.island_comm_rel > 0) * slack[:, None]

        busy = compute + data
        island_done = self._island_done(busy, island_comm)
        step = island_done.max(axis=0) + comm  # (steps,)
        comm_wait = step[None, :] - busy
        done_of_rank = island_done[layout.island_of]  # (world, steps)

        first_step = seq * steps
        t0 = self.t
        t1 = t0 + float(step.sum()) / 1000.0
        self.t = t1
        step_mean = float(step.mean())
        telemetry = self._telemetry(seq, intensities)
        cols = WindowColumns(
            seq=seq,
            first_step=first_step,
            steps=steps,
            t0=t0,
            t1=t1,
            step=np.full(world, step_mean),
            busy=busy.mean(axis=1),
            compute=compute.mean(axis=1),
            data=data.mean(axis=1),
            comm_wait=comm_wait.mean(axis=1),
            step_p50=np.full(world, float(np.median(step))),
            busy_p50=np.median(busy, axis=1),
            world_coll_ms=(step[None, :] - done_of_rank).sum(axis=1) if n_isl > 1 else comm_wait.sum(axis=1),
            island_coll_ms=(done_of_rank - busy).sum(axis=1) if n_isl > 1 else None,
            samples=np.full(world, float(spec.batch * steps)),
            telemetry=telemetry,
            arrival=rng.lognormal(np.log(0.03), 0.6, world),
        )
        cols.probe = self._probe(seq, step_mean)
        return cols

    def _island_done(self, busy: np.ndarray, island_comm: np.ndarray) -> np.ndarray:
        """(islands, steps): when each island's slowest rank and its own stage are done."""
        done = np.empty_like(island_comm)
        for k in range(len(island_comm)):
            done[k] = busy[self.layout.island_of == k].max(axis=0) + island_comm[k]
        return done

    def _add_transients(self, seq: int, compute: np.ndarray) -> None:
        """GC pauses, short per-rank spikes and checkpoints: slow, but not faults."""
        rng, noise = self.rng, self.spec.noise
        world, steps = compute.shape
        n_gc = rng.poisson(noise.gc_rate * world * steps)
        if n_gc:
            rows = rng.integers(world, size=n_gc)
            cols = rng.integers(steps, size=n_gc)
            pause = noise.gc_ms * rng.lognormal(0.0, 0.7, n_gc)
            np.add.at(compute, (rows, cols), pause)
            # Only pauses that move a window mean by 1 % are worth remembering.
            rise = pause / (steps * self.nominal_busy[rows])
            self.transients.extend(Transient("gc", seq, int(r), float(x)) for r, x in zip(rows, rise) if x > 0.01)
        n_spike = rng.binomial(world, noise.spike_rate)
        for rank in rng.choice(world, size=n_spike, replace=False) if n_spike else ():
            start, length = int(rng.integers(steps)), int(rng.integers(2, 15))
            factor = float(rng.uniform(0.2, 0.6))
            compute[rank, start:start + length] *= 1.0 + factor
            self.transients.append(Transient("spike", seq, int(rank), factor * min(length, steps - start) / steps))
        if noise.checkpoint_every and seq and seq % noise.checkpoint_every == 0:
            # Every rank writes its shard: all stall together, so no rank
            # stands out, but the job's step time jumps for one window.
            step_at = int(rng.integers(steps))
            compute[:, step_at] += noise.checkpoint_ms * rng.lognormal(0.0, 0.1, world)
            rise = noise.checkpoint_ms / (steps * float(self.nominal_busy.mean()))
            self.transients.append(Transient("checkpoint", seq, None, rise))

    def _telemetry(self, seq: int, intensities: list[float]) -> Telemetry:
        layout, rng, noise = self.layout, self.rng, self.spec.noise
        world, n = layout.world, layout.nodes
        power_limit = self.default_limit.copy()
        capped = rng.random(world) < noise.benign_power_cap
        clock = self.max_clock * (1.0 - np.abs(rng.normal(0.0, 0.01, world)))
        clock[capped] *= rng.uniform(0.93, 0.98, int(capped.sum()))
        power = power_limit * self.gpu_power_share * rng.uniform(0.97, 1.03, world)
        power[capped] = power_limit[capped] * rng.uniform(0.97, 1.0, int(capped.sum()))
        throttle = np.where(capped, THROTTLE_BIT["sw_power_cap"], 0).astype(np.int64)
        tel = Telemetry(
            sm_clock_mhz=clock,
            max_sm_clock_mhz=self.max_clock.copy(),
            power_w=power,
            power_limit_w=power_limit,
            default_power_limit_w=self.default_limit.copy(),
            temp_c=self.gpu_temp + rng.normal(0.0, 1.0, world),
            util_pct=np.minimum(100.0, rng.normal(97.0, 1.0, world)),
            throttle=throttle,
            cpu_pct=np.clip(self.node_cpu + rng.normal(0.0, 3.0, n), 0.0, 100.0),
            steal_pct=np.abs(rng.normal(0.0, 0.05, n)),
            iowait_pct=self.node_iowait + np.abs(rng.normal(0.0, 0.2, n)),
            ctx_invol_per_s=self.node_ctx * rng.uniform(0.8, 1.25, n),
            net_retransmits_per_s=self.node_retrans * rng.uniform(0.0, 2.0, n),
        )
        for fault, mean_inten in zip(self.faults, intensities):
            apply_telemetry(fault, mean_inten, tel, rng, THROTTLE_BIT)
        return tel

    def _probe(self, seq: int, step_ms: float) -> ProbeColumns | None:
        """The matched probe's block, ``probe_after`` windows after a fault's onset.

        Identical work on every rank: a GEMM (slower only on a degraded
        device), an island all-reduce (slower under comm faults) and one
        inter-node send per rank to the same local rank of the next node
        (rail-aligned, so every hop crosses the NICs; hops touching a node
        with a bad link are slow).
        """
        after = self.spec.probe_after
        if after is None or not any(seq == f.onset + after for f in self.faults):
            return None
        layout, rng = self.layout, self.rng
        world = layout.world
        gemm = 8.0 * self.speed * rng.normal(1.0, 0.01, world)
        allreduce = np.full(world, 12.0) * rng.normal(1.0, 0.02, world)
        rpn = layout.ranks_per_node
        peer = (np.arange(world) + rpn) % world if layout.nodes > 1 else (np.arange(world) + 1) % world
        p2p = 3.0 * rng.normal(1.0, 0.03, world)
        for f in self.faults:
            if not f.onset <= seq <= f.end:
                continue
            m = f.magnitude
            if f.cause in ("gpu.thermal", "gpu.power", "gpu.clocks"):
                gemm[f.ranks] *= 1.0 + m
            elif f.cause == "comm.link":
                touches = (layout.node_of == f.node) | (layout.node_of[peer] == f.node)
                p2p[touches] *= 1.0 + 8.0 * m  # a degraded port loses far more than the job-wide average
                allreduce *= 1.0 + m * step_ms / max(self.spec.comm_ms, 1.0)
            elif f.cause == "comm.island":
                allreduce[layout.island_of == f.island] *= 1.0 + m * step_ms / max(self.spec.island_comm_ms, 1.0)
        return ProbeColumns(id=f"PRB-{self.spec.job}-{seq}", gemm_ms=gemm, allreduce_ms=allreduce,
                            p2p_peer=peer, p2p_ms=p2p)
