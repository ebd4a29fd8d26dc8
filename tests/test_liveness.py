"""Rank 0 finds a peer whose process died through its liveness connection (job/train/distributed/liveness.py), without waiting
out the heartbeat's peer timeout; a frozen peer and a peer that leaves in order are not declared dead through it.

The group test forms a real group of processes by hand (MASTER_ADDR/RANK/WORLD_SIZE, no torchrun, as
tests/test_startup.py does) with a peer timeout of ten minutes: a declaration within the test's hang guard can only
have come from the connection. Nothing here asserts a duration.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
from datetime import timedelta

import pytest
from helpers_distributed import free_port, wait_until

from job.train.distributed import auth
from job.train.distributed.liveness import BYE, HELLO, Liveness, liveness_key

# rank 0 prints its view (declared rank, connections lost and left, dead/<rank> keys) whenever it changes; a peer
# prints "connected" once its liveness connection is up, then leaves in order when told on stdin ("leave")
GROUP_SCRIPT = """
import json, sys, time
from job.train.distributed.group import init_distributed, leave
ctx = init_distributed("digest")
if ctx.rank == 0:
    last = None
    while True:
        view = {"dead_rank": ctx.heartbeat.dead_rank, "lost": list(ctx.liveness.lost), "left": list(ctx.liveness.left),
                "dead_keys": [r for r in range(1, ctx.world_size) if ctx.store.check([ctx.key(f"dead/{r}")])]}
        if view != last:
            print(json.dumps(view), flush=True)
            last = view
        time.sleep(0.02)
ctx.liveness.connected.wait(60)
print("connected" if ctx.liveness.connected.is_set() else "not connected", flush=True)
if sys.stdin.readline().strip() == "leave":
    leave(ctx)
    print("left", flush=True)
"""


def test_rank_0_declares_a_killed_peer_at_once_but_neither_a_frozen_one_nor_one_that_left() -> None:
    port = free_port()
    world = 4  # rank 1 is killed, rank 2 frozen, rank 3 leaves in order
    procs = []
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(world), TORCHELASTIC_RUN_ID="liveness-test", OMP_NUM_THREADS="1",
                   BIGGRAPH_PEER_INTERVAL="1", BIGGRAPH_PEER_TIMEOUT="600", PYTHONUNBUFFERED="1")
        env.pop("BIGGRAPH_RUN_ID", None)
        procs.append(subprocess.Popen([sys.executable, "-c", GROUP_SCRIPT], env=env, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    views: list[dict] = []

    def view_where(check: object) -> dict:
        """Rank 0's next printed view for which ``check(view)`` holds (views read in order)."""
        assert procs[0].stdout is not None
        for line in procs[0].stdout:
            views.append(json.loads(line))
            if check(views[-1]):  # type: ignore[operator]
                return views[-1]
        raise AssertionError(f"rank 0 ended: {procs[0].communicate()[1][-3000:]}")

    try:
        for proc in procs[1:]:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "connected", proc.communicate(timeout=60)[1][-3000:]
        assert view_where(lambda v: True)["dead_rank"] is None
        procs[2].send_signal(signal.SIGSTOP)  # frozen: its connection stays open
        assert procs[3].stdin is not None
        procs[3].stdin.write("leave\n")
        procs[3].stdin.flush()
        assert procs[3].wait(timeout=60) == 0  # left in order, and its process is gone
        assert view_where(lambda v: v["left"] == [3])["lost"] == []
        procs[1].send_signal(signal.SIGKILL)
        # the hang guard of view_where is rank 0's life: without the connection, ten minutes of heartbeat
        declared = view_where(lambda v: v["dead_rank"] is not None)
        assert declared == {"dead_rank": 1, "lost": [1], "left": [3], "dead_keys": [1]}, views
        assert procs[0].poll() is None
    finally:
        errors = []
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
            errors.append(proc.communicate()[1])
    assert "rank 1's liveness connection to rank 0 closed without a goodbye" in errors[0], errors[0][-3000:]


def store() -> object:
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def test_a_connection_of_another_round_or_rank_is_refused_and_its_end_declares_nothing(
        caplog: pytest.LogCaptureFixture) -> None:
    """A stale peer (another round's hello), a rank outside the group and a connection that never says who it is
    are refused; their end declares nothing. A peer of the round that goes without a goodbye is declared."""
    server = store()
    lost: list[int] = []
    watcher = Liveness(0, 3, "r2")
    with caplog.at_level(logging.INFO, logger="biggraph"):
        watcher.listen(server, "127.0.0.1")
        watcher.start(server, lost.append)
        port = int(server.get(liveness_key("r2")).decode().rpartition(":")[2])  # type: ignore[attr-defined]
        for hello in (b"%s r1 1\n" % HELLO, b"%s r2 3\n" % HELLO, b"%s r2 0\n" % HELLO, b"GET / HTTP/1.0\r\n\r\n", b""):
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.sendall(hello)
        assert wait_until(lambda: sum("refused a liveness connection" in r.getMessage() for r in caplog.records) == 5)
        assert lost == [] and watcher.lost == []
        with socket.create_connection(("127.0.0.1", port)) as sock:
            nonce = sock.recv(64).split(b"\n")[0].decode()
            sock.sendall(b"%s r2 2 %s\n" % (HELLO, auth.mac("liveness", "r2", "2", nonce).encode()))
        assert wait_until(lambda: lost == [2])
        watcher.close()
    messages = [r.getMessage() for r in caplog.records]
    assert any("not of round r2" in m for m in messages)
    assert any("rank 3 is not a peer of a group of 3" in m for m in messages)


def test_a_peer_that_cannot_reach_rank_0_logs_it_once_and_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    """A firewall between the pods: the peer's dial fails, it says so once, and nothing raises (the heartbeat alone
    watches it)."""
    server = store()
    closed_port = free_port()  # nothing listens there
    server.set(liveness_key("r3"), f"127.0.0.1:{closed_port}")  # type: ignore[attr-defined]
    peer = Liveness(1, 2, "r3")
    with caplog.at_level(logging.INFO, logger="biggraph"):
        peer.start(server, lambda rank: None, hosts=("127.0.0.1",))
        assert wait_until(lambda: any("cannot connect" in r.getMessage() for r in caplog.records))
        peer.close()
    assert not peer.connected.is_set()
    assert sum("cannot connect to rank 0's liveness listener" in r.getMessage() for r in caplog.records) == 1


def test_a_peer_that_leaves_in_order_is_not_declared_dead() -> None:
    server = store()
    lost: list[int] = []
    watcher = Liveness(0, 2, "r4")
    watcher.listen(server, "127.0.0.1")
    watcher.start(server, lost.append)
    peer = Liveness(1, 2, "r4")
    peer.start(server, lambda rank: None, hosts=("127.0.0.1",))
    assert peer.connected.wait(30)
    peer.close()
    assert wait_until(lambda: watcher.left == [1])
    watcher.close()
    assert lost == [] and watcher.lost == []


# every rank watches rank 0 (issue 44) ------------------------------------------------------------------------------

RANK0_SCRIPT = """
import sys, time
from datetime import timedelta
from torch.distributed import TCPStore
from job.train.distributed.liveness import Liveness
store = TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=30))
watcher = Liveness(0, 2, "r9", ping_interval_s=0.2, silent_after_s=2.0)
watcher.listen(store, "127.0.0.1")
watcher.start(store, lambda rank: None)
print("listening", flush=True)
time.sleep(600)
"""


def _rank0_process(server: object) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", RANK0_SCRIPT, str(server.port)],  # type: ignore[attr-defined]
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "listening"
    return proc


@pytest.mark.parametrize("how", ["frozen", "killed"])
def test_a_peer_leaves_the_round_when_rank_0_is_frozen_or_gone(how: str) -> None:
    """Rank 0 (a process of its own) pings its peers; a peer that hears nothing for the peer timeout (rank 0
    SIGSTOPped: its store would freeze with it) or sees the connection end without a goodbye (SIGKILLed) calls its
    ``on_rank0_lost``, whatever the store does."""
    server = store()
    proc = _rank0_process(server)
    lost: list[str] = []
    peer = Liveness(1, 2, "r9", ping_interval_s=0.2, silent_after_s=2.0)
    try:
        peer.start(server, lambda rank: None, hosts=("127.0.0.1",), on_rank0_lost=lost.append)
        assert peer.connected.wait(30)
        assert not wait_until(lambda: bool(lost), seconds=4.0)  # pings arrive: rank 0 is not lost while it runs
        os.kill(proc.pid, signal.SIGSTOP if how == "frozen" else signal.SIGKILL)
        assert wait_until(lambda: bool(lost), seconds=60.0)  # a hang guard
        expected = "sent nothing" if how == "frozen" else "closed without a goodbye"
        assert expected in lost[0] and len(lost) == 1
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()
        peer.close()


def test_rank_0_leaving_in_order_is_not_a_loss() -> None:
    server = store()
    watcher = Liveness(0, 2, "r10", ping_interval_s=0.2, silent_after_s=2.0)
    watcher.listen(server, "127.0.0.1")
    watcher.start(server, lambda rank: None)
    lost: list[str] = []
    peer = Liveness(1, 2, "r10", ping_interval_s=0.2, silent_after_s=2.0)
    peer.start(server, lambda rank: None, hosts=("127.0.0.1",), on_rank0_lost=lost.append)
    assert peer.connected.wait(30)
    watcher.close()  # rank 0 leaves first here: its goodbye reaches the peer
    assert not wait_until(lambda: bool(lost), seconds=4.0)
    peer.close()
    assert lost == []


def test_rank_0_leaving_before_it_read_a_peers_hello_is_not_a_loss() -> None:
    """Rank 0 may leave between accepting a peer's connection and reading its hello: its goodbye then follows the
    nonce at once and often arrives in the same read as it. A listener that sends both in one write and closes (what
    rank 0's watcher does then) is rank 0 leaving in order, not rank 0 lost (CI once saw the opposite)."""
    server = store()
    listener = socket.create_server(("127.0.0.1", 0))
    server.set(liveness_key("r11"), f"127.0.0.1:{listener.getsockname()[1]}")  # type: ignore[attr-defined]
    lost: list[str] = []
    peer = Liveness(1, 2, "r11", ping_interval_s=0.2, silent_after_s=2.0)
    try:
        peer.start(server, lambda rank: None, hosts=("127.0.0.1",), on_rank0_lost=lost.append)
        conn, _ = listener.accept()
        conn.sendall(b"0123456789abcdef\n" + BYE)
        conn.close()
        assert peer.connected.wait(30)
        assert not wait_until(lambda: bool(lost), seconds=4.0), lost
    finally:
        peer.close()
        listener.close()


def test_rank_0s_goodbye_ends_the_stream_in_order_even_with_bytes_it_never_read() -> None:
    """Rank 0 leaving with a peer's bytes unread (a hello that came after the watcher's last read): its close must not
    become a reset. The peer reads the goodbye and then the end of the stream; a plain close would have sent a
    reset (and dropped a goodbye that Nagle's algorithm still held), which the peer takes for rank 0's death."""
    from job.train.distributed.liveness import _part

    with socket.create_server(("127.0.0.1", 0)) as listener:
        peer = socket.create_connection(listener.getsockname()[:2], timeout=5)
        conn, _ = listener.accept()
        with peer, conn:
            conn.setblocking(False)
            peer.sendall(b"a hello rank 0 never read\n")
            assert wait_until(lambda: bool(select.select([conn], [], [], 0)[0]), 5)  # the peer's bytes arrived
            _part(conn)
            conn.close()
            assert peer.recv(64) == BYE
            assert peer.recv(64) == b""  # the end of the stream: not ConnectionResetError


SLOW_PARTING_RANK0 = """
import sys, time
from datetime import timedelta
from torch.distributed import TCPStore
from job.train.distributed import liveness
store = TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=30))
watcher = liveness.Liveness(0, 2, "r12", ping_interval_s=0.2, silent_after_s=30.0)
watcher.listen(store, "127.0.0.1")
watcher.start(store, lambda rank: None)
print("listening", flush=True)
sys.stdin.readline()
part = liveness._part
liveness._part = lambda sock: (time.sleep(6.0), part(sock))  # the watcher starved of the CPU for 6 s
watcher.close()
print("left", flush=True)
"""


def test_rank_0_leaving_with_a_starved_watcher_still_says_goodbye_before_its_process_exits() -> None:
    """Rank 0 leaves in order and its process exits at once. Its watcher thread sends the goodbyes; a watcher that
    gets the CPU late (here 6 s late, as under load) must still send them before the exit closes the sockets, or
    every peer takes the orderly leaving for rank 0's death (exit 76: CI's test_startup, with a 5 s wait)."""
    server = store()
    proc = subprocess.Popen([sys.executable, "-c", SLOW_PARTING_RANK0, str(server.port)],  # type: ignore[attr-defined]
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    lost: list[str] = []
    peer = Liveness(1, 2, "r12", ping_interval_s=0.2, silent_after_s=30.0)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "listening"
        peer.start(server, lambda rank: None, hosts=("127.0.0.1",), on_rank0_lost=lost.append)
        assert peer.connected.wait(30)
        assert proc.stdin is not None
        proc.stdin.write("leave\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "left"
        assert proc.wait(timeout=60) == 0
        assert not wait_until(lambda: bool(lost), seconds=2.0), lost
    finally:
        proc.kill()
        proc.wait()
        peer.close()


def test_rank_0_leaving_says_goodbye_even_when_its_watcher_sees_the_flag_before_the_wake() -> None:
    """``close`` marks the watcher closed, then wakes it. A watcher that returns from its wait in between (a ping
    due, another event) sees the flag first and leaves its loop without reading the wake: it must still say goodbye
    to every peer, not close the connections plainly (each peer then took rank 0's orderly leaving for its death)."""
    server = store()
    watcher = Liveness(0, 2, "r13", ping_interval_s=0.05, silent_after_s=30.0)
    watcher.listen(server, "127.0.0.1")
    watcher.start(server, lambda rank: None)
    lost: list[str] = []
    peer = Liveness(1, 2, "r13", ping_interval_s=0.05, silent_after_s=30.0)
    try:
        peer.start(server, lambda rank: None, hosts=("127.0.0.1",), on_rank0_lost=lost.append)
        assert peer.connected.wait(30)
        watcher._closed = True  # the race's first half only: the flag set, the wake never sent
        assert watcher._thread is not None
        watcher._thread.join(timeout=30)  # the next ping's timeout ends the loop on the flag
        assert not watcher._thread.is_alive()
        assert not wait_until(lambda: bool(lost), seconds=2.0), lost
    finally:
        peer.close()
        for end in (watcher._listener, *(watcher._wake or ())):  # what ``close`` would have closed after its wake
            if end is not None:
                end.close()
