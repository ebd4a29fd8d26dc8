"""``biggraph grow``: add new entities, relation types and edges to a trained model, then train on.

What a grow does, in order (each step's reasons are in its module):

1. checks: the checkpoint (``--into``, default ``checkpoint_path``) has a committed version whose
   config fits this one (``model_state.check_compatible``); the new edge files parse, their relation
   types are known, no new name collides with another type (``ingest``). Any failure: one line,
   exit 2, nothing written.
2. reads the new edges into the trained id space: known entities keep id, partition and row; new ones
   are appended to partitions, balanced (``ingest``).
3. writes the new input (bucket files = old edges then new ones; counts and names) into staging
   directories, the grown checkpoint version N+1 (trained rows bit-identical, new rows initialised by
   ``rows``, the model with rows for new relation types) and the journal, then commits N+1 and
   publishes the staged input (``journal``).
4. trains ``grow_num_epochs`` passes over the new edges plus a replayed sample of the old ones
   (``training``).

Run again with the same files after a crash, it resumes: an uncommitted grow is discarded and redone,
a committed one is published and its training continued from the last committed pass.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import storage_adapters as storage
from job.checkpoint import CheckpointManager, ModelState
from job.checkpoint.journal import (
    GrowRecord,
    describe_files,
    journal_file,
    latest_record,
    publish,
    staging_dir,
    write_record,
)
from job.checkpoint.journal_checks import GrowInputs
from job.config import ConfigSchema
from job.data.importing import ImportOptions, check_request
from job.formats.checkpoint import CheckpointStorage
from job.growing import ingest
from job.growing import rows as grown_rows
from job.growing.ingest import GrowImporter, read_trained_names
from job.growing.model_state import GrowError, check_compatible, committed_config, grown_model
from job.growing.training import grow_trainer
from job.session import storage_scoped
from job.types import PartitionKey

logger = logging.getLogger("biggraph")

__all__ = ["GrowError", "GrowSummary", "grow"]


@dataclass
class GrowSummary:
    """What a grow did (printed by the command, returned by ``job.grow``)."""

    version: int = 0  # the grown checkpoint version
    from_version: int = 0
    new_entities: dict[str, int] = field(default_factory=dict)
    entities: dict[str, int] = field(default_factory=dict)
    new_relations: list[str] = field(default_factory=list)
    new_edges: int = 0
    skipped_rows: int = 0
    from_neighbours: int = 0
    init: str = ""
    grow_seconds: float = 0.0
    resumed: bool = False
    training: dict[str, Any] | None = None

    def describe(self) -> str:
        new = ", ".join(f"{name}=+{count:,}" for name, count in self.new_entities.items())
        text = (f"grew checkpoint version {self.from_version} into {self.version}"
                f"{' (resumed: already committed)' if self.resumed else ''}: {self.new_edges:,} new edges, new entities "
                f"{new or 'none'}, new relation types {len(self.new_relations)}")
        if not self.resumed:
            text += f"; {self.from_neighbours:,} new rows from neighbours ({self.init}); {self.grow_seconds:.1f} s"
        if self.skipped_rows:
            text += f"; skipped {self.skipped_rows:,} bad rows"
        if self.training is not None:
            text += (f"; trained to version {self.training.get('version')} "
                     f"({self.training.get('seconds', 0.0):.1f} s)")
        return text


def _options_record(options: ImportOptions) -> dict[str, Any]:
    """The options that decide what the new edges mean (a re-run with other ones is another grow)."""
    keys = ("lhs_col", "rhs_col", "rel_col", "input_format", "delimiter", "header", "skip_bad_rows", "seed",
            "entity_min_count", "relation_type_min_count")
    return {k: getattr(options, k) for k in keys}


@storage_scoped
def grow(config: ConfigSchema, files: list[str], options: ImportOptions, *, into: str | None = None,
         train: bool = True) -> GrowSummary:
    """Grow the model at ``into`` (default ``config.checkpoint_path``) with the edges of ``files`` (the i-th into
    ``config.edge_paths[i]``), commit it as the next version, then train ``grow_num_epochs`` passes on it."""
    if into is not None:
        config = dataclasses.replace(config, checkpoint_path=into)
    if train and config.grow_num_epochs > 0 and "TORCHELASTIC_RUN_ID" in os.environ:
        raise GrowError("biggraph grow trains on one machine: run it outside torchrun (or with --no-train, then "
                        "train the grown model with torchrun as usual)")
    check_request(config, files, options)
    # one writer: taken (and cleaned of what a killed grow or train left) for the grow and the training after it
    manager = CheckpointManager(config.checkpoint_path, _keys(config), GrowInputs.of(config))
    try:
        return _grow_and_train(config, files, options, manager, train)
    finally:
        manager.close()


def _grow_and_train(config: ConfigSchema, files: list[str], options: ImportOptions, manager: CheckpointManager,
                    train: bool) -> GrowSummary:
    version = manager.open()
    if version == 0:
        raise GrowError(f"--into {config.checkpoint_path}: no committed checkpoint there (train a model first)")
    described, options_record = describe_files(files), _options_record(options)
    record = latest_record(config.checkpoint_path, version)
    if record is not None and record.same_input(described, options_record):
        logger.info("grow: these files were already grown into version %d: resuming its training", record.version)
        summary = GrowSummary(record.version, record.from_version, dict(record.new_entities), {}, list(record.new_relations),
                              record.new_edges, init=record.init, resumed=True)
    else:
        record, summary = _grow_once(config, files, options, manager, version, described, options_record)
    if train and config.grow_num_epochs > 0:
        _check_boundaries(config, record)
        trainer = grow_trainer(config, record)
        try:
            summary.training = trainer.run()
        finally:
            trainer.close()
    return summary


def _grow_once(config: ConfigSchema, files: list[str], options: ImportOptions, manager: CheckpointManager,
               version: int, described: list[dict[str, Any]], options_record: dict[str, Any]) -> tuple[GrowRecord, GrowSummary]:
    """Read the new edges, write the grown input (staged), checkpoint version and journal, commit, then publish."""
    started = time.monotonic()
    checkpoint = manager.storage
    into = config.checkpoint_path
    params, optimizer, metadata = checkpoint.load_model(version)
    old_config = committed_config(checkpoint, metadata)
    check_compatible(old_config, config, into)
    counts, names, relations = read_trained_names(config)
    old_num_rels = len(relations) if relations is not None else 0
    new_version = version + 1
    workdir = tempfile.mkdtemp(prefix="biggraph-grow-", dir=options.tmp_dir)
    staged: list[str] = []
    try:
        importer = GrowImporter(config, files, options, workdir, counts, names, relations)
        members, relation_names, spills = importer.ingest()
        # every check passed: from here on output is written (staged, then committed, then published)
        model, model_state, model_optimizer = grown_model(
            old_config, old_num_rels, config, len(relation_names or []), params, optimizer)
        old_counts = {(t, p): counts[t][p] for t, p in _keys(config)}
        added = {(t, p): int(importer.added[t][p]) for t, p in _keys(config)}
        grid = (importer.plan.parts_lhs, importer.plan.parts_rhs)
        rows = grown_rows.initial_rows(config, model, checkpoint, old_version=version, new_version=new_version,
                                       old_counts=old_counts, added=added, spills=spills, grid=grid)
        moves, boundaries = _stage_input(config, importer, members, relation_names=relation_names, spills=spills,
                                         grid=grid, new_version=new_version,
                                         workdir=workdir, staged=staged)
        grown_metadata = dict(metadata)
        grown_metadata["config/json"] = config.to_json(exclude=("storage_options",))
        # through the module, as ingest.write_merged_edges: the crash tests replace both to kill a grow inside them
        grown_rows.write_grown_partitions(config, checkpoint, version, new_version, rows, grown_metadata)
        manager.add_metadata_provider(lambda: grown_metadata)
        manager.write_model(new_version, ModelState(model_state, model_optimizer))
        new_entities = {t: int(importer.added[t].sum()) for t in config.entities}
        new_relations = (relation_names[old_num_rels:] if relation_names is not None
                         else [r.name for r in config.relations[len(old_config.relations):]])
        record = GrowRecord(
            version=new_version, from_version=version, files=described, options=options_record, moves=moves,
            staging_dirs=staged, config_json=config.to_pbg_json(), boundaries=boundaries, new_entities=new_entities,
            new_relations=new_relations, new_edges=int(sum(int(c.sum()) for _, c in spills)), init=config.grow_init,
        )
        write_record(into, record)
        manager.commit(new_version, drop_previous=False)  # the commit point; version N goes once the input is published
    except BaseException:
        _discard(checkpoint, version, new_version, staged, _keys(config))
        raise
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    publish(into, record)
    checkpoint.drop_version(version, _keys(config))
    manager.forget_best()  # a best version of the old entity set cannot be read with the grown one
    summary = GrowSummary(
        new_version, version, record.new_entities, dict(importer.summary.entities), record.new_relations,
        record.new_edges, importer.summary.skipped_rows, sum(r.from_neighbours for r in rows.values()),
        config.grow_init, time.monotonic() - started,
    )
    logger.info("grow: %s", summary.describe())
    return record, summary


def _stage_input(config: ConfigSchema, importer: GrowImporter, members: list[list[np.ndarray]],
                 *,
                 relation_names: list[str] | None, spills: list[tuple[str, np.ndarray]], grid: tuple[int, int],
                 new_version: int, workdir: str, staged: list[str]) -> tuple[list[list[str]], list[list[int]]]:
    """Write the grown input (edge files: old edges then new ones; entity counts and names) into staging
    directories (appended to ``staged`` as they are made, so a failure can remove them); returns the journal's
    moves (staged file -> input file) and, per edge path, where the new edges start in each bucket file."""
    moves: list[list[str]] = []
    boundaries: list[list[int]] = []
    for edge_path, (bucket_dir, _) in zip(config.edge_paths, spills):
        target = staging_dir(edge_path, new_version)
        staged.append(target)
        bounds, written = ingest.write_merged_edges(edge_path, target, grid, bucket_dir, workdir)
        boundaries.append(bounds)
        moves += [[url, storage.join(edge_path, url.rsplit("/", 1)[-1])] for url in written]
    entity_target = staging_dir(config.entity_path, new_version)
    staged.append(entity_target)
    written = importer.write_entities(members, relation_names, entity_target)
    moves += [[url, storage.join(config.entity_path, url.rsplit("/", 1)[-1])] for url in written]
    return moves, boundaries


def _check_boundaries(config: ConfigSchema, record: GrowRecord) -> None:
    """The journal's boundaries (where the new edges start) fit this config: one count per bucket per edge path."""
    from job.train.inputs import bucket_grid

    lhs, rhs = bucket_grid(config)
    if len(record.boundaries) != len(config.edge_paths) or any(len(b) != lhs * rhs for b in record.boundaries):
        raise GrowError(f"{journal_file(config.checkpoint_path, record.version)}: its 'boundaries' are not one list of "
                        f"{lhs * rhs} bucket edge counts per edge path ({len(config.edge_paths)}) of this config")


def _keys(config: ConfigSchema) -> list[PartitionKey]:
    return [(t, p) for t, e in config.entities.items() for p in range(e.num_partitions)]


def _discard(checkpoint: CheckpointStorage, committed: int, new_version: int, staged: list[str],
             keys: list[PartitionKey]) -> None:
    """Undo an uncommitted grow that failed while writing (the files are garbage either way; a clean directory
    is easier to reason about)."""
    try:
        if checkpoint.load_version() != committed:
            return  # committed after all: publishing will finish it
        for directory in staged:
            storage.remove(directory)
        storage.remove(journal_file(checkpoint.url, new_version))
        checkpoint.drop_uncommitted_manifests(committed)
        checkpoint.drop_uncommitted(committed, keys)
    except Exception as err:  # the original error matters more; leftovers are removed next run
        logger.warning("grow: could not remove the files of the failed grow (%s); the next grow or train will", err)

