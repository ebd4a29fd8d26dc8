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

from job.train.elastic.agent import install, readmitting

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


def _handler(port: int, readmit: bool) -> Any:
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import _create_c10d_handler

    # the chart's rendezvous settings (2 s x 3 attempts), shortened: a keep-alive window of 3 s (1 s x 3 attempts)
    params = RendezvousParameters(backend="c10d", endpoint=f"127.0.0.1:{port}", run_id="readmit", min_nodes=2,
                                  max_nodes=3, join_timeout=60, last_call_timeout=1, keep_alive_interval=1,
                                  keep_alive_max_attempt=3, is_host=False)
    handler = _create_c10d_handler(params)
    return readmitting(handler) if readmit else handler


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
    plain, readmitted = _handler(port, readmit=False), _handler(port, readmit=True)
    first = _rendezvous_all([plain, readmitted])
    assert sorted(info.world_size for info in first) == [2, 2]
    assert plain.num_nodes_waiting() == 0 and readmitted.num_nodes_waiting() == 0  # a healthy round: nobody waits

    os.kill(proc.pid, signal.SIGSTOP)  # the store host frozen past the keep-alive window
    time.sleep(6)
    os.kill(proc.pid, signal.SIGCONT)
    time.sleep(2.5)  # the heartbeats that were blocked go through; the first sync drops both stale nodes

    # a node that joins now (a replacement, a scale-up) starts a new round alone and waits there for min_nodes
    newcomer = _handler(port, readmit=False)
    joined: list[Any] = []
    thread = threading.Thread(target=lambda: joined.append(newcomer.next_rendezvous()))
    thread.start()
    deadline = time.monotonic() + 30
    while readmitted.num_nodes_waiting() == 0:
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


def test_install_makes_torchs_c10d_backend_return_readmitting_handlers(
        store_process: tuple[subprocess.Popen, int]) -> None:
    from torch.distributed.elastic.rendezvous import RendezvousParameters, registry

    before = dict(registry.handler_registry._registry)
    try:
        assert install() is None
        _, port = store_process
        handler = registry.get_rendezvous_handler(RendezvousParameters(
            backend="c10d", endpoint=f"127.0.0.1:{port}", run_id="installed", min_nodes=1, max_nodes=1,
            is_host=False))
        assert handler.num_nodes_waiting.__qualname__.startswith("readmitting")
    finally:
        registry.handler_registry._registry.clear()
        registry.handler_registry._registry.update(before)
