"""`biggraph eval --candidates all` on the CPU and on a GPU: the same checkpoint, the same test edges.

A generated graph (one entity type, 10 ComplEx relations), trained briefly so that there is a checkpoint,
then every test edge is ranked against every entity on both sides, once per device. Needs CUDA for the
GPU figure (without it only the CPU is timed):

    python3 bench/eval_bench.py --entities 1000000 --train-edges 200000 --test-edges 1000
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from train_bench import generated_config, write_generated_graph  # noqa: E402

from job.config import parse_config  # noqa: E402
from job.evaluation import evaluate  # noqa: E402
from job.train import train  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entities", type=int, default=1_000_000)
    parser.add_argument("--train-edges", type=int, default=200_000)
    parser.add_argument("--test-edges", type=int, default=1_000)
    parser.add_argument("--dimension", type=int, default=100)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="biggraph-eval-bench-"))
    write_generated_graph(work, args.entities, args.train_edges, 1)
    test_root = work / "test"
    write_generated_graph(test_root, args.entities, args.test_edges, 1, seed=1)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    raw = generated_config(work, 1, 1, args.dimension, "ckpt")
    raw["device"] = devices[-1]
    train(parse_config(raw))
    results = {}
    for device in devices:
        config = parse_config({**raw, "device": device, "edge_paths": [str(test_root / "data" / "edges")]})
        started = time.perf_counter()
        metrics = evaluate(config, candidates="all")
        seconds = time.perf_counter() - started
        results[device] = (seconds, metrics)
        print(f"{device:>4}: {seconds:.2f} s for {metrics['count']} edges x 2 sides x {args.entities:,} candidates "
              f"({metrics['count'] / seconds:,.0f} edges/s), MRR {metrics['mrr']:.6f}, mean rank {metrics['mean_rank']:.1f}",
              flush=True)
    if "cuda" in results:
        print(f"GPU / CPU: {results['cpu'][0] / results['cuda'][0]:.1f}x, torch threads on the CPU: {torch.get_num_threads()}")


if __name__ == "__main__":
    main()
