"""``biggraph import``: real files in, real h5/JSON out, every edge traced back to its strings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from job.cli import main
from job.config import load_config
from job.data.importing import EntityTable, ImportOptions, hash_strings, import_edges

REPO = Path(__file__).resolve().parent.parent


def write_config(root: Path, entities: dict[str, int], relations: list[tuple[str, str, str]], **extra: Any) -> Path:
    config: dict[str, Any] = {
        "entities": {name: {"num_partitions": parts} for name, parts in entities.items()},
        "relations": [{"name": name, "lhs": lhs, "rhs": rhs, "operator": "none"} for name, lhs, rhs in relations],
        "dimension": 4,
        "entity_path": str(root / "entities"),
        "edge_paths": [str(root / "edges")],
        "checkpoint_path": str(root / "checkpoints"),
    }
    config.update(extra)
    path = root / "config.json"
    path.write_text(json.dumps(config))
    return path


def read_back(config_path: Path) -> list[tuple[str, str, str]]:
    """Every imported edge as (lhs name, relation name, rhs name), checking the layout on the way."""
    config = load_config(str(config_path))
    entity_path = Path(config.entity_path)
    names: dict[tuple[str, int], list[str]] = {}
    for entity_type, schema in config.entities.items():
        for part in range(schema.num_partitions):
            count = int((entity_path / f"entity_count_{entity_type}_{part}.txt").read_text())
            part_names = json.loads((entity_path / f"entity_names_{entity_type}_{part}.json").read_text())
            assert len(part_names) == count
            names[entity_type, part] = part_names
    if config.dynamic_relations:
        rel_names = json.loads((entity_path / "dynamic_rel_names.json").read_text())
        assert int((entity_path / "dynamic_rel_count.txt").read_text()) == len(rel_names)
    else:
        rel_names = [r.name for r in config.relations]
    parts_lhs = max(config.entities[r.lhs].num_partitions for r in config.relations)
    parts_rhs = max(config.entities[r.rhs].num_partitions for r in config.relations)
    edges = []
    for edge_path in config.edge_paths:
        for lp in range(parts_lhs):
            for rp in range(parts_rhs):
                with h5py.File(Path(edge_path) / f"edges_{lp}_{rp}.h5", "r") as handle:
                    assert handle.attrs["format_version"] == 1
                    rel, lhs, rhs = (handle[k][...] for k in ("rel", "lhs", "rhs"))
                for r, lo, ro in zip(rel.tolist(), lhs.tolist(), rhs.tolist()):
                    relation = config.relations[0 if config.dynamic_relations else r]
                    lpart = lp if config.entities[relation.lhs].num_partitions > 1 else 0
                    rpart = rp if config.entities[relation.rhs].num_partitions > 1 else 0
                    edges.append((names[relation.lhs, lpart][lo], rel_names[r], names[relation.rhs, rpart][ro]))
    return edges


def random_edges(n: int, num_entities: int, relations: list[str], seed: int = 0) -> list[tuple[str, str, str]]:
    rng = np.random.default_rng(seed)
    ids = [f"ent{i}" for i in range(num_entities)] + ["é-unicode", "a longer identifier with spaces and more than 32 bytes"]
    lhs = rng.integers(0, len(ids), n)
    rhs = rng.integers(0, len(ids), n)
    rel = rng.integers(0, len(relations), n)
    return [(ids[a], relations[r], ids[b]) for a, r, b in zip(lhs, rel, rhs)]


def write_tsv(path: Path, edges: list[tuple[str, str, str]], sep: str = "\t") -> Path:
    path.write_text("".join(f"{a}{sep}{r}{sep}{b}\n" for a, r, b in edges))
    return path


def run_cli(*argv: str) -> int:
    return main(["import", *argv])


def test_round_trip_tsv(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"all": 1}, [("follows", "all", "all"), ("likes", "all", "all")])
    edges = random_edges(500, 60, ["follows", "likes"])
    tsv = write_tsv(tmp_path / "edges.tsv", edges)
    assert run_cli(str(config), str(tsv), "-l", "0", "-r", "2", "--rel-col", "1") == 0
    assert read_back(config) == edges  # one bucket: file order is kept
    names = json.loads((tmp_path / "entities" / "entity_names_all_0.json").read_text())
    assert sorted(names) == sorted({e[0] for e in edges} | {e[2] for e in edges})
    with h5py.File(tmp_path / "edges" / "edges_0_0.h5", "r") as handle:
        assert handle["lhs"].dtype == np.int32 and handle["lhs"].chunks is None


def test_partitions_multiple_types_and_small_batches(tmp_path: Path) -> None:
    config_path = write_config(
        tmp_path,
        {"user": 3, "item": 3, "tag": 1},
        [("buys", "user", "item"), ("tagged", "item", "tag"), ("knows", "user", "user")],
    )
    rng = np.random.default_rng(1)
    edges = []
    for _ in range(3000):
        kind = int(rng.integers(0, 3))
        if kind == 0:
            edges.append((f"u{rng.integers(0, 80)}", "buys", f"i{rng.integers(0, 50)}"))
        elif kind == 1:
            edges.append((f"i{rng.integers(0, 50)}", "tagged", f"t{rng.integers(0, 5)}"))
        else:
            edges.append((f"u{rng.integers(0, 80)}", "knows", f"u{rng.integers(0, 80)}"))
    tsv = write_tsv(tmp_path / "edges.tsv", edges)
    config = load_config(str(config_path))
    summary = import_edges(config, [str(tsv)], ImportOptions(lhs_col=0, rhs_col=2, rel_col=1, block_size=4096))
    assert summary.edges_written == 3000
    for lp in range(3):
        for rp in range(3):
            assert (tmp_path / "edges" / f"edges_{lp}_{rp}.h5").exists()
    counts = {
        t: [int((tmp_path / "entities" / f"entity_count_{t}_{p}.txt").read_text()) for p in range(n)]
        for t, n in (("user", 3), ("item", 3), ("tag", 1))
    }
    assert sum(counts["user"]) == 80 and sum(counts["item"]) == 50 and counts["tag"] == [5]
    assert min(counts["user"]) > 0 and min(counts["item"]) > 0  # partitions come from a hash of the name
    for lp in range(3):
        for rp in range(3):
            with h5py.File(tmp_path / "edges" / f"edges_{lp}_{rp}.h5", "r") as handle:
                rel, lhs, rhs = (handle[k][...] for k in ("rel", "lhs", "rhs"))
            lhs_types = np.array(["user", "item", "user"])[rel]
            rhs_types = np.array(["item", "tag", "user"])[rel]
            for t, part in (("user", lp), ("item", lp)):
                assert (lhs[lhs_types == t] < counts[t][part]).all()
            for t, part in (("user", rp), ("item", rp)):
                assert (rhs[rhs_types == t] < counts[t][part]).all()
            assert (rhs[rhs_types == "tag"] < 5).all()
    assert sorted(read_back(config_path)) == sorted(edges)
    # Edges into the unpartitioned "tag" type are spread over all rhs buckets, not piled into bucket 0.
    tagged_per_rhs_bucket = []
    for rp in range(3):
        n = 0
        for lp in range(3):
            with h5py.File(tmp_path / "edges" / f"edges_{lp}_{rp}.h5", "r") as handle:
                n += int((handle["rel"][...] == 1).sum())
        tagged_per_rhs_bucket.append(n)
    assert min(tagged_per_rhs_bucket) > 0


def test_seed_makes_partitioning_deterministic(tmp_path: Path) -> None:
    edges = random_edges(400, 100, ["r"])
    outputs = []
    for run, seed in enumerate((5, 5, 6)):
        root = tmp_path / f"run{run}"
        root.mkdir()
        config = write_config(root, {"all": 2}, [("r", "all", "all")])
        tsv = write_tsv(root / "e.tsv", edges)
        assert run_cli(str(config), str(tsv), "-l", "0", "-r", "2", "--seed", str(seed)) == 0
        outputs.append((root / "entities" / "entity_names_all_0.json").read_text())
        assert sorted(read_back(config)) == sorted((a, "r", b) for a, _, b in edges)
    assert outputs[0] == outputs[1] != outputs[2]


def test_dynamic_relations_and_min_counts(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"all": 1}, [("all_edges", "all", "all")], dynamic_relations=True, global_emb=False)
    edges = [("a", "common", "b")] * 3 + [("b", "common", "c")] * 2 + [("a", "rare", "c"), ("d", "common", "a")]
    tsv = write_tsv(tmp_path / "e.tsv", edges)
    argv = [
        str(config),
        str(tsv),
        "-l",
        "0",
        "-r",
        "2",
        "--rel-col",
        "1",
        "--relation-type-min-count",
        "2",
        "--entity-min-count",
        "2",
    ]
    assert run_cli(*argv) == 0
    ent = tmp_path / "entities"
    assert json.loads((ent / "dynamic_rel_names.json").read_text()) == ["common"]
    assert (ent / "dynamic_rel_count.txt").read_text().strip() == "1"
    assert sorted(json.loads((ent / "entity_names_all_0.json").read_text())) == ["a", "b", "c"]  # d is seen once
    assert sorted(read_back(config)) == sorted([("a", "common", "b")] * 3 + [("b", "common", "c")] * 2)


def test_dynamic_relations_need_rel_col(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path, {"all": 1}, [("x", "all", "all")], dynamic_relations=True, global_emb=False)
    tsv = write_tsv(tmp_path / "e.tsv", [("a", "r", "b")])
    assert run_cli(str(config), str(tsv), "-l", "0", "-r", "2") == 2
    assert "--rel-col is required" in capsys.readouterr().err


def test_no_rel_col_means_relation_zero_and_csv(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"all": 1}, [("only", "all", "all")])
    csv_file = tmp_path / "e.csv"
    csv_file.write_text('src,dst\n"x,1",y\nz,"x,1"\n')
    assert run_cli(str(config), str(csv_file), "-l", "0", "-r", "1", "--header") == 0
    assert read_back(config) == [("x,1", "only", "y"), ("z", "only", "x,1")]


def test_parquet_with_integer_ids(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"all": 2}, [("r0", "all", "all"), ("r1", "all", "all")])
    table = pa.table({"src": pa.array([1, 2, 3, 1], pa.int64()), "rel": ["r0", "r1", "r1", "r0"], "dst": [2, 3, 1, 3]})
    pq.write_table(table, tmp_path / "e.parquet")
    assert run_cli(str(config), str(tmp_path / "e.parquet"), "-l", "0", "-r", "2", "--rel-col", "1") == 0
    assert sorted(read_back(config)) == sorted([("1", "r0", "2"), ("2", "r1", "3"), ("3", "r1", "1"), ("1", "r0", "3")])


def test_multiple_files_go_to_multiple_edge_paths(tmp_path: Path) -> None:
    config = write_config(
        tmp_path, {"all": 1}, [("r", "all", "all")], edge_paths=[str(tmp_path / "train"), str(tmp_path / "test")]
    )
    train = write_tsv(tmp_path / "train.tsv", [("a", "r", "b"), ("b", "r", "c")])
    test = write_tsv(tmp_path / "test.tsv", [("c", "r", "a")])
    assert run_cli(str(config), str(train), str(test), "-l", "0", "-r", "2", "--rel-col", "1") == 0
    names = json.loads((tmp_path / "entities" / "entity_names_all_0.json").read_text())
    with h5py.File(tmp_path / "test" / "edges_0_0.h5", "r") as handle:
        assert [names[handle["lhs"][0]], names[handle["rhs"][0]]] == ["c", "a"]
    assert sorted(read_back(config)) == [("a", "r", "b"), ("b", "r", "c"), ("c", "r", "a")]


def test_space_delimiter_and_gzip(tmp_path: Path) -> None:
    import gzip

    config = write_config(tmp_path, {"all": 1}, [("r", "all", "all")])
    path = tmp_path / "e.txt.gz"
    with gzip.open(path, "wt") as fh:
        fh.write("a r b\nb r c\n")
    assert run_cli(str(config), str(path), "-l", "0", "-r", "2", "--rel-col", "1", "--delimiter", " ") == 0
    assert read_back(config) == [("a", "r", "b"), ("b", "r", "c")]


# Bad input: message text, exit code 2, and no output left behind ------------------------------------


def bad_case(tmp_path: Path, content: str, *extra: str) -> tuple[int, str]:
    config = write_config(tmp_path, {"all": 2}, [("r", "all", "all"), ("s", "all", "all")])
    tsv = tmp_path / "bad.tsv"
    tsv.write_text(content)
    code = run_cli(str(config), str(tsv), "-l", "0", "-r", "2", "--rel-col", "1", *extra)
    return code, str(tsv)


def test_wrong_column_count_names_file_and_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, tsv = bad_case(tmp_path, "a\tr\tb\n\nb\tr\nc\ts\td\n")
    err = capsys.readouterr().err
    assert code == 2
    assert f"{tsv} row 3: has 2 fields, not 3 as in the first row" in err
    assert "Traceback" not in err
    assert not (tmp_path / "entities").exists() and not (tmp_path / "edges").exists()


def test_empty_id_names_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, tsv = bad_case(tmp_path, "a\tr\tb\nb\tr\t\n")
    assert code == 2
    assert f"{tsv} row 2: has an empty rhs id in column 2" in capsys.readouterr().err


def test_unknown_relation_names_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, tsv = bad_case(tmp_path, "a\tr\tb\nb\tnope\tc\n")
    assert code == 2
    err = capsys.readouterr().err
    assert f"{tsv} row 2: has relation type 'nope', which is not in the config" in err
    assert "--skip-bad-rows" in err
    assert not (tmp_path / "entities").exists()


def test_skip_bad_rows_reports_counts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _ = bad_case(tmp_path, "a\tr\tb\nb\tr\nb\tnope\tc\n\tr\tc\nc\ts\ta\n", "--skip-bad-rows")
    assert code == 0
    out = capsys.readouterr().out
    assert "imported 2 edges" in out
    assert "skipped 3 bad rows (1 malformed, 1 with an empty id, 1 with an unknown relation)" in out
    assert sorted(read_back(tmp_path / "config.json")) == [("a", "r", "b"), ("c", "s", "a")]


def test_column_out_of_range(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path, {"all": 1}, [("r", "all", "all")])
    tsv = write_tsv(tmp_path / "e.tsv", [("a", "r", "b")])
    assert run_cli(str(config), str(tsv), "-l", "0", "-r", "5") == 2
    assert f"{tsv}: --rhs-col 5 is out of range: the file has 3 columns in its first row" in capsys.readouterr().err


def test_missing_file_and_file_count_mismatch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path, {"all": 1}, [("r", "all", "all")])
    assert run_cli(str(config), str(tmp_path / "nope.tsv"), "-l", "0", "-r", "1") == 2
    assert f"input file {tmp_path / 'nope.tsv'}: not found" in capsys.readouterr().err
    tsv = write_tsv(tmp_path / "e.tsv", [("a", "r", "b")])
    assert run_cli(str(config), str(tsv), str(tsv), "-l", "0", "-r", "1") == 2
    assert "got 2 input file(s) but the config's edge_paths lists 1" in capsys.readouterr().err


def test_parquet_null_id_names_row(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path, {"all": 1}, [("r", "all", "all")])
    pq.write_table(pa.table({"a": ["x", None, "y"], "b": ["y", "z", "x"]}), tmp_path / "e.parquet")
    assert run_cli(str(config), str(tmp_path / "e.parquet"), "-l", "0", "-r", "1") == 2
    assert "e.parquet row 2: has an empty or null id" in capsys.readouterr().err


def test_subprocess_error_has_no_traceback(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"all": 1}, [("r", "all", "all")])
    tsv = tmp_path / "e.tsv"
    tsv.write_text("a\tr\tb\nc\tq\td\n")
    result = subprocess.run(
        [sys.executable, "-m", "job", "import", str(config), str(tsv), "-l", "0", "-r", "2", "--rel-col", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=60,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert f"biggraph import: error: {tsv} row 2: has relation type 'q', which is not in the config" in result.stderr


# Output locations: checked before any input is read ---------------------------------------------------


def test_unwritable_local_output_is_found_before_reading(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    tsv = tmp_path / "bad.tsv"
    tsv.write_text("a\tr\tb\nb\tnope\tc\n")  # pass 1 would stop at row 2: the output check must come first
    for key, value in (("entity_path", str(blocker / "entities")), ("edge_paths", [str(blocker)])):
        config = write_config(tmp_path, {"all": 1}, [("r", "all", "all")], **{key: value})
        assert run_cli(str(config), str(tsv), "-l", "0", "-r", "2", "--rel-col", "1") == 2
        err = capsys.readouterr().err
        assert "a-file" in err and "not a directory" in err, err
        assert "nope" not in err and "Traceback" not in err
    # a missing local directory is fine (made when writing), and nothing is created by the check itself
    config = write_config(tmp_path, {"all": 1}, [("r", "all", "all")], entity_path=str(tmp_path / "new" / "deep" / "ent"))
    assert run_cli(str(config), str(tsv), "-l", "0", "-r", "2", "--rel-col", "1") == 2
    assert "nope" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


@pytest.mark.slow
def test_missing_bucket_is_found_before_reading(
    tmp_path: Path, s3_endpoint: str, s3_bucket: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import storage_adapters as storage

    tsv = tmp_path / "bad.tsv"
    tsv.write_text("a\tr\tb\nb\tnope\tc\n")
    options = {"endpoint_url": s3_endpoint}
    for key, value in (("entity_path", "s3://nobucket/graph/entities"), ("edge_paths", ["s3://nobucket/graph/edges"])):
        config = write_config(tmp_path, {"all": 1}, [("r", "all", "all")], storage_options=options, **{key: value})
        assert run_cli(str(config), str(tsv), "-l", "0", "-r", "2", "--rel-col", "1") == 2
        err = capsys.readouterr().err
        assert f"{value if isinstance(value, str) else value[0]}: the bucket 'nobucket' does not exist" in err, err
        assert "nope" not in err and "Traceback" not in err
    # an existing bucket passes the check and receives the import
    good = write_tsv(tmp_path / "good.tsv", [("a", "r", "b"), ("b", "r", "c")])
    config = write_config(tmp_path, {"all": 1}, [("r", "all", "all")], storage_options=options,
                          entity_path=f"{s3_bucket}/entities", edge_paths=[f"{s3_bucket}/edges"])
    assert run_cli(str(config), str(good), "-l", "0", "-r", "2", "--rel-col", "1") == 0
    assert "edges_0_0.h5" in storage.listdir(f"{s3_bucket}/edges")
    assert json.loads(storage.read_text(f"{s3_bucket}/entities/entity_names_all_0.json"))


# Internals ---------------------------------------------------------------------------------------------


def test_hash_is_independent_of_batch_padding() -> None:
    # "y" * 40 sends the whole batch through the numpy path; alone, each id of at most 32 bytes is padded by
    # pyarrow (bytes, not characters: multibyte ids get the numpy path's hash)
    ids = ["a", "abcdefg", "abcdefgh", "x" * 31, "y" * 40, "é", "", "日本語", "héllo wörld", "ü" * 16]
    together, lengths = hash_strings(pa.array(ids))
    alone = [hash_strings(pa.array([s]))[0][0] for s in ids]
    assert list(together) == alone
    assert list(lengths) == [len(s.encode()) for s in ids]
    assert len(set(together.tolist())) == len(ids)
    # Large strings and sliced arrays hash alike.
    assert list(hash_strings(pa.array(ids, pa.large_string()))[0]) == alone
    assert list(hash_strings(pa.array(["zz", *ids]).slice(1))[0]) == alone


def test_entity_table_gives_dense_consistent_ids() -> None:
    table = EntityTable()
    first = pa.array(["b", "a", "b", "c"])
    ids = table.encode(hash_strings(first)[0], lambda pos: first.take(pos))
    assert sorted(set(ids.tolist())) == [0, 1, 2] and ids[0] == ids[2]
    second = pa.array(["c", "d", "a"])
    ids2 = table.encode(hash_strings(second)[0], lambda pos: second.take(pos))
    assert ids2[0] == ids[3] and ids2[2] == ids[1] and ids2[1] == 3
    names = table.names().to_pylist()
    assert [names[i] for i in [*ids, *ids2]] == ["b", "a", "b", "c", "c", "d", "a"]
    assert table.counts[ids].tolist() == [2, 2, 2, 2] and table.counts[3] == 1


def test_entity_table_keeps_ids_across_batches_that_grow_it() -> None:
    """Many batches, each bringing new ids and repeating old ones: the merges through the reused buffers keep
    every id where a plain dictionary of first appearances (in hash order within a batch) puts it."""
    rng = np.random.default_rng(7)
    table = EntityTable()
    expected: dict[int, int] = {}
    for size in (5, 300, 40, 900, 1, 0, 2500, 700):
        batch = pa.array([f"e{i}" for i in rng.integers(0, 3000, size)], pa.string())
        hashes = hash_strings(batch)[0]
        ids = table.encode(hashes, lambda pos, batch=batch: batch.take(pos))
        for value in sorted(set(hashes.tolist()) - expected.keys()):
            expected[value] = len(expected)
        assert ids.tolist() == [expected[value] for value in hashes.tolist()]
        assert table.size == len(expected) == len(table.sorted_hashes) == len(table.sorted_ids)
        assert table.sorted_hashes.tolist() == sorted(expected)
        assert table.sorted_ids.tolist() == [expected[value] for value in sorted(expected)]
    names = table.names().to_pylist()
    assert len(set(names)) == table.size
    assert table.hashes_of(np.arange(table.size)).tolist() == hash_strings(pa.array(names))[0].tolist()


@pytest.mark.parametrize("merge_min", [1, 64, 1 << 20])
def test_entity_table_finds_ids_in_both_lookups_until_they_merge(monkeypatch: pytest.MonkeyPatch,
                                                                 merge_min: int) -> None:
    """The ids a batch brings go to the recent lookup, merged into the main one only once it outgrows an eighth of
    it (never, at ``merge_min`` 2^20): every later batch finds each id in whichever lookup holds it, with its first
    id, and the whole lookup read at the end is the same sorted one."""
    from job.data.importing import table as table_module

    monkeypatch.setattr(table_module, "MERGE_MIN", merge_min)
    rng = np.random.default_rng(11)
    table = EntityTable()
    expected: dict[int, int] = {}
    merges = 0
    for size in (2000, 5, 300, 40, 900, 1, 0, 2500, 700, 3, 60):
        batch = pa.array([f"id{i}" for i in rng.integers(0, 4000, size)], pa.string())
        hashes = hash_strings(batch)[0]
        before = len(table._hashes)
        ids = table.encode(hashes, lambda pos, batch=batch: batch.take(pos))
        merges += before != len(table._hashes)
        for value in sorted(set(hashes.tolist()) - expected.keys()):
            expected[value] = len(expected)
        assert ids.tolist() == [expected[value] for value in hashes.tolist()]
        assert table.size == len(expected)
    assert len(table._recent_hashes) > 0 or merge_min == 1  # the recent lookup in use at the end
    assert (merges > 1) == (merge_min < 100)
    assert table.sorted_hashes.tolist() == sorted(expected)
    assert table.sorted_ids.tolist() == [expected[value] for value in sorted(expected)]
    assert not len(table._recent_hashes)
