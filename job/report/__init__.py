"""``biggraph report``: one self-contained HTML page (and optionally a PNG) about a trained checkpoint.

It shows what the checkpoint directory records: loss and held-out MRR per epoch, throughput, where the time
went (from each bucket's ``time``, ``io_time`` and ``swap_time``), per-relation MRR (computed from the
checkpoint on a sample of edges) and a 2-D PCA projection of a sample of the embeddings, coloured by entity
type. Anything that was not recorded is said to be missing, never invented.

- ``collect``: the figures (``build_report`` -> ``ReportData``; ``ReportOptions`` says what to sample, where
  to read);
- ``sampled``: per-relation MRR and PCA computed from the checkpoint's tensors;
- ``svg``: the hand-written chart kit, so the page needs no network and no extra Python package;
- ``html``: the page; ``png``: the same charts with matplotlib (``pip install 'biggraph[report]'``).

Not to be confused with ``job.monitoring``, which reports on a run while it trains (progress, TensorBoard,
Pushgateway). The command line lives in ``job.cli.report``.
"""

from __future__ import annotations

import logging
from typing import Optional

import storage_adapters as storage
from job.report.collect import ReportData, ReportOptions, build_report
from job.report.html import render_html
from job.report.png import render_png

__all__ = ["ReportData", "ReportOptions", "build_report", "render_html", "render_png", "write_report"]

logger = logging.getLogger("biggraph")


def write_report(checkpoint_url: str, out: str, png: Optional[str] = None,
                 options: Optional[ReportOptions] = None) -> ReportData:
    """Write the HTML report of ``checkpoint_url`` to ``out`` (and the PNG to ``png``); paths or URLs."""
    data = build_report(checkpoint_url, options)
    storage.write_text(out, render_html(data))
    logger.info("report: wrote %s", out)
    if png:
        storage.write_bytes(png, render_png(data))
        logger.info("report: wrote %s", png)
    return data
