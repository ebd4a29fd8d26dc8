"""Whether training is already complete (job/checkpoint/completion.py, ``biggraph completed``), and the pod
entrypoint's use of it: a pod that comes back after the others finished exits 0 at once, without a rendezvous that
can no longer happen, and only when the committed version is its own config's last pass.

Real processes throughout: ``python -m job`` for the check, docker/entrypoint.sh with a stand-in torchrun."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from helpers_graphs import write_cycle_graph

from job.checkpoint.completion import training_complete
from job.config import parse_config
from job.train import train

REPO = Path(__file__).resolve().parent.parent
ENTRYPOINT = REPO / "docker" / "entrypoint.sh"
NOT_COMPLETE = 3


def write_config(root: Path, **extra: Any) -> tuple[Path, dict[str, Any]]:
    raw = write_cycle_graph(root / "graph", num_epochs=2, **extra)
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path, raw


def completed(config: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "job", "completed", str(config), *args], capture_output=True,
                          text=True, timeout=120, cwd=cwd, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_complete_only_once_this_configs_last_pass_is_committed(tmp_path: Path) -> None:
    path, raw = write_config(tmp_path)
    config = parse_config(raw)
    none = completed(path)
    assert none.returncode == NOT_COMPLETE and "no version committed" in none.stdout
    train(config, stop_after_iterations=1)
    half = completed(path)
    assert half.returncode == NOT_COMPLETE, half.stdout + half.stderr
    assert "version 1" in half.stdout and "epoch 1/2" in half.stdout
    train(config)
    done = completed(path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines() == [
        f"training already complete: checkpoint version 2 in {config.checkpoint_path} is this config's last pass "
        "(epoch 2/2, edge path 1/1, chunk 1/1); nothing to train"]
    assert training_complete(config).complete and training_complete(config).version == 2
    # the same checkpoint is not the end of a run with more epochs (train's -p overrides are read as train reads them)
    more = completed(path, "-p", "num_epochs=3")
    assert more.returncode == NOT_COMPLETE and "differs: num_epochs" in more.stdout, more.stdout
    # nor of another config pointed at the same checkpoint_path, whatever its epochs
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump({**raw, "num_epochs": 1, "lr": 0.05}))
    stale = completed(other)
    assert stale.returncode == NOT_COMPLETE and "not written by this config" in stale.stdout, stale.stdout
    assert not training_complete(parse_config({**raw, "num_epochs": 1, "lr": 0.05})).complete
    # bad input: one line, exit 2
    bad = completed(path, "-p", "dimensoin=3")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().splitlines() == [
        "biggraph completed: error: override 'dimensoin': unknown key 'dimensoin' (did you mean 'dimension'?)"]


def test_a_grown_checkpoint_is_not_the_end_of_its_config(tmp_path: Path) -> None:
    """A grow with the very config that trained the model commits a version whose metadata still names the last pass
    of that config (it carries the trained version's ``iteration/*``): the check must not take it for the end."""
    from test_grow import COLUMNS, make_trained, run_cli

    root = make_trained(tmp_path / "m")
    with contextlib.chdir(root):
        assert completed(Path("config.json"), cwd=root).returncode == 0
        assert run_cli("grow", "config.json", "new.tsv", *COLUMNS, "--no-train")[0] == 0
        grown = completed(Path("config.json"), cwd=root)
        assert grown.returncode == NOT_COMPLETE, grown.stdout
        assert "was grown" in grown.stdout and "version 3" in grown.stdout


# the entrypoint ---------------------------------------------------------------------------------------------


def stand_in_torchrun(tmp_path: Path, trains: bool) -> Path:
    """A torchrun that records that it ran, optionally runs what it was given (``-m job train ...``: the last commit
    landing while the pod waits), and then fails, as an agent does whose rendezvous is gone."""
    script = tmp_path / "torchrun"
    run = 'while [ $# -gt 0 ] && [ "$1" != -m ]; do shift; done; python "$@" || exit 9\n' if trains else ""
    script.write_text(f"#!/usr/bin/env bash\necho TORCHRUN-RAN\n{run}exit 1\n")
    script.chmod(0o755)
    return script


def run_pod(config: Path, torchrun: Path, index: str = "1") -> subprocess.CompletedProcess:
    """docker/entrypoint.sh as the chart runs it in the pod of ``index`` (BIGGRAPH_CONFIG set, `-m job train`)."""
    env = {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONPATH": str(REPO),
           "BIGGRAPH_TORCHRUN": str(torchrun), "BIGGRAPH_CONFIG": str(config), "JOB_COMPLETION_INDEX": index,
           "BIGGRAPH_RDZV_HOST_INDEX": "0", "OMP_NUM_THREADS": "1"}
    return subprocess.run([str(ENTRYPOINT), "--nnodes=2:3", "--rdzv-conf=join_timeout=60", "-m", "job", "train",
                           str(config)], env=env, capture_output=True, text=True, timeout=180)


def test_a_pod_started_after_training_completed_exits_0_without_torchrun(tmp_path: Path) -> None:
    path, raw = write_config(tmp_path)
    train(parse_config(raw))
    pod = run_pod(path, stand_in_torchrun(tmp_path, trains=False))
    assert pod.returncode == 0, pod.stderr
    assert "TORCHRUN-RAN" not in pod.stdout
    said = [line for line in pod.stderr.splitlines() if "complete" in line]
    assert len(said) == 1, pod.stderr
    assert "biggraph-entrypoint: exit code=0 reason=complete index=1 (start): training already complete: " \
           "checkpoint version 2" in said[0] and "epoch 2/2" in said[0]


def test_a_pod_whose_agent_fails_before_training_completed_fails(tmp_path: Path) -> None:
    path, raw = write_config(tmp_path)
    train(parse_config(raw), stop_after_iterations=1)
    pod = run_pod(path, stand_in_torchrun(tmp_path, trains=False))
    assert pod.returncode == 1, pod.stderr
    assert "TORCHRUN-RAN" in pod.stdout
    assert "training not complete: checkpoint version 1" in pod.stderr and "exit code=1 seconds=" in pod.stderr


def test_a_pod_whose_agent_fails_after_the_last_commit_exits_0(tmp_path: Path) -> None:
    """The last commit lands while this pod's agent waits in a rendezvous that no longer forms: asked again when
    the agent fails, the pod exits 0."""
    path, _ = write_config(tmp_path)
    pod = run_pod(path, stand_in_torchrun(tmp_path, trains=True))
    assert "TORCHRUN-RAN" in pod.stdout
    assert pod.returncode == 0, pod.stderr[-3000:]
    assert "reason=complete index=1 (after torchrun exited 1): training already complete: checkpoint version 2" \
           in pod.stderr
