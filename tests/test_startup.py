"""A torchrun group's start-up: the input checked once (rank 0) with its verdict and facts handed to every rank, a
heartbeat that judges a starting peer from its first beat without hiding a peer that died, and the start-up clock.

The group tests form real groups of processes by hand (MASTER_ADDR/RANK/WORLD_SIZE, no torchrun: as
tests/test_elastic_rounds.py does), each rank with a config of its own: a rank that took rank 0's verdict instead
of checking its own input is told apart by giving it input that its own check would judge otherwise.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
from helpers_distributed import Agents, free_port, wait_until
from helpers_graphs import write_cycle_graph

from job.train.distributed.group import Heartbeat
from job.train.distributed.heartbeat import read_beat
from job.train.startup import StartupClock, process_age

# one rank: joins the group, takes the input's facts (its own config: argv[1]), prints what it got, leaves
CHECK_SCRIPT = """
import json, sys
from job.config import load_config
from job.errors import UserError
from job.train.distributed.group import init_distributed, leave
from job.train.input_check import checked_input
from storage_adapters.errors import StorageError
ctx = init_distributed("digest")
try:
    facts = checked_input(load_config(sys.argv[1]), ctx)
    out = {"rank": ctx.rank, "counts": facts.entity_counts, "chunks": facts.num_chunks,
           "dynamic": facts.num_dynamic_rels}
except (UserError, StorageError) as err:
    out = {"rank": ctx.rank, "error": str(err), "exit_code": err.exit_code, "kind": type(err).__name__}
print(json.dumps(out), flush=True)
leave(ctx)
"""


def rank_env(port: int, rank: int, world_size: int, **extra: str) -> dict[str, str]:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
               WORLD_SIZE=str(world_size), TORCHELASTIC_RUN_ID="startup-test", OMP_NUM_THREADS="1", **extra)
    env.pop("BIGGRAPH_RUN_ID", None)
    return env


def run_group(script: str, args: list[list[str]]) -> list[dict]:
    """One process per rank (``args[rank]``: its arguments), joined into a gloo group; each one's JSON line."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", script, *rank_args], env=rank_env(port, rank, len(args)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank, rank_args in enumerate(args)]
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
        outputs.append(json.loads(out.strip().splitlines()[-1]))
    return outputs


def graph_config(root: Path, num_partitions: int = 2, **changes: object) -> Path:
    """A cycle graph (2 partitions) under ``root`` and its config file."""
    config = write_cycle_graph(root, num_entities=40, num_partitions=num_partitions, **changes)
    path = root / "config.json"
    path.write_text(json.dumps(config))
    return path


def test_rank_0_checks_the_input_and_the_other_ranks_take_its_facts(tmp_path: Path) -> None:
    """Ranks 1 and 2 are given a config whose input does not exist: they never look at it (their own check would
    refuse it), and get rank 0's entity counts and edge chunks."""
    good = graph_config(tmp_path / "good")
    missing = json.loads(good.read_text())
    missing.update(entity_path=str(tmp_path / "nowhere" / "entities"), edge_paths=[str(tmp_path / "nowhere" / "e")])
    elsewhere = tmp_path / "missing.json"
    elsewhere.write_text(json.dumps(missing))
    outputs = run_group(CHECK_SCRIPT, [[str(good)], [str(elsewhere)], [str(elsewhere)]])
    assert [o.get("error") for o in outputs] == [None, None, None], outputs
    counts = [int((tmp_path / "good" / "entities" / f"entity_count_node_{p}.txt").read_text()) for p in range(2)]
    assert outputs[0]["counts"] == {"node": counts} and outputs[0]["chunks"] == 1
    assert all(o["counts"] == outputs[0]["counts"] and o["chunks"] == outputs[0]["chunks"] for o in outputs)


def test_a_refusal_by_rank_0s_check_reaches_every_rank_with_the_file_and_the_exit_code(tmp_path: Path) -> None:
    """Rank 0's input lacks a bucket file; ranks 1 and 2 have all of theirs (their own check would pass), and still
    refuse, with rank 0's message naming the missing file and exit code 2, as a rank that checked itself."""
    good = graph_config(tmp_path / "good")
    bad = graph_config(tmp_path / "bad")
    missing_file = tmp_path / "bad" / "edges" / "edges_1_0.h5"
    missing_file.unlink()
    outputs = run_group(CHECK_SCRIPT, [[str(bad)], [str(good)], [str(good)]])
    for output in outputs:
        assert output.get("exit_code") == 2, outputs
        assert str(missing_file) in output["error"], output
    assert outputs[0]["kind"] == "InputFormatError"
    assert [o["kind"] for o in outputs[1:]] == ["InputRefused", "InputRefused"]
    assert all("rank 0's input check" in o["error"] for o in outputs[1:])


def test_storage_errors_are_handed_on_as_refusals_too(tmp_path: Path) -> None:
    """A config whose input is on an object store with no backend for its scheme (a StorageError, exit 2): every
    rank refuses, the others with rank 0's message."""
    good = graph_config(tmp_path / "good")
    config = json.loads(good.read_text())
    config.update(entity_path="nosuchscheme://bucket/entities", edge_paths=["nosuchscheme://bucket/edges"])
    unreachable = tmp_path / "unreachable.json"
    unreachable.write_text(json.dumps(config))
    outputs = run_group(CHECK_SCRIPT, [[str(unreachable)], [str(good)]])
    assert [o.get("exit_code") for o in outputs] == [2, 2], outputs
    assert "nosuchscheme://bucket" in outputs[1]["error"] and outputs[1]["kind"] == "InputRefused"


def test_the_facts_taken_from_the_check_are_what_the_trainer_would_read_itself(tmp_path: Path) -> None:
    """Entity counts, dynamic relation count and edge chunks from what ``validate_cheap`` read equal the trainer's
    own readers' (the chunks with a ``max_edges_per_chunk`` that cuts the largest bucket file)."""
    from job.config import load_config
    from job.formats.entities import read_dynamic_rel_count
    from job.train.input_check import read_facts
    from job.train.inputs import count_edge_chunks, read_entity_counts

    path = graph_config(tmp_path, num_partitions=2, dynamic=True)
    for max_edges in (7, 1_000_000):
        config = load_config(str(path), [f"max_edges_per_chunk={max_edges}"])
        facts = read_facts(config)
        assert facts.entity_counts == read_entity_counts(config)
        assert facts.num_dynamic_rels == read_dynamic_rel_count(config.entity_path)
        assert facts.num_chunks == count_edge_chunks(config)
    assert read_facts(load_config(str(path), ["max_edges_per_chunk=7"])).num_chunks > 1


# the heartbeat ------------------------------------------------------------------------------------------


def test_a_peer_whose_first_beat_comes_after_the_peer_timeout_is_not_declared_dead_then_is_when_it_stops() -> None:
    """The late peer starts beating well after ``dead_after`` (as a starting pod whose store connection stalled
    on DNS): judged from the group's forming, it was declared dead; judged from its first beat, it is alive. When
    its beats stop, it is declared dead: the start-up allowance does not hide a death."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    interval, dead_after = 0.05, 0.3
    watcher = Heartbeat(store, 0, 3, interval=interval, dead_after=dead_after, first_beat_after=600)
    prompt = Heartbeat(store, 1, 3, interval=interval, dead_after=dead_after)
    late = None
    try:
        time.sleep(4 * dead_after)  # the late peer has not beaten for four peer timeouts
        late = Heartbeat(store, 2, 3, interval=interval, dead_after=dead_after)
        assert wait_until(lambda: read_beat(store, "0", 2) > 10)
        assert watcher.dead_rank is None
        late.stop()
        assert wait_until(lambda: watcher.dead_rank is not None)
        assert watcher.dead_rank == 2 and watcher.silent_for == dead_after
        assert store.check(["biggraph/0/dead/2"])  # fenced
    finally:
        for beat in (watcher, prompt, late):
            if beat is not None:
                beat.stop()


def test_a_peer_that_never_beats_is_declared_dead_after_the_first_beat_allowance() -> None:
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    watcher = Heartbeat(store, 0, 3, interval=0.05, dead_after=0.3, first_beat_after=0.5)
    alive = Heartbeat(store, 1, 3, interval=0.05, dead_after=0.3)
    try:
        assert wait_until(lambda: watcher.dead_rank is not None)
        assert watcher.dead_rank == 2 and watcher.silent_for == 0.5
    finally:
        watcher.stop()
        alive.stop()


# a rank that beats, then is killed while the others start: rank 0 names it (real processes)
KILLED_SCRIPT = """
import sys, time
from job.train.distributed.group import init_distributed, wait_all
from job.train.distributed.heartbeat import read_beat
ctx = init_distributed("digest")
if ctx.rank == 2:
    while read_beat(ctx.store, ctx.round_id, 2) == 0:
        time.sleep(0.01)
    print("beating", flush=True)
    time.sleep(600)
wait_all(ctx, "started")
"""


def test_a_rank_killed_during_the_groups_start_up_is_found_by_rank_0() -> None:
    port = free_port()
    env = {"BIGGRAPH_PEER_INTERVAL": "0.2", "BIGGRAPH_PEER_TIMEOUT": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", KILLED_SCRIPT], env=rank_env(port, rank, 3, **env),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(3)]
    try:
        assert procs[2].stdout is not None
        assert procs[2].stdout.readline().strip() == "beating"
        procs[2].send_signal(signal.SIGKILL)
        _, err = procs[0].communicate(timeout=120)
        assert procs[0].returncode != 0
        # found through its liveness connection (job/train/distributed/liveness.py) or, failing that, its heartbeat
        assert re.search(r"rank 2 stopped responding for \d+ s", err), err
        procs[1].communicate(timeout=120)
        assert procs[1].returncode != 0  # its group is gone with rank 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


# the start-up clock ----------------------------------------------------------------------------------------


def test_the_clock_counts_from_the_process_start_and_its_phases_add_up() -> None:
    age = process_age()
    assert age is not None and age > 0  # this process started before this test
    clock = StartupClock()
    clock.mark("one")
    clock.mark("two")
    phases = clock.phases()
    assert [name for name, _ in phases][-2:] == ["one", "two"]
    assert sum(seconds for _, seconds in phases) == pytest.approx(clock.total())
    # from the process's start, not the clock's (the two process ages differ by /proc's 10 ms ticks, and by any
    # pause of the VM, which /proc/uptime counts and the monotonic clock does not)
    assert clock.total() > age / 2


def test_a_trainer_logs_its_start_up_once_after_its_first_bucket(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    from job.config import load_config
    from job.train import train

    path = graph_config(tmp_path, num_epochs=2, workers=1)
    with caplog.at_level(logging.INFO, logger="biggraph"):
        train(load_config(str(path)))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("start-up:")]
    assert len(lines) == 1, lines
    for phase in ("imports", "input check", "model", "partition buffer", "pass start", "bucket trained"):
        assert f"{phase} " in lines[0]


# the whole command under torchrun (slow) ------------------------------------------------------------------


@pytest.mark.slow
def test_every_trainer_of_a_torchrun_group_exits_2_naming_the_bad_file(tmp_path: Path) -> None:
    """``biggraph train`` under torchrun on input with a missing bucket file: each worker prints the command's
    one-line error naming the file and exits 2, rank 1 with rank 0's verdict (the agents restart the group up to
    their ``--max-restarts``; every round refuses the same way, and the agents give up)."""
    path = graph_config(tmp_path / "graph")
    missing_file = tmp_path / "graph" / "edges" / "edges_0_1.h5"
    missing_file.unlink()
    logs = tmp_path / "logs"
    logs.mkdir()
    agents = Agents(path, "2", logs)
    try:
        codes = agents.run(["a", "b"], timeout=300)
    finally:
        shutil.rmtree(tmp_path / "graph" / "checkpoints", ignore_errors=True)
    text = {name: (logs / f"{name}.log").read_text() for name in ("a", "b")}
    assert all(code != 0 for code in codes.values()), codes
    errors = [line for t in text.values() for line in t.splitlines() if "biggraph train: error:" in line]
    assert any("rank 0's input check" in line for line in errors), text
    assert all(str(missing_file) in line for line in errors) and errors, text
    assert all("exitcode: 2" in t for t in text.values()), text


# the input check kept for the next start -----------------------------------------------------------------------


class KeptChecks:
    """``CheckRecords`` over the format's real file (``input_check.json`` through ``CheckpointStorage``)."""

    def __init__(self, checkpoint: Path) -> None:
        from job.formats.checkpoint import CheckpointStorage

        checkpoint.mkdir(parents=True, exist_ok=True)
        self.storage = CheckpointStorage(str(checkpoint))

    def input_check(self) -> dict | None:
        return self.storage.load_input_check()

    def record_input_check(self, record: dict) -> None:
        self.storage.save_input_check(record)


def test_a_passing_input_check_is_not_repeated_until_the_input_or_the_config_changes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A group formed again after a lost pod starts its trainers again: the second start with the same input and
    config takes the kept facts without checking; a changed bucket file, a changed config, a malformed record each
    make the next start check again; a refused input is never kept."""
    from job.config import load_config
    from job.errors import InputFormatError
    from job.train import input_check

    checks: list[str] = []
    real = input_check.validate_cheap

    def counted(config: object) -> object:
        checks.append("checked")
        return real(config)

    monkeypatch.setattr(input_check, "validate_cheap", counted)
    path = graph_config(tmp_path / "graph")
    config = load_config(str(path), [])
    kept = KeptChecks(tmp_path / "checkpoint")
    first = input_check.facts_once(config, kept)
    assert input_check.facts_once(config, kept) == first and len(checks) == 1
    assert input_check.facts_once(config, None) == first and len(checks) == 2  # nothing kept: always checked

    edge_file = tmp_path / "graph" / "edges" / "edges_0_1.h5"
    data = edge_file.read_bytes()
    edge_file.write_bytes(data)  # rewritten in place, later: its change tag moved
    os.utime(edge_file, ns=(time.time_ns(), edge_file.stat().st_mtime_ns + 10_000_000))
    assert input_check.facts_once(config, kept) == first and len(checks) == 3
    assert input_check.facts_once(config, kept) == first and len(checks) == 3

    other = load_config(str(path), ["max_edges_per_chunk=7"])
    assert input_check.facts_once(other, kept).num_chunks > 1 and len(checks) == 4
    assert input_check.facts_once(config, kept) == first and len(checks) == 5  # the record is the last config's

    (tmp_path / "checkpoint" / "input_check.json").write_text('{"format": 1, "config": "x"')  # cut short
    assert input_check.facts_once(config, kept) == first and len(checks) == 6
    record = json.loads((tmp_path / "checkpoint" / "input_check.json").read_text())
    record["facts"] = {"entity_counts": "not counts"}
    (tmp_path / "checkpoint" / "input_check.json").write_text(json.dumps(record))
    assert input_check.facts_once(config, kept) == first and len(checks) == 7

    edge_file.unlink()  # refused: raised, and the next start checks again
    with pytest.raises(InputFormatError):
        input_check.facts_once(config, kept)
    with pytest.raises(InputFormatError):
        input_check.facts_once(config, kept)
    assert len(checks) == 9
    edge_file.write_bytes(data)  # a new file (a new inode)
    assert input_check.facts_once(config, kept) == first and len(checks) == 10
