"""``biggraph archive`` streams an entity type's names (job/archive/names.py, serialize.GraphMember): the names
files are parsed a window at a time and spooled, graph.fb's names vectors are copied behind its head; a reader sees
the same names as before, and the writer's memory does not grow with the type's names."""

from __future__ import annotations

import io
import json
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from job.archive import ArchiveError, load, verify
from job.archive import names as archive_names
from job.archive.writer import add_tag
from job.config import parse_config
from job.errors import CheckpointError, InputFormatError
from job.formats.checkpoint import CheckpointStorage
from job.formats.entities import write_entity_count
from job.model.scoring import Model

DOCUMENTS = [
    '[]', ' [ ] \n', '["a"]', '[\n"a",\n"b\\u00e9\\n",\n"c\\"d"\n]', '["x" , "y"]  ',
    '[123456789, -1.5e3, true, null, "ünï\\t"]', '["' + "long" * 50 + '", "z"]',
]


@pytest.mark.parametrize("window", [1, 2, 3, 7, 1 << 20])
@pytest.mark.parametrize("document", DOCUMENTS)
def test_a_list_parsed_a_window_at_a_time_is_the_list_json_reads(document: str, window: int) -> None:
    expected = [value if isinstance(value, str) else str(value) for value in json.loads(document)]
    assert list(archive_names.iter_json_list(io.StringIO(document), "names.json", window=window)) == expected


@pytest.mark.parametrize(("document", "problem"), [
    ('{"a": 1}', "does not start a JSON list at line 1"), ('["a",\n"b"\n"c"]', "expected ',' or ']'"),
    ('["a",\n"b', "invalid JSON at line 2"), ('["a"] ["b"]', "holds more after its list"), ('', "does not start"),
])
def test_a_malformed_names_file_is_named_with_its_line(document: str, problem: str) -> None:
    with pytest.raises(InputFormatError, match=problem) as caught:
        list(archive_names.iter_json_list(io.StringIO(document), "s3://b/names.json", window=2))
    assert "s3://b/names.json" in str(caught.value)


def _checkpoint(root: Path, counts: list[int], names: dict[int, list[str]], dimension: int = 2) -> Any:
    """A one-type checkpoint (version 1) whose partitions have ``counts`` rows; ``names`` files for some partitions."""
    entity_path = root / "entities"
    raw = {"entities": {"n": {"num_partitions": len(counts)}},
           "relations": [{"name": "r", "lhs": "n", "rhs": "n", "operator": "diagonal"}],
           "dimension": dimension, "entity_path": str(entity_path), "edge_paths": [str(root / "edges")],
           "checkpoint_path": str(root / "checkpoints"), "workers": 1}
    config = parse_config(raw)
    rng = np.random.default_rng(0)
    for part, count in enumerate(counts):
        write_entity_count(str(entity_path), "n", part, count)
        if part in names:
            (entity_path / f"entity_names_n_{part}.json").write_text(json.dumps(names[part]))
    storage = CheckpointStorage(config.checkpoint_path)
    storage.prepare()
    storage.save_config(config.to_json())
    for part, count in enumerate(counts):
        storage.save_entity_partition(1, "n", part, rng.normal(size=(count, dimension)).astype(np.float32), None)
    state = {name: (private, rng.normal(size=tuple(t.shape)).astype(np.float32))
             for name, (private, t) in Model(config, 0).public_state_dict().items()}
    storage.save_model(1, state, None, {"config/json": config.to_json()})
    storage.save_version(1)
    return config


def test_names_read_back_through_the_streamed_graph_fb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(archive_names, "WINDOW", 5)  # names cut across windows, a name longer than one
    monkeypatch.setattr(archive_names, "COPY_SLICE", 7)
    first = ["é" * 9, "b", "", "long name " * 20, "e"]  # lengths not multiples of 4: the vectors' padding
    config = _checkpoint(tmp_path, [5, 3, 2], {0: first, 2: ["x", "y"]})  # partition 1 has no names file
    out = tmp_path / "model.zip"
    add_tag(config, str(out))
    add_tag(config, str(out), dtype="fp16")  # the first tag's graph.fb copied into the second archive as it is
    verify(str(out))
    for tag in ("v1-fp32", "v1-fp16"):
        model = load(str(out), tag=tag)
        assert model.entity_names("n") == first + ["n_1_0", "n_1_1", "n_1_2"] + ["x", "y"]
        assert model.entity_count("n") == 10


@pytest.mark.parametrize(("names", "error", "message"), [
    (["a", "b"], CheckpointError, "2 names but the partition has 3 entities"),
    (["a", "b", "c", "d"], CheckpointError, "more than 3 names but the partition has 3 entities"),
    (["a", "b\0", "c"], ArchiveError, "a name holds a NUL character"),
])
def test_names_that_do_not_fit_the_partition_are_refused(tmp_path: Path, names: list[str], error: type,
                                                         message: str) -> None:
    config = _checkpoint(tmp_path, [3], {0: names})
    with pytest.raises(error, match=message):
        add_tag(config, str(tmp_path / "model.zip"))
    assert not (tmp_path / "model.zip").exists()


def _peak_of_archiving(root: Path, names: list[str]) -> int:
    """tracemalloc's peak over ``add_tag`` of a one-partition checkpoint with ``names``."""
    config = _checkpoint(root, [len(names)], {0: names}, dimension=1)
    tracemalloc.start()
    try:
        add_tag(config, str(root / "model.zip"))
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_writers_memory_does_not_grow_with_a_types_names(tmp_path: Path) -> None:
    """The same 50,000 rows with short names (~5 bytes) and long ones (500 bytes, 25 MB in all): the old writer held
    a type's names as a list, joined and in its FlatBuffers builder, several times their size at once; the streaming
    one's peak grows by less than an eighth of what the names grew by. The difference of two runs leaves out the
    fixed part of the peak (h5py's and the storage layer's read buffers), which does not depend on the names."""
    count = 50_000
    short = [f"{i}" for i in range(count)]
    long = [f"{i:09d}-" + "n" * 490 for i in range(count)]
    grown = sum(len(n) for n in long) - sum(len(n) for n in short)
    peak_short = _peak_of_archiving(tmp_path / "short", short)
    peak_long = _peak_of_archiving(tmp_path / "long", long)
    assert peak_long - peak_short < grown / 8, f"peak {peak_short:,} -> {peak_long:,} B for names {grown:,} B longer"
    model = load(str(tmp_path / "long" / "model.zip"))
    assert model.entity_count("n") == count
    assert model.entity_names("n")[12_345] == long[12_345]
