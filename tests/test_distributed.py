"""Distributed training: the lock server's rules, and real torchrun agents on 127.0.0.1 (gloo, c10d).

The agents, the UMLS graph they train (the ``umls_p4`` fixture, tests/conftest.py) and the checks on a run's
records are in tests/helpers_distributed.py, shared with tests/test_distributed_prefetch.py."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers_distributed import (
    Agents,
    assert_each_bucket_once_per_epoch,
    bucket_records,
    buckets_per_epoch,
    filtered_mrr,
    free_port,
    partition_keys,
    write_run_config,
)

from job.errors import UserError
from job.train.distributed.group import DEFAULT_PEER_INTERVAL_S, DEFAULT_PEER_TIMEOUT_S, Heartbeat, peer_timing
from job.train.distributed.lock_state import LockState
from job.train.schedule.orders import all_buckets
from job.types import Bucket

# the scheduling rules -------------------------------------------------------------------------------


def test_lock_server_hands_out_each_bucket_once_and_never_shares_a_partition() -> None:
    rng = random.Random(0)
    state = LockState(4, 4, partition_keys(4))
    held: dict[int, set] = {0: set(), 1: set(), 2: set()}
    current: dict[int, Bucket | None] = {0: None, 1: None, 2: None}
    handed: list[Bucket] = []
    for _ in range(200):
        rank = rng.randrange(3)
        kind, bucket = state.next_bucket(rank, held[rank], current[rank], rng)
        current[rank] = None
        if kind == "done":
            break
        if kind == "wait":
            state.release(rank, sorted(held[rank]))
            held[rank] = set()
            continue
        assert bucket is not None
        handed.append(bucket)
        needed = state.bucket_keys[bucket]
        state.release(rank, sorted(held[rank] - needed))
        held[rank] = set(needed)
        current[rank] = bucket
        # no partition is held by two ranks at once
        owners = [k for r in held for k in held[r]]
        assert len(owners) == len(set(owners))
    for rank in held:  # the last buckets are finished by the ranks' next call
        if current[rank] is not None:
            state.next_bucket(rank, held[rank], current[rank], rng)
    assert sorted(handed) == sorted(all_buckets(4, 4))
    assert state.finished()


def test_lock_server_prefers_buckets_that_reuse_held_partitions() -> None:
    state = LockState(4, 4, partition_keys(4))
    kind, bucket = state.next_bucket(0, set(), None, random.Random(1))
    assert kind == "bucket"
    for seed in range(10):
        kind, nxt = state.next_bucket(0, set(state.bucket_keys[bucket]), bucket, random.Random(seed))
        assert kind == "bucket" and nxt is not None
        assert {nxt.lhs, nxt.rhs} & {bucket.lhs, bucket.rhs}
        bucket = nxt


def test_initialised_partition_rule_on_the_first_pass() -> None:
    state = LockState(4, 4, partition_keys(4), tree_init_order=True)
    rng = random.Random(0)
    kind, first = state.next_bucket(0, set(), None, rng)
    assert 0 in (first.lhs, first.rhs)
    trained = {first.lhs, first.rhs}
    previous = first
    while True:
        kind, bucket = state.next_bucket(0, set(state.bucket_keys[previous]), previous, rng)
        if kind != "bucket":
            break
        assert 0 in (bucket.lhs, bucket.rhs) or {bucket.lhs, bucket.rhs} & trained
        trained |= {bucket.lhs, bucket.rhs}
        previous = bucket
    assert kind == "done"


def test_progress_round_trip_counts_in_flight_buckets_as_redone() -> None:
    state = LockState(2, 2, partition_keys(2), version=3)
    rng = random.Random(0)
    _, a = state.next_bucket(0, set(), None, rng)
    _, b = state.next_bucket(1, set(), None, rng)
    state.next_bucket(0, set(), a, rng)  # a done; rank 0 gets another bucket or waits for rank 1
    state.release(0, [("node", a.lhs), ("node", a.rhs)])  # ... and wrote its partitions
    in_flight = len(state.in_flight)
    assert in_flight >= 1  # rank 1 still trains b
    saved = json.loads(json.dumps(state.to_json()))
    restored = LockState(2, 2, partition_keys(2), version=3)
    restored.restore(saved)
    restored.forget_rank_locks()
    assert a in restored.done
    assert restored.redone == in_flight
    assert ("node", a.lhs) in restored.dirty
    assert not restored.locks and not restored.in_flight


def test_a_finished_bucket_whose_partitions_died_unwritten_is_redone() -> None:
    """The fault bench's case: X = (3, 0) finished, Y = (0, 3) in flight on the same rank, which holds both
    partitions and dies before writing them: X's training is lost with them, so X is trained again."""
    keys = partition_keys(4)
    state = LockState(4, 4, keys, version=1)
    x, y, z = Bucket(3, 0), Bucket(0, 3), Bucket(1, 1)
    rng = random.Random(0)
    for rank, bucket in ((0, x), (1, z)):  # hand out chosen buckets
        state.in_flight[rank] = bucket
        for key in keys[bucket]:
            state.locks[key] = rank
    state.next_bucket(1, set(), z, rng)
    state.add_record({"epoch_idx": 0, "lhs_partition": 1, "rhs_partition": 1})  # z's stats line
    state.release(1, [("node", 1)])  # z finished and its partition written: safe
    state.next_bucket(0, {("node", 0), ("node", 3)}, x, rng)  # x finished; rank 0 keeps its partitions
    state.add_record({"epoch_idx": 0, "lhs_partition": 3, "rhs_partition": 0})  # x's
    state.in_flight[0] = y
    in_flight = len(state.in_flight)  # y, and whatever rank 1 took next
    restored = LockState(4, 4, keys, version=1)
    restored.restore(json.loads(json.dumps(state.to_json())))  # what rank 0's successor reads
    restored.forget_rank_locks()
    assert x not in restored.done and y not in restored.done and z in restored.done
    assert restored.redone == in_flight + 1  # the buckets in flight + x, finished but unsaved
    # x's stats line goes with it (its redo writes one), z's stays: the pass's stats hold each bucket once
    assert [(r["lhs_partition"], r["rhs_partition"]) for r in restored.records] == [(1, 1)]
    # released partitions make a finished bucket safe
    state.release(0, [("node", 0), ("node", 3)])
    state.forget_rank_locks()
    assert x in state.done


def test_a_rank_told_the_round_ends_finishes_its_bucket_and_settles_once_it_gave_back() -> None:
    """The round's end (issue #30): a surviving rank's finished bucket is recorded done, it gets no other, its
    reservation and the locks only that needed are dropped; once it has written and released its partitions it
    holds nothing a restart would redo, so a restart redoes only what the lost rank held."""
    keys = partition_keys(4)
    state = LockState(4, 4, keys, version=1, world_size=2)
    rng = random.Random(0)
    _, lost = state.next_bucket(0, set(), None, rng)
    _, mine = state.next_bucket(1, set(), None, rng)
    assert lost is not None and mine is not None
    ahead = state.reserve(1, rng)
    state.stop(1, mine)
    assert mine in state.done and 1 not in state.in_flight and 1 not in state.reserved
    assert not state.settled(1)  # its finished bucket's partitions are still only in its memory
    if ahead is not None:
        assert all(state.locks.get(k) != 1 for k in keys[ahead] - keys[mine])
    state.record_written(1, sorted(keys[mine]))
    assert not state.settled(1)  # written, not yet published and released
    state.release(1, sorted(keys[mine]), written=False)
    assert state.settled(1) and not state.settled(0)
    restored = LockState(4, 4, keys, version=1)
    restored.restore(json.loads(json.dumps(state.to_json())))
    assert restored.forget_rank_locks() == {0: 1}  # only the lost rank's bucket in flight
    assert mine in restored.done and lost not in restored.done and restored.redone == 1


def test_a_redone_buckets_first_stats_line_is_dropped_so_the_pass_commits_one_line_per_bucket() -> None:
    """x finished (its stats line recorded) but its partitions died unwritten with its rank: the restart redoes x,
    and the redo's line must be x's only line in what the pass commits (the chaos bench found both kept)."""
    keys = partition_keys(4)
    state = LockState(4, 4, keys, version=1)
    x, z = Bucket(3, 0), Bucket(1, 1)
    rng = random.Random(0)
    for rank, bucket in ((0, x), (1, z)):
        state.in_flight[rank] = bucket
        for key in keys[bucket]:
            state.locks[key] = rank
    for rank, bucket in ((0, x), (1, z)):
        state.add_record({"epoch_idx": 0, "lhs_partition": bucket.lhs, "rhs_partition": bucket.rhs, "rank": rank})
    state.next_bucket(1, set(), z, rng)
    state.release(1, [("node", 1)])  # z saved
    state.next_bucket(0, {("node", 0), ("node", 3)}, x, rng)  # x finished, its partitions still held by rank 0
    restored = LockState(4, 4, keys, version=1)
    restored.restore(json.loads(json.dumps(state.to_json())))  # what rank 0's successor reads
    restored.forget_rank_locks()
    assert [(r["lhs_partition"], r["rhs_partition"]) for r in restored.records] == [(1, 1)]
    restored.add_record({"epoch_idx": 0, "lhs_partition": 3, "rhs_partition": 0, "rank": 2})  # the redo's line
    again = LockState(4, 4, keys, version=1)
    again.restore(json.loads(json.dumps(restored.to_json())))  # the resumed pass's snapshot, read by a later restart
    again.forget_rank_locks()
    assert sorted((r["lhs_partition"], r["rhs_partition"], r["rank"]) for r in again.records) == [(1, 1, 1), (3, 0, 2)]


# heartbeats ------------------------------------------------------------------------------------------


def test_peer_timing_defaults_and_overrides() -> None:
    assert peer_timing({}) == (DEFAULT_PEER_INTERVAL_S, DEFAULT_PEER_TIMEOUT_S)
    # the timeout bounds the recovery time after a lost pod (bench/elastic_bench.py); keep it short
    assert DEFAULT_PEER_TIMEOUT_S <= 6
    assert peer_timing({"BIGGRAPH_PEER_TIMEOUT": "8"}) == (DEFAULT_PEER_INTERVAL_S, 8.0)
    assert peer_timing({"BIGGRAPH_PEER_INTERVAL": "0.5", "BIGGRAPH_PEER_TIMEOUT": "3"}) == (0.5, 3.0)
    for env in ({"BIGGRAPH_PEER_TIMEOUT": "soon"}, {"BIGGRAPH_PEER_TIMEOUT": "0"}, {"BIGGRAPH_PEER_INTERVAL": "-1"},
                {"BIGGRAPH_PEER_INTERVAL": "2", "BIGGRAPH_PEER_TIMEOUT": "3"}):
        with pytest.raises(UserError):
            peer_timing(env)


def test_heartbeat_names_the_peer_that_went_silent_after_the_timeout() -> None:
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    interval, dead_after = 0.05, 0.6
    watcher = Heartbeat(store, 0, 3, interval=interval, dead_after=dead_after)
    alive = Heartbeat(store, 1, 3, interval=interval, dead_after=dead_after)
    silent = Heartbeat(store, 2, 3, interval=interval, dead_after=dead_after)
    try:
        time.sleep(0.5)
        assert watcher.dead_rank is None
        silent.stop()
        stopped = time.monotonic()
        while watcher.dead_rank is None and time.monotonic() < stopped + 5:
            time.sleep(0.01)
        noticed = time.monotonic() - stopped
        assert watcher.dead_rank == 2  # and never the peer that kept beating
        assert dead_after <= noticed + interval and noticed < dead_after + 1.0, noticed
    finally:
        for beat in (watcher, alive, silent):
            beat.stop()


# real torchrun agents --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def single_machine_mrr(umls_p4: dict) -> float:
    from job.config import load_config
    from job.train import train

    path = write_run_config(umls_p4, "single")
    train(load_config(str(path)))
    return filtered_mrr(umls_p4, path)


@pytest.mark.slow
@pytest.mark.parametrize("nodes", [2, 3])
def test_nodes_train_every_bucket_once_with_mrr_close_to_one_machine(
    umls_p4: dict, single_machine_mrr: float, nodes: int, tmp_path: Path
) -> None:
    path = write_run_config(umls_p4, f"dist{nodes}")
    agents = Agents(path, str(nodes), tmp_path)
    codes = agents.run([f"node{i}" for i in range(nodes)], timeout=300)
    assert set(codes.values()) == {0}, agents.tail()
    records = bucket_records(json.loads(path.read_text())["checkpoint_path"])
    assert_each_bucket_once_per_epoch(records, 8)
    summaries = [r for r in records if r.get("pass_summary")]
    assert all(s["world_size"] == nodes for s in summaries)
    assert len({r["rank"] for r in records if "rank" in r}) > 1  # the work really was shared
    mrr = filtered_mrr(umls_p4, path)
    assert mrr == pytest.approx(single_machine_mrr, abs=0.06), (mrr, single_machine_mrr)


@pytest.mark.slow
def test_two_nodes_with_sparse_shared_parameters_train_every_bucket_once_with_mrr_close_to_one_machine(
        umls_p4: dict, single_machine_mrr: float, tmp_path: Path) -> None:
    """Every bucket's change of the relation rows only, and a pull of the rows its next bucket reads (issue #45;
    ``BIGGRAPH_SHARED_SPARSE_AT_MOST=1``: sparse whatever the share of UMLS's 46 relations a bucket uses): the same
    buckets, and a model as good as one machine's."""
    path = write_run_config(umls_p4, "sparse2")
    agents = Agents(path, "2", tmp_path, env={"BIGGRAPH_SHARED_SPARSE_AT_MOST": "1"})
    codes = agents.run(["node0", "node1"], timeout=300)
    assert set(codes.values()) == {0}, agents.tail()
    records = bucket_records(json.loads(path.read_text())["checkpoint_path"])
    assert_each_bucket_once_per_epoch(records, 8)
    pulls = [int(n) for n in re.findall(r'requests by kind \{[^}]*"pull": (\d+)', agents.text())]
    assert len(pulls) == 8 and min(pulls) > 0, pulls  # every pass's buckets pulled their rows
    mrr = filtered_mrr(umls_p4, path)
    assert mrr == pytest.approx(single_machine_mrr, abs=0.06), (mrr, single_machine_mrr)


# the pass summary both modes write (tests/test_train_buckets_and_partitions.py checks a single-process run against it)
PASS_SUMMARY_KEYS = {
    "epoch_idx", "edge_path_idx", "edge_chunk_idx", "index", "pass_summary", "world_size", "restart_count",
    "buckets_trained", "buckets_redone", "stats", "edges_per_sec", "time", "checkpoint_version", "partition_loads",
    "partition_reads", "partition_writes", "bytes_read", "bytes_written", "io_blocked_seconds", "commit_seconds",
    "partition_loads_prefetched", "partition_writes_background",
}
# and in a group, once a partition came from a trainer's memory (``partition_handoff``, on by default)
HANDOFF_SUMMARY_KEYS = {"partition_handoffs", "bytes_handed_over", "partition_kept_hits"}


def test_pass_metrics_are_the_edge_weighted_mean_of_every_ranks_buckets() -> None:
    from job.train.pass_stats import eval_mrr_of, pass_summary
    from job.train.schedule.interfaces import Iteration, PassGather

    def record(rank: int, count: int, loss: float, mrr: float) -> dict:
        return {"rank": rank, "time": 1.0, "stats": {"count": count, "metrics": {"loss": loss}},
                "eval_stats_after": {"count": count // 10, "metrics": {"mrr": mrr, "hits@10": mrr}}}

    # rank 0 trained one large bucket, rank 1 three small ones: rank 1's own MRR (0.2) is not the pass's
    gathered = PassGather([record(0, 3000, 1.0, 0.8), *(record(1, 1000, 2.0, 0.2) for _ in range(3))],
                          world_size=2)
    summary = pass_summary(Iteration(0, 0, 0, 0), gathered, 5.0, {}, 1)
    assert summary["stats"] == {"count": 6000, "metrics": {"loss": pytest.approx(1.5)}}
    assert summary["eval_stats_after"]["count"] == 600
    assert eval_mrr_of(summary) == pytest.approx(0.5)
    assert summary["edges_per_sec"] == pytest.approx(6000 / 4.0)
    assert (summary["world_size"], summary["buckets_trained"]) == (2, 4)


@pytest.mark.slow
def test_ranks_take_the_same_early_stopping_decision_on_the_whole_pass_mrr(umls_p4: dict, tmp_path: Path) -> None:
    """Each rank's buckets alone give different MRRs; the decision must use one value, the same on every rank
    (a rank that stopped alone would leave the other waiting for it at the next pass)."""
    import re

    path = write_run_config(umls_p4, "early", num_epochs=4, eval_fraction=0.1, early_stopping=True, lr=0.5)
    agents = Agents(path, "2", tmp_path)
    codes = agents.run(["a", "b"], timeout=300)
    assert codes == {"a": 0, "b": 0}, agents.tail()
    pattern = re.compile(r"early stopping check after epoch (\d+): eval MRR ([0-9.]+)")
    checks = {name: pattern.findall((tmp_path / f"{name}.log").read_text()) for name in ("a", "b")}
    assert checks["a"] and checks["a"] == checks["b"], checks
    stopped = {name: "early stopping: eval MRR fell" in (tmp_path / f"{name}.log").read_text() for name in ("a", "b")}
    assert stopped["a"] == stopped["b"]
    records = bucket_records(json.loads(path.read_text())["checkpoint_path"])
    summaries = [r for r in records if r.get("pass_summary")]
    assert len(summaries) == len(checks["a"])  # one pass per epoch, each one checked, none after a stop
    assert all(s["restart_count"] == 0 and s["world_size"] == 2 for s in summaries)  # nobody left the group
    expected = PASS_SUMMARY_KEYS | {"eval_stats_after"}
    assert all(expected <= set(s) <= expected | HANDOFF_SUMMARY_KEYS for s in summaries)
    # the value decided on is the summary's: every rank's buckets, weighted by their edges
    for (_, logged), summary in zip(checks["a"], summaries):
        assert float(logged) == pytest.approx(summary["eval_stats_after"]["metrics"]["mrr"], abs=1e-6)
    assert {r["rank"] for r in records if "rank" in r} == {0, 1}


@pytest.mark.slow
def test_ranks_receive_the_validation_of_rank_0_and_stop_together(umls_p4: dict, tmp_path: Path) -> None:
    """validation_edge_paths in a group: rank 0 scores the committed version, every rank decides on its line. The
    entity type is frozen and the relations have no operator, so nothing trains and no validation beats the first:
    the group must stop after epoch 3 (patience 2) of 6, both ranks together, version 1 kept as the best."""
    import re

    data = umls_p4["root"] / "data"
    path = write_run_config(umls_p4, "validated", num_epochs=6, early_stopping=True, early_stopping_patience=2,
                            validation_edge_paths=[str(data / "valid")], validation_filter_paths=[str(data / "test")],
                            entities={"all": {"num_partitions": 4, "frozen": True}},
                            relations=[{"name": "all_edges", "lhs": "all", "rhs": "all", "operator": "none"}])
    agents = Agents(path, "2", tmp_path)
    codes = agents.run(["a", "b"], timeout=300)
    assert codes == {"a": 0, "b": 0}, agents.tail()
    pattern = re.compile(r"early stopping check after the validation of version (\d+): MRR ([0-9.]+)")
    checks = {name: pattern.findall((tmp_path / f"{name}.log").read_text()) for name in ("a", "b")}
    assert [v for v, _ in checks["a"]] == ["1", "2", "3"] and checks["a"] == checks["b"], checks
    logs = {name: (tmp_path / f"{name}.log").read_text() for name in ("a", "b")}
    assert all("early stopping: the validation MRR has not beaten" in text for text in logs.values())
    checkpoint_path = Path(json.loads(path.read_text())["checkpoint_path"])
    lines = [r for r in bucket_records(str(checkpoint_path)) if r.get("validation")]
    assert [r["checkpoint_version"] for r in lines] == [1, 2, 3]
    assert [r["improved"] for r in lines] == [True, False, False]
    assert (checkpoint_path / "checkpoint_version.txt").read_text().strip() == "3"
    assert (checkpoint_path / "best_version.txt").read_text().strip() == "1"
    assert (checkpoint_path / "model.v1.h5").exists() and not (checkpoint_path / "model.v2.h5").exists()


@pytest.mark.slow
def test_killed_node_the_job_completes_and_redoes_only_buckets_in_flight(umls_p4: dict, tmp_path: Path) -> None:
    import re

    from job.checkpoint.group_progress import current_state
    from job.formats.checkpoint import CheckpointStorage

    path = write_run_config(umls_p4, "killed", num_epochs=40)
    checkpoint_path = json.loads(path.read_text())["checkpoint_path"]
    storage = CheckpointStorage(checkpoint_path)
    agents = Agents(path, "1:2", tmp_path)
    versions_seen: list[int] = []
    try:
        agents.start("a")
        time.sleep(0.5)
        agents.start("b")
        deadline = time.monotonic() + 180
        # kill b in the middle of a pass: the lock server's progress names finished buckets
        while time.monotonic() < deadline:
            version = storage.load_version()
            progress = current_state(checkpoint_path) or {}
            # the progress of the pass after the committed version (not the last one's, in the moment after its commit)
            if version >= 3 and progress.get("version") == version + 1 and progress.get("done"):
                break
            time.sleep(0.02)
        else:
            raise AssertionError("training never got going: " + agents.tail())
        versions_seen.append(storage.load_version())
        agents.kill_node("b")
        while agents.procs["a"].poll() is None and time.monotonic() < deadline + 240:
            version = storage.load_version()
            assert version >= versions_seen[-1], "a committed checkpoint went backwards"
            versions_seen.append(version)
            # every committed version stays loadable while training goes on, until a newer commit retires it (the
            # marker read above may be a commit old by the time its file is opened)
            try:
                storage.load_entity_partition(version, "all", 0) if version else None
            except FileNotFoundError:
                assert storage.load_version() > version, f"v{version}'s file is gone while the marker still names it"
            time.sleep(0.2)
        codes = agents.wait(["a"], timeout=60)
    finally:
        agents.stop()
    assert codes["a"] == 0, agents.tail()
    assert storage.load_version() == 40
    # the restarted rank 0 replayed the progress: the buckets done before the kill are kept or redone
    resumed = re.findall(r"resuming pass \d+: (\d+) of 16 buckets already done, (\d+) to redo", agents.text())
    assert resumed and int(resumed[0][0]) + int(resumed[0][1]) > 0, agents.tail()
    records = bucket_records(checkpoint_path)
    summaries = [r for r in records if r.get("pass_summary")]
    assert len(summaries) == 40
    # the group was re-formed after the kill: a membership change, which spends no restart (restart_count stays 0:
    # job/train/elastic/budget.py)
    assert "without spending a restart" in agents.text()
    assert summaries[-1]["world_size"] == 1 and max(s["restart_count"] for s in summaries) == 0
    redone = sum(s["buckets_redone"] for s in summaries)
    # at most what the two trainers had in flight (2), plus the finished buckets whose partitions they still
    # held unwritten when the group stopped (their training died with them): a trainer holds 2 of the 4
    # partitions, so at most the 4 buckets among them each
    assert 0 <= redone <= 2 + 2 * 4
    # epochs away from the kill show every bucket exactly once (around it, a bucket may have run twice)
    killed_at = versions_seen[0]
    per_epoch = buckets_per_epoch([r for r in records if r.get("epoch_idx") not in (killed_at, killed_at + 1)])
    assert len(per_epoch) >= 38
    for buckets in per_epoch.values():
        assert sorted(buckets) == sorted(all_buckets(4, 4))


# a bucket of UMLS that trains for seconds, not milliseconds: the peer timeout (2 s) then finds the survivors
# mid-bucket, not waiting on the lost rank's partitions (having given everything back while waiting, as they would)
SLOW_BUCKETS = {"dimension": 1024, "num_uniform_negs": 16000, "batch_size": 50}


def _rank_of(agents: Agents, name: str, world_size: int) -> int:
    """The rank agent ``name``'s worker has in the group formed last (from its log)."""
    found = re.findall(rf"rank (\d+) of {world_size} joined round", (agents.log_dir / f"{name}.log").read_text())
    return int(found[-1]) if found else -1


def _mid_pass(checkpoint_path: str, agents: Agents, world_size: int, deadline: float, first: int = 1,
              spare: tuple[str, ...] = ()) -> set[int]:
    """Wait until the group of ``world_size`` trains a pass (version ``first`` or later) with buckets already done
    and a rank other than 0 training one (one whose agent is not in ``spare``); returns the ranks with a bucket in
    flight."""
    from job.checkpoint.group_progress import current_state
    from job.formats.checkpoint import CheckpointStorage

    storage = CheckpointStorage(checkpoint_path)
    while time.monotonic() < deadline:
        version = storage.load_version()
        progress = current_state(checkpoint_path) or {}
        formed = all(_rank_of(agents, name, world_size) >= 0 for name in agents.procs)
        in_flight = {int(rank) for rank in progress.get("in_flight", {})}
        spared = {_rank_of(agents, name, world_size) for name in spare}
        if (formed and version >= first and progress.get("version") == version + 1 and len(progress.get("done", [])) >= 2
                and in_flight - {0} - spared):
            return in_flight
        time.sleep(0.02)
    raise AssertionError("training never got going: " + agents.tail())


def _resumed(agents: Agents) -> list[tuple[int, dict[str, int]]]:
    """Each resumed pass's buckets to redo and, by rank of the round that ended, whose they were."""
    found = re.findall(r"resuming pass \d+: \d+ of 16 buckets already done, (\d+) to redo \(by rank of the round "
                       r"that ended: (\{[^}]*\})\)", agents.text())
    return [(int(redo), json.loads(by_rank)) for redo, by_rank in found]


def _three_ranks_one_killed_mid_pass(path: Path, checkpoint_path: str, tmp_path: Path
                                     ) -> tuple[Agents, int, list[str], dict[str, int]]:
    """Three agents train ``path`` (a 2 s peer timeout); mid-pass one whose rank is training and is not rank 0 is
    SIGKILLed and the survivors run to their end. Never agent ``a``: it hosts the c10d rendezvous store, whose loss
    ends the job for everyone (exit 77), and its worker is not always rank 0 (ranks follow the rendezvous, not the
    agents' start order). Returns the (stopped) agents, the lost rank, the survivors and their exit codes."""
    agents = Agents(path, "1:3", tmp_path, env={"BIGGRAPH_PEER_INTERVAL": "0.5", "BIGGRAPH_PEER_TIMEOUT": "2"})
    try:
        for name in "abc":
            agents.start(name)
            time.sleep(0.3)
        training = _mid_pass(checkpoint_path, agents, 3, time.monotonic() + 240, spare=("a",))
        victim = next(name for name in "bc" if _rank_of(agents, name, 3) in training - {0})
        lost_rank = _rank_of(agents, victim, 3)
        agents.kill_node(victim)
        survivors = [name for name in "abc" if name != victim]
        codes = agents.wait(survivors, timeout=300)
    finally:
        agents.stop()
    return agents, lost_rank, survivors, codes


@pytest.mark.slow
@pytest.mark.parametrize("handoff", [False, True])
def test_a_killed_rank_costs_only_its_own_buckets_the_survivors_give_back_theirs(umls_p4: dict, tmp_path: Path,
                                                                                  handoff: bool) -> None:
    """Issue #30: rank 0 declares a SIGKILLed peer dead; the survivors finish their bucket, give back what they hold
    and exit, rank 0 serving until they have; the resumed pass redoes only the lost rank's buckets (its bucket in
    flight and the done ones whose partitions died unwritten with it), none of the survivors'. With
    ``partition_handoff`` (issue 45) the same: the rows the lost rank kept die with it and are read from storage."""
    # buckets slow enough (~1 s here) that the survivors are still training when the peer timeout (2 s) expires
    path = write_run_config(umls_p4, f"drained-{handoff}", num_epochs=2, partition_handoff=handoff, **SLOW_BUCKETS)
    checkpoint_path = json.loads(path.read_text())["checkpoint_path"]
    agents, lost_rank, survivors, codes = _three_ranks_one_killed_mid_pass(path, checkpoint_path, tmp_path)
    assert codes == dict.fromkeys(survivors, 0), agents.tail()
    text = agents.text()
    assert "every live rank gave back what it held" in text, agents.tail()
    # rank 0 finished its bucket and gave back (the other survivor too, unless it held nothing then: waiting for a
    # bucket, or at the pass's barrier, it is cut off by rank 0's exit with nothing to lose)
    assert "rank 0: the round ends" in text, agents.tail()
    # every trainer, the first ones and the survivors' restarted ones, came from a warm spare (job/train/elastic/spare.py)
    startups = [line for line in text.splitlines() if "start-up: first bucket trained" in line]
    assert len(startups) >= 3 and all("after its hand-off" in line for line in startups), startups
    resumed = _resumed(agents)
    assert resumed, agents.tail()
    redo, by_rank = resumed[0]
    assert set(by_rank) <= {str(lost_rank)}, (lost_rank, by_rank)
    # its bucket in flight, and at most the 4 buckets among the 2 partitions it held
    assert redo == sum(by_rank.values()) <= 1 + 4
    records = bucket_records(checkpoint_path)
    assert len([r for r in records if r.get("pass_summary")]) == 2
    assert_each_bucket_once_per_epoch(records, 2)  # the committed stats: one line per bucket and pass


@pytest.mark.slow
@pytest.mark.parametrize("shards", [False, True])
def test_written_behind_a_killed_rank_rolls_the_group_back_to_the_last_cut_and_each_bucket_is_still_trained_once(
        umls_p4: dict, tmp_path: Path, shards: bool) -> None:
    """``write_behind_buckets`` (job/train/distributed/cuts.py), a cut every 4 buckets: a SIGKILLed peer's kept rows
    were the only copy of buckets no cut stored, so the resumed pass redoes every bucket done since the last cut
    (whoever did it), and nothing else: every bucket still reaches the committed version once per epoch. ``shards``
    (``shared_shards``): the killed rank served a third of the relation rows too; the two left re-form with the rows
    split between them, every shard starting from the vector rank 0 persisted."""
    path = write_run_config(umls_p4, "behind-killed" + ("-shards" if shards else ""), num_epochs=2,
                            partition_handoff=True, write_behind_buckets=4, shared_shards=shards, **SLOW_BUCKETS)
    checkpoint_path = json.loads(path.read_text())["checkpoint_path"]
    agents, _, survivors, codes = _three_ranks_one_killed_mid_pass(path, checkpoint_path, tmp_path)
    assert codes == dict.fromkeys(survivors, 0), agents.tail()
    resumed = _resumed(agents)
    assert resumed, agents.tail()
    redo, by_rank = resumed[0]
    # the buckets done since the last recorded cut and those in flight: a cut's 4 and the other ranks' 2 in flight
    # when it became due (its set, job/train/distributed/cut_behind.py), those they started while it was taken in the
    # background (about one each, two at most), one in flight per rank; never the pass's 16
    assert 1 <= redo == sum(by_rank.values()) <= 4 + 2 + 2 * 2 + 3, (redo, by_rank)
    records = bucket_records(checkpoint_path)
    assert len([r for r in records if r.get("pass_summary")]) == 2
    assert_each_bucket_once_per_epoch(records, 2)
    assert "cut_partitions_staged" in agents.text(), agents.tail()
    if shards:  # rows went through the shards, and each pass's end found rank 0's persisted vector whole
        assert re.search(r'"shard_bytes": [1-9]', agents.text()), agents.tail()
        gaps = [float(g) for g in re.findall(r"differs from the served one by at most (\S+) at", agents.text())]
        assert gaps and max(gaps) < 1e-4, gaps


@pytest.mark.slow
def test_written_behind_a_pod_leaving_in_order_takes_a_cut_first_and_nothing_is_redone(umls_p4: dict,
                                                                                       tmp_path: Path) -> None:
    """Issue 45: ``write_behind_buckets`` -1 (a cut only at the commit), three agents; mid-pass (the first) one agent (not the
    rendezvous host) gets SIGTERM, as the kubelet sends it to a pod deleted, evicted or scaled down. Its worker
    finishes its bucket and says it leaves; the group takes a cut first (every rank stages what it holds, the leaving
    one included), then the round ends and the two others re-form: the resumed pass redoes no bucket (before, it
    redid every bucket done in the pass), and each bucket reaches the committed version once per epoch."""
    path = write_run_config(umls_p4, "behind-leaving", num_epochs=1, partition_handoff=True, write_behind_buckets=-1,
                            **SLOW_BUCKETS)
    checkpoint_path = json.loads(path.read_text())["checkpoint_path"]
    # nothing here waits on a death: a long peer timeout, so that a stall of this shared machine is not taken for one
    agents = Agents(path, "1:3", tmp_path, env={"BIGGRAPH_PEER_TIMEOUT": "60"})
    try:
        for name in "abc":
            agents.start(name)
            time.sleep(0.3)
        _mid_pass(checkpoint_path, agents, 3, time.monotonic() + 240, first=0)
        # not the rendezvous host ("a"), and not rank 0 (the lock server leaving is an orderly end too, but the
        # pod scaled down is the common case)
        victim = next(name for name in "bc" if _rank_of(agents, name, 3) != 0)
        agents.procs[victim].send_signal(signal.SIGTERM)
        survivors = [name for name in "abc" if name != victim]
        codes = agents.wait(survivors, timeout=300)
        agents.wait([victim], timeout=60)
    finally:
        agents.stop()
    assert codes == dict.fromkeys(survivors, 0), agents.tail()
    # the round the SIGTERM ended: its resumed pass redoes nothing (a later round's end, a stall of this machine
    # taken for a loss say, would roll back as designed: not what is tested here)
    resumed = _resumed(agents)
    assert resumed and resumed[0] == (0, {}), (resumed, agents.tail())
    text = agents.text()
    assert "the group takes a cut first" in text, agents.tail()
    records = bucket_records(checkpoint_path)
    summaries = [r for r in records if r.get("pass_summary")]
    assert len(summaries) == 1 and (len(resumed) > 1 or summaries[0]["buckets_redone"] == 0), summaries
    assert_each_bucket_once_per_epoch(records, 1)


def _sigterm_mid_pass(path: Path, tmp_path: Path, env: dict[str, str] | None = None,
                      first_until: str | None = None) -> tuple[Agents, dict[str, int]]:
    """Two agents train ``path``; mid-pass every worker's process group gets SIGTERM, as the agent's
    ``SubprocessHandler.close`` sends it (Hogwild workers included); returns the agents and their exit codes.

    With ``first_until`` (a pattern) the agent of a rank other than 0 with a bucket in flight gets it first, and
    rank 0's only once that pattern is in the logs (or 60 s passed): with no drain window rank 0 leaves at once, and
    a peer that sees its connection close before its own SIGTERM leaves as for a lost rank 0 instead."""
    checkpoint_path = json.loads(path.read_text())["checkpoint_path"]
    agents = Agents(path, "1:2", tmp_path, env=env)
    try:
        agents.start("a")
        time.sleep(0.3)
        agents.start("b")
        in_flight = _mid_pass(checkpoint_path, agents, 2, time.monotonic() + 240)
        order = ["a", "b"]
        if first_until is not None:
            ranks = {name: _rank_of(agents, name, 2) for name in order}
            order.sort(key=lambda name: (ranks[name] == 0, ranks[name] not in in_flight))
        for name in order:
            agents.terminate_workers(name)
            if first_until is not None and name == order[0]:
                until = time.monotonic() + 60
                while time.monotonic() < until and not re.search(first_until, agents.text()):
                    time.sleep(0.02)
        codes = agents.wait(["a", "b"], timeout=300)
    finally:
        agents.stop()
    return agents, codes


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_sigterm_of_every_worker_as_the_agent_sends_it_leaves_nothing_to_redo(umls_p4: dict, tmp_path: Path,
                                                                              workers: int) -> None:
    """The torchrun agent stops its workers with SIGTERM (then SIGKILL 30 s later) to re-form the group when a node
    waits to join. Each worker finishes its bucket and gives back what it holds, rank 0 serving until all have; they
    exit non-zero, torchrun restarts them, and the resumed pass has nothing to redo. With Hogwild workers (which
    the SIGTERM reaches too: the whole process group) the same: they stay until their trainer is done with them."""
    path = write_run_config(umls_p4, f"terminated-{workers}", num_epochs=2, workers=workers, **SLOW_BUCKETS)
    checkpoint_path = json.loads(path.read_text())["checkpoint_path"]
    agents, codes = _sigterm_mid_pass(path, tmp_path)
    assert codes == {"a": 0, "b": 0}, agents.tail()
    text = agents.text()
    assert "received SIGTERM" in text and "every live rank gave back what it held" in text, agents.tail()
    assert "Hogwild worker" not in text and "worker(s) died" not in text, agents.tail()
    resumed = _resumed(agents)
    assert resumed and all(redo == 0 and not by_rank for redo, by_rank in resumed), resumed
    records = bucket_records(checkpoint_path)
    summaries = [r for r in records if r.get("pass_summary")]
    # (the group was re-formed: ``resumed``; ``restart_count`` may stay 0, as rank 0's agent may have restarted its
    # worker for the membership change, which torchrun does not count)
    assert len(summaries) == 2 and sum(s["buckets_redone"] for s in summaries) == 0
    assert_each_bucket_once_per_epoch(records, 2)


@pytest.mark.slow
def test_a_bucket_that_cannot_end_before_the_drain_deadline_is_given_up_at_once(umls_p4: dict,
                                                                                tmp_path: Path) -> None:
    """A drain deadline shorter than any bucket (``BIGGRAPH_DRAIN_TIMEOUT`` 0, buckets of ~1 s; as a big graph's
    buckets of minutes under the default 25 s): at the SIGTERM each rank with a bucket in flight (rank 1 at least,
    ``_mid_pass``) gives it up at its next batch instead of training on (it was redone anyway, and the group waited
    for it, then for the agent's SIGKILL). Its partitions are not written, its locks go back, the resumed pass trains
    it again (counted as redone, with any bucket done before it whose rows were still only in memory), and the
    committed passes hold every bucket once per epoch."""
    path = write_run_config(umls_p4, "given-up", num_epochs=2, **SLOW_BUCKETS)
    checkpoint_path = json.loads(path.read_text())["checkpoint_path"]
    pattern = r"rank (\d+): the round ends \(.*\) and bucket \(\d+, \d+\) cannot finish before the drain deadline"
    agents, codes = _sigterm_mid_pass(path, tmp_path, env={"BIGGRAPH_DRAIN_TIMEOUT": "0"}, first_until=pattern)
    assert codes == {"a": 0, "b": 0}, agents.tail()
    given_up = re.findall(pattern, agents.text())
    assert given_up, agents.tail()
    records = bucket_records(checkpoint_path)
    summaries = [r for r in records if r.get("pass_summary")]
    assert len(summaries) == 2
    # each given-up bucket was trained again, and counted so
    assert sum(s["buckets_redone"] for s in summaries) >= len(given_up), (given_up, summaries)
    assert_each_bucket_once_per_epoch(records, 2)


@pytest.mark.slow
def test_a_killed_node_is_found_through_its_connection_with_a_peer_timeout_of_ten_minutes(umls_p4: dict,
                                                                                        tmp_path: Path) -> None:
    """Node b is SIGKILLed mid-pass with ``BIGGRAPH_PEER_TIMEOUT`` at ten minutes: rank 0 still declares it dead
    (its liveness connection closed, job/train/distributed/liveness.py), the group re-forms without it and the run completes.
    The wait below is a hang guard: through the heartbeat alone the survivor would wait the ten minutes."""
    from job.checkpoint.group_progress import current_state
    from job.formats.checkpoint import CheckpointStorage

    epochs = 8
    path = write_run_config(umls_p4, "liveness", num_epochs=epochs)
    checkpoint_path = json.loads(path.read_text())["checkpoint_path"]
    storage = CheckpointStorage(checkpoint_path)
    agents = Agents(path, "1:2", tmp_path, env={"BIGGRAPH_PEER_TIMEOUT": "600"})
    try:
        agents.start("a")
        time.sleep(0.5)
        agents.start("b")
        deadline = time.monotonic() + 240
        while True:  # b killed in the middle of a pass, holding partitions
            assert time.monotonic() < deadline, "training never got going: " + agents.tail()
            version = storage.load_version()
            progress = current_state(checkpoint_path) or {}
            if version >= 1 and progress.get("version") == version + 1 and progress.get("done"):
                break
            time.sleep(0.02)
        assert version < epochs - 1, "the run ended before the kill; give it more epochs"
        agents.kill_node("b")
        codes = agents.wait(["a"], timeout=300)
    finally:
        agents.stop()
    assert codes["a"] == 0, agents.tail()
    assert storage.load_version() == epochs
    logs = agents.text()
    assert "rank 1's liveness connection to rank 0 closed without a goodbye" in logs, agents.tail()
    assert "rank 1 stopped responding" in logs  # declared as the heartbeat declares, then the same path
    summaries = [r for r in bucket_records(checkpoint_path) if r.get("pass_summary")]
    assert "without spending a restart" in logs and summaries[-1]["world_size"] == 1  # re-formed, for free


@pytest.mark.slow
def test_a_node_added_during_training_joins_and_takes_buckets(umls_p4: dict, tmp_path: Path) -> None:
    from job.formats.checkpoint import CheckpointStorage

    path = write_run_config(umls_p4, "scaleup", num_epochs=30)
    checkpoint_path = json.loads(path.read_text())["checkpoint_path"]
    storage = CheckpointStorage(checkpoint_path)
    agents = Agents(path, "1:2", tmp_path)
    try:
        agents.start("a")
        deadline = time.monotonic() + 180
        while storage.load_version() < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert storage.load_version() >= 2, agents.tail()
        agents.start("b")
        codes = agents.wait(["a", "b"], timeout=300)
    finally:
        agents.stop()
    assert codes == {"a": 0, "b": 0}, agents.tail()
    assert storage.load_version() == 30
    summaries = [r for r in bucket_records(checkpoint_path) if r.get("pass_summary")]
    assert summaries[0]["world_size"] == 1
    assert summaries[-1]["world_size"] == 2
    late = [r for r in bucket_records(checkpoint_path) if "rank" in r and r["epoch_idx"] >= summaries[-1]["epoch_idx"]]
    assert {r["rank"] for r in late} == {0, 1}


@pytest.fixture
def two_hosts() -> list[tuple[str, str, str]]:
    """Two network namespaces joined by a veth pair: (namespace, address, interface) each."""
    tag = f"{os.getpid() % 10000}"
    hosts = [(f"bg{tag}a", "10.201.0.1", f"bgv{tag}a"), (f"bg{tag}b", "10.201.0.2", f"bgv{tag}b")]

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True)

    try:
        for ns, _, _ in hosts:
            ip("netns", "add", ns)
        ip("link", "add", hosts[0][2], "type", "veth", "peer", "name", hosts[1][2])
        for ns, address, iface in hosts:
            ip("link", "set", iface, "netns", ns)
            ip("-n", ns, "addr", "add", f"{address}/24", "dev", iface)
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "link", "set", iface, "up")
    except (FileNotFoundError, subprocess.CalledProcessError) as err:
        for ns, _, _ in hosts:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        detail = getattr(err, "stderr", None) or str(err)
        pytest.skip(f"cannot create network namespaces here (needs iproute2 and CAP_NET_ADMIN): {detail.strip()}")
    yield hosts
    for ns, _, _ in hosts:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.mark.slow
def test_two_hosts_in_separate_network_namespaces_train_together(umls_p4: dict, two_hosts: list, tmp_path: Path) -> None:
    path = write_run_config(umls_p4, "netns", num_epochs=3)
    port = free_port()
    # Not ``Agents``: these run inside network namespaces, each on its own address and interface, as a fixed
    # group with torchrun's own restart and rendezvous defaults (nothing here is elastic).
    procs = []
    for index, (ns, address, iface) in enumerate(two_hosts):
        env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=iface,
                   PYTHONUNBUFFERED="1")
        log = open(tmp_path / f"{ns}.log", "w")  # closed with the process
        procs.append(subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
             "--rdzv-backend=c10d", f"--rdzv-endpoint={two_hosts[0][1]}:{port}", "--rdzv-id=biggraph-netns",
             f"--local-addr={address}", f"--rdzv-conf=is_host={'true' if index == 0 else 'false'},join_timeout=120",
             "-m", "job", "train", str(path)],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        ))
    try:
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs = "\n".join(f.read_text()[-2000:] for f in tmp_path.glob("*.log"))
    assert codes == [0, 0], logs
    records = bucket_records(json.loads(path.read_text())["checkpoint_path"])
    assert_each_bucket_once_per_epoch(records, 3)
    assert {r["rank"] for r in records if "rank" in r} == {0, 1}
    assert all(r["world_size"] == 2 for r in records if r.get("pass_summary"))


@pytest.mark.slow
def test_every_trainer_of_a_group_takes_the_decayed_rate(umls_p4: dict, tmp_path: Path) -> None:
    """lr_decay 0 in a group of two: each trainer derives epoch 2's rate (0) from the pass it runs, so no partition
    either trains in epoch 2 changes, and both log the same rate."""
    import numpy as np

    from job.formats.checkpoint import CheckpointStorage

    path = write_run_config(umls_p4, "decayed", num_epochs=2, lr_decay=0.0, checkpoint_preservation_interval=1)
    agents = Agents(path, "2", tmp_path)
    codes = agents.run(["a", "b"], timeout=300)
    assert codes == {"a": 0, "b": 0}, agents.tail()
    for name in ("a", "b"):
        assert "learning rate for epoch 2: lr 0, relation_lr 0" in (tmp_path / f"{name}.log").read_text(), agents.tail()
    records = bucket_records(json.loads(path.read_text())["checkpoint_path"])
    assert {r["rank"] for r in records if "rank" in r and r.get("epoch_idx") == 1} == {0, 1}  # both trained epoch 2
    storage = CheckpointStorage(json.loads(path.read_text())["checkpoint_path"])
    for part in range(4):
        after_one, _ = storage.load_entity_partition(1, "all", part, base=storage.snapshot_dir(0))
        after_two, _ = storage.load_entity_partition(2, "all", part)
        np.testing.assert_array_equal(after_one, after_two)
