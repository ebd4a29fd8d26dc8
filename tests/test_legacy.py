"""``biggraph convert-legacy``: legacy counts, edges and checkpoints become v1, and unsafe .pt files are refused.

The fixtures are written with ``torch.save`` exactly as the legacy spec describes them
(pbg-data-model-and-legacy-format.rst); results are read back with the v1 readers.
"""

from __future__ import annotations

import json
import pickle
import shutil
import sys
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch

from job.cli import main
from job.config import parse_config
from job.data.legacy import convert_checkpoint, convert_edges, map_legacy_config, map_state_dict_key, safe_torch_load
from job.errors import UserError
from job.formats.checkpoint import CheckpointStorage
from job.formats.entities import read_dynamic_rel_count, read_entity_count

sys.path.insert(0, str(Path(__file__).parent))
from helpers_graphs import SmallGraph, make_graph  # noqa: E402

DIM = 4


class Evil:
    """Unpickling this would create the marker file: loading must refuse it before that."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


class Custom:
    """A harmless custom class: weights_only refuses it too (it is not a tensor or plain value)."""


def adagrad_state(rows: int, seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "state": {0: {"step": torch.tensor(7.0), "sum": torch.rand(rows, generator=gen)}},
        "param_groups": [{"lr": 0.1, "lr_decay": 0, "initial_accumulator_value": 0.0, "eps": 1e-10, "params": [0]}],
    }


def legacy_config(root: Path) -> dict[str, Any]:
    return {
        "entities": {"user": {"numPartitions": 2}, "item": {"numPartitions": 2}},
        "relations": [
            {"name": "buys", "lhs": "user", "rhs": "item", "operator": "diagonal"},
            {"name": "follows", "lhs": "user", "rhs": "user", "operator": "translation"},
        ],
        "dimension": DIM,
        "entityPath": str(root / "old_entities"),
        "edgePaths": [str(root / "old_edges")],
        "outdir": str(root / "old_ckpt"),
        "numEpochs": 3,
        "lossFn": "ranking",
        "initScale": 0.01,
        "someAncientKey": True,
    }


def write_legacy_checkpoint(root: Path, counts: dict[str, list[int]], version: int = 2) -> dict[str, Any]:
    """A legacy checkpoint at version ``version`` (plus a stale older one); returns what it holds."""
    ckpt = root / "old_ckpt"
    ckpt.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    state_dict = {
        "rhs_operators.0.diagonal": torch.nn.Parameter(torch.rand(DIM, generator=gen)),
        "rhs_operators.1.translation": torch.nn.Parameter(torch.rand(DIM, generator=gen)),
        "global_embs.emb_user": torch.nn.Parameter(torch.rand(DIM, generator=gen)),
        "global_embs.emb_item": torch.nn.Parameter(torch.rand(DIM, generator=gen)),
    }
    model_optimizer = adagrad_state(DIM, 99)
    torch.save((legacy_config(root), 7, 11, state_dict, model_optimizer), ckpt / f"METADATA_1.pt.{version}")
    embeddings = {}
    for entity_type, per_part in counts.items():
        for part, count in enumerate(per_part):
            emb = torch.nn.Parameter(torch.rand(count, DIM, generator=gen))
            optimizer = adagrad_state(count, part)
            torch.save((emb, optimizer), ckpt / f"{entity_type}_{part + 1}.pt.{version}")
            torch.save((torch.zeros(count, DIM), None), ckpt / f"{entity_type}_{part + 1}.pt.{version - 1}")
            embeddings[(entity_type, part)] = (emb.detach().clone(), optimizer)
    (ckpt / "CHECKPOINT_VERSION").write_text(f"{version}\n")
    return {"state_dict": state_dict, "optimizer": model_optimizer, "embeddings": embeddings}


def legacy_inputs(graph: SmallGraph, root: Path) -> tuple[Path, Path]:
    """The graph's counts as legacy .pt files and its buckets without format_version."""
    entities, edges = root / "old_entities", root / "old_edges"
    entities.mkdir()
    for entity_type, per_part in graph.counts.items():
        for part, count in enumerate(per_part):
            torch.save(count, entities / f"entity_count_{entity_type}_{part}.pt")
    shutil.copytree(graph.edge_path, edges)
    for path in edges.glob("*.h5"):
        with h5py.File(path, "r+") as handle:
            del handle.attrs["format_version"]
    return entities, edges


@pytest.fixture
def graph(tmp_path: Path) -> SmallGraph:
    return make_graph(tmp_path / "v1", counts={"user": [8, 6], "item": [5, 4]})


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["convert-legacy", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# Entity counts and edges ---------------------------------------------------------------------------------


def test_inputs_convert_and_then_validate(graph: SmallGraph, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old_entities, old_edges = legacy_inputs(graph, tmp_path)
    torch.save(3, old_entities / "dynamic_rel_count.pt")
    (old_entities / "entity_names_user_0.json").write_text('["a"]')
    new_entities, new_edges = tmp_path / "new_entities", tmp_path / "new_edges"
    code, out, err = run(
        capsys, "--entity-path", str(old_entities), "--out", str(new_entities),
        "--edge-path", str(old_edges), "--edge-out", str(new_edges),
    )
    assert code == 0, err
    assert "entity counts: 4 files" in out and "edges: 4 files" in out
    assert read_entity_count(str(new_entities), "user", 1) == 6
    assert read_entity_count(str(new_entities), "item", 0) == 5
    assert read_dynamic_rel_count(str(new_entities)) == 3
    assert (new_entities / "entity_names_user_0.json").read_text() == '["a"]'
    for (lhs, rhs), (rel, lhs_ids, rhs_ids) in graph.edges.items():
        with h5py.File(new_edges / f"edges_{lhs}_{rhs}.h5", "r") as handle:
            assert handle.attrs["format_version"] == 1
            np.testing.assert_array_equal(handle["rel"][...], rel)
            np.testing.assert_array_equal(handle["lhs"][...], lhs_ids)
            np.testing.assert_array_equal(handle["rhs"][...], rhs_ids)
        with h5py.File(old_edges / f"edges_{lhs}_{rhs}.h5", "r") as handle:
            assert "format_version" not in handle.attrs  # the originals are untouched
    graph.write_config(entity_path=str(new_entities), edge_paths=[str(new_edges)])
    assert main(["validate", str(graph.config_path)]) == 0


def test_edges_in_place(graph: SmallGraph, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, old_edges = legacy_inputs(graph, tmp_path)
    assert run(capsys, "--edge-path", str(old_edges), "--edge-out", str(old_edges))[0] == 0
    with h5py.File(old_edges / "edges_1_0.h5", "r") as handle:
        assert handle.attrs["format_version"] == 1


def test_edges_with_another_format_version_are_refused(graph: SmallGraph, tmp_path: Path) -> None:
    _, old_edges = legacy_inputs(graph, tmp_path)
    with h5py.File(old_edges / "edges_0_1.h5", "r+") as handle:
        handle.attrs["format_version"] = 2
    with pytest.raises(UserError, match=r"edges_0_1\.h5: format_version is 2 \(expected no format_version \(legacy\) or 1\)"):
        convert_edges(str(old_edges), str(tmp_path / "out"))


def test_edges_missing_dataset_is_refused(graph: SmallGraph, tmp_path: Path) -> None:
    _, old_edges = legacy_inputs(graph, tmp_path)
    with h5py.File(old_edges / "edges_1_1.h5", "r+") as handle:
        del handle["lhs"]
    with pytest.raises(UserError, match=r"edges_1_1\.h5 dataset 'lhs': missing"):
        convert_edges(str(old_edges), str(tmp_path / "out"))


def test_one_based_counts_are_detected(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = tmp_path / "old"
    old.mkdir()
    torch.save(4, old / "entity_count_user_1.pt")
    torch.save(torch.tensor(9), old / "entity_count_user_2.pt")  # a 0-d tensor is accepted too
    assert run(capsys, "--entity-path", str(old), "--out", str(tmp_path / "new"))[0] == 0
    assert read_entity_count(str(tmp_path / "new"), "user", 0) == 4
    assert read_entity_count(str(tmp_path / "new"), "user", 1) == 9
    code, _, err = run(capsys, "--entity-path", str(old), "--out", str(tmp_path / "new2"), "--count-base", "0")
    assert code == 2
    assert "count files of entity type 'user': partitions 1,2 are not contiguous from 0 (missing 0)" in err


@pytest.mark.parametrize(
    ("value", "message"),
    [("12", "holds a str (expected a torch.save'd non-negative integer)"), (-2, "negative count -2"), (3.5, "holds a float")],
)
def test_bad_legacy_count(tmp_path: Path, capsys: pytest.CaptureFixture[str], value: Any, message: str) -> None:
    old = tmp_path / "old"
    old.mkdir()
    torch.save(value, old / "entity_count_user_0.pt")
    code, _, err = run(capsys, "--entity-path", str(old), "--out", str(tmp_path / "new"))
    assert code == 2
    assert f"{old / 'entity_count_user_0.pt'}: {message}" in err


# Checkpoints ----------------------------------------------------------------------------------------------------


def test_checkpoint_converts_with_values(graph: SmallGraph, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    old_entities, old_edges = legacy_inputs(graph, tmp_path)
    legacy = write_legacy_checkpoint(tmp_path, graph.counts)
    new = tmp_path / "new_ckpt"

    original_save_version = CheckpointStorage.save_version

    def save_version_last(self: CheckpointStorage, version: int) -> None:
        assert (new / f"model.v{version}.h5").exists() and (new / "config.json").exists()
        assert len(list(new.glob(f"embeddings_*.v{version}.h5"))) == 4
        original_save_version(self, version)

    monkeypatch.setattr(CheckpointStorage, "save_version", save_version_last)
    code, out, err = run(
        capsys, "--entity-path", str(old_entities), "--out", str(tmp_path / "new_entities"),
        "--edge-path", str(old_edges), "--edge-out", str(tmp_path / "new_edges"),
        "--checkpoint", str(tmp_path / "old_ckpt"), "--checkpoint-out", str(new),
    )
    assert code == 0, err
    assert f"checkpoint: version 2 -> {new}" in out
    target = CheckpointStorage(str(new))
    assert target.load_version() == 2
    for (entity_type, part), (emb, optimizer) in legacy["embeddings"].items():
        loaded, loaded_optimizer = target.load_entity_partition(2, entity_type, part)
        np.testing.assert_array_equal(loaded, emb.numpy())
        assert loaded_optimizer is not None
        assert torch.equal(loaded_optimizer["state"][0]["sum"], optimizer["state"][0]["sum"])
        assert loaded_optimizer["param_groups"] == optimizer["param_groups"]
    params, model_optimizer, metadata = target.load_model(2)
    expected = {
        "relations/0/operator/rhs/diagonal": "rhs_operators.0.diagonal",
        "relations/1/operator/rhs/translation": "rhs_operators.1.translation",
        "entities/user/global_embedding": "global_embs.emb_user",
        "entities/item/global_embedding": "global_embs.emb_item",
    }
    assert set(params) == set(expected)
    with h5py.File(new / "model.v2.h5", "r") as handle:
        for public, private in expected.items():
            assert handle["model"][public].attrs["state_dict_key"] == private
            np.testing.assert_array_equal(params[public], legacy["state_dict"][private].detach().numpy())
    assert model_optimizer is not None
    assert torch.equal(model_optimizer["state"][0]["sum"], legacy["optimizer"]["state"][0]["sum"])
    assert metadata["legacy/metadata_int_1"] == 7 and metadata["legacy/metadata_int_2"] == 11
    config = parse_config(json.loads((new / "config.json").read_text()))
    assert config.checkpoint_path == str(new)
    assert config.entity_path == str(tmp_path / "new_entities")
    assert config.edge_paths == [str(tmp_path / "new_edges")]
    assert config.num_epochs == 3 and config.init_scale == 0.01
    assert [r.operator for r in config.relations] == ["diagonal", "translation"]
    assert json.loads(metadata["config/json"])["num_epochs"] == 3


def test_embeddings_only_unversioned_directory(tmp_path: Path) -> None:
    """An initial-embeddings directory: no METADATA, no CHECKPOINT_VERSION, no suffixes, old torch format."""
    old = tmp_path / "init"
    old.mkdir()
    emb = torch.rand(3, DIM)
    torch.save(emb, old / "user_1.pt", _use_new_zipfile_serialization=False)
    version = convert_checkpoint(str(old), str(tmp_path / "out"))
    assert version == 1
    target = CheckpointStorage(str(tmp_path / "out"))
    assert target.load_version() == 1
    loaded, optimizer = target.load_entity_partition(1, "user", 0)
    np.testing.assert_array_equal(loaded, emb.numpy())
    assert optimizer is None
    assert target.load_model(1)[0] == {}


def test_embedding_count_mismatch_is_refused(graph: SmallGraph, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old_entities, _ = legacy_inputs(graph, tmp_path)
    torch.save(99, old_entities / "entity_count_item_1.pt")
    write_legacy_checkpoint(tmp_path, graph.counts)
    code, _, err = run(
        capsys, "--entity-path", str(old_entities), "--out", str(tmp_path / "e"),
        "--checkpoint", str(tmp_path / "old_ckpt"), "--checkpoint-out", str(tmp_path / "c"),
    )
    assert code == 2
    bad = tmp_path / "old_ckpt" / "item_2.pt.2"
    assert f"{bad}: has 4 embeddings (expected 99, the entity count of 'item' partition 1)" in err
    assert not (tmp_path / "c" / "checkpoint_version.txt").exists()


def test_unmapped_state_dict_key_is_refused(tmp_path: Path) -> None:
    ckpt = tmp_path / "old"
    ckpt.mkdir()
    torch.save(({"dimension": DIM}, 0, 0, {"mystery.weight": torch.ones(2)}, None), ckpt / "METADATA_1.pt")
    torch.save((torch.ones(2, DIM), None), ckpt / "user_1.pt")
    with pytest.raises(UserError, match=r"METADATA_1\.pt: model state dict key 'mystery\.weight' has no v1 name"):
        convert_checkpoint(str(ckpt), str(tmp_path / "out"))


def test_bad_metadata_tuple_is_refused(tmp_path: Path) -> None:
    ckpt = tmp_path / "old"
    ckpt.mkdir()
    torch.save(({}, 0, {}), ckpt / "METADATA_1.pt.1")
    (ckpt / "CHECKPOINT_VERSION").write_text("1")
    with pytest.raises(UserError, match=r"METADATA_1\.pt\.1: holds 3 elements \(expected a 5-tuple"):
        convert_checkpoint(str(ckpt), str(tmp_path / "out"))


def test_state_dict_and_config_mapping() -> None:
    assert map_state_dict_key("lhs_operators.3.linear_transformation") == "relations/3/operator/lhs/linear_transformation"
    assert map_state_dict_key("global_embs.emb_user") == "entities/user/global_embedding"
    mapped, notes = map_legacy_config({"numEpochs": 2, "outdir": "x", "loadPath": "y", "bogus": 1,
                                       "entities": {"a": {"numPartitions": 3}}})
    assert mapped == {"num_epochs": 2, "checkpoint_path": "x", "init_path": "y", "entities": {"a": {"num_partitions": 3}}}
    assert "dropped legacy key 'bogus' (no v1 equivalent)" in notes


# Security ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("writer", ["torch.save", "pickle"])
def test_malicious_count_file_is_refused_and_not_executed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], writer: str
) -> None:
    marker = tmp_path / "PWNED"
    old = tmp_path / "old"
    old.mkdir()
    path = old / "entity_count_user_0.pt"
    if writer == "torch.save":
        torch.save(Evil(marker), path)
    else:
        path.write_bytes(pickle.dumps(Evil(marker), protocol=2))  # the protocol legacy torch.save used
    code, _, err = run(capsys, "--entity-path", str(old), "--out", str(tmp_path / "new"))
    assert code == 2
    assert not marker.exists()
    assert f"{path}: refused to load: it references 'exec'" in err
    assert "weights_only=True" in err
    assert "Traceback" not in err


def test_malicious_metadata_and_custom_class_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    marker = tmp_path / "PWNED"
    ckpt = tmp_path / "old"
    ckpt.mkdir()
    torch.save(({}, 0, 0, {}, Evil(marker)), ckpt / "METADATA_1.pt")
    torch.save((torch.ones(2, DIM), None), ckpt / "user_1.pt")
    code, _, err = run(capsys, "--checkpoint", str(ckpt), "--checkpoint-out", str(tmp_path / "out"))
    assert code == 2
    assert not marker.exists()
    assert f"{ckpt / 'METADATA_1.pt'}: refused to load" in err
    (ckpt / "METADATA_1.pt").unlink()
    torch.save((torch.ones(2, DIM), Custom()), ckpt / "user_1.pt")
    with pytest.raises(UserError, match=r"user_1\.pt: refused to load: it references '[\w.]*Custom'"):
        convert_checkpoint(str(ckpt), str(tmp_path / "out"))


def test_parameter_loads_with_weights_only(tmp_path: Path) -> None:
    """torch.nn.Parameter is on weights_only's allow-list (what legacy embeddings often are)."""
    path = tmp_path / "p.pt"
    torch.save(torch.nn.Parameter(torch.ones(2, 2)), path)
    assert isinstance(safe_torch_load(str(path)), torch.nn.Parameter)
    path.write_bytes(b"garbage")
    with pytest.raises(UserError, match=r"p\.pt: not a readable torch\.save file"):
        safe_torch_load(str(path))


def test_flag_pairing_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys)[0] == 2
    code, _, err = run(capsys, "--edge-path", "a", "--edge-path", "b", "--edge-out", "c")
    assert code == 2 and "pair them" in err
    code, _, err = run(capsys, "--checkpoint", "a")
    assert code == 2 and "--checkpoint and --checkpoint-out go together" in err
