"""Fuzzing the readers of untrusted input: bad input is a clean ``UserError``, never another exception, hang or crash.

- TSV importer (hypothesis): random rows (column counts, empty ids, unicode, tabs, quotes, CR/LF,
  huge ids, invalid UTF-8). Either a ``UserError`` naming the file (and, for a bad row, its
  line), or success whose output round-trips exactly: the imported edges are the multiset of
  the good input rows (computed here by an independent model of the format).
- Model archive (hypothesis): random mutations of a small valid archive (flipped bytes,
  truncation, reordered/duplicated/dropped members, members rewritten with valid CRCs but
  random bytes, edited tags.txt/params.txt). ``load``/``verify`` and a few queries either
  work or raise a ``UserError``; each example runs under a ``signal.alarm`` hang guard.
- HDF5 inputs (seeded loop in a subprocess, so a segfault or a hang in the HDF5 C library is
  reported with its case number): a valid ``edges_0_0.h5`` (with the importer's checksum
  manifest) and a committed checkpoint embeddings file with flipped bytes / truncation, read by
  ``read_edges``, ``CheckpointStorage.load_entity_partition`` and ``run_validation`` (what
  ``biggraph validate`` runs). Every damaged file must be an error: none may read back as
  other data, and validate may accept none.

The fast tests run a few hundred cases in total; ``-m slow`` runs ten times more. Every test
prints the number of cases it ran (``pytest -s``), and appends it to ``$BIGGRAPH_FUZZ_COUNTS``
(a JSON-lines file) when that is set.
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from job.errors import UserError

REPO = Path(__file__).resolve().parent.parent
HANG_SECONDS = 20


def record(name: str, cases: int, **extra: Any) -> None:
    line = json.dumps({"fuzz": name, "cases": cases, **extra})
    print(line)
    target = os.environ.get("BIGGRAPH_FUZZ_COUNTS")
    if target:
        with open(target, "a") as handle:
            handle.write(line + "\n")


def fuzz_settings(examples: int) -> settings:
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example,
                                           HealthCheck.function_scoped_fixture])


@contextlib.contextmanager
def hang_guard(seconds: int = HANG_SECONDS) -> Iterator[None]:
    """Fail (with a traceback showing where) if the body runs longer than ``seconds``."""

    def on_alarm(signum: int, frame: Any) -> None:
        raise TimeoutError(f"hang: still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# TSV importer -----------------------------------------------------------------------------------------

RELATIONS = ("r0", "r1")  # r0: node -> node, r1: node -> item
LHS_COL, REL_COL, RHS_COL = 0, 1, 2

plain_ids = st.sampled_from(["a", "b", "c", "node-1", "42", "0", "-1", "é", "北京", "a b", "NULL", "NA", "nan", "true"])
odd_ids = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=0, max_size=12)
huge_ids = st.one_of(
    st.integers(min_value=10**18, max_value=10**40).map(str),
    st.builds(lambda c, n: c * n, st.sampled_from(["x", "é", "\U0001f600", '"']), st.integers(33, 3000)),
)
fields = st.one_of(plain_ids, plain_ids, odd_ids, huge_ids, st.just(""), st.sampled_from(['"', '""', "'", '"a"', "\\"]))
relations = st.one_of(st.sampled_from(RELATIONS), st.sampled_from(RELATIONS), st.sampled_from(["", "r2", "R0", " r0"]), odd_ids)


@st.composite
def rows(draw: Any) -> list[str]:
    width = draw(st.sampled_from([3, 3, 3, 3, 4, 2, 1, 5]))
    row = [draw(fields) for _ in range(width)]
    if width > REL_COL:
        row[REL_COL] = draw(relations)
    return row


@st.composite
def tsv_files(draw: Any) -> tuple[bytes, bool, int]:
    """(file bytes, --skip-bad-rows, block size)."""
    lines = ["\t".join(r) for r in draw(st.lists(rows(), min_size=0, max_size=25))]
    newline = draw(st.sampled_from(["\n", "\n", "\r\n"]))
    text = newline.join(lines) + draw(st.sampled_from(["", newline]))
    data = text.encode("utf-8")
    if draw(st.integers(0, 14)) == 0 and data:  # invalid UTF-8 somewhere
        at = draw(st.integers(0, len(data)))
        data = data[:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80\x80"])) + data[at:]
    return data, draw(st.booleans()), draw(st.sampled_from([1 << 10, 8 << 20]))


def model_lines(data: bytes) -> list[tuple[int, list[str]]] | None:
    """(1-based line number, fields) of each non-empty line, as the format defines it; None if not UTF-8."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    out = []
    for number, line in enumerate(text.replace("\r\n", "\n").replace("\r", "\n").split("\n"), 1):
        if line:
            out.append((number, line.split("\t")))
    return out


def expected_import(lines: list[tuple[int, list[str]]]) -> tuple[list[tuple[str, str, str]], int | None, int]:
    """(edges kept, line of the first bad row, column count) for a file of 3+ columns."""
    width = len(lines[0][1])
    kept, first_bad = [], None
    for number, row in lines:
        bad = len(row) != width or "" in (row[LHS_COL], row[RHS_COL], row[REL_COL]) or row[REL_COL] not in RELATIONS
        if bad:
            first_bad = first_bad or number
        else:
            kept.append((row[LHS_COL], row[REL_COL], row[RHS_COL]))
    return kept, first_bad, width


def import_case(root: Path, data: bytes, skip: bool, block_size: int) -> tuple[str, Any]:
    """Run one import; ('ok', edges read back) or ('error', the UserError). Anything else propagates."""
    from test_importer import read_back, write_config

    from job.config import load_config
    from job.data.importing import ImportOptions, import_edges

    config_path = write_config(root, {"node": 2, "item": 1}, [("r0", "node", "node"), ("r1", "node", "item")])
    source = root / "input.tsv"
    source.write_bytes(data)
    options = ImportOptions(lhs_col=LHS_COL, rhs_col=RHS_COL, rel_col=REL_COL, skip_bad_rows=skip, block_size=block_size,
                            tmp_dir=str(root))
    try:
        import_edges(load_config(str(config_path)), [str(source)], options)
    except UserError as err:
        assert not (root / "entities").exists() and not (root / "edges").exists(), "a failed import left output behind"
        return "error", err
    return "ok", read_back(config_path)


def check_tsv_case(data: bytes, skip: bool, block_size: int) -> str:
    with tempfile.TemporaryDirectory(prefix="fuzz-tsv-") as tmp:
        root = Path(tmp)
        with hang_guard():
            outcome, value = import_case(root, data, skip, block_size)
        lines = model_lines(data)
        source = str(root / "input.tsv")
        if outcome == "error":
            message = str(value)
            assert source in message, f"the error does not name the file: {message}"
            if lines is None or not lines or len(lines[0][1]) <= max(LHS_COL, RHS_COL, REL_COL):
                return "error"  # not UTF-8, or too few columns: a whole-file problem
            longest = max(len(line.encode()) for line in data.decode("utf-8").splitlines())
            if longest + 2 >= block_size:
                return "error"  # a row longer than the read block: a whole-file problem, named as such
            kept, first_bad, _ = expected_import(lines)
            assert not skip, f"--skip-bad-rows failed on a well-formed file: {message}"
            assert first_bad is not None, f"rejected a valid file: {message}"
            assert f"row {first_bad}:" in message, f"expected the error to name line {first_bad}: {message}"
            return "error"
        assert lines is not None, "invalid UTF-8 was imported"
        if not lines:
            assert value == []
            return "ok"
        kept, first_bad, width = expected_import(lines)
        assert width > max(LHS_COL, RHS_COL, REL_COL)
        assert skip or first_bad is None, f"line {first_bad} is bad but the import succeeded without --skip-bad-rows"
        assert collections.Counter(value) == collections.Counter(kept), "imported edges differ from the good input rows"
        return "ok"


def run_tsv_fuzz(examples: int) -> collections.Counter:
    outcomes: collections.Counter = collections.Counter()

    @fuzz_settings(examples)
    @given(tsv_files())
    def case(generated: tuple[bytes, bool, int]) -> None:
        outcomes[check_tsv_case(*generated)] += 1

    case()
    return outcomes


# pyarrow decodes a bad row's text before calling our invalid-row handler; on invalid UTF-8 that decode fails inside
# pyarrow ("Exception ignored in _on_invalid_row"), and the file is then reported as not UTF-8: a clean error.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_tsv_import_fuzz() -> None:
    outcomes = run_tsv_fuzz(80)
    record("tsv_import", sum(outcomes.values()), **outcomes)
    assert outcomes["ok"] and outcomes["error"]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_tsv_import_fuzz_long() -> None:
    outcomes = run_tsv_fuzz(1000)
    record("tsv_import_long", sum(outcomes.values()), **outcomes)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("data,skip,line", [
    (b"a\tr0\tb\nc\tr0\n", False, 2),  # too few fields
    (b"a\tr0\tb\n\n\nc\tr0\t\n", False, 4),  # empty id after blank lines
    (b"a\tr0\tb\r\nc\tr9\td\r\n", False, 2),  # unknown relation, CRLF
    (b'a\tr0\t"b\n"c\tr1\td\te\n', False, 2),  # quotes are plain characters in TSV
])
def test_tsv_known_bad_rows(data: bytes, skip: bool, line: int) -> None:
    assert check_tsv_case(data, skip, 8 << 20) == "error"
    with tempfile.TemporaryDirectory() as tmp:
        _, err = import_case(Path(tmp), data, skip, 8 << 20)
        assert f"row {line}:" in str(err)
        assert check_tsv_case(data, True, 8 << 20) == "ok"


# Model archive -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def archive_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    from test_archive import write_checkpoint

    from job.archive import add_tag
    from job.config import parse_config

    root = tmp_path_factory.mktemp("fuzz_archive")
    raw = write_checkpoint(root / "cp", versions=1)
    out = root / "m.zip"
    add_tag(parse_config(raw), str(out), tag="base")
    add_tag(parse_config(raw), str(out), tag="small", dtype="int8")
    return out.read_bytes()


def zip_members(data: bytes) -> list[tuple[str, bytes]]:
    with zipfile.ZipFile(io.BytesIO(data)) as handle:
        return [(info.filename, handle.read(info.filename)) for info in handle.infolist()]


def write_members(path: Path, members: list[tuple[str, bytes]]) -> None:
    import warnings

    from job.archive.container import ZipWriter

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns about duplicate names, which is the point
        with ZipWriter(str(path)) as writer:
            for name, payload in members:
                writer.write(name, payload, date_time=(2026, 1, 1, 0, 0, 0))


@st.composite
def text_edits(draw: Any, text: str) -> str:
    lines = text.splitlines()
    op = draw(st.sampled_from(["replace", "duplicate", "drop", "case", "insert", "swap", "digits", "garbage"]))
    if op == "replace" or not lines:
        return draw(st.text(max_size=200))
    i = draw(st.integers(0, len(lines) - 1))
    if op == "duplicate":
        lines.insert(i, lines[i])
    elif op == "drop":
        del lines[i]
    elif op == "case":
        lines[i] = lines[i].swapcase()
    elif op == "insert":
        lines.insert(i, draw(st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)))
    elif op == "swap":
        j = draw(st.integers(0, len(lines) - 1))
        lines[i], lines[j] = lines[j], lines[i]
    elif op == "digits":
        lines[i] = "".join(str(draw(st.integers(0, 10**12))) if c.isdigit() else c for c in lines[i])
    else:
        lines[i] = lines[i] + draw(st.sampled_from(["/", " x", " ../0", " base/", "\x00", "small/99"]))
    return "\n".join(lines) + draw(st.sampled_from(["", "\n", "\r\n"]))


@st.composite
def archive_mutations(draw: Any, original: bytes) -> tuple[str, bytes | list[tuple[str, bytes]]]:
    kind = draw(st.sampled_from(["flip", "truncate", "reorder", "duplicate", "drop", "member_bytes", "text"]))
    if kind == "flip":
        data = bytearray(original)
        for _ in range(draw(st.integers(1, 8))):
            data[draw(st.integers(0, len(data) - 1))] ^= draw(st.integers(1, 255))
        return kind, bytes(data)
    if kind == "truncate":
        return kind, original[: draw(st.integers(0, len(original) - 1))]
    members = zip_members(original)
    if kind == "reorder":
        return kind, draw(st.permutations(members))
    if kind == "duplicate":
        i = draw(st.integers(0, len(members) - 1))
        name, payload = members[i]
        if draw(st.booleans()):
            payload = draw(st.binary(max_size=64))
        return kind, members + [(name, payload)] if draw(st.booleans()) else [(name, payload)] + members
    if kind == "drop":
        i = draw(st.integers(0, len(members) - 1))
        return kind, members[:i] + members[i + 1:]
    i = draw(st.integers(0, len(members) - 1))
    name, payload = members[i]
    if kind == "member_bytes":  # the zip is intact (valid CRC): the FlatBuffer/array readers see the damage
        data = bytearray(payload)
        if data and draw(st.booleans()):
            for _ in range(draw(st.integers(1, 6))):
                data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
        else:
            data = bytearray(data[: draw(st.integers(0, len(data)))]) + draw(st.binary(max_size=16))
        members[i] = (name, bytes(data))
        return kind, members
    text_members = [j for j, (n, _) in enumerate(members) if n.endswith(".txt")]
    j = draw(st.sampled_from(text_members))
    name, payload = members[j]
    members[j] = (name, draw(text_edits(payload.decode("utf-8"))).encode("utf-8", "surrogatepass"))
    return kind, members


def exercise_archive(path: Path) -> str:
    """Load every tag and touch everything a user would; 'ok' or 'error' (a UserError)."""
    from job.archive import load, verify

    try:
        with hang_guard():
            for tag in (None, "base", "small"):
                model = load(str(path), tag)
                try:
                    for entity_type in model.entity_types:
                        names = model.entity_names(entity_type)
                        model.table(entity_type)
                        if names:
                            model.embedding(names[0], entity_type)
                    for relation in model.graph.relation_types[:3]:
                        lhs_names = model.entity_names(relation.lhs)
                        if lhs_names:
                            model.nearest(lhs_names[0], k=2, relation=relation.name)
                finally:
                    model.close()
            verify(str(path))
    except UserError:
        return "error"
    return "ok"


def run_archive_fuzz(original: bytes, examples: int, workdir: Path) -> collections.Counter:
    outcomes: collections.Counter = collections.Counter()

    @fuzz_settings(examples)
    @given(archive_mutations(original))
    def case(mutation: tuple[str, bytes | list[tuple[str, bytes]]]) -> None:
        kind, payload = mutation
        path = workdir / f"case-{sum(outcomes.values())}.zip"
        if isinstance(payload, bytes):
            path.write_bytes(payload)
        else:
            write_members(path, payload)
        try:
            outcomes[f"{kind}:{exercise_archive(path)}"] += 1
        finally:
            path.unlink()

    case()
    return outcomes


def test_archive_fuzz(archive_bytes: bytes, tmp_path: Path) -> None:
    assert exercise_archive_bytes(archive_bytes, tmp_path) == "ok"  # the unmutated archive works
    outcomes = run_archive_fuzz(archive_bytes, 200, tmp_path)
    record("archive", sum(outcomes.values()), **outcomes)
    assert sum(v for k, v in outcomes.items() if k.endswith(":error")) > 0


@pytest.mark.slow
def test_archive_fuzz_long(archive_bytes: bytes, tmp_path: Path) -> None:
    outcomes = run_archive_fuzz(archive_bytes, 2000, tmp_path)
    record("archive_long", sum(outcomes.values()), **outcomes)


def exercise_archive_bytes(data: bytes, workdir: Path) -> str:
    path = workdir / "plain.zip"
    path.write_bytes(data)
    try:
        return exercise_archive(path)
    finally:
        path.unlink()


# HDF5 inputs (subprocess) -----------------------------------------------------------------------------------

H5_CHILD = textwrap.dedent(
    r"""
    import json, random, signal, sys, traceback
    from pathlib import Path
    import numpy as np
    from job.errors import UserError

    target, cases, seed, work = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    progress = open(work / f"progress-{target}", "w", buffering=1)

    def on_alarm(signum, frame):
        raise TimeoutError("hang")

    signal.signal(signal.SIGALRM, on_alarm)

    def flat(value):
        if isinstance(value, dict):
            return [np.asarray(repr(k)) for k in value] + [a for v in value.values() for a in flat(v)]
        if isinstance(value, (list, tuple)):
            return [np.asarray(len(value))] + [a for v in value for a in flat(v)]
        return [np.asarray(value)]

    if target == "checkpoint":
        from job.formats.checkpoint import CheckpointStorage
        storage = CheckpointStorage(str(work / "ckpt"))
        victim = Path(storage.partition_file(1, "node", 0))
        def read():
            table, state = storage.load_entity_partition(1, "node", 0)
            return [table] + flat(state)
    elif target == "edges":
        from job.formats.edges import read_edges
        victim = work / "data" / "edges" / "edges_0_0.h5"
        def read():
            edges = read_edges(str(victim))
            return [edges.rel, edges.lhs, edges.rhs]
    else:
        from job.config import load_config
        from job.formats.validate import run_validation
        config = load_config(str(work / "config.json"))
        victim = work / "data" / "edges" / "edges_0_0.h5"
        def read():
            report = run_validation(config, full=True)
            if report.problems:
                raise UserError(report.problems[0])
            return []
    original = victim.read_bytes()
    expected = read()
    rng = random.Random(seed)
    counts = {"error": 0, "same": 0, "different": 0} if target != "validate" else {"error": 0, "accepted": 0}
    counts["unchanged"] = 0  # a zeroed range that was zero already: not damage
    failures = []
    for case in range(cases):
        data = bytearray(original)
        mode = rng.choice(["flip", "flip", "flips", "truncate", "flip+truncate", "zero"])
        if "flip" in mode:
            for _ in range(1 if mode == "flip" else rng.randint(2, 16)):
                data[rng.randrange(len(data))] ^= rng.randrange(1, 256)
        if "truncate" in mode:
            data = data[: rng.randrange(len(data))]
        if mode == "zero":
            start = rng.randrange(len(data))
            data[start:start + rng.randint(1, 64)] = bytes(len(data[start:start + 64]))
        if bytes(data) == original:
            counts["unchanged"] += 1
            continue
        victim.write_bytes(bytes(data))
        progress.write(f"{case} {mode}\n")
        signal.alarm(20)
        try:
            got = read()
        except UserError:
            counts["error"] += 1
        except BaseException as err:
            failures.append({"case": case, "mode": mode, "error": f"{type(err).__name__}: {err}"[:300],
                             "trace": traceback.format_exc()[-1500:]})
        else:
            same = len(got) == len(expected) and all(
                a.shape == b.shape and a.dtype == b.dtype
                and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc") for a, b in zip(got, expected))
            counts[("accepted" if target == "validate" else "same") if same else "different"] += 1
        finally:
            signal.alarm(0)
    victim.write_bytes(original)
    print(json.dumps({"target": target, "cases": cases, "counts": counts, "failures": failures[:20],
                      "num_failures": len(failures)}))
    """
)


@pytest.fixture(scope="module")
def h5_inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch

    from job.formats.checkpoint import CheckpointStorage
    from job.formats.edges import edges_file, write_edge_manifest, write_edges
    from job.formats.entities import write_entity_count
    from job.train.batch.optim import row_adagrad_state

    work = tmp_path_factory.mktemp("fuzz_h5")
    rng = np.random.default_rng(0)
    write_entity_count(str(work / "data"), "node", 0, 50)
    n = 200
    entry = write_edges(edges_file(str(work / "data" / "edges"), 0, 0), rng.integers(0, 2, n), rng.integers(0, 50, n),
                        rng.integers(0, 50, n))
    write_edge_manifest(str(work / "data" / "edges"), {"edges_0_0.h5": entry})  # as `biggraph import` does
    config = {"entities": {"node": {"num_partitions": 1}},
              "relations": [{"name": f"r{i}", "lhs": "node", "rhs": "node"} for i in range(2)], "dimension": 8,
              "entity_path": str(work / "data"), "edge_paths": [str(work / "data" / "edges")],
              "checkpoint_path": str(work / "ckpt")}
    (work / "config.json").write_text(json.dumps(config))
    storage = CheckpointStorage(str(work / "ckpt"))
    storage.prepare()
    state = row_adagrad_state(torch.from_numpy(rng.random(50).astype(np.float32)), 0.1, 3)
    storage.save_entity_partition(1, "node", 0, rng.normal(size=(50, 8)).astype(np.float32), state,
                                  {"config/json": json.dumps(config)})
    storage.save_version(1)
    return work


def run_h5_fuzz(work: Path, target: str, cases: int, seed: int) -> dict[str, Any]:
    script = work / "child.py"
    script.write_text(H5_CHILD)
    try:
        result = subprocess.run([sys.executable, str(script), target, str(cases), str(seed), str(work)], cwd=REPO,
                                capture_output=True, text=True, timeout=60 + cases)
    except subprocess.TimeoutExpired:
        last = (work / f"progress-{target}").read_text().splitlines()[-1:]
        pytest.fail(f"{target}: the fuzz loop hung at case {last} (seed {seed})")
    if result.returncode != 0:
        last = (work / f"progress-{target}").read_text().splitlines()[-1:]
        pytest.fail(f"{target}: the interpreter died (exit {result.returncode}) at case {last} (seed {seed}):\n"
                    f"{result.stderr[-3000:]}")
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    record(f"hdf5_{target}", cases, seed=seed, **summary["counts"])
    assert summary["num_failures"] == 0, json.dumps(summary["failures"], indent=1)
    # checksums: no damaged file reads back as other data, and validate accepts none
    assert summary["counts"].get("different", 0) == 0 and summary["counts"].get("accepted", 0) == 0, summary["counts"]
    return summary


@pytest.mark.parametrize("target,cases", [("edges", 200), ("checkpoint", 200), ("validate", 100)])
def test_hdf5_corrupt_bytes(h5_inputs: Path, target: str, cases: int) -> None:
    summary = run_h5_fuzz(h5_inputs, target, cases, seed=1)
    assert summary["counts"]["error"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("target", ["edges", "checkpoint", "validate"])
def test_hdf5_corrupt_bytes_long(h5_inputs: Path, target: str) -> None:
    for seed in (2, 3, 4):
        run_h5_fuzz(h5_inputs, target, 1000, seed=seed)


def test_hdf5_fuzz_inputs_are_restored(h5_inputs: Path) -> None:
    """The loops put the original files back (the slow run and the fast run share them)."""
    from job.formats.edges import read_edges

    assert len(read_edges(str(h5_inputs / "data" / "edges" / "edges_0_0.h5"))) == 200


@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_tsv_single_line_without_final_newline_is_imported(tmp_path: Path, suffix: str) -> None:
    """pyarrow calls such a file empty ("cannot infer number of columns"); found by the fuzzer: 0 edges were imported."""
    import gzip

    from test_importer import read_back, write_config

    from job.config import load_config
    from job.data.importing import ImportOptions, import_edges

    config_path = write_config(tmp_path, {"node": 2, "item": 1}, [("r0", "node", "node"), ("r1", "node", "item")])
    source = tmp_path / f"input.tsv{suffix}"
    data = "a\tr1\té".encode()
    source.write_bytes(gzip.compress(data) if suffix else data)
    summary = import_edges(load_config(str(config_path)), [str(source)], ImportOptions(lhs_col=0, rhs_col=2, rel_col=1))
    assert summary.edges_written == 1 and read_back(config_path) == [("a", "r1", "é")]
    source.write_bytes(gzip.compress(b"\n\r\n") if suffix else b"\n\r\n")  # really empty: still 0 edges, no error
    assert import_edges(load_config(str(config_path)), [str(source)], ImportOptions(0, 2, 1)).edges_written == 0
