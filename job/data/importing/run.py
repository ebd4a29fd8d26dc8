"""``import_edges``: the library entry point of ``biggraph import``.

Nothing is written to ``entity_path`` or ``edge_paths`` until both passes succeeded, so a bad row
(which always surfaces in pass 1) leaves no output behind. Where the output goes is checked
first, though: a typo in a path or a bucket that does not exist must not be found only after
reading all the input.
"""

from __future__ import annotations

import logging
import shutil
import tempfile

from job.config import ConfigSchema
from job.data.importing.importer import Importer
from job.data.importing.options import ImportOptions, ImportSummary, check_request
from job.data.outputs import check_output_dir
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
    workdir = tempfile.mkdtemp(prefix="biggraph-import-", dir=options.tmp_dir)
    try:
        summary = Importer(config, files, options, workdir).run()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if summary.skipped_rows:
        logger.warning(
            "import: skipped %s bad rows (%s malformed, %s with an empty id, %s with an unknown relation)",
            f"{summary.skipped_rows:,}",
            f"{summary.malformed_rows:,}",
            f"{summary.empty_id_rows:,}",
            f"{summary.unknown_relation_rows:,}",
        )
    logger.info("import: %s", summary.describe())
    return summary
