"""The ``artemis`` command: one module per subcommand, each with ``register(subparsers)``."""

from __future__ import annotations

import argparse
import importlib
import sys

from artemisd import __version__

# Each module defines register(subparsers) and sets a ``func`` default that
# takes the parsed args and returns an exit status.
COMMAND_MODULES = (
    "artemisd.cli.replay",
    "artemisd.cli.sim",
    "artemisd.cli.admin",
    "artemisd.cli.config_check",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="artemis",
        description="Artemis: find the rank, GPU, link or host slowing a training job.",
    )
    parser.add_argument("--version", action="version", version=f"artemis {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # `artemis replay … | head` is normal use
        return 0
    except KeyboardInterrupt:
        return 130
