"""The report's charts as one PNG, drawn with matplotlib (the optional ``report`` extra).

matplotlib is imported when a PNG is asked for: the HTML report needs no plotting package.
"""

from __future__ import annotations

import io
from typing import Any, Optional

import numpy as np

from job.errors import UserError
from job.report.collect import ReportData
from job.report.svg import PALETTE, TIME_PARTS


def _line(ax: Any, epochs: list[int], ys: list[Optional[float]], title: str, ylabel: str, note: str, color: str) -> None:
    from matplotlib.ticker import MaxNLocator  # optional dependency (see the module docstring)

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


def _time_bars(ax: Any, data: ReportData) -> None:
    from matplotlib.ticker import MaxNLocator  # optional dependency (see the module docstring)

    epochs = [r.epoch for r in data.epochs]
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


def _relations(ax: Any, data: ReportData) -> None:
    ax.set_title("MRR per relation" + (f" ({data.relation_label})" if data.relation_label else ""))
    if data.relation_mrr:
        items = sorted(data.relation_mrr, key=lambda t: t[1])[-25:]
        ax.barh([n[:24] for n, _, _ in items], [v for _, v, _ in items], color=PALETTE[0])
        ax.tick_params(axis="y", labelsize=7)
        ax.set_xlabel("MRR")
    else:
        ax.text(0.5, 0.5, data.relation_note[:80] or "not computed", ha="center", va="center", fontsize=9,
                transform=ax.transAxes)
        ax.set_axis_off()


def _validation(ax: Any, data: ReportData) -> None:
    label = f" ({data.validation_label})" if data.validation_label else ""
    ax.set_title("Validation MRR against wall time" + label, fontsize=10)
    seconds = [p.seconds for p in data.validation]
    drawn = False
    for name, values, color in (("MRR", [p.mrr for p in data.validation], PALETTE[0]),
                                ("Hits@10", [p.hits10 for p in data.validation], PALETTE[1])):
        pts = [(x, y) for x, y in zip(seconds, values) if y is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=color, label=name)
            drawn = True
    if not drawn:
        ax.text(0.5, 0.5, data.validation_note[:80] or "not recorded", ha="center", va="center", wrap=True,
                fontsize=9, transform=ax.transAxes)
        ax.set_axis_off()
        return
    ax.set_xlabel("seconds since training started")
    ax.set_ylabel("MRR / Hits@10")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def _projection(ax: Any, data: ReportData) -> None:
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


def render_png(data: ReportData) -> bytes:
    """The same charts as the HTML page, on a 4 x 2 grid; UserError when matplotlib is not installed."""
    try:  # optional dependency (see the module docstring)
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--png needs matplotlib: pip install 'biggraph[report]' (the HTML report needs nothing)") from None
    epochs = [r.epoch for r in data.epochs]
    fig, axes = plt.subplots(4, 2, figsize=(12, 17))
    fig.suptitle(f"biggraph report: {data.checkpoint} (version {data.version})", fontsize=12)
    _line(axes[0, 0], epochs, [r.loss for r in data.epochs], "Training loss", "mean loss", "", PALETTE[3])
    held_out = f"Held-out MRR ({data.heldout_label})" if data.heldout_label else "Held-out MRR"
    _line(axes[0, 1], epochs, [r.mrr for r in data.epochs], held_out, "MRR", "MRR per epoch " + data.mrr_note[:60],
          PALETTE[0])
    _line(axes[1, 0], epochs, [r.edges_per_sec for r in data.epochs], "Throughput", "edges/s", "", PALETTE[2])
    _time_bars(axes[1, 1], data)
    _relations(axes[2, 0], data)
    _projection(axes[2, 1], data)
    _validation(axes[3, 0], data)
    axes[3, 1].set_axis_off()
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=80)
    plt.close(fig)
    return buffer.getvalue()
