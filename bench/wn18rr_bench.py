"""WN18RR (issue #33): `preset: quality` with ComplEx, filtered MRR / Hits@10 against wall time.

Imports ``../shared/data/wn18rr`` once (one entity type, dynamic relations: already reciprocal), trains the
config a user writes (``preset: quality``, ``complex_diagonal``, ``dimension: 256``, ``workers: 2``) plus
the given overrides, keeping a snapshot every epoch, then scores every snapshot on the validation split
(filtered by train, valid and test, against every entity, both sides) and prints one JSON line per epoch
with the wall time since the trainer started. ``--minutes`` stops the trainer there, as the issue's target
does ("the run stopped there, its last committed version scored"); ``--test`` also scores the last snapshot
on the test split (once per recipe: tune on valid). The machine's float32 / bfloat16 product rate (one
thread, the 1-vs-all batch's shape) is printed first.

    .venv/bin/python bench/wn18rr_bench.py --epochs 3 --label base
    .venv/bin/python bench/wn18rr_bench.py --epochs 6 --label n3 -p regularization_coef=0.05
    .venv/bin/python bench/wn18rr_bench.py --minutes 25 --epochs 1000 --label final --test
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from machine import matmul_rate  # noqa: E402 - a sibling bench module
from train_bench import import_kg  # noqa: E402

from job.config import load_config  # noqa: E402
from job.evaluation import evaluate  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "wn18rr"
ENTITIES, DIM = 40_943, 256


def product_rates(batch: int = 1000) -> dict[str, float]:
    """GFLOP/s of one thread's (batch x d) by (d x entities) product, float32 and bfloat16."""
    rates = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(batch, DIM, dtype=dtype), torch.randn(ENTITIES, DIM, dtype=dtype)
        a @ b.t()
        started = time.perf_counter()
        for _ in range(3):
            a @ b.t()
        rates[str(dtype).replace("torch.", "")] = round(3 * 2 * batch * DIM * ENTITIES / (time.perf_counter() - started) / 1e9, 1)
    torch.set_num_threads(threads)
    rates["float32_2048_square_2_threads"] = round(matmul_rate(), 1)
    return rates


def base_config(root: Path, label: str, epochs: int) -> dict[str, Any]:
    return {
        "entity_path": str(root / "data"),
        "edge_paths": [str(root / "data" / "train")],
        "checkpoint_path": str(root / f"ckpt_{label}"),
        "entities": {"all": {"num_partitions": 1}},
        "relations": [{"name": "all_edges", "lhs": "all", "rhs": "all", "operator": "complex_diagonal"}],
        "dynamic_relations": True,
        "dimension": DIM,
        "preset": "quality",
        "workers": 2,
        "num_epochs": epochs,
        "checkpoint_preservation_interval": 1,
    }


def train(config_path: Path, overrides: list[str], minutes: float | None, log: Path) -> tuple[float, dict[int, float]]:
    """Run the trainer (stopped after ``minutes``); (wall seconds, {epoch: seconds at which its snapshot appeared})."""
    args = [sys.executable, "-m", "job", "train", str(config_path)]
    for item in overrides:
        args += ["-p", item]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    checkpoint = Path(json.loads(config_path.read_text())["checkpoint_path"])
    started = time.time()
    seen: dict[int, float] = {}
    with open(log, "w") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        while proc.poll() is None:
            time.sleep(1.0)
            for entry in checkpoint.glob("epoch_*"):  # epoch_{k}: the snapshot after k + 1 epochs
                seen.setdefault(int(entry.name.split("_")[1]) + 1, time.time() - started)
            if minutes is not None and time.time() - started > minutes * 60:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                break
    wall = time.time() - started
    for entry in checkpoint.glob("epoch_*"):
        seen.setdefault(int(entry.name.split("_")[1]) + 1, wall)
    return wall, seen


def score(config_path: Path, overrides: list[str], root: Path, split: str, version: int | None) -> dict[str, float]:
    filters = [str(root / "data" / s) for s in ("train", "valid", "test")]
    loaded = load_config(str(config_path), [*overrides, f"edge_paths={root / 'data' / split}"])
    metrics = evaluate(loaded, filter_paths=filters, candidates="all", version=version)
    return {"mrr": round(float(metrics["mrr"]), 4), "hits@10": round(float(metrics["hits@10"]), 4),
            "hits@1": round(float(metrics["hits@1"]), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-p", "--param", action="append", default=[], help="config override key=value")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--minutes", type=float, default=None, help="stop the trainer after this wall time")
    parser.add_argument("--label", default="run")
    parser.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "biggraph-wn18rr"))
    parser.add_argument("--test", action="store_true", help="also score the last snapshot on the test split")
    parser.add_argument("--every", type=int, default=1, help="score every so many epochs on valid")
    parser.add_argument("--data", default=str(DATA), help="the WN18RR files (train/valid/test.txt)")
    args = parser.parse_args()
    root = Path(args.work)
    if not (root / "data" / "test").exists():
        root.mkdir(parents=True, exist_ok=True)
        import_kg(args.data, root)
    print(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "label": args.label, "overrides": args.param,
                      "product_gflops_1_thread": product_rates(), "load": os.getloadavg()}), flush=True)
    config = base_config(root, args.label, args.epochs)
    shutil.rmtree(config["checkpoint_path"], ignore_errors=True)
    path = root / f"config_{args.label}.json"
    path.write_text(json.dumps(config))
    wall, seen = train(path, args.param, args.minutes, root / f"{args.label}.log")
    print(json.dumps({"label": args.label, "wall_s": round(wall, 1), "epochs_done": max(seen, default=0)}), flush=True)
    last = max(seen, default=None)
    for epoch in sorted(seen):
        if epoch % args.every and epoch != last:
            continue
        print(json.dumps({"label": args.label, "epoch": epoch, "wall_s": round(seen[epoch], 1),
                          "valid": score(path, args.param, root, "valid", epoch)}), flush=True)
    if args.test and last is not None:
        print(json.dumps({"label": args.label, "epoch": last, "wall_s": round(seen[last], 1),
                          "test": score(path, args.param, root, "test", last)}), flush=True)


if __name__ == "__main__":
    main()
