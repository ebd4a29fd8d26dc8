"""``biggraph grow CONFIG FILE... [import's column options] [--into CHECKPOINT] [--no-train]``."""

from __future__ import annotations

import argparse
from typing import Any

from job.cli.common import add_config_arguments, overrides_of
from job.cli.importing import add_import_arguments, import_options
from job.config import load_config


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "grow",
        help="add new entities, relation types and edges to a trained model, then train on the new edges",
        description=(
            "Read new edge lists (as `biggraph import` reads them: the i-th FILE goes to the i-th edge_paths entry) "
            "into a trained model: known entities keep their id, partition and row, new ones are appended to "
            "partitions (balanced) and initialised (config key grow_init), new relation types follow the old ones. "
            "The grown input and checkpoint are committed together as the next checkpoint version, then "
            "grow_num_epochs passes train on the new edges plus a grow_replay_fraction sample of the old ones. "
            "Run it again with the same files after a crash to resume."
        ),
    )
    add_config_arguments(parser)
    parser.add_argument("files", nargs="+", metavar="FILE", help="new edge list(s): paths or URLs, .gz etc. allowed")
    add_import_arguments(parser)
    parser.add_argument("--into", default=None, metavar="CHECKPOINT",
                        help="the trained checkpoint directory to grow (default: the config's checkpoint_path)")
    parser.add_argument("--no-train", action="store_true", help="only grow and commit; no training passes")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from job.growing import grow  # torch: only when the command runs

    config = load_config(args.config, overrides_of(args))
    summary = grow(config, args.files, import_options(args), into=args.into, train=not args.no_train)
    print(summary.describe())
    return 0
