"""``training_stats.json``: one JSON object a line, appended per pass; PBG's format.

Object stores cannot append, so there the file is rewritten whole; a line cut short by a kill
is skipped on reading and rewritten away before the next append.
"""

from __future__ import annotations

import json
from typing import Any

import storage_adapters as storage


def append_stats(url: str, records: list[dict[str, Any]]) -> None:
    """Append JSON lines; object stores cannot append, so the file is rewritten whole."""
    if not records:
        return
    storage.append_text(url, "".join(json.dumps(r) + "\n" for r in records))


def trim_stats(url: str, committed: int) -> int:
    """Drop the stats lines of versions after ``committed`` (written just before a marker that never
    came); returns how many were dropped."""
    try:
        text = storage.read_text(url)
    except FileNotFoundError:
        return 0
    records = load_stats(url)
    kept = [r for r in records if not isinstance(r.get("checkpoint_version"), int) or r["checkpoint_version"] <= committed]
    if len(kept) == len(records) and (not text or text.endswith("\n")):
        return 0  # (a line cut short by a kill is rewritten away: the next append would run into it)
    storage.write_text(url, "".join(json.dumps(r) + "\n" for r in kept))
    return len(records) - len(kept)


def load_stats(url: str) -> list[dict[str, Any]]:
    """The records, skipping a line cut short by a crash mid-append; [] when there is no file."""
    try:
        text = storage.read_text(url)
    except FileNotFoundError:
        return []
    records = []
    for line in text.splitlines():
        line = line.strip()
        if line:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut short by a crash mid-append
    return records
