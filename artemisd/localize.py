"""Localize: from evidence to a cause, with the measurements behind it.

Each ``diagnose_*`` function weighs what the window reports (and, when the
daemon ran one, the matched probe) say about a confirmed slowdown and returns
a ``Diagnosis``: one cause of the taxonomy (design.md §4), a confidence, and
the evidence list (signal, subject's value, peers' value).  Below the
configured ``ConfidenceFloor`` the cause is ``unknown`` and the evidence says
what was missing — an honest "not enough to call it" beats a guess that sends
an admin to the wrong rack.

Rules, strongest first (confidence in brackets):

* input — the rank's data-loader wait explains at least half its excess busy
  time: ``input.storage`` if its node's iowait is raised, else
  ``input.loader`` [0.6–0.9].
* GPU — the device reports a throttle reason its peers do not:
  thermal reasons → ``gpu.thermal`` [0.9], power-cap/brake → ``gpu.power``
  [0.9], locked application clocks → ``gpu.clocks`` [0.85]; an enforced power
  limit below the default → ``gpu.power`` [0.85]; SM clock well below peers'
  with no reason given → ``gpu.clocks`` [0.8].
* host — CPU steal, cgroup CPU-quota throttling, involuntary context switches
  or a process CPU share clearly below the peers' → ``host.cpu`` [0.7–0.8].
* matched probe — identical GEMM slow → GPU class only (+0.1); identical
  work at peer speed → GPU readings below 0.85 −0.1, and host/input +0.05
  unless a device names a hardware throttle reason (≥ 0.85), which keeps
  precedence: a short probe can slip through a throttle a whole training
  step cannot.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

import numpy as np

from artemisd.baseline import JobHistory, JobSummary, RankBaseline, WorkloadReference
from artemisd.confirm import ProbeJudgement, ProbeVerdict
from artemisd.detect import JobFlag, RankFlags
from artemisd.frame import THROTTLE_BIT, THROTTLE_UNMEASURED, WindowFrame
from artemisd.incident import Cause, Evidence
from artemisd.thresholds import (CLOCK_DROP, HOT_DELTA_C, POWER_LIMIT_DROP, POWER_REASONS, RETRANSMIT_FACTOR,
                                 RETRANSMITS_PER_S, THERMAL_REASONS, THROTTLED_DELTA_PCT)

THERMAL_BITS = sum(THROTTLE_BIT[reason] for reason in THERMAL_REASONS)
POWER_BITS = sum(THROTTLE_BIT[reason] for reason in POWER_REASONS)
APP_CLOCK_BITS = THROTTLE_BIT["applications_clocks"]
SLOWDOWN_BIT = THROTTLE_BIT["hw_slowdown"]

IOWAIT_DELTA_PCT = 5.0
STEAL_DELTA_PCT = 5.0
CTX_FACTOR = 3.0
CPU_SHARE_DELTA = 0.25
GROUP_RISE = 1.2  # a process group's collective time up 20 % on its baseline


@dataclass(frozen=True)
class Diagnosis:
    cause: Cause
    confidence: float
    evidence: tuple[Evidence, ...]


@dataclass(frozen=True)
class JobDiagnosis:
    """A job-wide slowdown: which kind of incident, and where, if anywhere."""

    kind: str  # "job" | "link" | "island"
    diagnosis: Diagnosis
    node: str | None = None
    island: str | None = None
    link: str | None = None


def _median(values: np.ndarray) -> float:
    finite = values[np.isfinite(values)]
    return float(np.median(finite)) if finite.size else float("nan")


def _r(value: float, digits: int = 2) -> float | None:
    return round(float(value), digits) if np.isfinite(value) else None


def _pick(candidates: list[tuple[Cause, float, list[Evidence]]], missing: list[str], floor: float,
          base: Iterable[Evidence] = ()) -> Diagnosis:
    evidence = list(base)
    if candidates:
        cause, confidence, found = max(candidates, key=lambda c: c[1])
        evidence.extend(found)
        if confidence >= floor:
            return Diagnosis(cause, round(confidence, 2), tuple(evidence))
    else:
        confidence = 0.0
    for what in missing:
        evidence.append(Evidence(signal="missing", value=what, note="needed to name a cause"))
    if not missing and not candidates:
        evidence.append(Evidence(signal="missing", value="a deviating signal",
                                 note="no measured signal differs from the peers'"))
    return Diagnosis(Cause.UNKNOWN, round(confidence, 2), tuple(evidence))


def _throttle_share(frame: WindowFrame, rows: np.ndarray, bits: int) -> float:
    """Share of ``rows`` (that measured throttle reasons) with any of ``bits`` active."""
    masks = frame.throttle[rows]
    measured = masks[masks != THROTTLE_UNMEASURED]
    if measured.size == 0:
        return 0.0
    return float(np.mean((measured & bits) != 0))


def _gpu_candidates(frame: WindowFrame, rows: np.ndarray, peers: np.ndarray) -> tuple[list, bool]:
    tel = frame.telemetry
    found: list[tuple[Cause, float, list[Evidence]]] = []
    measured = bool(np.any(frame.throttle[rows] != THROTTLE_UNMEASURED))

    def stands_out(bits: int) -> bool:
        # Most of the subject's GPUs show the reason and few of the peers do: a
        # healthy GPU at full load touches its power cap now and then, and one
        # such GPU must not explain a whole node's slowdown.
        return _throttle_share(frame, rows, bits) >= 0.5 and _throttle_share(frame, peers, bits) < 0.25

    names = [name for name, bit in THROTTLE_BIT.items() if stands_out(bit)]
    clock = _median(tel["sm_clock_mhz"][rows])
    peer_clock = _median(tel["sm_clock_mhz"][peers])
    max_clock = _median(tel["max_sm_clock_mhz"][rows])
    temp, peer_temp = _median(tel["temp_c"][rows]), _median(tel["temp_c"][peers])
    clock_ev = Evidence(signal="sm_clock_mhz", value=_r(clock, 0), peers=_r(peer_clock, 0),
                        note=f"max {_r(max_clock, 0)} MHz" if np.isfinite(max_clock) else "")
    throttle_ev = Evidence(signal="throttle", value=names, peers=[], note="clock-event reasons active")
    measured = measured or np.isfinite(clock) or np.isfinite(temp)

    for bits, cause, conf in ((THERMAL_BITS, Cause.GPU_THERMAL, 0.9), (POWER_BITS, Cause.GPU_POWER, 0.9),
                              (APP_CLOCK_BITS, Cause.GPU_CLOCKS, 0.85)):
        if stands_out(bits):
            ev = [throttle_ev, clock_ev]
            if cause is Cause.GPU_THERMAL and np.isfinite(temp):
                ev.append(Evidence(signal="temp_c", value=_r(temp, 0), peers=_r(peer_temp, 0)))
            found.append((cause, conf, ev))
    if stands_out(SLOWDOWN_BIT):
        hot = np.isfinite(temp) and np.isfinite(peer_temp) and temp - peer_temp >= HOT_DELTA_C
        found.append((Cause.GPU_THERMAL if hot else Cause.GPU_POWER, 0.7,
                      [throttle_ev, Evidence(signal="temp_c", value=_r(temp, 0), peers=_r(peer_temp, 0))]))

    limit, default = _median(tel["power_limit_w"][rows]), _median(tel["default_power_limit_w"][rows])
    peer_limit = _median(tel["power_limit_w"][peers])
    if np.isfinite(limit) and np.isfinite(default) and limit < POWER_LIMIT_DROP * default:
        if not np.isfinite(peer_limit) or limit < POWER_LIMIT_DROP * peer_limit:
            found.append((Cause.GPU_POWER, 0.85, [Evidence(
                signal="power_limit_w", value=_r(limit, 0), peers=_r(peer_limit, 0),
                note=f"enforced limit below the default {_r(default, 0)} W")]))

    # Clocks explain the slowdown when they dropped by at least half as much as
    # busy rose (work scales with 1/clock) — or by 8 % whatever busy did.
    busy_rise = _median(frame.busy[rows]) / max(_median(frame.busy[peers]), 1e-9) - 1.0
    clock_floor = max(CLOCK_DROP, 1.0 - 0.5 * busy_rise) if busy_rise > 0 else CLOCK_DROP
    if np.isfinite(clock) and np.isfinite(peer_clock) and clock < min(clock_floor, 0.98) * peer_clock:
        hot = np.isfinite(temp) and np.isfinite(peer_temp) and temp - peer_temp >= HOT_DELTA_C
        if hot:
            found.append((Cause.GPU_THERMAL, 0.75, [clock_ev, Evidence(
                signal="temp_c", value=_r(temp, 0), peers=_r(peer_temp, 0), note="hotter than peers")]))
        else:
            found.append((Cause.GPU_CLOCKS, 0.8, [Evidence(
                signal="sm_clock_mhz", value=_r(clock, 0), peers=_r(peer_clock, 0),
                note="SM clock well below peers' with no throttle reason: clocks not boosting")]))
    return found, bool(measured)


def _host_candidates(frame: WindowFrame, rows: np.ndarray, peers: np.ndarray) -> tuple[list, bool]:
    tel = frame.telemetry
    found: list[tuple[Cause, float, list[Evidence]]] = []
    measured = False
    steal, peer_steal = _median(tel["steal_pct"][rows]), _median(tel["steal_pct"][peers])
    ctx, peer_ctx = _median(tel["ctx_invol_per_s"][rows]), _median(tel["ctx_invol_per_s"][peers])
    cpu, peer_cpu = _median(tel["cpu_pct"][rows]), _median(tel["cpu_pct"][peers])
    evidence: list[Evidence] = []
    score = 0.0
    if np.isfinite(steal) and np.isfinite(peer_steal):
        measured = True
        if steal - peer_steal >= STEAL_DELTA_PCT:
            score = max(score, 0.78)
            evidence.append(Evidence(signal="steal_pct", value=_r(steal, 1), peers=_r(peer_steal, 1)))
    if np.isfinite(ctx) and np.isfinite(peer_ctx):
        measured = True
        if ctx >= CTX_FACTOR * peer_ctx + 10.0:
            score = max(score, 0.75)
            evidence.append(Evidence(signal="ctx_invol_per_s", value=_r(ctx, 1), peers=_r(peer_ctx, 1),
                                     note="involuntary context switches: CPU contention"))
    if np.isfinite(cpu) and np.isfinite(peer_cpu) and peer_cpu > 0:
        measured = True
        # Only a *smaller* share: a straggler whose extra busy time is CPU work
        # uses more CPU than peers that sleep in a collective waiting for it --
        # a consequence of being slow, not a cause.  Contention is the rank
        # that is runnable and gets less CPU than its peers.
        if (peer_cpu - cpu) / peer_cpu >= CPU_SHARE_DELTA:
            score = max(score, 0.7)
            evidence.append(Evidence(signal="cpu_pct", value=_r(cpu, 1), peers=_r(peer_cpu, 1),
                                     note="process CPU share below its peers': runnable, not running"))
    throttled, peer_throttled, held = _quota(frame, rows, peers)
    if np.isfinite(throttled) and np.isfinite(peer_throttled):
        measured = True
        if held:
            score = max(score, 0.8)
            evidence.append(Evidence(signal="cpu_throttled_pct", value=_r(throttled, 1), peers=_r(peer_throttled, 1),
                                     note="the rank's cgroup CPU quota holds it back"))
    waits = frame.run_wait_per_step()
    wait, peer_wait = _median(waits[rows]), _median(waits[peers])
    if score and np.isfinite(wait) and np.isfinite(peer_wait) and wait > peer_wait:
        # Shown beside a signal that convicts, never alone: on a shared host the scheduler holds one
        # rank off a CPU more than another for seconds at a time, and that wait names no fault.
        evidence.append(Evidence(signal="run_wait_ms", value=_r(wait, 2), peers=_r(peer_wait, 2),
                                 note="waited for a CPU, ms per step (all its threads)"))
    if score:
        found.append((Cause.HOST_CPU, score, evidence))
    return found, measured


def _quota(frame: WindowFrame, rows: np.ndarray, peers: np.ndarray) -> tuple[float, float, bool]:
    """The subject's and its peers' ``cpu_throttled_pct`` (medians), and whether its quota holds it back."""
    throttled = frame.telemetry["cpu_throttled_pct"]
    mine, theirs = _median(throttled[rows]), _median(throttled[peers])
    return mine, theirs, bool(np.isfinite(mine) and np.isfinite(theirs) and mine - theirs >= THROTTLED_DELTA_PCT)


def counter_explains(frame: WindowFrame, rows: np.ndarray, peers: np.ndarray) -> bool:
    """Whether a counter of the subject's own says why it is slow: a GPU clock-event reason or power limit
    that its peers do not share, or its cgroup's CPU quota running out (``cpu_throttled_pct``) where theirs
    does not.  Scheduling noise moves none of these (confirm.Persistence.observe)."""
    return bool(_gpu_candidates(frame, rows, peers)[0]) or _quota(frame, rows, peers)[2]


def _input_candidate(frame: WindowFrame, rows: np.ndarray, peers: np.ndarray, excess_ms: float):
    data, peer_data = _median(frame.data[rows]), _median(frame.data[peers])
    if not (np.isfinite(data) and np.isfinite(peer_data)) or excess_ms <= 0:
        return None, False
    data_excess = data - peer_data
    share = data_excess / excess_ms
    if share < 0.5:
        return None, True
    evidence = [Evidence(signal="ms.data", value=_r(data), peers=_r(peer_data),
                         note=f"data-loader wait is {min(share, 1.0):.0%} of the excess busy time")]
    iowait = _median(frame.telemetry["iowait_pct"][rows])
    peer_iowait = _median(frame.telemetry["iowait_pct"][peers])
    conf = 0.6 + 0.3 * min(1.0, share)
    if np.isfinite(iowait) and np.isfinite(peer_iowait) and iowait - peer_iowait >= IOWAIT_DELTA_PCT:
        evidence.append(Evidence(signal="iowait_pct", value=_r(iowait, 1), peers=_r(peer_iowait, 1),
                                 note="the node waits on storage"))
        return (Cause.INPUT_STORAGE, conf, evidence), True
    return (Cause.INPUT_LOADER, conf, evidence), True


def pair_evidence(frame: WindowFrame, row: int, partner: int, baseline: RankBaseline) -> tuple[Evidence, ...]:
    """What convicted a rank of an island of two: its busy against its own
    healthy history, and the other rank's comm_wait against its own
    (``baseline`` aligned with the frame's rows)."""
    other = int(frame.rank[partner])
    own = baseline.busy[row]
    usual_wait = baseline.comm_wait[partner] if baseline.comm_wait is not None else float("nan")
    return (
        Evidence(signal="ms.busy", value=_r(frame.busy[row]), peers=_r(own),
                 note="against its own healthy windows: an island of two has no peer median"),
        Evidence(signal="ms.comm_wait", value=_r(frame.comm_wait[partner]), peers=_r(usual_wait),
                 note=f"rank {other}, the other rank of its island, now waits for it at every collective"),
    )


def own_history_evidence(frame: WindowFrame, rows: np.ndarray, flags: RankFlags,
                         baseline: RankBaseline | None) -> tuple[Evidence, ...]:
    """A rank of an island of two was judged against its own history and the wait it causes: say so."""
    if rows.size != 1 or baseline is None or flags.partner[rows[0]] < 0:
        return ()
    return pair_evidence(frame, int(rows[0]), int(flags.partner[rows[0]]), baseline)


class IslandPeers:
    """A subject's island peers (its island less its own rows), built only when needed.

    Excluding the subject moves the median of a large island by a hair, so for
    islands of ``EXACT_PEERS_BELOW`` ranks or more the island median already
    computed by detect stands in, and the O(world) peer set is built only for
    localisation, once, at confirmation.
    """

    EXACT_PEERS_BELOW = 256

    def __init__(self, frame: WindowFrame, subject_rows: np.ndarray, island_size: int):
        self.frame = frame
        self.subject_rows = subject_rows
        self.island_size = island_size
        self._rows: np.ndarray | None = None

    @property
    def rows(self) -> np.ndarray:
        if self._rows is None:
            frame, code = self.frame, self.frame.island[self.subject_rows[0]]
            mask = frame.island == code
            mask[self.subject_rows] = False
            self._rows = np.flatnonzero(mask)
        return self._rows

    def median_busy(self, flags: RankFlags) -> float:
        if self.island_size >= self.EXACT_PEERS_BELOW:
            return float(flags.island_median[int(self.subject_rows[0])])
        peers = self.rows
        return float(np.median(self.frame.busy[peers])) if peers.size else float("nan")


def straggler_measures(frame: WindowFrame, rows: np.ndarray, peers: IslandPeers, flags: RankFlags,
                       step_ms: float) -> tuple[float, float, float]:
    """A straggler subject's ratio to its peers' busy, its excess (ms per step) and the share of the step it costs."""
    busy = float(np.median(frame.busy[rows]))
    peer_busy = peers.median_busy(flags)
    excess = busy - peer_busy
    return busy / max(peer_busy, 1e-9), excess, 100.0 * excess / max(step_ms, 1e-9)


def diagnose_straggler(
    frame: WindowFrame,
    rows: np.ndarray,
    peers: np.ndarray,
    floor: float,
    probe: ProbeJudgement | None = None,
    history: Iterable[Evidence] = (),
) -> Diagnosis:
    """Why are ``rows`` (one rank, or the ranks of one node) slower than ``peers``?

    ``history`` is evidence from the subject's own past (``pair_evidence``),
    listed after the comparison with the peers.
    """
    busy, peer_busy = _median(frame.busy[rows]), _median(frame.busy[peers])
    excess = busy - peer_busy
    base = [Evidence(signal="ms.busy", value=_r(busy), peers=_r(peer_busy),
                     note="time not spent waiting for other ranks, per step"), *history]
    candidates: list[tuple[Cause, float, list[Evidence]]] = []
    missing: list[str] = []

    input_cand, data_measured = _input_candidate(frame, rows, peers, excess)
    gpu, gpu_measured = _gpu_candidates(frame, rows, peers)
    host, host_measured = _host_candidates(frame, rows, peers)
    if input_cand is not None:
        candidates.append(input_cand)
        # Time spent waiting for data is not time the GPU is slow in: the more
        # of the excess the loader explains, the less a GPU reason can.
        data_share = min(1.0, (input_cand[1] - 0.6) / 0.3)
        gpu = [(c, conf * (1.0 - 0.5 * data_share), ev) for c, conf, ev in gpu]
    candidates.extend(gpu)
    candidates.extend(host)

    if probe is not None and probe.verdict is not ProbeVerdict.INCOMPLETE:
        base.extend(probe.evidence)
        if probe.verdict is ProbeVerdict.DEVICE:
            # Identical work is slow: the device.  Keep a GPU cause the telemetry
            # named, strengthened; otherwise the clocks are the usual suspect.
            candidates = [(c, min(1.0, conf + 0.1), ev) for c, conf, ev in candidates
                          if c.value.startswith("gpu.")] or [(Cause.GPU_CLOCKS, 0.6, [])]
        elif probe.verdict is ProbeVerdict.NORMAL:
            # Identical work ran at peer speed: host or input is likelier.  But a
            # short probe GEMM can slip through a throttle that a whole training
            # step cannot (a CPU quota, a clock that drops under sustained load),
            # so a device that names a hardware reason (confidence >= 0.85) keeps
            # its say; weaker GPU readings step back.
            hardware_named = any(c.value.startswith("gpu.") and conf >= 0.85 for c, conf, _ in candidates)
            candidates = [(c, conf - 0.1 if conf < 0.85 else conf, ev) if c.value.startswith("gpu.")
                          else (c, conf if hardware_named else min(1.0, conf + 0.05), ev)
                          for c, conf, ev in candidates] or [(Cause.HOST_CPU, 0.55, [])]

    if not data_measured:
        missing.append("ms.data (data-loader wait)")
    if not gpu_measured:
        missing.append("gpu telemetry (clocks, throttle reasons)")
    if not host_measured:
        missing.append("host telemetry (steal, context switches, CPU share)")
    diagnosis = _pick(candidates, missing, floor, base)
    if probe is not None and probe.verdict is ProbeVerdict.NORMAL and diagnosis.cause.value.startswith("gpu."):
        diagnosis = _speaks_against(diagnosis, "probe.gemm_ms")
    return diagnosis


def _speaks_against(diagnosis: Diagnosis, signal: str) -> Diagnosis:
    """A GPU cause that stands on a hardware reason the telemetry named although the matched probe's
    identical work ran at peer speed: the probe's line says it is evidence *against* the cause, and
    why the cause stands anyway, rather than reading as support."""
    why = (f"speaks against {diagnosis.cause.value}; the cause stands on the telemetry's hardware reason, "
           f"which a short probe can slip through and a whole training step cannot")
    return replace(diagnosis, evidence=tuple(
        e.model_copy(update={"note": f"{e.note}: {why}"}) if e.signal == signal else e
        for e in diagnosis.evidence))


def _node_retransmits(frame: WindowFrame) -> tuple[str | None, float, float]:
    """The node whose transport retransmits stand out, if one does (evidence, never a localisation)."""
    values = frame.telemetry["net_retransmits_per_s"]
    if not np.any(np.isfinite(values)):
        return None, float("nan"), float("nan")
    per_node = {}
    for code, name in enumerate(frame.node_names):
        v = _median(values[frame.node == code])
        if np.isfinite(v):
            per_node[name] = v
    if len(per_node) < 2:
        return None, float("nan"), float("nan")
    worst = max(per_node, key=per_node.get)
    others = _median(np.array([v for n, v in per_node.items() if n != worst]))
    if per_node[worst] >= max(RETRANSMITS_PER_S, RETRANSMIT_FACTOR * others):
        return worst, per_node[worst], others
    return None, per_node[worst], others


def diagnose_job(
    flag: JobFlag,
    frame: WindowFrame,
    summary: JobSummary,
    history: JobHistory,
    floor: float,
    probe: ProbeJudgement | None = None,
) -> JobDiagnosis:
    """A whole job slowed down together: communication, input, or unknown."""
    base = [Evidence(signal="ms.step", value=_r(flag.step_ms), peers=_r(flag.baseline_step_ms),
                     note="job median step time vs its own healthy baseline")]
    if not flag.comm_bound:
        base.append(Evidence(signal="ms.busy", value=_r(summary.busy), peers=_r(history.reference("busy")),
                             note="every rank's own work rose together"))
        if flag.data_rise_ms >= 0.5 * flag.busy_rise_ms > 0:
            base.append(Evidence(signal="ms.data", value=_r(summary.data), peers=_r(history.reference("data"))))
            iowait = _median(frame.telemetry["iowait_pct"])
            cause = Cause.INPUT_STORAGE if np.isfinite(iowait) and iowait >= IOWAIT_DELTA_PCT else Cause.INPUT_LOADER
            return JobDiagnosis("job", Diagnosis(cause, 0.7, tuple(base)))
        return JobDiagnosis("job", _pick([], ["per-rank telemetry that differs from the job's history"],
                                         floor, base))

    base.append(Evidence(signal="ms.comm_wait", value=_r(summary.comm_wait),
                         peers=_r(history.reference("comm_wait")), note="every rank waits longer at collectives"))
    # One island's own collective groups slowed while the other islands' did not?
    rising = []
    for group, ms in summary.collectives.items():
        before = history.collective_median(group)
        if np.isfinite(before) and before > 0 and ms / before >= GROUP_RISE:
            rising.append((group, ms, before))
    island_groups = [g for g in rising if g[0] in frame.island_names]
    if len(frame.island_names) >= 2 and len(island_groups) == 1:
        group, ms, before = island_groups[0]
        ev = base + [Evidence(signal=f"collectives[{group}].ms", value=_r(ms), peers=_r(before),
                              note="this island's collectives slowed; the other islands' did not")]
        return JobDiagnosis("island", Diagnosis(Cause.COMM_ISLAND, 0.8, tuple(ev)), island=group)

    if probe is not None and probe.verdict is ProbeVerdict.LINK and probe.node:
        ev = base + list(probe.evidence)
        return JobDiagnosis("link", Diagnosis(Cause.COMM_LINK, 0.85, tuple(ev)), node=probe.node, link=probe.node)
    if probe is not None:
        base += [e for e in probe.evidence if e.signal != "missing"]
    node, worst, others = _node_retransmits(frame)
    if node is not None:
        # Retransmits are counted by the *senders* to a slow link: the node whose
        # counter stands out may be a healthy neighbour of the bad link.  They
        # say the network is involved, not whose link it is.
        base.append(Evidence(signal="net_retransmits_per_s", value=_r(worst, 1), peers=_r(others, 1),
                             note=f"{node}'s transport retransmits stand out; senders to a slow link count "
                                  f"them, so this does not say whose link it is"))
    missing = [e.value for e in probe.evidence if e.signal == "missing"] if probe is not None else []
    missing = missing or ["per-node link evidence: matched probes whose ring timings agree on one link"]
    # A communication slowdown with no node to name: still a comm problem, said
    # plainly, with what would have named the link.
    diag = _pick([(Cause.COMM_LINK, max(0.0, floor - 0.05), [])], missing, floor, base)
    return JobDiagnosis("job", diag)


FINGERPRINT_CAUSES = (("driver", Cause.CHANGE_DRIVER), ("comm_lib", Cause.CHANGE_COMM_LIB),
                      ("config", Cause.CHANGE_CONFIG), ("torch", Cause.CHANGE_CONFIG),
                      ("kernel", Cause.CHANGE_CONFIG), ("firmware", Cause.CHANGE_DRIVER))


def diagnose_change(
    reference: WorkloadReference,
    fingerprint: dict[str, str | None],
    summary: JobSummary,
) -> Diagnosis | None:
    """A job of a known workload runs slower than its last healthy run: what changed?"""
    changed = [(key, cause) for key, cause in FINGERPRINT_CAUSES
               if fingerprint.get(key) is not None and reference.fingerprint.get(key) is not None
               and fingerprint.get(key) != reference.fingerprint.get(key)]
    if not changed:
        return None
    evidence = [Evidence(signal="ms.step", value=_r(summary.step), peers=_r(reference.step),
                         note=f"same workload as job {reference.job}, which ran before the change")]
    for key, _ in changed:
        evidence.append(Evidence(signal=f"env.{key}", value=fingerprint[key], peers=reference.fingerprint[key],
                                 note="changed since the reference run"))
    # Several fields changed at once (a new image): name the first in order of
    # how often each is to blame, and list all of them as evidence.
    confidence = 0.85 if len(changed) == 1 else 0.6
    return Diagnosis(changed[0][1], confidence, tuple(evidence))
