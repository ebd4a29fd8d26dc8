"""What an import is asked to do (``ImportOptions``), what it did (``ImportSummary``), and the up-front checks.

Kept free of the heavy parts of the importer so that the command line (and ``biggraph grow``,
which reads new edges with the same options) can build and check a request cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

import storage_adapters as storage
from job.errors import UserError

if TYPE_CHECKING:
    from job.config import ConfigSchema

FORMATS = ("tsv", "csv", "parquet")
ID_DTYPE = np.int32  # spilled entity / relation ids; 2^31 distinct ids per type is far beyond any names file


@dataclass
class ImportOptions:
    """Everything that controls an import besides the config (the CLI flags)."""

    lhs_col: int
    rhs_col: int
    rel_col: int | None = None
    input_format: str = "auto"
    delimiter: str | None = None
    header: bool = False
    skip_bad_rows: bool = False
    seed: int = 0
    block_size: int = 8 << 20
    entity_min_count: int = 1
    relation_type_min_count: int = 1
    tmp_dir: str | None = None
    progress_every: int = 5_000_000
    shard_size: int = 256 << 20  # bytes of uncompressed TSV per shard (0: whole files); never changes the output
    group_size: int = 1 << 30  # input bytes a pod reads with one entity table (``shards.Group``); nor does this


@dataclass
class ImportSummary:
    """What an import did, for the final report line and for tests."""

    edges_read: int = 0
    edges_written: int = 0
    malformed_rows: int = 0
    empty_id_rows: int = 0
    unknown_relation_rows: int = 0
    filtered_edges: int = 0
    entities: dict[str, int] = field(default_factory=dict)
    relations: int = 0
    seconds: float = 0.0

    @property
    def skipped_rows(self) -> int:
        return self.malformed_rows + self.empty_id_rows + self.unknown_relation_rows

    def describe(self) -> str:
        rate = self.edges_read / self.seconds if self.seconds > 0 else 0.0
        entities = ", ".join(f"{name}={count:,}" for name, count in self.entities.items())
        text = (
            f"imported {self.edges_written:,} edges ({self.edges_read:,} rows read) in {self.seconds:.1f} s "
            f"({rate:,.0f} edges/s); entities: {entities}; relation types: {self.relations:,}"
        )
        if self.skipped_rows:
            text += (
                f"; skipped {self.skipped_rows:,} bad rows ({self.malformed_rows:,} malformed, "
                f"{self.empty_id_rows:,} with an empty id, {self.unknown_relation_rows:,} with an unknown relation)"
            )
        if self.filtered_edges:
            text += f"; dropped {self.filtered_edges:,} edges below --entity-min-count/--relation-type-min-count"
        return text


def check_request(config: ConfigSchema, files: list[str], options: ImportOptions) -> None:
    """Refuse, before any reading, a request that cannot succeed: option values, the config, missing inputs."""
    if len(files) != len(config.edge_paths):
        raise UserError(
            f"got {len(files)} input file(s) but the config's edge_paths lists {len(config.edge_paths)} "
            f"({', '.join(config.edge_paths)}); the i-th file is written to the i-th edge path"
        )
    for flag, col in (("--lhs-col", options.lhs_col), ("--rhs-col", options.rhs_col), ("--rel-col", options.rel_col)):
        if col is not None and col < 0:
            raise UserError(f"{flag} must be a column index >= 0, got {col}")
    if options.entity_min_count < 1 or options.relation_type_min_count < 1:
        raise UserError("--entity-min-count and --relation-type-min-count must be >= 1")
    if options.shard_size < 0:
        raise UserError("--shard-size must be >= 0 (0: one shard per file)")
    if options.block_size < 1 << 10:
        raise UserError("--block-size must be at least 1 (MiB)")
    if config.dynamic_relations and options.rel_col is None:
        raise UserError("the config has dynamic_relations enabled, so --rel-col is required")
    featurized = [name for name, entity in config.entities.items() if entity.featurized]
    if featurized:
        raise UserError(f"entity type(s) {', '.join(featurized)} are featurized; import only handles plain entities")
    for url in files:
        _check_input(url)


def _check_input(url: str) -> None:
    try:
        present = storage.exists(url) and not storage.isdir(url)
    except UserError:
        raise
    except Exception as err:  # any backend error means we cannot read it
        raise UserError(f"input file {url}: cannot be accessed ({err})") from None
    if not present:
        raise UserError(f"input file {url}: not found")
