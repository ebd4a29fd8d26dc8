"""A grow journal is confined: it may name only the ``.grow-v{N}/`` staging directories of the config's
``entity_path`` / ``edge_paths`` and the files they publish; anything else is refused before anything is moved
or deleted (a checkpoint directory from elsewhere must not make ``eval`` or ``train`` touch other files).

Planted journals sit beside a real committed version of a real trained model; the template journal is the one a
real ``biggraph grow`` wrote.
"""

from __future__ import annotations

import contextlib
import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from test_grow import COLUMNS, make_trained, run_cli, snapshot

from job.checkpoint.journal import GrowRecord, finish_committed_grow, read_record
from job.checkpoint.journal_checks import GrowInputs
from job.errors import CheckpointError
from job.formats.checkpoint import CheckpointStorage


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A trained model (committed version 2) and the journal a real grow of it wrote (version 3)."""
    trained = make_trained(tmp_path_factory.mktemp("journal") / "trained")
    grown = trained.parent / "grown"
    shutil.copytree(trained, grown)
    with contextlib.chdir(grown):
        assert run_cli("grow", "config.json", "new.tsv", *COLUMNS, "--no-train")[0] == 0
    return trained, json.loads((grown / "model" / "grow.v3.json").read_text())


@pytest.fixture
def model(template: tuple[Path, dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "model-dir"
    shutil.copytree(template[0], root)
    monkeypatch.chdir(root)
    return root


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory beside the model's, with files someone cares about (and a .grow-v2 of its own)."""
    root = tmp_path / "precious"
    (root / ".grow-v2").mkdir(parents=True)
    (root / "keep.txt").write_text("mine\n")
    (root / "entity_count_user_0.txt").write_text("7\n")
    (root / ".grow-v2" / "entity_count_user_0.txt").write_text("9\n")
    return root


def planted(template: dict[str, Any], version: int, **changes: Any) -> dict[str, Any]:
    """The real journal turned into an unpublished journal of ``version``, with ``changes``."""
    journal = copy.deepcopy(template)
    journal["moves"] = [[src.replace(".grow-v3", f".grow-v{version}"), dst] for src, dst in journal["moves"]]
    journal["staging_dirs"] = [d.replace(".grow-v3", f".grow-v{version}") for d in journal["staging_dirs"]]
    journal.update(version=version, from_version=version - 1, published=False)
    journal.update(changes)
    return journal


def plant(journal: dict[str, Any]) -> Path:
    path = Path("model") / f"grow.v{journal['version']}.json"
    path.write_text(json.dumps(journal))
    return path


def plants(outside: Path) -> dict[str, dict[str, Any]]:
    return {
        "staging-dir-outside": {"moves": [], "staging_dirs": [str(outside)]},  # the report
        "another-grow-v-dir": {"moves": [], "staging_dirs": [str(outside / ".grow-v2")]},
        "moves-a-file-out": {"moves": [["entities/.grow-v2/entity_count_user_0.txt", str(outside / "keep.txt")]]},
        "moves-a-file-in": {"moves": [[str(outside / ".grow-v2" / "entity_count_user_0.txt"),
                                       "entities/entity_count_user_0.txt"]]},
        "dot-dot": {"staging_dirs": ["entities/.grow-v2/../../../precious"]},
    }


PLANTS = ["staging-dir-outside", "another-grow-v-dir", "moves-a-file-out", "moves-a-file-in", "dot-dot"]


@pytest.mark.parametrize("command", ["eval", "train", "export"])
@pytest.mark.parametrize("name", PLANTS)
def test_a_planted_journal_beside_the_committed_version_is_refused_and_nothing_is_touched(
        model: Path, outside: Path, template: tuple[Path, dict[str, Any]], command: str, name: str,
        tmp_path: Path) -> None:
    assert CheckpointStorage("model").load_version() == 2
    journal = plant(planted(template[1], 2, **plants(outside)[name]))
    before_model, before_outside = snapshot(model), snapshot(outside)
    extra = ["--out", str(tmp_path / "exported")] if command == "export" else []
    code, _, err = run_cli(command, "config.json", *extra)
    assert code == 2
    line = err.strip().splitlines()[-1]
    assert str(journal) in line and "refusing this journal" in line and "nothing was moved or deleted" in line
    assert snapshot(outside) == before_outside and (outside / ".grow-v2").is_dir()
    assert snapshot(model) == before_model  # the journal and the model's input untouched too


@pytest.mark.parametrize("name", PLANTS)
def test_train_refuses_a_planted_uncommitted_journal_instead_of_cleaning_up_what_it_names(
        model: Path, outside: Path, template: tuple[Path, dict[str, Any]], name: str) -> None:
    journal = plant(planted(template[1], 3, **plants(outside)[name]))  # after the committed version 2
    before = snapshot(outside)
    code, _, err = run_cli("train", "config.json")
    assert code == 2 and str(journal) in err
    assert snapshot(outside) == before and journal.exists()


def test_a_published_journal_is_only_read_so_eval_may_name_other_edge_paths(
        model: Path, template: tuple[Path, dict[str, Any]]) -> None:
    """After a grow, ``eval -p edge_paths=[...]`` (a test split) reads the journal but touches nothing it names."""
    plant(planted(template[1], 2, published=True))
    shutil.copytree("edges", "held-out")
    code, _, err = run_cli("eval", "config.json", "-p", "edge_paths=held-out")
    assert code == 0, err
    # unpublished, the same journal names files outside held-out/: finishing it needs the config that grew it
    plant(planted(template[1], 2))
    code, _, err = run_cli("eval", "config.json", "-p", "edge_paths=held-out")
    assert code == 2 and "finish it with the config that grew this model" in err


def test_a_resumed_grow_refuses_boundaries_that_do_not_fit_the_config(model: Path,
                                                                     template: tuple[Path, dict[str, Any]]) -> None:
    plant(planted(template[1], 2, published=True, files=[{"url": "new.tsv", "size": Path("new.tsv").stat().st_size}],
                  boundaries=[[1, 2, 3]]))  # 4 buckets (user: 2 partitions)
    code, _, err = run_cli("grow", "config.json", "new.tsv", *COLUMNS)
    assert code == 2 and "grow.v2.json: its 'boundaries' are not one list of 4 bucket edge counts" in err


def test_without_a_config_a_journal_is_held_to_its_own_recorded_input(
        model: Path, outside: Path, template: tuple[Path, dict[str, Any]]) -> None:
    """What ``Trainer`` still calls (the checkpoint path alone): the issue's journal is refused there too."""
    plant(planted(template[1], 2, moves=[], staging_dirs=[str(outside)]))
    with pytest.raises(CheckpointError, match="refusing this journal"):
        finish_committed_grow("model")
    recorded = json.loads(template[1]["config_json"])
    recorded["entity_path"] = str(outside)  # a journal may not widen its own confinement past .grow-v{N}/
    plant(planted(template[1], 2, moves=[], staging_dirs=[str(outside)], config_json=json.dumps(recorded)))
    with pytest.raises(CheckpointError, match="refusing this journal"):
        finish_committed_grow("model")
    assert (outside / "keep.txt").exists()


def test_a_journal_unpublished_by_a_crash_is_still_published(model: Path, template: tuple[Path, dict[str, Any]]) -> None:
    """The real journal, committed but not published, from a config spelling the same input absolutely."""
    journal = plant(planted(template[1], 2))
    for src, _ in json.loads(journal.read_text())["moves"]:  # the staged files the grow wrote
        Path(src).parent.mkdir(parents=True, exist_ok=True)
        Path(src).write_bytes(Path(src.replace("/.grow-v2", "")).read_bytes())
    config = json.loads(Path("config.json").read_text())
    config.update(entity_path=str(model / "entities"), edge_paths=[str(model / "edges")])
    finish_committed_grow("model", inputs=GrowInputs.of(config))
    assert json.loads(journal.read_text())["published"] is True
    assert not list(model.rglob(".grow-v*"))


# the rules, one path at a time -------------------------------------------------------------------------

INPUTS = GrowInputs("/data/model/entities", ("/data/model/edges", "s3://bucket/model/edges"))
GOOD = {  # staged -> final, as a grow of version 3 writes them
    "local": ["/data/model/entities/.grow-v3/entity_count_user_0.txt", "/data/model/entities/entity_count_user_0.txt"],
    "remote": ["s3://bucket/model/edges/.grow-v3/edges_0_0.h5", "s3://bucket/model/edges/edges_0_0.h5"],
}


def journal_text(moves: list[list[str]], staging_dirs: list[str], **changes: Any) -> str:
    data = {"version": 3, "from_version": 2, "files": [{"url": "new.tsv", "size": 10}], "options": {},
            "moves": moves, "staging_dirs": staging_dirs, "config_json": json.dumps({"entity_path": "e", "edge_paths": ["d"]}),
            "boundaries": [[0, 1]], "new_entities": {"user": 1}, "new_relations": [], "new_edges": 1,
            "init": "neighbours", "published": False}
    data.update(changes)
    return json.dumps(data)


def read(text: str, version: int | None = 3) -> GrowRecord:
    return GrowRecord.from_json("s3://ckpt/grow.v3.json", text, version).confined("s3://ckpt/grow.v3.json", INPUTS)


def test_a_real_shape_is_accepted_and_its_urls_rebuilt_from_the_config() -> None:
    record = read(journal_text([GOOD["local"], GOOD["remote"]], ["/data/model/entities/.grow-v3/",
                                                                  "s3://bucket/model/edges/.grow-v3"]))
    assert record.moves == [GOOD["local"], GOOD["remote"]]
    assert record.staging_dirs == ["/data/model/entities/.grow-v3", "s3://bucket/model/edges/.grow-v3"]
    # the same local files spelt otherwise (file://, a redundant ./) are the same files
    record = read(journal_text([["file:///data/model/entities/./.grow-v3/a.txt", "/data/./model/entities/a.txt"]],
                               ["file:///data/model/entities/.grow-v3"]))
    assert record.moves == [["/data/model/entities/.grow-v3/a.txt", "/data/model/entities/a.txt"]]


BAD_PATHS = {  # (moves, staging_dirs, the path named; None: the first that is not GOOD)
    "dot-dot-staged": ([["/data/model/entities/.grow-v3/../../../etc/passwd", "/data/model/entities/passwd"]], [], None),
    "dot-dot-final": ([[GOOD["local"][0], "/data/model/entities/../../../etc/entity_count_user_0.txt"]], [], None),
    "dot-dot-staging-dir": ([], ["/data/model/entities/.grow-v3/.."], None),
    "dot-dot-remote": ([["s3://bucket/model/edges/.grow-v3/../../x/edges_0_0.h5", GOOD["remote"][1]]], [], None),
    "absolute-elsewhere": ([], ["/etc/.grow-v3"], None),
    "prefix-model2": ([], ["/data/model2/entities/.grow-v3"], None),
    "prefix-entities2": ([], ["/data/model/entities2/.grow-v3"], None),
    "the-input-itself": ([], ["/data/model/entities"], None),
    "another-version": ([], ["/data/model/entities/.grow-v30"], None),
    "prefix-staged-file": ([["/data/model/entities/.grow-v3x/a.txt", "/data/model/entities/a.txt"]], [], None),
    "other-scheme-staging": ([], ["memory:///data/model/entities/.grow-v3"], None),
    "other-scheme-final": ([[GOOD["local"][0], "s3://data/model/entities/entity_count_user_0.txt"]], [], None),
    "other-bucket": ([], ["s3://bucket2/model/edges/.grow-v3"], None),
    "nested-staged-file": ([["/data/model/entities/.grow-v3/sub/a.txt", "/data/model/entities/sub/a.txt"]], [], None),
    "renamed-on-publish": ([["/data/model/entities/.grow-v3/a.txt", "/data/model/entities/b.txt"]], [],
                           "/data/model/entities/b.txt"),
    "published-elsewhere": ([["/data/model/entities/.grow-v3/a.txt", "/data/model/edges/a.txt"]], [], "/data/model/edges/a.txt"),
    "staging-dir-as-file": ([["/data/model/entities/.grow-v3", "/data/model/entities"]], [], None),
    "trailing-slash": ([["/data/model/entities/.grow-v3/a/", "/data/model/entities/a"]], [], None),
    "relative-elsewhere": ([], ["../elsewhere/.grow-v3"], None),
}


@pytest.mark.parametrize("case", list(BAD_PATHS))
def test_a_path_outside_the_staging_directories_is_refused_by_name(case: str) -> None:
    moves, staging_dirs, offending = BAD_PATHS[case]
    if offending is None:
        offending = next(p for pair in moves for p in pair if p not in GOOD["local"] + GOOD["remote"]) if moves \
            else staging_dirs[0]
    with pytest.raises(CheckpointError) as caught:
        read(journal_text(moves, staging_dirs))
    message = str(caught.value)
    assert message.startswith("s3://ckpt/grow.v3.json: names ") and f"names {offending}," in message
    assert "nothing was moved or deleted" in message


BAD_SHAPES = {
    "a list": ("[]", "holds a JSON list"),
    "not JSON": ("{", "not a grow journal"),
    "missing key": (json.dumps({k: v for k, v in json.loads(journal_text([], [])).items() if k != "moves"}), "no 'moves'"),
    "unknown key": (journal_text([], [], extra=1), "unknown key 'extra'"),
    "wrong type": (journal_text([], [], version="3"), "'version' is a str"),
    "bool as int": (journal_text([], [], new_edges=True), "'new_edges' is a bool"),
    "negative": (journal_text([], [], from_version=-1), "'from_version' is negative"),
    "other version": (journal_text([], [], version=4, from_version=3), "'version' is 4 but the file is the journal of version 3"),
    "backwards": (journal_text([], [], from_version=3), "'from_version' 3 is not before"),
    "move of three": (journal_text([[GOOD["local"][0], GOOD["local"][1], "x"]], []), "a move is"),
    "staging not a path": (journal_text([], [3]), "'staging_dirs' holds"),
    "boundaries": (journal_text([], [], boundaries=[[-1]]), "'boundaries' holds"),
    "files": (journal_text([], [], files=[{"url": 1}]), "'files' holds"),
    "config_json": (journal_text([], [], config_json="[]"), "'config_json' is not a JSON object"),
}


@pytest.mark.parametrize("case", list(BAD_SHAPES))
def test_a_journal_of_the_wrong_shape_is_refused(case: str) -> None:
    text, expected = BAD_SHAPES[case]
    with pytest.raises(CheckpointError, match="^s3://ckpt/grow.v3.json: ") as caught:
        read(text)
    assert expected in str(caught.value)


def test_read_record_takes_the_version_from_the_file_name(tmp_path: Path) -> None:
    path = tmp_path / "grow.v5.json"
    path.write_text(journal_text([], []))
    with pytest.raises(CheckpointError, match="but the file is the journal of version 5"):
        read_record(str(path))
