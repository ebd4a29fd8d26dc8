"""Typed training configuration, compatible key for key with PBG's ``ConfigSchema``.

PBG users keep their configs as Python files exposing ``get_torchbiggraph_config()``;
we load those unchanged, as well as YAML/JSON files holding the same dict (the
Helm chart ships YAML in a ConfigMap, so no code runs from cluster-supplied
config). Every field carries its help string in ``metadata["help"]`` so that
``biggraph config-help`` and the generated reference stay in sync with the code.

Parsing is strict: unknown keys, wrong types and impossible combinations raise
``ConfigError`` naming the offending key, because a typo in a config of a
multi-hour job should fail in the first second, not after the first epoch.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import json
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Union

from job.errors import ConfigError
from job.model.names import COMPARATORS, LOSS_FUNCTIONS, OPERATORS  # the model registries' names; no torch

MISSING = dataclasses.MISSING


def _help(text: str, **kwargs: Any) -> Any:
    """A dataclass field whose help text is kept next to it."""
    return field(metadata={"help": text}, **kwargs)


_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int, key: str) -> int:
    """'8GiB', '500 MB', '1e9' or a plain number of bytes -> bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    try:
        value = float(match.group(1)) if match else -1.0
    except ValueError:
        value = -1.0
    if unit not in _BYTE_UNITS or value <= 0:
        raise ConfigError(f"config key '{key}': {text!r} is not a size (expected e.g. '8GiB', '500MB' or bytes)")
    return int(value * _BYTE_UNITS[unit])


class BucketOrder(str, enum.Enum):
    """Order in which the buckets of an edge chunk are trained (PBG's names)."""

    RANDOM = "random"
    AFFINITY = "affinity"
    INSIDE_OUT = "inside_out"
    OUTSIDE_IN = "outside_in"
    BUFFER = "buffer"  # ours: few partition swaps for a buffer of partition_buffer partitions


REGULARIZERS = ("N3",)
EDGE_READ_MODES = ("stage", "stream")
GROW_INITS = ("random", "neighbours")
GROW_NUM_EPOCHS_DEFAULT = 5


@dataclass
class EntitySchema:
    """One entity type."""

    num_partitions: int = _help(
        "Number of partitions for this entity type. Set to 1 if unpartitioned. All "
        "partitioned entity types must have the same number of partitions."
    )
    featurized: bool = _help(
        "Whether the entities of this type are represented as sets of features "
        "(an entity's embedding is the mean of its features' embeddings).",
        default=False,
    )
    dimension: int | None = _help(
        "Dimension of this type's embeddings; defaults to the global `dimension`.",
        default=None,
    )
    frozen: bool = _help(
        "Keep this type's embeddings and their row-wise Adagrad state fixed while training (PBG issue #270): "
        "its rows are still scored and drawn as negatives, but never updated, and neither is its global "
        "embedding. Typical use: a trained catalogue stays exactly as it is while new entities of other types "
        "are fitted to it (`biggraph grow`).",
        default=False,
    )

    def __post_init__(self) -> None:
        if self.num_partitions < 1:
            raise ConfigError("num_partitions: must be a positive integer")
        if self.dimension is not None and self.dimension < 1:
            raise ConfigError("dimension: must be a positive integer")


@dataclass
class RelationSchema:
    """One relation type; its index in `relations` is its id in the edge files."""

    name: str = _help("A human-readable identifier for the relation type.")
    lhs: str = _help("The type of the entities on the left-hand side of this relation.")
    rhs: str = _help("The type of the entities on the right-hand side of this relation.")
    weight: float = _help(
        "The weight that the loss of this relation gets multiplied by.", default=1.0
    )
    operator: str = _help(
        "The transformation applied to the right-hand side embedding (and, with "
        f"dynamic relations, also to the left-hand side). One of {', '.join(OPERATORS)}.",
        default="none",
    )
    all_negs: bool = _help(
        "If enabled, the negatives for (x, r, y) are all (x, r, z) for every z of "
        "the right-hand side entity type in the partition, instead of a sample.",
        default=False,
    )

    def __post_init__(self) -> None:
        if self.operator not in OPERATORS:
            raise ConfigError(
                f"operator: unknown operator '{self.operator}' (expected one of {', '.join(OPERATORS)})"
            )


@dataclass(kw_only=True)
class ConfigSchema:
    """The whole training configuration (every key of PBG's ConfigSchema, plus a few of ours)."""

    # model config
    entities: dict[str, EntitySchema] = _help(
        "The entity types. The ID with which they are referenced by the relation "
        "types is the key they have in this dict."
    )
    relations: list[RelationSchema] = _help(
        "The relation types. The ID with which they will be referenced in the edge "
        "lists is their index in this list."
    )
    dimension: int = _help("The dimension of the real space the embedding live in.")
    init_scale: float = _help(
        "If no initial embeddings are provided, they are generated by sampling each "
        "dimension from a centered normal distribution having this standard deviation.",
        default=1e-3,
    )
    max_norm: float | None = _help(
        "If set, rescale the embeddings if their norm exceeds this value.", default=None
    )
    global_emb: bool = _help(
        "If enabled, add to each embedding a vector that is common to all the entities "
        "of a certain type. This vector is learned during training.",
        default=True,
    )
    comparator: str = _help(
        "How the embeddings of the two sides of an edge (after having already undergone "
        f"some processing) are compared to each other to produce a score. One of {', '.join(COMPARATORS)}.",
        default="cos",
    )
    bias: bool = _help(
        "If enabled, withhold the first dimension of the embeddings from the comparator "
        "and instead use it as a bias, adding back to the score. Makes sense for "
        "logistic and softmax loss functions.",
        default=False,
    )
    loss_fn: str = _help(
        "How the scores of positive edges and their corresponding negatives are "
        f"evaluated. One of {', '.join(LOSS_FUNCTIONS)}.",
        default="ranking",
    )
    margin: float = _help(
        "When using ranking loss, this value controls the minimum separation between "
        "positive and negative scores, below which a (linear) loss is incurred.",
        default=0.1,
    )
    regularization_coef: float = _help(
        "The coefficient of the regularization term added to the loss (0 disables it).",
        default=0.0,
    )
    regularizer: str = _help(
        "The regularization applied when regularization_coef > 0 (N3: the sum of the "
        "cubed absolute values of the embeddings and operator parameters).",
        default="N3",
    )

    # data config
    entity_path: str = _help(
        "The path (or URL) of the directory containing entity count files."
    )
    edge_paths: list[str] = _help(
        "A list of paths (or URLs) to directories containing (partitioned) edgelists. "
        "Typically a single path is provided.",
    )
    checkpoint_path: str = _help(
        "The path (or URL) of the directory where checkpoints (and thus the output) "
        "will be written to. If checkpoints are found in it, training resumes from them.",
    )
    init_path: str | None = _help(
        "If set, it must be a path to a directory that contains initial values for the "
        "embeddings of all the entities of some types.",
        default=None,
    )
    checkpoint_preservation_interval: int | None = _help(
        "If set, every so many epochs a snapshot of the checkpoint is kept (in "
        "epoch_{N}/) instead of being deleted when the next one is written.",
        default=None,
    )

    # training config
    num_epochs: int = _help("The number of times the training loop iterates over all the edges.", default=1)
    num_edge_chunks: int | None = _help(
        "The number of equally-sized parts each bucket will be split into. Training "
        "first proceeds over all the first chunks of all buckets, then over all the "
        "second chunks, and so on. If not set, the minimal number of chunks such that "
        "each holds at most max_edges_per_chunk edges.",
        default=None,
    )
    max_edges_per_chunk: int = _help(
        "The maximum number of edges in each edge chunk when num_edge_chunks is not set.",
        default=1_000_000_000,
    )
    bucket_order: BucketOrder = _help(
        "The order in which to iterate over the buckets: random, affinity, inside_out or outside_in (PBG's), or "
        "buffer: an order close to the fewest partition loads for the partition buffer (groups of "
        "partition_buffer - 1 partitions stay while every other partition passes through the last slot; "
        "single-machine runs, other trainers walk inside_out).",
        default=BucketOrder.INSIDE_OUT,
    )
    workers: int | None = _help(
        "The number of worker processes for Hogwild training. Defaults to the number of CPUs.",
        default=None,
    )
    batch_size: int = _help("The number of edges per batch.", default=1000)
    num_batch_negs: int = _help(
        "The number of negatives sampled from the batch, per positive edge.", default=50
    )
    num_uniform_negs: int = _help(
        "The number of negatives uniformly sampled from the currently active partition, per positive edge.",
        default=50,
    )
    disable_lhs_negs: bool = _help("Disable negative sampling on the left-hand side.", default=False)
    disable_rhs_negs: bool = _help("Disable negative sampling on the right-hand side.", default=False)
    lr: float = _help("The learning rate for the optimizer.", default=1e-2)
    relation_lr: float | None = _help(
        "If set, the learning rate for the optimizer for relations. Otherwise, `lr` is used.",
        default=None,
    )
    eval_fraction: float = _help(
        "The fraction of edges withheld from training and used to track evaluation metrics during training.",
        default=0.05,
    )
    eval_num_batch_negs: int = _help(
        "The value that overrides the number of negatives per positive edge sampled from the batch during the "
        "evaluation steps that occur before and after each training step.",
        default=1000,
    )
    eval_num_uniform_negs: int = _help(
        "The value that overrides the number of uniformly-sampled negatives per positive edge during the "
        "evaluation steps that occur before and after each training step.",
        default=1000,
    )
    early_stopping: bool = _help(
        "Stop training when the evaluation MRR stops improving from one epoch to the next.",
        default=False,
    )

    # expert options
    background_io: bool = _help("Whether to do load/save in a background process (PBG; accepted).", default=False)
    verbose: int = _help("The verbosity level of logging, currently 0 or 1.", default=0)
    hogwild_delay: float = _help(
        "The number of seconds by which to delay the start of all 'Hogwild!' processes except the first one, "
        "on the first epoch.",
        default=2.0,
    )
    dynamic_relations: bool = _help(
        "If enabled, activates the dynamic relation mode, in which case, there must be a single relation type "
        "in the config (whose parameters will apply to all dynamic relations types) and there must be a file "
        "called dynamic_rel_count.txt in the entity path that contains the number of dynamic relations.",
        default=False,
    )

    # distributed training config options
    num_machines: int = _help("The number of machines for distributed training (PBG; torchrun decides here).", default=1)
    num_partition_servers: int = _help(
        "If -1, use trainer as partition servers. If 0, don't use partition servers (PBG; accepted).", default=-1
    )
    distributed_init_method: str | None = _help(
        "A URI defining how to synchronize all the workers of a distributed run (PBG; torchrun replaces it).",
        default=None,
    )
    distributed_tree_init_order: bool = _help(
        "If enabled, distributed training can occur on a bucket only if at least one of its partitions was "
        "already trained on before in the same round (or if one of its partitions is 0, for bootstrapping).",
        default=True,
    )
    num_gpus: int = _help("Number of GPUs to use for GPU training (0 trains on the CPU).", default=0)
    num_groups_for_partition_server: int = _help(
        "Number of td.distributed 'groups' to use for the partition server (PBG; accepted).", default=16
    )
    num_groups_per_sharded_partition_server: int = _help(
        "Number of groups per sharded partition server (PBG; accepted).", default=1
    )
    partition_shard_size: int = _help("Size of partition shards (PBG; accepted).", default=250)
    half_precision: bool = _help("Use half-precision training (GPU only).", default=False)

    # biggraph additions
    seed: int | None = _help(
        "Seed for every random choice (initialisation, shuffling, negatives, bucket order); with workers=1 two "
        "runs with the same seed give the same embeddings.",
        default=None,
    )
    device: str = _help(
        "Where to compute: 'auto' (CUDA when num_gpus > 0), 'cpu' or 'cuda'.", default="auto"
    )
    prefetch_partitions: bool = _help(
        "Single-machine runs: while a bucket trains, a background thread writes back the partition the next "
        "bucket evicts (when the current one does not use it) and reads the one it needs into the freed room: "
        "the same loads, within the partition buffer, without the wait. false: every swap waits, as in PBG.",
        default=True,
    )
    partition_buffer: int | None = _help(
        "Single-machine runs: how many partitions (of the partitioned entity types, per partition index) stay "
        "in memory, >= 2. Partitions leave the buffer only when it is full, the one needed again latest first. "
        "Default: what memory_budget allows, else 3 with prefetch_partitions (the bucket's two plus room for "
        "the next to arrive) and 2 without (PBG: the current bucket only).",
        default=None,
    )
    memory_budget: str | None = _help(
        "Single-machine runs: the bytes of embeddings and optimizer state the trainer may hold, e.g. '8GiB', "
        "'500MB' or a number of bytes; partition_buffer follows from it (unpartitioned types are held first). "
        "The trainer says at start what it will hold and why.",
        default=None,
    )
    cuda_graphs: bool = _help(
        "On a GPU, record each relation's full-size training batch as a CUDA graph once and replay it (the "
        "same arithmetic with a fraction of the launch overhead); false runs every batch eagerly.",
        default=True,
    )
    edge_read_mode: str = _help(
        "How edge files on object stores are read: 'stage' (download each bucket file to a local cache first) "
        "or 'stream' (HDF5 over a remote file object with a large read-ahead).",
        default="stage",
    )
    storage_options: dict[str, Any] = _help(
        "Extra keyword arguments for the fsspec filesystem of every URL (e.g. {'endpoint_url': ...} for "
        "MinIO/Ceph, or a profile name). Credentials belong in the environment, not here.",
        default_factory=dict,
    )
    tensorboard_dir: str | None = _help(
        "If set, a directory (local path) where TensorBoard scalars are written: loss, eval MRR/Hits, edges/s "
        "and swap time per bucket, and per pass (needs the 'tensorboard' extra: pip install 'biggraph[tensorboard]').",
        default=None,
    )
    pushgateway_url: str | None = _help(
        "If set, the URL of a Prometheus Pushgateway (e.g. http://pushgateway:9091) to which every trainer pushes "
        "its metrics at the end of each pass; a failed push is logged as a warning and never stops training.",
        default=None,
    )
    pushgateway_job: str = _help(
        "The job label of the Pushgateway grouping key ({pushgateway_url}/metrics/job/{job}/instance/{rank}).",
        default="biggraph",
    )
    grow_init: str = _help(
        "How `biggraph grow` initialises the rows of new entities: 'random' (normal with standard deviation "
        "init_scale, as a fresh run does) or 'neighbours' (the mean of the trained embeddings of the entities "
        "each one is linked to by the new edges, mapped through the relation operator; entities reached only "
        "through other new entities are filled in later rounds, and those with no trained neighbour at all "
        "start at random).",
        default="neighbours",
    )
    grow_num_epochs: int = _help(
        "How many passes over the new edges (plus the replayed old ones) `biggraph grow` trains after it has "
        "committed the grown checkpoint; 0 only grows the checkpoint.",
        default=GROW_NUM_EPOCHS_DEFAULT,
    )
    grow_replay_fraction: float = _help(
        "The fraction of the old edges that each pass of `biggraph grow`'s training replays beside the new ones "
        "(a fresh uniform sample per pass and bucket, read from the same edge files: no second copy), so that "
        "old embeddings keep fitting the old graph; 0 trains on the new edges only, 1 on all edges.",
        default=0.1,
    )

    def __post_init__(self) -> None:
        if not self.edge_paths:
            raise ConfigError("config key 'edge_paths': must list at least one directory")
        if not self.entities:
            raise ConfigError("config key 'entities' must define at least one entity type")
        if not self.relations:
            raise ConfigError("config key 'relations' must define at least one relation type")
        for rel_idx, relation in enumerate(self.relations):
            for side in ("lhs", "rhs"):
                entity_type = getattr(relation, side)
                if entity_type not in self.entities:
                    raise ConfigError(
                        f"config key 'relations[{rel_idx}].{side}': relation '{relation.name}' names unknown "
                        f"entity type '{entity_type}' (known: {', '.join(sorted(self.entities))})"
                    )
        partition_counts = {e.num_partitions for e in self.entities.values()} - {1}
        if len(partition_counts) > 1:
            detail = ", ".join(f"{name}={e.num_partitions}" for name, e in self.entities.items())
            raise ConfigError(
                f"config key 'entities.*.num_partitions': partition counts are not broadcastable ({detail}); "
                "every partitioned entity type must have the same number of partitions"
            )
        if self.dynamic_relations and len(self.relations) != 1:
            raise ConfigError(
                "config key 'relations': with dynamic_relations exactly one relation type must be defined "
                f"(got {len(self.relations)})"
            )
        if self.disable_lhs_negs and self.disable_rhs_negs:
            raise ConfigError("config keys 'disable_lhs_negs' and 'disable_rhs_negs': cannot disable both sides")
        self._check_choice("comparator", COMPARATORS)
        self._check_choice("loss_fn", LOSS_FUNCTIONS)
        self._check_choice("regularizer", REGULARIZERS)
        self._check_choice("edge_read_mode", EDGE_READ_MODES)
        self._check_choice("device", ("auto", "cpu", "cuda"))
        self._check_choice("grow_init", GROW_INITS)
        if not 0.0 <= self.grow_replay_fraction <= 1.0:
            raise ConfigError(f"config key 'grow_replay_fraction': must be in [0, 1], got {self.grow_replay_fraction}")
        if self.partition_buffer is not None and self.partition_buffer < 2:
            raise ConfigError(f"config key 'partition_buffer': a bucket needs two partitions, got {self.partition_buffer}")
        if self.memory_budget is not None:
            parse_bytes(self.memory_budget, "memory_budget")
        if self.grow_num_epochs < 0:
            raise ConfigError(f"config key 'grow_num_epochs': must be >= 0, got {self.grow_num_epochs}")
        for name in ("dimension", "batch_size", "num_epochs", "max_edges_per_chunk"):
            if getattr(self, name) < 1:
                raise ConfigError(f"config key '{name}': must be a positive integer, got {getattr(self, name)}")
        for name in ("num_batch_negs", "num_uniform_negs", "eval_num_batch_negs", "eval_num_uniform_negs", "num_gpus"):
            if getattr(self, name) < 0:
                raise ConfigError(f"config key '{name}': must be >= 0, got {getattr(self, name)}")
        if self.num_edge_chunks is not None and self.num_edge_chunks < 1:
            raise ConfigError(f"config key 'num_edge_chunks': must be a positive integer, got {self.num_edge_chunks}")
        if self.workers is not None and self.workers < 1:
            raise ConfigError(f"config key 'workers': must be a positive integer, got {self.workers}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ConfigError(f"config key 'eval_fraction': must be in [0, 1), got {self.eval_fraction}")
        if self.lr <= 0 or (self.relation_lr is not None and self.relation_lr <= 0):
            raise ConfigError("config keys 'lr'/'relation_lr': learning rates must be positive")
        if self.checkpoint_preservation_interval is not None and self.checkpoint_preservation_interval < 1:
            raise ConfigError("config key 'checkpoint_preservation_interval': must be a positive integer")
        if self.max_norm is not None and self.max_norm <= 0:
            raise ConfigError(f"config key 'max_norm': must be positive, got {self.max_norm}")
        for name, entity in self.entities.items():
            dim = entity.dimension or self.dimension
            if dim != self.dimension:
                raise ConfigError(
                    f"config key 'entities.{name}.dimension': per-type dimensions differing from 'dimension' "
                    "are not supported by the relation operators"
                )
        for rel_idx, relation in enumerate(self.relations):
            if relation.all_negs and (self.entities[relation.lhs].featurized or self.entities[relation.rhs].featurized):
                raise ConfigError(
                    f"config key 'relations[{rel_idx}].all_negs': featurized entity types cannot list all their "
                    "entities (PBG has the same limit)"
                )
            if relation.operator == "complex_diagonal" and self.dimension % 2:
                raise ConfigError(
                    f"config key 'relations[{rel_idx}].operator': complex_diagonal needs an even dimension, "
                    f"got {self.dimension}"
                )
        if self.bias and self.dimension < 2:
            raise ConfigError("config key 'bias': needs dimension >= 2 (the first dimension becomes the bias)")
        if self.num_batch_negs > 0 and self.batch_size % self.num_batch_negs != 0:
            raise ConfigError(
                f"config key 'batch_size': {self.batch_size} must be a multiple of num_batch_negs ({self.num_batch_negs})"
            )
        if self.dynamic_relations and self.global_emb:
            raise ConfigError(
                "config key 'global_emb': per-type global embeddings cannot be used with dynamic_relations "
                "(set global_emb=False, as PBG's dynamic-relation examples do)"
            )

    def _check_choice(self, name: str, choices: tuple[str, ...]) -> None:
        value = getattr(self, name)
        if value not in choices:
            raise ConfigError(f"config key '{name}': unknown value '{value}' (expected one of {', '.join(choices)})")

    # Derived values -----------------------------------------------------------------

    @property
    def num_partitions(self) -> int:
        """The broadcast number of partitions (what buckets range over)."""
        return max(e.num_partitions for e in self.entities.values())

    def entity_dimension(self, entity_type: str) -> int:
        return self.entities[entity_type].dimension or self.dimension

    def effective_workers(self) -> int:
        import os

        return self.workers if self.workers is not None else (os.cpu_count() or 1)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict with PBG's key names (what config.json holds)."""
        return _to_plain(self)

    def to_json(self, exclude: tuple[str, ...] = ()) -> str:
        data = self.to_dict()
        for key in exclude:
            data.pop(key, None)
        return json.dumps(data, indent=4)

    def to_pbg_dict(self) -> dict[str, Any]:
        """``to_dict()`` without the keys PBG 1.0.0's ``ConfigSchema`` lacks.

        PBG's ``ConfigSchema.from_dict`` rejects unknown keys, so a ``config.json`` holding our
        additions (``seed``, ``device``...) or keys of later PBG versions (``regularization_coef``,
        ``num_gpus``...) cannot be read by PBG 1.0.0's ``CheckpointManager.read_config``. The
        dropped values must be kept elsewhere (e.g. the ``config/json`` metadata attribute).
        """
        plain = self.to_dict()
        out = {k: v for k, v in plain.items() if k not in NON_PBG_1_0_KEYS}
        out["entities"] = {
            name: {k: v for k, v in entity.items() if k not in NON_PBG_1_0_ENTITY_KEYS}
            for name, entity in plain["entities"].items()
        }
        if out.get("bucket_order") == BucketOrder.BUFFER.value:
            out["bucket_order"] = BucketOrder.INSIDE_OUT.value  # PBG 1.0.0 knows only its own four orders
        return out

    def to_pbg_json(self) -> str:
        """What ``config.json`` must hold for PBG 1.0.0 to read the checkpoint's config."""
        return json.dumps(self.to_pbg_dict(), indent=4)


# Keys of ours (or of PBG versions after 1.0.0) that PBG 1.0.0's from_dict refuses.
NON_PBG_1_0_KEYS = frozenset({
    "regularization_coef", "regularizer", "early_stopping", "num_gpus", "num_groups_for_partition_server",
    "num_groups_per_sharded_partition_server", "partition_shard_size", "half_precision",
    "seed", "device", "cuda_graphs", "prefetch_partitions", "partition_buffer", "memory_budget", "edge_read_mode",
    "storage_options",
    "tensorboard_dir", "pushgateway_url", "pushgateway_job", "grow_init", "grow_num_epochs", "grow_replay_fraction",
})
NON_PBG_1_0_ENTITY_KEYS = frozenset({"dimension", "frozen"})


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    return value


# Parsing -------------------------------------------------------------------------------


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return f"{_type_name(args[0])} or null"
    if origin is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return f"mapping of {_type_name(typing.get_args(tp)[1])}"
    if tp is Any:
        return "any value"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of " + ", ".join(m.value for m in tp)
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _convert(value: Any, tp: Any, key: str) -> Any:
    """Check and convert a raw (JSON-like) value to the schema type ``tp``."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(value, inner[0], key)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key '{key}': expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
        (item_tp,) = typing.get_args(tp)
        return [_convert(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}': expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
        _, value_tp = typing.get_args(tp)
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ConfigError(f"config key '{key}': keys must be strings, got {k!r}")
            out[k] = _convert(v, value_tp, f"{key}.{k}")
        return out
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}': expected a mapping, got {type(value).__name__} {value!r}")
        return _from_dict(tp, value, prefix=f"{key}.")
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        if isinstance(value, tp):
            return value
        try:
            return tp(value)
        except ValueError:
            raise ConfigError(f"config key '{key}': expected {_type_name(tp)}, got {value!r}") from None
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"config key '{key}': expected a boolean, got {type(value).__name__} {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"config key '{key}': expected an integer, got {type(value).__name__} {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"config key '{key}': expected a number, got {type(value).__name__} {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"config key '{key}': expected a string, got {type(value).__name__} {value!r}")
    raise TypeError(f"unsupported schema type {tp!r}")  # a bug in the schema, not user input


def _from_dict(cls: type, raw: dict[str, Any], prefix: str = "") -> Any:
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names, key=str)  # YAML may give non-string keys
    if unknown:
        import difflib

        key = str(unknown[0])
        close = difflib.get_close_matches(key, names, n=1)
        hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
        raise ConfigError(f"config key '{prefix}{key}': unknown key{hint}")
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in raw:
            kwargs[f.name] = _convert(raw[f.name], hints[f.name], prefix + f.name)
        elif f.default is MISSING and f.default_factory is MISSING:
            raise ConfigError(f"config key '{prefix}{f.name}' is required")
    try:
        return cls(**kwargs)
    except ConfigError as err:
        message = str(err)
        if prefix and message.startswith(("num_partitions", "dimension", "operator")):
            message = f"config key '{prefix}{message}"
            message = message.replace(":", "':", 1)
        raise ConfigError(message) from None


def parse_config(raw: Any) -> ConfigSchema:
    """Build a validated ``ConfigSchema`` from a PBG-style dict."""
    if not isinstance(raw, dict):
        raise ConfigError(f"the config must be a mapping of keys to values, got {type(raw).__name__}")
    return _from_dict(ConfigSchema, raw)


# Overrides (-p key=value) -----------------------------------------------------------


def _schema_type_at(path: list[str]) -> Any:
    tp: Any = ConfigSchema
    for i, part in enumerate(path):
        while typing.get_origin(tp) in (Union, types.UnionType):
            tp = [a for a in typing.get_args(tp) if a is not type(None)][0]
        origin = typing.get_origin(tp)
        if dataclasses.is_dataclass(tp):
            hints = _hints(tp)
            if part not in hints:
                raise ConfigError(f"override '{'.'.join(path)}': unknown key '{part}'")
            tp = hints[part]
        elif origin is list:
            if not part.isdigit():
                raise ConfigError(f"override '{'.'.join(path)}': '{part}' must be a list index")
            tp = typing.get_args(tp)[0]
        elif origin is dict:
            tp = typing.get_args(tp)[1]
        else:
            raise ConfigError(f"override '{'.'.join(path)}': '{'.'.join(path[:i])}' has no sub-keys")
    return tp


def _parse_override_value(text: str, tp: Any, key: str) -> Any:
    while typing.get_origin(tp) in (Union, types.UnionType):
        if text in ("None", "null"):
            return None
        tp = [a for a in typing.get_args(tp) if a is not type(None)][0]
    origin = typing.get_origin(tp)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        return [_parse_override_value(part, item_tp, key) for part in text.split(",")] if text else []
    if tp is bool:
        lowered = text.lower()
        if lowered in ("true", "1", "yes", "on"):
            return True
        if lowered in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"override '{key}': expected a boolean (true/false), got '{text}'")
    if tp is int:
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"override '{key}': expected an integer, got '{text}'") from None
    if tp is float:
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"override '{key}': expected a number, got '{text}'") from None
    if tp is str or (isinstance(tp, type) and issubclass(tp, enum.Enum)):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise ConfigError(f"override '{key}': expected JSON for a {_type_name(tp)}, got '{text}'") from None


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply PBG-style ``key.sub=value`` overrides, typed from the schema, to a raw dict (in a copy)."""
    raw = json.loads(json.dumps(raw, default=_json_default))
    for override in overrides:
        key, sep, text = override.partition("=")
        if not sep or not key:
            raise ConfigError(f"override '{override}': expected key=value")
        path = key.strip().split(".")
        tp = _schema_type_at(path)
        value = _parse_override_value(text, tp, key)
        node: Any = raw
        for part in path[:-1]:
            if isinstance(node, list):
                index = int(part)
                if index >= len(node):
                    raise ConfigError(f"override '{key}': index {index} out of range (have {len(node)})")
                node = node[index]
            else:
                node = node.setdefault(part, {})
        last = path[-1]
        if isinstance(node, list):
            index = int(last)
            if index >= len(node):
                raise ConfigError(f"override '{key}': index {index} out of range (have {len(node)})")
            node[index] = value
        else:
            node[last] = value
    return raw


def _json_default(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value):
        return _to_plain(value)
    raise TypeError(f"cannot serialise {value!r}")


# Files ---------------------------------------------------------------------------------


def load_raw_config(path: str) -> dict[str, Any]:
    """Read a config file: a PBG Python file, YAML, or JSON (by extension).

    Python files are executed, exactly as PBG does, so this is only ever called on a
    path the user passed on the command line.
    """
    from storage_adapters import read_text

    lower = path.lower()
    try:
        if lower.endswith(".py"):
            return _load_python_config(path)
        text = read_text(path)
    except FileNotFoundError:
        raise ConfigError(f"config file {path}: not found") from None
    if lower.endswith(".json"):
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError(f"config file {path}: invalid JSON at line {err.lineno}: {err.msg}") from None
    else:
        import yaml

        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark is not None else ""
            raise ConfigError(f"config file {path}: invalid YAML{where}: {getattr(err, 'problem', err)}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path}: expected a mapping of config keys, got {type(raw).__name__}")
    return raw


def _load_python_config(path: str) -> dict[str, Any]:
    import os

    if not os.path.exists(path):
        raise FileNotFoundError(path)
    module_name = f"biggraph_user_config_{abs(hash(path))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"config file {path}: cannot be loaded as Python")
    module = importlib.util.module_from_spec(spec)
    # Registered so that classes defined in the config can be pickled to Hogwild workers.
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as err:
        raise ConfigError(f"config file {path}: Python syntax error at line {err.lineno}: {err.msg}") from None
    getter = getattr(module, "get_torchbiggraph_config", None)
    if getter is None:
        raise ConfigError(f"config file {path}: defines no get_torchbiggraph_config() function")
    raw = getter()
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path}: get_torchbiggraph_config() returned {type(raw).__name__}, not a dict")
    return raw


def load_config(path: str, overrides: list[str] | None = None) -> ConfigSchema:
    """Load, override and validate a config file."""
    raw = load_raw_config(path)
    if overrides:
        raw = apply_overrides(raw, overrides)
    try:
        return parse_config(raw)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None


def config_help() -> str:
    """Every key with its type, default and help text (``biggraph config-help``)."""
    lines: list[str] = []
    for cls, prefix in ((ConfigSchema, ""), (EntitySchema, "entities.<type>."), (RelationSchema, "relations[i].")):
        hints = _hints(cls)
        for f in dataclasses.fields(cls):
            if f.default is not MISSING:
                default = _to_plain(f.default)
                default_text = json.dumps(default)
            elif f.default_factory is not MISSING:
                default_text = json.dumps(f.default_factory())
            else:
                default_text = "(required)"
            lines.append(f"{prefix}{f.name}  [{_type_name(hints[f.name])}]  default: {default_text}")
            lines.append(f"    {f.metadata.get('help', '')}")
    return "\n".join(lines)
