"""Distributed training throughput on one machine: 1, 2, 4 trainer processes under torchrun.

    .venv/bin/python bench/dist_bench.py --entities 200000 --edges 2000000 --partitions 8 --trainers 1,2,4

Each run is `torchrun --standalone --nproc-per-node=K -m job train` on the same generated graph
(workers=1 per trainer, so K trainers use K processes), one epoch. Reported: edges/s over the
whole epoch (wall clock of the pass, start-up excluded), buckets per trainer, and the bytes
swapped through the checkpoint storage per bucket, the inputs of the scaling model in
bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_bench import generated_config, run_measured, write_generated_graph, write_py_config  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entities", type=int, default=200_000)
    parser.add_argument("--edges", type=int, default=2_000_000)
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--dimension", type=int, default=100)
    parser.add_argument("--trainers", default="1,2,4")
    parser.add_argument("--work", default=None)
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="biggraph-dist-bench-"))
    root = work / "graph"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    write_generated_graph(root, args.entities, args.edges, args.partitions)
    results = []
    for trainers in [int(t) for t in args.trainers.split(",")]:
        label = f"t{trainers}"
        config = generated_config(root, args.partitions, 1, args.dimension, label)
        config["num_uniform_negs"] = 50
        path = root / f"config_{label}.py"
        write_py_config(path, config)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={trainers}",
                   "-m", "job", "train", str(path)]
        measured = run_measured(command, env={"OMP_NUM_THREADS": "1"}, log=root / f"{label}.log")
        records = [json.loads(line) for line in open(os.path.join(config["checkpoint_path"], "training_stats.json"))]
        buckets = [r for r in records if "lhs_partition" in r]
        summary = next((r for r in records if r.get("pass_summary")), {})
        edges = sum(r["stats"]["count"] for r in buckets)
        compute = sum(r["time"] for r in buckets)
        swap = sum(r.get("swap_time", 0.0) for r in buckets)
        per_rank: dict[int, int] = {}
        for r in buckets:
            per_rank[r.get("rank", 0)] = per_rank.get(r.get("rank", 0), 0) + 1
        partition_bytes = args.entities / args.partitions * (args.dimension + 1) * 4
        result = {
            "trainers": trainers, "partitions": args.partitions, "edges": edges, "wall_s": measured["wall"],
            "wall_edges_per_s": edges / measured["wall"], "compute_s_total": compute, "swap_s_total": swap,
            "per_trainer_compute_edges_per_s": edges / compute if compute else 0.0,
            "buckets_per_rank": per_rank, "partition_mib": partition_bytes / 2**20, "peak_rss_mib": measured["peak_rss_mib"],
            # every rank's partition traffic, added up: how long trainers waited on it, and how much was written
            # behind a bucket instead of before it
            **{key: summary.get(key) for key in ("io_blocked_seconds", "partition_loads", "partition_loads_prefetched",
                                                  "partition_writes", "partition_writes_background")},
        }
        print(json.dumps(result), flush=True)
        results.append(result)
        shutil.rmtree(config["checkpoint_path"], ignore_errors=True)
    out = Path(__file__).resolve().parent / "out"
    out.mkdir(exist_ok=True)
    (out / f"dist_bench_{int(time.time())}.json").write_text(json.dumps({"command": " ".join(sys.argv), "runs": results},
                                                                        indent=2))


if __name__ == "__main__":
    main()
