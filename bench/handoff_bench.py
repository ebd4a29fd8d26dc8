"""Partitions pod to pod (issue 45, ``partition_handoff``): bytes through checkpoint storage and bytes between trainers
per epoch, for 1, 2 and 4 torchrun trainers on a generated graph, against main in the same go.

    flock /work/bench.lock .venv/bin/python bench/handoff_bench.py --main-src /tmp/h45-main

Each run is ``torchrun --standalone --nproc-per-node=K -m job train`` (workers=1 per trainer) on the same graph,
for ``--epochs`` epochs. Variants: ``main`` (the code at ``--main-src``: ``git archive main | tar -x -C DIR`` plus
the built kernels, job/native/_ext), ``off`` (this checkout, or ``--branch-src``; ``partition_handoff: false``, the
default) and ``on`` (``partition_handoff: true``). Reported per epoch, summed over the trainers (the pass
summaries): partition bytes read from and written to storage, partition bytes handed from one trainer to another,
partitions taken back from a trainer's own memory, storage reads, the time trainers were blocked on partition I/O,
and the wall time of the run. All trainers share this machine, so "pod to pod" is loopback TCP here: bytes are
the figure, not the seconds.
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
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import matmul_rate  # noqa: E402
from train_bench import generated_config, run_measured, write_generated_graph, write_py_config  # noqa: E402

SUMMED = ("bytes_read", "bytes_written", "bytes_handed_over", "partition_reads", "partition_writes",
          "partition_handoffs", "partition_kept_hits", "io_blocked_seconds", "commit_seconds")


def run_variant(root: Path, args: argparse.Namespace, trainers: int, variant: str) -> dict[str, Any]:
    label = f"t{trainers}-{variant}"
    config = generated_config(root, args.partitions, 1, args.dimension, label)
    config.update(num_epochs=args.epochs, seed=0)
    if variant != "main":
        config["partition_handoff"] = variant == "on"
    shutil.rmtree(config["checkpoint_path"], ignore_errors=True)
    path = root / f"config_{label}.py"
    write_py_config(path, config)
    env = {"OMP_NUM_THREADS": "1"}
    source = args.main_src if variant == "main" else args.branch_src
    if source:
        env["PYTHONPATH"] = str(Path(source).resolve())
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={trainers}",
               "-m", "job", "train", str(path)]
    measured = run_measured(command, env=env, log=root / f"{label}.log")
    stats = Path(config["checkpoint_path"]) / "training_stats.json"
    if not stats.exists():
        raise SystemExit(f"{label}: no training_stats.json; output:\n{''.join(measured.get('output', []))[-3000:]}")
    summaries = [json.loads(line) for line in stats.read_text().splitlines() if '"pass_summary"' in line]
    per_epoch = {key: round(sum(float(s.get(key, 0)) for s in summaries) / len(summaries), 3) for key in SUMMED}
    shutil.rmtree(config["checkpoint_path"], ignore_errors=True)
    return {"trainers": trainers, "variant": variant, "epochs": len(summaries), "wall_s": round(measured["wall"], 1),
            "buckets_redone": sum(s.get("buckets_redone", 0) for s in summaries), **per_epoch}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entities", type=int, default=400_000)
    parser.add_argument("--edges", type=int, default=800_000)
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--dimension", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--trainers", default="1,2,4")
    parser.add_argument("--main-src", default=None, help="an export of main (with its built kernels); none: skip it")
    parser.add_argument("--branch-src", default=None, help="an export of the code measured as off/on (default: this "
                        "checkout's, as imported)")
    parser.add_argument("--work", default=None)
    args = parser.parse_args()
    print(json.dumps({"matmul_gflops": round(matmul_rate(), 1), "cpus": os.cpu_count()}), flush=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="biggraph-handoff-bench-"))
    root = work / "graph"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    write_generated_graph(root, args.entities, args.edges, args.partitions)
    checkpoint_bytes = args.entities * (args.dimension + 1) * 4  # one version's partitions (row-wise Adagrad)
    variants = (["main"] if args.main_src else []) + ["off", "on"]
    results = []
    for trainers in [int(t) for t in args.trainers.split(",")]:
        for variant in variants:
            result = run_variant(root, args, trainers, variant)
            result["storage_bytes_per_checkpoint"] = round((result["bytes_read"] + result["bytes_written"])
                                                           / checkpoint_bytes, 2)
            print(json.dumps(result), flush=True)
            results.append(result)
    out = Path(__file__).resolve().parent / "out"
    out.mkdir(exist_ok=True)
    (out / f"handoff_bench_{int(time.time())}.json").write_text(json.dumps(
        {"command": " ".join(sys.argv), "checkpoint_bytes": checkpoint_bytes, "runs": results}, indent=2))


if __name__ == "__main__":
    main()
