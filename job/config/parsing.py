"""From a PBG-style dict to a validated ``ConfigSchema``: strict, and every refusal names its key.

Unknown keys, wrong types and impossible combinations raise ``ConfigError`` (a
``ConfigKeyError`` carrying the keys involved), because a typo in the config of a
multi-hour job should fail in the first second, not after the first epoch.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from typing import Any, Union

from job.config.base import MISSING, ConfigKeyError, did_you_mean, type_hints_of, type_name
from job.config.presets import expand_preset
from job.config.schema import ConfigSchema
from job.errors import ConfigError


def _mismatch(key: str, expected: str, value: Any) -> ConfigKeyError:
    return ConfigKeyError(f"config key '{key}': expected {expected}, got {type(value).__name__} {value!r}", [key])


def _convert(value: Any, tp: Any, key: str) -> Any:
    """Check and convert a raw (JSON-like) value to the schema type ``tp``: containers here, leaves below."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(value, inner[0], key)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise _mismatch(key, type_name(tp), value)
        (item_tp,) = typing.get_args(tp)
        return [_convert(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise _mismatch(key, type_name(tp), value)
        _, value_tp = typing.get_args(tp)
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ConfigKeyError(f"config key '{key}': keys must be strings, got {k!r}", [key])
            out[k] = _convert(v, value_tp, f"{key}.{k}")
        return out
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):  # a schema class (never an instance)
        if not isinstance(value, dict):
            raise _mismatch(key, "a mapping", value)
        return _from_dict(tp, value, prefix=f"{key}.")
    return _convert_leaf(value, tp, key)


def _convert_leaf(value: Any, tp: Any, key: str) -> Any:
    """An enum, bool, int, float or str value; ints pass as floats, integral floats as ints, bools as neither."""
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        if isinstance(value, tp):
            return value
        try:
            return tp(value)
        except ValueError:
            raise ConfigKeyError(f"config key '{key}': expected {type_name(tp)}, got {value!r}", [key]) from None
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _mismatch(key, "a boolean", value)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise _mismatch(key, "an integer", value)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _mismatch(key, "a number", value)
    if tp is str:
        if isinstance(value, str):
            return value
        raise _mismatch(key, "a string", value)
    raise TypeError(f"unsupported schema type {tp!r}")  # a bug in the schema, not user input


def _from_dict(cls: type, raw: dict[str, Any], prefix: str = "") -> Any:
    """One schema dataclass from its dict; ``prefix`` is its place in the config (``entities.all.``)."""
    hints = type_hints_of(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names, key=str)  # YAML may give non-string keys
    if unknown:
        key = str(unknown[0])
        raise ConfigKeyError(f"config key '{prefix}{key}': unknown key{did_you_mean(key, names, prefix)}",
                             [prefix + key])
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in raw:
            kwargs[f.name] = _convert(raw[f.name], hints[f.name], prefix + f.name)
        elif f.default is MISSING and f.default_factory is MISSING:
            raise ConfigKeyError(f"config key '{prefix}{f.name}' is required", [prefix + f.name])
    try:
        return cls(**kwargs)
    except ConfigError as err:
        if not prefix:
            raise
        # EntitySchema/RelationSchema name their own keys ("dimension: ..."): give the full key.
        message = str(err)
        if message.startswith(("num_partitions", "dimension", "operator")):
            message = f"config key '{prefix}{message}".replace(":", "':", 1)
        raise ConfigKeyError(message, [prefix + key for key in getattr(err, "keys", ())]) from None


def parse_config(raw: Any) -> ConfigSchema:
    """Build a validated ``ConfigSchema`` from a PBG-style dict."""
    if not isinstance(raw, dict):
        raise ConfigError(f"the config must be a mapping of keys to values, got {type(raw).__name__}")
    return _from_dict(ConfigSchema, expand_preset(raw))
