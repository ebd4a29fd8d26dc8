"""What starting a run's Hogwild workers costs: forked from the fork server against spawned, alternated.

A small graph (so that training is a small part of the wall time) trained for one epoch by ``python -m job train``
with ``workers`` W, once with ``BIGGRAPH_WORKER_START=forkserver`` (the default) and once with ``spawn``, repeated;
prints wall seconds and peak PSS of the process tree (the fork server included) per run and the medians.

    .venv/bin/python bench/startup_bench.py --workers 2,16 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import matmul_rate  # noqa: E402 - a sibling bench module, not a package
from train_bench import PYTHON, run_measured  # noqa: E402

from job.cli import main as cli_main  # noqa: E402


def make_graph(root: Path, entities: int, edges: int) -> Path:
    """A random graph imported under ``root``; returns its config (JSON)."""
    rng = random.Random(0)
    tsv = root / "edges.tsv"
    tsv.write_text("".join(f"n{rng.randrange(entities)}\tr{rng.randrange(4)}\tn{rng.randrange(entities)}\n"
                           for _ in range(edges)))
    config = {"entity_path": str(root / "data"), "edge_paths": [str(root / "data" / "edges")],
              "checkpoint_path": str(root / "ckpt"), "entities": {"node": {"num_partitions": 1}},
              "relations": [{"name": f"r{i}", "lhs": "node", "rhs": "node", "operator": "complex_diagonal"}
                            for i in range(4)],
              "dimension": 100, "num_epochs": 1, "batch_size": 1000, "num_batch_negs": 50, "num_uniform_negs": 50,
              "eval_fraction": 0.0, "hogwild_delay": 0.0, "device": "cpu"}
    path = root / "config.json"
    path.write_text(json.dumps(config))
    if cli_main(["import", str(path), str(tsv), "-l", "0", "--rel-col", "1", "-r", "2"]) != 0:
        raise SystemExit("import failed")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="2,16", help="comma-separated worker counts")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--entities", type=int, default=20_000)
    parser.add_argument("--edges", type=int, default=40_000)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="startup-bench-"))
    config = make_graph(root, args.entities, args.edges)
    print(json.dumps({"matmul_gflops": round(matmul_rate(), 1)}), flush=True)
    results: dict[str, list[dict[str, float]]] = {}
    for workers in [int(w) for w in args.workers.split(",")]:
        for repeat in range(args.repeats):
            for method in ("forkserver", "spawn"):
                command = [PYTHON, "-m", "job", "train", str(config), "-p", f"workers={workers}",
                           "-p", f"checkpoint_path={root / f'ckpt_{method}_{workers}_{repeat}'}"]
                measured = run_measured(command, env={"BIGGRAPH_WORKER_START": method})  # raises if it fails
                row = {"wall_s": round(measured["wall"], 3), "peak_pss_mib": round(measured["peak_rss_mib"], 1)}
                results.setdefault(f"{method} W={workers}", []).append(row)
                print(json.dumps({"method": method, "workers": workers, "repeat": repeat, **row}), flush=True)
    summary = {key: {"wall_s_median": statistics.median(r["wall_s"] for r in rows),
                     "peak_pss_mib_median": statistics.median(r["peak_pss_mib"] for r in rows)}
               for key, rows in results.items()}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
