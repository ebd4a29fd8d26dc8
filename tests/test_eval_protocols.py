"""Ranking protocols (eval_protocol / ``biggraph eval --candidates``): meaningful by default, PBG's on request,
and every figure labelled with its protocol (logs, training_stats.json, eval --json, the report)."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from job.cli import main
from job.config import parse_config
from job.errors import ConfigError
from job.eval_protocol import protocol_label, recorded_label, resolve_protocol
from job.evaluation import evaluate
from job.model.scoring import Model, Table
from job.train.batch.batching import process_edges
from job.train.batch.ranking import rank_bucket
from job.train.batch.step import BatchContext
from job.train.inputs import EdgeTensors
from job.train.pass_stats import pass_message, weighted
from job.train.schedule.interfaces import Iteration

sys.path.insert(0, str(Path(__file__).parent))
from helpers_graphs import base_config, make_graph  # noqa: E402

UMLS_ENTITIES = 135  # UMLS's size: smaller than PBG's 1000 + 1000 evaluation draws


@pytest.fixture(scope="module")
def umls_sized(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One unpartitioned type of UMLS's size, 3 relations, trained 2 epochs with 20% of edges held out,
    with PBG's default evaluation draws (1000 batch + 1000 uniform)."""
    root = tmp_path_factory.mktemp("umls_sized")
    graph = make_graph(root, entities={"e": 1}, relations=[("r0", "e", "e"), ("r1", "e", "e"), ("r2", "e", "e")],
                       counts={"e": [UMLS_ENTITIES]}, edges_per_bucket=1500, num_epochs=2, eval_fraction=0.2,
                       dimension=16, batch_size=100, num_batch_negs=20, num_uniform_negs=20, seed=0)
    os.environ["BIGGRAPH_PROGRESS"] = "off"
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("biggraph").addHandler(handler)
    try:
        assert main(["train", str(graph.config_path)]) == 0
    finally:
        del os.environ["BIGGRAPH_PROGRESS"]
        logging.getLogger("biggraph").removeHandler(handler)
    stats_file = root / "checkpoints" / "training_stats.json"
    stats = [json.loads(line) for line in stats_file.read_text().splitlines()]
    return {"root": root, "graph": graph, "stats": stats, "log": [r.getMessage() for r in records]}


def _eval_json(config_path: Path, capsys: pytest.CaptureFixture, *extra: str) -> dict[str, Any]:
    assert main(["eval", str(config_path), "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_default_eval_on_a_umls_sized_graph_ranks_all_candidates(umls_sized: dict[str, Any],
                                                                 capsys: pytest.CaptureFixture) -> None:
    config_path = umls_sized["graph"].config_path
    default = _eval_json(config_path, capsys)
    everything = _eval_json(config_path, capsys, "--candidates", "all")
    pbg = _eval_json(config_path, capsys, "--candidates", "pbg")
    assert default["protocol"] == "all" and default["filtered"] is False
    assert default["mean_rank"] <= UMLS_ENTITIES
    for key in ("mrr", "hits@1", "hits@10", "mean_rank", "auc", "count"):
        assert default[key] == pytest.approx(everything[key], rel=1e-9), key
    # PBG's protocol counts all 2000 draws, repeats and the positive itself included: ranks beyond the graph
    assert pbg["protocol"] == "pbg" and pbg["mean_rank"] > UMLS_ENTITIES
    sampled = _eval_json(config_path, capsys, "--candidates", "sampled")
    assert sampled["protocol"] == "sampled" and sampled["mean_rank"] <= UMLS_ENTITIES
    assert main(["eval", str(config_path)]) == 0
    out = capsys.readouterr().out
    assert "protocol: all candidates, raw" in out
    filtered = _eval_json(config_path, capsys, "--filter", str(umls_sized["graph"].edge_path))
    assert filtered["protocol"] == "all" and filtered["filtered"] is True


def test_held_out_ranks_in_training_are_labelled_and_bounded(umls_sized: dict[str, Any]) -> None:
    stats = umls_sized["stats"]
    buckets = [r for r in stats if not r.get("pass_summary")]
    passes = [r for r in stats if r.get("pass_summary")]
    assert buckets and passes
    for record in buckets:
        for when in ("eval_stats_before", "eval_stats_after"):
            assert record[when]["protocol"] == "all" and record[when]["filtered"] is False
            assert 1 <= record[when]["metrics"]["mean_rank"] <= UMLS_ENTITIES
    for summary in passes:
        assert summary["eval_stats_after"]["protocol"] == "all"
    pass_lines = [m for m in umls_sized["log"] if " edges/s, loss " in m and "eval MRR" in m]
    assert pass_lines and all("all candidates, raw" in m for m in pass_lines), pass_lines


def _zero_model(tmp_path: Path, **extra: Any) -> tuple[Any, Model, dict[int, Table], EdgeTensors]:
    """A model whose every score is 0 (all embeddings zero): every candidate ties with the positive."""
    raw = base_config(tmp_path, {"e": 1}, [("r", "e", "e")], global_emb=False, comparator="dot", **extra)
    config = parse_config(raw)
    model = Model(config)
    tables = {0: Table(torch.zeros(UMLS_ENTITIES, 4), None)}
    generator = torch.Generator().manual_seed(0)
    lhs = torch.randint(0, UMLS_ENTITIES, (200,), generator=generator)
    rhs = torch.randint(0, UMLS_ENTITIES, (200,), generator=generator)
    return config, model, tables, EdgeTensors(torch.zeros(200, dtype=torch.long), lhs, rhs)


@pytest.mark.parametrize("num_uniform", [300, 40])
def test_pbg_protocol_counts_ties_and_repeats_against_the_positive(tmp_path: Path, num_uniform: int) -> None:
    """PBG ranks as ``(neg >= pos).sum(1) + 1`` over every batch negative (the chunk's other positives, the
    positive's own entity among them when it repeats) and every uniform draw: with all scores tied, each rank is
    1 + (chunk - 1) + draws, whatever the graph's size. The corrected protocols rank a set of other entities."""
    config, model, tables, edges = _zero_model(tmp_path, eval_num_batch_negs=50, eval_num_uniform_negs=num_uniform)
    indices = torch.arange(len(edges))
    ctx = BatchContext(config, model, None, tables, tables, 50, num_uniform)
    with torch.no_grad():
        pbg = process_edges(ctx, edges, indices, config.batch_size, False, torch.Generator().manual_seed(1), False)
    assert pbg.ranking_metrics()["mean_rank"] == pytest.approx(1 + 49 + num_uniform)
    everything = rank_bucket(config, model, tables, tables, edges, indices, "all", None)
    assert everything.ranking_metrics()["mean_rank"] == pytest.approx(UMLS_ENTITIES)  # ties count against
    sampled = rank_bucket(config, model, tables, tables, edges, indices, "sampled", torch.Generator().manual_seed(1))
    ranks = sampled.ranking_metrics()["mean_rank"]
    assert ranks <= UMLS_ENTITIES  # at most every other entity
    if num_uniform == 40:  # 50 positives + 40 draws hold fewer than 90 distinct entities, the positive left out
        assert ranks < 90
    assert everything.num_ranks == sampled.num_ranks == pbg.num_ranks == 400


def test_sampled_protocol_ranks_a_perfect_model_first(tmp_path: Path) -> None:
    """Each entity scores highest against itself (one-hot rows, dot product): the positive is never beaten by
    a draw of itself under 'sampled', while PBG's protocol counts such draws (ties) against it."""
    config, model, _, _ = _zero_model(tmp_path, dimension=UMLS_ENTITIES, eval_num_batch_negs=50,
                                      eval_num_uniform_negs=300)
    tables = {0: Table(torch.eye(UMLS_ENTITIES), None)}
    ids = torch.randint(0, UMLS_ENTITIES, (200,), generator=torch.Generator().manual_seed(3))
    edges = EdgeTensors(torch.zeros(200, dtype=torch.long), ids, ids.clone())  # self-loops: lhs == rhs
    indices = torch.arange(200)
    sampled = rank_bucket(config, model, tables, tables, edges, indices, "sampled", torch.Generator().manual_seed(1))
    assert sampled.ranking_metrics()["mrr"] == pytest.approx(1.0)
    ctx = BatchContext(config, model, None, tables, tables, 50, 300)
    with torch.no_grad():
        pbg = process_edges(ctx, edges, indices, config.batch_size, False, torch.Generator().manual_seed(1), False)
    assert pbg.ranking_metrics()["mrr"] < 0.9  # 300 draws among 135 entities: the positive is drawn ~2 times


def test_auto_picks_all_only_when_no_larger_than_the_draws(tmp_path: Path) -> None:
    config = parse_config(base_config(tmp_path, {"e": 1}, [("r", "e", "e")], eval_num_batch_negs=100,
                                      eval_num_uniform_negs=100))
    assert resolve_protocol("auto", config, 200) == "all"
    assert resolve_protocol("auto", config, 201) == "sampled"
    assert resolve_protocol("pbg", config, 10) == "pbg" and resolve_protocol("all", config, 10**9) == "all"
    assert protocol_label("all", True) == "all candidates, filtered"
    assert protocol_label("pbg") == "sampled as PBG, raw"
    assert recorded_label({"count": 3, "metrics": {}}) == "sampled as PBG, raw"  # stats written before labels
    assert recorded_label({}, legacy=None) == "protocol not recorded"


def test_bad_protocols_are_refused_naming_the_key(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(ConfigError, match="eval_protocol.*expected one of auto, all, sampled, pbg"):
        parse_config(base_config(tmp_path, {"e": 1}, [("r", "e", "e")], eval_protocol="exact"))
    featurized = base_config(tmp_path, {"e": 1}, [("r", "e", "e")], eval_protocol="sampled")
    featurized["entities"]["e"]["featurized"] = True
    with pytest.raises(ConfigError, match="eval_protocol.*featurized"):
        parse_config(featurized)
    graph = make_graph(tmp_path / "g", entities={"e": 1}, relations=[("r", "e", "e")])
    assert main(["train", str(graph.config_path)]) == 0
    capsys.readouterr()
    code = main(["eval", str(graph.config_path), "--candidates", "pbg", "--filter", str(graph.edge_path)])
    err = capsys.readouterr().err
    assert code == 2 and "--filter needs all candidates" in err and "Traceback" not in err
    assert evaluate(parse_config(graph.config), candidates="pbg")["protocol"] == "pbg"


def test_pass_summary_and_log_line_carry_the_protocol() -> None:
    new = [{"eval_stats_after": {"count": 2, "metrics": {"mrr": 0.5, "hits@10": 1.0}, "protocol": "sampled",
                                 "filtered": False}}] * 2
    old = [{"eval_stats_after": {"count": 2, "metrics": {"mrr": 0.5, "hits@10": 1.0}}}]
    merged = weighted(new, "eval_stats_after")
    assert merged is not None and merged["protocol"] == "sampled" and merged["count"] == 4
    legacy = weighted(old, "eval_stats_after")
    assert legacy is not None and "protocol" not in legacy
    summary = {"stats": {"count": 10, "metrics": {"loss": 1.0}}, "edges_per_sec": 5.0, "world_size": 1,
               "eval_stats_after": merged}
    iteration = Iteration(0, 0, 0, 0)
    assert "eval MRR 0.5000 (hits@10 1.0000, sampled candidates, raw)" in pass_message(iteration, 1, 1, 1, summary, False)
    summary["eval_stats_after"] = legacy
    assert "sampled as PBG, raw" in pass_message(iteration, 1, 1, 1, summary, False)


@pytest.mark.slow
def test_report_labels_every_mrr_with_its_protocol(umls_sized: dict[str, Any], tmp_path: Path,
                                                   capsys: pytest.CaptureFixture) -> None:
    checkpoint = umls_sized["root"] / "checkpoints"
    metrics = tmp_path / "metrics.json"
    metrics.write_text(json.dumps(_eval_json(umls_sized["graph"].config_path, capsys, "--filter",
                                             str(umls_sized["graph"].edge_path))))
    out = tmp_path / "report.html"
    assert main(["report", str(checkpoint), "--out", str(out), "--sample", "50", "--metrics", str(metrics)]) == 0
    page = out.read_text()
    headline = page[page.index('<table id="headline">'):page.index('<table id="facts">')]
    assert "final held-out MRR (all candidates, raw)" in headline
    assert "eval MRR (metrics.json; all candidates, filtered)" in headline
    assert "MRR of the per-relation sample (all candidates, raw)" in headline
    assert "sampled MRR" not in page
    # a stats file written before protocols were recorded: its held-out ranks were PBG's
    old = tmp_path / "old"
    old.mkdir()
    for item in checkpoint.iterdir():
        if item.is_file():
            (old / item.name).write_bytes(item.read_bytes())
    lines = [json.loads(line) for line in (checkpoint / "training_stats.json").read_text().splitlines()]
    for record in lines:
        for when in ("eval_stats_before", "eval_stats_after"):
            if when in record:
                record[when].pop("protocol")
                record[when].pop("filtered")
    (old / "training_stats.json").write_text("".join(json.dumps(r) + "\n" for r in lines))
    metrics.write_text(json.dumps({"mrr": 0.3, "hits@10": 0.5}))
    assert main(["report", str(old), "--out", str(out), "--sample", "0", "--metrics", str(metrics)]) == 0
    page = out.read_text()
    assert "final held-out MRR (sampled as PBG, raw)" in page
    assert "eval MRR (metrics.json; protocol not recorded)" in page


def test_the_reader_keeps_every_partition_that_fits_its_budget(tmp_path: Path) -> None:
    """Ranking against every entity visits the candidate type's partitions in the same cycle for every relation and
    side of every bucket: an LRU of 4 under P=8 reloads every partition on every visit. Within the byte budget each
    is read once; with no budget beyond ``max_resident``, the cycle misses every time."""
    from job.config import load_config
    from job.evaluation import CheckpointReader

    graph = make_graph(tmp_path, entities={"e": 8}, relations=[("r0", "e", "e")], counts={"e": [5] * 8},
                       edges_per_bucket=4, num_epochs=1, dimension=8, seed=0)
    os.environ["BIGGRAPH_PROGRESS"] = "off"
    try:
        assert main(["train", str(graph.config_path)]) == 0
    finally:
        del os.environ["BIGGRAPH_PROGRESS"]
    config = load_config(str(graph.config_path))
    kept = CheckpointReader(config)
    cycled = CheckpointReader(config, resident_bytes=0)
    for reader in (kept, cycled):
        for _ in range(3):
            for part in range(8):
                assert reader.partition("e", part).shape == (5, 8)
    assert kept.loads == 8
    assert cycled.loads == 24
