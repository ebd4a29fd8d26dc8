"""The whole pipeline on a small real knowledge graph, on local files: what ``biggraph demo`` runs.

import (TSV -> PBG v1 layout) -> train (ComplEx, as PBG's FB15k example) -> filtered evaluation against every
entity -> export to TSV. It is the README's first command and the quickest way to see that an installation
works; it calls the same Python API a user's script would (``job.import_edges``, ``job.train``, ...).

The config it leaves behind (``config.yaml``) is the one to reuse: its ``edge_paths`` is the training split only,
so ``biggraph train demo-output/config.yaml`` trains on what the demo trained on. The import and the evaluation
use the same config with other ``edge_paths`` (the three splits; the test split).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any

import yaml

from job.config import ConfigSchema, parse_config
from job.data.datasets import dataset_dir
from job.data.export import export_checkpoint
from job.data.importing import ImportOptions, import_edges
from job.evaluation import evaluate
from job.train import train

logger = logging.getLogger("biggraph")
SPLITS = ("train", "valid", "test")


def demo_config(out: str, epochs: int = 25, workers: int | None = None) -> dict[str, Any]:
    """PBG's FB15k example config (ComplEx, dynamic relations, softmax), sized for a laptop; trains on ``train``."""
    config: dict[str, Any] = {
        "entity_path": os.path.join(out, "data"),
        "edge_paths": [os.path.join(out, "data", "train")],
        "checkpoint_path": os.path.join(out, "checkpoints"),
        "entities": {"all": {"num_partitions": 1}},
        "relations": [{"name": "all_edges", "lhs": "all", "rhs": "all", "operator": "complex_diagonal"}],
        "dynamic_relations": True,
        "dimension": 200,
        "global_emb": False,
        "comparator": "dot",
        "num_epochs": epochs,
        "num_uniform_negs": 1000,
        "loss_fn": "softmax",
        "lr": 0.1,
        "batch_size": 1000,
        "eval_fraction": 0.0,
        "seed": 0,
    }
    if workers is not None:
        config["workers"] = workers
    return config


@dataclass
class DemoResult:
    """Where the demo put things, and what it measured."""

    out: str
    config_path: str
    training: dict[str, Any]
    test_metrics: dict[str, Any]
    export_dir: str
    seconds: float


def run_demo(out: str = "demo-output", dataset: str = "umls", epochs: int = 25,
             workers: int | None = None) -> DemoResult:
    """Import ``dataset`` (umls, kinships or nations) into ``out``, train, evaluate on its test split, export."""
    started = time.perf_counter()
    out = os.path.abspath(out)
    for stale in ("data", "checkpoints", "export"):
        shutil.rmtree(os.path.join(out, stale), ignore_errors=True)
    os.makedirs(out, exist_ok=True)
    source = dataset_dir(dataset)
    raw = demo_config(out, epochs, workers)
    config_path = os.path.join(out, "config.yaml")
    with open(config_path, "w", encoding="utf-8") as handle:
        yaml.safe_dump(raw, handle, sort_keys=False)
    config = parse_config(raw)
    split_dirs = [os.path.join(out, "data", split) for split in SPLITS]

    logger.info("[1/4] importing %s from %s", dataset, source)
    import_edges(_with_edges(config, split_dirs), [os.path.join(source, f"{s}.txt") for s in SPLITS],
                 ImportOptions(lhs_col=0, rel_col=1, rhs_col=2))
    logger.info("[2/4] training (%d epochs)", epochs)
    training = train(config)
    logger.info("[3/4] filtered evaluation on the test split against every entity")
    metrics = evaluate(_with_edges(config, split_dirs[2:]), filter_paths=split_dirs, candidates="all")
    with open(os.path.join(out, "test_metrics.json"), "w", encoding="utf-8") as handle:
        json.dump(metrics, handle, indent=2)
    logger.info("[4/4] exporting embeddings to TSV")
    export_dir = os.path.join(out, "export")
    export_checkpoint(config, export_dir, fmt="tsv")
    return DemoResult(out, config_path, training, metrics, export_dir, time.perf_counter() - started)


def _with_edges(config: ConfigSchema, edge_paths: list[str]) -> ConfigSchema:
    return dataclasses.replace(config, edge_paths=list(edge_paths))
