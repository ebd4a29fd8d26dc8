"""``biggraph config-help``, ``biggraph train`` (and ``completed``, its check whether there is anything to train) and
``biggraph eval``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from typing import Any

from job.cli.common import add_config_arguments, add_version_argument, overrides_of, resolve_version
from job.config import ConfigSchema, config_help, load_config
from job.config.choices import EDGE_READ_MODES, EVAL_PROTOCOLS

logger = logging.getLogger("biggraph")

# ``biggraph completed``'s answer "not complete": apart from 0 (complete), 1 (a crash) and 2 (bad input, one line)
EXIT_NOT_COMPLETE = 3


def register(subparsers: Any) -> None:
    help_parser = subparsers.add_parser("config-help", help="print every config key with its type, default and help")
    help_parser.set_defaults(func=_config_help)

    train = subparsers.add_parser("train", help="train embeddings (resumes from the last checkpoint if any)")
    _add_train_arguments(train)
    train.set_defaults(func=_train)

    completed = subparsers.add_parser(
        "completed", help="whether training is already complete: exit 0 when the checkpoint's committed version is "
                          f"this config's last pass, {EXIT_NOT_COMPLETE} when not (takes train's arguments; run by the "
                          "pod entrypoint before torchrun)")
    _add_train_arguments(completed)
    completed.set_defaults(func=_completed)

    evaluate = subparsers.add_parser("eval", help="rank held-out edges: MRR, Hits@1/10/50, AUC, mean rank")
    add_config_arguments(evaluate)
    evaluate.add_argument("--filter", action="append", default=[], metavar="EDGE_DIR",
                          help="directories of true edges removed from the candidates (filtered ranks); repeatable")
    evaluate.add_argument(
        "--candidates", choices=EVAL_PROTOCOLS, default=None,
        help="the ranking protocol (default: the config's eval_protocol, 'auto'): 'all' every entity of the type; "
             "'sampled' the distinct sampled negatives, the positive left out; 'pbg' PBG's sampled protocol exactly "
             "(repeats and draws of the positive count against it); 'auto' all when a type has no more entities than "
             "the draws, else sampled")
    evaluate.add_argument("--json", action="store_true", help="print one JSON object with the metrics")
    evaluate.add_argument("--out", metavar="URL", default=None,
                          help="also write the metrics as one JSON object to this path or URL (the chart's eval "
                               "stage: a resubmit skips the stage when it exists)")
    add_version_argument(evaluate, "checkpoint version (default: the latest)")
    evaluate.set_defaults(func=_eval)


def _add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """``train``'s arguments; ``completed`` takes the same, so that the entrypoint can hand it train's command line
    and the check reads the very config the trainer would (its ``-p`` overrides included)."""
    add_config_arguments(parser)
    parser.add_argument(
        "--edge-read-mode", choices=EDGE_READ_MODES, default=None,
        help="how to read edge files from object stores (overrides the config key edge_read_mode)",
    )
    parser.add_argument(
        "--take-over", action="store_true",
        help="take the checkpoint directory from a run whose heartbeat stopped (a job that was killed elsewhere); "
             "a run whose heartbeat is fresh is never taken over")


def _config_help(args: argparse.Namespace) -> int:
    print(config_help())
    return 0


def load(args: argparse.Namespace) -> ConfigSchema:
    """The config of a command: CONFIG with its ``-p`` overrides (and ``--edge-read-mode`` where the command has it,
    a typed value: argparse already checked it against the choices)."""
    config = load_config(args.config, overrides_of(args))
    if getattr(args, "edge_read_mode", None):
        config = dataclasses.replace(config, edge_read_mode=args.edge_read_mode)
    return config


def _train(args: argparse.Namespace) -> int:
    from job.train.startup import mark_early  # torch-free

    config = load(args)
    mark_early("interpreter and config")  # the trainer's start-up line counts from the process's start
    if config.effective_workers() > 1 and not config.wants_cuda():
        # Hogwild on the CPU: the workers' fork server imports torch while this process does
        from job.train.hogwild.spawning import start_worker_server

        start_worker_server()
    from job.train.distributed.group import round_ended
    from job.train.elastic.budget import round_ended_exit_code
    from job.train.elastic.launch import launch  # heavy (torch): only when the command runs, so `biggraph --help` is instant

    try:
        return launch(config, args.argv, take_over=args.take_over)
    except Exception as err:
        if not round_ended(err):
            raise
        # the round ended from outside (job/train/elastic/budget.py): the code tells the agent whether it was a
        # membership change after progress (free) or a round that did nothing (spends its restarts)
        code = round_ended_exit_code()
        logger.warning("%s (exit code %d)", err, code)
        return code


def _completed(args: argparse.Namespace) -> int:
    """One line on stdout either way: the entrypoint logs it (docker/entrypoint.sh)."""
    from job.checkpoint.completion import training_complete

    completion = training_complete(load(args))
    print(completion.message)
    return 0 if completion.complete else EXIT_NOT_COMPLETE


def _eval(args: argparse.Namespace) -> int:
    from job.eval_protocol import protocol_label
    from job.evaluation import evaluate  # torch: only when the command runs

    config = load(args)
    metrics = evaluate(config, filter_paths=args.filter, candidates=args.candidates,
                       version=resolve_version(config, args.version))
    if args.out:
        import storage_adapters as storage

        storage.write_text(args.out, json.dumps(metrics, sort_keys=True) + "\n")  # one PUT: whole or absent
    if args.json:
        print(json.dumps(metrics))
    else:
        print(f"{'protocol':>10}: {protocol_label(metrics['protocol'], metrics['filtered'])}")
        for key, value in metrics.items():
            if key in ("protocol", "filtered"):
                continue
            print(f"{key:>10}: {value:.6g}" if isinstance(value, float) else f"{key:>10}: {value}")
    return 0
