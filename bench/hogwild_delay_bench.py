"""What PBG's ``hogwild_delay`` buys in MRR, and what each ``hogwild_delay_scope`` costs (issue #33).

PBG holds every Hogwild worker but the first back by ``hogwild_delay`` seconds on every bucket of epoch 0, so
that workers do not start together on fresh rows. This bench imports WN18RR into P partitions, trains PBG's
knowledge-graph recipe (bench/train_bench.py ``kg_config``: ComplEx d=200, 1000 uniform + 50 batch negatives,
softmax, lr 0.1, batch 1000) with 2 workers under three settings — ``hogwild_delay: 0``, the default
``first_visit`` scope and PBG's ``epoch_0`` scope — for each seed, and prints one JSON line per run: the epoch-0
wall seconds (from training_stats.json: the buckets' compute, which includes the delays), the number of delayed
buckets the log announced, and the filtered MRR on the validation split against every entity.

    .venv/bin/python bench/hogwild_delay_bench.py --partitions 4 --epochs 3 --seeds 0,1

The MRR figures do not depend on the machine's load; the seconds do (print the load beside them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.train_bench import kg_config  # noqa: E402
from job.config import load_config  # noqa: E402
from job.evaluation import evaluate  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "wn18rr"
VARIANTS = {"none": ["hogwild_delay=0"], "first_visit": [], "epoch_0": ["hogwild_delay_scope=epoch_0"]}


def import_partitioned(source: Path, root: Path, partitions: int) -> None:
    from job.cli import main as cli_main

    if (root / "data" / "valid").exists():
        return
    root.mkdir(parents=True, exist_ok=True)
    config = kg_config(root, 1, 1)
    config["entities"]["all"]["num_partitions"] = partitions
    config["edge_paths"] = [str(root / "data" / s) for s in ("train", "valid", "test")]
    path = root / "import.json"
    path.write_text(json.dumps(config))
    if cli_main(["import", str(path), *[str(source / f"{s}.txt") for s in ("train", "valid", "test")],
                 "-l", "0", "--rel-col", "1", "-r", "2"]) != 0:
        raise SystemExit(f"import of {source} failed")


def run(root: Path, partitions: int, epochs: int, seed: int, label: str, overrides: list[str]) -> dict[str, Any]:
    config = kg_config(root, epochs, 2)
    config["entities"]["all"]["num_partitions"] = partitions
    config["checkpoint_path"] = str(root / f"ckpt_{label}_{seed}")
    config["seed"] = seed
    shutil.rmtree(config["checkpoint_path"], ignore_errors=True)
    path = root / f"config_{label}_{seed}.json"
    path.write_text(json.dumps(config))
    args = [sys.executable, "-m", "job", "train", str(path)]
    for item in overrides:
        args += ["-p", item]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    log = subprocess.run(args, check=True, capture_output=True, text=True, env=env).stderr
    note = next((line.split("hogwild_delay: ", 1)[1] for line in log.splitlines() if "Hogwild workers trains alone" in line), "")
    with open(os.path.join(config["checkpoint_path"], "training_stats.json")) as handle:
        records = [json.loads(line) for line in handle]
    epoch0 = sum(r["time"] for r in records if "lhs_partition" in r and r["epoch_idx"] == 0)
    later = [r["time"] for r in records if "lhs_partition" in r and r["epoch_idx"] == 1]
    filters = [str(root / "data" / s) for s in ("train", "valid", "test")]
    loaded = load_config(str(path), [*overrides, f"edge_paths={root / 'data' / 'valid'}"])
    metrics = evaluate(loaded, filter_paths=filters, candidates="all")
    return {"variant": label, "seed": seed, "partitions": partitions, "epochs": epochs,
            "epoch0_bucket_s": round(epoch0, 1), "epoch1_bucket_s": round(sum(later), 1), "announced": note,
            "valid_mrr": round(float(metrics["mrr"]), 4), "valid_hits@10": round(float(metrics["hits@10"]), 4),
            "load": [round(x, 1) for x in os.getloadavg()]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--data", default=str(DATA))
    parser.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "biggraph-hogwild-delay"))
    args = parser.parse_args()
    root = Path(args.work) / f"p{args.partitions}"
    import_partitioned(Path(args.data), root, args.partitions)
    for seed in (int(s) for s in args.seeds.split(",")):
        for label, overrides in VARIANTS.items():  # alternated, so a change in load touches every variant
            print(json.dumps(run(root, args.partitions, args.epochs, seed, label, overrides)), flush=True)


if __name__ == "__main__":
    main()
