"""The house's layout holds: docs/ARCHITECTURE.md names only what exists, modules stay small and keep to their
concern, the lock protocol has one module, and every module name held in a string imports.

Why tests: a map that names a moved file, or a warm-import list naming a module that no longer exists, fails
silently (a newcomer is misled; a spare warms nothing, a fork server preloads nothing)."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
PRODUCT = ("job", "storage_adapters")
MAX_MODULE_LINES = 450
MAX_TRAIN_TOP_LEVEL = 12


def python_files(*tops: str) -> list[Path]:
    return sorted(p for top in tops for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts)


def defined_names() -> set[str]:
    """Every class, function, method and module-level name defined in the product, also as ``Class.method``."""
    names: set[str] = set()
    for path in python_files(*PRODUCT):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            if isinstance(node, ast.ClassDef):
                names.update(f"{node.name}.{item.name}" for item in node.body
                             if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)))
            if isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


# docs/ARCHITECTURE.md ------------------------------------------------------------------------------------------


def test_the_map_is_short() -> None:
    assert len(ARCHITECTURE.read_text().splitlines()) <= 150


def test_every_path_the_map_names_exists() -> None:
    text = ARCHITECTURE.read_text()
    quoted = re.findall(r"`([^`\s]+)`", text)
    paths = [q for q in quoted if "/" in q and not q.startswith("python")]
    paths += re.findall(r"\b((?:job|storage_adapters|docs|tests|bench|charts|k8s)/[\w./-]*\w)", text)
    missing = sorted({p for p in paths if not (ROOT / p.rstrip("/")).exists()})
    assert not missing, f"docs/ARCHITECTURE.md names paths that do not exist: {missing}"


def test_every_entry_of_the_package_tree_exists() -> None:
    block = ARCHITECTURE.read_text().split("## Packages", 1)[1].split("```")[1]
    parents: list[str] = []
    checked = 0
    for line in block.splitlines():
        if not line.strip() or line.startswith("  " * 14):  # blank, or a description's continuation line
            continue
        depth = (len(line) - len(line.lstrip())) // 2
        entry = line.strip().split("  ", 1)[0]  # the name(s) before the description
        names = [n.strip() for n in entry.split(",")]
        parents = parents[:depth]
        for name in names:
            path = ROOT.joinpath(*parents, name.rstrip("/"))
            assert path.exists(), f"docs/ARCHITECTURE.md's tree names {'/'.join([*parents, name])}, which does not exist"
            checked += 1
        parents.append(names[0].rstrip("/"))
    assert checked > 30


def module_map_paths(text: str) -> list[str]:
    """The files each row of docs/design/modules.md's table names in its first cell: a path with a slash inside
    or at its end (a folder) is from the root and sets the folder for the bare names after it (`job/x/a.py`, `b.py`),
    and `{a,b}.py` stands for both."""
    paths: list[str] = []
    for line in text.splitlines():
        if not line.startswith("| `"):
            continue
        folder = ""
        for token in re.findall(r"`([^`]+)`", line.split("|")[1]):
            braces = re.fullmatch(r"(.*)\{([^}]*)\}(.*)", token)
            names = [braces[1] + part + braces[3] for part in braces[2].split(",")] if braces else [token]
            for name in (n.rstrip("/") for n in names):
                if "/" in name or token.endswith("/"):  # a path from the root
                    folder = name if token.endswith("/") else name.rsplit("/", 1)[0]
                    paths.append(name)
                else:
                    paths.append(f"{folder}/{name}" if folder else name)
    return paths


def test_every_file_the_module_map_names_exists() -> None:
    paths = module_map_paths((ROOT / "docs" / "design" / "modules.md").read_text())
    assert len(paths) > 60
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"docs/design/modules.md names files that do not exist: {missing}"


def test_the_module_map_reader_resolves_folders_and_braces() -> None:
    row = "| `job/a/b.py`, `c.py`; `job/d/`, `f.py`, `k8s/`; `Dockerfile`; `job/g/{h,i}.py` | what |"
    assert module_map_paths(row) == ["job/a/b.py", "job/a/c.py", "job/d", "job/d/f.py", "k8s", "k8s/Dockerfile",
                                     "job/g/h.py", "job/g/i.py"]


def test_every_symbol_the_map_names_is_defined() -> None:
    quoted = re.findall(r"`([A-Za-z_][\w.]*)`", ARCHITECTURE.read_text())
    symbols = {q for q in quoted if "/" not in q and not q.endswith((".py", ".md", ".txt", ".json", ".h5"))
               and (q[0].isupper() or "_" in q or "." in q) and q != "weights_only=True"}
    missing = sorted(symbols - defined_names())
    assert not missing, f"docs/ARCHITECTURE.md names symbols that are not defined in job/ or storage_adapters/: {missing}"


def test_every_test_file_of_the_invariants_table_exists_and_tests() -> None:
    table = ARCHITECTURE.read_text().split("## Invariants", 1)[1].split("##", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) >= 10
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 4, row
        enforced, proved = cells[2].strip("`"), cells[3].strip("`")
        assert (ROOT / enforced).is_file(), row
        assert "def test_" in (ROOT / proved).read_text(), row


# modules ---------------------------------------------------------------------------------------------------------


def test_no_module_is_over_the_limit() -> None:
    long = {str(p.relative_to(ROOT)): n for p in python_files(*PRODUCT)
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_the_trainer_package_keeps_few_modules_at_its_top() -> None:
    top = sorted(p.name for p in (ROOT / "job" / "train").glob("*.py"))
    assert len(top) <= MAX_TRAIN_TOP_LEVEL, top


def test_no_module_imports_another_modules_private_names() -> None:
    found = []
    for path in python_files(*PRODUCT, "bench"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PRODUCT:
                found += [f"{path.relative_to(ROOT)}: {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    assert not found, found


def imported_modules(path: Path) -> set[str]:
    modules: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
            modules.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            modules.update(a.name for a in node.names)
    return modules


def test_one_module_defines_the_lock_protocol_and_both_ends_import_it() -> None:
    distributed = ROOT / "job" / "train" / "distributed"
    client, server = imported_modules(distributed / "lock_client.py"), imported_modules(distributed / "lock_server.py")
    assert "job.train.distributed.lock_server" not in client
    assert not any(m.startswith("job.train.distributed.lock_client") for m in server)
    assert any(m.startswith("job.train.distributed.protocol") for m in client)
    assert any(m.startswith("job.train.distributed.protocol") for m in server)
    # no other module builds or reads the protocol's wire messages by hand
    wire = [str(p.relative_to(ROOT)) for p in python_files(*PRODUCT)
            if p.name != "protocol.py" and re.search(r"[\"']op[\"']\s*:", p.read_text())]
    assert not wire, wire


# module names held in strings --------------------------------------------------------------------------------------


def names_in_strings() -> list[str]:
    from job.train.elastic import launch, spare
    from job.train.hogwild import spawning

    names = [*spare.WARM_IMPORTS, *spawning.PRELOAD]
    names += re.findall(r"-m (job[\w.]*)", (ROOT / "docker" / "entrypoint.sh").read_text())
    names += re.findall(r"\"(job\.[\w.]+)\"", (ROOT / "job" / "train" / "elastic" / "launch.py").read_text())
    names += re.findall(r"-m (job[\w.]*)", (ROOT / "charts" / "biggraph" / "templates" / "_helpers.tpl").read_text())
    assert launch.__name__ == "job.train.elastic.launch"
    return sorted(set(names))


@pytest.mark.parametrize("module", names_in_strings())
def test_every_module_name_held_in_a_string_imports(module: str) -> None:
    assert importlib.import_module(module) is not None


def test_the_vocabulary_the_memory_arithmetic_the_protocol_and_recovery_load_no_torch() -> None:
    """``biggraph submit`` sizes pods (job/k8s/sizing.py over residency/budget.py) on a machine that may have no torch
    loaded; the checkpoint package and the lock protocol's messages need none either."""
    import subprocess
    import sys

    code = ("import sys, job.types, job.train.residency.budget, job.train.distributed.protocol, job.checkpoint, "
            "job.k8s.sizing; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
