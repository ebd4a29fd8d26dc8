"""One round identity for the whole torchrun group: a replaced pod, whose agent counts its restarts from 0 while
the survivors' agents count 1, joins the same barriers, lock-server queues and checksum records as they do.

The identity is agreed through the process group after it forms (job/train/distributed/group.py ``agree_round``), never
taken from ``TORCHELASTIC_RESTART_COUNT``, which each agent counts for itself."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers_distributed import Agents, bucket_records, buckets_per_epoch, free_port, write_run_config

from job.train.distributed.group import run_identity
from job.train.schedule.orders import all_buckets

# one rank of a gloo group formed by hand (no torchrun): joins, prints what it agreed on, leaves
RANK_SCRIPT = """
import json, sys
from job.train.distributed.group import init_distributed, leave
ctx = init_distributed(sys.argv[1])
print(json.dumps({"rank": ctx.rank, "round": ctx.round_id, "run": ctx.run_id, "restarts": ctx.restart_count,
                  "barrier": ctx.key("barrier/x")}))
leave(ctx)
"""


def form_group(restart_counts: list[int], run_ids: list[str], digests: list[str]) -> list[dict]:
    """One process per rank, joined into a gloo group; each with its own agent's restart count and run id."""
    port = free_port()
    procs = []
    for rank, (count, run_id, digest) in enumerate(zip(restart_counts, run_ids, digests)):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(len(restart_counts)), TORCHELASTIC_RESTART_COUNT=str(count),
                   TORCHELASTIC_RUN_ID=run_id, OMP_NUM_THREADS="1")
        env.pop("BIGGRAPH_RUN_ID", None)
        procs.append(subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, digest], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        outputs.append(json.loads(out.strip().splitlines()[-1]))
    return outputs


def test_ranks_whose_agents_count_restarts_differently_agree_on_one_round() -> None:
    """A replaced pod's agent counts 0, the survivors' 1: the group still has one round, rank 0's, and one run id;
    the next formation of the group has another round."""
    first = form_group([1, 0, 1], ["job-a"] * 3, ["d0", "d1", "d2"])
    assert [o["restarts"] for o in first] == [1, 0, 1]  # still reported as each agent counts
    assert len({o["round"] for o in first}) == 1
    assert {o["run"] for o in first} == {"job-a/d0"}  # rank 0's
    assert len({o["barrier"] for o in first}) == 1 and first[0]["round"] in first[0]["barrier"]
    again = form_group([1, 0, 1], ["job-a"] * 3, ["d0"] * 3)
    assert again[0]["round"] != first[0]["round"]


def test_the_run_identity_is_the_jobs_name_and_its_config() -> None:
    assert run_identity({"TORCHELASTIC_RUN_ID": "job-a"}, "abc") == "job-a/abc"
    assert run_identity({"TORCHELASTIC_RUN_ID": "job-a", "BIGGRAPH_RUN_ID": "uid-1"}, "abc") == "uid-1/abc"
    assert run_identity({}, "") == "none"


@pytest.mark.slow
def test_a_replaced_pod_whose_agent_counts_from_zero_rejoins_and_the_run_completes(umls_p4: dict,
                                                                                    tmp_path: Path) -> None:
    """Three agents train; after the first commit one agent's tree is SIGKILLed and a fresh agent with the same
    arguments is started (as the Indexed Job's replacement pod): its restart count is 0, the survivors' 1. Before
    the round identity they waited on different barriers until the 30-minute timeout."""
    from job.formats.checkpoint import CheckpointStorage

    epochs = 10
    path = write_run_config(umls_p4, "replaced", num_epochs=epochs)
    checkpoint_path = json.loads(path.read_text())["checkpoint_path"]
    storage = CheckpointStorage(checkpoint_path)
    agents = Agents(path, "1:3", tmp_path)
    try:
        for name in ("a", "b", "c"):
            agents.start(name)
            time.sleep(0.3)
        deadline = time.monotonic() + 240
        while storage.load_version() < 1:
            assert time.monotonic() < deadline, "training never got going: " + agents.tail()
            assert all(p.poll() is None for p in agents.procs.values()), agents.tail()
            time.sleep(0.05)
        killed_at = storage.load_version()
        assert killed_at < epochs, "the run ended before the kill; give it more epochs"
        agents.kill_node("c")
        agents.start("c-replacement")  # same arguments: a fresh agent, restart count 0
        # a hang guard, not a timing threshold: without one round identity the group never trains again
        codes = agents.wait(["a", "b", "c-replacement"], timeout=420)
    finally:
        agents.stop()
    assert codes == {"a": 0, "b": 0, "c-replacement": 0}, agents.tail()
    assert storage.load_version() == epochs
    records = bucket_records(checkpoint_path)
    summaries = [r for r in records if r.get("pass_summary")]
    assert [s["checkpoint_version"] for s in summaries] == list(range(1, epochs + 1))
    assert summaries[-1]["world_size"] == 3  # the replacement trained in the group
    # every epoch trained every bucket; away from the kill, exactly once
    per_epoch = buckets_per_epoch(records)
    assert sorted(per_epoch) == list(range(epochs))
    for epoch, buckets in per_epoch.items():
        assert set(buckets) == set(all_buckets(4, 4)), epoch
        if epoch not in (killed_at, killed_at + 1):
            assert sorted(buckets) == sorted(all_buckets(4, 4)), epoch
    logs = agents.text()
    assert "round " in logs  # every rank logged the round it joined


@pytest.mark.slow
def test_a_node_lost_once_its_round_formed_costs_the_others_no_pod(umls_p4: dict, tmp_path: Path) -> None:
    """Three agents start; the third is SIGKILLed (with its process group) the moment its first round has formed,
    before it publishes its role in the round's store (tests/agent_hooks/sitecustomize.py): a pod lost while the
    group forms. The two others wait for its role until the store's read timeout; torch's agent then raised the
    timeout out of ``run`` and each pod exited 1 (the chaos bench's Job failed so, its index 0 four times). They join
    the next round instead, train, and exit 0 (job/train/elastic/agent.py, module docstring, 4)."""
    path = write_run_config(umls_p4, "lost-in-round", num_epochs=2)
    died = tmp_path / "died"
    agents = Agents(path, "2:3", tmp_path, read_timeout_s=10)
    hook = {"PYTHONPATH": str(Path(__file__).parent / "agent_hooks"), "BIGGRAPH_TEST_AGENT_DIES_AFTER_ROUND": "1",
            "BIGGRAPH_TEST_AGENT_DIED_FILE": str(died)}
    try:
        agents.start("a")
        agents.start("b")
        agents.start("c", env_of_this=hook)
        codes = agents.wait(["a", "b"], timeout=300)  # a hang guard, not a timing threshold
    finally:
        agents.stop()
    assert died.exists(), "the hook never fired: " + agents.tail()
    assert codes == {"a": 0, "b": 0}, agents.tail()
    logs = (tmp_path / "a.log").read_text() + (tmp_path / "b.log").read_text()
    assert "the round's roles did not all arrive" in logs and "joining the next round" in logs, agents.tail()
    records = bucket_records(json.loads(path.read_text())["checkpoint_path"])
    summaries = [r for r in records if r.get("pass_summary")]
    assert [s["checkpoint_version"] for s in summaries] == [1, 2] and summaries[-1]["world_size"] == 2
    for epoch, buckets in buckets_per_epoch(records).items():
        assert sorted(buckets) == sorted(all_buckets(4, 4)), epoch


def kill_mid_pass(agents: Agents, checkpoint_path: str, min_version: int) -> int:
    """Wait until the pass after a committed version >= ``min_version`` has finished buckets, then SIGKILL every
    agent tree at once (the whole job lost); returns the version the killed pass would have committed."""
    from job.checkpoint.group_progress import current_state
    from job.formats.checkpoint import CheckpointStorage

    storage = CheckpointStorage(checkpoint_path)
    deadline = time.monotonic() + 240
    while True:
        assert time.monotonic() < deadline, "training never got going: " + agents.tail()
        assert all(p.poll() is None for p in agents.procs.values()), agents.tail()
        version = storage.load_version()
        progress = current_state(checkpoint_path) or {}
        if version >= min_version and progress.get("version") == version + 1 and progress.get("done"):
            break
        time.sleep(0.02)
    agents.stop()
    return version + 1


@pytest.mark.slow
def test_the_same_job_restarted_resumes_its_pass_and_another_job_starts_it_over(
        umls_p4: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every agent of a job killed mid-pass; the same job started again (same rendezvous id and config) resumes the
    pass from the lock server's progress. Killed again; a different job (another run id) on the same checkpoint
    refuses that progress, removes it with the pass's uncommitted files and trains the pass again."""
    import re

    epochs = 12
    path = write_run_config(umls_p4, "rerun", num_epochs=epochs)
    checkpoint_path = json.loads(path.read_text())["checkpoint_path"]
    resumed = re.compile(r"resuming pass (\d+): (\d+) of 16 buckets already done, (\d+) to redo")

    first = Agents(path, "2", tmp_path / "first")
    (tmp_path / "first").mkdir()
    for name in ("a", "b"):
        first.start(name)
    killed_pass = kill_mid_pass(first, checkpoint_path, 2)

    again = Agents(path, "2", tmp_path / "again")  # the same job: same --rdzv-id, same config
    (tmp_path / "again").mkdir()
    for name in ("a", "b"):
        again.start(name)
    killed_again = kill_mid_pass(again, checkpoint_path, killed_pass)
    found = resumed.findall(again.text())
    assert found and int(found[0][0]) == killed_pass and int(found[0][1]) + int(found[0][2]) > 0, again.tail()
    assert "not resumed" not in again.text()

    monkeypatch.setenv("BIGGRAPH_RUN_ID", "another-job")
    other = Agents(path, "2", tmp_path / "other")
    (tmp_path / "other").mkdir()
    codes = other.run(["a", "b"], timeout=420)
    assert codes == {"a": 0, "b": 0}, other.tail()
    assert "not resumed (written by run 'biggraph-test/" in other.text()
    assert not resumed.findall(other.text())
    records = bucket_records(checkpoint_path)
    summaries = [r for r in records if r.get("pass_summary")]
    assert [s["checkpoint_version"] for s in summaries] == list(range(1, epochs + 1))
    redone = next(s for s in summaries if s["checkpoint_version"] == killed_again)
    assert redone["buckets_redone"] == 0 and redone["buckets_trained"] == 16  # trained from the start again
    # every epoch trained every bucket; the pass another job started over, exactly once
    per_epoch = buckets_per_epoch(records)
    for epoch, buckets in per_epoch.items():
        assert set(buckets) == set(all_buckets(4, 4)), epoch
    assert sorted(per_epoch[killed_again - 1]) == sorted(all_buckets(4, 4))


@contextlib.contextmanager
def store_in_another_process() -> Iterator[tuple[int, subprocess.Popen]]:
    """A TCPStore hosted by a child process (its port, the process): the test kills the process to make the store
    go away, as a round's host pod does; it is killed at the end whatever happened."""
    host = subprocess.Popen([sys.executable, "-c", (
        "import time; from datetime import timedelta; from torch.distributed import TCPStore; "
        "s = TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)); "
        "print(s.port, flush=True); time.sleep(120)")], stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout is not None
        yield int(host.stdout.readline()), host
    finally:
        if host.poll() is None:
            host.kill()
            host.wait()


def test_a_rank_whose_round_is_over_is_fenced_off_from_writing(tmp_path: Path) -> None:
    """A rank rank 0 declared dead (its heartbeat stopped: a SIGSTOPped pod), or whose round's store is gone (the
    group re-formed without it), raises before writing a checkpoint file; a live rank of a live round writes."""
    from datetime import timedelta

    import numpy as np
    from torch.distributed import TCPStore

    from job.checkpoint.manager import CheckpointManager
    from job.train.distributed import auth
    from job.train.distributed.group import DistributedContext, RoundOver, round_key

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    ctx = DistributedContext(rank=1, world_size=2, store=store, restart_count=0, round_id="r1")
    manager = CheckpointManager(str(tmp_path / "cp"), [("node", 0)], fence=ctx.fence)
    manager.storage.save_entity_partition(1, "node", 0, np.zeros((3, 2), np.float32))
    written = sorted(p.name for p in (tmp_path / "cp").iterdir())
    assert written == ["embeddings_node_0.v1.h5"]
    store.set(round_key("r1", "dead/1"), "1")  # forged (any client of the store can set it): not a declaration
    manager.storage.save_entity_partition(1, "node", 0, np.zeros((3, 2), np.float32))
    store.set(round_key("r1", "dead/1"), auth.mac("dead", "r1", "1"))  # rank 0's declaration
    with pytest.raises(RoundOver, match="rank 1: round r1 of the group is over .rank 0 declared this rank dead"):
        manager.storage.save_entity_partition(2, "node", 0, np.zeros((3, 2), np.float32))
    assert sorted(p.name for p in (tmp_path / "cp").iterdir()) == written  # nothing new, no temporary file left

    with store_in_another_process() as (port, host):
        remote = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
        gone = DistributedContext(rank=2, world_size=3, store=remote, restart_count=0, round_id="r2")
        gone.fence()  # the round stands
        host.kill()
        host.wait()
        with pytest.raises(RoundOver, match="rank 2: round r2 of the group is over .its store is gone"):
            gone.fence()


def test_a_rank_frozen_before_its_first_write_finds_its_round_over_when_thawed() -> None:
    """A rank stopped before it wrote anything in its round, woken after the round's store went away: its first fence
    fails on the connection it opened with the round, instead of dialling the dead store for the whole timeout of
    the store (here two hours: the test's watchdog, not an assertion on time, would end a fence that dialled)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from job.train.distributed.group import DistributedContext, RoundOver

    with store_in_another_process() as (port, host):
        remote = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(hours=2))
        frozen = DistributedContext(rank=2, world_size=3, store=remote, restart_count=0, round_id="r3")
        host.kill()  # the group re-formed without the frozen rank: the round's store is gone
        host.wait()
        with pytest.raises(RoundOver, match="rank 2: round r3 of the group is over .its store is gone"):
            frozen.fence()


def test_a_writer_stopped_while_it_built_a_file_checks_again_before_publishing(tmp_path: Path) -> None:
    """The guard runs before a file is built and again right before the rename publishes it: a writer frozen in
    between, whose round ended meanwhile, publishes nothing."""
    import numpy as np

    from job.formats.checkpoint import CheckpointStorage

    calls: list[int] = []

    def guard() -> None:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("round over")

    storage = CheckpointStorage(str(tmp_path), guard=guard)
    with pytest.raises(RuntimeError, match="round over"):
        storage.save_entity_partition(1, "node", 0, np.zeros((3, 2), np.float32))
    assert len(calls) == 2 and list(tmp_path.iterdir()) == []
