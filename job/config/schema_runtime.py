"""The run-time keys of ``ConfigSchema``: PBG's distributed options and biggraph's own additions.

One of three groups of keys ``job.config.schema.ConfigSchema`` inherits (split by concern).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from job.config.base import field_help
from job.config.choices import GROW_NUM_EPOCHS_DEFAULT


@dataclass(kw_only=True)
class RuntimeKeys:
    """Where and with what resources it runs: machines, GPUs, precision, memory, storage, monitoring, growing."""

    # distributed training config options
    num_machines: int = field_help("The number of machines for distributed training (PBG; torchrun decides here).", default=1)
    num_partition_servers: int = field_help(
        "If -1, use trainer as partition servers. If 0, don't use partition servers (PBG; accepted).", default=-1
    )
    distributed_init_method: str | None = field_help(
        "A URI defining how to synchronize all the workers of a distributed run (PBG; torchrun replaces it).",
        default=None,
    )
    distributed_tree_init_order: bool = field_help(
        "If enabled, distributed training can occur on a bucket only if at least one of its partitions was "
        "already trained on before in the same round (or if one of its partitions is 0, for bootstrapping).",
        default=True,
    )
    num_gpus: int = field_help("Number of GPUs to use for GPU training (0 trains on the CPU).", default=0)
    num_groups_for_partition_server: int = field_help(
        "Number of td.distributed 'groups' to use for the partition server (PBG; accepted).", default=16
    )
    num_groups_per_sharded_partition_server: int = field_help(
        "Number of groups per sharded partition server (PBG; accepted).", default=1
    )
    partition_shard_size: int = field_help("Size of partition shards (PBG; accepted).", default=250)
    half_precision: bool = field_help(
        "Use half-precision training (GPU only). On a GPU it means compute_dtype 'bfloat16' (or 'float16' on "
        "a card without bfloat16) unless compute_dtype is set; on the CPU it is ignored with a warning.",
        default=False,
    )
    compute_dtype: str | None = field_help(
        "The precision of the training step's scores and matrix products: 'float32', 'bfloat16' (CPUs with "
        "AVX512-BF16/AMX, GPUs from Ampere on), 'float16' (GPUs; CPUs with AVX512-FP16/AMX-FP16) or 'auto' "
        "(bfloat16 where the device has native kernels for it, else float32; preset: quality sets it). The "
        "embeddings, their gradients, the loss and the Adagrad state stay float32, and evaluation scores in "
        "float32. null: float32, or half_precision's choice on a GPU. A device that cannot compute in the "
        "dtype is a config error.",
        default=None,
    )

    # biggraph additions
    seed: int | None = field_help(
        "Seed for every random choice (initialisation, shuffling, negatives, bucket order); with workers=1 two "
        "runs with the same seed give the same embeddings.",
        default=None,
    )
    device: str = field_help(
        "Where to compute: 'auto' (CUDA when num_gpus > 0), 'cpu' or 'cuda'.", default="auto"
    )
    prefetch_partitions: bool = field_help(
        "While a bucket trains, a background thread writes back the partition the next bucket evicts (when the "
        "current one does not use it) and reads the one it needs into the freed room: the same loads, within the "
        "partition buffer, without the wait. Distributed runs (torchrun): the lock server reserves a trainer's next "
        "bucket when it starts one (only if that leaves the other trainers work) and the trainer reads its missing "
        "partitions within the buffer meanwhile, and writes back the partitions the bucket does not use (their "
        "locks are released once stored). false: every swap waits, as in PBG.",
        default=True,
    )
    partition_handoff: bool = field_help(
        "Distributed runs (torchrun): a trainer keeps the partitions it has just written back in memory (two "
        "buckets' at most; under memory_budget, as many as the buffer's room holds beside the bucket's and the "
        "next one's), the lock server names it in the grant of the next bucket that needs one, and that trainer "
        "takes the rows from there (its own memory, or over TCP from the other pod, authenticated with the "
        "group's secret and checked against a digest) instead of downloading the file. Partitions are still "
        "written to checkpoint storage as before, so a lost pod costs the same; a failed hand-off reads the file. "
        "Each trainer listens on one more ephemeral port for it (the chart's NetworkPolicy admits the release's "
        "pods). false: every partition that changes hands is read back from storage.",
        default=True,
    )
    write_behind_buckets: int = field_help(
        "Distributed runs with partition_handoff: 0 writes every partition that changes hands to checkpoint "
        "storage before its release (write groups; a lost pod costs only its own unsaved buckets). N > 0: a "
        "partition is handed to its next holder unwritten, and storage receives partitions only at cuts of the "
        "whole group, every N buckets done (taken in the background: the group trains on while each pod stages its "
        "part at its next bucket switch) and at the pass's end (the group waits for that one); -1: only at the "
        "pass's end (one checkpoint's bytes per epoch). A lost pod then costs the whole group's buckets since the "
        "last recorded cut; a pod leaving in order "
        "(SIGTERM: deleted, evicted, scaled down, a re-formation) makes the group take a cut first, within the drain "
        "window (BIGGRAPH_DRAIN_TIMEOUT), so nothing done is redone. Kept rows are never dropped before a cut stores "
        "them; with memory_budget a cut comes early enough that they fit in it (without one they are not bounded).",
        default=0,
    )
    write_behind_seconds: float = field_help(
        "With write_behind_buckets (N > 0 or -1): a cut in the background also once this many seconds passed since "
        "the last cut began, whichever comes first; 0: cuts by buckets alone. What a lost pod costs with writes "
        "behind is the group's work since the last cut, so this bounds it in time (N buckets are minutes of one "
        "graph and hours of another); a pass shorter than it still writes one checkpoint's bytes (with -1), a "
        "longer one a checkpoint's more per cut.",
        default=0.0,
    )
    shared_shards: bool = field_help(
        "Distributed runs with write_behind_buckets and dynamic_relations: every pod serves a slice of the shared "
        "relation parameters (relation r on pod r mod the group's size, with their Adagrad sums), as PBG's "
        "parameter servers do, instead of rank 0 serving all of them: a bucket's changed rows go to the pods that "
        "serve them and its pulled rows come from there, so rank 0's network link carries about 1/pods of those "
        "bytes. Each pod listens on one more ephemeral port (authenticated with the group's secret, like the "
        "partition hand-off). What is persisted and how a restart resumes do not change: rank 0 writes the shards' "
        "saved rows into the one stored vector with each cut's record. false: rank 0 serves every row.",
        default=False,
    )
    partition_buffer: int | None = field_help(
        "How many partitions (of the partitioned entity types, per partition index) stay in memory, >= 2. "
        "Partitions leave the buffer only when it is full, the one needed again latest first. Default: what "
        "memory_budget allows, else 3 with prefetch_partitions (the bucket's two plus room for the next to "
        "arrive) and 2 without (PBG: the current bucket only). Distributed trainers keep only the current "
        "bucket's partitions (the others may need the rest); the buffer bounds those plus the next bucket's "
        "read ahead (prefetch_partitions).",
        default=None,
    )
    memory_budget: str | None = field_help(
        "The memory the whole trainer (its process, its Hogwild workers and the fork server they start from) may "
        "use, e.g. '8GiB' (a container's limit), '500MB' or a number of bytes. partition_buffer follows from it: "
        "what is left after the processes' own memory (measured at start), the unpartitioned types, one partition in flight at a "
        "swap, for a checkpoint on S3, the transfers' buffers (8 uploads of a 16 MiB part, 2 reads of 2) and, in a "
        "torchrun group, the shared parameters' sync copies and copies of the partitions a write group keeps (a "
        "bucket's less one). The trainer says at start what it will hold and why.",
        default=None,
    )
    cuda_graphs: bool = field_help(
        "On a GPU, record each relation's full-size training batch as a CUDA graph once and replay it (the "
        "same arithmetic with a fraction of the launch overhead); false runs every batch eagerly.",
        default=True,
    )
    edge_read_mode: str = field_help(
        "How edge files on object stores are read: 'stage' (download each bucket file to a local cache first) "
        "or 'stream' (HDF5 over a remote file object with a large read-ahead).",
        default="stage",
    )
    storage_options: dict[str, Any] = field_help(
        "Extra keyword arguments for the fsspec filesystem of every URL (e.g. {'endpoint_url': ...} for "
        "MinIO/Ceph, or a profile name). Credentials belong in the environment, not here.",
        default_factory=dict,
    )
    tensorboard_dir: str | None = field_help(
        "If set, a directory (local path) where TensorBoard scalars are written: loss, eval MRR/Hits, edges/s "
        "and swap time per bucket, and per pass (needs the 'tensorboard' extra: pip install 'biggraph[tensorboard]').",
        default=None,
    )
    pushgateway_url: str | None = field_help(
        "If set, the URL of a Prometheus Pushgateway (e.g. http://pushgateway:9091) to which every trainer pushes "
        "its metrics at the end of each pass; a failed push is logged as a warning and never stops training.",
        default=None,
    )
    pushgateway_job: str = field_help(
        "The job label of the Pushgateway grouping key ({pushgateway_url}/metrics/job/{job}/instance/{rank}).",
        default="biggraph",
    )
    reciprocal_relations: bool = field_help(
        "Train each static relation type r in one direction plus an inverse relation type: an edge (h, r, t) "
        "trains 'predict t from (h, r)', scored c(g_r(h), t'), and 'predict h from (t, r_inv)', scored "
        "c(h_r(t), h'), so each side's candidates are plain rows and only the query is transformed. Evaluation "
        "ranks the lhs side through the inverse. g_r is stored as relations/<i>/operator/lhs/*, h_r as PBG's "
        "relations/<i>/operator/rhs/* (PBG 1.0.0 reads the checkpoint, ignoring g_r). Dynamic relations are "
        "scored this way already.",
        default=False,
    )
    embedding_dropout: float = field_help(
        "Dropout on the query side of reciprocal scoring while training (never in evaluation): each query's "
        "entity row and its own copy of the relation operator's parameters are dropped out with this "
        "probability, as LibKGE trains ComplEx. The candidates and the rows the regularizer reads stay whole. "
        "In [0, 1); 0 (the default) turns it off. Needs reciprocal_relations or dynamic_relations (PBG's static "
        "scoring has no query side). See docs/quality-preset.md.",
        default=0.0,
    )
    init_method: str = field_help(
        "How fresh embeddings are drawn: 'normal' (PBG's: standard deviation init_scale) or 'xavier' (Glorot's "
        "normal by fan: standard deviation sqrt(2 / (entities of the type + dimension)), the type's count over "
        "all its partitions; init_scale is then unused).",
        default="normal",
    )
    preset: str | None = field_help(
        "A named set of defaults for keys the config leaves out (keys it sets win): 'quality' is the 1-vs-all "
        "recipe of docs/quality-preset.md (reciprocal relations, all_negs, softmax, Xavier init, PBG's "
        "Adagrad at lr 0.3), for entity types of up to a few tens of thousands of entities; 'quality_sampled' "
        "is the same recipe with sampled negatives (4000 uniform + 50 batch per chunk of 50), for larger "
        "types, where all_negs costs every batch a product with the whole table. The keys each sets are "
        "listed there. Applied when the config is read; the checkpoint's metadata (model.h5 config/json) "
        "records the expanded keys.",
        default=None,
    )
    grow_init: str = field_help(
        "How `biggraph grow` initialises the rows of new entities: 'random' (normal with standard deviation "
        "init_scale, as a fresh run does) or 'neighbours' (the mean of the trained embeddings of the entities "
        "each one is linked to by the new edges, mapped through the relation operator; entities reached only "
        "through other new entities are filled in later rounds, and those with no trained neighbour at all "
        "start at random).",
        default="neighbours",
    )
    grow_num_epochs: int = field_help(
        "How many passes over the new edges (plus the replayed old ones) `biggraph grow` trains after it has "
        "committed the grown checkpoint; 0 only grows the checkpoint.",
        default=GROW_NUM_EPOCHS_DEFAULT,
    )
    grow_replay_fraction: float = field_help(
        "The fraction of the old edges that each pass of `biggraph grow`'s training replays beside the new ones "
        "(a fresh uniform sample per pass and bucket, read from the same edge files: no second copy), so that "
        "old embeddings keep fitting the old graph; 0 trains on the new edges only, 1 on all edges.",
        default=0.1,
    )
