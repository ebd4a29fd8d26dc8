"""Measured scaling of a group (issue 45): epoch time and what each pod waits on, for 1 to 16 pods, with the
batch arithmetic SIMULATED.

    flock /work/bench.lock .venv/bin/python bench/scale_bench.py --rates 200000,1800000 --rows 1:16,2:16,4:16,8:16,1:32,16:32
    # partitions written behind (write_behind_buckets, with hand-off): today's write groups, a cut every 8, at the commit
    flock /work/bench.lock .venv/bin/python bench/scale_bench.py --rates 1800000 --rows 1:16,8:16 --handoff on --behind 0,8,-1
    # shared relation rows served by every pod (shared_shards) against rank 0 serving them all: Freebase86m's relation
    # count, dynamic relations, written behind; what rank 0's link carries for the shared vector
    flock /work/bench.lock .venv/bin/python bench/scale_bench.py --rates 1800000 --rows 4:16,8:16 --handoff on \
        --behind -1 --shards off,on --dynamic-relations --relations 14824 --dimension 32 --edges 2000000

Each row is a real group: ``torchrun --standalone --nproc-per-node=M -m job train`` (M trainers = M pods, workers=1
each), the real lock server and its committer, the real transports (store queues, gloo for the shared vector, TCP
for partitions pod to pod with ``partition_handoff``), partitions and edges on local disk. Only the batch arithmetic
is replaced: with ``BIGGRAPH_BENCH_SIMULATED_EDGES_PER_S`` (job/train/bucket_run.py, benchmark only) a bucket waits
its edges / ``--edges-per-s`` instead of training, so one 2-vCPU machine carries the coordination of 16 pods at the
speed of a 2-vCPU pod (200k edges/s) or an H100 (1.8M). What the machine still adds by hosting every pod is the
coordination's CPU, which is reported per bucket so that it stays visible.

Per row (one epoch; M pods, P partitions, hand-off on or off, a rate):
- ``epoch_s``: the pass's wall time on rank 0 (start to committed version), start-up excluded;
- ``efficiency``: T(1) / (M T(M)), T(1) the one-pod row with the same P, rate and hand-off;
- per pod (min / max over pods): seconds waiting on the scheduler (the lock server's reply to ``next`` and the
  shared-parameter sync, net of partition I/O inside those calls) and blocked on partitions (reads, hand-offs,
  the writes a switch waits for before its release);
- bytes pod to pod (partition hand-offs) and bytes through storage (partition reads + writes, the commit included),
  also as multiples of one checkpoint's partitions (``storage_checkpoints``: the committed version's partition files);
  with ``--behind`` (``write_behind_buckets`` of the hand-off rows) the cuts each rank took part in;
- the lock server's serving thread busy fraction (its wall time over the epoch) and its CPU;
- CPU seconds of coordination per bucket: ``server`` (serving thread + committer), ``transfers`` (partition
  hand-offs on both ends, digests included), ``client`` (the rest of every trainer process: scheduler calls,
  partition and edge reads, writes, the commit); and ``cpu_load``: all of it over (epoch x the machine's CPUs);
- ``shared_link_mib``: the shared vector's payload bytes through rank 0's link (its lock server's transfers with the
  other pods, and with ``--shards on`` its own shard traffic and its committer's saves), and the most through any
  other pod's (``pod_shared_link_mib_max``: its transfers with rank 0 and its shard's traffic, both ways).

``--model`` prints the paper model of a Freebase86m epoch instead (bench/scale_model.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import matmul_rate  # noqa: E402
from train_bench import generated_config, run_measured, write_py_config  # noqa: E402

from job.train.bucket_run import SIMULATED_COMPUTE_ENV  # noqa: E402

POD_LINE = re.compile(r"this trainer did (\d+) buckets, \d+ edges, [0-9.]+ edges/s, loss [0-9.naif]+; waited "
                      r"([0-9.]+) s on the scheduler, ([0-9.]+) s on partitions; ([0-9.]+) s of CPU in ([0-9.]+) s")
SERVER_LINE = re.compile(r"lock server: (\d+) requests served in ([0-9.]+) s of its thread \(([0-9.]+) s of CPU\); "
                         r"its committer ([0-9.]+) s \(([0-9.]+) s of CPU")
HANDOFF_LINE = re.compile(r"rank (\d+): partition hand-off this pass: (\{.*\})")


def write_graph(root: Path, entities: int, edges: int, partitions: int, relations: int, seed: int = 0) -> None:
    """Uniformly random edges over one entity type, written straight to input format v1 (grouped by bucket with
    one sort per block, so that P=32's 1,024 files cost no more than P=1's)."""
    from job.formats.edges import edges_file, write_edges
    from job.formats.entities import write_dynamic_rel_count, write_entity_count

    rng = np.random.default_rng(seed)
    counts = np.array([entities // partitions + (1 if p < entities % partitions else 0) for p in range(partitions)])
    for p, count in enumerate(counts):
        write_entity_count(str(root / "data"), "node", p, int(count))
    write_dynamic_rel_count(str(root / "data"), relations)  # (read with --dynamic-relations only)
    parts: dict[int, list[tuple[np.ndarray, ...]]] = {}
    block = 5_000_000
    for start in range(0, edges, block):
        n = min(block, edges - start)
        lhs_part, rhs_part = rng.integers(0, partitions, n), rng.integers(0, partitions, n)
        lhs = (rng.random(n) * counts[lhs_part]).astype(np.int64)
        rhs = (rng.random(n) * counts[rhs_part]).astype(np.int64)
        rel = rng.integers(0, relations, n)
        bucket = lhs_part * partitions + rhs_part
        order = np.argsort(bucket, kind="stable")
        bounds = np.searchsorted(bucket[order], np.arange(partitions * partitions + 1))
        for b in range(partitions * partitions):
            sel = order[bounds[b]:bounds[b + 1]]
            parts.setdefault(b, []).append((rel[sel], lhs[sel], rhs[sel]))
    for b, chunks in parts.items():
        columns = [np.concatenate(c) for c in zip(*chunks)]
        write_edges(edges_file(str(root / "data" / "edges"), b // partitions, b % partitions), *columns)


def parse_run(output: str, checkpoint_path: Path) -> dict[str, Any]:
    """The figures of one run from its pass summary, bucket records and trainers' log lines."""
    records = [json.loads(line) for line in (checkpoint_path / "training_stats.json").read_text().splitlines()]
    (summary,) = [r for r in records if r.get("pass_summary")]
    buckets = [r for r in records if "lhs_partition" in r]
    pods = [tuple(float(x) for x in m.groups()) for m in POD_LINE.finditer(output)]
    server = SERVER_LINE.search(output)
    handoffs = [json.loads(m.group(2)) for m in HANDOFF_LINE.finditer(output)]
    link = {int(m.group(1)): int(json.loads(m.group(2)).get("shared_link_bytes", 0)) for m in HANDOFF_LINE.finditer(output)}
    checkpoint_bytes = sum(f.stat().st_size for f in checkpoint_path.glob("embeddings_*.v1.h5"))
    if not pods or server is None:
        raise SystemExit(f"{checkpoint_path}: the trainers' figures are missing from the log")
    epoch = float(summary["time"])
    n = len(buckets)
    server_cpu = float(server.group(3)) + float(server.group(5))
    transfers_cpu = sum(float(h.get("handoff_cpu_s", 0.0)) for h in handoffs)
    all_cpu = sum(p[3] for p in pods)
    return {
        "epoch_s": round(epoch, 2), "buckets": n, "buckets_per_pod": sorted(int(p[0]) for p in pods),
        "simulated_compute_s_per_pod_max": round(max(sum(r["time"] for r in buckets if r.get("rank") == k)
                                                     for k in {r.get("rank") for r in buckets}), 2),
        "wait_scheduler_s": [round(min(p[1] for p in pods), 2), round(max(p[1] for p in pods), 2)],
        "blocked_partitions_s": [round(min(p[2] for p in pods), 2), round(max(p[2] for p in pods), 2)],
        "bytes_pod_to_pod": int(summary.get("bytes_handed_over", 0)),
        "bytes_storage": int(summary["bytes_read"]) + int(summary["bytes_written"]),
        "bytes_storage_read": int(summary["bytes_read"]), "bytes_storage_written": int(summary["bytes_written"]),
        "checkpoint_bytes": checkpoint_bytes,
        "storage_checkpoints": round((int(summary["bytes_read"]) + int(summary["bytes_written"])) / checkpoint_bytes, 2),
        "written_checkpoints": round(int(summary["bytes_written"]) / checkpoint_bytes, 2),
        "cuts": max((int(h.get("cuts", 0)) for h in handoffs), default=0),
        "pinned_peak_mib": [round(min((int(h.get("pinned_peak_bytes", 0)) for h in handoffs), default=0) / 2**20),
                            round(max((int(h.get("pinned_peak_bytes", 0)) for h in handoffs), default=0) / 2**20)],
        "partition_handoffs": int(summary.get("partition_handoffs", 0)),
        "partition_reads": int(summary["partition_reads"]), "partition_writes": int(summary["partition_writes"]),
        "server_busy": round(float(server.group(2)) / epoch, 3), "server_cpu_busy": round(float(server.group(3)) / epoch, 3),
        "cpu_ms_per_bucket": {"server": round(1e3 * server_cpu / n, 1), "transfers": round(1e3 * transfers_cpu / n, 1),
                              "client": round(1e3 * (all_cpu - server_cpu - transfers_cpu) / n, 1)},
        "cpu_load": round(all_cpu / (epoch * (os.cpu_count() or 1)), 2),
        "shared_link_mib": round(link.get(0, 0) / 2**20, 1),
        "pod_shared_link_mib_max": round(max((b for r, b in link.items() if r != 0), default=0) / 2**20, 1),
    }


def run_row(root: Path, work: Path, *, pods: int, partitions: int, handoff: bool, rate: float,
            dimension: int, behind: int = 0, memory_budget: str | None = None, dynamic: bool = False,
            shards: bool = False) -> dict[str, Any]:
    label = f"m{pods}-p{partitions}-{'on' if handoff else 'off'}-{int(rate)}" + (f"-behind{behind}" if behind else "")
    label += (f"-budget{memory_budget}" if memory_budget else "") + ("-shards" if shards else "")
    config = generated_config(root, partitions, 1, dimension, label)
    config.update(num_epochs=1, seed=0, partition_handoff=handoff, checkpoint_path=str(work / f"ckpt_{label}"))
    if dynamic:  # one operator row per relation type (dynamic_rel_count.txt: write_graph's)
        config.update(dynamic_relations=True, global_emb=False,
                      relations=[{"name": "rel", "lhs": "node", "rhs": "node", "operator": "complex_diagonal"}])
    if shards:
        config["shared_shards"] = True
    if behind:
        config["write_behind_buckets"] = behind
    if memory_budget:
        config["memory_budget"] = memory_budget
    shutil.rmtree(config["checkpoint_path"], ignore_errors=True)
    path = work / f"config_{label}.py"
    write_py_config(path, config)
    # a 60 s peer timeout (default 6 s): 16 pods on 2 shared vCPUs can leave a heartbeat thread unscheduled that long,
    # which would end the round (a real pod has its own CPUs); nothing else of the group's behaviour changes
    # every push and pull sparse, with shards or without (a generated bucket's uniform relations touch many rows:
    # the comparison is of where the same sparse bytes go)
    env = {"OMP_NUM_THREADS": "1", SIMULATED_COMPUTE_ENV: str(rate), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "BIGGRAPH_PEER_TIMEOUT": "60", "BIGGRAPH_SHARED_SPARSE_AT_MOST": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={pods}",
               "-m", "job", "train", str(path)]
    measured = run_measured(command, env=env, log=work / f"{label}.log")
    result = {"pods": pods, "partitions": partitions, "handoff": handoff, "write_behind": behind, "edges_per_s": rate,
              "memory_budget": memory_budget, "dynamic_relations": dynamic, "shared_shards": shards,
              "wall_with_startup_s": round(measured["wall"], 1), "peak_pss_mib": round(measured["peak_rss_mib"]),
              **parse_run(measured["output"], Path(config["checkpoint_path"]))}
    shutil.rmtree(config["checkpoint_path"], ignore_errors=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entities", type=int, default=2_000_000)
    parser.add_argument("--edges", type=int, default=20_000_000)
    parser.add_argument("--relations", type=int, default=10)
    parser.add_argument("--dimension", type=int, default=100)
    parser.add_argument("--rates", default="200000,1800000", help="simulated edges/s per pod, comma-separated")
    parser.add_argument("--rows", default="1:16,2:16,4:16,8:16,1:32,16:32", help="pods:P, comma-separated")
    parser.add_argument("--handoff", default="off,on", help="partition_handoff values to run")
    parser.add_argument("--behind", default="0", help="write_behind_buckets values for the hand-off rows "
                        "(0: write groups at every switch; N: a cut every N buckets; -1: only at the commit)")
    parser.add_argument("--memory-budget", default="", help="memory_budget of every trainer, comma-separated values "
                        "to run each row under ('' none; e.g. ',1GiB': without and with)")
    parser.add_argument("--shards", default="off", help="shared_shards values for the rows written behind "
                        "(needs --dynamic-relations)")
    parser.add_argument("--dynamic-relations", action="store_true", help="one operator row per relation type "
                        "(--relations of them), as Freebase86m's model")
    parser.add_argument("--work", default=None)
    parser.add_argument("--model", action="store_true", help="print the paper model (bench/scale_model.py) and exit")
    args = parser.parse_args()
    if args.model:
        from scale_model import main as model_main

        model_main([])
        return
    print(json.dumps({"matmul_gflops": round(matmul_rate(), 1), "cpus": os.cpu_count(), "load": os.getloadavg()[0],
                      "note": "COMPUTE SIMULATED: each bucket waits edges / edges_per_s instead of training"}), flush=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="biggraph-scale-bench-"))
    rows = [tuple(int(x) for x in row.split(":")) for row in args.rows.split(",")]
    results = []
    for p in sorted({p for _, p in rows}):
        root = work / f"graph_p{p}"
        if not (root / "data" / "edges").exists():
            started = time.perf_counter()
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir(parents=True)
            write_graph(root, args.entities, args.edges, p, args.relations)
            print(json.dumps({"graph": str(root), "partitions": p, "seconds": round(time.perf_counter() - started, 1)}),
                  flush=True)
    for rate in [float(r) for r in args.rates.split(",")]:
        modes = [(h == "on", int(b), s == "on") for h in args.handoff.split(",")
                 for b in (args.behind.split(",") if h == "on" else ["0"])
                 for s in (args.shards.split(",") if h == "on" and b != "0" else ["off"])]
        budgets = [b or None for b in args.memory_budget.split(",")]
        for (handoff, behind, shards), budget in [(mode, b) for mode in modes for b in budgets]:
            ones: dict[int, float] = {}
            for pods, p in rows:
                result = run_row(work / f"graph_p{p}", work, pods=pods, partitions=p, handoff=handoff, rate=rate,
                                 dimension=args.dimension, behind=behind, memory_budget=budget,
                                 dynamic=args.dynamic_relations, shards=shards)
                if pods == 1:
                    ones[p] = result["epoch_s"]
                if p in ones:
                    result["efficiency"] = round(ones[p] / (pods * result["epoch_s"]), 3)
                print(json.dumps(result), flush=True)
                results.append(result)
    out = Path(__file__).resolve().parent / "out"
    out.mkdir(exist_ok=True)
    (out / f"scale_bench_{int(time.time())}.json").write_text(json.dumps(
        {"command": " ".join(sys.argv), "simulated_compute": True, "runs": results}, indent=2))


if __name__ == "__main__":
    main()
