"""A frozen peer is found whatever a forger writes into the store (issue 44).

A SIGSTOPped process keeps its liveness connection open, so rank 0 finds it through the heartbeat alone; when the
beat was a counter anyone could ``add`` to, a client of the store that kept bumping it hid the frozen peer for as long
as it bumped. The peer here is a real process beating into a real TCPStore; rank 0's watcher runs in the test; the
forger is another store client without the group's secret.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import timedelta

import pytest
from helpers_distributed import wait_until
from torch.distributed import TCPStore

from job.train.distributed import auth
from job.train.distributed.heartbeat import Heartbeat, beat_count, beat_value, read_beat, round_key

ROUND = "r-frozen"
SECRET = "a-group-secret-for-the-frozen-peer-test"

PEER = """
import sys, time
from datetime import timedelta
from torch.distributed import TCPStore
from job.train.distributed.heartbeat import Heartbeat
store = TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=30))
beat = Heartbeat(store, 1, 2, interval=0.1, dead_after=1.0, round_id=sys.argv[2])
print("beating", flush=True)
time.sleep(600)
"""


@pytest.fixture(autouse=True)
def group_secret() -> Iterator[None]:
    auth.reset_for_tests(SECRET.encode())
    yield
    auth.reset_for_tests(None)


def test_a_beat_counts_only_with_its_mac_for_its_rank_and_round() -> None:
    good = beat_value(ROUND, 1, 7)
    assert beat_count(good, ROUND, 1) == 7
    count, _, proof = good.partition(" ")
    assert beat_count(f"8 {proof}", ROUND, 1) == 0  # a bumped count under the old MAC
    assert beat_count(good, ROUND, 2) == 0 and beat_count(good, "r-other", 1) == 0  # another rank's, round's
    assert beat_count("7", ROUND, 1) == 0 and beat_count("", ROUND, 1) == 0 and beat_count("x y", ROUND, 1) == 0
    assert beat_count(f"7 {auth.mac('heartbeat', ROUND, '1', '7', key=b'a-guess-0123456789')}", ROUND, 1) == 0


def forge(store: TCPStore, stop: threading.Event) -> None:
    """Keep rank 1's beat looking alive without the secret: a count above the last one under its old MAC, an old
    beat replayed, a bare counter as the old protocol had it, and the key deleted."""
    key = round_key(ROUND, "heartbeat/1")
    seen = ""
    bumped = 10**6
    while not stop.is_set():
        raw = store.compare_set(key, "\x00none", "\x00none").decode(errors="replace")
        if beat_count(raw, ROUND, 1):
            seen = raw
        bumped += 1
        _, _, proof = seen.partition(" ")
        for value in (f"{bumped} {proof}", seen, str(bumped)):
            if value:
                store.set(key, value)
        store.delete_key(key)
        store.set(key, f"{bumped} {proof}")
        stop.wait(0.01)


@pytest.mark.slow
def test_a_sigstopped_peer_is_declared_dead_while_a_forger_bumps_its_beat() -> None:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    env = {**os.environ, auth.SECRET_ENV: SECRET}
    peer = subprocess.Popen([sys.executable, "-c", PEER, str(store.port), ROUND], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    watcher = Heartbeat(store, 0, 2, interval=0.1, dead_after=1.0, round_id=ROUND, first_beat_after=120)
    forger_store = TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=30))
    stop = threading.Event()
    forger = threading.Thread(target=forge, args=(forger_store, stop), daemon=True)
    try:
        assert wait_until(lambda: read_beat(store, ROUND, 1) > 5, seconds=120), "the peer never beat"
        assert watcher.dead_rank is None  # alive and beating: not declared
        forger.start()
        os.kill(peer.pid, signal.SIGSTOP)
        assert wait_until(lambda: watcher.dead_rank is not None, seconds=60), "the frozen peer stayed hidden"
        assert watcher.dead_rank == 1 and forger.is_alive()  # found while the forger still wrote
        declared = store.get(round_key(ROUND, "dead/1")).decode()
        assert auth.verify(declared, "dead", ROUND, "1")  # fenced by rank 0's own declaration
    finally:
        stop.set()
        forger.join(timeout=10)
        watcher.stop()
        peer.kill()
        peer.wait(timeout=30)
