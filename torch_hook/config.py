"""Probe settings, read from the environment the SPANK plugin exports."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass


class ConfigError(ValueError):
    """A bad ARTEMIS_* variable; the message names the variable and value."""


def _number(env: dict[str, str], name: str, default: float, low: float, kind: type = float) -> float:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r}: expected {'an integer' if kind is int else 'a number'}") from None
    if value < low:
        raise ConfigError(f"{name}={raw!r}: must be at least {low}")
    return value


def _optional_int(env: dict[str, str], name: str) -> int | None:
    """A launcher's variable: None where it is unset or not a plain number (never an error: the
    probe only uses it to find its node's relay)."""
    raw = (env.get(name) or "").strip()
    return int(raw) if raw.isdigit() else None


def _flag(env: dict[str, str], name: str) -> bool:
    raw = (env.get(name) or "1").strip().lower()
    if raw not in ("0", "1", "yes", "no", "true", "false", "on", "off"):
        raise ConfigError(f"{name}={raw!r}: expected 1 or 0")
    return raw in ("1", "yes", "true", "on")


@dataclass(frozen=True)
class ProbeConfig:
    """Everything the probe needs besides rank/world (which come from torch.distributed).

    ``endpoint``: ``http://host:port`` of artemisd, ``file:/path.jsonl`` to
    record a trace, or None (measure, send nowhere).  ``window_steps`` is W:
    window k covers steps [kW, (k+1)W).  ``window_seconds`` bounds a window's
    wall time: once a window took longer, ranks agree on shorter windows.
    ``completion_hooks``: on NCCL groups, time collectives with the process
    group's completion hooks (``ARTEMIS_COMPLETION_HOOKS``, default 1).
    """

    endpoint: str | None
    job: str
    job_step: str
    node: str
    window_steps: int = 50
    window_seconds: float = 60.0
    queue_size: int = 64
    http_timeout_s: float = 2.0
    munge_socket: str | None = None
    boundary_sync: bool = True
    completion_hooks: bool = True
    relay: bool = True
    local_rank: int | None = None
    local_world: int | None = None

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> ProbeConfig:
        env = dict(os.environ if env is None else env)
        endpoint = (env.get("ARTEMIS_ENDPOINT") or "").strip() or None
        if endpoint and not endpoint.startswith("file:"):
            # A list (http://a:7600,http://b:7600): several artemisd, one leading.
            urls = [u.strip() for u in endpoint.split(",")]
            if not all(u.startswith(("http://", "https://")) for u in urls):
                raise ConfigError(f"ARTEMIS_ENDPOINT={endpoint!r}: expected http://host:port (or a comma-separated "
                                  f"list of them) or file:/path")
            endpoint = ",".join(urls)
        sync = _flag(env, "ARTEMIS_BOUNDARY_SYNC")
        relay = _flag(env, "ARTEMIS_RELAY")
        hooks = _flag(env, "ARTEMIS_COMPLETION_HOOKS")
        return cls(
            endpoint=endpoint,
            job=env.get("ARTEMIS_JOB_ID") or env.get("SLURM_JOB_ID") or "local",
            job_step=env.get("ARTEMIS_STEP_ID") or env.get("SLURM_STEP_ID") or "0",
            node=env.get("ARTEMIS_NODE") or env.get("SLURMD_NODENAME") or socket.gethostname(),
            window_steps=int(_number(env, "ARTEMIS_WINDOW_STEPS", 50, 1, int)),
            window_seconds=_number(env, "ARTEMIS_WINDOW_SECONDS", 60.0, 0.001),
            queue_size=int(_number(env, "ARTEMIS_QUEUE", 64, 1, int)),
            http_timeout_s=_number(env, "ARTEMIS_HTTP_TIMEOUT", 2.0, 0.01),
            munge_socket=env.get("ARTEMIS_MUNGE_SOCKET") or None,
            boundary_sync=sync,
            completion_hooks=hooks,
            relay=relay,
            # torchrun's, else Slurm's (one srun task per rank); a launcher that sets neither: no relay.
            local_rank=_optional_int(env, "LOCAL_RANK") if env.get("LOCAL_RANK") else _optional_int(env, "SLURM_LOCALID"),
            local_world=(_optional_int(env, "LOCAL_WORLD_SIZE") if env.get("LOCAL_WORLD_SIZE")
                         else _optional_int(env, "SLURM_NTASKS_PER_NODE")),
        )
