"""The partitions written this pass travel to each client once (job/train/distributed/written_delta.py): a client's
view always equals the server's set, whatever it claims; a reply carries only what its request did not know; a
claim of another epoch or past the end gets the whole list, a malformed one is refused naming the field.

Real TCPStore, a real lock server and clients (rank 0's transport in memory)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from datetime import timedelta
from types import SimpleNamespace

import numpy as np
import pytest
from helpers_distributed import partition_keys, transports
from torch.distributed import TCPStore

from job.train.distributed import protocol
from job.train.distributed.lock_client import LockClient
from job.train.distributed.lock_server import LockServer
from job.train.distributed.lock_state import LockState
from job.train.distributed.protocol import LockServerError
from job.train.distributed.written_delta import WrittenDelta, WrittenLog, WrittenView

PREFIX = "biggraph/test-written/lock"


@pytest.mark.parametrize("seed", range(4))
def test_a_clients_view_equals_the_written_set_whatever_it_claimed(seed: int) -> None:
    rng = random.Random(seed)
    log = WrittenLog("epoch-a")
    written: set = set()
    views = [WrittenView() for _ in range(3)]
    for _ in range(200):
        if rng.random() < 0.4:
            written.add(("node", rng.randrange(40)))
        log.catch_up(written)
        view = rng.choice(views)
        if rng.random() < 0.1:  # a claim of another epoch, or past the end: the whole list comes back
            known = rng.choice([("epoch-b", 3), ("epoch-a", len(log.keys) + 1), ("", 0)])
        else:
            known = view.known
        delta = log.since(known)
        assert view.merge(delta) == frozenset(written)
    assert len(log.keys) == len(written)


def test_a_delta_past_what_the_client_holds_is_an_error() -> None:
    view = WrittenView()
    view.merge(WrittenDelta("e", 0, (("node", 1),)))
    with pytest.raises(protocol.ProtocolError, match="from position 3, but 1 are known"):
        view.merge(WrittenDelta("e", 3, (("node", 2),)))


@pytest.fixture
def served() -> Iterator[tuple[LockServer, TCPStore]]:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    ranks = transports(store, 1)
    server = LockServer(store, LockState(4, 4, partition_keys(4), world_size=2),
                        SimpleNamespace(append=lambda records, shared=None: None), np.zeros(3, np.float32), 0,
                        ranks[0], prefix=PREFIX)
    try:
        yield server, store
    finally:
        server.stop()


def test_replies_carry_only_the_partitions_written_since_the_clients_last(served: tuple[LockServer, TCPStore]) -> None:
    server, store = served
    client = LockClient(store, 1, timeout_s=60, prefix=PREFIX)
    writer = LockClient(store, 1, timeout_s=60, prefix=PREFIX, channel="/writer")
    held: set = set()
    bucket = None
    for _ in range(6):  # buckets trained, their partitions written and released as they are left
        kind, bucket, dirty = client.next_bucket(held, bucket, None)
        assert dirty == server.state.dirty
        if kind != "bucket" or bucket is None:
            break
        keys = set(server.state.bucket_keys[bucket])
        if held - keys:
            writer.release(sorted(held - keys))
        held = keys
        ahead, dirty = client.reserve()
        assert dirty == server.state.dirty
    assert server.state.dirty  # (some were written)
    # asked again with nothing new written: the reply names no partition, and the client still knows them all
    raw = client._call({"op": "reserve", "leaving": [], "written_known": list(client._written.known)})
    reply = protocol.unpack(raw)
    assert reply["written"]["keys"] == [] and reply["written"]["from"] == len(server.state.dirty)
    assert "dirty" not in reply
    # a client that does not say what it holds (an older one) gets the whole list, as before
    raw = client._call({"op": "reserve", "leaving": []})
    assert sorted(map(tuple, protocol.unpack(raw)["dirty"])) == sorted(server.state.dirty)
    # another epoch's claim, or one past the end: the whole list from the start
    for known in (["another-server", 1], ["", 0], [server.written_log.epoch, 10_000]):
        written = protocol.unpack(client._call({"op": "reserve", "leaving": [], "written_known": known}))["written"]
        assert written["from"] == 0 and sorted(map(tuple, written["keys"])) == sorted(server.state.dirty)


@pytest.mark.parametrize("known", [[1, 2], ["e"], ["e", -1], ["e", 1.5], "e,1"])
def test_a_malformed_claim_is_refused_naming_the_field(served: tuple[LockServer, TCPStore], known: object) -> None:
    _, store = served
    client = LockClient(store, 1, timeout_s=60, prefix=PREFIX)
    with pytest.raises(LockServerError, match="written_known"):
        client._call({"op": "next", "held": [], "finished": None, "record": None, "written_known": known})
    assert client.next_bucket(set(), None, None)[0] == "bucket"  # and it serves on
