"""Credentials never reach a checkpoint: the config stored in one has its ``storage_options`` secrets hidden."""

from __future__ import annotations

import json
from typing import Any

_SECRET_WORDS = ("key", "secret", "token", "password", "passwd", "credential", "signature", "sas")


def redact_secrets(value: Any) -> Any:
    """``value`` with every credential-like entry of its mappings replaced by "***" (recursively)."""
    if isinstance(value, dict):
        return {
            k: ("***" if isinstance(k, str) and any(w in k.lower() for w in _SECRET_WORDS) and v not in (None, "")
                else redact_secrets(v))
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [redact_secrets(v) for v in value]
    return value


def redact_config_json(text: str) -> str:
    """A config JSON with the credentials in ``storage_options`` hidden (never stored in a checkpoint)."""
    try:
        config = json.loads(text)
    except (TypeError, ValueError):
        return text
    if not isinstance(config, dict) or not config.get("storage_options"):
        return text
    config["storage_options"] = redact_secrets(config["storage_options"])
    return json.dumps(config, indent=4)
