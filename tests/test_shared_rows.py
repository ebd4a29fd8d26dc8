"""Sparse shared parameters (issue #45): a bucket's change carries only the relation rows it changed, a trainer pulls
only the rows its next bucket reads (job/train/distributed/shared_rows.py, shared_params.py, the ``rows`` of ``next``
and the ``pull`` request). Real TCPStore, real gloo transports (rank 0's trainer hands its vectors over in memory,
rank 1's go through gloo), a real progress log: every change counted once in the served vector and in what a
restart resumes; rows a trainer does not read stay as they were, rows it reads are the group's."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers_distributed import partition_keys, transports, wait_until
from torch.distributed import TCPStore

from job.checkpoint.group_progress import ProgressLog, read_progress
from job.train.distributed import protocol
from job.train.distributed.lock_client import LockClient
from job.train.distributed.lock_server import LockServer
from job.train.distributed.lock_state import LockState
from job.train.distributed.protocol import LockServerError, ProtocolError
from job.train.distributed.shared_params import SharedParameters
from job.train.distributed.shared_rows import RowLayout

PREFIX = "biggraph/test-rows/lock"
RELATIONS = 6


def model_tensors() -> tuple[list[torch.Tensor], list[bool]]:
    """A dynamic operator's (6 relations x 3) parameter and its sums between two whole tensors, as ``shared_state``
    flattens a model: 2 + 18 + 18 + 1 values."""
    torch.manual_seed(0)
    tensors = [torch.randn(2), torch.randn(RELATIONS, 3), torch.rand(RELATIONS, 3), torch.randn(1)]
    return tensors, [False, True, True, False]


def layout_of(tensors: list[torch.Tensor], indexed: list[bool]) -> RowLayout:
    return RowLayout.of_tensors(tensors, indexed, RELATIONS)


# the layout and the wire --------------------------------------------------------------------------------------------


def test_a_payload_is_the_whole_values_then_each_rows_values_of_every_segment() -> None:
    layout = layout_of(*model_tensors())
    assert (layout.size, layout.rows, layout.segments, layout.row_values) == (39, 6, ((2, 3), (20, 3)), 6)
    assert layout.count(2) == 3 + 2 * 6
    assert layout.positions(np.array([1, 4])).tolist() == [0, 1, 38, 5, 6, 7, 23, 24, 25, 14, 15, 16, 32, 33, 34]
    vector = np.arange(39, dtype=np.float32)
    out = np.empty(15, np.float32)
    layout.gather(vector, np.array([1, 4]), out)  # through the segments' row views: the positions' values
    assert out.tolist() == [0, 1, 38, 5, 6, 7, 23, 24, 25, 14, 15, 16, 32, 33, 34]
    layout.scatter_add(vector, np.array([1, 4]), np.ones(15, np.float32))
    assert np.flatnonzero(vector != np.arange(39)).tolist() == sorted(layout.positions(np.array([1, 4])).tolist())
    with pytest.raises(ValueError, match="ascending distinct relation ids in \\[0, 6\\)"):
        layout.check(np.array([4, 1]))
    with pytest.raises(ValueError, match="ascending distinct"):
        layout.check(np.array([6]))
    with pytest.raises(ValueError, match="a payload of 14 values for 2 rows \\(they hold 15\\)"):
        layout.check(np.array([1, 4]), values=14)
    with pytest.raises(ValueError, match="no relation-indexed rows"):
        RowLayout.dense(39).check(np.array([0]))
    with pytest.raises(ValueError, match="does not fit"):
        RowLayout.of(10, 4, [(0, 3)])
    assert layout.worth(2) and not layout.worth(3)  # a sparse payload moves at most half the vector


def test_rows_travel_in_next_and_pull_and_malformed_ones_are_protocol_errors() -> None:
    envelope = protocol.Envelope(1, "", protocol.Payload(15, 7), seq=3)
    for request in (protocol.Next(finished=None, rows=(1, 4)), protocol.Pull(rows=(0, 5), tag=9)):
        raw = protocol.encode_request(envelope, request, scope=PREFIX)
        assert protocol.decode_request(protocol.read_incoming(raw, scope=PREFIX)) == request
    dense = protocol.encode_request(envelope, protocol.Next(), scope=PREFIX)
    assert protocol.decode_request(protocol.read_incoming(dense, scope=PREFIX)).rows is None
    for fields, why in (({"op": "next", "rows": [4, 1]}, "not strictly ascending"),
                        ({"op": "next", "rows": [1, -2]}, "non-negative"), ({"op": "next", "rows": "1,2"}, "a list"),
                        ({"op": "pull", "rows": [1], "pull_tag": -1}, "negative"),
                        ({"op": "pull", "rows": [1, 1], "pull_tag": 2}, "ascending"),
                        ({"op": "pull", "rows": [1]}, "no 'pull_tag'"), ({"op": "pull", "pull_tag": 1}, "no 'rows'"),
                        ({"op": "pull", "rows": [True], "pull_tag": 1}, "non-negative integers")):
        incoming = protocol.Incoming(protocol.Envelope(1), str(fields["op"]), fields)
        with pytest.raises(ProtocolError, match=why):
            protocol.decode_request(incoming)


# the trainer's side ---------------------------------------------------------------------------------------------------


def test_a_change_carries_the_rows_that_differ_and_a_pull_refreshes_only_the_rows_named() -> None:
    tensors, indexed = model_tensors()
    shared = SharedParameters(tensors, layout_of(tensors, indexed))
    before = shared.flatten()
    with torch.no_grad():
        tensors[1][2] += 1.0  # the bucket trained relation 2: its parameter and its sums
        tensors[2][2] += 0.5
    change, rows = shared.outgoing()
    assert rows is not None and rows.tolist() == [2]
    assert change.numel() == shared.layout.count(1)
    assert change[3:].tolist() == pytest.approx([1.0] * 3 + [0.5] * 3) and change[:3].tolist() == [0.0] * 3
    shared.taken(None)
    assert not shared.fresh
    change, rows = shared.outgoing()  # nothing new since: only the (unchanged) whole values travel
    assert rows is not None and rows.size == 0 and change.tolist() == [0.0] * 3
    shared.taken(None)
    # a pull of relations 2 and 4: their values and the whole ones become the group's, the others stay as they were
    values = torch.arange(shared.layout.count(2), dtype=torch.float32) + 100
    shared.take_rows(np.array([2, 4]), values)
    assert tensors[0].tolist() == [100.0, 101.0] and tensors[3].tolist() == [102.0]
    assert tensors[1][2].tolist() == [103.0, 104.0, 105.0] and tensors[2][2].tolist() == [106.0, 107.0, 108.0]
    assert tensors[1][4].tolist() == [109.0, 110.0, 111.0] and tensors[2][4].tolist() == [112.0, 113.0, 114.0]
    stale = before.reshape(-1)[2:20].reshape(RELATIONS, 3)
    assert torch.equal(tensors[1][[0, 1, 3, 5]], torch.from_numpy(stale[[0, 1, 3, 5]]))  # rows not read: untouched
    change, rows = shared.outgoing()  # what was pulled is synced: no change to give back
    assert rows is not None and rows.size == 0
    shared.taken(None)
    with torch.no_grad():
        tensors[1] += 1.0  # every relation changed: the whole change goes, and the sum comes back whole
    change, rows = shared.outgoing()
    assert rows is None and change.numel() == 39
    shared.taken(change + 1.0)
    assert shared.fresh and torch.equal(shared.synced, torch.from_numpy(shared.flatten()))


# against the real server ---------------------------------------------------------------------------------------------


@pytest.fixture
def store() -> TCPStore:
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))


class Group:
    """Rank 0 (the server and its own trainer's client) and rank 1, over real gloo, the progress in ``tmp_path``."""

    def __init__(self, store: TCPStore, tmp_path: Path) -> None:
        self.ranks = transports(store, 2, timeout_s=30.0)
        self.checkpoint = str(tmp_path)
        self.state = LockState(4, 4, partition_keys(4), world_size=2, version=1)
        tensors, indexed = model_tensors()
        self.initial = SharedParameters(tensors, layout_of(tensors, indexed)).flatten()
        log = ProgressLog(self.checkpoint, "run", 1, compact_every=0)
        log.start(self.state.to_json(), self.initial)
        self.server = LockServer(store, self.state, log, self.initial, 0, self.ranks[0], prefix=PREFIX,
                                 world_size=2, layout=layout_of(tensors, indexed))
        self.clients = [LockClient(store, rank, timeout_s=60, prefix=PREFIX, transport=self.ranks[rank])
                        for rank in (0, 1)]


@pytest.fixture
def group(store: TCPStore, tmp_path: Path) -> Iterator[Group]:
    served = Group(store, tmp_path)
    try:
        yield served
    finally:
        served.server.stop()


def test_sparse_changes_are_counted_once_served_and_resumed_and_a_pull_returns_the_rows_asked(group: Group) -> None:
    layout = group.server.layout
    expected = group.initial.copy()
    trainers = []
    for rank, rows in ((0, [1, 4]), (1, [4, 5])):
        tensors, indexed = model_tensors()
        trainers.append((tensors, SharedParameters(tensors, layout_of(tensors, indexed))))
        client = group.clients[rank]
        kind, bucket, _, _ = client.finish_and_next(set(), None, None)
        assert kind == "bucket" and bucket is not None
        with torch.no_grad():
            tensors[1][rows] += float(rank + 1)
            tensors[2][rows] += 0.25
        change, changed = trainers[-1][1].outgoing()
        assert changed is not None and changed.tolist() == rows
        positions = layout.positions(changed)
        np.add.at(expected, positions, change.numpy())
        kind, _, _, back = client.finish_and_next(set(), bucket, {"n": 1}, change, rows=changed.tolist())
        assert back is None  # a sparse change takes no sum back
        trainers[-1][1].taken(back)
        keys = sorted(group.state.bucket_keys[bucket])
        client.written(keys, [])  # its partitions are saved: the bucket's update enters what a restart resumes
        client.release(keys, written=False)
    np.testing.assert_array_equal(group.server.shared, expected)  # row 4: both changes, once each
    # rank 1 pulls relations 1 and 4 (rank 0's change and both): fresh there, its relation 5 kept, 0 left stale
    tensors, shared = trainers[1]
    stale_row_0 = tensors[1][0].clone()
    shared.pull(group.clients[1], torch.tensor([4, 1, 4, 1]))
    pulled = layout.positions(np.array([1, 4]))
    np.testing.assert_array_equal(shared.synced.numpy()[pulled], expected[pulled])
    assert torch.equal(tensors[1][4], torch.from_numpy(expected[14:17])) and torch.equal(tensors[1][0], stale_row_0)
    change, rows = shared.outgoing()
    assert rows is not None and rows.size == 0  # nothing read or pulled counts as a change of its own
    # rank 0's trainer pulls through the in-memory hand-over
    values = group.clients[0].pull([5], torch.empty(layout.count(1)))
    np.testing.assert_array_equal(values.numpy(), expected[layout.positions(np.array([5]))])
    resumed = read_progress(group.checkpoint, 0, "run")
    assert resumed is not None and resumed.shared is not None
    np.testing.assert_array_equal(resumed.shared, expected)  # persisted: each bucket's change exactly once
    assert group.server.stats()["pending_spilled"] == 0
    assert wait_until(lambda: group.server._slots.sparse_held == 0, 10)  # each pull's buffer back once it was taken


def test_an_unsaved_buckets_sparse_change_is_served_but_resumed_only_once_its_partitions_are_written(
        group: Group) -> None:
    client = group.clients[1]
    kind, bucket, _, _ = client.finish_and_next(set(), None, None)
    assert bucket is not None
    change = torch.full((group.server.layout.count(1),), 2.0)
    client.finish_and_next(set(), bucket, {"n": 1}, change, rows=[3])
    positions = group.server.layout.positions(np.array([3]))
    assert group.server.shared[positions].tolist() == (group.initial[positions] + 2.0).tolist()
    assert bucket in group.server.vector.pending  # done, its partitions not yet written: a restart redoes it
    resumed = read_progress(group.checkpoint, 0, "run")
    assert resumed is not None and (resumed.shared is None or np.array_equal(resumed.shared, group.initial))
    keys = sorted(group.state.bucket_keys[bucket])
    client.written(keys, [])
    resumed = read_progress(group.checkpoint, 0, "run")
    assert resumed is not None and resumed.shared is not None
    np.testing.assert_array_equal(resumed.shared, group.server.shared)


def test_rows_out_of_range_a_wrong_size_or_a_disordered_pull_are_refused_and_change_nothing(group: Group) -> None:
    client = group.clients[1]
    layout = group.server.layout
    kind, bucket, _, _ = client.finish_and_next(set(), None, None)
    assert bucket is not None
    served, state = group.server.shared.copy(), client.status()
    for rows, values, why in (([9], layout.count(1), "ascending distinct relation ids in \\[0, 6\\)"),
                              ([1, 2], layout.count(1), "a payload of 9 values for 2 rows")):
        with pytest.raises(LockServerError, match=why):
            client.finish_and_next(set(), bucket, {"n": 1}, torch.ones(values), rows=rows)
    for message, why in (({"op": "pull", "rows": [2, 1], "pull_tag": 3}, "not strictly ascending"),
                         ({"op": "pull", "rows": list(range(7)), "pull_tag": 3}, "relation ids in \\[0, 6\\)"),
                         ({"op": "reserve", "rows": [1]}, "carries no shared-parameter change")):
        with pytest.raises(LockServerError, match=why):
            client._call(message, torch.ones(layout.count(1)) if message["op"] == "reserve" else None, back=False)
    np.testing.assert_array_equal(group.server.shared, served)
    assert client.status() == state and group.server.thread.is_alive()
    assert wait_until(lambda: group.server._slots.sparse_held == 0, 10)  # every refused payload's buffer given back
    kind, _, _, _ = client.finish_and_next(set(), bucket, {"n": 1}, torch.zeros(layout.count(1)), rows=[2])
    assert kind in ("bucket", "wait")  # and the rank goes on


def test_unsaved_sparse_changes_wait_as_their_rows_in_memory_or_a_small_file_and_are_stored_once() -> None:
    from job.train.distributed.shared_vector import SharedVector
    from job.types import Bucket

    layout = layout_of(*model_tensors())
    vector = SharedVector(np.zeros(layout.size, np.float32), in_memory=1, layout=layout)  # 156 bytes held at most
    expected = np.zeros(layout.size, np.float32)
    for index, rows in enumerate(([1, 4], [0, 2, 5], [4])):
        rows_array = np.array(rows)
        change = np.full(layout.count(len(rows)), float(index + 1), np.float32)
        vector.add(change, rows_array)
        assert not vector.finish(Bucket(index, 0), change, saved=False, rows=rows_array)
        np.add.at(expected, layout.positions(rows_array), change)
    assert vector.spilled == 1 and vector.held_bytes <= 4 * layout.size  # the third one went to a file
    assert vector.pending[Bucket(1, 0)].file is not None  # 3 rows: 76 bytes, past the bound after the first
    np.testing.assert_array_equal(vector.served, expected)
    assert not vector.stored.any()  # nothing saved yet: a restart redoes all three
    assert vector.save(unsaved={Bucket(2, 0)})
    assert vector.save(unsaved=set())
    np.testing.assert_array_equal(vector.stored, expected)
    assert vector.held_bytes == 0 and not vector.pending
