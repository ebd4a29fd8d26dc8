"""Reading a committed checkpoint for export: one partition at a time, joined with its entity names.

Memory stays bounded by one partition: ``iter_partitions`` yields each partition's names and
embeddings and drops them before reading the next. ``CheckpointReader`` opens the checkpoint
for this command only (the checkpoint layer's own readers serve training).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import storage_adapters as storage
from job.errors import CheckpointError, InputFormatError, UserError
from job.formats import entities
from job.formats.committed import open_committed

logger = logging.getLogger("biggraph.export")

# Order in which PBG's operators declare their parameters (what ``named_parameters``
# yields, hence the row order of PBG's relation TSV); unknown names go last, sorted.
_PARAM_ORDER = (
    "linear_transformation", "linear_transformations", "translation", "translations",
    "diagonal", "diagonals", "real", "imag",
)
_RELATION_PARAM_RE = re.compile(r"^relations/(?P<idx>\d+)/operator/(?P<side>lhs|rhs)/(?P<param>[^/]+)$")
_GLOBAL_EMB_RE = re.compile(r"^entities/(?P<type>.+)/global_embedding$")


class ExportError(UserError):
    """The export cannot run: no checkpoint, inconsistent names, unwritable output."""


@dataclass
class RelationParam:
    """One relation operator parameter, for one relation type (dynamic ones are split per type)."""

    relation: str
    side: str
    operator: str
    param: str
    values: np.ndarray
    index: int  # the relation type id (position in config.relations or in the dynamic list)


@dataclass
class PartitionInfo:
    entity_type: str
    partition: int
    start: int
    rows: int
    names_source: str  # "names file" or "generated"


@dataclass
class ExportSummary:
    """What was written, for the CLI message and ``manifest.json``."""

    version: int
    format: str
    files: list[str] = field(default_factory=list)
    partitions: list[PartitionInfo] = field(default_factory=list)
    generated_names: list[str] = field(default_factory=list)  # "type/part" without a names file
    global_emb_added: list[str] = field(default_factory=list)
    dimension: dict[str, int] = field(default_factory=dict)

    def manifest(self) -> dict[str, Any]:
        return {
            "checkpoint_version": self.version,
            "format": self.format,
            "global_embedding_added": self.global_emb_added,
            "dimension": self.dimension,
            "partitions": [
                {"entity_type": p.entity_type, "partition": p.partition, "start": p.start, "rows": p.rows,
                 "names": p.names_source}
                for p in self.partitions
            ],
            "files": [url.rsplit("/", 1)[-1] for url in self.files],
        }


class CheckpointReader:
    """The committed (or a chosen) version of a checkpoint, read one partition at a time."""

    def __init__(self, config: Any, version: int | None = None) -> None:
        # job.growing loads torch: not at import (`import job.cli` stays torch-free, tests/test_api.py)
        from job.growing.journal import finish_committed_grow
        from job.growing.journal_checks import GrowInputs

        self.config = config
        # a grown version's input, if a crash left it unpublished (the journal confined to this config's input)
        finish_committed_grow(config.checkpoint_path, inputs=GrowInputs.of(config))
        committed = open_committed(config.checkpoint_path, version)
        self.storage, self.version = committed.checkpoint, committed.version
        self._model: dict[str, np.ndarray] | None = None

    def model_params(self) -> dict[str, np.ndarray]:
        """The shared parameters (public names); empty when the version has no model file."""
        if self._model is None:
            if self.storage.has_model(self.version):
                self._model, _, _ = self.storage.load_model(self.version)
            else:
                self._model = {}
        return self._model

    def global_embedding(self, entity_type: str) -> np.ndarray | None:
        return self.model_params().get(f"entities/{entity_type}/global_embedding")

    def partition(self, entity_type: str, partition: int) -> np.ndarray:
        if not self.storage.has_entity_partition(self.version, entity_type, partition):
            raise CheckpointError(
                f"{self.storage.partition_file(self.version, entity_type, partition)}: missing "
                f"(checkpoint version {self.version} should hold every partition of '{entity_type}')"
            )
        embeddings, _ = self.storage.load_entity_partition(self.version, entity_type, partition)
        return embeddings

    def relation_params(self) -> list[RelationParam]:
        """Operator parameters in PBG's export order (see ``make_tsv_for_relation_types``)."""
        config = self.config
        found: dict[tuple[int, str], dict[str, np.ndarray]] = {}
        for name, array in self.model_params().items():
            match = _RELATION_PARAM_RE.match(name)
            if match:
                found.setdefault((int(match["idx"]), match["side"]), {})[match["param"]] = np.asarray(array)

        def ordered(params: dict[str, np.ndarray]) -> list[tuple[str, np.ndarray]]:
            rank = {p: i for i, p in enumerate(_PARAM_ORDER)}
            return sorted(params.items(), key=lambda kv: (rank.get(kv[0], len(rank)), kv[0]))

        out: list[RelationParam] = []
        if config.dynamic_relations:
            operator = config.relations[0].operator
            names = self._dynamic_relation_names()
            for side in ("lhs", "rhs"):
                for param, stacked in ordered(found.get((0, side), {})):
                    if names is None:
                        names = [f"rel_{i}" for i in range(stacked.shape[0])]
                    if stacked.shape[0] != len(names):
                        raise ExportError(
                            f"model parameter relations/0/operator/{side}/{param} has {stacked.shape[0]} rows but "
                            f"there are {len(names)} dynamic relation names"
                        )
                    for idx, rel_name in enumerate(names):
                        out.append(RelationParam(rel_name, side, operator, param, stacked[idx], idx))
            return out
        for idx, relation in enumerate(config.relations):
            for side in ("lhs", "rhs"):
                for param, values in ordered(found.get((idx, side), {})):
                    out.append(RelationParam(relation.name, side, relation.operator, param, values, idx))
        return out

    def _dynamic_relation_names(self) -> list[str] | None:
        url = entities.dynamic_rel_names_file(self.config.entity_path)
        if not storage.exists(url):
            logger.warning("%s is missing: dynamic relation types are named rel_0, rel_1, ...", url)
            return None
        return entities.read_dynamic_rel_names(self.config.entity_path)


def _names_for(config: Any, entity_type: str, partition: int, rows: int, emb_url: str) -> tuple[list[str], str]:
    """The names of a partition's rows, or generated ``{type}_{part}_{offset}`` ids when no names file exists."""
    if not entities.has_entity_names(config.entity_path, entity_type, partition):
        return [f"{entity_type}_{partition}_{offset}" for offset in range(rows)], "generated"
    names = entities.read_entity_names(config.entity_path, entity_type, partition)
    if len(names) != rows:
        raise InputFormatError(
            entities.names_file(config.entity_path, entity_type, partition),
            f"holds {len(names)} names but {emb_url} has {rows} embedding rows",
            expected="one name per embedding row (was the entity path re-imported after training?)",
        )
    return names, "names file"


def iter_partitions(
    reader: CheckpointReader, summary: ExportSummary, add_global: bool
) -> Iterator[tuple[str, int, list[str], np.ndarray]]:
    """Yield (type, partition, names, embeddings) one partition at a time, in config order."""
    config = reader.config
    for entity_type, schema in config.entities.items():
        global_emb = reader.global_embedding(entity_type) if add_global else None
        if global_emb is not None:
            summary.global_emb_added.append(entity_type)
        start = 0
        for partition in range(schema.num_partitions):
            embeddings = reader.partition(entity_type, partition)
            if global_emb is not None:
                embeddings += global_emb.astype(np.float32)
            url = reader.storage.partition_file(reader.version, entity_type, partition)
            names, source = _names_for(config, entity_type, partition, embeddings.shape[0], url)
            if source == "generated":
                summary.generated_names.append(f"{entity_type}/{partition}")
            summary.dimension.setdefault(entity_type, int(embeddings.shape[1]))
            if embeddings.shape[1] != summary.dimension[entity_type]:
                raise InputFormatError(
                    url, f"has dimension {embeddings.shape[1]}", dataset="embeddings",
                    expected=f"{summary.dimension[entity_type]} like the other partitions of '{entity_type}'",
                )
            summary.partitions.append(PartitionInfo(entity_type, partition, start, embeddings.shape[0], source))
            start += embeddings.shape[0]
            yield entity_type, partition, names, embeddings
            del embeddings, names
