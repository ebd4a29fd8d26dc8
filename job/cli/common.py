"""Arguments more than one command can use: ``--storage-option key=value`` (fsspec options from the command line)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from job.errors import UserError


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
