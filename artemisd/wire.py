"""Wire format v1: the window report and the node event (design.md §3).

One JSON object per rank per window (``type: "window"``) or per node event
(``type: "node"``).  A trace file is JSON Lines of both, in arrival order.

The daemon's hot path holds a window report it took whole through the ingest
fast path as that path's frozen msgspec Struct (``ingest.FastReport``) instead
of a ``WindowReport``: the same fields, names and values, read by attribute;
``record.type`` tells a window report from a node event either way, and
``dump_record`` / ``with_step`` take both.

Rules the models enforce, because tools outside this repository rely on them:

* Times in ``ms`` are per-step means over the window, in milliseconds;
  ``ms_p50`` holds per-step medians when the probe measured them.
* ``busy`` = ``step`` - ``comm_wait``: the time a rank spends *not* waiting for
  its peers.  When a report omits ``busy`` but has ``step`` and ``comm_wait``,
  it is derived; when it has neither ``busy`` nor ``comm_wait`` the report is
  rejected, because a rank's own work cannot be told from its waiting.
* Unknown fields are ignored (but for a counter in ``fabric.ports[].per_s``,
  ``FabricCounters``: refused, as a misspelling).  A missing optional field means "not measured",
  never zero: it stays ``None``.
* ``gpu.throttle`` uses one vocabulary for every vendor (``THROTTLE_REASONS``);
  ``[]`` means "measured, none active".
* Everything is bounded before it is stored (a report comes from a job's
  owner and may be hostile): integers within int64 and their sane range,
  floats finite (NaN and Infinity are refused, not stored as null), strings at
  most ``MAX_TEXT`` characters (identifiers ``MAX_ID``) of valid Unicode (a
  lone surrogate escape is refused), lists and maps at most ``MAX_ITEMS``
  entries, ``rank < world <= MaxWorld`` (``DEFAULT_MAX_WORLD``, or the
  ``max_world`` in the validation context).  Nesting depth and invalid UTF-8
  are the body decoder's business (``check_strings`` walks an item that may
  hold either).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args

import msgspec

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

WIRE_VERSION = 1

ThrottleReason = Literal[
    "sw_power_cap",
    "hw_slowdown",
    "hw_thermal",
    "sw_thermal",
    "hw_power_brake",
    "sync_boost",
    "applications_clocks",
    "idle",
]
THROTTLE_REASONS: tuple[str, ...] = get_args(ThrottleReason)

INT64_MAX = 2**63 - 1
DEFAULT_MAX_WORLD = 65_536  # artemis.conf MaxWorld; replay and restore use it too
MAX_ID = 255  # job, step, node, island: a hostname is at most 255 bytes
MAX_TEXT = 1024  # any other string (model names, versions, fingerprints)
MAX_ITEMS = 1024  # entries of any list or map in one record
MAX_STEPS = 2**31 - 1  # steps in one window: a window is seconds to minutes long

NonNegative = Annotated[float, Field(ge=0)]
Count = Annotated[int, Field(ge=0, le=INT64_MAX)]
Id = Annotated[str, Field(min_length=1, max_length=MAX_ID)]
# Tolerance when a report carries busy *and* comm_wait: probes round each field
# independently, so busy + comm_wait may differ from step by a little.
_BUSY_SLACK_MS = 0.5
_BUSY_SLACK_REL = 0.01


class _Model(BaseModel):
    # Unknown fields are ignored (wire contract); models are immutable values.
    # NaN/Infinity would be stored as null and skipped on restore, so that the
    # daemon's state after a restart would differ from before: refused here.
    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False, str_max_length=MAX_TEXT)


class Device(_Model):
    vendor: str = Field(min_length=1)
    model: str = Field(min_length=1)
    index: int | None = Field(default=None, ge=0, le=INT64_MAX)
    uuid: str | None = None


class WindowSpan(_Model):
    """Window ``seq`` covers steps ``[first_step, first_step + steps)``; wall clock t0..t1 (s)."""

    seq: int = Field(ge=0, le=INT64_MAX)
    first_step: int = Field(ge=0, le=INT64_MAX - MAX_STEPS)
    steps: int = Field(gt=0, le=MAX_STEPS)
    t0: float
    t1: float

    @model_validator(mode="after")
    def _ordered(self) -> WindowSpan:
        if self.t1 < self.t0:
            raise ValueError(f"t1 ({self.t1}) is before t0 ({self.t0})")
        return self

    @property
    def seconds(self) -> float:
        return self.t1 - self.t0


class StepTimes(_Model):
    """Per-step mean times over the window, milliseconds."""

    step: NonNegative
    busy: NonNegative | None = None
    compute: NonNegative | None = None
    data: NonNegative | None = None
    comm_wait: NonNegative | None = None

    @model_validator(mode="before")
    @classmethod
    def _derive_busy(cls, raw: Any) -> Any:
        if isinstance(raw, dict) and raw.get("busy") is None:
            step, wait = raw.get("step"), raw.get("comm_wait")
            if isinstance(step, int | float) and isinstance(wait, int | float):
                return {**raw, "busy": max(0.0, float(step) - float(wait))}
        return raw

    @model_validator(mode="after")
    def _consistent(self) -> StepTimes:
        if self.busy is None:
            raise ValueError("needs busy or comm_wait: a rank's own work cannot be told from its waiting")
        if self.busy > self.step + _BUSY_SLACK_MS:
            raise ValueError(f"busy ({self.busy}) exceeds step ({self.step})")
        if self.comm_wait is not None:
            gap = abs(self.step - self.comm_wait - self.busy)
            if gap > max(_BUSY_SLACK_MS, _BUSY_SLACK_REL * self.step):
                raise ValueError(
                    f"busy ({self.busy}) must equal step - comm_wait "
                    f"({self.step} - {self.comm_wait})"
                )
        return self


class Collective(_Model):
    op: str = Field(min_length=1)
    group: str = "world"
    calls: Count
    bytes: NonNegative | None = None
    ms: NonNegative  # total over the window, not per step


class GpuTelemetry(_Model):
    sm_clock_mhz: NonNegative | None = None
    max_sm_clock_mhz: NonNegative | None = None
    power_w: NonNegative | None = None
    power_limit_w: NonNegative | None = None
    default_power_limit_w: NonNegative | None = None
    temp_c: float | None = None
    util_pct: Annotated[float, Field(ge=0, le=100)] | None = None
    throttle: tuple[ThrottleReason, ...] | None = Field(default=None, max_length=len(THROTTLE_REASONS))
    ecc_uncorrected: Count | None = None
    pcie_replay: Count | None = None


class HostTelemetry(_Model):
    cpu_pct: NonNegative | None = None
    steal_pct: NonNegative | None = None
    iowait_pct: NonNegative | None = None
    ctx_invol_per_s: NonNegative | None = None
    net_retransmits_per_s: NonNegative | None = None
    # Extension of v1 (readers that do not know it ignore it): the share of the
    # rank's cgroup CPU-quota periods in the window whose quota ran out
    # (cpu.stat nr_throttled / nr_periods), 0..100; 0 without a quota.
    cpu_throttled_pct: NonNegative | None = None
    # Extension of v1: milliseconds per second that this process's threads were
    # runnable but not running (summed over threads, /proc schedstat): time the
    # host, or its cgroup's quota, could not give it a CPU.  May exceed 1000
    # with several threads waiting at once.
    run_wait_ms_per_s: NonNegative | None = None


class EnvFingerprint(_Model):
    driver: str | None = None
    comm_lib: str | None = None
    torch: str | None = None
    config: str | None = None


class P2PTiming(_Model):
    """One ring pair of the probe, this rank -> ``peer``: ``ms`` its fastest round trip (``bench``)."""

    peer: int = Field(ge=0, le=INT64_MAX)
    ms: NonNegative
    node: str | None = Field(default=None, max_length=MAX_ID)
    # The sender's run-queue wait during that round trip (every thread, /proc
    # schedstat): time its host could not run it, which slows the transfer as a link would.
    wait_ms: NonNegative | None = None


class ProbeResult(_Model):
    """Matched micro-benchmark run on a directive (an optional extension of v1).

    Identical work on every rank: ``gemm_ms`` a fixed-size matrix multiply on the
    rank's device, ``allreduce_ms`` a fixed-size all-reduce within the island,
    ``p2p`` the rank's sends in a ring.  ``id`` echoes the directive.
    """

    id: str = Field(max_length=MAX_ID)
    gemm_ms: NonNegative | None = None
    gemm_tflops: NonNegative | None = None
    allreduce_ms: NonNegative | None = None
    p2p: tuple[P2PTiming, ...] = Field(default=(), max_length=MAX_ITEMS)
    # This rank's least run-queue wait over the round trips it answered for the
    # ring pair that ends at it (its left neighbour's ``p2p`` entry): the far end's share.
    served_wait_ms: NonNegative | None = None
    cost_ms: NonNegative | None = None


class WindowReport(_Model):
    type: Literal["window"]
    v: Literal[1]
    job: Id
    step: Id = "0"
    rank: int = Field(ge=0, le=INT64_MAX)
    world: int = Field(gt=0, le=INT64_MAX)
    node: Id
    device: Device | None = None
    island: str | None = Field(default=None, max_length=MAX_ID)
    window: WindowSpan
    ms: StepTimes
    ms_p50: dict[Annotated[str, Field(max_length=32)], NonNegative] | None = Field(default=None, max_length=16)
    samples: NonNegative | None = None
    collectives: tuple[Collective, ...] | None = Field(default=None, max_length=MAX_ITEMS)
    gpu: GpuTelemetry | None = None
    host: HostTelemetry | None = None
    env: EnvFingerprint | None = None
    probe: ProbeResult | None = None
    dropped_reports: Count | None = None
    # Extension of v1: a node relay's (local rank 0's) count of its siblings'
    # reports it took and could not deliver (cumulative), torch_hook/relay.py.
    relay_dropped: Count | None = None
    # Extension of v1: true once the job reads its work shares (the probe's
    # WeightedDistributedSampler or work_share()): rebalancing is opt-in.
    rebalance_opt_in: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _coerce_ids(cls, raw: Any) -> Any:
        # Slurm ids are strings in the contract; accept numbers for robustness.
        if isinstance(raw, dict):
            fixed = dict(raw)
            for key in ("job", "step"):
                if isinstance(fixed.get(key), int) and not isinstance(fixed.get(key), bool):
                    fixed[key] = str(fixed[key])
            return fixed
        return raw

    @field_validator("world")
    @classmethod
    def _world_bounded(cls, world: int, info: ValidationInfo) -> int:
        # Per-rank state is sized by the ranks a job really has, but a world
        # beyond any real job is refused outright (MaxWorld, artemis.conf).
        limit = (info.context or {}).get("max_world", DEFAULT_MAX_WORLD)
        if world > limit:
            raise ValueError(f"{world} is above MaxWorld ({limit})")
        return world

    @model_validator(mode="after")
    def _rank_in_world(self) -> WindowReport:
        if self.rank >= self.world:
            raise ValueError(f"rank {self.rank} is not below world {self.world}")
        return self

    @property
    def island_key(self) -> str:
        """Ranks are compared only within one island (same vendor and model)."""
        if self.island:
            return self.island
        if self.device is not None:
            return f"{self.device.vendor}:{self.device.model}"
        return "default"

    @property
    def job_key(self) -> tuple[str, str]:
        return (self.job, self.step)


class NodeGpu(_Model):
    index: int = Field(ge=0, le=INT64_MAX)
    vendor: str | None = None
    model: str | None = None
    uuid: str | None = None
    sm_clock_mhz: NonNegative | None = None
    max_sm_clock_mhz: NonNegative | None = None
    power_limit_w: NonNegative | None = None
    default_power_limit_w: NonNegative | None = None
    temp_c: float | None = None
    # Root-side corroboration counts a reading only under load (policy._idle).
    util_pct: Annotated[float, Field(ge=0, le=100)] | None = None
    throttle: tuple[ThrottleReason, ...] | None = None


class NodeFingerprint(_Model):
    driver: str | None = None
    comm_lib: str | None = None
    kernel: str | None = None
    firmware: str | None = None


class NodeProbe(_Model):
    gemm_tflops: tuple[NonNegative, ...] = Field(default=(), max_length=MAX_ITEMS)
    membw_gbs: tuple[NonNegative, ...] = Field(default=(), max_length=MAX_ITEMS)


# Extension of v1: the node check's fabric evidence (prolog_epilog/fabric.py), read from sysfs.
MAX_FABRIC_ITEMS = 64  # ports, and PCIe links, in one block (the node check keeps to it)
FabricState = Annotated[str, Field(min_length=1, max_length=32)]


class FabricCounters(_Model):
    """A port's counters per second since the node check's previous pass.

    Receive side and link training (what may convict this node's link): ``symbol_error``,
    ``link_error_recovery``, ``link_downed``, ``port_rcv_errors`` (InfiniBand/RoCE),
    ``rx_crc_errors``, ``rx_errors``, ``carrier_changes`` (Ethernet).  Shown only: the transmit
    side's ``port_xmit_discards``, ``port_xmit_wait``, ``tx_errors`` (they rise on every sender
    to a slow link) and ``rx_dropped`` (the host had no room).  An unknown counter is ignored, as
    any unknown field: a node check newer than the daemon must not cost the node its whole health
    event (its GPU evidence too)."""

    symbol_error: NonNegative | None = None
    link_error_recovery: NonNegative | None = None
    link_downed: NonNegative | None = None
    port_rcv_errors: NonNegative | None = None
    port_xmit_discards: NonNegative | None = None
    port_xmit_wait: NonNegative | None = None
    carrier_changes: NonNegative | None = None
    rx_crc_errors: NonNegative | None = None
    rx_errors: NonNegative | None = None
    tx_errors: NonNegative | None = None
    rx_dropped: NonNegative | None = None


class FabricPort(_Model):
    """An InfiniBand/RoCE port (``mlx5_0/1``) or an Ethernet interface (``eth0``)."""

    name: Id
    kind: Literal["ib", "eth"]
    state: FabricState | None = None  # ACTIVE, DOWN, ... (ib); up, down, unknown, ... (eth operstate)
    phys_state: FabricState | None = None  # LinkUp, Polling, Disabled, ... (ib only)
    rate_gbps: NonNegative | None = None  # as trained; an Ethernet interface's speed / 1000
    per_s: FabricCounters | None = None


class PcieLink(_Model):
    """The PCIe link of a GPU or network controller as trained, against its maximum."""

    device: Id  # the PCI address, 0000:3b:00.0
    role: Literal["gpu", "nic"]
    width: int | None = Field(default=None, ge=0, le=64)
    max_width: int | None = Field(default=None, ge=0, le=64)
    speed_gts: NonNegative | None = None
    max_speed_gts: NonNegative | None = None


class NodeFabric(_Model):
    interval_s: NonNegative | None = None  # seconds the per_s counters cover (absent: no rates)
    ports: tuple[FabricPort, ...] | None = Field(default=None, max_length=MAX_FABRIC_ITEMS)
    pcie: tuple[PcieLink, ...] | None = Field(default=None, max_length=MAX_FABRIC_ITEMS)


class NodeEvent(_Model):
    type: Literal["node"]
    v: Literal[1]
    event: Literal["job_start", "job_end", "health", "probe"]
    job: Id | None = None
    node: Id
    time: float
    fingerprint: NodeFingerprint | None = None
    gpus: tuple[NodeGpu, ...] | None = Field(default=None, max_length=MAX_ITEMS)
    probe: NodeProbe | None = None
    host: HostTelemetry | None = None
    fabric: NodeFabric | None = None  # extension of v1: health events of the node check

    @model_validator(mode="before")
    @classmethod
    def _coerce_job(cls, raw: Any) -> Any:
        if isinstance(raw, dict) and isinstance(raw.get("job"), int) and not isinstance(raw.get("job"), bool):
            return {**raw, "job": str(raw["job"])}
        return raw


Record = Annotated[Union[WindowReport, NodeEvent], Field(discriminator="type")]
_RECORD = TypeAdapter(Record)


class ReportError(ValueError):
    """A record that does not follow the wire contract.

    ``problems`` lists ``(field path, reason)`` pairs; ``where`` names the
    source (``file:line`` or an item index) when known.
    """

    def __init__(self, problems: list[tuple[str, str]], where: str | None = None):
        self.problems = problems
        self.where = where
        text = "; ".join(f"{path or '<record>'}: {reason}" for path, reason in problems)
        super().__init__(f"{where}: {text}" if where else text)


def _path(loc: tuple[Any, ...]) -> str:
    # Drop the discriminator tag pydantic inserts ("window"/"node") so paths
    # read like the JSON the user wrote: ms.busy, window.seq, gpu.throttle.1
    parts = [str(p) for p in loc]
    if parts and parts[0] in ("window", "node"):
        parts = parts[1:]
    # A map key is the sender's text: shortened, and escaped where it is not valid Unicode.
    return ".".join(p[:64].encode("utf-8", "backslashreplace").decode("utf-8") for p in parts)


def parse_record(obj: Any, where: str | None = None, context: dict[str, Any] | None = None
                 ) -> WindowReport | NodeEvent:
    """Validate one decoded JSON value; raise ReportError naming field and reason.

    ``context``: ``{"max_world": N}`` (the daemon's MaxWorld; default ``DEFAULT_MAX_WORLD``).
    """
    if not isinstance(obj, dict):
        raise ReportError([("", f"expected a JSON object, got {type(obj).__name__}")], where)
    if obj.get("v") not in (None, WIRE_VERSION) and obj.get("type") in ("window", "node"):
        raise ReportError([("v", f"unsupported wire version {obj.get('v')!r} (this reader knows {WIRE_VERSION})")], where)
    try:
        return _RECORD.validate_python(obj, context=context)
    except ValidationError as err:
        problems = [(_path(e["loc"]), e["msg"].removeprefix("Value error, ")) for e in err.errors(include_url=False)]
        raise ReportError(problems, where) from None


def parse_line(line: str, where: str | None = None) -> WindowReport | NodeEvent:
    try:
        # The fast path: pydantic parses the JSON itself (a third faster than
        # json.loads + validate).  Only a bad line pays for the careful path,
        # which words the error the way parse_record does.
        return _RECORD.validate_json(line)
    except ValidationError:
        pass
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as err:
        raise ReportError([("", f"not JSON: {err.msg} at column {err.colno}")], where) from None
    except RecursionError:
        raise ReportError([("", "not JSON: nested too deep")], where) from None
    return parse_record(obj, where)


@dataclass
class TraceReader:
    """Reads a JSON Lines trace; a bad line is reported as file:line and skipped.

    Iterate for the valid records in arrival order; afterwards ``errors`` holds
    every rejected line's ReportError and ``rejected`` their count.
    """

    path: Path
    errors: list[ReportError]

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.errors = []

    @property
    def rejected(self) -> int:
        return len(self.errors)

    def __iter__(self) -> Iterator[WindowReport | NodeEvent]:
        with self.path.open("r", encoding="utf-8", errors="replace") as handle:
            yield from self._records(handle)

    def _records(self, lines: Iterable[str]) -> Iterator[WindowReport | NodeEvent]:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                yield parse_line(line, f"{self.path}:{number}")
            except ReportError as err:
                self.errors.append(err)


def dump_record(record: WindowReport | NodeEvent) -> str:
    """One JSON line, omitting fields that were not measured (a wire model, or the ingest fast path's Struct)."""
    if isinstance(record, BaseModel):
        return record.model_dump_json(exclude_none=True)
    return msgspec.json.encode(record).decode()


def with_step(record: WindowReport, step: str) -> WindowReport:
    """The same window report under another step key (a wire model, or the ingest fast path's Struct)."""
    if isinstance(record, BaseModel):
        return record.model_copy(update={"step": step})
    return msgspec.structs.replace(record, step=step)
