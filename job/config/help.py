"""``biggraph config-help``: every key with its type, default and help text, from the schema itself."""

from __future__ import annotations

import dataclasses
import json

from job.config.base import MISSING, to_plain, type_hints_of, type_name
from job.config.graph_schema import EntitySchema, RelationSchema
from job.config.schema import ConfigSchema


def config_help() -> str:
    """Every key with its type, default and help text (``biggraph config-help``)."""
    lines: list[str] = []
    for cls, prefix in ((ConfigSchema, ""), (EntitySchema, "entities.<type>."), (RelationSchema, "relations[i].")):
        hints = type_hints_of(cls)
        for f in dataclasses.fields(cls):
            if f.default is not MISSING:
                default = to_plain(f.default)
                default_text = json.dumps(default)
            elif f.default_factory is not MISSING:
                default_text = json.dumps(f.default_factory())
            else:
                default_text = "(required)"
            lines.append(f"{prefix}{f.name}  [{type_name(hints[f.name])}]  default: {default_text}")
            lines.append(f"    {f.metadata.get('help', '')}")
    return "\n".join(lines)
