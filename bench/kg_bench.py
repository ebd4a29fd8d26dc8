"""Real knowledge graphs, seeded, side by side with PBG 1.0.0: wall time, compute rate and filtered MRR.

The issue-#16 benchmark: the WordNet KG (112k entities, built from Debian's ``wordnet-base`` by
``../shared/data/wordnet-kg/make_wordnet_kg.py``) or the small KGs of the pykeen wheel (umls, kinships,
nations), one PBG config (ComplEx d=200, 1000 uniform + 50 batch negatives, softmax, lr 0.1, batch 1000),
several seeds per trainer, alternated (biggraph seed 0, PBG seed 0, biggraph seed 1, ...), every
checkpoint scored by ``biggraph eval --candidates all --filter train,valid,test`` on the test split.

    .venv/bin/python bench/kg_bench.py --dataset wordnet --epochs 5 --seeds 0,1,2
    .venv/bin/python bench/kg_bench.py --dataset wordnet --epochs 5 --seeds 0,1,2 \\
        --variant bf16:compute_dtype=bfloat16 --no-pbg

``--variant LABEL:KEY=VALUE[:KEY=VALUE]`` adds a biggraph run with config overrides (repeatable). PBG's
parent process is seeded through a wrapper (``torch``/``numpy``/``random``: initialisation and shuffles);
its Hogwild workers draw negatives unseeded, as PBG does. The machine's measured product rate (the bmm of
one batch's chunks against their negatives, float32 and bfloat16) is printed beside the figures, with the
fraction of it the trainers reach (~2.5 MFLOP per edge forward+backward at d=200 with ~1,050 negatives).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_bench import (  # noqa: E402 - a sibling bench script, not a package
    PYTHON,
    filtered_mrr,
    import_kg,
    kg_config,
    ours_compute_rate,
    pbg_compute_rate,
    run_measured,
    write_py_config,
)

ROOT = Path(__file__).resolve().parent.parent
WORDNET_SCRIPT = ROOT.parent / "shared" / "data" / "wordnet-kg" / "make_wordnet_kg.py"
PBG_SEEDED = ("import random, sys, numpy, torch; seed = int(sys.argv.pop(1)); random.seed(seed); "
              "numpy.random.seed(seed); torch.manual_seed(seed); from torchbiggraph.train import main; main()")


def product_rates(dim: int = 200, negatives: int = 1000, chunks: int = 20, chunk: int = 50) -> dict[str, float]:
    """GFLOP/s of one thread's bmm of (chunks x chunk x dim) by (chunks x dim x negatives), per dtype."""
    rates = {}
    torch.set_num_threads(1)
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(chunks, chunk, dim, dtype=dtype)
        b = torch.randn(chunks, dim, negatives, dtype=dtype)
        torch.bmm(a, b)
        repeats = 50
        started = time.perf_counter()
        for _ in range(repeats):
            torch.bmm(a, b)
        seconds = time.perf_counter() - started
        rates[str(dtype).replace("torch.", "")] = 2 * chunks * chunk * dim * negatives * repeats / seconds / 1e9
    torch.set_num_threads(os.cpu_count() or 1)
    return rates


def dataset_source(name: str, work: Path) -> str:
    """A directory with train/valid/test.txt: the pykeen KGs from the wheel, WordNet built from wordnet-base."""
    if name != "wordnet":
        from job.data.datasets import dataset_dir

        return dataset_dir(name)
    target = work / "wordnet-src"
    if not (target / "test.txt").exists():
        if not Path("/usr/share/wordnet/data.noun").exists():
            raise SystemExit("the WordNet KG needs Debian's wordnet-base: apt-get install -y wordnet-base")
        subprocess.run([PYTHON, str(WORDNET_SCRIPT), "/usr/share/wordnet", str(target)], check=True)
    return str(target)


def parse_variant(text: str) -> tuple[str, list[str]]:
    label, *pairs = text.split(":")
    return label, [item for pair in pairs for item in ("-p", pair)]


def one_run(root: Path, label: str, seed: int, args: argparse.Namespace, overrides: list[str]) -> dict[str, Any]:
    config = kg_config(root, args.epochs, args.workers)
    config["checkpoint_path"] = str(root / f"ckpt_{label}_{seed}")
    shutil.rmtree(config["checkpoint_path"], ignore_errors=True)
    if label != "pbg":
        config["seed"] = seed
    path = root / f"config_{label}_{seed}.py"
    write_py_config(path, config)
    if label == "pbg":
        command = [PYTHON, "-c", PBG_SEEDED, str(seed), str(path)]
    else:
        command = [PYTHON, "-m", "job", "train", str(path), *overrides]
    measured = run_measured(command, log=root / f"{label}_{seed}.log")
    if label == "pbg":
        edges, seconds = pbg_compute_rate(measured["output"])
    else:
        edges, seconds = ours_compute_rate(config["checkpoint_path"])
    filters = [str(root / "data" / s) for s in ("train", "valid", "test")]
    return {"trainer": label, "seed": seed, "wall_s": measured["wall"], "edges": edges,
            "compute_edges_per_s": edges / seconds if seconds else 0.0,
            "filtered_mrr": filtered_mrr(path, str(root / "data" / "test"), filters)}


def summarise(runs: list[dict[str, Any]], rates: dict[str, float], workers: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label in dict.fromkeys(r["trainer"] for r in runs):
        mine = [r for r in runs if r["trainer"] == label]
        mrr = [r["filtered_mrr"] for r in mine]
        rate = statistics.mean(r["compute_edges_per_s"] for r in mine)
        out[label] = {"wall_s_mean": statistics.mean(r["wall_s"] for r in mine), "compute_edges_per_s_mean": rate,
                      "mrr_mean": statistics.mean(mrr), "mrr_sd": statistics.stdev(mrr) if len(mrr) > 1 else 0.0,
                      "mrr": mrr,
                      # 2.5 MFLOP per edge against `workers` threads at the measured float32 bmm rate
                      "fraction_of_fp32_limit": rate * 2.5e-3 / (rates["float32"] * workers)}
    if "pbg" in out:
        for row in out.values():
            row["wall_vs_pbg"] = out["pbg"]["wall_s_mean"] / row["wall_s_mean"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="wordnet", help="wordnet, umls, kinships or nations")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--variant", action="append", default=[], help="LABEL:KEY=VALUE[:KEY=VALUE...]")
    parser.add_argument("--no-pbg", action="store_true")
    parser.add_argument("--no-baseline", action="store_true", help="skip the plain biggraph run")
    parser.add_argument("--work", default=None)
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="kg-bench-"))
    root = work / args.dataset
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "data" / "test").exists():
        import_kg(dataset_source(args.dataset, work), root)
    rates = product_rates()
    print(json.dumps({"bmm_gflops_per_thread": {k: round(v, 1) for k, v in rates.items()}}), flush=True)
    trainers = [] if args.no_baseline else [("biggraph", [])]
    trainers += [parse_variant(v) for v in args.variant]
    if not args.no_pbg:
        trainers.append(("pbg", []))
    runs = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for label, overrides in trainers:
            runs.append(one_run(root, label, seed, args, overrides))
            print(json.dumps(runs[-1]), flush=True)
    summary = summarise(runs, rates, args.workers)
    print(json.dumps(summary, indent=1), flush=True)
    out = ROOT / "bench" / "out"
    out.mkdir(exist_ok=True)
    (out / f"kg_bench_{args.dataset}_{int(time.time())}.json").write_text(
        json.dumps({"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M"), "rates": rates,
                    "runs": runs, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
