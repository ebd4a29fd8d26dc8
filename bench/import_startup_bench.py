"""What one import process (one pod of ``biggraph import --pods N``) spends before and around its work: the CPU of a
tiny import, this tree against ``--compare-commit`` (main, say), alternated, each process timed on its own.

Every pod of an import pays its interpreter and imports (issue #46): on a tiny input (two files of 1,000 edges)
nearly all of a process's CPU is that. Two ways to start, both measured:

- ``bytecode``: the modules' .pyc files are there (as in this checkout, and in the pods bench);
- ``source``: no bytecode anywhere (``PYTHONPYCACHEPREFIX`` set to an empty directory nobody writes to), so each
  process compiles every module it imports, as the image's processes do for its venv (the Dockerfile ships no
  .pyc); the standard library is compiled too here, so this is an upper bound for the image.

Prints, per tree and mode, each run's CPU (wait4: user + sys), the start-up line of its log (interpreter, imports,
config, plan: before phase 1) and the medians, beside the machine's float32 matmul rate.

    flock /work/bench.lock .venv/bin/python bench/import_startup_bench.py --compare-commit main --repeat 7
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from import_pods_bench import STARTUP, unpack, write_config  # noqa: E402
from machine import matmul_rate  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PARTITIONS, FILES, EDGES = 2, 2, 1000


def tiny_inputs(root: Path) -> list[str]:
    """Two TSV files of ``EDGES`` edges over 500 ids and 3 relations."""
    rng = random.Random(0)
    paths = []
    for i in range(FILES):
        path = root / f"part-{i}.tsv"
        path.write_text("".join(f"n{rng.randrange(500)}\tr{rng.randrange(3)}\tn{rng.randrange(500)}\n"
                                for _ in range(EDGES)))
        paths.append(str(path))
    return paths


def one_process(src: Path, root: Path, inputs: list[str], env: dict[str, str]) -> tuple[float, float]:
    """One ``python -m job import`` of ``src`` on ``inputs`` (pod 0 of 1): its CPU (wait4) and its logged start-up."""
    out = root / "out"
    shutil.rmtree(out, ignore_errors=True)
    config = write_config(root / "config.json", out, PARTITIONS, FILES)
    argv = [sys.executable, "-m", "job", "import", str(config), *inputs, "-l", "0", "-r", "2", "--rel-col", "1"]
    with open(root / "import.log", "w") as sink:
        proc = subprocess.Popen(argv, cwd=src, env=env, stdout=sink, stderr=subprocess.STDOUT)
    _, status, usage = os.wait4(proc.pid, 0)  # the process's own usage (Popen.wait would reap it without)
    proc.returncode = os.waitstatus_to_exitcode(status)
    log = (root / "import.log").read_text()
    if proc.returncode != 0:
        raise SystemExit(f"{src}: import failed:\n{log[-3000:]}")
    found = STARTUP.search(log)
    return usage.ru_utime + usage.ru_stime, float(found.group(1)) if found else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compare-commit", default="main", help="the other tree's commit ('' for this tree alone)")
    parser.add_argument("--git", default=str(REPO), help="the checkout the commit is taken from")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--modes", default="bytecode,source")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="biggraph-import-startup-bench-"))
    try:
        print(f"machine: float32 matmul {matmul_rate():.0f} GFLOP/s, {os.cpu_count()} CPUs, load average "
              f"{os.getloadavg()[0]:.1f}", flush=True)
        inputs = tiny_inputs(root)
        trees = [("this", REPO)]
        if args.compare_commit:
            trees.append((args.compare_commit, unpack(args.compare_commit, root / "other", Path(args.git))))
        for _, src in trees:
            subprocess.run([sys.executable, "-m", "compileall", "-q", "job", "storage_adapters"], cwd=src, check=True)
        empty = root / "no-bytecode"  # with PYTHONDONTWRITEBYTECODE nothing is cached there: each process compiles
        empty.mkdir()
        base = {**os.environ, "OMP_NUM_THREADS": "1"}
        envs = {"bytecode": base, "source": {**base, "PYTHONPYCACHEPREFIX": str(empty), "PYTHONDONTWRITEBYTECODE": "1"}}
        results: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for mode in args.modes.split(","):
            for rep in range(args.repeat):
                for name, src in trees if rep % 2 == 0 else trees[::-1]:
                    env = envs[mode] if src == REPO else {**envs[mode], "PYTHONPATH": str(src)}
                    results.setdefault((mode, name), []).append(one_process(src, root, inputs, env))
        print(f"load average after the runs: {os.getloadavg()[0]:.1f}\n")
        print("| mode | tree | CPU per process (each run) | median | start-up before phase 1 (median) |")
        print("|---|---|---|---|---|")
        for (mode, name), runs in results.items():
            cpu = [c for c, _ in runs]
            print(f"| {mode} | {name} | {', '.join(f'{c:.3f}' for c in cpu)} s | {statistics.median(cpu):.3f} s "
                  f"| {statistics.median(s for _, s in runs):.3f} s |")
        return 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
