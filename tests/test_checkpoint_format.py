"""PBG's checkpoint layout through ``CheckpointStorage``: round trips, the version marker,
snapshots, cleanup of uncommitted versions, and refusing optimizer blobs that would run code."""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch

import storage_adapters
from job.errors import CheckpointError, InputFormatError
from job.formats import checkpoint as checkpoint_module
from job.formats.checkpoint import CheckpointStorage

PARTITIONS = [("user", 0), ("user", 1), ("item", 0)]


def adagrad_state(rows: int, step: int = 3) -> dict[str, Any]:
    """PBG's RowAdagrad state_dict layout: one row-wise sum per embedding row."""
    return {
        "state": {0: {"step": step, "sum": torch.arange(rows, dtype=torch.float32)}},
        "param_groups": [{"lr": 0.1, "initial_accumulator_value": 0.0, "params": [0]}],
    }


def write_version(store: CheckpointStorage, version: int, seed: int = 0) -> dict[tuple[str, int], np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for entity_type, part in PARTITIONS:
        emb = rng.standard_normal((3 + part, 4)).astype(np.float32)
        store.save_entity_partition(version, entity_type, part, emb, adagrad_state(len(emb)))
        out[(entity_type, part)] = emb
    store.save_model(version, {"relations/0/operator/rhs/diagonal": ("rhs_operators.0.diagonal", np.ones(4, np.float32))})
    return out


def test_embeddings_optimizer_and_metadata_round_trip(tmp_path: Path) -> None:
    store = CheckpointStorage(str(tmp_path / "ckpt"))
    store.prepare()
    emb = np.arange(12, dtype=np.float32).reshape(3, 4)
    meta = {"config/json": '{"dimension": 4}', "iteration/num_epochs": 2}
    store.save_entity_partition(1, "user", 0, emb, adagrad_state(3, step=7), meta)
    loaded, optim = store.load_entity_partition(1, "user", 0)
    np.testing.assert_array_equal(loaded, emb)
    assert loaded.dtype == np.float32
    assert optim is not None and optim["state"][0]["step"] == 7
    assert torch.equal(optim["state"][0]["sum"], torch.arange(3, dtype=torch.float32))
    assert optim["param_groups"][0]["lr"] == 0.1
    with h5py.File(tmp_path / "ckpt" / "embeddings_user_0.v1.h5", "r") as handle:
        assert handle.attrs["format_version"] == 1
        assert handle.attrs["config/json"] == '{"dimension": 4}'
        assert handle.attrs["iteration/num_epochs"] == 2
        assert handle["optimizer/state_dict"].dtype == np.dtype("V1")
    out = np.zeros((3, 4), np.float32)
    same, _ = store.load_entity_partition(1, "user", 0, out=out)
    assert same is out and np.array_equal(out, emb)
    with pytest.raises(InputFormatError, match=r"expected \(2, 4\)"):
        store.load_entity_partition(1, "user", 0, out=np.zeros((2, 4), np.float32))


def test_partition_without_optimizer_state(tmp_path: Path) -> None:
    store = CheckpointStorage(str(tmp_path))
    store.save_entity_partition(1, "t", 0, np.zeros((0, 4), np.float32))
    emb, optim = store.load_entity_partition(1, "t", 0)
    assert emb.shape == (0, 4) and optim is None


def test_model_round_trip(tmp_path: Path) -> None:
    store = CheckpointStorage(str(tmp_path))
    state = {
        "relations/0/operator/rhs/linear_transformation": ("rhs_operators.0.linear_transformation", np.eye(3, dtype=np.float32)),
        "entities/user/global_embedding": ("global_embs.emb_user", np.full(3, 0.5, np.float32)),
    }
    store.save_model(2, state, {"state": {}, "param_groups": []}, {"iteration/edge_chunk_idx": 1})
    params, optim, metadata = store.load_model(2)
    assert set(params) == set(state)
    np.testing.assert_array_equal(params["relations/0/operator/rhs/linear_transformation"], np.eye(3))
    assert optim == {"state": {}, "param_groups": []}
    assert metadata["format_version"] == 1 and metadata["iteration/edge_chunk_idx"] == 1
    with h5py.File(tmp_path / "model.v2.h5", "r") as handle:
        assert handle["model/entities/user/global_embedding"].attrs["state_dict_key"] == "global_embs.emb_user"


def test_config_and_stats(tmp_path: Path) -> None:
    store = CheckpointStorage(str(tmp_path))
    with pytest.raises(CheckpointError, match=r"config\.json: missing"):
        store.load_config_dict()
    store.save_config(json.dumps({"dimension": 4}))
    assert store.load_config_dict() == {"dimension": 4}
    assert store.load_stats() == []
    store.append_stats([{"epoch": 0}])
    store.append_stats([{"epoch": 1}, {"epoch": 2}])
    with open(tmp_path / "training_stats.json", "a") as handle:
        handle.write('{"epoch": 3, "lo')  # a crash mid-append
    assert store.load_stats() == [{"epoch": 0}, {"epoch": 1}, {"epoch": 2}]


def test_version_marker_semantics(tmp_path: Path) -> None:
    store = CheckpointStorage(str(tmp_path / "ckpt"))
    assert store.load_version() == 0  # no directory at all
    store.prepare()
    assert store.load_version() == 0
    (tmp_path / "ckpt" / "checkpoint_version.txt").write_text("")  # created but not yet written (PBG tolerates it)
    assert store.load_version() == 0
    write_version(store, 1)
    store.save_version(1)
    assert (tmp_path / "ckpt" / "checkpoint_version.txt").read_text() == "1\n"
    write_version(store, 2)  # written but not committed
    assert store.load_version() == 1
    assert store.list_versions() == {1, 2}
    (tmp_path / "ckpt" / "checkpoint_version.txt").write_text("two")
    with pytest.raises(CheckpointError, match="not an integer: 'two'"):
        store.load_version()
    (tmp_path / "ckpt" / "checkpoint_version.txt").write_text("-3")
    with pytest.raises(CheckpointError, match="negative version"):
        store.load_version()


def test_drop_uncommitted_removes_only_newer_versions(tmp_path: Path) -> None:
    store = CheckpointStorage(str(tmp_path))
    first = write_version(store, 1)
    store.save_version(1)
    write_version(store, 2, seed=1)
    store.save_entity_partition(3, "user", 0, np.zeros((1, 4), np.float32))  # a crash mid-way through v3
    store.drop_uncommitted(store.load_version(), PARTITIONS)
    assert store.list_versions() == {1}
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".h5") == [
        "embeddings_item_0.v1.h5", "embeddings_user_0.v1.h5", "embeddings_user_1.v1.h5", "model.v1.h5",
    ]
    np.testing.assert_array_equal(store.load_entity_partition(1, "user", 1)[0], first[("user", 1)])


def test_preserve_snapshots_a_committed_version_marker_last(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = CheckpointStorage(str(tmp_path))
    saved = write_version(store, 4)
    store.save_config(json.dumps({"dimension": 4}))
    store.save_version(4)
    events: list[str] = []
    real_copy, real_write_text = checkpoint_module.copy_file, storage_adapters.write_text
    monkeypatch.setattr(checkpoint_module, "copy_file", lambda src, dst: (events.append(dst), real_copy(src, dst))[1])
    monkeypatch.setattr(storage_adapters, "write_text", lambda url, text: (events.append(url), real_write_text(url, text))[1])
    store.preserve(4, 10, PARTITIONS)
    # partitions, model, config and the checksum manifest, then the marker
    assert events[-1].endswith("epoch_10/checkpoint_version.txt") and len(events) == len(PARTITIONS) + 4
    assert any(e.endswith("epoch_10/checksums.v4.json") for e in events)
    snapshot = CheckpointStorage(str(tmp_path / "epoch_10"))
    assert snapshot.manifest(4) is not None
    assert snapshot.load_version() == 4
    assert snapshot.load_config_dict() == {"dimension": 4}
    for (entity_type, part), emb in saved.items():
        np.testing.assert_array_equal(snapshot.load_entity_partition(4, entity_type, part)[0], emb)
    assert snapshot.has_model(4)
    # Later versions replace files in the main directory; the snapshot keeps its own.
    write_version(store, 5, seed=9)
    store.save_version(5)
    store.drop_version(4, PARTITIONS)
    np.testing.assert_array_equal(snapshot.load_entity_partition(4, "item", 0)[0], saved[("item", 0)])


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, ("open(__import__('os').environ['EVIL_MARKER'], 'w').write('pwned')",))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("kind", ["torch.save", "plain pickle"])
def test_malicious_optimizer_blob_is_refused_without_running(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    marker = tmp_path / "pwned"
    monkeypatch.setenv("EVIL_MARKER", str(marker))
    if kind == "torch.save":
        buffer = io.BytesIO()
        torch.save({"state": {0: _Evil()}, "param_groups": []}, buffer)
        blob = buffer.getvalue()
    else:
        blob = pickle.dumps({"state": _Evil()})
    store = CheckpointStorage(str(tmp_path))
    store.save_entity_partition(1, "user", 0, np.zeros((2, 4), np.float32))
    with h5py.File(tmp_path / "embeddings_user_0.v1.h5", "a") as handle:
        handle.create_dataset("optimizer/state_dict", data=np.frombuffer(blob, dtype=np.dtype("V1")))
    # a reader with no checksum for the file (as for files written by PBG) gets as far as the blob
    with pytest.raises(InputFormatError, match="optimizer state cannot be loaded safely"):
        CheckpointStorage(str(tmp_path)).load_entity_partition(1, "user", 0)
    # the writer itself knows the file changed after it wrote it
    with pytest.raises(InputFormatError, match="damaged"):
        store.load_entity_partition(1, "user", 0)
    assert not marker.exists()
    # Sanity check that the blob really runs code when loaded unsafely.
    if kind == "plain pickle":
        pickle.loads(blob)
        assert marker.read_text() == "pwned"


def test_wrong_format_version_and_missing_files(tmp_path: Path) -> None:
    store = CheckpointStorage(str(tmp_path))
    with pytest.raises(CheckpointError, match=r"embeddings_user_0\.v1\.h5: missing"):
        store.load_entity_partition(1, "user", 0)
    store.save_entity_partition(1, "user", 0, np.zeros((2, 4), np.float32))
    with h5py.File(tmp_path / "embeddings_user_0.v1.h5", "a") as handle:
        handle.attrs["format_version"] = 2
    reader = CheckpointStorage(str(tmp_path))  # no record of the write: checks the format itself
    with pytest.raises(InputFormatError, match="format_version is 2"):
        reader.load_entity_partition(1, "user", 0)
    (tmp_path / "model.v1.h5").write_bytes(b"not hdf5")
    with pytest.raises(InputFormatError, match="not a readable HDF5 file"):
        store.load_model(1)


def test_checkpoint_on_a_memory_url() -> None:
    import fsspec

    store = CheckpointStorage("memory://ckpt-test/run/")
    try:
        store.prepare()
        saved = write_version(store, 1)
        store.save_config("{}")
        store.save_version(1)
        assert store.load_version() == 1
        assert store.list_versions() == {1}
        emb, optim = store.load_entity_partition(1, "user", 1)
        np.testing.assert_array_equal(emb, saved[("user", 1)])
        assert optim is not None and optim["state"][0]["step"] == 3
        store.preserve(1, 0, PARTITIONS)
        assert CheckpointStorage("memory://ckpt-test/run/epoch_0").load_version() == 1
    finally:
        fsspec.filesystem("memory").rm("/ckpt-test", recursive=True)
