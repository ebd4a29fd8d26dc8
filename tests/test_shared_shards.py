"""The shards of the shared vector (``shared_shards``, issue #45): job/train/distributed/shard_service.py, shard_client.py,
shard_routing.py. Real TCPStore and real sockets on 127.0.0.1; the ranks are objects of this process. The group's
exactness with shards on (a real torchrun group, kills) is in tests/test_shared_shards_group.py."""

from __future__ import annotations

import json
import queue
import socket
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers_distributed import transports
from torch.distributed import TCPStore

from job.train.distributed import auth, shard_wire
from job.train.distributed.commits import Commit, Committer, VectorWork
from job.train.distributed.handoff import SocketReader
from job.train.distributed.shard_client import ShardClient, ShardError
from job.train.distributed.shard_routing import ShardedRows
from job.train.distributed.shard_service import ShardRefusal, ShardService, ShardSlice, owned_rows, set_rows
from job.train.distributed.shared_rows import RowLayout
from job.train.distributed.shared_vector import SharedVector
from job.types import Bucket

WORLD = 3
# 10 relation rows: two segments (an operator of width 2 and its Adagrad sums of width 2), 3 whole values first
LAYOUT = RowLayout.of(3 + 10 * 2 + 10 * 2, 10, [(3, 2), (23, 2)])
WIDTH = LAYOUT.row_values


def key(name: str) -> str:
    return f"round-1/{name}"


@pytest.fixture
def group() -> Iterator[tuple[list[ShardService], ShardClient, ShardClient]]:
    """Shards of ranks 1 and 2 (loaded for pass "0": each row's values r * 10 + column), rank 0's and rank 1's clients."""
    auth.reset_for_tests(b"s" * 32)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    services = []
    for rank in (1, 2):
        shard = ShardSlice(rank=rank, world_size=WORLD, layout=LAYOUT)
        owned = owned_rows(rank, WORLD, LAYOUT.rows)
        shard.load("0", (owned[:, None] * 10.0 + np.arange(WIDTH)[None, :]).astype(np.float32).reshape(-1))
        service = ShardService(shard, round_id="r1", store=store, key=key)
        service.start()
        services.append(service)
    clients = [ShardClient(rank=rank, world_size=WORLD, round_id="r1", store=store, key=key, limit=1 << 16)
               for rank in (0, 1)]
    try:
        yield services, clients[0], clients[1]
    finally:
        for client in clients:
            client.close()
        for service in services:
            service.close()
        auth.reset_for_tests(None)


def values_of(rows: list[int], plus: float = 0.0) -> np.ndarray:
    return np.concatenate([np.arange(WIDTH, dtype=np.float32) + r * 10 + plus for r in rows])


def test_rows_belong_to_their_rank_modulo_the_world() -> None:
    assert owned_rows(1, 3, 10).tolist() == [1, 4, 7]
    assert owned_rows(0, 3, 10).tolist() == [0, 3, 6, 9]
    assert owned_rows(5, 8, 4).tolist() == []  # more ranks than relations: an empty shard
    empty = ShardSlice(rank=5, world_size=8, layout=RowLayout.of(8, 4, [(0, 2)]))
    empty.load("0", np.zeros(0, np.float32))
    empty.push(3, "0", Bucket(0, 0), np.zeros(0, np.int64), np.zeros(0, np.float32))
    assert [a.tolist() for a in empty.save(0, "0", [Bucket(0, 0)])] == [[], []]


def test_a_push_is_served_at_once_and_stored_only_when_its_bucket_is_saved(group) -> None:
    services, rank0, rank1 = group
    rank1.exchange("push", "0", {1: (np.array([1, 7]), np.ones(2 * WIDTH, np.float32))}, Bucket(0, 1))
    rank1.exchange("push", "0", {1: (np.array([4]), np.full(WIDTH, 2.0, np.float32))}, Bucket(1, 1))
    pulled = rank1.exchange("pull", "0", {1: (np.array([1, 4, 7]), np.zeros(0, np.float32))})[1].values
    assert pulled.tolist() == values_of([1], 1.0).tolist() + values_of([4], 2.0).tolist() + values_of([7], 1.0).tolist()
    # a record saves bucket (0, 1) only: its rows come back with their stored values; (1, 1) stays pending
    (rows, values), (other_rows, _) = rank0.save("0", [Bucket(0, 1)])
    assert rows.tolist() == [1, 7] and values.tolist() == values_of([1, 7], 1.0).tolist()
    assert other_rows.tolist() == []  # rank 2's shard had nothing of it
    assert list(services[0].shard.vector.pending) == [Bucket(1, 1)]
    # the next save returns only what changed since: row 4
    (rows, values), _ = rank0.save("0", [Bucket(1, 1)])
    assert rows.tolist() == [4] and values.tolist() == values_of([4], 2.0).tolist()
    assert rank0.save("0", [])[0][0].tolist() == []


def test_a_push_outside_a_bucket_is_served_but_never_stored(group) -> None:
    services, rank0, rank1 = group
    rank1.exchange("push", "0", {2: (np.array([5]), np.ones(WIDTH, np.float32))})
    assert rank1.exchange("pull", "0", {2: (np.array([5]), np.zeros(0, np.float32))})[2].values.tolist() == \
        values_of([5], 1.0).tolist()
    assert [rows.tolist() for rows, _ in rank0.save("0", [Bucket(0, 0)])] == [[], []]


@pytest.mark.parametrize("rows, values, bucket, error", [
    ([2], 1, Bucket(0, 0), "names rows it does not serve"),  # row 2 is rank 2's
    ([7, 4], 2, Bucket(0, 0), "ascending"),
    ([1, 4], 1, Bucket(0, 0), "1 values for 2 rows"),
    ([10], 1, Bucket(0, 0), "ascending distinct relation ids in [0, 10)"),
])
def test_a_shard_refuses_what_is_not_its_own_or_not_well_formed(group, rows, values, bucket, error) -> None:
    services, rank0, rank1 = group
    with pytest.raises(ShardError, match=r"shard of rank 1: a push for bucket \(0, 0\) from rank 1.*" + error.replace(
            "[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        rank1.exchange("push", "0", {1: (np.array(rows), np.ones(values * WIDTH if values > 1 or len(rows) == 1
                                                                   else values, np.float32))}, bucket)
    assert not services[0].shard.vector.pending  # nothing of it taken
    # the connection serves on after a refusal
    rank1.exchange("push", "0", {1: (np.array([1]), np.ones(WIDTH, np.float32))}, Bucket(0, 0))


def test_a_shard_refuses_a_second_update_of_a_bucket_another_pass_and_saves_from_others_than_rank_0(group) -> None:
    services, rank0, rank1 = group
    push = {1: (np.array([1]), np.ones(WIDTH, np.float32))}
    rank1.exchange("push", "0", push, Bucket(0, 0))
    with pytest.raises(ShardError, match=r"bucket \(0, 0\).*pending here already"):
        rank1.exchange("push", "0", push, Bucket(0, 0))
    with pytest.raises(ShardError, match="for pass '1', but this shard serves pass '0'"):
        rank1.exchange("push", "1", push, Bucket(1, 0))
    with pytest.raises(ShardError, match="a save from rank 1; only rank 0"):
        rank1.save("0", [Bucket(0, 0)])
    assert list(services[0].shard.vector.pending) == [Bucket(0, 0)]


def test_a_message_without_the_groups_mac_or_replayed_is_refused_and_its_connection_closed(group) -> None:
    services, rank0, rank1 = group
    host, _, port = rank1._store.get(key("shards/1")).decode().rpartition(":")
    for forged in ("bad-mac", "replay"):
        with socket.create_connection((host.strip("[]"), int(port)), timeout=5) as sock:
            reader = SocketReader(sock)
            nonce = shard_wire.read_hello(reader, "shard 1")
            header = {"op": "push", "rank": 1, "pass": "0", "bucket": [0, 0]}
            rows, values = np.array([1]), np.ones(WIDTH, np.float32)
            if forged == "bad-mac":
                text = json.dumps(dict(header, seq=1, rows=1, values=WIDTH), sort_keys=True, separators=(",", ":"))
                sock.sendall(f"{'0' * 64} {text}\n".encode() + rows.astype(np.int64).tobytes() + values.tobytes())
                why = "whose MAC fails"
            else:  # a message MAC'd for another connection's nonce (a replay): fails the same way
                shard_wire.send(sock, kind="shard-ask", round_id="r1", nonce="another", seq=1, header=header,
                                rows=rows, values=values)
                why = "whose MAC fails"
            reply = shard_wire.receive(reader, kind="shard-reply", round_id="r1", nonce=nonce, seq=1, limit=100)
            assert not reply.header["ok"] and why in reply.header["error"] and "claiming rank 1" in reply.header["error"]
            assert sock.recv(1) == b""  # closed
    assert not services[0].shard.vector.pending
    # a message out of order on a connection of its own (number 2 first) is refused too
    with socket.create_connection((host.strip("[]"), int(port)), timeout=5) as sock:
        reader = SocketReader(sock)
        nonce = shard_wire.read_hello(reader, "shard 1")
        shard_wire.send(sock, kind="shard-ask", round_id="r1", nonce=nonce, seq=2,
                        header={"op": "pull", "rank": 1, "pass": "0"}, rows=np.array([1]), values=np.zeros(0))
        reply = shard_wire.receive(reader, kind="shard-reply", round_id="r1", nonce=nonce, seq=1, limit=100)
        assert "message number 2 where 1 was due" in reply.header["error"]


def test_an_asker_whose_shard_is_gone_fails_naming_the_shard_and_the_bucket(group) -> None:
    services, rank0, rank1 = group
    rank1.exchange("pull", "0", {2: (np.array([2]), np.zeros(0, np.float32))})  # connected
    services[1].close()
    rank1._connections[2].sock.shutdown(socket.SHUT_RDWR)  # (the shard's process gone: its sockets with it)
    with pytest.raises(ShardError, match=r"shard of rank 2 did not (take|answer) a push for bucket \(3, 1\)"):
        rank1.exchange("push", "0", {2: (np.array([2]), np.ones(WIDTH, np.float32))}, Bucket(3, 1))


def test_a_trainers_change_is_split_by_owner_and_its_pull_gathered_from_them(group) -> None:
    services, rank0, rank1 = group
    routing = ShardedRows(rank1, LAYOUT, WORLD)
    routing.pass_tag = "0"
    rows = np.array([0, 1, 2, 3])
    payload = torch.arange(LAYOUT.count(rows.size), dtype=torch.float32)
    mine, mine_rows = routing.push(Bucket(2, 2), payload, rows)
    # rank 0 keeps the whole values and rows 0 and 3
    by_row = payload[3:].view(4, WIDTH)
    assert mine_rows.tolist() == [0, 3]
    assert mine.tolist() == payload[:3].tolist() + by_row[0].tolist() + by_row[3].tolist()
    assert services[0].shard.vector.pending[Bucket(2, 2)].values.tolist() == by_row[1].tolist()
    assert services[1].shard.vector.pending[Bucket(2, 2)].values.tolist() == by_row[2].tolist()

    class RankZero:  # the lock server's part of a pull: the whole values, then rank 0's rows
        def pull(self, rows: list[int], into: torch.Tensor) -> torch.Tensor:
            assert rows == [0, 3]
            return into.copy_(torch.arange(into.numel(), dtype=torch.float32) - 100)

    pulled = routing.pull(RankZero(), rows)  # type: ignore[arg-type]
    got = pulled[3:].view(4, WIDTH)
    assert pulled[:3].tolist() == [-100.0, -99.0, -98.0]
    assert got[0].tolist() == [-97.0, -96.0, -95.0, -94.0] and got[3].tolist() == [-93.0, -92.0, -91.0, -90.0]
    assert got[1].tolist() == (values_of([1]) + by_row[1].numpy()).tolist()
    assert got[2].tolist() == (values_of([2]) + by_row[2].numpy()).tolist()
    # a whole vector's shard rows filled from the shards, rank 0's left as they were
    vector = np.full(LAYOUT.size, -1.0, np.float32)
    routing.fill(vector)
    expect = np.full(LAYOUT.size, -1.0, np.float32)
    others = routing.others()
    served = np.concatenate([routing.client.exchange("pull", "0", {s: (others[others % WORLD == s], np.zeros(0))})[s]
                             .values.reshape(-1, WIDTH) for s in (1, 2)])
    set_rows(LAYOUT, expect, np.concatenate([others[others % WORLD == 1], others[others % WORLD == 2]]),
             served.reshape(-1))
    assert vector.tolist() == expect.tolist()
    routing.zero_others(vector)
    assert all(vector[p] == 0 for p in LAYOUT.positions(others)[3:])
    assert all(vector[p] == -1 for p in LAYOUT.positions(np.array([0, 3, 6, 9])))


def test_a_slice_refuses_a_load_of_the_wrong_size() -> None:
    shard = ShardSlice(rank=1, world_size=WORLD, layout=LAYOUT)
    with pytest.raises(ShardRefusal, match="5 values loaded for 3 rows of 4 values"):
        shard.load("0", np.zeros(5, np.float32))


@pytest.mark.parametrize("keys, got", [
    ({"write_behind_buckets": 0, "dynamic_relations": True}, "got write_behind_buckets 0 and dynamic_relations true"),
    ({"write_behind_buckets": -1, "dynamic_relations": False}, "got write_behind_buckets -1 and dynamic_relations false"),
])
def test_shards_asked_for_without_writes_behind_or_relation_rows_are_a_config_error(keys, got) -> None:
    from job.config import parse_config
    from job.config.base import ConfigKeyError

    raw = {"entities": {"all": {"num_partitions": 2}}, "relations": [{"name": "r", "lhs": "all", "rhs": "all"}],
           "dimension": 8, "entity_path": "e", "edge_paths": ["d"], "checkpoint_path": "m", "shared_shards": True,
           "global_emb": False,
           **keys}
    with pytest.raises(ConfigKeyError, match="config key 'shared_shards': only with write_behind_buckets .*" + got) as info:
        parse_config(raw)
    assert info.value.exit_code == 2 and "shared_shards" in info.value.keys
    assert parse_config({**raw, "write_behind_buckets": 4, "dynamic_relations": True}).shared_shards


def test_a_model_without_relation_rows_is_refused_at_the_start() -> None:
    from job.errors import ConfigError
    from job.train.distributed.shard_routing import shardable

    with pytest.raises(ConfigError, match="'shared_shards': the model's shared parameters have no relation rows"):
        shardable(RowLayout.dense(12))
    assert shardable(LAYOUT) is LAYOUT


class Log:
    """A progress log that keeps what each write carried (the stored vector's blocks, or the whole vector)."""

    def __init__(self) -> None:
        self.writes: list[tuple[list[dict], Any]] = []

    def append(self, records: list[dict], shared: Any = None, blocks: Any = None) -> bool:
        self.writes.append((records, shared.copy() if shared is not None else blocks))
        return False


def committed(events: queue.Queue) -> Any:
    while True:
        event = events.get(timeout=10)
        if event[0] == "committed":
            return event[1]


def test_the_committer_writes_the_shards_saved_rows_into_the_stored_vector_with_the_record() -> None:
    vector = SharedVector(np.zeros(LAYOUT.size, np.float32), layout=LAYOUT)
    asked: list[list[Bucket]] = []

    def shard_save(buckets: list[Bucket]) -> list[tuple[np.ndarray, np.ndarray]]:
        asked.append(list(buckets))
        return [(np.array([1, 4]), np.full(2 * WIDTH, 7.0, np.float32)), (np.zeros(0, np.int64), np.zeros(0))]

    events: queue.Queue = queue.Queue()
    log = Log()
    committer = Committer(vector, log, events.put, shard_save)
    try:
        # a bucket done (rank 0's part: the whole values and row 0), unsaved: nothing asked of the shards
        committer.submit(Commit(None, None, [{"done": 1}], VectorWork(
            change=np.ones(LAYOUT.count(1), np.float32), rows=np.array([0]), finished=Bucket(0, 0))))
        assert not committed(events).error and asked == [] and not vector.stored.any()
        # the cut's record saves it: the shards save it too, and their rows enter the stored vector before the write
        committer.submit(Commit(None, None, [{"cut": 1}], VectorWork(unsaved=frozenset())))
        assert not committed(events).error and asked == [[Bucket(0, 0)]]
        expect = np.zeros(LAYOUT.size, np.float32)
        LAYOUT.scatter_add(expect, np.array([0]), np.ones(LAYOUT.count(1), np.float32))
        set_rows(LAYOUT, expect, np.array([1, 4]), np.full(2 * WIDTH, 7.0, np.float32))
        assert vector.stored.tolist() == expect.tolist()
        records, written = log.writes[-1]
        assert records == [{"cut": 1}] and written is not None  # the stored vector's change went with the record
    finally:
        committer.stop()


def test_a_shard_that_does_not_save_fails_the_commit_as_a_failed_write() -> None:
    vector = SharedVector(np.zeros(LAYOUT.size, np.float32), layout=LAYOUT)

    def shard_save(buckets: list[Bucket]) -> list[tuple[np.ndarray, np.ndarray]]:
        raise ShardError("rank 0: the shard of rank 2 did not answer a save")

    events: queue.Queue = queue.Queue()
    log = Log()
    committer = Committer(vector, log, events.put, shard_save)
    try:
        committer.submit(Commit(None, None, [{"done": 1}], VectorWork(
            change=np.ones(LAYOUT.count(1), np.float32), rows=np.array([0]), finished=Bucket(0, 0))))
        committed(events)
        committer.submit(Commit(None, None, [{"cut": 1}], VectorWork(unsaved=frozenset())))
        batch = committed(events)
        assert batch.error is not None and "shard of rank 2 did not answer a save" in batch.error
        assert [records for records, _ in log.writes] == [[{"done": 1}]]  # the cut's record never written
    finally:
        committer.stop()


@pytest.mark.slow  # ~60 s, as tests/test_lock_protocol.py's others of its kind
@pytest.mark.parametrize("behind", [3, -1])
def test_with_shards_each_buckets_update_is_counted_once_across_a_death_at_every_step(
        tmp_path: Path, behind: int) -> None:
    """``kill_at_every_step`` (tests/test_lock_protocol.py) with rank 1 serving the odd relation rows: the group dies
    after every action, among them a rank killed with its bucket's update acknowledged by its shard and its ``next``
    unsent, and rank 0 killed after the shards saved what a cut's record saves and before that record was stored; the
    round after resumes from the persisted vector (rank 0 alone): every bucket's update reaches it once."""
    from test_lock_protocol import kill_at_every_step

    auth.reset_for_tests(b"s" * 32)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    try:
        points = kill_at_every_step(lambda crash_after: str(tmp_path / str(crash_after) / "checkpoint"), store,
                                    transports(store, 2), handoff=True, behind=behind, withhold=True, shards=True)
        assert points > 40
    finally:
        auth.reset_for_tests(None)


def test_memory_budget_counts_a_shards_slice_and_the_trainers_larger_payloads() -> None:
    from job.train.residency.budget import SHARD_CLIENT_VECTORS, SHARD_VECTORS, sync_memory_bytes

    alone = sync_memory_bytes(1000, serves=False)
    assert sync_memory_bytes(1000, serves=False, shards=4) == alone + 4 * (1000 * SHARD_CLIENT_VECTORS
                                                                           + int(1000 * SHARD_VECTORS / 4))
    assert sync_memory_bytes(1000, serves=True, shards=4) == sync_memory_bytes(1000, serves=True) + \
        4 * 1000 * SHARD_CLIENT_VECTORS  # rank 0: no slice of its own beyond its server's vectors
    assert sync_memory_bytes(1000, serves=False, shards=1) == alone  # one pod: nothing sharded
