"""The ``biggraph`` command line itself: ``-p`` overrides where users put them, errors that blame the
override rather than the file, and a reader that closes the pipe early (``| head``) ending it quietly."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

from job.cli import EXIT_BROKEN_PIPE, add_config_arguments, build_parser, main, overrides_of

sys.path.insert(0, str(Path(__file__).parent))
from helpers_graphs import SmallGraph, make_graph  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def graph(tmp_path: Path) -> SmallGraph:
    return make_graph(tmp_path, counts={"user": [8, 6], "item": [5, 4]})


# -p: one value each, repeatable, before or after CONFIG ----------------------------------------------------


@pytest.mark.parametrize("argv", [
    ["train", "-p", "num_epochs=1", "cfg.yaml", "-p", "lr=0.5"],
    ["train", "-p", "num_epochs=1", "-p", "lr=0.5", "cfg.yaml"],
    ["train", "cfg.yaml", "-p", "num_epochs=1", "--param", "lr=0.5"],
    ["train", "-pnum_epochs=1", "cfg.yaml", "--param=lr=0.5"],
])
def test_p_takes_one_value_and_config_may_come_before_or_after(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    assert args.config == "cfg.yaml"
    assert overrides_of(args) == ["num_epochs=1", "lr=0.5"]


def test_no_p_gives_no_overrides() -> None:
    assert overrides_of(build_parser().parse_args(["eval", "cfg.yaml"])) == []


def test_config_arguments_stay_importable_from_job_cli() -> None:
    from job.cli import common

    assert add_config_arguments is common.add_config_arguments and overrides_of is common.overrides_of


def test_p_before_config_reaches_the_command(graph: SmallGraph, capsys: pytest.CaptureFixture[str]) -> None:
    """The config file points nowhere; only both overrides, one on each side of it, make it valid."""
    config = graph.write_config(entity_path=str(graph.root / "nowhere"), edge_paths=[str(graph.root / "nor-here")])
    code, out, err = run(capsys, "validate", "--cheap", "-p", f"entity_path={graph.entity_path}", str(config),
                         "-p", f"edge_paths={graph.edge_path}")
    assert code == 0, err
    assert "arguments are required" not in err and out.startswith("ok:")


def test_old_multi_value_p_is_refused_by_argparse(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["train", "-p", "num_epochs=1", "lr=0.5", "cfg.yaml"])
    assert info.value.code == 2
    assert "unrecognized arguments: cfg.yaml" in capsys.readouterr().err


# errors name the override that caused them -------------------------------------------------------------------


def test_override_error_names_the_override_not_the_file(graph: SmallGraph, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "validate", "-p", "num_epochs=-1", str(graph.config_path))
    assert code == 2
    assert err == "biggraph validate: error: -p num_epochs=-1: config key 'num_epochs': must be a positive integer, " \
                  "got -1\n"
    assert str(graph.config_path) not in err


def test_file_error_still_names_the_file(graph: SmallGraph, capsys: pytest.CaptureFixture[str]) -> None:
    config = graph.write_config(num_epochs=0)
    code, _, err = run(capsys, "validate", str(config), "-p", "lr=0.5")
    assert code == 2
    assert err == f"biggraph validate: error: {config}: config key 'num_epochs': must be a positive integer, got 0\n"


def test_misspelt_override_gets_did_you_mean(graph: SmallGraph, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "validate", "-p", "num_epoch=3", str(graph.config_path))
    assert code == 2 and err.count("\n") == 1
    assert "'num_epoch'" in err and "(did you mean 'num_epochs'?)" in err
    code, _, err = run(capsys, "validate", "-p", "entities.user.num_partition=3", str(graph.config_path))
    assert code == 2 and "(did you mean 'entities.user.num_partitions'?)" in err


def test_combination_error_names_every_override_involved(graph: SmallGraph,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "validate", "-p", "num_batch_negs=7", str(graph.config_path), "-p", "batch_size=20",
                       "-p", "lr=0.5")
    assert code == 2
    assert "error: -p num_batch_negs=7 -p batch_size=20: config key 'batch_size': 20 must be a multiple" in err


# a closed stdout ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(not hasattr(fcntl, "F_SETPIPE_SZ"), reason="needs Linux's F_SETPIPE_SZ")
def test_closed_pipe_ends_quietly_with_141() -> None:
    """``biggraph config-help | head -1``: the reader leaves after one line, while the writer still writes."""
    read_end, write_end = os.pipe()
    # The help is ~13 kB: it would fit a default 64 kB pipe and never see the close. With one page of
    # buffer the writer is still blocked in write() when the reader goes away, as with a long output.
    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 4096)
    process = subprocess.Popen([sys.executable, "-m", "job", "config-help"], stdout=write_end,
                               stderr=subprocess.PIPE, cwd=REPO)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as reader:
        first = reader.readline()
    _, stderr = process.communicate(timeout=60)
    assert first.startswith(b"entities  [")
    assert process.returncode == EXIT_BROKEN_PIPE, stderr.decode()
    assert stderr == b"", stderr.decode()


def test_config_help_into_an_open_pipe_still_succeeds() -> None:
    result = subprocess.run([sys.executable, "-m", "job", "config-help"], capture_output=True, cwd=REPO, timeout=60)
    assert result.returncode == 0 and result.stderr == b""
    assert result.stdout.count(b"\n") > 100


@pytest.mark.skipif(sys.platform != "linux", reason="elsewhere any BrokenPipeError counts as stdout's")
def test_is_broken_pipe_tells_a_closed_reader_from_an_open_one() -> None:
    from job.cli import _is_broken_pipe

    read_end, write_end = os.pipe()
    try:
        assert not _is_broken_pipe(write_end)
        os.close(read_end)
        assert _is_broken_pipe(write_end)
    finally:
        os.close(write_end)
    assert not _is_broken_pipe(None)


def test_a_broken_pipe_elsewhere_keeps_its_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a closed stdout is quiet: a socket or worker pipe breaking is a real error."""
    import job.cli

    def broken(verbose: bool, log_format: str) -> None:
        raise BrokenPipeError("a worker's pipe")

    monkeypatch.setattr(job.cli, "setup_logging", broken)
    with pytest.raises(BrokenPipeError, match="a worker's pipe"):
        main(["config-help"])
