"""Prolog and Epilog: one ``job_start`` / ``job_end`` node event per node of an opted-in job.

Only jobs submitted with ``--artemis=on`` (the SPANK plugin sets
``SPANK_ARTEMIS=on`` for them) are reported; others cost one environment
lookup.  Exit status is always 0: a failing Prolog drains the node and requeues
the job held, which no monitoring tool may ever cause.
"""

from __future__ import annotations

import os

from artemis_node import (SlurmJobEnv, arm_hard_timeout, guarded, load_config, log,
                          node_event, open_gpus, send_records)


def run(program: str, event: str, env: dict[str, str] | None = None) -> int:
    env = dict(os.environ) if env is None else env
    job = SlurmJobEnv.from_env(env)
    if not job.opted_in:
        return 0

    def body() -> None:
        cfg = load_config(env)
        arm_hard_timeout(program, cfg.timeout_s)
        if not cfg.endpoint:
            log(program, f"job {job.job}: no Endpoint in {cfg.source}; nothing sent")
            return
        backend = open_gpus(cfg, job.node or "")
        try:
            record = node_event(event, job.node or "", job.job, backend)
        finally:
            if backend is not None:
                backend.close()
        send_records(cfg, [record])

    return guarded(program, body)
