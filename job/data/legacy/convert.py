"""``convert_legacy``: the library entry point of ``biggraph convert-legacy``.

Entity path, edge paths and checkpoint may be converted in one call; the converted checkpoint's
config then points at the converted inputs, and its partitions are checked against the
converted entity counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from job.config import ConfigSchema
from job.data.legacy.checkpoint import convert_checkpoint
from job.data.legacy.inputs import convert_edges, convert_entities
from job.errors import UserError


@dataclass
class LegacyConversion:
    """What ``convert_legacy`` wrote."""

    entity_count_files: int = 0  # count files written (0 without an entity path)
    edge_files: list[tuple[str, int]] = field(default_factory=list)  # (new edge path, files written)
    checkpoint_version: int | None = None  # the v1 version written, None without a checkpoint


def convert_legacy(
    *,
    entities: tuple[str, str] | None = None,
    edges: list[tuple[str, str]] | None = None,
    checkpoint: tuple[str, str] | None = None,
    count_base: str = "auto",
    checkpoint_base: str = "auto",
    version: int | None = None,
    config: ConfigSchema | None = None,
) -> LegacyConversion:
    """Convert (old, new) pairs: a legacy entity path, edge paths (new == old edits in place) and a checkpoint.

    ``count_base``/``checkpoint_base``: "auto", "0" or "1", the partition numbering of the legacy files;
    ``version``: the legacy checkpoint version (default: CHECKPOINT_VERSION, else the newest);
    ``config``: a v1 config to store in the checkpoint instead of the mapped legacy one.
    """
    edges = edges or []
    if not (entities or edges or checkpoint):
        raise UserError("nothing to convert: give --entity-path, --edge-path and/or --checkpoint")
    if version is not None and checkpoint is None:
        raise UserError("--version applies to --checkpoint")
    result = LegacyConversion()
    counts = None
    if entities is not None:
        counts = convert_entities(entities[0], entities[1], count_base).counts
        result.entity_count_files = sum(len(c) for c in counts.values())
    for old, new in edges:
        result.edge_files.append((new, convert_edges(old, new)))
    if checkpoint is not None:
        rewrites: dict[str, Any] = {"checkpoint_path": checkpoint[1]}
        if entities is not None:
            rewrites["entity_path"] = entities[1]
        if edges:
            rewrites["edge_paths"] = dict(edges)
        result.checkpoint_version = convert_checkpoint(
            checkpoint[0], checkpoint[1], version=version, config=config, partition_base=checkpoint_base,
            path_rewrites=rewrites, expected_counts=counts,
        )
    return result
