"""Time of one training step on a GPU, eager and replayed from a CUDA graph, and where the eager time goes.

A 1M x 100 table, 10 ComplEx relations, 50 batch + 50 uniform negatives, softmax: the generated graph of
bench/train_bench.py, one step at a time, without I/O. Needs CUDA (run on a machine with a GPU):

    python3 bench/gpu_step_bench.py            # eager at batch 1000 / 5000 / 20000, graphs at 1000 / 5000, profile
    python3 bench/gpu_step_bench.py --no-profile

Results and their interpretation: bench/RESULTS.md ("Training on a GPU").
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from job.config import parse_config  # noqa: E402
from job.model.scoring import Model, Table  # noqa: E402
from job.train.batch.graphs import GraphedSteps  # noqa: E402
from job.train.batch.optim import RelationAdagrad  # noqa: E402
from job.train.batch.step import BatchContext, run_batch  # noqa: E402

NUM_ENTITIES, DIMENSION, NUM_RELATIONS = 1_000_000, 100, 10


def timed(step, steps: int) -> float:  # step: a callable taking the step index
    torch.cuda.synchronize()
    started = time.perf_counter()
    for i in range(steps):
        step(i)
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-profile", action="store_true", help="skip the torch.profiler table")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_step_bench.py needs CUDA")
    device = torch.device("cuda")
    config = parse_config({
        "entities": {"node": {"num_partitions": 1}},
        "relations": [{"name": f"r{i}", "lhs": "node", "rhs": "node", "operator": "complex_diagonal"}
                      for i in range(NUM_RELATIONS)],
        "dimension": DIMENSION, "entity_path": "x", "edge_paths": ["x"], "checkpoint_path": "x", "batch_size": 1000,
        "num_batch_negs": 50, "num_uniform_negs": 50, "lr": 0.1, "loss_fn": "softmax", "comparator": "dot",
    })
    model = Model(config).to(device)
    optimizer = RelationAdagrad(list(model.parameters()), config.lr)
    table = Table(torch.randn(NUM_ENTITIES, DIMENSION, device=device) * 0.1, torch.zeros(NUM_ENTITIES, device=device))
    tables = {r: table for r in range(NUM_RELATIONS)}
    ctx = BatchContext(config, model, optimizer, tables, tables, config.num_batch_negs, config.num_uniform_negs)
    generator = torch.Generator().manual_seed(0)

    def ids(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randint(0, NUM_ENTITIES, (batch,), device=device),
                torch.randint(0, NUM_ENTITIES, (batch,), device=device))

    for batch in (1000, 5000, 20000):
        lhs, rhs = ids(batch)
        timed(lambda i: run_batch(ctx, i % NUM_RELATIONS, lhs, rhs, None, generator=generator, train=True), 20)  # noqa: B023
        seconds = timed(lambda i: run_batch(ctx, i % NUM_RELATIONS, lhs, rhs, None, generator=generator, train=True),  # noqa: B023
                        200 if batch == 1000 else 50)
        print(f"eager,  batch {batch:>6}: {seconds * 1e3:.2f} ms/batch, {batch / seconds:>12,.0f} edges/s", flush=True)
    for batch in (1000, 5000):
        config.batch_size = batch  # graphs capture full-size batches only
        lhs, rhs = ids(batch)
        graphs = GraphedSteps()
        timed(lambda i: graphs.run(ctx, i % NUM_RELATIONS, lhs, rhs, None, generator), 30)  # noqa: B023
        seconds = timed(lambda i: graphs.run(ctx, i % NUM_RELATIONS, lhs, rhs, None, generator), 300)  # noqa: B023
        print(f"graphs, batch {batch:>6}: {seconds * 1e3:.2f} ms/batch, {batch / seconds:>12,.0f} edges/s "
              f"(replays so far {GraphedSteps.replays}, capture failure: {GraphedSteps.disabled_reason})", flush=True)
    if not args.no_profile:
        from torch.profiler import ProfilerActivity, profile

        config.batch_size = 1000
        lhs, rhs = ids(1000)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            timed(lambda i: run_batch(ctx, i % NUM_RELATIONS, lhs, rhs, None, generator=generator, train=True), 50)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
