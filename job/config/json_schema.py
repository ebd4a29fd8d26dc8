"""The training config as JSON Schema: what ``charts/biggraph/values.schema.json`` holds under ``config``.

``helm install``/``helm template`` validate the chart's values against that file, so a misspelled training key
must fail there as ``biggraph train`` fails on it, naming the key, rather than in every pod minutes later. The
schema is derived from the dataclasses (``ConfigSchema``, ``EntitySchema``, ``RelationSchema``): every key with
its type, no other key (``additionalProperties: false`` at every level), the required keys, the closed sets of
names (``KEY_CHOICES``, ``OPERATORS``, ``PRESETS``) and the single-key minimums of ``job.config.checks``. The
checks that span keys (a relation naming an unknown entity type, DURA with a non-bilinear operator...) stay
``biggraph train``'s (and ``biggraph submit``'s, which parses the config before rendering).

The generated part is checked in (helm reads the chart from the checkout, the image and the wheel alike; a
build step could not refresh the checkout's copy): ``python -m job.config.json_schema`` rewrites it, and
``--check`` (tests/test_config_json_schema.py) fails when it is stale. The rest of values.schema.json (the
chart's own values, the cross-value rules) is written by hand and left as it is.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any, Union

from job.config.base import MISSING, type_hints_of
from job.config.checks import NON_NEGATIVE_INTS, POSITIVE_INTS
from job.config.choices import KEY_CHOICES, OPERATORS
from job.config.graph_schema import EntitySchema, RelationSchema
from job.config.presets import PRESETS
from job.config.schema import ConfigSchema

VALUES_SCHEMA = Path(__file__).resolve().parents[2] / "charts" / "biggraph" / "values.schema.json"
GENERATED_NOTE = "generated from job/config by `python -m job.config.json_schema`: edit the dataclasses, not this"
# keys whose list or mapping must not be empty (check_required_lists)
NON_EMPTY = ("entities", "relations", "edge_paths")
# what each class's own checks refuse besides the types: (class, key) -> JSON Schema keywords
_EXTRA: dict[tuple[type, str], dict[str, Any]] = {
    **{(ConfigSchema, key): {"minimum": 1} for key in POSITIVE_INTS},
    **{(ConfigSchema, key): {"minimum": 0} for key in NON_NEGATIVE_INTS},
    **{(ConfigSchema, key): {"enum": list(values)} for key, values in KEY_CHOICES.items()},
    (ConfigSchema, "preset"): {"enum": [*PRESETS, None]},
    (ConfigSchema, "compute_dtype"): {"enum": [*KEY_CHOICES["compute_dtype"], None]},
    (EntitySchema, "num_partitions"): {"minimum": 1},
    (EntitySchema, "dimension"): {"minimum": 1},
    (RelationSchema, "operator"): {"enum": list(OPERATORS)},
}


def _type_schema(tp: Any) -> dict[str, Any]:
    """The JSON Schema of one field type, as ``job.config.parsing`` converts it (ints pass as numbers, integral
    numbers as integers: JSON Schema's ``integer`` accepts 3.0 too)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return {}
    if origin in (Union, types.UnionType):
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        schema = _type_schema(inner)
        if "type" in schema:
            return {**schema, "type": [schema["type"], "null"]}
        return {"anyOf": [schema, {"type": "null"}]}
    if origin is list:
        return {"type": "array", "items": _type_schema(typing.get_args(tp)[0])}
    if origin is dict:
        return {"type": "object", "additionalProperties": _type_schema(typing.get_args(tp)[1])}
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return {"type": "string", "enum": [member.value for member in tp]}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return class_schema(tp)
    leaf = {bool: "boolean", int: "integer", float: "number", str: "string"}.get(tp)
    if leaf is None:
        raise TypeError(f"unsupported schema type {tp!r}")  # a bug in the schema, not user input
    return {"type": leaf}


def class_schema(cls: type) -> dict[str, Any]:
    """One schema dataclass as a closed JSON object: its keys, their types, its required keys."""
    hints = type_hints_of(cls)
    properties: dict[str, Any] = {}
    required = []
    for field in dataclasses.fields(cls):
        schema = {**_type_schema(hints[field.name]), **_EXTRA.get((cls, field.name), {})}
        if field.name in NON_EMPTY and cls is ConfigSchema:
            schema["minProperties" if schema["type"] == "object" else "minItems"] = 1
        properties[field.name] = schema
        if field.default is MISSING and field.default_factory is MISSING:
            required.append(field.name)
    return {"type": "object", "additionalProperties": False, "required": required, "properties": properties}


def config_schema() -> dict[str, Any]:
    """The JSON Schema of a training config (the chart's ``config`` value)."""
    return {"$comment": GENERATED_NOTE, "description": "the training config (biggraph config-help)",
            **class_schema(ConfigSchema)}


def values_schema_text(current: str) -> str:
    """``current`` (values.schema.json's text) with its ``config`` property regenerated, in the file's layout:
    two-space indentation, one key per line."""
    values = json.loads(current)
    values["properties"]["config"] = config_schema()
    return json.dumps(values, indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m job.config.json_schema", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is stale instead of rewriting it")
    parser.add_argument("--path", type=Path, default=VALUES_SCHEMA, help="values.schema.json to update")
    args = parser.parse_args(argv)
    current = args.path.read_text()
    wanted = values_schema_text(current)
    if args.check:
        if current != wanted:
            print(f"{args.path}: stale; run python -m job.config.json_schema", file=sys.stderr)
            return 1
        return 0
    if current != wanted:
        args.path.write_text(wanted)
        print(f"{args.path}: config schema regenerated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
