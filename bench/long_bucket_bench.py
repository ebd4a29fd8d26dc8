"""What a round's end costs when buckets outlast the drain window (issue #30): from the event to a new group.

A big graph's bucket takes minutes; the drain that lets survivors finish their bucket (``BIGGRAPH_DRAIN_TIMEOUT``,
25 s) cannot wait for one. This bench trains a generated graph whose buckets take tens of seconds with torchrun
agents on loopback (c10d, as tests/test_distributed.py starts them: one trainer each), and mid-bucket either
- ``sigterm``: signals every worker's process group with SIGTERM, as the agent does when it re-forms the group for
  a replaced or added pod (then SIGKILL 30 s later), or
- ``kill``: SIGKILLs one agent and its worker (a lost pod) and starts a fresh agent in its place,
then measures the seconds until a group formed after the event (its first rank's ``joined round`` line; the logs
are read as they grow, bench/chaos_checks.py ``LogTail``), and whether buckets were given up.

Each ``--tree LABEL=PATH`` is a source tree whose ``job`` package the agents run (PYTHONPATH; the bench runs from
its work directory, so that no checkout shadows it): a worktree of the commit before a change against the change.
The graph is generated and imported once (by this checkout's ``biggraph import``) and shared by the runs.

    git worktree add /tmp/wt-base <commit>
    PYTHONPATH=. .venv/bin/python bench/long_bucket_bench.py --tree before=/tmp/wt-base --tree after=. \\
        --json bench/out/long_bucket.json      # ~15 min on 2 vCPUs: buckets of ~55 s
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(ROOT / "tests"))

from chaos_checks import LogTail  # noqa: E402
from helpers_distributed import Agents  # noqa: E402
from machine import matmul_rate  # noqa: E402


def write_graph(work: Path, edges: int, entities: int, seed: int) -> Path:
    """A TSV of ``edges`` random edges of 4 relations among ``entities`` nodes."""
    import numpy as np

    rng = np.random.default_rng(seed)
    lhs, rhs, rel = (rng.integers(0, entities, edges), rng.integers(0, entities, edges), rng.integers(0, 4, edges))
    path = work / "edges.tsv"
    path.write_text("".join(f"e{a}\tr{r}\te{b}\n" for a, r, b in zip(lhs.tolist(), rel.tolist(), rhs.tolist())))
    return path


def base_config(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    return {
        "entity_path": str(work / "data" / "entities"), "edge_paths": [str(work / "data" / "edges")],
        "checkpoint_path": "", "entities": {"node": {"num_partitions": args.partitions}},
        "relations": [{"name": f"r{i}", "lhs": "node", "rhs": "node", "operator": "none"} for i in range(4)],
        "dimension": args.dimension, "comparator": "dot", "loss_fn": "softmax", "num_epochs": 3,
        "num_batch_negs": 50, "num_uniform_negs": args.negs, "batch_size": 1000, "workers": 1, "seed": 0,
        "eval_fraction": 0.0, "num_edge_chunks": 1,
    }


def import_graph(config: dict[str, Any], tsv: Path, work: Path) -> None:
    path = work / "import-config.json"
    path.write_text(json.dumps(config))
    done = subprocess.run([sys.executable, "-m", "job", "import", str(path), str(tsv), "-l", "0", "-r", "2",
                           "--rel-col", "1"], capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    if done.returncode != 0:
        raise RuntimeError(f"biggraph import exited {done.returncode}: {done.stderr[-2000:]}")


def mid_bucket(checkpoint: str, ranks: int, deadline: float, into: float) -> dict[str, Any]:
    """Wait until every rank trains a bucket after having finished one in this run (so each has timed a bucket),
    then ``into`` seconds more; returns the progress state then."""
    from job.checkpoint.group_progress import current_state

    while time.monotonic() < deadline:
        state = current_state(checkpoint) or {}
        if len(state.get("in_flight", {})) >= ranks and len(state.get("done", [])) >= ranks:
            time.sleep(into)
            return current_state(checkpoint) or {}
        time.sleep(0.1)
    raise AssertionError("never trained: every rank with a bucket in flight after one done")


def one_run(args: argparse.Namespace, label: str, tree: Path, event: str, work: Path,
            config: dict[str, Any]) -> dict[str, Any]:
    run_dir = work / f"{label}-{event}"
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    checkpoint = str(run_dir / "checkpoint")
    path = run_dir / "config.json"
    path.write_text(json.dumps(dict(config, checkpoint_path=checkpoint)))
    names = [chr(ord("a") + i) for i in range(args.agents)]
    agents = Agents(path, f"1:{args.agents}", run_dir / "logs",
                    env={"PYTHONPATH": str(tree), "BIGGRAPH_PEER_TIMEOUT": "6"})
    tail = LogTail(run_dir / "logs").start()
    result: dict[str, Any] = {"tree": label, "event": event}
    try:
        for name in names:
            agents.start(name)
            time.sleep(0.3)
        started = time.monotonic()
        state = mid_bucket(checkpoint, args.agents, started + args.timeout, args.into)
        result["first_buckets_s"] = round(time.monotonic() - started, 1)
        result["in_flight_at_event"] = len(state.get("in_flight", {}))
        at = time.monotonic()
        if event == "sigterm":
            for name in names:
                agents.terminate_workers(name)
        else:
            agents.kill_node(names[-1])
            agents.start(names[-1] + "2")  # the replacement pod
        while time.monotonic() < at + args.timeout:
            took = tail.new_group(at)
            if took is not None:
                result["to_new_group_s"] = round(took, 1)
                break
            time.sleep(0.1)
        else:
            result["to_new_group_s"] = None
    finally:
        agents.stop()
        tail.stop()
    text = agents.text()
    result["given_up"] = text.count("cannot finish before the drain deadline")
    result["waited_in_vain"] = text.count("not every live rank gave back")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", default=[], metavar="LABEL=PATH",
                        help="a source tree to run (repeatable; default: this checkout)")
    parser.add_argument("--event", action="append", choices=("sigterm", "kill"), default=[],
                        help="the events to run (repeatable; default both)")
    parser.add_argument("--agents", type=int, default=2)
    # at P=2 two ranks never train at once after the first two buckets (every other bucket locks both partitions)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--edges", type=int, default=1_600_000)
    parser.add_argument("--entities", type=int, default=100_000)
    parser.add_argument("--dimension", type=int, default=256)
    parser.add_argument("--negs", type=int, default=4000, help="uniform negatives per chunk (the bucket's length)")
    parser.add_argument("--into", type=float, default=3.0, help="seconds into the bucket before the event")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--work", default="/tmp/long-bucket-bench")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    trees = [(t.split("=", 1)[0], Path(t.split("=", 1)[1]).resolve()) for t in args.tree] or [("this", ROOT)]
    json_path = Path(args.json).resolve() if args.json else None
    events = args.event or ["sigterm", "kill"]
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    os.chdir(work)  # no checkout's ``job`` on the agents' path but the tree's (``-m job`` looks in the cwd first)
    config = base_config(args, work)
    if not (work / "data" / "edges").exists():
        import_graph(config, write_graph(work, args.edges, args.entities, 0), work)
    machine = {"matmul_gflops": round(matmul_rate(), 1), "load_at_start": os.getloadavg(), "cpus": os.cpu_count()}
    results = []
    for event in events:
        for label, tree in trees:
            result = one_run(args, label, tree, event, work, config)
            print(json.dumps(result), flush=True)
            results.append(result)
    out = {"command": " ".join(sys.argv), "args": vars(args), "machine": machine, "results": results}
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
