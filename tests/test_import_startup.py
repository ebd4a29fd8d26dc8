"""What an import process loads before it reads a byte: only the import command's own parser and what it needs
(each pod of an import pays its start-up; issue #46), with the parse unchanged."""

from __future__ import annotations

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
