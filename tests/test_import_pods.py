"""The sharded import: 1 process and N pods write the same bytes, whatever the shards, their order or a lost pod.

Pods run as threads here (each through ``import_pod``, the code an Indexed Job's pod runs, against real
local or moto-S3 storage); the slow tests run them as real processes through ``biggraph import --pods N``.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import storage_adapters as storage
from job.cli import main
from job.config import load_config
from job.data.importing import ImportOptions, assemble, import_edges, import_pod, mapper
from job.data.importing.pods import CRASH_ENV, PodRole
from job.data.importing.staging import IMPORT_MARKER, Staging
from job.errors import UserError

REPO = Path(__file__).resolve().parent.parent
SHARD = 2048  # bytes: the small inputs below make several byte-range shards per file
# groups of 3 shards: each pod reads several groups (the unit a lost pod redoes)
OPTIONS = ImportOptions(lhs_col=0, rel_col=1, rhs_col=2, shard_size=SHARD, group_size=3 * SHARD, entity_min_count=2,
                        block_size=4096)


def write_inputs(root: Path, n: int = 4000, seed: int = 0) -> list[str]:
    """Two TSV files (the second without a final line break) of a skewed graph with 3 relation types."""
    rng = np.random.default_rng(seed)
    ids = [f"e{i}" for i in range(600)] + ["é-ünïcode", "an id that is rather longer than thirty-two bytes", "x"]
    lhs = np.minimum(rng.zipf(1.3, n), len(ids)) - 1
    rhs = rng.integers(0, len(ids), n)
    rel = rng.integers(0, 3, n)
    lines = [f"{ids[a]}\tr{r}\t{ids[b]}\n" for a, r, b in zip(lhs, rel, rhs)]
    root.mkdir(parents=True, exist_ok=True)
    (root / "a.tsv").write_text("".join(lines[: n // 2]))
    (root / "b.tsv").write_text("".join(lines[n // 2 :]).rstrip("\n"))
    return [str(root / "a.tsv"), str(root / "b.tsv")]


def write_config(path: Path, out: str, **extra: Any) -> str:
    raw: dict[str, Any] = {
        "entities": {"all": {"num_partitions": 3}},
        "relations": [{"name": "all", "lhs": "all", "rhs": "all", "operator": "translation"}],
        "dynamic_relations": True,
        "global_emb": False,
        "dimension": 4,
        "entity_path": f"{out}/entities",
        "edge_paths": [f"{out}/edges_a", f"{out}/edges_b"],
        "checkpoint_path": f"{out}/model",
    }
    raw.update(extra)
    path.write_text(json.dumps(raw))
    return str(path)


def digests(out: str) -> dict[str, str]:
    """Every output file's SHA-256 by path under ``out`` (the import marker names the request, so it is left out)."""
    found: dict[str, str] = {}
    for sub in ("entities", "edges_a", "edges_b"):
        for name in storage.listdir(storage.join(out, sub)):
            if name != IMPORT_MARKER:
                found[f"{sub}/{name}"] = hashlib.sha256(storage.read_bytes(storage.join(out, sub, name))).hexdigest()
    return found


def run_pods(config: str, files: list[str], count: int, *, staging: str, options: ImportOptions = OPTIONS,
             order: list[int] | None = None, before: Callable[[int], None] | None = None) -> dict[int, Any]:
    """Pods 0..count-1 as threads (started in ``order``; ``before(i)`` runs before pod i starts); result per pod."""
    results: dict[int, Any] = {}

    def pod(index: int) -> None:
        try:
            results[index] = import_pod(load_config(config), files, options, PodRole(index, count, staging))
        except BaseException as err:  # the test inspects it
            results[index] = err

    threads = []
    for index in order or list(range(count)):
        if before is not None:
            before(index)
        thread = threading.Thread(target=pod, args=(index,), daemon=True)  # a failed test must not hang on them
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join(120)
    return results


@pytest.fixture
def reference(tmp_path: Path) -> tuple[list[str], dict[str, str]]:
    """The inputs and what one process makes of them (several byte-range shards per file)."""
    files = write_inputs(tmp_path / "in")
    config = write_config(tmp_path / "one.json", str(tmp_path / "one"))
    summary = import_edges(load_config(config), files, OPTIONS)
    assert summary.edges_read == 4000 and 0 < summary.edges_written < 4000  # entity_min_count=2 drops some
    return files, digests(str(tmp_path / "one"))


def test_three_pods_write_the_same_bytes_as_one_process(tmp_path: Path, reference: tuple[list[str], dict[str, str]]) -> None:
    files, expected = reference
    assert len(expected) == 3 * 2 + 2 + 2 * (9 + 1)  # names and counts, dynamic relation files, 9 buckets and a manifest each
    config = write_config(tmp_path / "three.json", str(tmp_path / "three"))
    results = run_pods(config, files, 3, staging=str(tmp_path / "staging"))
    assert results[1] is None and results[2] is None and results[0].edges_read == 4000
    assert digests(str(tmp_path / "three")) == expected
    assert storage.listdir(str(tmp_path / "staging")) == []  # the commit removed the pieces
    # a resubmit finds the import committed and does nothing (the bucket files are not rewritten)
    before = os.stat(tmp_path / "three" / "edges_a" / "edges_0_0.h5").st_mtime_ns
    again = run_pods(config, files, 3, staging=str(tmp_path / "staging"))
    assert again[0].edges_written == results[0].edges_written
    assert os.stat(tmp_path / "three" / "edges_a" / "edges_0_0.h5").st_mtime_ns == before


@pytest.mark.parametrize("limit", [0, 150])
def test_pieces_kept_in_local_files_or_in_memory_write_the_same_bytes(
    tmp_path: Path, reference: tuple[list[str], dict[str, str]], monkeypatch: pytest.MonkeyPatch, limit: int
) -> None:
    """A shard's bucket pieces (phase 1) and a bucket's columns (phase 3) go to local files above
    ``PIECES_IN_MEMORY`` edges: 0 sends all there, 150 some (shards and buckets here hold ~100-250 edges)."""
    files, expected = reference  # made with the default limit: everything in memory
    monkeypatch.setattr(mapper, "PIECES_IN_MEMORY", limit)
    monkeypatch.setattr(assemble, "PIECES_IN_MEMORY", limit)
    config = write_config(tmp_path / "files.json", str(tmp_path / "files"))
    results = run_pods(config, files, 3, staging=str(tmp_path / "staging"))
    assert not any(isinstance(r, BaseException) for r in results.values()), results
    assert digests(str(tmp_path / "files")) == expected


def test_shard_size_and_the_order_pods_finish_in_change_nothing(
    tmp_path: Path, reference: tuple[list[str], dict[str, str]]
) -> None:
    files, expected = reference
    whole = ImportOptions(**{**OPTIONS.__dict__, "shard_size": 0})
    config = write_config(tmp_path / "whole.json", str(tmp_path / "whole"))
    import_edges(load_config(config), files, whole)
    assert digests(str(tmp_path / "whole")) == expected
    # pods 2 and 1 read all their shards before pod 0 starts: the last shards are committed first
    staging = str(tmp_path / "staging")
    config = write_config(tmp_path / "late.json", str(tmp_path / "late"))

    def hold_pod_0(index: int) -> None:
        if index == 0:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                done = [n for d in storage.listdir(staging) for n in storage.listdir(f"{staging}/{d}/done")]
                if len([n for n in done if n.startswith("group-")]) >= 6:  # pods 1 and 2 well ahead
                    return
                time.sleep(0.05)

    results = run_pods(config, files, 3, staging=staging, order=[2, 1, 0], before=hold_pod_0)
    assert not any(isinstance(r, BaseException) for r in results.values()), results
    assert digests(str(tmp_path / "late")) == expected


def test_a_pod_lost_before_committing_redoes_only_its_own_unit(
    tmp_path: Path, reference: tuple[list[str], dict[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    files, expected = reference
    staging = str(tmp_path / "staging")
    config = write_config(tmp_path / "lost.json", str(tmp_path / "lost"))
    commits: list[str] = []
    real_commit = Staging.commit

    lost: list[str] = []

    def commit(self: Staging, unit: str, record: dict) -> None:
        if threading.current_thread().name == "doomed" and unit.startswith("group-") and not lost and \
                any(u.startswith("group-") for u, pod in commits if pod == "doomed"):
            lost.append(unit)
            raise SystemExit("pod lost")  # its files are written, its marker is not
        commits.append((unit, threading.current_thread().name))
        real_commit(self, unit, record)

    monkeypatch.setattr(Staging, "commit", commit)
    # pod 1 of 3 dies before committing its second group; pods 0 and 2 wait for it at the end of phase 1
    results: dict[int, Any] = {}
    doomed = threading.Thread(name="doomed", daemon=True, target=lambda: results.update(
        lost=_catch(lambda: import_pod(load_config(config), files, OPTIONS, PodRole(1, 3, staging)))))
    others = run_pods_async(config, files, staging, [0, 2], results)
    doomed.start()
    doomed.join(60)
    assert isinstance(results["lost"], SystemExit)
    root = f"{staging}/{storage.listdir(staging)[0]}"
    number = lost[0].split("-")[1]
    assert storage.exists(f"{root}/groups/{number}/edges.bin") and not storage.exists(f"{root}/done/{lost[0]}.json")
    assert all(t.is_alive() for t in others)  # the others are waiting, not failing
    # the pod's replacement reads the lost group again; no unit committed before is done twice
    replaced = run_pods(config, files, 3, staging=staging, order=[1])
    for thread in others:
        thread.join(60)
    assert not isinstance(replaced[1], BaseException) and results[0].edges_read == 4000
    units = [unit for unit, _ in commits]
    assert lost[0] in units and len(units) == len(set(units))
    assert digests(str(tmp_path / "lost")) == expected


def _catch(func: Callable[[], Any]) -> Any:
    try:
        return func()
    except BaseException as err:
        return err


def run_pods_async(config: str, files: list[str], staging: str, indexes: list[int], results: dict) -> list[threading.Thread]:
    threads = []
    for index in indexes:
        thread = threading.Thread(daemon=True, target=lambda i=index: results.update(
            {i: _catch(lambda: import_pod(load_config(config), files, OPTIONS, PodRole(i, 3, staging)))}))
        thread.start()
        threads.append(thread)
    return threads


def test_three_pods_on_s3_write_the_same_bytes(
    tmp_path: Path, reference: tuple[list[str], dict[str, str]], s3_bucket: str, s3_endpoint: str
) -> None:
    files, expected = reference
    remote = []
    for path in files:
        storage.put_file(path, f"{s3_bucket}/raw/{Path(path).name}")
        remote.append(f"{s3_bucket}/raw/{Path(path).name}")
    config = write_config(tmp_path / "s3.json", f"{s3_bucket}/out", storage_options={"endpoint_url": s3_endpoint})
    results = run_pods(config, remote, 3, staging=f"{s3_bucket}/staging")
    assert not any(isinstance(r, BaseException) for r in results.values()), results
    assert digests(f"{s3_bucket}/out") == expected
    assert storage.listdir(f"{s3_bucket}/staging") == []


def test_a_bad_row_in_a_later_shard_names_file_and_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = write_inputs(tmp_path / "in")
    lines = Path(files[1]).read_text().split("\n")
    lines[1500] = "e1\tr1"  # one field short, in the last shards of the file
    Path(files[1]).write_text("\n".join(lines))
    config = write_config(tmp_path / "bad.json", str(tmp_path / "bad"))
    argv = ["import", config, *files, "-l", "0", "-r", "2", "--rel-col", "1", "--shard-size", str(SHARD / 2**20)]
    assert main([*argv, "--pods", "1", "--pod-index", "0", "--staging", str(tmp_path / "st")]) == 2
    err = capsys.readouterr().err.strip()
    last = err.splitlines()[-1]  # the lines before it are the progress log
    assert "Traceback" not in err and last.startswith("biggraph import: error: ")
    assert f"{files[1]} row 1501" in last and "expected the same number of fields" in last
    # a pod of a 2-pod run of the same import learns of it from the staging directory if its shards are good
    # (instead of waiting for ever for the bad one)
    for index in (0, 1):
        assert main([*argv, "--pods", "2", "--pod-index", str(index), "--staging", str(tmp_path / "st")]) == 2
        assert f"{files[1]} row 1501" in capsys.readouterr().err
    assert not (tmp_path / "bad" / "edges_b").exists()  # nothing of the output was written
    with pytest.raises(UserError, match="pod index 3 is out of range for 2 pods"):
        import_pod(load_config(config), files, OPTIONS, PodRole(3, 2, str(tmp_path / "st")))


@pytest.mark.slow
def test_pods_as_processes_one_killed_mid_import(tmp_path: Path, reference: tuple[list[str], dict[str, str]]) -> None:
    """``biggraph import --pods 3`` as real processes; pod 1 is SIGKILLed before committing a bucket and restarted."""
    files, expected = reference
    config = write_config(tmp_path / "procs.json", str(tmp_path / "procs"))
    argv = [sys.executable, "-m", "job", "import", config, *files, "-l", "0", "-r", "2", "--rel-col", "1",
            "--entity-min-count", "2", "--shard-size", str(SHARD / 2**20), "--pods", "3"]
    env = {**os.environ, CRASH_ENV: "bucket-001-00000-00001"}  # pod 1's first bucket of the second edge path
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "pod 1 was killed (signal 9); starting it again" in done.stderr
    assert digests(str(tmp_path / "procs")) == expected


PBG_TRAIN = """
import json, sys, warnings
from typing import Optional
warnings.simplefilter("ignore")
from torchbiggraph import schema

def unpack_optional(type_):  # PBG 1.0.0 compares Optional[X] by identity, which typing's cache does not keep
    args = getattr(type_, "__args__", None)
    if not args or type_ != Optional[args[0]]:
        raise TypeError("Not an optional type")
    return args[0]

schema.unpack_optional = unpack_optional
from torchbiggraph.config import ConfigSchema
from torchbiggraph.train import train
raw = json.loads(sys.argv[1])
train(ConfigSchema.from_dict(raw))
"""


@pytest.mark.slow
@pytest.mark.pbg
@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
def test_pbg_reads_and_trains_on_a_three_pod_import(tmp_path: Path, reference: tuple[list[str], dict[str, str]]) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("torchbiggraph")
        from torchbiggraph.checkpoint_manager import CheckpointManager
        from torchbiggraph.graph_storages import FileEdgeStorage, FileEntityStorage, FileRelationTypeStorage

    files, _ = reference
    out = tmp_path / "pods"
    config = write_config(tmp_path / "pods.json", str(out))
    results = run_pods(config, files, 3, staging=str(tmp_path / "staging"))
    written = results[0].edges_written
    entities, relations = FileEntityStorage(str(out / "entities")), FileRelationTypeStorage(str(out / "entities"))
    counts = [entities.load_count("all", p) for p in range(3)]
    assert [len(entities.load_names("all", p)) for p in range(3)] == counts
    assert relations.load_count() == len(relations.load_names()) == 3
    total = 0
    for path in ("edges_a", "edges_b"):
        edges = FileEdgeStorage(str(out / path))
        for lp in range(3):
            for rp in range(3):
                chunk = edges.load_edges(lp, rp)
                total += len(chunk)
                if len(chunk):
                    assert int(chunk.lhs.to_tensor().max()) < counts[lp] and int(chunk.rhs.to_tensor().max()) < counts[rp]
    assert total == written
    raw = json.loads(Path(config).read_text())
    raw.update(num_epochs=1, workers=1, batch_size=100, num_uniform_negs=10, num_batch_negs=10)
    done = subprocess.run([sys.executable, "-c", PBG_TRAIN, json.dumps(raw)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    embeddings, _ = CheckpointManager(raw["checkpoint_path"]).read("all", 2)
    assert tuple(embeddings.shape) == (counts[2], 4)


@pytest.mark.parametrize("num_parts", [1, 3, 40_000])
def test_a_groups_layout_orders_its_ids_by_partition_then_hash(num_parts: int) -> None:
    """The (partition, hash) order of a group's ids (names.arrow's batches, the positions its edges refer to), taken
    from the table's hash order by a radix sort on the partition, is the order a two-key sort gives."""
    import pyarrow as pa

    from job.config import parse_config
    from job.data.importing.hashing import hash_strings, partition_of
    from job.data.importing.mapper import GroupImporter
    from job.data.importing.table import EntityTable

    table = EntityTable()
    rng = np.random.default_rng(num_parts)
    for _ in range(3):  # ids in batches, as pass 1 adds them: dense ids not in hash order
        names = pa.array([f"id{i}" for i in rng.integers(0, 5000, 3000)])
        table.encode(hash_strings(names)[0], names.take)
    config = parse_config({"entities": {"all": {"num_partitions": num_parts}}, "dimension": 4, "global_emb": False,
                           "relations": [{"name": "r", "lhs": "all", "rhs": "all", "operator": "none"}],
                           "dynamic_relations": True, "entity_path": "/e", "edge_paths": ["/p"], "checkpoint_path": "/c"})
    importer = GroupImporter.__new__(GroupImporter)  # the layouts of a read group: its plan, tables and seed only
    importer.config, importer.tables, importer.options = config, [table], ImportOptions(lhs_col=0, rhs_col=2, seed=7)
    importer.plan = type("Plan", (), {"type_names": ["all"]})()
    [layout] = importer.layouts()
    hashes = table.hashes_of(np.arange(table.size))
    part = partition_of(hashes, num_parts, 7)
    expected = np.lexsort((hashes, part))
    assert np.array_equal(layout.order, expected) and np.array_equal(layout.packed >> 32, part)
    assert np.array_equal(layout.hashes, hashes)
    assert np.array_equal(layout.sizes, np.bincount(part, minlength=num_parts))
    starts = np.concatenate([[0], np.cumsum(layout.sizes)[:-1]])
    index = layout.packed & 0xFFFFFFFF
    assert np.array_equal(index[expected], np.arange(table.size) - starts[part[expected]])
