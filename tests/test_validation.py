"""Validation during training (validation_edge_paths): lines recorded each interval, early stopping after the
patience, the best version kept and readable while later ones are dropped, bad validation input refused.

Real files and real training on the tiny cycle graph (tests/helpers_graphs.py); the non-improving validation is
planted by a model that cannot change (its only entity type frozen, operator none, no global embedding), so its
validation MRR repeats exactly, whatever the machine.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from job.checkpoint import CheckpointManager
from job.checkpoint.completion import training_complete
from job.cli import main
from job.config import parse_config
from job.errors import UserError
from job.evaluation import evaluate
from job.formats.checkpoint import CheckpointStorage
from job.formats.edges import edges_file, write_edges
from job.train import train

sys.path.insert(0, str(Path(__file__).parent))
from helpers_graphs import write_cycle_graph  # noqa: E402

N = 40


def write_split(path: Path, heads: np.ndarray, rel: int = 0) -> str:
    """Cycle edges of relation ``rel`` from ``heads`` (one partition) as an edge directory."""
    tails = (heads + rel + 1) % N
    write_edges(edges_file(str(path), 0, 0), np.full(len(heads), rel), heads, tails)
    return str(path)


def validation_lines(checkpoint_path: str) -> list[dict[str, Any]]:
    return [r for r in CheckpointStorage(checkpoint_path).load_stats() if r.get("validation")]


def test_a_validation_line_is_recorded_every_interval_and_scores_what_was_committed(tmp_path: Path) -> None:
    valid = write_split(tmp_path / "valid", np.arange(0, N, 4))
    test = write_split(tmp_path / "test", np.arange(1, N, 4))
    raw = write_cycle_graph(tmp_path, num_epochs=3, validation_edge_paths=[valid], validation_interval=2,
                            validation_filter_paths=[test])
    config = parse_config(raw)
    train(config)
    lines = validation_lines(config.checkpoint_path)
    # every 2nd epoch, and the last one
    assert [(r["epoch_idx"], r["checkpoint_version"]) for r in lines] == [(1, 2), (2, 3)]
    for line in lines:
        assert line["protocol"] == "all" and line["filtered"] is True
        assert line["label"] == "all candidates, filtered" and line["count"] == N // 4
        assert {"mrr", "hits@1", "hits@10"} <= set(line["metrics"])
    assert 0 < lines[0]["seconds"] < lines[1]["seconds"]
    # the last line is what `biggraph eval` gives for the committed version with the same edges and filter
    again = evaluate(parse_config({**raw, "edge_paths": [valid]}), filter_paths=[raw["edge_paths"][0], valid, test],
                     candidates="all")
    assert again["mrr"] == pytest.approx(lines[-1]["metrics"]["mrr"], abs=1e-12)
    assert again["hits@10"] == pytest.approx(lines[-1]["metrics"]["hits@10"], abs=1e-12)
    # validation lines are not PBG's: the pass summaries and config.json are unchanged
    assert sum(1 for r in CheckpointStorage(config.checkpoint_path).load_stats() if r.get("pass_summary")) == 3
    pbg_config = json.loads((Path(config.checkpoint_path) / "config.json").read_text())
    assert not any(k.startswith("validation") or k == "early_stopping_patience" for k in pbg_config)


def frozen_cycle(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    """A cycle graph whose model cannot change: every validation gives exactly the first one's MRR."""
    valid = write_split(tmp_path / "valid", np.arange(0, N, 3))
    extra.setdefault("num_epochs", 8)
    raw = write_cycle_graph(tmp_path, validation_edge_paths=[valid], global_emb=False, **extra)
    raw["entities"]["node"]["frozen"] = True
    for relation in raw["relations"]:
        relation["operator"] = "none"
    return raw


def test_early_stopping_stops_after_the_patience_and_keeps_the_best_version(tmp_path: Path) -> None:
    raw = frozen_cycle(tmp_path, early_stopping=True, early_stopping_patience=2)
    config = parse_config(raw)
    train(config)
    lines = validation_lines(config.checkpoint_path)
    # version 1 is the best (the first); versions 2 and 3 do not beat it: two validations without improvement
    assert [r["checkpoint_version"] for r in lines] == [1, 2, 3]
    assert len({r["metrics"]["mrr"] for r in lines}) == 1
    assert [r["improved"] for r in lines] == [True, False, False]
    assert all(r["best_version"] == 1 for r in lines)
    directory = Path(config.checkpoint_path)
    assert (directory / "checkpoint_version.txt").read_text().strip() == "3"  # stopped after epoch 3 of 8
    assert (directory / "best_version.txt").read_text().strip() == "1"
    names = {p.name for p in directory.iterdir()}
    assert {"model.v1.h5", "checksums.v1.json", "model.v3.h5"} <= names
    assert "model.v2.h5" not in names and "checksums.v2.json" not in names  # retention dropped version 2
    # the best version is read by eval (--version best) and by export, as committed
    assert CheckpointManager.version_named(config.checkpoint_path, "best") == 1
    valid_config = parse_config({**raw, "edge_paths": raw["validation_edge_paths"]})
    best = evaluate(valid_config, filter_paths=[raw["edge_paths"][0]] + raw["validation_edge_paths"],
                    candidates="all", version=1)
    assert best["mrr"] == pytest.approx(lines[0]["metrics"]["mrr"], abs=1e-12)
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps(raw))
    out = tmp_path / "exported"
    assert main(["export", str(config_file), "--version", "best", "--out", str(out)]) == 0
    assert main(["eval", str(config_file), "--version", "best", "--json"]) == 0
    # early stopping ended the run: a restarted pod or a resubmitted Job trains no further, and the pod
    # entrypoint's question (biggraph completed) says it is complete
    assert training_complete(config).complete
    assert "early stopping ended it at checkpoint version 3" in training_complete(config).message
    train(config)
    assert (directory / "checkpoint_version.txt").read_text().strip() == "3"
    assert len(validation_lines(config.checkpoint_path)) == 3
    # with more patience the same checkpoint goes on training (another config: not complete, not ended)
    more = parse_config({**raw, "early_stopping_patience": 3})
    assert not training_complete(more).complete


def test_without_early_stopping_the_run_goes_on_and_a_resume_keeps_the_best(tmp_path: Path) -> None:
    raw = frozen_cycle(tmp_path, num_epochs=4)
    config = parse_config(raw)
    train(config, stop_after_iterations=2)
    directory = Path(config.checkpoint_path)
    assert (directory / "best_version.txt").read_text().strip() == "1"
    train(config)  # a new process: opens the directory (its clean-up keeps the best version) and goes on
    assert (directory / "checkpoint_version.txt").read_text().strip() == "4"
    assert (directory / "best_version.txt").read_text().strip() == "1"
    names = {p.name for p in directory.iterdir()}
    assert "model.v1.h5" in names and "model.v4.h5" in names
    assert not {"model.v2.h5", "model.v3.h5"} & names
    lines = validation_lines(config.checkpoint_path)
    assert [r["checkpoint_version"] for r in lines] == [1, 2, 3, 4]
    assert [r["improved"] for r in lines] == [True, False, False, False]  # the resumed run knew the best MRR
    assert lines[2]["seconds"] >= lines[1]["seconds"]  # time goes on from the earlier run's last line


@pytest.mark.parametrize("case", ["missing", "empty", "out_of_range", "missing_filter"])
def test_bad_validation_input_exits_2_naming_the_path(tmp_path: Path, case: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    valid = tmp_path / "valid"
    extra: dict[str, Any] = {}
    if case == "missing":
        named = str(valid)
    elif case == "empty":
        write_split(valid, np.arange(0))
        named = str(valid)
    elif case == "out_of_range":
        write_edges(edges_file(str(valid), 0, 0), np.array([0, 0]), np.array([1, N + 5]), np.array([2, 3]))
        named = edges_file(str(valid), 0, 0)
    else:
        write_split(valid, np.arange(0, N, 4))
        named = str(tmp_path / "no-such-test")
        extra["validation_filter_paths"] = [named]
    raw = write_cycle_graph(tmp_path, num_epochs=1, validation_edge_paths=[str(valid)], **extra)
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps(raw))
    assert main(["train", str(config_file)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0], err
    assert not (Path(raw["checkpoint_path"]) / "checkpoint_version.txt").exists()  # refused before training


def test_the_report_draws_validation_mrr_against_wall_time_or_says_it_was_not_recorded(tmp_path: Path) -> None:
    from job.report import ReportOptions, write_report
    from job.report.html import validation_chart

    valid = write_split(tmp_path / "with" / "valid", np.arange(0, N, 4))
    raw = write_cycle_graph(tmp_path / "with", num_epochs=3, validation_edge_paths=[valid])
    train(parse_config(raw))
    options = ReportOptions(sample=0, relation_edges=0)
    data = write_report(raw["checkpoint_path"], str(tmp_path / "with.html"), options=options)
    lines = validation_lines(raw["checkpoint_path"])
    assert [(p.version, p.seconds, p.mrr) for p in data.validation] == [
        (r["checkpoint_version"], r["seconds"], r["metrics"]["mrr"]) for r in lines]
    best = max(lines, key=lambda r: r["metrics"]["mrr"])
    assert data.best_version == best["checkpoint_version"] == lines[-1]["best_version"]
    page = (tmp_path / "with.html").read_text()
    figure = page[page.index('<figure id="chart-validation">'):]
    figure = figure[:figure.index("</figure>")]
    assert "Validation MRR against wall time (all candidates, filtered)" in figure
    assert "seconds since training started" in figure
    assert figure.count("<circle") == 2 * len(lines)  # MRR and Hits@10 at each validation
    for line in lines:
        assert f"MRR {line['seconds']:g}: {line['metrics']['mrr']:.4g}</title>" in figure
    assert f"Best: version {best['checkpoint_version']}" in figure
    assert f"best validation MRR (version {best['checkpoint_version']})" in page
    try:
        from job.report.png import render_png

        assert render_png(data)[:8] == b"\x89PNG\r\n\x1a\n"
    except UserError:  # matplotlib is optional ('biggraph[report]'): the PNG is not drawn without it
        pass

    plain = write_cycle_graph(tmp_path / "without", num_epochs=1)
    train(parse_config(plain))
    data = write_report(plain["checkpoint_path"], str(tmp_path / "without.html"), options=options)
    assert data.validation == [] and data.validation_note.startswith("not recorded: no validation_edge_paths")
    page = (tmp_path / "without.html").read_text()
    figure = page[page.index('<figure id="chart-validation">'):]
    figure = figure[:figure.index("</figure>")]
    assert "not recorded: no validation_edge_paths" in figure and "<circle" not in figure
    assert validation_chart(data) in figure


def test_patience_counts_validations_since_the_best_and_a_better_one_resets_it() -> None:
    from job.train.validation import Patience

    patience = Patience()
    stale, best = [], []
    for version, mrr in enumerate([0.1, 0.2, 0.15, 0.25, 0.25, 0.2], start=1):
        patience.observe({"checkpoint_version": version, "metrics": {"mrr": mrr}})
        stale.append(patience.stale)
        best.append(patience.best_version)
    assert stale == [0, 0, 1, 0, 1, 2]  # an equal MRR is no improvement
    assert best == [1, 2, 2, 4, 4, 4]


@pytest.mark.parametrize("changes, keys", [
    ({"validation_filter_paths": ["test"]}, "validation_filter_paths"),
    ({"validation_edge_paths": ["valid"], "validation_filter_paths": ["test"], "validation_filtered": False},
     "validation_filtered"),
    ({"validation_edge_paths": ["valid"], "validation_interval": 0}, "validation_interval"),
    ({"validation_edge_paths": ["valid"], "early_stopping_patience": 0}, "early_stopping_patience"),
])
def test_impossible_validation_settings_are_config_errors_naming_the_key(tmp_path: Path, changes: dict[str, Any],
                                                                         keys: str) -> None:
    from job.config.base import ConfigKeyError

    raw = write_cycle_graph(tmp_path, **changes)
    with pytest.raises(ConfigKeyError) as err:
        parse_config(raw)
    assert keys in err.value.keys and keys in str(err.value)
