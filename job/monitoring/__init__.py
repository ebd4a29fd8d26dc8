"""Watching a job while it runs: progress display, TensorBoard scalars, Prometheus Pushgateway pushes.

The trainer calls ``on_bucket`` after every bucket, ``on_pass`` after every committed pass and ``close``
at the end of whatever ``make_reporter`` built from the environment and the config:

- ``progress``: a live bar on a terminal or rate-limited log lines (rank 0 only); also ``task_progress``,
  the bar of ``import`` and ``eval``;
- ``tensorboard``: scalars when ``tensorboard_dir`` is set;
- ``pushgateway``: gauges pushed after every pass when ``pushgateway_url`` is set;
- ``json_logs``: the JSON-lines log format those progress lines use under ``--log-format json``.

Not to be confused with ``job.report``, which writes an HTML/PNG report about a finished checkpoint
(``biggraph report``), nor with ``job.cli.logging_setup``, which installs the log handler. A sink that
fails logs a warning: monitoring never stops training.
"""

from __future__ import annotations

import logging
from typing import Any

from job.monitoring.base import MultiReporter, Reporter
from job.monitoring.progress import BarProgress, LineProgress, progress_interval, progress_mode, task_progress
from job.monitoring.pushgateway import PushgatewayReporter
from job.monitoring.tensorboard import TensorBoardReporter

__all__ = ["MultiReporter", "Reporter", "make_reporter", "task_progress"]

logger = logging.getLogger("biggraph")


def _progress_reporters(config: Any, total_passes: int, buckets_per_pass: int) -> list[Reporter]:
    mode = progress_mode()
    if mode == "bar":
        return [BarProgress(config, total_passes, buckets_per_pass)]
    if mode == "lines":
        return [LineProgress(config, total_passes, buckets_per_pass, progress_interval())]
    return []


def make_reporter(config: Any, rank: int = 0, total_passes: int = 1, buckets_per_pass: int = 1) -> Reporter:
    """What the environment and ``config`` ask for (progress on rank 0, TensorBoard, Pushgateway), as one reporter."""
    reporters: list[Reporter] = []
    if rank == 0:
        reporters += _progress_reporters(config, total_passes, buckets_per_pass)
    tensorboard_dir = getattr(config, "tensorboard_dir", None)
    if tensorboard_dir:
        try:
            reporters.append(TensorBoardReporter(tensorboard_dir, rank))
        except ImportError:
            logger.warning("tensorboard_dir is set but TensorBoard is not installed: pip install 'biggraph[tensorboard]' "
                           "(training goes on without it)")
    pushgateway_url = getattr(config, "pushgateway_url", None)
    if pushgateway_url:
        try:
            reporters.append(PushgatewayReporter(pushgateway_url, getattr(config, "pushgateway_job", "biggraph"), rank,
                                                 total_passes, buckets_per_pass))
        except ImportError:
            logger.warning("pushgateway_url is set but prometheus_client is not installed: pip install "
                           "'biggraph[prometheus]' (training goes on without pushes)")
    if not reporters:
        return Reporter()
    return MultiReporter(reporters)
