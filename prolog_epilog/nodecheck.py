"""One pass of the node check (``artemis-nodecheck``; slurmd HealthCheckProgram).

1. Apply the corrections artemisd queued for this node, as root, and report
   each outcome (``POST /v1/nodes/{node}/corrections/{id}``).
2. Send a ``health`` node event: fingerprint, GPU and host snapshot — taken
   after the corrections, so the daemon sees their effect.  This is the
   root-side evidence the daemon wants before a hard action.  It carries the
   node's fabric evidence too (``fabric.py``: link state, rate and error
   counters per second since the previous pass, PCIe training, from sysfs).
3. When the fingerprint differs from the last pass (driver, comm library,
   kernel or firmware changed), run the matched node probe and send it as a
   ``probe`` node event, so a change regression is measured, not guessed.

It judges nothing and never drains: that is the daemon's call, within policy.
Exit status is always 0 (slurmd would otherwise log a failing health check on
every interval for a monitoring problem).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any

import corrections
import fabric
from artemis_node import (DaemonError, NodeConfig, arm_hard_timeout, guarded, load_config, log,
                          node_event, open_gpus, request, send_records)

PROGRAM = "artemis-nodecheck"
HERE = Path(__file__).resolve().parent


def apply_corrections(cfg: NodeConfig, node: str) -> list[dict[str, Any]]:
    """Fetch, apply and acknowledge queued corrections; returns what was reported."""
    quoted = urllib.parse.quote(node, safe="")
    queued = (request(cfg, "GET", f"/v1/nodes/{quoted}/corrections") or {}).get("corrections") or []
    if not queued:
        return []
    outcomes = []
    corrector = None
    try:
        corrector = corrections.open_corrector(cfg.telemetry, cfg.emulated_gpu_dir, node)
    except corrections.CorrectionError as err:
        opened_error = str(err)
    for item in queued:
        if corrector is None:
            status, detail = "failed", opened_error
        else:
            try:
                status, detail = "done", corrections.apply(corrector, item)
            except corrections.CorrectionError as err:
                status, detail = "failed", str(err)
        log(PROGRAM, f"correction {item.get('id')} ({item.get('kind')}): {status}: {detail}")
        outcome = {"status": status, "detail": detail}
        request(cfg, "POST", f"/v1/nodes/{quoted}/corrections/"
                f"{urllib.parse.quote(str(item.get('id')), safe='')}", outcome)
        outcomes.append({"id": item.get("id"), **outcome})
    if corrector is not None:
        corrector.close()
    return outcomes


def fingerprint_changed(cfg: NodeConfig, node: str, current: dict[str, Any],
                        remember: bool = True) -> bool:
    """Compare with (and remember) the last pass's fingerprint; the first pass counts as changed."""
    state = Path(cfg.state_dir) / f"fingerprint.{node}.json"
    try:
        previous = json.loads(state.read_text())
    except (OSError, ValueError):
        previous = None
    if previous != current and remember:
        state.parent.mkdir(parents=True, exist_ok=True)
        state.write_text(json.dumps(current, sort_keys=True))
    return previous != current


def node_probe(budget_s: float) -> dict[str, Any] | None:
    """Run node_probe.py in a child (torch may be missing or slow to import)."""
    try:
        done = subprocess.run([sys.executable, str(HERE / "node_probe.py")], capture_output=True,
                              text=True, timeout=budget_s, check=False)
    except subprocess.TimeoutExpired:
        log(PROGRAM, f"node probe did not finish within {budget_s:.0f} s; skipped")
        return None
    if done.returncode != 0:
        log(PROGRAM, f"node probe skipped: {done.stderr.strip()[-300:]}")
        return None
    return json.loads(done.stdout)


def fabric_block(cfg: NodeConfig, node: str, root: Path = Path("/"),
                 remember: bool = True) -> dict[str, Any] | None:
    """The health event's ``fabric`` block: this pass's readings, rated against the last pass's
    (kept in ``StateDir``; a dry run reads it and keeps nothing)."""
    now = time.time()
    taken = fabric.snapshot(root)
    kept = fabric.previous(cfg.state_dir, node)
    if remember:
        try:
            fabric.remember(cfg.state_dir, node, taken, now)
        except OSError as err:  # the next pass has no rates; this one's readings still count
            log(PROGRAM, f"fabric readings not kept in {cfg.state_dir}: {err}")
    if kept is None:
        return fabric.block(None, taken, None)
    return fabric.block(kept[1], taken, now - kept[0])


def check(cfg: NodeConfig, node: str, dry_run: bool = False,
          sysfs_root: Path = Path("/")) -> list[dict[str, Any]]:
    """One pass; returns the node events (sent unless ``dry_run``).

    ``sysfs_root``: where ``sys/`` is read for the fabric evidence (a fake tree in tests)."""
    started = time.monotonic()
    if not dry_run and cfg.http_base:
        try:
            apply_corrections(cfg, node)
        except DaemonError as err:
            log(PROGRAM, f"corrections not fetched: {err}")
    backend = open_gpus(cfg, node)
    try:
        health = node_event("health", node, None, backend)
    finally:
        if backend is not None:
            backend.close()
    try:
        links = fabric_block(cfg, node, sysfs_root, remember=not dry_run)
    except Exception as err:  # noqa: BLE001 -- fabric evidence is never worth a failed check
        log(PROGRAM, f"fabric evidence skipped: {type(err).__name__}: {err}")
        links = None
    if links:
        health["fabric"] = links
    records = [health]
    if cfg.node_probe and fingerprint_changed(cfg, node, health["fingerprint"],
                                                remember=not dry_run):
        budget = cfg.timeout_s - (time.monotonic() - started) - 1.0
        probe = node_probe(budget) if budget > 1.0 else None
        if probe:
            records.append({"type": "node", "v": 1, "event": "probe", "node": node,
                            "time": time.time(), "fingerprint": health["fingerprint"],
                            "probe": probe})
    if dry_run:
        for record in records:
            print(json.dumps(record))
    elif cfg.endpoint:
        send_records(cfg, records)
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROGRAM, description=__doc__.split("\n")[0])
    parser.add_argument("--node", help="Slurm node name (default: $SLURMD_NODENAME, else hostname)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the node events; send nothing, apply nothing")
    args = parser.parse_args(argv)
    node = args.node or os.environ.get("SLURMD_NODENAME") or os.uname().nodename.split(".")[0]

    def body() -> None:
        cfg = load_config()
        arm_hard_timeout(PROGRAM, cfg.timeout_s)
        if not cfg.endpoint and not args.dry_run:
            log(PROGRAM, f"no Endpoint in {cfg.source}; nothing to do")
            return
        check(cfg, node, dry_run=args.dry_run)

    return guarded(PROGRAM, body)
