"""``biggraph report CHECKPOINT``: the arguments of the HTML/PNG training report (the report itself: ``job.report``).

A checkpoint's config.json holds no storage options (training leaves them out: they may be credentials),
so a checkpoint on a custom S3 endpoint needs them here: ``--config CFG`` (its ``storage_options``) and/or
``--storage-option KEY=VALUE`` (which win over the config's, key by key).
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Optional

from job.cli.common import add_storage_option_argument, parse_storage_options
from job.config import load_config
from job.errors import UserError


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "report", help="an HTML (and PNG) report of a checkpoint: loss, MRR, throughput, time split, embeddings",
    )
    parser.add_argument("checkpoint", help="checkpoint directory (path or URL) holding config.json and training_stats.json")
    parser.add_argument("--out", default="report.html", help="HTML file to write (default: ./report.html)")
    parser.add_argument("--png", default=None, help="also write the charts as a PNG (needs matplotlib: biggraph[report])")
    parser.add_argument("--sample", type=int, default=2000, help="entities drawn for the 2-D projection (default 2000)")
    parser.add_argument("--edges", default=None,
                        help="edge directory for the per-relation MRR (default: the config's last edge_paths entry)")
    parser.add_argument("--relation-edges", type=int, default=20000,
                        help="at most this many edges for the per-relation MRR (default 20000; 0 skips it)")
    parser.add_argument("--metrics", default=None,
                        help="a JSON file of `biggraph eval --json` (e.g. the demo's test_metrics.json) to show as well")
    parser.add_argument("--seed", type=int, default=0, help="seed of the samples (default 0)")
    parser.add_argument("--config", default=None, metavar="CFG",
                        help="a config file whose storage_options (e.g. an S3 endpoint_url) are used to read the checkpoint")
    add_storage_option_argument(parser)
    parser.set_defaults(func=_run)


def storage_options_of(args: argparse.Namespace) -> Optional[dict[str, Any]]:
    """The --config file's storage_options overlaid with --storage-option; None when neither was given."""
    if args.config is None and not args.storage_option:
        return None
    options: dict[str, Any] = {}
    if args.config is not None:
        options.update(load_config(args.config).storage_options)
    options.update(parse_storage_options(args.storage_option))
    return options


def _run(args: argparse.Namespace) -> int:
    # numpy, h5py and the trainer load when the command runs, not for `biggraph --help`
    from job.report import ReportOptions, write_report

    if args.sample < 0 or args.relation_edges < 0:
        raise UserError("--sample and --relation-edges must be >= 0")
    started = time.perf_counter()
    options = ReportOptions(sample=args.sample, edges=args.edges, relation_edges=args.relation_edges,
                            metrics_file=args.metrics, seed=args.seed, storage_options=storage_options_of(args))
    data = write_report(args.checkpoint, args.out, args.png, options)
    print(f"report of {data.checkpoint} (version {data.version}, {len(data.epochs)} epochs) in "
          f"{time.perf_counter() - started:.1f} s: {args.out}" + (f", {args.png}" if args.png else ""))
    return 0
