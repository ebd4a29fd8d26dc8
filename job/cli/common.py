"""Arguments several commands share: CONFIG with PBG's ``-p key=value`` overrides, and ``--storage-option``."""

from __future__ import annotations

import argparse
import json
from typing import Any, Optional

from job.errors import UserError
from job.session import storage_scoped


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



def add_version_argument(parser: argparse.ArgumentParser, help_text: str) -> None:
    """``--version N`` or ``--version best`` (the version that scored best on the validation edges)."""
    parser.add_argument("--version", type=_version_value, default=None, metavar="N|best",
                        help=f"{help_text}; 'best': the version that scored best on validation_edge_paths "
                             "(best_version.txt)")


def _version_value(text: str) -> int | str:
    if text == "best":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a version number or 'best', got '{text}'") from None


@storage_scoped
def resolve_version(config: Any, value: int | str | None) -> Optional[int]:
    """``--version``'s value as a number (``best`` read from the config's checkpoint directory)."""
    from job.checkpoint import CheckpointManager

    return CheckpointManager.version_named(config.checkpoint_path, value)


def add_storage_option_argument(parser: argparse.ArgumentParser) -> None:
    """A repeatable ``--storage-option KEY=VALUE``, collected (unparsed) in ``args.storage_option``."""
    parser.add_argument(
        "--storage-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a storage option for s3:// and other remote URLs, as the config key storage_options holds them "
             "(repeatable; the value is JSON when it parses, else a string; e.g. "
             "--storage-option endpoint_url=http://127.0.0.1:9000 --storage-option anon=false)",
    )


def parse_storage_options(items: list[str]) -> dict[str, Any]:
    """``["endpoint_url=http://h:9000", "anon=true"]`` -> ``{"endpoint_url": "http://h:9000", "anon": True}``."""
    options: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UserError(f"--storage-option {item!r}: expected KEY=VALUE (e.g. endpoint_url=http://127.0.0.1:9000)")
        try:
            options[key] = json.loads(text)
        except ValueError:
            options[key] = text
    return options
