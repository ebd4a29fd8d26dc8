"""Progress reporting, TensorBoard and Pushgateway sinks (job/monitoring/).

The Pushgateway tests talk to a real (tiny) HTTP server on 127.0.0.1 that records every request, so the
wire format is what is checked, not calls into a mock.
"""

from __future__ import annotations

import io
import json
import logging
import re
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from job.config import parse_config
from job.monitoring import MultiReporter, Reporter, make_reporter
from job.monitoring.json_logs import JsonFormatter
from job.monitoring.progress import LineProgress, progress_mode
from job.monitoring.pushgateway import PushgatewayReporter
from job.monitoring.tensorboard import TensorBoardReporter, scalars_of_bucket, scalars_of_pass

sys.path.insert(0, str(Path(__file__).parent))
from helpers_graphs import make_graph  # noqa: E402


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Config:
    num_epochs = 2


def bucket_record(index: int, epoch: int, loss: float = 0.5, mrr: float | None = 0.25, count: int = 100) -> dict[str, Any]:
    record: dict[str, Any] = {
        "epoch_idx": epoch, "edge_path_idx": 0, "edge_chunk_idx": 0, "lhs_partition": index % 2,
        "rhs_partition": (index // 2) % 2, "index": index, "stats": {"count": count, "metrics": {"loss": loss}},
        "edges_per_sec": 1000.0, "time": 0.1, "io_time": 0.03, "swap_time": 0.02,
    }
    if mrr is not None:
        record["eval_stats_after"] = {"count": 10, "metrics": {"mrr": mrr, "hits@1": 0.1, "hits@10": 0.5, "hits@50": 0.9,
                                                               "auc": 0.8, "mean_rank": 7.0}}
    return record


def pass_summary(index: int, loss: float = 0.5, mrr: float = 0.3) -> dict[str, Any]:
    return {"epoch_idx": index, "edge_path_idx": 0, "edge_chunk_idx": 0, "index": index, "pass_summary": True,
            "stats": {"count": 400, "metrics": {"loss": loss}}, "edges_per_sec": 1234.5, "time": 2.0,
            "eval_stats_after": {"count": 40, "metrics": {"mrr": mrr, "hits@1": 0.2, "hits@10": 0.6, "hits@50": 0.9,
                                                          "auc": 0.85, "mean_rank": 5.0}}}


@pytest.fixture
def json_log() -> Iterator[io.StringIO]:
    """The biggraph logger's lines, formatted as --log-format json formats them."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("biggraph")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield stream
    logger.removeHandler(handler)
    logger.setLevel(old_level)


def test_lines_are_rate_limited_plus_one_per_pass(json_log: io.StringIO) -> None:
    clock = FakeClock()
    progress = LineProgress(Config(), total_passes=2, buckets_per_pass=50, interval=30.0, clock=clock)
    for index in range(100):
        clock.now += 1.0  # one bucket per second: 100 s in all
        progress.on_bucket(bucket_record(index, epoch=index // 50, loss=1.0 / (index + 1)))
        if index % 50 == 49:
            progress.on_pass(pass_summary(index // 50))
    lines = [json.loads(line) for line in json_log.getvalue().splitlines()]
    kinds = [line["event"] for line in lines]
    assert kinds.count("pass") == 2
    # the first bucket, then at most one line per 30 s of the 100 s (pass lines reset the timer)
    assert 2 <= kinds.count("progress") <= 1 + 100 // 30
    first = lines[0]
    assert first["message"].startswith("progress: epoch 1/2, bucket 1/50, pass 1/2")
    assert first["bucket"] == 1 and first["buckets_per_pass"] == 50 and first["loss"] == 1.0
    last = lines[-1]
    assert last["event"] == "pass" and last["progress"] == 1.0 and last["pass"] == 2 and last["eta_s"] == 0.0
    mid = next(line for line in lines if line["event"] == "pass")
    # after 50 of 100 buckets in 50 s, 50 s are left
    assert mid["progress"] == 0.5 and mid["eta_s"] == pytest.approx(50.0, abs=1.0)
    assert "ETA 50s" in mid["message"] and "edges/s" in mid["message"] and "eval MRR 0.2500" in mid["message"]


def test_one_bucket_per_pass_prints_one_line_per_pass(json_log: io.StringIO) -> None:
    clock = FakeClock()
    progress = LineProgress(Config(), total_passes=3, buckets_per_pass=1, interval=30.0, clock=clock)
    for index in range(3):
        clock.now += 1.0
        progress.on_bucket(bucket_record(index, epoch=index))
        progress.on_pass(pass_summary(index))
    lines = [json.loads(line) for line in json_log.getvalue().splitlines()]
    assert [line["event"] for line in lines] == ["pass", "pass", "pass"]
    assert [line["pass"] for line in lines] == [1, 2, 3]
    assert len({line["message"] for line in lines}) == 3


def test_resumed_run_counts_eta_from_where_it_started(json_log: io.StringIO) -> None:
    clock = FakeClock()
    progress = LineProgress(Config(), total_passes=4, buckets_per_pass=10, interval=1e9, clock=clock)
    for index in range(20, 30):  # resumed at pass 3 of 4
        clock.now += 2.0
        progress.on_bucket(bucket_record(index, epoch=2))
    progress.on_pass(pass_summary(2))
    line = json.loads(json_log.getvalue().splitlines()[-1])
    assert line["pass"] == 3 and line["progress"] == 0.75
    assert line["eta_s"] == pytest.approx(20.0)  # 10 buckets left at 2 s each, not (20 s / 30 buckets) x 10


def test_progress_mode_follows_the_terminal_and_the_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BIGGRAPH_PROGRESS", raising=False)

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert progress_mode() == "lines"
    monkeypatch.setattr(sys, "stderr", Tty())
    assert progress_mode() == "bar"
    monkeypatch.setenv("BIGGRAPH_PROGRESS", "off")
    assert progress_mode() == "off"
    monkeypatch.setenv("BIGGRAPH_PROGRESS", "lines")
    assert progress_mode() == "lines"


def test_only_rank_0_shows_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BIGGRAPH_PROGRESS", "lines")
    config = Config()
    assert isinstance(make_reporter(config, rank=0, total_passes=1, buckets_per_pass=1), MultiReporter)
    other = make_reporter(config, rank=1, total_passes=1, buckets_per_pass=1)
    assert type(other) is Reporter  # nothing configured, nothing shown


def test_bar_shows_epoch_bucket_speed_loss_and_keeps_log_lines_readable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BIGGRAPH_PROGRESS", "bar")
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    root = logging.getLogger()
    handler = logging.StreamHandler(sys.stderr)
    # the console handler alone (an earlier main() may have left biggraph's own, with its timestamp format)
    monkeypatch.setattr(root, "handlers", [handler])
    reporter = make_reporter(Config(), rank=0, total_passes=2, buckets_per_pass=4)
    for index in range(4):
        reporter.on_bucket(bucket_record(index, epoch=0, loss=0.125))
    logging.getLogger("biggraph").warning("a log line while the bar runs")
    reporter.on_pass(pass_summary(0))
    reporter.close()
    assert root.handlers == [handler]  # tqdm's handler swapped out again
    text = err.getvalue()
    assert "epoch 1/2 bucket 4/4" in text
    assert "1,000 edges/s" in text and "loss 0.1250" in text and "MRR 0.2500" in text
    assert "4/8 buckets" in text
    # the log line is printed on a line of its own, not glued to the bar
    assert any(line.strip() == "a log line while the bar runs" for line in re.split(r"[\r\n]", text))
    assert handler.stream is err  # restored after close


def test_a_failing_sink_never_fails_training(caplog: pytest.LogCaptureFixture) -> None:
    class Broken(Reporter):
        def on_bucket(self, record: dict[str, Any]) -> None:
            raise RuntimeError("disk full")

    seen = []

    class Recorder(Reporter):
        def on_bucket(self, record: dict[str, Any]) -> None:
            seen.append(record["index"])

    multi = MultiReporter([Broken(), Recorder()])
    with caplog.at_level(logging.WARNING, logger="biggraph"):
        multi.on_bucket(bucket_record(3, 0))
    assert seen == [3]
    assert "disk full" in caplog.text


def test_tensorboard_missing_is_a_warning(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                                          tmp_path: Path) -> None:
    def no_tensorboard(*args: Any, **kwargs: Any) -> None:
        raise ImportError("No module named 'tensorboard'")

    monkeypatch.setattr(TensorBoardReporter, "__init__", no_tensorboard)
    monkeypatch.setenv("BIGGRAPH_PROGRESS", "off")

    class TbConfig(Config):
        tensorboard_dir = str(tmp_path / "tb")

    with caplog.at_level(logging.WARNING, logger="biggraph"):
        reporter = make_reporter(TbConfig(), rank=0)
    assert type(reporter) is Reporter
    assert "pip install 'biggraph[tensorboard]'" in caplog.text


def test_tensorboard_scalars(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="the 'tensorboard' extra is not installed (pip install 'biggraph[tensorboard]')")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = TensorBoardReporter(str(tmp_path / "tb"))
    for index in range(3):
        tb.on_bucket(bucket_record(index, 0, loss=0.5 - 0.1 * index))
    tb.on_pass(pass_summary(0, loss=0.4, mrr=0.3))
    tb.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [round(e.value, 4) for e in events.Scalars("bucket/loss")] == [0.5, 0.4, 0.3]
    assert [round(e.value, 4) for e in events.Scalars("eval/mrr")] == [0.3]
    assert {"bucket/edges_per_sec", "bucket/swap_time_s", "bucket_eval_after/hits@10"} <= set(events.Tags()["scalars"])


def test_scalar_tags_of_records() -> None:
    scalars = scalars_of_bucket(bucket_record(0, 0, loss=0.5, mrr=0.25))
    assert scalars["bucket/loss"] == 0.5 and scalars["bucket/swap_time_s"] == 0.02
    assert scalars["bucket/edges_per_sec"] == 1000.0 and scalars["bucket_eval_after/mrr"] == 0.25
    summary = scalars_of_pass(pass_summary(1, loss=0.2, mrr=0.4))
    assert summary == {"pass/loss": 0.2, "pass/edges_per_sec": 1234.5, "pass/time_s": 2.0, "pass/edges": 400.0,
                       "eval/mrr": 0.4, "eval/hits@1": 0.2, "eval/hits@10": 0.6, "eval/hits@50": 0.9, "eval/auc": 0.85,
                       "eval/mean_rank": 5.0}


# Pushgateway ---------------------------------------------------------------------------------


class Gateway:
    """A real HTTP server on 127.0.0.1 that records requests; ``fail_next`` requests answer 500."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, str, str]] = []  # method, path, content type, body
        self.fail_next = 0
        gateway = self

        class Handler(BaseHTTPRequestHandler):
            def _record(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length).decode("utf-8")
                gateway.requests.append((self.command, self.path, self.headers.get("Content-Type", ""), body))
                if gateway.fail_next > 0:
                    gateway.fail_next -= 1
                    self.send_response(500)
                else:
                    self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_PUT = do_POST = _record

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def gateway() -> Iterator[Gateway]:
    server = Gateway()
    yield server
    server.close()


def parse_exposition(body: str) -> dict[str, float]:
    """Checks the text format line by line (HELP, TYPE gauge, sample) and returns the samples."""
    values: dict[str, float] = {}
    lines = body.splitlines()
    assert body.endswith("\n")
    assert len(lines) % 3 == 0
    for i in range(0, len(lines), 3):
        help_line, type_line, sample = lines[i:i + 3]
        name = help_line.split()[2]
        assert re.fullmatch(r"# HELP biggraph_[a-z0-9_]+ .+", help_line)
        assert type_line == f"# TYPE {name} gauge"
        match = re.fullmatch(rf"{name} (-?[0-9.]+(e[-+]?[0-9]+)?|inf|nan)", sample)
        assert match, sample
        values[name] = float(match.group(1))
    return values


def test_push_after_each_pass_in_the_exposition_format(gateway: Gateway) -> None:
    pusher = PushgatewayReporter(gateway.url, "my job", rank=0, total_passes=2, buckets_per_pass=2)
    pusher.on_bucket(bucket_record(0, 0, loss=0.5))
    pusher.on_bucket(bucket_record(1, 0, loss=0.3))
    assert gateway.requests == []  # nothing before the pass ends
    pusher.on_pass(pass_summary(0, loss=0.4, mrr=0.3))
    pusher.close()  # nothing left to push
    assert len(gateway.requests) == 1
    method, path, content_type, body = gateway.requests[0]
    assert method == "PUT"
    assert path == "/metrics/job@base64/bXkgam9i/instance/0"  # prometheus_client escapes the space (base64)
    assert content_type.startswith("text/plain; version=")
    values = parse_exposition(body)
    assert values["biggraph_loss"] == 0.4 and values["biggraph_eval_mrr"] == 0.3
    assert values["biggraph_eval_hits_at_10"] == 0.6 and values["biggraph_edges_per_second"] == 1234.5
    assert values["biggraph_pass"] == 1 and values["biggraph_passes_total"] == 2 and values["biggraph_epoch"] == 1
    assert values["biggraph_swap_seconds"] == pytest.approx(0.04) and values["biggraph_edges_trained"] == 200


def test_ranks_without_pass_summaries_push_when_their_pass_changes(gateway: Gateway) -> None:
    pusher = PushgatewayReporter(gateway.url + "/", "biggraph", rank=3, total_passes=2, buckets_per_pass=4)
    pusher.on_bucket(bucket_record(1, 0, loss=0.5, count=100))
    pusher.on_bucket(bucket_record(2, 0, loss=0.25, count=300))
    pusher.on_bucket(bucket_record(5, 1, loss=0.1))  # pass 2 started: pass 1's numbers go out
    pusher.close()  # and pass 2's at the end
    assert [r[1] for r in gateway.requests] == ["/metrics/job/biggraph/instance/3"] * 2
    first = parse_exposition(gateway.requests[0][3])
    assert first["biggraph_loss"] == pytest.approx((0.5 * 100 + 0.25 * 300) / 400)
    assert first["biggraph_pass"] == 1 and first["biggraph_pass_edges"] == 400
    assert parse_exposition(gateway.requests[1][3])["biggraph_pass"] == 2


def test_push_failures_are_warnings(gateway: Gateway, caplog: pytest.LogCaptureFixture) -> None:
    gateway.fail_next = 1
    pusher = PushgatewayReporter(gateway.url, "biggraph", rank=0, total_passes=2, buckets_per_pass=1)
    with caplog.at_level(logging.WARNING, logger="biggraph"):
        pusher.on_pass(pass_summary(0))
        pusher.on_pass(pass_summary(1))
    assert len(gateway.requests) == 2 and pusher.failures == 1
    assert "push failed" in caplog.text and "500" in caplog.text
    dead = PushgatewayReporter("http://127.0.0.1:9", "biggraph", rank=0, total_passes=1, buckets_per_pass=1)
    with caplog.at_level(logging.WARNING, logger="biggraph"):
        dead.on_pass(pass_summary(0))
    assert dead.failures == 1


def test_without_prometheus_client_training_goes_on_without_pushes(monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    from job.monitoring import make_reporter

    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # not installed: importing it raises ImportError

    class Config:
        tensorboard_dir, pushgateway_url, pushgateway_job = None, "http://gw:9091", "biggraph"

    monkeypatch.setenv("BIGGRAPH_PROGRESS", "off")
    with caplog.at_level(logging.WARNING, logger="biggraph"):
        reporter = make_reporter(Config(), rank=1)
    assert type(reporter).__name__ == "Reporter"  # nothing to push with
    assert "pip install 'biggraph[prometheus]'" in caplog.text


def test_config_keys_stay_out_of_pbg_config_json(tmp_path: Path) -> None:
    graph = make_graph(tmp_path)
    config = parse_config({**graph.config, "tensorboard_dir": "tb", "pushgateway_url": "http://gw:9091",
                           "pushgateway_job": "nightly"})
    assert config.pushgateway_job == "nightly" and config.tensorboard_dir == "tb"
    assert not {"tensorboard_dir", "pushgateway_url", "pushgateway_job"} & set(config.to_pbg_dict())


@pytest.mark.slow
def test_training_pushes_every_pass_and_survives_a_failing_gateway(gateway: Gateway, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     json_log: io.StringIO) -> None:
    from job.cli import main

    monkeypatch.setenv("BIGGRAPH_PROGRESS", "lines")
    gateway.fail_next = 1  # the first push fails: training must go on
    graph = make_graph(tmp_path, num_epochs=3, eval_fraction=0.2, edges_per_bucket=40, eval_num_uniform_negs=10,
                       eval_num_batch_negs=10, pushgateway_url=gateway.url, pushgateway_job="t")
    graph.write_config()
    assert main(["train", str(graph.config_path)]) == 0
    assert [r[1] for r in gateway.requests] == ["/metrics/job/t/instance/0"] * 3
    stats = [json.loads(line) for line in (tmp_path / "checkpoints" / "training_stats.json").read_text().splitlines()]
    last_pass = [s for s in stats if s.get("pass_summary")][-1]
    pushed = parse_exposition(gateway.requests[-1][3])
    assert pushed["biggraph_pass"] == 3
    assert pushed["biggraph_loss"] == pytest.approx(last_pass["stats"]["metrics"]["loss"], rel=1e-6)
    assert pushed["biggraph_eval_mrr"] == pytest.approx(last_pass["eval_stats_after"]["metrics"]["mrr"], rel=1e-6)
    progress = [json.loads(line) for line in json_log.getvalue().splitlines() if '"progress: ' in line]
    assert [p["pass"] for p in progress if p["event"] == "pass"] == [1, 2, 3]
