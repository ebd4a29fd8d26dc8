"""How relation ids map to entity types and buckets, derived from the config once per import."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from job.config import ConfigSchema


@dataclass
class Plan:
    """The config's entity types and relations as the arrays the passes index with."""

    type_names: list[str]
    dynamic: bool
    relation_ids: dict[str, int]  # config relation name -> index (static relations)
    lhs_type: np.ndarray  # per static relation id: index into type_names
    rhs_type: np.ndarray
    parts_lhs: int
    parts_rhs: int


def make_plan(config: ConfigSchema) -> Plan:
    type_names = list(config.entities)
    index = {name: i for i, name in enumerate(type_names)}
    relation_ids: dict[str, int] = {}
    for i, relation in enumerate(config.relations):
        relation_ids.setdefault(relation.name, i)
    lhs_type = np.array([index[r.lhs] for r in config.relations], dtype=np.int64)
    rhs_type = np.array([index[r.rhs] for r in config.relations], dtype=np.int64)
    # As in PBG, each side has as many partitions as its most partitioned entity type.
    parts_lhs = max(config.entities[r.lhs].num_partitions for r in config.relations)
    parts_rhs = max(config.entities[r.rhs].num_partitions for r in config.relations)
    return Plan(type_names, config.dynamic_relations, relation_ids, lhs_type, rhs_type, parts_lhs, parts_rhs)
