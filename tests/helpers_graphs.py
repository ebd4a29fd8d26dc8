"""Small, valid v1 graph directories for tests (entity counts, bucket files and a JSON config).

Tests of ``validate``, ``train`` and friends need a graph on disk that is correct in every
respect, so that each test can break exactly one thing and check the message about it.
The graph is deterministic (seeded) and tiny, so writing it costs a few milliseconds.

``line_graph`` / ``save_line_checkpoint``: three entities on a line whose ranks a test can work out by
hand (evaluation metrics, reciprocal relations, presets).

``write_cycle_graph``: a graph a model can learn (relation r links i to i + r + 1 mod n), the training
tests' workhorse (tests/test_train_*.py and many others); ``pass_losses`` and ``assert_same_run`` read and
compare what such a run wrote. ``BIGGRAPH_TEST_DEVICE=cuda`` (``TEST_DEVICE``) trains these graphs on the GPU.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from job.formats.checkpoint import CheckpointStorage
from job.formats.edges import edges_file, write_edges
from job.formats.entities import write_dynamic_rel_count, write_entity_count


@dataclass
class SmallGraph:
    """Where a written graph lives and what it holds (to compute expected values in tests)."""

    root: Path
    config_path: Path
    config: dict[str, Any]
    entity_path: Path
    edge_path: Path
    counts: dict[str, list[int]]
    edges: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=dict)

    def bucket_file(self, lhs: int, rhs: int) -> Path:
        return Path(edges_file(str(self.edge_path), lhs, rhs))

    def count_file(self, entity_type: str, partition: int) -> Path:
        return self.entity_path / f"entity_count_{entity_type}_{partition}.txt"

    def write_config(self, **changes: Any) -> Path:
        """Rewrite the config file with some top-level keys changed."""
        self.config.update(changes)
        self.config_path.write_text(json.dumps(self.config, indent=2))
        return self.config_path


def base_config(root: Path, entities: dict[str, int], relations: list[tuple[str, str, str]], **extra: Any) -> dict[str, Any]:
    """A PBG-style config dict for entity types {name: num_partitions} and (name, lhs, rhs) relations."""
    config: dict[str, Any] = {
        "entities": {name: {"num_partitions": parts} for name, parts in entities.items()},
        "relations": [{"name": name, "lhs": lhs, "rhs": rhs, "operator": "none"} for name, lhs, rhs in relations],
        "dimension": 4,
        "entity_path": str(root / "entities"),
        "edge_paths": [str(root / "edges")],
        "checkpoint_path": str(root / "checkpoints"),
        "num_epochs": 1,
        "workers": 1,
    }
    config.update(extra)
    return config


def make_graph(
    root: Path,
    *,
    entities: dict[str, int] | None = None,
    relations: list[tuple[str, str, str]] | None = None,
    counts: dict[str, list[int]] | None = None,
    edges_per_bucket: int = 20,
    dynamic_rel_count: int | None = None,
    seed: int = 0,
    **config_extra: Any,
) -> SmallGraph:
    """Write a valid graph under ``root`` and return where everything is.

    Defaults: ``user`` (2 partitions) and ``item`` (2 partitions), relations ``buys``
    (user -> item) and ``follows`` (user -> user), 20 edges per bucket. With
    ``dynamic_rel_count`` set, the config uses dynamic relations over the single
    first relation and rel ids range over that count.
    """
    entities = entities or {"user": 2, "item": 2}
    relations = relations or [("buys", "user", "item"), ("follows", "user", "user")]
    if dynamic_rel_count is not None:
        relations = relations[:1]
        config_extra.setdefault("dynamic_relations", True)
        config_extra.setdefault("global_emb", False)
    rng = np.random.default_rng(seed)
    if counts is None:
        counts = {name: [int(rng.integers(3, 9)) for _ in range(parts)] for name, parts in entities.items()}
    config = base_config(root, entities, relations, **config_extra)
    entity_path = root / "entities"
    edge_path = root / "edges"
    entity_path.mkdir(parents=True, exist_ok=True)
    edge_path.mkdir(parents=True, exist_ok=True)
    for name, per_part in counts.items():
        for part, count in enumerate(per_part):
            write_entity_count(str(entity_path), name, part, count)
    if dynamic_rel_count is not None:
        write_dynamic_rel_count(str(entity_path), dynamic_rel_count)

    def side_parts(side: int) -> int:
        parts = {entities[rel[side]] for rel in relations} - {1}
        return max(parts, default=1)

    graph = SmallGraph(root, root / "config.json", config, entity_path, edge_path, counts)
    num_rel_ids = dynamic_rel_count if dynamic_rel_count is not None else len(relations)
    for lhs_part in range(side_parts(1)):
        for rhs_part in range(side_parts(2)):
            rel = rng.integers(0, max(num_rel_ids, 1), size=edges_per_bucket)
            lhs = np.empty(edges_per_bucket, dtype=np.int64)
            rhs = np.empty(edges_per_bucket, dtype=np.int64)
            for i, rel_id in enumerate(rel):
                _, lhs_type, rhs_type = relations[0 if dynamic_rel_count is not None else int(rel_id)]
                lhs_limit = counts[lhs_type][lhs_part if entities[lhs_type] > 1 else 0]
                rhs_limit = counts[rhs_type][rhs_part if entities[rhs_type] > 1 else 0]
                lhs[i] = rng.integers(0, lhs_limit)
                rhs[i] = rng.integers(0, rhs_limit)
            write_edges(edges_file(str(edge_path), lhs_part, rhs_part), rel, lhs, rhs)
            graph.edges[(lhs_part, rhs_part)] = (rel, lhs, rhs)
    graph.write_config()
    return graph


def line_graph(root: Path, operator: str = "none", **extra: Any) -> dict[str, Any]:
    """A config dict over three entities (type ``e``, one partition) and two edges 0 -> 1 and 1 -> 2 of
    relation ``r`` (with ``operator``), dimension 1, ``dot`` comparator, no global embedding: with the
    embeddings 1, 2, 3 of ``save_line_checkpoint`` every score is a product a test can rank by hand.
    ``extra``: top-level config keys added or replaced."""
    entity_path = root / "entities"
    edge_path = root / "edges"
    write_entity_count(str(entity_path), "e", 0, 3)
    write_edges(edges_file(str(edge_path), 0, 0), np.array([0, 0]), np.array([0, 1]), np.array([1, 2]))
    raw: dict[str, Any] = {
        "entities": {"e": {"num_partitions": 1}},
        "relations": [{"name": "r", "lhs": "e", "rhs": "e", "operator": operator}],
        "dimension": 1, "global_emb": False, "comparator": "dot",
        "entity_path": str(entity_path), "edge_paths": [str(edge_path)], "checkpoint_path": str(root / "ckpt"),
    }
    raw.update(extra)
    return raw


def save_line_checkpoint(checkpoint_path: str, params: dict[str, tuple[str, np.ndarray]] | None = None) -> None:
    """Version 1 of a ``line_graph`` checkpoint: embeddings 1, 2, 3 and the model parameters ``params``
    (``CheckpointStorage.save_model``'s form; none by default)."""
    storage = CheckpointStorage(checkpoint_path)
    storage.prepare()
    storage.save_entity_partition(1, "e", 0, np.array([[1.0], [2.0], [3.0]], dtype=np.float32))
    storage.save_model(1, params or {})
    storage.save_version(1)


# BIGGRAPH_TEST_DEVICE=cuda trains the graphs written here on the GPU (tests/test_cuda.py: the CUDA-only tests)
TEST_DEVICE = os.environ.get("BIGGRAPH_TEST_DEVICE", "auto")


def write_cycle_files(entity_path: str, edge_path: str, num_entities: int, num_partitions: int,
                      num_relations: int) -> None:
    """The cycle graph's entity counts and bucket files at any path or URL: relation r links entity i to
    i + r + 1 (mod n); entities spread over partitions at random (seeded)."""
    rng = np.random.default_rng(0)
    part_of = rng.integers(0, num_partitions, num_entities)
    offset_of = np.zeros(num_entities, dtype=np.int64)
    counts = [0] * num_partitions
    for entity in range(num_entities):
        offset_of[entity] = counts[part_of[entity]]
        counts[part_of[entity]] += 1
    for part, count in enumerate(counts):
        write_entity_count(entity_path, "node", part, count)
    heads = np.repeat(np.arange(num_entities), num_relations)
    rels = np.tile(np.arange(num_relations), num_entities)
    tails = (heads + rels + 1) % num_entities
    for lhs_part in range(num_partitions):
        for rhs_part in range(num_partitions):
            sel = (part_of[heads] == lhs_part) & (part_of[tails] == rhs_part)
            write_edges(edges_file(edge_path, lhs_part, rhs_part), rels[sel], offset_of[heads[sel]], offset_of[tails[sel]])


def write_cycle_graph(root: Path, num_entities: int = 40, num_partitions: int = 1, num_relations: int = 2,
                      dynamic: bool = False, **config: Any) -> dict[str, Any]:
    """A learnable graph (``write_cycle_files``) under ``root``, and a config dict to train it."""
    entity_path = root / "entities"
    edge_path = root / "edges"
    write_cycle_files(str(entity_path), str(edge_path), num_entities, num_partitions, num_relations)
    if dynamic:
        write_dynamic_rel_count(str(entity_path), num_relations)
    relations = [{"name": "all", "lhs": "node", "rhs": "node", "operator": "translation"}] if dynamic else [
        {"name": f"r{r}", "lhs": "node", "rhs": "node", "operator": "translation"} for r in range(num_relations)
    ]
    raw: dict[str, Any] = {
        "entities": {"node": {"num_partitions": num_partitions}},
        "relations": relations,
        "dynamic_relations": dynamic,
        "global_emb": not dynamic,
        "dimension": 16,
        "entity_path": str(entity_path),
        "edge_paths": [str(edge_path)],
        "checkpoint_path": str(root / "checkpoints"),
        "num_epochs": 10,
        "batch_size": 20,
        "num_batch_negs": 10,
        "num_uniform_negs": 10,
        "lr": 0.1,
        "eval_fraction": 0.0,
        "workers": 1,
        "seed": 3,
        "init_scale": 0.1,
        "hogwild_delay": 0,
        "device": TEST_DEVICE,
    }
    raw.update(config)
    return raw


def assert_same_run(a: np.ndarray, b: np.ndarray) -> None:
    """Two runs that must compute the same: bit for bit on the CPU; on a GPU up to the order of its atomic
    additions (index_add_ sums a row's gradients in whatever order the threads arrive)."""
    if TEST_DEVICE == "cuda":
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    else:
        np.testing.assert_array_equal(a, b)


def pass_losses(checkpoint_path: str) -> list[float]:
    """The training loss of each committed pass, in order (from training_stats.json's pass summaries)."""
    stats = CheckpointStorage(checkpoint_path).load_stats()
    return [s["stats"]["metrics"]["loss"] for s in stats if s.get("pass_summary")]
