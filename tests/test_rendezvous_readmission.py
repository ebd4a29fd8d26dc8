"""job/train/elastic/agent.py: a node that torch's c10d rendezvous dropped while its store stalled is readmitted.

Real parts: the rendezvous store runs in a process of its own, stalled with SIGSTOP as a frozen store-host pod
is; the handlers are torch's own (``registry.get_rendezvous_handler``), as torchrun's agents create them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from job.train.elastic.agent import BiggraphAgent, nodes_waiting

STORE = """
import sys, time
from torch.distributed import TCPStore
store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
print(store.port, flush=True)
time.sleep(600)
"""


@pytest.fixture
def store_process() -> Iterator[tuple[subprocess.Popen, int]]:
    proc = subprocess.Popen([sys.executable, "-c", STORE], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        yield proc, port
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()


def _handler(port: int) -> Any:
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import _create_c10d_handler

    # the chart's rendezvous settings (2 s x 3 attempts), shortened: a keep-alive window of 3 s (1 s x 3 attempts)
    params = RendezvousParameters(backend="c10d", endpoint=f"127.0.0.1:{port}", run_id="readmit", min_nodes=2,
                                  max_nodes=3, join_timeout=60, last_call_timeout=1, keep_alive_interval=1,
                                  keep_alive_max_attempt=3, is_host=False)
    return _create_c10d_handler(params)


def _rendezvous_all(handlers: list[Any]) -> list[Any]:
    """``next_rendezvous`` of every handler at once (each blocks until the round completes): their results."""
    results: list[Any] = [None] * len(handlers)
    errors: list[BaseException] = []

    def join(i: int) -> None:
        try:
            results[i] = handlers[i].next_rendezvous()
        except BaseException as err:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(err)

    threads = [threading.Thread(target=join, args=(i,)) for i in range(len(handlers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    assert not errors, errors
    return results


def test_agents_dropped_while_the_store_stalled_restart_to_admit_a_node_that_joins_after(
        store_process: tuple[subprocess.Popen, int]) -> None:
    proc, port = store_process
    plain, readmitted = _handler(port), _handler(port)
    first = _rendezvous_all([plain, readmitted])
    assert sorted(info.world_size for info in first) == [2, 2]
    assert plain.num_nodes_waiting() == 0 and nodes_waiting(readmitted) == 0  # a healthy round: nobody waits

    os.kill(proc.pid, signal.SIGSTOP)  # the store host frozen past the keep-alive window
    time.sleep(6)
    os.kill(proc.pid, signal.SIGCONT)
    time.sleep(2.5)  # the heartbeats that were blocked go through; the first sync drops both stale nodes

    # a node that joins now (a replacement, a scale-up) starts a new round alone and waits there for min_nodes
    newcomer = _handler(port)
    joined: list[Any] = []
    thread = threading.Thread(target=lambda: joined.append(newcomer.next_rendezvous()))
    thread.start()
    deadline = time.monotonic() + 30
    while nodes_waiting(readmitted) == 0:
        assert time.monotonic() < deadline, "the dropped agent never saw the round forming without it"
        time.sleep(0.2)
    # torch's own count: the newcomer is a participant of the new round, not on the wait list, so an agent that
    # only reads the wait list never restarts for it (the deadlock job/train/elastic/agent.py exists for)
    assert plain.num_nodes_waiting() == 0

    # what torchrun does on a positive count: its workers stop and it joins the next round, with the newcomer
    again = readmitted.next_rendezvous()
    thread.join(60)
    assert joined, "the newcomer was not admitted"
    assert again.world_size == 2 and joined[0].world_size == 2
    assert {again.rank, joined[0].rank} == {0, 1}
    for handler in (plain, readmitted, newcomer):
        handler.shutdown()


def test_the_agent_counts_the_nodes_of_a_round_formed_without_it_as_waiting() -> None:
    """``BiggraphAgent._nodes_waiting`` (what its monitoring loop acts on) is torch's count, or the readmission's when
    torch's is 0; torch's ``LocalElasticAgent`` is its base class, nothing in torch's registry replaced."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class State:
        participants = {"other-a": 0, "other-b": 1}
        wait_list: set = set()

    class Handler:
        _this_node = "me"
        _state_holder = type("Holder", (), {"state": State()})()

        def __init__(self, waiting: int) -> None:
            self.waiting = waiting

        def num_nodes_waiting(self) -> int:
            return self.waiting

    assert issubclass(BiggraphAgent, LocalElasticAgent)
    agent = BiggraphAgent.__new__(BiggraphAgent)
    agent._warned_evicted = False
    for torch_count, expected in ((0, 2), (1, 1)):
        agent._worker_group = type("Group", (), {"spec": type("Spec", (), {"rdzv_handler": Handler(torch_count)})()})()
        assert agent._nodes_waiting() == expected
    State.participants["me"] = 2  # still a participant: torch's answer unchanged
    agent._worker_group = type("Group", (), {"spec": type("Spec", (), {"rdzv_handler": Handler(0)})()})()
    assert agent._nodes_waiting() == 0
