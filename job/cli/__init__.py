"""The ``biggraph`` command line: one subcommand per module, each registering its own arguments.

Keeping each command's arguments beside its implementation keeps this file thin; the
modules import their heavy dependencies (torch, h5py) only when the command runs, so
``biggraph config-help`` answers instantly.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from job import __version__
from job.errors import UserError
from storage_adapters.errors import StorageError

# Modules that define ``register(subparsers)``; order is the order of ``biggraph --help``.
COMMAND_MODULES = (
    "job.commands",
    "job.importer",
    "job.growing.cli",
    "job.validate",
    "job.exporter",
    "job.legacy",
    "job.demo",
    "job.k8s_cli",
    "job.archive_cli",
    "job.report",
)

logger = logging.getLogger("biggraph")


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """The CONFIG positional and PBG's repeatable ``-p key=value`` overrides."""
    parser.add_argument("config", help="config file: a PBG .py file, or .yaml/.json with the same keys")
    parser.add_argument(
        "-p",
        "--param",
        action="append",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, typed from the schema (e.g. -p num_epochs=5 -p entities.all.num_partitions=4)",
    )


def overrides_of(args: argparse.Namespace) -> list[str]:
    return [item for group in (args.param or []) for item in group]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="biggraph",
        description="Train PyTorch-BigGraph-compatible graph embeddings on local files, S3 or Kubernetes.",
    )
    parser.add_argument("--version", action="version", version=f"biggraph {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument(
        "--log-format", choices=("text", "json"), default="text", help="log line format (json for log collectors)"
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def setup_logging(verbose: bool, log_format: str) -> None:
    from job.logs import configure_logging

    configure_logging(logging.DEBUG if verbose else logging.INFO, log_format)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # a command may re-launch itself (one process per GPU)
    setup_logging(args.verbose, args.log_format)
    try:
        return int(args.func(args) or 0)
    except (UserError, StorageError) as err:
        print(f"biggraph {args.command}: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print(f"biggraph {args.command}: interrupted", file=sys.stderr)
        return 130
