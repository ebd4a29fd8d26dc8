"""The graph's types: ``EntitySchema`` (each value of ``entities``) and ``RelationSchema`` (each item of
``relations``), with their help texts.

Kept apart from ``ConfigSchema`` (``job.config.schema``), which holds them by these names: they describe the
graph being trained, one entry per type, while ``ConfigSchema`` holds the run's keys. Each checks only its own
keys; checks that span types (e.g. a relation naming an unknown entity type) live in ``job.config.checks``.
"""

from __future__ import annotations

from dataclasses import dataclass

from job.config.base import ConfigKeyError, field_help
from job.config.choices import OPERATORS


@dataclass
class EntitySchema:
    """One entity type."""

    num_partitions: int = field_help(
        "Number of partitions for this entity type. Set to 1 if unpartitioned. All "
        "partitioned entity types must have the same number of partitions."
    )
    featurized: bool = field_help(
        "Whether the entities of this type are represented as sets of features "
        "(an entity's embedding is the mean of its features' embeddings).",
        default=False,
    )
    dimension: int | None = field_help(
        "Dimension of this type's embeddings; defaults to the global `dimension`.",
        default=None,
    )
    frozen: bool = field_help(
        "Keep this type's embeddings and their row-wise Adagrad state fixed while training (PBG issue #270): "
        "its rows are still scored and drawn as negatives, but never updated, and neither is its global "
        "embedding. Typical use: a trained catalogue stays exactly as it is while new entities of other types "
        "are fitted to it (`biggraph grow`).",
        default=False,
    )

    def __post_init__(self) -> None:
        if self.num_partitions < 1:
            raise ConfigKeyError("num_partitions: must be a positive integer", ["num_partitions"])
        if self.dimension is not None and self.dimension < 1:
            raise ConfigKeyError("dimension: must be a positive integer", ["dimension"])


@dataclass
class RelationSchema:
    """One relation type; its index in `relations` is its id in the edge files."""

    name: str = field_help("A human-readable identifier for the relation type.")
    lhs: str = field_help("The type of the entities on the left-hand side of this relation.")
    rhs: str = field_help("The type of the entities on the right-hand side of this relation.")
    weight: float = field_help(
        "The weight that the loss of this relation gets multiplied by.", default=1.0
    )
    operator: str = field_help(
        "The transformation applied to the right-hand side embedding (and, with "
        f"dynamic relations, also to the left-hand side). One of {', '.join(OPERATORS)}.",
        default="none",
    )
    all_negs: bool = field_help(
        "If enabled, the negatives for (x, r, y) are all (x, r, z) for every z of "
        "the right-hand side entity type in the partition, instead of a sample.",
        default=False,
    )

    def __post_init__(self) -> None:
        if self.operator not in OPERATORS:
            raise ConfigKeyError(
                f"operator: unknown operator '{self.operator}' (expected one of {', '.join(OPERATORS)})", ["operator"]
            )
