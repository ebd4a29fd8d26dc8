"""Core subcommands: ``config-help``, ``train`` and ``eval``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any


def register(subparsers: Any) -> None:
    from job.cli import add_config_arguments

    help_parser = subparsers.add_parser("config-help", help="print every config key with its type, default and help")
    help_parser.set_defaults(func=_config_help)

    train = subparsers.add_parser("train", help="train embeddings (resumes from the last checkpoint if any)")
    add_config_arguments(train)
    train.add_argument(
        "--edge-read-mode", choices=("stage", "stream"), default=None,
        help="how to read edge files from object stores (overrides the config key edge_read_mode)",
    )
    train.set_defaults(func=_train)

    evaluate = subparsers.add_parser("eval", help="rank held-out edges: MRR, Hits@1/10/50, AUC, mean rank")
    add_config_arguments(evaluate)
    evaluate.add_argument("--filter", action="append", default=[], metavar="EDGE_DIR",
                          help="directories of true edges removed from the candidates (filtered ranks); repeatable")
    evaluate.add_argument("--candidates", choices=("sampled", "all"), default="sampled",
                          help="rank against sampled negatives (as during training) or every entity of the type")
    evaluate.add_argument("--json", action="store_true", help="print one JSON object with the metrics")
    evaluate.add_argument("--version", type=int, default=None, help="checkpoint version (default: the latest)")
    evaluate.set_defaults(func=_eval)


def _config_help(args: argparse.Namespace) -> int:
    from job.config import config_help

    print(config_help())
    return 0


def _load(args: argparse.Namespace):  # noqa: ANN202 - returns ConfigSchema
    from job.cli import overrides_of
    from job.config import load_config

    extra = []
    if getattr(args, "edge_read_mode", None):
        extra.append(f"edge_read_mode={args.edge_read_mode}")
    return load_config(args.config, overrides_of(args) + extra)


def _train(args: argparse.Namespace) -> int:
    import os

    import torch

    from job.train import train

    config = _load(args)
    launched_by_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    cards = torch.cuda.device_count() if torch.cuda.is_available() else 0
    processes = gpu_processes(config.num_gpus, config.device, cards, launched_by_torchrun)
    if 0 < cards < config.num_gpus and not launched_by_torchrun and config.device != "cpu":
        logging.getLogger("biggraph").warning("num_gpus=%d but this machine has %d GPU(s): training with %d",
                                              config.num_gpus, cards, cards)
    if processes > 1:
        advice = partition_advice(config, processes)
        if advice:
            logging.getLogger("biggraph").warning(advice)
        return _train_one_process_per_gpu(processes, args.argv)
    train(config)
    return 0


def gpu_processes(num_gpus: int, device: str, cards: int, launched_by_torchrun: bool) -> int:
    """How many trainer processes ``biggraph train`` starts on this machine: one per GPU, as PBG's GPU trainer.

    The processes are an ordinary single-node torchrun group, so they share buckets through the same
    lock server as a multi-node job (each holds disjoint partitions, which is PBG's sub-bucket rule).
    Under torchrun the launcher already chose the processes; on the CPU there is one (Hogwild workers
    inside it).
    """
    if launched_by_torchrun or device == "cpu" or num_gpus <= 1:
        return 1
    return max(1, min(num_gpus, cards))


def partition_advice(config: Any, processes: int) -> str:
    """Why some of ``processes`` trainers would wait: a bucket locks its partitions, so with P partitions at
    most about P/2 buckets train at once (PBG's GPU trainer asks for 2 partitions per GPU for the same reason)."""
    most = max((e.num_partitions for e in config.entities.values()), default=1)
    if most >= 2 * processes:
        return ""
    return (f"{processes} GPU processes but at most {most} partitions per entity type: buckets hold their partitions, "
            f"so some GPUs will wait; use num_partitions >= {2 * processes}")


def _train_one_process_per_gpu(processes: int, argv: list[str]) -> int:
    import subprocess

    logging.getLogger("biggraph").info("training with %d processes, one per GPU (torchrun --standalone)", processes)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
               "-m", "job", *argv]
    return subprocess.call(command)


def _eval(args: argparse.Namespace) -> int:
    from job.evaluation import evaluate_command

    metrics = evaluate_command(
        _load(args), filter_paths=args.filter, candidates=args.candidates, version=args.version
    )
    if args.json:
        print(json.dumps(metrics))
    else:
        for key, value in metrics.items():
            print(f"{key:>10}: {value:.6g}" if isinstance(value, float) else f"{key:>10}: {value}", file=sys.stdout)
    return 0
