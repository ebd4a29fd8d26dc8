"""Which ranking protocol a metric was computed with, which one ``auto`` picks, and how it is labelled.

A rank means little without its protocol: PBG's sampled ranks (1,000 uniform draws with replacement plus the
batch's other positives, every draw counted, ties against the positive) exceed the number of entities on a
graph smaller than the draws (mean rank 179.5 on UMLS's 135 entities), while ranks against every entity
are bounded by it. So every metric biggraph prints or records carries its protocol (``protocol`` and
``filtered`` beside ``metrics`` in training_stats.json, in ``biggraph eval --json``), and every label here
says both the candidates (all / sampled / sampled as PBG) and raw or filtered.

Torch-free: the report reads these labels without loading the trainer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from job.config.choices import EVAL_PROTOCOLS

# what ranked eval stats recorded before protocols were recorded used: PBG's protocol was the only one
LEGACY_PROTOCOL = "pbg"

_CANDIDATES = {
    "all": "all candidates",
    "sampled": "sampled candidates",
    "pbg": "sampled as PBG",
}


def sampling_draws(config: Any) -> int:
    """The candidates a sampled rank draws per positive: the chunk's positives plus the uniform draws."""
    return int(config.eval_num_batch_negs) + int(config.eval_num_uniform_negs)


def has_featurized_sides(config: Any) -> bool:
    return any(config.entities[t].featurized for r in config.relations for t in (r.lhs, r.rhs))


def resolve_protocol(requested: str, config: Any, candidate_count: int) -> str:
    """The protocol ``requested`` (one of ``EVAL_PROTOCOLS``) means when the largest set of candidates a side
    is ranked against has ``candidate_count`` entities.

    ``auto`` ranks against every candidate when there are no more of them than a sampled rank would draw
    (then all candidates cost no more than sampling, and sampling could only repeat them), and samples
    otherwise; featurized types (bags of features, not rows) keep PBG's protocol.
    """
    if requested not in EVAL_PROTOCOLS:
        raise ValueError(f"unknown eval protocol {requested!r} (expected one of {', '.join(EVAL_PROTOCOLS)})")
    if requested != "auto":
        return requested
    if has_featurized_sides(config):
        return "pbg"
    return "all" if candidate_count <= sampling_draws(config) else "sampled"


def corrupted_types(config: Any) -> set[str]:
    """Entity types whose entities are candidates (the sides whose negatives are not disabled)."""
    types: set[str] = set()
    for relation in config.relations:
        if not config.disable_lhs_negs:
            types.add(relation.lhs)
        if not config.disable_rhs_negs:
            types.add(relation.rhs)
    return types


def largest_partition(config: Any, counts: Mapping[str, Iterable[int]]) -> int:
    """The most rows a bucket's side is ranked against (in-training evaluation works within a bucket)."""
    return max((int(c) for t in corrupted_types(config) for c in counts.get(t, [])), default=0)


def largest_type(config: Any, counts: Mapping[str, Iterable[int]]) -> int:
    """The most entities a side is ranked against across all partitions (``biggraph eval --candidates all``)."""
    return max((sum(int(c) for c in counts.get(t, [])) for t in corrupted_types(config)), default=0)


def protocol_label(protocol: str, filtered: bool = False) -> str:
    """``"all candidates, filtered"``, ``"sampled candidates, raw"``, ``"sampled as PBG, raw"``."""
    return f"{_CANDIDATES.get(protocol, protocol)}, {'filtered' if filtered else 'raw'}"


def protocol_fields(protocol: str, filtered: bool = False) -> dict[str, Any]:
    """What a metrics record carries beside its numbers."""
    return {"protocol": protocol, "filtered": filtered}


def recorded_label(entry: Mapping[str, Any], legacy: str | None = LEGACY_PROTOCOL) -> str:
    """The label of a recorded metrics entry. Without a ``protocol`` field: ``legacy`` (held-out stats in
    training_stats.json were always PBG's before protocols were recorded), or "protocol not recorded" when
    None (an old ``biggraph eval --json`` file may hold any of them)."""
    protocol = entry.get("protocol", legacy)
    if protocol is None:
        return "protocol not recorded"
    return protocol_label(str(protocol), bool(entry.get("filtered", False)))
