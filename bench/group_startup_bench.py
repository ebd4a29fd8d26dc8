"""A torchrun group's start-up: seconds from starting its agents to every rank's first bucket trained.

What a lost pod costs before the group trains again is mostly this (bench/RESULTS.md, the chaos bench: a median of
37 s from a round forming to a trainer ready, the rounds re-formed by every event starting every trainer again). Here
``--ranks`` torchrun agents (one trainer each, c10d rendezvous on 127.0.0.1, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``,
started as tests/helpers_distributed.py starts them) are launched together on a generated graph (P=16 by default,
the chaos bench's shape) with a fresh checkpoint; each agent's output is read as it comes and timestamped here. A
rank's first bucket is its first ``bucket (l, r): {...}`` debug line (a bucket trained: the line every version of
the trainer writes); the run's figure is the last rank's, from the moment the first agent started. Once every rank
has trained a bucket the agents are killed (the rest of the pass is not the start-up).

``--checkout`` (repeatable) names the source trees to compare, alternated within each repeat (each run's trainer
imports ``job`` from its checkout: PYTHONPATH and the working directory); the trainer's own ``start-up:`` line,
where the checkout has one, splits each rank's time into phases (job/train/startup.py), whose medians are printed.
``--storage s3`` puts the data and the checkpoint on a moto S3 server (the input check then asks S3 for every bucket
file: ~3 requests a file, P^2 files). ``--device cuda`` trains on the GPU (every rank on card ``LOCAL_RANK`` modulo
the cards, so several ranks share a one-GPU machine). ``--cold`` runs each checkout a second time with
``BIGGRAPH_WARM_SPARES=0`` (trainers started cold, not from warm spares: job/train/elastic/spare.py), alternated with the
first.

    .venv/bin/python bench/group_startup_bench.py --checkout /work/wt-startup-base --checkout . --repeats 3
    .venv/bin/python bench/group_startup_bench.py --checkout . --storage s3 --repeats 1
    python3 bench/group_startup_bench.py --ranks 2 --device cuda --cold --repeats 3   # on a GPU machine

Timings are CPU-bound on a small machine (every rank imports torch and forms its groups at once): the load average
before and after each run and the machine's float32 matmul rate (bench/machine.py) are printed beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from helpers_distributed import agent_command, free_port, kill_tree  # noqa: E402
from logged_process import LoggedProcess  # noqa: E402
from machine import matmul_rate  # noqa: E402
from train_bench import generated_config, write_generated_graph  # noqa: E402

FIRST_BUCKET = re.compile(r"DEBUG (?:\[rank (\d+)\] )?bucket \(\d+, \d+\): \{")
STARTUP = re.compile(r"\[rank (\d+)\] start-up: .*? ([\d.]+) s after (?:the process started|its hand-off) \((.*?)\)")
PHASE = re.compile(r"([^,]+?) ([\d.]+) s(?:,|$)")
REFUSED = re.compile(r"biggraph train: error: (.*)")


def one_run(checkout: Path, label: str, args: argparse.Namespace, graph_config: dict[str, Any],
            work: Path, env_extra: dict[str, str], variant: str) -> dict[str, Any]:
    """Start ``args.ranks`` agents of ``checkout`` at once; when every rank trained a bucket, kill them."""
    config = dict(graph_config, checkpoint_path=f"{graph_config['checkpoint_path']}_{label}")
    if not config["checkpoint_path"].startswith("s3://"):
        shutil.rmtree(config["checkpoint_path"], ignore_errors=True)
    config_path = work / f"{label}.json"
    config_path.write_text(json.dumps(config))
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
               PYTHONPATH=str(checkout), **env_extra)
    load_before = os.getloadavg()
    started = time.monotonic()
    agents = []
    for index in range(args.ranks):
        # the first agent hosts the rendezvous store, as tests/helpers_distributed.py's Agents do
        rdzv = f"join_timeout=300,last_call_timeout=1,is_host={'true' if index == 0 else 'false'}"
        command = agent_command(str(args.ranks), port, f"startup-{label}", rdzv, 0, None,
                                ["-v", "train", str(config_path)])
        agents.append(LoggedProcess(command, checkout, env, work / f"{label}-{index}.log"))
    firsts: dict[int, float] = {}
    error = None
    try:
        deadline = started + args.timeout
        while time.monotonic() < deadline:
            for agent in agents:
                found = agent.first_match(FIRST_BUCKET)
                if found is not None:
                    firsts[int(found[1].group(1) or 0)] = found[0] - started
            if len(firsts) == args.ranks:
                break
            if any(agent.proc.poll() is not None for agent in agents):
                error = f"an agent exited before every rank trained a bucket; see {work}/{label}-*.log"
                break
            time.sleep(0.05)
        else:
            error = f"not every rank trained a bucket in {args.timeout:.0f} s; see {work}/{label}-*.log"
    finally:
        time.sleep(0.5)  # the start-up lines follow the bucket line
        for agent in agents:
            if agent.proc.poll() is None:
                kill_tree(agent.proc)
            agent.reader.join(timeout=10)
    phases: dict[int, dict[str, float]] = {}
    for agent in agents:
        found = agent.first_match(STARTUP)
        if found is not None:
            rank, detail = int(found[1].group(1)), found[1].group(3)
            phases[rank] = {name.strip(): float(seconds) for name, seconds in PHASE.findall(detail)}
    return {"checkout": str(checkout), "variant": variant, "label": label, "error": error,
            "first_bucket_s": {r: round(s, 2) for r, s in sorted(firsts.items())},
            "every_rank_s": round(max(firsts.values()), 2) if len(firsts) == args.ranks else None,
            "phases": phases, "load_before": round(load_before[0], 2), "load_after": round(os.getloadavg()[0], 2)}


def s3_setup(graph: Path) -> tuple[subprocess.Popen, str, dict[str, str]]:
    """moto in its own process, the generated graph copied onto it; (server, s3 root, the trainers' environment)."""
    import s3fs
    from storage_bench import start_moto

    moto, endpoint = start_moto()
    fs = s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True)
    fs.mkdir("startup-bench")
    fs.put(str(graph / "data"), "startup-bench/data", recursive=True)
    env = {name: os.environ[name] for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
                                               "AWS_EC2_METADATA_DISABLED")}
    env["AWS_ENDPOINT_URL"] = endpoint
    return moto, "s3://startup-bench", env


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkout", action="append", default=None,
                        help="a source tree to run the trainers from (repeatable; default: this one)")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--partitions", type=int, default=16)
    parser.add_argument("--entities", type=int, default=20_000)
    parser.add_argument("--edges", type=int, default=240_000)
    parser.add_argument("--dimension", type=int, default=32)
    parser.add_argument("--storage", choices=("local", "s3"), default="local")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="the trainers' device (config)")
    parser.add_argument("--cold", action="store_true",
                        help="also run each checkout with BIGGRAPH_WARM_SPARES=0 (trainers started cold)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a run may take to its last first bucket")
    parser.add_argument("--work", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    checkouts = [Path(c).resolve() for c in (args.checkout or [str(Path(__file__).resolve().parent.parent)])]
    work = Path(args.work or tempfile.mkdtemp(prefix="biggraph-startup-bench-"))
    graph = work / "graph"
    shutil.rmtree(graph, ignore_errors=True)
    graph.mkdir(parents=True)
    write_generated_graph(graph, args.entities, args.edges, args.partitions)
    config = generated_config(graph, args.partitions, 1, args.dimension, "run")
    config.update(num_uniform_negs=20, num_batch_negs=20, seed=0, num_edge_chunks=1, device=args.device)
    moto, env_extra = None, {}
    if args.storage == "s3":
        moto, root, env_extra = s3_setup(graph)
        config.update(entity_path=f"{root}/data", edge_paths=[f"{root}/data/edges"], checkpoint_path=f"{root}/ckpt")
    machine = {"matmul_gflops": round(matmul_rate(), 1), "cpus": os.cpu_count(), "load": os.getloadavg()[0]}
    print(json.dumps({"machine": machine, "ranks": args.ranks, "partitions": args.partitions,
                      "storage": args.storage, "device": args.device}), flush=True)
    variants = [("spares", {})] + ([("cold", {"BIGGRAPH_WARM_SPARES": "0"})] if args.cold else [])
    runs: list[dict[str, Any]] = []
    try:
        for repeat in range(args.repeats):
            for index, checkout in enumerate(checkouts):
                for variant, env in variants:
                    result = one_run(checkout, f"r{repeat}c{index}{variant}", args, config, work,
                                     {**env_extra, **env}, variant)
                    runs.append(result)
                    print(json.dumps(result), flush=True)
    finally:
        if moto is not None:
            moto.terminate()
            moto.wait(timeout=30)
    machine["matmul_gflops_after"] = round(matmul_rate(), 1)
    summary = []
    print(f"\nmatmul {machine['matmul_gflops']} -> {machine['matmul_gflops_after']} GFLOP/s, {machine['cpus']} CPUs")
    print("| checkout | trainers | every rank's first bucket, median (s) | runs (s) | load before |")
    print("|---|---|---|---|---|")
    for checkout, (variant, _) in ((c, v) for c in checkouts for v in variants):
        mine = [r for r in runs if r["checkout"] == str(checkout) and r["variant"] == variant]
        times = [r["every_rank_s"] for r in mine if r["every_rank_s"] is not None]
        median = statistics.median(times) if times else None
        summary.append({"checkout": str(checkout), "variant": variant, "median_s": median, "runs_s": times})
        print(f"| {checkout} | {variant} | {median} | {', '.join(map(str, times))} | "
              f"{', '.join(str(r['load_before']) for r in mine)} |")
        names: list[str] = []
        for r in mine:
            for rank_phases in r["phases"].values():
                names += [n for n in rank_phases if n not in names]
        if names:
            medians = {n: statistics.median(p[n] for r in mine for p in r["phases"].values() if n in p)
                       for n in names}
            print("    phases (median over ranks and runs): "
                  + ", ".join(f"{n} {s:.2f} s" for n, s in medians.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine, "runs": runs, "summary": summary}, indent=1))
    return 0 if all(r["error"] is None for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
