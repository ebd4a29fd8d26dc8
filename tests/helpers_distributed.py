"""What the distributed tests share: real torchrun agents on 127.0.0.1 and the checks on what they trained.

- ``free_port``: a free TCP port on 127.0.0.1 (rendezvous endpoints; also tests/test_chart.py, test_image.py)
- ``agent_command`` / ``kill_tree``: one torchrun agent's command line (a node of a c10d rendezvous on
  127.0.0.1) and killing it together with its workers, as a lost pod dies
- ``partition_keys``: the lock server's partition keys of every bucket, for the ``LockState`` rule tests
- ``transports``: one real gloo tensor transport per rank, all in this process (the lock-server tests' ranks)
- ``import_umls_p4``: UMLS imported into 4 partitions (the ``umls_p4`` fixture of tests/conftest.py), and
  ``write_run_config`` / ``filtered_mrr`` to train and score runs on it
- ``Agents``: torchrun agents started like pods, each killable together with its worker
- ``bucket_records`` / ``buckets_per_epoch`` / ``assert_each_bucket_once_per_epoch``: what a run's checkpoint says it trained

Kept in one module so that tests/test_distributed.py and tests/test_distributed_prefetch.py start agents
with the same rendezvous settings and judge runs by the same rules. It imports ``job`` (and so torch) only
inside the functions that need it: tests/conftest.py and the chart and image tests import it too, and
should not pay for torch unless they train. bench/elastic_bench.py and bench/storage_bench.py import
``free_port``, ``agent_command`` and ``kill_tree`` from here (tests/ on their ``sys.path``) rather than keep
copies: benches and tests always sit side by side in a checkout (neither is in the wheel or the image), and
the way an agent is started and killed should not drift between what is tested and what is measured.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from helpers_graphs import TEST_DEVICE

if TYPE_CHECKING:
    from job.train.distributed.transport import TensorTransport
    from job.types import Bucket


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def agent_command(nnodes: str, port: int, run_id: str, rdzv_conf: str, max_restarts: int,
                  monitor_interval: float | None, job_args: list[str]) -> list[str]:
    """One agent (a node, one trainer) of the c10d rendezvous at 127.0.0.1:``port``, running ``python -m job
    *job_args``; ``monitor_interval`` None leaves torchrun's default. The agent is the pod's launcher
    (job/train/elastic/agent.py: torchrun with the readmission of evicted nodes and warm spares)."""
    command = [sys.executable, "-m", "job.train.elastic.agent", f"--nnodes={nnodes}", "--nproc-per-node=1",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}",
               f"--rdzv-conf={rdzv_conf}", f"--max-restarts={max_restarts}"]
    if monitor_interval is not None:
        command.append(f"--monitor-interval={monitor_interval}")
    return [*command, "-m", "job", *job_args]


def kill_tree(agent: subprocess.Popen) -> None:
    """SIGKILL an agent and its workers at once, as a lost pod would (workers run in sessions of their own,
    so killing the agent's process group would miss them), and reap the agent."""
    children = subprocess.run(["pgrep", "-P", str(agent.pid)], capture_output=True, text=True).stdout.split()
    for pid in [agent.pid, *map(int, children)]:
        with contextlib.suppress(ProcessLookupError):  # already gone
            os.kill(pid, signal.SIGKILL)
    agent.wait()


def partition_keys(nparts: int) -> dict[Bucket, frozenset]:
    from job.train.schedule.orders import all_buckets

    return {b: frozenset({("node", b.lhs), ("node", b.rhs)}) for b in all_buckets(nparts, nparts)}


def transports(store: object, world_size: int, timeout_s: float = 60.0) -> list[TensorTransport]:
    """Every rank's end of a real gloo transport (job/train/distributed/transport.py), formed over ``store`` (a real TCPStore)
    in this process: the ranks of the lock-server tests are threads of one process, their payloads still go
    through gloo's sockets (rank 0's to its own server in memory, as in a trainer). Each rank joins from a
    thread of its own and through a store client of its own (the group forms only once all have joined)."""
    import threading
    import uuid

    from torch.distributed import PrefixStore

    from job.train.distributed.transport import TensorTransport

    prefix = f"transport-{uuid.uuid4().hex}"
    made: dict[int, TensorTransport] = {}

    def join(rank: int) -> None:
        # gloo's mesh given a minute to form whatever the transfer deadline (2 s in some tests): on a loaded
        # machine forming three ranks' pairs took longer than 2 s
        made[rank] = TensorTransport.over_store(PrefixStore(prefix, store.clone()), rank, world_size,  # type: ignore[attr-defined]
                                                timeout_s, group_timeout_s=60.0)

    threads = [threading.Thread(target=join, args=(rank,)) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(made) == world_size, "the transport's group did not form"
    return [made[rank] for rank in range(world_size)]


# a small real graph, and runs on it ------------------------------------------------------------------


def import_umls_p4(root: Path) -> dict:
    """UMLS (a small real knowledge graph) imported into 4 partitions under ``root``: ``{"root", "config"}``."""
    from job.cli import main
    from job.data.datasets import dataset_dir

    source = dataset_dir("umls")
    config = {
        "entity_path": str(root / "data"),
        "edge_paths": [str(root / "data" / s) for s in ("train", "valid", "test")],
        "checkpoint_path": str(root / "unused"),
        "entities": {"all": {"num_partitions": 4}},
        "relations": [{"name": "all_edges", "lhs": "all", "rhs": "all", "operator": "complex_diagonal"}],
        "dynamic_relations": True, "dimension": 64, "global_emb": False, "comparator": "dot",
        "num_uniform_negs": 100, "loss_fn": "softmax", "lr": 0.1, "batch_size": 200, "eval_fraction": 0.0,
        "num_epochs": 8, "workers": 1, "seed": 0, "bucket_order": "affinity",
        # BIGGRAPH_TEST_DEVICE=cuda trains the distributed tests' trainers on the GPU (bench/device_check.sh elastic;
        # every rank on card LOCAL_RANK modulo the cards)
        "device": TEST_DEVICE,
    }
    path = root / "config.json"
    path.write_text(json.dumps(config))
    files = [os.path.join(source, f"{s}.txt") for s in ("train", "valid", "test")]
    assert main(["import", str(path), *files, "-l", "0", "--rel-col", "1", "-r", "2"]) == 0
    return {"root": root, "config": config}


def write_run_config(graph: dict, name: str, **changes: object) -> Path:
    config = dict(graph["config"], **changes)
    config["edge_paths"] = [graph["config"]["edge_paths"][0]]
    config["checkpoint_path"] = str(graph["root"] / name)
    path = graph["root"] / f"{name}.json"
    path.write_text(json.dumps(config))
    return path


def filtered_mrr(graph: dict, config_path: Path) -> float:
    from job.config import load_config
    from job.evaluation import evaluate

    data = graph["root"] / "data"
    config = load_config(str(config_path), [f"edge_paths={data / 'test'}"])
    metrics = evaluate(config, filter_paths=[str(data / s) for s in ("train", "valid", "test")], candidates="all")
    return metrics["mrr"]


# torchrun agents --------------------------------------------------------------------------------------


class Agents:
    """torchrun agents started like pods: each in its own session, killable together with its worker."""

    def __init__(self, config_path: Path, nnodes: str, log_dir: Path, env: dict[str, str] | None = None,
                 max_restarts: int = 3, read_timeout_s: int | None = None) -> None:
        """``env``: variables for every agent and its worker, over the defaults (``BIGGRAPH_PEER_TIMEOUT``...);
        ``max_restarts``: torchrun's ``--max-restarts`` (3: the chart's ``torchrun.maxRestarts``);
        ``read_timeout_s``: the rendezvous store's read timeout (torch's default, 60 s, when None)."""
        self.max_restarts = max_restarts
        self.read_timeout = f",read_timeout={read_timeout_s}" if read_timeout_s is not None else ""
        self.config_path = config_path
        self.nnodes = nnodes
        self.env = env or {}  # over the agents' defaults below (BIGGRAPH_PEER_TIMEOUT=8...)
        self.port = free_port()
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, env_of_this: dict[str, str] | None = None) -> None:
        """Start agent ``name`` (``env_of_this``: variables of this agent alone, over ``self.env``)."""
        # The first agent hosts the c10d rendezvous store (torchrun's single point of failure, see
        # docs/kubernetes.md); said explicitly, since on one machine every agent would otherwise race for it.
        is_host = "true" if not self.procs else "false"
        env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1",
                   BIGGRAPH_PEER_TIMEOUT="8", PYTHONUNBUFFERED="1")
        env.update(self.env)
        env.update(env_of_this or {})
        log = open(self.log_dir / f"{name}.log", "w")  # closed with the process
        command = agent_command(self.nnodes, self.port, "biggraph-test",
                                f"join_timeout=120,last_call_timeout=3,is_host={is_host}{self.read_timeout}",
                                self.max_restarts, 1,
                                ["train", str(self.config_path)])
        self.procs[name] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)

    def run(self, names: list[str], timeout: float) -> dict[str, int]:
        """Start the agents ``names`` in order and wait for them all (exit codes by name); none is left running."""
        try:
            for name in names:
                self.start(name)
            return self.wait(names, timeout)
        finally:
            self.stop()

    def terminate_workers(self, name: str) -> None:
        """SIGTERM agent ``name``'s worker process group, as the agent's ``SubprocessHandler.close`` does when it
        re-forms the group (Hogwild workers included)."""
        for pid in subprocess.run(["pgrep", "-P", str(self.procs[name].pid)], capture_output=True,
                                  text=True).stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(int(pid), signal.SIGTERM)

    def kill_node(self, name: str) -> None:
        """SIGKILL the agent and its workers at once, as a lost pod would."""
        kill_tree(self.procs[name])

    def wait(self, names: list[str], timeout: float) -> dict[str, int]:
        deadline = time.monotonic() + timeout
        codes = {}
        for name in names:
            try:
                codes[name] = self.procs[name].wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.stop()
                raise AssertionError(f"agent {name} still running after {timeout:.0f} s; logs: {self.tail()}") from None
        return codes

    def tail(self) -> str:
        """The last lines of every agent's log, for assertion messages."""
        return "\n".join(f"--- {p.name}\n" + p.read_text()[-3000:] for p in sorted(self.log_dir.glob("*.log")))

    def text(self) -> str:
        """Every agent's whole log, for assertions on what was logged (a tail can miss a start-up line)."""
        return "\n".join(f"--- {p.name}\n" + p.read_text() for p in sorted(self.log_dir.glob("*.log")))

    def stop(self) -> None:
        for name in list(self.procs):
            if self.procs[name].poll() is None:
                self.kill_node(name)


# what a run trained -----------------------------------------------------------------------------------


def bucket_records(checkpoint_path: str) -> list[dict]:
    from job.formats.checkpoint import CheckpointStorage

    return CheckpointStorage(checkpoint_path).load_stats()


def buckets_per_epoch(records: list[dict]) -> dict[int, list[tuple[int, int]]]:
    """The (lhs, rhs) partitions of every bucket record, by epoch (pass summaries and other records left out)."""
    per_epoch: dict[int, list[tuple[int, int]]] = {}
    for record in records:
        if "lhs_partition" in record:
            per_epoch.setdefault(record["epoch_idx"], []).append((record["lhs_partition"], record["rhs_partition"]))
    return per_epoch


def assert_each_bucket_once_per_epoch(records: list[dict], epochs: int) -> None:
    from job.train.schedule.orders import all_buckets

    per_epoch = buckets_per_epoch(records)
    assert sorted(per_epoch) == list(range(epochs))
    for epoch, buckets in per_epoch.items():
        assert sorted(buckets) == sorted(all_buckets(4, 4)), epoch


def wait_until(condition: Callable[[], bool], seconds: float = 60.0) -> bool:
    """Poll ``condition()`` until it holds (True) or ``seconds`` pass (False): a bound on a hang, not a timing."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False
