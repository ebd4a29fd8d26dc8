"""Arguments several commands share: the CONFIG positional and PBG's ``-p key=value`` overrides."""

from __future__ import annotations

import argparse


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """The CONFIG positional and the repeatable ``-p key=value`` overrides.

    ``-p`` takes exactly one value per use: with several (PBG's ``nargs="*"``) it swallowed
    the CONFIG positional in ``biggraph train -p num_epochs=1 cfg.yaml``.
    """
    parser.add_argument("config", help="config file: a PBG .py file, or .yaml/.json with the same keys")
    parser.add_argument(
        "-p",
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, typed from the schema; one per -p, repeatable, before or after CONFIG "
        "(e.g. -p num_epochs=5 -p entities.all.num_partitions=4)",
    )


def overrides_of(args: argparse.Namespace) -> list[str]:
    """The ``-p`` overrides, in command-line order (later ones win)."""
    return list(args.param or [])
