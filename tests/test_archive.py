"""Model archive: checkpoint -> zip of tagged FlatBuffers -> torch-free load, same scores as the trainer."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pytest
import torch
from storage_scope import use_storage

from job.archive import (
    ArchiveError,
    ArchiveFormatError,
    ArchiveIntegrityError,
    DanglingReferenceError,
    QueryError,
    ShapeMismatchError,
    TagError,
    load,
    verify,
)
from job.archive import writer as archive_writer
from job.archive.container import ZipWriter
from job.archive.evaluate import link_prediction_metrics
from job.archive.ndarray import decode, encode, quantize_int8
from job.archive.writer import add_tag
from job.cli import main as cli_main
from job.config import parse_config
from job.errors import UserError
from job.formats.checkpoint import CheckpointStorage
from job.formats.entities import write_dynamic_rel_count, write_dynamic_rel_names, write_entity_count, write_entity_names
from job.model.scoring import Model
from job.model.side import Side
from job.train.batch.optim import row_adagrad_state
from storage_adapters import StorageSettings, using

REPO = Path(__file__).resolve().parents[1]

# (name, config overrides, relations, entities, num_dynamic)
STATIC_RELATIONS = [
    {"name": "a_to_b", "lhs": "a", "rhs": "b", "operator": "linear"},
    {"name": "b_to_a", "lhs": "b", "rhs": "a", "operator": "complex_diagonal"},
    {"name": "a_to_a", "lhs": "a", "rhs": "a", "operator": "affine"},
    {"name": "b_to_b", "lhs": "b", "rhs": "b", "operator": "diagonal"},
    {"name": "trans", "lhs": "a", "rhs": "b", "operator": "translation"},
    {"name": "plain", "lhs": "b", "rhs": "a", "operator": "none"},
]
ENTITIES = {"a": {"num_partitions": 2}, "b": {"num_partitions": 1}}
COUNTS = {"a": [7, 5], "b": [9]}


def write_checkpoint(root: Path, comparator: str = "cos", bias: bool = False, dynamic: bool = False,
                     operator: str = "complex_diagonal", versions: int = 2, seed: int = 0) -> dict[str, Any]:
    """A checkpoint written directly (random tables and operator parameters), ``versions`` committed versions."""
    rng = np.random.default_rng(seed)
    entity_path = root / "entities"
    num_dynamic = 4 if dynamic else 0
    entities = {"n": {"num_partitions": 1}} if dynamic else ENTITIES
    counts = {"n": [11]} if dynamic else COUNTS
    relations = [{"name": "all", "lhs": "n", "rhs": "n", "operator": operator}] if dynamic else STATIC_RELATIONS
    raw = {
        "entities": entities, "relations": relations, "dimension": 8, "comparator": comparator, "bias": bias,
        "dynamic_relations": dynamic, "global_emb": not dynamic, "entity_path": str(entity_path),
        "edge_paths": [str(root / "edges")], "checkpoint_path": str(root / "checkpoints"), "workers": 1,
    }
    config = parse_config(raw)
    for entity_type, parts in counts.items():
        for part, count in enumerate(parts):
            write_entity_count(str(entity_path), entity_type, part, count)
            if entity_type != "b":  # type b gets generated names
                write_entity_names(str(entity_path), entity_type, part, [f"{entity_type}{part}:{i}" for i in range(count)])
    if dynamic:
        write_dynamic_rel_count(str(entity_path), num_dynamic)
        write_dynamic_rel_names(str(entity_path), [f"rel {i}" if i else "first" for i in range(num_dynamic)])
    storage = CheckpointStorage(config.checkpoint_path)
    storage.prepare()
    storage.save_config(config.to_json())
    model = Model(config, num_dynamic)
    for version in range(1, versions + 1):
        for entity_type, parts in counts.items():
            for part, count in enumerate(parts):
                table = rng.normal(size=(count, 8)).astype(np.float32)
                sums = torch.from_numpy(rng.random(count).astype(np.float32))
                storage.save_entity_partition(version, entity_type, part, table, row_adagrad_state(sums, 0.1, 3))
        state = {}
        for name, (private, tensor) in model.public_state_dict().items():
            state[name] = (private, rng.normal(size=tuple(tensor.shape)).astype(np.float32))
        optim = {"state": {i: {"step": torch.tensor(3.0), "sum": torch.from_numpy(rng.random(a.shape).astype(np.float32))}
                           for i, (_, a) in enumerate(state.values())},
                 "param_groups": [{"lr": 0.1, "params": list(range(len(state)))}]}
        storage.save_model(version, state, optim, {"config/json": config.to_json()})
        storage.save_version(version)
    storage.append_stats([{"epoch_idx": 0, "stats": {"metrics": {"loss": 1.5}}}])
    return raw


def trainer_scores(raw: dict[str, Any], version: int, rel_idx: int, rel_rows: Optional[np.ndarray],
                   lhs_rows: np.ndarray, rhs_rows: np.ndarray) -> np.ndarray:
    """Forward scores from the trainer's own torch scoring (Model.score_batch, positives only)."""
    config = parse_config(raw)
    storage = CheckpointStorage(config.checkpoint_path)
    num_dynamic = 4 if config.dynamic_relations else 0
    model = Model(config, num_dynamic)
    params, _, _ = storage.load_model(version)
    model.load_public_state_dict(params, "test")
    relation = config.relations[rel_idx]

    def table(entity_type: str) -> torch.Tensor:
        parts = [storage.load_entity_partition(version, entity_type, p)[0]
                 for p in range(config.entities[entity_type].num_partitions)]
        return torch.from_numpy(np.concatenate(parts))

    lhs_table = table(relation.lhs)
    rhs_table = lhs_table if relation.lhs == relation.rhs else table(relation.rhs)
    with torch.no_grad():
        # rhs_table is lhs_table when both sides are one type: one set of rows
        lhs_scores, _ = model.score_batch(
            rel_idx, torch.from_numpy(rel_rows) if rel_rows is not None else None,
            lhs=Side(lhs_table, torch.from_numpy(lhs_rows), negs_disabled=True),
            rhs=Side(rhs_table, torch.from_numpy(rhs_rows), negs_disabled=True), num_batch_negs=0, all_negs=False,
        )
    return lhs_scores.pos.numpy()


def names_of(model: Any, entity_type: str, rows: np.ndarray) -> list[str]:
    names = model.entity_names(entity_type)
    return [names[i] for i in rows]


@pytest.fixture(scope="module")
def static_archive(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    root = tmp_path_factory.mktemp("static")
    raw = write_checkpoint(root, comparator="cos")
    out = str(root / "model.zip")
    config = parse_config(raw)
    add_tag(config, out, version=1)
    add_tag(config, out, dtype="fp32")
    add_tag(config, out, dtype="fp16")
    add_tag(config, out, dtype="int8", include_updater=True)
    return raw, out


# round trips ---------------------------------------------------------------------------------------------


def test_tags_sharing_and_two_versions(static_archive: tuple[dict[str, Any], str]) -> None:
    raw, out = static_archive
    with zipfile.ZipFile(out) as handle:
        assert handle.read("tags.txt").decode().split() == ["v1-fp32", "v2-fp32", "v2-fp16", "v2-int8"]
        assert all(info.compress_type == zipfile.ZIP_STORED for info in handle.infolist())
        int8_params = dict(line.split() for line in handle.read("v2-int8/params.txt").decode().splitlines())
        v1_params = dict(line.split() for line in handle.read("v1-fp32/params.txt").decode().splitlines())
    # embeddings are the tag's own files; operators and global embeddings refer to the fp32 tag of version 2
    assert all(not int8_params[f"embeddings/{t}/{p}"].count("/") for t, c in COUNTS.items() for p in range(len(c)))
    shared = {k: v for k, v in int8_params.items() if not k.startswith("embeddings/")}
    assert shared and all(v.startswith("v2-fp32/") for v in shared.values())
    assert all("/" not in v for v in v1_params.values())  # version 1 shares nothing with version 2
    storage = CheckpointStorage(raw["checkpoint_path"])
    newest = load(out)
    assert newest.tag == "v2-int8" and newest.tags == ["v1-fp32", "v2-fp32", "v2-fp16", "v2-int8"]
    with load(out, "V2-FP32") as fp32, load(out, "v1-fp32") as v1:  # tags are case-insensitive
        for name, value in storage.load_model(2)[0].items():
            assert np.array_equal(fp32.param(name), value)
            assert np.array_equal(newest.param(name), value)  # shared by reference, resolved, exact
        assert np.array_equal(fp32.table("a"), np.concatenate([storage.load_entity_partition(2, "a", p)[0] for p in (0, 1)]))
        assert np.array_equal(v1.table("b"), storage.load_entity_partition(1, "b", 0)[0])
        assert not np.array_equal(v1.table("b"), fp32.table("b"))
        assert fp32.checkpoint_version == 2 and v1.checkpoint_version == 1
        assert fp32.training["training_stats"][0]["stats"]["metrics"]["loss"] == 1.5
        assert fp32.config["comparator"] == "cos"
    newest.close()
    assert set(verify(out)) == {"v1-fp32", "v2-fp32", "v2-fp16", "v2-int8"}


@pytest.mark.parametrize("comparator,bias", [("cos", False), ("dot", True), ("l2", False), ("squared_l2", True)])
def test_fp32_scores_equal_trainer_scoring(tmp_path: Path, comparator: str, bias: bool) -> None:
    raw = write_checkpoint(tmp_path, comparator=comparator, bias=bias)
    out = str(tmp_path / "m.zip")
    add_tag(parse_config(raw), out)
    rng = np.random.default_rng(1)
    with load(out) as model:
        for rel_idx, relation in enumerate(STATIC_RELATIONS):
            lhs_rows = rng.integers(0, model.entity_count(relation["lhs"]), 30)
            rhs_rows = rng.integers(0, model.entity_count(relation["rhs"]), 30)
            expected = trainer_scores(raw, 2, rel_idx, None, lhs_rows, rhs_rows)
            got = model.score(names_of(model, relation["lhs"], lhs_rows), relation["name"],
                              names_of(model, relation["rhs"], rhs_rows))
            np.testing.assert_allclose(got, expected, rtol=2e-6, atol=2e-6)
            one = model.score(model.entity_names(relation["lhs"])[lhs_rows[0]], rel_idx,
                              model.entity_names(relation["rhs"])[rhs_rows[0]])
            assert one == pytest.approx(float(expected[0]), rel=2e-6, abs=2e-6)


@pytest.mark.parametrize("operator", ["complex_diagonal", "linear", "affine", "translation"])
def test_dynamic_relations_score_forward_direction(tmp_path: Path, operator: str) -> None:
    raw = write_checkpoint(tmp_path, comparator="dot", dynamic=True, operator=operator)
    out = str(tmp_path / "m.zip")
    add_tag(parse_config(raw), out, tag="dyn")
    with load(out, "dyn") as model:
        assert model.relation_names == ["first", "rel 1", "rel 2", "rel 3"]
        rng = np.random.default_rng(2)
        rel_rows = rng.integers(0, 4, 40)
        lhs_rows, rhs_rows = rng.integers(0, 11, 40), rng.integers(0, 11, 40)
        expected = trainer_scores(raw, 2, 0, rel_rows, lhs_rows, rhs_rows)
        for i in range(40):
            got = model.score(f"n0:{lhs_rows[i]}", int(rel_rows[i]), f"n0:{rhs_rows[i]}")
            assert got == pytest.approx(float(expected[i]), rel=2e-6, abs=2e-6)
        # nearest with a relation ranks rhs candidates by exactly these scores
        all_rhs = model.score(["n0:3"] * 11, "rel 2", model.entity_names("n"))
        best = model.nearest("n0:3", k=11, relation="rel 2")
        assert [n for n, _ in best] == [model.entity_names("n")[i] for i in np.lexsort((np.arange(11), -all_rhs))]


def test_nearest_matches_brute_force(static_archive: tuple[dict[str, Any], str]) -> None:
    _, out = static_archive
    with load(out, "v2-fp32") as model:
        vecs = model.prepared("a")
        for row in (0, 8):
            name = model.entity_names("a")[row]
            expected = [(model.entity_names("a")[j], float(vecs[row] @ vecs[j])) for j in range(len(vecs)) if j != row]
            expected.sort(key=lambda p: -p[1])
            got = model.nearest(name, k=4)
            assert [n for n, _ in got] == [n for n, _ in expected[:4]]
            assert [s for _, s in got] == pytest.approx([s for _, s in expected[:4]], abs=1e-6)
        # with a relation: the best rhs of (u, r, .) by score()
        scores = model.score("a0:2", "a_to_b", model.entity_names("b"))
        got = model.nearest("a0:2", k=3, relation="a_to_b")
        assert [n for n, _ in got] == [model.entity_names("b")[i] for i in np.argsort(-scores)[:3]]
        assert [s for _, s in got] == pytest.approx(np.sort(scores)[::-1][:3].tolist(), abs=1e-6)
        assert model.entity_names("b")[:2] == ["b_0_0", "b_0_1"]  # no names file: generated as the exporter does
        emb = model.embedding("a1:0")
        assert np.array_equal(emb, model.table("a")[7] + model.param("entities/a/global_embedding"))
        with pytest.raises(QueryError, match="unknown entity 'zzz'"):
            model.nearest("zzz")
        with pytest.raises(QueryError, match="unknown relation"):
            model.score("a0:0", "nope", "b_0_0")
        with pytest.raises(QueryError, match="takes lhs entities of type 'a'"):
            model.nearest("b_0_1", relation="a_to_b")


def test_fp16_and_int8_bounded_error(static_archive: tuple[dict[str, Any], str]) -> None:
    _, out = static_archive
    with load(out, "v2-fp32") as fp32, load(out, "v2-fp16") as fp16, load(out, "v2-int8") as int8:
        for entity_type in ("a", "b"):
            exact = fp32.table(entity_type)
            peak = np.abs(exact).max(1, keepdims=True)
            assert np.all(np.abs(int8.table(entity_type) - exact) <= peak / 127 / 2 + 1e-7)
            assert np.all(np.abs(fp16.table(entity_type) - exact) <= np.abs(exact) * 2**-11 + 1e-7)
        rng = np.random.default_rng(5)
        for relation in STATIC_RELATIONS:
            lhs = names_of(fp32, relation["lhs"], rng.integers(0, fp32.entity_count(relation["lhs"]), 50))
            rhs = names_of(fp32, relation["rhs"], rng.integers(0, fp32.entity_count(relation["rhs"]), 50))
            ref = fp32.score(lhs, relation["name"], rhs)
            assert np.abs(int8.score(lhs, relation["name"], rhs) - ref).max() < 0.03  # cos scores lie in [-1, 1]
            assert np.abs(fp16.score(lhs, relation["name"], rhs) - ref).max() < 2e-3


def test_updater_state_round_trip(static_archive: tuple[dict[str, Any], str]) -> None:
    raw, out = static_archive
    from job.archive.loader import ArchiveReader

    storage = CheckpointStorage(raw["checkpoint_path"])
    reader = ArchiveReader(out)
    try:
        _, _, training, updater = reader.load_tag("v2-int8", with_updater=True)
        assert training["has_updater_state"] and training["storage_dtype"] == "int8"
        _, state = storage.load_entity_partition(2, "a", 1)
        assert np.array_equal(updater["embeddings/a/1"][0].stored, state["state"][0]["sum"].numpy())
        _, optim, _ = storage.load_model(2)
        names = list(Model(parse_config(raw)).public_state_dict())
        assert np.array_equal(updater[names[-1]][0].stored, optim["state"][len(names) - 1]["sum"].numpy())
        assert reader.load_tag("v2-fp32", with_updater=True)[3] == {}
    finally:
        reader.close()


def test_arrays_are_aligned_views_of_the_file(static_archive: tuple[dict[str, Any], str]) -> None:
    _, out = static_archive
    with load(out, "v2-fp32") as model:
        table = model.param("embeddings/a/0")
        assert not table.flags.owndata and not table.flags.writeable
        assert table.__array_interface__["data"][0] % 64 == 0


def test_ndarray_codec() -> None:
    x = np.random.default_rng(0).normal(size=(3, 4, 5)).astype(np.float32)
    for storage in ("fp32", "fp16", "int8"):
        decoded = decode(memoryview(encode(x, storage)), "a", "m")
        assert decoded.shape == (3, 4, 5)
        assert np.allclose(decoded.to_float32(), x, atol=np.abs(x).max() / 127)
    q, scales = quantize_int8(np.zeros((2, 3), np.float32))
    assert not q.any() and not scales.any()
    ints = np.arange(6, dtype=np.int64).reshape(2, 3)
    assert np.array_equal(decode(memoryview(encode(ints, "native")), "a", "m").stored, ints)


def test_import_is_torch_free(static_archive: tuple[dict[str, Any], str]) -> None:
    _, out = static_archive
    code = (
        "import sys\nfrom job.archive import load\n"
        f"m = load({out!r})\nprint(m.nearest('a0:1', k=2))\n"
        "bad = [n for n in ('torch', 'h5py', 'storage_adapters', 'job.config') if n in sys.modules]\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


# errors ---------------------------------------------------------------------------------------------------


def rewrite(src: str, dst: str, change: Callable[[str, bytes], Optional[bytes]], extra: Optional[dict[str, bytes]] = None,
            compress: tuple[str, ...] = ()) -> None:
    """Copy an archive member by member; ``change`` returns new bytes, or None to drop the member."""
    with zipfile.ZipFile(src) as handle:
        members = [(info.filename, handle.read(info.filename)) for info in handle.infolist()]
    with ZipWriter(dst) as writer:
        for name, data in members:
            new = change(name, data)
            if new is None:
                continue
            if name in compress:
                assert writer._zip.fp is not None
                writer._zip.writestr(name, new, compress_type=zipfile.ZIP_DEFLATED)
            else:
                writer.write(name, new)
        for name, data in (extra or {}).items():
            writer.write(name, data)


def keep(name: str, data: bytes) -> bytes:
    return data


@pytest.fixture()
def small_archive(tmp_path: Path) -> tuple[dict[str, Any], str]:
    raw = write_checkpoint(tmp_path / "cp", versions=1)
    out = str(tmp_path / "m.zip")
    add_tag(parse_config(raw), out, tag="base")
    add_tag(parse_config(raw), out, tag="small", dtype="int8")
    return raw, out


def test_adding_existing_or_invalid_tag_is_refused(small_archive: tuple[dict[str, Any], str]) -> None:
    raw, out = small_archive
    before = Path(out).read_bytes()
    with pytest.raises(TagError, match="tag 'BASE' is already in the archive"):
        add_tag(parse_config(raw), out, tag="BASE")
    for bad in ("a/b", "..", "", "with space", "-x", "x" * 101):
        with pytest.raises(TagError):
            add_tag(parse_config(raw), out, tag=bad or "/")
    with pytest.raises(UserError, match="no committed checkpoint version 7"):
        add_tag(parse_config(raw), out, tag="x", version=7)
    assert Path(out).read_bytes() == before  # untouched
    assert not [p for p in os.listdir(os.path.dirname(out)) if ".tmp-" in p]


@pytest.mark.parametrize("case,error,pattern", [
    ("unknown tag", TagError, r"member 'tags.txt': unknown tag 'nope' \(tags: base, small\)"),
    ("duplicate tag", TagError, r"member 'tags.txt': duplicate tag 'BASE'"),
    ("invalid tag", TagError, r"member 'tags.txt': invalid tag 'a b'"),
    ("folder without tag", TagError, r"member 'ghost/params/0.fb': belongs to no tag"),
    ("dangling tag", DanglingReferenceError, r"member 'small/params.txt': line \d+: .* tag 'gone' is not in tags.txt"),
    ("dangling file", DanglingReferenceError, r"member 'base/params/99.fb': missing"),
    ("shape", ShapeMismatchError, r"member 'small/params/0.fb': variable 'embeddings/a/0' has shape \(7, 4\)"),
    ("dtype", ShapeMismatchError, r"member 'small/params/0.fb': variable 'embeddings/a/0' is float16 but graph.fb "
                                  r"declares int8"),
    ("crc", ArchiveIntegrityError, r"member 'small/params/0.fb': bad CRC-32"),
    ("truncated", ArchiveIntegrityError, r"member 'small/params/0.fb': truncated: \d+ of \d+ bytes present"),
    ("compressed", ArchiveFormatError, r"member 'small/graph.fb': is compressed"),
    ("not flatbuffers", ArchiveFormatError, r"member 'small/graph.fb': not a graph FlatBuffer"),
    ("missing graph", DanglingReferenceError, r"member 'small/graph.fb': missing"),
])
def test_corrupt_archives_name_the_member(small_archive: tuple[dict[str, Any], str], tmp_path: Path, case: str,
                                          error: type, pattern: str) -> None:
    _, out = small_archive
    bad = str(tmp_path / "bad.zip")
    tag = "small"
    if case == "unknown tag":
        shutil.copy(out, bad)
        tag = "nope"
    elif case in ("duplicate tag", "invalid tag"):
        extra_tag = "BASE" if case == "duplicate tag" else "a b"
        rewrite(out, bad, lambda n, d: d + f"{extra_tag}\n".encode() if n == "tags.txt" else d)
    elif case == "folder without tag":
        rewrite(out, bad, keep, extra={"ghost/params/0.fb": b"x"})
    elif case == "dangling tag":
        rewrite(out, bad, lambda n, d: d.replace(b"base/", b"gone/") if n == "small/params.txt" else d)
    elif case == "dangling file":
        rewrite(out, bad, lambda n, d: d.replace(b"base/3\n", b"base/99\n") if n == "small/params.txt" else d)
    elif case in ("shape", "dtype"):
        array = np.zeros((7, 4), np.float32) if case == "shape" else np.zeros((7, 8), np.float32)
        storage = "int8" if case == "shape" else "fp16"
        rewrite(out, bad, lambda n, d: encode(array, storage) if n == "small/params/0.fb" else d)
    elif case == "crc":
        data = bytearray(Path(out).read_bytes())
        with zipfile.ZipFile(out) as handle:
            info = handle.getinfo("small/params/0.fb")
        from job.archive.container import ZipReader

        reader = ZipReader(out)
        start = reader.data_offset("small/params/0.fb")
        reader.close()
        data[start + info.file_size // 2] ^= 0xFF
        Path(bad).write_bytes(bytes(data))
    elif case == "truncated":
        from job.archive.container import ZipReader

        reader = ZipReader(out)
        start = reader.data_offset("small/params/0.fb")
        reader.close()
        Path(bad).write_bytes(Path(out).read_bytes()[:start + 50])
    elif case == "compressed":
        rewrite(out, bad, keep, compress=("small/graph.fb",))
    elif case == "not flatbuffers":
        rewrite(out, bad, lambda n, d: b"\0" * 64 if n == "small/graph.fb" else d)
    elif case == "missing graph":
        rewrite(out, bad, lambda n, d: None if n == "small/graph.fb" else d)
    with pytest.raises(error, match=pattern) as caught:
        load(bad, tag)
    assert isinstance(caught.value, UserError) and isinstance(caught.value, ArchiveError)


def test_not_an_archive(tmp_path: Path) -> None:
    with pytest.raises(ArchiveError, match="missing"):
        load(str(tmp_path / "none.zip"))
    (tmp_path / "x.zip").write_bytes(b"hello")
    with pytest.raises(ArchiveFormatError, match="not a readable zip archive"):
        load(str(tmp_path / "x.zip"))
    with zipfile.ZipFile(tmp_path / "y.zip", "w") as handle:
        handle.writestr("other.txt", "x")
    with pytest.raises(TagError, match="member 'tags.txt': missing"):
        load(str(tmp_path / "y.zip"))


# CLI ---------------------------------------------------------------------------------------------------


def test_cli_archive_and_query(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    raw = write_checkpoint(tmp_path / "cp", comparator="dot")
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(raw))
    out = str(tmp_path / "m.zip")
    assert cli_main(["archive", str(config_path), "--out", out, "--version", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tag"] == "v1-fp32"
    assert cli_main(["archive", str(config_path), "--out", out, "--tag", "Q8", "--dtype", "int8", "-p", "bias=true"]) == 0
    assert "shared by reference with tag(s) v1-fp32" not in capsys.readouterr().out  # version 2 shares nothing with 1
    assert cli_main(["query", out, "--tags", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == ["v1-fp32", "Q8"]
    assert cli_main(["query", out, "--tag", "v1-fp32", "--nearest", "a0:1", "-k", "3", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    with load(out, "v1-fp32") as model:
        assert [(n["name"], pytest.approx(n["score"])) for n in result["neighbours"]] == model.nearest("a0:1", 3)
        expected_score = model.score("a0:1", "a_to_b", "b_0_2")
    assert cli_main(["query", out, "--tag", "v1-fp32", "--score", "a0:1", "a_to_b", "b_0_2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["score"] == pytest.approx(expected_score)
    assert cli_main(["query", out, "--tag", "v1-fp32", "--score", "a0:1", "0", "b_0_2"]) == 0
    assert float(capsys.readouterr().out) == pytest.approx(expected_score, abs=1e-5)
    assert cli_main(["query", out, "--nearest", "a0:1", "--relation", "a_to_b", "-k", "2"]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 2
    assert cli_main(["query", out, "--embedding", "b_0_0", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["embedding"]) == 8
    with load(out, "q8") as model:
        assert model.comparator.bias  # the -p override reached the archived config
    assert cli_main(["query", out, "--verify"]) == 0
    assert "Q8: ok" in capsys.readouterr().out
    assert cli_main(["query", out, "--tag", "nope", "--nearest", "a0:1"]) == 2
    assert "unknown tag 'nope'" in capsys.readouterr().err
    assert cli_main(["archive", str(config_path), "--out", out, "--tag", "q8"]) == 2
    assert "already in the archive" in capsys.readouterr().err


def test_version_from_epoch_snapshot(tmp_path: Path) -> None:
    raw = write_checkpoint(tmp_path, versions=2)
    storage = CheckpointStorage(raw["checkpoint_path"])
    keys = [(t, p) for t, c in COUNTS.items() for p in range(len(c))]
    storage.preserve(1, 0, keys)
    storage.drop_version(1, keys)
    out = str(tmp_path / "m.zip")
    summary = add_tag(parse_config(raw), out, version=1)
    assert summary.checkpoint_version == 1
    with load(out) as model:
        assert np.array_equal(model.table("b"), storage.load_entity_partition(1, "b", 0, base=storage.snapshot_dir(0))[0])


# object storage: the same paths as every other command ------------------------------------------------------


@pytest.mark.slow
def test_cli_archive_and_query_on_s3(tmp_path: Path, s3_endpoint: str, s3_bucket: str,
                                     capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=s3_endpoint, skip_instance_cache=True)
    raw = write_checkpoint(tmp_path / "cp", comparator="dot")
    raw["storage_options"] = {"endpoint_url": s3_endpoint}
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(raw))
    out = f"{s3_bucket}/models/m.zip"
    assert cli_main(["archive", str(config_path), "--out", out, "--version", "1"]) == 0
    assert cli_main(["archive", str(config_path), "--out", out, "--dtype", "int8"]) == 0  # extends the remote archive
    capsys.readouterr()
    local = tmp_path / "copy.zip"
    fs.get_file(out[len("s3://"):], str(local))
    with load(str(local), "v1-fp32") as model:
        expected = model.nearest("a0:1", 3)
    assert verify(str(local)).keys() == {"v1-fp32", "v2-int8"}

    use_storage({})  # only --storage-option (query) or a using() block (load) supplies the endpoint from here on
    endpoint = ["--storage-option", f"endpoint_url={s3_endpoint}"]
    assert cli_main(["query", out, "--tags", "--json", *endpoint]) == 0
    assert json.loads(capsys.readouterr().out) == ["v1-fp32", "v2-int8"]
    assert cli_main(["query", out, "--tag", "v1-fp32", "--nearest", "a0:1", "-k", "3", "--json", *endpoint]) == 0
    got = json.loads(capsys.readouterr().out)["neighbours"]
    assert [(n["name"], pytest.approx(n["score"])) for n in got] == expected
    assert cli_main(["query", out, "--verify", *endpoint]) == 0
    with using(StorageSettings(options={"endpoint_url": s3_endpoint})):
        with load(out) as model:
            assert model.tag == "v2-int8"

    # a failed update loses nothing: the committed archive keeps its bytes
    before = fs.cat_file(out[len("s3://"):])
    assert cli_main(["archive", str(config_path), "--out", out, "--tag", "V1-FP32"]) == 2
    assert "already in the archive" in capsys.readouterr().err

    def broken(*args: Any, **kwargs: Any) -> bytes:
        raise ArchiveError(out, "simulated failure while writing the tag")

    monkeypatch.setattr(archive_writer, "training_flatbuffer", broken)
    assert cli_main(["archive", str(config_path), "--out", out, "--tag", "late"]) == 2
    assert "simulated failure" in capsys.readouterr().err
    assert fs.cat_file(out[len("s3://"):]) == before


@pytest.mark.slow
def test_cli_archive_to_a_missing_bucket(tmp_path: Path, s3_endpoint: str, capsys: pytest.CaptureFixture[str]) -> None:
    import s3fs

    raw = write_checkpoint(tmp_path / "cp", versions=1)
    raw["storage_options"] = {"endpoint_url": s3_endpoint}
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(raw))
    assert cli_main(["archive", str(config_path), "--out", "s3://no-such-bucket/m.zip"]) == 2
    err = capsys.readouterr().err
    assert "biggraph archive: error: s3://no-such-bucket" in err and "bucket" in err and "Traceback" not in err
    assert not s3fs.S3FileSystem(endpoint_url=s3_endpoint, skip_instance_cache=True).exists("no-such-bucket")


# slow: training and a fresh venv -------------------------------------------------------------------------


@pytest.mark.slow
def test_trained_model_metrics_match_biggraph_eval(tmp_path: Path) -> None:
    try:
        from helpers_graphs import write_cycle_graph
    except ImportError:  # tests/ collected as a package
        from tests.helpers_graphs import write_cycle_graph

    from job.evaluation import evaluate
    from job.formats.edges import edges_file, read_edges
    from job.train import train

    raw = write_cycle_graph(tmp_path, num_entities=30, num_partitions=2, num_epochs=3, comparator="l2", bias=True)
    train(parse_config(raw))
    out = str(tmp_path / "m.zip")
    add_tag(parse_config(raw), out, tag="fp32")
    add_tag(parse_config(raw), out, tag="int8", dtype="int8")
    expected = evaluate(parse_config(raw), filter_paths=raw["edge_paths"], candidates="all")
    with load(out, "fp32") as model:
        counts = model.graph.entity_types["node"].partition_counts
        offsets = np.concatenate(([0], np.cumsum(counts)[:-1]))
        edges = []
        for lhs_part in range(2):
            for rhs_part in range(2):
                arrays = read_edges(edges_file(raw["edge_paths"][0], lhs_part, rhs_part))
                edges.append(np.stack([arrays.rel, arrays.lhs + offsets[lhs_part], arrays.rhs + offsets[rhs_part]], 1))
        triples = np.concatenate(edges).astype(np.int64)
        got = link_prediction_metrics(model, triples, triples)
    assert got["mrr"] == pytest.approx(expected["mrr"], abs=1e-9)
    assert got["hits@10"] == pytest.approx(expected["hits@10"], abs=1e-9)
    with load(out, "int8") as model:
        assert abs(link_prediction_metrics(model, triples, triples)["mrr"] - expected["mrr"]) < 0.05


@pytest.mark.slow
def test_fresh_venv_with_only_numpy_and_flatbuffers(static_archive: tuple[dict[str, Any], str], tmp_path: Path) -> None:
    _, out = static_archive
    # only the loader's files: job/__init__.py, job/errors.py, job/archive/ minus the writer, and the pure-Python
    # names and registry of job/model/ that the numpy twin registers against
    app = tmp_path / "app"
    (app / "job" / "model").mkdir(parents=True)
    shutil.copy(REPO / "job" / "__init__.py", app / "job")
    shutil.copy(REPO / "job" / "errors.py", app / "job")
    for name in ("__init__.py", "names.py", "registry.py"):
        shutil.copy(REPO / "job" / "model" / name, app / "job" / "model")
    shutil.copytree(REPO / "job" / "archive", app / "job" / "archive", ignore=shutil.ignore_patterns("__pycache__"))
    (app / "job" / "archive" / "writer.py").unlink()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    install = subprocess.run([str(python), "-m", "pip", "install", "-q", "numpy", "flatbuffers"], capture_output=True,
                             text=True, timeout=300)
    if install.returncode != 0:
        pytest.skip(f"cannot install numpy/flatbuffers from the package index: {install.stderr.strip()[-300:]}")
    code = (
        "import sys, importlib.util\n"
        "assert importlib.util.find_spec('torch') is None and importlib.util.find_spec('h5py') is None\n"
        "from job.archive import load\n"
        f"m = load({out!r})\n"
        "print(m.tag, m.nearest('a0:1', k=3), m.score('a0:1', 'a_to_b', 'b_0_2'))\n"
        "assert 'torch' not in sys.modules\n"
    )
    result = subprocess.run([str(python), "-c", code], cwd=app, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("v2-int8 [(")
