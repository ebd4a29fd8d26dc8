"""Training progress reporting hooks (progress display, metrics sinks).

The trainer calls ``on_bucket`` after every bucket, ``on_pass`` after every committed pass and
``close`` at the end; this module decides what to do with them:

- progress, on rank 0 only: a live ``tqdm`` bar when stderr is a terminal (epoch, bucket x/y,
  edges/s, loss, ETA), otherwise (Kubernetes logs, CI, a pipe) one plain log line at most every
  ``BIGGRAPH_PROGRESS_INTERVAL`` seconds (default 30) plus one per pass; with ``--log-format json``
  those lines are JSON objects with the numbers as fields. ``BIGGRAPH_PROGRESS=bar|lines|off``
  overrides the choice.
- TensorBoard scalars when ``tensorboard_dir`` is set (``pip install 'biggraph[tensorboard]'``).
- a Prometheus Pushgateway push at the end of every pass when ``pushgateway_url`` is set (batch
  jobs have no scrape endpoint); a failed push is a warning, never a training failure.

``task_progress`` gives the same bar-or-nothing behaviour to ``import`` and ``eval``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any, Optional

logger = logging.getLogger("biggraph")

DEFAULT_INTERVAL_S = 30.0
PUSH_TIMEOUT_S = 5.0


class Reporter:
    """Does nothing; subclasses show progress or ship metrics."""

    def on_bucket(self, record: dict[str, Any]) -> None:
        pass

    def on_pass(self, summary: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class MultiReporter(Reporter):
    """Fans the hooks out; one failing sink never stops the others, nor training."""

    def __init__(self, reporters: list[Reporter]) -> None:
        self.reporters = reporters

    def _each(self, method: str, *args: Any) -> None:
        for reporter in self.reporters:
            try:
                getattr(reporter, method)(*args)
            except Exception as err:  # noqa: BLE001 - reporting must never fail training
                logger.warning("%s.%s failed: %s", type(reporter).__name__, method, err)

    def on_bucket(self, record: dict[str, Any]) -> None:
        self._each("on_bucket", record)

    def on_pass(self, summary: dict[str, Any]) -> None:
        self._each("on_pass", summary)

    def close(self) -> None:
        self._each("close")


# helpers -----------------------------------------------------------------------------------


def _metric(record: dict[str, Any], *path: str) -> Optional[float]:
    value: Any = record
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def format_duration(seconds: float) -> str:
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
    if _json_logging():
        return "lines"
    try:
        return "bar" if sys.stderr.isatty() else "lines"
    except (AttributeError, ValueError):
        return "lines"


def _json_logging() -> bool:
    from job.logs import JsonFormatter

    return any(isinstance(h.formatter, JsonFormatter) for h in logging.getLogger().handlers)


def _interval() -> float:
    try:
        return max(0.0, float(os.environ.get("BIGGRAPH_PROGRESS_INTERVAL", DEFAULT_INTERVAL_S)))
    except ValueError:
        return DEFAULT_INTERVAL_S


class _TqdmStream:
    """A stream for logging handlers that prints above the live bar instead of through it."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, text: str) -> None:
        from tqdm import tqdm

        text = text.rstrip("\n")
        if text:
            tqdm.write(text, file=self.stream)

    def flush(self) -> None:
        self.stream.flush()


@contextlib.contextmanager
def _logs_above_bar() -> Iterator[None]:
    swapped = []
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stderr, sys.stdout):
            swapped.append((handler, handler.setStream(_TqdmStream(handler.stream))))
    try:
        yield
    finally:
        for handler, old in swapped:
            handler.setStream(old)


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
    try:
        from tqdm import tqdm
    except ImportError:
        yield _Progress()
        return
    bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=True, dynamic_ncols=True, leave=False, file=sys.stderr)
    try:
        with _logs_above_bar():
            yield _Progress(bar)
    finally:
        bar.close()


# progress ----------------------------------------------------------------------------------


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
        for name, value in (("edges_per_sec", _metric(record, "edges_per_sec")),
                            ("loss", _metric(record, "stats", "metrics", "loss")),
                            ("eval_mrr", _metric(record, "eval_stats_after", "metrics", "mrr"))):
            if value is not None:
                out[name] = round(value, 6)
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
        parts.append(f"eval MRR {fields['eval_mrr']:.4f}")
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
        if self.clock() - self.last_line >= self.interval:
            self._emit("progress")

    def on_pass(self, summary: dict[str, Any]) -> None:
        self.state.passed(summary)
        self._emit("pass")


class BarProgress(Reporter):
    """Interactive progress: a tqdm bar over every bucket of the run, log lines printed above it."""

    def __init__(self, config: Any, total_passes: int, buckets_per_pass: int) -> None:
        from tqdm import tqdm

        self.state = _ProgressState(config, total_passes, buckets_per_pass, time.monotonic)
        self.bar = tqdm(total=self.state.total, unit="bucket", dynamic_ncols=True, file=sys.stderr,
                        bar_format="{desc} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} buckets "
                                   "[{elapsed}<{remaining}{postfix}]")
        self._logs = _logs_above_bar()
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


# TensorBoard -------------------------------------------------------------------------------


RANKING_METRICS = ("mrr", "hits@1", "hits@10", "hits@50", "auc", "mean_rank")


def scalars_of_bucket(record: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for tag, path in (("bucket/loss", ("stats", "metrics", "loss")), ("bucket/edges_per_sec", ("edges_per_sec",)),
                      ("bucket/compute_time_s", ("time",)), ("bucket/io_time_s", ("io_time",)),
                      ("bucket/swap_time_s", ("swap_time",))):
        value = _metric(record, *path)
        if value is not None:
            out[tag] = value
    for name in RANKING_METRICS:
        for when in ("before", "after"):
            value = _metric(record, f"eval_stats_{when}", "metrics", name)
            if value is not None:
                out[f"bucket_eval_{when}/{name}"] = value
    return out


def scalars_of_pass(summary: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for tag, path in (("pass/loss", ("stats", "metrics", "loss")), ("pass/edges_per_sec", ("edges_per_sec",)),
                      ("pass/time_s", ("time",)), ("pass/edges", ("stats", "count"))):
        value = _metric(summary, *path)
        if value is not None:
            out[tag] = value
    for name in RANKING_METRICS:
        value = _metric(summary, "eval_stats_after", "metrics", name)
        if value is not None:
            out[f"eval/{name}"] = value
    return out


class TensorBoardReporter(Reporter):
    """Scalars per bucket (step: global bucket index) and per pass (step: pass number)."""

    def __init__(self, log_dir: str, rank: int = 0) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        self.log_dir = os.path.join(log_dir, f"rank{rank}") if world > 1 else log_dir
        self.writer = SummaryWriter(log_dir=self.log_dir)

    def on_bucket(self, record: dict[str, Any]) -> None:
        step = int(record.get("index", 0))
        for tag, value in scalars_of_bucket(record).items():
            self.writer.add_scalar(tag, value, step)

    def on_pass(self, summary: dict[str, Any]) -> None:
        step = int(summary.get("index", 0)) + 1
        for tag, value in scalars_of_pass(summary).items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


# Prometheus Pushgateway --------------------------------------------------------------------

# name, help; values come from ``PushgatewayReporter._values``
PUSH_METRICS = (
    ("biggraph_pass", "Number of the last pass (epoch x edge path x chunk) this trainer finished."),
    ("biggraph_passes_total", "Number of passes of the whole run."),
    ("biggraph_epoch", "Epoch (1-based) of the last finished pass."),
    ("biggraph_loss", "Mean training loss over the last pass."),
    ("biggraph_edges_per_second", "Training throughput of the last pass (edges per second of compute)."),
    ("biggraph_pass_edges", "Edges trained in the last pass."),
    ("biggraph_edges_trained", "Edges trained by this process since it started."),
    ("biggraph_pass_seconds", "Wall-clock seconds of the last pass (rank 0: including the commit)."),
    ("biggraph_compute_seconds", "Seconds spent training buckets in the last pass, on this trainer."),
    ("biggraph_io_seconds", "Seconds spent loading partitions and reading edges in the last pass, on this trainer."),
    ("biggraph_swap_seconds", "Seconds spent swapping partitions in and out in the last pass, on this trainer."),
    ("biggraph_eval_mrr", "Mean reciprocal rank on the held-out edges after the last pass."),
    ("biggraph_eval_hits_at_1", "Hits@1 on the held-out edges after the last pass."),
    ("biggraph_eval_hits_at_10", "Hits@10 on the held-out edges after the last pass."),
    ("biggraph_eval_hits_at_50", "Hits@50 on the held-out edges after the last pass."),
    ("biggraph_eval_auc", "AUC on the held-out edges after the last pass."),
    ("biggraph_eval_mean_rank", "Mean rank on the held-out edges after the last pass."),
    ("biggraph_last_push_timestamp_seconds", "Unix time of this push."),
)


def exposition(values: dict[str, float]) -> str:
    """Prometheus text exposition format (version 0.0.4), gauges only."""
    lines = []
    for name, text in PUSH_METRICS:
        if name in values and values[name] is not None and math.isfinite(values[name]):
            lines += [f"# HELP {name} {text}", f"# TYPE {name} gauge", f"{name} {float(values[name])!r}"]
    return "\n".join(lines) + "\n"


def push_to_gateway(url: str, job: str, instance: str, body: str, timeout: float = PUSH_TIMEOUT_S) -> None:
    """PUT the metric group ``job/instance`` (replacing what it held); raises on failure."""
    target = (f"{url.rstrip('/')}/metrics/job/{urllib.parse.quote(job, safe='')}"
              f"/instance/{urllib.parse.quote(instance, safe='')}")
    request = urllib.request.Request(target, data=body.encode("utf-8"), method="PUT",
                                     headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})
    with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 - the configured URL
        if response.status >= 300:
            raise urllib.error.HTTPError(target, response.status, response.reason, response.headers, None)


class PushgatewayReporter(Reporter):
    """Pushes this trainer's numbers after each pass; other ranks (no pass summary) push when their pass changes."""

    def __init__(self, url: str, job: str, rank: int, total_passes: int, buckets_per_pass: int) -> None:
        self.url = url
        self.job = job
        self.rank = rank
        self.total_passes = total_passes
        self.buckets_per_pass = max(1, buckets_per_pass)
        self.buckets: list[dict[str, Any]] = []
        self.current_pass: Optional[int] = None
        self.edges_trained = 0.0
        self.failures = 0

    def _pass_of(self, record: dict[str, Any]) -> int:
        return int(record.get("index", 0)) // self.buckets_per_pass

    def on_bucket(self, record: dict[str, Any]) -> None:
        this_pass = self._pass_of(record)
        if self.current_pass is not None and this_pass != self.current_pass and self.buckets:
            self._push(None)
        self.current_pass = this_pass
        self.buckets.append(record)
        self.edges_trained += _metric(record, "stats", "count") or 0.0

    def on_pass(self, summary: dict[str, Any]) -> None:
        self._push(summary)

    def close(self) -> None:
        if self.buckets:
            self._push(None)

    def _values(self, summary: Optional[dict[str, Any]]) -> dict[str, float]:
        buckets = self.buckets
        values: dict[str, float] = {"biggraph_passes_total": self.total_passes,
                                    "biggraph_edges_trained": self.edges_trained,
                                    "biggraph_last_push_timestamp_seconds": time.time()}
        count = sum(_metric(r, "stats", "count") or 0.0 for r in buckets)
        compute = sum(_metric(r, "time") or 0.0 for r in buckets)
        if buckets:
            values["biggraph_compute_seconds"] = compute
            values["biggraph_io_seconds"] = sum(_metric(r, "io_time") or 0.0 for r in buckets)
            values["biggraph_swap_seconds"] = sum(_metric(r, "swap_time") or 0.0 for r in buckets)
            values["biggraph_pass_edges"] = count
            if count:
                values["biggraph_loss"] = sum((_metric(r, "stats", "metrics", "loss") or 0.0) * (_metric(r, "stats", "count")
                                              or 0.0) for r in buckets) / count
            if compute > 0:
                values["biggraph_edges_per_second"] = count / compute
            last = buckets[-1]
            values["biggraph_pass"] = self._pass_of(last) + 1
            values["biggraph_epoch"] = int(last.get("epoch_idx", 0)) + 1
        eval_sums: dict[str, float] = {}
        eval_count = 0.0
        for r in buckets:
            n = _metric(r, "eval_stats_after", "count") or 0.0
            metrics = (r.get("eval_stats_after") or {}).get("metrics") or {}
            for name in RANKING_METRICS:
                if isinstance(metrics.get(name), (int, float)):
                    eval_sums[name] = eval_sums.get(name, 0.0) + float(metrics[name]) * n
            eval_count += n
        evals = {k: v / eval_count for k, v in eval_sums.items()} if eval_count else {}
        if summary is not None:
            values["biggraph_pass"] = int(summary.get("index", 0)) + 1
            values["biggraph_epoch"] = int(summary.get("epoch_idx", 0)) + 1
            for name, path in (("biggraph_loss", ("stats", "metrics", "loss")), ("biggraph_pass_edges", ("stats", "count")),
                               ("biggraph_edges_per_second", ("edges_per_sec",)), ("biggraph_pass_seconds", ("time",))):
                value = _metric(summary, *path)
                if value is not None:
                    values[name] = value
            for name in RANKING_METRICS:
                value = _metric(summary, "eval_stats_after", "metrics", name)
                if value is not None:
                    evals[name] = value
        for name, value in evals.items():
            values["biggraph_eval_" + name.replace("@", "_at_")] = value
        return values

    def _push(self, summary: Optional[dict[str, Any]]) -> None:
        body = exposition(self._values(summary))
        self.buckets = []
        try:
            push_to_gateway(self.url, self.job, str(self.rank), body)
        except Exception as err:  # noqa: BLE001 - a monitoring outage must not stop training
            self.failures += 1
            logger.warning("pushgateway %s: push failed (%s); training goes on", self.url, err)


# factory -----------------------------------------------------------------------------------


def make_reporter(config: Any, rank: int = 0, total_passes: int = 1, buckets_per_pass: int = 1) -> Reporter:
    reporters: list[Reporter] = []
    if rank == 0:
        mode = progress_mode()
        if mode == "bar":
            try:
                reporters.append(BarProgress(config, total_passes, buckets_per_pass))
            except ImportError:
                mode = "lines"
        if mode == "lines":
            reporters.append(LineProgress(config, total_passes, buckets_per_pass, _interval()))
    tensorboard_dir = getattr(config, "tensorboard_dir", None)
    if tensorboard_dir:
        try:
            reporters.append(TensorBoardReporter(tensorboard_dir, rank))
        except ImportError:
            logger.warning("tensorboard_dir is set but TensorBoard is not installed: pip install 'biggraph[tensorboard]' "
                           "(training goes on without it)")
    pushgateway_url = getattr(config, "pushgateway_url", None)
    if pushgateway_url:
        reporters.append(PushgatewayReporter(pushgateway_url, getattr(config, "pushgateway_job", "biggraph"), rank,
                                             total_passes, buckets_per_pass))
    if not reporters:
        return Reporter()
    return MultiReporter(reporters)
