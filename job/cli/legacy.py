"""``biggraph convert-legacy [--entity-path OLD --out NEW] [--edge-path OLD --edge-out NEW]... [--checkpoint OLD
--checkpoint-out NEW]``: the flags, paired into the (old, new) arguments of ``convert_legacy``."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import storage_adapters as storage
from job.cli.common import add_storage_option_argument, parse_storage_options
from job.config import load_config
from job.data.legacy import convert_legacy
from job.errors import UserError
from job.session import settings_of
from storage_adapters import StorageSettings


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "convert-legacy",
        help="convert pre-1.0 PBG inputs (.pt counts, edges without format_version) and checkpoints to v1",
        description=(
            "Convert legacy PBG files to the v1 format. Any combination of entity path, edge paths and "
            "checkpoint may be given; .pt files are loaded with torch.load(weights_only=True) only."
        ),
    )
    parser.add_argument("--entity-path", metavar="OLD", help="legacy entity path (entity_count_{type}_{part}.pt)")
    parser.add_argument("--out", metavar="NEW", help="where the v1 entity counts go (with --entity-path)")
    parser.add_argument("--count-base", choices=("auto", "0", "1"), default="auto",
                        help="partition numbering of legacy count files (auto: 0-based unless only _1.. exist)")
    parser.add_argument("--edge-path", metavar="OLD", action="append", default=[],
                        help="legacy edge directory; repeatable, paired in order with --edge-out")
    parser.add_argument("--edge-out", metavar="NEW", action="append", default=[],
                        help="where its v1 copy goes (the same path as --edge-path edits the files in place)")
    parser.add_argument("--checkpoint", metavar="OLD", help="legacy checkpoint directory (METADATA_1.pt, {type}_{part}.pt)")
    parser.add_argument("--checkpoint-out", metavar="NEW", help="where the v1 checkpoint goes (with --checkpoint)")
    parser.add_argument("--version", type=int, default=None,
                        help="legacy checkpoint version to convert (default: CHECKPOINT_VERSION, else the newest)")
    parser.add_argument("--checkpoint-base", choices=("auto", "0", "1"), default="auto",
                        help="partition numbering of legacy checkpoint files (the format says 1-based)")
    parser.add_argument("--config", default=None,
                        help="a v1 config to store in the converted checkpoint instead of the mapped legacy one")
    add_storage_option_argument(parser)
    parser.set_defaults(func=run)


def _check_pairs(args: argparse.Namespace) -> None:
    if not (args.entity_path or args.edge_path or args.checkpoint):
        raise UserError("nothing to convert: give --entity-path, --edge-path and/or --checkpoint")
    if bool(args.entity_path) != bool(args.out):
        raise UserError("--entity-path and --out go together")
    if len(args.edge_path) != len(args.edge_out):
        raise UserError(f"--edge-path given {len(args.edge_path)} times but --edge-out {len(args.edge_out)} times (pair them)")
    if bool(args.checkpoint) != bool(args.checkpoint_out):
        raise UserError("--checkpoint and --checkpoint-out go together")
    if args.version is not None and not args.checkpoint:
        raise UserError("--version applies to --checkpoint")


def run(args: argparse.Namespace) -> int:
    _check_pairs(args)
    config = load_config(args.config) if args.config else None
    # the storage settings: those of --config (storage_options, edge_read_mode), --storage-option replacing its options
    settings = settings_of(config) if config is not None else StorageSettings()
    if args.storage_option:
        settings = dataclasses.replace(settings, options=parse_storage_options(args.storage_option))
    with storage.using(settings):
        result = convert_legacy(
            entities=(args.entity_path, args.out) if args.entity_path else None,
            edges=list(zip(args.edge_path, args.edge_out, strict=True)),
            checkpoint=(args.checkpoint, args.checkpoint_out) if args.checkpoint else None,
            count_base=args.count_base,
            checkpoint_base=args.checkpoint_base,
            version=args.version,
            config=config,
        )
    if args.entity_path:
        print(f"entity counts: {result.entity_count_files} files -> {args.out}")
    for new, count in result.edge_files:
        print(f"edges: {count} files -> {new}")
    if result.checkpoint_version is not None:
        print(f"checkpoint: version {result.checkpoint_version} -> {args.checkpoint_out}")
    return 0
