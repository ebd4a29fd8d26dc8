"""Buckets redone after an orderly SIGTERM with partitions written behind (issue 45), before and after the cut taken
at an orderly round end (job/train/distributed/cuts.py, ``before_leaving``).

Three torchrun agents on loopback (c10d, one trainer each, as tests/test_distributed.py starts them) train a generated
graph with ``partition_handoff`` and ``write_behind_buckets`` (``--every``; -1: a cut only at the commit). Once the
group has done ``--done`` buckets of the first pass and a rank other than 0 trains one, the event:

- ``leave``: SIGTERM to one agent that does not host the rendezvous (the kubelet deleting, evicting or scaling down a
  pod): its worker finishes its bucket and leaves, the two others re-form;
- ``reform``: SIGTERM to every worker's process group, as the agent does when it re-forms the group for a node that
  waits to join.

Reported per run: the buckets done in the pass at the event, the buckets the resumed pass redoes (its ``resuming pass``
line: what the restart found unsaved), whether the server took the cut or gave it up, and the seconds from the event
to the new group's first ``joined round`` line. Each ``--tree LABEL=PATH`` is a source tree whose ``job`` package the
agents run (PYTHONPATH; see bench/long_bucket_bench.py, whose graph and import this bench shares).

    git archive <commit before> | tar -x -C /tmp/h45-base      # and copy job/native/_ext/kernels.so beside it
    flock /work/bench.lock .venv/bin/python bench/sigterm_cut_bench.py --tree before=/tmp/h45-base --tree after=. \\
        --json bench/out/sigterm_cut.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
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
from long_bucket_bench import base_config, import_graph, write_graph  # noqa: E402
from machine import matmul_rate  # noqa: E402

RESUMED = re.compile(r"resuming pass \d+: (\d+) of (\d+) buckets already done, (\d+) to redo")


def mid_pass(checkpoint: str, done: int, deadline: float) -> dict[str, Any]:
    """Wait until ``done`` buckets of the pass are done and a rank other than 0 trains one; the progress then."""
    from job.checkpoint.group_progress import current_state

    while time.monotonic() < deadline:
        state = current_state(checkpoint) or {}
        if len(state.get("done", [])) >= done and set(state.get("in_flight", {})) - {"0", 0}:
            return state
        time.sleep(0.05)
    raise AssertionError(f"the group never had {done} buckets done with a rank other than 0 training")


def one_run(args: argparse.Namespace, label: str, tree: Path, event: str, run: int, work: Path,
            config: dict[str, Any]) -> dict[str, Any]:
    run_dir = work / f"{label}-{event}-{run}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a run left by an earlier go would resume its finished checkpoint
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    checkpoint = str(run_dir / "checkpoint")
    path = run_dir / "config.json"
    path.write_text(json.dumps(dict(config, checkpoint_path=checkpoint)))
    agents = Agents(path, "1:3", run_dir / "logs", env={"PYTHONPATH": str(tree), "BIGGRAPH_PEER_INTERVAL": "0.5",
                                                         "BIGGRAPH_PEER_TIMEOUT": "4"})
    tail = LogTail(run_dir / "logs").start()
    result: dict[str, Any] = {"tree": label, "event": event, "run": run}
    try:
        for name in "abc":
            agents.start(name)
            time.sleep(0.3)
        state = mid_pass(checkpoint, args.done, time.monotonic() + args.timeout)
        result["done_at_event"] = len(state.get("done", []))
        at = time.monotonic()
        if event == "leave":
            agents.procs["b"].send_signal(signal.SIGTERM)
        else:
            for name in "abc":
                agents.terminate_workers(name)
        while time.monotonic() < at + args.timeout:
            took = tail.new_group(at)
            if took is not None:
                result["to_new_group_s"] = round(took, 1)
                break
            time.sleep(0.1)
        else:
            result["to_new_group_s"] = None
        survivors = ["a", "c"] if event == "leave" else ["a", "b", "c"]
        result["exit_codes"] = agents.wait(survivors, timeout=args.timeout)
    finally:
        agents.stop()
        tail.stop()
    text = agents.text()
    resumed = RESUMED.findall(text)
    result["resumed_done"] = int(resumed[0][0]) if resumed else None
    result["redone"] = int(resumed[0][2]) if resumed else None
    result["cut_taken"] = "takes a cut first" in text and "takes no cut" not in text
    result["cut_given_up"] = "takes no cut" in text
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", default=[], metavar="LABEL=PATH",
                        help="a source tree to run (repeatable; default: this checkout)")
    parser.add_argument("--event", action="append", choices=("leave", "reform"), default=[])
    parser.add_argument("--runs", type=int, default=2, help="runs of each event and tree")
    parser.add_argument("--every", type=int, default=-1, help="write_behind_buckets")
    parser.add_argument("--done", type=int, default=8, help="buckets of the pass done before the event")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--edges", type=int, default=400_000)
    parser.add_argument("--entities", type=int, default=40_000)
    parser.add_argument("--dimension", type=int, default=128)
    parser.add_argument("--negs", type=int, default=1000, help="uniform negatives per chunk (the bucket's length)")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--work", default="/tmp/sigterm-cut-bench")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    trees = [(t.split("=", 1)[0], Path(t.split("=", 1)[1]).resolve()) for t in args.tree] or [("this", ROOT)]
    json_path = Path(args.json).resolve() if args.json else None
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    os.chdir(work)  # no checkout's ``job`` on the agents' path but the tree's (``-m job`` looks in the cwd first)
    config = dict(base_config(args, work), num_epochs=1, partition_handoff=True, write_behind_buckets=args.every)
    if not (work / "data" / "edges").exists():
        import_graph(config, write_graph(work, args.edges, args.entities, 0), work)
    machine = {"matmul_gflops": round(matmul_rate(), 1), "load_at_start": os.getloadavg(), "cpus": os.cpu_count()}
    print(json.dumps(machine), flush=True)
    results = []
    for run in range(args.runs):
        for event in args.event or ["leave", "reform"]:
            for label, tree in trees:
                result = one_run(args, label, tree, event, run, work, config)
                print(json.dumps(result), flush=True)
                results.append(result)
    out = {"command": " ".join(sys.argv), "args": vars(args), "machine": machine, "results": results}
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
