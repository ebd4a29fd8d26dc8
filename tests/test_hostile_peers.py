"""A hostile neighbour against the group's server (issue 44): real ``LockServer``, real TCPStore, real gloo transport,
a real progress log, a real liveness listener, all on 127.0.0.1. The attacker is any client of rank 0's store or
listener without the group's secret (job/train/distributed/auth.py), or an insider sending what no trainer sends.

After each attack the server answers a ``status`` and nothing it persisted or decided changed (no corrupted
version, no update lost or doubled).
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers_distributed import partition_keys, transports, wait_until
from torch.distributed import TCPStore

from job.checkpoint.group_progress import ProgressLog
from job.train.distributed import auth, protocol
from job.train.distributed.group import DistributedContext
from job.train.distributed.liveness import HELLO, Liveness, liveness_key
from job.train.distributed.lock_client import LockClient
from job.train.distributed.lock_server import LockServer
from job.train.distributed.lock_state import LockState
from job.train.distributed.protocol import LockServerError

ROUND = "r-hostile"
PREFIX = f"biggraph/{ROUND}/lock"
SECRET = b"the-group-secret-of-this-test-0123456789"


@pytest.fixture(autouse=True)
def group_secret() -> Iterator[None]:
    auth.reset_for_tests(SECRET)
    yield
    auth.reset_for_tests(None)


class Served:
    def __init__(self, store: TCPStore, tmp_path: Path) -> None:
        self.store = store
        self.ranks = transports(store, 2, timeout_s=30.0)
        self.log_dir = tmp_path / "checkpoint"
        log = ProgressLog(str(self.log_dir), "run", 1, compact_every=0)
        state = LockState(4, 4, partition_keys(4), world_size=2)
        log.start(state.to_json(), np.zeros(3, np.float32))
        self.server = LockServer(store, state, log, np.zeros(3, np.float32), 0, self.ranks[0], prefix=PREFIX,
                                 world_size=2)
        self.rank0 = LockClient(store, 0, timeout_s=60, prefix=PREFIX, transport=self.ranks[0])
        self.rank1 = LockClient(store, 1, timeout_s=60, prefix=PREFIX, transport=self.ranks[1])
        self.attacker = TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=30))

    def persisted(self) -> dict[str, bytes]:
        return {str(p.relative_to(self.log_dir)): p.read_bytes() for p in sorted(self.log_dir.rglob("*")) if p.is_file()}

    def push(self, raw: bytes) -> None:
        self.attacker.queue_push(f"{PREFIX}/requests", raw)
        self.attacker.queue_len(f"{PREFIX}/requests")  # the push is queued before the next question

    def unchanged_after(self, attack: Any) -> None:
        """Run ``attack``; then the server answers a status and neither its state nor what it persisted moved. (A grant
        is answered before its record is stored, job/train/distributed/commits.py: what was persisted is read once
        every record decided so far is.)"""
        wait_stored(self.server)
        state, files = self.rank0.status(), self.persisted()
        attack()
        assert self.rank0.status() == state
        wait_stored(self.server)
        assert self.persisted() == files
        assert self.server.thread.is_alive()


def wait_stored(server: LockServer) -> None:
    """Until the records of every request ``server`` decided are stored (a hang guard, not a timing threshold)."""
    assert wait_until(server.stored), "the server's records were never stored"


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    group = Served(store, tmp_path)
    try:
        yield group
    finally:
        group.server.stop()


def forged(message: dict[str, Any], scope: str = PREFIX) -> bytes:
    """``message`` sealed as an attacker would: under a key that is not the group's."""
    body = json.dumps(message, sort_keys=True)
    return protocol.pack({**message, "mac": auth.mac("lock", scope, body, key=b"a-guess-at-the-secret-000000")})


def test_forged_release_written_and_stop_change_nothing(served: Served) -> None:
    kind, bucket, _ = served.rank1.next_bucket(set(), None, None)
    assert kind == "bucket" and bucket is not None
    held = [["node", bucket.lhs], ["node", bucket.rhs]]
    served.unchanged_after(lambda: served.push(forged({"op": "release", "rank": 1, "channel": "", "seq": 2**62,
                                                       "keys": held, "written": True})))
    served.unchanged_after(lambda: served.push(forged({"op": "written", "rank": 1, "channel": "", "seq": 2**62,
                                                       "keys": held, "staged": [["node", 0, "x"]]})))
    served.unchanged_after(lambda: served.push(protocol.pack({"op": "release", "rank": 1, "channel": "",
                                                              "keys": held, "written": True})))  # no MAC at all
    served.unchanged_after(lambda: served.push(forged({"op": "stop", "rank": -1, "server": served.server.server_id})))
    assert served.server.thread.is_alive()
    assert served.server._gate.dropped["unauthentic"] == 4
    # the rank that holds the bucket still finishes it and gets the next one
    kind, _, _ = served.rank1.next_bucket({("node", bucket.lhs), ("node", bucket.rhs)}, bucket, None)
    assert kind in ("bucket", "wait")


def test_a_forged_dead_key_fences_no_live_rank(served: Served) -> None:
    ctx = DistributedContext(rank=1, world_size=2, store=served.store, restart_count=0, round_id=ROUND)
    served.attacker.set(f"biggraph/{ROUND}/dead/1", "1")
    served.attacker.set(f"biggraph/{ROUND}/dead/1", auth.mac("dead", ROUND, "1", key=b"not-the-secret-0000000"))
    ctx.fence()  # still writes
    served.unchanged_after(lambda: None)


def test_a_huge_sync_malformed_json_and_an_unknown_op(served: Served) -> None:
    # from outside: dropped unanswered
    served.unchanged_after(lambda: served.push(forged({"op": "sync", "rank": 1, "channel": "", "seq": 2**62,
                                                       "values": 2**42, "tag": 1})))
    served.unchanged_after(lambda: served.push(b"{not json"))
    served.unchanged_after(lambda: served.push(forged({"op": "frobnicate", "rank": 1, "channel": "", "seq": 2**62})))
    # from an insider (the secret, but not what a trainer sends): answered with the server's error
    with pytest.raises(LockServerError, match="frobnicate"):
        served.rank1._call({"op": "frobnicate"})
    huge = protocol.seal({"op": "sync", "rank": 1, "channel": "huge", "seq": 1, "values": 2**42, "tag": 9}, PREFIX)
    served.push(huge)  # no buffer is sized from it: refused unreceived, the rank treated as gone
    assert wait_until(lambda: 1 in served.server.gone())
    assert served.rank0.sync(torch.tensor([1.0, 2.0, 3.0])).tolist() == [1.0, 2.0, 3.0]
    assert served.server.thread.is_alive()


def test_forged_and_malformed_sparse_rows_and_pulls_change_nothing(served: Served) -> None:
    """The fields of sparse shared parameters (issue #45): a forged pull or sparse change is dropped; an insider's
    pull or sparse change that names rows these parameters do not have, or rows that are not a list of ascending ids,
    is refused with the server's error, its payload taken and its buffer given back."""
    forged_pull = {"op": "pull", "rank": 1, "channel": "", "seq": 2**62, "rows": [0], "pull_tag": 1}
    served.unchanged_after(lambda: served.push(forged(forged_pull)))
    served.unchanged_after(lambda: served.push(forged({"op": "next", "rank": 1, "channel": "", "seq": 2**62,
                                                       "rows": [0], "values": 1, "tag": 3})))
    assert served.server._gate.dropped["unauthentic"] == 2

    def insider(message: dict[str, Any], change: Any, why: str) -> None:
        with pytest.raises(LockServerError, match=why):
            served.rank1._call(message, change, back=False)

    # (the parameters of this server have no relation rows: every row named is out of range)
    served.unchanged_after(lambda: insider({"op": "pull", "rows": [0], "pull_tag": 4}, None, "no relation-indexed"))
    served.unchanged_after(lambda: insider({"op": "pull", "rows": {"0": 1}, "pull_tag": 4}, None, "'rows' is not a"))
    served.unchanged_after(lambda: insider({"op": "next", "rows": [0]}, torch.ones(1), "no relation-indexed"))
    served.unchanged_after(lambda: insider({"op": "next", "rows": [2, 1]}, torch.ones(1), "not strictly ascending"))
    assert wait_until(lambda: served.server._slots.sparse_held == 0, 10) and not served.server.gone()
    assert served.rank1.sync(torch.zeros(3)).tolist() == [0.0, 0.0, 0.0]  # the rank's pair still carries its sums


def test_replays_from_an_earlier_round_and_of_this_one_are_dropped(served: Served) -> None:
    release = protocol.Release(keys=(("node", 0),), written=True)
    envelope = protocol.Envelope(1, "", None, time.time_ns())  # numbered past anything rank 1 sent: only the round
    earlier = protocol.encode_request(envelope, release, scope="biggraph/r-earlier/lock")  # an authentic old one
    served.unchanged_after(lambda: served.push(earlier))
    assert served.server._gate.dropped["unauthentic"] == 1
    # this round's own request, sent twice: the second is a replay
    first = protocol.encode_request(protocol.Envelope(1, "", None, served.rank1.seq + 1), release, scope=PREFIX)
    served.rank1.seq += 1  # the client numbers past it, as if it had sent it itself
    served.push(first)
    served.rank1.store.queue_pop(served.rank1.responses, block=True)  # its answer
    served.unchanged_after(lambda: served.push(first))
    assert served.server._gate.dropped["replayed"] == 1
    assert served.rank1.status() == served.rank0.status()  # rank 1's own numbering goes on


@pytest.fixture
def listener() -> Iterator[tuple[Liveness, TCPStore, list[int]]]:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    lost: list[int] = []
    watcher = Liveness(0, 3, ROUND, ping_interval_s=0.2, silent_after_s=5.0)
    watcher.listen(store, "127.0.0.1")
    watcher.start(store, lost.append)
    try:
        yield watcher, store, lost
    finally:
        watcher.close()


def _port(store: TCPStore) -> int:
    return int(store.get(liveness_key(ROUND)).decode().rpartition(":")[2])


def test_a_hello_with_a_stolen_round_id_declares_no_one_dead(listener: tuple[Liveness, TCPStore, list[int]]) -> None:
    """The round id is in the logs; the secret is not. A hello that names the round and a rank but cannot answer
    the connection's nonce, or that replays another connection's good answer, is refused, and its end declares
    nothing."""
    watcher, store, lost = listener
    port = _port(store)
    with socket.create_connection(("127.0.0.1", port)) as first:
        nonce = first.recv(64).split(b"\n")[0].decode()
        good = auth.mac("liveness", ROUND, "1", nonce)
        with socket.create_connection(("127.0.0.1", port)) as second:  # the good answer, on another connection
            second.recv(64)
            second.sendall(b"%s %s 1 %s\n" % (HELLO, ROUND.encode(), good.encode()))
        with socket.create_connection(("127.0.0.1", port)) as third:
            third.recv(64)
            third.sendall(b"%s %s 2 %s\n" % (HELLO, ROUND.encode(), b"0" * 64))
        assert wait_until(lambda: watcher.refused == 2)
    assert wait_until(lambda: watcher.refused == 3)  # the first never said hello: closed by the attacker, refused
    assert lost == [] and watcher.lost == []
    peer = Liveness(2, 3, ROUND)  # the real rank 2 still connects, and is watched
    peer.start(store, lambda rank: None, hosts=("127.0.0.1",))
    assert peer.connected.wait(30)
    peer.close()
    assert wait_until(lambda: watcher.left == [2])


def test_five_thousand_idle_connections_leave_the_listener_serving(
        listener: tuple[Liveness, TCPStore, list[int]]) -> None:
    """The machine allows 20,000 open files (``ulimit -n``): 5,000 idle connections fit on the attacker's side. The
    listener holds at most ``MAX_PENDING`` of them (the oldest give way), so a real peer connecting after them
    still says hello and is watched."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    count = 5000
    assert soft > count + 500, f"ulimit -n is {soft}: too low for {count} connections and the test's own files"
    # (the listener's own side is bounded: it holds at most MAX_PENDING of them)
    watcher, store, lost = listener
    port = _port(store)
    idle = []
    try:
        for _ in range(count):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=30))
        assert wait_until(lambda: watcher.refused >= count - 64)
        peer = Liveness(1, 3, ROUND)
        peer.start(store, lambda rank: None, hosts=("127.0.0.1",))
        assert peer.connected.wait(30)
        for sock in idle:
            sock.close()
        peer.close()
        assert wait_until(lambda: watcher.left == [1])
        assert lost == []
    finally:
        for sock in idle:
            sock.close()
