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
  sends out as many, overlapped with the compute (prefetch), and writes ``w`` partitions to storage, each of C/P
  bytes (C: every entity's row and Adagrad sum), on the pod's own link of ``bandwidth``; today a switch stores its
  write group before its release, so that write is on the critical path: a bucket costs
  max(compute + overheads, reads' link time) + write time ("behind": the writes join the overlapped reads).
Not modelled: pods queueing for free partitions at P = 2M and the epoch's tail (the bench measures both, on one
shared disk that inflates them).
One rank serves the schedule and, in this design, the shared vector:
- its serving thread spends ``server_s`` of CPU per bucket, its committer ``committer_s``, and all its threads
  together ``server_threads_s``, under one GIL: the epoch is at least P^2 times each (``server_gil`` the largest);
- its link carries each bucket's change in and the sum out: the dense vector (V = 11.86 MB for Freebase86m's
  14,824 relations x 200 floats) or, with a sparse exchange, only the rows a bucket touches (values and Adagrad
  sums, 1.6 KB a row; rows = min(R, ``rows_per_5k`` x e / 5,200) for a bucket of e edges: linear in e, which
  overstates large buckets, whose distinct relations grow slower than e).
Epoch = max(P^2/M x bucket, P^2 x server_s, P^2 x committer_s, P^2 x server_threads_s, P^2 x 2 x V / bandwidth)
+ the commit.
With the shared vector sharded (``shared_shards``: relation row r served by pod r mod M), rank 0's link carries its
slice of every bucket's exchange both ways (1/M of it) and the shards' saved rows (at most the vector once per cut;
at -1 once an epoch); every pod's own link carries, per bucket it trains, its rows of the other M-1 shards both
ways and its shard's share of serving the others': 4 x exchange x (M-1)/M, added to the bucket's link time.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from typing import Any

GB = 1e9


@dataclass(frozen=True, kw_only=True)
class Costs:
    """What each bucket costs besides its compute; defaults: this session's measurements (bench/RESULTS.md)."""

    round_trip_s: float = 0.018  # a pod's wait on the scheduler per bucket, one pod (its `next` waits for the
    #                              progress record's fsync in the group commit): 18.8-19.8 s / 1,024 buckets
    client_cpu_s: float = 0.005  # trainer-side coordination CPU per bucket besides partition bytes (the fit of
    #                              the client's CPU against storage bytes per bucket, P=16 and 32, leaves ~0)
    handoff_s_per_gb: float = 0.85  # CPU per GB handed over, at each end (socket copies, the receiver's digest)
    digest_s_per_gb: float = 0.26  # CPU per GB of partition kept for a hand-off (its digest)
    write_s_per_gb: float = 1.8  # CPU per GB of partition read or written on storage (serialising, CRC-32, I/O):
    #                              1.7-1.9 measured, on a machine loaded 13-24 (so an upper bound)
    server_s: float = 0.0006  # serving thread CPU per bucket (lock_server_bench, 128 pods, P=256, sparse, batched
    #                           serving: 0.49-0.71 ms; 4.0 ms before the batching and the O(P) index)
    committer_s: float = 0.0009  # committer thread CPU per bucket (same runs: 0.65-1.12 ms)
    server_threads_s: float = 0.0022  # every lock-server thread's CPU per bucket (reader, serving, replier, gatherer,
    #                                   committer: 1.93-2.76 ms); they share one GIL, so the process serves at most
    #                                   one bucket per this much CPU (an upper bound: fsyncs and copies release it)
    alpha: float = 0.5  # partitions a pod takes in per bucket (hand-offs + storage reads): 0.43-0.56 measured
    writes: float = 1.0  # partitions a pod writes to storage per bucket (write groups at every switch): 1.0-1.01
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
          sparse: bool, behind: bool = False, shards: bool = False) -> dict[str, Any]:
    """Seconds of one epoch and of each bound (``bandwidth`` in bytes/s per pod, ``rate`` edges/s per pod).
    ``behind``: storage written behind the training at the issue's target, 1.5 checkpoints an epoch, instead of
    ``costs.writes`` partitions at every bucket. ``shards``: the sparse exchange sharded over the pods (see the
    module docstring)."""
    buckets = partitions**2
    if behind:
        costs = replace(costs, writes=1.5 / partitions)  # 1.5 C over the P^2 buckets: 1.5/P partitions each
    edges = graph.edges / buckets
    partition = graph.checkpoint_bytes / partitions
    compute = edges / rate
    moved = costs.alpha * partition  # in from a peer or storage; as much out to a peer, on average
    if sparse:
        rows = min(graph.relations, costs.rows_per_5k * edges / 5_200)
        exchange = min(graph.vector_bytes, rows * 2 * graph.shared_floats_per_relation * 4)  # never above dense
    else:
        exchange = graph.vector_bytes
    shard_traffic = 4 * exchange * (pods - 1) / pods if shards else 0.0  # a pod's link per bucket it trains
    moved += shard_traffic  # (on the pod's link, overlapped with the compute as the partitions' are)
    overhead = costs.round_trip_s
    if cpu_pod:  # the coordination's CPU is taken from the pod's 2 vCPUs that train: X s of it costs X/2 of wall
        written = costs.writes * partition
        overhead += 0.5 * (costs.client_cpu_s + (2 * costs.handoff_s_per_gb * moved + costs.digest_s_per_gb * written
                                                 + costs.write_s_per_gb * written) / GB)
    if behind:  # writes leave with the prefetched reads, off the critical path
        link = (moved + costs.writes * partition) / bandwidth
        bucket = max(compute + overhead, link)
    else:  # reads and hand-offs are prefetched; the switch's write group is stored before the release (measured:
        link = (moved + costs.writes * partition) / bandwidth  # a pod blocked on partitions for the bytes it wrote)
        bucket = max(compute + overhead, moved / bandwidth) + costs.writes * partition / bandwidth
    bounds = {
        "pods": buckets / pods * bucket,  # P^2/M buckets per pod
        "server": buckets * costs.server_s,
        "committer": buckets * costs.committer_s,
        "server_gil": buckets * costs.server_threads_s,
        "rank0_link": (buckets * 2 * exchange / pods + graph.vector_bytes) / bandwidth if shards
        else buckets * 2 * exchange / bandwidth,
    }
    commit = graph.checkpoint_bytes / pods / bandwidth  # every pod writes what it holds at the pass's end
    total = max(bounds.values()) + commit
    return {"epoch_s": total, "compute_s": graph.edges / rate / pods, "bucket_s": bucket, "compute_per_bucket_s": compute,
            "overhead_s": overhead,
            "link_per_bucket_s": link, **{f"{k}_s": v for k, v in bounds.items()}, "commit_s": commit,
            "bound": max(bounds, key=lambda k: bounds[k]), "exchange_mb": exchange / 1e6,
            "pod_shard_gb": buckets / pods * shard_traffic / GB}


def table(graph: Graph, costs: Costs, rows: list[tuple[int, int]], behind: bool = False) -> list[str]:
    lines = ["| pods | P | pod | network | compute alone | per bucket: compute + overheads / link | epoch, dense vector "
             "(bound) | epoch, sparse rows (exchange; bound) |", "|---|---|---|---|---|---|---|---|"]
    for pods, partitions in rows:
        for kind, rate, cpu in (("CPU 2 vCPU", 200e3, True), ("H100", 1.8e6, False)):
            for gbps in (10, 100):
                dense, sparse = (epoch(graph, costs, pods=pods, partitions=partitions, rate=rate,
                                       bandwidth=gbps * GB / 8, cpu_pod=cpu, sparse=s, behind=behind)
                                 for s in (False, True))
                lines.append(
                    f"| {pods} | {partitions} | {kind} | {gbps} Gb/s | {_t(dense['compute_s'])} | "
                    f"{dense['overhead_s'] * 1e3 + dense['compute_per_bucket_s'] * 1e3:.0f} / "
                    f"{dense['link_per_bucket_s'] * 1e3:.0f} ms | **{_t(dense['epoch_s'])}** ({dense['bound']}) | "
                    f"**{_t(sparse['epoch_s'])}** ({sparse['exchange_mb']:.2f} MB; {sparse['bound']}) |")
    return lines


def shard_lines(graph: Graph, costs: Costs, rows: list[tuple[int, int]]) -> list[str]:
    """Written behind, sparse rows: rank 0 serving every row against the rows sharded over the pods."""
    lines = ["| pods | P | pod | network | epoch, rank 0 serves every row (bound) | epoch, rows sharded (bound) | "
             "rank 0's link for the vector, per epoch | each pod's shard traffic per epoch |",
             "|---|---|---|---|---|---|---|---|"]
    for pods, partitions in rows:
        for kind, rate, cpu in (("CPU 2 vCPU", 200e3, True), ("H100", 1.8e6, False)):
            for gbps in (10, 100):
                one, sharded = (epoch(graph, costs, pods=pods, partitions=partitions, rate=rate,
                                      bandwidth=gbps * GB / 8, cpu_pod=cpu, sparse=True, behind=True, shards=s)
                                for s in (False, True))
                lines.append(
                    f"| {pods} | {partitions} | {kind} | {gbps} Gb/s | **{_t(one['epoch_s'])}** ({one['bound']}) | "
                    f"**{_t(sharded['epoch_s'])}** ({sharded['bound']}) | {_t(one['rank0_link_s'])} -> "
                    f"{_t(sharded['rank0_link_s'])} | {sharded['pod_shard_gb']:.1f} GB |")
    return lines


def bench_graph_lines(costs: Costs) -> list[str]:
    """The scale bench's graph (2M entities, 20M edges, 10 relations, d=100) on pods that each have their own link
    and CPUs: the efficiency the bench would show without one machine's disk and CPUs under every pod."""
    graph = Graph(entities=2e6, edges=20e6, relations=10)
    lines = ["| rate | P | pods | link per pod | epoch, 1 pod | epoch, M pods | efficiency | bound by |",
             "|---|---|---|---|---|---|---|---|"]
    for rate, partitions, pods in ((200e3, 32, 16), (1.8e6, 16, 8), (1.8e6, 32, 16)):
        for name, bandwidth in (("200 MB/s", 0.2 * GB), ("10 Gb/s", 1.25 * GB), ("100 Gb/s", 12.5 * GB)):
            one, many = (epoch(graph, costs, pods=m, partitions=partitions, rate=rate, bandwidth=bandwidth,
                               cpu_pod=rate < 1e6, sparse=False) for m in (1, pods))
            lines.append(f"| {rate / 1e3:.0f}k | {partitions} | {pods} | {name} | {_t(one['epoch_s'])} | "
                         f"{_t(many['epoch_s'])} | {one['epoch_s'] / pods / many['epoch_s']:.2f} | {many['bound']} |")
    return lines


def round_trip_lines(graph: Graph, costs: Costs, rows: list[tuple[int, int]]) -> list[str]:
    """The lock server as a closed queue (bench/RESULTS.md, "The `next` round trip under load"): M pods, each a
    bucket's requests then its compute Z (think time); the server serves at most 1 / D buckets a second, D every
    lock-server thread's CPU per bucket (one GIL). Offered M / Z against that: past it, Little's law puts a bucket's
    requests at R = M x D - Z whatever one request costs, and R <= 50 ms needs D <= (50 ms + Z) / M."""
    d = costs.server_threads_s
    lines = ["| pods, P | pod | compute Z per bucket | offered buckets/s | server's 1/D | utilisation | R per bucket "
             "(M D - Z) | D for R <= 50 ms |", "|---|---|---|---|---|---|---|---|"]
    for pods, parts in rows:
        for name, rate in (("CPU 200k e/s", 2e5), ("H100 1.8M e/s", 1.8e6)):
            z = graph.edges / parts**2 / rate
            offered = pods / z
            lines.append(f"| {pods}, {parts} | {name} | {1e3 * z:.1f} ms | {offered:.0f} | {1 / d:.0f} | "
                         f"{offered * d:.2f} | {1e3 * max(d, pods * d - z):.0f} ms | {1e3 * (0.05 + z) / pods:.2f} ms |")
    return lines


def _t(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, value in Costs().__dict__.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=float, default=value)
    parser.add_argument("--rows", default="8:16,16:32,32:64,128:256", help="pods:P, comma-separated")
    args = parser.parse_args(argv)
    costs = Costs(**{name: getattr(args, name) for name in Costs().__dict__})
    graph = Graph()
    rows = [(int(m), int(p)) for m, p in (row.split(":") for row in args.rows.split(","))]
    print(f"Freebase86m: checkpoint {graph.checkpoint_bytes / GB:.1f} GB, shared vector "
          f"{graph.vector_bytes / 1e6:.2f} MB; costs {costs}")
    print("\n".join(table(graph, costs, rows)))
    print("\nWith storage written behind the training (write_behind_buckets; -1 measured 1.0 checkpoint an epoch, "
          "modelled at 1.5):")
    print("\n".join(table(graph, costs, rows, behind=True)))
    print("\nWritten behind, sparse rows: the shared vector served by rank 0 against sharded over the pods "
          "(shared_shards):")
    print("\n".join(shard_lines(graph, costs, rows)))
    print("\nThe scale bench's graph on pods with their own links and CPUs (today's writes at every switch; queueing "
          "for partitions is not modelled, so the efficiency is an upper bound):")
    print("\n".join(bench_graph_lines(costs)))
    print("\nThe lock server's queue: a bucket's requests (R) when every pod asks as soon as its bucket is computed:")
    print("\n".join(round_trip_lines(graph, costs, rows)))


if __name__ == "__main__":
    main()
