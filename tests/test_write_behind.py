"""Partitions written behind the training (``write_behind_buckets``, job/train/distributed/cuts.py): released to their
next holder unwritten, stored only at cuts of the whole group. The kill-at-every-step exactly-once test of write
groups (tests/test_lock_protocol.py, ``kill_at_every_step``) with cuts every few buckets and only at the commit, and
the server's refusals: a per-rank write group, a release that would lose unwritten rows, a staged report from a
fenced rank or naming the wrong partitions; a hand-off that fails ends the round instead of reading the stale file.
Cuts taken in the background (job/train/distributed/cut_behind.py): which buckets are granted during one, what its
record saves (exactly its buckets and their shared updates), a stop of the group waiting for it, what is unpinned,
the pinned limit calling one early, and a pinned partition handed on before its stage."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_lock_protocol import handoffs, kill_at_every_step, ranks, serve, store  # noqa: F401 - fixtures
from torch.distributed import TCPStore

from job.checkpoint.group_progress import read_progress
from job.checkpoint.write_groups import staged_name
from job.train.distributed.handoff import HandoffLost, rows_digest
from job.train.distributed.lock_client import LockClient
from job.train.distributed.protocol import LockServerError
from job.train.distributed.transport import TensorTransport


@pytest.mark.slow  # ~as long as the write-group test (a point of death per request, staged file and move)
@pytest.mark.parametrize("every", [3, -1])
def test_with_writes_behind_each_buckets_update_reaches_the_pass_exactly_once(
        tmp_path: Path, store: TCPStore, ranks: list[TensorTransport], every: int) -> None:  # noqa: F811
    """Partitions handed on unwritten, stored at a cut every 3 buckets done (``every`` 3: taken in the background, the
    other rank training buckets started after the cut began, some points of death among them) or only at the pass's
    end (-1): killed after every request, staged file and move, each bucket's update reaches the committed rows of
    each of its partitions once and its shared update the vector once, and no staged file is left."""
    points = kill_at_every_step(lambda crash_after: str(tmp_path / str(crash_after) / "checkpoint"), store, ranks,
                                handoff=True, behind=every)
    assert points > 40  # 119 points of death at 3 (the cuts in the background), 52 at -1 (67 with write groups)


def test_a_cut_refuses_what_would_lose_or_count_twice_a_bucket(tmp_path: Path, store: TCPStore,  # noqa: F811
                                                                ranks: list[TensorTransport]) -> None:  # noqa: F811
    """With writes behind (a cut after every bucket here) the server refuses a rank's own write group, a release
    that writes a trained partition or lets one go unwritten without keeping its rows, a staged report from a
    fenced rank, and one naming other partitions than the rank was given; the rank's right report then records
    the cut: every done bucket saved, its partitions made current, the staged files in the progress a restart
    rolls forward."""
    server = serve(store, str(tmp_path), None, "wb/lock", ranks[0], write_behind=1, lost=frozenset({1}))
    client = LockClient(store, 0, timeout_s=60, prefix="wb/lock", transport=ranks[0])
    fenced = LockClient(store, 1, timeout_s=60, prefix="wb/lock", transport=ranks[1])
    try:
        kind, bucket, _, _ = client.finish_and_next(set(), None, None)
        assert kind == "bucket" and bucket is not None
        keys = sorted(server.state.bucket_keys[bucket])

        def entries(parts: list, token: str) -> list[list[Any]]:
            return [[key[0], key[1], staged_name(key, 1, token), 10, "0a0b0c0d"] for key in parts]

        with pytest.raises(LockServerError, match="write group"):
            client.written(keys, entries(keys, "own"))
        kind, _, _, _ = client.finish_and_next(set(keys), bucket, None)
        assert kind == "cut" and server.state.unsaved_buckets() == {bucket}
        with pytest.raises(LockServerError, match="unwritten without keeping"):
            client.release(keys, written=False)
        with pytest.raises(LockServerError, match="as written"):
            client.release(keys, written=True)
        step = client.cut()
        assert step.step == "stage" and sorted(step.keys) == keys  # it holds their locks: it has their latest rows
        with pytest.raises(LockServerError, match="declared dead"):
            fenced.cut(staged=[])
        other = sorted({("node", part) for part in range(4)} - set(keys))[:1]
        with pytest.raises(LockServerError, match="not the partitions this cut gave it"):
            client.cut(staged=entries(other, "wrong"))
        assert server.state.unsaved_buckets() == {bucket} and not server.state.dirty  # nothing recorded
        assert client.cut(staged=entries(keys, "cut")).step == "move"
        assert not server.state.unsaved_buckets() and set(keys) <= server.state.dirty
        assert client.cut(moved=True).step == "go"
        progress = read_progress(str(tmp_path), 0, "run")
        assert progress is not None
        assert [entry[:3] for entry in progress.staged()] == [entry[:3] for entry in entries(keys, "cut")]
        assert sorted(np.flatnonzero(progress.shared).tolist()) == []  # no shared change travelled here
    finally:
        server.stop()


def test_with_writes_behind_a_failed_hand_off_ends_the_round_instead_of_reading_the_older_file(
        store: TCPStore) -> None:  # noqa: F811
    """The holder of rows trained since the last cut is their only copy: a receive that fails (rows not kept, holder
    gone) raises ``HandoffLost`` (the trainer exits, the round restarts from the last cut) instead of reading the
    file; rows a cut stored and their holder dropped since send the asker to the file, as without writes behind."""
    ends = handoffs(store, "wb", True)
    try:
        holder, taker = ends
        assert holder is not None and taker is not None
        holder.strict = taker.strict = True
        weight = torch.arange(48, dtype=torch.float32).reshape(3, 16)
        digest = holder.keep(("node", 1), weight, torch.zeros(3), 0)
        taker.hint([("node", 1)], [("node", 1, 0, digest)])
        rows = taker.take(("node", 1), (3, 16), False, False)
        assert rows is not None and torch.equal(rows.weight, weight)
        holder.hint([("node", 1)], [("node", 1, 0, digest)])  # its own rows back (a read ahead, say)...
        assert holder.take(("node", 1), (3, 16), False, False) is not None
        assert holder.kept_rows(("node", 1)) is not None  # ...still kept: a read ahead dropped at a cut loses nothing
        taker.hint([("node", 1)], [("node", 1, 0, "not-the-digest")])  # rows the holder does not keep
        with pytest.raises(HandoffLost):
            taker.take(("node", 1), (3, 16), False, False)
        for part in (2, 3, 0):  # pinned: kept beyond the limit (2) until a cut stores them
            holder.keep(("node", part), weight + part, torch.zeros(3), 0)
        assert holder.kept_rows(("node", 1)) is not None
        holder.unpin()  # a cut stored them: the oldest beyond the limit go
        assert holder.kept_rows(("node", 1)) is None
        taker.hint([("node", 1)], [("node", 1, 0, digest)])
        assert taker.take(("node", 1), (3, 16), False, False) is None  # stored by the cut: the file is current
        kept = holder.kept_rows(("node", 0))
        assert kept is not None
        holder.close()  # the holder gone
        taker.hint([("node", 0)], [("node", 0, 0, rows_digest("wb", ("node", 0), kept.weight, kept.optim_sum, 0))])
        with pytest.raises(HandoffLost):
            taker.take(("node", 0), (3, 16), False, False)
    finally:
        for end in ends:
            if end is not None:
                end.close()


def test_a_round_that_ends_abandons_the_cut_and_waits_for_locks_not_writes(tmp_path: Path, store: TCPStore,  # noqa: F811
                                                                           ranks: list[TensorTransport]) -> None:  # noqa: F811
    """Written behind, a round's end cannot save what no cut stored: a cut under way answers ``ending``, the rank
    hands its locks back unwritten and without kept rows (refused while the round stands), and rank 0 is settled
    once every live rank holds no lock and no bucket in flight, its done buckets unsaved (the restart redoes them)."""
    server = serve(store, str(tmp_path), None, "end/lock", ranks[0], write_behind=-1, lost=frozenset({1}))
    client = LockClient(store, 0, timeout_s=60, prefix="end/lock", transport=ranks[0])
    try:
        kind, bucket, _, _ = client.finish_and_next(set(), None, None)
        assert kind == "bucket" and bucket is not None
        keys = sorted(server.state.bucket_keys[bucket])
        for _ in range(40):  # every bucket but the one in flight, as if done by this rank
            kind, bucket, _, _ = client.finish_and_next(set(keys), bucket, None)
            if kind != "bucket":
                break
            with pytest.raises(LockServerError, match="unwritten without keeping"):
                client.release(keys, written=False)
            client.release(keys, written=False, kept=[(k[0], k[1], "digest") for k in keys])
            keys = sorted(server.state.bucket_keys[bucket])
        assert kind == "cut" and len(server.state.unsaved_buckets()) == 16  # the pass's end: its only cut
        assert client.cut().step == "stage"
        server._ending = lambda: "a peer was lost"  # the round ends (as ``DistributedContext.ending`` says)
        step = client.cut()
        assert step.step == "ending" and step.why == "a peer was lost"
        assert not server.settled()  # it still holds the last bucket's locks
        client.release(keys, written=False)  # unwritten, nothing kept: accepted now
        assert server.settled() and len(server.state.unsaved_buckets()) == 16 and not server.state.dirty
    finally:
        server.stop()


def test_a_rank_waiting_for_the_end_of_one_cut_is_not_drawn_into_the_next(tmp_path: Path, store: TCPStore,  # noqa: F811
                                                                          ranks: list[TensorTransport]) -> None:  # noqa: F811
    """The last rank to move its files hears ``go`` at once and may finish a bucket that makes the next cut due
    before another rank asks again: that rank still hears ``go`` (the cut it took part in is over), not the next
    cut's steps (the scale bench's 8 pods, a cut every 8 buckets, failed so)."""
    server = serve(store, str(tmp_path), None, "two/lock", ranks[0], write_behind=1)
    assert server.cuts is not None
    server.cuts.background = False  # (the cut of the whole group: what the pass's end and an orderly end take)
    clients = [LockClient(store, rank, timeout_s=60, prefix="two/lock", transport=ranks[rank]) for rank in (0, 1)]

    def take_part(rank: int) -> str:  # stage what it is given, report it; the step it hears then
        step = clients[rank].cut()
        assert step.step == "stage", step
        return clients[rank].cut(staged=[[k[0], k[1], staged_name(k, 1, f"r{rank}"), 10, "0a0b0c0d"]
                                         for k in step.keys]).step

    try:
        buckets = [clients[rank].finish_and_next(set(), None, None)[1] for rank in (0, 1)]
        assert clients[0].finish_and_next(set(), buckets[0], None)[0] == "cut"
        assert clients[0].cut().step == "wait"  # rank 1 still trains
        assert clients[1].finish_and_next(set(), buckets[1], None)[0] == "cut"
        assert take_part(0) == "wait" and take_part(1) == "move" and clients[0].cut().step == "move"
        assert clients[0].cut(moved=True).step == "wait"
        assert clients[1].cut(moved=True).step == "go"
        kind, bucket, _, _ = clients[1].finish_and_next(set(), None, None)
        assert kind == "bucket"
        assert clients[1].finish_and_next(set(), bucket, None)[0] == "cut"  # the next cut is due
        assert clients[0].cut().step == "go"  # the one rank 0 took part in is over
        assert clients[0].finish_and_next(set(), None, None)[0] == "cut"
        assert take_part(0) == "wait" and take_part(1) == "move"
        assert server.cuts is not None and server.cuts.stats.cuts == 2
    finally:
        server.stop()


def staged_report(rank: int, keys: Any, token: str) -> list[list[Any]]:
    """A report of ``keys`` staged under names of their own (the server checks names, sizes and CRC-32s' form)."""
    return [[k[0], k[1], staged_name(k, 1, f"{token}{rank}"), 10, "0a0b0c0d"] for k in keys]


@pytest.mark.parametrize("end", ["in order", "window over", "leaver late"])
def test_a_round_that_ends_in_order_takes_a_cut_first_unless_it_cannot_in_time(
        tmp_path: Path, store: TCPStore, ranks: list[TensorTransport], end: str) -> None:  # noqa: F811
    """Issue 45: written behind (only at the commit here), a rank's SIGTERM (``next`` with ``leaving``) no longer
    rolls the group back to the last cut: every rank, the leaving one included, first stages what it holds in a cut,
    and hears ``ending`` once it is recorded, so the next round redoes nothing. Exactness first: once the drain
    window is over, or the leaving rank gives its part up (its own deadline passed), the cut is abandoned and the
    round ends as after a loss (nothing of it recorded, every done bucket redone)."""
    prefix = f"order{end.replace(' ', '')}/lock"
    server = serve(store, str(tmp_path), None, prefix, ranks[0], write_behind=-1)
    clients = [LockClient(store, rank, timeout_s=60, prefix=prefix, transport=ranks[rank]) for rank in (0, 1)]
    try:
        assert server.cuts is not None
        server.cuts.bound(window_s=0.0 if end == "window over" else 60.0, pinned_limit=None)
        buckets = [clients[rank].finish_and_next(set(), None, None)[1] for rank in (0, 1)]
        assert None not in buckets
        keys = [sorted(server.state.bucket_keys[b]) for b in buckets]  # type: ignore[index]
        # rank 1 finishes its bucket and leaves (its SIGTERM): a cut, not ``ending``; it waits for rank 0's bucket
        assert clients[1].finish_and_next(set(keys[1]), buckets[1], None, leaving="rank 1 received SIGTERM")[0] \
            == "cut"
        if end == "leaver late":
            assert clients[1].cut().step == "wait"
            clients[1].finish_and_next(set(), None, None, leaving="its deadline passed", gave_up=True)
        elif end == "window over":
            time.sleep(0.01)
        assert clients[0].finish_and_next(set(keys[0]), buckets[0], None)[0] == ("cut" if end == "in order"
                                                                                  else "ending")
        if end == "in order":
            steps = [clients[rank].cut() for rank in (0, 1)]
            assert [s.step for s in steps] == ["stage", "stage"]
            assert sorted(steps[0].keys) == keys[0] and sorted(steps[1].keys) == keys[1]
            assert clients[0].cut(staged=staged_report(0, keys[0], "end")).step == "wait"
            assert clients[1].cut(staged=staged_report(1, keys[1], "end")).step == "move"  # recorded
            assert not server.state.unsaved_buckets() and len(server.state.done) == 2
            assert clients[0].cut(moved=True).step == "wait" and clients[1].cut(moved=True).step == "go"
            assert clients[0].cut().step == "go"
            for rank in (0, 1):  # the cut over, the round ends: nothing unsaved is left to redo
                assert clients[rank].finish_and_next(set(keys[rank]), None, None)[0] == "ending"
                clients[rank].release(keys[rank], written=False)
            progress = read_progress(str(tmp_path), 0, "run")
            assert progress is not None and len(progress.staged()) == len(keys[0]) + len(keys[1])
        else:  # nothing recorded: the restart redoes both buckets, as after a loss
            assert clients[1].cut().step == "ending" or end == "leaver late"
            assert server.state.unsaved_buckets() == set(buckets) and not server.state.dirty
            assert server.cuts.stats.cuts == 0
        assert server.settled() or end != "in order"
    finally:
        server.stop()


def train_pinning_until_a_cut(client: LockClient, server: Any) -> tuple[str, set]:
    """One rank (``client`` of ``server``, a ``LockServer``) trains bucket after bucket, releasing the partitions that
    leave at each switch unwritten with their rows kept (pinned), until ``next`` answers ``cut`` (at most 16
    buckets); the last answer's kind and what it pinned."""
    kind, bucket, _, _ = client.finish_and_next(set(), None, None)
    pinned: set = set()
    for _ in range(15):
        keys = sorted(server.state.bucket_keys[bucket])
        kind, bucket, _, _ = client.finish_and_next(set(keys), bucket, None)
        if kind == "cut":
            break
        leaving = sorted(set(keys) - set(server.state.bucket_keys[bucket]))
        client.release(leaving, written=False, kept=[(k[0], k[1], "digest") for k in leaving])
        pinned |= set(leaving)
    return kind, pinned


def test_a_cut_is_due_before_a_ranks_pinned_rows_could_pass_what_memory_budget_allows(
        tmp_path: Path, store: TCPStore, ranks: list[TensorTransport]) -> None:  # noqa: F811
    """Issue 45: the rows a rank released unwritten since the last cut stay pinned in its memory until a cut stores
    them. With a limit (``pinned_partitions`` from memory_budget) a cut comes before the pass's end (``-1``) once one
    more switch could pass it, and the pinned count starts again from zero after it."""
    server = serve(store, str(tmp_path), None, "pinned/lock", ranks[0], write_behind=-1)
    client = LockClient(store, 0, timeout_s=60, prefix="pinned/lock", transport=ranks[0])
    idle = LockClient(store, 1, timeout_s=60, prefix="pinned/lock", transport=ranks[1])  # (holds nothing)
    try:
        assert server.cuts is not None
        server.cuts.background = False  # (the group stops at one switch from the limit; background: two)
        server.cuts.bound(window_s=25.0, pinned_limit=4)  # a bucket pins 2 at a switch: a cut past 2 pinned
        kind, pinned = train_pinning_until_a_cut(client, server)
        assert kind == "cut" and len(server.state.done) < 16 and len(pinned) + 2 > 4 >= len(pinned), pinned
        step = client.cut()
        assert step.step == "stage"
        assert client.cut(staged=staged_report(0, step.keys, "pin")).step == "wait"
        assert idle.cut().step == "stage" and idle.cut(staged=[]).step == "move"  # recorded
        assert not server.cuts.pinned and not server.state.unsaved_buckets()  # counted from zero again
    finally:
        server.stop()


def test_memory_budget_gives_the_pinned_rows_the_buffer_room_a_distributed_trainer_does_not_use() -> None:
    """``pinned_partitions``: with a budget, a rank may pin the part of the buffer's capacity beyond its bucket's and
    the next one's read ahead (where the hand-off's kept partitions live too); without one, no limit."""
    from job.config import parse_config
    from job.train.residency.budget import choose_capacity, handoff_kept_partitions, pinned_partitions

    base = {"entity_path": "/tmp/e", "edge_paths": ["/tmp/x"], "checkpoint_path": "/tmp/c", "dimension": 99,
            "entities": {"all": {"num_partitions": 16}}, "relations": [{"name": "r", "lhs": "all", "rhs": "all"}],
            "partition_handoff": True, "write_behind_buckets": -1}
    counts = {"all": [10_000] * 16}  # 4 MB a partition
    assert pinned_partitions(parse_config(base), 3) is None
    budget = parse_config({**base, "memory_budget": str(3 * 2**20 + 14 * 4_000_000)})
    # 14 partitions' room: one in flight and a write group's copy leave the buffer 12; the trainer holds 4 of them
    # (its bucket's and the next one's), so 8 may be pinned, the hand-off's 4 kept among them
    capacity = choose_capacity(budget, counts, distributed=True, processes=1, runtime_bytes=2**20)
    assert capacity == 12 and pinned_partitions(budget, capacity) == 8 and handoff_kept_partitions(budget, capacity) == 4
    tight = parse_config({**base, "memory_budget": str(3 * 2**20 + 9 * 4_000_000)})  # a buffer of 7: 3 to spare
    capacity = choose_capacity(tight, counts, distributed=True, processes=1, runtime_bytes=2**20)
    assert capacity == 7 and pinned_partitions(tight, capacity) == 3 and handoff_kept_partitions(tight, capacity) == 3
    # a fixed partition_buffer is not the budget's: the hand-off keeps its 4 beside it, and they may be pinned
    fixed = parse_config({**base, "memory_budget": "1GiB", "partition_buffer": 6})
    assert pinned_partitions(fixed, 6) == 4 + 2 and handoff_kept_partitions(fixed, 6) == 4


def test_a_cut_taken_in_the_background_saves_exactly_its_buckets_while_the_group_trains_on(
        tmp_path: Path, store: TCPStore, ranks: list[TensorTransport]) -> None:  # noqa: F811
    """Issue 45: a cut every 2 buckets taken in the background. When it becomes due (rank 1 finishing b1) its set D is
    the done unsaved buckets plus the one in flight (b0, b1, b2). Rank 1 stages its keys and trains on at once (b3,
    granted during the cut, not in D and not touching a partition rank 0 still has to stage); rank 0's next ``next``
    is its turn, not a bucket. The record (when the last key is staged) saves exactly D: its buckets leave the
    unsaved ones, only their shared updates reach the stored vector, b3's stays pending, and a restart after it
    redoes b3 alone. Each rank moves at its next ``next`` after the record; then the cut is over."""
    server = serve(store, str(tmp_path), None, "bg/lock", ranks[0], write_behind=2)
    clients = [LockClient(store, rank, timeout_s=60, prefix="bg/lock", transport=ranks[rank]) for rank in (0, 1)]
    keys_of = server.state.bucket_keys

    def delta(bucket: Any) -> torch.Tensor:  # its shared update: 1 in its own slot
        change = torch.zeros(16)
        change[bucket.lhs * 4 + bucket.rhs] = 1.0
        return change

    try:
        assert server.cuts is not None
        b0, b1 = (clients[rank].finish_and_next(set(), None, None)[1] for rank in (0, 1))
        kind, b2, _, _ = clients[0].finish_and_next(set(keys_of[b0]), b0, None, delta(b0))
        assert kind == "bucket" and b2 is not None  # one unsaved: no cut yet
        assert clients[1].finish_and_next(set(keys_of[b1]), b1, None, delta(b1))[0] == "cut"
        cut = server.cuts.behind
        assert cut is not None and cut.buckets == {b0, b1, b2} and not server.cuts.active  # nobody stops
        step = clients[1].cut()
        assert step.step == "stage" and step.behind and set(step.keys) == set(keys_of[b1])
        assert clients[1].cut(staged=staged_report(1, step.keys, "bg")).step == "go"  # b2 still in flight: not recorded
        kind, b3, _, _ = clients[1].finish_and_next(set(keys_of[b1]), None, None)
        assert kind == "bucket" and b3 not in cut.buckets  # granted during the cut
        assert not keys_of[b3] & (keys_of[b0] | keys_of[b2])  # rank 0 has not staged those yet
        assert not server.state.dirty and server.state.unsaved_buckets() == {b0, b1}
        assert clients[0].finish_and_next(set(keys_of[b2]), b2, None, delta(b2))[0] == "cut"  # its turn first
        step = clients[0].cut()
        assert step.step == "stage" and set(step.keys) == set(keys_of[b0] | keys_of[b2])
        assert clients[0].cut(staged=staged_report(0, step.keys, "bg")).step == "move"  # the last key: recorded
        assert server.state.unsaved_buckets() == set() and server.state.dirty == keys_of[b0] | keys_of[b1] | keys_of[b2]
        assert clients[0].cut(moved=True).step == "go"
        assert clients[1].finish_and_next(set(keys_of[b3]), b3, None, delta(b3))[0] == "cut"  # its move is due
        step = clients[1].cut()
        assert step.step == "move" and set(step.keys) == set(keys_of[b1])
        assert clients[1].cut(moved=True).step == "go" and server.cuts.behind is None  # over
        assert server.state.unsaved_buckets() == {b3} and server.cuts.stats.cuts == 1
        slots = sorted(b.lhs * 4 + b.rhs for b in (b0, b1, b2))
        assert np.flatnonzero(server.vector.stored).tolist() == slots  # D's shared updates, not b3's
        assert set(server.vector.pending) == {b3}
        progress = read_progress(str(tmp_path), 0, "run")
        assert progress is not None
        cuts = [r for r in progress.records if r["e"] == "cut"]
        assert len(cuts) == 1 and sorted(map(tuple, cuts[0]["buckets"])) == sorted([b0, b1, b2])
        restarted = type(server.state)(4, 4, keys_of, world_size=2, version=1)  # what a restart resumes
        restarted.restore(progress.state)
        for record in progress.records:
            restarted.apply(record)
        restarted.forget_rank_locks()
        assert restarted.done == {b0, b1, b2} and restarted.redone == 1  # b3 alone is redone
        assert np.flatnonzero(progress.shared).tolist() == slots
    finally:
        server.stop()


def test_a_cut_of_the_whole_group_waits_for_the_one_in_the_background_and_rows_are_unpinned_only_unchanged(
        tmp_path: Path, store: TCPStore, ranks: list[TensorTransport]) -> None:  # noqa: F811
    """The pass's end stops the group (its commit needs every bucket saved) but first lets a cut taken in the
    background end: a rank owing its turn hears that turn's steps before the stop's. And a rank unpins, of the rows
    it kept at its turn, only those neither kept anew nor taken back to train since (they may hold later work)."""
    ends = handoffs(store, "unpin", True)
    try:
        holder = ends[0]
        assert holder is not None
        holder.strict = True
        weight = torch.zeros(3, 16)
        digests = [holder.keep(("node", part), weight + part, torch.zeros(3), 0) for part in (0, 1, 2)]
        marks = holder.pinned_marks()  # its turn
        holder.keep(("node", 1), weight + 10, torch.zeros(3), 0)  # kept anew after it: work after the cut
        holder.hint([("node", 2)], [("node", 2, 0, digests[2])])
        assert holder.take(("node", 2), (3, 16), False, False) is not None  # taken back to train
        holder.unpin_unchanged(marks)
        assert holder.pinned_marks() == {("node", 1): 2}  # 2 stays pinned, but taken back: not a mark
        assert holder.pinned_bytes() == 2 * (weight.nbytes + 3 * 4)  # 1 and 2 pinned, 0 no longer
    finally:
        for end in ends:
            if end is not None:
                end.close()
    server = serve(store, str(tmp_path), None, "stop/lock", ranks[0], write_behind=2)
    clients = [LockClient(store, rank, timeout_s=60, prefix="stop/lock", transport=ranks[rank]) for rank in (0, 1)]
    try:
        assert server.cuts is not None
        b0, b1 = (clients[rank].finish_and_next(set(), None, None)[1] for rank in (0, 1))
        assert clients[0].finish_and_next(set(), b0, None)[0] == "bucket"
        assert clients[1].finish_and_next(set(), b1, None)[0] == "cut"  # in the background
        server.cuts.phase = "drain"  # as if the pass's last bucket were done now: the group stops
        assert clients[0].cut().step == "stage" and clients[0].cut().behind is False  # its turn, reservation gone
        step = clients[1].cut()
        assert step.step == "stage"
        assert clients[1].cut(staged=staged_report(1, step.keys, "bg")).step == "go"
        assert clients[1].cut().step == "wait"  # the stop waits for the background cut
    finally:
        server.stop()


def test_memory_budget_calls_a_cut_in_the_background_two_switches_before_the_limit(
        tmp_path: Path, store: TCPStore, ranks: list[TensorTransport]) -> None:  # noqa: F811
    """Issue 45: with a pinned limit (``pinned_partitions``) the cut comes in the background once a rank's next two
    switches could pass it (the group stops only at one), before the pass's end (``-1``); its move unpins what the
    rank kept at its turn, and a rank that held nothing still takes its (empty) turn before the cut is over."""
    server = serve(store, str(tmp_path), None, "pinbg/lock", ranks[0], write_behind=-1)
    client = LockClient(store, 0, timeout_s=60, prefix="pinbg/lock", transport=ranks[0])
    idle = LockClient(store, 1, timeout_s=60, prefix="pinbg/lock", transport=ranks[1])  # (holds nothing)
    try:
        assert server.cuts is not None
        server.cuts.bound(window_s=25.0, pinned_limit=6)  # a bucket pins 2 at a switch: background past 2 pinned
        kind, pinned = train_pinning_until_a_cut(client, server)
        assert kind == "cut" and len(server.state.done) < 16 and len(pinned) + 4 > 6 >= len(pinned) + 2, pinned
        assert server.cuts.behind is not None and not server.cuts.active  # in the background
        step = client.cut()
        assert step.step == "stage" and step.behind
        assert client.cut(staged=staged_report(0, step.keys, "pin")).step == "move"  # its keys were all: recorded
        assert client.cut(moved=True).step == "go" and not server.cuts.pinned[0]  # unpinned: counted from zero
        assert not server.state.unsaved_buckets() and server.cuts.behind is not None  # rank 1's turn is owed
        assert idle.finish_and_next(set(), None, None)[0] == "cut"
        assert idle.cut().step == "stage" and idle.cut(staged=[]).step == "move"
        assert idle.cut(moved=True).step == "go" and server.cuts.behind is None and server.cuts.stats.cuts == 1
    finally:
        server.stop()


def test_during_a_cut_in_the_background_a_partition_its_stager_keeps_pinned_is_handed_on_before_its_stage(
        tmp_path: Path, store: TCPStore, ranks: list[TensorTransport]) -> None:  # noqa: F811
    """Why no partition waits for its stage: rows a rank released kept are pinned there and never change (it takes
    its own back only for a bucket it starts, and it starts none before its turn), so another rank may take a copy and
    train it during the cut while the stager later stages the pinned rows as the cut's buckets left them. Here rank 0
    keeps b0's partitions pinned and has not taken its turn; rank 1, after its own, is granted a bucket on one of them,
    named with rank 0 as its holder."""
    server = serve(store, str(tmp_path), None, "pinon/lock", ranks[0], write_behind=2)
    clients = [LockClient(store, rank, timeout_s=60, prefix="pinon/lock", transport=ranks[rank]) for rank in (0, 1)]
    keys_of = server.state.bucket_keys
    try:
        assert server.cuts is not None
        b0, b1 = (clients[rank].finish_and_next(set(), None, None)[1] for rank in (0, 1))
        kind, b2, _, _ = clients[0].finish_and_next(set(), b0, None)
        assert kind == "bucket" and b2 is not None
        leaving = sorted(keys_of[b0] - keys_of[b2])
        assert leaving, (b0, b2)  # (the seeded order: b0 and b2 share at most one partition)
        clients[0].release(leaving, written=False, kept=[(k[0], k[1], f"d{k[1]}") for k in leaving])
        assert clients[1].finish_and_next(set(keys_of[b1]), b1, None)[0] == "cut"
        cut = server.cuts.behind
        assert cut is not None and cut.buckets == {b0, b1, b2} and all(cut.stager[k] == 0 for k in leaving)
        step = clients[1].cut()
        assert clients[1].cut(staged=staged_report(1, step.keys, "pin")).step == "go"
        kind, b3, _, _ = clients[1].finish_and_next(set(keys_of[b1]) | set(leaving), None, None)
        assert kind == "bucket" and b3 not in cut.buckets and keys_of[b3] & set(leaving), (b3, leaving)
        assert cut.turned == {1} and not cut.recorded  # rank 0 has staged nothing yet
        # (held named them, to steer the choice; a rank that does not hold them is told to take them from rank 0)
        handed = {(h[0], h[1]): h[2] for h in server.holders.grant(b3, keys_of[b1])}
        assert all(handed[k] == 0 for k in keys_of[b3] & set(leaving))  # from rank 0's pinned rows
    finally:
        server.stop()
