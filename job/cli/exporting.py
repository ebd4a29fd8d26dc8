"""``biggraph export CONFIG (--out DIR [--format F] | --entities-output FILE --relation-types-output FILE)``."""

from __future__ import annotations

import argparse
from typing import Any

from job.cli.common import add_config_arguments, add_version_argument, overrides_of, resolve_version
from job.config import load_config
from job.data.export import DEFAULT_ROW_GROUP_ROWS, FORMATS, ExportError, export_checkpoint


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "export",
        help="write the embeddings and relation parameters of a checkpoint as TSV, .npy or Parquet",
        description="Export the latest committed checkpoint (or --version N) of config.checkpoint_path, joined with "
        "the entity names of config.entity_path. TSV is byte-for-byte PBG's export_to_tsv layout.",
    )
    add_config_arguments(parser)
    parser.add_argument("--out", metavar="DIR", help="output directory (path or URL)")
    parser.add_argument("--format", choices=FORMATS, default=None, help="output format for --out (default: tsv)")
    add_version_argument(parser, "checkpoint version (default: the committed one)")
    parser.add_argument("--entities-output", metavar="FILE", help="PBG-style: the entity TSV file")
    parser.add_argument("--relation-types-output", metavar="FILE", help="PBG-style: the relation parameter TSV file")
    parser.add_argument("--no-global-emb", action="store_true",
                        help="do not add the learned global embedding of each type (PBG's exporter adds it)")
    parser.add_argument("--overwrite", action="store_true", help="replace output files that already exist")
    parser.add_argument("--row-group-rows", type=int, default=DEFAULT_ROW_GROUP_ROWS,
                        help="Parquet rows per row group (bounds memory while writing)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.row_group_rows < 1:
        raise ExportError("--row-group-rows must be a positive integer")
    config = load_config(args.config, overrides_of(args))
    summary = export_checkpoint(
        config,
        args.out,
        fmt=args.format or "tsv",
        version=resolve_version(config, args.version),
        entities_output=args.entities_output,
        relation_types_output=args.relation_types_output,
        add_global=not args.no_global_emb,
        overwrite=args.overwrite,
        row_group_rows=args.row_group_rows,
    )
    rows = sum(p.rows for p in summary.partitions)
    print(f"exported checkpoint version {summary.version}: {rows} embeddings of {len(summary.dimension)} entity type(s)")
    for url in summary.files:
        print(f"  {url}")
    if summary.generated_names:
        print(f"  note: no names files for {', '.join(summary.generated_names)}; names are {{type}}_{{part}}_{{offset}}")
    return 0
