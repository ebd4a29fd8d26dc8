"""Buckets and partitions in training: bucket orders, the local scheduler, the pass summary and its partition
traffic, a partition buffer that is never exceeded, prefetching that changes only when partitions are read."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest
import torch

from job.config import BucketOrder, parse_config
from job.formats.checkpoint import CheckpointStorage
from job.train import Trainer, train
from job.train.schedule.orders import (
    Bucket,
    all_buckets,
    lower_bound_loads,
    order_buckets,
    swaps_needed,
)

sys.path.insert(0, str(Path(__file__).parent))
from helpers_graphs import assert_same_run, write_cycle_graph  # noqa: E402

# buckets --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("order", list(BucketOrder))
@pytest.mark.parametrize("shape", [(1, 1), (4, 4), (3, 1), (1, 3), (5, 5)])
def test_every_bucket_exactly_once(order: BucketOrder, shape: tuple[int, int]) -> None:
    for seed in range(5):
        buckets = order_buckets(*shape, order, random.Random(seed))
        assert sorted(buckets) == sorted(all_buckets(*shape))


def test_inside_out_and_outside_in_layers() -> None:
    for seed in range(5):
        inside_out = order_buckets(5, 5, BucketOrder.INSIDE_OUT, random.Random(seed))
        layers = [min(b) for b in inside_out]
        assert layers == sorted(layers, reverse=True)
        outside_in = order_buckets(5, 5, BucketOrder.OUTSIDE_IN, random.Random(seed))
        layers = [min(b) for b in outside_in]
        assert layers == sorted(layers)
        # a bucket and its transpose are adjacent
        for i, bucket in enumerate(outside_in):
            if bucket.lhs != bucket.rhs:
                neighbours = outside_in[max(0, i - 1):i + 2]
                assert Bucket(bucket.rhs, bucket.lhs) in neighbours


def test_affinity_needs_fewer_swaps_than_random() -> None:
    affinity = sum(swaps_needed(order_buckets(8, 8, BucketOrder.AFFINITY, random.Random(s))) for s in range(10))
    rand = sum(swaps_needed(order_buckets(8, 8, BucketOrder.RANDOM, random.Random(s))) for s in range(10))
    assert affinity < rand
    for seed in range(5):
        order = order_buckets(6, 6, BucketOrder.AFFINITY, random.Random(seed))
        shared = sum(1 for a, b in zip(order, order[1:]) if {a.lhs, a.rhs} & {b.lhs, b.rhs})
        assert shared >= 0.8 * (len(order) - 1)  # nearly every step keeps a partition


def test_local_scheduler_walks_its_order_offers_the_rest_for_prefetch_and_keeps_every_record() -> None:
    from job.train.schedule.interfaces import LocalScheduler

    order = [Bucket(0, 0), Bucket(1, 0), Bucket(0, 1), Bucket(1, 1)]
    scheduler = LocalScheduler(lambda rng: list(order), lambda b: {("n", b.lhs), ("n", b.rhs)})
    scheduler.start_pass(0, 1, 0)
    trained: list[Bucket] = []
    record = None
    while (bucket := scheduler.next_bucket(record)) is not None:
        following, needs = scheduler.upcoming()
        assert list(following) == order[len(trained) + 1:]
        assert list(needs) == [{("n", b.lhs), ("n", b.rhs)} for b in following]
        trained.append(bucket)
        record = {"bucket": list(bucket)}
    assert trained == order
    gathered = scheduler.gather({})
    assert gathered is not None and [r["bucket"] for r in gathered.records] == [list(b) for b in order]
    assert (gathered.world_size, gathered.buckets_redone, gathered.others_io) == (1, 0, [])


def test_a_single_process_run_writes_the_stats_shape_of_a_distributed_one(tmp_path: Path) -> None:
    from test_distributed import PASS_SUMMARY_KEYS

    raw = write_cycle_graph(tmp_path, num_entities=80, num_partitions=2, num_epochs=1, eval_fraction=0.2)
    train(parse_config(raw))
    records = CheckpointStorage(raw["checkpoint_path"]).load_stats()
    buckets = [r for r in records if "lhs_partition" in r]
    (summary,) = [r for r in records if r.get("pass_summary")]
    assert {r["rank"] for r in buckets} == {0}
    assert set(summary) - {"partition_loads_lower_bound"} == PASS_SUMMARY_KEYS | {"eval_stats_after"}
    assert (summary["world_size"], summary["restart_count"], summary["buckets_redone"]) == (1, 0, 0)
    assert summary["buckets_trained"] == len(buckets) == 4
    evaluated = [r["eval_stats_after"] for r in buckets]
    assert summary["eval_stats_after"]["count"] == sum(e["count"] for e in evaluated)
    mrr = sum(e["metrics"]["mrr"] * e["count"] for e in evaluated) / sum(e["count"] for e in evaluated)
    assert summary["eval_stats_after"]["metrics"]["mrr"] == pytest.approx(mrr)


def test_buffer_run_reports_its_partition_traffic(tmp_path: Path) -> None:
    raw = write_cycle_graph(tmp_path, num_entities=90, num_partitions=6, num_epochs=2, bucket_order="buffer",
                            partition_buffer=3)
    train(parse_config(raw))
    summaries = [s for s in CheckpointStorage(raw["checkpoint_path"]).load_stats() if s.get("pass_summary")]
    assert len(summaries) == 2
    first = summaries[0]
    # the buffer order takes the fewest loads there are on this grid (tests/test_bucket_order.py)
    assert first["partition_loads"] == first["partition_loads_lower_bound"] == lower_bound_loads(6, 3) == 9
    # the first pass initialises each partition on first use; it reads back only those it evicted and needs again
    assert first["partition_reads"] == first["partition_loads"] - 6
    assert first["partition_writes"] >= 6 and first["bytes_written"] > 0
    second = summaries[1]  # starts with 3 partitions in memory, reads the rest of the committed version
    assert second["partition_reads"] == second["partition_loads"] > 0
    assert second["partition_loads"] == second["partition_loads_lower_bound"] == lower_bound_loads(6, 3, resident=3) == 6
    assert second["io_blocked_seconds"] >= 0 and second["commit_seconds"] > 0


# partitions and prefetching -------------------------------------------------------------------------------


@pytest.mark.parametrize("buffer,prefetch", [(2, False), (3, True), (4, True)])
def test_partitioned_training_stays_within_its_buffer_and_writes_every_partition(
    tmp_path: Path, monkeypatch, buffer: int, prefetch: bool
) -> None:
    raw = write_cycle_graph(tmp_path, num_entities=60, num_partitions=4, num_epochs=2, bucket_order="affinity",
                            partition_buffer=buffer, prefetch_partitions=prefetch)
    config = parse_config(raw)
    trainer = Trainer(config)
    resident: list[int] = []
    store = trainer.store
    original_hold, original_prepare = store.hold, store.prepare

    def held() -> int:  # in memory or being read into it (a write-back frees its slot before the read starts)
        return len(store.loaded) + len(store.pending)

    def spy_hold(keys: set, upcoming=()):
        evicted = original_hold(keys, upcoming)
        resident.append(held())
        return evicted

    def spy_prepare(*args):
        original_prepare(*args)
        resident.append(held())

    monkeypatch.setattr(store, "hold", spy_hold)
    monkeypatch.setattr(store, "prepare", spy_prepare)
    try:
        trainer.run()
    finally:
        trainer.close()
    assert len(resident) >= 2 * 16  # every bucket of both epochs
    assert max(resident) <= buffer
    if prefetch:
        assert store.prefetched_reads > 0  # the pipeline did read ahead
    stats = CheckpointStorage(config.checkpoint_path).load_stats()
    per_epoch = {}
    for record in stats:
        if "lhs_partition" in record:
            per_epoch.setdefault(record["epoch_idx"], []).append((record["lhs_partition"], record["rhs_partition"]))
    assert {e: sorted(b) for e, b in per_epoch.items()} == {e: sorted(all_buckets(4, 4)) for e in (0, 1)}
    summaries = [record for record in stats if record.get("pass_summary")]
    behind = [s["partition_writes_background"] for s in summaries]
    assert all(0 <= b <= s["partition_writes"] for b, s in zip(behind, summaries))
    # evictions are written while a bucket trains when prefetching; a buffer of all 4 partitions evicts none
    assert (sum(behind) > 0) == (prefetch and buffer < 4)
    storage = CheckpointStorage(config.checkpoint_path)
    assert storage.load_version() == 2
    names = sorted(p.name for p in Path(config.checkpoint_path).iterdir())
    assert names == sorted(
        [f"embeddings_node_{p}.v2.h5" for p in range(4)] + ["model.v2.h5", "checkpoint_version.txt", "config.json",
                                                             "training_stats.json", "checksums.v2.json",
                                                             "input_check.json"]  # kept for the next start
    )


def test_prefetching_partitions_changes_nothing_but_when_they_are_read(tmp_path: Path) -> None:
    runs = {}
    for prefetch in (False, True):
        raw = write_cycle_graph(tmp_path / str(prefetch), num_partitions=4, num_epochs=3, prefetch_partitions=prefetch,
                                bucket_order="random")
        config = parse_config(raw)
        trainer = Trainer(config)
        try:
            trainer.run()
            runs[prefetch] = trainer.store.prefetched_reads
        finally:
            trainer.close()
    assert runs[False] == 0 and runs[True] > 0, runs
    a = CheckpointStorage(str(tmp_path / "False" / "checkpoints"))
    b = CheckpointStorage(str(tmp_path / "True" / "checkpoints"))
    for part in range(4):
        emb_a, state_a = a.load_entity_partition(3, "node", part)
        emb_b, state_b = b.load_entity_partition(3, "node", part)
        assert_same_run(emb_a, emb_b)
        torch.testing.assert_close(state_a["state"][0]["sum"], state_b["state"][0]["sum"])


def test_a_failed_prefetch_fails_the_run_when_its_partition_is_needed(tmp_path: Path, monkeypatch) -> None:
    from job.train.residency.partitions import PartitionStore

    raw = write_cycle_graph(tmp_path, num_partitions=3, num_epochs=1, prefetch_partitions=True)
    read = PartitionStore._read

    def failing_read(self, key):
        import threading

        if threading.current_thread().name.startswith("biggraph-prefetch"):
            raise OSError(f"simulated read failure of {key}")
        return read(self, key)

    monkeypatch.setattr(PartitionStore, "_read", failing_read)
    with pytest.raises(OSError, match="simulated read failure"):
        train(parse_config(raw))
    assert CheckpointStorage(raw["checkpoint_path"]).load_version() == 0  # nothing committed, nothing half-written


# write groups behind a bucket (distributed trainers: job/checkpoint/write_groups.py) ------------------------------


def slow_store(tmp_path: Path, monkeypatch, fail: bool = False):
    """A trainer over a 3-partition graph whose store is exclusive (as a distributed trainer's) and whose writes
    take 0.3 s (or fail), so that a test can see what happens while one is under way."""
    import time

    from job.train.residency.partitions import PartitionStore, Residency

    raw = write_cycle_graph(tmp_path, num_partitions=3, num_epochs=1, prefetch_partitions=True)
    save = PartitionStore._save

    def slow_save(self, key, table, name=None, after=None):
        time.sleep(0.3)
        if fail:
            raise OSError(f"simulated write failure of {key}")
        save(self, key, table, name, after=after)

    monkeypatch.setattr(PartitionStore, "_save", slow_save)
    trainer = Trainer(parse_config(raw))
    # a distributed trainer's store: what it holds is locked from the others
    trainer.store = PartitionStore(trainer.config, trainer.checkpoint, trainer.version, trainer.entity_counts,
                                   trainer.checkpoints.metadata, trainer.device, Residency(capacity=3, exclusive=True))
    return trainer


def test_a_write_group_behind_stages_the_leaving_and_kept_partitions_then_publishes_them(tmp_path: Path,
                                                                                         monkeypatch) -> None:
    """The partition leaving and the one kept are written as one group, under staged names only until the commit
    callback (the server's record) publishes them; the kept one is written as it was at the switch, not as the next
    bucket changes it meanwhile; the leaving one reads back from the version just written."""
    trainer = slow_store(tmp_path, monkeypatch)
    store, leaving, kept = trainer.store, ("node", 0), ("node", 1)
    checkpoint = store.checkpoint
    try:
        store.get(leaving).weight.fill_(7.0)
        store.get(kept).weight.fill_(3.0)
        seen: list = []

        def commit(group) -> None:
            seen.append((group.leaving, group.keys, [checkpoint.has_entity_partition(group.version, *k)
                                                     for k in group.keys]))
            store.publish(group)

        released, future = store.write_group({kept, ("node", 2)}, commit, behind=True)
        assert released == [leaving] and future is not None
        store.get(kept).weight.fill_(5.0)  # the next bucket trains on the kept partition while the group is written
        future.result(timeout=30)
        assert seen == [([leaving], [leaving, kept], [False, False])]  # staged names only before the commit
        assert store.stats.written_behind == 2 and {leaving, kept} <= store.written
        weights, _ = checkpoint.load_entity_partition(store.next_version, *kept)
        assert (weights == 3.0).all()  # the copy taken at the switch
        assert bool((store.get(leaving).weight == 7.0).all())  # read back from the version just written
        assert not [n for n in os.listdir(trainer.config.checkpoint_path) if n.startswith(".tmp-")]
    finally:
        trainer.close()


def test_a_failed_write_group_commits_nothing_and_raises(tmp_path: Path, monkeypatch) -> None:
    trainer = slow_store(tmp_path, monkeypatch, fail=True)
    store, key = trainer.store, ("node", 0)
    try:
        store.get(key)
        committed: list = []
        _, future = store.write_group(set(), committed.append, behind=True)
        assert future is not None
        with pytest.raises(OSError, match="simulated write failure"):
            future.result(timeout=30)
        assert committed == [] and not store.checkpoint.has_entity_partition(store.next_version, *key)
    finally:
        store.writing.clear()
        trainer.close()


def test_a_switch_that_lets_nothing_go_writes_nothing(tmp_path: Path, monkeypatch) -> None:
    """Every row of the finished bucket stays in memory: a redo would read files without its update already."""
    trainer = slow_store(tmp_path, monkeypatch)
    store = trainer.store
    try:
        store.get(("node", 0))
        store.get(("node", 1))
        assert store.write_group({("node", 0), ("node", 1)}, store.publish, behind=True) == ([], None)
        assert store.stats.writes == 0 and not store.writing
    finally:
        trainer.close()


def test_a_distributed_store_reads_in_the_foreground_only_after_its_writes_behind(tmp_path: Path,
                                                                                  monkeypatch) -> None:
    """The tables being written still take room: a read that was not prefetched waits for them, so the buffer
    (loaded + being written) is never exceeded."""
    trainer = slow_store(tmp_path, monkeypatch)
    store = trainer.store
    try:
        store.get(("node", 0))
        store.get(("node", 1))
        store.write_group(set(), store.publish, behind=True)
        assert len(store.writing) == 2
        store.get(("node", 2))
        assert not store.writing and list(store.loaded) == [("node", 2)]
    finally:
        trainer.close()
