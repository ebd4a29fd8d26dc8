"""charts/biggraph/values.schema.json's ``config``, generated from job/config: current, and refusing what
``biggraph train`` refuses (keys, types, choices), with real helm for the misspelled key."""

from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from job.config import ConfigError, ConfigSchema, parse_config
from job.config.json_schema import VALUES_SCHEMA, config_schema, main, values_schema_text

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "biggraph"
HELM = REPO / ".cache" / "bin" / "helm"
CI_CONFIGS = {p.name: yaml.safe_load(p.read_text())["config"] for p in sorted((CHART / "ci").glob("*.yaml"))}


def base() -> dict[str, Any]:
    return {"entities": {"node": {"num_partitions": 2}},
            "relations": [{"name": "r", "lhs": "node", "rhs": "node", "operator": "translation"}],
            "dimension": 8, "entity_path": "s3://b/e", "edge_paths": ["s3://b/p"], "checkpoint_path": "s3://b/c"}


def schema_errors(config: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft7Validator(config_schema())
    return [f"/{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(config)]


def test_the_checked_in_schema_is_generated_from_the_config_schema() -> None:
    assert main(["--check"]) == 0, "run: python -m job.config.json_schema"
    assert values_schema_text(VALUES_SCHEMA.read_text()) == VALUES_SCHEMA.read_text()


@pytest.mark.parametrize("name", sorted(CI_CONFIGS))
def test_every_config_train_accepts_passes_the_schema(name: str) -> None:
    config = CI_CONFIGS[name]
    parse_config(config)
    assert schema_errors(config) == []
    # and with every key spelled out (config.json's form: all 77 keys at their defaults)
    assert schema_errors(parse_config(config).to_dict()) == []


@pytest.mark.parametrize("key", [f.name for f in dataclasses.fields(ConfigSchema)])
def test_a_misspelled_key_is_refused_by_both_naming_it(key: str) -> None:
    config = {**base(), key + "x": 1}
    with pytest.raises(ConfigError, match=f"'{key}x'"):
        parse_config(config)
    assert any(f"'{key}x'" in error for error in schema_errors(config))


@pytest.mark.parametrize(("change", "where"), [
    ({"entities": {"node": {"num_partitions": 2, "partitions": 1}}}, "/entities/node"),
    ({"relations": [{"name": "r", "lhs": "node", "rhs": "node", "operator": "translaton"}]}, "/relations/0/operator"),
    ({"comparator": "cosine"}, "/comparator"),
    ({"bucket_order": "sideways"}, "/bucket_order"),
    ({"num_epochs": 0}, "/num_epochs"),
    ({"num_epochs": "5"}, "/num_epochs"),
    ({"lr": True}, "/lr"),
    ({"compute_dtype": "float64"}, "/compute_dtype"),
    ({"edge_paths": []}, "/edge_paths"),
    ({"dimension": None}, "/dimension"),
])
def test_values_train_refuses_are_refused_at_their_key(change: dict[str, Any], where: str) -> None:
    config = {**base(), **change}
    with pytest.raises(ConfigError):
        parse_config(config)
    assert any(error.startswith(where + ":") for error in schema_errors(config)), schema_errors(config)


def test_a_required_key_is_required() -> None:
    config = base()
    del config["dimension"]
    assert schema_errors(config) == ["/: 'dimension' is a required property"]


def helm(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    if not HELM.exists():
        pytest.skip("no .cache/bin/helm: run tests/k8s_tools.sh")
    env = {**os.environ, **{v: str(tmp_path / v.lower()) for v in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME",
                                                                   "HELM_DATA_HOME")}}
    return subprocess.run([str(HELM), *args], capture_output=True, text=True, env=env, timeout=60)


@pytest.mark.parametrize(("setting", "message"), [
    ("config.num_epoch=3", "at '/config': additional properties 'num_epoch' not allowed"),
    ("config.relations[0].operater=linear", "at '/config/relations/0': additional properties 'operater' not allowed"),
    ("config.loss_fn=hinge", "/config/loss_fn"),
])
def test_helm_install_refuses_a_misspelled_training_key_naming_it(setting: str, message: str, tmp_path: Path) -> None:
    values = str(CHART / "ci" / "cpu-values.yaml")
    done = helm(tmp_path, "install", "--dry-run=client", "rel", str(CHART), "-f", values, "--set", setting)
    assert done.returncode != 0
    assert "values don't meet the specifications of the schema" in done.stderr, done.stderr
    assert message in done.stderr, done.stderr
    assert helm(tmp_path, "install", "--dry-run=client", "rel", str(CHART), "-f", values).returncode == 0
