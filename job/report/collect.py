"""What ``biggraph report`` shows, gathered from a checkpoint directory: ``build_report`` returns ``ReportData``.

Loss, held-out MRR, throughput, the time split and the validation MRR against wall time (the validation lines
of ``validation_edge_paths``) come from ``training_stats.json``; the per-relation MRR
and the 2-D PCA projection are computed from the checkpoint itself (``job.report.sampled``). Anything that
was not recorded gets a note saying so, never an invented figure.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

import storage_adapters as storage
from job.checkpoint import CheckpointManager
from job.config import ConfigSchema, parse_config
from job.errors import CheckpointError, ConfigError, UserError
from job.eval_protocol import protocol_label, recorded_label
from job.formats.checkpoint import CheckpointStorage
from job.report.sampled import embedding_sample, pca_2d, relation_mrr

logger = logging.getLogger("biggraph")


@dataclass
class ReportOptions:
    """What to sample and where to read; the defaults are those of ``biggraph report``.

    ``storage_options`` (fsspec keyword arguments such as ``endpoint_url``) are applied process-wide before the
    checkpoint is read; None keeps whatever is in force (the caller's ``storage.using`` scope, else the environment).
    A checkpoint's own config.json holds none (training leaves them out, they may be credentials), so a
    report of an S3 checkpoint on a custom endpoint needs them from the caller.
    """

    sample: int = 2000  # entities drawn for the 2-D projection
    edges: Optional[str] = None  # edge directory of the per-relation MRR (default: the config's last edge path)
    relation_edges: int = 20000  # at most this many edges for the per-relation MRR (0 skips it)
    metrics_file: Optional[str] = None  # a JSON file of `biggraph eval --json` to show as well
    seed: int = 0
    storage_options: Optional[dict[str, Any]] = None


@dataclass
class EpochRow:
    epoch: int
    edges: int = 0
    loss: Optional[float] = None
    mrr: Optional[float] = None
    hits10: Optional[float] = None
    edges_per_sec: Optional[float] = None
    compute: float = 0.0
    swap: float = 0.0
    edge_io: float = 0.0
    other: Optional[float] = None


@dataclass
class ValidationPoint:
    """One validation line of training_stats.json (validation_edge_paths)."""

    seconds: float  # since training started
    epoch: int  # 1-based
    version: int
    mrr: Optional[float]
    hits10: Optional[float]


@dataclass
class ReportData:
    checkpoint: str
    version: int
    config: dict[str, Any]
    epochs: list[EpochRow]
    num_bucket_records: int
    num_passes: int
    relation_mrr: list[tuple[str, float, int]] = field(default_factory=list)  # name, mrr, edges
    relation_note: str = ""
    projection: dict[str, np.ndarray] = field(default_factory=dict)  # type -> (n, 2)
    projection_names: dict[str, list[str]] = field(default_factory=dict)
    projection_note: str = ""
    explained: tuple[float, float] = (0.0, 0.0)
    eval_metrics: Optional[dict[str, Any]] = None
    eval_metrics_source: str = ""
    mrr_note: str = ""
    heldout_label: str = ""  # the protocol of the held-out MRR ("all candidates, raw"...), from the records
    relation_label: str = ""  # the protocol of the per-relation MRR
    validation: list[ValidationPoint] = field(default_factory=list)
    validation_label: str = ""  # the protocol of the validation MRR
    validation_note: str = ""  # why there is no validation chart
    best_version: Optional[int] = None  # the version that scored best on the validation edges

    @property
    def best_validation(self) -> Optional[ValidationPoint]:
        return next((p for p in self.validation if p.version == self.best_version), None)

    @property
    def eval_metrics_label(self) -> str:
        """The protocol of the ``--metrics`` file (older ``biggraph eval --json`` files do not say)."""
        return recorded_label(self.eval_metrics, legacy=None) if self.eval_metrics else ""

    @property
    def final(self) -> EpochRow:
        return self.epochs[-1] if self.epochs else EpochRow(0)


def num(value: Any) -> Optional[float]:
    """A finite number, or None (stats files may hold anything)."""
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


# training_stats.json -------------------------------------------------------------------------


@dataclass
class _EpochSums:
    """Weighted sums of one epoch: loss by trained edges, MRR and Hits@10 by held-out edges."""

    loss_seen: bool = False
    loss: float = 0.0
    loss_edges: float = 0.0
    mrr: float = 0.0
    hits10: float = 0.0
    eval_edges: float = 0.0
    pass_time: Optional[float] = None


def _unique_records(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Bucket records and pass summaries, the last of each kept: a resumed pass replaces its first try."""
    buckets: dict[tuple[Any, ...], dict[str, Any]] = {}
    passes: dict[int, dict[str, Any]] = {}
    for record in records:
        if record.get("validation"):  # not a bucket's: validation_lines reads them
            continue
        if record.get("pass_summary"):
            passes[int(record.get("index", len(passes)))] = record
        else:
            key = (record.get("index"), record.get("lhs_partition"), record.get("rhs_partition"), record.get("rank"))
            buckets[key] = record
    return list(buckets.values()), list(passes.values())


def _add_bucket(row: EpochRow, sums: _EpochSums, record: dict[str, Any]) -> None:
    stats = record.get("stats") or {}
    count = int(stats.get("count") or 0)
    loss = num((stats.get("metrics") or {}).get("loss"))
    row.edges += count
    if loss is not None:
        sums.loss_seen = True
        sums.loss += loss * count
        sums.loss_edges += count
    row.compute += num(record.get("time")) or 0.0
    swap = num(record.get("swap_time")) or 0.0
    row.swap += swap
    row.edge_io += max(0.0, (num(record.get("io_time")) or 0.0) - swap)
    after = record.get("eval_stats_after") or {}
    mrr = num((after.get("metrics") or {}).get("mrr"))
    hits10 = num((after.get("metrics") or {}).get("hits@10"))
    n = int(after.get("count") or 0)
    if mrr is not None and n:
        sums.mrr += mrr * n
        sums.hits10 += (hits10 or 0.0) * n
        sums.eval_edges += n


def _add_pass(row: EpochRow, sums: _EpochSums, summary: dict[str, Any]) -> None:
    if not sums.loss_seen:  # bucket records lost (e.g. a rewritten stats file): use the pass summary
        stats = summary.get("stats") or {}
        loss = num((stats.get("metrics") or {}).get("loss"))
        if loss is not None:
            weight = int(stats.get("count") or 1)
            sums.loss_seen, sums.loss, sums.loss_edges = True, loss * weight, weight
            row.edges = row.edges or int(stats.get("count") or 0)
    seconds = num(summary.get("time"))
    if seconds is not None and summary.get("world_size", 1) == 1:  # a multi-trainer pass time is not this split's
        sums.pass_time = (sums.pass_time or 0.0) + seconds


def _finish(row: EpochRow, sums: _EpochSums) -> None:
    if sums.loss_edges:
        row.loss = sums.loss / sums.loss_edges
    if sums.eval_edges:
        row.mrr = sums.mrr / sums.eval_edges
        row.hits10 = sums.hits10 / sums.eval_edges
    if row.compute > 0:
        row.edges_per_sec = row.edges / row.compute
    if sums.pass_time is not None:
        row.other = max(0.0, sums.pass_time - row.compute - row.swap - row.edge_io)


def epoch_rows(records: list[dict[str, Any]]) -> tuple[list[EpochRow], int, int]:
    """Per-epoch figures from training_stats.json records, with the number of bucket records and passes."""
    buckets, passes = _unique_records(records)
    rows: dict[int, EpochRow] = {}
    sums: dict[int, _EpochSums] = {}

    def slot(record: dict[str, Any]) -> tuple[EpochRow, _EpochSums]:
        epoch = int(record.get("epoch_idx", 0))
        return rows.setdefault(epoch, EpochRow(epoch + 1)), sums.setdefault(epoch, _EpochSums())

    for record in buckets:
        _add_bucket(*slot(record), record)
    for summary in passes:
        _add_pass(*slot(summary), summary)
    for epoch, row in rows.items():
        _finish(row, sums[epoch])
    return [rows[e] for e in sorted(rows)], len(buckets), len(passes)


def validation_lines(records: list[dict[str, Any]]) -> tuple[list[ValidationPoint], str, Optional[int]]:
    """The validation lines (one per version, the last kept: a resumed run may redo one) in wall-time order, their
    protocol label(s), and the best version the last line names."""
    by_version: dict[int, dict[str, Any]] = {}
    for record in records:
        if record.get("validation") and isinstance(record.get("checkpoint_version"), int):
            by_version[record["checkpoint_version"]] = record
    points, labels, best = [], set(), None
    for version in sorted(by_version):
        record = by_version[version]
        metrics = record.get("metrics") or {}
        seconds = num(record.get("seconds"))
        if seconds is None:
            continue
        points.append(ValidationPoint(seconds, int(record.get("epoch_idx", 0)) + 1, version, num(metrics.get("mrr")),
                                      num(metrics.get("hits@10"))))
        labels.add(recorded_label(record, legacy=None))
        best = record.get("best_version") if isinstance(record.get("best_version"), int) else best
    return points, " / ".join(sorted(labels)), best


# the whole report ----------------------------------------------------------------------------


def heldout_labels(records: list[dict[str, Any]]) -> str:
    """The protocol(s) of the held-out ranks of the bucket records; records written before protocols were
    recorded are PBG's (the only in-training protocol then). A resumed run may mix two: both are named."""
    labels = {recorded_label(r["eval_stats_after"]) for r in records
              if not r.get("pass_summary") and isinstance(r.get("eval_stats_after"), dict)}
    return " / ".join(sorted(labels))


def _training_figures(checkpoint_url: str, version: int, raw_config: dict[str, Any],
                      records: list[dict[str, Any]]) -> ReportData:
    rows, num_buckets, num_passes = epoch_rows(records)
    data = ReportData(checkpoint_url, version, raw_config, rows, num_buckets, num_passes)
    data.heldout_label = heldout_labels(records)
    data.validation, data.validation_label, data.best_version = validation_lines(records)
    if not records:
        data.validation_note = "training_stats.json is missing or empty"
    elif not data.validation:
        data.validation_note = ("not recorded: no validation_edge_paths in this run's config, so no validation split "
                                "was scored during training (docs/quality-preset.md says how to set one)")
    if not records:
        data.mrr_note = "training_stats.json is missing or empty"
    elif not any(r.mrr is not None for r in rows):
        data.mrr_note = (f"not recorded: eval_fraction is {raw_config.get('eval_fraction')} in this run's config, so no "
                         "edges were held out during training; `biggraph eval` results can be added with --metrics")
    return data


def _relation_note(config: ConfigSchema, version: int, edge_path: str, budget: int, edges: int, protocol: str) -> str:
    how = {
        "all": "against every entity of the bucket's partitions (raw: other true edges count against)",
        "sampled": (f"against the distinct entities among {config.eval_num_batch_negs} batch and "
                    f"{config.eval_num_uniform_negs} uniform draws, the true entity left out (raw)"),
        "pbg": (f"as PBG ranks: {config.eval_num_batch_negs} batch + {config.eval_num_uniform_negs} uniform draws, "
                "every draw scoring at least the true entity counted, repeats and the true entity included, so "
                "on a graph smaller than the draws ranks exceed the number of entities"),
    }[protocol]
    return (f"computed now from checkpoint version {version} on {edges:,} edges of {edge_path} "
            f"(at most {budget:,}), {protocol_label(protocol)}: ranked {how}; eval_protocol "
            f"'{config.eval_protocol}'. Compare relations with each other; `biggraph eval --candidates all --filter` "
            "gives the standard filtered figure. Training edges give optimistic numbers; pass --edges DIR for a "
            "held-out split.")


def _add_relation_mrr(data: ReportData, config: ConfigSchema, options: ReportOptions) -> None:
    edge_path = options.edges or config.edge_paths[-1]
    if options.relation_edges == 0:
        data.relation_note = "not computed (--relation-edges 0)"
        return
    try:
        logger.info("report: per-relation MRR on at most %d edges of %s", options.relation_edges, edge_path)
        data.relation_mrr, protocol = relation_mrr(config, edge_path, options.relation_edges, options.seed)
        edges = sum(c for _, _, c in data.relation_mrr)
        data.relation_label = protocol_label(protocol)
        data.relation_note = _relation_note(config, data.version, edge_path, options.relation_edges, edges, protocol)
    except Exception as err:  # the rest of the report is still worth writing
        logger.warning("report: per-relation MRR not computed: %s", err)
        data.relation_note = f"not computed: {err}"


def _add_projection(data: ReportData, checkpoint: CheckpointStorage, config: ConfigSchema,
                    options: ReportOptions) -> None:
    try:
        samples, data.projection_names = embedding_sample(checkpoint, data.version, config, options.sample, options.seed)
        data.projection, data.explained = pca_2d(samples)
        n = sum(len(a) for a in data.projection.values())
        data.projection_note = (f"{n:,} entities sampled from version {data.version}; axes: the first two principal "
                                f"components ({100 * data.explained[0]:.1f}% and {100 * data.explained[1]:.1f}% of the "
                                "variance)")
        if not data.projection:
            data.projection_note = "not drawn: " + ("--sample 0" if options.sample == 0 else
                                                    "entity types of different dimensions")
    except Exception as err:
        logger.warning("report: embedding projection not drawn: %s", err)
        data.projection_note = f"not drawn: {err}"


def _read_eval_metrics(path: str) -> dict[str, Any]:
    try:
        return json.loads(storage.read_text(path))
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(f"--metrics {path}: cannot read JSON ({err})") from None


def build_report(checkpoint_url: str, options: Optional[ReportOptions] = None) -> ReportData:
    """Every figure of the report of ``checkpoint_url``; raises CheckpointError when nothing was committed.

    ``options.storage_options`` (when given) are the storage settings of the whole report; otherwise the ones in
    force apply (a biggraph checkpoint's config.json never holds any: training leaves them out)."""
    options = options or ReportOptions()
    if options.storage_options is None:
        return _build_report(checkpoint_url, options)
    settings = dataclasses.replace(storage.current().settings, options=dict(options.storage_options))
    with storage.using(settings):
        return _build_report(checkpoint_url, options)


def _trained_config(checkpoint: CheckpointStorage, version: int) -> dict[str, Any]:
    """The whole config the version was trained with (model.h5's ``config/json``), else ``config.json``.

    ``config.json`` holds only the keys PBG 1.0.0 reads: a model trained with keys of ours that change its
    parameters (``reciprocal_relations``) is only scored right with the whole config."""
    try:
        text = checkpoint.load_model(version)[2].get("config/json")
        if isinstance(text, str) and text:
            full = json.loads(text)
            if isinstance(full, dict):
                return full
    except (OSError, ValueError, CheckpointError):  # a damaged model file: the report says so further on
        pass
    return checkpoint.load_config_dict()


def _build_report(checkpoint_url: str, options: ReportOptions) -> ReportData:
    committed = CheckpointManager.reader(checkpoint_url)
    checkpoint, version = committed.checkpoint, committed.version
    raw_config = _trained_config(checkpoint, version)
    data = _training_figures(checkpoint_url, version, raw_config, checkpoint.load_stats())
    try:
        config = parse_config(raw_config)
    except ConfigError as err:
        data.relation_note = data.projection_note = f"not computed: config.json does not parse ({err})"
        return data
    # the per-relation MRR reads the checkpoint reported on, not the directory it was trained in (it may have
    # moved), with the storage settings of this report
    config = dataclasses.replace(config, checkpoint_path=checkpoint_url,
                                 storage_options=dict(storage.current().settings.options))
    if options.metrics_file:
        data.eval_metrics = _read_eval_metrics(options.metrics_file)
        data.eval_metrics_source = options.metrics_file
    _add_relation_mrr(data, config, options)
    _add_projection(data, checkpoint, config, options)
    return data
