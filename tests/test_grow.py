"""``biggraph grow``: trained entities keep id, partition and row; new ones are appended; input and checkpoint
change together; training after a grow; frozen entity types; bad input.

Every test drives real files: the importer's TSV input, the trainer's checkpoints, h5py, a killed process
(SIGKILL at chosen points), PBG 1.0.0 reading the result and moto for S3.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from job.checkpoint.journal import finish_committed_grow, list_journals
from job.cli import main
from job.config import load_config
from job.formats import entities as ent
from job.formats.checkpoint import CheckpointStorage
from job.formats.edges import edges_file, read_edges
from job.growing.ingest import balanced_additions
from job.model.operators import OPERATORS, Operator
from job.train.batch.optim import sums_from_state

REPO = Path(__file__).resolve().parent.parent
USERS = [f"user{i}" for i in range(70)]
ITEMS = [f"item{i}" for i in range(36)]
OLD_USERS, OLD_ITEMS = set(USERS[:52]), set(ITEMS[:28])
COLUMNS = ["-l", "0", "--rel-col", "1", "-r", "2"]


def triples(seed: int, users: list[str], items: list[str], count: int) -> list[tuple[str, str, str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        if rng.random() < 0.5:
            out.append((rng.choice(users), "follows", rng.choice(users)))
        else:
            out.append((rng.choice(users), "likes", rng.choice(items)))
    return out


def write_tsv(path: Path, rows: list[tuple[str, str, str]]) -> Path:
    path.write_text("".join(f"{h}\t{r}\t{t}\n" for h, r, t in rows))
    return path


def static_config(**extra: Any) -> dict[str, Any]:
    config = {
        "entities": {"user": {"num_partitions": 2}, "item": {"num_partitions": 1}},
        "relations": [
            {"name": "follows", "lhs": "user", "rhs": "user", "operator": "diagonal"},
            {"name": "likes", "lhs": "user", "rhs": "item", "operator": "complex_diagonal"},
        ],
        "dimension": 8, "entity_path": "entities", "edge_paths": ["edges"], "checkpoint_path": "model",
        "num_epochs": 2, "workers": 1, "seed": 3, "eval_fraction": 0.0, "batch_size": 50, "num_batch_negs": 10,
        "num_uniform_negs": 10, "grow_num_epochs": 2, "lr": 0.05,
    }
    config.update(extra)
    return config


def run_cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def make_trained(root: Path, config: dict[str, Any] | None = None, old: list | None = None,
                 new: list | None = None) -> Path:
    """An imported and trained model in ``root`` (relative paths: run with ``root`` as working directory),
    with ``old.tsv`` (what it was trained on) and ``new.tsv`` (edges touching new entities) beside it."""
    root.mkdir(parents=True, exist_ok=True)
    old = old if old is not None else triples(1, sorted(OLD_USERS), sorted(OLD_ITEMS), 500)
    if new is None:
        new = [t for t in triples(2, USERS, ITEMS, 300) if t[0] not in OLD_USERS or t[2] not in OLD_USERS | OLD_ITEMS]
    write_tsv(root / "old.tsv", old)
    write_tsv(root / "new.tsv", new)
    (root / "config.json").write_text(json.dumps(config or static_config()))
    with contextlib.chdir(root):
        assert run_cli("import", "config.json", "old.tsv", *COLUMNS)[0] == 0
        assert run_cli("train", "config.json")[0] == 0
    return root


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_trained(tmp_path_factory.mktemp("grow") / "template")


@pytest.fixture
def model(trained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private copy of the trained model, as the working directory."""
    root = tmp_path / "m"
    shutil.copytree(trained, root)
    monkeypatch.chdir(root)
    return root


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def names_of(config: Any) -> dict[str, list[list[str]]]:
    return {t: [ent.read_entity_names(config.entity_path, t, p) for p in range(e.num_partitions)]
            for t, e in config.entities.items()}


def partitions_of(config: Any) -> dict[tuple[str, int], tuple[np.ndarray, np.ndarray]]:
    checkpoint = CheckpointStorage(config.checkpoint_path)
    version = checkpoint.load_version()
    out = {}
    for t, e in config.entities.items():
        for p in range(e.num_partitions):
            values, state = checkpoint.load_entity_partition(version, t, p)
            sums, _ = sums_from_state(state, values.shape[0], values.shape[1], per_coordinate=False)
            out[(t, p)] = (values, sums.numpy())
    return out


def edge_triples(config: Any, names: dict[str, list[list[str]]]) -> list[tuple[str, str, str]]:
    """Every edge of the edge files, as names."""
    out = []
    grid = (2, 2)
    for lhs_part in range(grid[0]):
        for rhs_part in range(grid[1]):
            arrays = read_edges(edges_file(config.edge_paths[0], lhs_part, rhs_part))
            for rel, lhs, rhs in zip(arrays.rel, arrays.lhs, arrays.rhs):
                relation = config.relations[int(rel)]
                lhs_names = names[relation.lhs][lhs_part if relation.lhs == "user" else 0]
                rhs_names = names[relation.rhs][rhs_part if relation.rhs == "user" else 0]
                out.append((lhs_names[int(lhs)], relation.name, rhs_names[int(rhs)]))
    return out


# the grown model ---------------------------------------------------------------------------------------


def test_grow_keeps_every_trained_entity_and_appends_the_new_ones(model: Path) -> None:
    config = load_config("config.json")
    names_before, rows_before = names_of(config), partitions_of(config)
    edges_before = {(lp, rp): read_edges(edges_file("edges", lp, rp)) for lp in range(2) for rp in range(2)}
    version_before = CheckpointStorage("model").load_version()
    code, out, _ = run_cli("grow", "config.json", "new.tsv", *COLUMNS, "--no-train")
    assert code == 0 and "grew checkpoint version" in out
    assert CheckpointStorage("model").load_version() == version_before + 1
    names_after, rows_after = names_of(config), partitions_of(config)
    new_rows = [row for row in (Path("new.tsv").read_text().splitlines())]
    new_names = {"user": set(), "item": set()}
    for row in new_rows:
        head, rel, tail = row.split("\t")
        new_names["user"].add(head)
        new_names["item" if rel == "likes" else "user"].add(tail)
    for entity_type in ("user", "item"):
        old_parts, new_parts = names_before[entity_type], names_after[entity_type]
        appended: set[str] = set()
        for part, (was, now) in enumerate(zip(old_parts, new_parts)):
            assert now[: len(was)] == was  # same names at the same offsets of the same partitions
            appended.update(now[len(was):])
            assert ent.read_entity_count("entities", entity_type, part) == len(now)
            values, sums = rows_after[(entity_type, part)]
            old_values, old_sums = rows_before[(entity_type, part)]
            assert values.shape == (len(now), 8)
            assert np.array_equal(values[: len(was)].view(np.uint32), old_values.view(np.uint32))  # bit-equal
            assert np.array_equal(sums[: len(was)].view(np.uint32), old_sums.view(np.uint32))
        known = {n for part in old_parts for n in part}
        assert appended == new_names[entity_type] - known and not appended & known
        sizes = [len(p) for p in new_parts]
        assert max(sizes) - min(sizes) <= max(1, max(map(len, old_parts)) - min(map(len, old_parts)))
    # the edge files hold the old edges unchanged, then the new ones, in the grown id space
    record = json.loads(Path(list_journals("model")[version_before + 1]).read_text())
    for (lhs_part, rhs_part), old in edges_before.items():
        merged = read_edges(edges_file("edges", lhs_part, rhs_part))
        boundary = record["boundaries"][0][lhs_part * 2 + rhs_part]
        assert boundary == len(old)
        for column in ("rel", "lhs", "rhs"):
            assert np.array_equal(getattr(merged, column)[:boundary], getattr(old, column))
    expected = sorted(tuple(r.split("\t")) for r in Path("old.tsv").read_text().splitlines() + new_rows)
    assert sorted(edge_triples(config, names_after)) == expected
    # staging directories are gone, a plain validate/eval of the grown model works
    assert not list(Path(".").rglob(".grow-v*"))
    assert run_cli("validate", "config.json")[0] == 0
    code, out, _ = run_cli("eval", "config.json", "--json")
    assert code == 0 and json.loads(out)["count"] == len(expected)


def test_grow_with_dynamic_relations_adds_relation_types_after_the_old_ones(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    config = dynamic_config()
    users = sorted(OLD_USERS)
    old = [(h, "follows", t) for h, _, t in triples(1, users, users, 400)]
    new = [(h, "knows" if i % 2 else "follows", t) for i, (h, _, t) in enumerate(triples(2, USERS, USERS, 120))]
    root = make_trained(tmp_path / "dyn", config, old, new)
    monkeypatch.chdir(root)
    loaded = load_config("config.json")
    checkpoint = CheckpointStorage("model")
    before, _, _ = checkpoint.load_model(checkpoint.load_version())
    assert ent.read_dynamic_rel_names("entities") == ["follows"]
    assert run_cli("grow", "config.json", "new.tsv", *COLUMNS, "--no-train")[0] == 0
    assert ent.read_dynamic_rel_names("entities") == ["follows", "knows"]
    assert ent.read_dynamic_rel_count("entities") == 2
    after, optimizer, _ = checkpoint.load_model(checkpoint.load_version())
    for name, value in before.items():
        assert after[name].shape == (2,) + value.shape[1:]
        assert np.array_equal(after[name][:1], value)  # the trained relation's parameters, unchanged
    assert np.all(after["relations/0/operator/rhs/real"][1] == 1) and np.all(after["relations/0/operator/rhs/imag"][1] == 0)
    assert optimizer is not None and all(entry["sum"].shape[0] == 2 for entry in optimizer["state"].values())
    assert run_cli("eval", "config.json", "--json")[0] == 0
    assert len(names_of(loaded)["all"][0]) + len(names_of(loaded)["all"][1]) == len({e for t in old + new for e in (t[0], t[2])})


def test_balanced_additions_fill_the_smallest_partitions_first() -> None:
    assert balanced_additions(np.array([5, 3, 4]), 4).tolist() == [1, 2, 1]  # ends at 6, 5, 5
    assert balanced_additions(np.array([5, 3, 4]), 1).tolist() == [0, 1, 0]
    assert balanced_additions(np.array([2, 2]), 5).tolist() == [3, 2]
    assert balanced_additions(np.array([10, 0]), 3).tolist() == [0, 3]
    assert balanced_additions(np.array([4]), 0).tolist() == [0]


def test_neighbours_initialisation_is_the_mean_of_trained_neighbours_through_the_operator(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One type, operator ``none``, dot comparator, no global embedding: a new entity's row is exactly the mean of
    its trained neighbours' rows (times NEIGHBOUR_SCALE); one reached only through a new entity is filled in the
    next round; new rows' Adagrad sums start at zero."""
    from job.growing.rows import NEIGHBOUR_SCALE

    config = static_config(entities={"e": {"num_partitions": 1}}, global_emb=False, comparator="dot",
                           relations=[{"name": "r", "lhs": "e", "rhs": "e", "operator": "none"}])
    old = [(f"a{i}", "r", f"a{(i * 7 + 1) % 20}") for i in range(60)]
    new = [("n0", "r", "a1"), ("a2", "r", "n0"), ("n1", "r", "a3"), ("n2", "r", "n0")]
    root = make_trained(tmp_path / "nb", config, old, new)
    monkeypatch.chdir(root)
    loaded = load_config("config.json")
    (values, sums), = partitions_of(loaded).values()
    index = {name: i for i, name in enumerate(names_of(loaded)["e"][0])}
    assert run_cli("grow", "config.json", "new.tsv", *COLUMNS, "--no-train")[0] == 0
    (grown, grown_sums), = partitions_of(loaded).values()
    grown_index = {name: i for i, name in enumerate(names_of(loaded)["e"][0])}
    expected_n0 = NEIGHBOUR_SCALE * (values[index["a1"]].astype(np.float64) + values[index["a2"]]) / 2
    assert np.allclose(grown[grown_index["n0"]], expected_n0, atol=1e-6)
    assert np.allclose(grown[grown_index["n1"]], NEIGHBOUR_SCALE * values[index["a3"]], atol=1e-6)
    # round 2, through n0 (scaled again: a row filled from new rows is as unsure as they are, and then some)
    assert np.allclose(grown[grown_index["n2"]], NEIGHBOUR_SCALE * grown[grown_index["n0"]], atol=1e-6)
    assert not grown_sums[len(sums):].any() and np.array_equal(grown_sums[: len(sums)], sums)


def test_random_initialisation_draws_at_init_scale(model: Path) -> None:
    config = load_config("config.json")
    before = {k: v[0].shape[0] for k, v in partitions_of(config).items()}
    assert run_cli("grow", "config.json", "new.tsv", *COLUMNS, "--no-train", "-p", "grow_init=random",
                   "-p", "init_scale=0.5")[0] == 0
    new_rows = np.concatenate([v[0][before[k]:] for k, v in partitions_of(config).items()])
    new_sums = np.concatenate([v[1][before[k]:] for k, v in partitions_of(config).items()])
    assert len(new_rows) > 20 and 0.4 < new_rows.std() < 0.6 and not new_sums.any()


def test_neighbour_targets_invert_each_operator() -> None:
    """``adjoint`` is where x must be for op(x) to match y: exactly the inverse for the l2 comparators."""
    torch.manual_seed(0)
    x = torch.randn(5, 6)
    for kind in OPERATORS.names():  # every registered operator, so a new one cannot go untested
        for num in (0, 3):
            op = Operator(kind, 6, num)
            with torch.no_grad():
                for param in op.parameters():
                    param.add_(torch.randn_like(param) * 0.3)
            rel = torch.tensor([0, 1, 2, 1, 0]) if num else None
            with torch.no_grad():
                back = op.adjoint(op(x, rel), rel, inverse=True)
                assert torch.allclose(back, x, atol=1e-4), (kind, num)
                # for dot: <y, op(x)> == <adjoint(y), x> minus the translation's constant
                y = torch.randn(5, 6)
                lhs = (y * (op(x, rel) - op(torch.zeros_like(x), rel))).sum(-1)
                assert torch.allclose(lhs, (op.adjoint(y, rel, inverse=False) * x).sum(-1), atol=1e-4), (kind, num)


# training after a grow ----------------------------------------------------------------------------------


def pass_counts(checkpoint_path: str) -> list[int]:
    records = CheckpointStorage(checkpoint_path).load_stats()
    return [r["stats"]["count"] for r in records if r.get("pass_summary")]


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_training_after_a_grow_sees_the_new_edges_plus_the_replayed_fraction(model: Path, fraction: float) -> None:
    old_edges = len(Path("old.tsv").read_text().splitlines())
    new_edges = len(Path("new.tsv").read_text().splitlines())
    passes_before = len(pass_counts("model"))
    code, out, _ = run_cli("grow", "config.json", "new.tsv", *COLUMNS, "-p", f"grow_replay_fraction={fraction}")
    assert code == 0 and "trained to version" in out
    counts = pass_counts("model")[passes_before:]
    assert len(counts) == 2
    for count in counts:
        expected = new_edges + fraction * old_edges
        assert abs(count - expected) <= 4 * np.sqrt(old_edges * fraction * (1 - fraction)) + 1e-9
    assert CheckpointStorage("model").load_version() == 2 + 1 + 2  # trained, grown, two passes
    assert json.loads(Path("model/config.json").read_text())["num_epochs"] == 2  # the user's config, not the passes'


def test_a_second_grow_builds_on_the_first_and_a_rerun_resumes(model: Path) -> None:
    assert run_cli("grow", "config.json", "new.tsv", *COLUMNS)[0] == 0
    sizes = [len(read_edges(edges_file("edges", lp, rp))) for lp in range(2) for rp in range(2)]
    write_tsv(Path("day3.tsv"), [("user99", "follows", "user1"), ("user98", "likes", "item3"), ("user1", "likes", "item99")])
    passes_before = len(pass_counts("model"))
    code, out, _ = run_cli("grow", "config.json", "day3.tsv", *COLUMNS, "-p", "grow_replay_fraction=0")
    assert code == 0 and "grew checkpoint version 5 into 6" in out and "user=+2, item=+1" in out
    assert sorted(list_journals("model")) == [3, 6]
    record = json.loads(Path(list_journals("model")[6]).read_text())
    assert record["boundaries"] == [sizes] and record["published"]
    assert pass_counts("model")[passes_before:] == [3, 3]  # the day's edges only
    code, out, _ = run_cli("grow", "config.json", "day3.tsv", *COLUMNS, "-p", "grow_replay_fraction=0")
    assert code == 0 and "resumed: already committed" in out and CheckpointStorage("model").load_version() == 8


@pytest.mark.parametrize("path", ["workers1", "hogwild", "static-shapes"])
def test_frozen_entity_type_keeps_rows_and_optimizer_state_bit_identical(model: Path, path: str) -> None:
    from job.model.kernel_options import KernelOptions
    from job.train import Collaborators, Trainer

    workers = 2 if path == "hogwild" else 1
    raw = json.loads(Path("config.json").read_text())
    raw["entities"]["item"]["frozen"] = True
    raw.update(num_epochs=5, workers=workers, max_norm=0.05, global_emb=True)
    Path("frozen.json").write_text(json.dumps(raw))
    config = load_config("frozen.json")
    checkpoint = CheckpointStorage("model")
    before = partitions_of(config)
    globals_before, _, _ = checkpoint.load_model(checkpoint.load_version())
    if path == "static-shapes":  # the GPU's static-shape step on the CPU: a trainer given that option
        trainer = Trainer(config, parts=Collaborators(kernel_options=KernelOptions(static_shapes_on_cpu=True)))
        try:
            trainer.run()
        finally:
            trainer.close()
    else:
        assert run_cli("train", "frozen.json")[0] == 0
    assert checkpoint.load_version() == 5
    after = partitions_of(config)
    globals_after, _, _ = checkpoint.load_model(5)
    assert np.array_equal(after[("item", 0)][0].view(np.uint32), before[("item", 0)][0].view(np.uint32))
    assert np.array_equal(after[("item", 0)][1].view(np.uint32), before[("item", 0)][1].view(np.uint32))
    assert np.array_equal(globals_after["entities/item/global_embedding"], globals_before["entities/item/global_embedding"])
    for part in (0, 1):  # the other type trained
        assert not np.array_equal(after[("user", part)][0], before[("user", part)][0])
        assert not np.array_equal(after[("user", part)][1], before[("user", part)][1])
    assert not np.array_equal(globals_after["entities/user/global_embedding"], globals_before["entities/user/global_embedding"])


# crashes -----------------------------------------------------------------------------------------------

KILLER = """
import os, signal, sys, importlib
module, name, nth, when = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
owner = importlib.import_module(module)
if "." in name:
    owner, name = getattr(owner, name.split(".")[0]), name.split(".")[1]
original = getattr(owner, name)
calls = [0]
def wrapper(*args, **kwargs):
    calls[0] += 1
    if calls[0] == nth and when == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    result = original(*args, **kwargs)
    if calls[0] == nth and when == "after":
        os.kill(os.getpid(), signal.SIGKILL)
    return result
setattr(owner, name, wrapper)
from job.cli import main
sys.exit(main(sys.argv[5:]))
"""

KILL_POINTS = [  # (module, function, which call, kill before/after it, the version then committed)
    ("job.growing.ingest", "write_merged_edges", 1, "after", 2),  # staged edges only
    ("job.growing.rows", "write_grown_partitions", 1, "after", 2),  # + partitions of the new version
    ("job.formats.checkpoint", "write_manifest", 1, "after", 2),  # + its manifest, no marker
    ("job.checkpoint.journal", "_move", 3, "after", 3),  # committed, input half published
    # published, journal not yet marked: publish's call is the second (the grow's own write of the journal before
    # its commit is the first; both call the wrapped function, the killer imports the journal before job.growing)
    ("job.checkpoint.journal", "write_record", 2, "before", 3),
    ("job.train.trainer", "Trainer._commit", 2, "before", 4),  # grown and one training pass committed
]


def grow_command(*extra: str) -> list[str]:
    return [sys.executable, "-c", KILLER, *extra, "grow", "config.json", "new.tsv", *COLUMNS]


def input_state(root: Path) -> dict[str, str]:
    """The input files (staged files of an uncommitted grow are not input)."""
    return {k: v for k, v in snapshot(root).items() if k.startswith(("entities/", "edges/")) and "/.grow-v" not in k}


@pytest.fixture(scope="module")
def reference(trained: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict, dict]:
    """The uninterrupted grow (same files, same seed): input and final partitions to compare resumed runs with."""
    root = tmp_path_factory.mktemp("ref") / "m"
    shutil.copytree(trained, root)
    subprocess.run([sys.executable, "-m", "job", "grow", "config.json", "new.tsv", *COLUMNS], cwd=root, check=True,
                   capture_output=True)
    with contextlib.chdir(root):
        config = load_config("config.json")
        return input_state(root), partitions_of(config), {"version": CheckpointStorage("model").load_version()}


@pytest.mark.parametrize("point", KILL_POINTS, ids=[f"{p[1]}-{p[2]}-{p[3]}" for p in KILL_POINTS])
def test_kill_mid_grow_leaves_the_old_or_the_new_version_and_a_rerun_finishes_it(
        model: Path, trained: Path, reference: tuple[dict, dict, dict], point: tuple[str, str, int, str, int]) -> None:
    module, name, nth, when, expected_version = point
    original_input = input_state(model)
    # the killed grow cannot remove its work directory: keep it under the model's tmp, not the machine's /tmp
    scratch = model / "scratch"
    scratch.mkdir()
    killed = subprocess.run(grow_command(module, name, str(nth), when), cwd=model, capture_output=True, text=True,
                            env=dict(os.environ, TMPDIR=str(scratch)))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    committed = CheckpointStorage("model").load_version()
    assert committed == expected_version
    if name == "_move":  # half published: neither input until a reader finishes publishing
        assert input_state(model) not in (original_input, reference[0])
    finish_committed_grow("model")  # what any reader (eval, export, train) does first
    config = load_config("config.json")
    rows = partitions_of(config)  # every partition of the committed version loads and matches the counts
    for (entity_type, part), (values, _) in rows.items():
        assert values.shape[0] == ent.read_entity_count("entities", entity_type, part)
    if committed == 2:
        assert input_state(model) == original_input  # the old version with the old input
    else:
        assert input_state(model) == reference[0]  # the grown version with the grown input
    env = dict(os.environ, PYTHONPATH=str(REPO))
    rerun = subprocess.run([sys.executable, "-m", "job", "grow", "config.json", "new.tsv", *COLUMNS], cwd=model,
                           capture_output=True, text=True, env=env)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert CheckpointStorage("model").load_version() == reference[2]["version"]
    assert input_state(model) == reference[0]
    final = partitions_of(config)
    for key, (values, sums) in reference[1].items():
        assert np.array_equal(final[key][0], values) and np.array_equal(final[key][1], sums), key
    assert not list(model.rglob(".grow-v*"))
    assert len(list_journals("model")) == 1


# PBG and S3 ---------------------------------------------------------------------------------------------


def dynamic_config() -> dict[str, Any]:
    return static_config(entities={"all": {"num_partitions": 2}}, global_emb=False, dynamic_relations=True,
                         relations=[{"name": "all", "lhs": "all", "rhs": "all", "operator": "complex_diagonal"}])


@pytest.mark.pbg
@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
@pytest.mark.parametrize("relations", ["static", "dynamic"])
def test_pbg_reads_and_exports_the_grown_checkpoint(model: Path, relations: str, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("torchbiggraph")
        from torchbiggraph.checkpoint_manager import CheckpointManager
        from torchbiggraph.config import ConfigSchema as PbgConfigSchema
        from torchbiggraph.converters.export_to_tsv import make_tsv
        from torchbiggraph.graph_storages import FileEdgeStorage

    from job.data.export import export_checkpoint

    if relations == "dynamic":  # new relation types too; PBG exports their parameters
        users = sorted(OLD_USERS)
        old = [(h, "follows", t) for h, _, t in triples(1, users, users, 400)]
        new = [(h, "knows" if i % 2 else "follows", t) for i, (h, _, t) in enumerate(triples(2, USERS, USERS, 120))]
        monkeypatch.chdir(make_trained(tmp_path / "dyn", dynamic_config(), old, new))
    assert run_cli("grow", "config.json", "new.tsv", *COLUMNS)[0] == 0
    config = load_config("config.json")
    if relations == "static":  # PBG's exporter reads relation names from this file (as in test_pbg_compat)
        ent.write_dynamic_rel_names(config.entity_path, [r.name for r in config.relations])
    pbg_config = PbgConfigSchema.from_dict(config.to_pbg_dict())
    manager = CheckpointManager(config.checkpoint_path)
    assert manager.checkpoint_version == CheckpointStorage("model").load_version() == 5
    assert manager.read_config().dimension == 8
    entity_type = "user" if relations == "static" else "all"
    embeddings, optimizer = manager.read(entity_type, 1)
    assert embeddings.shape[0] == ent.read_entity_count("entities", entity_type, 1) and optimizer is not None
    edges = FileEdgeStorage(config.edge_paths[0])
    total = len(Path("old.tsv").read_text().splitlines()) + len(Path("new.tsv").read_text().splitlines())
    assert sum(len(edges.load_edges(lp, rp)) for lp in range(2) for rp in range(2)) == total
    pbg_entities, pbg_relations = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()):
        make_tsv(pbg_config, pbg_entities, pbg_relations)
    export_checkpoint(config, out="export")
    assert Path("export/entity_embeddings.tsv").read_text() == pbg_entities.getvalue()
    assert Path("export/relation_types_parameters.tsv").read_text() == pbg_relations.getvalue()


@pytest.mark.slow
def test_grow_on_s3(s3_bucket: str, s3_endpoint: str, trained: Path, tmp_path: Path) -> None:
    import storage_adapters as storage

    raw = static_config(entity_path=f"{s3_bucket}/entities", edge_paths=[f"{s3_bucket}/edges"],
                        checkpoint_path=f"{s3_bucket}/model", storage_options={"endpoint_url": s3_endpoint})
    config_path = tmp_path / "s3.json"
    config_path.write_text(json.dumps(raw))
    shutil.copy(trained / "old.tsv", tmp_path / "old.tsv")
    storage.put_file(str(trained / "new.tsv"), f"{s3_bucket}/input/new.tsv")
    assert run_cli("import", str(config_path), str(tmp_path / "old.tsv"), *COLUMNS)[0] == 0
    assert run_cli("train", str(config_path))[0] == 0
    config = load_config(str(config_path))
    before_names, before_rows = names_of(config), partitions_of(config)
    code, out, err = run_cli("grow", str(config_path), f"{s3_bucket}/input/new.tsv", *COLUMNS)
    assert code == 0, err
    assert CheckpointStorage(config.checkpoint_path).load_version() == 5
    after_names, after_rows = names_of(config), partitions_of(config)
    grown = list_journals(config.checkpoint_path)
    assert list(grown) == [3] and json.loads(storage.read_text(grown[3]))["published"]
    assert not [n for n in storage.listdir(config.entity_path) if n.startswith(".grow")]
    for key in before_rows:
        part_names = after_names[key[0]][key[1]]
        assert part_names[: len(before_names[key[0]][key[1]])] == before_names[key[0]][key[1]]
        assert after_rows[key][0].shape == (len(part_names), 8)
    assert run_cli("eval", str(config_path), "--json")[0] == 0


# bad input ----------------------------------------------------------------------------------------------


def refused(root: Path, *args: str) -> str:
    before = snapshot(root)
    code, out, err = run_cli("grow", *args)
    assert code == 2, (out, err)
    assert snapshot(root) == before  # nothing written
    lines = [line for line in err.strip().splitlines() if " INFO " not in line]  # log lines share stderr
    assert len(lines) == 1 and lines[0].startswith("biggraph grow: error: ")
    return lines[0]


def test_refuses_a_checkpoint_whose_dimension_differs(model: Path) -> None:
    message = refused(model, "config.json", "new.tsv", *COLUMNS, "-p", "dimension=16")
    assert "--into model: the checkpoint's config does not match this config: dimension is 8 there and 16 here" in message


def test_refuses_a_checkpoint_whose_operator_differs(model: Path) -> None:
    message = refused(model, "config.json", "new.tsv", *COLUMNS, "-p", "relations.0.operator=translation")
    assert "relations[0].operator is 'diagonal' there and 'translation' here" in message


def test_refuses_a_checkpoint_whose_entity_types_differ(model: Path) -> None:
    raw = json.loads(Path("config.json").read_text())
    raw["entities"]["shop"] = {"num_partitions": 1}
    Path("other.json").write_text(json.dumps(raw))
    message = refused(model, "other.json", "new.tsv", *COLUMNS)
    assert "the set of entity types is ['item', 'user'] there and ['item', 'shop', 'user'] here" in message


def test_refuses_an_into_checkpoint_of_another_model(model: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(model / "model", other)
    raw = json.loads((other / "config.json").read_text())
    message = refused(model, "config.json", "new.tsv", *COLUMNS, "--into", str(other), "-p", "relations.1.operator=none")
    assert f"--into {other}: the checkpoint's config does not match" in message and raw["dimension"] == 8
    assert "relations[1].operator is 'complex_diagonal' there and 'none' here" in message


def test_refuses_an_into_directory_without_a_checkpoint(model: Path, tmp_path: Path) -> None:
    message = refused(model, "config.json", "new.tsv", *COLUMNS, "--into", str(tmp_path / "empty"))
    assert "no committed checkpoint there (train a model first)" in message


def test_refuses_a_new_edge_whose_entity_type_is_unknown(model: Path) -> None:
    write_tsv(Path("bad.tsv"), [("user1", "likes", "item2"), ("user90", "rates", "item40")])
    message = refused(model, "config.json", "bad.tsv", *COLUMNS)
    assert "bad.tsv row 2: has relation type 'rates', which is not in the config, so the entity types of its ends " \
           "are unknown" in message


def test_refuses_a_name_that_collides_with_another_type(model: Path) -> None:
    write_tsv(Path("bad.tsv"), [("user1", "likes", "item2"), ("user3", "likes", "user5")])  # user5 is a user
    message = refused(model, "config.json", "bad.tsv", *COLUMNS)
    assert "new edges put 'user5' on a side of entity type 'item', but the model knows 'user5' as a 'user' entity" in message


def test_config_help_lists_the_grow_keys() -> None:
    code, out, _ = run_cli("config-help")
    assert code == 0
    for key in ("grow_init", "grow_num_epochs", "grow_replay_fraction", "entities.<type>.frozen"):
        assert key in out


def test_a_grow_forgets_the_best_version_of_the_old_entity_set(model: Path) -> None:
    """best_version.txt (validation_edge_paths) names a version of the entities before the grow: its rows no longer
    match the entity counts, so the grow removes the pointer (and the version's files)."""
    version = CheckpointStorage("model").load_version()
    Path("model/best_version.txt").write_text(f"{version}\n")
    assert run_cli("grow", "config.json", "new.tsv", *COLUMNS, "--no-train")[0] == 0
    assert CheckpointStorage("model").load_version() == version + 1
    assert not Path("model/best_version.txt").exists()
    assert not Path(f"model/model.v{version}.h5").exists()
