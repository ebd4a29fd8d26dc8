"""Quality of two biggraph checkouts (and PBG 1.0.0) on the issue's KG config, over seeds: filtered MRR only.

Experiment E2 of bench/RESULTS.md ("Quality: what differs from PBG 1.0.0"): the same PBG config
(bench/train_bench.py ``kg_config``: ComplEx d=200, 1000 uniform + 50 batch negatives, softmax, lr
0.1, batch 1000) trained by a checkout given by ``--checkout`` (its ``job`` package first on the
path), with each seed of ``--seeds`` and each worker count of ``--workers``; every checkpoint is
scored by this checkout's evaluator (``--candidates all --filter train,valid,test``). No timings.

    nice -n 19 .venv/bin/python bench/parity_bench.py --datasets umls,kinships --workers 2,16 \\
        --seeds 1,2,3 --checkout /path/to/checkout --label after

``--one-process`` trains every bucket in the trainer's own process, as on a GPU (the slices of the
Hogwild split one after another; before PBG's split was adopted, one slice: ``-p workers=1``).
``--pbg`` trains with PBG 1.0.0 instead (never seeded: its runs differ only by Hogwild timing).
Results are appended, one JSON line per run, to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from train_bench import filtered_mrr, kg_config, pbg_train_command, write_py_config  # noqa: E402

ONE_PROCESS = (
    "import sys\n"
    "from job.config import load_config\n"
    "from job.train import Collaborators, Trainer\n"
    "trainer = Trainer(load_config(sys.argv[1], sys.argv[2:]), parts=Collaborators(hogwild=False))  # as on a GPU\n"
    "try:\n"
    "    trainer.run()\n"
    "finally:\n"
    "    trainer.close()\n"
)


def import_dataset(name: str, work: Path) -> Path:
    """The dataset's train/valid/test splits in PBG's format under ``work/name`` (imported once)."""
    from job.cli import main as cli_main
    from job.data.datasets import dataset_dir

    root = work / name
    if (root / "data" / "test").exists():
        return root
    root.mkdir(parents=True, exist_ok=True)
    source = dataset_dir(name)
    config = kg_config(root, 1, 1)
    config["edge_paths"] = [str(root / "data" / s) for s in ("train", "valid", "test")]
    (root / "import.json").write_text(json.dumps(config))
    code = cli_main(["import", str(root / "import.json"),
                     *[os.path.join(source, f"{s}.txt") for s in ("train", "valid", "test")],
                     "-l", "0", "--rel-col", "1", "-r", "2"])
    if code != 0:
        raise SystemExit(f"import of {name} failed ({code})")
    return root


def train_once(root: Path, args: argparse.Namespace, workers: int, seed: int) -> tuple[Path, float]:
    """Train one run; returns its config file and wall seconds."""
    mode = "pbg" if args.pbg else ("one" if args.one_process else "hogwild")
    label = f"{args.label}_{mode}_w{workers}_s{seed}"
    config = kg_config(root, args.epochs, workers)
    config["checkpoint_path"] = str(root / f"ckpt_{label}")
    path = root / f"config_{label}.py"
    write_py_config(path, config)
    overrides = [f"seed={seed}"]
    # one intra-op thread per process (Hogwild workers already run one): no oversubscription on a shared machine
    env = dict(os.environ, PYTHONPATH=str(Path(args.checkout).resolve()), OMP_NUM_THREADS="1")
    if args.pbg:
        command = (pbg_train_command() or []) + [str(path)]
    elif args.one_process:
        command = [sys.executable, "-c", ONE_PROCESS, str(path), *overrides]
    else:
        command = [sys.executable, "-m", "job", "train", str(path), *[a for o in overrides for a in ("-p", o)]]
    started = time.perf_counter()
    with open(root / f"{label}.log", "w") as log:
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=args.checkout)
    return path, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", default="umls,kinships")
    parser.add_argument("--workers", default="2,16")
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--epochs", type=int, default=25)
    parser.add_argument("--checkout", default=str(ROOT), help="the biggraph checkout that trains")
    parser.add_argument("--label", default="run")
    parser.add_argument("--one-process", action="store_true", help="no Hogwild pool (the GPU's organisation)")
    parser.add_argument("--pbg", action="store_true", help="train with PBG 1.0.0")
    parser.add_argument("--work", default="/tmp/parity_bench")
    parser.add_argument("--out", default="/tmp/parity_bench/results.jsonl")
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    for name in args.datasets.split(","):
        root = import_dataset(name, work)
        filters = [str(root / "data" / s) for s in ("train", "valid", "test")]
        for workers in (int(w) for w in args.workers.split(",")):
            for seed in (int(s) for s in args.seeds.split(",")):
                path, wall = train_once(root, args, workers, seed)
                mrr = filtered_mrr(path, str(root / "data" / "test"), filters)
                record = {"dataset": name, "label": args.label, "pbg": args.pbg, "one_process": args.one_process,
                          "workers": workers, "seed": seed, "epochs": args.epochs, "mrr": mrr, "wall_s": wall}
                print(json.dumps(record), flush=True)
                with open(args.out, "a") as out:
                    out.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
