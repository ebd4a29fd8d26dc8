"""``biggraph import CONFIG FILE... -l COL -r COL [options]``: the arguments, and ``ImportOptions`` built from them.

``biggraph grow`` reads new edges with the same column and parsing options, so it uses
``add_import_arguments`` and ``import_options`` too.
"""

from __future__ import annotations

import argparse
from typing import Any

from job.cli.common import add_config_arguments, overrides_of
from job.config import load_config
from job.data.importing import FORMATS, ImportOptions, ImportSummary, import_edges, import_pod
from job.data.importing.pods import PodRole, launch_local, pod_index_from_env
from job.errors import UserError


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "import",
        help="convert TSV/CSV/Parquet edge lists with string ids into PBG's partitioned input format",
        description=(
            "Read edge lists (one edge per row, entity and relation names as strings), assign every entity "
            "a partition and an offset, and write entity_path (counts and names of each partition) and one "
            "edges_{lhs}_{rhs}.h5 per bucket in each edge_paths directory. The i-th FILE goes to the i-th "
            "entry of the config's edge_paths. Put -p overrides after the files (or end them with --)."
        ),
    )
    add_config_arguments(parser)
    parser.add_argument("files", nargs="+", metavar="FILE", help="input edge list(s): paths or URLs, .gz etc. allowed")
    add_import_arguments(parser)
    parser.add_argument(
        "--shard-size", type=float, default=256, metavar="MIB",
        help="cut uncompressed TSV files into line-aligned shards of this many MiB (0: one shard per file); "
        "the output does not depend on it",
    )
    parser.add_argument(
        "--group-size", type=float, default=1024, metavar="MIB",
        help="input a pod reads with one entity table (memory grows with the distinct ids of a group; a lost pod "
        "redoes its group); the output does not depend on it",
    )
    parser.add_argument(
        "--pods", type=int, default=None, metavar="N",
        help="import as N pods: with --pod-index (or JOB_COMPLETION_INDEX, in an Indexed Job) be one of them; "
        "without, start all N here as local processes. The output is byte-identical to a single process",
    )
    parser.add_argument("--pod-index", type=int, default=None, metavar="I", help="this pod's index, 0..N-1 (see --pods)")
    parser.add_argument(
        "--staging", default=None, metavar="URL",
        help="where the pods leave their pieces for each other (default: ENTITY_PATH/.import-staging; "
        "shared storage when the pods run on several machines)",
    )
    parser.set_defaults(func=run)


def add_import_arguments(parser: argparse.ArgumentParser) -> None:
    """The column and parsing options of ``biggraph import`` (``biggraph grow`` reads new edges with the same ones)."""
    parser.add_argument("-l", "--lhs-col", type=int, required=True, help="0-based column of the source entity")
    parser.add_argument("-r", "--rhs-col", type=int, required=True, help="0-based column of the target entity")
    parser.add_argument(
        "--rel-col", type=int, default=None, help="0-based column of the relation name (without it every edge is relation 0)"
    )
    parser.add_argument(
        "--relation-type-min-count",
        type=int,
        default=1,
        help="with dynamic_relations, drop relation types seen fewer times (and their edges)",
    )
    parser.add_argument(
        "--entity-min-count", type=int, default=1, help="drop entities seen fewer times (and the edges touching them)"
    )
    parser.add_argument(
        "--format", choices=("auto", *FORMATS), default="auto", help="input format (auto: by extension, default tsv)"
    )
    parser.add_argument("--delimiter", default=None, help="field delimiter for tsv/csv (default: tab for tsv, ',' for csv)")
    parser.add_argument("--header", action="store_true", help="tsv/csv files start with a header line to skip")
    parser.add_argument(
        "--skip-bad-rows",
        action="store_true",
        help="skip malformed rows, empty ids and unknown relation names (and report how many) instead of failing",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random partition assignment (default 0)")
    parser.add_argument("--block-size", type=int, default=8, metavar="MIB", help="input read chunk in MiB (default 8)")
    parser.add_argument("--tmp-dir", default=None, help="local directory for temporary files (default: system temp)")
    parser.add_argument(
        "--progress-every", type=float, default=5.0, metavar="MILLIONS", help="log progress every this many million edges"
    )


def import_options(args: argparse.Namespace) -> ImportOptions:
    """The ``ImportOptions`` of parsed ``add_import_arguments`` flags."""
    return ImportOptions(
        lhs_col=args.lhs_col,
        rhs_col=args.rhs_col,
        rel_col=args.rel_col,
        input_format=args.format,
        delimiter=args.delimiter,
        header=args.header,
        skip_bad_rows=args.skip_bad_rows,
        seed=args.seed,
        block_size=args.block_size << 20,
        entity_min_count=args.entity_min_count,
        relation_type_min_count=args.relation_type_min_count,
        tmp_dir=args.tmp_dir,
        progress_every=max(1, int(args.progress_every * 1_000_000)),
        shard_size=int(getattr(args, "shard_size", 256) * (1 << 20)),
        group_size=int(getattr(args, "group_size", 1024) * (1 << 20)),
    )


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config, overrides_of(args))
    options = import_options(args)
    index = args.pod_index if args.pod_index is not None else pod_index_from_env()
    summary: ImportSummary | None
    if args.pods is None and index is None:
        summary = import_edges(config, args.files, options)
    else:
        pods = args.pods if args.pods is not None else 1
        if pods < 1:
            raise UserError(f"--pods must be >= 1, got {pods}")
        if index is None:
            return launch_local(args.argv, args.command, pods)
        summary = import_pod(config, args.files, options, PodRole(index, pods, args.staging))
        if summary is None:
            print(f"import: pod {index} of {pods} done")
            return 0
    print(summary.describe())
    return 0
