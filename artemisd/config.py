"""artemis.conf: slurm.conf-style configuration.

Syntax (as slurm.conf(5)): one or more ``Key=Value`` pairs per line, keys are
case-insensitive, ``#`` starts a comment outside quotes, values with spaces are
double-quoted, ``Include PATH`` (or ``Include=PATH``; globs allowed, relative to
the including file) reads another file in place.  Lines whose first key is a
*block key* (``PartitionPolicy=gpu …``) open a record of their own; see
``BLOCK_KEYS``.

Every unknown key and every bad value raises ``ConfigError`` naming the file,
line and key.  The daemon reads with ``secure=True``: a file (or an included
one) that anyone but root or the daemon's own user could have written is
refused, as munged and slurmctld refuse theirs (``conf_syntax.check_config_file_secure``,
where the syntax and Include are read).
The schema lives in pydantic models; ``KEYS`` maps each ``artemis.conf`` key
to the model field it sets, so there is exactly one table to extend when a
key is added (and docs/artemis.conf.5.md documents each).
"""

from __future__ import annotations

import fnmatch
import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import parse_qs, urlsplit

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from artemisd.conf_syntax import ConfigError, ConfLine, Setting, read_lines, split_pairs
from artemisd.control import actions
from artemisd.wire import DEFAULT_MAX_WORLD

COMMAND_LINE = "command line"  # where a setting given as an option (artemisd --listen) was written


# --- schema ---------------------------------------------------------------


class CrossKeyError(ValueError):
    """A check across fields of one model; ``fields`` name the ones to blame, most to blame first.

    A model-level error has no location of its own (pydantic's ``loc`` is
    empty): without these the error would name whichever key happened to be
    given last.  ``build_config`` names the first of ``fields`` the file sets.
    """

    def __init__(self, reason: str, *fields: str):
        super().__init__(reason)
        self.fields = fields


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AnalysisSettings(_Section):
    """Detection and confirmation thresholds (docs/artemis.conf.5.md, "Analysis").

    A rank is *flagged* in a window when its busy time exceeds the median busy of
    its island peers by at least ``min_slowdown`` (relative) **and** by at least
    ``robust_z`` robust standard deviations (1.4826 x MAD of the peers).  A flag
    becomes an incident after ``confirm_windows`` consecutive flagged windows
    under matched conditions, lasting ``confirm_seconds``; a job-wide slowdown
    no signal explains must last ``job_confirm_seconds``.
    """

    window_steps: int = Field(default=50, ge=1, le=100_000)
    min_slowdown: float = Field(default=0.04, gt=0.0, lt=10.0)
    robust_z: float = Field(default=4.0, gt=0.0, le=100.0)
    confirm_windows: int = Field(default=2, ge=1, le=1000)
    confirm_seconds: Seconds = Field(default=2.0, le=86_400)
    job_confirm_seconds: Seconds = Field(default=60.0, le=86_400)
    history_windows: int = Field(default=20, ge=2, le=100_000)
    job_slowdown: float = Field(default=0.05, gt=0.0, lt=10.0)
    confidence_floor: float = Field(default=0.5, ge=0.0, le=1.0)
    recover_windows: int = Field(default=3, ge=1, le=1000)
    recur_windows: int = Field(default=30, ge=0, le=100_000)


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)?\s*$", re.IGNORECASE)
_DURATION_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(value: Any) -> float:
    """``90``, ``90s``, ``15m``, ``2h``, ``1d`` -> seconds."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    match = _DURATION.match(str(value))
    if not match:
        raise ValueError(f"expected a duration such as 90, 90s, 15m or 2h, got {value!r}")
    return float(match.group(1)) * _DURATION_UNIT[(match.group(2) or "s").lower()]


_SIZE = re.compile(r"^\s*(\d+)\s*(?:([kmg])(?:i?b)?|b)?\s*$", re.IGNORECASE)
_SIZE_UNIT = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_size(value: Any) -> int:
    """``65536``, ``64K``, ``16M``, ``16MiB``, ``1G`` -> bytes (units are powers of 1024)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = _SIZE.match(str(value))
    if not match:
        raise ValueError(f"expected a size such as 65536, 64K, 16M or 1G, got {value!r}")
    return int(match.group(1)) * _SIZE_UNIT.get((match.group(2) or "").lower(), 1)


def _split_list(value: Any) -> Any:
    if isinstance(value, str):
        return tuple(item.strip() for item in value.split(",") if item.strip())
    return value


def _host_port(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    return value


Seconds = Annotated[float, BeforeValidator(parse_duration), Field(ge=0)]
Bytes = Annotated[int, BeforeValidator(parse_size)]
HostPort = Annotated[str, BeforeValidator(_host_port)]
NameList = Annotated[tuple[str, ...], BeforeValidator(_split_list)]
UidList = Annotated[tuple[Annotated[int, Field(ge=0)], ...], BeforeValidator(_split_list)]

# The rungs a site policy names (``Auto=``, ``Approve=``): from the action table.
POLICY_ACTIONS = actions.RUNGS
PolicyAction = Literal[POLICY_ACTIONS]  # type: ignore[valid-type]
ActionList = Annotated[tuple[PolicyAction, ...], BeforeValidator(_split_list)]


class DaemonSettings(_Section):
    """How artemisd runs: where it listens and keeps state, whom it trusts.

    ``Enabled=no`` is the global kill switch: incidents are still detected,
    recorded and escalated by email, but nothing is changed in Slurm or in a
    job.  ``DryRun=yes`` goes one step further: the daemon decides and records
    every action it *would* take (status ``proposed``, audit ``dry-run``) and
    sends nothing anywhere.
    """

    listen: HostPort = "127.0.0.1:7600"
    state_dir: str = "/var/lib/artemis"
    state_url: str | None = None
    state_password_file: str | None = None
    lease_time: Seconds = Field(default=15.0, ge=1.0, le=3600.0)
    slurm_backend: Literal["cli", "pyslurm"] = "cli"
    slurm_timeout: Seconds = 30.0
    slurm_read_workers: int = Field(default=4, ge=1, le=64)
    auth_type: Literal["munge", "none"] = "munge"
    read_auth: Literal["open", "required"] = "open"
    munge_socket: str | None = None
    slurm_user: str = "slurm"
    admin_uids: UidList = ()
    dry_run: bool = False
    enabled: bool = True
    hard_action_evidence: Literal["root", "root_or_probe"] = "root"
    evidence_max_age: Seconds = 900.0
    probe_min_interval: Seconds = 300.0
    probe_max_per_hour: int = Field(default=4, ge=0, le=3600)
    probe_timeout: Seconds = 120.0
    history_windows_kept: int = Field(default=200, ge=10, le=100_000)
    ended_job_history: Seconds = Field(default=7 * 86_400.0, ge=600.0, le=366 * 86_400.0)
    verify_windows: int = Field(default=3, ge=1, le=1000)
    verify_warmup_windows: int = Field(default=3, ge=0, le=1000)
    verify_seconds: Seconds = Field(default=5.0, le=86_400)
    unknown_escalate_after: Seconds = 600.0
    unknown_escalate_loss: float = Field(default=20.0, ge=0.0, le=100.0)
    escalate_loss: float = Field(default=2.0, ge=0.0, le=100.0)
    recur_escalate: int = Field(default=3, ge=0, le=1000)
    recovery_fraction: float = Field(default=0.95, gt=0.0, le=2.0)
    retry_backoff: Seconds = 5.0
    retry_backoff_max: Seconds = 600.0
    job_cache_seconds: Seconds = 30.0
    max_world: int = Field(default=DEFAULT_MAX_WORLD, ge=1, le=10_000_000)
    # The front door (artemisd/transport.py; TRUST in artemis.conf(5)).
    max_body_size: Bytes = Field(default=16 << 20, ge=64 << 10, le=1 << 30)
    max_body_memory: Bytes = Field(default=64 << 20, ge=64 << 10, le=16 << 30)
    read_timeout: Seconds = Field(default=30.0, gt=0, le=3600)
    idle_timeout: Seconds = Field(default=15.0, gt=0, le=3600)
    max_connections: int = Field(default=4096, ge=8, le=1_000_000)
    # None: derived from MaxBodyMemory (body_memory_per_user).
    max_body_memory_per_user: Bytes | None = Field(default=None, ge=64 << 10, le=16 << 30)
    # 64 KiB/s is over a thousand times below what any cluster network carries per
    # connection, even with thousands of ranks posting through one NIC at once; 5 s
    # is several TCP retransmissions and a descheduled sender on a loaded node.
    min_body_rate: Bytes = Field(default=64 << 10, ge=0, le=1 << 30)
    body_grace: Seconds = Field(default=5.0, gt=0, le=3600)

    @property
    def body_memory_per_user(self) -> int:
        """MaxBodyMemoryPerUser, or by default a quarter of MaxBodyMemory: no one user can fill it,
        and one largest body always fits."""
        if self.max_body_memory_per_user is not None:
            return self.max_body_memory_per_user
        return max(self.max_body_size, self.max_body_memory // 4)

    @model_validator(mode="after")
    def _body_fits_memory(self) -> DaemonSettings:
        if self.max_body_memory < self.max_body_size:
            raise CrossKeyError(f"MaxBodyMemory ({self.max_body_memory} bytes) must be at least "
                                f"MaxBodySize ({self.max_body_size} bytes): one largest body must fit",
                                "max_body_memory", "max_body_size")
        per_user = self.max_body_memory_per_user
        if per_user is not None and not self.max_body_size <= per_user <= self.max_body_memory:
            raise CrossKeyError(f"MaxBodyMemoryPerUser ({per_user} bytes) must be at least MaxBodySize "
                                f"({self.max_body_size} bytes), so one largest body fits, and at most "
                                f"MaxBodyMemory ({self.max_body_memory} bytes)", "max_body_memory_per_user")
        return self

    @model_validator(mode="after")
    def _body_rate(self) -> DaemonSettings:
        if 0 < self.min_body_rate < 1024:
            raise CrossKeyError(f"MinBodyRate ({self.min_body_rate} bytes/s) must be 0 (off: ReadTimeout alone) "
                                "or at least 1K", "min_body_rate")
        # Only when set: the default grace is simply capped by a shorter ReadTimeout.
        if "body_grace" in self.model_fields_set and self.body_grace > self.read_timeout:
            raise CrossKeyError(f"BodyGrace ({self.body_grace:g} s) must not exceed ReadTimeout "
                                f"({self.read_timeout:g} s), which caps every body", "body_grace", "read_timeout")
        return self

    @model_validator(mode="after")
    def _state_url(self) -> DaemonSettings:
        if self.state_url is None:
            if self.state_password_file is not None:
                raise CrossKeyError("StatePasswordFile is the password of StateURL, which is not set",
                                    "state_password_file")
            return self
        url = urlsplit(self.state_url)
        if url.scheme not in ("postgresql", "postgres") or not url.path.strip("/"):
            raise CrossKeyError("StateURL must be postgresql://[USER@]HOST[:PORT]/DATABASE[?OPTIONS]", "state_url")
        # artemis.conf is world-readable, and a URL ends up in logs and process lists.
        if url.password is not None or "password" in {k.lower() for k in parse_qs(url.query)}:
            raise CrossKeyError("StateURL must not hold the password: put it in StatePasswordFile (mode 600)",
                                "state_url")
        return self

    @model_validator(mode="after")
    def _loopback_for_none(self) -> DaemonSettings:
        # Every caller is trusted as root: only this host may call.  An address, not a
        # name: "localhost" or "127.example.org" resolve to whatever the resolver says.
        if self.auth_type == "none" and not _is_loopback_address(self.listen.rpartition(":")[0].strip("[]")):
            raise CrossKeyError(f"AuthType=none is only allowed with a loopback IP address in Listen "
                                f"(127.0.0.0/8 or [::1]), not {self.listen!r}", "auth_type", "listen")
        return self


def _is_loopback_address(host: str) -> bool:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    # Not IPv6Address.is_loopback: from Python 3.13 it also takes ::ffff:127.0.0.1.
    return address in _LOOPBACK_V4 if address.version == 4 else address == _LOOPBACK_V6


_LOOPBACK_V4 = ipaddress.ip_network("127.0.0.0/8")
_LOOPBACK_V6 = ipaddress.ip_address("::1")


class MailSettings(_Section):
    """Escalation email through an SMTP relay; no relay = no email (escalation still recorded)."""

    mail_relay: HostPort | None = None
    mail_from: str = "artemis@localhost"
    mail_to: NameList = ()
    mail_timeout: Seconds = 10.0
    mail_subject_prefix: str = "[artemis]"


DEFAULT_APPROVE = ("correct", "drain", "requeue", "constrain")


class PartitionPolicy(_Section):
    """One ``PartitionPolicy=`` line: what Artemis may do to jobs and nodes of matching partitions.

    ``name`` is a shell-style pattern (``gpu*``) or ``DEFAULT``; the first line
    whose pattern matches the job's partition wins, ``DEFAULT`` matches all.
    ``auto`` actions run without a person; ``approve`` actions wait for
    ``artemis approve``; any other action is only recommended (escalated).
    ``max_drain_fraction`` caps the share of the partition's nodes drained by
    Artemis at any time, ``max_drains_per_hour`` the drains in any sliding
    hour; ``cooldown`` is the minimum time between two actions on one node or job.
    ``constraint`` is a feature expression ANDed into the Features of a job
    Artemis requeued (e.g. a feature the site's node check sets on healthy nodes).
    """

    name: str = Field(min_length=1)
    auto: ActionList = ("rebalance", "escalate")
    approve: ActionList = DEFAULT_APPROVE
    max_drain_fraction: float = Field(default=0.1, ge=0.0, le=1.0)
    max_drains_per_hour: int = Field(default=2, ge=0, le=10_000)
    cooldown: Seconds = 900.0
    checkpoint_interval: Seconds = 1800.0
    restart_cost: Seconds = 300.0
    transient_fault_time: Seconds = 600.0
    unlimited_job_horizon: Seconds = Field(default=86_400.0, gt=0, le=366 * 86_400.0)
    probe: bool = True
    constraint: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _default_approve(cls, raw: Any) -> Any:
        # Without an Approve=, the default approval list yields to what Auto= grants.
        if isinstance(raw, dict) and "approve" not in raw and "auto" in raw:
            auto = set(_split_list(raw["auto"]))
            return {**raw, "approve": tuple(a for a in DEFAULT_APPROVE if a not in auto)}
        return raw

    @model_validator(mode="after")
    def _disjoint(self) -> PartitionPolicy:
        both = set(self.auto) & set(self.approve)
        if both:
            raise CrossKeyError(f"{', '.join(sorted(both))} listed in both Auto and Approve", "approve", "auto")
        return self


DEFAULT_POLICY = PartitionPolicy(name="DEFAULT")


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    analysis: AnalysisSettings = AnalysisSettings()
    daemon: DaemonSettings = DaemonSettings()
    mail: MailSettings = MailSettings()
    # PartitionPolicy lines in file order; the first match wins (policy_for).
    policies: tuple[PartitionPolicy, ...] = ()
    # Where each setting came from, for errors raised after parsing.
    sources: dict[str, Setting] = Field(default_factory=dict, exclude=True)


    def policy_for(self, partition: str | None) -> PartitionPolicy:
        """The first PartitionPolicy whose pattern matches ``partition`` (DEFAULT matches all)."""
        for policy in self.policies:
            if policy.name.upper() == "DEFAULT" or (
                    partition is not None and fnmatch.fnmatchcase(partition, policy.name)):
                return policy
        return DEFAULT_POLICY


@dataclass(frozen=True)
class KeySpec:
    section: str
    field: str
    doc: str


# Key (as written in artemis.conf, CamelCase) -> where it goes.
KEYS: dict[str, KeySpec] = {
    "WindowSteps": KeySpec("analysis", "window_steps", "steps per window the probe aggregates"),
    "MinSlowdown": KeySpec("analysis", "min_slowdown", "relative busy excess over island median to flag"),
    "RobustZ": KeySpec("analysis", "robust_z", "robust z-score (MAD units) needed to flag"),
    "ConfirmWindows": KeySpec("analysis", "confirm_windows", "consecutive flagged windows to confirm"),
    "ConfirmSeconds": KeySpec("analysis", "confirm_seconds", "wall time a subject must stay flagged to confirm"),
    "JobConfirmSeconds": KeySpec("analysis", "job_confirm_seconds",
                                 "wall time a job-wide slowdown no signal explains must last to confirm"),
    "HistoryWindows": KeySpec("analysis", "history_windows", "healthy windows kept per baseline"),
    "JobSlowdown": KeySpec("analysis", "job_slowdown", "job-wide step-time rise vs baseline to flag"),
    "ConfidenceFloor": KeySpec("analysis", "confidence_floor", "below this confidence a cause is 'unknown'"),
    "RecoverWindows": KeySpec("analysis", "recover_windows", "healthy windows that end an incident"),
    "RecurWindows": KeySpec("analysis", "recur_windows",
                            "a subject confirmed again within this many windows is a recurrence of its incident"),
    "Listen": KeySpec("daemon", "listen", "HOST:PORT the HTTP API listens on"),
    "StateDir": KeySpec("daemon", "state_dir", "directory of the SQLite state database"),
    "StateURL": KeySpec("daemon", "state_url",
                        "postgresql://[USER@]HOST[:PORT]/DATABASE: keep the state in PostgreSQL, not under StateDir"),
    "StatePasswordFile": KeySpec("daemon", "state_password_file",
                                 "file holding StateURL's password, readable by the daemon's user only"),
    "LeaseTime": KeySpec("daemon", "lease_time",
                         "how long the leader's lease lasts unrenewed: a standby takes over within this plus a turn"),
    "SlurmBackend": KeySpec("daemon", "slurm_backend", "cli (scontrol/sinfo/squeue/sacct) or pyslurm"),
    "SlurmTimeout": KeySpec("daemon", "slurm_timeout", "timeout of one Slurm command"),
    "SlurmReadWorkers": KeySpec("daemon", "slurm_read_workers",
                                "Slurm reads at once for the jobs users' reports name (squeue/sacct); restart to change"),
    "ReadAuth": KeySpec("daemon", "read_auth",
                        "open: anyone reads incidents; required: a munge credential, and users read their own jobs'"),
    "AuthType": KeySpec("daemon", "auth_type", "munge, or none (loopback Listen only)"),
    "MungeSocket": KeySpec("daemon", "munge_socket", "munged socket (default: munge's own)"),
    "SlurmUser": KeySpec("daemon", "slurm_user", "user whose credentials count as root-side"),
    "AdminUids": KeySpec("daemon", "admin_uids", "uids besides root and SlurmUser allowed to approve/deny"),
    "DryRun": KeySpec("daemon", "dry_run", "decide and record actions, perform none"),
    "Enabled": KeySpec("daemon", "enabled", "global kill switch for actions"),
    "HardActionEvidence": KeySpec("daemon", "hard_action_evidence", "corroboration a drain/requeue needs"),
    "EvidenceMaxAge": KeySpec("daemon", "evidence_max_age", "how long root-side node evidence stays valid"),
    "ProbeMinInterval": KeySpec("daemon", "probe_min_interval", "minimum time between probes of one job"),
    "ProbeMaxPerHour": KeySpec("daemon", "probe_max_per_hour", "probes per job in any sliding hour"),
    "ProbeTimeout": KeySpec("daemon", "probe_timeout", "how long a probe directive is offered"),
    "HistoryWindowsKept": KeySpec("daemon", "history_windows_kept", "windows per job kept in the state database"),
    "VerifyWindows": KeySpec("daemon", "verify_windows", "windows measured after an action to verify it"),
    "UnknownEscalateAfter": KeySpec("daemon", "unknown_escalate_after",
                                    "an unknown cause with no deviating signal waits this long before a person is told"),
    "EscalateLoss": KeySpec("daemon", "escalate_loss",
                            "the least loss (% of the job's throughput) a person is paged for, any cause"),
    "UnknownEscalateLoss": KeySpec("daemon", "unknown_escalate_loss",
                                   "... and must cost at least this % of the job's healthy samples/s"),
    "RecurEscalate": KeySpec("daemon", "recur_escalate",
                             "recurrences after which a device that keeps coming back goes to a person (0: never)"),
    "EndedJobHistory": KeySpec("daemon", "ended_job_history",
                               "how long an ended job's window history stays while one of its incidents is "
                               "open (a person may look at it); then it goes, the incidents stay"),
    "VerifyWarmupWindows": KeySpec("daemon", "verify_warmup_windows",
                                   "first windows of a requeued job left out of verification (warm-up)"),
    "VerifySeconds": KeySpec("daemon", "verify_seconds", "wall time the windows that verify an action must last"),
    "RecoveryFraction": KeySpec("daemon", "recovery_fraction", "share of baseline throughput that counts as recovered"),
    "RetryBackoff": KeySpec("daemon", "retry_backoff", "first retry delay of a failed Slurm/SMTP call"),
    "RetryBackoffMax": KeySpec("daemon", "retry_backoff_max", "longest retry delay"),
    "JobCacheSeconds": KeySpec("daemon", "job_cache_seconds", "how long a job's owner/partition is cached"),
    "MaxWorld": KeySpec("daemon", "max_world", "largest world size (ranks per job) a report may claim"),
    "MaxBodySize": KeySpec("daemon", "max_body_size", "largest request body accepted (413 beyond)"),
    "MaxBodyMemory": KeySpec("daemon", "max_body_memory", "request bodies buffered at once, all clients (503 beyond)"),
    "ReadTimeout": KeySpec("daemon", "read_timeout", "time a client has to send a request body (408 after)"),
    "IdleTimeout": KeySpec("daemon", "idle_timeout", "a connection without a complete request head for this long is closed"),
    "MaxConnections": KeySpec("daemon", "max_connections",
                              "open client connections; idle ones are closed, then a slow upload of the user "
                              "over its share, then 503"),
    "MaxBodyMemoryPerUser": KeySpec("daemon", "max_body_memory_per_user",
                                    "request bodies of one user buffered at once (503 beyond; default: a quarter "
                                    "of MaxBodyMemory, at least MaxBodySize)"),
    "MinBodyRate": KeySpec("daemon", "min_body_rate",
                           "after BodyGrace a body must keep arriving at this many bytes/s (408 otherwise; 0: off)"),
    "BodyGrace": KeySpec("daemon", "body_grace", "time a body has before MinBodyRate applies (ReadTimeout caps it)"),
    "MailRelay": KeySpec("mail", "mail_relay", "SMTP relay HOST:PORT for escalations"),
    "MailFrom": KeySpec("mail", "mail_from", "sender address"),
    "MailTo": KeySpec("mail", "mail_to", "comma-separated recipients"),
    "MailTimeout": KeySpec("mail", "mail_timeout", "SMTP connection timeout"),
    "MailSubjectPrefix": KeySpec("mail", "mail_subject_prefix", "prefix of every subject line"),
}
_KEY_BY_LOWER = {k.lower(): k for k in KEYS}
_KEY_BY_FIELD = {(spec.section, spec.field): k for k, spec in KEYS.items()}

SECTIONS: dict[str, type[_Section]] = {
    "analysis": AnalysisSettings,
    "daemon": DaemonSettings,
    "mail": MailSettings,
}


@dataclass(frozen=True)
class BlockSpec:
    """A line opened by ``Key=Name`` whose other pairs configure that one record.

    ``keys`` maps the block's own keys to model fields; the opening key sets
    ``name``.  Blocks go, in file order, to the ``Config`` field ``target``.
    """

    model: type[_Section]
    target: str
    keys: dict[str, KeySpec]


BLOCK_KEYS: dict[str, BlockSpec] = {
    "PartitionPolicy": BlockSpec(PartitionPolicy, "policies", {
        "Auto": KeySpec("policy", "auto", "actions taken without a person"),
        "Approve": KeySpec("policy", "approve", "actions that wait for artemis approve"),
        "MaxDrainFraction": KeySpec("policy", "max_drain_fraction", "cap on the share of the partition drained"),
        "MaxDrainsPerHour": KeySpec("policy", "max_drains_per_hour", "drains in any sliding hour"),
        "Cooldown": KeySpec("policy", "cooldown", "minimum time between actions on one node or job"),
        "CheckpointInterval": KeySpec("policy", "checkpoint_interval",
                                      "how often jobs checkpoint: a requeue loses half of it on every GPU"),
        "RestartCost": KeySpec("policy", "restart_cost", "time a requeued job needs to be training again"),
        "TransientFaultTime": KeySpec("policy", "transient_fault_time",
                                      "how long a slowdown that is not hardware is expected to last"),
        "UnlimitedJobHorizon": KeySpec("policy", "unlimited_job_horizon",
                                       "how long a job without a time limit is priced as running on"),
        "Probe": KeySpec("policy", "probe", "allow active matched probes in these jobs"),
        "Constraint": KeySpec("policy", "constraint", "feature expression added to a requeued job's Features"),
    }),
}
_BLOCK_BY_LOWER = {k.lower(): k for k in BLOCK_KEYS}


def _build_block(opening: str, settings: list[Setting]) -> _Section:
    spec = BLOCK_KEYS[opening]
    by_lower = {k.lower(): k for k in spec.keys}
    values: dict[str, Any] = {"name": settings[0].value}
    sources: dict[str, Setting] = {"name": settings[0]}
    for setting in settings[1:]:
        canonical = by_lower.get(setting.key.lower())
        if canonical is None:
            raise ConfigError(setting.file, setting.line, setting.key, f"unknown key in a {opening} line")
        values[spec.keys[canonical].field] = setting.value
        sources[spec.keys[canonical].field] = setting
    try:
        return spec.model(**values)
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        src = next((sources[f] for f in _blamed_fields(first) if f in sources), settings[0])
        raise ConfigError(src.file, src.line, src.key, f"bad value {_shown(src.value)!r}: {first['msg']}") from None


def _blamed_fields(error: Any) -> tuple[str, ...]:
    """The fields a pydantic error is about: its location, or a ``CrossKeyError``'s own list."""
    if error["loc"]:
        return (str(error["loc"][0]),)
    cause = error.get("ctx", {}).get("error")
    return cause.fields if isinstance(cause, CrossKeyError) else ()


def _section_values(
    lines: list[ConfLine],
) -> tuple[dict[str, dict[str, Any]], dict[str, Setting], dict[str, list[_Section]]]:
    values: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    sources: dict[str, Setting] = {}
    blocks: dict[str, list[_Section]] = {spec.target: [] for spec in BLOCK_KEYS.values()}
    for line in lines:
        opening = _BLOCK_BY_LOWER.get(line.settings[0].key.lower()) if line.settings else None
        if opening is not None:
            blocks[BLOCK_KEYS[opening].target].append(_build_block(opening, line.settings))
            continue
        for setting in line.settings:
            canonical = _KEY_BY_LOWER.get(setting.key.lower())
            if canonical is None:
                raise ConfigError(setting.file, setting.line, setting.key, "unknown key")
            spec = KEYS[canonical]
            values[spec.section][spec.field] = setting.value
            sources[f"{spec.section}.{spec.field}"] = setting
    return values, sources, blocks


_URL_PASSWORD = re.compile(r"(?P<head>[a-z][a-z0-9+.-]*://[^/@:\s]*:)[^/@\s]*@", re.IGNORECASE)
_QUERY_PASSWORD = re.compile(r"(?P<head>[?&]password=)[^&\s]*", re.IGNORECASE)


def _shown(value: str) -> str:
    """A value as an error message may show it: a password in a URL is not echoed to logs and terminals."""
    value = _URL_PASSWORD.sub(lambda m: f"{m['head']}***@", value)
    return _QUERY_PASSWORD.sub(lambda m: f"{m['head']}***", value)


def build_config(lines: list[ConfLine], origin: str = "<defaults>") -> Config:
    values, sources, blocks = _section_values(lines)
    sections: dict[str, _Section] = {}
    for name, model in SECTIONS.items():
        try:
            sections[name] = model(**values[name])
        except ValidationError as err:
            first = err.errors(include_url=False)[0]
            fields = _blamed_fields(first)
            # The first blamed key the file sets; where it sets none (a default is at
            # fault, e.g. MaxBodySize over the default MaxBodyMemory), the key itself.
            src = next((sources[f"{name}.{f}"] for f in fields if f"{name}.{f}" in sources), None)
            key = src.key if src else (_KEY_BY_FIELD.get((name, fields[0]), fields[0]) if fields else None)
            reason = f"bad value {_shown(src.value)!r}: {first['msg']}" if src else first["msg"]
            raise ConfigError(src.file if src else origin, src.line if src else None, key, reason) from None
    return Config(**sections, **{k: tuple(v) for k, v in blocks.items()}, sources=sources)


def load_config(path: str | Path | None, overrides: Sequence[tuple[str, str]] = (), *,
                secure: bool = False) -> Config:
    """Read artemis.conf; ``None`` gives the embedded defaults.  ``overrides``: ``(key, value)`` pairs
    given on the command line, applied after the file's own (they win); an error in one names the
    command line instead of a file.  ``secure``: the daemon's reading, which refuses a file (or an
    included one) that others than root or this user could have written (``check_config_file_secure``)."""
    if path is None and not overrides:
        return Config()
    lines = [] if path is None else read_lines(path, secure=secure)
    if overrides:
        lines.append(ConfLine([Setting(key, value, COMMAND_LINE, 0) for key, value in overrides]))
    return build_config(lines, "<defaults>" if path is None else str(path))


def parse_config_text(text: str, name: str = "<text>") -> Config:
    """Parse config text (tests, embedded examples) exactly as a file."""
    lines = [ConfLine(split_pairs(raw.strip(), name, n))
             for n, raw in enumerate(text.splitlines(), start=1)
             if raw.strip() and not raw.strip().startswith("#")]
    return build_config(lines, name)

