"""``biggraph validate``: every input file a training run reads, checked before it runs (see :mod:`job.formats.validate`)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from job.cli.common import add_config_arguments, overrides_of
from job.config import load_config
from job.errors import UserError
from job.formats.validate import CHUNK_ROWS, run_validation


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "validate",
        help="check entity counts and edge files against the config (exit 2 listing every problem)",
        description=(
            "Check that every input file a training run reads is present and well formed: entity counts, "
            "bucket files, HDF5 structure and every index range. Each problem is one line naming the file, "
            "dataset, first bad row (0-based) and what was expected."
        ),
    )
    add_config_arguments(parser)
    parser.add_argument(
        "--cheap", action="store_true",
        help="skip the scan of the values (what train checks before it starts)",
    )
    parser.add_argument("--chunk-rows", type=int, default=CHUNK_ROWS, help="rows read at a time while scanning")
    parser.set_defaults(func=_validate_command)


def _validate_command(args: argparse.Namespace) -> int:
    if args.chunk_rows < 1:
        raise UserError("--chunk-rows must be a positive integer")
    config = load_config(args.config, overrides_of(args))
    report = run_validation(config, full=not args.cheap, chunk_rows=args.chunk_rows)
    for warning in report.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    for problem in report.problems:
        print(f"error: {problem}", file=sys.stderr)
    if report.problems:
        print(f"biggraph validate: {len(report.problems)} problem(s) found", file=sys.stderr)
        return 2
    print(
        f"ok: {report.count_files} entity count files ({report.total_entities} entities), "
        f"{report.edge_files} edge files in {len(config.edge_paths)} edge path(s)"
        + (", values not scanned" if args.cheap else "")
    )
    for edge_path, total in report.edges_per_path.items():
        print(f"  {edge_path}: {total} edges")
    return 0
