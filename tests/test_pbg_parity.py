"""A PBG config trains as PBG 1.0.0 organises training (bench/RESULTS.md, "Quality: what differs from PBG 1.0.0").

- every bucket is cut into exactly ``workers`` slices of floor/ceil sizes (torchbiggraph/util.py
  ``split_almost_equally``), each processed in batches of ``batch_size``: the number of optimizer steps
  per epoch is PBG's, also for tiny buckets and on the one-process (GPU) path;
- ``hogwild_delay`` staggers the workers of buckets of epoch 0 (PBG's every bucket with
  ``hogwild_delay_scope: epoch_0``; by default those with a partition not trained before), of no later bucket;
- ``init_path`` brings the Adagrad state saved beside the embeddings;
- a featurized entity type on both sides of a relation gets one Adagrad step per feature row.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers_graphs import write_cycle_graph

from job.config import parse_config
from job.formats.checkpoint import CheckpointStorage
from job.model.kernel_options import KernelOptions
from job.model.scoring import Model, Table
from job.model.side import Side
from job.train import Collaborators, Trainer, bucket_run, train
from job.train.batch import batching
from job.train.batch.batching import process_edges, split_almost_equally
from job.train.batch.optim import ADAGRAD_EPS, RelationAdagrad
from job.train.batch.step import BatchContext, BatchStats, _finish, run_batch
from job.train.inputs import EdgeTensors


def pbg_batch_sizes(num_edges: int, workers: int, batch_size: int) -> list[int]:
    """PBG 1.0.0's batches of one relation's bucket: W slices (floor/ceil, larger first), each in batches of
    batch_size with a partial last one (torchbiggraph/batching.py ``batch_edges_group_by_relation_type``)."""
    base, larger = divmod(num_edges, workers)
    sizes = []
    for rank in range(workers):
        left = base + (1 if rank < larger else 0)
        while left > 0:
            sizes.append(min(batch_size, left))
            left -= batch_size
    return sorted(sizes)


@pytest.mark.parametrize("size", [0, 1, 5, 16, 17, 326, 5216])
@pytest.mark.parametrize("parts", [1, 2, 3, 16])
def test_split_is_pbgs(size: int, parts: int) -> None:
    slices = split_almost_equally(size, parts)
    assert len(slices) == parts
    lengths = [s.stop - s.start for s in slices]
    assert sum(lengths) == size and slices[0].start == 0 and slices[-1].stop == size
    assert all(a.stop == b.start for a, b in zip(slices, slices[1:]))
    assert lengths == sorted(lengths, reverse=True) and max(lengths) - min(lengths) <= 1
    pbg_util = pytest.importorskip("torchbiggraph.util")
    assert slices == list(pbg_util.split_almost_equally(size, num_parts=parts))


class RecordingPool:
    """Stands in for ``WorkerPool``: runs each slice here, one after another, and records the delays."""

    delays: list[list[float]] = []

    def __init__(self, num_workers: int, config: Any, model: Model, relation_optimizer: Any,
                 options: KernelOptions) -> None:
        self.config = config
        self.model = model
        self.relation_optimizer = relation_optimizer
        self.num_workers = num_workers
        self.options = options

    def run(self, edges: EdgeTensors, index_slices: list[torch.Tensor], lhs_tables: dict[int, Table],
            rhs_tables: dict[int, Table], seeds: list[int], train: bool, num_batch_negs: int,
            num_uniform_negs: int, delays: Optional[list[float]] = None, lr_scale: float = 1.0,
            stop: Optional[Callable[[], bool]] = None) -> BatchStats:
        assert len(index_slices) == self.num_workers
        RecordingPool.delays.append(list(delays or []))
        ctx = BatchContext(config=self.config, model=self.model, relation_optimizer=self.relation_optimizer,
                           lhs_tables=lhs_tables, rhs_tables=rhs_tables, num_batch_negs=num_batch_negs,
                           num_uniform_negs=num_uniform_negs, options=self.options, lr_scale=lr_scale, stop=stop)
        total = BatchStats()
        for indices, seed in zip(index_slices, seeds):
            generator = torch.Generator()
            generator.manual_seed(seed)
            total.add(process_edges(ctx, edges, indices, self.config.batch_size, self.config.dynamic_relations,
                                    generator, train))
        return total

    def close(self) -> None:
        pass


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    """The size of every training batch and the delays of every pool run, in this process."""
    record: dict[str, list] = {"sizes": [], "delays": []}
    original = batching.run_batch

    def counting(ctx: BatchContext, rel_idx: int, lhs: torch.Tensor, *args: Any, **kwargs: Any) -> BatchStats:
        if kwargs["train"]:
            record["sizes"].append(int(lhs.shape[0]))
        return original(ctx, rel_idx, lhs, *args, **kwargs)

    monkeypatch.setattr(batching, "run_batch", counting)
    monkeypatch.setattr(bucket_run, "WorkerPool", RecordingPool)
    RecordingPool.delays = record["delays"]
    return record


@pytest.mark.parametrize(("num_edges", "workers", "batch_size", "one_process"), [
    (40, 1, 20, False),     # one worker: full batches
    (39, 3, 20, False),     # a bucket under 2 x batch_size: one process, still 3 slices of 13
    (5, 16, 20, False),     # fewer edges than workers: 5 slices of one edge, 11 empty ones
    (100, 16, 20, False),   # 16 slices of 6-7 edges: every batch partial
    (130, 2, 20, False),    # the Hogwild pool: 65 + 65 -> 20, 20, 20, 5 each
    (130, 4, 30, True),     # the GPU's path: one process, 4 slices (33, 33, 32, 32)
])
@pytest.mark.parametrize("dynamic", [False, True])
def test_steps_per_epoch_are_pbgs(tmp_path: Path, recorded: dict[str, list], num_edges: int, workers: int,
                                  batch_size: int, one_process: bool, dynamic: bool) -> None:
    """One relation (or dynamic relations), one bucket: the batches of an epoch are exactly PBG's."""
    raw = write_cycle_graph(tmp_path, num_entities=num_edges, num_relations=1, dynamic=dynamic, num_epochs=2,
                            workers=workers, batch_size=batch_size, device="cpu")
    # one_process: as on a GPU, the trainer keeps the slices (slices_per_bucket) but runs no Hogwild pool
    trainer = Trainer(parse_config(raw), parts=Collaborators(hogwild=not one_process))
    try:
        trainer.run()
    finally:
        trainer.close()
    expected = pbg_batch_sizes(num_edges, workers, batch_size)
    assert sorted(recorded["sizes"]) == sorted(expected * 2)
    # the step count alone, as PBG's formula: sum over the W slices of ceil(slice / batch_size)
    assert len(recorded["sizes"]) == 2 * sum(math.ceil((num_edges // workers + (rank < num_edges % workers))
                                                       / batch_size) for rank in range(workers))
    used_pool = workers > 1 and not one_process and num_edges >= 2 * batch_size
    assert len(recorded["delays"]) == (2 if used_pool else 0)


def test_the_gpus_static_shapes_train_partial_batches_of_every_slice(tmp_path: Path) -> None:
    """The GPU's organisation on the CPU: one process, 3 slices of 133-134 edges in batches of 50 (a partial
    batch per relation and slice), through the static-shape step the CUDA graphs capture: the same training as
    the dynamic-shape step."""
    results = []
    for static in (False, True):
        raw = write_cycle_graph(tmp_path / str(static), num_entities=200, num_relations=2, num_epochs=3, workers=3,
                                batch_size=50, device="cpu")
        trainer = Trainer(parse_config(raw), parts=Collaborators(
            hogwild=False, kernel_options=KernelOptions(static_shapes_on_cpu=static)))
        try:
            trainer.run()
        finally:
            trainer.close()
        weight, _ = CheckpointStorage(raw["checkpoint_path"]).load_entity_partition(3, "node", 0)
        results.append(weight)
        losses = [s["stats"]["metrics"]["loss"] for s in CheckpointStorage(raw["checkpoint_path"]).load_stats()
                  if s.get("pass_summary")]
        assert losses[-1] < losses[0]
    np.testing.assert_allclose(results[0], results[1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("scope", ["epoch_0", "first_visit"])
def test_hogwild_delay_staggers_buckets_of_epoch_zero_only(tmp_path: Path, recorded: dict[str, list],
                                                           scope: str) -> None:
    """``epoch_0`` (PBG 1.0.0): every bucket of epoch 0 staggers its workers; ``first_visit`` (the default): only
    a bucket with a partition not trained before, whatever order the buckets come in; no bucket after epoch 0."""
    raw = write_cycle_graph(tmp_path, num_entities=800, num_partitions=4, num_relations=2, num_epochs=2,
                            workers=3, batch_size=20, hogwild_delay=0.25, hogwild_delay_scope=scope, device="cpu")
    train(parse_config(raw))
    order = [(r["lhs_partition"], r["rhs_partition"]) for r in CheckpointStorage(raw["checkpoint_path"]).load_stats()
             if "lhs_partition" in r and r["epoch_idx"] == 0]
    assert len(order) == 16 and len(recorded["delays"]) == 2 * 16  # every bucket big enough for the pool
    trained: set[int] = set()
    expected = []
    for lhs, rhs in order:
        expected.append(scope == "epoch_0" or not {lhs, rhs} <= trained)
        trained |= {lhs, rhs}
    assert [delays == [0.0, 0.25, 0.25] for delays in recorded["delays"][:16]] == expected
    assert all(delays == [0.0, 0.0, 0.0] for delays in recorded["delays"][:16] if delays != [0.0, 0.25, 0.25])
    assert recorded["delays"][16:] == [[0.0, 0.0, 0.0]] * 16
    if scope == "first_visit":
        assert expected[0] and 2 <= sum(expected) <= 4  # one bucket per new partition at most, of 16


def test_init_path_brings_the_optimizer_state(tmp_path: Path) -> None:
    first = write_cycle_graph(tmp_path / "first", num_epochs=3)
    train(parse_config(first))
    second = write_cycle_graph(tmp_path / "second", num_epochs=1, init_path=first["checkpoint_path"], lr=1e-9)
    train(parse_config(second))
    before, after = CheckpointStorage(first["checkpoint_path"]), CheckpointStorage(second["checkpoint_path"])
    _, state_before = before.load_entity_partition(3, "node", 0)
    _, state_after = after.load_entity_partition(1, "node", 0)
    sums_before = np.asarray(state_before["state"][0]["sum"])
    sums_after = np.asarray(state_after["state"][0]["sum"])
    # Adagrad sums only grow: the second run went on from the first's (a reset would leave one epoch's worth)
    assert (sums_after >= sums_before - 1e-6).all() and sums_after.sum() > sums_before.sum()
    _, model_before, _ = before.load_model(3)
    _, model_after, _ = after.load_model(1)
    assert model_before is not None and model_after is not None
    for i, entry in model_before["state"].items():
        grown = np.asarray(model_after["state"][i]["sum"]) >= np.asarray(entry["sum"]) - 1e-6
        assert grown.all()


def featurized_both_sides_config(tmp_path: Path) -> Any:
    return parse_config({
        "entities": {"tag": {"num_partitions": 1, "featurized": True}},
        "relations": [{"name": "near", "lhs": "tag", "rhs": "tag", "operator": "diagonal"}],
        "dimension": 8, "comparator": "dot", "loss_fn": "softmax", "entity_path": str(tmp_path / "entities"),
        "edge_paths": [str(tmp_path / "edges")], "checkpoint_path": str(tmp_path / "ckpt"),
        "batch_size": 4, "num_batch_negs": 2, "num_uniform_negs": 0, "lr": 0.1, "workers": 1,
        "device": "cpu",
    })


def test_featurized_type_on_both_sides_takes_one_adagrad_step_per_feature_row(tmp_path: Path) -> None:
    """PBG's RowAdagrad steps the shared parameter once with both sides' gradients summed (coalesced)."""
    config = featurized_both_sides_config(tmp_path)
    torch.manual_seed(0)
    model = Model(config, 0)
    weight = torch.randn(6, 8) * 0.5
    optim_sum = torch.rand(6)
    # feature 2 is on both sides; feature 5 is never used
    lhs_features = (torch.tensor([0, 2, 3, 4, 6]), torch.tensor([0, 2, 1, 3, 2, 4]))
    rhs_features = (torch.tensor([0, 1, 3, 4, 5]), torch.tensor([2, 3, 1, 0, 4]))
    table = Table(weight.clone(), optim_sum.clone())
    ctx = BatchContext(config=config, model=model, relation_optimizer=None, lhs_tables={0: table},
                       rhs_tables={0: table}, num_batch_negs=2, num_uniform_negs=0)
    ids = torch.zeros(4, dtype=torch.long)
    run_batch(ctx, 0, ids, ids, None, generator=None, train=True, lhs_features=lhs_features, rhs_features=rhs_features)

    reference = weight.clone().requires_grad_(True)
    lhs_rows = F.embedding_bag(lhs_features[1], reference, lhs_features[0][:-1], mode="mean")
    rhs_rows = F.embedding_bag(rhs_features[1], reference, rhs_features[0][:-1], mode="mean")
    positions = torch.arange(4)
    lhs_scores, rhs_scores = model.score_batch(0, None, lhs=Side(lhs_rows, positions), rhs=Side(rhs_rows, positions),
                                               num_batch_negs=2, all_negs=False)
    _finish(ctx, 0, None, 4, True, lhs=lhs_scores, rhs=rhs_scores)
    grad = reference.grad
    assert grad is not None
    touched = torch.tensor([0, 1, 2, 3, 4])
    expected_sum = optim_sum.clone()
    expected_sum[touched] += grad[touched].pow(2).mean(1)
    expected = weight.clone()
    expected[touched] -= 0.1 * grad[touched] / (expected_sum[touched].sqrt() + ADAGRAD_EPS).unsqueeze(1)
    torch.testing.assert_close(table.optim_sum, expected_sum, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(table.weight, expected, rtol=1e-5, atol=1e-7)


def test_the_log_says_what_hogwild_delay_will_cost_the_first_epoch() -> None:
    """The delay is announced with its total, and only where it applies: PBG's every bucket of epoch 0, or the
    default's at most one bucket per partition."""
    def note(workers: int = 4, buckets: int = 64, **overrides: Any) -> Optional[str]:
        config = parse_config({"entities": {"e": {"num_partitions": 8}}, "relations": [{"name": "r", "lhs": "e", "rhs": "e"}],
                               "dimension": 4, "entity_path": "x", "edge_paths": ["x"], "checkpoint_path": "x",
                               **overrides})
        return bucket_run.HogwildStagger(config, workers, enabled=True).cost_note(buckets, 8)

    pbg = note(hogwild_delay_scope="epoch_0")
    assert pbg is not None and "one of 4 Hogwild workers trains alone for the first 2 s" in pbg
    assert "each of the 64 buckets" in pbg and "up to 96 s" in pbg  # 3 of 4 workers' share of 2 s, 64 times
    default = note()
    assert default is not None and "at most 8 buckets" in default and "up to 12 s" in default
    assert note(hogwild_delay=0.0) is None
    assert note(workers=1) is None  # one worker (or a GPU): nobody waits
    assert note(buckets=1, hogwild_delay_scope="epoch_0") is None  # one bucket: PBG's single delay, as ever


def test_relation_adagrad_steps_as_torch_adagrad_does() -> None:
    """PBG steps relation parameters with torch.optim.Adagrad: the same updates and state, over several steps in
    which only some parameters have a gradient (a batch's relation), and none after a step."""
    generator = torch.Generator().manual_seed(0)
    ours = [torch.randn(5, generator=generator, dtype=torch.float64) for _ in range(3)]
    theirs = [torch.nn.Parameter(p.clone()) for p in ours]
    optimizer = RelationAdagrad(ours, 0.1)
    reference = torch.optim.Adagrad(theirs, lr=0.1, eps=ADAGRAD_EPS)
    for step_index in range(4):
        for i, (mine, other) in enumerate(zip(ours, theirs)):
            grad = torch.randn(5, generator=generator, dtype=torch.float64)
            stepped = i != step_index % 3  # one parameter sits each step out
            mine.grad = grad.clone() if stepped else None
            other.grad = grad.clone() if stepped else None
        optimizer.step()
        reference.step()
        assert all(p.grad is None for p in ours)
        for mine, other in zip(ours, theirs):
            torch.testing.assert_close(mine, other.detach(), rtol=1e-12, atol=1e-12)
    for i, state_sum in enumerate(optimizer.sums):
        torch.testing.assert_close(state_sum, reference.state[theirs[i]]["sum"], rtol=1e-12, atol=1e-12)
