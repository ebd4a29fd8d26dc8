"""Where one training batch's time goes: the median batch time on one thread, then a torch.profiler table.

A batch in isolation, without Hogwild workers, I/O or scheduling, so that a change to the batch code can be
timed alone (A/B: run it from two checkouts, one after the other). Two shapes:

- ``ooc``: the out-of-core benchmark's batch (bench/ooc_bench.py, issue #15 and the 1M/10M graph of #16):
  ComplEx d=100, 10 relations, 50 batch + 50 uniform negatives, softmax, power-law ids over 250k-row tables;
- ``wordnet``: the WordNet KG's (issue #16, bench/kg_bench.py's config): ComplEx d=200, one entity type (both
  sides share one 112k-row table), 18 dynamic relations, 50 batch + 1,000 uniform negatives per chunk.

    .venv/bin/python bench/batch_profile.py --shape ooc            # median ms per batch, then the profile
    .venv/bin/python bench/batch_profile.py --shape wordnet --no-profile -p compute_dtype=bfloat16
    .venv/bin/python bench/batch_profile.py --shape wn18rr --no-profile -p entity_optimizer=adagrad
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import matmul_rate  # noqa: E402 - a sibling bench module, not a package

from job.config import parse_config  # noqa: E402
from job.config.overrides import apply_overrides  # noqa: E402
from job.model.kernel_options import KernelOptions  # noqa: E402
from job.model.scoring import Model, Table  # noqa: E402
from job.train.batch.allocator import keep_freed_memory  # noqa: E402
from job.train.batch.optim import RelationAdagrad  # noqa: E402
from job.train.batch.precision import training_dtype  # noqa: E402
from job.train.batch.step import BatchContext, run_batch  # noqa: E402
from job.train.residency.budget import per_coordinate  # noqa: E402

SHAPES: dict[str, dict[str, Any]] = {
    "ooc": {"relations": 10, "dimension": 100, "num_batch_negs": 50, "num_uniform_negs": 50, "rows": 250_000,
            "skew": 2.5},
    "wordnet": {"relations": 18, "dimension": 200, "num_batch_negs": 50, "num_uniform_negs": 1000, "rows": 112_000,
                "skew": 1.0, "dynamic": True, "global_emb": False},
    # preset: quality on WN18RR (issue #33): 1-vs-all (every row a negative), ComplEx d=256, batch 500
    "wn18rr": {"relations": 11, "dimension": 256, "num_batch_negs": 0, "num_uniform_negs": 0, "rows": 40_943,
               "skew": 1.0, "dynamic": True, "global_emb": False, "all_negs": True, "batch_size": 500, "lr": 0.3,
               "init_method": "xavier"},
}


def make_config(shape: dict[str, Any], overrides: list[str]) -> Any:
    count = 1 if shape.get("dynamic") else shape["relations"]
    raw = {"entities": {"node": {"num_partitions": 1}}, "dynamic_relations": bool(shape.get("dynamic")),
           "relations": [{"name": f"r{i}", "lhs": "node", "rhs": "node", "operator": "complex_diagonal",
                          "all_negs": bool(shape.get("all_negs"))} for i in range(count)],
           "dimension": shape["dimension"], "comparator": "dot", "loss_fn": "softmax", "lr": shape.get("lr", 0.1),
           "batch_size": shape.get("batch_size", 1000), "num_batch_negs": shape["num_batch_negs"],
           "num_uniform_negs": shape["num_uniform_negs"], "entity_path": "x", "edge_paths": ["x"],
           "checkpoint_path": "x", "global_emb": shape.get("global_emb", True)}
    return parse_config(apply_overrides(raw, overrides))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="ooc")
    parser.add_argument("--batches", type=int, default=60, help="timed batches (after 5 warm-up ones)")
    parser.add_argument("--no-profile", action="store_true", help="only the median time")
    parser.add_argument("--autograd-all", action="store_true",
                        help="1-vs-all softmax through autograd (job.model.fused_all off): the reference to compare")
    parser.add_argument("-p", dest="overrides", action="append", default=[], help="config override key=value")
    args = parser.parse_args()
    keep_freed_memory()
    options = KernelOptions(fused_all_negs=not args.autograd_all)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    shape = SHAPES[args.shape]
    config = make_config(shape, args.overrides)
    dynamic = bool(shape.get("dynamic"))
    model = Model(config, shape["relations"] if dynamic else 0)
    model.compute_dtype = training_dtype(config, torch.device("cpu"))  # as the Trainer sets it
    rows, dim = shape["rows"], config.dimension
    # the Adagrad sums: one per row (PBG's), one per coordinate with -p entity_optimizer=adagrad
    sums = (rows, dim) if per_coordinate(config, "node") else (rows,)
    lhs_table = Table(torch.randn(rows, dim) * 0.1, torch.zeros(sums))
    # dynamic relations: one entity type on both sides, so one table (as the WordNet KG trains)
    rhs_table = lhs_table if dynamic else Table(torch.randn(rows, dim) * 0.1, torch.zeros(sums))
    relation_optimizer = RelationAdagrad(list(model.parameters()), config.lr)
    n = len(config.relations)  # dynamic: one relation, the edges' types in ``rel_ids``
    ctx = BatchContext(config, model, relation_optimizer, dict.fromkeys(range(n), lhs_table),
                       dict.fromkeys(range(n), rhs_table), config.num_batch_negs, config.num_uniform_negs, options)
    generator = torch.Generator().manual_seed(0)

    def one(i: int) -> None:
        # power-law ids (skew > 1: a few rows take most edges), as the generated graphs have
        lhs = (rows * torch.rand(config.batch_size, generator=generator) ** shape["skew"]).long()
        rhs = (rows * torch.rand(config.batch_size, generator=generator) ** shape["skew"]).long()
        rel_ids = (torch.randint(0, shape["relations"], (config.batch_size,), generator=generator) if dynamic
                   else None)
        run_batch(ctx, 0 if dynamic else i % n, lhs, rhs, rel_ids, generator=generator, train=True)

    for i in range(5):
        one(i)
    times = []
    for i in range(args.batches):
        started = time.perf_counter()
        one(i)
        times.append(time.perf_counter() - started)
    print(json.dumps({"shape": args.shape, "overrides": args.overrides, "fused_all": options.fused_all_negs,
                      "median_ms": round(statistics.median(times) * 1e3, 2),
                      "matmul_gflops_1_thread": round(matmul_rate(), 1)}), flush=True)
    if not args.no_profile:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for i in range(20):
                one(i)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=40))


if __name__ == "__main__":
    main()
