"""Scoring pieces against hand-computed values: operators, comparators, losses, weighted uniform negatives and
the evaluation metrics of a graph whose ranks can be worked out by hand."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from job.config import parse_config
from job.evaluation import evaluate
from job.formats.edges import edges_file, write_edges
from job.model.comparators import Comparator
from job.model.losses import compute_loss
from job.model.operators import Operator

sys.path.insert(0, str(Path(__file__).parent))
from helpers_graphs import line_graph, save_line_checkpoint, write_cycle_graph  # noqa: E402

# model pieces ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["none", "diagonal", "translation", "linear", "affine", "complex_diagonal"])
@pytest.mark.parametrize("dynamic", [False, True])
def test_operator_shapes_gradients_and_identity_at_init(kind: str, dynamic: bool) -> None:
    operator = Operator(kind, 8, num_operations=3 if dynamic else 0)
    x = torch.randn(5, 8, requires_grad=True)
    rel = torch.tensor([0, 1, 2, 0, 1]) if dynamic else None
    y = operator(x, rel)
    assert y.shape == x.shape
    # PBG initialises every operator to the identity (complex_diagonal: 1 + 0i)
    assert torch.allclose(y, x)
    y.pow(2).sum().backward()
    assert torch.isfinite(x.grad).all()
    for param in operator.parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all()


@pytest.mark.parametrize("kind", ["dot", "cos", "l2", "squared_l2"])
@pytest.mark.parametrize("bias", [False, True])
def test_comparator_pairwise_matches_elementwise(kind: str, bias: bool) -> None:
    comparator = Comparator(kind, bias)
    x = comparator.prepare(torch.randn(2, 3, 6))
    y = comparator.prepare(torch.randn(2, 4, 6))
    pairwise = comparator.pairwise(x, y)
    assert pairwise.shape == (2, 3, 4)
    for c in range(2):
        for i in range(3):
            for j in range(4):
                expected = comparator.pos(x[c, i], y[c, j])
                assert torch.allclose(pairwise[c, i, j], expected, atol=1e-4), (c, i, j)


def test_cos_comparator_scores_are_cosines() -> None:
    comparator = Comparator("cos", False)
    x = comparator.prepare(torch.tensor([[3.0, 4.0]]))
    y = comparator.prepare(torch.tensor([[6.0, 8.0]]))
    assert torch.allclose(comparator.pos(x, y), torch.tensor([1.0]))


def test_losses_match_hand_computed_values() -> None:
    pos = torch.tensor([1.0, 0.0])
    neg = torch.tensor([[0.5, 1.5], [-1.0, 0.0]])
    # ranking: sum(max(0, margin - pos + neg))
    assert compute_loss("ranking", 0.1, pos, neg).item() == pytest.approx((0.0 + 0.6) + (0.0 + 0.1))
    # softmax: sum(logsumexp([pos, negs]) - pos)
    expected = sum(float(torch.logsumexp(torch.cat((pos[i:i + 1], neg[i])), 0) - pos[i]) for i in range(2))
    assert compute_loss("softmax", 0.1, pos, neg).item() == pytest.approx(expected, rel=1e-6)
    # logistic: BCE(pos, 1) + mean over negatives of BCE(neg, 0), summed over rows
    sig = torch.nn.functional.softplus
    expected = float(sig(-pos).sum() + sig(neg).sum() / 2)
    assert compute_loss("logistic", 0.1, pos, neg).item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("loss_fn", ["ranking", "logistic", "softmax"])
def test_weighted_uniform_negatives_equal_the_materialised_ones(tmp_path: Path, loss_fn: str) -> None:
    """Few candidates, many samples: scoring each candidate once with its draw count must give PBG's sums."""
    from job.model.kernel_options import KernelOptions
    from job.model.scoring import Model, _Batch
    from job.model.side import Side
    from job.train.batch.step import BatchStats, _add_ranks

    config = parse_config(write_cycle_graph(tmp_path, loss_fn=loss_fn, comparator="dot"))
    model = Model(config)
    generator = torch.Generator().manual_seed(0)
    anchor = torch.randn(7, 16, generator=generator)
    positives = torch.randn(7, 16, generator=generator)
    candidates = torch.randn(5, 16, generator=generator)
    neg_inv = torch.randint(0, 5, (2, 9), generator=generator)  # 2 chunks of 4, 9 draws each > 5 candidates
    with torch.no_grad():  # the scoring used by evaluation; training's fused twin is held to it in test_fused.py
        side = Side(candidates, torch.arange(7), neg_inv)
        batch = _Batch(0, None, side, side, num_batch_negs=4, all_negs=False, options=KernelOptions())
        weighted = model._side_scores(batch, side, anchor=anchor, positives=positives, candidates=candidates)
    assert weighted.weight is not None  # the counted path was taken
    # the same negatives, one column per draw, as PBG lays them out
    padded_anchor = torch.cat((anchor, torch.zeros(1, 16))).view(2, 4, 16)
    padded_pos = torch.cat((positives, torch.zeros(1, 16))).view(2, 4, 16)
    batch = padded_anchor @ padded_pos.transpose(1, 2)
    mask = torch.eye(4, dtype=torch.bool).expand(2, 4, 4).clone()
    mask[-1, :, 3:] = True
    batch = batch.masked_fill(mask, -1e9)
    uniform = padded_anchor @ candidates[neg_inv].transpose(1, 2)
    explicit = torch.cat((batch, uniform), dim=2).reshape(8, -1)[:7]
    expected = compute_loss(loss_fn, 0.1, weighted.pos, explicit)
    got = compute_loss(loss_fn, 0.1, weighted.pos, weighted.neg, weighted.weight, weighted.num_neg)
    assert got.item() == pytest.approx(expected.item(), rel=1e-5)
    from job.model.scoring import SideScores

    ranks_weighted, ranks_explicit = BatchStats(), BatchStats()
    _add_ranks(ranks_weighted, weighted)
    _add_ranks(ranks_explicit, SideScores(weighted.pos, explicit))
    assert ranks_weighted.rank_sum == pytest.approx(ranks_explicit.rank_sum)
    assert ranks_weighted.auc_sum == pytest.approx(ranks_explicit.auc_sum)


# eval metrics against a hand-computed case ----------------------------------------------------------------


def test_eval_metrics_match_hand_computed_ranks(tmp_path: Path) -> None:
    """Three entities on a line, dot comparator, no operator: ranks can be worked out by hand."""
    config = parse_config(line_graph(tmp_path))
    edge_path = config.edge_paths[0]
    save_line_checkpoint(config.checkpoint_path)
    metrics = evaluate(config, candidates="all")
    # edge (0 -> 1), score 1*2 = 2.
    #   corrupt rhs: candidates 0 (1*1=1), 2 (1*3=3): one scores >= 2 -> rank 2
    #   corrupt lhs: candidates 1 (2*2=4), 2 (3*2=6): both >= 2 -> rank 3
    # edge (1 -> 2), score 2*3 = 6.
    #   corrupt rhs: 0 (2), 1 (4): none >= 6 -> rank 1
    #   corrupt lhs: 0 (1*3=3), 2 (3*3=9): one -> rank 2
    ranks = [2, 3, 1, 2]
    assert metrics["count"] == 2
    assert metrics["mean_rank"] == pytest.approx(np.mean(ranks))
    assert metrics["mrr"] == pytest.approx(np.mean([1 / r for r in ranks]))
    assert metrics["hits@1"] == pytest.approx(0.25)
    assert metrics["hits@10"] == pytest.approx(1.0)
    # AUC: fraction of the 2 candidates below the positive, per rank: 1/2, 0, 1, 1/2
    assert metrics["auc"] == pytest.approx(np.mean([0.5, 0.0, 1.0, 0.5]))
    # filtered: removing the true edge (1 -> 2) from the candidates of edge (0 -> 1)'s lhs side...
    filtered = evaluate(config, filter_paths=[edge_path], candidates="all")
    # edge (0->1) corrupt lhs: candidate 1 would form (1 -> 1)? not a true edge; candidate 2: (2 -> 1) no.
    # edge (1->2) corrupt lhs: candidate 0 forms (0 -> 2)? no. corrupt rhs of (0->1): candidate 2 forms (0->2)? no.
    # edge (1->2) corrupt rhs: candidate 1 forms (1 -> 1)? no. So nothing is filtered here:
    assert filtered["mrr"] == pytest.approx(metrics["mrr"])
    # now add (0 -> 2) as a known edge: it filters candidate 2 for (0 -> 1)'s rhs side (rank 2 -> 1)
    # and candidate 0 for (1 -> 2)'s lhs side (which scored below the positive: rank stays 2)
    known = tmp_path / "known"
    write_edges(edges_file(str(known), 0, 0), np.array([0]), np.array([0]), np.array([2]))
    filtered = evaluate(config, filter_paths=[edge_path, str(known)], candidates="all")
    assert filtered["mean_rank"] == pytest.approx(np.mean([1, 3, 1, 2]))
