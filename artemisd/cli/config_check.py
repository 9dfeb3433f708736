"""``artemis config check FILE``: validate artemis.conf the way the daemon will read it."""

from __future__ import annotations

import argparse
import sys

from artemisd.config import ConfigError, load_config


def run(args: argparse.Namespace) -> int:
    try:
        # Not secure=True: who owns the file and who may write it are judged by the daemon against
        # its own user (unknown here), and checking a copy in one's home directory must work.
        config = load_config(args.file)
    except ConfigError as err:
        print(f"{err}", file=sys.stderr)
        return 1
    d = config.daemon
    print(f"{args.file}: OK")
    print(f"  listen {d.listen}, state {d.state_dir}, auth {d.auth_type}, slurm backend {d.slurm_backend}")
    mode = "DRY RUN" if d.dry_run else ("actions OFF (Enabled=no)" if not d.enabled else "actions on")
    print(f"  {mode}; hard actions need {d.hard_action_evidence} evidence")
    mail = f"{config.mail.mail_relay} -> {', '.join(config.mail.mail_to)}" if config.mail.mail_relay else "off"
    print(f"  mail {mail}")
    if not config.policies:
        print("  no PartitionPolicy lines: the built-in DEFAULT applies to every partition")
    for p in config.policies:
        print(f"  PartitionPolicy={p.name}: auto {','.join(p.auto) or '-'}; approve {','.join(p.approve) or '-'}; "
              f"drain <= {p.max_drain_fraction:g} of nodes, <= {p.max_drains_per_hour}/h; cooldown {p.cooldown:g} s")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("config", help="artemis.conf tools")
    sub = p.add_subparsers(dest="config_command", metavar="SUBCOMMAND")
    check = sub.add_parser("check", help="validate an artemis.conf (errors name file:line: key)")
    check.add_argument("file", help="artemis.conf to check")
    check.set_defaults(func=run)
