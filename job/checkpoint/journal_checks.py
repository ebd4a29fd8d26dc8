"""What a grow journal may say: its JSON shape, and the only places its moves and clean-up may touch.

A journal (``grow.v{N}.json``) is read from the checkpoint directory, which may come from elsewhere (a copied
model, a shared bucket). Publishing a journal moves and deletes what it names, so nothing it names is trusted:

- its shape is checked field by field (types, a 2-element move, non-negative counts) and its version must be
  the N of its file name;
- before it is acted on (publishing a committed grow, removing an uncommitted one: ``confine``) it may name only
  the staging directory ``.grow-v{N}/`` of the input locations (``entity_path`` and each of ``edge_paths``: the
  caller's config, or when a caller has no config the ones the journal's own ``config_json`` records), and
  moves only of a plain file name from that staging directory to the same name directly inside the same input
  location; a published journal is only read (a re-run's files, the boundaries), so its paths are not held
  to the caller's input (``eval`` of a test split names other ``edge_paths``);
- the URLs that are then moved and deleted are built from the input locations, never taken from the journal.

Local paths are compared absolute and normalised (``entities/.grow-v3/x`` from the model's directory is
``/data/m/entities/.grow-v3/x``), component by component (``/data/model2`` is not inside ``/data/model``); other
URLs must match exactly, scheme included, and may not hold ``.`` or ``..`` components. Anything else is a
``CheckpointError`` (exit 2) naming the path and the journal, raised before anything is moved or deleted.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import storage_adapters as storage
from job.errors import CheckpointError


@dataclass(frozen=True)
class GrowInputs:
    """The input locations a grow stages into and publishes to: ``entity_path`` and ``edge_paths``."""

    entity_path: str
    edge_paths: tuple[str, ...]

    @classmethod
    def of(cls, config: Any) -> GrowInputs:
        """The input locations of a ``ConfigSchema`` (or of a config mapping, as ``config.json`` holds it)."""
        if isinstance(config, dict):
            entity_path, edge_paths = config.get("entity_path"), config.get("edge_paths")
        else:
            entity_path, edge_paths = config.entity_path, config.edge_paths
        if not isinstance(entity_path, str) or not isinstance(edge_paths, list | tuple) or not edge_paths \
                or not all(isinstance(p, str) and p for p in edge_paths) or not entity_path:
            raise CheckpointError("the config names no entity_path and edge_paths to confine the grow journal to")
        return cls(entity_path, tuple(edge_paths))

    def roots(self) -> list[str]:
        return [*self.edge_paths, self.entity_path]


_FIELDS: dict[str, tuple[type, bool]] = {  # name -> (JSON type, required)
    "version": (int, True), "from_version": (int, True), "files": (list, True), "options": (dict, True),
    "moves": (list, True), "staging_dirs": (list, True), "config_json": (str, True), "boundaries": (list, True),
    "new_entities": (dict, False), "new_relations": (list, False), "new_edges": (int, False), "init": (str, False),
    "published": (bool, False),
}


def check_shape(url: str, data: Any, version: int | None) -> dict[str, Any]:
    """``data`` (the parsed JSON of the journal at ``url``) as the fields of a ``GrowRecord``, or a CheckpointError."""
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{url}: not a valid grow journal: {what} (nothing was moved or deleted)")

    if not isinstance(data, dict):
        raise bad(f"holds a JSON {type(data).__name__}, expected an object")
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise bad(f"unknown key '{unknown[0]}'")
    for name, (kind, required) in _FIELDS.items():
        if name not in data:
            if required:
                raise bad(f"no '{name}'")
            continue
        value: Any = data[name]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise bad(f"'{name}' is a {type(value).__name__}, expected a {kind.__name__}")
        if kind is int and not _count(value):
            raise bad(f"'{name}' is negative")
    if version is not None and data["version"] != version:
        raise bad(f"'version' is {data['version']} but the file is the journal of version {version}")
    if data["from_version"] >= data["version"]:
        raise bad(f"'from_version' {data['from_version']} is not before 'version' {data['version']}")
    _check_items(bad, data)
    return data


def _check_items(bad: Any, data: dict[str, Any]) -> None:
    for move in data["moves"]:
        if not (isinstance(move, list) and len(move) == 2 and all(isinstance(p, str) and p for p in move)):
            raise bad(f"a move is {json.dumps(move)[:200]}, expected [staged path, final path]")
    if not all(isinstance(p, str) and p for p in data["staging_dirs"]):
        raise bad("'staging_dirs' holds something other than paths")
    for described in data["files"]:
        if not (isinstance(described, dict) and isinstance(described.get("url"), str)
                and _count(described.get("size"))):
            raise bad("'files' holds something other than {url, size} entries")
    for bounds in data["boundaries"]:
        if not (isinstance(bounds, list) and all(_count(b) for b in bounds)):
            raise bad("'boundaries' holds something other than lists of edge counts")
    if not all(isinstance(k, str) and _count(v) for k, v in data.get("new_entities", {}).items()):
        raise bad("'new_entities' holds something other than entity counts")
    if not all(isinstance(r, str) for r in data.get("new_relations", [])):
        raise bad("'new_relations' holds something other than names")
    try:
        recorded = json.loads(data["config_json"])
    except json.JSONDecodeError:
        recorded = None
    if not isinstance(recorded, dict):
        raise bad("'config_json' is not a JSON object")


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def confine(url: str, version: int, moves: list[list[str]], staging_dirs: list[str],
            inputs: GrowInputs) -> tuple[list[list[str]], list[str]]:
    """The journal's moves and staging directories, rebuilt from ``inputs``: every one it names must be the
    ``.grow-v{N}/`` staging directory of an input location, or a plain file inside it moved to the same name
    in that location; anything else is a CheckpointError naming it (before anything is touched)."""
    roots = inputs.roots()
    staging = {_key(storage.join(root, f".grow-v{version}")): root for root in roots}
    where = (f"the staging directory .grow-v{version}/ of entity_path {inputs.entity_path} or edge_paths "
             f"{', '.join(inputs.edge_paths)}")

    def refuse(path: str, what: str) -> CheckpointError:
        return CheckpointError(f"{url}: names {path}, {what}: refusing this journal (nothing was moved or deleted; "
                               "finish it with the config that grew this model, or remove the journal if it is not "
                               "this model's)")

    confined_dirs = []
    for directory in staging_dirs:
        root = staging.get(_key(directory))
        if root is None:
            raise refuse(directory, f"which is not {where}")
        confined_dirs.append(storage.join(root, f".grow-v{version}"))
    confined_moves = []
    for src, dst in moves:
        parent, name = _split(src)
        root = staging.get(parent) if name else None
        if root is None:
            raise refuse(src, f"which is not a file directly inside {where}")
        if _key(dst) != _key(storage.join(root, name)):
            raise refuse(dst, f"which is not where its staged file {src} goes ({storage.join(root, name)})")
        confined_moves.append([storage.join(root, f".grow-v{version}", name), storage.join(root, name)])
    return confined_moves, confined_dirs


def _key(url: str) -> tuple[str, ...]:
    """A URL as comparable components: a local path absolute and normalised; others as written (scheme, then
    the path's components), refused when they hold ``.`` or ``..`` components (stores differ on their meaning)."""
    if storage.is_local(url):
        return ("", *os.path.abspath(storage.local_path(url)).split(os.sep))
    scheme = storage.scheme_of(url)
    parts = url.split("://", 1)[1].rstrip("/").split("/") if scheme else [url]
    if any(part in (".", "..") for part in parts):
        return ("<refused>", url)  # matches no root's staging directory
    return (scheme, *parts)


def _split(url: str) -> tuple[tuple[str, ...], str]:
    """The key of a file's directory, and the file's name ('' when the URL does not end in a plain name)."""
    key = _key(url)
    name = key[-1] if len(key) > 1 else ""
    if name in ("", ".", "..") or key[0] == "<refused>" or url.endswith("/"):
        return key, ""
    return key[:-1], name


def recorded_inputs(url: str, config_json: str) -> GrowInputs:
    """The input locations the journal's own ``config_json`` records (for a caller without a config)."""
    try:
        return GrowInputs.of(json.loads(config_json))
    except CheckpointError as err:
        raise CheckpointError(f"{url}: {err}") from None
