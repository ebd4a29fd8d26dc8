"""Placeholder: the `exporter` command is being written."""

from typing import Any


def register(subparsers: Any) -> None:
    pass
