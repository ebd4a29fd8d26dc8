"""Config files: PBG Python files, YAML and JSON, read, overridden and validated.

PBG users keep their configs as Python files exposing ``get_torchbiggraph_config()``;
we load those unchanged, as well as YAML/JSON files holding the same dict (the Helm
chart ships YAML in a ConfigMap, so no code runs from cluster-supplied config).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from typing import Any

from job.config.overrides import apply_overrides, blamed_overrides
from job.config.parsing import parse_config
from job.config.schema import ConfigSchema
from job.errors import ConfigError


def load_raw_config(path: str) -> dict[str, Any]:
    """Read a config file: a PBG Python file, YAML, or JSON (by extension).

    Python files are executed, exactly as PBG does, so this is only ever called on a
    path the user passed on the command line.
    """
    from storage_adapters import read_text  # lazy: fsspec is slow to import and parse_config needs none of it

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
        import yaml  # lazy: only YAML files need it

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
    """Execute a PBG config file and return what its ``get_torchbiggraph_config()`` returns."""
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
    """Load, override and validate a config file.

    A refusal names its culprit: the ``-p`` overrides that set one of the offending keys
    (``-p num_epochs=-1: config key 'num_epochs': ...``), else the file.
    """
    raw = load_raw_config(path)
    if overrides:
        raw = apply_overrides(raw, overrides)
    try:
        return parse_config(raw)
    except ConfigError as err:
        culprits = blamed_overrides(overrides or [], getattr(err, "keys", ()))
        where = " ".join(f"-p {override}" for override in culprits) or path
        raise ConfigError(f"{where}: {err}") from None
