"""The checks ``ConfigSchema.__post_init__`` runs: impossible values and combinations, by name.

Each check raises a ``ConfigKeyError`` naming the keys involved, so a typo in the config of a
multi-hour job fails in the first second, and ``load_config`` can tell whether a ``-p``
override or the file is to blame. ``validate_config`` runs them in a fixed order: a config with
several faults always reports the same one first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from job.config.base import ConfigKeyError
from job.config.choices import DURA_OPERATORS, KEY_CHOICES
from job.config.presets import PRESETS

if TYPE_CHECKING:  # schema.py imports this module to run the checks
    from job.config.schema import ConfigSchema

POSITIVE_INTS = ("dimension", "batch_size", "num_epochs", "max_edges_per_chunk", "validation_interval",
                 "early_stopping_patience", "lr_plateau_patience")
NON_NEGATIVE_INTS = ("num_batch_negs", "num_uniform_negs", "eval_num_batch_negs", "eval_num_uniform_negs", "num_gpus")


def check_required_lists(config: ConfigSchema) -> None:
    """A config trains nothing without edges, entity types and relation types."""
    if not config.edge_paths:
        raise ConfigKeyError("config key 'edge_paths': must list at least one directory", ["edge_paths"])
    if not config.entities:
        raise ConfigKeyError("config key 'entities' must define at least one entity type", ["entities"])
    if not config.relations:
        raise ConfigKeyError("config key 'relations' must define at least one relation type", ["relations"])


def check_relation_entity_types(config: ConfigSchema) -> None:
    """Both sides of every relation name a defined entity type."""
    for rel_idx, relation in enumerate(config.relations):
        for side in ("lhs", "rhs"):
            entity_type = getattr(relation, side)
            if entity_type not in config.entities:
                raise ConfigKeyError(
                    f"config key 'relations[{rel_idx}].{side}': relation '{relation.name}' names unknown "
                    f"entity type '{entity_type}' (known: {', '.join(sorted(config.entities))})",
                    [f"relations.{rel_idx}.{side}", "entities"],
                )


def check_partition_counts(config: ConfigSchema) -> None:
    """Partitioned entity types share one partition count (buckets range over it)."""
    partition_counts = {e.num_partitions for e in config.entities.values()} - {1}
    if len(partition_counts) > 1:
        detail = ", ".join(f"{name}={e.num_partitions}" for name, e in config.entities.items())
        raise ConfigKeyError(
            f"config key 'entities.*.num_partitions': partition counts are not broadcastable ({detail}); "
            "every partitioned entity type must have the same number of partitions",
            ["entities.*.num_partitions"],
        )


def check_dynamic_relations(config: ConfigSchema) -> None:
    """Dynamic relations share one relation type's parameters, as in PBG."""
    if config.dynamic_relations and len(config.relations) != 1:
        raise ConfigKeyError(
            "config key 'relations': with dynamic_relations exactly one relation type must be defined "
            f"(got {len(config.relations)})",
            ["relations", "dynamic_relations"],
        )


def check_negative_sides(config: ConfigSchema) -> None:
    """At least one side must be corrupted, or there are no negatives to rank against."""
    if config.disable_lhs_negs and config.disable_rhs_negs:
        raise ConfigKeyError(
            "config keys 'disable_lhs_negs' and 'disable_rhs_negs': cannot disable both sides",
            ["disable_lhs_negs", "disable_rhs_negs"],
        )


def check_choices(config: ConfigSchema) -> None:
    """Keys taking one of a closed set of names (the tuples of ``job.config.choices``)."""
    for name, choices in KEY_CHOICES.items():
        value = getattr(config, name)
        if value not in choices and not (name == "compute_dtype" and value is None):
            raise ConfigKeyError(
                f"config key '{name}': unknown value '{value}' (expected one of {', '.join(choices)})", [name]
            )


def check_preset(config: ConfigSchema) -> None:
    """A preset is one of the named ones (``job.config.presets``)."""
    if config.preset is not None and config.preset not in PRESETS:
        raise ConfigKeyError(
            f"config key 'preset': unknown preset '{config.preset}' (expected one of {', '.join(PRESETS)})",
            ["preset"],
        )


def check_ranges(config: ConfigSchema) -> None:
    """Single keys whose value must lie in a range."""
    def fail(name: str, message: str, keys: tuple[str, ...] = ()) -> None:
        raise ConfigKeyError(message, keys or (name,))

    if not 0.0 <= config.grow_replay_fraction <= 1.0:
        fail("grow_replay_fraction",
             f"config key 'grow_replay_fraction': must be in [0, 1], got {config.grow_replay_fraction}")
    if config.partition_buffer is not None and config.partition_buffer < 2:
        fail("partition_buffer",
             f"config key 'partition_buffer': a bucket needs two partitions, got {config.partition_buffer}")
    if config.write_behind_buckets != 0 and (config.write_behind_buckets < -1 or not config.partition_handoff):
        fail("write_behind_buckets", "config key 'write_behind_buckets': 0 (off), N > 0 or -1, and only with "
             f"partition_handoff: true; got {config.write_behind_buckets} with partition_handoff "
             f"{str(config.partition_handoff).lower()}")
    if config.write_behind_seconds < 0 or (config.write_behind_seconds > 0 and config.write_behind_buckets == 0):
        fail("write_behind_seconds", "config key 'write_behind_seconds': seconds between cuts, >= 0, and only with "
             f"write_behind_buckets N > 0 or -1; got {config.write_behind_seconds:g} with write_behind_buckets "
             f"{config.write_behind_buckets}")
    if config.shared_shards and (config.write_behind_buckets == 0 or not config.dynamic_relations):
        fail("shared_shards", "config key 'shared_shards': only with write_behind_buckets (N > 0 or -1) and "
             f"dynamic_relations: true; got write_behind_buckets {config.write_behind_buckets} and dynamic_relations "
             f"{str(config.dynamic_relations).lower()}", ("shared_shards", "write_behind_buckets", "dynamic_relations"))
    if config.hogwild_delay < 0:
        fail("hogwild_delay", f"config key 'hogwild_delay': seconds, must be >= 0, got {config.hogwild_delay}")
    if config.grow_num_epochs < 0:
        fail("grow_num_epochs", f"config key 'grow_num_epochs': must be >= 0, got {config.grow_num_epochs}")
    for name in POSITIVE_INTS:
        if getattr(config, name) < 1:
            fail(name, f"config key '{name}': must be a positive integer, got {getattr(config, name)}")
    for name in NON_NEGATIVE_INTS:
        if getattr(config, name) < 0:
            fail(name, f"config key '{name}': must be >= 0, got {getattr(config, name)}")
    if config.num_edge_chunks is not None and config.num_edge_chunks < 1:
        fail("num_edge_chunks",
             f"config key 'num_edge_chunks': must be a positive integer, got {config.num_edge_chunks}")
    if config.workers is not None and config.workers < 1:
        fail("workers", f"config key 'workers': must be a positive integer, got {config.workers}")
    if not 0.0 <= config.eval_fraction < 1.0:
        fail("eval_fraction", f"config key 'eval_fraction': must be in [0, 1), got {config.eval_fraction}")
    if config.lr <= 0 or (config.relation_lr is not None and config.relation_lr <= 0):
        fail("lr", "config keys 'lr'/'relation_lr': learning rates must be positive", ("lr", "relation_lr"))
    if config.checkpoint_preservation_interval is not None and config.checkpoint_preservation_interval < 1:
        fail("checkpoint_preservation_interval",
             "config key 'checkpoint_preservation_interval': must be a positive integer")
    if not 0.0 <= config.embedding_dropout < 1.0:
        fail("embedding_dropout",
             f"config key 'embedding_dropout': a dropout probability, must be in [0, 1), got {config.embedding_dropout}")
    if config.max_norm is not None and config.max_norm <= 0:
        fail("max_norm", f"config key 'max_norm': must be positive, got {config.max_norm}")
    if not 0.0 <= config.lr_decay <= 1.0:
        fail("lr_decay", f"config key 'lr_decay': a factor per epoch, must be in [0, 1] (1: off), got {config.lr_decay}")
    if not 0.0 < config.lr_plateau_factor <= 1.0:
        fail("lr_plateau_factor",
             f"config key 'lr_plateau_factor': a factor per plateau, must be in (0, 1] (1: off), got "
             f"{config.lr_plateau_factor}")
    if not 0.0 <= config.label_smoothing < 1.0:
        fail("label_smoothing",
             f"config key 'label_smoothing': must be in [0, 1) (0: off), got {config.label_smoothing}")


def check_entity_dimensions(config: ConfigSchema) -> None:
    """The relation operators need one dimension for all entity types."""
    for name, entity in config.entities.items():
        dim = entity.dimension or config.dimension
        if dim != config.dimension:
            raise ConfigKeyError(
                f"config key 'entities.{name}.dimension': per-type dimensions differing from 'dimension' "
                "are not supported by the relation operators",
                [f"entities.{name}.dimension", "dimension"],
            )


def check_relation_options(config: ConfigSchema) -> None:
    """Per-relation options that depend on the entity types or the dimension."""
    for rel_idx, relation in enumerate(config.relations):
        if relation.all_negs and (config.entities[relation.lhs].featurized or
                                  config.entities[relation.rhs].featurized):
            raise ConfigKeyError(
                f"config key 'relations[{rel_idx}].all_negs': featurized entity types cannot list all their "
                "entities (PBG has the same limit)",
                [f"relations.{rel_idx}.all_negs", f"entities.{relation.lhs}.featurized",
                 f"entities.{relation.rhs}.featurized"],
            )
        if relation.operator == "complex_diagonal" and config.dimension % 2:
            raise ConfigKeyError(
                f"config key 'relations[{rel_idx}].operator': complex_diagonal needs an even dimension, "
                f"got {config.dimension}",
                [f"relations.{rel_idx}.operator", "dimension"],
            )


def check_model_combinations(config: ConfigSchema) -> None:
    """Combinations of model keys that cannot train."""
    if config.bias and config.dimension < 2:
        raise ConfigKeyError("config key 'bias': needs dimension >= 2 (the first dimension becomes the bias)",
                             ["bias", "dimension"])
    if config.num_batch_negs > 0 and config.batch_size % config.num_batch_negs != 0:
        raise ConfigKeyError(
            f"config key 'batch_size': {config.batch_size} must be a multiple of num_batch_negs "
            f"({config.num_batch_negs})",
            ["batch_size", "num_batch_negs"],
        )
    if config.embedding_dropout > 0 and not (config.reciprocal_relations or config.dynamic_relations):
        raise ConfigKeyError(
            "config key 'embedding_dropout': drops out the query side of reciprocal scoring; set "
            "reciprocal_relations true (or use dynamic_relations), or embedding_dropout 0",
            ["embedding_dropout", "reciprocal_relations"],
        )
    if config.dynamic_relations and config.global_emb:
        raise ConfigKeyError(
            "config key 'global_emb': per-type global embeddings cannot be used with dynamic_relations "
            "(set global_emb=False, as PBG's dynamic-relation examples do)",
            ["global_emb", "dynamic_relations"],
        )


def check_regularizer(config: ConfigSchema) -> None:
    """DURA penalises both sides of a bilinear score <L_r q, t> = <q, L_r^T t>: only the dot comparator and
    operators without an additive term have that form (``job.model.regularizers``)."""
    if config.regularizer != "DURA" or config.regularization_coef <= 0:
        return
    if config.comparator != "dot":
        raise ConfigKeyError(
            f"config key 'comparator': regularizer DURA needs comparator 'dot' (a bilinear score), got "
            f"'{config.comparator}'; use regularizer N3 or set regularization_coef 0",
            ["comparator", "regularizer"],
        )
    for rel_idx, relation in enumerate(config.relations):
        if relation.operator not in DURA_OPERATORS:
            raise ConfigKeyError(
                f"config key 'relations[{rel_idx}].operator': regularizer DURA is defined for the bilinear "
                f"operators ({', '.join(DURA_OPERATORS)}), not '{relation.operator}' (its additive term has no "
                "duality to penalise); use regularizer N3 or set regularization_coef 0",
                [f"relations.{rel_idx}.operator", "regularizer"],
            )


def check_eval_protocol(config: ConfigSchema) -> None:
    """The corrected protocols rank rows; a featurized type's entities are bags of features, not rows."""
    featurized = sorted({t for r in config.relations for t in (r.lhs, r.rhs) if config.entities[t].featurized})
    if config.eval_protocol in ("all", "sampled") and featurized:
        raise ConfigKeyError(
            f"config key 'eval_protocol': '{config.eval_protocol}' cannot rank featurized entity types "
            f"({', '.join(featurized)}); use 'pbg' or 'auto' (which picks 'pbg' for them)",
            ["eval_protocol"] + [f"entities.{t}.featurized" for t in featurized],
        )


def check_validation(config: ConfigSchema) -> None:
    """Validation during training: its filter needs validation edges and rows to rank (all candidates)."""
    if config.validation_filter_paths and not config.validation_edge_paths:
        raise ConfigKeyError("config key 'validation_filter_paths': set without validation_edge_paths (nothing to "
                             "validate)", ["validation_filter_paths", "validation_edge_paths"])
    if config.validation_filter_paths and not config.validation_filtered:
        raise ConfigKeyError("config key 'validation_filter_paths': set with validation_filtered false (raw ranks "
                             "use no filter)", ["validation_filter_paths", "validation_filtered"])
    featurized = sorted({t for r in config.relations for t in (r.lhs, r.rhs) if config.entities[t].featurized})
    if config.validation_edge_paths and config.validation_filtered and featurized:
        raise ConfigKeyError(
            "config key 'validation_filtered': filtered ranks are against every entity, which featurized entity "
            f"types ({', '.join(featurized)}) cannot list; set validation_filtered false (eval_protocol 'pbg')",
            ["validation_filtered"] + [f"entities.{t}.featurized" for t in featurized],
        )


def check_schedule(config: ConfigSchema) -> None:
    """The plateau schedule follows the validation MRR, and must get the chance to act before early stopping."""
    if config.lr_plateau_factor >= 1.0:
        return
    if not config.validation_edge_paths:
        raise ConfigKeyError(
            "config key 'lr_plateau_factor': reduces the learning rate when the validation MRR stops improving, "
            "which needs validation_edge_paths (none set); set them, or lr_plateau_factor 1",
            ["lr_plateau_factor", "validation_edge_paths"],
        )
    if config.early_stopping and config.early_stopping_patience <= config.lr_plateau_patience:
        raise ConfigKeyError(
            f"config key 'lr_plateau_patience': {config.lr_plateau_patience} validations without improvement "
            f"reduce the rate, but early_stopping ends the run after {config.early_stopping_patience}; set "
            "lr_plateau_patience below early_stopping_patience",
            ["lr_plateau_patience", "early_stopping_patience"],
        )


def check_label_smoothing(config: ConfigSchema) -> None:
    """Label smoothing is defined for the 1-vs-all softmax, where the candidates are every entity: with sampled
    negatives the candidates are a sample (drawn with repeats and weights), over which a uniform target means
    something else."""
    if config.label_smoothing <= 0:
        return
    if config.loss_fn != "softmax":
        raise ConfigKeyError(
            f"config key 'label_smoothing': smooths the softmax loss's target, but loss_fn is '{config.loss_fn}'; "
            "set loss_fn softmax, or label_smoothing 0", ["label_smoothing", "loss_fn"],
        )
    for rel_idx, relation in enumerate(config.relations):
        if not relation.all_negs:
            raise ConfigKeyError(
                f"config key 'relations[{rel_idx}].all_negs': label_smoothing spreads its mass over every entity, "
                f"which needs 1-vs-all training (all_negs true; relation '{relation.name}' samples its negatives); "
                "set all_negs true (preset: quality), or label_smoothing 0",
                [f"relations.{rel_idx}.all_negs", "label_smoothing"],
            )


CHECKS: tuple[Callable[[ConfigSchema], None], ...] = (
    check_required_lists,
    check_relation_entity_types,
    check_partition_counts,
    check_dynamic_relations,
    check_negative_sides,
    check_choices,
    check_preset,
    check_ranges,
    check_entity_dimensions,
    check_relation_options,
    check_model_combinations,
    check_regularizer,
    check_eval_protocol,
    check_validation,
    check_schedule,
    check_label_smoothing,
)


def validate_config(config: ConfigSchema) -> None:
    """Run every check, in order; the first failing one raises."""
    for check in CHECKS:
        check(config)
