"""PBG-style ``-p key.sub=value`` overrides: typed from the schema, applied to the raw dict.

An override is applied before validation (so it may supply a key the file lacks), which is
why ``blamed_overrides`` exists: when the combined config is refused, the message should
name the override that set the offending key, not the file.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import types
import typing
from typing import Any, Union

from job.config.base import did_you_mean, strip_optional, to_plain, type_hints_of, type_name
from job.config.schema import ConfigSchema
from job.errors import ConfigError


def _schema_type_at(path: list[str]) -> Any:
    """The schema type of the key at ``path`` (``["relations", "0", "operator"]`` -> ``str``)."""
    tp: Any = ConfigSchema
    for i, part in enumerate(path):
        tp = strip_optional(tp)
        origin = typing.get_origin(tp)
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):  # a schema class (never an instance)
            hints = type_hints_of(tp)
            if part not in hints:
                hint = did_you_mean(part, hints, "".join(p + "." for p in path[:i]))
                raise ConfigError(f"override '{'.'.join(path)}': unknown key '{part}'{hint}")
            tp = hints[part]
        elif origin is list:
            if not part.isdigit():
                raise ConfigError(f"override '{'.'.join(path)}': '{part}' must be a list index")
            tp = typing.get_args(tp)[0]
        elif origin is dict:
            tp = typing.get_args(tp)[1]
        else:
            raise ConfigError(f"override '{'.'.join(path)}': '{'.'.join(path[:i])}' has no sub-keys")
    return tp


def _parse_override_value(text: str, tp: Any, key: str) -> Any:
    """The command-line text of an override as a value of the schema type ``tp``."""
    while typing.get_origin(tp) in (Union, types.UnionType):
        if text in ("None", "null"):
            return None
        tp = [a for a in typing.get_args(tp) if a is not type(None)][0]
    origin = typing.get_origin(tp)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        return [_parse_override_value(part, item_tp, key) for part in text.split(",")] if text else []
    if tp is bool:
        lowered = text.lower()
        if lowered in ("true", "1", "yes", "on"):
            return True
        if lowered in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"override '{key}': expected a boolean (true/false), got '{text}'")
    if tp is int:
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"override '{key}': expected an integer, got '{text}'") from None
    if tp is float:
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"override '{key}': expected a number, got '{text}'") from None
    if tp is str or (isinstance(tp, type) and issubclass(tp, enum.Enum)):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise ConfigError(f"override '{key}': expected JSON for a {type_name(tp)}, got '{text}'") from None


def _set_at(raw: dict[str, Any], path: list[str], key: str, value: Any) -> None:
    """Set ``raw[path[0]][path[1]]...`` (list items by index, missing mappings created) to ``value``."""
    node: Any = raw
    for part in path[:-1]:
        if isinstance(node, list):
            index = int(part)
            if index >= len(node):
                raise ConfigError(f"override '{key}': index {index} out of range (have {len(node)})")
            node = node[index]
        else:
            node = node.setdefault(part, {})
    last = path[-1]
    if isinstance(node, list):
        index = int(last)
        if index >= len(node):
            raise ConfigError(f"override '{key}': index {index} out of range (have {len(node)})")
        node[index] = value
    else:
        node[last] = value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply PBG-style ``key.sub=value`` overrides, typed from the schema, to a raw dict (in a copy)."""
    raw = json.loads(json.dumps(raw, default=_json_default))
    for override in overrides:
        key, sep, text = override.partition("=")
        if not sep or not key:
            raise ConfigError(f"override '{override}': expected key=value")
        path = key.strip().split(".")
        tp = _schema_type_at(path)
        _set_at(raw, path, key, _parse_override_value(text, tp, key))
    return raw


def _json_default(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value):
        return to_plain(value)
    raise TypeError(f"cannot serialise {value!r}")


def _overlaps(a: list[str], b: list[str]) -> bool:
    """One key path lies inside the other (``*`` matches any one part): setting one may change the other."""
    return all(x == y or "*" in (x, y) for x, y in zip(a, b))


def blamed_overrides(overrides: list[str], keys: tuple[str, ...]) -> list[str]:
    """The overrides that set one of ``keys`` (dotted paths), or a key inside or around one of them.

    When several overrides set the same key only the last counts, as only its value was used.
    """
    blamed: dict[str, str] = {}
    for override in overrides:
        path = override.partition("=")[0].strip()
        if any(_overlaps(path.split("."), key.split(".")) for key in keys):
            blamed.pop(path, None)
            blamed[path] = override
    return list(blamed.values())
