"""How Hogwild workers start (job/train/hogwild/spawning.py): a fork server with torch imported, the trainer's
environment handed over, the server counted in the memory budget, ``BIGGRAPH_WORKER_START=spawn`` as before."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from job.config import parse_config
from job.train import Trainer
from job.train import trainer as loop
from job.train.hogwild import spawning
from job.train.hogwild.spawning import (
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

    from job.model.kernel_options import KernelOptions
    from job.model.scoring import Model
    from job.train.hogwild.pool import _worker_main

    config = parse_config(write_cycle_graph(tmp_path))
    model = Model(config)
    monkeypatch.delenv(MARK, raising=False)
    handed = {**os.environ, MARK: "the trainer's"}
    tasks: queue.Queue[Any] = queue.Queue()
    results: queue.Queue[Any] = queue.Queue()
    tasks.put(None)  # stop after start-up
    receive, send = multiprocessing.Pipe(duplex=False)
    send.send((model, [torch.zeros(1)], torch.zeros(1, dtype=torch.float64)))
    threads = torch.get_num_threads()
    try:
        _worker_main(0, config, receive, tasks=tasks, results=results, lock=None, environment=handed, options=KernelOptions())
        assert os.environ.get(MARK) == "the trainer's"
        assert results.get_nowait()[0] == "ready"
    finally:
        torch.set_num_threads(threads)
        os.environ.pop(MARK, None)


@pytest.mark.parametrize("method,preloaded", [("forkserver", True), ("spawn", False)])
def test_a_worker_starts_with_torch_imported_by_the_server(monkeypatch: pytest.MonkeyPatch, method: str,
                                                          preloaded: bool) -> None:
    """What a child has imported before it runs anything: torch (the server's preload) when forked, nothing
    when spawned. The target is a builtin, so that unpickling it imports nothing."""
    if method == "forkserver" and "forkserver" not in multiprocessing.get_all_start_methods():
        pytest.skip("this platform has no forkserver start method")
    monkeypatch.setenv(spawning.START_ENV, method)
    context = worker_context()
    queue = context.Queue()
    probe = "import sys; queue.put(sorted(m for m in ('torch', 'job.train.hogwild.pool') if m in sys.modules))"
    process = context.Process(target=exec, args=(probe, {"queue": queue}), daemon=True)
    with spawning.main_module_hidden():
        process.start()
    try:
        assert queue.get(timeout=120) == (["job.train.hogwild.pool", "torch"] if preloaded else [])
    finally:
        process.join(timeout=30)


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_a_model_with_many_relations_trains_on_several_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                method: str) -> None:
    """200 relations share 400 tensors with every worker (a parameter and its Adagrad sum each): more file
    descriptors than a fork server passes with a start (~250), so they go through a pipe afterwards. (Spawned
    workers never had that limit: their case checks the pipe does not break them.)"""
    if method == "forkserver" and "forkserver" not in multiprocessing.get_all_start_methods():
        pytest.skip("this platform has no forkserver start method")
    monkeypatch.setenv(spawning.START_ENV, method)
    from job.train import train

    raw = write_cycle_graph(tmp_path, num_relations=200, workers=2, num_epochs=1, device="cpu")
    summary = train(parse_config(raw))
    assert summary["version"] == 1 and summary["train_edges"] == 8000  # 40 per relation


def _one_slice(options: Any, pool_workers: int = 0) -> Any:
    """A slice of 1,000 edges over 3,000 rows trained from a fixed state with the kernel ``options``: here, or on a
    pool of ``pool_workers`` Hogwild processes (one thread each, as here). Returns the trained table."""
    import torch

    from job.model.scoring import Model, Table
    from job.train.batch.batching import process_edges
    from job.train.batch.optim import RelationAdagrad
    from job.train.batch.step import BatchContext
    from job.train.hogwild.pool import WorkerPool
    from job.train.inputs import EdgeTensors

    rows, num_edges = 3000, 1000
    config = parse_config({
        "entities": {"node": {"num_partitions": 1}},
        "relations": [{"name": "r", "lhs": "node", "rhs": "node", "operator": "complex_diagonal"}],
        "dimension": 16, "comparator": "dot", "loss_fn": "softmax", "batch_size": 100, "num_batch_negs": 20,
        "num_uniform_negs": 50, "lr": 0.1, "entity_path": "x", "edge_paths": ["x"], "checkpoint_path": "x"})
    torch.manual_seed(0)
    model = Model(config)
    optimizer = RelationAdagrad(list(model.parameters()), config.lr)
    table = Table(torch.randn(rows, 16) * 0.1, torch.zeros(rows))
    draws = torch.Generator().manual_seed(5)
    edges = EdgeTensors(torch.zeros(num_edges, dtype=torch.long), torch.randint(0, rows, (num_edges,), generator=draws),
                        torch.randint(0, rows, (num_edges,), generator=draws))
    indices, seed = torch.arange(num_edges), 7
    if not pool_workers:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            ctx = BatchContext(config, model, optimizer, {0: table}, {0: table}, config.num_batch_negs,
                               config.num_uniform_negs, options)
            process_edges(ctx, edges, indices, config.batch_size, False, torch.Generator().manual_seed(seed), True)
        finally:
            torch.set_num_threads(threads)
        return table.weight
    model.share_memory()
    optimizer.share_memory()
    table = Table(table.weight.share_memory_(), table.optim_sum.share_memory_())
    pool = WorkerPool(pool_workers, config, model, optimizer, options)
    try:
        tables = {0: table}
        pool.run(edges.share_memory_(), [indices], tables, tables, seeds=[seed], train=True, num_batch_negs=config.num_batch_negs,
                 num_uniform_negs=config.num_uniform_negs)
    finally:
        pool.close()
    return table.weight


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_kernel_options_set_in_the_trainer_reach_its_workers(monkeypatch: pytest.MonkeyPatch, method: str) -> None:
    """The pool hands its workers the trainer's ``KernelOptions`` at start: a worker trains a slice exactly as this
    process does with the same options, and not as with the defaults (the module globals these options replaced,
    set in the trainer, never reached a worker: it imports the modules afresh, or from the fork server's start)."""
    if method == "forkserver" and "forkserver" not in multiprocessing.get_all_start_methods():
        pytest.skip("this platform has no forkserver start method")
    import torch

    from job.model.kernel_options import KernelOptions

    monkeypatch.setenv(spawning.START_ENV, method)
    # the reference paths, each a different sum order in float32 (native_loss: where the kernels load)
    options = KernelOptions(native_loss=False, occurrences_on_cpu=False, operator_adjoint=False)
    here = _one_slice(options)
    assert not torch.equal(here, _one_slice(KernelOptions()))  # the options change the bits
    assert torch.equal(_one_slice(options, pool_workers=1), here)


def test_a_run_under_a_tmpdir_too_long_for_a_socket_trains(tmp_path: Path) -> None:
    """Workers take shared tensors over Unix sockets in the temporary directory, and a socket's path has ~107
    bytes: under a deeper TMPDIR multiprocessing's directory moves to /tmp, and two workers train (a real run, in a
    subprocess: the directory is a process-wide setting)."""
    long_tmp = tmp_path / ("d" * 110)
    long_tmp.mkdir()
    code = textwrap.dedent(f"""
        import logging, sys
        from pathlib import Path
        logging.basicConfig(level=logging.INFO)
        sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
        from helpers_graphs import write_cycle_graph
        from job.config import parse_config
        from job.train import train
        from job.train.hogwild.spawning import start_method
        raw = write_cycle_graph(Path({str(tmp_path)!r}), workers=2, num_epochs=2, device="cpu")
        print(start_method(), train(parse_config(raw))["version"])
    """)
    env = {**os.environ, "TMPDIR": str(long_tmp)}
    env.pop(spawning.START_ENV, None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    has_server = "forkserver" in multiprocessing.get_all_start_methods()
    assert done.stdout.split() == ["forkserver" if has_server else "spawn", "2"]
    assert "is too long for a Unix socket; using /tmp/pymp-" in done.stderr


@forkserver_only
def test_the_workers_spawn_where_the_fork_server_cannot_start(monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """A server that fails to start (injected here: out of file descriptors) leaves the run to spawned workers,
    with one warning, and the memory budget then counts no server."""
    def fail() -> None:
        raise OSError(24, "Too many open files")

    monkeypatch.delenv(spawning.START_ENV, raising=False)
    monkeypatch.setattr(spawning, "_server_failed", [])
    monkeypatch.setattr(spawning.forkserver, "ensure_running", fail)
    with caplog.at_level(logging.WARNING, logger="biggraph"):
        assert worker_context().get_start_method() == "spawn"
        assert start_method() == "spawn" and server_processes() == 0
        start_worker_server()
    assert caplog.text.count("the fork server could not start ([Errno 24] Too many open files)") == 1


def test_the_open_file_limit_is_raised_to_the_hard_one() -> None:
    """Shared tensors are open descriptors until the workers take them: the pool raises the soft limit first."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = 256 if soft == resource.RLIM_INFINITY else min(soft, 256)
    if hard != resource.RLIM_INFINITY and hard <= low:
        pytest.skip(f"the hard limit ({hard}) leaves nothing to raise")
    code = ("import resource\n"
            f"resource.setrlimit(resource.RLIMIT_NOFILE, ({low}, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
            "from job.train.hogwild.spawning import raise_open_file_limit\n"
            "raise_open_file_limit()\n"
            "print(*resource.getrlimit(resource.RLIMIT_NOFILE))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    new_soft, new_hard = map(int, done.stdout.split())
    assert new_soft > low and (new_soft == new_hard or new_hard == resource.RLIM_INFINITY)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_a_killed_trainer_leaves_no_worker_or_server_running(tmp_path: Path, method: str) -> None:
    """SIGKILL sends the workers no stop: they notice their trainer is gone and exit, and the fork server with
    them (it lives while any process holds its "alive" pipe: the workers do)."""
    if method == "forkserver" and "forkserver" not in multiprocessing.get_all_start_methods():
        pytest.skip("this platform has no forkserver start method")
    write_cycle_graph(tmp_path, workers=2)
    script = textwrap.dedent(f"""
        import json, sys, time
        from multiprocessing import forkserver
        sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
        from helpers_graphs import write_cycle_graph
        from job.config import parse_config
        from job.model.kernel_options import KernelOptions
        from job.model.scoring import Model
        from job.train.hogwild.pool import WorkerPool
        from job.train.batch.optim import RelationAdagrad
        from pathlib import Path
        config = parse_config(write_cycle_graph(Path({str(tmp_path)!r}), workers=2, device="cpu"))
        model = Model(config)
        pool = WorkerPool(2, config, model, RelationAdagrad(list(model.parameters()), 0.1), KernelOptions())
        server = getattr(forkserver._forkserver, "_forkserver_pid", None)
        print(json.dumps({{"workers": [p.pid for p in pool.processes], "server": server}}), flush=True)
        time.sleep(600)
    """)
    env = {**os.environ, spawning.START_ENV: method}
    trainer = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
    try:
        line = trainer.stdout.readline() if trainer.stdout else ""
        assert line, "the trainer printed no pids"
        started = json.loads(line)
        pids = started["workers"] + ([started["server"]] if method == "forkserver" else [])
        assert len(pids) == (3 if method == "forkserver" else 2) and all(_running(pid) for pid in pids)
    finally:
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
    deadline = time.monotonic() + 120  # a liveness bound, not a speed figure: the workers check every 2 s
    while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [pid for pid in pids if _running(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"still running after the trainer was killed: {left}"
