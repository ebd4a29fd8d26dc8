"""A small hand-written SVG chart kit: line charts, stacked bars, horizontal bars, a scatter plot.

Written by hand so that the report page is one self-contained file that needs no network, no JavaScript and
no plotting package; every mark carries a ``<title>`` so a browser shows its value on hover.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable
from typing import Any, Optional

import numpy as np

PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf")
# the parts of a pass's time, in stacking order, with their colours (the HTML and PNG charts agree on them)
TIME_PARTS = (("compute", "#1f77b4"), ("partition swap", "#ff7f0e"), ("edge reading", "#2ca02c"),
              ("other (eval, commit, waiting)", "#bbbbbb"))

W, H = 560, 300
ML, MR, MT, MB = 64, 16, 34, 44  # margins


def esc(text: Any) -> str:
    """Text made safe inside SVG/HTML elements and attributes."""
    return html.escape(str(text), quote=True)


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About ``count`` round tick values (steps of 1, 2, 2.5 or 5 x 10^k) covering ``lo``..``hi``."""
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
            f'role="img" aria-label="{esc(title)}"><rect width="{W}" height="{height}" fill="#fff"/>'
            f'<text x="{W / 2}" y="20" text-anchor="middle" font-size="15" font-weight="bold">{esc(title)}</text>'
            f"{body}</svg>")


def svg_empty(title: str, note: str) -> str:
    """A chart frame that says why there is nothing to draw (missing data is said, never invented)."""
    lines, line = [], ""
    for word in note.split():  # wrap: SVG text does not
        if len(line) + len(word) > 80:
            lines.append(line)
            line = ""
        line = f"{line} {word}".strip()
    lines.append(line)
    body = "".join(f'<text x="{W / 2}" y="{56 + 17 * i}" text-anchor="middle" font-size="13" fill="#777">{esc(text)}</text>'
                   for i, text in enumerate(lines[:6]))
    return _frame(title, body, height=70 + 17 * min(len(lines), 6))


def _axes(xt: list[float], yt: list[float], sx: Callable[[float], float], sy: Callable[[float], float], xlabel: str,
          ylabel: str, x_labels: Optional[Callable[[float], str]] = None) -> str:
    parts = [f'<line x1="{ML}" y1="{H - MB}" x2="{W - MR}" y2="{H - MB}" stroke="#333"/>',
             f'<line x1="{ML}" y1="{MT}" x2="{ML}" y2="{H - MB}" stroke="#333"/>']
    for y in yt:
        parts.append(f'<line x1="{ML}" y1="{sy(y):.1f}" x2="{W - MR}" y2="{sy(y):.1f}" stroke="#eee"/>'
                     f'<text x="{ML - 6}" y="{sy(y) + 4:.1f}" text-anchor="end" font-size="11">{_fmt_tick(y)}</text>')
    for x in xt:
        label = x_labels(x) if x_labels else _fmt_tick(x)
        parts.append(f'<text x="{sx(x):.1f}" y="{H - MB + 16}" text-anchor="middle" font-size="11">{esc(label)}</text>')
    parts.append(f'<text x="{(ML + W - MR) / 2}" y="{H - 8}" text-anchor="middle" font-size="12">{esc(xlabel)}</text>')
    parts.append(f'<text x="14" y="{(MT + H - MB) / 2}" text-anchor="middle" font-size="12" '
                 f'transform="rotate(-90 14 {(MT + H - MB) / 2})">{esc(ylabel)}</text>')
    return "".join(parts)


def _legend(items: list[tuple[str, str]], x: float = ML + 10, y: float = MT + 6) -> str:
    parts = []
    for i, (label, color) in enumerate(items):
        parts.append(f'<rect x="{x}" y="{y + 16 * i}" width="10" height="10" fill="{color}"/>'
                     f'<text x="{x + 14}" y="{y + 16 * i + 9}" font-size="11">{esc(label)}</text>')
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
            body.append(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="3" fill="{color}"><title>{esc(name)} {x:g}: '
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
                        f'height="{sy(base) - top:.1f}" fill="{color}"><title>epoch {labels[i]} {esc(name)}: '
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
        body.append(f'<text x="{left - 6}" y="{y + 12}" text-anchor="end" font-size="11">{esc(label)}</text>'
                    f'<rect x="{left}" y="{y + 2}" width="{max(0.5, sx(value) - left):.1f}" height="{bar - 4}" '
                    f'fill="{PALETTE[0]}"><title>{esc(name)}: MRR {value:.4f} over {count} edges</title></rect>'
                    f'<text x="{sx(value) + 4:.1f}" y="{y + 12}" font-size="10">{value:.3f}</text>')
    for x in xt:
        body.append(f'<text x="{sx(x):.1f}" y="{height - 20}" text-anchor="middle" font-size="11">{_fmt_tick(x)}</text>')
    body.append(f'<text x="{(left + W) / 2}" y="{height - 4}" text-anchor="middle" font-size="12">{esc(xlabel)}</text>')
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
            tip = f"<title>{esc(labels[j])}</title>" if j < len(labels) else ""
            body.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{color}" fill-opacity="0.6">{tip}</circle>')
    body.append(_legend(legend, x=ML + 6, y=MT + 6))
    body.append(f'<text x="{(ML + W) / 2}" y="{size - 4}" text-anchor="middle" font-size="12">PC1</text>')
    return _frame(title, "".join(body), height=size)
