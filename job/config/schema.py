"""The schema: PBG's ``ConfigSchema`` key for key, plus a few keys of ours, each with its help text.

Every field carries its help string in ``metadata["help"]`` so that ``biggraph config-help``
and the generated reference stay in sync with the code. The checks that span several keys
live in ``job.config.checks``. The keys themselves are declared in three groups by concern, which
``ConfigSchema`` inherits in PBG's order: ``schema_model`` (model and data), ``schema_training`` (the
training loop, evaluation, validation) and ``schema_runtime`` (distributed options and biggraph's additions).
The keys of each entity and relation type (``EntitySchema``, ``RelationSchema``) are in
``job.config.graph_schema``, re-exported here.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, ClassVar

from job.config.base import parse_bytes, to_plain
from job.config.checks import validate_config
from job.config.graph_schema import EntitySchema, RelationSchema
from job.config.pbg import to_pbg_dict
from job.config.schema_model import ModelKeys
from job.config.schema_runtime import RuntimeKeys
from job.config.schema_training import TrainingKeys

__all__ = ["ConfigSchema", "EntitySchema", "RelationSchema"]


@dataclass(kw_only=True)
class ConfigSchema(RuntimeKeys, TrainingKeys, ModelKeys):
    """The whole training configuration (every key of PBG's ConfigSchema, plus a few of ours).

    Dataclass fields are collected from the bases in reverse MRO order: ModelKeys', TrainingKeys', then
    RuntimeKeys' keys, which is PBG's order (``config.json`` and ``config-help`` list them so)."""

    # parsed once by __post_init__ (per instance; not a config key, so not a dataclass field)
    _memory_budget_bytes: ClassVar[int | None] = None

    def __post_init__(self) -> None:
        """Refuse impossible values and combinations now, naming the key (see ``job.config.checks``), and parse
        what has a typed form once (sizes in bytes), so that no reader parses it again."""
        budget = parse_bytes(self.memory_budget, "memory_budget") if self.memory_budget is not None else None
        object.__setattr__(self, "_memory_budget_bytes", budget)
        validate_config(self)

    @property
    def memory_budget_bytes(self) -> int | None:
        """``memory_budget`` in bytes (None: no budget)."""
        return self._memory_budget_bytes

    # Derived values -----------------------------------------------------------------

    @property
    def num_partitions(self) -> int:
        """The broadcast number of partitions (what buckets range over)."""
        return max(e.num_partitions for e in self.entities.values())

    def entity_dimension(self, entity_type: str) -> int:
        """The embedding dimension of one entity type (its own, else the global one)."""
        return self.entities[entity_type].dimension or self.dimension

    def init_std(self, entity_type: str, num_entities: int) -> float:
        """The standard deviation of a fresh embedding of ``entity_type`` (``num_entities``: over all partitions,
        so that partitioning a graph does not change its initialisation)."""
        if self.init_method == "xavier":
            return math.sqrt(2.0 / (num_entities + self.entity_dimension(entity_type)))
        return self.init_scale

    def wants_cuda(self) -> bool:
        """Whether the config asks for a GPU (``device: cuda``, or ``auto`` with ``num_gpus > 0``)."""
        return self.device == "cuda" or (self.device == "auto" and self.num_gpus > 0)

    def effective_workers(self) -> int:
        """The number of Hogwild workers: ``workers``, else one per CPU."""
        return self.workers if self.workers is not None else (os.cpu_count() or 1)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict with PBG's key names (what config.json holds)."""
        return to_plain(self)

    def to_json(self, exclude: tuple[str, ...] = ()) -> str:
        """``to_dict()`` as indented JSON, less the ``exclude`` keys."""
        data = self.to_dict()
        for key in exclude:
            data.pop(key, None)
        return json.dumps(data, indent=4)

    def to_pbg_dict(self) -> dict[str, Any]:
        """``to_dict()`` without the keys PBG 1.0.0's ``ConfigSchema`` lacks.

        PBG's ``ConfigSchema.from_dict`` rejects unknown keys, so a ``config.json`` holding our
        additions (``seed``, ``device``...) or keys of later PBG versions (``regularization_coef``,
        ``num_gpus``...) cannot be read by PBG 1.0.0's ``CheckpointManager.read_config``. The
        dropped values must be kept elsewhere (e.g. the ``config/json`` metadata attribute).
        """
        return to_pbg_dict(self.to_dict())

    def to_pbg_json(self) -> str:
        """What ``config.json`` must hold for PBG 1.0.0 to read the checkpoint's config."""
        return json.dumps(self.to_pbg_dict(), indent=4)
