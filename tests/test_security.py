"""Security rules that must hold in the source and at run time.

(a) Nothing in ``job/`` or ``storage_adapters/`` unpickles without ``weights_only=True``: no
    ``pickle.load(s)``/``Unpickler``, no ``torch.load`` without ``weights_only=True``, no
    ``yaml.load``/``yaml.unsafe_load``, no ``numpy.load(allow_pickle=True)`` (an AST scan, so
    docstrings and comments do not count).
(b) A YAML config is only ever ``safe_load``-ed: python tags are refused with a ConfigError and
    have no effect.
(c) A ``.py`` config is executed only when it is the file passed on the command line; a
    checkpoint directory's ``config.json`` is JSON-parsed, and a ``config.py`` lying beside it
    (or any other file) is never imported.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from job.config import load_config, load_raw_config
from job.errors import ConfigError, UserError
from job.formats.checkpoint import CheckpointStorage

REPO = Path(__file__).resolve().parent.parent
SCANNED = ("job", "storage_adapters")


# (a) source scan ------------------------------------------------------------------------------------


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _keyword_is(call: ast.Call, name: str, value: object) -> bool:
    return any(k.arg == name and isinstance(k.value, ast.Constant) and k.value.value is value for k in call.keywords)


def unsafe_loads(source: str, filename: str = "<source>") -> list[str]:
    """Every call in ``source`` that may unpickle (or construct objects from YAML) without a safe mode."""
    tree = ast.parse(source, filename)
    # names bound by `from pickle import load`, `import pickle as p`, `from torch import load as tl`...
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                aliases[alias.asname or alias.name] = alias.name
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        head, _, rest = name.partition(".")
        resolved = f"{aliases[head]}.{rest}" if head in aliases and rest else aliases.get(head, name)
        where = f"{filename}:{node.lineno}: {name}(...)"
        if resolved in ("pickle.load", "pickle.loads", "pickle.Unpickler", "cPickle.load", "cPickle.loads",
                        "dill.load", "dill.loads", "joblib.load", "yaml.unsafe_load", "yaml.full_load",
                        "marshal.load", "marshal.loads", "shelve.open"):
            found.append(where)
        elif resolved == "torch.load" and not _keyword_is(node, "weights_only", True):
            found.append(where + " without weights_only=True")
        elif resolved == "yaml.load" and not any(
            k.arg == "Loader" and _dotted(k.value).endswith(("SafeLoader", "CSafeLoader")) for k in node.keywords
        ):
            found.append(where + " without Loader=SafeLoader")
        elif resolved in ("numpy.load", "np.load") and _keyword_is(node, "allow_pickle", True):
            found.append(where + " with allow_pickle=True")
    return found


def test_scanner_catches_unsafe_loads() -> None:
    bad = (
        "import pickle\nimport torch\nimport yaml\nfrom pickle import loads as l\nimport numpy as np\n"
        "pickle.load(f)\nl(b)\ntorch.load(p)\ntorch.load(p, weights_only=False)\nyaml.load(t)\n"
        "np.load(p, allow_pickle=True)\n"
    )
    assert len(unsafe_loads(bad)) == 6
    good = (
        "import torch\nimport yaml\nimport numpy as np\n"
        "torch.load(p, map_location='cpu', weights_only=True)\nyaml.safe_load(t)\n"
        "yaml.load(t, Loader=yaml.SafeLoader)\nnp.load(p)\n"
    )
    assert unsafe_loads(good) == []


def test_no_unsafe_deserialisation_in_the_product() -> None:
    files = [p for d in SCANNED for p in sorted((REPO / d).rglob("*.py"))]
    assert len(files) > 20  # the scan really looked at the code
    problems = [hit for path in files for hit in unsafe_loads(path.read_text(encoding="utf-8"), str(path.relative_to(REPO)))]
    assert problems == [], "unsafe deserialisation:\n" + "\n".join(problems)
    # and the places that do load torch blobs really say weights_only=True
    texts = {str(p.relative_to(REPO)): p.read_text(encoding="utf-8") for p in files}
    assert "weights_only=True" in texts["job/formats/optimizer_state.py"]
    assert "weights_only=True" in texts["job/data/legacy/loading.py"]


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_a_malicious_optimizer_blob_is_refused(tmp_path: Path) -> None:
    """A checkpoint is untrusted input: a pickle that would run code is refused, not run."""
    import pickle

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self) -> tuple:
            return (Path.touch, (marker,))

    from job.formats.checkpoint import deserialize_optimizer_state

    blob = pickle.dumps({"state": Evil()})
    with pytest.raises(UserError, match="cannot be loaded safely"):
        deserialize_optimizer_state(blob, "embeddings_x_0.v1.h5")
    import io

    import torch

    buffer = io.BytesIO()
    torch.save({"state": Evil()}, buffer)
    with pytest.raises(UserError, match="cannot be loaded safely"):
        deserialize_optimizer_state(buffer.getvalue(), "embeddings_x_0.v1.h5")
    assert not marker.exists()


# (b) YAML is never executed -----------------------------------------------------------------------------

YAML_ATTACKS = [
    "!!python/object/apply:os.system ['touch {marker}']",
    "entities: !!python/object/apply:os.system ['touch {marker}']\n",
    "dimension: 4\nentities: {{}}\nx: !!python/object/new:subprocess.Popen [['touch', '{marker}']]\n",
    "a: !!python/name:os.system\n",
    "a: !!python/module:os\n",
]


@pytest.mark.parametrize("attack", YAML_ATTACKS)
def test_yaml_python_tags_are_refused_and_do_nothing(tmp_path: Path, attack: str) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "config.yaml"
    path.write_text(attack.format(marker=marker))
    with pytest.raises(ConfigError, match=r"config file .*config\.yaml: invalid YAML"):
        load_raw_config(str(path))
    with pytest.raises(ConfigError):
        load_config(str(path))
    assert not marker.exists()


def test_yaml_attack_through_the_cli_exits_2_without_effect(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "config.yml"
    path.write_text(f"!!python/object/apply:os.system ['touch {marker}']\n")
    result = subprocess.run([sys.executable, "-m", "job", "validate", str(path)], capture_output=True, text=True,
                            cwd=REPO, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "invalid YAML" in result.stderr and "Traceback" not in result.stderr
    assert not marker.exists()


# (c) Python configs only when passed explicitly -------------------------------------------------------------

PY_CONFIG = """
import pathlib
pathlib.Path({marker!r}).touch()

def get_torchbiggraph_config():
    return {{"entities": {{"node": {{"num_partitions": 1}}}}, "relations": [{{"name": "r", "lhs": "node", "rhs": "node"}}],
            "dimension": 4, "entity_path": "e", "edge_paths": ["x"], "checkpoint_path": "c"}}
"""


def test_python_config_runs_only_when_it_is_the_file_passed(tmp_path: Path) -> None:
    marker = tmp_path / "executed"
    py = tmp_path / "config.py"
    py.write_text(PY_CONFIG.format(marker=str(marker)))
    # a YAML/JSON/extension-less file holding Python is parsed, never executed
    for name in ("config.yaml", "config.json", "config"):
        other = tmp_path / name
        other.write_text(py.read_text())
        with pytest.raises(ConfigError):
            load_config(str(other))
        assert not marker.exists(), name
    # the positive control: the .py file itself, passed explicitly, is executed (as PBG does)
    config = load_config(str(py))
    assert marker.exists() and config.dimension == 4


def test_checkpoint_config_json_is_parsed_not_imported(tmp_path: Path) -> None:
    """Commands reading a checkpoint directory take its config.json as JSON; nothing there is imported."""
    marker = tmp_path / "executed"
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    config = {"entities": {"node": {"num_partitions": 1}}, "relations": [{"name": "r", "lhs": "node", "rhs": "node"}],
              "dimension": 4, "entity_path": str(tmp_path / "e"), "edge_paths": [str(tmp_path / "x")],
              "checkpoint_path": str(checkpoint)}
    (checkpoint / "config.json").write_text(json.dumps(config))
    for planted in ("config.py", "__init__.py", "sitecustomize.py", "job.py", "numpy.py", "h5py.py"):
        (checkpoint / planted).write_text(PY_CONFIG.format(marker=str(marker)))
    storage = CheckpointStorage(str(checkpoint))
    assert storage.load_config_dict() == config
    storage.save_entity_partition(1, "node", 0, np.zeros((3, 4), np.float32))
    storage.save_model(1, {}, None, {"config/json": json.dumps(config)})
    storage.save_version(1)
    # a full command on that directory, run from inside it (the worst case for a stray import)
    # (through the console script: `python -m` itself would put the working directory on sys.path)
    biggraph = Path(sys.executable).with_name("biggraph")
    if not biggraph.exists():
        pytest.skip(f"{biggraph} not installed (pip install -e .)")
    result = subprocess.run([str(biggraph), "report", str(checkpoint), "--out", str(tmp_path / "r.html")],
                            capture_output=True, text=True, cwd=checkpoint, timeout=180)
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert not marker.exists(), "a file of the checkpoint directory was executed"
    # a config.json that is not JSON is an error, not code
    (checkpoint / "config.json").write_text("import os\nos.system('touch x')\n")
    with pytest.raises(UserError, match="invalid JSON"):
        storage.load_config_dict()
    assert not marker.exists()


# dependency pinning and audit -----------------------------------------------------------------------------


def test_lock_file_pins_every_declared_dependency() -> None:
    """requirements.lock pins (==) every dependency of pyproject.toml, at a version its specifier allows."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    pins = {}
    for line in (REPO / "requirements.lock").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"not an exact pin: {line}"
            pins[canonicalize_name(name)] = version
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = [Requirement(r) for r in project["dependencies"]]
    declared += [Requirement(r) for extra in ("s3", "k8s", "report", "test") for r in project["optional-dependencies"][extra]]
    for req in declared:
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is not pinned in requirements.lock (run tests/audit.sh --lock)"
        assert req.specifier.contains(pins[name], prereleases=True), f"{name}=={pins[name]} does not satisfy {req}"
    assert "biggraph" not in pins and "torchbiggraph" not in pins


FAKE_AUDIT = """#!/bin/sh
# a stand-in for pip-audit: writes the report given in $FAKE_REPORT (if any), prints $FAKE_STDERR, exits $FAKE_RC
out=""
while [ $# -gt 0 ]; do [ "$1" = "-o" ] && out="$2"; shift; done
[ -n "$FAKE_REPORT" ] && printf '%s' "$FAKE_REPORT" > "$out"
printf '%s\\n' "$FAKE_STDERR" >&2
exit $FAKE_RC
"""


@pytest.mark.parametrize("report,stderr,rc,exit_code,says", [
    ({"dependencies": [{"name": "pyyaml", "version": "5.3", "vulns": [{"id": "PYSEC-2021-142", "fix_versions": ["5.4"]}]},
                       {"name": "numpy", "version": "2.4.6", "vulns": []}], "fixes": []}, "", 1, 1, "FAILED: 1 known"),
    ({"dependencies": [{"name": "numpy", "version": "2.4.6", "vulns": []}], "fixes": []}, "", 0, 0, "ok: no known"),
    ({"dependencies": [{"name": "numpy", "skip_reason": "Dependency not found on PyPI"}], "fixes": []}, "", 0, 0,
     "SKIPPED: the vulnerability database could not be reached"),
    (None, "requests.exceptions.ConnectionError: HTTPSConnectionPool(host='api.osv.dev'): Max retries exceeded", 1, 0,
     "SKIPPED: the vulnerability database could not be reached"),
    (None, "ERROR: invalid requirement: 'numpy=2'", 1, 2, "FAILED: pip-audit exited 1 without a report"),
])
def test_audit_script_tells_vulnerabilities_from_network_errors(tmp_path: Path, report: dict | None, stderr: str, rc: int,
                                                                exit_code: int, says: str) -> None:
    import os

    venv = tmp_path / "audit-venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "pip-audit").write_text(FAKE_AUDIT)
    (venv / "bin" / "pip-audit").chmod(0o755)
    (venv / "bin" / "python").symlink_to(sys.executable)
    env = dict(os.environ, AUDIT_VENV=str(venv), FAKE_REPORT=json.dumps(report) if report else "", FAKE_STDERR=stderr,
               FAKE_RC=str(rc))
    result = subprocess.run(["bash", str(REPO / "tests" / "audit.sh")], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == exit_code, result.stdout + result.stderr
    assert says in result.stdout, result.stdout
    if exit_code == 1:
        assert "VULNERABLE pyyaml==5.3: PYSEC-2021-142 (fixed in: 5.4)" in result.stdout
