"""bench/freebase_like.py: the Freebase86m-size generator the GPU device run makes its graph with (issue #48).

Device time is minutes, so the graph it writes must be read, checked and trained by our own trainer without a
second try: these tests make small graphs of the same kind and read them back with the readers the trainer uses.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from job.config import load_config
from job.formats.checkpoint import CheckpointStorage
from job.formats.edges import EdgeLimits, edges_file, read_edges
from job.formats.entities import read_dynamic_rel_count, read_entity_counts
from job.train.input_check import read_facts

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import freebase_like as fl  # noqa: E402 - a bench script, not a package

SMALL = fl.GraphSpec(num_entities=3001, num_edges=40_000, num_relations=97, num_partitions=3, seed=5,
                     block_edges=7_000)


def _global_edges(out: Path, spec: fl.GraphSpec) -> np.ndarray:
    """Every edge as (rel, global lhs, global rhs) rows, sorted: the graph whatever its split."""
    starts = spec.partition_starts()
    rows = []
    for lhs_part in range(spec.num_partitions):
        for rhs_part in range(spec.num_partitions):
            arrays = read_edges(edges_file(str(out / "edges"), lhs_part, rhs_part))
            rows.append(np.stack([arrays.rel, arrays.lhs + starts[lhs_part], arrays.rhs + starts[rhs_part]], axis=1))
    edges = np.concatenate(rows)
    return edges[np.lexsort(edges.T[::-1])]


def test_the_graph_reads_back_and_passes_the_input_check(tmp_path: Path) -> None:
    summary = fl.write_graph(tmp_path, SMALL, fl.TrainSpec(checkpoint_path=str(tmp_path / "ckpt")), threads=2)
    assert summary["blocks"] == 6
    config = load_config(summary["config"])
    assert config.dynamic_relations and len(config.relations) == 1
    assert config.relations[0].operator == "complex_diagonal" and config.comparator == "dot"
    assert (config.loss_fn, config.dimension, config.num_epochs, config.eval_fraction) == ("softmax", 100, 1, 0.0)
    assert (config.batch_size, config.num_batch_negs, config.num_uniform_negs) == (10_000, 250, 250)
    assert config.checkpoint_path == str(tmp_path / "ckpt")

    facts = read_facts(config)
    counts = read_entity_counts(config.entity_path, "node", SMALL.num_partitions)
    assert facts.entity_counts == {"node": counts} and sum(counts) == SMALL.num_entities
    assert max(counts) - min(counts) <= 1
    assert facts.num_dynamic_rels == read_dynamic_rel_count(config.entity_path) == SMALL.num_relations

    total = 0
    for lhs_part in range(SMALL.num_partitions):
        for rhs_part in range(SMALL.num_partitions):
            url = edges_file(config.edge_paths[0], lhs_part, rhs_part)
            arrays = read_edges(url)
            EdgeLimits.for_bucket(config, facts.entity_counts, SMALL.num_relations, (lhs_part, rhs_part)).check(
                arrays, url, 0)  # raises naming the first row out of its partition or relation range
            assert arrays.lhs.min() >= 0 and arrays.lhs.max() < counts[lhs_part]
            assert arrays.rhs.min() >= 0 and arrays.rhs.max() < counts[rhs_part]
            assert arrays.rel.min() >= 0 and arrays.rel.max() < SMALL.num_relations
            total += len(arrays)
    assert total == SMALL.num_edges


def test_same_files_whatever_the_thread_count_and_same_graph_whatever_the_split(tmp_path: Path) -> None:
    one, four = tmp_path / "one", tmp_path / "four"
    fl.write_graph(one, SMALL, fl.TrainSpec(), threads=1)
    fl.write_graph(four, SMALL, fl.TrainSpec(), threads=4)
    for lhs_part in range(SMALL.num_partitions):
        for rhs_part in range(SMALL.num_partitions):
            a = read_edges(edges_file(str(one / "edges"), lhs_part, rhs_part))
            b = read_edges(edges_file(str(four / "edges"), lhs_part, rhs_part))
            for name in ("rel", "lhs", "rhs"):  # same order too: the blocks are assembled by index
                np.testing.assert_array_equal(getattr(a, name), getattr(b, name))

    whole = fl.GraphSpec(**{**SMALL.__dict__, "num_partitions": 1})
    fl.write_graph(tmp_path / "whole", whole, fl.TrainSpec(), threads=2)
    np.testing.assert_array_equal(_global_edges(one, SMALL), _global_edges(tmp_path / "whole", whole))

    other_seed = fl.GraphSpec(**{**SMALL.__dict__, "seed": SMALL.seed + 1})
    fl.write_graph(tmp_path / "other", other_seed, fl.TrainSpec(), threads=2)
    assert not np.array_equal(_global_edges(one, SMALL), _global_edges(tmp_path / "other", other_seed))


def test_degrees_and_relations_are_skewed(tmp_path: Path) -> None:
    spec = fl.GraphSpec(num_entities=20_000, num_edges=80_000, num_relations=500, num_partitions=2)
    fl.write_graph(tmp_path, spec, fl.TrainSpec(), threads=2)
    stats = fl.degree_stats(tmp_path, spec)
    assert stats["mean_degree"] == pytest.approx(2 * spec.num_edges / spec.num_entities)
    assert stats["max_degree"] > 100 * stats["median_degree"] > 0, stats  # hubs and a long tail
    assert stats["top10_relation_share"] > 0.4, stats  # uniform would give 10 / 500 = 2%
    edges = _global_edges(tmp_path, spec)
    assert len(np.unique(edges[:, 0])) == spec.num_relations  # every relation id occurs
    # the hubs are scattered over the ids, so both partitions hold some: not all in the first
    degree = np.bincount(edges[:, 2], minlength=spec.num_entities)
    hubs = np.argsort(degree)[-20:]
    assert 0 < (hubs < spec.partition_starts()[1]).sum() < len(hubs)


def test_relation_table_follows_zipf_and_keeps_every_id() -> None:
    table = fl.relation_table(14_824, 1.2)
    counts = np.bincount(table, minlength=14_824)
    assert len(table) == 1 << fl.REL_TABLE_BITS and counts.min() >= 1
    assert np.all(np.diff(counts) <= 0)  # id 0 the most frequent, never increasing
    assert 0.15 < counts[0] / len(table) < 0.25


def test_a_tiny_instance_trains_one_epoch_on_the_cpu(tmp_path: Path) -> None:
    from job.train import train

    spec = fl.GraphSpec(num_entities=400, num_edges=3_000, num_relations=12, num_partitions=2, block_edges=1_000)
    train_spec = fl.TrainSpec(dimension=8, batch_size=500, num_batch_negs=20, num_uniform_negs=20, device="cpu",
                              workers=1)
    summary = fl.write_graph(tmp_path, spec, train_spec, threads=2)
    config = load_config(summary["config"])
    train(config)
    storage = CheckpointStorage(config.checkpoint_path)
    passes = [s for s in storage.load_stats() if s.get("pass_summary")]
    assert len(passes) == 1 and np.isfinite(passes[0]["stats"]["metrics"]["loss"])
    for part, count in enumerate(spec.partition_counts()):
        embeddings, _ = storage.load_entity_partition(storage.load_version(), "node", part)
        assert embeddings.shape == (count, 8) and np.isfinite(embeddings).all()


def test_the_cli_refuses_bad_sizes_on_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert fl.main(["--out", str(tmp_path), "--entities", "10", "--partitions", "20"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--partitions 20" in err
    assert fl.main(["--out", str(tmp_path), "--batch-size", "1000", "--num-batch-negs", "300"]) == 2
    assert "--num-batch-negs 300" in capsys.readouterr().err
    assert not (tmp_path / "edges").exists()


@pytest.mark.parametrize("partitions", [16, 17])  # 8-bit bucket keys up to P=16, 16-bit above
def test_every_bucket_holds_ids_of_its_own_partitions(partitions: int) -> None:
    spec = fl.GraphSpec(num_entities=5_000, num_edges=30_000, num_relations=10, num_partitions=partitions,
                        block_edges=7_000)
    counts = spec.partition_counts()
    total = 0
    for block in fl.Generator(spec).blocks(threads=2):
        for bucket in range(partitions * partitions):
            rows = slice(int(block.offsets[bucket]), int(block.offsets[bucket + 1]))
            lhs, rhs = block.lhs[rows], block.rhs[rows]
            assert ((lhs >= 0) & (lhs < counts[bucket // partitions])).all()
            assert ((rhs >= 0) & (rhs < counts[bucket % partitions])).all()
            total += rows.stop - rows.start
    assert total == spec.num_edges
