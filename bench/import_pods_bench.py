"""The cost of a parallel import: CPU seconds per million edges and peak memory per pod, N pods against 1 process.

Importers on the same generated TSV files (ids like Wikidata's, uniform, dynamic relations):

- ``baseline``: the importer of ``--baseline-commit`` (the single-process importer before sharding), unpacked
  with ``git archive`` into a temporary directory and run from there;
- with ``--compare-commit C``: ``1 process`` and ``N pods`` as below, of commit C's importer (unpacked the same
  way), so that a change is measured against main in the same go, on the same machine state;
- ``1 process``: ``biggraph import`` as it is now (pod 0 of 1, staging in a local temporary directory);
- ``N pods``: N processes ``biggraph import ... --pods N --pod-index i``, the code an Indexed Job's pods run,
  meeting in a local staging directory, each timed on its own (``os.wait4``: its CPU time and peak RSS).

Wall time cannot show a speed-up here (the pods share the machine's cores), so the figure is CPU time; the
pods' logs give each phase's CPU seconds, from which RESULTS.md models larger graphs. Checks that the N-pod
output is byte-identical to the 1-process output, and prints the machine's float32 matmul rate.

    flock /work/bench.lock .venv/bin/python bench/import_pods_bench.py --edges 20000000 --entities 1000000
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from import_bench import generate  # noqa: E402
from machine import matmul_rate  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PHASE = re.compile(r"import: pod (\d+): (.+?) took ([\d.]+) s wall, ([\d.]+) s CPU")
STARTUP = re.compile(r"import: pod \d+: start-up \(.*?\): ([\d.]+) s CPU")
GROUP_DONE = re.compile(r"pass 1 done: [\d,]+ edges .*; entities: \w+=([\d,]+)")


@dataclass
class Measured:
    """Costs from this run: CPU per edge and per group entry by phase, per-pod fixed CPU, memory per entry."""

    edge_p1: float  # phase 1 CPU s per edge (the 1-process run: its one group holds each id once)
    entry_p1: float  # phase 1 CPU s per distinct id of a group, beyond the first group holding it
    entry_p2: float  # phase 2 CPU s per group entry
    edge_p3: float  # phase 3 CPU s per edge
    fixed_cpu: float  # CPU s a pod spends whatever its share (interpreter, imports, start-up)
    fixed_rss: float  # bytes a pod holds whatever its share
    entry_rss: float  # bytes a pod holds per distinct id of its group


def measure(edges: int, one: dict[str, float], pods: dict[str, float], pod_count: int, outside: tuple[float, float],
            entries: tuple[int, int], peaks: tuple[int, int], fixed_rss: int) -> Measured:
    """``one``/``pods``: phase CPU of the 1-process and N-pod runs; ``outside``: their CPU outside the phases;
    ``entries``: group entries in all (1 process, N pods); ``peaks``: peak RSS (1 process, largest pod)."""
    fixed = (outside[1] - outside[0]) / max(pod_count - 1, 1)
    p1 = "phase 1 (shards)"
    extra = max(pods[p1] - one[p1], 0.0)
    return Measured(
        edge_p1=one[p1] / edges, entry_p1=extra / max(entries[1] - entries[0], 1),
        entry_p2=pods["phase 2 (dictionaries)"] / entries[1], edge_p3=pods["phase 3 (buckets)"] / edges,
        fixed_cpu=fixed, fixed_rss=fixed_rss, entry_rss=max(peaks[0] - fixed_rss, 0) / max(entries[0], 1))


def paper_model(m: Measured, *, group_mib: int = 256, parts: int = 128) -> None:
    """Import wall time and memory per pod for 2B edges / 100M entities on 8, 32, 128 pods at 200 MB/s each.
    Worst case: ids uniform over the entities, so a group of e edges holds 1 - exp(-2e/V) of them (a power-law
    graph far fewer). Each pod's CPU is one core; reads, writes and CPU are added, not overlapped."""
    big_e, big_v, name, rate = 2e9, 1e8, 9, 200e6
    b_in = big_e * (2 * name + 5)
    print(f"\nmodel: 2B edges, 100M entities, {b_in / 1e9:.0f} GB of TSV, groups of at most {group_mib} MiB, {parts} "
          f"partitions ({parts * parts} buckets); per edge: phase 1 {m.edge_p1 * 1e6:.3f} µs, phase 3 "
          f"{m.edge_p3 * 1e6:.3f} µs; per group entry: phase 1 {m.entry_p1 * 1e6:.3f} µs, phase 2 "
          f"{m.entry_p2 * 1e6:.3f} µs; a pod: {m.fixed_cpu:.2f} s CPU and {m.fixed_rss / 2**20:.0f} MiB fixed, "
          f"{m.entry_rss:.0f} B per group entry")
    print("| pods | group entries | phase 1 | phase 2 | phase 3 | total | memory per pod (phase 1 / phase 2) |")
    print("|---|---|---|---|---|---|---|")
    for pods in (8, 32, 128):
        group = min(group_mib * 2**20, b_in / pods)
        per_group = big_v * (1 - np.exp(-2 * (group / (2 * name + 5)) / big_v))
        entries = b_in / group * per_group
        t1 = m.fixed_cpu + (big_e * m.edge_p1 + (entries - big_v) * m.entry_p1
                            + (b_in + 12 * big_e + entries * (24 + name)) / rate) / pods
        t2 = (entries * m.entry_p2 + (entries * (28 + name) + big_v * (name + 4)) / rate) / min(pods, parts)
        t3 = (big_e * m.edge_p3 + (24 * big_e + 4 * entries) / rate) / min(pods, parts * parts)
        m1 = m.fixed_rss + per_group * m.entry_rss
        m2 = m.fixed_rss + entries / parts * m.entry_rss
        print(f"| {pods} | {entries / 1e9:.2f}B | {t1 / 60:.1f} min | {t2 / 60:.1f} min | {t3 / 60:.1f} min | "
              f"{(t1 + t2 + t3) / 60:.1f} min | {m1 / 2**30:.1f} GiB / {m2 / 2**30:.1f} GiB |")


def write_config(path: Path, out: Path, partitions: int, files: int) -> Path:
    """One edge path per input file (PBG's rule: the i-th file is the i-th edge set)."""
    path.write_text(json.dumps({
        "entities": {"all": {"num_partitions": partitions}},
        "relations": [{"name": "all_edges", "lhs": "all", "rhs": "all", "operator": "translation"}],
        "dynamic_relations": True, "global_emb": False, "dimension": 100,
        "entity_path": str(out / "entities"), "edge_paths": [str(out / f"edges_{i:02d}") for i in range(files)],
        "checkpoint_path": str(out / "model"),
    }))
    return path


# Forked from a small interpreter: a child's ru_maxrss starts at its parent's peak at the fork (Linux keeps it
# across exec), and this benchmark's own process holds torch and the generator's arrays.
MEASURE = """
import json, os, sys, time
started = time.monotonic()
pid = os.fork()
if pid == 0:
    os.execvp(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as out:
    json.dump([time.monotonic() - started, usage.ru_utime, usage.ru_stime, usage.ru_maxrss * 1024, usage.ru_minflt],
              out)
sys.exit(os.waitstatus_to_exitcode(status))
"""


@dataclass
class Usage:
    """One process's own wait4 figures."""

    wall: float
    user: float
    sys: float
    peak: int
    faults: int  # minor page faults: fresh pages the kernel mapped in (and zeroed), a 2 MiB huge page counting once

    @property
    def cpu(self) -> float:
        return self.user + self.sys


def run_all(commands: list[list[str]], logs: list[Path], env: dict[str, str], cwd: Path,
            stagger: bool = False) -> list[Usage]:
    """Start every command at once (``stagger``: each once the one before has logged the end of its phase 1, so
    that no two pods read shards at the same time); the usage of each, from its own wait4."""
    procs = []
    for argv, log in zip(commands, logs):
        if stagger and procs:
            while "phase 1 (shards) took" not in logs[len(procs) - 1].read_text() and procs[-1].poll() is None:
                time.sleep(0.05)
        with open(log, "w") as out:
            measure = [sys.executable, "-S", "-c", MEASURE, f"{log}.usage", *argv]
            procs.append(subprocess.Popen(measure, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, env=env))
    results = []
    for proc, log in zip(procs, logs):
        if proc.wait() != 0:
            raise SystemExit(f"{' '.join(proc.args[5:])} failed:\n{log.read_text()[-3000:]}")
        wall, user, system, peak, faults = json.loads(Path(f"{log}.usage").read_text())
        results.append(Usage(wall, user, system, int(peak), int(faults)))
    return results


def unpack(commit: str, where: Path, git: Path = REPO) -> Path:
    """The importer's code at ``commit`` of the checkout ``git`` (job/ and storage_adapters/, ``git archive``), run
    from ``where``."""
    if not where.exists():
        where.mkdir()
        archive = subprocess.run(["git", "-C", str(git), "archive", commit, "job", "storage_adapters"],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    return where


def digests(out: Path) -> dict[str, str]:
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file() and p.name != ".biggraph-import.json"}


def phases(logs: list[Path]) -> dict[str, float]:
    """CPU seconds per phase, summed over the pods (waits excluded); "start-up" (the CPU each pod spent before phase
    1: interpreter, imports, config) is not a phase and is summed apart."""
    totals: dict[str, float] = {}
    for log in logs:
        for match in STARTUP.finditer(log.read_text()):
            totals["start-up"] = totals.get("start-up", 0.0) + float(match.group(1))
        for match in PHASE.finditer(log.read_text()):
            if not match.group(2).startswith("waiting"):
                totals[match.group(2)] = totals.get(match.group(2), 0.0) + float(match.group(4))
    return totals


@dataclass(frozen=True)
class Request:
    """One importer run: its row name, source tree, pod count (0: the baseline, 1: one process) and repetition."""

    name: str
    src: Path
    pods: int
    rep: int


@dataclass
class Row:
    """What one importer run cost (every process's usage, each phase's CPU over the pods) and its output's digests."""

    name: str
    rep: int
    usages: list[Usage]
    phase_cpu: dict[str, float]
    out: Path
    digests: dict[str, str]

    @property
    def wall(self) -> float:
        return max(u.wall for u in self.usages)

    @property
    def user(self) -> float:
        return sum(u.user for u in self.usages)

    @property
    def sys(self) -> float:
        return sum(u.sys for u in self.usages)

    @property
    def cpu(self) -> float:
        return self.user + self.sys

    @property
    def peak(self) -> int:
        return max(u.peak for u in self.usages)

    @property
    def faults(self) -> int:
        return sum(u.faults for u in self.usages)


def run_importer(req: Request, root: Path, inputs: list[str], args: argparse.Namespace, env: dict[str, str]) -> Row:
    """One importer (1 process, or N pods meeting in a fresh staging directory) on ``inputs``, timed per process."""
    out = root / re.sub(r"\W", "_", req.name)
    shutil.rmtree(out, ignore_errors=True)
    config = str(write_config(root / f"{out.name}.json", out, args.partitions, args.files))
    pinned = ["taskset", "-c", args.cpu_list] if args.cpu_list else []
    base = [*pinned, sys.executable, "-m", "job", "import", config, *inputs, "-l", "0", "-r", "2", "--rel-col", "1",
            *args.import_args.split()]
    run_env = env if req.src == REPO else {**env, "PYTHONPATH": str(req.src)}
    if req.pods <= 1:
        commands = [base]
    else:
        staging = str(root / f"staging_{out.name}")
        shutil.rmtree(staging, ignore_errors=True)
        commands = [[*base, "--pods", str(req.pods), "--pod-index", str(i), "--staging", staging]
                    for i in range(req.pods)]
    logs = [root / f"{out.name}.{i}.log" for i in range(len(commands))]
    usages = run_all(commands, logs, run_env, req.src, args.stagger)
    row = Row(req.name, req.rep, usages, phases(logs), out, digests(out))
    print(f"run {req.rep + 1}: {req.name}: {row.cpu:.2f} s CPU ({row.user:.2f} user + {row.sys:.2f} sys), "
          f"{row.faults:,} page faults, load average {os.getloadavg()[0]:.1f}", flush=True)
    return row


def summarize(rows: list[Row], names: list[str]) -> None:
    """Across the runs: each importer's median CPU and its range, and each run's N pods / 1 process ratio."""
    if max(row.rep for row in rows) == 0:
        return
    for name in names:
        # a tree's pods against the same tree's 1 process ("4 pods (C)" against "1 process (C)")
        tree = name[name.index(" ("):] if " (" in name else ""
        one = {row.rep: row.cpu for row in rows if row.name == f"1 process{tree}"} or \
            {row.rep: row.cpu for row in rows if row.name == "1 process"}
        cpus = sorted(row.cpu for row in rows if row.name == name)
        ratios = sorted(row.cpu / one[row.rep] for row in rows if row.name == name)
        faults = sorted(row.faults for row in rows if row.name == name)
        print(f"{name}: CPU median {float(np.median(cpus)):.2f} s (range {cpus[0]:.2f}-{cpus[-1]:.2f}, {len(cpus)} runs); "
              f"against the 1 process of the same tree and run: median {float(np.median(ratios)):.2f}x "
              f"(range {ratios[0]:.2f}-{ratios[-1]:.2f}); page faults median {int(np.median(faults)):,}")
        mine = [row for row in rows if row.name == name]
        phase_names = list(dict.fromkeys(k for row in mine for k in row.phase_cpu))
        print(f"  {name}, median CPU s by phase (all pods): " + ", ".join(
            f"{k} {float(np.median([row.phase_cpu.get(k, 0.0) for row in mine])):.2f}" for k in phase_names)
            + f", outside the phases {float(np.median([row.cpu - sum(row.phase_cpu.values()) for row in mine])):.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--edges", type=int, default=20_000_000)
    parser.add_argument("--entities", type=int, default=1_000_000)
    parser.add_argument("--relations", type=int, default=100)
    parser.add_argument("--files", type=int, default=16)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--pods", type=int, default=4)
    parser.add_argument("--baseline-commit", default="3de917b",
                        help="the commit whose importer is the baseline ('' for none)")
    parser.add_argument("--compare-commit", default="",
                        help="also run 1 process and N pods of this commit's importer (main, say), in the same go")
    parser.add_argument("--dir", default=None, help="work directory (default: a temp dir, removed afterwards)")
    parser.add_argument("--git", default=str(REPO), help="the checkout the commits are taken from (default: this one; "
                        "set it when running a copy of the tree made with git archive)")
    parser.add_argument("--cpu-list", default="",
                        help="run every importer process on these CPUs only (taskset -c): with one CPU, N pods take "
                             "turns on it as one process has it alone, rather than running side by side on cores "
                             "that slow each other down (shared caches, memory bandwidth, a host's SMT siblings)")
    parser.add_argument("--stagger", action="store_true",
                        help="start each pod once the one before has read its shards (phase 1, where nearly all the "
                             "CPU goes): the pods' shares then run one at a time, as on a cluster each pod has its "
                             "own core, rather than side by side on cores that slow each other down")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run every importer this many times, alternating their order (this machine's CPU time "
                             "varies with other jobs: a ratio is read from runs side by side, over several runs)")
    parser.add_argument("--import-args", default="",
                        help="more options for every importer (e.g. '--block-size 2': a smaller read block, so a "
                             "smaller working set per process)")
    parser.add_argument("--fixed-rss", type=int, default=150, metavar="MIB",
                        help="a pod's peak on a tiny import (interpreter, numpy, pyarrow, h5py, fsspec), for the model")
    args = parser.parse_args()

    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="biggraph-import-pods-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"machine: float32 matmul {matmul_rate():.0f} GFLOP/s, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}"
          + (f"; importers pinned to CPUs {args.cpu_list}" if args.cpu_list else "")
          + ("; pods staggered (each starts once the one before has read its shards)" if args.stagger else ""),
          flush=True)
    try:
        inputs = []
        per_file = args.edges // args.files
        started = time.monotonic()
        for i in range(args.files):
            path = root / f"part-{i:02d}.tsv"
            if not path.exists():
                generate(path, per_file, args.entities, args.relations, seed=i)
            inputs.append(str(path))
        size = sum(os.path.getsize(p) for p in inputs)
        print(f"input: {args.files} files, {per_file * args.files:,} edges, {size / 2**20:,.0f} MiB "
              f"(generated in {time.monotonic() - started:.0f} s)", flush=True)
        edges = per_file * args.files
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        # (row name, source tree, pods): this tree's rows first (the model below reads rows 0 and 1)
        runs: list[tuple[str, Path, int]] = [("1 process", REPO, 1), (f"{args.pods} pods", REPO, args.pods)]
        if args.compare_commit:
            other = unpack(args.compare_commit, root / f"src_{args.compare_commit}", Path(args.git))
            runs += [(f"1 process ({args.compare_commit})", other, 1),
                     (f"{args.pods} pods ({args.compare_commit})", other, args.pods)]
        if args.baseline_commit:
            runs.append((f"baseline ({args.baseline_commit})",
                         unpack(args.baseline_commit, root / "baseline_src", Path(args.git)), 0))
        for _, src, _ in runs:  # byte-compiled before the first run, as an image ships it: not one run's cost alone
            subprocess.run([sys.executable, "-m", "compileall", "-q", "job", "storage_adapters"], cwd=src, check=True)
        rows = []
        for rep in range(args.repeat):
            # alternate the order, so that neither side always runs first (or right after the other)
            for name, src, pods in (runs if rep % 2 == 0 else runs[::-1]):
                rows.append(run_importer(Request(name, src, pods, rep), root, inputs, args, env))
        print(f"\nload average after the runs: {os.getloadavg()[0]:.1f}")
        print("\n| importer | run | edges | wall | CPU (user + sys) | CPU s / M edges | edges/s of CPU | peak RSS per process "
              "| CPU vs 1 process of the run |")
        print("|---|---|---|---|---|---|---|---|---|")
        one = {row.rep: row.cpu for row in rows if row.name == "1 process"}
        for row in rows:
            peaks = ", ".join(f"{u.peak / 2**20:,.0f}" for u in row.usages)
            print(f"| {row.name} | {row.rep + 1} | {edges:,} | {row.wall:.1f} s | {row.cpu:.1f} s ({row.user:.1f} + "
                  f"{row.sys:.1f}) | {row.cpu / edges * 1e6:.2f} | {edges / row.cpu:,.0f} | {row.peak / 2**20:,.0f} MiB "
                  f"({peaks}) | {row.cpu / one[row.rep]:.2f}x |")
        summarize(rows, [name for name, _, _ in runs])
        for row in rows:
            if row.phase_cpu:
                print(f"phases of {row.name}, run {row.rep + 1} (CPU s, all pods): "
                      + ", ".join(f"{k} {v:.2f}" for k, v in row.phase_cpu.items())
                      + ", outside the phases (interpreter, imports, start-up"
                      + (" counted above; exit" if "start-up" in row.phase_cpu else "")
                      + f") {row.cpu - sum(row.phase_cpu.values()):.2f}")
        rows_of = {row.name: row for row in rows if row.rep == 0}
        first = [rows_of[runs[0][0]], rows_of[runs[1][0]]]
        found = []
        for row in first:
            logs = sorted(root.glob(f"{row.out.name}.*.log"))
            found.append(sum(int(m.group(1).replace(",", "")) for log in logs for m in GROUP_DONE.finditer(log.read_text())))
        print(f"group entries (distinct ids per group, summed): 1 process {found[0]:,}, {args.pods} pods {found[1]:,}")
        # start-up and exit: what each pod pays whatever its share
        outside = tuple(row.cpu - sum(v for k, v in row.phase_cpu.items() if k != "start-up") for row in first)
        measured = measure(edges, first[0].phase_cpu, first[1].phase_cpu, args.pods, (outside[0], outside[1]),
                           (found[0], found[1]), (first[0].peak, first[1].peak), args.fixed_rss << 20)
        paper_model(measured)
        expected = first[0].digests
        same = all(row.digests == expected for row in rows if not row.name.startswith("baseline"))
        print(f"\nevery N-pod and 1-process output (of every tree and run) byte-identical to this tree's 1-process "
              f"output: {same} ({len(expected)} files)")
        return 0 if same else 1
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
