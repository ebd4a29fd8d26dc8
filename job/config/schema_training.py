"""The training loop's keys of ``ConfigSchema`` (PBG's "training config" and "expert options" sections).

One of three groups of keys ``job.config.schema.ConfigSchema`` inherits (split by concern).
"""

from __future__ import annotations

from dataclasses import dataclass

from job.config.base import field_help
from job.config.choices import BucketOrder


@dataclass(kw_only=True)
class TrainingKeys:
    """How training runs: epochs, buckets, batches, negatives, learning rates, evaluation and validation."""

    # training config
    num_epochs: int = field_help("The number of times the training loop iterates over all the edges.", default=1)
    num_edge_chunks: int | None = field_help(
        "The number of equally-sized parts each bucket will be split into. Training "
        "first proceeds over all the first chunks of all buckets, then over all the "
        "second chunks, and so on. If not set, the minimal number of chunks such that "
        "each holds at most max_edges_per_chunk edges.",
        default=None,
    )
    max_edges_per_chunk: int = field_help(
        "The maximum number of edges in each edge chunk when num_edge_chunks is not set.",
        default=1_000_000_000,
    )
    bucket_order: BucketOrder = field_help(
        "The order in which to iterate over the buckets: random, affinity, inside_out or outside_in (PBG's), or "
        "buffer: an order close to the fewest partition loads for the partition buffer (partition_buffer - 1 "
        "partitions stay while the others pass through the last slot, the changes of group searched for fewer "
        "loads; each pass logs its loads against the lower bound; single-machine runs, other trainers walk "
        "inside_out).",
        default=BucketOrder.INSIDE_OUT,
    )
    workers: int | None = field_help(
        "The number of worker processes for Hogwild training. Defaults to the number of CPUs. Each bucket's "
        "edges are cut into this many slices, each trained in batches of batch_size (as PBG); on a GPU, or a "
        "bucket under two batches, the slices run one after another in one process.",
        default=None,
    )
    batch_size: int = field_help("The number of edges per batch.", default=1000)
    num_batch_negs: int = field_help(
        "The number of negatives sampled from the batch, per positive edge.", default=50
    )
    num_uniform_negs: int = field_help(
        "The number of negatives uniformly sampled from the currently active partition, per positive edge.",
        default=50,
    )
    disable_lhs_negs: bool = field_help("Disable negative sampling on the left-hand side.", default=False)
    disable_rhs_negs: bool = field_help("Disable negative sampling on the right-hand side.", default=False)
    lr: float = field_help("The learning rate for the optimizer.", default=1e-2)
    entity_optimizer: str = field_help(
        "The embeddings' optimizer. 'row_adagrad' (PBG's): Adagrad with one sum of mean squared gradients per "
        "row, 4 bytes of state per row. 'adagrad': a sum per coordinate, as Lacroix et al. and LibKGE train "
        "ComplEx; its state is as large as the embeddings (counted in memory_budget), saved in PBG's layout plus "
        "the per-coordinate sums (PBG loads the partition and resumes row-wise). Relation parameters always take "
        "per-coordinate Adagrad. See docs/quality-preset.md.",
        default="row_adagrad",
    )
    relation_lr: float | None = field_help(
        "If set, the learning rate for the optimizer for relations. Otherwise, `lr` is used.",
        default=None,
    )
    lr_decay: float = field_help(
        "A factor applied to lr and relation_lr after every epoch: epoch e (counted from 0) trains at "
        "lr * lr_decay^e, in every optimizer (the embeddings' row-wise or per-coordinate Adagrad, in every Hogwild "
        "worker and every trainer of a group, and the relations' Adagrad). In [0, 1]; 1 (the default, PBG's) keeps "
        "the rate constant. The rate follows from the epoch number, so a resumed run goes on at the decayed rate. "
        "See docs/quality-preset.md.",
        default=1.0,
    )
    lr_plateau_factor: float = field_help(
        "Multiply the learning rates (lr, relation_lr, on top of lr_decay) by this factor whenever "
        "lr_plateau_patience validations in a row have not beaten the best validation MRR so far (the metric "
        "early_stopping follows; needs validation_edge_paths); the count starts again after each reduction. In "
        "(0, 1]; 1 (the default) turns it off. Derived from the validation lines of training_stats.json, so a "
        "resumed run goes on at the reduced rate.",
        default=1.0,
    )
    lr_plateau_patience: int = field_help(
        "With lr_plateau_factor < 1: how many validations in a row without a better validation MRR reduce the "
        "learning rates. With early_stopping it must be below early_stopping_patience (or the run stops before "
        "any reduction).",
        default=2,
    )
    eval_fraction: float = field_help(
        "The fraction of edges withheld from training and used to track evaluation metrics during training.",
        default=0.05,
    )
    eval_num_batch_negs: int = field_help(
        "The value that overrides the number of negatives per positive edge sampled from the batch during the "
        "evaluation steps that occur before and after each training step.",
        default=1000,
    )
    eval_num_uniform_negs: int = field_help(
        "The value that overrides the number of uniformly-sampled negatives per positive edge during the "
        "evaluation steps that occur before and after each training step.",
        default=1000,
    )
    eval_protocol: str = field_help(
        "How held-out edges are ranked, in training (eval_fraction) and by `biggraph eval` (its --candidates "
        "wins): 'all' ranks each positive against every entity of the corrupted side's type (in training: of the "
        "bucket's partition); 'sampled' against the distinct entities among its chunk's eval_num_batch_negs "
        "positives and eval_num_uniform_negs uniform draws, the positive itself left out, so a rank never exceeds "
        "the candidates + 1; 'pbg' is PBG 1.0's protocol exactly (every draw counts, repeats and draws equal to "
        "the positive included: on a graph smaller than the draws ranks exceed the number of entities); 'auto' "
        "is 'all' when the corrupted type has no more entities than eval_num_batch_negs + eval_num_uniform_negs "
        "(never costlier than sampling), else 'sampled' ('pbg' for featurized types). Every printed metric "
        "names its protocol.",
        default="auto",
    )
    early_stopping: bool = field_help(
        "Stop training when the evaluation MRR stops improving from one epoch to the next. With "
        "validation_edge_paths it follows the validation MRR instead: training stops once "
        "early_stopping_patience validations in a row have not beaten the best one, and the best version is kept "
        "(checkpoint_path/best_version.txt names it; `biggraph eval --version best` reads it).",
        default=False,
    )
    early_stopping_patience: int = field_help(
        "With early_stopping and validation_edge_paths: how many validations in a row without a better validation "
        "MRR than the best so far stop training (1: the first one that does not improve, PBG's 'fell once'). "
        "Without validation edges, PBG's rule applies (stop when the in-training eval MRR falls).",
        default=1,
    )
    validation_edge_paths: list[str] = field_help(
        "Directories (paths or URLs) of validation edges, imported like edge_paths (the same entities, e.g. a "
        "dataset's valid split). Every validation_interval epochs the version just committed is read back and "
        "ranked on them (as `biggraph eval`: all candidates, filtered by validation_filtered); the result is a "
        "line of training_stats.json (epoch, version, MRR, Hits@1/10, protocol, seconds since training started), "
        "logged, drawn by `biggraph report`, and followed by early_stopping. The best-scoring version is kept "
        "(best_version.txt). Empty: no validation.",
        default_factory=list,
    )
    validation_interval: int = field_help(
        "Validate every so many epochs (and after the last epoch).", default=1
    )
    validation_filtered: bool = field_help(
        "Rank validation edges against all entities with the other known true edges removed from the candidates "
        "(the training edges of edge_paths, the validation edges and validation_filter_paths), as `biggraph eval "
        "--candidates all --filter ...` does; false ranks them raw under eval_protocol.",
        default=True,
    )
    validation_filter_paths: list[str] = field_help(
        "More directories of true edges removed from the validation candidates besides the training and validation "
        "edges (e.g. the test split, as in the standard filtered protocol); needs validation_filtered.",
        default_factory=list,
    )

    # expert options
    background_io: bool = field_help("Whether to do load/save in a background process (PBG; accepted).", default=False)
    verbose: int = field_help("The verbosity level of logging, currently 0 or 1.", default=0)
    hogwild_delay: float = field_help(
        "The number of seconds by which to delay the start of all 'Hogwild!' processes except the first one, "
        "on the first epoch, on the buckets hogwild_delay_scope names (meanwhile the workers already running take "
        "the held workers' batches, so the same batches run and one worker trains alone for those seconds; the "
        "trainer logs the cost; 0 skips it).",
        default=2.0,
    )
    hogwild_delay_scope: str = field_help(
        "Which buckets of epoch 0 hogwild_delay staggers: 'first_visit' (a bucket with a left or right partition "
        "this process trains for the first time in the run: fresh rows, where PBG's reason for the delay holds; "
        "on an unpartitioned graph the first bucket, as PBG; on a P x P grid at most 2P - 1 of its P x P buckets) "
        "or 'epoch_0' (PBG 1.0.0: every bucket of epoch 0, P x P per edge path and chunk).",
        default="first_visit",
    )
    dynamic_relations: bool = field_help(
        "If enabled, activates the dynamic relation mode, in which case, there must be a single relation type "
        "in the config (whose parameters will apply to all dynamic relations types) and there must be a file "
        "called dynamic_rel_count.txt in the entity path that contains the number of dynamic relations.",
        default=False,
    )
