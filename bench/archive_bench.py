"""Model archive benchmark: size per dtype, load time, nearest-neighbour queries/s, int8/fp16 MRR loss.

Uses the demo graph (UMLS): run ``.venv/bin/biggraph demo --out /tmp/arch_demo --epochs 10`` first (or pass
``--train`` to have this script do it). Every figure is also given as a ratio to fp32 measured in the same run.

    .venv/bin/python bench/archive_bench.py --demo /tmp/arch_demo [--train] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

DTYPES = ("fp32", "fp16", "int8")


def edges_of(demo: str, split: str) -> np.ndarray:
    from job.formats.edges import edges_file, read_edges

    arrays = read_edges(edges_file(os.path.join(demo, "data", split), 0, 0))
    return np.stack([arrays.rel, arrays.lhs, arrays.rhs], 1).astype(np.int64)


def timed(fn: Any, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def queries_per_second(fn: Any, names: list[str], min_seconds: float = 1.0) -> float:
    done = 0
    started = time.perf_counter()
    while time.perf_counter() - started < min_seconds:
        for name in names:
            fn(name)
        done += len(names)
    return done / (time.perf_counter() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", default="/tmp/arch_demo", help="output folder of `biggraph demo`")
    parser.add_argument("--train", action="store_true", help="run `biggraph demo --epochs 10` into --demo first")
    parser.add_argument("--json", default=None, help="also write the figures as JSON here")
    args = parser.parse_args()
    if args.train or not os.path.exists(os.path.join(args.demo, "config.yaml")):
        subprocess.run([sys.executable, "-m", "job", "demo", "--out", args.demo, "--epochs", "10"], check=True)

    from job.archive import load
    from job.archive.evaluate import link_prediction_metrics
    from job.archive.writer import add_tag
    from job.config import load_config

    config = load_config(os.path.join(args.demo, "config.yaml"))
    test = edges_of(args.demo, "test")
    known = np.concatenate([edges_of(args.demo, s) for s in ("train", "valid", "test")])
    trainer_metrics = json.load(open(os.path.join(args.demo, "test_metrics.json")))
    results: dict[str, Any] = {"trainer_eval_mrr": trainer_metrics["mrr"], "dtypes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        combined = os.path.join(tmp, "all.zip")
        for dtype in DTYPES:
            alone = os.path.join(tmp, f"{dtype}.zip")
            started = time.perf_counter()
            add_tag(config, alone, tag=dtype, dtype=dtype)
            write_seconds = time.perf_counter() - started
            summary = add_tag(config, combined, tag=dtype, dtype=dtype)
            load_seconds = timed(lambda p=alone: load(p).close(), 20)
            model = load(alone)
            names = model.entity_names("all")
            first = time.perf_counter()
            model.nearest(names[0], k=10)  # decodes the table (fp16/int8) and prepares the candidates
            first_query = time.perf_counter() - first
            nn_qps = queries_per_second(lambda n, m=model: m.nearest(n, k=10), names)
            rel_qps = queries_per_second(lambda n, m=model: m.nearest(n, k=10, relation=0), names)
            started = time.perf_counter()
            metrics = link_prediction_metrics(model, test, known)
            mrr_seconds = time.perf_counter() - started
            rels, lhs, rhs = test[:, 0], test[:, 1], test[:, 2]
            scores = np.array([model.score(names[u], int(r), names[v]) for r, u, v in zip(rels, lhs, rhs)])
            results["dtypes"][dtype] = {
                "archive_bytes": os.path.getsize(alone), "bytes_added_to_combined": summary.tag_bytes,
                "shared_variables_in_combined": len(summary.shared), "write_seconds": write_seconds,
                "load_seconds": load_seconds, "first_query_seconds": first_query, "nearest_qps": nn_qps,
                "nearest_relation_qps": rel_qps, "metrics": metrics, "metrics_seconds": mrr_seconds,
                "test_scores": scores,
            }
            model.close()
        results["combined_archive_bytes"] = os.path.getsize(combined)
    base = results["dtypes"]["fp32"]
    for dtype, row in results["dtypes"].items():
        diff = np.abs(row.pop("test_scores") - base["test_scores"] if dtype != "fp32" else 0.0)
        row["max_abs_score_error"] = float(np.max(diff))
        row["mean_abs_score_error"] = float(np.mean(diff))
    base.pop("test_scores", None)
    print_table(results)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=2)
    return 0


def print_table(results: dict[str, Any]) -> None:
    rows = results["dtypes"]
    base = rows["fp32"]
    print(f"trainer (biggraph eval, filtered, all entities) test MRR: {results['trainer_eval_mrr']:.6f}")
    print(f"combined archive (fp32 + fp16 + int8 tags): {results['combined_archive_bytes']:,} bytes")
    print("| tag dtype | archive size | vs fp32 | added to combined | load | vs fp32 | first query | nearest q/s | vs fp32 | "
          "nearest+relation q/s | filtered MRR | MRR loss vs fp32 | max abs score error |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for dtype, row in rows.items():
        print(f"| {dtype} | {row['archive_bytes']:,} B | {row['archive_bytes'] / base['archive_bytes']:.2f}x | "
              f"{row['bytes_added_to_combined']:,} B | {row['load_seconds'] * 1e3:.2f} ms | "
              f"{row['load_seconds'] / base['load_seconds']:.2f}x | {row['first_query_seconds'] * 1e3:.2f} ms | "
              f"{row['nearest_qps']:,.0f} | {row['nearest_qps'] / base['nearest_qps']:.2f}x | "
              f"{row['nearest_relation_qps']:,.0f} | {row['metrics']['mrr']:.6f} | "
              f"{base['metrics']['mrr'] - row['metrics']['mrr']:+.6f} | {row['max_abs_score_error']:.2e} |")


if __name__ == "__main__":
    sys.exit(main())
