"""The paper model of a Freebase86m epoch on M pods (issue 45), from the costs bench/scale_bench.py and
bench/lock_server_bench.py measured (bench/RESULTS.md, "Measured scaling").

    .venv/bin/python bench/scale_model.py            # or: bench/scale_bench.py --model

A pod trains its buckets one after another; with P = 2M (the fewest partitions that let M pods train at once)
an epoch is P^2 buckets of E/P^2 edges. Per bucket a pod
- computes for T_b = E / (P^2 r);
- waits for the lock server's reply (``round_trip_s``, measured with the server idle) and, on a CPU pod, gives the
  coordination its CPU (``client_cpu_s`` per bucket, ``digest_s_per_gb`` for every byte of partition it hands
  over, takes or keeps: HMAC digests and copies, ``write_s_per_gb`` for every byte it writes), taken from the two
  vCPUs that train, so X s of it costs X/2 s of the bucket's wall (a GPU pod's host cores do it beside the card);
- takes in ``alpha`` partitions (from another pod's memory with ``partition_handoff``, else from storage) and
  sends out as many, and writes ``w`` partitions to storage (every switch writes its group before a release),
  each of C/P bytes (C: every entity's row and Adagrad sum), on the pod's own link of ``bandwidth``: overlapped
  with the compute (prefetch, write-behind), so a bucket costs max(compute + overheads, link time).
One rank serves the schedule and, in this design, the shared vector:
- its serving thread spends ``server_s`` of CPU per bucket, its committer ``committer_s``: the epoch is at least
  P^2 times either;
- its link carries each bucket's change in and the sum out: the dense vector (V = 11.86 MB for Freebase86m's
  14,824 relations x 200 floats) or, with a sparse exchange, only the rows a bucket touches (values and Adagrad
  sums, 1.6 KB a row; rows = min(R, ``rows_per_5k`` x e / 5,200) for a bucket of e edges: linear in e, which
  overstates large buckets, whose distinct relations grow slower than e).
Epoch = max(P^2/M x bucket, P^2 x server_s, P^2 x committer_s, P^2 x 2 x V / bandwidth) + the commit.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from typing import Any

GB = 1e9


@dataclass(frozen=True, kw_only=True)
class Costs:
    """What each bucket costs besides its compute; defaults: this session's measurements (bench/RESULTS.md)."""

    round_trip_s: float = 0.005  # the lock server's `next` + sync round trip, idle server (scale bench, 1-2 pods)
    client_cpu_s: float = 0.020  # trainer-side coordination CPU per bucket, partition bytes excluded
    digest_s_per_gb: float = 0.65  # CPU per GB of partition handed over (each end) or kept (its digest)
    write_s_per_gb: float = 1.0  # CPU per GB of partition written to storage (serialising, CRC-32, the write)
    server_s: float = 0.004  # serving thread CPU per bucket (lock_server_bench, 128 pods, Freebase's vector)
    committer_s: float = 0.0017  # committer thread CPU per bucket (same run)
    alpha: float = 0.6  # partitions a pod takes in per bucket (hand-offs + storage reads)
    writes: float = 1.0  # partitions a pod writes to storage per bucket (write groups at every switch)
    rows_per_5k: float = 300.0  # relation rows a 5.2k-edge Freebase86m bucket touches (issue 45)


@dataclass(frozen=True, kw_only=True)
class Graph:
    entities: float = 86e6
    edges: float = 338e6
    dimension: int = 100
    relations: int = 14_824
    shared_floats_per_relation: int = 200  # ComplEx d=100: real and imaginary diagonals

    @property
    def checkpoint_bytes(self) -> float:
        return self.entities * (self.dimension + 1) * 4  # rows + row-wise Adagrad sums

    @property
    def vector_bytes(self) -> float:
        return self.relations * self.shared_floats_per_relation * 4


def epoch(graph: Graph, costs: Costs, *, pods: int, partitions: int, rate: float, bandwidth: float, cpu_pod: bool,
          sparse: bool, behind: bool = False) -> dict[str, Any]:
    """Seconds of one epoch and of each bound (``bandwidth`` in bytes/s per pod, ``rate`` edges/s per pod).
    ``behind``: storage written behind the training at the issue's target, 1.5 checkpoints an epoch, instead of
    ``costs.writes`` partitions at every bucket."""
    buckets = partitions**2
    if behind:
        costs = replace(costs, writes=1.5 / partitions)  # 1.5 C over the P^2 buckets: 1.5/P partitions each
    edges = graph.edges / buckets
    partition = graph.checkpoint_bytes / partitions
    compute = edges / rate
    moved = costs.alpha * partition  # in from a peer or storage; as much out to a peer, on average
    overhead = costs.round_trip_s
    if cpu_pod:  # the coordination's CPU is taken from the pod's 2 vCPUs that train: X s of it costs X/2 of wall
        overhead += 0.5 * (costs.client_cpu_s + costs.digest_s_per_gb * (2 * moved + costs.writes * partition) / GB
                     + costs.write_s_per_gb * costs.writes * partition / GB)
    link = max(moved, moved + costs.writes * partition) / bandwidth
    bucket = max(compute + overhead, link)
    if sparse:
        rows = min(graph.relations, costs.rows_per_5k * edges / 5_200)
        exchange = min(graph.vector_bytes, rows * 2 * graph.shared_floats_per_relation * 4)  # never above dense
    else:
        exchange = graph.vector_bytes
    bounds = {
        "pods": buckets / pods * bucket,  # P^2/M buckets per pod
        "server": buckets * costs.server_s,
        "committer": buckets * costs.committer_s,
        "rank0_link": buckets * 2 * exchange / bandwidth,
    }
    commit = graph.checkpoint_bytes / pods / bandwidth  # every pod writes what it holds at the pass's end
    total = max(bounds.values()) + commit
    return {"epoch_s": total, "compute_s": graph.edges / rate / pods, "bucket_s": bucket, "compute_per_bucket_s": compute,
            "link_per_bucket_s": link, **{f"{k}_s": v for k, v in bounds.items()}, "commit_s": commit,
            "bound": max(bounds, key=lambda k: bounds[k]), "exchange_mb": exchange / 1e6}


def table(graph: Graph, costs: Costs, rows: list[tuple[int, int]], behind: bool = False) -> list[str]:
    lines = ["| pods | P | pod | network | shared exchange | compute alone | per bucket: compute + overheads / "
             "link | bound by | epoch |", "|---|---|---|---|---|---|---|---|---|"]
    for pods, partitions in rows:
        for kind, rate, cpu in (("CPU 2 vCPU", 200e3, True), ("H100", 1.8e6, False)):
            for gbps in (10, 100):
                for sparse in (False, True):
                    r = epoch(graph, costs, pods=pods, partitions=partitions, rate=rate, bandwidth=gbps * GB / 8,
                              cpu_pod=cpu, sparse=sparse, behind=behind)
                    over = r["bucket_s"] if r["bucket_s"] > r["link_per_bucket_s"] else r["compute_per_bucket_s"]
                    lines.append(
                        f"| {pods} | {partitions} | {kind} | {gbps} Gb/s | "
                        f"{'sparse' if sparse else 'dense'} {r['exchange_mb']:.2f} MB | {_t(r['compute_s'])} | "
                        f"{over * 1e3:.0f} / {r['link_per_bucket_s'] * 1e3:.0f} ms | {r['bound']} | "
                        f"**{_t(r['epoch_s'])}** |")
    return lines


def _t(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, value in Costs().__dict__.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=float, default=value)
    parser.add_argument("--rows", default="8:16,16:32,32:64,128:256", help="pods:P, comma-separated")
    args = parser.parse_args()
    costs = Costs(**{name: getattr(args, name) for name in Costs().__dict__})
    graph = Graph()
    rows = [(int(m), int(p)) for m, p in (row.split(":") for row in args.rows.split(","))]
    print(f"Freebase86m: checkpoint {graph.checkpoint_bytes / GB:.1f} GB, shared vector "
          f"{graph.vector_bytes / 1e6:.2f} MB; costs {costs}")
    print("\n".join(table(graph, costs, rows)))
    print("\nWith storage written behind the training at the issue's target (1.5 checkpoints an epoch):")
    print("\n".join(table(graph, costs, rows, behind=True)))


if __name__ == "__main__":
    main()
