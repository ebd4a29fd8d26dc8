"""Storage benchmark: training edges/s from local files vs s3:// (stage and stream), and checkpoint MB/s.

Everything runs in one process run, against one moto S3 server started as a subprocess on
127.0.0.1, so that the ratios are comparable. moto is a correctness tool: it copies the whole
object on every ranged GET and serves HTTP from Python, so the absolute S3 figures say little
about real S3; the ratio to local files in the same run is the figure to look at.

    .venv/bin/python bench/storage_bench.py                       # defaults below
    .venv/bin/python bench/storage_bench.py --edges 2000000 --json out.json
    .venv/bin/python bench/storage_bench.py --entities 1000000 --dim 32 --partitions 4 --edges 500000 --repeats 2
        (partition I/O matters: s3-stage-prefetch against s3-stage shows what prefetch_partitions hides)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # free_port: the tests' own

from helpers_distributed import free_port  # noqa: E402

import storage_adapters as storage  # noqa: E402
from job.formats.checkpoint import CheckpointStorage  # noqa: E402
from job.formats.edges import edges_file, write_edges  # noqa: E402
from job.formats.entities import write_entity_count  # noqa: E402


def start_fake_s3(command: list[str], credential: str) -> tuple[subprocess.Popen, str]:
    """A fake S3 server, ``command`` + its port, on 127.0.0.1; this process's AWS settings get ``credential`` as
    key and secret and point at nothing real."""
    port = free_port()
    for key in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
        os.environ.pop(key, None)
    os.environ.update(AWS_ACCESS_KEY_ID=credential, AWS_SECRET_ACCESS_KEY=credential, AWS_DEFAULT_REGION="us-east-1",
                      AWS_EC2_METADATA_DISABLED="true")
    proc = subprocess.Popen([*command, str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"{command[0]} did not start")


def start_moto() -> tuple[subprocess.Popen, str]:
    """moto's S3 server in its own process (every object in RAM)."""
    server = os.path.join(os.path.dirname(sys.executable), "moto_server")
    return start_fake_s3([server, "-H", "127.0.0.1", "-p"], "bench")


def start_s3rver(binary: str, directory: Path, bucket: str) -> tuple[subprocess.Popen, str]:
    """s3rver (a Node fake S3 keeping objects as files under ``directory``) with ``bucket``; its credentials are
    fixed (S3RVER)."""
    directory.mkdir(parents=True, exist_ok=True)
    return start_fake_s3([binary, "-d", str(directory), "-a", "127.0.0.1", "-s", "--configure-bucket", bucket, "-p"],
                         "S3RVER")


def write_graph(root: Path, num_entities: int, num_edges: int, num_partitions: int) -> None:
    rng = np.random.default_rng(0)
    per_part = [num_entities // num_partitions] * num_partitions
    for part, count in enumerate(per_part):
        write_entity_count(str(root / "entities"), "node", part, count)
    per_bucket = num_edges // (num_partitions * num_partitions)
    for lhs in range(num_partitions):
        for rhs in range(num_partitions):
            write_edges(edges_file(str(root / "edges"), lhs, rhs), rng.integers(0, 4, per_bucket),
                        rng.integers(0, per_part[lhs], per_bucket), rng.integers(0, per_part[rhs], per_bucket))


def train_once(data: str, checkpoints: str, args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    from job.config import parse_config
    from job.train import train

    raw = {
        "entities": {"node": {"num_partitions": args.partitions}},
        "relations": [{"name": f"r{r}", "lhs": "node", "rhs": "node", "operator": "translation"} for r in range(4)],
        "dimension": args.dim, "num_epochs": args.epochs, "batch_size": 1000, "num_batch_negs": 10,
        "num_uniform_negs": 10, "lr": 0.1, "eval_fraction": 0.0, "workers": 1, "seed": 1,
        "entity_path": storage.join(data, "entities"), "edge_paths": [storage.join(data, "edges")],
        "checkpoint_path": checkpoints, **extra,
    }
    started = time.perf_counter()
    summary = train(parse_config(raw))
    wall = time.perf_counter() - started
    return {"edges_per_sec": summary["train_edges"] / wall, "seconds": wall, "train_edges": summary["train_edges"]}


def checkpoint_io(base: str, megabytes: int, parts: int) -> dict[str, float]:
    rows = megabytes * 2**20 // (parts * 128 * 4)
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((rows, 128)).astype(np.float32) for _ in range(parts)]
    total = sum(a.nbytes for a in arrays) / 1e6
    cp = CheckpointStorage(base)
    cp.prepare()
    started = time.perf_counter()
    for part, array in enumerate(arrays):
        cp.save_entity_partition(1, "node", part, array)
    cp.save_version(1)  # waits for every upload, then writes the marker
    write = time.perf_counter() - started
    started = time.perf_counter()
    reader = CheckpointStorage(base)
    version = reader.load_version()
    for part in range(parts):
        reader.load_entity_partition(version, "node", part)
    read = time.perf_counter() - started
    cp.close()
    return {"mb": total, "write_mb_s": total / write, "read_mb_s": total / read}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entities", type=int, default=100_000)
    parser.add_argument("--edges", type=int, default=1_000_000)
    parser.add_argument("--partitions", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats; the best of each is reported")
    parser.add_argument("--checkpoint-mb", type=int, default=256)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()

    import logging

    import torch

    torch.set_num_threads(1)  # steadier on a shared machine; the storage path is what is being compared
    logging.basicConfig(level=logging.WARNING)
    tmp = Path(tempfile.mkdtemp(prefix="storage-bench-"))
    proc, endpoint = start_moto()
    scope = contextlib.ExitStack()
    try:
        import s3fs

        # checkpoint_io below reads and writes through the storage layer: it needs the endpoint too
        scope.enter_context(storage.using(storage.StorageSettings(options={"endpoint_url": endpoint})))
        fs = s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True)
        fs.mkdir("bench")
        write_graph(tmp / "data", args.entities, args.edges, args.partitions)
        data_bytes = sum(p.stat().st_size for p in (tmp / "data").rglob("*") if p.is_file())
        fs.put(str(tmp / "data"), "bench/data", recursive=True)
        results: dict[str, Any] = {"config": vars(args), "edge_bytes": data_bytes, "date": time.strftime("%Y-%m-%d")}
        runs = [("local", str(tmp / "data"), str(tmp / "ckpt-local"), "stage", False),
                ("s3-stage", "s3://bench/data", "s3://bench/ckpt-stage", "stage", False),
                ("s3-stream", "s3://bench/data", "s3://bench/ckpt-stream", "stream", False),
                # the next bucket's partitions read from S3 while the current one trains
                ("s3-stage-prefetch", "s3://bench/data", "s3://bench/ckpt-prefetch", "stage", True)]
        for repeat in range(args.repeats):  # interleaved and rotated, so that load and warm-up hurt every variant alike
            shift = repeat % len(runs)
            for name, data, checkpoints, mode, prefetch in runs[shift:] + runs[:shift]:
                os.environ["BIGGRAPH_EDGE_CACHE_DIR"] = str(tmp / f"cache-{name}-{repeat}")  # each run: a cold cache
                os.environ["BIGGRAPH_EDGE_CACHE_BYTES"] = str(2 * 2**30)
                run = train_once(data, f"{checkpoints}-{repeat}", args, edge_read_mode=mode,
                                 storage_options={"endpoint_url": endpoint}, prefetch_partitions=prefetch)
                print(f"train {name:10s} {run['edges_per_sec']:>12,.0f} edges/s ({run['seconds']:.1f} s)", flush=True)
                if name not in results or run["edges_per_sec"] > results[name]["edges_per_sec"]:
                    results[name] = run
        for name in ("s3-stage", "s3-stream", "s3-stage-prefetch"):
            results[name]["ratio_vs_local"] = results[name]["edges_per_sec"] / results["local"]["edges_per_sec"]
        results["checkpoint_local"] = checkpoint_io(str(tmp / "ckio"), args.checkpoint_mb, 4)
        results["checkpoint_s3"] = checkpoint_io("s3://bench/ckio", args.checkpoint_mb, 4)
        for name in ("checkpoint_local", "checkpoint_s3"):
            r = results[name]
            print(f"{name:16s} {r['mb']:.0f} MB: write {r['write_mb_s']:.0f} MB/s, read {r['read_mb_s']:.0f} MB/s")
        print(json.dumps(results, indent=1))
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
    finally:
        scope.close()
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
