"""A bucket that cannot end before its round's drain deadline is given up (job/train/schedule/clock.py): the clock's
estimate, the batch loop's and the Hogwild pool's stop, the lock server not waiting for a rank in vain, and a
Hogwild worker outliving the agent's SIGTERM while its trainer decides."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from helpers_distributed import partition_keys, transports, wait_until
from helpers_graphs import base_config
from torch.distributed import TCPStore

from job.config import parse_config
from job.model.kernel_options import KernelOptions
from job.model.scoring import Model, Table
from job.train.batch import batching
from job.train.batch.batching import process_edges, split_almost_equally
from job.train.batch.optim import RelationAdagrad
from job.train.batch.step import BatchContext, BatchStats, BucketAbandoned
from job.train.distributed.lock_client import LockClient
from job.train.distributed.lock_server import LockServer
from job.train.distributed.lock_state import LockState
from job.train.hogwild.pool import WorkerPool
from job.train.inputs import EdgeTensors
from job.train.schedule.clock import BucketClock

EDGES = 2_000
BATCH = 100
PREFIX = "biggraph/test-round/lock"


def test_the_clock_expects_the_median_of_the_last_buckets_and_unknown_may_end() -> None:
    clock = BucketClock()
    clock.start(100.0)
    assert clock.ends_by(101.0, 100.5)  # nothing timed yet: tried until the deadline itself
    assert not clock.ends_by(101.0, 101.0)  # the deadline has passed
    clock.finish(110.0)  # 10 s
    for took in (2.0, 3.0):
        clock.start(200.0)
        clock.finish(200.0 + took)
    clock.start(300.0)
    assert clock.expected_end() == 303.0  # the median of 10, 2, 3
    assert clock.ends_by(303.0, 301.0) and not clock.ends_by(302.9, 301.0)
    clock.drop()  # given up: not timed, nothing in flight
    assert not clock.in_flight and clock.expected_end() is None
    clock.finish(400.0)  # a finish without a start times nothing
    clock.start(500.0)
    assert clock.expected_end() == 503.0


def _edges() -> EdgeTensors:
    generator = torch.Generator().manual_seed(0)
    return EdgeTensors(torch.randint(0, 3, (EDGES,), generator=generator), torch.arange(EDGES),
                       torch.randint(0, EDGES, (EDGES,), generator=generator))


def _config(tmp_path: Path) -> Any:
    return parse_config(base_config(tmp_path, {"e": 1}, [(f"r{i}", "e", "e") for i in range(3)], batch_size=BATCH))


def test_the_batch_loop_gives_the_bucket_up_when_stop_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trained: list[int] = []

    def record(ctx: Any, rel_idx: int, lhs: torch.Tensor, *args: Any, **kwargs: Any) -> BatchStats:
        trained.extend(lhs.tolist())
        return BatchStats(count=int(lhs.numel()))

    monkeypatch.setattr(batching, "run_batch", record)
    polls: list[int] = []
    ctx = BatchContext(_config(tmp_path), None, None, {}, {}, 0, 0,  # type: ignore[arg-type] - recorded, not run
                       stop=lambda: polls.append(1) is None and len(polls) > 3)
    generator = torch.Generator().manual_seed(1)
    with pytest.raises(BucketAbandoned, match="after 3 of"):
        process_edges(ctx, _edges(), torch.arange(EDGES), BATCH, False, generator, True)
    assert 0 < len(trained) < EDGES  # three batches trained, then given up between two batches
    assert len(polls) == 4
    trained.clear()
    finished = process_edges(replace(ctx, stop=lambda: False), _edges(), torch.arange(EDGES), BATCH, False,
                             torch.Generator().manual_seed(1), True)
    assert finished.count == EDGES == len(trained)


def _pool_and_inputs(tmp_path: Path) -> tuple[WorkerPool, Any]:
    config = _config(tmp_path)
    model = Model(config)
    pool = WorkerPool(2, config, model, RelationAdagrad(list(model.parameters()), config.lr), KernelOptions())
    table = Table(torch.randn(EDGES, 4).share_memory_(), torch.zeros(EDGES).share_memory_())
    tables = {r: table for r in range(3)}
    slices = [torch.arange(EDGES)[s] for s in split_almost_equally(EDGES, 2)]
    inputs = SimpleNamespace(edges=_edges().share_memory_(), slices=slices, tables=tables, config=config)
    return pool, inputs


def test_a_hogwild_worker_outlives_the_agents_sigterm_and_its_pool_still_trains(tmp_path: Path) -> None:
    """torchrun's agent signals the worker's whole process group: the Hogwild workers must stay for the trainer,
    which finishes its bucket (or gives it up) first; the pool's own close still ends them."""
    pool, x = _pool_and_inputs(tmp_path)
    try:
        for process in pool.processes:
            os.kill(process.pid, signal.SIGTERM)
        time.sleep(0.5)
        assert all(process.is_alive() for process in pool.processes)
        stats = pool.run(x.edges, x.slices, x.tables, x.tables, seeds=[1, 2], train=True, num_batch_negs=x.config.num_batch_negs,
                         num_uniform_negs=x.config.num_uniform_negs)
        assert stats.count == EDGES
        processes = list(pool.processes)
    finally:
        pool.close()
    assert not any(process.is_alive() for process in processes)


def _signal_mask(pid: int, field: str) -> int:
    """A process's signal set from /proc (``SigBlk``: blocked, ``SigIgn``: ignored) as a bit mask."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1], 16)
    raise AssertionError(f"no {field} for {pid}")


SIGTERM_BIT = 1 << (signal.SIGTERM - 1)


def test_hogwild_workers_ignore_sigterm_from_birth(tmp_path: Path) -> None:
    """By construction, not by timing (issue 44): the fork server runs with SIGTERM blocked, so every worker it forks
    is born with it blocked and ignores it before unblocking it; no moment of a worker's life lets the agent's
    SIGTERM end it. The trainer's own mask is as before."""
    if not Path("/proc/self/status").exists():
        pytest.skip("no /proc")
    before = _signal_mask(os.getpid(), "SigBlk") & SIGTERM_BIT
    pool, _ = _pool_and_inputs(tmp_path)
    try:
        children = subprocess.run(["pgrep", "-P", str(os.getpid())], capture_output=True, text=True).stdout.split()
        servers = [int(pid) for pid in children
                   if b"forkserver" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert servers, "no fork server among this process's children"
        assert all(_signal_mask(pid, "SigBlk") & SIGTERM_BIT for pid in servers)
        for process in pool.processes:
            assert _signal_mask(process.pid, "SigIgn") & SIGTERM_BIT, process.name
            assert not _signal_mask(process.pid, "SigBlk") & SIGTERM_BIT, process.name
    finally:
        pool.close()
    assert _signal_mask(os.getpid(), "SigBlk") & SIGTERM_BIT == before


def test_a_hogwild_bucket_given_up_ends_its_workers_mid_slice(tmp_path: Path) -> None:
    """``stop`` turning true while the workers are busy (both slices delayed by 600 s: nobody takes the other's
    batches, so the bucket would take 10 minutes): the pool kills its workers and raises at once."""
    pool, x = _pool_and_inputs(tmp_path)
    processes = list(pool.processes)
    flag = threading.Event()
    threading.Timer(1.0, flag.set).start()
    started = time.monotonic()
    try:
        with pytest.raises(BucketAbandoned, match="slices in training"):
            pool.run(x.edges, x.slices, x.tables, x.tables, seeds=[1, 2], train=True, num_batch_negs=x.config.num_batch_negs,
                     num_uniform_negs=x.config.num_uniform_negs, delays=[600.0, 600.0], stop=flag.is_set)
    finally:
        pool.close()
    assert time.monotonic() - started < 300
    assert not any(process.is_alive() for process in processes) and pool.processes == []


def test_rank_0_does_not_wait_for_a_rank_whose_bucket_cannot_end_by_the_deadline() -> None:
    """The server times every rank's buckets from its requests: once the round ends, ``settled(deadline)`` counts a
    rank whose bucket in flight cannot end by then as settled (waiting for it is waiting in vain); a rank that may
    still make it, or one with nothing in flight but partitions unwritten, is waited for."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    ranks = transports(store, 2)
    state = LockState(4, 4, partition_keys(4), world_size=2)
    server = LockServer(store, state, SimpleNamespace(append=lambda records, shared=None: None),
                        np.zeros(3, np.float32), 0, ranks[0], prefix=PREFIX)
    client = LockClient(store, 1, timeout_s=60, prefix=PREFIX)
    try:
        _, first, _ = client.next_bucket(set(), None, None)
        time.sleep(0.2)
        kind, second, _ = client.next_bucket(set(), first, None)  # the first timed: ~0.2 s
        assert kind == "bucket" and second is not None
        now = time.monotonic()
        # a grant is answered before its record is stored (job/train/distributed/commits.py), and settled waits for it
        assert wait_until(server.stored), "the grant's record was never stored"
        assert not server.settled() and not server.settled(now + 60)  # it may still end by then
        assert server.settled(now - 1)  # a deadline passed: nothing to wait for
        assert server.settled(now + 0.01)  # expected ~0.2 s after its hand-out: past this deadline
    finally:
        server.stop()


def test_a_bucket_given_up_is_counted_as_redone_and_handed_out_again_also_after_a_restart() -> None:
    state = LockState(2, 2, partition_keys(2), world_size=2)
    snapshot = json.loads(json.dumps(state.to_json()))
    rng = random.Random(0)
    kind, bucket = state.next_bucket(1, set(), None, rng)
    assert kind == "bucket" and bucket is not None
    state.stop(1, None)  # the rank's ``next`` that finishes nothing, as ``LockServerScheduler.abandon`` sends it
    state.release(1, sorted(partition_keys(2)[bucket]), written=False)  # and its locks, unwritten
    assert state.redone == 1 and bucket not in state.done and 1 not in state.in_flight
    replayed = LockState(2, 2, partition_keys(2), world_size=2)
    replayed.restore(snapshot)
    for record in json.loads(json.dumps(state.drain_journal())):
        replayed.apply(record)
    assert replayed.redone == 1 and replayed.in_flight == {} and replayed.done == set()
    handed, finished = [], None
    while True:
        kind, finished = state.next_bucket(0, set(), finished, rng)
        if kind != "bucket":
            break
        handed.append(finished)
    assert kind == "done" and bucket in handed and len(handed) == 4


def test_a_rank_that_gave_up_is_not_waited_for_though_a_bucket_it_did_was_never_written() -> None:
    """A rank gives its bucket up after one it finished whose rows were still only in memory (no partition left at
    the switch, so no write group): those rows are lost with the given-up ones and that bucket is redone, so
    waiting for the rank to write it back is waiting in vain (rank 0 waited out the whole drain for itself)."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    ranks = transports(store, 2)
    state = LockState(4, 4, partition_keys(4), world_size=2)
    server = LockServer(store, state, SimpleNamespace(append=lambda records, shared=None: None),
                        np.zeros(3, np.float32), 0, ranks[0], prefix=PREFIX, ending=lambda: "a SIGTERM")
    client = LockClient(store, 1, timeout_s=60, prefix=PREFIX)
    try:
        state.next_bucket(1, set(), None, random.Random(0))  # handed out before the round ended
        [done] = list(state.in_flight.values())
        kind, _, _ = client.next_bucket(set(), done, None)  # finished, its rows unwritten
        assert kind == "ending" and done in state.done and state.unsaved[1]
        assert not server.settled()
        kind, _, _, _ = client.finish_and_next(set(), None, None, None, leaving="a SIGTERM", gave_up=True)
        assert kind == "ending" and server.settled()
        assert state.unsaved[1]  # not written: the next round redoes it (``forget_rank_locks``)
    finally:
        server.stop()
