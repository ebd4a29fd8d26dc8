"""The failure budget (job/train/elastic/budget.py, job/train/elastic/agent.py): with the chart's shipped
``torchrun.maxRestarts``, a membership change does not spend what a crash loop spends.

Real parts: agents started with the pods' launcher (``python -m job.train.elastic.agent``), a c10d rendezvous on
127.0.0.1, trainers training UMLS at P=4; a lost pod is an agent SIGKILLed together with its worker."""

from __future__ import annotations

import contextlib
import json
import re
import time
from pathlib import Path

import pytest
import yaml
from helpers_distributed import Agents, bucket_records, write_run_config

from job.cli.quick_exit import ROUND_ENDED, allowed
from job.train.elastic.budget import EXIT_ROUND_ENDED, EXIT_ROUND_ENDED_IDLE, judge

CHART_VALUES = Path(__file__).resolve().parents[1] / "charts" / "biggraph" / "values.yaml"


def chart_max_restarts() -> int:
    return int(yaml.safe_load(CHART_VALUES.read_text())["torchrun"]["maxRestarts"])


def test_a_trainer_whose_round_ended_leaves_without_the_teardown_that_could_abort_it() -> None:
    """job/cli/quick_exit.py: a trainer exiting with a round-ended code ends with ``os._exit`` after its exit
    handlers, so that the interpreter's teardown of the threads it abandoned (its lock server's, gloo's with a dead
    peer) cannot turn that code into an abort (-6) that the agent counts as a crash; the codes are the budget's."""
    assert ROUND_ENDED == {EXIT_ROUND_ENDED, EXIT_ROUND_ENDED_IDLE}
    assert allowed("train", EXIT_ROUND_ENDED) and allowed("train", EXIT_ROUND_ENDED_IDLE)
    assert not allowed("train", 0) and not allowed("train", 1) and not allowed("train", 2)  # Python's own exit
    assert allowed("import", 0) and not allowed("import", EXIT_ROUND_ENDED) and not allowed(None, EXIT_ROUND_ENDED)


def test_only_rounds_ended_from_outside_after_progress_are_free() -> None:
    assert judge([EXIT_ROUND_ENDED]).free
    assert judge([EXIT_ROUND_ENDED, EXIT_ROUND_ENDED]).free
    assert not judge([EXIT_ROUND_ENDED_IDLE]).free  # a round that did nothing: a loop of those must end
    assert not judge([EXIT_ROUND_ENDED, 1]).free  # one crash among them spends
    assert not judge([1]).free and not judge([-9]).free and not judge([2]).free
    assert not judge([]).free


def _latest_rank(log: str) -> int | None:
    ranks = re.findall(r"rank (\d+) of \d+ joined round", log)
    return int(ranks[-1]) if ranks else None


def _summaries(checkpoint_path: str) -> list[dict]:
    with contextlib.suppress(Exception):  # the stats file is being appended to
        return [r for r in bucket_records(checkpoint_path) if r.get("pass_summary")]
    return []


@pytest.mark.slow
def test_the_charts_defaults_survive_five_pod_losses_and_replacements_in_a_row(umls_p4: dict,
                                                                                 tmp_path: Path) -> None:
    """Three agents with the chart's ``--max-restarts``; five times in a row, once the group of three committed a
    version, a node that neither hosts the rendezvous nor runs rank 0 is SIGKILLed (agent and worker: a lost pod)
    and a fresh agent replaces it. Before the budget the fourth loss failed every agent (issue 44)."""
    from job.formats.checkpoint import CheckpointStorage

    losses, epochs = 5, 14
    path = write_run_config(umls_p4, "budget", num_epochs=epochs)
    checkpoint_path = json.loads(path.read_text())["checkpoint_path"]
    storage = CheckpointStorage(checkpoint_path)
    agents = Agents(path, "1:3", tmp_path, max_restarts=chart_max_restarts())
    live = ["a", "b", "c"]
    try:
        for name in live:
            agents.start(name)
            time.sleep(0.3)
        killed_after: list[int] = []
        for loss in range(losses):
            since = killed_after[-1] if killed_after else 0
            deadline = time.monotonic() + 300
            # a version the group of three committed after the last loss: every node's agent in the same round
            while not any(s["checkpoint_version"] > since and s["world_size"] == 3 for s in _summaries(checkpoint_path)):
                assert time.monotonic() < deadline, f"no version of three after loss {loss}: " + agents.tail()
                assert all(agents.procs[n].poll() is None for n in live), agents.tail()
                time.sleep(0.1)
            version = max(s["checkpoint_version"] for s in _summaries(checkpoint_path))
            assert version < epochs, "the run ended before the losses; give it more epochs"
            victim = next(n for n in live[1:] if _latest_rank((tmp_path / f"{n}.log").read_text()) != 0)
            agents.kill_node(victim)
            killed_after.append(version)
            replacement = f"{victim.rstrip('0123456789')}{loss + 1}"
            live[live.index(victim)] = replacement
            agents.start(replacement)
        codes = agents.wait(live, timeout=600)  # a hang guard
    finally:
        agents.stop()
    assert codes == dict.fromkeys(live, 0), agents.tail()
    assert storage.load_version() == epochs
    text = agents.text()
    assert "no restarts left" not in text
    assert text.count("without spending a restart") >= losses  # each survivor's group restarted for free


@pytest.mark.slow
def test_a_crash_loop_ends_after_the_charts_restarts(umls_p4: dict, tmp_path: Path) -> None:
    """A trainer that fails every round at once (here: its edge files are gone) spends the budget: each agent tries
    ``maxRestarts + 1`` times, then fails (exit 1: the pod fails and Kubernetes' per-index limit takes over)."""
    path = write_run_config(umls_p4, "crashing", edge_paths=[str(tmp_path / "missing")])
    config = json.loads(path.read_text())
    config["edge_paths"] = [str(tmp_path / "missing")]
    path.write_text(json.dumps(config))
    restarts = chart_max_restarts()
    agents = Agents(path, "2", tmp_path, max_restarts=restarts)
    codes = agents.run(["a", "b"], timeout=400)  # a hang guard
    assert codes == {"a": 1, "b": 1}, agents.tail()
    for name in ("a", "b"):
        log = (tmp_path / f"{name}.log").read_text()
        assert log.count("worker group failed") == restarts + 1, log[-3000:]
        assert "no restarts left" in log and "without spending a restart" not in log
