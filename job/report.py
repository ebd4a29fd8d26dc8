"""``biggraph report CHECKPOINT``: one self-contained HTML page (and optionally a PNG) about a trained model.

It shows what the checkpoint directory records: loss and held-out MRR per epoch, throughput, where the
time went (from each bucket's ``time``, ``io_time`` and ``swap_time``), per-relation MRR (computed here
from the checkpoint on a sample of edges, because training stats do not break MRR down by relation) and a
2-D PCA projection of a sample of the embeddings, coloured by entity type. Charts are inline SVG written by
hand, so the page needs no network and no extra Python package; ``--png`` uses matplotlib
(``pip install 'biggraph[report]'``). Anything that was not recorded is said to be missing, never invented.
"""

from __future__ import annotations

import argparse
import html
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

logger = logging.getLogger("biggraph")

PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf")
TIME_PARTS = (("compute", "#1f77b4"), ("partition swap", "#ff7f0e"), ("edge reading", "#2ca02c"),
              ("other (eval, commit, waiting)", "#bbbbbb"))


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "report", help="an HTML (and PNG) report of a checkpoint: loss, MRR, throughput, time split, embeddings",
    )
    parser.add_argument("checkpoint", help="checkpoint directory (path or URL) holding config.json and training_stats.json")
    parser.add_argument("--out", default="report.html", help="HTML file to write (default: ./report.html)")
    parser.add_argument("--png", default=None, help="also write the charts as a PNG (needs matplotlib: biggraph[report])")
    parser.add_argument("--sample", type=int, default=2000, help="entities drawn for the 2-D projection (default 2000)")
    parser.add_argument("--edges", default=None,
                        help="edge directory for the per-relation MRR (default: the config's last edge_paths entry)")
    parser.add_argument("--relation-edges", type=int, default=20000,
                        help="at most this many edges for the per-relation MRR (default 20000; 0 skips it)")
    parser.add_argument("--metrics", default=None,
                        help="a JSON file of `biggraph eval --json` (e.g. the demo's test_metrics.json) to show as well")
    parser.add_argument("--seed", type=int, default=0, help="seed of the samples (default 0)")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import storage_adapters as storage
    from job.errors import UserError

    if args.sample < 0 or args.relation_edges < 0:
        raise UserError("--sample and --relation-edges must be >= 0")
    started = time.perf_counter()
    data = collect(args.checkpoint, sample=args.sample, edges=args.edges, relation_edges=args.relation_edges,
                   metrics_file=args.metrics, seed=args.seed)
    storage.write_text(args.out, render_html(data))
    logger.info("report: wrote %s", args.out)
    if args.png:
        storage.write_bytes(args.png, render_png(data))
        logger.info("report: wrote %s", args.png)
    print(f"report of {data.checkpoint} (version {data.version}, {len(data.epochs)} epochs) in "
          f"{time.perf_counter() - started:.1f} s: {args.out}" + (f", {args.png}" if args.png else ""))
    return 0


# data ----------------------------------------------------------------------------------------


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

    @property
    def final(self) -> EpochRow:
        return self.epochs[-1] if self.epochs else EpochRow(0)


def _num(value: Any) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def epoch_rows(records: list[dict[str, Any]]) -> tuple[list[EpochRow], int, int]:
    """Per-epoch figures from training_stats.json records (deduplicated: a resumed pass replaces its first try)."""
    buckets: dict[tuple[Any, ...], dict[str, Any]] = {}
    passes: dict[int, dict[str, Any]] = {}
    for record in records:
        if record.get("pass_summary"):
            passes[int(record.get("index", len(passes)))] = record
        else:
            key = (record.get("index"), record.get("lhs_partition"), record.get("rhs_partition"), record.get("rank"))
            buckets[key] = record
    rows: dict[int, EpochRow] = {}
    loss_sums: dict[int, list[float]] = {}
    eval_sums: dict[int, list[float]] = {}
    for record in buckets.values():
        epoch = int(record.get("epoch_idx", 0))
        row = rows.setdefault(epoch, EpochRow(epoch + 1))
        stats = record.get("stats") or {}
        count = int(stats.get("count") or 0)
        loss = _num((stats.get("metrics") or {}).get("loss"))
        row.edges += count
        if loss is not None:
            sums = loss_sums.setdefault(epoch, [0.0, 0.0])
            sums[0] += loss * count
            sums[1] += count
        row.compute += _num(record.get("time")) or 0.0
        swap = _num(record.get("swap_time")) or 0.0
        row.swap += swap
        row.edge_io += max(0.0, (_num(record.get("io_time")) or 0.0) - swap)
        after = record.get("eval_stats_after") or {}
        mrr = _num((after.get("metrics") or {}).get("mrr"))
        hits10 = _num((after.get("metrics") or {}).get("hits@10"))
        n = int(after.get("count") or 0)
        if mrr is not None and n:
            sums = eval_sums.setdefault(epoch, [0.0, 0.0, 0.0])
            sums[0] += mrr * n
            sums[1] += (hits10 or 0.0) * n
            sums[2] += n
    pass_time: dict[int, float] = {}
    for summary in passes.values():
        epoch = int(summary.get("epoch_idx", 0))
        row = rows.setdefault(epoch, EpochRow(epoch + 1))
        if epoch not in loss_sums:  # bucket records lost (e.g. a rewritten stats file): use the pass summary
            stats = summary.get("stats") or {}
            loss = _num((stats.get("metrics") or {}).get("loss"))
            if loss is not None:
                loss_sums[epoch] = [loss * int(stats.get("count") or 1), int(stats.get("count") or 1)]
                row.edges = row.edges or int(stats.get("count") or 0)
        t = _num(summary.get("time"))
        if t is not None and summary.get("world_size", 1) == 1:  # several trainers: compute overlaps
            pass_time[epoch] = pass_time.get(epoch, 0.0) + t
    for epoch, row in rows.items():
        if epoch in loss_sums and loss_sums[epoch][1]:
            row.loss = loss_sums[epoch][0] / loss_sums[epoch][1]
        if epoch in eval_sums and eval_sums[epoch][2]:
            row.mrr = eval_sums[epoch][0] / eval_sums[epoch][2]
            row.hits10 = eval_sums[epoch][1] / eval_sums[epoch][2]
        if row.compute > 0:
            row.edges_per_sec = row.edges / row.compute
        if epoch in pass_time:
            row.other = max(0.0, pass_time[epoch] - row.compute - row.swap - row.edge_io)
    return [rows[e] for e in sorted(rows)], len(buckets), len(passes)


def _relation_names(config: Any) -> list[str]:
    from job.formats import entities as entity_format

    if not config.dynamic_relations:
        return [r.name for r in config.relations]
    try:
        return entity_format.read_dynamic_rel_names(config.entity_path)
    except Exception:  # noqa: BLE001 - names are cosmetic
        count = entity_format.read_dynamic_rel_count(config.entity_path)
        return [f"relation {i}" for i in range(count)]


def relation_mrr(config: Any, edge_path: str, budget: int, seed: int) -> list[tuple[str, float, int]]:
    """Sampled-negative MRR per relation (as ``biggraph eval --candidates sampled``) on at most ``budget`` edges."""
    import torch

    from job.evaluation import CheckpointReader, read_checked_edges
    from job.formats import edges as edge_format
    from job.train.batching import EdgeTensors, process_edges
    from job.train.data import bucket_grid
    from job.train.model import Table
    from job.train.step import BatchContext, BatchStats

    reader = CheckpointReader(config)
    names = _relation_names(config)
    nparts_lhs, nparts_rhs = bucket_grid(config)
    buckets = [(lhs, rhs) for lhs in range(nparts_lhs) for rhs in range(nparts_rhs)]
    per_bucket = max(1, budget // len(buckets))
    generator = torch.Generator()
    generator.manual_seed(seed)
    totals: dict[int, BatchStats] = {}
    for lhs_part, rhs_part in buckets:
        url = edge_format.edges_file(edge_path, lhs_part, rhs_part)
        count = edge_format.count_edges(url)
        if count == 0:
            continue
        arrays = read_checked_edges(reader, edge_path, lhs_part, rhs_part, 0, min(count, per_bucket))
        edges = EdgeTensors(torch.from_numpy(arrays.rel.astype(np.int64)), torch.from_numpy(arrays.lhs.astype(np.int64)),
                            torch.from_numpy(arrays.rhs.astype(np.int64)))
        lhs_tables = {i: Table(reader.partition(r.lhs, reader.part_of(r.lhs, lhs_part)), None)
                      for i, r in enumerate(config.relations)}
        rhs_tables = {i: Table(reader.partition(r.rhs, reader.part_of(r.rhs, rhs_part)), None)
                      for i, r in enumerate(config.relations)}
        ctx = BatchContext(config, reader.model, None, lhs_tables, rhs_tables, config.eval_num_batch_negs,
                           config.eval_num_uniform_negs)
        for rel in torch.unique(edges.rel).tolist():
            selection = torch.nonzero(edges.rel == rel).flatten()
            with torch.no_grad():
                stats = process_edges(ctx, edges, selection, config.batch_size, config.dynamic_relations, generator, False)
            totals.setdefault(int(rel), BatchStats()).add(stats)
    out = []
    for rel, stats in sorted(totals.items()):
        if stats.num_ranks:
            name = names[rel] if rel < len(names) else f"relation {rel}"
            out.append((name, stats.ranking_metrics()["mrr"], stats.count))
    return out


def embedding_sample(checkpoint: Any, version: int, config: Any, sample: int,
                     seed: int) -> tuple[dict[str, np.ndarray], dict[str, list[str]]]:
    """Up to ``sample`` rows over every (type, partition), in proportion to size (each type gets some)."""
    from job.formats import entities as entity_format
    from job.formats.checkpoint import EMBEDDING_DATASET

    rng = np.random.default_rng(seed)
    sizes: dict[tuple[str, int], int] = {}
    for entity_type, entity in config.entities.items():
        for part in range(entity.num_partitions):
            with checkpoint.open_partition(version, entity_type, part) as handle:
                sizes[(entity_type, part)] = int(handle[EMBEDDING_DATASET].shape[0])
    total = sum(sizes.values())
    rows: dict[str, list[np.ndarray]] = {}
    names: dict[str, list[str]] = {}
    for (entity_type, part), size in sizes.items():
        if size == 0 or sample == 0:
            continue
        take = min(size, max(min(size, 20), round(sample * size / max(total, 1))))
        idx = np.sort(rng.choice(size, size=take, replace=False))
        with checkpoint.open_partition(version, entity_type, part) as handle:  # checked when the block ends
            dataset = handle[EMBEDDING_DATASET]
            block = dataset[...] if size <= 100_000 else dataset[idx.tolist()]
        rows.setdefault(entity_type, []).append(np.asarray(block[idx] if size <= 100_000 else block, dtype=np.float64))
        try:
            if size <= 1_000_000 and entity_format.has_entity_names(config.entity_path, entity_type, part):
                all_names = entity_format.read_entity_names(config.entity_path, entity_type, part)
                names.setdefault(entity_type, []).extend(all_names[i] for i in idx)
            else:
                names.setdefault(entity_type, []).extend(f"{entity_type}/{part}/{i}" for i in idx)
        except Exception:  # noqa: BLE001 - names are cosmetic
            names.setdefault(entity_type, []).extend(f"{entity_type}/{part}/{i}" for i in idx)
    return {t: np.concatenate(r) for t, r in rows.items()}, names


def pca_2d(samples: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], tuple[float, float]]:
    """Project every type's rows on the first two principal axes of all of them (numpy SVD)."""
    dims = {a.shape[1] for a in samples.values()}
    if not samples or len(dims) != 1:
        return {}, (0.0, 0.0)
    stacked = np.concatenate(list(samples.values()))
    mean = stacked.mean(axis=0)
    centred = stacked - mean
    _, singular, vt = np.linalg.svd(centred, full_matrices=False)
    axes = vt[:2]
    if axes.shape[0] < 2:
        axes = np.vstack([axes, np.zeros_like(axes)])
    variance = singular**2
    share = variance / variance.sum() if variance.sum() > 0 else np.zeros_like(variance)
    explained = (float(share[0]) if len(share) > 0 else 0.0, float(share[1]) if len(share) > 1 else 0.0)
    return {t: (a - mean) @ axes.T for t, a in samples.items()}, explained


def collect(checkpoint_url: str, sample: int = 2000, edges: Optional[str] = None, relation_edges: int = 20000,
            metrics_file: Optional[str] = None, seed: int = 0) -> ReportData:
    import storage_adapters as storage
    from job.config import parse_config
    from job.errors import CheckpointError, ConfigError, UserError
    from job.formats.checkpoint import CheckpointStorage

    checkpoint = CheckpointStorage(checkpoint_url)
    version = checkpoint.load_version()
    raw_config = checkpoint.load_config_dict()
    if version == 0:
        raise CheckpointError(f"{checkpoint_url}: no committed checkpoint (checkpoint_version.txt missing): "
                              "train first, or point at the checkpoint_path of a finished run")
    records = checkpoint.load_stats()
    rows, num_buckets, num_passes = epoch_rows(records)
    data = ReportData(checkpoint_url, version, raw_config, rows, num_buckets, num_passes)
    if not records:
        data.mrr_note = "training_stats.json is missing or empty"
    elif not any(r.mrr is not None for r in rows):
        data.mrr_note = (f"not recorded: eval_fraction is {raw_config.get('eval_fraction')} in this run's config, so no "
                         "edges were held out during training; `biggraph eval` results can be added with --metrics")
    try:
        config = parse_config(raw_config)
        storage.set_storage_options(config.storage_options)
    except ConfigError as err:
        data.relation_note = data.projection_note = f"not computed: config.json does not parse ({err})"
        return data
    if metrics_file:
        try:
            data.eval_metrics = json.loads(storage.read_text(metrics_file))
            data.eval_metrics_source = metrics_file
        except (OSError, json.JSONDecodeError) as err:
            raise UserError(f"--metrics {metrics_file}: cannot read JSON ({err})") from None
    # per-relation MRR
    edge_path = edges or config.edge_paths[-1]
    if relation_edges == 0:
        data.relation_note = "not computed (--relation-edges 0)"
    else:
        try:
            logger.info("report: per-relation MRR on at most %d edges of %s", relation_edges, edge_path)
            data.relation_mrr = relation_mrr(config, edge_path, relation_edges, seed)
            n = sum(c for _, _, c in data.relation_mrr)
            data.relation_note = (f"computed now from checkpoint version {version} on {n:,} edges of {edge_path} "
                                  f"(at most {relation_edges:,}; sampled negatives: {config.eval_num_batch_negs} from the "
                                  f"batch + {config.eval_num_uniform_negs} uniform, unfiltered, as `biggraph eval` "
                                  "without --candidates all). Sampled ranks count every negative that scores above the "
                                  "true entity, repeats and other true edges included, so on small graphs they are far "
                                  "below the filtered all-candidate MRR; compare relations with each other, not with "
                                  "`biggraph eval --candidates all --filter`. Training edges give optimistic numbers; pass "
                                  "--edges DIR for a held-out split.")
        except Exception as err:  # noqa: BLE001 - the rest of the report is still worth writing
            logger.warning("report: per-relation MRR not computed: %s", err)
            data.relation_note = f"not computed: {err}"
    # embedding projection
    try:
        samples, data.projection_names = embedding_sample(checkpoint, version, config, sample, seed)
        data.projection, data.explained = pca_2d(samples)
        n = sum(len(a) for a in data.projection.values())
        data.projection_note = (f"{n:,} entities sampled from version {version}; axes: the first two principal components "
                                f"({100 * data.explained[0]:.1f}% and {100 * data.explained[1]:.1f}% of the variance)")
        if not data.projection:
            data.projection_note = "not drawn: " + ("--sample 0" if sample == 0 else "entity types of different dimensions")
    except Exception as err:  # noqa: BLE001
        logger.warning("report: embedding projection not drawn: %s", err)
        data.projection_note = f"not drawn: {err}"
    return data


# SVG -----------------------------------------------------------------------------------------

W, H = 560, 300
ML, MR, MT, MB = 64, 16, 34, 44  # margins


def _esc(text: Any) -> str:
    return html.escape(str(text), quote=True)


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    if not math.isfinite(lo) or not math.isfinite(hi):
        return [0.0]
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / max(1, count)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    first = math.floor(lo / step) * step
    ticks = []
    value = first
    while value <= hi + step * 1e-9:
        ticks.append(round(value, 12))
        value += step
    if ticks[-1] < hi:
        ticks.append(ticks[-1] + step)
    return ticks


def _fmt_tick(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 10000 or abs(value) < 0.001:
        return f"{value:.2g}"
    return f"{value:g}"


def _frame(title: str, body: str, height: int = H) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" viewBox="0 0 {W} {height}" '
            f'role="img" aria-label="{_esc(title)}"><rect width="{W}" height="{height}" fill="#fff"/>'
            f'<text x="{W / 2}" y="20" text-anchor="middle" font-size="15" font-weight="bold">{_esc(title)}</text>'
            f"{body}</svg>")


def svg_empty(title: str, note: str) -> str:
    lines, line = [], ""
    for word in note.split():  # wrap: SVG text does not
        if len(line) + len(word) > 80:
            lines.append(line)
            line = ""
        line = f"{line} {word}".strip()
    lines.append(line)
    body = "".join(f'<text x="{W / 2}" y="{56 + 17 * i}" text-anchor="middle" font-size="13" fill="#777">{_esc(text)}</text>'
                   for i, text in enumerate(lines[:6]))
    return _frame(title, body, height=70 + 17 * min(len(lines), 6))


def _axes(xt: list[float], yt: list[float], sx: Any, sy: Any, xlabel: str, ylabel: str, x_labels: Any = None) -> str:
    parts = [f'<line x1="{ML}" y1="{H - MB}" x2="{W - MR}" y2="{H - MB}" stroke="#333"/>',
             f'<line x1="{ML}" y1="{MT}" x2="{ML}" y2="{H - MB}" stroke="#333"/>']
    for y in yt:
        parts.append(f'<line x1="{ML}" y1="{sy(y):.1f}" x2="{W - MR}" y2="{sy(y):.1f}" stroke="#eee"/>'
                     f'<text x="{ML - 6}" y="{sy(y) + 4:.1f}" text-anchor="end" font-size="11">{_fmt_tick(y)}</text>')
    for x in xt:
        label = x_labels(x) if x_labels else _fmt_tick(x)
        parts.append(f'<text x="{sx(x):.1f}" y="{H - MB + 16}" text-anchor="middle" font-size="11">{_esc(label)}</text>')
    parts.append(f'<text x="{(ML + W - MR) / 2}" y="{H - 8}" text-anchor="middle" font-size="12">{_esc(xlabel)}</text>')
    parts.append(f'<text x="14" y="{(MT + H - MB) / 2}" text-anchor="middle" font-size="12" '
                 f'transform="rotate(-90 14 {(MT + H - MB) / 2})">{_esc(ylabel)}</text>')
    return "".join(parts)


def _legend(items: list[tuple[str, str]], x: float = ML + 10, y: float = MT + 6) -> str:
    parts = []
    for i, (label, color) in enumerate(items):
        parts.append(f'<rect x="{x}" y="{y + 16 * i}" width="10" height="10" fill="{color}"/>'
                     f'<text x="{x + 14}" y="{y + 16 * i + 9}" font-size="11">{_esc(label)}</text>')
    return "".join(parts)


def svg_line_chart(title: str, series: list[tuple[str, list[float], list[Optional[float]], str]], xlabel: str,
                   ylabel: str, note: str = "") -> str:
    points = [(x, y) for _, xs, ys, _ in series for x, y in zip(xs, ys) if y is not None]
    if not points:
        return svg_empty(title, note or "not recorded")
    xs_all = [p[0] for p in points]
    ys_all = [p[1] for p in points]
    xt = nice_ticks(min(xs_all), max(xs_all), min(6, max(1, len(set(xs_all)))))
    yt = nice_ticks(min(0.0, min(ys_all)) if min(ys_all) >= 0 and max(ys_all) <= 1 else min(ys_all), max(ys_all))
    x0, x1, y0, y1 = xt[0], xt[-1], yt[0], yt[-1]

    def sx(x: float) -> float:
        return ML + (x - x0) / ((x1 - x0) or 1) * (W - ML - MR)

    def sy(y: float) -> float:
        return H - MB - (y - y0) / ((y1 - y0) or 1) * (H - MT - MB)

    body = [_axes(xt, yt, sx, sy, xlabel, ylabel)]
    for name, xs, ys, color in series:
        pts = [(sx(x), sy(y), x, y) for x, y in zip(xs, ys) if y is not None]
        if len(pts) > 1:
            body.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" '
                        f'points="{" ".join(f"{px:.1f},{py:.1f}" for px, py, _, _ in pts)}"/>')
        for px, py, x, y in pts:
            body.append(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="3" fill="{color}"><title>{_esc(name)} {x:g}: '
                        f"{y:.4g}</title></circle>")
    if len(series) > 1:
        body.append(_legend([(n, c) for n, _, _, c in series], x=W - MR - 150))
    return _frame(title, "".join(body))


def svg_stacked_bars(title: str, labels: list[str], stacks: list[tuple[str, list[float], str]], ylabel: str) -> str:
    totals = [sum(s[1][i] for s in stacks) for i in range(len(labels))]
    if not labels or max(totals, default=0) <= 0:
        return svg_empty(title, "not recorded")
    yt = nice_ticks(0.0, max(totals))
    y1 = yt[-1]
    n = len(labels)
    slot = (W - ML - MR) / n

    def sx(i: float) -> float:
        return ML + (i + 0.5) * slot

    def sy(y: float) -> float:
        return H - MB - y / (y1 or 1) * (H - MT - MB)

    every = max(1, math.ceil(n / 12))
    body = [_axes([float(i) for i in range(0, n, every)], yt, sx, sy, "epoch", ylabel, lambda i: labels[int(i)])]
    for i in range(n):
        base = 0.0
        for name, values, color in stacks:
            value = values[i]
            if value <= 0:
                continue
            top = sy(base + value)
            body.append(f'<rect x="{sx(i) - slot * 0.35:.1f}" y="{top:.1f}" width="{slot * 0.7:.1f}" '
                        f'height="{sy(base) - top:.1f}" fill="{color}"><title>epoch {labels[i]} {_esc(name)}: '
                        f"{value:.3f} s</title></rect>")
            base += value
    body.append(_legend([(name, color) for name, _, color in stacks], x=W - MR - 200, y=MT))
    return _frame(title, "".join(body))


def svg_hbars(title: str, items: list[tuple[str, float, int]], xlabel: str, note: str) -> str:
    if not items:
        return svg_empty(title, note or "not recorded")
    items = sorted(items, key=lambda t: -t[1])
    bar = 16
    left = 190
    height = MT + bar * len(items) + 40
    xt = nice_ticks(0.0, max(1e-9, max(v for _, v, _ in items)))
    x1 = xt[-1]

    def sx(x: float) -> float:
        return left + x / (x1 or 1) * (W - left - MR - 40)

    body = [f'<line x1="{left}" y1="{MT}" x2="{left}" y2="{height - 34}" stroke="#333"/>']
    for i, (name, value, count) in enumerate(items):
        y = MT + i * bar
        label = name if len(name) <= 28 else name[:27] + "…"
        body.append(f'<text x="{left - 6}" y="{y + 12}" text-anchor="end" font-size="11">{_esc(label)}</text>'
                    f'<rect x="{left}" y="{y + 2}" width="{max(0.5, sx(value) - left):.1f}" height="{bar - 4}" '
                    f'fill="{PALETTE[0]}"><title>{_esc(name)}: MRR {value:.4f} over {count} edges</title></rect>'
                    f'<text x="{sx(value) + 4:.1f}" y="{y + 12}" font-size="10">{value:.3f}</text>')
    for x in xt:
        body.append(f'<text x="{sx(x):.1f}" y="{height - 20}" text-anchor="middle" font-size="11">{_fmt_tick(x)}</text>')
    body.append(f'<text x="{(left + W) / 2}" y="{height - 4}" text-anchor="middle" font-size="12">{_esc(xlabel)}</text>')
    return _frame(title, "".join(body), height=height)


def svg_scatter(title: str, groups: dict[str, np.ndarray], names: dict[str, list[str]], note: str) -> str:
    if not groups:
        return svg_empty(title, note or "not drawn")
    allpts = np.concatenate(list(groups.values()))
    lo = allpts.min(axis=0)
    hi = allpts.max(axis=0)
    span = np.where(hi - lo > 0, hi - lo, 1.0)
    lo, span = lo - 0.04 * span, span * 1.08  # a margin so that no point sits on the frame
    size = H + 120
    plot = size - MT - 20

    def sx(v: float) -> float:
        return ML + (v - lo[0]) / span[0] * (W - ML - MR - 10)

    def sy(v: float) -> float:
        return MT + plot - (v - lo[1]) / span[1] * plot

    body = [f'<rect x="{ML}" y="{MT}" width="{W - ML - MR - 10}" height="{plot}" fill="none" stroke="#ccc"/>']
    legend = []
    for i, (entity_type, pts) in enumerate(groups.items()):
        color = PALETTE[i % len(PALETTE)]
        legend.append((f"{entity_type} ({len(pts)})", color))
        labels = names.get(entity_type, [])
        for j, (x, y) in enumerate(pts):
            tip = f"<title>{_esc(labels[j])}</title>" if j < len(labels) else ""
            body.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{color}" fill-opacity="0.6">{tip}</circle>')
    body.append(_legend(legend, x=ML + 6, y=MT + 6))
    body.append(f'<text x="{(ML + W) / 2}" y="{size - 4}" text-anchor="middle" font-size="12">PC1</text>')
    return _frame(title, "".join(body), height=size)


# HTML ----------------------------------------------------------------------------------------


def _f(value: Optional[float], digits: int = 4) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def charts(data: ReportData) -> dict[str, str]:
    epochs = [float(r.epoch) for r in data.epochs]
    labels = [str(r.epoch) for r in data.epochs]
    time_values = [
        [r.compute for r in data.epochs], [r.swap for r in data.epochs], [r.edge_io for r in data.epochs],
        [r.other or 0.0 for r in data.epochs],
    ]
    mrr_series = [("MRR", epochs, [r.mrr for r in data.epochs], PALETTE[0]),
                  ("Hits@10", epochs, [r.hits10 for r in data.epochs], PALETTE[1])]
    return {
        "loss": svg_line_chart("Training loss per epoch", [("loss", epochs, [r.loss for r in data.epochs], PALETTE[3])],
                               "epoch", "mean loss per edge", "training_stats.json has no loss"),
        "mrr": svg_line_chart("Held-out MRR per epoch", mrr_series, "epoch", "MRR / Hits@10", data.mrr_note),
        "speed": svg_line_chart("Throughput per epoch",
                                [("edges/s", epochs, [r.edges_per_sec for r in data.epochs], PALETTE[2])],
                                "epoch", "edges / s of compute", "training_stats.json has no timings"),
        "time": svg_stacked_bars("Where the time went", labels,
                                 [(name, values, color) for (name, color), values in zip(TIME_PARTS, time_values)],
                                 "seconds"),
        "relations": svg_hbars("MRR per relation (sampled negatives, unfiltered)", data.relation_mrr, "MRR",
                               data.relation_note),
        "projection": svg_scatter("Embeddings (PCA, coloured by entity type)", data.projection,
                                  data.projection_names, data.projection_note),
    }


CSS = """
body { font-family: -apple-system, "Segoe UI", Roboto, Helvetica, Arial, sans-serif; margin: 24px; color: #222;
       max-width: 1180px; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 17px; margin-top: 28px; }
.sub { color: #666; font-size: 13px; }
table { border-collapse: collapse; font-size: 13px; margin: 8px 0; }
td, th { border: 1px solid #ddd; padding: 3px 8px; text-align: right; } th { background: #f4f4f4; }
td.k { text-align: left; color: #555; }
.grid { display: flex; flex-wrap: wrap; gap: 12px; } .grid > figure { margin: 0; }
figcaption { font-size: 12px; color: #666; max-width: 560px; }
.big { font-size: 20px; font-weight: bold; }
"""


def render_html(data: ReportData) -> str:
    c = charts(data)
    final = data.final
    config = data.config
    relations = config.get("relations") or []
    operators = sorted({str(r.get("operator", "none")) for r in relations if isinstance(r, dict)})
    entities = config.get("entities") or {}
    facts = [
        ("checkpoint", data.checkpoint), ("checkpoint version", data.version),
        ("epochs trained", len(data.epochs)), ("passes recorded", data.num_passes),
        ("buckets recorded", data.num_bucket_records),
        ("edges trained (last epoch)", f"{final.edges:,}"),
        ("entity types", ", ".join(f"{k} ({v.get('num_partitions', 1)} part.)" for k, v in entities.items()
                                   if isinstance(v, dict))),
        ("relation types", f"{len(relations)}" + (" (dynamic)" if config.get("dynamic_relations") else "")),
        ("model", f"dimension {config.get('dimension')}, operator {', '.join(operators) or 'none'}, comparator "
                  f"{config.get('comparator')}, loss {config.get('loss_fn')}, lr {config.get('lr')}"),
    ]
    headline = [("final loss", _f(final.loss)), ("final held-out MRR", _f(final.mrr)),
                ("final Hits@10", _f(final.hits10)), ("edges/s (last epoch)", _f(final.edges_per_sec, 0))]
    if data.eval_metrics:
        m = data.eval_metrics
        headline += [(f"eval MRR ({os.path.basename(data.eval_metrics_source)})", _f(_num(m.get("mrr")))),
                     ("eval Hits@10", _f(_num(m.get("hits@10"))))]
    if data.relation_mrr:
        n = sum(c for _, _, c in data.relation_mrr)
        overall = sum(v * c for _, v, c in data.relation_mrr) / max(n, 1)
        headline.append(("sampled MRR (per-relation sample)", _f(overall)))
    rows = "".join(
        f"<tr><td>{r.epoch}</td><td>{r.edges:,}</td><td>{_f(r.loss)}</td><td>{_f(r.mrr)}</td><td>{_f(r.hits10)}</td>"
        f"<td>{_f(r.edges_per_sec, 0)}</td><td>{r.compute:.2f}</td><td>{r.swap:.2f}</td><td>{r.edge_io:.2f}</td>"
        f"<td>{_f(r.other, 2)}</td></tr>" for r in data.epochs)
    rel_rows = "".join(f"<tr><td class='k'>{_esc(n)}</td><td>{v:.4f}</td><td>{c:,}</td></tr>"
                       for n, v, c in sorted(data.relation_mrr, key=lambda t: -t[1]))
    generated = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>biggraph report: {_esc(data.checkpoint)}</title>
<style>{CSS}</style></head><body>
<h1>biggraph training report</h1>
<div class="sub">{_esc(data.checkpoint)} · checkpoint version {data.version} · generated {generated}</div>
<h2>Results</h2>
<table id="headline"><tr>{"".join(f"<th>{_esc(k)}</th>" for k, _ in headline)}</tr>
<tr>{"".join(f'<td class="big">{_esc(v)}</td>' for _, v in headline)}</tr></table>
<table id="facts">{"".join(f"<tr><td class='k'>{_esc(k)}</td><td>{_esc(v)}</td></tr>" for k, v in facts)}</table>
<h2>Training</h2>
<div class="grid">
<figure id="chart-loss">{c["loss"]}</figure>
<figure id="chart-mrr">{c["mrr"]}<figcaption>MRR of the edges held out of each bucket (eval_fraction), after
training on it, averaged over the epoch's buckets.</figcaption></figure>
<figure id="chart-speed">{c["speed"]}<figcaption>Edges trained per second of bucket compute (all Hogwild workers of a
trainer together).</figcaption></figure>
<figure id="chart-time">{c["time"]}<figcaption>compute: training the buckets; partition swap: loading and writing
embedding partitions; edge reading: reading bucket edge files; other: the rest of each pass (held-out evaluation,
the checkpoint commit, waiting). "other" is shown for single-process runs only.</figcaption></figure>
</div>
<table id="epochs"><tr><th>epoch</th><th>edges</th><th>loss</th><th>MRR</th><th>Hits@10</th><th>edges/s</th>
<th>compute s</th><th>swap s</th><th>edge read s</th><th>other s</th></tr>{rows}</table>
<h2>Per relation</h2>
<figure id="chart-relations">{c["relations"]}<figcaption>{_esc(data.relation_note)}</figcaption></figure>
{f'<table id="relations"><tr><th>relation</th><th>MRR</th><th>edges</th></tr>{rel_rows}</table>' if rel_rows else ""}
<h2>Embeddings</h2>
<figure id="chart-projection">{c["projection"]}<figcaption>{_esc(data.projection_note)}</figcaption></figure>
</body></html>
"""


# PNG -----------------------------------------------------------------------------------------


def render_png(data: ReportData) -> bytes:
    """The same charts with matplotlib (the optional ``report`` extra)."""
    import io

    from job.errors import UserError

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise UserError("--png needs matplotlib: pip install 'biggraph[report]' (the HTML report needs nothing)") from None
    epochs = [r.epoch for r in data.epochs]
    fig, axes = plt.subplots(3, 2, figsize=(12, 13))
    fig.suptitle(f"biggraph report: {data.checkpoint} (version {data.version})", fontsize=12)

    def line(ax: Any, ys: list[Optional[float]], title: str, ylabel: str, note: str, color: str) -> None:
        pts = [(x, y) for x, y in zip(epochs, ys) if y is not None]
        ax.set_title(title)
        if not pts:
            ax.text(0.5, 0.5, note or "not recorded", ha="center", va="center", wrap=True, fontsize=9,
                    transform=ax.transAxes)
            ax.set_axis_off()
            return
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=color)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("epoch")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)

    line(axes[0, 0], [r.loss for r in data.epochs], "Training loss", "mean loss", "", PALETTE[3])
    line(axes[0, 1], [r.mrr for r in data.epochs], "Held-out MRR", "MRR", "MRR per epoch " + data.mrr_note[:60],
         PALETTE[0])
    line(axes[1, 0], [r.edges_per_sec for r in data.epochs], "Throughput", "edges/s", "", PALETTE[2])
    ax = axes[1, 1]
    ax.set_title("Where the time went")
    bottom = np.zeros(len(epochs))
    for (name, color), values in zip(TIME_PARTS, ([r.compute for r in data.epochs], [r.swap for r in data.epochs],
                                                  [r.edge_io for r in data.epochs], [r.other or 0.0 for r in data.epochs])):
        ax.bar(epochs, values, bottom=bottom, color=color, label=name)
        bottom += np.asarray(values)
    ax.set_xlabel("epoch")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("seconds")
    ax.legend(fontsize=8)
    ax = axes[2, 0]
    ax.set_title("MRR per relation")
    if data.relation_mrr:
        items = sorted(data.relation_mrr, key=lambda t: t[1])[-25:]
        ax.barh([n[:24] for n, _, _ in items], [v for _, v, _ in items], color=PALETTE[0])
        ax.tick_params(axis="y", labelsize=7)
        ax.set_xlabel("MRR")
    else:
        ax.text(0.5, 0.5, data.relation_note[:80] or "not computed", ha="center", va="center", fontsize=9,
                transform=ax.transAxes)
        ax.set_axis_off()
    ax = axes[2, 1]
    ax.set_title("Embeddings (PCA)")
    if data.projection:
        for i, (entity_type, pts) in enumerate(data.projection.items()):
            ax.scatter(pts[:, 0], pts[:, 1], s=6, alpha=0.6, color=PALETTE[i % len(PALETTE)], label=entity_type)
        ax.legend(fontsize=8)
        ax.set_xlabel(f"PC1 ({100 * data.explained[0]:.1f}%)")
        ax.set_ylabel(f"PC2 ({100 * data.explained[1]:.1f}%)")
    else:
        ax.text(0.5, 0.5, data.projection_note[:80], ha="center", va="center", fontsize=9, transform=ax.transAxes)
        ax.set_axis_off()
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=80)
    plt.close(fig)
    return buffer.getvalue()
