"""The same training run from two checkouts of biggraph, alternated: did a change slow the trainer down?

    .venv/bin/python bench/ab_bench.py --baseline /path/to/old/checkout [--edges 2000000 --entities 200000]

Both trainers run as ``python -m job train`` with their checkout first on PYTHONPATH (same venv, same files, same
config), in alternation (A B A B ...) so that machine load hurts both alike. Reported per checkout: the best wall
time and the compute rate (edges over the summed per-bucket training time, from training_stats.json), and
candidate / baseline ratios. The machine's float32 matmul rate is printed beside them (figures from different
machines are not comparable).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from grow_bench import matmul_rate  # noqa: E402
from storage_bench import write_graph  # noqa: E402


def run(checkout: Path, config: dict[str, Any], work: Path, name: str) -> dict[str, float]:
    ckpt = work / f"ckpt-{name}"
    shutil.rmtree(ckpt, ignore_errors=True)
    path = work / f"config-{name}.json"
    path.write_text(json.dumps({**config, "checkpoint_path": str(ckpt)}))
    env = dict(os.environ, PYTHONPATH=str(checkout))
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "job", "train", str(path)], cwd=checkout, env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    records = [json.loads(line) for line in (ckpt / "training_stats.json").read_text().splitlines() if line]
    buckets = [r for r in records if "lhs_partition" in r]
    edges = sum(r["stats"]["count"] for r in buckets)
    return {"wall_s": wall, "compute_edges_per_s": edges / sum(r["time"] for r in buckets), "edges": edges}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="the other checkout (its job/ is what is compared)")
    parser.add_argument("--entities", type=int, default=200_000)
    parser.add_argument("--edges", type=int, default=2_000_000)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ab-bench-"))
    try:
        write_graph(work, args.entities, args.edges, args.partitions)
        config = {"entities": {"node": {"num_partitions": args.partitions}},
                  "relations": [{"name": f"r{i}", "lhs": "node", "rhs": "node", "operator": "translation"}
                                for i in range(10)],
                  "dimension": 100, "num_epochs": args.epochs, "batch_size": 1000, "num_batch_negs": 50,
                  "num_uniform_negs": 50, "lr": 0.1, "eval_fraction": 0.0, "workers": 2, "seed": 1,
                  "entity_path": str(work / "entities"), "edge_paths": [str(work / "edges")]}
        checkouts = {"baseline": Path(args.baseline).resolve(), "candidate": ROOT}
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in checkouts}
        for repeat in range(args.repeats):
            order = list(checkouts) if repeat % 2 == 0 else list(reversed(checkouts))
            for name in order:
                runs[name].append(run(checkouts[name], config, work, name))
                print(f"{name:9s} run {repeat + 1}: wall {runs[name][-1]['wall_s']:.1f} s, compute "
                      f"{runs[name][-1]['compute_edges_per_s']:,.0f} edges/s", flush=True)
        best = {name: {"wall_s": min(r["wall_s"] for r in rs),
                       "compute_edges_per_s": max(r["compute_edges_per_s"] for r in rs)} for name, rs in runs.items()}
        result = {"args": vars(args), "matmul_gflops": matmul_rate(), "best": best, "runs": runs,
                  "wall_ratio_candidate_over_baseline": best["candidate"]["wall_s"] / best["baseline"]["wall_s"],
                  "compute_ratio_candidate_over_baseline":
                      best["candidate"]["compute_edges_per_s"] / best["baseline"]["compute_edges_per_s"]}
        print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
