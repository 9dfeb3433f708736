"""``artemis sim``: write a simulated fleet trace (wire v1) and its ground truth."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from artemisd.sim import AMD_MI300X, NVIDIA_H100, FaultSpec, Fleet, FleetSpec, JobSpec, NoiseSpec
from artemisd.sim.closedloop import MODES
from artemisd.sim.scenarios import change_pair
from artemisd.sim.spec import CHANGE_CAUSES, DENSE_NOISE, VARLEN_NOISE, describe

EXAMPLES = """\
examples:
  artemis sim run.jsonl --world 64 --windows 40 --fault gpu.thermal:rank=5,onset=12,magnitude=0.2
  artemis sim run.jsonl --mixed --fault comm.island:island=amd,magnitude=0.15,pattern=ramp
  artemis sim run.jsonl --fault change.driver:magnitude=0.1   # adds the reference job first
  artemis sim run.jsonl --spec fleet.json                      # a FleetSpec as JSON
  artemis sim run.jsonl --world 16 --dump-spec > fleet.json    # the spec, to edit

Writes run.jsonl (window reports and node events in arrival order) and
run.truth.json (injected faults, healthy-but-slow GPUs, transients).

closed loop at fleet scale (no trace; prints the GPU-hours each mode loses):
  artemis sim --fleet --nodes 1024 --days 3 --seed 1
  artemis sim --fleet --mode artemis --policy /etc/artemis/artemis.conf
  artemis sim --fleet --nodes 64 --days 0.5 --json fleet.json
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "sim", help="simulate a training fleet into a wire-format trace with ground truth",
        description="Write a simulated training-fleet trace (wire v1) and its ground truth.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", type=Path, nargs="?",
                   help="output trace (JSON Lines); the truth goes beside it (not with --fleet)")
    p.add_argument("--spec", type=Path, help="FleetSpec JSON; replaces the job options below")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0); same seed, same trace")
    p.add_argument("--jobs", type=int, default=1, help="independent jobs in the fleet (default 1)")
    p.add_argument("--world", type=int, default=64, help="ranks per job (default 64)")
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--windows", type=int, default=40)
    p.add_argument("--window-steps", type=int, default=50)
    p.add_argument("--noise", default="dense",
                   help=f"per-step noise: dense ({DENSE_NOISE}), varlen ({VARLEN_NOISE}) or a fraction")
    p.add_argument("--mixed", action="store_true", help="half NVIDIA H100, half AMD MI300X nodes")
    p.add_argument("--healthy-slow", type=int, default=0, help="GPUs per job made 2-3 %% slower (healthy)")
    p.add_argument("--fault", action="append", default=[], metavar="CAUSE[:key=value,...]",
                   help="inject a fault into the first job (repeatable); keys are FaultSpec fields")
    p.add_argument("--probe-after", type=int, help="a matched-probe block this many windows after each onset")
    p.add_argument("--dump-spec", action="store_true", help="print the FleetSpec JSON instead of simulating")
    fleet = p.add_argument_group("closed loop at fleet scale (--fleet; docs/benchmarks.md)")
    fleet.add_argument("--fleet", action="store_true",
                       help="run the closed-loop fleet simulation instead of writing a trace")
    fleet.add_argument("--nodes", type=int, default=1024, help="nodes of 8 GPUs (default 1024)")
    fleet.add_argument("--days", type=float, default=3.0, help="simulated days (default 3)")
    fleet.add_argument("--mode", choices=("all", *MODES), default="all",
                       help="who acts: none, person (detect-only), artemis (--policy or the shipped "
                            "defaults), artemis-auto (every rung automatic); default all, on the same fleet")
    fleet.add_argument("--policy", type=Path, help="artemis.conf for the artemis mode (default: shipped defaults)")
    fleet.add_argument("--link-probes", action="store_true",
                       help="the live daemon's matched probes name degraded links, as often as "
                            "benchmarks/links.py measured (right node, wrong node or none)")
    fleet.add_argument("--json", type=Path, help="also write every mode's numbers as JSON here")
    p.set_defaults(func=run)


def _value(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return None if text.lower() == "none" else text


def parse_fault(text: str) -> FaultSpec:
    cause, _, rest = text.partition(":")
    fields: dict[str, Any] = {"cause": cause}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--fault {text!r}: {item!r} is not key=value")
        fields[key.strip()] = _value(value.strip())
    if cause in CHANGE_CAUSES:
        fields.setdefault("onset", 0)
    try:
        return FaultSpec(**fields)
    except ValidationError as err:
        raise ValueError(f"--fault {text!r}: {describe(err)}") from None


def _noise(text: str) -> float:
    named = {"dense": DENSE_NOISE, "varlen": VARLEN_NOISE}
    if text in named:
        return named[text]
    value = float(text)
    if not 0 <= value < 0.5:
        raise ValueError(f"--noise {text}: expected dense, varlen or a fraction below 0.5")
    return value


def build_spec(args: argparse.Namespace) -> FleetSpec:
    if args.spec is not None:
        return FleetSpec.model_validate(json.loads(args.spec.read_text()))
    rpn = args.ranks_per_node
    if args.mixed:
        nv = max(1, args.world // rpn // 2) * rpn
        islands = (NVIDIA_H100.model_copy(update={"ranks": nv}),
                   AMD_MI300X.model_copy(update={"ranks": max(rpn, args.world - nv)}))
    else:
        islands = (NVIDIA_H100.model_copy(update={"ranks": args.world}),)
    faults = [parse_fault(f) for f in args.fault]
    change = [f for f in faults if f.cause in CHANGE_CAUSES]
    if len(change) > 1:
        raise ValueError("--fault: one change.* fault per trace (each needs its own reference job)")
    base = dict(islands=islands, ranks_per_node=rpn, windows=args.windows, window_steps=args.window_steps,
                noise=NoiseSpec(step=_noise(args.noise), healthy_slow=args.healthy_slow),
                probe_after=args.probe_after)
    jobs: list[JobSpec] = []
    if change:
        ref = JobSpec(job="1000", first_node=0, **base)
        jobs += [ref, change_pair(ref, change[0].cause, change[0].magnitude, "1001")]
        faults = [f for f in faults if f not in change]
        jobs[1] = jobs[1].model_copy(update={"faults": jobs[1].faults + tuple(faults)})
    else:
        jobs.append(JobSpec(job="1001", faults=tuple(faults), **base))
    for i in range(1, args.jobs):
        jobs.append(JobSpec(job=str(1001 + len(jobs)), start_s=30.0 * i, **base))
    # Re-validate the assembled jobs so a fault that does not fit names its field.
    return FleetSpec(seed=args.seed, jobs=tuple(JobSpec.model_validate(j.model_dump()) for j in jobs))


def run_fleet_cli(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from artemisd.config import ConfigError
    from artemisd.sim.closedloop import FleetParams, run_fleet, summary

    if args.nodes < 1 or not 0 < args.days <= 365:
        print("artemis sim: --nodes must be at least 1 and --days in (0, 365]", file=sys.stderr)
        return 2
    params = replace(FleetParams(), nodes=args.nodes, days=args.days, seed=args.seed)
    modes = MODES if args.mode == "all" else (args.mode,)
    try:
        results = run_fleet(params, modes, policy=args.policy, link_probes=args.link_probes)
    except (ConfigError, OSError) as err:
        print(f"artemis sim: {err}", file=sys.stderr)
        return 2
    print(f"{args.nodes} nodes x 8 GPUs, {args.days:g} days, seed {args.seed}"
          + (" (links named by probes: assumed)" if args.link_probes else ""))
    print(summary(results))
    if args.json is not None:
        args.json.write_text(json.dumps({m: r.as_json() for m, r in results.items()}, indent=1) + "\n")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.fleet:
        return run_fleet_cli(args)
    if args.trace is None:
        print("artemis sim: a trace file is needed (or --fleet)", file=sys.stderr)
        return 2
    try:
        spec = build_spec(args)
    except ValidationError as err:
        where = f"{args.spec}: " if args.spec is not None else ""
        print(f"artemis sim: {where}{describe(err)}", file=sys.stderr)
        return 2
    except json.JSONDecodeError as err:
        print(f"artemis sim: {args.spec}:{err.lineno}: not JSON: {err.msg}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as err:
        print(f"artemis sim: {err}", file=sys.stderr)
        return 2
    if args.dump_spec:
        print(spec.model_dump_json(indent=1))
        return 0
    count, truth = Fleet(spec).write(args.trace)
    faults = sum(len(j.faults) for j in spec.jobs)
    print(f"{args.trace}: {count} records, {len(spec.jobs)} job(s), {faults} fault(s); truth in {truth}")
    return 0
