"""Named sets of defaults (``preset: quality``), expanded into the raw config before it is parsed.

``quality`` is 1-vs-all (every entity a negative): best per epoch, but each batch scores against the whole
entity table, so an epoch costs ~entities x edges products; ``quality_sampled`` keeps the same model recipe
(reciprocal relations, Xavier init, softmax, lr 0.3) with PBG's sampled negatives, for graphs whose types
hold more than a few tens of thousands of entities (bench/RESULTS.md: on the 112k-entity WordNet KG one
epoch of ``quality`` took 877 s for filtered MRR 0.064, ten of ``quality_sampled`` 415 s for 0.077).

A preset only fills in keys the config leaves out, so a user can start from it and change any one key;
its expansion is what ``config.json`` records (together with the ``preset`` key itself, which then sets
nothing more). Relation-level keys are filled into every relation type that leaves them out.
docs/quality-preset.md documents each preset's keys and the experiments behind them; a test holds that
page to this table.
"""

from __future__ import annotations

from typing import Any

from job.config.base import ConfigKeyError

# the model recipe both quality presets share; they differ in how negatives are drawn (and N3, below).
_QUALITY_MODEL: dict[str, Any] = {
    "reciprocal_relations": True,
    "init_method": "xavier",
    "loss_fn": "softmax",
    "comparator": "dot",
    "global_emb": False,
    "lr": 0.3,
    # bfloat16 products where the CPU (AVX512-BF16/AMX) or GPU has them natively, else float32
    "compute_dtype": "auto",
    # PBG's 5% of the training edges held out for its sampled in-training metrics: a benchmark has its own
    # validation split, and those edges are worth more as training data
    "eval_fraction": 0.0,
}
# N3 on each batch's positives, relation parameters once per batch (issue #33, docs/quality-preset.md), with 1-vs-all
# only: at equal epochs WN18RR's valid MRR 0.437 -> 0.464 (30 epochs), Kinships 0.793 -> 0.850 and Nations 0.696 ->
# 0.740 (100 epochs), UMLS 0.866 -> 0.853 (100; ahead up to 50). 0.3 broke Kinships/Nations; the per-edge form is
# worse at every coefficient (our operators start at the identity). With sampled negatives it cost WN18RR valid MRR
# at 5 epochs (0.385 -> 0.310), so quality_sampled leaves it off.
_ALL_NEGS_REGULARIZER: dict[str, Any] = {"regularizer": "N3_shared_relations", "regularization_coef": 0.1}

# name -> (top-level keys, keys of every relation type)
PRESETS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "quality": (
        {**_QUALITY_MODEL, **_ALL_NEGS_REGULARIZER, "batch_size": 500, "num_batch_negs": 0, "num_uniform_negs": 0},
        {"all_negs": True},
    ),
    "quality_sampled": (
        {**_QUALITY_MODEL, "batch_size": 1000, "num_batch_negs": 50, "num_uniform_negs": 4000},
        {"all_negs": False},
    ),
}


def expand_preset(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` with its preset's defaults filled in (a copy; ``raw`` itself when it names no preset)."""
    name = raw.get("preset")
    if name is None:
        return raw
    if not isinstance(name, str) or name not in PRESETS:
        raise ConfigKeyError(
            f"config key 'preset': unknown preset {name!r} (expected one of {', '.join(PRESETS)})", ["preset"]
        )
    top, per_relation = PRESETS[name]
    out = dict(raw)
    for key, value in top.items():
        out.setdefault(key, value)
    relations = out.get("relations")
    if isinstance(relations, list):
        out["relations"] = [
            {**per_relation, **relation} if isinstance(relation, dict) else relation for relation in relations
        ]
    return out
