"""``biggraph demo``: the whole pipeline on a small real knowledge graph, on local files.

import (TSV -> PBG v1 layout) -> train (ComplEx, as PBG's FB15k example) -> filtered
evaluation against every entity -> export to TSV. It is the README's first command
and the quickest way to see that an installation works.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import time
from typing import Any

logger = logging.getLogger("biggraph")


def demo_config(out: str, dataset: str, epochs: int, workers: int | None) -> dict[str, Any]:
    """PBG's FB15k example config (ComplEx, dynamic relations, softmax), sized for a laptop."""
    config: dict[str, Any] = {
        "entity_path": os.path.join(out, "data"),
        "edge_paths": [os.path.join(out, "data", split) for split in ("train", "valid", "test")],
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


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("demo", help="import, train, evaluate and export a small real graph (UMLS by default)")
    parser.add_argument("--dataset", default="umls", choices=("umls", "kinships", "nations"), help="which graph")
    parser.add_argument("--out", default="demo-output", help="output directory (default: ./demo-output)")
    parser.add_argument("--epochs", type=int, default=25, help="training epochs (default 25)")
    parser.add_argument("--workers", type=int, default=None, help="Hogwild workers (default: number of CPUs)")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import yaml

    from job.cli import main as cli_main
    from job.config import load_config
    from job.data.datasets import dataset_dir
    from job.evaluation import evaluate_command
    from job.train import train

    started = time.perf_counter()
    out = os.path.abspath(args.out)
    for stale in ("data", "checkpoints", "export"):
        shutil.rmtree(os.path.join(out, stale), ignore_errors=True)
    os.makedirs(out, exist_ok=True)
    source = dataset_dir(args.dataset)
    config_path = os.path.join(out, "config.yaml")
    with open(config_path, "w", encoding="utf-8") as handle:
        yaml.safe_dump(demo_config(out, args.dataset, args.epochs, args.workers), handle, sort_keys=False)
    splits = [os.path.join(source, f"{split}.txt") for split in ("train", "valid", "test")]

    logger.info("[1/4] importing %s from %s", args.dataset, source)
    code = cli_main(["import", config_path, *splits, "--lhs-col", "0", "--rel-col", "1", "--rhs-col", "2"])
    if code:
        return code

    train_dir, valid_dir, test_dir = (os.path.join(out, "data", s) for s in ("train", "valid", "test"))
    logger.info("[2/4] training (%d epochs)", args.epochs)
    summary = train(load_config(config_path, [f"edge_paths={train_dir}"]))

    logger.info("[3/4] filtered evaluation on the test split against every entity")
    metrics = evaluate_command(
        load_config(config_path, [f"edge_paths={test_dir}"]),
        filter_paths=[train_dir, valid_dir, test_dir],
        candidates="all",
    )
    with open(os.path.join(out, "test_metrics.json"), "w", encoding="utf-8") as handle:
        json.dump(metrics, handle, indent=2)

    logger.info("[4/4] exporting embeddings to TSV")
    export_dir = os.path.join(out, "export")
    code = cli_main(["export", config_path, "--out", export_dir, "--format", "tsv"])
    if code:
        return code

    elapsed = time.perf_counter() - started
    print()
    print(f"biggraph demo on {args.dataset}: done in {elapsed:.0f} s")
    print(f"  training:    {summary.get('train_edges', 0)} edges at {summary.get('edges_per_sec', 0):.0f} edges/s")
    print(f"  test (filtered, all entities): MRR {metrics['mrr']:.4f}  Hits@1 {metrics['hits@1']:.4f}  "
          f"Hits@10 {metrics['hits@10']:.4f}  over {metrics['count']} edges")
    print(f"  config:      {config_path}")
    print(f"  checkpoints: {os.path.join(out, 'checkpoints')}  (PBG format; training_stats.json inside)")
    print(f"  embeddings:  {export_dir}")
    print(f"  metrics:     {os.path.join(out, 'test_metrics.json')}")
    print(f"  next: biggraph eval {config_path} -p edge_paths={test_dir} --candidates all "
          f"--filter {train_dir} --filter {valid_dir} --filter {test_dir}")
    print(f"  report: biggraph report {os.path.join(out, 'checkpoints')} --metrics {os.path.join(out, 'test_metrics.json')}")
    return 0
