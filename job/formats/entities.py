"""Entity side of PBG's input format v1 (``entity_path``).

- ``entity_count_{type}_{part}.txt``: one integer, the entities in that partition.
- ``entity_names_{type}_{part}.json``: the names, in offset order (written by importers).
- ``dynamic_rel_count.txt`` / ``dynamic_rel_names.json``: with dynamic relations.
"""

from __future__ import annotations

import json

import storage_adapters as storage
from job.errors import InputFormatError


def count_file(entity_path: str, entity_type: str, partition: int) -> str:
    return storage.join(entity_path, f"entity_count_{entity_type}_{partition}.txt")


def names_file(entity_path: str, entity_type: str, partition: int) -> str:
    return storage.join(entity_path, f"entity_names_{entity_type}_{partition}.json")


def dynamic_rel_count_file(entity_path: str) -> str:
    return storage.join(entity_path, "dynamic_rel_count.txt")


def dynamic_rel_names_file(entity_path: str) -> str:
    return storage.join(entity_path, "dynamic_rel_names.json")


def _parse_count(url: str, text: str) -> int:
    stripped = text.strip()
    try:
        value = int(stripped)
    except ValueError:
        shown = stripped[:40] + ("..." if len(stripped) > 40 else "")
        raise InputFormatError(url, f"not an integer: '{shown}'", expected="a single non-negative integer") from None
    if value < 0:
        raise InputFormatError(url, f"negative count {value}", expected="a single non-negative integer")
    return value


def read_count_file(url: str) -> int:
    try:
        text = storage.read_text(url)
    except FileNotFoundError:
        raise InputFormatError(url, "missing", expected="an entity count file") from None
    except UnicodeDecodeError:
        raise InputFormatError(url, "not UTF-8 text", expected="a single non-negative integer") from None
    return _parse_count(url, text)


def write_count_file(url: str, count: int) -> None:
    storage.write_text(url, f"{count}\n")


def read_entity_count(entity_path: str, entity_type: str, partition: int) -> int:
    return read_count_file(count_file(entity_path, entity_type, partition))


def write_entity_count(entity_path: str, entity_type: str, partition: int, count: int) -> None:
    write_count_file(count_file(entity_path, entity_type, partition), count)


def read_entity_counts(entity_path: str, entity_type: str, num_partitions: int) -> list[int]:
    return [read_entity_count(entity_path, entity_type, p) for p in range(num_partitions)]


def write_entity_names(entity_path: str, entity_type: str, partition: int, names: list[str]) -> None:
    storage.write_text(names_file(entity_path, entity_type, partition), json.dumps(names, indent=0))


def read_entity_names(entity_path: str, entity_type: str, partition: int) -> list[str]:
    url = names_file(entity_path, entity_type, partition)
    try:
        names = json.loads(storage.read_text(url))
    except FileNotFoundError:
        raise InputFormatError(url, "missing", expected="an entity names file (written by biggraph import)") from None
    except json.JSONDecodeError as err:
        raise InputFormatError(url, f"invalid JSON at line {err.lineno}", expected="a JSON list of names") from None
    if not isinstance(names, list):
        raise InputFormatError(url, f"holds a {type(names).__name__}", expected="a JSON list of names")
    return [str(n) for n in names]


def has_entity_names(entity_path: str, entity_type: str, partition: int) -> bool:
    return storage.exists(names_file(entity_path, entity_type, partition))


def read_dynamic_rel_count(entity_path: str) -> int:
    return read_count_file(dynamic_rel_count_file(entity_path))


def write_dynamic_rel_count(entity_path: str, count: int) -> None:
    write_count_file(dynamic_rel_count_file(entity_path), count)


def write_dynamic_rel_names(entity_path: str, names: list[str]) -> None:
    storage.write_text(dynamic_rel_names_file(entity_path), json.dumps(names, indent=0))


def read_dynamic_rel_names(entity_path: str) -> list[str]:
    url = dynamic_rel_names_file(entity_path)
    try:
        return [str(n) for n in json.loads(storage.read_text(url))]
    except FileNotFoundError:
        raise InputFormatError(url, "missing", expected="a relation names file") from None
