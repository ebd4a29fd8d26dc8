"""How Hogwild workers start (job/train/spawning.py): a fork server with torch imported, the trainer's
environment handed over, the server counted in the memory budget, ``BIGGRAPH_WORKER_START=spawn`` as before."""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from job.config import parse_config
from job.train import Trainer, loop, spawning
from job.train.spawning import (
    apply_environment,
    server_processes,
    start_method,
    start_worker_server,
    worker_context,
    worker_environment,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers_graphs import write_cycle_graph  # noqa: E402

MARK = "BIGGRAPH_SPAWNING_TEST_MARK"
forkserver_only = pytest.mark.skipif("forkserver" not in multiprocessing.get_all_start_methods(),
                                     reason="this platform has no forkserver start method")


def _report(queue: Any, environment: dict[str, str] | None) -> None:
    """In the child: what a worker sees of MARK (after taking the trainer's environment, if given), and the
    child's parent."""
    if environment is not None:
        apply_environment(environment)
    queue.put((os.environ.get(MARK), os.getppid()))


def _run_child(environment: dict[str, str] | None) -> tuple[str | None, int]:
    context = worker_context()
    queue = context.Queue()
    process = context.Process(target=_report, args=(queue, environment), daemon=True)
    process.start()
    try:
        return queue.get(timeout=120)
    finally:
        process.join(timeout=30)


def test_start_method_follows_the_switch(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    has_server = "forkserver" in multiprocessing.get_all_start_methods()
    monkeypatch.delenv(spawning.START_ENV, raising=False)
    assert start_method() == ("forkserver" if has_server else "spawn")
    assert server_processes() == (1 if has_server else 0)
    monkeypatch.setenv(spawning.START_ENV, "spawn")
    assert start_method() == "spawn" and server_processes() == 0
    assert worker_context().get_start_method() == "spawn"
    monkeypatch.setenv(spawning.START_ENV, "fork")  # forking the trainer (its threads) is never offered
    with caplog.at_level(logging.WARNING, logger="biggraph"):
        assert start_method() == ("forkserver" if has_server else "spawn")
    assert "BIGGRAPH_WORKER_START=fork is not one of forkserver, spawn" in caplog.text


@forkserver_only
def test_a_forked_worker_takes_the_trainers_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(spawning.START_ENV, raising=False)
    monkeypatch.delenv(MARK, raising=False)
    start_worker_server()
    monkeypatch.setenv(MARK, "set after the server started")
    # as a worker starts: the server's environment, then the trainer's applied
    seen, parent = _run_child(worker_environment())
    assert seen == "set after the server started"
    assert parent != os.getpid()  # forked by the server, not started by this process
    # without the hand-over a forked child would not see it (why the workers take the environment)
    assert _run_child(None)[0] is None


def test_a_spawned_worker_starts_fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(spawning.START_ENV, "spawn")
    monkeypatch.setenv(MARK, "inherited")
    seen, parent = _run_child(None)
    assert seen == "inherited" and parent == os.getpid()


@pytest.mark.parametrize("method,processes", [("forkserver", 4), ("spawn", 3)])
def test_the_memory_budget_counts_the_fork_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str,
                                                  processes: int) -> None:
    if method == "forkserver" and "forkserver" not in multiprocessing.get_all_start_methods():
        pytest.skip("this platform has no forkserver start method")
    monkeypatch.setenv(spawning.START_ENV, method)
    counted: list[int] = []
    choose = loop.choose_capacity

    def spy(*args: Any, **kwargs: Any) -> Any:
        counted.append(kwargs["processes"])
        return choose(*args, **kwargs)

    monkeypatch.setattr(loop, "choose_capacity", spy)
    # A budget far above what the processes take: the count is what is asserted, not whether the buffer fits
    # (the test process itself grows with the tests run before it).
    raw = write_cycle_graph(tmp_path, num_partitions=4, workers=2, memory_budget="64GiB", device="cpu")
    Trainer(parse_config(raw))
    assert counted == [processes]  # the trainer, 2 workers (and the server they fork from)


def test_a_worker_applies_the_environment_it_is_handed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``_worker_main`` (run here, in this process, told to stop at once) makes the handed environment its own
    before anything else: a forked worker would otherwise keep the fork server's."""
    import queue

    import torch

    from job.model.scoring import Model
    from job.train.hogwild import _worker_main

    config = parse_config(write_cycle_graph(tmp_path))
    model = Model(config)
    monkeypatch.delenv(MARK, raising=False)
    handed = {**os.environ, MARK: "the trainer's"}
    tasks: queue.Queue[Any] = queue.Queue()
    results: queue.Queue[Any] = queue.Queue()
    tasks.put(None)  # stop after start-up
    threads = torch.get_num_threads()
    try:
        _worker_main(0, config, model, [torch.zeros(1)], torch.zeros(1, dtype=torch.float64), tasks, results, None,
                     handed)
        assert os.environ.get(MARK) == "the trainer's"
        assert results.get_nowait()[0] == "ready"
    finally:
        torch.set_num_threads(threads)
        os.environ.pop(MARK, None)
