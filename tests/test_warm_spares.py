"""job/train/elastic/spare.py: warm spares, processes that import torch and the trainer while the rendezvous forms, then
become the trainer torchrun starts. Real processes throughout (tests/spare_probe.py stands in for ``python -m job``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from job.train.elastic import agent
from job.train.elastic.spare import PER_TRAINER_KEYS, SparePool, environment_mismatch

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
PROBE = [sys.executable, "-u", "-m", "spare_probe"]


@pytest.fixture(autouse=True)
def _probe_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Spares start with the agent's environment: this one finds tests/spare_probe.py."""
    monkeypatch.setenv("PYTHONPATH", f"{TESTS}:{REPO}")
    monkeypatch.delenv("BIGGRAPH_WARM_SPARES", raising=False)


def _output(proc: subprocess.Popen, stdout_path: Path) -> dict[str, Any]:
    proc.wait(timeout=60)
    return json.loads(stdout_path.read_text().strip().splitlines()[-1])


def _trainer_env(**extra: str) -> dict[str, str]:
    """What torchrun hands a trainer: the agent's environment and the per-trainer variables."""
    return dict(os.environ, RANK="3", WORLD_SIZE="4", MASTER_ADDR="10.0.0.7", MASTER_PORT="29500",
                TORCHELASTIC_RESTART_COUNT="2", TORCHELASTIC_RUN_ID="run", **extra)


def _pool_with_output(tmp_path: Path, command: list[str], count: int = 1) -> tuple[SparePool, Path]:
    """A pool whose spares write their output to a file (as a pod's trainer writes to the pod's log)."""
    out = tmp_path / "out.txt"
    pool = SparePool(command, count)
    with out.open("w") as sink:  # the spares inherit stdout: point ours at the file while they start
        saved = os.dup(1)
        os.dup2(sink.fileno(), 1)
        try:
            pool.warm()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
    return pool, out


def test_a_spare_becomes_the_trainer_with_its_arguments_environment_and_exit_code(tmp_path: Path) -> None:
    command = [*PROBE, "train", "config.yaml", "7"]
    pool, out = _pool_with_output(tmp_path, command)
    assert pool.alive() == 1
    [spare_pid] = pool.pids()
    proc = pool.take(command, _trainer_env())
    assert proc is not None and proc.pid == spare_pid  # the process torchrun watches is the spare itself
    seen = _output(proc, out)
    assert proc.returncode == 7
    assert seen["argv"] == ["train", "config.yaml", "7"] and seen["name"] == "__main__" and seen["rank"] == "3"
    assert seen["torch_imported"] and seen["stdin"] == "/dev/null" and seen["session_leader"]
    assert seen["marker"] is None  # the spare's marker is not the trainer's
    assert seen["spare"].startswith("a warm spare: its imports took")
    assert (pool.handed_off, pool.cold_starts, pool.alive()) == (1, 0, 0)


def test_a_spare_is_not_used_where_the_environment_differs_beyond_what_torchrun_sets_per_trainer(
        tmp_path: Path) -> None:
    command = [*PROBE, "0"]
    pool = SparePool(command, 1)
    pool.warm()
    [spare_pid] = pool.pids()
    assert pool.take(command, _trainer_env(OMP_NUM_THREADS="9")) is None  # read when torch loads: a cold start
    assert not _running(spare_pid), "the unusable spare was ended"
    assert pool.cold_starts == 1 and pool.handed_off == 0
    pool.warm()
    assert pool.take([sys.executable, "-u", "-m", "json.tool"], _trainer_env()) is None  # another module
    assert pool.alive() == 0, "a spare that fits no trainer of the round does not wait through it"
    assert environment_mismatch({"A": "1"}, {"A": "1", **dict.fromkeys(PER_TRAINER_KEYS, "x"),
                                             "TORCHELASTIC_ERROR_FILE": "/e"}) is None
    assert environment_mismatch({"A": "1", "LD_PRELOAD": "x"}, {"A": "1"}) == "LD_PRELOAD"
    pool.close()


def test_spares_are_off_for_other_commands_and_by_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    assert SparePool([sys.executable, "train.py"], 1).reason_off is not None  # torchrun without -m
    monkeypatch.setenv("BIGGRAPH_WARM_SPARES", "0")
    pool = SparePool(PROBE, 1)
    assert pool.reason_off == "BIGGRAPH_WARM_SPARES=0"
    pool.warm()
    assert pool.alive() == 0 and pool.take(PROBE, _trainer_env()) is None


def test_an_unused_spare_exits_when_its_agent_dies(tmp_path: Path) -> None:
    """An agent SIGKILLed with a lost pod leaves no spare behind: the spare reads the end of its stdin."""
    pids = tmp_path / "pids"
    script = textwrap.dedent(f"""
        import sys, time
        from job.train.elastic.spare import SparePool
        pool = SparePool({PROBE!r}, 2)
        pool.warm()
        open({str(pids)!r}, "w").write(" ".join(map(str, pool.pids())))
        time.sleep(600)
    """)
    fake_agent = subprocess.Popen([sys.executable, "-c", script], env=dict(os.environ))
    deadline = time.monotonic() + 60
    while not (pids.exists() and pids.read_text()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    spare_pids = [int(pid) for pid in pids.read_text().split()]
    fake_agent.kill()
    fake_agent.wait()
    deadline = time.monotonic() + 60
    while any(_running(pid) for pid in spare_pids):
        assert time.monotonic() < deadline, "a spare outlived its agent"
        time.sleep(0.1)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_torchruns_process_handler_takes_a_spare_and_its_close_signals_it(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent's hooks (job/train/elastic/agent.py): the launch makes the pool, the agent's rendezvous warms it, and
    torch's ``SubprocessHandler`` gets the spare's process, which its ``close`` (a killpg) ends."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    monkeypatch.setattr(subprocess_handler.SubprocessHandler, "_popen", subprocess_handler.SubprocessHandler._popen)
    monkeypatch.setattr(agent, "_pool", SparePool([sys.executable, "-u", "-m", "spare_probe", "sleep"], 1))
    assert agent.install_spares() is None
    monkeypatch.setattr(agent.LocalElasticAgent, "_rendezvous", lambda self, group: None)
    warming = agent.BiggraphAgent.__new__(agent.BiggraphAgent)
    warming._pool = agent._pool
    warming._rendezvous(None)  # what the agent does before each rendezvous
    pool = agent._pool
    assert pool.alive() == 1
    [spare_pid] = pool.pids()
    handler = subprocess_handler.SubprocessHandler(
        entrypoint=sys.executable, args=("-u", "-m", "spare_probe", "sleep"), env={"RANK": "0"},
        stdout=None, stderr=None, local_rank_id=0, numa_options=None)
    assert handler.proc.pid == spare_pid and pool.handed_off == 1
    handler.close(signal.SIGKILL)
    assert handler.proc.wait(timeout=60) in (0, -signal.SIGKILL)
    # output redirected by torchrun (--redirects): a spare's output is fixed, so a fresh process starts
    pool.warm()
    redirected = subprocess_handler.SubprocessHandler(
        entrypoint=sys.executable, args=("-u", "-m", "spare_probe", "0"), env={"RANK": "0"},
        stdout=str(tmp_path / "o"), stderr=str(tmp_path / "e"), local_rank_id=0, numa_options=None)
    assert redirected.proc.wait(timeout=60) == 0 and pool.handed_off == 1
    assert pool.alive() == 0 and pool.cold_starts == 1  # the unusable spare was ended, not left waiting
    assert json.loads((tmp_path / "o").read_text())["spare"] is None
    pool.close()
