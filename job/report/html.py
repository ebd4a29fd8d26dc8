"""The report as one self-contained HTML page: headline figures, facts, the SVG charts and their tables."""

from __future__ import annotations

import os
import time
from typing import Any, Optional

from job.report.collect import ReportData, num
from job.report.svg import (
    PALETTE,
    TIME_PARTS,
    esc,
    svg_hbars,
    svg_line_chart,
    svg_scatter,
    svg_stacked_bars,
)


def _f(value: Optional[float], digits: int = 4) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _titled(title: str, label: str) -> str:
    """A figure's name with its ranking protocol, e.g. "Held-out MRR per epoch (all candidates, raw)"."""
    return f"{title} ({label})" if label else title


def validation_chart(data: ReportData) -> str:
    """Validation MRR and Hits@10 against the seconds since training started (validation_edge_paths)."""
    seconds = [p.seconds for p in data.validation]
    series = [("MRR", seconds, [p.mrr for p in data.validation], PALETTE[0]),
              ("Hits@10", seconds, [p.hits10 for p in data.validation], PALETTE[1])]
    return svg_line_chart(_titled("Validation MRR against wall time", data.validation_label), series,
                          "seconds since training started", "MRR / Hits@10", data.validation_note)


def _validation_caption(data: ReportData) -> str:
    best = data.best_validation
    if best is None:
        return "The validation split (validation_edge_paths) ranked after each validation_interval epochs: not recorded."
    return (f"The validation split (validation_edge_paths) ranked with the version committed at each validation, "
            f"{data.validation_label}; {len(data.validation)} validations. Best: version {best.version} (epoch "
            f"{best.epoch}, MRR {_f(best.mrr)}, after {best.seconds:.1f} s), kept in the checkpoint directory "
            "(best_version.txt): `biggraph eval CONFIG --version best`. A flat curve means the run has converged.")


def charts(data: ReportData) -> dict[str, str]:
    """The seven SVG charts of the page, by figure id."""
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
        "mrr": svg_line_chart(_titled("Held-out MRR per epoch", data.heldout_label), mrr_series, "epoch",
                              "MRR / Hits@10", data.mrr_note),
        "validation": validation_chart(data),
        "speed": svg_line_chart("Throughput per epoch",
                                [("edges/s", epochs, [r.edges_per_sec for r in data.epochs], PALETTE[2])],
                                "epoch", "edges / s of compute", "training_stats.json has no timings"),
        "time": svg_stacked_bars("Where the time went", labels,
                                 [(name, values, color) for (name, color), values in zip(TIME_PARTS, time_values)],
                                 "seconds"),
        "relations": svg_hbars(_titled("MRR per relation", data.relation_label), data.relation_mrr, "MRR",
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



def _facts(data: ReportData) -> list[tuple[str, Any]]:
    config = data.config
    relations = config.get("relations") or []
    operators = sorted({str(r.get("operator", "none")) for r in relations if isinstance(r, dict)})
    entities = config.get("entities") or {}
    return [
        ("checkpoint", data.checkpoint), ("checkpoint version", data.version),
        ("epochs trained", len(data.epochs)), ("passes recorded", data.num_passes),
        ("buckets recorded", data.num_bucket_records),
        ("edges trained (last epoch)", f"{data.final.edges:,}"),
        ("entity types", ", ".join(f"{k} ({v.get('num_partitions', 1)} part.)" for k, v in entities.items()
                                   if isinstance(v, dict))),
        ("relation types", f"{len(relations)}" + (" (dynamic)" if config.get("dynamic_relations") else "")),
        ("model", f"dimension {config.get('dimension')}, operator {', '.join(operators) or 'none'}, comparator "
                  f"{config.get('comparator')}, loss {config.get('loss_fn')}, lr {config.get('lr')}"),
    ]


def _headline(data: ReportData) -> list[tuple[str, str]]:
    final = data.final
    held_out = data.heldout_label
    headline = [("final loss", _f(final.loss)), (_titled("final held-out MRR", held_out), _f(final.mrr)),
                (_titled("final held-out Hits@10", held_out), _f(final.hits10)),
                ("edges/s (last epoch)", _f(final.edges_per_sec, 0))]
    best = data.best_validation
    if best is not None:
        headline.append((_titled(f"best validation MRR (version {best.version})", data.validation_label),
                         _f(best.mrr)))
    if data.eval_metrics:
        m = data.eval_metrics
        source = os.path.basename(data.eval_metrics_source)
        headline += [(f"eval MRR ({source}; {data.eval_metrics_label})", _f(num(m.get("mrr")))),
                     (f"eval Hits@10 ({source}; {data.eval_metrics_label})", _f(num(m.get("hits@10"))))]
    if data.relation_mrr:
        n = sum(c for _, _, c in data.relation_mrr)
        overall = sum(v * c for _, v, c in data.relation_mrr) / max(n, 1)
        headline.append((_titled("MRR of the per-relation sample", data.relation_label), _f(overall)))
    return headline


def _epoch_rows_html(data: ReportData) -> str:
    return "".join(
        f"<tr><td>{r.epoch}</td><td>{r.edges:,}</td><td>{_f(r.loss)}</td><td>{_f(r.mrr)}</td><td>{_f(r.hits10)}</td>"
        f"<td>{_f(r.edges_per_sec, 0)}</td><td>{r.compute:.2f}</td><td>{r.swap:.2f}</td><td>{r.edge_io:.2f}</td>"
        f"<td>{_f(r.other, 2)}</td></tr>" for r in data.epochs)


def render_html(data: ReportData) -> str:
    """The page: no script, no stylesheet or font to fetch, so it opens anywhere (mail, artifact stores)."""
    c = charts(data)
    headline = _headline(data)
    held_out = data.heldout_label
    rel_rows = "".join(f"<tr><td class='k'>{esc(n)}</td><td>{v:.4f}</td><td>{count:,}</td></tr>"
                       for n, v, count in sorted(data.relation_mrr, key=lambda t: -t[1]))
    generated = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>biggraph report: {esc(data.checkpoint)}</title>
<style>{CSS}</style></head><body>
<h1>biggraph training report</h1>
<div class="sub">{esc(data.checkpoint)} · checkpoint version {data.version} · generated {generated}</div>
<h2>Results</h2>
<table id="headline"><tr>{"".join(f"<th>{esc(k)}</th>" for k, _ in headline)}</tr>
<tr>{"".join(f'<td class="big">{esc(v)}</td>' for _, v in headline)}</tr></table>
<table id="facts">{"".join(f"<tr><td class='k'>{esc(k)}</td><td>{esc(v)}</td></tr>" for k, v in _facts(data))}</table>
<h2>Training</h2>
<div class="grid">
<figure id="chart-loss">{c["loss"]}</figure>
<figure id="chart-mrr">{c["mrr"]}<figcaption>MRR of the edges held out of each bucket (eval_fraction), after
training on it, averaged over the epoch's buckets; ranked {esc(data.heldout_label or "(not recorded)")}
(eval_protocol).</figcaption></figure>
<figure id="chart-validation">{c["validation"]}<figcaption>{esc(_validation_caption(data))}</figcaption></figure>
<figure id="chart-speed">{c["speed"]}<figcaption>Edges trained per second of bucket compute (all Hogwild workers of a
trainer together).</figcaption></figure>
<figure id="chart-time">{c["time"]}<figcaption>compute: training the buckets; partition swap: loading and writing
embedding partitions; edge reading: reading bucket edge files; other: the rest of each pass (held-out evaluation,
the checkpoint commit, waiting). "other" is shown for single-process runs only.</figcaption></figure>
</div>
<table id="epochs"><tr><th>epoch</th><th>edges</th><th>loss</th><th>{esc(_titled("MRR", held_out))}</th>
<th>{esc(_titled("Hits@10", held_out))}</th><th>edges/s</th>
<th>compute s</th><th>swap s</th><th>edge read s</th><th>other s</th></tr>{_epoch_rows_html(data)}</table>
<h2>Per relation</h2>
<figure id="chart-relations">{c["relations"]}<figcaption>{esc(data.relation_note)}</figcaption></figure>
{f'<table id="relations"><tr><th>relation</th><th>MRR</th><th>edges</th></tr>{rel_rows}</table>' if rel_rows else ""}
<h2>Embeddings</h2>
<figure id="chart-projection">{c["projection"]}<figcaption>{esc(data.projection_note)}</figcaption></figure>
</body></html>
"""
