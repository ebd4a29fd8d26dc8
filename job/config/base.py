"""The building blocks of the schema: help-carrying fields, type names, plain values, key errors.

Kept apart from the dataclasses so that parsing, overrides, the help text and the
generated reference (docs/gen_config_reference.py) describe types the same way.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import types
import typing
from collections.abc import Iterable
from dataclasses import field
from typing import Any, Union

from job.errors import ConfigError

MISSING = dataclasses.MISSING


class ConfigKeyError(ConfigError):
    """A ``ConfigError`` that knows which config keys it is about.

    ``keys`` are dotted paths as ``-p`` writes them (``relations.0.operator``; ``*`` stands
    for any entity type), so that ``load_config`` can blame an override instead of the file
    when an override set one of them.
    """

    def __init__(self, message: str, keys: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.keys = tuple(dotted(key) for key in keys)


def dotted(key: str) -> str:
    """``relations[0].operator`` (how messages write list items) -> ``relations.0.operator``."""
    return re.sub(r"\[(\d+)\]", r".\1", key)


def did_you_mean(key: str, names: Iterable[str], prefix: str = "") -> str:
    """`` (did you mean 'prefix.close'?)`` for the closest known name, or ``""``."""
    import difflib  # here: only a config with a mistake needs it, and every process (each import pod) loads this module

    close = difflib.get_close_matches(key, list(names), n=1)
    return f" (did you mean '{prefix}{close[0]}'?)" if close else ""


def field_help(text: str, **kwargs: Any) -> Any:
    """A dataclass field whose help text is kept next to it."""
    return field(metadata={"help": text}, **kwargs)


def to_plain(value: Any) -> Any:
    """Dataclasses, enums and tuples as the JSON-like values a config file holds."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    return value


def type_name(tp: Any) -> str:
    """A schema type in words (``int or null``, ``list of str``) for messages and the help."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return f"{type_name(args[0])} or null"
    if origin is list:
        return f"list of {type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return f"mapping of {type_name(typing.get_args(tp)[1])}"
    if tp is Any:
        return "any value"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of " + ", ".join(m.value for m in tp)
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


_HINTS: dict[type, dict[str, Any]] = {}


def type_hints_of(cls: type) -> dict[str, Any]:
    """The resolved field types of a schema class (cached: ``get_type_hints`` evaluates strings)."""
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def strip_optional(tp: Any) -> Any:
    """``X | None`` -> ``X`` (the schema's unions are all optionals)."""
    while typing.get_origin(tp) in (Union, types.UnionType):
        tp = [a for a in typing.get_args(tp) if a is not type(None)][0]
    return tp


_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int, key: str) -> int:
    """'8GiB', '500 MB', '1e9' or a plain number of bytes -> bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    try:
        value = float(match.group(1)) if match else -1.0
    except ValueError:
        value = -1.0
    if unit not in _BYTE_UNITS or value <= 0:
        raise ConfigKeyError(
            f"config key '{key}': {text!r} is not a size (expected e.g. '8GiB', '500MB' or bytes)", [key]
        )
    return int(value * _BYTE_UNITS[unit])
