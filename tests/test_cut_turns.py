"""A rank's turn in a cut taken in the background when the group stops before the cut is recorded (issue 45;
job/train/schedule/behind.py, job/train/distributed/cut_behind.py). Beside tests/test_write_behind.py, which is large.

The case: a cut in the background owes rank 1 its turn, and the pass's last bucket ends meanwhile, so the group
stops. Rank 1's stage is then not ``behind`` (its reservation is dropped: there is nothing to train on), it stages on
its training thread, and its report is answered ``go``, since rank 0's share is still missing. That answer is a turn
of a cut not yet recorded: the rank must move at a later turn. The trainer used to take it for a protocol error and
end the round (the scale bench's 8 pods met it once cuts lasted longer).

And a pass's start with writes behind: rows the last pass's cuts stored, dropped by their holder since, are in the
committed version's files, not in the new pass's names (the chaos bench with shards met it: a pod lost to exit 2)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from test_lock_protocol import handoffs, ranks, row_store, serve, store  # noqa: F401 - fixtures
from test_write_behind import staged_report
from torch.distributed import TCPStore

from job.train.distributed.handoff import HandoffLost
from job.train.distributed.lock_client import LockClient
from job.train.distributed.transport import TensorTransport
from job.train.schedule.behind import BehindWrites


def test_a_turn_owed_to_a_cut_in_the_background_while_the_group_stops_is_moved_at_a_later_turn(
        tmp_path: Path, store: TCPStore, ranks: list[TensorTransport]) -> None:  # noqa: F811
    prefix = "stopping"
    server = serve(store, str(tmp_path), None, f"{prefix}/lock", ranks[0], write_behind=2)
    ends = handoffs(store, prefix, True)
    try:
        client0 = LockClient(store, 0, timeout_s=60, prefix=f"{prefix}/lock", transport=ranks[0])
        client1 = LockClient(store, 1, timeout_s=60, prefix=f"{prefix}/lock", transport=ranks[1])
        partitions = row_store(str(tmp_path), store, prefix)
        partitions.peers = ends[1]
        assert ends[1] is not None
        behind = BehindWrites(client1, partitions, partitions.checkpoint, ends[1])
        keys_of = server.state.bucket_keys
        b0 = client0.finish_and_next(set(), None, None)[1]
        b1 = client1.finish_and_next(set(), None, None)[1]
        for key in sorted(keys_of[b1]):  # rank 1 trains b1: +1 in its column
            partitions.get(key).weight[:, b1.lhs * 4 + b1.rhs] += 1.0
        assert client0.finish_and_next(set(keys_of[b0]), b0, None)[0] == "bucket"
        assert client1.finish_and_next(set(keys_of[b1]), b1, None)[0] == "cut"  # a cut every 2 buckets: due
        assert server.cuts is not None and server.cuts.behind is not None
        cut = server.cuts.behind
        assert cut.keys_of(1) == tuple(sorted(keys_of[b1]))
        trained = {key: partitions.loaded[key].weight.clone() for key in cut.keys_of(1)}

        server.cuts.phase = "drain"  # as if the pass's last bucket were done now: the group stops
        assert behind.cut() is None  # staged and reported, answered `go`: not a protocol error
        assert not behind.kept_reservation and 1 in cut.reports and not cut.recorded

        b2 = server.state.in_flight[0]  # rank 0 finishes its bucket and takes its turn: the cut is recorded
        assert client0.finish_and_next(set(keys_of[b2]), b2, None)[0] == "cut"
        step = client0.cut()
        assert step.step == "stage" and not step.behind
        assert client0.cut(staged=staged_report(0, step.keys, "stop")).step == "move" and cut.recorded
        assert client0.cut(moved=True).step == "go"

        # rank 1's next turn is its move; then the cut is over and the stop's own plan may go on
        assert behind.client.finish_and_next(set(partitions.loaded), None, None)[0] == "cut"
        assert behind.cut() is None and server.cuts.behind is None
        for key, rows in trained.items():  # its move published the rows it staged
            weight, _ = partitions.checkpoint.load_entity_partition(1, *key)
            assert np.array_equal(weight, rows.numpy())
    finally:
        server.stop()
        for end in ends:
            if end is not None:
                end.close()


def test_rows_a_cut_stored_in_the_last_pass_send_their_asker_to_the_committed_file_once_dropped(
        store: TCPStore) -> None:  # noqa: F811
    """Issue 45, found by the chaos bench with writes behind: the holders of the last commit pass to the next pass's
    server, so a grant early in a pass may name a rank that has since dropped those rows (kept beyond its limit once
    a cut stored them). Its answer used to be "stored", which sends the asker to the next version's file (a cut of
    *this* pass), which no cut has written yet: "embeddings_node_1.v12.h5: missing", exit 2, a pod lost. Since the
    pass's start those rows are in the committed version: the answer is "committed", the asker reads the committed
    file (``told_stored`` False), and the holder asking for its own dropped rows reads it too (no HandoffLost)."""
    ends = handoffs(store, "passes", True)
    try:
        holder, taker = ends
        assert holder is not None and taker is not None
        holder.strict = taker.strict = True
        weight = torch.arange(48, dtype=torch.float32).reshape(3, 16)
        digest = holder.keep(("node", 1), weight, torch.zeros(3), 0)  # pinned until the commit's cut stores them
        for end in ends:
            end.new_pass(behind=True)  # (as ``LockServerScheduler.start_pass``: the commit stored what was kept)
        for part in (2, 3):  # the next pass keeps two more: the oldest goes once a cut stores them
            holder.keep(("node", part), weight + part, torch.zeros(3), 0)
        holder.unpin()
        assert holder.kept_rows(("node", 1)) is None
        taker.hint([("node", 1)], [("node", 1, 0, digest)])  # the adopted holder, from the last commit
        assert taker.take(("node", 1), (3, 16), False, False) is None
        assert not taker.told_stored(("node", 1))  # the committed file, not this pass's names
        holder.hint([("node", 1)], [("node", 1, 0, digest)])
        assert holder.take(("node", 1), (3, 16), False, False) is None and not holder.told_stored(("node", 1))
        taker.hint([("node", 3)], [("node", 3, 0, "newer-rows")])  # rows it never kept: still the only copy lost
        with pytest.raises(HandoffLost):
            taker.take(("node", 3), (3, 16), False, False)
    finally:
        for end in ends:
            if end is not None:
                end.close()
