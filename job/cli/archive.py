"""``biggraph archive`` (add a checkpoint as a tag of a model archive) and ``biggraph query`` (serve one).

    biggraph archive CONFIG --out model.zip [--tag NAME] [--dtype fp32|fp16|int8] [--version N] [--updater] [-p k=v]
    biggraph query model.zip [--tag T] (--nearest NAME [-k 10] [--relation R] | --score LHS REL RHS
                                        | --embedding NAME | --tags | --verify) [--entity-type T] [--json]
                                        [--storage-option KEY=VALUE]

Both take a path or any storage URL (``s3://bucket/model.zip``): ``archive`` with the config's
``storage_options``, ``query`` with ``--storage-option``. ``query`` runs on the torch-free loader
(job.archive.load).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from typing import Any

from job.cli.common import (
    add_config_arguments,
    add_storage_option_argument,
    add_version_argument,
    overrides_of,
    parse_storage_options,
    resolve_version,
)
from job.config import load_config
from storage_adapters import StorageSettings, using


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "archive",
        help="add a checkpoint version to a model archive (.zip, FlatBuffers inside) as a named tag",
        description="Add checkpoint version N (the latest by default) of CONFIG's checkpoint_path to the model archive "
                    "--out (created if missing) as tag --tag (default v{N}-{dtype}). Arrays equal to ones already in "
                    "the archive are shared by reference; relation operators and global embeddings stay fp32.",
    )
    add_config_arguments(parser)
    parser.add_argument("--out", required=True,
                        help="the archive file (.zip; path or URL, e.g. s3://bucket/model.zip), created or extended")
    parser.add_argument("--tag", default=None, help="tag name (letters, digits, _ - . +; case-insensitive); default v{N}-{dtype}")
    parser.add_argument("--dtype", choices=("fp32", "fp16", "int8"), default="fp32",
                        help="storage of the embedding tables (int8: per-row scales); default fp32")
    add_version_argument(parser, "checkpoint version (default: the latest committed; older ones from epoch_*/ "
                                 "snapshots)")
    parser.add_argument("--updater", action="store_true", help="also store the Adagrad state (updater.txt, updater/*.fb)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.set_defaults(func=_archive)
    _register_query(subparsers)


def _register_query(subparsers: Any) -> None:
    query = subparsers.add_parser(
        "query",
        help="query a model archive without torch: nearest neighbours, scores, embeddings",
        description="Load a tag of a model archive (numpy + flatbuffers only) and answer one query.",
    )
    query.add_argument("archive", help="the model archive (.zip; path or URL)")
    query.add_argument("--tag", default=None, help="tag to load (default: the newest)")
    what = query.add_mutually_exclusive_group(required=True)
    what.add_argument("--nearest", metavar="NAME", help="the k entities closest to NAME (or best rhs with --relation)")
    what.add_argument("--score", nargs=3, metavar=("LHS", "REL", "RHS"), help="the score of one edge")
    what.add_argument("--embedding", metavar="NAME", help="the embedding of NAME (global embedding included)")
    what.add_argument("--tags", action="store_true", help="list the tags (oldest first)")
    what.add_argument("--verify", action="store_true", help="check every tag: CRCs, references, shapes, dtypes")
    query.add_argument("-k", type=int, default=10, help="neighbours to return (default 10)")
    query.add_argument("--relation", default=None, help="with --nearest: rank rhs entities v of (NAME, REL, v)")
    query.add_argument("--entity-type", default=None, help="entity type of NAME when several types have that name")
    query.add_argument("--json", action="store_true", help="print JSON")
    add_storage_option_argument(query)
    query.set_defaults(func=_query)


def _archive(args: argparse.Namespace) -> int:
    from job.archive.writer import add_tag  # reads checkpoints (h5py, torch): imported when the command runs

    started = time.perf_counter()
    config = load_config(args.config, overrides_of(args))
    summary = add_tag(config, args.out, tag=args.tag, dtype=args.dtype,
                      version=resolve_version(config, args.version),
                      include_updater=args.updater)
    elapsed = time.perf_counter() - started
    if args.json:
        print(json.dumps({**summary.as_dict(), "seconds": round(elapsed, 3)}, indent=2))
        return 0
    print(f"{summary.archive}: added tag '{summary.tag}' (checkpoint version {summary.checkpoint_version}, "
          f"{summary.dtype}) in {elapsed:.1f} s")
    print(f"  {summary.variables} variables, {summary.files_written} new array files, {summary.tag_bytes} bytes added; "
          f"archive {summary.archive_bytes} bytes")
    if summary.shared:
        tags = sorted({member.split("/", 1)[0] for member in summary.shared.values()})
        print(f"  {len(summary.shared)} variables shared by reference with tag(s) {', '.join(tags)}")
    print(f"  tags (oldest first): {', '.join(summary.tags)}")
    return 0


def _query(args: argparse.Namespace) -> int:
    # --storage-option applies to this command's reads only; without it the current settings stay in force
    scope: Any = contextlib.nullcontext()
    if args.storage_option:
        scope = using(StorageSettings(options=parse_storage_options(args.storage_option)))
    with scope:
        return _run_query(args)


def _run_query(args: argparse.Namespace) -> int:
    from job.archive import list_tags, load, verify  # numpy + flatbuffers: imported when the command runs

    if args.tags:
        tags = list_tags(args.archive)
        print(json.dumps(tags) if args.json else "\n".join(tags))
        return 0
    if args.verify:
        summary = verify(args.archive)
        if args.json:
            print(json.dumps(summary, indent=2))
        else:
            for tag, info in summary.items():
                print(f"{tag}: ok ({info['variables']} variables, {info['storage_dtype']}, checkpoint version "
                      f"{info['checkpoint_version']})")
        return 0
    with load(args.archive, args.tag) as model:
        result = _answer(model, args)
    if result is not None:
        json.dump(result, sys.stdout)
        print()
    return 0


def _answer(model: Any, args: argparse.Namespace) -> dict[str, Any] | None:
    """Answer --nearest, --score or --embedding; the JSON result with --json, else None after printing it."""
    result: dict[str, Any]
    if args.nearest is not None:
        pairs = model.nearest(args.nearest, k=args.k, relation=args.relation, entity_type=args.entity_type)
        result = {"tag": model.tag, "query": args.nearest, "relation": args.relation,
                  "neighbours": [{"name": name, "score": score} for name, score in pairs]}
        text = "\n".join(f"{score:.6f}\t{name}" for name, score in pairs)
    elif args.score is not None:
        lhs, rel, rhs = args.score
        relation: Any = rel
        if rel not in model.relation_names and rel.isdigit():
            relation = int(rel)
        value = model.score(lhs, relation, rhs)
        result = {"tag": model.tag, "lhs": lhs, "relation": rel, "rhs": rhs, "score": value}
        text = f"{value:.6f}"
    else:
        vector = model.embedding(args.embedding, args.entity_type)
        result = {"tag": model.tag, "name": args.embedding, "embedding": [float(x) for x in vector]}
        text = "\t".join(f"{x:.9f}" for x in vector)
    if args.json:
        return result
    if text:
        print(text)
    return None
