"""Growing a trained model against retraining it, on the WordNet KG (issue #18's targets).

    apt-get install -y wordnet-base
    python3 /work/shared/data/wordnet-kg/make_wordnet_kg.py /usr/share/wordnet /tmp/wn
    .venv/bin/python bench/grow_bench.py --kg /tmp/wn --out /tmp/grow_bench

A seeded ``--new-fraction`` (20%) of the train split's entities is held back. The base model is trained
``--epochs`` epochs on the edges among the others; ``biggraph grow`` then adds the held-back entities
with every train edge touching them and trains ``grow_num_epochs`` passes on those edges plus a
``grow_replay_fraction`` sample of the old ones. The full retrain trains ``--epochs`` epochs on every
train edge from scratch, the same number of epochs the base model had (the grown model has had those
plus the grow's passes over the new edges). Compared: filtered MRR (every entity a candidate, train +
valid + test filtered, both sides) on the test edges touching a new entity and on those among old
entities; wall time of the grow step plus its training against the full retrain (each the whole
command, import included: ``import`` + ``train`` for the retrain, ``grow`` for the increment); and
the MRR on new entities right after the grow, before any training, for ``neighbours`` and ``random``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import matmul_rate  # noqa: E402 - a sibling bench module, not a package

REPO = Path(__file__).resolve().parent.parent
COLUMNS = ["-l", "0", "--rel-col", "1", "-r", "2"]


def read_triples(path: Path) -> list[tuple[str, str, str]]:
    return [tuple(line.split("\t")) for line in path.read_text().splitlines() if line]  # type: ignore[misc]


def write_tsv(path: Path, rows: list[tuple[str, str, str]]) -> Path:
    path.write_text("".join(f"{h}\t{r}\t{t}\n" for h, r, t in rows))
    return path


def config_for(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "entities": {"all": {"num_partitions": 1}},
        "relations": [{"name": "all", "lhs": "all", "rhs": "all", "operator": "complex_diagonal"}],
        "dynamic_relations": True, "global_emb": False, "dimension": args.dim, "comparator": "dot",
        "loss_fn": "softmax", "lr": args.lr, "num_epochs": args.epochs, "batch_size": 1000, "num_batch_negs": 50,
        "num_uniform_negs": args.uniform_negs, "eval_fraction": 0.0, "workers": args.workers, "seed": args.seed,
        "entity_path": str(root / "entities"), "edge_paths": [str(root / "edges")],
        "checkpoint_path": str(root / "model"), "grow_num_epochs": args.grow_epochs,
        "grow_replay_fraction": args.replay, "grow_init": "neighbours",
    }


def run(command: list[str], log: Path) -> float:
    """Run a biggraph command, return its wall time (interpreter start-up included)."""
    started = time.perf_counter()
    with log.open("a") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        subprocess.run([sys.executable, "-m", "job", *command], check=True, stdout=out, stderr=subprocess.STDOUT,
                       cwd=REPO)
    return time.perf_counter() - started


def write_mapped(config_path: Path, rows: list[tuple[str, str, str]], out: Path) -> Path:
    """``rows`` (names) as a bucket directory in the id space of the model at ``config_path``."""
    from job.config import load_config
    from job.formats import entities as ent
    from job.formats.edges import edges_file, write_edges

    config = load_config(str(config_path))
    parts = config.entities["all"].num_partitions
    where = {}
    for part in range(parts):
        for offset, name in enumerate(ent.read_entity_names(config.entity_path, "all", part)):
            where[name] = (part, offset)
    relation = {name: i for i, name in enumerate(ent.read_dynamic_rel_names(config.entity_path))}
    buckets: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for head, rel, tail in rows:
        (hp, ho), (tp, to) = where[head], where[tail]
        buckets.setdefault((hp, tp), []).append((relation[rel], ho, to))
    out.mkdir(parents=True, exist_ok=True)
    for lhs in range(parts):
        for rhs in range(parts):
            edges = np.array(buckets.get((lhs, rhs), []), dtype=np.int64).reshape(-1, 3)
            write_edges(edges_file(str(out), lhs, rhs), edges[:, 0], edges[:, 1], edges[:, 2])
    return out


def evaluate(config_path: Path, name: str, splits: dict[str, list], work: Path, log: Path) -> dict[str, float]:
    """Filtered MRR of the model at ``config_path`` on each test subset."""
    root = work / f"eval_{name}"
    shutil.rmtree(root, ignore_errors=True)
    from job.config import load_config

    config = load_config(str(config_path))
    filters = [config.edge_paths[0], str(write_mapped(config_path, splits["valid"], root / "valid")),
               str(write_mapped(config_path, splits["test"], root / "test"))]
    metrics = {}
    for subset in ("test_new", "test_old"):
        edges = write_mapped(config_path, splits[subset], root / subset)
        command = ["eval", str(config_path), "-p", f"edge_paths={edges}", "--candidates", "all", "--json"]
        for f in filters:
            command += ["--filter", f]
        with log.open("a") as out:
            result = subprocess.run([sys.executable, "-m", "job", *command], check=True, capture_output=True,
                                    text=True, cwd=REPO)
            out.write(result.stderr)
        metrics[subset] = json.loads(result.stdout)["mrr"]
    return metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kg", type=Path, required=True, help="directory with train.txt, valid.txt, test.txt")
    parser.add_argument("--out", type=Path, default=Path("/tmp/grow_bench"))
    parser.add_argument("--new-fraction", type=float, default=0.2)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--grow-epochs", type=int, default=5)
    parser.add_argument("--replay", type=float, default=0.1)
    parser.add_argument("--dim", type=int, default=100)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--uniform-negs", type=int, default=100)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-full", action="store_true", help="reuse the full retrain of an earlier run in --out")
    parser.add_argument("--train-random", action="store_true", help="also train the random-initialised grow")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    sys.path.insert(0, str(REPO))
    work = args.out
    work.mkdir(parents=True, exist_ok=True)
    log = work / "bench.log"
    train = read_triples(args.kg / "train.txt")
    entities = sorted({e for h, _, t in train for e in (h, t)})
    held_back = set(random.Random(args.seed).sample(entities, int(args.new_fraction * len(entities))))
    old_edges = [t for t in train if t[0] not in held_back and t[2] not in held_back]
    new_edges = [t for t in train if t[0] in held_back or t[2] in held_back]
    old_entities = {e for h, _, t in old_edges for e in (h, t)}
    test = read_triples(args.kg / "test.txt")
    splits = {
        "valid": read_triples(args.kg / "valid.txt"), "test": test,
        "test_new": [t for t in test if t[0] not in old_entities or t[2] not in old_entities],
        "test_old": [t for t in test if t[0] in old_entities and t[2] in old_entities],
    }
    files = {"all": write_tsv(work / "all.tsv", train), "old": write_tsv(work / "old.tsv", old_edges),
             "new": write_tsv(work / "new.tsv", new_edges)}
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(), "load_before": os.getloadavg()[0], "matmul_gflops": round(matmul_rate(), 1),
        "entities": len(entities), "train_edges": len(train), "old_edges": len(old_edges), "new_edges": len(new_edges),
        "old_entities": len(old_entities), "new_entities": len(entities) - len(old_entities),
        "test_new": len(splits["test_new"]), "test_old": len(splits["test_old"]),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    print(json.dumps(result))

    def setup(name: str) -> Path:
        root = work / name
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir()
        path = root / "config.json"
        path.write_text(json.dumps(config_for(root, args)))
        return path

    full = work / "full" / "config.json"
    if not args.skip_full:
        full = setup("full")
        result["full_import_s"] = run(["import", str(full), str(files["all"]), *COLUMNS], log)
        result["full_train_s"] = run(["train", str(full)], log)
    result["full"] = evaluate(full, "full", splits, work, log)
    print(json.dumps({"full": result["full"]}))

    base = setup("base")
    result["base_import_s"] = run(["import", str(base), str(files["old"]), *COLUMNS], log)
    result["base_train_s"] = run(["train", str(base)], log)
    # the increment as a user runs it, one command (grow, then its training passes): what the wall ratio counts
    timed = work / "grow_timed"
    shutil.rmtree(timed, ignore_errors=True)
    shutil.copytree(work / "base", timed)
    timed_config = timed / "config.json"
    timed_config.write_text((timed / "config.json").read_text().replace(str(work / "base"), str(timed)))
    result["grow_and_train_s"] = run(["grow", str(timed_config), str(files["new"]), *COLUMNS], log)
    result["grown"] = evaluate(timed_config, "grown", splits, work, log)
    print(json.dumps({"grown": result["grown"]}))
    for init in ("neighbours", "random"):
        root = work / f"grow_{init}"
        shutil.rmtree(root, ignore_errors=True)
        shutil.copytree(work / "base", root)
        raw = json.loads((root / "config.json").read_text().replace(str(work / "base"), str(root)))
        raw["grow_init"] = init
        config = root / "config.json"
        config.write_text(json.dumps(raw))
        grow_command = ["grow", str(config), str(files["new"]), *COLUMNS]
        result[f"{init}_grow_s"] = run([*grow_command, "--no-train"], log)
        result[f"{init}_before_training"] = evaluate(config, f"{init}_0", splits, work, log)
        print(json.dumps({init: result[f"{init}_before_training"]}))
        if init == "random" and args.train_random:  # the same command again resumes: the training passes
            run(grow_command, log)
            result[init] = evaluate(config, init, splits, work, log)
            print(json.dumps({init: result[init]}))
    full_wall = result.get("full_import_s", 0.0) + result.get("full_train_s", 0.0)
    if full_wall:
        result["wall_ratio"] = result["grow_and_train_s"] / full_wall
    result["load_after"] = os.getloadavg()[0]
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
