"""``export_checkpoint``: the library entry point of ``biggraph export`` (layouts: see ``job.data.export``)."""

from __future__ import annotations

import json
import logging

import storage_adapters as storage
from job.config import ConfigSchema
from job.data.export.reader import CheckpointReader, ExportError, ExportSummary
from job.data.export.writers import (
    DEFAULT_ROW_GROUP_ROWS,
    FORMATS,
    MANIFEST,
    TSV_ENTITIES,
    TSV_RELATIONS,
    export_npy,
    export_parquet,
    export_tsv,
)
from job.data.outputs import check_output_dir
from job.session import storage_scoped

logger = logging.getLogger("biggraph.export")


def _check_targets(out: str | None, fmt: str, entities_output: str | None, relation_types_output: str | None) -> bool:
    """Validate the output arguments and check, before reading any checkpoint, that the output directories
    can be written (made when missing). True when the two TSV files are named directly (PBG's flags)."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown format '{fmt}' (expected one of {', '.join(FORMATS)})")
    named_tsv = entities_output is not None or relation_types_output is not None
    if named_tsv:
        if entities_output is None or relation_types_output is None:
            raise ExportError("--entities-output and --relation-types-output must be given together")
        if fmt != "tsv":
            raise ExportError("--entities-output/--relation-types-output write TSV; do not combine them with --format")
        for url in (entities_output, relation_types_output):
            parent = url.rstrip("/").rsplit("/", 1)[0] if "/" in url.rstrip("/") else "."
            check_output_dir(parent, create=True, error=ExportError)
    elif out is None:
        raise ExportError("give --out DIR (or PBG's --entities-output FILE --relation-types-output FILE)")
    else:
        check_output_dir(out, create=True, error=ExportError)
    return named_tsv


@storage_scoped
def export_checkpoint(
    config: ConfigSchema,
    out: str | None = None,
    *,
    fmt: str = "tsv",
    version: int | None = None,
    entities_output: str | None = None,
    relation_types_output: str | None = None,
    add_global: bool = True,
    overwrite: bool = False,
    row_group_rows: int = DEFAULT_ROW_GROUP_ROWS,
) -> ExportSummary:
    """Export one checkpoint version (default: the committed one) into the directory ``out``, or, PBG-style, into
    the two TSV files ``entities_output`` and ``relation_types_output``; see ``job.data.export`` for the layouts."""
    named_tsv = _check_targets(out, fmt, entities_output, relation_types_output)
    reader = CheckpointReader(config, version)
    summary = ExportSummary(version=reader.version, format=fmt)
    if named_tsv:
        assert entities_output is not None and relation_types_output is not None
        export_tsv(reader, entities_output, relation_types_output, summary, add_global, overwrite)
    else:
        assert out is not None
        if fmt == "tsv":
            export_tsv(reader, storage.join(out, TSV_ENTITIES), storage.join(out, TSV_RELATIONS), summary,
                       add_global, overwrite)
        elif fmt == "npy":
            export_npy(reader, out, summary, add_global, overwrite)
        else:
            export_parquet(reader, out, summary, add_global, overwrite, row_group_rows)
        manifest_url = storage.join(out, MANIFEST)
        summary.files.append(manifest_url)
        storage.write_text(manifest_url, json.dumps(summary.manifest(), indent=1) + "\n")
    if summary.generated_names:
        logger.warning(
            "no entity_names_{type}_{part}.json in %s for %s: names were generated as {type}_{part}_{offset}",
            config.entity_path, ", ".join(summary.generated_names),
        )
    return summary
