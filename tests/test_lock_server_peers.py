"""The lock server never waits on one peer (issue #30): a rank that does not send its change, or does not take its
sum, holds neither the server's thread nor any other rank; a rank whose transfer outlives the transport's timeout is
treated as gone (its requests refused) while the others' transfers go on; the vectors in flight are bounded.

Real TCPStore, real gloo transports (tests/helpers_distributed.py: every rank's end in this process, payloads
through gloo's sockets) and a real server thread. A stalled rank is driven by hand (``Peer``): it posts its request
and does its transfers only when the test says, as a frozen (SIGSTOPped) process would. Every assertion is on the
order of answers, never on a duration: a rank's answer that arrives while a stalled rank's transfer is still in
flight (``LockServer.in_flight``) or while its request is still unanswered (``Peer.answers``) was not held up by it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta
from types import SimpleNamespace
from typing import Any, Optional

import numpy as np
import pytest
import torch
from helpers_distributed import partition_keys, transports
from torch.distributed import TCPStore

from job.train.distributed.lock_client import LockClient
from job.train.distributed.lock_server import LockServer
from job.train.distributed.lock_state import LockState
from job.train.distributed.protocol import LockServerError, seal
from job.train.distributed.transport import TensorTransport, Transfer
from job.train.residency.budget import TRANSFER_SLOTS

PREFIX = "biggraph/test-round/lock"


@pytest.fixture
def store() -> TCPStore:
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))


class Peer:
    """A rank whose requests and transfers are made by hand, each when the test says (a frozen process makes
    none of them): ``ask`` pushes a request (with ``posted``, its change sent first, as a ``LockClient`` does),
    ``send`` posts a change late, ``answer`` pops the reply, ``take`` receives the sum."""

    def __init__(self, store: TCPStore, rank: int, transport: TensorTransport) -> None:
        self.store = store.clone()
        self.store.set_timeout(timedelta(seconds=60))  # far above any answer: a lost one fails, never hangs
        self.rank = rank
        self.transport = transport
        self.responses = f"{PREFIX}/response/{rank}"
        self.seq = 0  # its requests, numbered as a LockClient numbers them
        self.sends: list[Transfer] = []  # kept: gloo drops a send whose work is let go before the peer takes it

    def ask(self, op: str, change: Optional[torch.Tensor] = None, posted: bool = True, **fields: Any) -> int:
        """Push a request; with ``change``, announce it under a fresh tag (posted first unless ``posted`` is
        False). Returns the tag."""
        tag = self.transport.next_tag()
        self.seq += 1
        request: dict[str, Any] = {"op": op, "rank": self.rank, "channel": "", "seq": self.seq, **fields}
        if change is not None:
            request.update(values=change.numel(), tag=tag)
            if posted:
                self.send(change, tag)
        self.store.queue_push(f"{PREFIX}/requests", seal(request, PREFIX))
        return tag

    def send(self, change: torch.Tensor, tag: int) -> None:
        self.sends.append(self.transport.send(change, 0, tag))

    def answers(self) -> int:
        """Replies waiting in this rank's queue (the server answered, the rank did not read them yet)."""
        return int(self.store.queue_len(self.responses))

    def answer(self) -> dict[str, Any]:
        reply: dict[str, Any] = json.loads(self.store.queue_pop(self.responses, block=True))
        return reply

    def take(self, tag: int, values: int) -> list[float]:
        into = torch.empty(values)
        self.transport.recv(into, 0, tag)
        return into.tolist()


def serve(store: TCPStore, ranks: list[TensorTransport], values: int = 3) -> LockServer:
    state = LockState(4, 4, partition_keys(4), world_size=len(ranks))
    return LockServer(store, state, SimpleNamespace(append=lambda records: None), np.zeros(values, np.float32), 0,
                      ranks[0], prefix=PREFIX)


@pytest.fixture
def group(store: TCPStore) -> Iterator[tuple[LockServer, list[TensorTransport]]]:
    """Ranks 0 (the server's), 1 (stalled by the test) and 2 over a real gloo transport whose timeout no test
    reaches: a stalled transfer stays in flight until the test ends it."""
    ranks = transports(store, 3, timeout_s=120.0)
    server = serve(store, ranks)
    try:
        yield server, ranks
    finally:
        server.stop()


def client(store: TCPStore, rank: int, ranks: list[TensorTransport]) -> LockClient:
    return LockClient(store, rank, timeout_s=60, prefix=PREFIX, transport=ranks[rank])


def test_a_rank_that_does_not_send_its_change_holds_up_no_other_rank(
        store: TCPStore, group: tuple[LockServer, list[TensorTransport]]) -> None:
    """Rank 1 announces a change and does not send it (frozen after its request): ranks 2 and 0 sync and take
    buckets meanwhile; once rank 1 sends, its request is judged and answered with the sum as it then stands."""
    server, ranks = group
    stalled = Peer(store, 1, ranks[1])
    tag = stalled.ask("sync", torch.tensor([1.0, 0.0, 0.0]), posted=False)
    other, own = client(store, 2, ranks), client(store, 0, ranks)
    assert other.sync(torch.tensor([0.0, 0.0, 1.0])).tolist() == [0.0, 0.0, 1.0]
    assert own.sync(torch.tensor([0.0, 1.0, 0.0])).tolist() == [0.0, 1.0, 1.0]
    kind, bucket, _ = other.next_bucket(set(), None, None)
    assert kind == "bucket" and bucket is not None
    # all of it answered while rank 1's change was still awaited, its request unanswered
    assert server.in_flight().get(1) == "receive" and stalled.answers() == 0
    stalled.send(torch.tensor([1.0, 0.0, 0.0]), tag)
    assert stalled.answer()["ok"]
    assert stalled.take(tag, 3) == [1.0, 1.0, 1.0]
    assert server.values().tolist() == [1.0, 1.0, 1.0] and not server.gone()


def test_a_rank_that_does_not_take_its_sum_holds_up_no_other_rank_and_later_takes_the_sum_of_its_time(
        store: TCPStore, group: tuple[LockServer, list[TensorTransport]]) -> None:
    """Rank 1's sync is answered but rank 1 does not take its sum (frozen after reading the reply): the others
    sync meanwhile, changing the served vector; rank 1's next change waits behind its untaken sum (one transfer
    in flight per rank) while the others are still answered; when rank 1 takes its sum it is the one of its time,
    kept in a buffer of its own, and then its waiting request is served."""
    server, ranks = group
    stalled = Peer(store, 1, ranks[1])
    first = stalled.ask("sync", torch.tensor([1.0, 1.0, 1.0]))
    assert stalled.answer()["ok"]
    other = client(store, 2, ranks)
    assert other.sync(torch.tensor([0.0, 0.0, 1.0])).tolist() == [1.0, 1.0, 2.0]
    assert server.in_flight().get(1) == "send"
    second = stalled.ask("sync", torch.tensor([0.0, 2.0, 0.0]))  # posted: its sender is not frozen yet
    assert other.sync(torch.tensor([0.0, 0.0, 1.0])).tolist() == [1.0, 1.0, 3.0]
    assert client(store, 0, ranks).status()["done"] == []
    assert stalled.answers() == 0  # its second request waits for its first sum to be taken, the others served
    assert server.slots_allocated <= TRANSFER_SLOTS
    assert stalled.take(first, 3) == [1.0, 1.0, 1.0]  # the sum when it was answered, not the vector since
    assert stalled.answer()["ok"]
    assert stalled.take(second, 3) == [1.0, 3.0, 3.0]
    assert not server.gone()


def test_a_rank_past_the_timeout_is_gone_and_the_other_ranks_transfers_go_on(
        store: TCPStore, caplog: pytest.LogCaptureFixture) -> None:
    """Rank 1 does not take its sum within the transport's timeout: the server counts it gone (its waiting and later
    requests refused, naming why) without letting gloo time out, which would close every pair of rank 0's group:
    rank 2 keeps syncing through the same group afterwards."""
    ranks = transports(store, 3, timeout_s=2.0)
    server = serve(store, ranks)
    try:
        stalled, other = Peer(store, 1, ranks[1]), client(store, 2, ranks)
        first = stalled.ask("sync", torch.tensor([1.0, 1.0, 1.0]))
        assert stalled.answer()["ok"]
        stalled.ask("sync", torch.tensor([0.0, 0.0, 5.0]))  # waits behind the untaken sum, then refused
        refused = stalled.answer()
        assert not refused["ok"] and "rank 1 is treated as gone" in refused["error"]
        assert "payload" in refused["error"] and "to rank 1: not taken in 2 s" in refused["error"]
        stalled.ask("reserve")  # no change to carry: refused all the same
        assert "rank 1 is treated as gone" in stalled.answer()["error"]
        assert other.sync(torch.tensor([0.0, 0.0, 1.0])).tolist() == [1.0, 1.0, 2.0]
        assert other.sync(torch.tensor([0.0, 1.0, 0.0])).tolist() == [1.0, 2.0, 2.0]
        assert list(server.gone()) == [1]
        assert "did not reach rank 1 or come from it" in caplog.text
        # thawed, rank 1 still finds its sum (gloo never gave its buffer up), and the slot comes back
        assert stalled.take(first, 3) == [1.0, 1.0, 1.0]
        with pytest.raises(LockServerError, match="treated as gone"):
            client(store, 1, ranks).sync(torch.zeros(3))
    finally:
        server.stop()


def test_the_transfer_slots_bound_the_vectors_in_flight_and_a_request_without_a_slot_waits_its_turn(
        store: TCPStore) -> None:
    """``TRANSFER_SLOTS`` ranks each announce a change and do not send it: each holds a slot. Another rank's change
    then waits for a slot (its request unanswered), while requests without a change are still answered; it is
    served once a stalled rank's transfer ends and gives its slot back, and never is a vector allocated beyond the
    slots."""
    world = TRANSFER_SLOTS + 2
    ranks = transports(store, world, timeout_s=120.0)
    server = serve(store, ranks)
    try:
        stalled = [Peer(store, rank, ranks[rank]) for rank in range(1, TRANSFER_SLOTS + 1)]
        tags = [peer.ask("sync", torch.ones(3), posted=False) for peer in stalled]
        last = Peer(store, world - 1, ranks[world - 1])
        waiting = last.ask("sync", torch.full((3,), 10.0))
        side = LockClient(store, world - 1, timeout_s=60, prefix=PREFIX, channel="b")  # its background writer's
        kind, _, _ = side.next_bucket(set(), None, None)
        assert kind == "bucket"
        assert last.answers() == 0 and server.slots_allocated == TRANSFER_SLOTS
        assert all(server.in_flight().get(peer.rank) == "receive" for peer in stalled)
        first = stalled[0]
        first.send(torch.ones(3), tags[0])
        assert first.answer()["ok"]
        assert last.answers() == 0  # the slot goes on to carry the sum, until rank 1 takes it
        assert first.take(tags[0], 3) == [1.0, 1.0, 1.0]
        assert last.answer()["ok"]
        assert last.take(waiting, 3) == [11.0, 11.0, 11.0]
        for peer, tag in zip(stalled[1:], tags[1:]):
            peer.send(torch.ones(3), tag)
            assert peer.answer()["ok"]
            peer.take(tag, 3)
        assert server.values().tolist() == [10.0 + TRANSFER_SLOTS] * 3
        assert server.slots_allocated == TRANSFER_SLOTS and not server.gone()
    finally:
        server.stop()


class HeldTransfer:
    """A posted transfer that ends when the test says (``Transfer``'s ``wait_unbounded`` and ``what``)."""

    def __init__(self) -> None:
        import threading

        self.release = threading.Event()
        self.what = "a held transfer"

    def wait_unbounded(self) -> None:
        self.release.wait(timeout=60)


def test_transfer_waiters_are_reused_and_a_held_transfer_never_holds_up_anothers_end() -> None:
    """``Flights`` hands a transfer to an idle waiter, and starts a new one only when none is idle: a transfer that
    never ends (a frozen peer's) keeps its waiter, another transfer's end is still reported at once, and the
    transfers that follow reuse the waiters freed instead of starting a thread each."""
    import queue

    from job.train.distributed.transfers import Flights, Waiting

    inbox: queue.Queue[Any] = queue.Queue()
    flights = Flights(inbox, timeout_s=60)
    frozen = HeldTransfer()
    job = Waiting(None, 1, "")  # type: ignore[arg-type]
    flights.start("send", job, torch.empty(1), False, frozen)  # type: ignore[arg-type]
    for rank in range(2, 7):  # one after the other: each ends before the next is posted
        quick = HeldTransfer()
        quick.release.set()
        flight = flights.start("send", Waiting(None, rank, ""), torch.empty(1), False, quick)  # type: ignore
        kind, ended, error = inbox.get(timeout=30)
        assert (kind, ended, error) == ("ended", flight, None)
    assert flights.waiters == 2  # the frozen one's, and one reused by the five others
    frozen.release.set()
    assert inbox.get(timeout=30)[1].job is job
    flights.close()
