"""Where the pods of one import leave their pieces for each other, and how they know a piece is complete.

Every unit of work (a shard read, a partition's dictionary, a bucket file) writes its files first
and a small JSON marker under ``done/`` last, as the checkpoint code commits a version: a unit
without its marker is redone from scratch on the next run, so a file left half-written by a pod
that died is never taken as done. A pod waits for other pods' units by listing ``done/`` (one
LIST a poll, however many units), and gives up at once if a pod recorded a bad input in
``DIGEST.failed.json``: the others would otherwise wait for a unit that can never be done.

The staging directory is named by a fingerprint of everything that decides the output (inputs
with their sizes and versions, options, the config's graph and paths), so a rerun of the same
import resumes and a changed one starts clean beside it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Iterable
from dataclasses import asdict
from typing import Any

import storage_adapters as storage
from job.config import ConfigSchema
from job.data.importing.options import ImportOptions, ImportSummary
from job.errors import UserError

logger = logging.getLogger("biggraph")

IMPORT_MARKER = ".biggraph-import.json"  # in entity_path, last of all: this import is complete
STAGING_DIR = ".import-staging"  # default staging root, under entity_path
_OUTPUT_OPTIONS = ("lhs_col", "rhs_col", "rel_col", "input_format", "delimiter", "header", "skip_bad_rows", "seed",
                   "entity_min_count", "relation_type_min_count", "shard_size")


def _version(url: str) -> str:
    info = storage.info(url)
    for key in ("ETag", "etag", "mtime", "LastModified", "last_modified", "created"):
        if info.get(key) is not None:
            return str(info[key])
    return ""


def input_versions(files: list[str]) -> list[tuple[int, str]]:
    """(size, version tag) of each input: a file rewritten in place must not resume a stale import."""
    return [(storage.size(url), _version(url)) for url in files]


def fingerprint(config: ConfigSchema, files: list[str], versions: list[tuple[int, str]], options: ImportOptions) -> str:
    """A digest of everything the import's output depends on (not the number of pods)."""
    chosen = asdict(options)
    graph = {
        "entities": {name: entity.num_partitions for name, entity in config.entities.items()},
        "relations": [[r.name, r.lhs, r.rhs] for r in config.relations],
        "dynamic_relations": bool(config.dynamic_relations),
        "entity_path": config.entity_path,
        "edge_paths": list(config.edge_paths),
    }
    described = {
        "format": "biggraph-import/1",
        "inputs": [[url, size, tag] for url, (size, tag) in zip(files, versions)],
        "options": {key: chosen[key] for key in _OUTPUT_OPTIONS},
        "graph": graph,
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:20]


class Staging:
    """The staging directory of one import (``root`` is per fingerprint)."""

    def __init__(self, root: str, failure_url: str | None = None) -> None:
        self.root = root.rstrip("/")
        self.done_dir = storage.join(self.root, "done")
        # a bad input is one whatever the pod count: recorded beside the per-count directories when given
        self.failure_url = failure_url or storage.join(self.root, "failed.json")

    def url(self, *parts: str) -> str:
        return storage.join(self.root, *parts)

    def marker(self, unit: str) -> str:
        return storage.join(self.done_dir, f"{unit}.json")

    def is_done(self, unit: str) -> bool:
        return storage.exists(self.marker(unit))

    def commit(self, unit: str, record: dict[str, Any]) -> None:
        """Mark ``unit`` done; called only after every file of the unit is written."""
        storage.write_text(self.marker(unit), json.dumps(record, sort_keys=True))

    def read(self, units: Iterable[str]) -> list[dict[str, Any]]:
        """The markers of ``units`` (all must be committed)."""
        names = list(units)
        found = storage.read_many([self.marker(u) for u in names])
        records = []
        for unit, data in zip(names, found):
            if data is None:
                raise RuntimeError(f"import staging {self.root}: marker of {unit} vanished")
            records.append(json.loads(data))
        return records

    def fail(self, error: UserError, pod: int) -> None:
        """Record a bad input so that the other pods stop waiting (and report the same cause)."""
        storage.write_text(self.failure_url, json.dumps({"pod": pod, "message": str(error)}))

    def failure(self) -> str | None:
        try:
            return str(json.loads(storage.read_text(self.failure_url))["message"])
        except FileNotFoundError:
            return None

    def wait_for(self, units: list[str], what: str, poll: float = 0.5, max_poll: float = 5.0) -> None:
        """Block until every unit is committed (other pods' work), or raise the failure a pod recorded."""
        wanted = {f"{u}.json" for u in units}
        logged = False
        while True:
            missing = wanted - set(storage.listdir(self.done_dir))
            if not missing:
                return
            failure = self.failure()
            if failure is not None:
                raise UserError(failure)
            if not logged:
                logger.info("import: waiting for %d of %d %s (other pods)", len(missing), len(wanted), what)
                logged = True
            time.sleep(poll)
            poll = min(max_poll, poll * 1.5)

    def remove(self) -> None:
        """Remove this import's pieces, and the default staging root too once no other import's are left in it
        (a root the user named is left alone: it may be a bucket)."""
        storage.remove(self.root)
        parent = self.root.rsplit("/", 1)[0]
        if parent.endswith("/" + STAGING_DIR) and not storage.listdir(parent):
            storage.remove(parent)


def default_staging_root(config: ConfigSchema) -> str:
    return storage.join(config.entity_path, STAGING_DIR)


def import_marker(config: ConfigSchema) -> str:
    return storage.join(config.entity_path, IMPORT_MARKER)


def already_imported(config: ConfigSchema, digest: str) -> bool:
    """Whether ``entity_path`` holds a complete import of exactly this request (a resubmit skips it)."""
    try:
        return bool(json.loads(storage.read_text(import_marker(config))).get("fingerprint") == digest)
    except (FileNotFoundError, ValueError, AttributeError):
        return False


def write_import_marker(config: ConfigSchema, digest: str, summary: ImportSummary) -> None:
    """The last file of an import: what was imported (for a resubmit to skip) and its summary."""
    record = {key: value for key, value in asdict(summary).items() if key != "seconds"}
    storage.write_text(import_marker(config), json.dumps({"fingerprint": digest, "summary": record}, sort_keys=True))


def summary_of_marker(config: ConfigSchema) -> ImportSummary:
    """The summary an earlier run of this import recorded (its time excluded)."""
    record = json.loads(storage.read_text(import_marker(config))).get("summary") or {}
    return ImportSummary(**record)
