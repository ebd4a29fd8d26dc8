"""PBG's ``hogwild_delay`` without idle workers: the same batches, one worker alone during the delay.

PBG holds every Hogwild worker but the first back by ``hogwild_delay`` on each bucket of epoch 0. Here a worker
done with its own slice takes the delayed slices' batches from their back (``work_sharing.SharedSlice``), so
each batch still runs exactly once and a delay longer than the bucket's work costs nothing more.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers_graphs import base_config

from job.config import parse_config
from job.model.kernel_options import KernelOptions
from job.model.scoring import Model, Table
from job.train.batch import batching
from job.train.batch.batching import plan_batches, split_almost_equally
from job.train.batch.optim import RelationAdagrad
from job.train.batch.step import BatchContext, BatchStats
from job.train.hogwild import pool as hogwild
from job.train.hogwild.pool import WorkerPool
from job.train.hogwild.work_sharing import SharedSlice
from job.train.inputs import EdgeTensors

NUM_EDGES = 2_000
BATCH = 100  # a multiple of the default 50 batch negatives


def _edges(num_entities: int = NUM_EDGES, num_relations: int = 3) -> EdgeTensors:
    """Edge i has lhs i, so a batch's lhs names its edges."""
    generator = torch.Generator().manual_seed(0)
    rel = torch.randint(0, num_relations, (NUM_EDGES,), generator=generator)
    rhs = torch.randint(0, num_entities, (NUM_EDGES,), generator=generator)
    return EdgeTensors(rel, torch.arange(NUM_EDGES) % num_entities, rhs)


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_plan_is_a_function_of_slice_and_seed(dynamic: bool) -> None:
    """Two processes planning one slice with one seed get the same batches: PBG's, each edge once."""
    edges = _edges()
    indices = torch.randperm(NUM_EDGES, generator=torch.Generator().manual_seed(1))[:1_500]
    first = plan_batches(edges.rel, indices, BATCH, dynamic, torch.Generator().manual_seed(7))
    again = plan_batches(edges.rel, indices, BATCH, dynamic, torch.Generator().manual_seed(7))
    other = plan_batches(edges.rel, indices, BATCH, dynamic, torch.Generator().manual_seed(8))
    for name in ("indices", "relations", "starts", "ends"):
        assert torch.equal(getattr(first, name), getattr(again, name)), name
    covered = torch.cat([first.indices[s:e] for s, e in zip(first.starts.tolist(), first.ends.tolist())])
    assert sorted(covered.tolist()) == sorted(indices.tolist())
    sizes = (first.ends - first.starts).tolist()
    assert max(sizes) == BATCH and min(sizes) > 0
    if dynamic:
        assert torch.equal(first.indices, indices) and sizes == [BATCH] * 15
        return
    for k in range(first.num_batches):  # one relation per batch, the one the plan names
        batch_rels = edges.rel[first.indices[first.starts[k]:first.ends[k]]]
        assert bool((batch_rels == first.relations[k]).all())
    # the relation is drawn per batch (proportional to edges left), so another seed orders the batches otherwise
    assert not torch.equal(first.relations, other.relations)


def _shared(indices: torch.Tensor, seed: int) -> SharedSlice:
    return SharedSlice.allocate(indices, seed, BATCH, 3).with_lock(threading.Lock())


def test_a_shared_slice_hands_each_batch_out_once_from_both_ends() -> None:
    shared = _shared(torch.arange(10), 0)
    taken: dict[str, list[int]] = {"front": [], "back": []}

    def take(side: str) -> None:
        taken[side].extend(shared.claims(5_000, side == "back"))

    threads = [threading.Thread(target=take, args=(side,)) for side in ("front", "back")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    front, back = taken["front"], taken["back"]
    assert sorted(front + back) == list(range(5_000))
    assert front == list(range(len(front))) and back == list(range(4_999, 4_999 - len(back), -1))
    assert shared.claim(5_000, False) is None


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_published_plan_is_the_owners_and_an_unpublished_one_is_planned_alike(dynamic: bool) -> None:
    edges = _edges()
    indices = torch.randperm(NUM_EDGES, generator=torch.Generator().manual_seed(3))[:1_234]
    shared = _shared(indices, 5)
    owners = plan_batches(edges.rel, indices, BATCH, dynamic, torch.Generator().manual_seed(5))
    unpublished = shared.plan(edges.rel, BATCH, dynamic)
    assert not shared.exhausted()  # nothing published yet: nobody may think the slice is done
    shared.publish(owners)
    published = shared.plan(edges.rel, BATCH, dynamic)
    for plan in (unpublished, published):
        for name in ("indices", "relations", "starts", "ends"):
            assert torch.equal(getattr(plan, name), getattr(owners, name)), name
    assert list(shared.claims(owners.num_batches, True)) == list(range(owners.num_batches - 1, -1, -1))
    assert shared.exhausted()


@pytest.fixture
def trained_lhs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every edge a batch trains (by its lhs), in this process; the batch itself is not run."""
    seen: list[int] = []

    def record(ctx: Any, rel_idx: int, lhs: torch.Tensor, *args: Any, **kwargs: Any) -> BatchStats:
        seen.extend(lhs.tolist())
        return BatchStats(count=int(lhs.numel()))

    monkeypatch.setattr(batching, "run_batch", record)
    return seen


def _tasks(edges: EdgeTensors, delay: float) -> tuple[dict[str, Any], dict[str, Any], SharedSlice]:
    """The two tasks of a bucket as ``WorkerPool.run`` makes them: the first takes from the second, delayed."""
    own, delayed = (torch.arange(NUM_EDGES)[s] for s in split_almost_equally(NUM_EDGES, 2))
    shared = SharedSlice.allocate(delayed, 2, BATCH, 3)
    common = {"edges": edges, "train": True}
    return ({**common, "indices": own, "seed": 1, "delay": 0.0, "shared": None, "steal": [shared]},
            {**common, "indices": delayed, "seed": 2, "delay": delay, "shared": shared, "steal": []}, shared)


def _ctx() -> BatchContext:
    return BatchContext(parse_config(base_config(Path("/tmp"), {"e": 1}, [("r", "e", "e")], batch_size=BATCH)),
                        None, None, {}, {}, 0, 0)  # type: ignore[arg-type]  # run_batch is recorded, not run


@pytest.mark.timeout(120)  # the delay is 600 s: only the owner seeing its batches taken ends the wait early
def test_the_undelayed_worker_takes_a_delayed_slice_and_its_owner_stops_waiting(trained_lhs: list[int]) -> None:
    first, delayed, _ = _tasks(_edges(), delay=600.0)
    lock = threading.Lock()
    assert hogwild._run_task(_ctx(), first, lock).count == NUM_EDGES
    assert sorted(trained_lhs) == list(range(NUM_EDGES))
    assert hogwild._run_task(_ctx(), delayed, lock).count == 0
    assert len(trained_lhs) == NUM_EDGES


def test_batches_the_owner_took_are_not_taken_again(trained_lhs: list[int]) -> None:
    """The owner planned, published and ran its first 3 batches; the other worker takes exactly the rest."""
    edges = _edges()
    first, _, shared = _tasks(edges, delay=0.0)
    plan = plan_batches(edges.rel, shared.indices, BATCH, False, torch.Generator().manual_seed(2))
    shared.with_lock(threading.Lock()).publish(plan)
    shared.counters[0] = 3
    owner_took = torch.cat([plan.indices[s:e] for s, e in zip(plan.starts[:3].tolist(), plan.ends[:3].tolist())])
    stats = hogwild._run_task(_ctx(), first, threading.Lock())
    assert stats.count == NUM_EDGES - owner_took.numel()
    assert sorted(trained_lhs + owner_took.tolist()) == list(range(NUM_EDGES))


@pytest.mark.timeout(120)
def test_both_workers_at_once_train_every_edge_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The owner (a short delay) and the other worker in two threads, batches slow enough to meet midway."""
    seen: list[tuple[str, int]] = []

    def record(ctx: Any, rel_idx: int, lhs: torch.Tensor, *args: Any, **kwargs: Any) -> BatchStats:
        time.sleep(0.002)
        seen.extend((threading.current_thread().name, int(i)) for i in lhs)
        return BatchStats(count=int(lhs.numel()))

    monkeypatch.setattr(batching, "run_batch", record)
    first, delayed, _ = _tasks(_edges(), delay=0.01)
    lock = threading.Lock()
    threads = [threading.Thread(target=hogwild._run_task, args=(_ctx(), task, lock), name=name)
               for task, name in ((first, "first"), (delayed, "owner"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(i for _, i in seen) == list(range(NUM_EDGES))
    delayed_ids = set(delayed["indices"].tolist())
    by_first = {i for name, i in seen if name == "first"} & delayed_ids
    by_owner = {i for name, i in seen if name == "owner"}
    assert by_first and by_owner  # both took part of the delayed slice
    assert by_owner <= delayed_ids


@pytest.mark.slow
@pytest.mark.timeout(300)  # a 600 s delay: the run ends early only if the first worker takes the batches
def test_a_real_pool_trains_every_edge_once_without_sitting_out_the_delay(tmp_path: Path) -> None:
    config = parse_config(base_config(tmp_path, {"e": 1}, [(f"r{i}", "e", "e") for i in range(3)], batch_size=BATCH))
    model = Model(config)
    optimizer = RelationAdagrad(list(model.parameters()), config.lr)
    table = Table(torch.randn(NUM_EDGES, 4).share_memory_(), torch.zeros(NUM_EDGES).share_memory_())
    before = table.weight.clone()
    edges = _edges().share_memory_()  # three relations: the plan draws from the seed, so seeds must match
    slices = [torch.arange(NUM_EDGES)[s] for s in split_almost_equally(NUM_EDGES, 2)]
    pool = WorkerPool(2, config, model, optimizer, KernelOptions())
    try:
        tables = {r: table for r in range(3)}
        stats = pool.run(edges, slices, tables, tables, seeds=[1, 2], train=True, num_batch_negs=config.num_batch_negs,
                         num_uniform_negs=config.num_uniform_negs, delays=[0.0, 600.0])
    finally:
        pool.close()
    assert stats.count == NUM_EDGES
    assert not torch.equal(table.weight, before)  # the workers trained the shared table
