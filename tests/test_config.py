"""The typed config: PBG files load unchanged, PBG 1.0.0's defaults, typed overrides, and
rejections whose message names the offending key (so a typo fails in the first second)."""

from __future__ import annotations

import dataclasses
import json
import logging
import string
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from job.cli import main
from job.config import (
    COMPARATORS,
    LOSS_FUNCTIONS,
    OPERATORS,
    BucketOrder,
    ConfigSchema,
    EntitySchema,
    RelationSchema,
    apply_overrides,
    config_help,
    load_config,
    parse_bytes,
    parse_config,
)
from job.errors import ConfigError

PBG_CONFIGS = Path(__file__).parent / "pbg_configs"

# Read from PBG 1.0.0's torchbiggraph/config.py (attr.ib defaults), key -> default.
PBG_1_0_DEFAULTS: dict[str, Any] = {
    "init_scale": 1e-3,
    "max_norm": None,
    "global_emb": True,
    "comparator": "cos",
    "bias": False,
    "loss_fn": "ranking",
    "margin": 0.1,
    "init_path": None,
    "checkpoint_preservation_interval": None,
    "num_epochs": 1,
    "num_edge_chunks": None,
    "max_edges_per_chunk": 1_000_000_000,
    "bucket_order": "inside_out",
    "workers": None,
    "batch_size": 1000,
    "num_batch_negs": 50,
    "num_uniform_negs": 50,
    "disable_lhs_negs": False,
    "disable_rhs_negs": False,
    "lr": 1e-2,
    "relation_lr": None,
    "eval_fraction": 0.05,
    "eval_num_batch_negs": 1000,
    "eval_num_uniform_negs": 1000,
    "background_io": False,
    "verbose": 0,
    "hogwild_delay": 2,
    "dynamic_relations": False,
    "num_machines": 1,
    "num_partition_servers": -1,
    "distributed_init_method": None,
    "distributed_tree_init_order": True,
}
PBG_1_0_ENTITY_DEFAULTS = {"featurized": False}
PBG_1_0_RELATION_DEFAULTS = {"weight": 1.0, "operator": "none", "all_negs": False}
PBG_1_0_REQUIRED = {"entities", "relations", "dimension", "entity_path", "edge_paths", "checkpoint_path"}


def minimal() -> dict[str, Any]:
    return {
        "entities": {"all": {"num_partitions": 1}},
        "relations": [{"name": "r", "lhs": "all", "rhs": "all"}],
        "dimension": 8,
        "entity_path": "data/entities",
        "edge_paths": ["data/edges"],
        "checkpoint_path": "model",
    }


def rejects(raw: dict[str, Any], *fragments: str) -> str:
    """Parse ``raw`` expecting a ConfigError whose message contains every fragment."""
    with pytest.raises(ConfigError) as info:
        parse_config(raw)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


# PBG's files load unchanged ---------------------------------------------------------------------


def test_pbg_fb15k_example_loads_unchanged() -> None:
    config = load_config(str(PBG_CONFIGS / "fb15k_config.py"))
    assert config.dimension == 400 and config.dynamic_relations is True and config.global_emb is False
    assert config.relations[0].operator == "complex_diagonal" and config.loss_fn == "softmax"
    assert config.edge_paths[2].endswith("test_partitioned")
    assert config.eval_fraction == 0.0 and isinstance(config.eval_fraction, float)


def test_pbg_livejournal_example_loads_unchanged() -> None:
    config = load_config(str(PBG_CONFIGS / "livejournal_config.py"))
    assert config.entities == {"user_id": EntitySchema(num_partitions=1)}
    assert config.dimension == 1024 and config.lr == 0.001 and config.hogwild_delay == 2.0
    assert config.bucket_order is BucketOrder.INSIDE_OUT


@pytest.mark.parametrize("suffix", ["yaml", "json"])
def test_yaml_and_json_equivalents_equal_the_python_file(suffix: str) -> None:
    assert load_config(str(PBG_CONFIGS / f"fb15k_config.{suffix}")) == load_config(str(PBG_CONFIGS / "fb15k_config.py"))


def test_defaults_equal_pbg_1_0() -> None:
    config = parse_config(minimal())
    actual = {key: getattr(config, key) for key in PBG_1_0_DEFAULTS}
    actual["bucket_order"] = config.bucket_order.value
    assert actual == PBG_1_0_DEFAULTS
    assert {k: getattr(config.entities["all"], k) for k in PBG_1_0_ENTITY_DEFAULTS} == PBG_1_0_ENTITY_DEFAULTS
    assert {k: getattr(config.relations[0], k) for k in PBG_1_0_RELATION_DEFAULTS} == PBG_1_0_RELATION_DEFAULTS
    required = {f.name for f in dataclasses.fields(ConfigSchema)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    assert required == PBG_1_0_REQUIRED


# -p overrides --------------------------------------------------------------------------------------


def test_overrides_are_typed_from_the_schema() -> None:
    raw = apply_overrides(minimal(), [
        "num_epochs=5", "lr=0.5", "global_emb=false", "bias=True", "edge_paths=a,b",
        "entities.all.num_partitions=4", "relations.0.operator=diagonal", "relations.0.weight=2",
        "max_norm=None", "relation_lr=0.25", "bucket_order=affinity", "init_path=null",
    ])
    config = parse_config(raw)
    assert config.num_epochs == 5 and type(raw["num_epochs"]) is int
    assert config.lr == 0.5 and type(raw["lr"]) is float
    assert config.global_emb is False and config.bias is True
    assert config.edge_paths == ["a", "b"]
    assert config.entities["all"].num_partitions == 4
    assert config.relations[0].operator == "diagonal" and config.relations[0].weight == 2.0
    assert config.max_norm is None and config.init_path is None and config.relation_lr == 0.25
    assert config.bucket_order is BucketOrder.AFFINITY


def test_overrides_do_not_modify_the_input_and_apply_in_order() -> None:
    raw = minimal()
    out = apply_overrides(raw, ["max_norm=1", "max_norm=None", "num_epochs=3", "num_epochs=4"])
    assert "max_norm" not in raw and out["max_norm"] is None and out["num_epochs"] == 4


def test_load_config_applies_overrides_to_a_pbg_file() -> None:
    config = load_config(str(PBG_CONFIGS / "livejournal_config.py"), ["num_epochs=2", "entities.user_id.num_partitions=8"])
    assert config.num_epochs == 2 and config.num_partitions == 8


@pytest.mark.parametrize(
    ("override", "fragments"),
    [
        ("num_epochs", ("override 'num_epochs'", "key=value")),
        ("=3", ("override '=3'", "key=value")),
        ("num_epoch=3", ("override 'num_epoch'", "unknown key 'num_epoch'", "(did you mean 'num_epochs'?)")),
        ("entities.all.dimensions=3", ("override 'entities.all.dimensions'", "unknown key 'dimensions'",
                                       "(did you mean 'entities.all.dimension'?)")),
        ("num_epochs=five", ("override 'num_epochs'", "expected an integer", "five")),
        ("lr=fast", ("override 'lr'", "expected a number")),
        ("global_emb=maybe", ("override 'global_emb'", "expected a boolean")),
        ("relations.3.operator=diagonal", ("override 'relations.3.operator'", "out of range")),
        ("relations.first.operator=diagonal", ("override 'relations.first.operator'", "list index")),
        ("dimension.x=1", ("override 'dimension.x'", "no sub-keys")),
    ],
)
def test_bad_overrides_name_the_key(override: str, fragments: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as info:
        apply_overrides(minimal(), [override])
    for fragment in fragments:
        assert fragment in str(info.value)


def test_load_config_blames_the_override_that_set_the_bad_key(tmp_path: Path) -> None:
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(minimal()))
    with pytest.raises(ConfigError) as info:
        load_config(str(path), ["lr=0.5", "num_epochs=-1"])
    assert str(info.value) == "-p num_epochs=-1: config key 'num_epochs': must be a positive integer, got -1"
    with pytest.raises(ConfigError) as info:  # only the last of two overrides of a key was used
        load_config(str(path), ["num_epochs=0", "num_epochs=-1"])
    assert str(info.value).startswith("-p num_epochs=-1: config key 'num_epochs'")
    with pytest.raises(ConfigError) as info:  # a key inside the one overridden, and one matched by '*'
        load_config(str(path), ["entities={\"all\": {\"num_partitions\": 0}}"])
    assert str(info.value).startswith("-p entities={")
    two_types = {**minimal(), "entities": {"all": {"num_partitions": 2}, "b": {"num_partitions": 1}}}
    path.write_text(json.dumps(two_types))
    with pytest.raises(ConfigError, match=r"^-p entities\.b\.num_partitions=3: config key 'entities\.\*\.num_parti"):
        load_config(str(path), ["entities.b.num_partitions=3"])
    with pytest.raises(ConfigError, match=r"^-p relations\.0\.operator=complex_diagonal -p dimension=3: "):
        load_config(str(path), ["relations.0.operator=complex_diagonal", "dimension=3", "lr=1"])


def test_load_config_blames_the_file_when_no_override_set_the_bad_key(tmp_path: Path) -> None:
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({**minimal(), "num_epochs": -1}))
    with pytest.raises(ConfigError) as info:
        load_config(str(path), ["lr=0.5", "entities.all.featurized=true"])
    assert str(info.value) == f"{path}: config key 'num_epochs': must be a positive integer, got -1"
    without_checkpoint = minimal()
    del without_checkpoint["checkpoint_path"]
    path.write_text(json.dumps(without_checkpoint))
    assert load_config(str(path), ["checkpoint_path=elsewhere"]).checkpoint_path == "elsewhere"
    with pytest.raises(ConfigError, match=r"cfg\.json: config key 'checkpoint_path' is required"):
        load_config(str(path), ["lr=0.5"])


# Rejections ------------------------------------------------------------------------------------------


def test_unknown_key_suggests_the_right_one() -> None:
    rejects({**minimal(), "num_epoch": 3}, "'num_epoch'", "unknown key", "did you mean 'num_epochs'")
    raw = minimal()
    raw["entities"]["all"]["num_partition"] = 2
    rejects(raw, "'entities.all.num_partition'", "did you mean 'entities.all.num_partitions'")
    rejects({**minimal(), "zzzz": 1}, "'zzzz': unknown key")


def test_non_string_keys_are_a_config_error() -> None:
    rejects({**minimal(), 1: "x", "zz": "y"}, "config key '1': unknown key")


@pytest.mark.parametrize(
    ("key", "value", "fragments"),
    [
        ("num_epochs", "3", ("'num_epochs'", "expected an integer", "str")),
        ("num_epochs", True, ("'num_epochs'", "expected an integer", "bool")),
        ("lr", "0.1", ("'lr'", "expected a number")),
        ("global_emb", 1, ("'global_emb'", "expected a boolean")),
        ("edge_paths", "data/edges", ("'edge_paths'", "expected list of str")),
        ("entity_path", 3, ("'entity_path'", "expected a string")),
        ("entities", [], ("'entities'", "expected mapping")),
        ("max_norm", "big", ("'max_norm'", "expected a number")),
    ],
)
def test_wrong_types_name_the_key(key: str, value: Any, fragments: tuple[str, ...]) -> None:
    rejects({**minimal(), key: value}, *fragments)


def test_nested_wrong_types_name_the_full_key() -> None:
    raw = minimal()
    raw["relations"][0]["weight"] = "heavy"
    rejects(raw, "'relations[0].weight'", "expected a number")
    raw = minimal()
    raw["entities"]["all"]["num_partitions"] = 0
    rejects(raw, "config key 'entities.all.num_partitions': must be a positive integer")


def test_relation_naming_an_unknown_entity_type() -> None:
    raw = minimal()
    raw["relations"][0]["rhs"] = "item"
    rejects(raw, "'relations[0].rhs'", "unknown entity type 'item'", "known: all")


def test_partition_counts_not_broadcastable() -> None:
    raw = minimal()
    raw["entities"] = {"a": {"num_partitions": 2}, "b": {"num_partitions": 3}, "all": {"num_partitions": 1}}
    rejects(raw, "'entities.*.num_partitions'", "not broadcastable", "a=2", "b=3")
    raw["entities"]["b"]["num_partitions"] = 1  # 2 and 1 broadcast
    assert parse_config(raw).num_partitions == 2


def test_dynamic_relations_need_exactly_one_relation() -> None:
    raw = minimal()
    raw["relations"].append({"name": "q", "lhs": "all", "rhs": "all"})
    rejects({**raw, "dynamic_relations": True, "global_emb": False}, "'relations'", "dynamic_relations", "got 2")


def test_both_negative_sides_disabled() -> None:
    rejects({**minimal(), "disable_lhs_negs": True, "disable_rhs_negs": True}, "'disable_lhs_negs'", "'disable_rhs_negs'")


@pytest.mark.parametrize(
    ("where", "value", "fragments"),
    [
        ("operator", "rotate", ("'relations[0].operator'", "unknown operator 'rotate'")),
        ("comparator", "manhattan", ("'comparator'", "'manhattan'", "cos")),
        ("loss_fn", "hinge", ("'loss_fn'", "'hinge'", "softmax")),
        ("bucket_order", "zigzag", ("'bucket_order'", "'zigzag'", "inside_out")),
    ],
)
def test_bad_choices_name_the_key(where: str, value: str, fragments: tuple[str, ...]) -> None:
    raw = minimal()
    if where == "operator":
        raw["relations"][0]["operator"] = value
    else:
        raw[where] = value
    rejects(raw, *fragments)


@pytest.mark.parametrize("key", sorted(PBG_1_0_REQUIRED))
def test_missing_required_key(key: str) -> None:
    raw = minimal()
    del raw[key]
    rejects(raw, f"config key '{key}' is required")


def test_missing_required_nested_key() -> None:
    raw = minimal()
    del raw["relations"][0]["lhs"]
    rejects(raw, "config key 'relations[0].lhs' is required")


def test_python_config_without_getter(tmp_path: Path) -> None:
    path = tmp_path / "cfg.py"
    path.write_text("config = {}\n")
    with pytest.raises(ConfigError, match=r"cfg\.py: defines no get_torchbiggraph_config\(\)"):
        load_config(str(path))


def test_python_config_syntax_error(tmp_path: Path) -> None:
    path = tmp_path / "cfg.py"
    path.write_text("def get_torchbiggraph_config(:\n")
    with pytest.raises(ConfigError, match=r"cfg\.py: Python syntax error at line 1"):
        load_config(str(path))


def test_yaml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text("dimension: 4\nentities: {all: {num_partitions: 1}\nrelations: []\n")
    with pytest.raises(ConfigError, match=r"cfg\.yaml: invalid YAML at line \d+"):
        load_config(str(path))


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(str(tmp_path / "missing.yaml"))
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"list\.json: expected a mapping"):
        load_config(str(tmp_path / "list.json"))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match=r"bad\.json: invalid JSON at line 1"):
        load_config(str(tmp_path / "bad.json"))
    (tmp_path / "typo.json").write_text(json.dumps({**minimal(), "dimensoin": 3}))
    with pytest.raises(ConfigError, match=r"typo\.json: config key 'dimensoin': unknown key \(did you mean 'dimension'\?\)"):
        load_config(str(tmp_path / "typo.json"))


def test_cli_reports_config_errors_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({**minimal(), "num_epochs": "many"}))
    assert main(["export", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'num_epochs'" in err and "Traceback" not in err


def test_config_help_lists_every_field(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config-help"]) == 0
    text = capsys.readouterr().out
    assert text.strip() == config_help().strip()
    keys = {line.split("  [", 1)[0] for line in text.splitlines() if not line.startswith(" ")}
    expected = {f.name for f in dataclasses.fields(ConfigSchema)}
    expected |= {f"entities.<type>.{f.name}" for f in dataclasses.fields(EntitySchema)}
    expected |= {f"relations[i].{f.name}" for f in dataclasses.fields(RelationSchema)}
    assert keys == expected
    assert "default: 1000000000" in text and "(required)" in text


# Property tests --------------------------------------------------------------------------------------

_names = st.text(alphabet=string.ascii_lowercase + "_", min_size=1, max_size=6)


@st.composite
def valid_configs(draw: st.DrawFn) -> ConfigSchema:
    """Random configs that satisfy every documented constraint."""
    types = draw(st.lists(_names, min_size=1, max_size=3, unique=True))
    shared = draw(st.integers(1, 8))
    entities = {t: {"num_partitions": draw(st.sampled_from([1, shared])), "featurized": draw(st.booleans())} for t in types}
    dynamic = draw(st.booleans())
    relations = [
        {
            "name": draw(_names),
            "lhs": draw(st.sampled_from(types)),
            "rhs": draw(st.sampled_from(types)),
            "operator": draw(st.sampled_from(OPERATORS)),
            "weight": draw(st.floats(0.01, 10)),
            "all_negs": draw(st.booleans()),
        }
        for _ in range(1 if dynamic else draw(st.integers(1, 3)))
    ]
    for relation in relations:  # featurized types cannot list all their entities
        if entities[relation["lhs"]]["featurized"] or entities[relation["rhs"]]["featurized"]:
            relation["all_negs"] = False
    num_batch_negs = draw(st.sampled_from([0, 10, 50]))
    disable = draw(st.sampled_from([(False, False), (True, False), (False, True)]))
    raw = {
        "entities": entities,
        "relations": relations,
        "dimension": 2 * draw(st.integers(1, 64)),
        "entity_path": draw(st.sampled_from(["data/e", "s3://bucket/e", "memory://x/e"])),
        "edge_paths": draw(st.lists(st.sampled_from(["a", "s3://b/edges", "file:///tmp/e"]), min_size=1, max_size=3)),
        "checkpoint_path": "ckpt",
        "dynamic_relations": dynamic,
        "global_emb": False if dynamic else draw(st.booleans()),
        "comparator": draw(st.sampled_from(COMPARATORS)),
        "loss_fn": draw(st.sampled_from(LOSS_FUNCTIONS)),
        "bias": draw(st.booleans()),
        "bucket_order": draw(st.sampled_from([b.value for b in BucketOrder])),
        "max_norm": draw(st.one_of(st.none(), st.floats(0.1, 100))),
        "num_epochs": draw(st.integers(1, 100)),
        "num_edge_chunks": draw(st.one_of(st.none(), st.integers(1, 10))),
        "workers": draw(st.one_of(st.none(), st.integers(1, 64))),
        "num_batch_negs": num_batch_negs,
        "batch_size": max(num_batch_negs, 1) * draw(st.integers(1, 40)),
        "num_uniform_negs": draw(st.integers(0, 1000)),
        "disable_lhs_negs": disable[0],
        "disable_rhs_negs": disable[1],
        "lr": draw(st.floats(1e-5, 1.0)),
        "relation_lr": draw(st.one_of(st.none(), st.floats(1e-5, 1.0))),
        "eval_fraction": draw(st.floats(0.0, 0.5)),
        "seed": draw(st.one_of(st.none(), st.integers(0, 2**31))),
        "storage_options": draw(st.dictionaries(_names, st.one_of(st.text(max_size=5), st.integers()), max_size=2)),
    }
    return parse_config(raw)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_configs())
def test_round_trip_through_to_dict(config: ConfigSchema) -> None:
    assert parse_config(config.to_dict()) == config
    assert parse_config(json.loads(config.to_json())) == config
    # The PBG-only dict keeps every PBG key; only our additions fall back to their defaults.
    pbg = parse_config(json.loads(config.to_pbg_json()))
    assert pbg.to_pbg_dict() == config.to_pbg_dict()


_field_names = sorted(
    {f.name for cls in (ConfigSchema, EntitySchema, RelationSchema) for f in dataclasses.fields(cls)}
)
_json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 10**12), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8), st.sampled_from(["cos", "diagonal", "inside_out", "all", "a"]),
)
_junk = st.recursive(
    _json_scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.one_of(st.sampled_from(_field_names), st.text(max_size=6), st.integers()), children, max_size=5),
    ),
    max_leaves=25,
)


@st.composite
def junk_configs(draw: st.DrawFn) -> Any:
    """Mostly-valid configs with random parts replaced by junk, plus pure junk."""
    if draw(st.booleans()):
        return draw(_junk)
    raw: dict[Any, Any] = minimal()
    for _ in range(draw(st.integers(1, 4))):
        key = draw(st.sampled_from(_field_names + ["entities.all", "relations.0"]))
        value = draw(_junk)
        if key == "entities.all":
            raw["entities"]["all"] = value
        elif key == "relations.0":
            raw["relations"][0] = value
        else:
            raw[key] = value
    return raw


@settings(max_examples=200, deadline=None)
@given(junk_configs())
def test_junk_never_raises_anything_but_config_error(raw: Any) -> None:
    try:
        config = parse_config(raw)
    except ConfigError as err:
        assert str(err)
    else:
        assert isinstance(config, ConfigSchema)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(alphabet=string.printable, max_size=30), max_size=3))
def test_junk_overrides_never_raise_anything_but_config_error(overrides: list[str]) -> None:
    try:
        apply_overrides(minimal(), overrides)
    except ConfigError as err:
        assert "override" in str(err)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["num_epochs", "lr", "max_norm", "global_emb", "edge_paths", "entities.all.num_partitions",
                        "relations.0.operator", "relations.0.weight", "bucket_order", "storage_options", "workers"]),
       st.text(max_size=12))
def test_junk_override_values_never_raise_anything_but_config_error(key: str, value: str) -> None:
    try:
        parse_config(apply_overrides(minimal(), [f"{key}={value}"]))
    except ConfigError as err:
        assert str(err)


def test_buffer_keys_and_what_pbg_reads_of_them() -> None:
    config = parse_config({**minimal(), "bucket_order": "buffer", "partition_buffer": 4, "memory_budget": "8GiB"})
    assert config.bucket_order is BucketOrder.BUFFER and config.partition_buffer == 4
    pbg = config.to_pbg_dict()  # config.json must stay readable by PBG 1.0.0, which knows four orders
    assert pbg["bucket_order"] == "inside_out" and "partition_buffer" not in pbg and "memory_budget" not in pbg
    assert "hogwild_delay_scope" not in pbg and "hogwild_delay" in pbg  # PBG's key kept, ours left out
    assert parse_bytes("8GiB", "k") == 8 * 2**30 and parse_bytes("500 MB", "k") == 500_000_000
    assert config.partition_handoff and config.write_behind_buckets == 0  # the defaults
    for bad, message in ((("partition_buffer", 1), "a bucket needs two partitions"),
                         (("memory_budget", "lots"), "is not a size"), (("memory_budget", "-5GB"), "is not a size"),
                         (("hogwild_delay", -1), r"'hogwild_delay': seconds, must be >= 0, got -1"),
                         (("write_behind_buckets", 8), "only with partition_handoff: true; got 8 with "
                          "partition_handoff false"),
                         (("hogwild_delay_scope", "always"),
                          r"'hogwild_delay_scope': unknown value 'always' \(expected one of first_visit, epoch_0\)")):
        with pytest.raises(ConfigError, match=message):
            parse_config({**minimal(), bad[0]: bad[1], **({"partition_handoff": False} if bad[0] == "write_behind_buckets"
                                                          else {})})


def test_memory_budget_too_small_for_a_bucket_says_how_much_is_needed(tmp_path: Path) -> None:
    from job.train.residency.budget import choose_capacity

    config = parse_config({**minimal(), "entities": {"all": {"num_partitions": 4}}, "dimension": 99,
                           "memory_budget": "1MB"})
    counts = {"all": [10_000] * 4}  # 10,000 x (99 + 1) x 4 bytes = 4 MB a partition
    # the budget is the whole trainer's: 3 processes x 1 MB of their own + one partition in flight come first
    with pytest.raises(ConfigError, match=r"holds 0 partition\(s\) of 3.8 MiB.*a bucket needs 2: raise it to at "
                                          r"least 14.4 MiB"):
        choose_capacity(config, counts, distributed=False, processes=3, runtime_bytes=2**20)
    sized = parse_config({**minimal(), "entities": {"all": {"num_partitions": 4}}, "dimension": 99,
                          "memory_budget": "20MB"})
    assert choose_capacity(sized, counts, distributed=False, processes=3, runtime_bytes=2**20) == 3
    assert choose_capacity(sized, counts, distributed=False, processes=3, runtime_bytes=2 * 2**20) == 2
    # distributed: without prefetch exactly the bucket's (PBG); with it the bucket's + the next one's read ahead,
    # within the same budget less the copy of the partition a write group keeps (job/checkpoint/write_groups.py), so
    # one partition fewer than alone (too small a budget is refused the same way)
    no_prefetch = parse_config({**minimal(), "entities": {"all": {"num_partitions": 4}}, "dimension": 99,
                                "memory_budget": "1MB", "prefetch_partitions": False})
    assert choose_capacity(no_prefetch, counts, distributed=True) is None
    with pytest.raises(ConfigError, match="a bucket needs 2"):
        choose_capacity(config, counts, distributed=True, runtime_bytes=2**20)
    assert choose_capacity(sized, counts, distributed=True, processes=3, runtime_bytes=2**20) == 2


def test_memory_budget_sets_aside_the_transfer_buffers_of_a_checkpoint_on_s3(caplog: pytest.LogCaptureFixture) -> None:
    from job.train.residency.budget import checkpoint_transfer_bytes, choose_capacity
    from storage_adapters import multipart

    on_s3 = checkpoint_transfer_bytes("s3://bucket/ckpt")
    assert on_s3 == (8 + 2 * multipart.DOWNLOAD_CHUNKS) * multipart.PART_BYTES  # 8 uploads, 2 reads
    assert checkpoint_transfer_bytes("/local/ckpt") == 0 and checkpoint_transfer_bytes("file:///c") == 0
    assert checkpoint_transfer_bytes("s3a://bucket/ckpt") == on_s3
    config = parse_config({**minimal(), "entities": {"all": {"num_partitions": 8}}, "dimension": 99,
                           "memory_budget": str(3 * 2**20 + 8 * 4_000_000)})  # a partition in flight + 7
    counts = {"all": [10_000] * 8}
    assert choose_capacity(config, counts, distributed=False, processes=3, runtime_bytes=2**20) == 7
    with caplog.at_level(logging.INFO, "biggraph"):
        assert choose_capacity(config, counts, distributed=False, processes=3, runtime_bytes=2**20,
                               transfer_bytes=3 * 4_000_000) == 4
    assert "11.4 MiB for transfers to and from the object store" in caplog.text


def test_memory_budget_counts_this_process_by_default() -> None:
    from job.train.residency.budget import choose_capacity, process_bytes

    own = process_bytes()
    assert 10 * 2**20 < own < 4 * 2**30  # this interpreter with torch loaded
    config = parse_config({**minimal(), "entities": {"all": {"num_partitions": 8}}, "dimension": 99,
                           "memory_budget": str(2 * own + 6 * 4_000_000)})
    counts = {"all": [10_000] * 8}
    # two processes of about this one's size and a partition in flight leave room for about five partitions
    assert choose_capacity(config, counts, distributed=False, processes=2) in (4, 5)


def test_memory_budget_sets_aside_the_shared_parameters_sync_vectors_of_a_group(
        caplog: pytest.LogCaptureFixture) -> None:
    """In a group a trainer keeps three copies of the shared vector to sync it (its synced values, one transfer
    buffer, a sparse payload of at most half of it), and rank 0, which serves it, its served and stored vectors and its
    transfer slots (the sums in flight to peers that have not taken them yet: job/train/distributed/transfers.py), the
    sparse payloads' buffers and at most ``PENDING_VECTORS`` updates of buckets done but unsaved: a fixed number each,
    whatever the pass's length or the group's size."""
    from job.train.residency.budget import (
        PENDING_VECTORS,
        SPARSE_TRANSFER_VECTORS,
        TRANSFER_SLOTS,
        choose_capacity,
        sync_memory_bytes,
    )

    values = 1_000_000  # 4 MB a copy
    assert sync_memory_bytes(values, serves=False) == 3 * 4 * values
    server = 4 + TRANSFER_SLOTS + PENDING_VECTORS + SPARSE_TRANSFER_VECTORS
    assert sync_memory_bytes(values, serves=True) == (3 + server) * 4 * values
    config = parse_config({**minimal(), "entities": {"all": {"num_partitions": 24}}, "dimension": 99,
                           "memory_budget": str(3 * 2**20 + 20 * 4_000_000)})
    counts = {"all": [10_000] * 24}
    # a partition in flight + the copy of the one a write group keeps (job/checkpoint/write_groups.py) + 18
    assert choose_capacity(config, counts, distributed=True, processes=3, runtime_bytes=2**20) == 18
    assert choose_capacity(config, counts, distributed=True, processes=3, runtime_bytes=2**20,
                           sync_bytes=sync_memory_bytes(values, serves=False)) == 15
    with caplog.at_level(logging.INFO, "biggraph"):
        assert choose_capacity(config, counts, distributed=True, processes=3, runtime_bytes=2**20,
                               sync_bytes=sync_memory_bytes(values, serves=True)) == 18 - 3 - server
    assert f"{(3 + server) * 4 * values / 2**20:.1f} MiB to sync the shared parameters" in caplog.text
    assert "3.8 MiB for the kept partitions' copies of a write group" in caplog.text


def test_a_gpu_holds_every_partition_that_fits_beside_its_reserve() -> None:
    """One GPU trainer's buffer is the card's free memory less a reserve (a floor, or a share of the card), at least
    a bucket's partitions, at most all of them; nothing partitioned: None."""
    from job.train.residency.budget import DEVICE_RESERVE_FLOOR, device_capacity

    config = parse_config({**minimal(), "entities": {"all": {"num_partitions": 8}}, "dimension": 99})
    part = 10_000_000 * 100 * 4  # 10M rows x (99 + 1 row-wise Adagrad) x 4 bytes = 4 GB a partition
    counts = {"all": [10_000_000] * 8}
    assert device_capacity(config, counts, free_bytes=140 * 10**9) == 8  # an H200: every partition
    assert device_capacity(config, counts, free_bytes=DEVICE_RESERVE_FLOOR + 4 * part) == 4  # the floor reserved
    share = int(5 * part / 0.8) + 1  # 25 GB free: a fifth of it is the larger reserve
    assert device_capacity(config, counts, free_bytes=share) == 5
    assert device_capacity(config, counts, free_bytes=share - 10) == 4
    assert device_capacity(config, counts, free_bytes=part) == 2  # too small: a bucket's, as always
    unpartitioned = parse_config({**minimal(), "entities": {"all": {"num_partitions": 1}}, "dimension": 99})
    assert device_capacity(unpartitioned, {"all": [10]}, free_bytes=10**12) is None
