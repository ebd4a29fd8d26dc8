"""Elastic recovery: SIGKILL one of two torchrun nodes mid-epoch; seconds until the survivor trains again.

Two torchrun agents on 127.0.0.1 (c10d rendezvous, gloo, one trainer each, started as
tests/test_distributed.py does: each in its own session, the first one ``is_host=true``) train a
generated graph (one entity type, ``--partitions`` partitions) with local checkpoints. Once the
job is past its first commit and the lock server's progress file shows node b's trainer holding a
bucket in the middle of a pass (after a seeded random number of finished buckets, 2 .. P^2-4), the
bench SIGKILLs node b's agent and its worker at once (a lost pod), and times, from the kill, on
node a's output (read as it comes, timestamped here):

- ``detect``: rank 0 reports the peer dead (the heartbeat's RuntimeError, ``stopped responding``);
- ``exited``: torchrun's agent saw its worker fail (``Worker group FAILED``);
- ``rejoin``: the agent completed the next rendezvous round (``Rendezvous complete for workers``);
- ``resume``: the new trainer read the lock server's progress (``resuming pass``);
- ``trains``: the new lock server hands out its first bucket (the progress file, polled every 10 ms,
  shows a bucket in flight again): the survivor trains again. This is the recovery time.
- ``first bucket``: the first bucket after the restart finished (its ``-v`` debug line).

Buckets redone: the ``buckets_redone`` of the pass summary that the killed pass commits (in-flight
buckets the lock server hands out again). Also reported, from the progress file read just before
the kill: finished buckets (marked done by the lock server) whose partitions node b's trainer still
held in memory, unwritten, at the kill (their updates on those partitions die with the trainer and
they are not redone; an upper bound, since a trainer that had to wait in between wrote them out).

What the time is made of (the knobs, all printed with each run):

- rank 0's detection: at once for a killed process, whose liveness connection closes (job/train/distributed/liveness.py);
  else the heartbeat check, ``BIGGRAPH_PEER_TIMEOUT`` (job/train/distributed/group.py; seen only between buckets);
- the c10d rendezvous keep-alive: the dead node stays a participant of the finished round until its
  last keep-alive is ``keep_alive_interval x keep_alive_max_attempt`` old (5 s x 3 by default), and
  the survivor cannot start a new round before that;
- ``last_call_timeout`` (30 s by default): once ``min`` nodes joined the new round, how long the
  round waits for more;
- torchrun's ``--monitor-interval`` (0.1 s by default in torch 2.13) and the new worker's start-up
  (Python, torch, checkpoint and progress reads).

    .venv/bin/python bench/elastic_bench.py --repeats 3                      # the project's defaults
    .venv/bin/python bench/elastic_bench.py --repeats 3 --preset torch-defaults
    .venv/bin/python bench/elastic_bench.py --rdzv-conf join_timeout=600,last_call_timeout=5 --peer-timeout 15

Timings depend on the machine's load (the worker start-up is CPU-bound): the bench prints the load
average before and after every run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
# the agents are started and killed as tests/test_distributed.py does it, by the same code
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from helpers_distributed import agent_command, free_port, kill_tree  # noqa: E402
from logged_process import LoggedProcess  # noqa: E402
from train_bench import generated_config, write_generated_graph  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

# The rendezvous settings the project recommends (docs/kubernetes.md, the chart's torchrun.rdzvConf).
RECOMMENDED_RDZV_CONF = "join_timeout=600,last_call_timeout=5,keep_alive_interval=2,keep_alive_max_attempt=3"
PRESETS: dict[str, dict[str, Any]] = {
    # what the project recommends: its own heartbeat default, short last call and keep-alive expiry
    "recommended": {"rdzv_conf": RECOMMENDED_RDZV_CONF, "peer_timeout": None, "monitor_interval": None},
    # torch's rendezvous defaults (keep-alive 5 s x 3, last call 30 s), as the chart rendered before; heartbeat 15 s
    "torch-defaults": {"rdzv_conf": "join_timeout=600", "peer_timeout": 15.0, "monitor_interval": None},
}
EVENTS = {
    "detect": re.compile(r"stopped responding"),
    "exited": re.compile(r"Worker group FAILED"),
    "rejoin": re.compile(r"Rendezvous complete for workers"),
    "resume": re.compile(r"resuming pass \d+"),
    "first bucket": re.compile(r"DEBUG (?:\[rank \d+\] )?bucket \(\d+, \d+\): \{"),
}


class Agent(LoggedProcess):
    """One torchrun agent (a node), in its own session; its output timestamped line by line (which is why
    this is not tests/helpers_distributed.py's ``Agents``, whose agents write to log files)."""

    def __init__(self, name: str, config_path: Path, port: int, run_id: str, is_host: bool, args: argparse.Namespace,
                 log_path: Path) -> None:
        self.name = name
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", LOGLEVEL="INFO")
        if not args.share_store:
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        if args.peer_timeout is not None:
            env["BIGGRAPH_PEER_TIMEOUT"] = str(args.peer_timeout)
        else:
            env.pop("BIGGRAPH_PEER_TIMEOUT", None)  # the project's default
        if args.peer_interval is not None:
            env["BIGGRAPH_PEER_INTERVAL"] = str(args.peer_interval)
        rdzv_conf = ",".join(filter(None, [args.rdzv_conf, f"is_host={'true' if is_host else 'false'}"]))
        command = agent_command("1:2", port, run_id, rdzv_conf, args.max_restarts, args.monitor_interval,
                                ["-v", "train", str(config_path)])
        super().__init__(command, ROOT, env, log_path)

    def first(self, event: str, after: float) -> Optional[float]:
        found = self.first_match(EVENTS[event], after)
        return found[0] if found else None

    def kill_tree(self) -> None:
        """SIGKILL the agent and its workers together (workers run in sessions of their own)."""
        kill_tree(self.proc)


def read_progress(checkpoint: Path) -> Optional[dict[str, Any]]:
    """The lock server's progress as it stands (its snapshot with the records since replayed)."""
    from job.checkpoint.group_progress import current_state

    try:
        return current_state(str(checkpoint))
    except (FileNotFoundError, ValueError):  # a record removed or rewritten while read: ask again
        return None


def read_version(checkpoint: Path) -> int:
    try:
        return int((checkpoint / "checkpoint_version.txt").read_text().strip() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def unsaved_done_buckets(progress: dict[str, Any], rank: int) -> int:
    """Buckets ``rank`` finished (done for the lock server) whose partitions it still held, unwritten.

    A trainer keeps the partitions its next bucket shares with the last one in memory; they are written
    into the next version only when evicted. Walking back from the in-flight bucket over the rank's
    finished buckets of this pass (in order), a bucket shares a still-resident partition while the chain
    of shared partitions is unbroken. Upper bound: a ``wait`` in between writes everything out, and the
    progress file does not record waits.
    """
    in_flight = progress.get("in_flight", {}).get(str(rank))
    if in_flight is None:
        return 0
    mine = [(r["lhs_partition"], r["rhs_partition"]) for r in progress.get("records", []) if r.get("rank") == rank]
    resident = {("lhs", in_flight[0]), ("rhs", in_flight[1])}
    # one entity type on both sides: a partition number is the key, whichever side it is on
    resident_parts = {p for _, p in resident}
    lost = 0
    for lhs, rhs in reversed(mine):
        shared = {lhs, rhs} & resident_parts
        if not shared:
            break
        lost += 1
        resident_parts = shared  # only the shared partitions stayed resident across that bucket change
    return lost


def one_run(index: int, args: argparse.Namespace, graph: Path, work: Path) -> dict[str, Any]:
    label = f"run{index}"
    config = generated_config(graph, args.partitions, 1, args.dimension, label)
    config.update(num_epochs=args.epochs, num_uniform_negs=20, num_batch_negs=20, seed=index)
    checkpoint = Path(config["checkpoint_path"])
    shutil.rmtree(checkpoint, ignore_errors=True)
    config_path = work / f"{label}.json"
    config_path.write_text(json.dumps(config))
    port = free_port()
    run_id = f"elastic-bench-{os.getpid()}-{index}"
    load_before = os.getloadavg()
    a = Agent("a", config_path, port, run_id, True, args, work / f"{label}-a.log")
    time.sleep(0.5)
    b = Agent("b", config_path, port, run_id, False, args, work / f"{label}-b.log")
    result: dict[str, Any] = {"run": index, "load_before": [round(x, 2) for x in load_before]}
    try:
        total = args.partitions * args.partitions
        # where in the pass to kill: after 2 .. total-4 finished buckets (seeded by the run's index)
        kill_after_done = random.Random(index).randint(2, max(2, total - 4))
        deadline = time.monotonic() + 240
        progress = None
        while time.monotonic() < deadline:
            if a.proc.poll() is not None or b.proc.poll() is not None:
                raise RuntimeError(f"an agent exited before the kill; see {work}/{label}-*.log")
            progress = read_progress(checkpoint)
            if (read_version(checkpoint) >= args.warmup_passes and progress is not None
                    and kill_after_done <= len(progress.get("done", [])) <= total - 3
                    and "1" in progress.get("in_flight", {})):
                break
            time.sleep(0.005)
        else:
            raise RuntimeError(f"the job never reached the middle of a pass; see {work}/{label}-*.log")
        assert progress is not None
        version_at_kill = read_version(checkpoint)
        killed = time.monotonic()
        b.kill_tree()
        result.update(version_at_kill=version_at_kill, done_at_kill=len(progress["done"]), buckets_per_pass=total,
                      unsaved_done_buckets_of_killed_rank=unsaved_done_buckets(progress, 1))
        # the survivor trains again: the progress file shows a bucket in flight, written after the resume
        trains: Optional[float] = None
        resumed: Optional[float] = None
        seen_after_resume: Optional[dict[str, Any]] = None
        deadline = killed + args.timeout
        while time.monotonic() < deadline and a.proc.poll() is None:
            if resumed is None:
                resumed = a.first("resume", killed)
                if resumed is not None:
                    seen_after_resume = read_progress(checkpoint) or {}
            else:
                state = read_progress(checkpoint) or {}
                if state and state != seen_after_resume:
                    seen_after_resume = state
                    if state.get("in_flight"):
                        trains = time.monotonic()
                        break
            time.sleep(0.01)
        # wait for the killed pass to commit, to read its summary
        while time.monotonic() < deadline and a.proc.poll() is None and read_version(checkpoint) <= version_at_kill:
            time.sleep(0.1)
        first_bucket = a.first("first bucket", resumed) if resumed is not None else None
        marks = {"detect": a.first("detect", killed), "exited": a.first("exited", killed),
                 "rejoin": a.first("rejoin", killed), "resume": resumed, "trains": trains, "first bucket": first_bucket}
        result.update({f"{k.replace(' ', '_')}_s": (round(v - killed, 2) if v is not None else None)
                       for k, v in marks.items()})
        # the summary is appended just after the commit: give it a moment
        killed_pass: list[dict[str, Any]] = []
        stats_deadline = time.monotonic() + 30
        while not killed_pass and time.monotonic() < stats_deadline:
            try:
                lines = (checkpoint / "training_stats.json").read_text().splitlines()
            except FileNotFoundError:
                lines = []
            summaries = [json.loads(line) for line in lines if '"pass_summary"' in line]
            killed_pass = [s for s in summaries if s["index"] == version_at_kill]
            if not killed_pass:
                time.sleep(0.1)
        result["buckets_redone"] = killed_pass[0]["buckets_redone"] if killed_pass else None
        result["restart_count"] = killed_pass[0]["restart_count"] if killed_pass else None
        result["world_size_after"] = killed_pass[0]["world_size"] if killed_pass else None
        result["killed_rank"] = 1
    finally:
        for agent in (a, b):
            if agent.proc.poll() is None:
                agent.kill_tree()
        result["load_after"] = [round(x, 2) for x in os.getloadavg()]
        if not args.keep:
            shutil.rmtree(checkpoint, ignore_errors=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="recommended",
                        help="torchrun/heartbeat settings; the options below override single values")
    parser.add_argument("--rdzv-conf", default=None, help="torchrun --rdzv-conf entries (is_host is added)")
    parser.add_argument("--peer-timeout", type=float, default=None, help="BIGGRAPH_PEER_TIMEOUT (default: the project's)")
    parser.add_argument("--peer-interval", type=float, default=None, help="BIGGRAPH_PEER_INTERVAL (default: the project's)")
    parser.add_argument("--monitor-interval", type=float, default=None, help="torchrun --monitor-interval (default: torch's)")
    parser.add_argument("--max-restarts", type=int, default=3)
    parser.add_argument("--share-store", action="store_true", help="leave TORCH_DISABLE_SHARE_RDZV_TCP_STORE unset")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--entities", type=int, default=100_000)
    parser.add_argument("--edges", type=int, default=96_000)
    parser.add_argument("--dimension", type=int, default=48)
    parser.add_argument("--epochs", type=int, default=500, help="never reached: each run stops after the recovery")
    parser.add_argument("--warmup-passes", type=int, default=1, help="committed passes before the kill")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds after the kill before giving up")
    parser.add_argument("--work", default=None)
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    preset = PRESETS[args.preset]
    for key in ("rdzv_conf", "peer_timeout", "monitor_interval"):
        if getattr(args, key) is None:
            setattr(args, key, preset[key])

    work = Path(args.work or tempfile.mkdtemp(prefix="biggraph-elastic-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    graph = work / "graph"
    shutil.rmtree(graph, ignore_errors=True)
    graph.mkdir(parents=True)
    write_generated_graph(graph, args.entities, args.edges, args.partitions)
    settings = {"rdzv_conf": args.rdzv_conf, "peer_timeout": args.peer_timeout, "peer_interval": args.peer_interval,
                "monitor_interval": args.monitor_interval, "share_store": args.share_store}
    print(f"elastic bench: preset {args.preset}, settings {json.dumps(settings)}", flush=True)
    runs = []
    for index in range(args.repeats):
        try:
            result = one_run(index, args, graph, work)
        except RuntimeError as err:
            result = {"run": index, "error": str(err)}
        runs.append(result)
        print(json.dumps(result), flush=True)
    ok = [r for r in runs if r.get("trains_s") is not None]
    print("\n| run | detect (s) | worker exited (s) | rejoin (s) | resume (s) | trains again (s) | first bucket done (s) | "
          "buckets redone | "
          "done buckets with unwritten partitions at the kill | load before/after |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        print(f"| {r['run']} | {r.get('detect_s')} | {r.get('exited_s')} | {r.get('rejoin_s')} | {r.get('resume_s')} | "
              f"{r.get('trains_s')} | "
              f"{r.get('first_bucket_s')} | {r.get('buckets_redone')} | {r.get('unsaved_done_buckets_of_killed_rank')} | "
              f"{r.get('load_before', [None])[0]} / {r.get('load_after', [None])[0]} |")
    summary: dict[str, Any] = {"preset": args.preset, "settings": settings, "runs": len(runs), "recovered": len(ok)}
    if ok:
        times = [r["trains_s"] for r in ok]
        summary.update(trains_again_median_s=round(statistics.median(times), 2), trains_again_min_s=min(times),
                       trains_again_max_s=max(times), buckets_redone=[r.get("buckets_redone") for r in ok])
        print(f"\ntrains again after the kill: median {summary['trains_again_median_s']} s, range "
              f"{summary['trains_again_min_s']}-{summary['trains_again_max_s']} s over {len(ok)} runs; "
              f"buckets redone {summary['buckets_redone']}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"command": " ".join(sys.argv), "summary": summary, "runs": runs}, indent=1))
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if len(ok) == len(runs) else 1


if __name__ == "__main__":
    sys.exit(main())
