"""What an import process loads before it reads a byte: only the import command's own parser and what it needs
(each pod of an import pays its start-up; issue #46), with the parse unchanged."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from job.cli import build_parser, command_of

REPO = Path(__file__).resolve().parents[1]

# after `biggraph import --help`: which other commands' modules were loaded, and fsspec.asyn (S3 only) or tqdm (a bar on
# a terminal only, and its import reads every installed package's metadata)
CHECK = """
import sys
from job.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
others = ("job.cli.train", "job.cli.k8s", "job.cli.exporting", "job.cli.archive", "job.cli.validate", "fsspec.asyn",
          "tqdm")
print(",".join(m for m in others if m in sys.modules) or "none")
"""


@pytest.mark.parametrize(("argv", "command"), [
    (["import", "c.json", "f.tsv"], "import"),
    (["-v", "--log-format", "json", "import", "c.json"], "import"),
    (["--log-format=text", "train", "c.json"], "train"),
    (["--log-format", "import"], None),  # "import" is the option's value here, and no command follows
    (["--version"], None),
])
def test_the_command_is_the_first_word_that_is_not_an_option_of_biggraph(argv: list[str], command: str | None) -> None:
    assert command_of(argv) == command


def test_an_import_loads_neither_the_other_commands_nor_what_it_does_not_use() -> None:
    run = subprocess.run([sys.executable, "-c", CHECK, "-v", "import", "--help"], capture_output=True, text=True,
                         cwd=REPO, check=True)
    assert run.stdout.split()[-1] == "none"
    everything = subprocess.run([sys.executable, "-c", CHECK, "train", "--help"], capture_output=True, text=True,
                                cwd=REPO, check=True)
    assert "job.cli.k8s" in everything.stdout  # any other command still builds the whole parser


@pytest.mark.parametrize("argv", [
    ["import", "c.json", "a.tsv", "b.tsv", "-l", "0", "-r", "2", "--rel-col", "1", "--pods", "4", "--pod-index", "1",
     "--staging", "/tmp/s", "-p", "dimension=8"],
    ["-v", "import", "c.json", "a.parquet", "--lhs-col", "0", "--rhs-col", "1"],
])
def test_the_import_parser_alone_parses_as_the_whole_one(argv: list[str]) -> None:
    alone, whole = vars(build_parser(("importing",)).parse_args(argv)), vars(build_parser().parse_args(argv))
    assert alone == whole


# A process armed with QuickExit: a module-level object whose finalizer speaks when the interpreter tears down, an
# exit handler registered after arming (as the command's own would be), a log line and an unflushed print.
QUICK = """
import atexit, logging, sys
from job.cli.quick_exit import QuickExit

class Noisy:
    def __del__(self):
        print("torn down", flush=True)

kept = Noisy()
quick = QuickExit()
quick.arm()
atexit.register(print, "handler ran", flush=True)
logging.basicConfig(stream=sys.stderr, format="%(message)s")
logging.getLogger("t").warning("logged")
print("unflushed", end="")
if sys.argv[1] == "allow":
    quick.allow(3)
sys.exit(3)
"""


@pytest.mark.parametrize("allowed", [True, False])
def test_a_quick_exit_skips_the_teardown_but_not_the_exit_handlers_logs_or_output(allowed: bool) -> None:
    run = subprocess.run([sys.executable, "-c", QUICK, "allow" if allowed else "no"], capture_output=True, text=True,
                         cwd=REPO)
    assert run.returncode == 3
    assert "handler ran" in run.stdout and "unflushed" in run.stdout and run.stderr.strip() == "logged"
    assert ("torn down" in run.stdout) is not allowed


def _import_config(tmp_path: Path, partitions: int, **extra: object) -> Path:
    """A one-type, one-relation config for a tiny import into ``tmp_path`` (its outputs under it)."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "entities": {"all": {"num_partitions": partitions}},
        "relations": [{"name": "r", "lhs": "all", "rhs": "all", "operator": "translation"}],
        "dimension": 4, "entity_path": str(tmp_path / "entities"), "edge_paths": [str(tmp_path / "edges")],
        "checkpoint_path": str(tmp_path / "model"), **extra,
    }))
    return config


def test_an_import_process_exits_quickly_with_its_output_whole(tmp_path: Path) -> None:
    edges = tmp_path / "edges.tsv"
    edges.write_text("a\tr\tb\nb\tr\tc\nc\tr\ta\n")
    config = _import_config(tmp_path, partitions=1)
    # a finalizer that would speak at the interpreter's teardown, loaded into the import process through -c
    script = ("import sys, runpy\nclass Noisy:\n    def __del__(self): print('torn down', flush=True)\n"
              "sys.modules['__main__'].kept = Noisy()\nsys.argv = ['job', *sys.argv[1:]]\n"
              "runpy.run_module('job', run_name='__main__')\n")
    argv = [sys.executable, "-c", script, "import", str(config), str(edges), "-l", "0", "-r", "2", "--rel-col", "1"]
    run = subprocess.run(argv, capture_output=True, text=True, cwd=REPO)
    assert run.returncode == 0, run.stderr
    assert "imported 3 edges" in run.stdout and "torn down" not in run.stdout
    assert (tmp_path / "entities" / "entity_count_all_0.txt").read_text().strip() == "3"
    failed = subprocess.run([*argv[:5], str(tmp_path / "missing.tsv"), *argv[6:]], capture_output=True, text=True,
                            cwd=REPO)
    assert failed.returncode == 2 and "torn down" in failed.stdout  # an error exits as Python does


# an import run to its end in this process (main, not entry: no quick exit), then which modules it loaded
LOADED = """
import gc, sys
from job.cli import main
unused = sys.argv.pop().split(",")
code = main(sys.argv[1:], own_process=True)
print("loaded:", ",".join(m for m in unused if m in sys.modules) or "none")
print("collector:", gc.isenabled(), gc.get_freeze_count() == 0)  # frozen at start-up, unfrozen at the end
sys.exit(code)
"""
# What a local import has no use for, and each of its processes (each pod) would pay at start-up: the kernels'
# named wrappers (pyarrow.compute, ~33 ms with numpy.ma) where it calls them from pyarrow's registry
# (job.data.importing.kernels); fsspec (~14 ms: local paths go through storage_adapters.local); the HTTP, TLS
# and asyncio modules of remote storage (~15 ms); difflib (the config's suggestions for a mistyped key); torch and
# the trainer's modules.
UNUSED = ("pyarrow.compute", "numpy.ma", "fsspec", "http.client", "ssl", "asyncio", "difflib", "torch",
          "job.train.trainer", "job.checkpoint")


def test_a_local_import_loads_none_of_what_it_does_not_use(tmp_path: Path) -> None:
    """A whole local import (pod 0 of 1) ends with none of ``UNUSED`` loaded. Ids with an empty field and a
    relation-less row take the null-filling and bad-row paths too."""
    edges = tmp_path / "edges.tsv"
    edges.write_text("a\tr\tb\nb\tr\tc\nc\ts\ta\nlonger-than-eight-bytes\tr\ta\n\tr\tb\n")
    config = _import_config(tmp_path, partitions=2, dynamic_relations=True, global_emb=False)
    argv = ["import", str(config), str(edges), "-l", "0", "-r", "2", "--rel-col", "1", "--skip-bad-rows"]
    run = subprocess.run([sys.executable, "-c", LOADED, *argv, ",".join(UNUSED)], capture_output=True, text=True,
                         cwd=REPO)
    assert run.returncode == 0, run.stderr
    assert "loaded: none" in run.stdout
    assert "collector: True True" in run.stdout  # back on, nothing left frozen for the teardown
    counts = [int((tmp_path / "entities" / f"entity_count_all_{p}.txt").read_text()) for p in range(2)]
    assert sum(counts) == 4


def test_the_pods_of_a_local_import_load_none_of_what_they_do_not_use(tmp_path: Path) -> None:
    """Two pods (``--pods 2 --pod-index i``, the Indexed Job's code path: staging, waiting on each other, each
    its share of the buckets), run side by side, each ends with none of ``UNUSED`` loaded."""
    files = []
    for i in range(2):
        files.append(tmp_path / f"edges{i}.tsv")
        files[-1].write_text("".join(f"a{i}-{j}\tr\tb{j}\n" for j in range(20)))  # 40 + 20 ids
    config = _import_config(tmp_path, partitions=2, edge_paths=[str(tmp_path / f"edges_{i}") for i in range(2)])
    argv = ["import", str(config), *map(str, files), "-l", "0", "-r", "2", "--rel-col", "1", "--pods", "2",
            "--staging", str(tmp_path / "staging")]
    pods = [subprocess.Popen([sys.executable, "-c", LOADED, *argv, "--pod-index", str(i), ",".join(UNUSED)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO) for i in range(2)]
    for pod in pods:
        out, err = pod.communicate(timeout=120)
        assert pod.returncode == 0, err
        assert "loaded: none" in out
    counts = [int((tmp_path / "entities" / f"entity_count_all_{p}.txt").read_text()) for p in range(2)]
    assert sum(counts) == 60


# the import parser's start-up in a process of its own or not (a test's, a script's), ended by --help or an error;
# gc.freeze wrapped to count its calls
SETTLE = """
import gc, sys
freezes = []
freeze = gc.freeze
gc.freeze = lambda: (freezes.append(gc.isenabled()), freeze())[1]
from job.cli import main
try:
    main(sys.argv[2:], own_process=sys.argv[1] == "own")
except SystemExit:
    pass
print("collector:", gc.isenabled(), gc.get_freeze_count(), freezes)
"""


@pytest.mark.parametrize("argv", [["import", "--help"], ["import", "c.json"], ["train", "--help"]])
def test_only_an_import_process_of_its_own_freezes_its_start_up(argv: list[str]) -> None:
    """An import process of its own freezes its start-up's objects once, collector off until then; whatever ends
    the command, the collector is back on and nothing is left frozen (a frozen object's finalizer would not run at
    the teardown). A caller's process (own_process=False) and any other command are left as they are."""
    def state(own: bool) -> str:
        run = subprocess.run([sys.executable, "-c", SETTLE, "own" if own else "caller", *argv], capture_output=True,
                             text=True, cwd=REPO, check=True)
        return run.stdout.strip().splitlines()[-1]

    assert state(own=False) == "collector: True 0 []"
    assert state(own=True) == ("collector: True 0 [False]" if argv[0] == "import" else "collector: True 0 []")
