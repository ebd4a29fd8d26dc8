"""Benchmark ``biggraph import`` on a synthetic edge list (and optionally PBG's importer on the same file).

Why a synthetic file: the importer's cost depends on edges, distinct ids and id length, which
a generator controls exactly, and nothing has to be downloaded. Ids look like Wikidata's
("Q123456", "P42"). Each importer runs as a child process so that its wall time and peak RSS
(from ``os.wait4``) are its own. Prints one Markdown table row per importer.

    .venv/bin/python bench/import_bench.py --edges 10000000 [--pbg-python /tmp/pbgvenv/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

REPO = Path(__file__).resolve().parent.parent


def generate(path: Path, edges: int, entities: int, relations: int, seed: int = 0) -> None:
    """Write a TSV of uniformly random (lhs, rel, rhs) string triples, a million rows at a time."""
    rng = np.random.default_rng(seed)
    names = pa.array([f"Q{i}" for i in range(entities)])
    rel_names = pa.array([f"P{i}" for i in range(relations)])
    schema = pa.schema([("lhs", pa.string()), ("rel", pa.string()), ("rhs", pa.string())])
    options = pacsv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
    with pacsv.CSVWriter(str(path), schema, write_options=options) as writer:
        for start in range(0, edges, 1_000_000):
            n = min(1_000_000, edges - start)
            writer.write_table(
                pa.table(
                    {
                        "lhs": names.take(rng.integers(0, entities, n)),
                        "rel": rel_names.take(rng.integers(0, relations, n)),
                        "rhs": names.take(rng.integers(0, entities, n)),
                    }
                )
            )


def timed(argv: list[str], log: Path) -> tuple[float, int, int]:
    """Run a command; return (wall seconds, peak RSS in bytes, exit code), its output kept in ``log``."""
    with open(log, "w") as out:
        start = time.monotonic()
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.monotonic() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    return seconds, usage.ru_maxrss * 1024, proc.returncode


def write_configs(root: Path, partitions: int) -> tuple[Path, Path]:
    config = {
        "entities": {"all": {"num_partitions": partitions}},
        "relations": [{"name": "all_edges", "lhs": "all", "rhs": "all", "operator": "translation"}],
        "dynamic_relations": True,
        "global_emb": False,
        "dimension": 100,
        "entity_path": str(root / "out" / "entities"),
        "edge_paths": [str(root / "out" / "edges")],
        "checkpoint_path": str(root / "out" / "checkpoints"),
    }
    ours = root / "config.json"
    ours.write_text(json.dumps(config, indent=2))
    pbg_config = dict(config, entity_path=str(root / "pbg" / "entities"), edge_paths=[str(root / "pbg" / "edges")])
    pbg = root / "pbg_config.py"
    pbg.write_text(f"def get_torchbiggraph_config():\n    return {pbg_config!r}\n")
    return ours, pbg


def row(name: str, edges: int, seconds: float, rss: int, ratio: str) -> str:
    return f"| {name} | {edges:,} | {seconds:.1f} s | {edges / seconds:,.0f} | {rss / 2**20:,.0f} MiB | {ratio} |"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--edges", type=int, default=10_000_000)
    parser.add_argument("--entities", type=int, default=None, help="distinct entities (default: edges / 10)")
    parser.add_argument("--relations", type=int, default=100)
    parser.add_argument("--partitions", type=int, default=1)
    parser.add_argument("--dir", default=None, help="work directory (default: a temp dir, removed afterwards)")
    parser.add_argument("--keep", action="store_true", help="keep the generated input and outputs")
    parser.add_argument("--pbg-python", default=None, help="a python with torchbiggraph installed, to run PBG's importer")
    parser.add_argument("--pbg-edges-per-s", type=float, default=69_000, help="PBG's figure when not measured live")
    args = parser.parse_args()

    entities = args.entities or max(1, args.edges // 10)
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="biggraph-import-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        data = root / f"edges_{args.edges}.tsv"
        if not data.exists():
            start = time.monotonic()
            generate(data, args.edges, entities, args.relations)
            print(
                f"generated {data} ({data.stat().st_size / 2**20:,.0f} MiB) in {time.monotonic() - start:.1f} s", file=sys.stderr
            )
        ours, pbg = write_configs(root, args.partitions)
        shutil.rmtree(root / "out", ignore_errors=True)
        cmd = [sys.executable, "-m", "job", "import", str(ours), str(data), "-l", "0", "-r", "2", "--rel-col", "1"]
        seconds, rss, code = timed(cmd, root / "biggraph.log")
        if code != 0:
            print((root / "biggraph.log").read_text(), file=sys.stderr)
            return code
        pbg_rate = args.pbg_edges_per_s
        rows = []
        if args.pbg_python:
            shutil.rmtree(root / "pbg", ignore_errors=True)
            pbg_cmd = [
                args.pbg_python,
                "-m",
                "torchbiggraph.converters.import_from_tsv",
                "--lhs-col",
                "0",
                "--rel-col",
                "1",
                "--rhs-col",
                "2",
                str(pbg),
                str(data),
            ]
            pbg_seconds, pbg_rss, pbg_code = timed(pbg_cmd, root / "pbg.log")
            if pbg_code != 0:
                print((root / "pbg.log").read_text()[-3000:], file=sys.stderr)
                return pbg_code
            pbg_rate = args.edges / pbg_seconds
            rows.append(row("PBG 1.0.0 import_from_tsv", args.edges, pbg_seconds, pbg_rss, "1.0x"))
        rate = args.edges / seconds
        rows.insert(0, row("biggraph import", args.edges, seconds, rss, f"{rate / pbg_rate:.1f}x"))
        print("| importer | edges | wall | edges/s | peak RSS | vs PBG |")
        print("|---|---|---|---|---|---|")
        print("\n".join(rows))
        print(f"(entities {entities:,}, relations {args.relations}, partitions {args.partitions}, cpus {os.cpu_count()})")
        return 0
    finally:
        if not args.keep and not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
