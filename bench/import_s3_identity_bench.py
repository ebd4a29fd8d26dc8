"""The identity target of the parallel import on S3: 1 process and N pods, from and to (moto) S3, byte-identical.

A generated TSV graph (ids like Wikidata's, uniform, dynamic relations; ``import_bench.generate``) in ``--files``
files is uploaded to a moto server (its own process, on 127.0.0.1), then imported twice, each into its own prefix:

- ``1 process``: ``biggraph import CONFIG s3://.../part-XX.tsv ...`` (pod 0 of 1, its staging in a local temporary
  directory);
- ``N pods``: ``biggraph import ... --pods N``: N local processes running the code an Indexed Job's pods run, meeting
  in the staging directory the pods of a cluster use (on S3, beside ``entity_path``);
- with ``--box``, ``N box pods`` instead: the import stage that ``biggraph submit --stages import --replicas N``
  renders through the chart (``helm template``), run as an Indexed Job of N pods in the cluster in a box
  (tests/cluster_box.py: each pod its own network namespace and hostname, the rendered command, env, ConfigMap and
  Secret refs), reading from and writing to the moto server over the box's bridge. Needs root, iproute2 and helm.

Every object of the two outputs is compared by SHA-256 (the import marker excepted: its fingerprint names the output
paths). With ``--pbg``, PBG 1.0.0 then trains one epoch on one edge path of the N-pod output (downloaded: PBG reads
local files only). Moto is for correctness, not speed (docs: ../shared/notes/test-infrastructure.md): the times
printed are what this machine did with moto in the loop, not a storage figure.

    flock /work/bench.lock .venv/bin/python bench/import_s3_identity_bench.py --edges 20000000 --files 16 --pods 4
    flock /work/bench.lock .venv/bin/python bench/import_s3_identity_bench.py --edges 20000000 --files 16 --pods 4 --box
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from import_bench import generate  # noqa: E402
from import_pods_bench import run_all  # noqa: E402
from machine import matmul_rate  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
BUCKET = "bench-import"
MARKER = ".biggraph-import.json"
AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_moto(port: int, log: Path, host: str = "127.0.0.1") -> subprocess.Popen:
    """A moto server in its own process (``host`` 0.0.0.0: the box's pods dial it on their bridge's .1)."""
    server = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-H", host, "-p", str(port)],
                              stdout=open(log, "w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server
        except OSError:
            time.sleep(0.2)
    server.kill()
    raise SystemExit(f"moto_server did not start:\n{log.read_text()[-2000:]}")


def write_config(path: Path, prefix: str, partitions: int, files: int, endpoint: str) -> Path:
    """One edge path per input file (PBG's rule: the i-th file is the i-th edge set)."""
    path.write_text(json.dumps({
        "entities": {"all": {"num_partitions": partitions}},
        "relations": [{"name": "all_edges", "lhs": "all", "rhs": "all", "operator": "translation"}],
        "dynamic_relations": True, "global_emb": False, "dimension": 16,
        "entity_path": f"{prefix}/entities", "edge_paths": [f"{prefix}/edges_{i:02d}" for i in range(files)],
        "checkpoint_path": f"{prefix}/model", "storage_options": {"endpoint_url": endpoint},
    }))
    return path


def digests(fs: object, prefix: str) -> dict[str, str]:
    """SHA-256 of every object under ``prefix`` (relative name -> digest), the import marker and staging left out."""
    root = prefix.removeprefix("s3://")
    found = {}
    for name in fs.find(root):  # type: ignore[attr-defined]
        relative = name[len(root):].lstrip("/")
        if relative.endswith(MARKER) or ".biggraph-import-staging" in relative:
            continue
        found[relative] = hashlib.sha256(fs.cat_file(name)).hexdigest()  # type: ignore[attr-defined]
    return found


def box_import(*, config: Path, inputs: list[str], columns: list[str], pods: int, subnet: str, endpoint: str,
               work: Path) -> tuple[float, int]:
    """The chart's rendered import stage on ``pods`` pods of the cluster in a box; (wall seconds, pods started).

    ``biggraph submit --dry-run`` renders the release exactly as a real submit would (helm template); the box then runs
    the Indexed Job's pods as Kubernetes would, each in its own network namespace, with the rendered command, env
    (the S3 keys through the rendered secretKeyRefs) and the ConfigMap mounted at /etc/biggraph."""
    sys.path.insert(0, str(REPO / "tests"))
    import yaml
    from cluster_box import ClusterBox, RenderedJob, available
    from test_chart import helm_binary, helm_env

    reason = available()
    if reason is not None:
        raise SystemExit(f"--box: the cluster in a box cannot run here: {reason}")
    helm = helm_binary()
    argv = [sys.executable, "-m", "job", "submit", str(config), "--name", "imp", "--stages", "import", "--dry-run",
            "--helm", helm, "--replicas", str(pods), "--set", "s3.existingSecret=s3",
            "--set", f"s3.endpointUrl={endpoint}", "--set", "importer.files={" + ",".join(inputs) + "}",
            "--set", "importer.args={" + ",".join(columns) + "}"]
    env = {**os.environ, **{k: v for k, v in helm_env(work).items() if k.startswith("HELM_")}}
    rendered = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
    if rendered.returncode != 0:
        raise SystemExit(f"biggraph submit --dry-run failed:\n{rendered.stderr[-3000:]}")
    docs = [d for d in yaml.safe_load_all(rendered.stdout) if d]
    job = RenderedJob.from_docs([d for d in docs if d["metadata"]["name"].startswith("imp-import")])
    secrets = {"s3": {k: AWS_ENV[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}}
    box = ClusterBox(job, work / "box", max_replicas=pods, subnet=subnet, secrets=secrets)
    started = time.monotonic()
    try:
        box.start()
        box.wait(3600)
    finally:
        box.close()
    if box.failed_reason is not None or not box.complete:
        raise SystemExit(f"the box's import Job did not complete: {box.failed_reason}\n{box.tail()}")
    return time.monotonic() - started, sum(1 for e in box.events if e.kind == "start")


def pbg_trains(fs: object, prefix: str, partitions: int, work: Path) -> float:
    """PBG 1.0.0 trains one epoch on edge path 0 of the import at ``prefix`` (downloaded); its wall seconds."""
    sys.path.insert(0, str(REPO / "tests"))
    from test_import_pods import PBG_TRAIN

    local = work / "pbg"
    shutil.rmtree(local, ignore_errors=True)
    root = prefix.removeprefix("s3://")
    for sub in ("entities", "edges_00"):
        fs.get(f"{root}/{sub}", str(local / sub), recursive=True)  # type: ignore[attr-defined]
    raw = {"entities": {"all": {"num_partitions": partitions}},
           "relations": [{"name": "all_edges", "lhs": "all", "rhs": "all", "operator": "translation"}],
           "dynamic_relations": True, "global_emb": False, "dimension": 16, "num_epochs": 1, "workers": 2,
           "entity_path": str(local / "entities"), "edge_paths": [str(local / "edges_00")],
           "checkpoint_path": str(local / "model"), "num_uniform_negs": 50, "batch_size": 1000}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", PBG_TRAIN, json.dumps(raw)], cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"PBG 1.0.0 failed on the import:\n{done.stderr[-3000:]}")
    return time.monotonic() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--edges", type=int, default=20_000_000)
    parser.add_argument("--entities", type=int, default=1_000_000)
    parser.add_argument("--relations", type=int, default=100)
    parser.add_argument("--files", type=int, default=16)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--pods", type=int, default=4)
    parser.add_argument("--box", action="store_true", help="the N pods are the chart's rendered import Job in the "
                        "cluster in a box (tests/cluster_box.py; needs root, iproute2, helm)")
    parser.add_argument("--pbg", action="store_true", help="PBG 1.0.0 trains an epoch on edge path 0 of the N-pod import")
    parser.add_argument("--dir", default=None, help="work directory (default: a temp dir, removed afterwards)")
    args = parser.parse_args()

    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="biggraph-import-s3-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"machine: float32 matmul {matmul_rate():.0f} GFLOP/s, {os.cpu_count()} CPUs", flush=True)
    port = free_port()
    server = start_moto(port, root / "moto.log", host="0.0.0.0" if args.box else "127.0.0.1")
    endpoint = f"http://127.0.0.1:{port}"
    subnet = ""
    if args.box:
        sys.path.insert(0, str(REPO / "tests"))
        from cluster_box import free_subnet

        subnet = free_subnet()
    os.environ.update(AWS_ENV)
    try:
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, endpoint_url=endpoint)
        fs.mkdir(BUCKET)
        per_file = args.edges // args.files
        edges = per_file * args.files
        started = time.monotonic()
        inputs = []
        for i in range(args.files):
            path = root / f"part-{i:02d}.tsv"
            if not path.exists():
                generate(path, per_file, args.entities, args.relations, seed=i)
            fs.put_file(str(path), f"{BUCKET}/raw/{path.name}")
            inputs.append(f"s3://{BUCKET}/raw/{path.name}")
        size = sum(os.path.getsize(root / f"part-{i:02d}.tsv") for i in range(args.files))
        print(f"input: {args.files} files on moto S3, {edges:,} edges, {size / 2**20:,.0f} MiB "
              f"(generated and uploaded in {time.monotonic() - started:.0f} s)", flush=True)
        columns = ["-l", "0", "-r", "2", "--rel-col", "1"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        outputs = {}
        print("\n| importer | edges | wall | CPU (all processes) | output objects |")
        print("|---|---|---|---|---|")
        runs = (("1 process", []), (f"{args.pods} {'box pods' if args.box else 'pods'}", ["--pods", str(args.pods)]))
        for name, extra in runs:
            prefix = f"s3://{BUCKET}/{'one' if not extra else 'pods'}"
            if extra and args.box:  # the pods reach the store on the box's bridge
                pods_endpoint = f"http://{subnet}.1:{port}"
                config = write_config(root / "pods.json", prefix, args.partitions, args.files, pods_endpoint)
                wall, started_pods = box_import(config=config, inputs=inputs, columns=columns, pods=args.pods,
                                                subnet=subnet, endpoint=pods_endpoint, work=root)
                cpu_text = f"({started_pods} pods started)"
            else:
                config = write_config(root / f"{prefix.rsplit('/', 1)[1]}.json", prefix, args.partitions, args.files,
                                      endpoint)
                argv = [sys.executable, "-m", "job", "import", str(config), *inputs, *columns, *extra]
                [(wall, cpu, _)] = run_all([argv], [root / f"{prefix.rsplit('/', 1)[1]}.log"], env, REPO)
                cpu_text = f"{cpu:.1f} s"
            outputs[name] = digests(fs, prefix)
            print(f"| {name} | {edges:,} | {wall:.1f} s | {cpu_text} | {len(outputs[name])} |", flush=True)
        one, pods = outputs.values()
        same = one == pods and len(one) > 0
        differing = sorted(k for k in set(one) | set(pods) if one.get(k) != pods.get(k))
        print(f"\n{args.pods}-pod output on S3 byte-identical to the 1-process output on S3: {same} ({len(one)} objects"
              + (f"; differing: {differing[:10]}" if differing else "") + ")", flush=True)
        if args.pbg and same:
            seconds = pbg_trains(fs, f"s3://{BUCKET}/pods", args.partitions, root)
            print(f"PBG 1.0.0 trained an epoch on edge path 0 of the {args.pods}-pod import ({per_file:,} edges) in "
                  f"{seconds:.0f} s", flush=True)
        return 0 if same else 1
    finally:
        server.terminate()
        server.wait()
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
