"""Out-of-core training: a partition buffer under a memory budget against everything in memory (and PBG).

Generates a power-law graph (one entity type, 10 relation types; a few entities take most edges, as in
real graphs; ids shuffled so the hubs spread over partitions) straight into input format v1, then trains
it one epoch per configuration, one after the other, and prints per run: wall and compute edges/s, peak
PSS of the trainer's process tree, partition loads against the lower bound for the buffer, bytes read
and written, seconds blocked on partition I/O and spent in the commit.

    # the penalty: P=1 in memory against P=8/16 with 3 partitions in memory (same run)
    .venv/bin/python bench/ooc_bench.py --entities 2000000 --edges 20000000 --runs p1,p8:buffer=3,p16:buffer=4
    # a budget instead of a count, checkpoints on moto S3
    .venv/bin/python bench/ooc_bench.py --entities 2000000 --edges 20000000 --runs p8:budget=400MB --backend s3
    # checkpoints bigger than memory on S3: s3rver (npm install s3rver@3.7.1) keeps objects on disk, moto in RAM
    .venv/bin/python bench/ooc_bench.py --entities 70000000 --edges 100000000 --runs p32:budget=8GiB --backend s3 \
        --s3rver /work/s3rver/node_modules/.bin/s3rver --hogwild-delay 0 --work /work/ooc70
    # PBG 1.0.0 at the same P, same files
    .venv/bin/python bench/ooc_bench.py --entities 2000000 --edges 20000000 --runs p8:buffer=3,pbg-p8

A run is ``p<P>[:buffer=N|:budget=SIZE][:order=ORDER][:sync]`` or ``pbg-p<P>``; ``sync`` turns
prefetch_partitions off. Every figure is from this invocation (bench/RESULTS.md: ratios from one run).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import matmul_rate  # noqa: E402 - a sibling bench module, not a package
from storage_bench import start_moto, start_s3rver  # noqa: E402
from train_bench import (  # noqa: E402
    PYTHON,
    pbg_compute_rate,
    pbg_train_command,
    run_measured,
    write_py_config,
)

from job.formats.edges import edges_file, write_edges  # noqa: E402
from job.formats.entities import write_entity_count  # noqa: E402

BLOCK = 5_000_000  # edges generated at a time (bounded memory for any graph size)


def power_law_ids(rng: np.random.Generator, n: int, num_entities: int, skew: float) -> np.ndarray:
    """Ids whose frequency falls off as a power of their rank (rank = floor(N * u^skew))."""
    return np.minimum((num_entities * rng.random(n) ** skew).astype(np.int64), num_entities - 1)


def write_graph(root: Path, num_entities: int, num_edges: int, partitions: int, skew: float, seed: int) -> None:
    """The graph in v1 for ``partitions``: edges spilled per bucket to raw files, then one h5 per bucket."""
    rng = np.random.default_rng(seed)
    shuffle = rng.permutation(num_entities)  # rank -> id: hubs land in every partition
    part_of = rng.integers(0, partitions, num_entities)
    offset = np.zeros(num_entities, dtype=np.int64)
    counts = np.zeros(partitions, dtype=np.int64)
    for p in range(partitions):
        members = np.flatnonzero(part_of == p)
        offset[members] = np.arange(len(members))
        counts[p] = len(members)
        write_entity_count(str(root), "node", p, int(counts[p]))
    spill = root / "spill"
    spill.mkdir(parents=True, exist_ok=True)
    for start in range(0, num_edges, BLOCK):
        n = min(BLOCK, num_edges - start)
        lhs = shuffle[power_law_ids(rng, n, num_entities, skew)]
        rhs = shuffle[power_law_ids(rng, n, num_entities, skew)]
        rel = rng.integers(0, 10, n)
        bucket = part_of[lhs] * partitions + part_of[rhs]
        order = np.argsort(bucket, kind="stable")
        bounds = np.searchsorted(bucket[order], np.arange(partitions * partitions + 1))
        for b in range(partitions * partitions):
            sel = order[bounds[b]:bounds[b + 1]]
            block = np.stack([rel[sel], offset[lhs[sel]], offset[rhs[sel]]], axis=1).astype(np.int32)
            with open(spill / f"{b}.bin", "ab") as handle:
                handle.write(block.tobytes())
    for b in range(partitions * partitions):
        path = spill / f"{b}.bin"
        data = np.fromfile(path, dtype=np.int32).reshape(-1, 3) if path.exists() else np.zeros((0, 3), np.int32)
        write_edges(edges_file(str(root / "edges"), b // partitions, b % partitions),
                    data[:, 0], data[:, 1], data[:, 2])
        path.unlink(missing_ok=True)
    shutil.rmtree(spill)


def parse_run(text: str) -> dict[str, Any]:
    if text.startswith("pbg-p"):
        return {"label": text, "pbg": True, "partitions": int(text[5:])}
    head, *options = text.split(":")
    run: dict[str, Any] = {"label": text, "pbg": False, "partitions": int(head[1:]), "extra": {}}
    for option in options:
        key, _, value = option.partition("=")
        if key == "buffer":
            run["extra"]["partition_buffer"] = int(value)
        elif key == "budget":
            run["extra"]["memory_budget"] = value
        elif key == "order":
            run["extra"]["bucket_order"] = value
        elif key == "sync":
            run["extra"]["prefetch_partitions"] = False
        else:
            raise SystemExit(f"unknown run option {option!r} in {text!r}")
    if run["partitions"] > 1:
        run["extra"].setdefault("bucket_order", "buffer")
    return run


def config_for(data: str, checkpoints: str, partitions: int, args: argparse.Namespace, extra: dict) -> dict[str, Any]:
    config = {
        "entity_path": f"{data}/p{partitions}", "edge_paths": [f"{data}/p{partitions}/edges"],
        "checkpoint_path": checkpoints, "entities": {"node": {"num_partitions": partitions}},
        "relations": [{"name": f"r{i}", "lhs": "node", "rhs": "node", "operator": "complex_diagonal"} for i in range(10)],
        "dimension": args.dim, "comparator": "dot", "loss_fn": "softmax", "num_epochs": args.epochs,
        "num_batch_negs": 50, "num_uniform_negs": 50, "batch_size": 1000, "lr": 0.1, "eval_fraction": 0.0,
        "workers": args.workers, "bucket_order": "inside_out", "hogwild_delay": args.hogwild_delay,
    }
    config.update(extra)
    return config


def summary_of(checkpoints: str, storage_options: dict) -> dict[str, Any]:
    """The last pass summary and the compute rate, read through the project's own storage layer."""
    import storage_adapters as storage

    with storage.using(storage.StorageSettings(options=storage_options)):
        text = storage.read_text(f"{checkpoints}/training_stats.json")
    records = [json.loads(line) for line in text.splitlines() if line]
    passes = [r for r in records if r.get("pass_summary")]
    buckets = [r for r in records if "lhs_partition" in r]
    compute = sum(r["time"] for r in buckets)
    out = {k: passes[-1].get(k) for k in ("partition_loads", "partition_loads_lower_bound", "partition_reads",
                                           "partition_writes", "bytes_read", "bytes_written", "io_blocked_seconds",
                                           "commit_seconds", "time")}
    out["edges"] = sum(r["stats"]["count"] for r in buckets)
    out["compute_edges_per_s"] = out["edges"] / compute if compute else 0.0
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entities", type=int, default=2_000_000)
    parser.add_argument("--edges", type=int, default=20_000_000)
    parser.add_argument("--dim", type=int, default=100)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--hogwild-delay", type=float, default=2.0,
                        help="seconds the Hogwild workers but the first wait on every bucket of epoch 0 (PBG's default "
                             "2 s: on a one-epoch run with many small buckets it dominates, for PBG as for biggraph)")
    parser.add_argument("--skew", type=float, default=2.5, help="power-law skew (1: uniform)")
    parser.add_argument("--runs", default="p1,p8:buffer=3,p16:buffer=4")
    parser.add_argument("--backend", choices=("local", "s3"), default="local", help="where checkpoints live")
    parser.add_argument("--s3rver", default=None, metavar="PATH",
                        help="with --backend s3: run this s3rver executable (objects on disk, under --work) instead "
                             "of moto, which holds every object in RAM and cannot store a checkpoint larger than it")
    parser.add_argument("--work", default=None, help="working directory (default: a temp dir)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()

    runs = [parse_run(r) for r in args.runs.split(",")]
    work = Path(args.work or tempfile.mkdtemp(prefix="ooc-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    moto, storage_options, checkpoint_root = None, {}, str(work / "ckpt")
    if args.backend == "s3":
        import s3fs

        if args.s3rver:
            shutil.rmtree(work / "s3rver-data", ignore_errors=True)
            moto, endpoint = start_s3rver(args.s3rver, work / "s3rver-data", "ooc-bench")
        else:
            moto, endpoint = start_moto()
            s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}).mkdir("ooc-bench")
        storage_options = {"endpoint_url": endpoint}
        checkpoint_root = "s3://ooc-bench/ckpt"
    matmul = matmul_rate()
    print(json.dumps({"matmul_gflops": round(matmul, 1), "entities": args.entities, "edges": args.edges,
                      "dim": args.dim, "embeddings_gib": round(args.entities * (args.dim + 1) * 4 / 2**30, 2),
                      "backend": args.backend if not args.s3rver else "s3 (s3rver)"}), flush=True)
    results = []
    try:
        for p in sorted({r["partitions"] for r in runs}):
            if not (work / "data" / f"p{p}" / "edges").exists():
                write_graph(work / "data" / f"p{p}", args.entities, args.edges, p, args.skew, seed=0)
        for run in runs:
            p = run["partitions"]
            checkpoints = f"{checkpoint_root}/{run['label'].replace(':', '_').replace('=', '-')}"
            config = config_for(str(work / "data"), checkpoints, p, args, run.get("extra", {}))
            if storage_options:
                config["storage_options"] = storage_options
            path = work / f"{run['label'].replace(':', '_').replace('=', '-')}.py"
            if run["pbg"]:
                command = pbg_train_command()
                if command is None:
                    print(json.dumps({"run": run["label"], "skipped": "torchbiggraph is not installed"}))
                    continue
                config["checkpoint_path"] = str(work / "ckpt" / run["label"])
                config.pop("storage_options", None)
            else:
                command = [PYTHON, "-m", "job", "train"]
            if "://" not in config["checkpoint_path"]:
                # a checkpoint left by an earlier invocation in the same --work would be resumed, not trained
                shutil.rmtree(config["checkpoint_path"], ignore_errors=True)
            write_py_config(path, config)
            measured = run_measured(command + [str(path)], log=work / f"{path.stem}.log")
            result: dict[str, Any] = {"run": run["label"], "wall_s": round(measured["wall"], 1),
                                      "peak_pss_mib": round(measured["peak_rss_mib"])}
            if run["pbg"]:
                edges, seconds = pbg_compute_rate(measured["output"])
                result.update(edges=edges, compute_edges_per_s=edges / seconds if seconds else 0.0)
            else:
                result.update(summary_of(config["checkpoint_path"], storage_options))
            result["wall_edges_per_s"] = result["edges"] / measured["wall"]
            results.append(result)
            print(json.dumps(result), flush=True)
    finally:
        if moto is not None:
            moto.kill()
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "matmul_gflops": matmul, "results": results}, indent=1))


if __name__ == "__main__":
    main()
