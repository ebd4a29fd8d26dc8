"""The quality options beyond PBG's recipe: reciprocal relations, fan initialisation, the quality preset.

Each option is opt-in: a PBG config means what it meant (checked here by the defaults), and each
option's behaviour is held to hand-computed values or to PBG 1.0.0 reading what it writes.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import re
import sys
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch

from job.archive import load
from job.archive.evaluate import link_prediction_metrics
from job.archive.writer import add_tag
from job.cli import main
from job.config import load_config, parse_config
from job.config.presets import PRESETS
from job.data.export.run import export_checkpoint
from job.errors import ConfigError
from job.evaluation import evaluate
from job.formats.checkpoint import CheckpointStorage
from job.formats.edges import edges_file, read_edges, write_edges
from job.formats.entities import write_entity_count
from job.model.kernel_options import KernelOptions
from job.model.operators import Operator
from job.model.scoring import Model, Table
from job.model.side import Side
from job.report.collect import ReportOptions, build_report
from job.train import bucket_run, train
from job.train.batch.step import BatchContext, BatchStats, run_batch
from job.train.bucket_run import ALL_NEGS_NOTE_ENTITIES, all_negs_cost

sys.path.insert(0, str(Path(__file__).parent))
from helpers_graphs import line_graph, save_line_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def save_line_operators(config: Any, forward: float, inverse: float) -> None:
    """The line graph's checkpoint with a diagonal operator: ``inverse`` under rhs (PBG's), ``forward`` under
    lhs when the relations are reciprocal."""
    params = {"relations/0/operator/rhs/diagonal": ("rhs_operators.0.diagonal", np.array([inverse], np.float32))}
    if config.reciprocal_relations:
        params["relations/0/operator/lhs/diagonal"] = ("lhs_operators.0.diagonal", np.array([forward], np.float32))
    save_line_checkpoint(config.checkpoint_path, params)


# reciprocal relations ---------------------------------------------------------------------------------


def test_reciprocal_eval_ranks_each_side_through_its_own_operator(tmp_path: Path) -> None:
    """g_r = 2 (stored under lhs) predicts the rhs, h_r = -1 (PBG's rhs operator) predicts the lhs."""
    config = parse_config(line_graph(tmp_path, "diagonal", reciprocal_relations=True))
    save_line_operators(config, forward=2.0, inverse=-1.0)
    metrics = evaluate(config, candidates="all")
    # edge 0 -> 1: rhs side c(2*1, v'): positive 4, candidates 0 (2), 2 (6) -> rank 2
    #              lhs side c(u', -1*2): positive -2, candidates 1 (-4), 2 (-6) -> rank 1
    # edge 1 -> 2: rhs side c(2*2, v'): positive 12, candidates 0 (4), 1 (8) -> rank 1
    #              lhs side c(u', -1*3): positive -6, candidates 0 (-3), 2 (-9) -> rank 2
    assert metrics["mean_rank"] == pytest.approx(np.mean([2, 1, 1, 2]))
    # the same parameters read by PBG's static scoring c(u, h_r(v)) on both sides: the rhs side differs
    plain = parse_config(line_graph(tmp_path, "diagonal", checkpoint_path=str(tmp_path / "plain")))
    save_line_operators(plain, forward=2.0, inverse=-1.0)
    # edge 0 -> 1 rhs: c(1, -v'): positive -2, candidates -1, -3 -> rank 2; edge 1 -> 2 rhs: positive -6,
    # candidates -2, -4 -> rank 3; lhs sides as above (rank 1 and 2)
    assert evaluate(plain, candidates="all")["mean_rank"] == pytest.approx(np.mean([2, 1, 3, 2]))


def test_reciprocal_scores_only_query_sides_and_each_direction_trains_its_own_operator(tmp_path: Path) -> None:
    # the score matrices themselves, as the autograd path forms them (the hand-differentiated 1-vs-all path forms
    # them inside and is held to this one by tests/test_fused_all.py)
    raw = line_graph(tmp_path, "diagonal", reciprocal_relations=True, dimension=4, loss_fn="softmax")
    raw["relations"][0]["operator"] = "complex_diagonal"
    model = Model(parse_config(raw))
    assert model.reciprocal and len(model.lhs_operators[0].param_names) == 2
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    rows = torch.randn(3, 4, requires_grad=True)
    lhs_inv, rhs_inv = torch.tensor([0, 1]), torch.tensor([1, 2])
    lhs, rhs = model.score_batch(0, None, lhs=Side(rows, lhs_inv), rhs=Side(rows, rhs_inv), num_batch_negs=0,
                                 all_negs=True, options=KernelOptions(fused_all_negs=False))
    g, h = model.lhs_operators[0], model.rhs_operators[0]
    # rhs side: c(g_r(u), v') for every v'; lhs side: c(u', h_r(v)) for every u' (own column masked)
    expected_rhs = g(rows[lhs_inv]) @ rows.T
    expected_lhs = h(rows[rhs_inv]) @ rows.T
    torch.testing.assert_close(rhs.pos, expected_rhs[[0, 1], [1, 2]])
    torch.testing.assert_close(lhs.pos, expected_lhs[[0, 1], [0, 1]])
    assert torch.equal(rhs.neg[[0, 1], [1, 2]], torch.full((2,), -1e9))
    torch.testing.assert_close(rhs.neg[0, 0], expected_rhs[0, 0])
    torch.testing.assert_close(lhs.neg[1, 2], expected_lhs[1, 2])
    # the inverse direction's loss reaches h_r only, the forward one g_r only
    lhs.neg.logsumexp(1).sum().backward(retain_graph=True)
    assert all(p.grad is None or not p.grad.any() for p in g.parameters())
    assert all(p.grad is not None and p.grad.any() for p in h.parameters())


def cycle_raw(root: Path, **extra: Any) -> dict[str, Any]:
    """Relation r links i to i + r + 1 (mod 30): a graph each direction can learn."""
    entity_path, edge_path = root / "entities", root / "edges"
    write_entity_count(str(entity_path), "node", 0, 30)
    heads = np.repeat(np.arange(30), 2)
    rels = np.tile(np.arange(2), 30)
    write_edges(edges_file(str(edge_path), 0, 0), rels, heads, (heads + rels + 1) % 30)
    raw = {
        "entities": {"node": {"num_partitions": 1}},
        "relations": [{"name": f"r{r}", "lhs": "node", "rhs": "node", "operator": "complex_diagonal"}
                      for r in range(2)],
        "dimension": 8, "global_emb": False, "comparator": "dot", "loss_fn": "softmax",
        "entity_path": str(entity_path), "edge_paths": [str(edge_path)], "checkpoint_path": str(root / "ckpt"),
        "num_epochs": 3, "batch_size": 20, "num_batch_negs": 10, "num_uniform_negs": 10, "lr": 0.1,
        "eval_fraction": 0.0, "workers": 1, "seed": 1, "hogwild_delay": 0, "device": "cpu",
        "reciprocal_relations": True,
    }
    raw.update(extra)
    return raw


def model_params(checkpoint_path: str) -> dict[str, np.ndarray]:
    storage = CheckpointStorage(checkpoint_path)
    params, _, _ = storage.load_model(storage.load_version())
    return {k: np.asarray(v) for k, v in params.items()}


@pytest.mark.parametrize("trained_side", ["rhs", "lhs"])
def test_reciprocal_training_trains_the_inverse_through_the_lhs_side_only(tmp_path: Path, trained_side: str) -> None:
    """With one side's negatives disabled only that direction learns: its operator moves, the other's stays."""
    disable = "disable_lhs_negs" if trained_side == "rhs" else "disable_rhs_negs"
    train(parse_config(cycle_raw(tmp_path, **{disable: True})))
    params = model_params(str(tmp_path / "ckpt"))
    identity_real = np.ones(4, dtype=np.float32)
    # the rhs side (predict t from (h, r)) trains g_r, kept under lhs; the lhs side trains h_r (PBG's rhs operator)
    moved = "lhs" if trained_side == "rhs" else "rhs"
    still = "rhs" if trained_side == "rhs" else "lhs"
    for rel in range(2):
        assert not np.allclose(params[f"relations/{rel}/operator/{moved}/real"], identity_real)
        np.testing.assert_array_equal(params[f"relations/{rel}/operator/{still}/real"], identity_real)


def test_reciprocal_checkpoint_is_read_by_our_eval_report_and_export(tmp_path: Path) -> None:
    config = parse_config(cycle_raw(tmp_path, num_epochs=20))
    train(config)
    params = model_params(config.checkpoint_path)
    assert {k.rsplit("/", 2)[0] for k in params} == {f"relations/{r}/operator" for r in range(2)}
    assert {k.split("/")[3] for k in params} == {"lhs", "rhs"}
    assert evaluate(config, candidates="all")["mrr"] > 0.5  # learnt, and ranked through both operators
    # the report scores with the whole trained config (model.h5's config/json), not config.json's PBG keys
    assert "reciprocal_relations" not in json.loads((tmp_path / "ckpt" / "config.json").read_text())
    report = build_report(config.checkpoint_path, ReportOptions(sample=10))
    assert [name for name, _, _ in report.relation_mrr] == ["r0", "r1"]  # config.json alone: "not computed"
    assert not report.relation_note.startswith("not computed")
    out = tmp_path / "export"
    export_checkpoint(config, out=str(out))
    sides = [line.split("\t")[1] for line in (out / "relation_types_parameters.tsv").read_text().splitlines()]
    assert sides.count("lhs") == sides.count("rhs") == 4  # 2 relations x (real, imag) per side


def test_reciprocal_archive_ranks_as_our_eval(tmp_path: Path) -> None:
    """The archive's numpy evaluator ranks the rhs side through g_r too (its metrics equal `biggraph eval`'s)."""
    config = parse_config(cycle_raw(tmp_path, num_epochs=5))
    train(config)
    out = str(tmp_path / "m.zip")
    add_tag(config, out, tag="fp32")
    expected = evaluate(config, filter_paths=config.edge_paths, candidates="all")
    arrays = read_edges(edges_file(config.edge_paths[0], 0, 0))
    triples = np.stack([arrays.rel, arrays.lhs, arrays.rhs], 1).astype(np.int64)
    with load(out, "fp32") as model:
        assert model.reciprocal
        got = link_prediction_metrics(model, triples, triples)
    assert got["mrr"] == pytest.approx(expected["mrr"], abs=1e-6)


def test_reciprocal_checkpoint_is_read_by_pbg_ignoring_the_forward_operator(tmp_path: Path) -> None:
    """PBG 1.0.0 loads model.h5 with strict=False: g_r lands on its empty lhs operator slots and is skipped."""
    tbg_cm = pytest.importorskip("torchbiggraph.checkpoint_manager")
    from torchbiggraph.config import ConfigSchema as PbgConfigSchema
    from torchbiggraph.model import make_model

    config = parse_config(cycle_raw(tmp_path))
    train(config)
    manager = tbg_cm.CheckpointManager(config.checkpoint_path)
    pbg_config = manager.read_config()  # config.json holds no key PBG 1.0.0 refuses
    assert isinstance(pbg_config, PbgConfigSchema)
    state_dict, _ = manager.read_model()
    missing, unexpected = make_model(pbg_config).load_state_dict(state_dict, strict=False)
    # g_r is read (PBG maps every model/ dataset name) and silently skipped: its lhs operator slots are None
    assert {k for k in state_dict if k.startswith("lhs_")} == {
        f"lhs_operators.{r}.{p}" for r in range(2) for p in ("real", "imag")}
    assert unexpected == []
    assert not [k for k in missing if "operators" in k]
    with h5py.File(next(Path(config.checkpoint_path).glob("model.v*.h5"))) as handle:
        np.testing.assert_array_equal(handle["model/relations/0/operator/rhs/real"][()],
                                      model_params(config.checkpoint_path)["relations/0/operator/rhs/real"])


# initialisation by fan ------------------------------------------------------------------------------------


@pytest.mark.parametrize("partitions", [1, 2])
def test_xavier_init_draws_rows_with_the_fan_standard_deviation(tmp_path: Path, partitions: int) -> None:
    entity_path, edge_path = tmp_path / "entities", tmp_path / "edges"
    counts = [3000 // partitions] * partitions
    for part, count in enumerate(counts):
        write_entity_count(str(entity_path), "e", part, count)
    for lhs in range(partitions):
        for rhs in range(partitions):
            write_edges(edges_file(str(edge_path), lhs, rhs), np.array([0]), np.array([0]), np.array([1]))
    raw = {
        "entities": {"e": {"num_partitions": partitions}}, "relations": [{"name": "r", "lhs": "e", "rhs": "e"}],
        "dimension": 50, "entity_path": str(entity_path), "edge_paths": [str(edge_path)],
        "checkpoint_path": str(tmp_path / "ckpt"), "num_epochs": 1, "lr": 1e-12, "eval_fraction": 0.0,
        "workers": 1, "seed": 0, "init_method": "xavier", "init_scale": 5.0,
    }
    config = parse_config(raw)
    assert config.init_std("e", 3000) == pytest.approx(math.sqrt(2 / 3050))
    train(config)
    storage = CheckpointStorage(config.checkpoint_path)
    rows = np.concatenate([storage.load_entity_partition(1, "e", p)[0] for p in range(partitions)])
    assert rows.std() == pytest.approx(math.sqrt(2 / 3050), rel=0.02)  # the total count, not a partition's
    assert abs(rows.mean()) < 0.002
    assert parse_config({**raw, "init_method": "normal"}).init_std("e", 3000) == 5.0  # PBG's default


# the preset ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_fills_in_its_keys_and_explicit_keys_win(tmp_path: Path, name: str) -> None:
    top, per_relation = PRESETS[name]
    config = parse_config(line_graph(tmp_path, "diagonal", preset=name))
    for key, value in top.items():
        assert getattr(config, key) == value, key
    assert all(relation.all_negs == per_relation["all_negs"] for relation in config.relations)
    raw = line_graph(tmp_path, "diagonal", preset=name, lr=0.5, reciprocal_relations=False)
    raw["relations"][0]["all_negs"] = not per_relation["all_negs"]
    explicit = parse_config(raw)
    assert (explicit.lr, explicit.reciprocal_relations, explicit.relations[0].all_negs) == (
        0.5, False, not per_relation["all_negs"])
    # no preset: PBG's defaults, untouched
    plain = parse_config(line_graph(tmp_path, "diagonal"))
    assert (plain.reciprocal_relations, plain.init_method, plain.preset, plain.relations[0].all_negs) == (
        False, "normal", None, False)
    # the expanded config round-trips (config.json) to the same config
    assert parse_config(json.loads(config.to_json())) == config


def test_presets_differ_only_in_how_negatives_are_drawn_and_n3() -> None:
    """quality_sampled is quality's model recipe with PBG's sampled negatives and without N3, which helped 1-vs-all
    only (docs/quality-preset.md)."""
    negatives = {"batch_size", "num_batch_negs", "num_uniform_negs", "regularizer", "regularization_coef"}
    (full, full_rel), (sampled, sampled_rel) = PRESETS["quality"], PRESETS["quality_sampled"]
    assert {k: v for k, v in full.items() if k not in negatives} == {
        k: v for k, v in sampled.items() if k not in negatives}
    assert (full_rel, sampled_rel) == ({"all_negs": True}, {"all_negs": False})
    assert sampled["num_uniform_negs"] > 0 and sampled["num_batch_negs"] > 0
    assert (full["regularizer"], full["regularization_coef"]) == ("N3_shared_relations", 0.1)
    assert "regularization_coef" not in sampled  # PBG's default, 0: off


def test_preset_page_documents_exactly_the_preset_keys() -> None:
    """The page's table has one column per preset, in the order of PRESETS; every row is a key a preset sets, its
    value in each preset's column, "-" where that preset leaves the key to its default."""
    text = (ROOT / "docs" / "quality-preset.md").read_text()
    header = re.search(r"^\| key \|(.*)\|$", text, re.MULTILINE)
    assert header is not None
    assert re.findall(r"`([a-z_]+)`", header.group(1)) == list(PRESETS)
    rows = re.findall(r"^\| `([a-z_.\[\]*]+)` \|((?: (?:`[^`]+`|-) \|)+)$", text, re.MULTILINE)
    table = {key: [cell.strip().strip("`") for cell in values.split("|")[:-1]] for key, values in rows}
    settings = [{**top, **{f"relations[*].{k}": v for k, v in per_relation.items()}} for top, per_relation in PRESETS.values()]
    expected = {key: [json.dumps(preset[key]) if key in preset else "-" for preset in settings]
                for key in dict.fromkeys(k for preset in settings for k in preset)}
    assert table == expected


def test_all_negs_on_a_large_type_is_warned_about_with_its_cost(tmp_path: Path) -> None:
    config = parse_config(line_graph(tmp_path, "diagonal", preset="quality", dimension=200))
    note = all_negs_cost(config, {"e": [111_969]})
    assert note is not None and "111,969" in note and "quality_sampled" in note
    assert "~134 GFLOP" in note  # 12 x 500 x 111,969 x 200: the preset's batch of 500 against the WordNet KG
    assert all_negs_cost(config, {"e": [ALL_NEGS_NOTE_ENTITIES]}) is None  # small enough: no warning
    sampled = parse_config(line_graph(tmp_path, "diagonal", preset="quality_sampled", dimension=200))
    assert all_negs_cost(sampled, {"e": [111_969]}) is None
    # the largest partition counts, not the type's total
    partitioned = parse_config({**line_graph(tmp_path, "diagonal", preset="quality"),
                                "entities": {"e": {"num_partitions": 2}}})
    assert all_negs_cost(partitioned, {"e": [40_000, 40_000]}) is None


def test_training_warns_at_start_when_all_negs_meets_a_large_type(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bucket_run, "ALL_NEGS_NOTE_ENTITIES", 2)  # the line graph's 3 entities count as large
    config = parse_config(line_graph(tmp_path, "diagonal", preset="quality", num_epochs=1, workers=1))
    with caplog.at_level(logging.WARNING, logger="biggraph"):
        train(config)
    assert [r for r in caplog.records if r.levelno == logging.WARNING and "all_negs" in r.getMessage()
            and "3 entities" in r.getMessage()]
    caplog.clear()
    sampled = parse_config(line_graph(tmp_path / "s", "diagonal", preset="quality_sampled", num_epochs=1, workers=1,
                                      num_uniform_negs=2, num_batch_negs=2))
    with caplog.at_level(logging.WARNING, logger="biggraph"):
        train(sampled)
    assert not [r for r in caplog.records if "all_negs" in r.getMessage()]


@pytest.mark.parametrize(("override", "key"), [
    ("preset=fast", "preset"), ("preset=quality-sampled", "preset"), ("init_method=glorot", "init_method"),
    ("reciprocal_relations=3", "reciprocal_relations"), ("embedding_dropout=1.0", "embedding_dropout"),
    ("embedding_dropout=-0.1", "embedding_dropout"),
])
def test_bad_values_are_clear_errors_naming_the_key(tmp_path: Path, override: str, key: str,
                                                    capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(line_graph(tmp_path, "diagonal")))
    with pytest.raises(ConfigError, match=f"'{key}'"):
        load_config(str(path), [override])
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["train", str(path), "-p", override]) == 2
    err = capsys.readouterr().err
    assert key in err and "Traceback" not in err


# embedding dropout ------------------------------------------------------------------------------------------


def _dropout_batch(seed: int, train: bool = True, options: KernelOptions = KernelOptions(),
                   operator: str = "complex_diagonal",
                   **overrides: Any) -> tuple[BatchStats, torch.Tensor, list[torch.Tensor], bool]:
    """One reciprocal 1-vs-all ComplEx batch (float64) from a fixed state, torch's global generator (which dropout
    draws from) seeded with ``seed``: (stats, the table after, the operators' gradients, whether the batch drew
    from the global generator)."""
    config = parse_config({
        "entities": {"node": {"num_partitions": 1}},
        "relations": [{"name": "r", "lhs": "node", "rhs": "node", "operator": operator, "all_negs": True}],
        "dimension": 8, "entity_path": "x", "edge_paths": ["x"], "checkpoint_path": "x", "batch_size": 40,
        "reciprocal_relations": True, "global_emb": False, "loss_fn": "softmax", "comparator": "dot",
        "num_batch_negs": 0, "num_uniform_negs": 0, **overrides})
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        state = torch.Generator().manual_seed(0)
        model = Model(config)
        for param in model.parameters():
            param.data.normal_(generator=state)
        weight = torch.randn(30, 8, generator=state)
        table = Table(weight, torch.zeros(30))
        ctx = BatchContext(config, model, None, {0: table}, {0: table}, 0, 0, options)
        lhs, rhs = torch.randint(0, 30, (17,), generator=state), torch.randint(0, 30, (17,), generator=state)
        torch.manual_seed(seed)
        before = torch.get_rng_state()
        stats = run_batch(ctx, 0, lhs, rhs, None, generator=torch.Generator().manual_seed(1), train=train)
        drew = not torch.equal(torch.get_rng_state(), before)
        grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    finally:
        torch.set_default_dtype(previous)
    return stats, weight, grads, drew


def test_embedding_dropout_is_off_by_default_and_draws_nothing(tmp_path: Path) -> None:
    """A config without the key trains bit-identically whatever torch's generator holds, and leaves it as it was."""
    assert parse_config(line_graph(tmp_path, "diagonal")).embedding_dropout == 0.0
    first, weight, grads, drew = _dropout_batch(seed=1)
    second, other_weight, other_grads, _ = _dropout_batch(seed=2)
    assert not drew
    assert torch.equal(weight, other_weight) and float(first.loss) == float(second.loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, other_grads))


def test_embedding_dropout_trains_with_fresh_masks_and_leaves_the_regulariser_whole() -> None:
    """p = 0.5: the update depends on the draw (same seed, same update; another seed, another), the hand-differentiated
    1-vs-all path agrees with autograd's for one draw, and the regulariser reads the undropped rows."""
    reg = {"regularizer": "DURA", "regularization_coef": 0.1}
    plain, plain_weight, _, _ = _dropout_batch(seed=1, **reg)
    dropped, weight, grads, drew = _dropout_batch(seed=1, embedding_dropout=0.5, **reg)
    again, again_weight, _, _ = _dropout_batch(seed=1, embedding_dropout=0.5, **reg)
    other, other_weight, _, _ = _dropout_batch(seed=2, embedding_dropout=0.5, **reg)
    assert drew
    assert torch.equal(weight, again_weight) and float(dropped.loss) == float(again.loss)
    assert not torch.allclose(weight, other_weight) and not torch.allclose(weight, plain_weight)
    assert float(dropped.loss) != pytest.approx(float(plain.loss))
    assert float(dropped.reg) == pytest.approx(float(plain.reg), rel=1e-12)
    _, ref_weight, ref_grads, _ = _dropout_batch(seed=1, options=KernelOptions(fused_all_negs=False),
                                              embedding_dropout=0.5, **reg)
    torch.testing.assert_close(weight, ref_weight, rtol=1e-9, atol=1e-9)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-7)
    # the entity rows are dropped too: without relation parameters (operator none) the update still changes
    _, none_weight, _, _ = _dropout_batch(seed=1, operator="none")
    _, none_dropped, _, _ = _dropout_batch(seed=1, operator="none", embedding_dropout=0.5)
    assert not torch.allclose(none_weight, none_dropped)


def test_embedding_dropout_is_inactive_in_evaluation() -> None:
    """An evaluation batch (train false) ranks exactly as without dropout, and draws nothing."""
    plain, _, _, _ = _dropout_batch(seed=1, train=False)
    evaluated, _, _, drew = _dropout_batch(seed=3, train=False, embedding_dropout=0.5)
    assert not drew
    assert evaluated.num_ranks == plain.num_ranks > 0
    assert (evaluated.reciprocal_rank_sum, evaluated.rank_sum) == (plain.reciprocal_rank_sum, plain.rank_sum)


def test_relation_dropout_masks_each_query_row_independently() -> None:
    """A static relation's parameters get one mask per query row (LibKGE embeds the relation per query): every
    entry is 0 or the parameter / (1 - p), and the rows differ."""
    torch.manual_seed(0)
    operator = Operator("diagonal", 6)
    with torch.no_grad():
        operator.diagonal.uniform_(1.0, 2.0)
    out = operator.forward_dropped(torch.ones(200, 6), None, 0.25)
    kept = out != 0
    torch.testing.assert_close(out[kept], (operator.diagonal.detach() / 0.75).expand(200, 6)[kept])
    assert 0.15 < 1 - kept.double().mean() < 0.35
    assert len({tuple(row) for row in kept.tolist()}) > 20
    dynamic = Operator("complex_diagonal", 4, 3)
    rel = torch.tensor([0, 2, 1, 2])
    x = torch.randn(4, 4)
    torch.testing.assert_close(dynamic.forward_dropped(x, rel, 0.0), dynamic(x, rel))


def test_embedding_dropout_needs_reciprocal_scoring(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'embedding_dropout'.*reciprocal_relations"):
        parse_config(line_graph(tmp_path, "diagonal", embedding_dropout=0.3))
    assert parse_config(line_graph(tmp_path, "diagonal", embedding_dropout=0.3,
                                   reciprocal_relations=True)).embedding_dropout == 0.3
    assert parse_config(line_graph(tmp_path, "diagonal", embedding_dropout=0.3, dynamic_relations=True,
                                   reciprocal_relations=False)).embedding_dropout == 0.3
    config = parse_config(line_graph(tmp_path, "diagonal", embedding_dropout=0.3, reciprocal_relations=True))
    assert "embedding_dropout" not in config.to_pbg_dict()  # PBG 1.0.0 refuses keys it does not know


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_each_hogwild_task_seeds_the_dropout_masks_with_its_own_seed(tmp_path: Path, dropout: float) -> None:
    """Workers start with the same global generator: with embedding_dropout each task reseeds it from its own seed
    (distinct per slice), so two workers do not share masks; without it nothing is reseeded."""
    from job.train.hogwild import pool as hogwild

    config = parse_config(line_graph(tmp_path, "diagonal", reciprocal_relations=True, embedding_dropout=dropout))
    ctx = BatchContext(config, Model(config), None, {}, {}, 0, 0)
    torch.manual_seed(7)
    task = {"seed": 123_456, "edges": None, "indices": torch.empty(0, dtype=torch.long), "shared": None,
            "steal": [], "train": True}
    hogwild._run_task(ctx, task, None)
    assert torch.initial_seed() == (123_456 if dropout else 7)
