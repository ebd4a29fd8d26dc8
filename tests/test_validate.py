"""``biggraph validate``: a valid graph passes, and every kind of bad input gets a precise one-line message.

Each case breaks one thing in an otherwise valid graph (tests/helpers_graphs.py) and
checks the message names the file, the dataset, the first bad row and the expectation.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from job.cli import main
from job.config import load_config
from job.errors import InputFormatError
from job.formats.validate import side_partitions, validate_cheap, validate_full

sys.path.insert(0, str(Path(__file__).parent))
from helpers_graphs import SmallGraph, make_graph  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def graph(tmp_path: Path) -> SmallGraph:
    return make_graph(tmp_path, counts={"user": [8, 6], "item": [5, 4]})


def run_validate(graph: SmallGraph, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str, str]:
    code = main(["validate", str(graph.config_path), *extra])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error: ")]


def rewrite_bucket(path: Path, attrs: dict[str, Any] | None = None, **datasets: np.ndarray) -> None:
    """Replace a bucket file with exactly these datasets and root attributes."""
    path.unlink(missing_ok=True)
    with h5py.File(path, "w") as handle:
        for key, value in (attrs if attrs is not None else {"format_version": 1}).items():
            handle.attrs[key] = value
        for name, values in datasets.items():
            handle.create_dataset(name, data=values)


def bucket_arrays(graph: SmallGraph, lhs: int = 0, rhs: int = 0) -> dict[str, np.ndarray]:
    rel, lhs_ids, rhs_ids = graph.edges[(lhs, rhs)]
    return {"rel": rel.copy(), "lhs": lhs_ids.copy(), "rhs": rhs_ids.copy()}


# The valid cases --------------------------------------------------------------------------------


def test_valid_graph_passes_with_summary(graph: SmallGraph, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_validate(graph, capsys)
    assert code == 0, err
    assert "4 entity count files (23 entities), 4 edge files in 1 edge path(s)" in out
    assert f"{graph.edge_path}: 80 edges" in out
    assert err == ""
    assert validate_full(load_config(str(graph.config_path))) == []


def test_empty_bucket_file_is_valid(graph: SmallGraph, capsys: pytest.CaptureFixture[str]) -> None:
    empty = np.empty(0, dtype=np.int64)
    rewrite_bucket(graph.bucket_file(1, 1), rel=empty, lhs=empty, rhs=empty)
    code, out, err = run_validate(graph, capsys)
    assert code == 0, err
    assert "60 edges" in out


def test_unpartitioned_type_uses_partition_zero_count_in_all_buckets(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    graph = make_graph(tmp_path, entities={"user": 2, "item": 1}, counts={"user": [8, 6], "item": [5]})
    config = load_config(str(graph.config_path))
    assert (side_partitions(config, "lhs"), side_partitions(config, "rhs")) == (2, 2)  # user is on both sides
    assert run_validate(graph, capsys)[0] == 0
    arrays = bucket_arrays(graph, 1, 1)
    row = int(np.flatnonzero(arrays["rel"] == 0)[0])  # 'buys': user -> item
    arrays["rhs"][row] = 5
    rewrite_bucket(graph.bucket_file(1, 1), **arrays)
    code, _, err = run_validate(graph, capsys)
    assert code == 2
    assert error_lines(err) == [
        f"error: {graph.bucket_file(1, 1)} dataset 'rhs' row {row}: index 5 out of range for entity type 'item' "
        "partition 0 (relation 'buys') (expected 0 <= rhs < 5, the count of 'item' partition 0)"
    ]


def test_side_with_only_unpartitioned_types_has_one_bucket_column(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    graph = make_graph(
        tmp_path, entities={"user": 3, "item": 1}, relations=[("buys", "user", "item")], counts={"user": [4, 4, 4], "item": [7]}
    )
    assert sorted(graph.edges) == [(0, 0), (1, 0), (2, 0)]
    code, out, err = run_validate(graph, capsys)
    assert code == 0, err
    assert "3 edge files" in out
    rewrite_bucket(graph.edge_path / "edges_0_1.h5", **bucket_arrays(graph))
    code, _, err = run_validate(graph, capsys)
    assert code == 2
    assert f"{graph.edge_path / 'edges_0_1.h5'}: unexpected bucket file (expected buckets" in err


def test_dynamic_relations(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    graph = make_graph(tmp_path, dynamic_rel_count=5, counts={"user": [8, 6], "item": [5, 4]})
    assert run_validate(graph, capsys)[0] == 0
    arrays = bucket_arrays(graph)
    arrays["rel"][4] = 5
    rewrite_bucket(graph.bucket_file(0, 0), **arrays)
    code, _, err = run_validate(graph, capsys)
    assert code == 2
    assert (
        f"{graph.bucket_file(0, 0)} dataset 'rel' row 4: relation id 5 out of range "
        "(expected 0 <= rel < 5, the number of dynamic relations)"
    ) in err
    (graph.entity_path / "dynamic_rel_count.txt").unlink()
    code, _, err = run_validate(graph, capsys)
    assert f"{graph.entity_path / 'dynamic_rel_count.txt'}: missing" in err


# Entity counts --------------------------------------------------------------------------------------


def test_missing_entity_count_file(graph: SmallGraph, capsys: pytest.CaptureFixture[str]) -> None:
    graph.count_file("user", 1).unlink()
    code, _, err = run_validate(graph, capsys)
    assert code == 2
    assert error_lines(err) == [f"error: {graph.count_file('user', 1)}: missing (expected an entity count file)"]


def test_extra_entity_count_file(graph: SmallGraph, capsys: pytest.CaptureFixture[str]) -> None:
    graph.count_file("user", 2).write_text("3\n")
    graph.count_file("stranger", 0).write_text("3\n")
    code, _, err = run_validate(graph, capsys)
    assert code == 2
    assert error_lines(err) == [
        f"error: {graph.count_file('user', 2)}: unexpected count file for partition 2 of entity type 'user' "
        "(expected partitions 0..1 only, as entities.user.num_partitions = 2)"
    ]
    assert f"warning: {graph.count_file('stranger', 0)}: entity type 'stranger' is not in the config" in err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("lots", "not an integer: 'lots' (expected a single non-negative integer)"),
        ("4.5", "not an integer: '4.5' (expected a single non-negative integer)"),
        ("", "not an integer: '' (expected a single non-negative integer)"),
        ("-3", "negative count -3 (expected a single non-negative integer)"),
    ],
)
def test_bad_entity_count(graph: SmallGraph, capsys: pytest.CaptureFixture[str], text: str, message: str) -> None:
    graph.count_file("item", 0).write_text(text)
    code, _, err = run_validate(graph, capsys)
    assert code == 2
    assert error_lines(err) == [f"error: {graph.count_file('item', 0)}: {message}"]


def test_zero_entities_with_edges_pointing_at_it(graph: SmallGraph, capsys: pytest.CaptureFixture[str]) -> None:
    graph.count_file("item", 1).write_text("0\n")
    code, _, err = run_validate(graph, capsys)
    assert code == 2
    arrays = bucket_arrays(graph, 0, 1)
    first = int(np.flatnonzero(arrays["rel"] == 0)[0])
    assert (
        f"error: {graph.bucket_file(0, 1)} dataset 'rhs' row {first}: edge points into entity type 'item' partition 1, "
        "which has 0 entities (relation 'buys')"
    ) in err
    assert "positive count in entity_count_item_1.txt" in err
    assert "warning" not in err


def test_zero_entities_without_edges_is_a_warning(graph: SmallGraph, capsys: pytest.CaptureFixture[str]) -> None:
    graph.count_file("item", 1).write_text("0\n")
    for lhs in (0, 1):  # keep only 'follows' (user -> user) edges in the buckets of item partition 1
        arrays = bucket_arrays(graph, lhs, 1)
        keep = arrays["rel"] == 1
        rewrite_bucket(graph.bucket_file(lhs, 1), **{k: v[keep] for k, v in arrays.items()})
    code, _, err = run_validate(graph, capsys)
    assert code == 0, err
    assert f"warning: {graph.count_file('item', 1)}: partition 1 of entity type 'item' has 0 entities" in err


def test_nonexistent_entity_path(graph: SmallGraph, capsys: pytest.CaptureFixture[str]) -> None:
    missing = graph.root / "nowhere"
    graph.write_config(entity_path=str(missing))
    code, _, err = run_validate(graph, capsys)
    assert code == 2
    assert error_lines(err) == [
        f"error: {missing}: directory not found "
        "(expected the entity_path directory holding entity_count_{type}_{part}.txt files)"
    ]
    assert "Traceback" not in err


# Edge files: presence and structure ----------------------------------------------------------------------


def test_missing_edges_file(graph: SmallGraph, capsys: pytest.CaptureFixture[str]) -> None:
    graph.bucket_file(1, 0).unlink()
    code, _, err = run_validate(graph, capsys)
    assert code == 2
    assert error_lines(err) == [
        f"error: {graph.bucket_file(1, 0)}: missing (expected one edges_{{l}}_{{r}}.h5 file per bucket (an empty one is fine))"
    ]


def test_missing_edge_path_directory(graph: SmallGraph, capsys: pytest.CaptureFixture[str]) -> None:
    missing = graph.root / "no-edges"
    graph.write_config(edge_paths=[str(graph.edge_path), str(missing)])
    code, _, err = run_validate(graph, capsys)
    assert code == 2
    assert error_lines(err) == [
        f"error: {missing}: directory not found (expected an edge_paths directory holding edges_{{l}}_{{r}}.h5 files)"
    ]


@pytest.mark.parametrize("dataset", ["rel", "lhs", "rhs"])
def test_missing_dataset(graph: SmallGraph, capsys: pytest.CaptureFixture[str], dataset: str) -> None:
    arrays = bucket_arrays(graph)
    del arrays[dataset]
    rewrite_bucket(graph.bucket_file(0, 0), **arrays)
    code, _, err = run_validate(graph, capsys)
    assert code == 2
    assert error_lines(err) == [f"error: {graph.bucket_file(0, 0)} dataset '{dataset}': missing (expected a 1-D integer dataset)"]


def test_lengths_differ(graph: SmallGraph, capsys: pytest.CaptureFixture[str]) -> None:
    arrays = bucket_arrays(graph)
    arrays["lhs"] = arrays["lhs"][:-1]
    rewrite_bucket(graph.bucket_file(0, 0), **arrays)
    code, _, err = run_validate(graph, capsys)
    assert code == 2
    assert error_lines(err) == [
        f"error: {graph.bucket_file(0, 0)}: datasets differ in length (rel=20, lhs=19, rhs=20) "
        "(expected rel, lhs and rhs of equal length)"
    ]


def test_two_dimensional_dataset(graph: SmallGraph, capsys: pytest.CaptureFixture[str]) -> None:
    arrays = bucket_arrays(graph)
    arrays["rhs"] = arrays["rhs"].reshape(4, 5)
    rewrite_bucket(graph.bucket_file(0, 0), **arrays)
    code, _, err = run_validate(graph, capsys)
    assert code == 2
    assert error_lines(err) == [
        f"error: {graph.bucket_file(0, 0)} dataset 'rhs': has shape (4, 5) (expected a 1-D integer dataset)"
    ]


def test_float_ids(graph: SmallGraph, capsys: pytest.CaptureFixture[str]) -> None:
    arrays = bucket_arrays(graph)
    arrays["lhs"] = arrays["lhs"].astype(np.float64)
    rewrite_bucket(graph.bucket_file(0, 0), **arrays)
    code, _, err = run_validate(graph, capsys)
    assert code == 2
    assert error_lines(err) == [
        f"error: {graph.bucket_file(0, 0)} dataset 'lhs': has dtype float64 (expected an integer dtype (ids are offsets))"
    ]


def test_wrong_format_version(graph: SmallGraph, capsys: pytest.CaptureFixture[str]) -> None:
    rewrite_bucket(graph.bucket_file(0, 1), attrs={"format_version": 2}, **bucket_arrays(graph, 0, 1))
    code, _, err = run_validate(graph, capsys)
    assert code == 2
    assert error_lines(err) == [
        f"error: {graph.bucket_file(0, 1)}: format_version is 2 (expected format_version = 1 on the root group)"
    ]


def test_missing_format_version(graph: SmallGraph, capsys: pytest.CaptureFixture[str]) -> None:
    rewrite_bucket(graph.bucket_file(0, 1), attrs={}, **bucket_arrays(graph, 0, 1))
    code, _, err = run_validate(graph, capsys)
    assert code == 2
    assert error_lines(err) == [
        f"error: {graph.bucket_file(0, 1)}: no 'format_version' attribute (expected format_version = 1 on the root group)"
    ]


def test_truncated_hdf5(graph: SmallGraph, capsys: pytest.CaptureFixture[str]) -> None:
    path = graph.bucket_file(1, 1)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    code, _, err = run_validate(graph, capsys)
    assert code == 2
    assert error_lines(err) == [
        f"error: {path}: truncated HDF5 file ({len(data) // 2} bytes, its header says {len(data)}) "
        "(expected a complete HDF5 file)"
    ]


def test_corrupt_data_found_by_the_scan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Header intact but a compressed chunk garbled: the scan names the first rows it cannot read."""
    graph = make_graph(tmp_path, entities={"user": 1, "item": 1}, counts={"user": [50], "item": [50]}, edges_per_bucket=1)
    path = graph.bucket_file(0, 0)
    path.unlink()
    n = 40_000
    with h5py.File(path, "w") as handle:
        handle.attrs["format_version"] = 1
        for name in ("rel", "lhs", "rhs"):
            handle.create_dataset(name, data=np.arange(n) % 2, chunks=(10_000,), compression="gzip")
        offset = handle["lhs"].id.get_chunk_info(2).byte_offset  # rows 20000..29999 of lhs
    data = bytearray(path.read_bytes())
    data[offset : offset + 64] = b"\xff" * 64
    path.write_bytes(bytes(data))
    code, _, err = run_validate(graph, capsys, "--chunk-rows", "10000")
    assert code == 2
    (line,) = error_lines(err)
    assert line.startswith(f"error: {path} dataset 'lhs' row 20000: cannot read rows 20000..29999 (")
    assert line.endswith("the file is truncated or corrupt (expected a complete HDF5 file)")


def test_random_bytes_named_h5(graph: SmallGraph, capsys: pytest.CaptureFixture[str]) -> None:
    graph.bucket_file(0, 0).write_bytes(np.random.default_rng(0).bytes(4096))
    code, _, err = run_validate(graph, capsys)
    assert code == 2
    (line,) = error_lines(err)
    assert line.startswith(f"error: {graph.bucket_file(0, 0)}: not a readable HDF5 file")
    assert line.endswith("(expected an HDF5 file)")


# Edge files: values ------------------------------------------------------------------------------------


def test_negative_index(graph: SmallGraph, capsys: pytest.CaptureFixture[str]) -> None:
    arrays = bucket_arrays(graph)
    arrays["rhs"][5] = -1
    rewrite_bucket(graph.bucket_file(0, 0), **arrays)
    code, _, err = run_validate(graph, capsys)
    assert code == 2
    rhs_type = "item" if arrays["rel"][5] == 0 else "user"
    relation = "buys" if arrays["rel"][5] == 0 else "follows"
    limit = {"item": 5, "user": 8}[rhs_type]
    assert error_lines(err) == [
        f"error: {graph.bucket_file(0, 0)} dataset 'rhs' row 5: negative index -1 for entity type '{rhs_type}' "
        f"(relation '{relation}') (expected 0 <= rhs < {limit}, the count of '{rhs_type}' partition 0)"
    ]


@pytest.mark.parametrize("chunk_rows", [1_000_000, 3])
def test_lhs_out_of_range_reports_first_bad_row(graph: SmallGraph, capsys: pytest.CaptureFixture[str], chunk_rows: int) -> None:
    arrays = bucket_arrays(graph, 1, 0)  # lhs is 'user' partition 1: 6 entities, for both relations
    arrays["lhs"][7] = 6
    arrays["lhs"][15] = 100
    rewrite_bucket(graph.bucket_file(1, 0), **arrays)
    code, _, err = run_validate(graph, capsys, "--chunk-rows", str(chunk_rows))
    assert code == 2
    relation = "buys" if arrays["rel"][7] == 0 else "follows"
    assert error_lines(err) == [
        f"error: {graph.bucket_file(1, 0)} dataset 'lhs' row 7: index 6 out of range for entity type 'user' partition 1 "
        f"(relation '{relation}'); 2 bad rows in all (expected 0 <= lhs < 6, the count of 'user' partition 1)"
    ]


def test_rel_out_of_range(graph: SmallGraph, capsys: pytest.CaptureFixture[str]) -> None:
    arrays = bucket_arrays(graph)
    arrays["rel"][3] = 2
    arrays["rel"][9] = -4
    rewrite_bucket(graph.bucket_file(0, 0), **arrays)
    code, _, err = run_validate(graph, capsys)
    assert code == 2
    assert error_lines(err) == [
        f"error: {graph.bucket_file(0, 0)} dataset 'rel' row 3: relation id 2 out of range; 2 bad rows in all "
        "(expected 0 <= rel < 2, the number of relation types)"
    ]


def test_all_problems_are_collected(graph: SmallGraph, capsys: pytest.CaptureFixture[str]) -> None:
    graph.count_file("user", 0).write_text("x")
    graph.bucket_file(1, 1).unlink()
    arrays = bucket_arrays(graph, 0, 1)
    arrays["rel"][0] = 7
    arrays["rhs"][2] = -2
    rewrite_bucket(graph.bucket_file(0, 1), attrs={}, **arrays)
    code, _, err = run_validate(graph, capsys)
    assert code == 2
    lines = error_lines(err)
    assert len(lines) == 5, lines
    assert lines[0].startswith(f"error: {graph.count_file('user', 0)}: not an integer")
    assert f"{graph.bucket_file(0, 1)}: no 'format_version' attribute" in lines[1]
    assert f"{graph.bucket_file(0, 1)} dataset 'rel' row 0:" in lines[2]
    assert f"{graph.bucket_file(0, 1)} dataset 'rhs' row 2: negative index -2" in lines[3]
    assert f"{graph.bucket_file(1, 1)}: missing" in lines[4]
    assert err.rstrip().endswith("biggraph validate: 5 problem(s) found")


# validate_cheap (what train calls) --------------------------------------------------------------------


def test_validate_cheap_raises_first_structural_problem_only(graph: SmallGraph) -> None:
    arrays = bucket_arrays(graph)
    arrays["lhs"][0] = 1000  # a value problem: not the cheap check's business
    rewrite_bucket(graph.bucket_file(0, 0), **arrays)
    config = load_config(str(graph.config_path))
    validate_cheap(config)
    assert len(validate_full(config)) == 1
    rewrite_bucket(graph.bucket_file(0, 1), attrs={"format_version": 3}, **bucket_arrays(graph, 0, 1))
    graph.bucket_file(1, 1).unlink()
    with pytest.raises(InputFormatError) as info:
        validate_cheap(config)
    assert str(info.value) == f"{graph.bucket_file(0, 1)}: format_version is 3 (expected format_version = 1 on the root group)"
    graph.count_file("item", 1).write_text("-1")
    with pytest.raises(InputFormatError, match="negative count -1"):
        validate_cheap(config)


def test_validate_cheap_on_s3_checks_every_bucket_and_raises_the_first_problem_in_bucket_order(
        tmp_path: Path, s3_endpoint: str, s3_bucket: str) -> None:
    """On an object store the cheap check opens the bucket files together (a trainer restarted into a torchrun round
    pays it again): whichever finishes first, the problem of the first bucket in (lhs, rhs) order is the one raised,
    and a whole graph passes."""
    import dataclasses

    import s3fs

    graph = make_graph(tmp_path, entities={"user": 4, "item": 4}, counts={"user": [3, 2, 2, 3], "item": [2, 2, 2, 2]})
    fs = s3fs.S3FileSystem(endpoint_url=s3_endpoint, skip_instance_cache=True)

    def upload(name: str) -> Any:
        fs.put(str(graph.entity_path), f"{s3_bucket}/{name}/entities", recursive=True)
        fs.put(str(graph.edge_path), f"{s3_bucket}/{name}/edges", recursive=True)
        return dataclasses.replace(load_config(str(graph.config_path)), entity_path=f"{s3_bucket}/{name}/entities",
                                   edge_paths=[f"{s3_bucket}/{name}/edges"], storage_options={"endpoint_url": s3_endpoint})

    validate_cheap(upload("whole"))
    config = upload("holed")  # (another prefix: the storage layer's listing of the first one is cached)
    for lhs, rhs in ((3, 1), (1, 2), (2, 0)):
        fs.rm(f"{s3_bucket}/holed/edges/edges_{lhs}_{rhs}.h5")
    with pytest.raises(InputFormatError) as info:
        validate_cheap(config)
    assert str(info.value).startswith(f"{s3_bucket}/holed/edges/edges_1_2.h5: missing"), str(info.value)


# Through a real process -----------------------------------------------------------------------------------


def test_subprocess_exit_code_and_no_traceback(graph: SmallGraph) -> None:
    graph.bucket_file(0, 0).write_bytes(b"not hdf5 at all")
    graph.count_file("user", 1).unlink()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run(
        [sys.executable, "-m", "job", "validate", str(graph.config_path)],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert f"error: {graph.count_file('user', 1)}: missing" in result.stderr
    assert f"error: {graph.bucket_file(0, 0)}: not a readable HDF5 file" in result.stderr
