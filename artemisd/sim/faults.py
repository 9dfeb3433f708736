"""Injected faults: when they are active, and what they do to time and telemetry.

A fault has an *intensity* per step in [0, 1] (its pattern) and a magnitude
``m`` (see ``artemisd.sim.spec``).  Its effect on timing is applied to the
step arrays of the lockstep model; its effect on telemetry to the window's
sampled values, using the window-mean intensity, because probes sample GPU and
host counters a few times per window, not per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from artemisd.sim.spec import FaultSpec


@dataclass
class ActiveFault:
    """A fault resolved against one job: its targets and its pattern's state."""

    id: str
    spec: FaultSpec
    ranks: np.ndarray  # affected ranks (empty for job-wide faults)
    node: int | None  # node index within the job
    island: int | None  # island index (comm.island)
    onset: int  # first window
    end: int  # last window, inclusive
    window_steps: int
    variant: str | None = None
    _on: bool = field(default=True, repr=False)

    @property
    def cause(self) -> str:
        return self.spec.cause

    @property
    def magnitude(self) -> float:
        return self.spec.magnitude

    def intensity(self, seq: int, rng: np.random.Generator) -> np.ndarray:
        """Per-step intensity of this window (zeros outside [onset, end])."""
        steps = self.window_steps
        if seq < self.onset or seq > self.end:
            return np.zeros(steps)
        spec = self.spec
        if spec.pattern == "steady":
            return np.ones(steps)
        if spec.pattern == "ramp":
            done = (seq - self.onset) * steps + np.arange(steps) + 1
            return np.minimum(1.0, done / (spec.ramp_windows * steps))
        return self._bursts(rng)

    def _bursts(self, rng: np.random.Generator) -> np.ndarray:
        # Two-state Markov chain per step whose stationary "on" share is the
        # duty cycle and whose mean on-burst lasts burst_steps.  State carries
        # over between windows, so bursts straddle window boundaries.
        duty, burst = self.spec.duty, self.spec.burst_steps
        p_off = 1.0 / burst
        p_on = 1.0 if duty >= 1.0 else min(1.0, duty * p_off / (1.0 - duty))
        draws = rng.random(self.window_steps)
        out = np.empty(self.window_steps)
        on = self._on
        for i, u in enumerate(draws):
            out[i] = on
            on = (u >= p_off) if on else (u < p_on)
        self._on = on
        return out

    @property
    def effective_magnitude(self) -> float:
        """Steady-state slowdown a window mean shows (intermittent faults: m × duty)."""
        if self.spec.pattern == "intermittent":
            return self.magnitude * self.spec.duty
        return self.magnitude

    def visible_window(self, threshold: float = 0.05) -> int:
        """First window whose mean slowdown reaches ``threshold`` (ramps take a while)."""
        if self.spec.pattern != "ramp" or self.magnitude <= threshold:
            return self.onset
        steps_needed = threshold / self.magnitude * self.spec.ramp_windows * self.window_steps
        # The window-mean intensity crosses threshold/m once about half the window is past it.
        return self.onset + int((steps_needed + self.window_steps / 2) // self.window_steps)

    @property
    def kind(self) -> str:
        """The incident kind a correct analyser reports for this fault."""
        scope = self.spec.scope
        if scope in ("rank", "node"):
            return "rank" if len(self.ranks) == 1 else "node"
        return scope


@dataclass
class JobWideEffects:
    """Per-step job-wide slowdowns, relative to the window's healthy median step time."""

    comm_rel: np.ndarray  # (steps,) added to the world collective
    island_comm_rel: np.ndarray  # (islands, steps) added to one island's stage
    compute_rel: np.ndarray  # (steps,) every rank's compute, scaled so the step rises by it

    def any(self) -> bool:
        return bool(self.comm_rel.any() or self.island_comm_rel.any() or self.compute_rel.any())


def apply_timing(fault: ActiveFault, inten: np.ndarray, compute: np.ndarray, data: np.ndarray,
                 nominal_busy: np.ndarray, job: JobWideEffects) -> None:
    """Apply one fault's timing effect to this window's (ranks × steps) arrays."""
    m = fault.magnitude
    cause = fault.cause
    rows = fault.ranks
    if cause in ("gpu.thermal", "gpu.power", "gpu.clocks"):
        compute[rows] *= 1.0 + m * inten
    elif cause == "host.cpu":
        # A starved host delays kernel launches (compute) and the loader
        # workers that share its cores (data); the split keeps busy at +m.
        compute[rows] *= 1.0 + 0.85 * m * inten
        data[rows] += 0.15 * m * inten[None, :] * nominal_busy[rows, None]
    elif cause in ("input.loader", "input.storage"):
        data[rows] += m * inten[None, :] * nominal_busy[rows, None]
    elif cause in ("comm.link", "change.comm_lib"):
        job.comm_rel += m * inten
    elif cause == "comm.island":
        assert fault.island is not None
        job.island_comm_rel[fault.island] += m * inten
    elif cause in ("change.driver", "change.config"):
        job.compute_rel += m * inten
    else:  # pragma: no cover - SimCause is a closed set
        raise ValueError(f"no timing model for cause {cause!r}")


@dataclass
class Telemetry:
    """One window's sampled counters, per rank (GPU) and per node (host)."""

    sm_clock_mhz: np.ndarray
    max_sm_clock_mhz: np.ndarray
    power_w: np.ndarray
    power_limit_w: np.ndarray
    default_power_limit_w: np.ndarray
    temp_c: np.ndarray
    util_pct: np.ndarray
    throttle: np.ndarray  # int bitmask over wire.THROTTLE_REASONS
    cpu_pct: np.ndarray  # per node from here on
    steal_pct: np.ndarray
    iowait_pct: np.ndarray
    ctx_invol_per_s: np.ndarray
    net_retransmits_per_s: np.ndarray


def apply_telemetry(fault: ActiveFault, mean_inten: float, tel: Telemetry, rng: np.random.Generator,
                    bits: dict[str, int]) -> None:
    """Make the window's counters show what this fault would show on real hardware."""
    if mean_inten <= 0.0:
        return
    m, rows, cause = fault.magnitude, fault.ranks, fault.cause
    slow = 1.0 + m * mean_inten
    if cause == "gpu.thermal":
        tel.temp_c[rows] = 87.0 + 6.0 * mean_inten + rng.normal(0, 0.8, len(rows))
        tel.sm_clock_mhz[rows] /= slow
        tel.power_w[rows] *= 0.85
        hw = fault.variant == "hw"
        tel.throttle[rows] = (tel.throttle[rows] & ~bits["sw_power_cap"]) | bits["hw_thermal" if hw else "sw_thermal"]
    elif cause == "gpu.power":
        # Someone (or a failed BMC) set the board limit below its default:
        # the GPU runs at the cap, clocks follow.
        cap = np.round(tel.default_power_limit_w[rows] / (1.0 + 1.6 * m) / 5.0) * 5.0
        tel.power_limit_w[rows] = cap
        tel.power_w[rows] = cap * rng.uniform(0.97, 1.0, len(rows))
        tel.sm_clock_mhz[rows] /= slow
        tel.throttle[rows] |= bits["sw_power_cap"]
    elif cause == "gpu.clocks":
        # Clocks that stopped boosting: low clock, cool, under its power
        # limit, and no throttle reason to explain it.
        tel.sm_clock_mhz[rows] /= slow
        tel.power_w[rows] /= slow
        tel.temp_c[rows] -= 4.0 * mean_inten
        tel.throttle[rows] = 0
    elif cause == "input.loader":
        tel.util_pct[rows] /= slow
    elif cause == "input.storage":
        tel.util_pct[rows] /= slow
        assert fault.node is not None
        tel.iowait_pct[fault.node] += (8.0 + 60.0 * m) * mean_inten
    elif cause == "host.cpu":
        assert fault.node is not None
        n = fault.node
        # The probe's cpu_pct is the rank's own CPU share: a contended rank is
        # runnable and gets less of the CPU than its peers.
        tel.cpu_pct[n] = max(0.0, tel.cpu_pct[n] * (1.0 - 0.6 * min(1.0, mean_inten)))
        if fault.variant == "steal":
            tel.steal_pct[n] += (4.0 + 50.0 * m) * mean_inten
        else:
            tel.ctx_invol_per_s[n] *= 1.0 + 40.0 * mean_inten
    elif cause == "comm.link":
        assert fault.node is not None
        tel.net_retransmits_per_s[fault.node] += (150.0 + 3000.0 * m) * mean_inten
    # comm.island and change.* leave no trace in per-node counters: the
    # analyser has to find them from collective timings and fingerprints.
