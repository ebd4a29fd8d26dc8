"""One training batch in float32 against the same batch with ``compute_dtype: bfloat16``, alternated.

The WordNet-KG shape of issue #16: ComplEx d=200, softmax, 1000 uniform + 50 batch negatives per
chunk of 50, batch 1000, one 112k-row table (uniform draws seldom repeat: the unweighted path). Both
dtypes run the same batches from the same state, one after the other, round after round, so a loaded
machine slows both alike: the figure to read is the ratio of the medians, not the times. Also prints
the ``torch.bmm`` rate of one batch's chunk-by-negatives product in each dtype (issue #16's
"limit on the machine"). Run it niced and alone: ``nice -n 19 python bench/precision_bench.py``.

``--adjoint`` compares instead, in each dtype, the relation operator applied to every rhs row (the
path before ``job.model.fused_pair.fused_pair_adjoint``) against its adjoint applied to the anchors,
alternated the same way: the figures to read are the ratios old / new.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Optional

import torch

from job.config import ConfigSchema, parse_config
from job.model.kernel_options import KernelOptions
from job.model.scoring import Model, Table
from job.train.batch.step import BatchContext, run_batch


def make_config(args: argparse.Namespace) -> ConfigSchema:
    return parse_config({
        "entities": {"all": {"num_partitions": 1}},
        "relations": [{"name": "r", "lhs": "all", "rhs": "all", "operator": "complex_diagonal"}],
        "dimension": args.dim, "comparator": "dot", "loss_fn": "softmax", "lr": 0.1, "batch_size": args.batch,
        "num_batch_negs": args.chunk, "num_uniform_negs": args.uniform, "entity_path": "x", "edge_paths": ["x"],
        "checkpoint_path": "x",
    })


def batch_seconds(ctx: BatchContext, dtype: Optional[torch.dtype], seed: int, entities: int, batch: int,
                  adjoint: bool = True) -> float:
    """The wall time of one trained batch with products in ``dtype`` (None: float32), the operator on the
    anchors (``adjoint``) or on every rhs row."""
    ctx.model.compute_dtype = dtype
    ctx = dataclasses.replace(ctx, options=KernelOptions(operator_adjoint=adjoint))
    generator = torch.Generator().manual_seed(seed)
    lhs = torch.randint(0, entities, (batch,), generator=generator)
    rhs = torch.randint(0, entities, (batch,), generator=generator)
    started = time.perf_counter()
    run_batch(ctx, 0, lhs, rhs, None, generator=generator, train=True)
    return time.perf_counter() - started


def bmm_rate(dtype: torch.dtype, args: argparse.Namespace) -> float:
    """GFLOP/s of one batch's (chunks x chunk x d) . (chunks x d x uniform) product."""
    chunks = args.batch // args.chunk
    a = torch.randn(chunks, args.chunk, args.dim).to(dtype)
    b = torch.randn(chunks, args.dim, args.uniform).to(dtype)
    torch.bmm(a, b)
    started = time.perf_counter()
    for _ in range(20):
        torch.bmm(a, b)
    return 20 * 2 * chunks * args.chunk * args.dim * args.uniform / (time.perf_counter() - started) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entities", type=int, default=112_000)
    parser.add_argument("--dim", type=int, default=200)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--chunk", type=int, default=50)
    parser.add_argument("--uniform", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--adjoint", action="store_true",
                        help="compare the operator on every rhs row (old) with its adjoint on the anchors (new)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = make_config(args)
    model = Model(config)
    table = Table(torch.randn(args.entities, args.dim) * 0.1, torch.zeros(args.entities))
    ctx = BatchContext(config, model, None, {0: table}, {0: table}, args.chunk, args.uniform)
    if args.adjoint:
        compare_adjoint(ctx, args)
        return
    times = alternate(ctx, args, [("float32", None, True), ("bfloat16", torch.bfloat16, True)])
    fp32, bf16 = statistics.median(times["float32"]), statistics.median(times["bfloat16"])
    print(f"threads={args.threads} rounds={args.rounds}: median batch float32 {fp32 * 1e3:.1f} ms, "
          f"bfloat16 {bf16 * 1e3:.1f} ms, speed-up {fp32 / bf16:.2f}x")
    rates = {name: bmm_rate(dtype, args) for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16))}
    print(f"bmm chunks x negatives: float32 {rates['float32']:.0f} GFLOP/s, bfloat16 {rates['bfloat16']:.0f} GFLOP/s "
          f"({rates['bfloat16'] / rates['float32']:.2f}x)")


def alternate(ctx: BatchContext, args: argparse.Namespace,
              variants: list[tuple[str, Optional[torch.dtype], bool]]) -> dict[str, list[float]]:
    """Batch times of each (name, dtype, adjoint) variant, run in turn round after round, the order reversed
    every other round; the first two rounds warm up (oneDNN builds its kernels) and are not kept."""
    times: dict[str, list[float]] = {name: [] for name, _, _ in variants}
    for round_index in range(args.rounds + 2):
        for name, dtype, adjoint in variants if round_index % 2 == 0 else variants[::-1]:
            seconds = batch_seconds(ctx, dtype, round_index, args.entities, args.batch, adjoint)
            if round_index >= 2:
                times[name].append(seconds)
    return times


def compare_adjoint(ctx: BatchContext, args: argparse.Namespace) -> None:
    """Old (operator on every rhs row) against new (adjoint on the anchors), in float32 and bfloat16."""
    for label, dtype in (("float32", None), ("bfloat16", torch.bfloat16)):
        times = alternate(ctx, args, [("old", dtype, False), ("new", dtype, True)])
        old, new = statistics.median(times["old"]), statistics.median(times["new"])
        ratios = statistics.median(o / n for o, n in zip(times["old"], times["new"]))
        print(f"{label} threads={args.threads} rounds={args.rounds}: median batch old {old * 1e3:.1f} ms, "
              f"new {new * 1e3:.1f} ms, old/new {old / new:.2f}x (median of per-round ratios {ratios:.2f}x)")


if __name__ == "__main__":
    main()
