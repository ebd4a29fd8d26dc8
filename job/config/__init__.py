"""Typed training configuration, compatible key for key with PBG's ``ConfigSchema``.

PBG users keep their configs as Python files exposing ``get_torchbiggraph_config()``;
we load those unchanged, as well as YAML/JSON files holding the same dict. Parsing is
strict: unknown keys, wrong types and impossible combinations raise ``ConfigError``
naming the offending key (or the ``-p`` override that set it).

The package, by concern (callers import from ``job.config``; the modules are internal):

- ``choices``: the closed sets of names (operators, comparators, losses...) and ``BucketOrder``
- ``base``: help fields, type names, plain values, ``ConfigKeyError``, ``parse_bytes``
- ``schema``: ``ConfigSchema`` (the top-level keys and their help)
- ``graph_schema``: ``EntitySchema``, ``RelationSchema`` (the keys of each entity and relation type)
- ``checks``: the named checks ``ConfigSchema.__post_init__`` runs
- ``parsing``: dict -> ``ConfigSchema`` (``parse_config``)
- ``overrides``: ``-p key=value`` (``apply_overrides``)
- ``loading``: files (``load_raw_config``, ``load_config``)
- ``help``: ``config_help``
- ``pbg``: what PBG 1.0.0 can read back (``NON_PBG_1_0_KEYS``)
"""

from __future__ import annotations

from job.config.base import MISSING, ConfigKeyError, parse_bytes, to_plain, type_hints_of, type_name
from job.config.choices import (
    COMPARATORS,
    COMPUTE_DTYPES,
    DEVICES,
    EDGE_READ_MODES,
    GROW_INITS,
    GROW_NUM_EPOCHS_DEFAULT,
    LOSS_FUNCTIONS,
    OPERATORS,
    REGULARIZERS,
    BucketOrder,
)
from job.config.graph_schema import EntitySchema, RelationSchema
from job.config.help import config_help
from job.config.loading import load_config, load_raw_config
from job.config.overrides import apply_overrides
from job.config.parsing import parse_config
from job.config.pbg import NON_PBG_1_0_ENTITY_KEYS, NON_PBG_1_0_KEYS
from job.config.schema import ConfigSchema
from job.errors import ConfigError

__all__ = [
    "COMPARATORS",
    "COMPUTE_DTYPES",
    "DEVICES",
    "EDGE_READ_MODES",
    "GROW_INITS",
    "GROW_NUM_EPOCHS_DEFAULT",
    "LOSS_FUNCTIONS",
    "MISSING",
    "NON_PBG_1_0_ENTITY_KEYS",
    "NON_PBG_1_0_KEYS",
    "OPERATORS",
    "REGULARIZERS",
    "BucketOrder",
    "ConfigError",
    "ConfigKeyError",
    "ConfigSchema",
    "EntitySchema",
    "RelationSchema",
    "type_hints_of",  # the three below: for docs/gen_config_reference.py, which describes types as config-help does
    "to_plain",
    "type_name",
    "apply_overrides",
    "config_help",
    "load_config",
    "load_raw_config",
    "parse_bytes",
    "parse_config",
]
