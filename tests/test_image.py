"""The container image itself, built and run: what tests/test_dockerfile.py can only read.

tests/image.sh builds the Dockerfile with buildah (chroot isolation, vfs storage) on a Debian bookworm
base made here with debootstrap (python:3.11-slim cannot be pulled), torch coming from the local CPU
wheel through the Dockerfile's `torch-wheels` build context. Each "container" is then the image's
real ENTRYPOINT, ENV and WORKDIR, run as uid/gid 10001 on a read-only view of the image's root
filesystem with /tmp and /dev/shm writable and host networking, the way the Job's pods run it
(k8s/base/job.yaml). Needs root, apt (for buildah and debootstrap) and the package registries; skips
with the reason otherwise. The build's time and size land in .cache/image-test/last-build.json.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers_distributed import free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "image.sh"
CACHE = REPO / ".cache" / "image-test"
TAG = "localhost/biggraph:test-cpu"
# the CPU image measured 1.10 GB (2026-11-23): room for dependency drift, not for CUDA or a compiler
MAX_IMAGE_BYTES = 1_400_000_000


@dataclass
class Image:
    tag: str
    root: Path  # the working container's root filesystem (buildah mount)
    build_seconds: int
    size_bytes: int
    config: dict
    docker_config: dict
    env: dict

    def start(self, args: list[str], log: Path, *, name: str = "biggraph", env: dict | None = None,
              volumes: tuple[str, ...] = (), tmp: Path | None = None) -> subprocess.Popen:
        command = ["bash", str(SCRIPT), "run", self.tag, str(self.root), "--name", name]
        for key, value in (env or {}).items():
            command += ["-e", f"{key}={value}"]
        for volume in volumes:
            command += ["-v", volume]
        if tmp is not None:
            command += ["--tmp", str(tmp)]
        # its own session: a hung container is stopped as a whole (see stop())
        return subprocess.Popen([*command, "--", *args], stdout=log.open("w"), stderr=subprocess.STDOUT, env=self.env,
                                start_new_session=True)

    def run(self, args: list[str], log: Path, timeout: float = 300, **kwargs: object) -> tuple[int, str]:
        proc = self.start(args, log, **kwargs)  # type: ignore[arg-type]
        return wait(proc, timeout, log), log.read_text()


def stop(proc: subprocess.Popen) -> None:
    """TERM first (the entrypoint forwards it to torchrun, which stops its workers), then KILL."""
    for sig, grace in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def wait(proc: subprocess.Popen, timeout: float, log: Path) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(proc)
        raise AssertionError(f"container still running after {timeout:.0f} s:\n{log.read_text()[-4000:]}") from None


def owned_by_container_user(*paths: Path) -> None:
    """A volume the pod may write to (fsGroup 10001 on Kubernetes)."""
    for path in paths:
        path.mkdir(parents=True, exist_ok=True)
        os.chown(path, 10001, 10001)


def script(*args: str, env: dict, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def image() -> Iterator[Image]:
    if not sys.platform.startswith("linux"):
        pytest.skip("the image test needs Linux (buildah, mount namespaces, chroot)")
    # PYTHON: the pip that finds the CPU torch wheel (with this run's pip configuration)
    env = dict(os.environ, IMAGE_TEST_STORE=str(CACHE / "storage"), PYTHON=sys.executable)
    script("clean", env=env, timeout=300)  # what a killed earlier run may have left
    started = time.monotonic()
    built = script("build", TAG, env=env, timeout=900)
    if built.returncode == 77:
        pytest.skip(built.stderr.strip().splitlines()[-1])
    assert built.returncode == 0, built.stdout + built.stderr[-6000:]
    facts = dict(line.split("=", 1) for line in built.stdout.splitlines() if "=" in line)
    try:
        mounted = script("mount", TAG, env=env, timeout=300)
        assert mounted.returncode == 0, mounted.stderr
        inspect = subprocess.run(
            ["buildah", "--root", f"{env['IMAGE_TEST_STORE']}/root", "--runroot", f"{env['IMAGE_TEST_STORE']}/run",
             "--storage-driver", "vfs", "inspect", "--type", "image", TAG],
            capture_output=True, text=True, check=True,
        )
        description = json.loads(inspect.stdout)
        result = Image(TAG, Path(mounted.stdout.strip().splitlines()[-1]), int(facts["build_seconds"]),
                       int(facts["size_bytes"]), description["OCIv1"]["config"], description["Docker"]["config"], env)
        CACHE.joinpath("last-build.json").write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d"), "build_seconds": result.build_seconds, "size_bytes": result.size_bytes,
            "base_and_build_seconds": round(time.monotonic() - started), "nproc": os.cpu_count(),
        }, indent=1))
        yield result
    finally:
        script("clean", env=env, timeout=300)


# the image's contents ---------------------------------------------------------------------------------


def test_image_config_is_the_pods(image: Image) -> None:
    config = image.config
    assert config["User"] == "10001:10001"
    assert config["Entrypoint"] == ["/usr/local/bin/biggraph-entrypoint"]
    assert config["Cmd"][-3:] == ["job", "train", "/etc/biggraph/config.yaml"]
    assert config["WorkingDir"] == "/tmp"
    env = dict(item.split("=", 1) for item in config["Env"])
    assert env["PATH"].startswith("/opt/venv/bin:") and env["HOME"] == "/tmp"
    assert image.docker_config["Healthcheck"]["Test"] == ["NONE"]  # a batch job: nothing to probe
    assert config["Labels"]["io.biggraph.torch-variant"] == "cpu"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def resolve_in(root: Path, path: str) -> Path:
    """The file `path` names inside the image: symbolic links followed as the container sees them."""
    for _ in range(20):
        host = root / path.lstrip("/")
        if not host.is_symlink():
            return host
        target = os.readlink(host)
        path = target if target.startswith("/") else os.path.normpath(os.path.join(os.path.dirname(path), target))
    raise AssertionError(f"symbolic link loop at {path}")


def test_runtime_stage_holds_the_venv_and_nothing_for_building(image: Image) -> None:
    root = image.root
    print(f"\nimage {image.tag}: {image.size_bytes / 1e9:.2f} GB unpacked, built in {image.build_seconds} s")
    assert image.size_bytes < MAX_IMAGE_BYTES
    venv = root / "opt" / "venv"
    site = venv / "lib" / "python3.11" / "site-packages"
    # the venv survived COPY --from=builder: its interpreter link resolves inside the runtime stage
    assert resolve_in(root, "/opt/venv/bin/python").is_file()
    assert (venv / "bin" / "biggraph").read_text().startswith("#!/opt/venv/bin/python")
    dists = {re.sub(r"-[^-]+\.dist-info$", "", p.name).lower(): p.name for p in site.glob("*.dist-info")}
    assert dists["torch"] == "torch-2.13.0+cpu.dist-info"
    assert not [name for name in dists if name.startswith("nvidia")], "CUDA libraries in the CPU image"
    assert {"biggraph", "s3fs", "kubernetes", "h5py", "pyarrow", "pip"} <= set(dists)  # [s3,k8s]; pip for the demo
    assert (site / "torch" / "bin" / "torch_shm_manager").exists()
    # the versions the tests ran with and tests/audit.sh audits (torch's pin is TORCH_VERSION's)
    pins = dict(line.split("==", 1) for line in (REPO / "requirements.lock").read_text().splitlines() if "==" in line)
    pins = {canonical(name): version.strip() for name, version in pins.items()}
    installed = {canonical(name): dist[len(name) + 1:-len(".dist-info")] for name, dist in dists.items()}
    drift = {name: (version, pins[name]) for name, version in installed.items() if name in pins and name != "torch"
             and version != pins[name]}
    assert not drift, f"image version != requirements.lock: {drift}"
    assert len(set(installed) & set(pins)) > 30
    # nothing only a build needs
    assert not (site / "torch" / "include").exists() and not list((site / "torch" / "bin").glob("protoc*"))
    # bytecode for what an import, eval or export pod loads (the Dockerfile's BYTECODE_PACKAGES), none for torch
    compiled = {path.relative_to(site).parts[0] for path in site.rglob("*.pyc")}
    assert compiled == {"job", "storage_adapters", "numpy", "h5py", "pyarrow", "fsspec", "s3fs", "aiobotocore",
                        "botocore", "aiohttp", "yaml"}, compiled
    assert sum(path.stat().st_size for path in site.rglob("*.pyc")) < 40e6
    assert not [p for p in site.rglob("tests") if p.is_dir()]
    assert not (root / "src").exists() and not (root / "wheels").exists() and not (root / "root" / ".cache").exists()
    assert not [c for c in ("gcc", "cc", "g++", "make") if (root / "usr" / "bin" / c).exists()]
    # ... but the native kernels the wheel carries, for the runtime's CPU whatever the build host's (target_clones)
    assert (site / "job" / "native" / "_ext" / "kernels.so").is_file()
    assert not (site / "job" / "native" / "_prebuilt").exists()
    # only the packages of the wheel: no tests, no bench, no repository files
    assert {p.name for p in site.iterdir() if p.is_dir() and not p.name.endswith(".dist-info")} >= {"job", "storage_adapters"}
    assert not (site / "tests").exists() and not (site / "bench").exists()
    # the chart for `biggraph submit`, and the entrypoint byte for byte
    assert (root / "opt" / "biggraph" / "charts" / "biggraph" / "Chart.yaml").exists()
    entrypoint = root / "usr" / "local" / "bin" / "biggraph-entrypoint"
    assert entrypoint.read_bytes() == (REPO / "docker" / "entrypoint.sh").read_bytes()
    assert os.stat(entrypoint).st_mode & 0o111 == 0o111


# running it -------------------------------------------------------------------------------------------

PROBE = """
import errno, json, os, shutil
import job, job.native as native, kubernetes, s3fs, torch
import sys, job.cli.importing, job.data.importing.pods, job.data.importing.assemble, storage_adapters, h5py
import pyarrow.csv
def writable(path):
    try:
        with open(os.path.join(path, ".probe"), "w"):
            pass
    except OSError as error:
        return errno.errorcode[error.errno]
    os.unlink(os.path.join(path, ".probe"))
    return "yes"
print("PROBE " + json.dumps({
    "uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(), "cwd": os.getcwd(), "home": os.environ["HOME"],
    "root": writable("/"), "venv": writable("/opt/venv"), "tmp": writable("/tmp"), "shm": writable("/dev/shm"),
    "torch": torch.__version__, "biggraph": job.__version__, "cli": shutil.which("biggraph"),
    "native": str(getattr(native.loaded(), "path", None)),
    # modules an import pod loads that were compiled at this start (no .pyc beside their source)
    "compiled_at_start": sorted(name for name, module in list(sys.modules.items())
                                if name.split(".")[0] in {"job", "storage_adapters", "numpy", "h5py", "pyarrow", "s3fs"}
                                and getattr(module, "__cached__", None) and not os.path.exists(module.__cached__)),
}))
"""


def test_entrypoint_runs_as_10001_on_a_read_only_root(image: Image, tmp_path: Path) -> None:
    code, out = image.run(["python", "-c", PROBE], tmp_path / "probe.log", timeout=120)
    assert code == 0, out
    probe = json.loads(out.split("PROBE ", 1)[1].splitlines()[0])
    assert (probe["uid"], probe["gid"], probe["groups"]) == (10001, 10001, [])
    assert probe["cwd"] == "/tmp" and probe["home"] == "/tmp"
    assert probe["root"] == "EROFS" and probe["venv"] == "EROFS"
    assert probe["tmp"] == "yes" and probe["shm"] == "yes"
    assert probe["torch"] == "2.13.0+cpu" and probe["cli"] == "/opt/venv/bin/biggraph"
    # the wheel's kernels load as uid 10001 on a read-only root: no compiler, nothing written
    assert probe["native"] == "/opt/venv/lib/python3.11/site-packages/job/native/_ext/kernels.so"
    # an import pod's modules start from the image's bytecode: none compiled (and nothing written) at start
    assert probe["compiled_at_start"] == [], probe["compiled_at_start"]


@pytest.fixture(scope="module")
def demo(image: Image, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """`biggraph demo` in the image. /tmp is a host directory (an emptyDir) so that the graphs the demo
    downloaded can be reused below; the output goes to a volume."""
    work = tmp_path_factory.mktemp("image-demo")
    tmp, data = work / "tmp", work / "data"
    owned_by_container_user(tmp, data)
    started = time.monotonic()
    code, out = image.run(["biggraph", "demo", "--out", "/data/demo"], work / "demo.log", timeout=420,
                          volumes=(f"{data}:/data",), tmp=tmp)
    return {"code": code, "log": out, "seconds": time.monotonic() - started, "data": data,
            "datasets": tmp / ".cache" / "biggraph" / "datasets"}


def test_demo_downloads_trains_and_evaluates_in_the_image(demo: dict) -> None:
    assert demo["code"] == 0, demo["log"][-6000:]
    # the graphs came from PyPI through the image's own pip, into $XDG_CACHE_HOME under /tmp
    assert "downloading the pykeen" in demo["log"]
    assert (demo["datasets"] / "umls" / "train.txt").exists()
    printed = re.search(r"test \(filtered, all entities\): MRR (\d\.\d+)", demo["log"])
    assert printed, demo["log"][-3000:]
    out = demo["data"] / "demo"
    metrics = json.loads((out / "test_metrics.json").read_text())
    assert metrics["mrr"] == pytest.approx(float(printed.group(1)), abs=1e-4)
    assert metrics["mrr"] > 0.5 and metrics["count"] == 661  # ~0.8 after 25 epochs (bench/RESULTS.md)
    assert (out / "checkpoints" / "checkpoint_version.txt").read_text().strip() == "25"
    assert (out / "export" / "entity_embeddings.tsv").stat().st_size > 0
    assert (out / "checkpoints" / "model.v25.h5").stat().st_uid == 10001


DIST_CONFIG = """\
entity_path: /data/dist/data
edge_paths: [/data/dist/data/train]
checkpoint_path: /data/dist/checkpoints
entities: {all: {num_partitions: 4}}
relations: [{name: all_edges, lhs: all, rhs: all, operator: complex_diagonal}]
dynamic_relations: true
dimension: 64
global_emb: false
comparator: dot
num_uniform_negs: 100
loss_fn: softmax
lr: 0.1
batch_size: 200
eval_fraction: 0.0
num_epochs: 4
workers: 1
seed: 0
"""


def test_two_containers_train_together_under_torchrun(image: Image, demo: dict, tmp_path: Path) -> None:
    """Two pods of an Indexed Job: the same arguments as k8s/base/job.yaml's (c10d on pod 0's store), the
    config from a read-only mount at /etc/biggraph, data and checkpoints on a volume both see."""
    if demo["code"] != 0:
        pytest.skip("the demo failed in the image, so there is no graph to train on (see the demo test)")
    config_dir, data = tmp_path / "config", tmp_path / "data"
    config_dir.mkdir()
    (config_dir / "config.yaml").write_text(DIST_CONFIG)
    owned_by_container_user(data, data / "umls", tmp_path / "tmp0", tmp_path / "tmp1")
    for split in ("train", "valid", "test"):
        shutil.copy(demo["datasets"] / "umls" / f"{split}.txt", data / "umls")
    volumes = (f"{config_dir}:/etc/biggraph:ro", f"{data}:/data")
    code, out = image.run(["biggraph", "import", "/etc/biggraph/config.yaml", "/data/umls/train.txt",
                           "-l", "0", "--rel-col", "1", "-r", "2"], tmp_path / "import.log", timeout=180, volumes=volumes)
    assert code == 0, out

    port = free_port()
    args = ["--nnodes=2:2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=image-test", "--rdzv-conf=join_timeout=120", "--max-restarts=0",
            "-m", "job", "train", "/etc/biggraph/config.yaml"]
    procs, logs = [], [tmp_path / f"pod{i}.log" for i in range(2)]
    try:
        for index in range(2):
            env = {"JOB_COMPLETION_INDEX": str(index), "BIGGRAPH_RDZV_HOST_INDEX": "0", "POD_NAME": f"biggraph-job-{index}",
                   "BIGGRAPH_CONFIG": "/etc/biggraph/config.yaml", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                   "OMP_NUM_THREADS": "1"}
            procs.append(image.start(args, logs[index], name=f"biggraph-job-{index}", env=env, volumes=volumes,
                                     tmp=tmp_path / f"tmp{index}"))
        codes = [wait(proc, 300, log) for proc, log in zip(procs, logs)]
    finally:
        for proc in procs:
            if proc.poll() is None:
                stop(proc)
    texts = [log.read_text() for log in logs]
    assert codes == [0, 0], "\n".join(t[-4000:] for t in texts)
    ranks = []
    for index, text in enumerate(texts):
        host = "true" if index == 0 else "false"
        assert re.search(rf"biggraph-entrypoint: start .* index={index} rdzv_host={host} uid=10001 "
                         r"cmd=python -m job\.train\.elastic\.agent ", text), text
        assert "config ok" in text  # preflight ran before torchrun
        # the rendezvous hands out ranks in arrival order, not by completion index
        ranks += re.findall(r"\[rank (\d)\] training finished: checkpoint version 4 in /data/dist/checkpoints", text)
        assert re.search(rf"biggraph-entrypoint: exit code=0 seconds=\d+ index={index}", text), text
    assert sorted(ranks) == ["0", "1"], texts

    checkpoints = data / "dist" / "checkpoints"
    assert (checkpoints / "checkpoint_version.txt").read_text().strip() == "4"
    records = [json.loads(line) for line in (checkpoints / "training_stats.json").read_text().splitlines() if line.strip()]
    summaries = [r for r in records if r.get("pass_summary")]
    assert len(summaries) == 4 and all(s["world_size"] == 2 for s in summaries)
    buckets = [r for r in records if "lhs_partition" in r]
    assert {r["rank"] for r in buckets} == {0, 1}  # both containers trained buckets
    per_epoch: dict[int, list] = {}
    for record in buckets:
        per_epoch.setdefault(record["epoch_idx"], []).append((record["lhs_partition"], record["rhs_partition"]))
    assert all(sorted(b) == [(lhs, rhs) for lhs in range(4) for rhs in range(4)] for b in per_epoch.values()), per_epoch
