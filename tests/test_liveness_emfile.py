"""Rank 0's liveness listener out of file descriptors (issue 44): it backs off instead of spinning, accepts again
once descriptors are free, and a real peer then connects and is watched.

Rank 0 runs in a subprocess whose ``RLIMIT_NOFILE`` is lowered and whose descriptors are then all taken, so its
``accept`` fails with EMFILE while connections wait in the listen backlog (the kernel completes their handshakes).
The listener's ``_accept`` is counted: spinning on a listener that stays readable would call it thousands of times
a second; backing off calls it about once per ``ACCEPT_BACKOFF_S``.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from job.train.distributed.liveness import ACCEPT_BACKOFF_S, Liveness, liveness_key

ROUND = "r-emfile"

RANK0 = """
import json, os, resource, sys, time
from datetime import timedelta
from torch.distributed import TCPStore
from job.train.distributed import liveness as lv

store = TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=30))
calls = []
accept = lv.Liveness._accept
def counted(self, selector, hellos):
    accepted = accept(self, selector, hellos)
    calls.append(accepted)
    return accepted
lv.Liveness._accept = counted
watcher = lv.Liveness(0, 3, sys.argv[2], ping_interval_s=0.1)
watcher.listen(store, "127.0.0.1")
watcher.start(store, lambda rank: None)
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (128, hard))
held = []
try:
    while True:
        held.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
print("exhausted", flush=True)
sys.stdin.readline()  # the test's connections wait in the backlog now
started = time.monotonic()
# at least 2 s out of descriptors, and until the listener has met EMFILE once (a loaded machine may not give its
# thread the CPU within 2 s: the test then waited for nothing and read 0 failures)
while time.monotonic() < started + 2.0 or (calls.count(False) == 0 and time.monotonic() < started + 60):
    time.sleep(0.05)
exhausted_for = time.monotonic() - started
failed = calls.count(False)
for fd in held:
    os.close(fd)
print(json.dumps({"failed": failed, "exhausted_for": exhausted_for, "refused": watcher.refused}), flush=True)
deadline = time.monotonic() + 60
while watcher.left != [1] and time.monotonic() < deadline:
    time.sleep(0.01)
print(json.dumps({"left": watcher.left, "lost": watcher.lost, "accepted": calls.count(True)}), flush=True)
watcher.close()
"""


@pytest.mark.slow
def test_the_listener_backs_off_on_emfile_then_accepts_a_real_peer() -> None:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    rank0 = subprocess.Popen([sys.executable, "-c", RANK0, str(store.port), ROUND], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    waiting: list[socket.socket] = []
    peer = None
    try:
        assert rank0.stdout is not None and rank0.stdin is not None
        assert rank0.stdout.readline().strip() == "exhausted", rank0.stderr.read() if rank0.stderr else ""
        port = int(store.get(liveness_key(ROUND)).decode().rpartition(":")[2])
        for _ in range(5):  # completed by the kernel, never accepted while rank 0 has no descriptor to spare
            waiting.append(socket.create_connection(("127.0.0.1", port), timeout=30))
        rank0.stdin.write("go\n")
        rank0.stdin.flush()
        exhausted = json.loads(rank0.stdout.readline())
        assert exhausted["failed"] >= 1 and exhausted["refused"] >= 1  # it did run out, and said so
        # backing off: about one try per ACCEPT_BACKOFF_S (spinning would be thousands)
        assert exhausted["failed"] <= exhausted["exhausted_for"] / ACCEPT_BACKOFF_S + 2
        # descriptors free again: a real peer connects, is identified, and its goodbye is read
        peer = Liveness(1, 3, ROUND)
        peer.start(store, lambda rank: None, hosts=("127.0.0.1",))
        assert peer.connected.wait(30)
        peer.close()
        after = json.loads(rank0.stdout.readline())
        assert after["left"] == [1] and after["lost"] == []
        assert after["accepted"] >= 6  # the five that waited in the backlog, then the peer
        assert rank0.wait(timeout=60) == 0
    finally:
        for sock in waiting:
            sock.close()
        if peer is not None:
            peer.close()
        rank0.kill()
        rank0.wait(timeout=30)
