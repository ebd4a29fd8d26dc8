"""``biggraph demo``: the README's first command (see :mod:`job.demo`)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from job.data.datasets import DATASETS


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("demo", help="import, train, evaluate and export a small real graph (UMLS by default)")
    parser.add_argument("--dataset", default="umls", choices=DATASETS, help="which graph")
    parser.add_argument("--out", default="demo-output", help="output directory (default: ./demo-output)")
    parser.add_argument("--epochs", type=int, default=25, help="training epochs (default 25)")
    parser.add_argument("--workers", type=int, default=None, help="Hogwild workers (default: number of CPUs)")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from job.demo import run_demo  # torch: only when the command runs

    result = run_demo(args.out, args.dataset, args.epochs, args.workers)
    metrics, training = result.test_metrics, result.training
    data, checkpoints = os.path.join(result.out, "data"), os.path.join(result.out, "checkpoints")
    metrics_file = os.path.join(result.out, "test_metrics.json")
    print()
    print(f"biggraph demo on {args.dataset}: done in {result.seconds:.0f} s")
    print(f"  training:    {training.get('train_edges', 0)} edges at {training.get('edges_per_sec', 0):.0f} edges/s")
    print(f"  test (filtered, all entities): MRR {metrics['mrr']:.4f}  Hits@1 {metrics['hits@1']:.4f}  "
          f"Hits@10 {metrics['hits@10']:.4f}  over {metrics['count']} edges")
    print(f"  config:      {result.config_path}  (trains on {data}/train)")
    print(f"  checkpoints: {checkpoints}  (PBG format; training_stats.json inside)")
    print(f"  embeddings:  {result.export_dir}")
    print(f"  metrics:     {metrics_file}")
    print(f"  next: biggraph eval {result.config_path} -p edge_paths={data}/test --candidates all "
          f"--filter {data}/train --filter {data}/valid --filter {data}/test")
    print(f"  report: biggraph report {checkpoints} --metrics {metrics_file}")
    return 0
