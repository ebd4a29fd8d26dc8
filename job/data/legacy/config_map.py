"""Legacy configs and model state-dict keys -> their v1 names.

The legacy config dict: mixedCase keys become snake_case (as PBG 1.0's own loader does),
``outdir`` becomes ``checkpoint_path`` and ``loadPath`` ``init_path``; keys unknown to the v1
schema are dropped (and noted). State-dict keys follow PBG's MODEL_STATE_DICT_MAPPINGS.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from job.config import ConfigSchema, EntitySchema, RelationSchema
from job.errors import UserError

# PBG's MODEL_STATE_DICT_MAPPINGS (checkpoint_manager.py): private state-dict key -> public dataset name.
_STATE_DICT_MAPPINGS = (
    (re.compile(r"^(?P<side>[^./]+)_operators\.(?P<idx>[^./]+)\.(?P<param>[^./]+)$"), "relations/{idx}/operator/{side}/{param}"),
    (re.compile(r"^global_embs\.emb_(?P<type>[^./]+)$"), "entities/{type}/global_embedding"),
)

# Legacy config keys whose snake_case form is not the v1 name.
_RENAMED_KEYS = {"outdir": "checkpoint_path", "load_path": "init_path"}


def _snake(key: str) -> str:
    """PBG 1.0's own legacy rule (schema.mixed_case_to_lowercase): every capital becomes _lowercase."""
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in key)


def map_legacy_config(raw: Any) -> tuple[dict[str, Any], list[str]]:
    """Legacy config dict -> v1 keys, and notes about what was renamed or dropped."""
    if not isinstance(raw, dict):
        return {}, [f"the legacy config is a {type(raw).__name__}, not a dict: dropped"]
    notes: list[str] = []

    def convert(mapping: dict[str, Any], cls: type, where: str) -> dict[str, Any]:
        known = {f.name for f in dataclasses.fields(cls)}
        out: dict[str, Any] = {}
        for key, value in mapping.items():
            new_key = _snake(str(key))
            new_key = _RENAMED_KEYS.get(new_key, new_key) if cls is ConfigSchema else new_key
            if new_key not in known:
                notes.append(f"dropped legacy key '{where}{key}' (no v1 equivalent)")
                continue
            if new_key != key:
                notes.append(f"renamed '{where}{key}' to '{where}{new_key}'")
            out[new_key] = value
        return out

    config = convert(raw, ConfigSchema, "")
    if isinstance(config.get("entities"), dict):
        config["entities"] = {
            name: convert(entity, EntitySchema, f"entities.{name}.") if isinstance(entity, dict) else entity
            for name, entity in config["entities"].items()
        }
    if isinstance(config.get("relations"), list):
        config["relations"] = [
            convert(rel, RelationSchema, f"relations[{i}].") if isinstance(rel, dict) else rel
            for i, rel in enumerate(config["relations"])
        ]
    if isinstance(config.get("edge_paths"), str):
        config["edge_paths"] = [config["edge_paths"]]
    return config, notes


def map_state_dict_key(private: str) -> str:
    """A legacy model state-dict key -> the v1 public dataset name (PBG's mapping)."""
    for pattern, public in _STATE_DICT_MAPPINGS:
        match = pattern.match(private)
        if match:
            return public.format(**match.groupdict())
    raise UserError(
        f"model state dict key '{private}' has no v1 name "
        "(expected {side}_operators.{idx}.{param} or global_embs.emb_{type})"
    )
