"""The trained model a grow starts from: its config, whether the grow's config fits it, and its grown model.h5.

The config a version was trained with is read from that version's own ``model.v{N}.h5`` (the
``config/json`` attribute every biggraph version carries), not from ``config.json``, which is not
versioned; a PBG-written checkpoint has only ``config.json``, which then serves.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch

from job.config import ConfigSchema, parse_config
from job.errors import ConfigError, UserError
from job.formats.checkpoint import CheckpointStorage
from job.model.scoring import Model
from job.train.batch.optim import RelationAdagrad


class GrowError(UserError):
    """A grow that cannot be done as asked (one line, exit 2, nothing written)."""


def committed_config(checkpoint: CheckpointStorage, metadata: dict[str, Any]) -> ConfigSchema:
    """The config the committed version was trained with."""
    text = metadata.get("config/json")
    try:
        raw = json.loads(text) if isinstance(text, str) and text else checkpoint.load_config_dict()
        return parse_config(raw)
    except (json.JSONDecodeError, ConfigError) as err:
        raise GrowError(f"--into {checkpoint.url}: the config it was trained with cannot be read ({err})") from None


def check_compatible(old: ConfigSchema, new: ConfigSchema, into: str) -> None:
    """Refuse a grow whose config would change the meaning of the trained rows or parameters.

    Growing only adds: entities (rows), relation types (after the old ones) and edges. Everything a
    trained row or operator depends on must be the same.
    """

    def refuse(what: str, there: Any, here: Any) -> None:
        raise GrowError(f"--into {into}: the checkpoint's config does not match this config: {what} is {there} there "
                        f"and {here} here (a grow keeps the trained model as it is; retrain to change it)")

    if old.dimension != new.dimension:
        refuse("dimension", old.dimension, new.dimension)
    if sorted(old.entities) != sorted(new.entities):
        refuse("the set of entity types", sorted(old.entities), sorted(new.entities))
    for name, entity in old.entities.items():
        other = new.entities[name]
        if entity.num_partitions != other.num_partitions:
            refuse(f"entities.{name}.num_partitions", entity.num_partitions, other.num_partitions)
        if entity.featurized or other.featurized:
            raise GrowError(f"entity type '{name}' is featurized: grow handles plain entities only (as import does)")
    for key in ("dynamic_relations", "reciprocal_relations", "comparator", "global_emb", "bias"):
        if getattr(old, key) != getattr(new, key):
            refuse(key, getattr(old, key), getattr(new, key))
    if len(new.relations) < len(old.relations):
        refuse("the number of relation types", len(old.relations), len(new.relations))
    for idx, (was, now) in enumerate(zip(old.relations, new.relations)):
        for key in ("name", "lhs", "rhs", "operator"):
            if getattr(was, key) != getattr(now, key):
                refuse(f"relations[{idx}].{key}", repr(getattr(was, key)), repr(getattr(now, key)))


def grown_model(
    old: ConfigSchema, old_num_rels: int, new: ConfigSchema, new_num_rels: int,
    params: dict[str, np.ndarray], optimizer: dict[str, Any] | None,
) -> tuple[Any, dict[str, tuple[str, np.ndarray]], dict[str, Any]]:
    """The grown model (a ``Model``), its public state dict and its relation optimizer state.

    Trained parameters are copied unchanged; a dynamic relation's parameter table gets rows for the
    new relation types and a new static relation type its own parameters, both as a fresh model
    initialises them (identity operators), with zero Adagrad sums. The optimizer state is matched
    by parameter name, since its entries are numbered by position and new relations shift positions.
    """
    old_model = Model(old, old_num_rels if old.dynamic_relations else 0)
    model = Model(new, new_num_rels if new.dynamic_relations else 0)
    own = model.public_state_dict()
    with torch.no_grad():
        for name, value in params.items():
            if name not in own:
                raise GrowError(f"--into: the trained model has parameter '{name}', which this config does not define")
            target = own[name][1]
            source = torch.as_tensor(np.asarray(value))
            if source.shape == target.shape:
                target.copy_(source)
            elif source.dim() >= 1 and source.shape[1:] == target.shape[1:] and source.shape[0] <= target.shape[0]:
                target[: source.shape[0]].copy_(source)  # dynamic relations: the old ones first
            else:
                raise GrowError(f"--into: model parameter '{name}' has shape {tuple(source.shape)}, which does not fit "
                                f"{tuple(target.shape)} of the grown model")
    old_names = [name for name, _ in old_model.named_parameters()]
    new_params = dict(model.named_parameters())
    adagrad = RelationAdagrad(list(new_params.values()), new.relation_lr or new.lr)
    index_of = {name: i for i, name in enumerate(new_params)}
    entries = (optimizer or {}).get("state", {}) if isinstance(optimizer, dict) else {}
    for old_index, name in enumerate(old_names):
        entry = entries.get(old_index, entries.get(str(old_index)))
        if entry is None or name not in index_of:
            continue
        sums = torch.as_tensor(entry["sum"])
        target = adagrad.sums[index_of[name]]
        if sums.shape == target.shape:
            target.copy_(sums)
        else:
            target[: sums.shape[0]].copy_(sums)  # the rows of the old dynamic relations
        step = entry.get("step", 0)
        adagrad.steps.fill_(float(step.item() if isinstance(step, torch.Tensor) else step))
    state = {name: (private, tensor.numpy().copy()) for name, (private, tensor) in model.public_state_dict().items()}
    return model, state, adagrad.state_dict()
