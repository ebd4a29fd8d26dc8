"""What rank 0 spends on the input before a re-formed group trains: the input check (``validate_cheap``, ~3 requests
per bucket file on S3) against the listing that tells an input already passed (``input_check.facts_once`` with the
last passing check kept in the checkpoint directory). Issue #30: every group formed after a lost pod starts its
trainers again, and rank 0 checked the whole input again each time.

A graph of ``--partitions`` P (P^2 bucket files, ``--edges`` edges) on a moto S3 server; per repeat, alternating:
``checked`` = ``read_facts`` (what every start did), ``kept`` = ``facts_once`` with a record of the same input and
config (what a re-formed group's rank 0 does now: one listing per input directory).

    PYTHONPATH=. .venv/bin/python bench/input_check_bench.py --partitions 16 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


class Kept:
    """The checkpoint directory's record of the last passing check (``CheckRecords``)."""

    def __init__(self, url: str) -> None:
        from job.formats.checkpoint import CheckpointStorage

        self.storage = CheckpointStorage(url)

    def input_check(self) -> dict | None:
        return self.storage.load_input_check()

    def record_input_check(self, record: dict) -> None:
        self.storage.save_input_check(record)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--partitions", type=int, default=16)
    parser.add_argument("--entities", type=int, default=20_000)
    parser.add_argument("--edges", type=int, default=240_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    import s3fs
    from machine import matmul_rate
    from storage_bench import start_moto, write_graph

    from job.config import parse_config
    from job.train import input_check

    machine = {"matmul_gflops": round(matmul_rate(), 1), "load": round(os.getloadavg()[0], 2)}
    print(f"machine: float32 matmul {machine['matmul_gflops']} GFLOP/s, load {machine['load']}")
    moto, endpoint = start_moto()
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    runs: dict[str, list[float]] = {"checked": [], "kept": []}
    try:
        fs = s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True)
        fs.mkdir("input-bench")
        with tempfile.TemporaryDirectory() as local:
            write_graph(Path(local), args.entities, args.edges, args.partitions)
            fs.put(local + "/", "input-bench/data", recursive=True)
        config = parse_config({
            "entity_path": "s3://input-bench/data/entities", "edge_paths": ["s3://input-bench/data/edges"],
            "checkpoint_path": "s3://input-bench/checkpoints",
            "entities": {"node": {"num_partitions": args.partitions}},
            "relations": [{"name": f"r{i}", "lhs": "node", "rhs": "node", "operator": "diagonal"} for i in range(4)],
            "dimension": 16})
        kept = Kept(config.checkpoint_path)
        reference = input_check.facts_once(config, kept)  # the first start: checked, and kept
        for _ in range(args.repeats):
            for kind in ("checked", "kept"):
                started = time.perf_counter()
                facts = input_check.read_facts(config) if kind == "checked" else input_check.facts_once(config, kept)
                runs[kind].append(round(time.perf_counter() - started, 3))
                assert facts == reference
                print(f"{kind}: {runs[kind][-1]:.3f} s", flush=True)
    finally:
        moto.terminate()
        moto.wait(timeout=30)
    after = {"matmul_gflops": round(matmul_rate(), 1), "load": round(os.getloadavg()[0], 2)}
    print(f"machine after: float32 matmul {after['matmul_gflops']} GFLOP/s, load {after['load']}")
    for kind, times in runs.items():
        print(f"{kind}: median {sorted(times)[len(times) // 2]:.3f} s (runs {', '.join(map(str, times))})")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine, "after": after, "runs": runs,
                                               "partitions": args.partitions}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
