"""Interoperability with the reference implementation, torchbiggraph 1.0.0.

Each file kind is written by one side and read by the other through the reference's own
classes (``FileEdgeStorage``, ``FileCheckpointStorage``/``CheckpointManager``,
``ConfigSchema.from_dict``, ``export_to_tsv.make_tsv``), so "PBG-compatible" is checked
against PBG itself rather than against our reading of its source.

Install the reference with ``pip install torchbiggraph==1.0.0 'setuptools<81'`` (it
imports ``pkg_resources``, which setuptools 81 removed); without it these tests skip.
"""

from __future__ import annotations

import io
import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from job.config import parse_config
from job.data.export import export_checkpoint
from job.formats.checkpoint import CheckpointStorage
from job.formats.edges import count_edges, edges_file, read_edges, write_edges
from job.formats.entities import write_dynamic_rel_names

pytestmark = [
    pytest.mark.pbg,
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # pkg_resources deprecation, printed on import
    tbg = pytest.importorskip(
        "torchbiggraph",
        reason="the reference torchbiggraph==1.0.0 is not installed (pip install torchbiggraph==1.0.0 'setuptools<81')",
    )
    from torchbiggraph.checkpoint_manager import CheckpointManager, ConfigMetadataProvider
    from torchbiggraph.config import ConfigSchema as PbgConfigSchema
    from torchbiggraph.converters.export_to_tsv import make_tsv
    from torchbiggraph.edgelist import EdgeList
    from torchbiggraph.entitylist import EntityList
    from torchbiggraph.graph_storages import FileEdgeStorage
    from torchbiggraph.model import make_model
    from torchbiggraph.row_adagrad import RowAdagrad
    from torchbiggraph.tensorlist import TensorList


def base_raw(root: Path, **extra: Any) -> dict[str, Any]:
    raw = {
        "entities": {"user": {"num_partitions": 2}, "item": {"num_partitions": 1}},
        "relations": [
            {"name": "follows", "lhs": "user", "rhs": "user", "operator": "diagonal"},
            {"name": "likes", "lhs": "user", "rhs": "item", "operator": "complex_diagonal", "weight": 0.5},
        ],
        "dimension": 4,
        "entity_path": str(root / "entities"),
        "edge_paths": [str(root / "edges")],
        "checkpoint_path": str(root / "checkpoint"),
    }
    raw.update(extra)
    return raw


def row_adagrad_state(rows: int, step: int) -> dict[str, Any]:
    """Exactly what ``RowAdagrad.state_dict()`` returns for one (rows x dim) parameter."""
    return {
        "state": {0: {"step": step, "sum": torch.linspace(0, 1, rows)}},
        "param_groups": [{"lr": 0.1, "lr_decay": 0, "weight_decay": 0, "params": [0]}],
    }


# (1) edge files -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("high", "dtype"), [(1000, np.int32), (2**40, np.int64)])
def test_our_edge_files_read_by_pbg(tmp_path: Path, high: int, dtype: type) -> None:
    import h5py

    rng = np.random.default_rng(0)
    n = 1001
    rel, lhs, rhs = rng.integers(0, 3, n), rng.integers(0, high, n), rng.integers(0, high, n)
    write_edges(edges_file(str(tmp_path), 1, 0), rel, lhs, rhs)
    with h5py.File(tmp_path / "edges_1_0.h5", "r") as handle:
        assert handle["lhs"].dtype == dtype  # int32 whenever the values fit
    storage = FileEdgeStorage(str(tmp_path))
    assert storage.has_edges(1, 0) and storage.get_number_of_edges(1, 0) == n
    for chunk in range(3):
        edges = storage.load_chunk_of_edges(1, 0, chunk, 3)
        begin, end = int(chunk * n / 3), int((chunk + 1) * n / 3)
        assert torch.equal(edges.lhs.to_tensor(), torch.from_numpy(lhs[begin:end]))
        assert torch.equal(edges.rhs.to_tensor(), torch.from_numpy(rhs[begin:end]))
        assert torch.equal(edges.rel, torch.from_numpy(rel[begin:end]))


def test_our_featurized_edge_files_read_by_pbg(tmp_path: Path) -> None:
    lhsd = (np.array([0, 2, 3, 3, 6]), np.array([5, 6, 7, 1, 2, 3]))
    write_edges(edges_file(str(tmp_path), 0, 0), np.zeros(4, np.int64), np.full(4, -1), np.arange(4), lhsd=lhsd)
    edges = FileEdgeStorage(str(tmp_path)).load_chunk_of_edges(0, 0, 1, 2)  # edges 2 and 3
    assert edges.lhs.to_tensor_list().offsets.tolist() == [0, 0, 3]
    assert edges.lhs.to_tensor_list().data.tolist() == [1, 2, 3]
    assert edges.rhs.to_tensor().tolist() == [2, 3]


def test_pbg_edge_files_read_by_ours(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    n = 500
    lhs, rhs, rel = (torch.from_numpy(rng.integers(0, 10**6, n)) for _ in range(3))
    FileEdgeStorage(str(tmp_path)).save_edges(0, 1, EdgeList(EntityList.from_tensor(lhs), EntityList.from_tensor(rhs), rel))
    url = edges_file(str(tmp_path), 0, 1)
    assert count_edges(url) == n
    edges = read_edges(url, 100, 250)
    assert np.array_equal(edges.lhs, lhs[100:250].numpy()) and np.array_equal(edges.rhs, rhs[100:250].numpy())
    assert np.array_equal(edges.rel, rel[100:250].numpy())
    assert edges.lhs_features is None

    offsets = torch.tensor([0, 1, 1, 4], dtype=torch.long)
    data = torch.tensor([9, 8, 7, 6], dtype=torch.long)
    featurized = EdgeList(
        EntityList.from_tensor_list(TensorList(offsets, data)),
        EntityList.from_tensor(torch.arange(3)),
        torch.zeros(3, dtype=torch.long),
    )
    FileEdgeStorage(str(tmp_path)).save_edges(1, 1, featurized)
    edges = read_edges(edges_file(str(tmp_path), 1, 1), 1, 3)
    assert edges.lhs_features is not None
    assert edges.lhs_features[0].tolist() == [0, 0, 3] and edges.lhs_features[1].tolist() == [8, 7, 6]


# (2) checkpoints --------------------------------------------------------------------------------------------


def write_our_checkpoint(root: Path) -> tuple[Any, dict[tuple[str, int], np.ndarray], dict[str, np.ndarray]]:
    config = parse_config(base_raw(root))
    store = CheckpointStorage(config.checkpoint_path)
    store.prepare()
    rng = np.random.default_rng(3)
    embeddings = {}
    for entity_type, part, rows in (("user", 0, 3), ("user", 1, 2), ("item", 0, 4)):
        emb = rng.standard_normal((rows, 4)).astype(np.float32)
        store.save_entity_partition(2, entity_type, part, emb, row_adagrad_state(rows, step=7),
                                    {"config/json": config.to_json()})
        embeddings[(entity_type, part)] = emb
    model = {
        "relations/0/operator/rhs/diagonal": ("rhs_operators.0.diagonal", rng.standard_normal(4).astype(np.float32)),
        "relations/1/operator/rhs/real": ("rhs_operators.1.real", rng.standard_normal(2).astype(np.float32)),
        "relations/1/operator/rhs/imag": ("rhs_operators.1.imag", rng.standard_normal(2).astype(np.float32)),
        "entities/user/global_embedding": ("global_embs.emb_user", rng.standard_normal(4).astype(np.float32)),
        "entities/item/global_embedding": ("global_embs.emb_item", rng.standard_normal(4).astype(np.float32)),
    }
    store.save_model(2, model, {"state": {}, "param_groups": [{"lr": 0.1, "params": []}]})
    store.save_config(config.to_pbg_json())
    store.append_stats([{"epoch_idx": 0, "stats": {"count": 10, "metrics": {"loss": 0.5}}}])
    store.save_version(2)
    return config, embeddings, {k: v for k, (_, v) in model.items()}


def test_our_checkpoint_read_by_pbg(tmp_path: Path) -> None:
    config, embeddings, model = write_our_checkpoint(tmp_path)
    manager = CheckpointManager(config.checkpoint_path)
    assert manager.checkpoint_version == 2
    for (entity_type, part), emb in embeddings.items():
        embs, optim_state = manager.read(entity_type, part)
        assert torch.equal(embs, torch.from_numpy(emb))
        assert optim_state["state"][0]["step"] == 7
        assert torch.equal(optim_state["state"][0]["sum"], torch.linspace(0, 1, len(emb)))
        # The state loads into PBG's own optimizer for that partition.
        optimizer = RowAdagrad([torch.nn.Parameter(embs)], lr=0.1)
        optimizer.load_state_dict(optim_state)
        assert torch.equal(next(iter(optimizer.state.values()))["sum"], torch.linspace(0, 1, len(emb)))
    state_dict, _ = manager.read_model()
    assert set(state_dict) == {"rhs_operators.0.diagonal", "rhs_operators.1.real", "rhs_operators.1.imag",
                               "global_embs.emb_user", "global_embs.emb_item"}
    assert torch.equal(state_dict["global_embs.emb_user"], torch.from_numpy(model["entities/user/global_embedding"]))
    pbg_config = manager.read_config()  # config.json as written by to_pbg_json
    assert pbg_config.relations[1].weight == 0.5 and pbg_config.entities["user"].num_partitions == 2
    pbg_model = make_model(pbg_config)
    missing, unexpected = pbg_model.load_state_dict(state_dict, strict=False)
    assert unexpected == [] and torch.equal(pbg_model.rhs_operators[0].diagonal.data, state_dict["rhs_operators.0.diagonal"])
    assert list(manager.read_stats())[0]["stats"]["count"] == 10


def test_pbg_export_to_tsv_matches_ours_byte_for_byte(tmp_path: Path) -> None:
    from test_exporter import build_checkpoint

    ckpt = build_checkpoint(tmp_path, with_item_names=True)
    write_dynamic_rel_names(ckpt.config.entity_path, [r.name for r in ckpt.config.relations])  # PBG's exporter reads them
    pbg_config = PbgConfigSchema.from_dict(ckpt.config.to_pbg_dict())
    pbg_entities, pbg_relations = io.StringIO(), io.StringIO()
    make_tsv(pbg_config, pbg_entities, pbg_relations)
    export_checkpoint(ckpt.config, out=str(tmp_path / "ours"))
    assert (tmp_path / "ours" / "entity_embeddings.tsv").read_text(encoding="utf-8") == pbg_entities.getvalue()
    assert (tmp_path / "ours" / "relation_types_parameters.tsv").read_text() == pbg_relations.getvalue()


def test_pbg_checkpoint_read_by_ours(tmp_path: Path) -> None:
    pbg_config = PbgConfigSchema.from_dict(base_raw(tmp_path))
    manager = CheckpointManager(pbg_config.checkpoint_path)
    manager.register_metadata_provider(ConfigMetadataProvider(pbg_config))
    manager.write_config(pbg_config)
    embs = {("user", 0): torch.randn(3, 4), ("user", 1): torch.randn(5, 4), ("item", 0): torch.randn(2, 4)}
    for (entity_type, part), emb in embs.items():
        manager.write(entity_type, part, emb, row_adagrad_state(len(emb), step=4))
    model = make_model(pbg_config)
    model.global_embs["emb_user"].data.fill_(0.25)
    model_state = {k: v for k, v in model.state_dict().items() if not k.startswith(("lhs_embs", "rhs_embs"))}
    manager.write_model(model_state, {"state": {}, "param_groups": []})
    manager.append_stats([{"epoch_idx": 0, "stats": {"count": 1}}])
    manager.switch_to_new_version()

    store = CheckpointStorage(pbg_config.checkpoint_path)
    assert store.load_version() == 1
    for (entity_type, part), emb in embs.items():
        ours, optim = store.load_entity_partition(1, entity_type, part)
        np.testing.assert_array_equal(ours, emb.numpy())
        assert optim is not None and optim["state"][0]["step"] == 4
    params, optim, metadata = store.load_model(1)
    assert "relations/1/operator/rhs/real" in params and "relations/0/operator/rhs/diagonal" in params
    np.testing.assert_array_equal(params["entities/user/global_embedding"], np.full(4, 0.25, np.float32))
    assert json.loads(metadata["config/json"])["dimension"] == 4
    config = parse_config(store.load_config_dict())  # PBG's config.json parses as ours
    assert config.relations[1].weight == 0.5 and config.bucket_order.value == pbg_config.bucket_order.value
    assert store.load_stats() == [{"epoch_idx": 0, "stats": {"count": 1}}]
    summary = export_checkpoint(config, out=str(tmp_path / "out"), fmt="npy")
    assert summary.generated_names == ["user/0", "user/1", "item/0"]
    exported = np.load(tmp_path / "out" / "embeddings_user.npy")
    np.testing.assert_allclose(exported, torch.cat([embs[("user", 0)], embs[("user", 1)]]).numpy() + 0.25, rtol=1e-6)


# (3) config.json ----------------------------------------------------------------------------------------------


def test_pbg_rejects_our_extra_keys_and_accepts_to_pbg_dict(tmp_path: Path) -> None:
    config = parse_config(base_raw(tmp_path, seed=3, device="cpu", num_gpus=0, regularization_coef=0.0))
    with pytest.raises(Exception, match="Unknown key"):
        PbgConfigSchema.from_dict(config.to_dict())
    pbg = PbgConfigSchema.from_dict(config.to_pbg_dict())
    assert pbg.to_dict() == config.to_pbg_dict()
    # And back: everything PBG writes parses as ours, equal to the original but for our extras.
    assert parse_config(pbg.to_dict()) == parse_config(base_raw(tmp_path))


def test_pbg_reference_configs_and_defaults_agree(tmp_path: Path) -> None:
    import attr

    from job.config import ConfigSchema, EntitySchema, RelationSchema

    ours_cfg = parse_config(base_raw(tmp_path))
    pbg_cfg = PbgConfigSchema.from_dict(base_raw(tmp_path))
    for ours, theirs in ((ours_cfg, pbg_cfg), (ours_cfg.entities["user"], pbg_cfg.entities["user"]),
                         (ours_cfg.relations[0], pbg_cfg.relations[0])):
        for field in attr.fields(type(theirs)):
            mine, ref = getattr(ours, field.name), getattr(theirs, field.name)
            if hasattr(ref, "value"):
                mine, ref = mine.value, ref.value
            if field.name in ("entities", "relations"):
                continue
            assert mine == ref, field.name
    import dataclasses

    for cls, ref in ((ConfigSchema, PbgConfigSchema), (EntitySchema, type(pbg_cfg.entities["user"])),
                     (RelationSchema, type(pbg_cfg.relations[0]))):
        assert {f.name for f in attr.fields(ref)} <= {f.name for f in dataclasses.fields(cls)}


# (4) what our trainer writes ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tiny graph trained for one epoch by our trainer, with names for PBG's exporter."""
    import contextlib
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from helpers_graphs import make_graph

    from job.cli import main
    from job.config import load_config
    from job.formats.entities import write_entity_names

    graph = make_graph(tmp_path_factory.mktemp("trained"), num_epochs=1)
    graph.config["relations"][0]["operator"] = "diagonal"
    graph.config["relations"][1]["operator"] = "complex_diagonal"
    graph.write_config()
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["train", str(graph.config_path)]) == 0
    config = load_config(str(graph.config_path))
    for entity_type, counts in graph.counts.items():
        for part, count in enumerate(counts):
            write_entity_names(config.entity_path, entity_type, part, [f"{entity_type}{part}-{i}" for i in range(count)])
    write_dynamic_rel_names(config.entity_path, [r.name for r in config.relations])
    return graph, config


def test_trainer_checkpoint_read_by_pbg_and_exported_identically(trained: Any) -> None:
    import contextlib

    graph, config = trained
    manager = CheckpointManager(config.checkpoint_path)
    assert manager.checkpoint_version >= 1
    embs, optim_state = manager.read("user", 1)
    assert embs.shape == (graph.counts["user"][1], 4)
    optimizer = RowAdagrad([torch.nn.Parameter(embs)], lr=0.1)
    optimizer.load_state_dict(optim_state)  # PBG's RowAdagrad layout
    state_dict, _ = manager.read_model()
    missing, unexpected = make_model(PbgConfigSchema.from_dict(config.to_pbg_dict())).load_state_dict(state_dict, strict=False)
    assert unexpected == [] and not [k for k in missing if "operators" in k or "global" in k]
    pbg_entities, pbg_relations = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()):
        make_tsv(PbgConfigSchema.from_dict(config.to_pbg_dict()), pbg_entities, pbg_relations)
    out = Path(graph.root) / "export"
    export_checkpoint(config, out=str(out))
    assert (out / "entity_embeddings.tsv").read_text() == pbg_entities.getvalue()
    assert (out / "relation_types_parameters.tsv").read_text() == pbg_relations.getvalue()


def test_trainer_config_json_read_by_pbg(trained: Any) -> None:
    _, config = trained
    assert CheckpointManager(config.checkpoint_path).read_config().dimension == config.dimension
