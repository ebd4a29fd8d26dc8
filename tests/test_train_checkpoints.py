"""Checkpoints of a training run: resume equals an uninterrupted run, uncommitted leftovers go, PBG's layout
and metadata, epoch snapshots, init_path, seeded reproducibility."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import h5py
import numpy as np
import torch

from job.config import parse_config
from job.formats.checkpoint import CheckpointStorage
from job.train import train

sys.path.insert(0, str(Path(__file__).parent))
from helpers_graphs import assert_same_run, write_cycle_graph  # noqa: E402


def test_resume_gives_the_same_result_as_an_uninterrupted_run(tmp_path: Path) -> None:
    straight = write_cycle_graph(tmp_path / "a", num_partitions=2, num_epochs=4)
    train(parse_config(straight))
    resumed = write_cycle_graph(tmp_path / "b", num_partitions=2, num_epochs=4)
    config = parse_config(resumed)
    train(config, stop_after_iterations=2)
    assert CheckpointStorage(config.checkpoint_path).load_version() == 2
    train(config)  # a new process would do exactly this: read version 2 and go on
    a = CheckpointStorage(straight["checkpoint_path"])
    b = CheckpointStorage(resumed["checkpoint_path"])
    assert a.load_version() == b.load_version() == 4
    for part in range(2):
        emb_a, state_a = a.load_entity_partition(4, "node", part)
        emb_b, state_b = b.load_entity_partition(4, "node", part)
        assert_same_run(emb_a, emb_b)
        torch.testing.assert_close(state_a["state"][0]["sum"], state_b["state"][0]["sum"])
    params_a, _, _ = a.load_model(4)
    params_b, _, _ = b.load_model(4)
    assert params_a.keys() == params_b.keys()
    for name in params_a:
        assert_same_run(params_a[name], params_b[name])


def test_uncommitted_leftovers_are_dropped_on_resume(tmp_path: Path) -> None:
    raw = write_cycle_graph(tmp_path, num_epochs=2)
    config = parse_config(raw)
    train(config, stop_after_iterations=1)
    # a crash while writing version 2: half a file exists, the marker still says 1
    (Path(config.checkpoint_path) / "embeddings_node_0.v2.h5").write_bytes(b"\x89HDF\r\n\x1a\n garbage")
    train(config)
    assert CheckpointStorage(config.checkpoint_path).load_version() == 2
    with h5py.File(Path(config.checkpoint_path) / "embeddings_node_0.v2.h5") as handle:
        assert handle["embeddings"].shape == (40, 16)


def test_checkpoint_layout_and_metadata_follow_pbg(tmp_path: Path) -> None:
    raw = write_cycle_graph(tmp_path, num_epochs=1)
    config = parse_config(raw)
    train(config)
    root = Path(config.checkpoint_path)
    assert (root / "checkpoint_version.txt").read_text().strip() == "1"
    assert json.loads((root / "config.json").read_text())["dimension"] == 16
    with h5py.File(root / "model.v1.h5") as handle:
        assert handle.attrs["format_version"] == 1
        assert json.loads(handle.attrs["config/json"])["relations"][0]["name"] == "r0"
        assert handle.attrs["iteration/epoch_idx"] == 0
        names: list[str] = []
        handle["model"].visit(names.append)
        assert "relations/0/operator/rhs/translation" in names
        assert "entities/node/global_embedding" in names
        assert handle["model/relations/1/operator/rhs/translation"].attrs["state_dict_key"] == "rhs_operators.1.translation"
        assert "optimizer/state_dict" in handle
    with h5py.File(root / "embeddings_node_0.v1.h5") as handle:
        assert handle["embeddings"].shape == (40, 16)
        assert handle["embeddings"].dtype == np.float32


def test_preservation_interval_keeps_epoch_snapshots(tmp_path: Path) -> None:
    raw = write_cycle_graph(tmp_path, num_epochs=4, checkpoint_preservation_interval=2)
    config = parse_config(raw)
    train(config)
    root = Path(config.checkpoint_path)
    for epoch, version in ((1, 2), (3, 4)):
        snapshot = CheckpointStorage(str(root / f"epoch_{epoch}"))
        assert snapshot.load_version() == version
        embeddings, _ = snapshot.load_entity_partition(version, "node", 0)
        assert embeddings.shape == (40, 16)
    assert not (root / "model.v3.h5").exists()


def test_init_path_starts_from_given_embeddings(tmp_path: Path) -> None:
    first = write_cycle_graph(tmp_path / "first", num_epochs=3)
    train(parse_config(first))
    second = write_cycle_graph(tmp_path / "second", num_epochs=1, init_path=first["checkpoint_path"], lr=1e-9)
    train(parse_config(second))
    a, _ = CheckpointStorage(first["checkpoint_path"]).load_entity_partition(3, "node", 0)
    b, _ = CheckpointStorage(second["checkpoint_path"]).load_entity_partition(1, "node", 0)
    np.testing.assert_allclose(a, b, atol=1e-5)


def test_seeded_single_worker_runs_are_reproducible(tmp_path: Path) -> None:
    for name in ("a", "b"):
        train(parse_config(write_cycle_graph(tmp_path / name, num_epochs=2)))
    a, _ = CheckpointStorage(str(tmp_path / "a" / "checkpoints")).load_entity_partition(2, "node", 0)
    b, _ = CheckpointStorage(str(tmp_path / "b" / "checkpoints")).load_entity_partition(2, "node", 0)
    assert_same_run(a, b)
