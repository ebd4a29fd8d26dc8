"""What ``pip install`` of the wheel gives a user: ``biggraph submit`` renders a job from anywhere, with the chart the
wheel ships (setup.py copies the top-level ``charts/biggraph`` into ``job/k8s/_bundled/``), not with files of a
checkout the user does not have; and training runs the native kernels the wheel carries (setup.py builds them),
with no compiler on the machine.

The wheel is built from a copy of the repository's files (``git ls-files``), installed with its dependencies into
a fresh venv outside the repository (no system site-packages, no PYTHONPATH), and run from a directory outside it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
HELM = REPO / ".cache" / "bin" / "helm"


def _source_copy(target: Path) -> Path:
    """The files a checkout holds (tracked, and new ones not ignored): no build/, .venv or stale egg-info."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, timeout=60)
    if listed.returncode != 0:
        pytest.skip(f"not a git checkout: {listed.stderr.decode().strip()[:200]}")
    for name in filter(None, listed.stdout.decode().split("\0")):
        source = REPO / name
        if source.is_file() and not name.startswith("tests/"):
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    return target


def _has_setuptools() -> bool:
    try:
        import setuptools
    except ImportError:
        return False
    return int(setuptools.__version__.split(".")[0]) >= 68  # pyproject.toml's build-system requirement


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("wheel")
    source = _source_copy(root / "src")
    # the build backend of this environment when it has one (offline, fast); else pip fetches pyproject's
    isolation = ["--no-build-isolation"] if _has_setuptools() else []
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q",
                            "--wheel-dir", str(root / "dist"), str(source)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    return next((root / "dist").glob("biggraph-*.whl"))


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv (outside the repository) with the wheel and its dependencies: its bin directory."""
    venv = tmp_path_factory.mktemp("user-venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "BIGGRAPH_CHART", "VIRTUAL_ENV")}
    # torch pinned as tests/run.sh installs it (the CPU wheel); unpinned, pip may take a newer CUDA build (GBs)
    install = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "torch==2.13.0", str(wheel)],
                             capture_output=True, text=True, timeout=600, env=env)
    if install.returncode != 0:
        pytest.skip(f"cannot install the wheel's dependencies: {install.stderr.strip()[-300:]}")
    return venv / "bin"


def test_the_wheel_ships_the_chart(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for relative in ("charts/biggraph",):
        expected = {f"job/k8s/_bundled/{p.relative_to(REPO)}" for p in (REPO / relative).rglob("*") if p.is_file()}
        assert expected and expected <= names, sorted(expected - names)



def test_the_wheel_carries_the_built_kernels_for_its_platform(wheel: Path) -> None:
    """The kernels are compiled into the wheel (job/native/_ext/kernels.so), which is tagged for the platform, not
    for a Python version: the library uses libc only."""
    assert "job/native/_ext/kernels.so" in set(zipfile.ZipFile(wheel).namelist())
    _, _, python, abi, platform = wheel.name[:-len(".whl")].split("-")
    assert (python, abi) == ("py3", "none") and platform != "any"

def user_run(bin_dir: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """A command of the venv as a user runs it: no PYTHONPATH to the checkout, no BIGGRAPH_CHART."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "BIGGRAPH_CHART", "VIRTUAL_ENV")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run([str(bin_dir / args[0]), *args[1:]], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env=env)


CONFIG = {
    "entities": {"node": {"num_partitions": 1}},
    "relations": [{"name": "r", "lhs": "node", "rhs": "node", "operator": "diagonal"}],
    "dimension": 16, "entity_path": "s3://bucket/graph/entities", "edge_paths": ["s3://bucket/graph/edges"],
    "checkpoint_path": "s3://bucket/graph/model",
}


@pytest.mark.slow
def test_an_installed_wheel_renders_a_job_from_outside_the_repository(installed: Path, tmp_path: Path) -> None:
    work = tmp_path / "user"
    work.mkdir()
    (work / "config.yaml").write_text(yaml.safe_dump(CONFIG))
    where = user_run(installed, work, "python", "-c", "import job.k8s.render as r; print(r.find_chart())")
    assert where.returncode == 0 and where.stdout.startswith(str(installed.parent)), where  # the wheel's chart
    if not HELM.is_file():
        pytest.skip(f"no helm at {HELM} (tests/k8s_tools.sh installs it)")
    flags = ["--helm", str(HELM)]
    done = user_run(installed, work, "biggraph", "submit", "config.yaml", "--dry-run", "--name", "user-job", *flags)
    assert done.returncode == 0, done.stderr[-2000:]
    objects = [o for o in yaml.safe_load_all(done.stdout) if o]
    kinds = {o["kind"] for o in objects}
    assert {"Job", "ConfigMap", "Service", "NetworkPolicy"} <= kinds
    job = next(o for o in objects if o["kind"] == "Job")
    assert job["metadata"]["name"] == "user-job"
    config_map = next(o for o in objects if o["kind"] == "ConfigMap")
    assert yaml.safe_load(config_map["data"]["config.yaml"])["checkpoint_path"] == CONFIG["checkpoint_path"]


EDGES = "".join(f"e{i}\tr{i % 2}\te{(i * 7 + 3) % 40}\n" for i in range(400))


@pytest.mark.slow
def test_an_installed_wheel_trains_with_its_kernels_without_a_compiler(installed: Path, tmp_path: Path) -> None:
    """No ``CC``, no ``cc``/``gcc`` on PATH, an empty kernel cache: training still runs the native kernels, the
    wheel's (job.native logs which library it loaded, in each process that loads one)."""
    work = tmp_path / "user"
    work.mkdir()
    (work / "edges.tsv").write_text(EDGES)
    config = {"entities": {"node": {"num_partitions": 1}},
              "relations": [{"name": "r0", "lhs": "node", "rhs": "node"}, {"name": "r1", "lhs": "node", "rhs": "node"}],
              "dimension": 8, "num_epochs": 1, "batch_size": 50, "num_uniform_negs": 5, "num_batch_negs": 5,
              "workers": 1, "eval_fraction": 0.0, "entity_path": str(work / "entities"),
              "edge_paths": [str(work / "edges")], "checkpoint_path": str(work / "model")}
    (work / "config.yaml").write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "BIGGRAPH_CHART", "VIRTUAL_ENV", "CC")}
    env.update(PATH=str(installed), BIGGRAPH_NATIVE_CACHE=str(tmp_path / "kernel-cache"))
    assert not [c for c in ("cc", "gcc") if shutil.which(c, path=env["PATH"])]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(installed / "biggraph"), *args], cwd=work, capture_output=True, text=True,
                              timeout=300, env=env)

    imported = run("import", "config.yaml", "edges.tsv", "-l", "0", "-r", "2", "--rel-col", "1")
    assert imported.returncode == 0, imported.stderr[-2000:]
    trained = run("train", "config.yaml")
    assert trained.returncode == 0, trained.stderr[-2000:]
    site = next(installed.parent.glob("lib/python*/site-packages"))
    assert "native kernels: built with the package, " in trained.stderr, trained.stderr[-2000:]
    assert f"({site / 'job' / 'native' / '_ext' / 'kernels.so'})" in trained.stderr
    assert "native kernels unavailable" not in trained.stderr and not (tmp_path / "kernel-cache").exists()
    assert (work / "model" / "training_stats.json").is_file()
