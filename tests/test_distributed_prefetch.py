"""Distributed prefetch: the lock server reserves a trainer's next bucket early (``LockState.reserve``) so that
the trainer reads its partitions while the current bucket trains; the rules, and a real 2-rank torchrun run."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Optional

import pytest
from helpers_distributed import (
    Agents,
    assert_each_bucket_once_per_epoch,
    bucket_records,
    filtered_mrr,
    partition_keys,
    transports,
    write_run_config,
)

from job.train.distributed.lock_state import LockState
from job.train.schedule.orders import all_buckets
from job.types import Bucket

Key = tuple[str, int]

def start(state: LockState, rank: int, bucket: Bucket) -> None:
    """Hand ``bucket`` to ``rank`` as the server would (the tests choose which)."""
    state.in_flight[rank] = bucket
    for key in state.bucket_keys[bucket]:
        state.locks[key] = rank


# the rules -------------------------------------------------------------------------------------------


def test_a_reserved_bucket_is_locked_for_its_rank_and_becomes_its_next_one() -> None:
    state = LockState(4, 4, partition_keys(4), world_size=2)
    rng = random.Random(0)
    _, current = state.next_bucket(0, set(), None, rng)
    assert current is not None
    ahead = state.reserve(0, rng)
    assert ahead is not None and ahead != current and ahead not in state.done
    assert all(state.locks[key] == 0 for key in state.bucket_keys[ahead])
    assert state.reserve(0, rng) == ahead  # one reservation at a time: asking again gives the same
    # another rank can take neither the reserved bucket nor any bucket needing its partitions
    kind, other = state.next_bucket(1, set(), None, rng)
    if kind == "bucket":
        assert other not in (current, ahead)
        assert not state.bucket_keys[other] & (state.bucket_keys[ahead] | state.bucket_keys[current])
    # finishing the current bucket hands out the reserved one, whatever this rank holds
    kind, nxt = state.next_bucket(0, set(), current, rng)
    assert (kind, nxt) == ("bucket", ahead)
    assert current in state.done and state.in_flight[0] == ahead and 0 not in state.reserved


def test_the_reservation_prefers_the_bucket_needing_the_fewest_new_partitions() -> None:
    for seed in range(20):
        state = LockState(6, 6, partition_keys(6), world_size=2)
        start(state, 0, Bucket(1, 2))
        start(state, 1, Bucket(4, 4))
        ahead = state.reserve(0, random.Random(seed))
        assert ahead in {Bucket(1, 1), Bucket(2, 2), Bucket(2, 1)}  # no new partition: costs nobody anything
    state.done |= {Bucket(1, 1), Bucket(2, 2), Bucket(2, 1)}
    state.reserved.clear()
    ahead = state.reserve(0, random.Random(0))
    assert ahead is not None and len({ahead.lhs, ahead.rhs} & {1, 2}) == 1  # then one new partition
    assert 4 not in (ahead.lhs, ahead.rhs)  # never one another rank holds


def test_partitions_being_written_back_count_as_new_for_the_reservation() -> None:
    """Rank 0 trains (1, 2) and still holds partition 3's lock while it writes 3 back in the background: the
    reservation must weigh 3 as a partition to read again (cost 1), not as one held (cost 0)."""
    picks: dict[bool, set[Bucket]] = {True: set(), False: set()}
    for seed in range(30):
        for leaving in (True, False):
            state = LockState(6, 6, partition_keys(6), world_size=2)
            start(state, 0, Bucket(1, 2))
            state.locks[("node", 3)] = 0
            start(state, 1, Bucket(5, 5))
            ahead = state.reserve(0, random.Random(seed), frozenset({("node", 3)}) if leaving else frozenset())
            assert ahead is not None
            picks[leaving].add(ahead)
    assert picks[True] <= {Bucket(1, 1), Bucket(2, 2), Bucket(2, 1)}
    assert any(3 in (b.lhs, b.rhs) for b in picks[False])  # held, 3 costs nothing: some seed takes it


def test_a_ranks_writer_thread_releases_through_its_own_channel_while_the_main_thread_asks() -> None:
    """Real TCPStore and lock server: rank 0's main client asks for buckets while its writer client (another
    thread, channel "/writer") releases partitions; each gets its own replies, and the releases land."""
    import threading
    from datetime import timedelta
    from types import SimpleNamespace

    import numpy as np
    from torch.distributed import TCPStore

    from job.train.distributed.lock_client import LockClient
    from job.train.distributed.lock_server import LockServer

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    state = LockState(6, 6, partition_keys(6), world_size=1)
    transport = transports(store, 1)[0]
    server = LockServer(store, state, SimpleNamespace(append=lambda records: None), np.zeros(1, np.float32), 0,
                        transport)
    main, writer = LockClient(store, 0, timeout_s=10), LockClient(store, 0, timeout_s=10, channel="/writer")
    errors: list[BaseException] = []

    def release_all() -> None:
        try:
            for part in range(6):
                writer.release([("node", part)])
        except BaseException as error:  # noqa: BLE001 - reported by the assertion below
            errors.append(error)

    try:
        kind, first, _ = main.next_bucket(set(), None, None)
        thread = threading.Thread(target=release_all)
        thread.start()
        buckets = [first]
        for _ in range(10):
            kind, bucket, _ = main.next_bucket(set(), buckets[-1], None)
            assert kind == "bucket" and bucket is not None  # a bucket reply, never the writer's release reply
            buckets.append(bucket)
        thread.join(timeout=30)
        assert not errors and not thread.is_alive()
        assert len(set(buckets)) == len(buckets)
        assert {("node", p) for p in range(6)} <= state.dirty  # every release of the writer reached the server
    finally:
        server.stop()


def test_no_reservation_takes_the_last_partitions_another_rank_could_use() -> None:
    """P=4, two ranks: rank 0 trains (0, 1), rank 1 trains (2, 2); the buckets within {0, 1} are done. Any next
    bucket for rank 0 needs partition 3, and every bucket left to rank 1 needs 3 or rank 0's partitions:
    reserving would make rank 1 wait, so nothing is reserved (rank 0 asks the usual way later)."""
    state = LockState(4, 4, partition_keys(4), world_size=2)
    state.done |= {Bucket(0, 0), Bucket(1, 1), Bucket(1, 0)}
    start(state, 0, Bucket(0, 1))
    start(state, 1, Bucket(2, 2))
    assert state.reserve(0, random.Random(0)) is None
    assert ("node", 3) not in state.locks
    # alone in the group, the same reservation starves nobody and is granted
    state.world_size = 1
    assert state.reserve(0, random.Random(0)) is not None
    # and with room for both (P=6), a new partition may be taken
    state = LockState(6, 6, partition_keys(6), world_size=2)
    state.done |= {Bucket(0, 0), Bucket(1, 1), Bucket(1, 0)}
    start(state, 0, Bucket(0, 1))
    start(state, 1, Bucket(2, 2))
    ahead = state.reserve(0, random.Random(0))
    assert ahead is not None and 2 not in (ahead.lhs, ahead.rhs)


def test_releasing_partitions_keeps_those_of_the_current_and_reserved_bucket() -> None:
    state = LockState(6, 6, partition_keys(6), world_size=2)
    start(state, 0, Bucket(1, 1))
    state.reserved[0] = Bucket(1, 3)
    state.locks[("node", 3)] = 0
    state.locks[("node", 5)] = 0  # left over from an earlier bucket
    state.release(0, [("node", 1), ("node", 3), ("node", 5)])
    assert state.locks == {("node", 1): 0, ("node", 3): 0}


def test_a_dead_ranks_reservation_goes_back_to_the_queue_not_counted_as_redone() -> None:
    keys = partition_keys(4)
    state = LockState(4, 4, keys, version=2, world_size=2)
    rng = random.Random(0)
    _, a = state.next_bucket(0, set(), None, rng)
    ahead = state.reserve(0, rng)
    assert a is not None and ahead is not None
    saved = json.loads(json.dumps(state.to_json()))  # what the new rank 0 reads after the group restarts
    assert saved["reserved"] == {"0": list(ahead)}
    restored = LockState(4, 4, keys, version=2, world_size=1)
    restored.restore(saved)
    restored.forget_rank_locks()
    assert not restored.reserved and not restored.locks and not restored.in_flight
    assert restored.redone == 1  # a, in flight; the reservation was never started
    assert ahead not in restored.done
    # the survivor trains everything left, each bucket once
    handed = drive(restored, ranks=[0], rng=rng, reserve=True)
    assert sorted(handed) == sorted(all_buckets(4, 4))  # a redone, the reserved bucket trained once


# a whole pass, ranks interleaved at random ---------------------------------------------------------


class SimRank:
    """What a trainer does with the server: ask, write back what the new bucket does not use, reserve, read ahead."""

    def __init__(self) -> None:
        self.current: Optional[Bucket] = None
        self.resident: set[Key] = set()
        self.read_ahead: set[Key] = set()
        self.finished = False


def step(state: LockState, rank: int, sim: SimRank, rng: random.Random, reserve: bool) -> Optional[Bucket]:
    kind, bucket = state.next_bucket(rank, sim.resident, sim.current, rng)
    sim.current = None
    if kind != "bucket" or bucket is None:
        state.release(rank, sorted(sim.resident))
        sim.resident = set()
        sim.finished = kind == "done"
        return None
    assert not sim.read_ahead or sim.read_ahead <= state.bucket_keys[bucket]  # the read-ahead was for this one
    needed = state.bucket_keys[bucket]
    state.release(rank, sorted(sim.resident - needed))
    sim.resident = set(needed)
    sim.read_ahead = set()
    sim.current = bucket
    if reserve:
        ahead = state.reserve(rank, rng)
        if ahead is not None:
            sim.read_ahead = set(state.bucket_keys[ahead]) - needed
    return bucket


def check_locks(state: LockState, sims: dict[int, SimRank]) -> None:
    """Every partition a rank has in memory or reads ahead is locked for that rank: one rank at a time."""
    for rank, sim in sims.items():
        for key in sim.resident | sim.read_ahead:
            assert state.locks.get(key) == rank, (rank, key, state.locks)


def drive(state: LockState, ranks: list[int], rng: random.Random, reserve: bool, steps: int = 10_000
          ) -> list[Bucket]:
    sims = {rank: SimRank() for rank in ranks}
    handed = []
    for _ in range(steps):
        active = [r for r, s in sims.items() if not s.finished]
        if not active:
            return handed
        rank = rng.choice(active)
        bucket = step(state, rank, sims[rank], rng, reserve)
        if bucket is not None:
            handed.append(bucket)
        check_locks(state, sims)
    raise AssertionError(f"the pass never finished: {state.to_json()}")


@pytest.mark.parametrize("nparts,world", [(4, 2), (4, 3), (6, 2), (6, 4), (8, 3)])
def test_every_bucket_once_per_pass_with_reservations_and_nobody_starves(nparts: int, world: int) -> None:
    for seed in range(10):
        state = LockState(nparts, nparts, partition_keys(nparts), tree_init_order=seed % 2 == 0, world_size=world)
        rng = random.Random(seed)
        handed = drive(state, list(range(world)), rng, reserve=True)
        assert sorted(handed) == sorted(all_buckets(nparts, nparts))  # each exactly once
        assert state.finished() and not state.reserved and not state.locks


def test_reservations_happen_and_some_need_a_partition_read_ahead() -> None:
    """The simulation above is not vacuous: ranks do get buckets early, some with a partition to read."""
    granted = needing_a_read = 0
    for seed in range(10):
        state = LockState(6, 6, partition_keys(6), world_size=2)
        rng = random.Random(seed)
        sims = {0: SimRank(), 1: SimRank()}
        while not all(s.finished for s in sims.values()):
            rank = rng.choice([r for r, s in sims.items() if not s.finished])
            step(state, rank, sims[rank], rng, reserve=True)
            granted += rank in state.reserved and sims[rank].current is not None
            needing_a_read += bool(sims[rank].read_ahead)
            check_locks(state, sims)
    assert granted > 50 and needing_a_read > 10, (granted, needing_a_read)


def test_a_rank_dying_mid_pass_with_a_reservation_every_bucket_still_trained() -> None:
    keys = partition_keys(6)
    for seed in range(10):
        rng = random.Random(seed)
        state = LockState(6, 6, keys, version=1, world_size=3)
        sims = {rank: SimRank() for rank in range(3)}
        before: list[Bucket] = []
        for _ in range(15):
            rank = rng.randrange(3)
            if not sims[rank].finished and (bucket := step(state, rank, sims[rank], rng, reserve=True)):
                before.append(bucket)
        restored = LockState(6, 6, keys, version=1, world_size=2)
        restored.restore(json.loads(json.dumps(state.to_json())))
        restored.forget_rank_locks()
        assert not restored.reserved and not restored.locks
        survived = set(restored.done)
        after = drive(restored, [0, 1], rng, reserve=True)
        assert restored.finished()
        # after the restart exactly the buckets not safely done before it are trained, each once
        assert sorted(after) == sorted(set(all_buckets(6, 6)) - survived)


# real torchrun agents --------------------------------------------------------------------------------


def partition_sizes(config_path: Path) -> list[int]:
    """Bytes a read or write of each partition counts: float32 embeddings + the row-wise Adagrad sums."""
    from job.config import load_config
    from job.train.inputs import read_entity_counts

    config = load_config(str(config_path))
    return [count * (config.dimension + 1) * 4 for count in read_entity_counts(config)["all"]]


def check_io_stats(summary: dict, sizes: list[int]) -> None:
    """A pass's partition I/O adds up: every read or write moved one whole partition."""
    reads, writes = summary["partition_reads"], summary["partition_writes"]
    assert 0 <= summary["partition_loads_prefetched"] <= summary["partition_loads"]
    assert 0 <= summary["partition_writes_background"] <= summary["partition_writes"]
    assert reads <= summary["partition_loads"] and writes > 0
    assert min(sizes) * reads <= summary["bytes_read"] <= max(sizes) * reads
    assert min(sizes) * writes <= summary["bytes_written"] <= max(sizes) * writes
    assert summary["io_blocked_seconds"] >= 0 and summary["commit_seconds"] >= 0


def check_checkpoint(checkpoint_path: str, version: int) -> None:
    """The committed version is whole: every partition reads back (verified against its manifest), finite."""
    import numpy as np

    from job.formats.committed import open_committed

    committed = open_committed(checkpoint_path)
    assert committed.version == version
    for part in range(4):
        array, _ = committed.checkpoint.load_entity_partition(version, "all", part)
        assert array.shape[1] == 64 and np.isfinite(array).all()


@pytest.mark.slow
def test_two_ranks_read_reserved_partitions_ahead_and_train_as_without(umls_p4: dict, tmp_path: Path) -> None:
    """2 torchrun agents on loopback, P=4: with prefetch_partitions the ranks read partitions of their reserved
    next buckets in the background (the pass stats count them), and the run trains every bucket once per epoch
    and ends as the run without prefetch does (checkpoint whole, MRR alike)."""
    epochs = 6
    runs: dict[bool, tuple[list[dict], float]] = {}
    logs: dict[bool, str] = {}
    for prefetch in (True, False):
        path = write_run_config(umls_p4, f"prefetch-{prefetch}", num_epochs=epochs, prefetch_partitions=prefetch)
        log_dir = tmp_path / f"prefetch-{prefetch}"
        log_dir.mkdir()
        agents = Agents(path, "2", log_dir)
        codes = agents.run(["a", "b"], timeout=300)
        assert codes == {"a": 0, "b": 0}, agents.tail()
        logs[prefetch] = agents.text()
        checkpoint_path = json.loads(path.read_text())["checkpoint_path"]
        records = bucket_records(checkpoint_path)
        assert_each_bucket_once_per_epoch(records, epochs)
        assert {r["rank"] for r in records if "rank" in r} == {0, 1}
        summaries = [r for r in records if r.get("pass_summary")]
        assert len(summaries) == epochs and all(s["world_size"] == 2 and s["buckets_redone"] == 0 for s in summaries)
        sizes = partition_sizes(path)
        for summary in summaries:
            check_io_stats(summary, sizes)
        check_checkpoint(checkpoint_path, epochs)
        runs[prefetch] = (summaries, filtered_mrr(umls_p4, path))
    (with_prefetch, mrr_on), (without, mrr_off) = runs[True], runs[False]
    assert sum(s["partition_loads_prefetched"] for s in with_prefetch) > 0, logs[True][-3000:]
    assert all(s["partition_loads_prefetched"] == 0 for s in without)
    # evictions at a bucket's start are written while it trains (released once stored); without prefetch, PBG's way
    assert sum(s["partition_writes_background"] for s in with_prefetch) > 0, logs[True][-3000:]
    assert all(s["partition_writes_background"] == 0 for s in without)
    assert "partition buffer: 3 of 4 partitions" in logs[True], logs[True][-3000:]  # read-ahead within the buffer
    assert mrr_on == pytest.approx(mrr_off, abs=0.06), (mrr_on, mrr_off)


@pytest.mark.slow
def test_two_ranks_hand_partitions_over_in_memory_and_still_train_each_bucket_once(umls_p4: dict,
                                                                                  tmp_path: Path) -> None:
    """2 torchrun agents on loopback, P=4, partition_handoff (job/train/distributed/handoff.py): partitions that change
    hands come from the memory of the rank that published them (the other's, over TCP, or its own) instead of
    storage, every bucket is trained once per epoch, every write still reaches storage, and the version is whole."""
    epochs = 4
    reads, mrr = {}, {}
    for handoff in (True, False):
        path = write_run_config(umls_p4, f"handoff-{handoff}", num_epochs=epochs, partition_handoff=handoff)
        (tmp_path / str(handoff)).mkdir()
        agents = Agents(path, "2", tmp_path / str(handoff))
        codes = agents.run(["a", "b"], timeout=300)
        assert codes == {"a": 0, "b": 0}, agents.tail()
        checkpoint_path = json.loads(path.read_text())["checkpoint_path"]
        records = bucket_records(checkpoint_path)
        assert_each_bucket_once_per_epoch(records, epochs)
        summaries = [r for r in records if r.get("pass_summary")]
        sizes = partition_sizes(path)
        for summary in summaries:
            check_io_stats(summary, sizes)  # storage reads and writes as before, fewer reads
        handed = sum(s.get("partition_handoffs", 0) for s in summaries)
        kept = sum(s.get("partition_kept_hits", 0) for s in summaries)
        assert (handed + kept > 0) == handoff, agents.text()[-3000:]
        assert sum(s.get("bytes_handed_over", 0) for s in summaries) <= max(sizes) * handed
        check_checkpoint(checkpoint_path, epochs)
        reads[handoff], mrr[handoff] = sum(s["partition_reads"] for s in summaries), filtered_mrr(umls_p4, path)
    assert reads[True] < reads[False], reads
    assert mrr[True] == pytest.approx(mrr[False], abs=0.06), mrr  # the rows handed over are the files' rows


@pytest.mark.slow
@pytest.mark.parametrize("every, seconds", [(-1, 0.0), (5, 0.0), (-1, 0.001)])
def test_two_ranks_writing_behind_store_partitions_only_at_cuts_and_train_each_bucket_once(umls_p4: dict,
                                                                                         tmp_path: Path, every: int,
                                                                                         seconds: float) -> None:
    """2 torchrun agents on loopback, P=4, partitions handed on unwritten and stored only at cuts
    (``write_behind_buckets``, job/train/distributed/cuts.py): only at the pass's end (-1), each pass writes each
    partition once (one checkpoint's partitions: the commit's cut); every 5 buckets, a cut mid-pass too, taken in the
    background while the group trains (job/train/distributed/cut_behind.py); -1 with ``write_behind_seconds`` (a
    millisecond here: due at every bucket's end), cuts mid-pass by time. Every bucket is trained once per epoch, and
    the version is whole."""
    epochs = 3
    path = write_run_config(umls_p4, f"behind{every}-{seconds}", num_epochs=epochs, partition_handoff=True,
                            write_behind_buckets=every, write_behind_seconds=seconds)
    agents = Agents(path, "2", tmp_path)
    codes = agents.run(["a", "b"], timeout=300)
    assert codes == {"a": 0, "b": 0}, agents.tail()
    checkpoint_path = json.loads(path.read_text())["checkpoint_path"]
    records = bucket_records(checkpoint_path)
    assert_each_bucket_once_per_epoch(records, epochs)
    summaries = [r for r in records if r.get("pass_summary")]
    sizes = partition_sizes(path)
    assert len(summaries) == epochs
    for summary in summaries:
        check_io_stats(summary, sizes)
        if every == -1 and not seconds:
            assert summary["partition_writes"] == 4, summary  # each partition once: nothing written between cuts
        elif seconds:
            assert 4 < summary["partition_writes"] <= 4 * 17, summary  # a cut begun at most at each bucket's end
        else:
            assert 4 < summary["partition_writes"] <= 4 * 4, summary  # at most 4 cuts of 16 buckets
    assert sum(s.get("partition_handoffs", 0) + s.get("partition_kept_hits", 0) for s in summaries) > 0
    check_checkpoint(checkpoint_path, epochs)
    assert "cut_partitions_staged" in agents.text(), agents.text()[-3000:]
    # every 5 buckets or by time: cuts taken in the background mid-pass (job/train/distributed/cut_behind.py), the
    # group training on through them; only at the pass's end: none (the commit's cut stops the group)
    background = [int(n) for n in re.findall(r'"cuts_in_background": (\d+)', agents.text())]
    assert len(background) == 2 * epochs and (sum(background) > 0) == (every > 0 or seconds > 0), background
