"""Training throughput, peak memory and quality: biggraph against PyTorch-BigGraph 1.0.0, side by side.

Both trainers run on the same files (our importer's output is PBG input format v1), the same
config file (a PBG Python config), on the same machine one after the other; both checkpoints
are scored by the same evaluator (filtered MRR against every entity). Figures are ratios
within one run, as bench/RESULTS.md requires.

    .venv/bin/python bench/train_bench.py --datasets umls,kinships,nations --epochs 25
    .venv/bin/python bench/train_bench.py --generated --edges 10000000 --entities 1000000 --partitions 1,4
    .venv/bin/python bench/train_bench.py --memory --entities 10000000 --partitions 1,4,8

Throughput is "compute" edges/s (training time per bucket, I/O and eval excluded; PBG logs the same
quantity as "Processed N edges in T s") and "wall" edges/s (the whole command, start-up included).
Peak memory is the maximum over time of the summed PSS (proportional set size: shared pages split among
the processes mapping them) of the trainer and its worker processes, for both systems.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import matmul_rate  # noqa: E402 - a sibling bench module, not a package

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


def pbg_train_command() -> list[str] | None:
    exe = Path(PYTHON).parent / "torchbiggraph_train"
    if exe.exists():
        return [str(exe)]
    import importlib.util

    # installed without its console script (pip install --target): the same entry point as a module
    return [PYTHON, "-m", "torchbiggraph.train"] if importlib.util.find_spec("torchbiggraph") else None


def run_measured(command: list[str], env: dict[str, str] | None = None, log: Path | None = None) -> dict[str, Any]:
    """Run a command; return wall seconds, peak summed RSS (MiB) of its process tree, and its output."""
    started = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, **(env or {})))
    peak = 0
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)  # type: ignore[arg-type]
    reader.start()
    parent = psutil.Process(proc.pid)
    while proc.poll() is None:
        sampled = time.perf_counter()
        try:
            # PSS: shared-memory embeddings mapped by every Hogwild worker are counted once, not per process
            processes = [parent, *parent.children(recursive=True)]
            total = sum(_pss(p) for p in processes)
            peak = max(peak, total)
        except psutil.Error:
            pass
        # reading smaps_rollup walks every mapped page: with GiBs mapped a sample costs ~0.1 s of CPU, which
        # every 0.2 s took a third of a core from the trainer (70M-entity run); at most ~10% of one core now
        time.sleep(max(0.2, 9 * (time.perf_counter() - sampled)))
    reader.join()
    wall = time.perf_counter() - started
    text = "".join(output)
    if log is not None:
        log.write_text(text)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({proc.returncode}):\n{text[-3000:]}")
    return {"wall": wall, "peak_rss_mib": peak / 2**20, "output": text}


def _pss(process: psutil.Process) -> int:
    try:
        with open(f"/proc/{process.pid}/smaps_rollup") as handle:
            for line in handle:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return process.memory_info().rss


def write_py_config(path: Path, config: dict[str, Any]) -> None:
    """A PBG config file: PBG only loads Python configs."""
    path.write_text("def get_torchbiggraph_config():\n    return " + repr(config) + "\n")


def ours_compute_rate(checkpoint_path: str) -> tuple[int, float]:
    edges = 0
    seconds = 0.0
    with open(os.path.join(checkpoint_path, "training_stats.json")) as handle:
        for line in handle:
            record = json.loads(line)
            if "lhs_partition" in record:
                edges += record["stats"]["count"]
                seconds += record["time"]
    return edges, seconds


def pbg_compute_rate(output: str) -> tuple[int, float]:
    edges = 0
    seconds = 0.0
    for match in re.finditer(r"Processed (\d+) edges in ([0-9.]+) s", output):
        edges += int(match.group(1))
        seconds += float(match.group(2))
    return edges, seconds


def filtered_mrr(config_path: Path, test_dir: str, filters: list[str]) -> float:
    from job.config import load_config
    from job.evaluation import evaluate

    metrics = evaluate(load_config(str(config_path), [f"edge_paths={test_dir}"]), filter_paths=filters,
                               candidates="all")
    return float(metrics["mrr"])


def kg_config(root: Path, epochs: int, workers: int) -> dict[str, Any]:
    return {
        "entity_path": str(root / "data"),
        "edge_paths": [str(root / "data" / "train")],
        "checkpoint_path": str(root / "ckpt"),
        "entities": {"all": {"num_partitions": 1}},
        "relations": [{"name": "all_edges", "lhs": "all", "rhs": "all", "operator": "complex_diagonal"}],
        "dynamic_relations": True,
        "dimension": 200,
        "global_emb": False,
        "comparator": "dot",
        "num_epochs": epochs,
        "num_uniform_negs": 1000,
        "num_batch_negs": 50,
        "loss_fn": "softmax",
        "lr": 0.1,
        "batch_size": 1000,
        "eval_fraction": 0.0,
        "workers": workers,
    }


def import_kg(source: str, root: Path) -> None:
    """``source``'s train/valid/test.txt (head, relation, tail) as PBG input under ``root/data`` (one entity
    type, dynamic relations), with our importer."""
    from job.cli import main as cli_main

    config = kg_config(root, 1, 1)
    config["edge_paths"] = [str(root / "data" / s) for s in ("train", "valid", "test")]
    path = root / "import.json"
    path.write_text(json.dumps(config))
    code = cli_main(["import", str(path), *[os.path.join(source, f"{s}.txt") for s in ("train", "valid", "test")],
                     "-l", "0", "--rel-col", "1", "-r", "2"])
    if code != 0:
        raise SystemExit(f"import of {source} failed ({code})")


def trainer_runs(devices: tuple[str, ...], with_pbg: bool) -> list[tuple[str, list[str], list[str]]]:
    """(label, command, arguments after the config file): biggraph on each device ("biggraph" is the CPU), then PBG."""
    runs = []
    for spec in devices:  # "cuda", or "cuda/bfloat16": the device and a compute_dtype
        device, _, dtype = spec.partition("/")
        label = ("biggraph" if device == "cpu" else f"biggraph-{device}") + (f"-{dtype}" if dtype else "")
        extra = ["-p", f"device={device}"] + (["-p", f"compute_dtype={dtype}"] if dtype else [])
        runs.append((label, [PYTHON, "-m", "job", "train"], extra))
    pbg = pbg_train_command()
    if with_pbg and pbg:
        runs.append(("pbg", pbg, []))
    return runs


def bench_dataset(name: str, epochs: int, workers: int, work: Path, with_pbg: bool,
                  devices: tuple[str, ...] = ("cpu",)) -> dict[str, Any]:
    from job.data.datasets import dataset_dir

    root = work / name
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    import_kg(dataset_dir(name), root)
    filters = [str(root / "data" / s) for s in ("train", "valid", "test")]
    test_dir = str(root / "data" / "test")
    result: dict[str, Any] = {"dataset": name, "epochs": epochs, "workers": workers}
    runs = trainer_runs(devices, with_pbg)
    for label, command, extra in runs:
        config = kg_config(root, epochs, workers)
        config["checkpoint_path"] = str(root / f"ckpt_{label}")
        path = root / f"config_{label}.py"
        write_py_config(path, config)
        measured = run_measured(command + [str(path)] + extra, log=root / f"{label}.log")
        if label == "pbg":
            edges, seconds = pbg_compute_rate(measured["output"])
        else:
            edges, seconds = ours_compute_rate(config["checkpoint_path"])
        result[label] = {
            "compute_edges_per_s": edges / seconds if seconds else 0.0,
            "wall_edges_per_s": edges / measured["wall"],
            "wall_s": measured["wall"],
            "peak_rss_mib": measured["peak_rss_mib"],
            "filtered_mrr": filtered_mrr(path, test_dir, filters),
        }
    return result


def write_generated_graph(root: Path, num_entities: int, num_edges: int, partitions: int, seed: int = 0) -> None:
    """Uniformly random edges over one entity type and 10 relation types, written straight to v1."""
    from job.formats.edges import edges_file, write_edges
    from job.formats.entities import write_entity_count

    rng = np.random.default_rng(seed)
    counts = [num_entities // partitions + (1 if p < num_entities % partitions else 0) for p in range(partitions)]
    for p, count in enumerate(counts):
        write_entity_count(str(root / "data"), "node", p, count)
    buckets: dict[tuple[int, int], list] = {}
    block = 5_000_000
    for start in range(0, num_edges, block):
        n = min(block, num_edges - start)
        lhs_part = rng.integers(0, partitions, n)
        rhs_part = rng.integers(0, partitions, n)
        lhs = (rng.random(n) * np.array(counts)[lhs_part]).astype(np.int64)
        rhs = (rng.random(n) * np.array(counts)[rhs_part]).astype(np.int64)
        rel = rng.integers(0, 10, n)
        for lp in range(partitions):
            for rp in range(partitions):
                sel = (lhs_part == lp) & (rhs_part == rp)
                buckets.setdefault((lp, rp), []).append((rel[sel], lhs[sel], rhs[sel]))
    for (lp, rp), parts in buckets.items():
        write_edges(edges_file(str(root / "data" / "edges"), lp, rp), *(np.concatenate(c) for c in zip(*parts)))


def generated_config(root: Path, partitions: int, workers: int, dimension: int, label: str) -> dict[str, Any]:
    return {
        "entity_path": str(root / "data"),
        "edge_paths": [str(root / "data" / "edges")],
        "checkpoint_path": str(root / f"ckpt_{label}"),
        "entities": {"node": {"num_partitions": partitions}},
        "relations": [{"name": f"r{i}", "lhs": "node", "rhs": "node", "operator": "complex_diagonal"} for i in range(10)],
        "dimension": dimension,
        "comparator": "dot",
        "loss_fn": "softmax",
        "num_epochs": 1,
        "num_batch_negs": 50,
        "num_uniform_negs": 50,
        "batch_size": 1000,
        "lr": 0.1,
        "eval_fraction": 0.0,
        "workers": workers,
        "bucket_order": "affinity",
    }


def bench_generated(num_entities: int, num_edges: int, partitions: list[int], workers: int, dimension: int,
                    work: Path, with_pbg: bool, repeats: int = 1,
                    devices: tuple[str, ...] = ("cpu",)) -> list[dict[str, Any]]:
    results = []
    for p in partitions:
        root = work / f"generated_{num_entities}_{num_edges}_p{p}"
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        write_generated_graph(root, num_entities, num_edges, p)
        result: dict[str, Any] = {"entities": num_entities, "edges": num_edges, "partitions": p, "dimension": dimension}
        runs = trainer_runs(devices, with_pbg)
        # The trainers alternate (A B A B ...): this VM's speed drifts by +-20% over minutes, so each
        # system's best run is compared with the other's best taken in the same stretch of time.
        for repeat in range(repeats):
            for label, command, extra in runs:
                config = generated_config(root, p, workers, dimension, label)
                path = root / f"config_{label}.py"
                write_py_config(path, config)
                measured = run_measured(command + [str(path)] + extra, log=root / f"{label}.log")
                edges, seconds = (pbg_compute_rate(measured["output"]) if label == "pbg"
                                  else ours_compute_rate(config["checkpoint_path"]))
                run = {"compute_edges_per_s": edges / seconds if seconds else 0.0,
                       "wall_edges_per_s": edges / measured["wall"], "wall_s": measured["wall"],
                       "compute_s": seconds, "peak_rss_mib": measured["peak_rss_mib"]}
                # where the rest of the wall went: the trainer's start-up clock and its pass lines
                run["log"] = [line.strip()[-300:] for line in measured["output"].splitlines()
                              if "start-up:" in line or "edges/s" in line or "orker" in line][:6]
                entry = result.setdefault(label, {"runs": []})
                entry["runs"].append(run)
                for key in ("compute_edges_per_s", "wall_edges_per_s"):
                    entry[key] = max(r[key] for r in entry["runs"])
                entry["peak_rss_mib"] = max(r["peak_rss_mib"] for r in entry["runs"])
                entry["wall_s"] = min(r["wall_s"] for r in entry["runs"])
                shutil.rmtree(config["checkpoint_path"], ignore_errors=True)
                print(json.dumps({"partitions": p, "repeat": repeat, label: run}), flush=True)
        embeddings_mib = num_entities * dimension * 4 / 2**20
        result["embeddings_mib"] = embeddings_mib
        results.append(result)
        shutil.rmtree(root, ignore_errors=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", default="", help="comma-separated: umls,kinships,nations")
    parser.add_argument("--epochs", type=int, default=25)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--generated", action="store_true", help="the generated-graph throughput bench")
    parser.add_argument("--memory", action="store_true", help="the peak-memory bench (biggraph only)")
    parser.add_argument("--entities", type=int, default=1_000_000)
    parser.add_argument("--edges", type=int, default=10_000_000)
    parser.add_argument("--dimension", type=int, default=100)
    parser.add_argument("--partitions", default="1,4")
    parser.add_argument("--no-pbg", action="store_true", help="skip the PBG baseline")
    parser.add_argument("--repeats", type=int, default=1,
                        help="generated graph: alternate the two trainers this many times, report each one's best")
    parser.add_argument("--devices", default="cpu",
                        help="comma-separated devices biggraph trains on (cpu, cuda; cuda/bfloat16 adds a "
                             "compute_dtype), each next to the same PBG run")
    parser.add_argument("--work", default=None, help="scratch directory (default: a temp dir)")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="biggraph-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "command": " ".join(sys.argv),
                               "matmul_gflops": round(matmul_rate(), 1)}
    print(json.dumps({"matmul_gflops": results["matmul_gflops"]}), flush=True)
    devices = tuple(d for d in args.devices.split(",") if d)
    for name in [d for d in args.datasets.split(",") if d]:
        results.setdefault("datasets", []).append(bench_dataset(name, args.epochs, args.workers, work, not args.no_pbg,
                                                                devices))
        print(json.dumps(results["datasets"][-1]), flush=True)
    partitions = [int(p) for p in args.partitions.split(",")]
    if args.generated:
        results["generated"] = bench_generated(args.entities, args.edges, partitions, args.workers, args.dimension, work,
                                               not args.no_pbg, args.repeats, devices)
        print(json.dumps(results["generated"]), flush=True)
    if args.memory:
        results["memory"] = bench_generated(args.entities, args.edges, partitions, args.workers, args.dimension, work,
                                             False)
        print(json.dumps(results["memory"]), flush=True)
    out = ROOT / "bench" / "out"
    out.mkdir(exist_ok=True)
    results["matmul_gflops_after"] = round(matmul_rate(), 1)
    print(json.dumps({"matmul_gflops_after": results["matmul_gflops_after"]}), flush=True)
    (out / f"train_bench_{int(time.time())}.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
