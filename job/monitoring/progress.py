"""Progress of a running task: a live ``tqdm`` bar on a terminal, rate-limited log lines anywhere else.

Training (rank 0 only) gets ``BarProgress`` when stderr is a terminal (epoch, bucket x/y, edges/s, loss,
ETA), otherwise ``LineProgress``: one plain log line at most every ``BIGGRAPH_PROGRESS_INTERVAL`` seconds
(default 30) plus one per pass; with ``--log-format json`` those lines are JSON objects with the numbers as
fields. ``BIGGRAPH_PROGRESS=bar|lines|off`` overrides the choice. ``task_progress`` gives the same
bar-or-nothing behaviour to ``import`` and ``eval``.

tqdm is a dependency of the package (small, pure Python): a bar never depends on an optional import. Log lines
written while a bar is drawn go above it through ``tqdm.contrib.logging.logging_redirect_tqdm``. tqdm is imported
only when a bar is drawn: its import reads the installed packages' metadata (~30 ms), which every process that
logs would pay, each pod of an import included (issue #46).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, Optional

from job.eval_protocol import recorded_label
from job.monitoring.base import Reporter, metric
from job.monitoring.json_logs import json_logging

logger = logging.getLogger("biggraph")

DEFAULT_INTERVAL_S = 30.0


def format_duration(seconds: float) -> str:
    """A short human duration for ETAs: 45s, 3m05s, 2h07m."""
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def progress_mode() -> str:
    """'bar' on an interactive terminal with text logs, 'lines' otherwise; BIGGRAPH_PROGRESS overrides."""
    forced = os.environ.get("BIGGRAPH_PROGRESS", "").strip().lower()
    if forced in ("bar", "lines", "off"):
        return forced
    if json_logging():
        return "lines"
    try:
        return "bar" if sys.stderr.isatty() else "lines"
    except (AttributeError, ValueError):
        return "lines"


def progress_interval() -> float:
    """Seconds between two progress lines (``BIGGRAPH_PROGRESS_INTERVAL``, default 30)."""
    try:
        return max(0.0, float(os.environ.get("BIGGRAPH_PROGRESS_INTERVAL", DEFAULT_INTERVAL_S)))
    except ValueError:
        return DEFAULT_INTERVAL_S


class _Progress:
    """What ``task_progress`` yields: ``update(n)`` and ``set_postfix(text)``."""

    def __init__(self, bar: Any = None) -> None:
        self.bar = bar

    def update(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def set_postfix(self, text: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)


@contextlib.contextmanager
def task_progress(desc: str, total: Optional[int] = None, unit: str = "it") -> Iterator[_Progress]:
    """A tqdm bar on an interactive terminal; nothing otherwise (the task logs its own lines)."""
    if progress_mode() != "bar":
        yield _Progress()
        return
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=True, dynamic_ncols=True, leave=False, file=sys.stderr)
    try:
        with logging_redirect_tqdm():  # the root logger's console handler writes above the bar meanwhile
            yield _Progress(bar)
    finally:
        bar.close()



class _ProgressState:
    """Where training is, from the records alone (resume-aware: the first record says where we started)."""

    def __init__(self, config: Any, total_passes: int, buckets_per_pass: int, clock: Callable[[], float]) -> None:
        self.num_epochs = max(1, int(getattr(config, "num_epochs", 1) or 1))
        self.total_passes = max(1, total_passes)
        self.buckets_per_pass = max(1, buckets_per_pass)
        self.total = self.total_passes * self.buckets_per_pass
        self.clock = clock
        self.started = clock()
        self.start_position: Optional[int] = None
        self.position = 0  # buckets done, over the whole run (all passes, all ranks as far as known)
        self.last: dict[str, Any] = {}

    def bucket(self, record: dict[str, Any]) -> None:
        index = int(record.get("index", self.position))
        if self.start_position is None:
            self.start_position = index  # resumed runs start part-way; the clock started with the reporter
        self.position = max(self.position, index + 1)
        self.last = record

    def passed(self, summary: dict[str, Any]) -> None:
        done = (int(summary.get("index", 0)) + 1) * self.buckets_per_pass
        if self.start_position is None:
            self.start_position = done - self.buckets_per_pass
        self.position = max(self.position, done)

    def eta(self) -> Optional[float]:
        if self.start_position is None:
            return None
        done = self.position - self.start_position
        if done <= 0:
            return None
        return (self.clock() - self.started) / done * (self.total - self.position)

    def fields(self) -> dict[str, Any]:
        record = self.last
        out: dict[str, Any] = {
            "epoch": int(record.get("epoch_idx", 0)) + 1,
            "num_epochs": self.num_epochs,
            "bucket": (self.position - 1) % self.buckets_per_pass + 1 if self.position else 0,
            "buckets_per_pass": self.buckets_per_pass,
            "pass": min(self.total_passes, (self.position - 1) // self.buckets_per_pass + 1) if self.position else 0,
            "total_passes": self.total_passes,
            "progress": round(self.position / self.total, 4),
        }
        for name, value in (("edges_per_sec", metric(record, "edges_per_sec")),
                            ("loss", metric(record, "stats", "metrics", "loss")),
                            ("eval_mrr", metric(record, "eval_stats_after", "metrics", "mrr"))):
            if value is not None:
                out[name] = round(value, 6)
        evaluated = record.get("eval_stats_after")
        if "eval_mrr" in out and isinstance(evaluated, dict):
            out["eval_protocol"] = recorded_label(evaluated)
        eta = self.eta()
        if eta is not None:
            out["eta_s"] = round(eta, 1)
        return out


def _describe(fields: dict[str, Any]) -> str:
    parts = [f"epoch {fields['epoch']}/{fields['num_epochs']}",
             f"bucket {fields['bucket']}/{fields['buckets_per_pass']}",
             f"pass {fields['pass']}/{fields['total_passes']} ({100 * fields['progress']:.0f}%)"]
    if "edges_per_sec" in fields:
        parts.append(f"{fields['edges_per_sec']:,.0f} edges/s")
    if "loss" in fields:
        parts.append(f"loss {fields['loss']:.4f}")
    if "eval_mrr" in fields:
        parts.append(f"eval MRR {fields['eval_mrr']:.4f}" + (f" ({fields['eval_protocol']})" if "eval_protocol" in fields
                                                             else ""))
    if "eta_s" in fields:
        parts.append(f"ETA {format_duration(fields['eta_s'])}")
    return ", ".join(parts)


class LineProgress(Reporter):
    """Non-interactive progress: one log line at most every ``interval`` seconds, and one per pass."""

    def __init__(self, config: Any, total_passes: int, buckets_per_pass: int, interval: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.state = _ProgressState(config, total_passes, buckets_per_pass, clock)
        self.interval = interval
        self.clock = clock
        self.last_line = -math.inf  # the first bucket gets a line: the job visibly started

    def _emit(self, kind: str) -> None:
        fields = self.state.fields()
        fields["event"] = kind
        logger.info("progress: %s", _describe(fields), extra={"fields": fields})
        self.last_line = self.clock()

    def on_bucket(self, record: dict[str, Any]) -> None:
        self.state.bucket(record)
        # a bucket that ends its pass gets the pass's line instead (``on_pass`` follows at once): with one bucket
        # per pass the first pass printed the same line twice
        ends_pass = self.state.position % self.state.buckets_per_pass == 0
        if not ends_pass and self.clock() - self.last_line >= self.interval:
            self._emit("progress")

    def on_pass(self, summary: dict[str, Any]) -> None:
        self.state.passed(summary)
        self._emit("pass")


class BarProgress(Reporter):
    """Interactive progress: a tqdm bar over every bucket of the run, log lines printed above it."""

    def __init__(self, config: Any, total_passes: int, buckets_per_pass: int) -> None:
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        self.state = _ProgressState(config, total_passes, buckets_per_pass, time.monotonic)
        self.bar = tqdm(total=self.state.total, unit="bucket", dynamic_ncols=True, file=sys.stderr,
                        bar_format="{desc} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} buckets "
                                   "[{elapsed}<{remaining}{postfix}]")
        self._logs = logging_redirect_tqdm()  # until close(): log lines go above the bar
        self._logs.__enter__()
        self._started = False

    def _move(self) -> None:
        state = self.state
        if not self._started and state.start_position is not None:
            # resumed runs start part-way: ETA counts only this run's buckets
            self.bar.n = self.bar.last_print_n = self.bar.initial = state.start_position
            self.bar.start_t = self.bar.last_print_t = time.time()
            self._started = True
        fields = state.fields()
        self.bar.set_description_str(f"epoch {fields['epoch']}/{fields['num_epochs']} "
                                     f"bucket {fields['bucket']}/{fields['buckets_per_pass']}", refresh=False)
        postfix = []
        if "edges_per_sec" in fields:
            postfix.append(f"{fields['edges_per_sec']:,.0f} edges/s")
        if "loss" in fields:
            postfix.append(f"loss {fields['loss']:.4f}")
        if "eval_mrr" in fields:
            postfix.append(f"MRR {fields['eval_mrr']:.4f}")
        self.bar.set_postfix_str(", ".join(postfix), refresh=False)
        self.bar.update(max(0, state.position - self.bar.n))

    def on_bucket(self, record: dict[str, Any]) -> None:
        self.state.bucket(record)
        self._move()

    def on_pass(self, summary: dict[str, Any]) -> None:
        self.state.passed(summary)
        self._move()

    def close(self) -> None:
        self.bar.close()
        self._logs.__exit__(None, None, None)
