"""Whether a stage's output is already committed, asked before its Job is created (a resubmit skips the stage).

The question is asked of the stage's rendered command itself: the pod's arguments (``biggraph import CONFIG
FILES... --pods N``, ``... -m job train CONFIG -p ...``, ``biggraph eval CONFIG --out URL``...) are parsed by
``biggraph``'s own parser, with the submitted config file in place of the ConfigMap's path, so that the check
reads exactly the request the pods would run:

- import: ``entity_path`` holds the import marker of this very request (the fingerprint of the inputs, their
  sizes and versions, the options and the graph; ``job.data.importing.staging``), as the pods check it;
- train: ``biggraph completed``: the checkpoint's committed version is the config's last pass;
- eval, export, archive: their output exists (the metrics JSON; the export's manifest, written last; the
  archive holding the tag, ``v{N}-{dtype}`` of the committed version when no tag is named).

A check that cannot be answered from here (storage this machine cannot read) answers "not committed": the stage
then runs, and its pods skip or resume the work themselves.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

import storage_adapters as storage
from job.errors import UserError

logger = logging.getLogger("biggraph")
POD_CONFIG = "/etc/biggraph/config.yaml"  # where the chart mounts the ConfigMap's config


def pod_command(job: dict[str, Any]) -> list[str]:
    """The ``biggraph`` arguments of a rendered Job's pods (after ``biggraph`` or ``-m job``)."""
    container = next(c for c in job["spec"]["template"]["spec"]["containers"] if c["name"] == "trainer")
    args = [str(a) for a in container.get("args") or []]
    if args and args[0] == "biggraph":
        return args[1:]
    for i in range(len(args) - 1):
        if args[i] == "-m" and args[i + 1] == "job":
            return args[i + 2:]
    raise UserError(f"job {job['metadata']['name']}: no biggraph command in its arguments")


def _parsed(job: dict[str, Any], config_path: str) -> argparse.Namespace:
    from job.cli import build_parser

    argv = [config_path if a == POD_CONFIG else a for a in pod_command(job)]
    args = build_parser().parse_args(argv)
    args.argv = argv
    return args


def committed_output(stage: str, job: dict[str, Any], config_path: str) -> str | None:
    """Why ``stage``'s output is already committed (one phrase), or None when it is not (or cannot be told)."""
    try:
        args = _parsed(job, config_path)
        return _CHECKS[stage](args)
    except SystemExit:  # argparse refused the rendered command: the pods would too, and say why
        return None
    except Exception as err:  # any failure to tell (unreachable storage, a half-written file): the stage runs
        logger.warning("stage %s: whether its output is already committed cannot be told from here (%s: %s); it runs",
                       stage, type(err).__name__, err)
        return None


def _import_done(args: argparse.Namespace) -> str | None:
    from job.cli.common import overrides_of
    from job.cli.importing import import_options
    from job.config import load_config
    from job.data.importing.staging import already_imported, fingerprint, import_marker, input_versions

    config = load_config(args.config, overrides_of(args))
    digest = fingerprint(config, args.files, input_versions(args.files), import_options(args))
    return f"{import_marker(config)} records this import" if already_imported(config, digest) else None


def _train_done(args: argparse.Namespace) -> str | None:
    from job.checkpoint.completion import training_complete
    from job.cli.train import load

    completion = training_complete(load(args))
    return completion.message if completion.complete else None


def _file_done(args: argparse.Namespace) -> str | None:
    return f"{args.out} exists" if storage.exists(args.out) else None


def _export_done(args: argparse.Namespace) -> str | None:
    from job.data.export.writers import MANIFEST

    manifest = storage.join(args.out, MANIFEST)
    return f"{manifest} exists" if storage.exists(manifest) else None


def _archive_done(args: argparse.Namespace) -> str | None:
    from job.archive import list_tags

    if not storage.exists(args.out):
        return None
    tag = args.tag
    if not tag:
        from job.checkpoint import CheckpointManager
        from job.cli.common import overrides_of
        from job.config import load_config

        config = load_config(args.config, overrides_of(args))
        version = CheckpointManager.version_named(config.checkpoint_path, args.version)
        if version is None:
            from job.checkpoint.completion import training_complete

            version = training_complete(config).version  # the committed version (0: none)
        if not version:
            return None
        tag = f"v{version}-{args.dtype}"
    held = [t for t in list_tags(args.out) if t.casefold() == tag.casefold()]
    return f"{args.out} holds tag {held[0]}" if held else None


_CHECKS = {"import": _import_done, "train": _train_done, "eval": _file_done, "export": _export_done,
           "archive": _archive_done}
