"""``import_edges`` and ``import_pod``: the library entry points of ``biggraph import``.

Both run the sharded import of ``job.data.importing.pods``: ``import_edges`` as its only pod, with
its staging in a local temporary directory; ``import_pod`` as one pod of N meeting the others in a
shared staging directory. Nothing is written to ``entity_path`` or ``edge_paths`` until every shard
has been read, so a bad row (found while reading) leaves no output behind. Where the output goes is
checked first, though: a typo in a path or a bucket that does not exist must not be found only
after reading all the input.
"""

from __future__ import annotations

import logging
import shutil
import tempfile

from job.config import ConfigSchema
from job.data.importing.options import ImportOptions, ImportSummary, check_request
from job.data.importing.pods import PodRole, run_pod
from job.data.outputs import check_output_dir
from job.errors import UserError
from job.session import storage_scoped

logger = logging.getLogger("biggraph")


def check_outputs(config: ConfigSchema) -> None:
    """Fail now unless every output location can be written: a local directory that is (or can be made)
    writable, or an object-store URL whose bucket exists. Creates nothing locally."""
    for url in (config.entity_path, *config.edge_paths):
        check_output_dir(url, create=False)


@storage_scoped
def import_edges(config: ConfigSchema, files: list[str], options: ImportOptions) -> ImportSummary:
    """Import ``files`` (the i-th into ``config.edge_paths[i]``) and write ``config.entity_path``."""
    check_request(config, files, options)
    check_outputs(config)
    staging = tempfile.mkdtemp(prefix="biggraph-import-staging-", dir=options.tmp_dir)
    try:
        summary = run_pod(config, files, options, PodRole(0, 1, staging, skip_done=False))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    assert summary is not None  # pod 0 always returns it
    _report(summary)
    return summary


@storage_scoped
def import_pod(config: ConfigSchema, files: list[str], options: ImportOptions, role: PodRole) -> ImportSummary | None:
    """Pod ``role.index`` of ``role.count`` (an Indexed Job's pod, or one of ``--pods N``); pod 0 returns the summary."""
    check_request(config, files, options)
    check_outputs(config)
    if not 0 <= role.index < role.count:
        raise UserError(f"pod index {role.index} is out of range for {role.count} pods (expected 0..{role.count - 1})")
    summary = run_pod(config, files, options, role)
    if summary is not None:
        _report(summary)
    return summary


def _report(summary: ImportSummary) -> None:
    if summary.skipped_rows:
        logger.warning(
            "import: skipped %s bad rows (%s malformed, %s with an empty id, %s with an unknown relation)",
            f"{summary.skipped_rows:,}",
            f"{summary.malformed_rows:,}",
            f"{summary.empty_id_rows:,}",
            f"{summary.unknown_relation_rows:,}",
        )
    logger.info("import: %s", summary.describe())
