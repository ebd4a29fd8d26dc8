"""Nothing trained on bad data: edge ids checked where they are read, checksums verified on every read.

Each case runs the real command line (``biggraph train`` / ``eval`` / ``validate``) and checks three
things: exit code 2, a one-line message naming the file (and dataset and row where they apply), and
the last committed checkpoint left exactly as it was.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from job.cli import main
from job.formats.checkpoint import CheckpointStorage
from job.formats.checksums import EDGE_MANIFEST, checksum_file
from job.formats.edges import edges_file, read_edges, write_edge_manifest, write_edges
from tests.helpers_graphs import write_cycle_graph


def write_config(root: Path, **overrides: Any) -> tuple[Path, dict[str, Any]]:
    raw = write_cycle_graph(root, num_entities=40, num_partitions=2, num_epochs=1, **overrides)
    path = root / "config.json"
    path.write_text(json.dumps(raw))
    return path, raw


def snapshot(checkpoint: Path) -> dict[str, bytes]:
    """The committed state: every file but config.json (each run rewrites it with its own config)."""
    return {p.name: p.read_bytes() for p in sorted(checkpoint.iterdir()) if p.is_file() and p.name != "config.json"}


def rewrite_bucket(edge_path: str, lhs: int, rhs: int, column: str, row: int, value: int) -> None:
    url = edges_file(edge_path, lhs, rhs)
    arrays = read_edges(url)
    getattr(arrays, column)[row] = value
    write_edges(url, arrays.rel, arrays.lhs, arrays.rhs)


def train(path: Path, capsys: pytest.CaptureFixture, *extra: str) -> tuple[int, str]:
    code = main(["train", str(path), *extra])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("column,value,problem", [
    ("lhs", 10_000, "index 10000 out of range for entity type 'node' partition 1"),
    ("rhs", -3, "negative index -3 for entity type 'node'"),
    ("rel", 7, "relation id 7 out of range"),
])
def test_train_refuses_edge_ids_out_of_range(tmp_path: Path, capsys: pytest.CaptureFixture, column: str, value: int,
                                             problem: str) -> None:
    path, raw = write_config(tmp_path)
    code, err = train(path, capsys)
    assert code == 0, err
    checkpoint = Path(raw["checkpoint_path"])
    before = snapshot(checkpoint)
    raw["num_epochs"] = 2
    path.write_text(json.dumps(raw))
    rewrite_bucket(raw["edge_paths"][0], 1, 0, column, 3, value)
    code, err = train(path, capsys)
    assert code == 2, err
    assert "Traceback" not in err
    assert f"edges_1_0.h5 dataset '{column}' row 3: {problem}" in err
    after = snapshot(checkpoint)
    assert after["checkpoint_version.txt"] == before["checkpoint_version.txt"] == b"1\n"
    for name, data in before.items():
        if name.endswith(".h5") or name.startswith("checksums"):
            assert after[name] == data, name


def test_eval_refuses_edge_ids_out_of_range(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path, raw = write_config(tmp_path)
    assert train(path, capsys)[0] == 0
    rewrite_bucket(raw["edge_paths"][0], 0, 1, "rhs", 0, 99)
    code = main(["eval", str(path), "--candidates", "all"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "edges_0_1.h5 dataset 'rhs' row 0: index 99 out of range" in err


def flip_byte(path: Path, offset_from_end: int = 200) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) - offset_from_end] ^= 0x40
    path.write_bytes(bytes(data))


def test_damaged_committed_partition_is_an_error_not_a_fallback(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path, raw = write_config(tmp_path)
    assert train(path, capsys)[0] == 0
    checkpoint = Path(raw["checkpoint_path"])
    manifest = json.loads((checkpoint / "checksums.v1.json").read_text())
    assert sorted(manifest["files"]) == ["embeddings_node_0.v1.h5", "embeddings_node_1.v1.h5", "model.v1.h5"]
    for name, entry in manifest["files"].items():
        assert checksum_file(str(checkpoint / name)) == (entry["size"], entry["crc32"])
    # a flipped bit inside the embeddings (HDF5 has no checksum there: it would read back as another number)
    victim = checkpoint / "embeddings_node_1.v1.h5"
    with h5py.File(victim, "r") as handle:
        offset = handle["embeddings"].id.get_offset()
    data = bytearray(victim.read_bytes())
    data[offset + 5] ^= 0x01
    victim.write_bytes(bytes(data))
    before = snapshot(checkpoint)
    raw["num_epochs"] = 2
    path.write_text(json.dumps(raw))
    code, err = train(path, capsys)
    assert code == 2, err
    assert "embeddings_node_1.v1.h5: damaged: crc32" in err and "Traceback" not in err
    assert snapshot(checkpoint) == before
    # the same for every other reader of the version
    for command in (["eval", str(path)], ["export", str(path), "--out", str(tmp_path / "export")]):
        assert main(command) == 2
        assert "embeddings_node_1.v1.h5: damaged" in capsys.readouterr().err


def test_missing_committed_partition_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path, raw = write_config(tmp_path)
    assert train(path, capsys)[0] == 0
    (Path(raw["checkpoint_path"]) / "embeddings_node_0.v1.h5").unlink()
    raw["num_epochs"] = 2
    path.write_text(json.dumps(raw))
    code, err = train(path, capsys)
    assert code == 2, err
    assert "embeddings_node_0.v1.h5: missing" in err


def test_truncated_model_file_is_named(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path, raw = write_config(tmp_path)
    assert train(path, capsys)[0] == 0
    model = Path(raw["checkpoint_path"]) / "model.v1.h5"
    model.write_bytes(model.read_bytes()[:-10])
    code = main(["eval", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and "model.v1.h5: damaged" in err and "truncated" in err, err


def test_checkpoint_without_manifest_still_loads(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Checkpoints written by PBG (or older biggraph) have no manifest: they load as before."""
    path, raw = write_config(tmp_path)
    assert train(path, capsys)[0] == 0
    checkpoint = Path(raw["checkpoint_path"])
    (checkpoint / "checksums.v1.json").unlink()
    store = CheckpointStorage(str(checkpoint))
    assert store.manifest(1) is None
    assert store.load_entity_partition(1, "node", 0)[0].shape[1] == 16
    raw["num_epochs"] = 2
    path.write_text(json.dumps(raw))
    assert train(path, capsys)[0] == 0
    assert (checkpoint / "checksums.v2.json").exists()


def test_stale_manifest_of_an_uncommitted_version_is_dropped(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A crash between the manifest and the marker leaves checksums.v{N+1}.json: the pass redoing N+1 must
    not be held to it."""
    path, raw = write_config(tmp_path)
    assert train(path, capsys)[0] == 0
    checkpoint = Path(raw["checkpoint_path"])
    shutil.copy(checkpoint / "checksums.v1.json", checkpoint / "checksums.v2.json")
    raw["num_epochs"] = 2
    path.write_text(json.dumps(raw))
    code, err = train(path, capsys)
    assert code == 0, err
    manifest = json.loads((checkpoint / "checksums.v2.json").read_text())
    assert sorted(manifest["files"]) == ["embeddings_node_0.v2.h5", "embeddings_node_1.v2.h5", "model.v2.h5"]


def test_imported_edge_files_are_verified(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rows = [f"e{i}\tr{i % 3}\te{(i * 7 + 1) % 50}\n" for i in range(300)]
    (tmp_path / "edges.tsv").write_text("".join(rows))
    raw = {"entities": {"all": {"num_partitions": 2}},
           "relations": [{"name": "all_edges", "lhs": "all", "rhs": "all", "operator": "translation"}],
           "dynamic_relations": True, "global_emb": False, "dimension": 8, "num_epochs": 1, "workers": 1,
           "entity_path": str(tmp_path / "data"), "edge_paths": [str(tmp_path / "data" / "train")],
           "checkpoint_path": str(tmp_path / "ckpt")}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    assert main(["import", str(path), str(tmp_path / "edges.tsv"), "-l", "0", "--rel-col", "1", "-r", "2"]) == 0
    edge_dir = tmp_path / "data" / "train"
    manifest = json.loads((edge_dir / EDGE_MANIFEST).read_text())
    assert sorted(manifest["files"]) == [f"edges_{a}_{b}.h5" for a in range(2) for b in range(2)]
    assert main(["validate", str(path)]) == 0
    capsys.readouterr()
    victim = edge_dir / "edges_1_1.h5"
    with h5py.File(victim, "r") as handle:
        offset = handle["rhs"].id.get_offset()
    data = bytearray(victim.read_bytes())
    data[offset] ^= 0x01  # still a valid id, so only the checksum can tell
    victim.write_bytes(bytes(data))
    for command in (["validate", str(path)], ["train", str(path)]):
        code = main(command)
        err = capsys.readouterr()
        assert code == 2, err
        assert "edges_1_1.h5: damaged: crc32" in err.err + err.out, command
    assert not (tmp_path / "ckpt" / "checkpoint_version.txt").exists()
    # a directory whose files another tool rewrote: the message says how to accept them
    victim.unlink()
    arrays = read_edges(str(edge_dir / "edges_0_0.h5"))
    write_edges(str(victim), arrays.rel, arrays.lhs, arrays.rhs)
    assert main(["train", str(path)]) == 2
    assert "delete that manifest" in capsys.readouterr().err
    (edge_dir / EDGE_MANIFEST).unlink()
    assert main(["train", str(path)]) == 0


def test_edge_manifest_written_by_the_api_round_trips(tmp_path: Path) -> None:
    url = edges_file(str(tmp_path), 0, 0)
    entry = write_edges(url, np.array([0, 1]), np.array([2, 3]), np.array([4, 5]))
    write_edge_manifest(str(tmp_path), {"edges_0_0.h5": entry})
    assert len(read_edges(url)) == 2
    flip_byte(Path(url), 10)
    from job.errors import InputFormatError

    with pytest.raises(InputFormatError, match="damaged"):
        read_edges(url)


def test_ranks_verify_partitions_other_ranks_wrote(tmp_path: Path) -> None:
    """Two trainers sharing records through a real TCPStore: B verifies what A wrote, and the latest write wins."""
    import datetime

    import torch.distributed as dist

    from job.errors import InputFormatError
    from job.formats.checkpoint import SharedSumRegistry

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10))
    writer, reader = CheckpointStorage(str(tmp_path)), CheckpointStorage(str(tmp_path))
    writer.sums, reader.sums = SharedSumRegistry(store, "0"), SharedSumRegistry(store, "0")
    writer.prepare()
    first = np.ones((3, 4), np.float32)
    writer.save_entity_partition(2, "node", 0, first)
    np.testing.assert_array_equal(reader.load_entity_partition(2, "node", 0)[0], first)
    reader.save_entity_partition(2, "node", 0, first * 2)  # B rewrites it; A must now expect B's bytes
    np.testing.assert_array_equal(writer.load_entity_partition(2, "node", 0)[0], first * 2)
    flip_byte(Path(writer.partition_file(2, "node", 0)))
    with pytest.raises(InputFormatError, match="damaged"):
        writer.load_entity_partition(2, "node", 0)
    # a new round (after an elastic restart) has no records: unverified, and the commit checksums the file
    fresh = CheckpointStorage(str(tmp_path))
    fresh.sums = SharedSumRegistry(store, "1")
    assert fresh.sums.get(fresh.partition_file(2, "node", 0)) is None


def test_a_kill_between_commit_and_cleanup_loses_no_stats_and_leaves_no_old_version(tmp_path: Path,
                                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The window the S3 kill run found: marker written, old version not yet deleted (and, before, the pass's
    stats not yet appended). The next run drops the old files; the pass's lines are there."""
    from job.config import parse_config
    from job.train import train as run_training

    raw = write_cycle_graph(tmp_path, num_entities=40, num_partitions=2, num_epochs=3)
    checkpoint = CheckpointStorage(raw["checkpoint_path"])
    real_drop = CheckpointStorage.drop_version

    def killed(self, version, partitions):
        raise SystemExit("killed right after the commit of the next version")

    monkeypatch.setattr(CheckpointStorage, "drop_version", killed)
    with pytest.raises(SystemExit):
        run_training(parse_config(raw))  # pass 1 commits (nothing to drop), pass 2 commits, then the kill
    assert checkpoint.load_version() == 2 and checkpoint.list_versions() == {1, 2}
    assert [r["index"] for r in checkpoint.load_stats() if r.get("pass_summary")] == [0, 1]
    monkeypatch.setattr(CheckpointStorage, "drop_version", real_drop)
    run_training(parse_config(raw))
    assert checkpoint.list_versions() == {3}
    summaries = [r for r in checkpoint.load_stats() if r.get("pass_summary")]
    assert [(r["index"], r["checkpoint_version"]) for r in summaries] == [(0, 1), (1, 2), (2, 3)]


def test_stats_of_a_version_that_never_committed_are_dropped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from job.config import parse_config
    from job.train import train as run_training

    raw = write_cycle_graph(tmp_path, num_entities=40, num_partitions=2, num_epochs=2)
    checkpoint = CheckpointStorage(raw["checkpoint_path"])
    real_save = CheckpointStorage.save_version

    def killed_before_marker(self, version):
        if version == 2:
            raise SystemExit("killed before the marker of version 2")
        real_save(self, version)

    monkeypatch.setattr(CheckpointStorage, "save_version", killed_before_marker)
    with pytest.raises(SystemExit):
        run_training(parse_config(raw))
    assert checkpoint.load_version() == 1
    assert {r["checkpoint_version"] for r in checkpoint.load_stats()} == {1, 2}  # v2's lines went before its marker
    monkeypatch.setattr(CheckpointStorage, "save_version", real_save)
    run_training(parse_config(raw))
    records = checkpoint.load_stats()
    assert [r["index"] for r in records if r.get("pass_summary")] == [0, 1]  # v2's pass once, not twice
    assert sum(1 for r in records if "lhs_partition" in r) == 2 * 4


def test_an_empty_marker_beside_versions_is_an_error_and_deletes_nothing(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture) -> None:
    """PBG rewrites checkpoint_version.txt in place: a kill there leaves it empty. Read as "no checkpoint", the
    start-up clean-up would delete every version."""
    path, raw = write_config(tmp_path)
    assert train(path, capsys)[0] == 0
    checkpoint = Path(raw["checkpoint_path"])
    (checkpoint / "checkpoint_version.txt").write_text("")
    before = {name: data for name, data in snapshot(checkpoint).items() if name != "checkpoint_version.txt"}
    code, err = train(path, capsys)
    assert code == 2 and "checkpoint_version.txt: empty, although versions [1] are in the directory" in err, err
    after = snapshot(checkpoint)
    assert all(after.get(name) == data for name, data in before.items())


def test_a_stats_line_cut_by_a_kill_does_not_swallow_the_next(tmp_path: Path) -> None:
    store = CheckpointStorage(str(tmp_path))
    store.append_stats([{"index": 0, "checkpoint_version": 1}])
    with open(store.stats_file(), "a") as handle:
        handle.write('{"index": 1, "checkpo')  # killed mid-append
    store.trim_stats(1)
    store.append_stats([{"index": 1, "checkpoint_version": 2}])
    assert [r["index"] for r in store.load_stats()] == [0, 1]
