"""``biggraph export``: TSV (PBG's layout), .npy and Parquet from a committed checkpoint.

The checkpoint is built directly with ``CheckpointStorage`` (no training), so every
expected value is known exactly: embeddings, global embeddings and operator parameters.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from job.cli import main
from job.config import parse_config
from job.data.export import ExportError, export_checkpoint
from job.errors import CheckpointError, InputFormatError
from job.formats.checkpoint import CheckpointStorage
from job.formats.entities import write_dynamic_rel_count, write_dynamic_rel_names, write_entity_count, write_entity_names

DIM = 4


@dataclass
class BuiltCheckpoint:
    """A checkpoint written for a test, with the values it holds."""

    root: Path
    config: Any
    config_file: Path
    embeddings: dict[tuple[str, int], np.ndarray]
    names: dict[tuple[str, int], list[str]]
    model: dict[str, np.ndarray]


def build_checkpoint(
    root: Path,
    *,
    dynamic: bool = False,
    global_emb: bool = True,
    with_item_names: bool = False,
    version: int = 3,
    commit: bool = True,
) -> BuiltCheckpoint:
    """Two entity types (``user`` in 2 partitions, ``item`` unpartitioned), two relations, version ``version``.

    ``user`` has names files; ``item`` has none unless ``with_item_names`` (to exercise generated ids).
    With ``dynamic`` there is a single relation whose complex_diagonal parameters are stacked for 3 types.
    """
    rng = np.random.default_rng(7)
    entity_path = root / "entities"
    checkpoint_path = root / "checkpoint"
    if dynamic:
        relations = [{"name": "all", "lhs": "user", "rhs": "item", "operator": "complex_diagonal"}]
    else:
        relations = [
            {"name": "follows", "lhs": "user", "rhs": "user", "operator": "diagonal"},
            {"name": "likes", "lhs": "user", "rhs": "item", "operator": "complex_diagonal"},
        ]
    raw = {
        "entities": {"user": {"num_partitions": 2}, "item": {"num_partitions": 1}},
        "relations": relations,
        "dimension": DIM,
        "entity_path": str(entity_path),
        "edge_paths": [str(root / "edges")],
        "checkpoint_path": str(checkpoint_path),
        "global_emb": global_emb and not dynamic,
        "dynamic_relations": dynamic,
    }
    config_file = root / "config.json"
    config_file.write_text(json.dumps(raw))
    config = parse_config(raw)
    counts = {("user", 0): 3, ("user", 1): 2, ("item", 0): 4}
    embeddings: dict[tuple[str, int], np.ndarray] = {}
    names: dict[tuple[str, int], list[str]] = {}
    storage = CheckpointStorage(str(checkpoint_path))
    storage.prepare()
    for (entity_type, part), count in counts.items():
        write_entity_count(str(entity_path), entity_type, part, count)
        emb = rng.standard_normal((count, DIM)).astype(np.float32)
        embeddings[(entity_type, part)] = emb
        storage.save_entity_partition(version, entity_type, part, emb)
        if entity_type == "user" or with_item_names:
            names[(entity_type, part)] = [f"{entity_type}-{part}-{i}\u00e9" for i in range(count)]
            write_entity_names(str(entity_path), entity_type, part, names[(entity_type, part)])
    model: dict[str, np.ndarray] = {}
    state: dict[str, tuple[str, np.ndarray]] = {}
    if dynamic:
        write_dynamic_rel_count(str(entity_path), 3)
        write_dynamic_rel_names(str(entity_path), ["r0", "r1", "r2"])
        for side in ("lhs", "rhs"):
            for param in ("real", "imag"):
                model[f"relations/0/operator/{side}/{param}"] = rng.standard_normal((3, DIM // 2)).astype(np.float32)
    else:
        model["relations/0/operator/rhs/diagonal"] = rng.standard_normal(DIM).astype(np.float32)
        # Stored imag first: the export must still put real first, as PBG's named_parameters order does.
        model["relations/1/operator/rhs/imag"] = rng.standard_normal(DIM // 2).astype(np.float32)
        model["relations/1/operator/rhs/real"] = rng.standard_normal(DIM // 2).astype(np.float32)
    if config.global_emb:
        for entity_type in ("user", "item"):
            model[f"entities/{entity_type}/global_embedding"] = rng.standard_normal(DIM).astype(np.float32)
    for public, array in model.items():
        parts = public.split("/")
        if parts[0] == "entities":
            private = f"global_embs.emb_{parts[1]}"
        else:
            private = f"{parts[3]}_operators.{parts[1]}.{parts[4]}"
        state[public] = (private, array)
    storage.save_model(version, state)
    storage.save_config(config.to_json())
    if commit:
        storage.save_version(version)
    return BuiltCheckpoint(root, config, config_file, embeddings, names, model)


def expected_rows(ckpt: BuiltCheckpoint, entity_type: str, parts: int, add_global: bool = True) -> np.ndarray:
    rows = np.concatenate([ckpt.embeddings[(entity_type, p)] for p in range(parts)])
    glob = ckpt.model.get(f"entities/{entity_type}/global_embedding")
    if add_global and glob is not None:
        rows = rows + glob
    return rows


def test_tsv_has_pbg_layout_with_global_embedding_added(tmp_path: Path) -> None:
    ckpt = build_checkpoint(tmp_path)
    summary = export_checkpoint(ckpt.config, out=str(tmp_path / "out"))
    lines = (tmp_path / "out" / "entity_embeddings.tsv").read_text(encoding="utf-8").splitlines()
    assert len(lines) == 3 + 2 + 4
    user = expected_rows(ckpt, "user", 2)
    first = lines[0].split("\t")
    assert first[0] == "user-0-0\u00e9"
    assert first[1:] == [f"{v:.9f}" for v in user[0].tolist()]
    assert lines[3].split("\t")[0] == "user-1-0\u00e9"
    np.testing.assert_allclose([float(x) for x in lines[4].split("\t")[1:]], user[4], atol=1e-8)
    # item has no names file: generated ids, and the summary says so.
    assert [line.split("\t")[0] for line in lines[5:]] == [f"item_0_{i}" for i in range(4)]
    assert summary.generated_names == ["item/0"]
    rel_lines = (tmp_path / "out" / "relation_types_parameters.tsv").read_text().splitlines()
    assert [line.split("\t")[:5] for line in rel_lines] == [
        ["follows", "rhs", "diagonal", "diagonal", "4"],
        ["likes", "rhs", "complex_diagonal", "real", "2"],
        ["likes", "rhs", "complex_diagonal", "imag", "2"],
    ]
    assert rel_lines[1].split("\t")[5:] == [f"{v:.9f}" for v in ckpt.model["relations/1/operator/rhs/real"].tolist()]
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["checkpoint_version"] == 3
    assert manifest["global_embedding_added"] == ["user", "item"]
    assert [(p["entity_type"], p["partition"], p["start"], p["rows"], p["names"]) for p in manifest["partitions"]] == [
        ("user", 0, 0, 3, "names file"), ("user", 1, 3, 2, "names file"), ("item", 0, 0, 4, "generated"),
    ]


def test_no_global_emb_exports_the_raw_table(tmp_path: Path) -> None:
    ckpt = build_checkpoint(tmp_path)
    export_checkpoint(ckpt.config, out=str(tmp_path / "out"), fmt="npy", add_global=False)
    np.testing.assert_array_equal(np.load(tmp_path / "out" / "embeddings_user.npy"), expected_rows(ckpt, "user", 2, False))


def test_npy_concatenates_partitions_with_names_and_relations(tmp_path: Path) -> None:
    ckpt = build_checkpoint(tmp_path)
    out = tmp_path / "out"
    export_checkpoint(ckpt.config, out=str(out), fmt="npy")
    user = np.load(out / "embeddings_user.npy")
    assert user.dtype == np.float32 and user.shape == (5, DIM)
    np.testing.assert_array_equal(user, expected_rows(ckpt, "user", 2))
    np.testing.assert_array_equal(np.load(out / "embeddings_item.npy"), expected_rows(ckpt, "item", 1))
    assert json.loads((out / "names_user.json").read_text(encoding="utf-8")) == ckpt.names[("user", 0)] + ckpt.names[("user", 1)]
    assert json.loads((out / "names_item.json").read_text()) == [f"item_0_{i}" for i in range(4)]
    table = json.loads((out / "relations.json").read_text())
    assert [(t["relation"], t["param"], t["shape"]) for t in table] == [
        ("follows", "diagonal", [4]), ("likes", "real", [2]), ("likes", "imag", [2]),
    ]
    with np.load(out / "relations.npz") as npz:
        np.testing.assert_array_equal(npz[table[2]["key"]], ckpt.model["relations/1/operator/rhs/imag"])


def test_npy_header_is_rewritten_for_large_row_counts() -> None:
    from job.data.export.writers import _npy_header

    for rows, dim in ((0, 1), (10**12, 4096)):
        header = _npy_header(rows, dim)
        assert len(header) == 128
        import io

        buffer = io.BytesIO(header)
        assert np.lib.format.read_magic(buffer) == (1, 0)
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(buffer)
        assert (shape, fortran, dtype) == ((rows, dim), False, np.dtype("<f4"))


def test_parquet_columns_and_bounded_row_groups(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    ckpt = build_checkpoint(tmp_path, with_item_names=True)
    out = tmp_path / "out"
    export_checkpoint(ckpt.config, out=str(out), fmt="parquet", row_group_rows=2)
    parquet = pq.ParquetFile(out / "embeddings.parquet")
    assert parquet.schema_arrow.field("embedding").type == pa.list_(pa.float32())
    assert parquet.schema_arrow.names == ["entity_type", "partition", "offset", "name", "embedding"]
    # user/0: 3 rows -> 2 groups, user/1: 2 rows -> 1, item/0: 4 rows -> 2
    assert parquet.metadata.num_row_groups == 5
    assert max(parquet.metadata.row_group(i).num_rows for i in range(5)) == 2
    table = parquet.read().to_pydict()
    assert table["entity_type"] == ["user"] * 5 + ["item"] * 4
    assert table["partition"] == [0, 0, 0, 1, 1, 0, 0, 0, 0]
    assert table["offset"] == [0, 1, 2, 0, 1, 0, 1, 2, 3]
    assert table["name"][3] == "user-1-0\u00e9" and table["name"][8] == "item-0-3\u00e9"
    np.testing.assert_array_equal(np.array(table["embedding"][5:], dtype=np.float32), expected_rows(ckpt, "item", 1))
    rels = pq.read_table(out / "relations.parquet").to_pylist()
    assert [(r["relation"], r["side"], r["param"], r["shape"]) for r in rels] == [
        ("follows", "rhs", "diagonal", [4]), ("likes", "rhs", "real", [2]), ("likes", "rhs", "imag", [2]),
    ]
    np.testing.assert_array_equal(np.float32(rels[0]["values"]), ckpt.model["relations/0/operator/rhs/diagonal"])


def test_dynamic_relations_are_split_per_named_type(tmp_path: Path) -> None:
    ckpt = build_checkpoint(tmp_path, dynamic=True)
    export_checkpoint(ckpt.config, out=str(tmp_path / "out"))
    rows = [line.split("\t") for line in (tmp_path / "out" / "relation_types_parameters.tsv").read_text().splitlines()]
    # PBG's order: side, then parameter, then relation type.
    assert [r[:5] for r in rows[:4]] == [
        ["r0", "lhs", "complex_diagonal", "real", "2"],
        ["r1", "lhs", "complex_diagonal", "real", "2"],
        ["r2", "lhs", "complex_diagonal", "real", "2"],
        ["r0", "lhs", "complex_diagonal", "imag", "2"],
    ]
    assert len(rows) == 2 * 2 * 3
    assert rows[-1][5:] == [f"{v:.9f}" for v in ckpt.model["relations/0/operator/rhs/imag"][2].tolist()]


def test_cli_pbg_style_flags_and_overwrite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = build_checkpoint(tmp_path)
    ent, rel = tmp_path / "e.tsv", tmp_path / "r.tsv"
    argv = ["export", str(ckpt.config_file), "--entities-output", str(ent), "--relation-types-output", str(rel)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "version 3" in out and "item/0" in out
    assert len(ent.read_text(encoding="utf-8").splitlines()) == 9 and len(rel.read_text().splitlines()) == 3
    assert not (tmp_path / "manifest.json").exists()
    assert main(argv) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(argv + ["--overwrite", "--no-global-emb"]) == 0
    first = ent.read_text(encoding="utf-8").splitlines()[0].split("\t")
    assert first[1:] == [f"{v:.9f}" for v in ckpt.embeddings[("user", 0)][0].tolist()]
    assert main(argv + ["--overwrite", "--format", "npy"]) == 2
    assert "write TSV" in capsys.readouterr().err


def test_cli_overrides_and_version(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = build_checkpoint(tmp_path, version=2)
    moved = tmp_path / "moved"
    (tmp_path / "checkpoint").rename(moved)
    out = tmp_path / "out"
    argv = ["export", str(ckpt.config_file), "-p", f"checkpoint_path={moved}", "--out", str(out), "--format", "npy"]
    assert main(argv + ["--version", "2"]) == 0
    assert np.load(out / "embeddings_item.npy").shape == (4, DIM)
    assert main(argv + ["--version", "5", "--overwrite"]) == 2
    assert "no committed checkpoint version 5 (available: " in capsys.readouterr().err


def test_no_checkpoint_yet(tmp_path: Path) -> None:
    ckpt = build_checkpoint(tmp_path, commit=False)
    with pytest.raises(CheckpointError, match="no committed checkpoint yet"):
        export_checkpoint(ckpt.config, out=str(tmp_path / "out"))


def test_names_count_mismatch_names_both_files(tmp_path: Path) -> None:
    ckpt = build_checkpoint(tmp_path)
    write_entity_names(str(tmp_path / "entities"), "user", 1, ["just-one"])
    with pytest.raises(InputFormatError, match=r"entity_names_user_1\.json.*1 names.*embeddings_user_1\.v3\.h5 has 2"):
        export_checkpoint(ckpt.config, out=str(tmp_path / "out"), fmt="parquet")
    assert not (tmp_path / "out" / "embeddings.parquet").exists()  # nothing half-written is left behind
    assert [p.name for p in (tmp_path / "out").iterdir()] == []


def test_output_dir_not_writable(tmp_path: Path) -> None:
    ckpt = build_checkpoint(tmp_path)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(ExportError, match="a-file/out: output directory cannot be created"):
        export_checkpoint(ckpt.config, out=str(blocker / "out"))
    with pytest.raises(ExportError, match="exists and is not a directory"):
        export_checkpoint(ckpt.config, out=str(blocker))


def test_missing_partition_file_is_named(tmp_path: Path) -> None:
    ckpt = build_checkpoint(tmp_path)
    (tmp_path / "checkpoint" / "embeddings_user_1.v3.h5").unlink()
    with pytest.raises(CheckpointError, match=r"embeddings_user_1\.v3\.h5: missing"):
        export_checkpoint(ckpt.config, out=str(tmp_path / "out"))


def test_export_to_memory_url(tmp_path: Path) -> None:
    import fsspec

    import storage_adapters as storage

    ckpt = build_checkpoint(tmp_path)
    out = "memory://export-test/run1"
    try:
        export_checkpoint(ckpt.config, out=out, fmt="npy")
        assert "embeddings_user.npy" in storage.listdir(out)
        import io

        array = np.load(io.BytesIO(storage.read_bytes(storage.join(out, "embeddings_user.npy"))))
        np.testing.assert_array_equal(array, expected_rows(ckpt, "user", 2))
        assert json.loads(storage.read_text(storage.join(out, "manifest.json")))["format"] == "npy"
    finally:
        fsspec.filesystem("memory").rm("/export-test", recursive=True)
