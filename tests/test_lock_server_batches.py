"""The lock server's serving thread takes the events queued for it together (issue #45): each request is still
judged in the queue's order, exactly as if it had come alone, and every reply leaves sealed for its own request, in
the order decided (the replier thread, job/train/distributed/replier.py).

Real TCPStore, real server threads and real gloo transports (unused: these requests carry no change). A batch is
made certain, not hoped for: the test holds the server's lock while the requests are queued, so the serving thread
waits inside the first one while the reader queues the others; ``LockServer.let_in`` says when all are there.
"""

from __future__ import annotations

import random
import time
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from helpers_distributed import partition_keys, transports
from torch.distributed import TCPStore

from job.train.distributed import protocol
from job.train.distributed.lock_server import LockServer
from job.train.distributed.lock_state import LockState
from job.train.distributed.protocol import Envelope, Granted, Next, Reserve, Reserved

PREFIX = "biggraph/test-batches/lock"
RANKS = 6
NPARTS = 8


@pytest.fixture
def store() -> TCPStore:
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))


def requests() -> list[tuple[int, int, Any]]:
    """(rank, seq, request): every rank's first ``next``, then every rank's ``reserve``, as a burst of a group
    starting together would queue them."""
    asked = [(rank, 1, Next()) for rank in range(RANKS)]
    return asked + [(rank, 2, Reserve()) for rank in range(RANKS)]


def one_at_a_time(seed: int) -> list[Any]:
    """What the same requests decide on a ``LockState`` driven directly, one after another, with the server's rng."""
    state = LockState(NPARTS, NPARTS, partition_keys(NPARTS), world_size=RANKS)
    rng = random.Random(seed)
    decided = []
    for rank, _, request in requests():
        if isinstance(request, Next):
            decided.append(state.next_bucket(rank, set(), None, rng)[1])
        else:
            decided.append(state.reserve(rank, rng))
    return decided


def test_requests_served_in_one_batch_are_decided_and_answered_as_one_at_a_time(store: TCPStore) -> None:
    """Twelve requests queued at once: the serving thread takes at least half of them in one pass, and each rank
    gets exactly one reply to each of its two requests, each sealed for that request, granting what a ``LockState`` driven
    one request at a time grants (same seed, same order)."""
    ranks = transports(store, 2, timeout_s=60.0)
    state = LockState(NPARTS, NPARTS, partition_keys(NPARTS), world_size=RANKS)
    server = LockServer(store, state, SimpleNamespace(append=lambda records: None), np.zeros(3, np.float32), 7,
                        ranks[0], prefix=PREFIX, world_size=RANKS)
    pusher = store.clone()
    try:
        asked = requests()
        with server.lock:  # the first request waits for it inside the serving thread; the others queue up
            for rank, seq, request in asked:
                pusher.queue_push(f"{PREFIX}/requests", protocol.encode_request(
                    Envelope(rank=rank, seq=seq), request, scope=PREFIX))
            deadline = time.monotonic() + 60  # (a wait for the reader, never a threshold on speed)
            while server.let_in < len(asked) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert server.let_in == len(asked)
        replies: dict[tuple[int, int], Any] = {}
        reader = store.clone()
        reader.set_timeout(timedelta(seconds=60))
        for rank, _, _ in asked:  # (a next's reply leaves once its record is stored, a reserve's at once)
            raw = reader.queue_pop(f"{PREFIX}/response/{rank}", block=True)
            for seq, request in ((1, Next()), (2, Reserve())):  # the request it answers: the one its MAC names
                try:
                    reply = protocol.decode_reply(raw, Granted if seq == 1 else Reserved, request.op,
                                                  scope=protocol.reply_scope(PREFIX, rank, "", seq))
                except protocol.Unauthentic:
                    continue
                assert (rank, seq) not in replies
                replies[rank, seq] = reply
        assert sorted(replies) == sorted((rank, seq) for rank, seq, _ in asked)  # each request answered once
        assert all(int(reader.queue_len(f"{PREFIX}/response/{rank}")) == 0 for rank in range(RANKS))
        assert [replies[rank, seq].bucket for rank, seq, _ in asked] == one_at_a_time(7)
        assert sum(replies[rank, 1].kind == "bucket" for rank in range(RANKS)) >= 2  # (and reservations made)
        assert any(replies[rank, 2].bucket is not None for rank in range(RANKS))
        stats = server.stats()
        # the serving thread took one event or a few before it waited for the lock, the rest in one go after it
        assert stats["largest_batch"] >= len(asked) // 2 and stats["batches"] < stats["events"]
    finally:
        server.stop()
