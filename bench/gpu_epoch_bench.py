"""One GPU epoch of a large graph, in this process: wall, compute, the pass's own time, peak GPU memory.

    python3 bench/gpu_epoch_bench.py CONFIG.json [-p key=value ...] [--label L] [--json OUT]

``CONFIG.json``: a training config (``bench/freebase_like.py`` writes one beside the graph it generates). The
trainer runs in this process (``job.train.train``), so the card's peak allocation is read from torch itself. The
figures printed, one JSON line:

- ``wall_s``: ``train()`` from the call to its return (start-up, the input check, the pass, its commit);
- ``pass_s``: the pass's own wall time (``pass_summary``'s ``time``: its buckets, their edges' reads, the commit);
- ``compute_s`` and ``compute_edges_per_s``: the buckets' training time (the GPU's clock: the trainer waits for the
  card before it stops each bucket's clock), summed over buckets;
- ``peak_allocated_gib`` / ``peak_reserved_gib``: torch's caching allocator's peaks on the card;
- the card's measured copy bandwidth and matmul rates, so that a figure can be set against another card's.

Nothing here asserts anything: the numbers go to bench/RESULTS.md with the card, driver and torch version.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def card_facts() -> dict[str, Any]:
    """The card, its driver, torch's version, and what the card measured here does: device-to-device copy GB/s
    (what a gather-bound step is limited by), float32 and bfloat16 matmul TFLOP/s."""
    facts: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                             "card": torch.cuda.get_device_name(0)}
    try:
        facts["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                         capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        facts["driver"] = "?"
    source = torch.empty(2**28, dtype=torch.float32, device="cuda")  # 1 GiB
    target = torch.empty_like(source)
    target.copy_(source)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(10):
        target.copy_(source)
    torch.cuda.synchronize()
    facts["copy_gb_per_s"] = round(10 * 2 * source.numel() * 4 / (time.perf_counter() - started) / 1e9, 1)
    del source, target
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(8192, 8192, device="cuda", dtype=dtype)
        a @ a
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()
        facts[f"matmul_{str(dtype).split('.')[-1]}_tflops"] = round(10 * 2 * 8192**3 / (time.perf_counter() - started)
                                                                    / 1e12, 1)
    torch.cuda.empty_cache()
    return facts


def stats_of(checkpoint_path: str) -> dict[str, Any]:
    """Summed bucket records and the last pass summary of ``training_stats.json``."""
    edges, compute, io, buckets, summary = 0, 0.0, 0.0, 0, None
    with open(Path(checkpoint_path) / "training_stats.json") as handle:
        for line in handle:
            record = json.loads(line)
            if "lhs_partition" in record:
                edges += record["stats"]["count"]
                compute += record["time"]
                io += record.get("io_time", 0.0)
                buckets += 1
            elif record.get("pass_summary"):
                summary = record
    return {"edges": edges, "compute_s": round(compute, 2), "edge_io_s": round(io, 2), "buckets": buckets,
            "pass_s": round(summary["time"], 2) if summary else None,
            "commit_s": summary.get("commit_seconds") if summary else None,
            "io_blocked_s": summary.get("io_blocked_seconds") if summary else None,
            "loss": summary["stats"]["metrics"].get("loss") if summary else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("-p", "--param", action="append", default=[], help="config override key=value")
    parser.add_argument("--label", default="gpu")
    parser.add_argument("--json", default=None, help="also append the result line to this file")
    parser.add_argument("--no-card-facts", action="store_true")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of this script on a machine without a GPU")
    args = parser.parse_args()

    from job.config import load_config
    from job.train import train

    on_gpu = args.device == "cuda"
    facts = card_facts() if on_gpu and not args.no_card_facts else {}
    config = load_config(args.config, [f"device={args.device}", *args.param])
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    train(config)
    wall = time.perf_counter() - started
    stats = stats_of(config.checkpoint_path)
    result = {
        "label": args.label, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), **facts,
        "entities": sum(sum(c) for c in _counts(config).values()), "partitions": max(
            e.num_partitions for e in config.entities.values()), "dimension": config.dimension,
        "batch_size": config.batch_size, "num_batch_negs": config.num_batch_negs,
        "num_uniform_negs": config.num_uniform_negs, "compute_dtype": config.compute_dtype,
        "wall_s": round(wall, 2), **stats,
        "compute_edges_per_s": round(stats["edges"] / stats["compute_s"]) if stats["compute_s"] else None,
        "wall_edges_per_s": round(stats["edges"] / wall),
        "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if on_gpu else None,
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2) if on_gpu else None,
        "peak_host_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
    }
    line = json.dumps(result)
    print(line, flush=True)
    if args.json:
        with open(args.json, "a") as handle:
            handle.write(line + "\n")


def _counts(config: Any) -> dict[str, list[int]]:
    from job.train.inputs import read_entity_counts

    return read_entity_counts(config)


if __name__ == "__main__":
    main()
