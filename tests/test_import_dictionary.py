"""Phase 2 of the sharded import: each id's name is taken from one group only, and two distinct ids that share a
64-bit hash are refused with one line naming both (and the other pods stop waiting), not silently merged."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import job.data.importing.importer as importer_module
from job.cli import main
from job.config import load_config
from job.data.importing import ImportOptions, import_edges
from job.data.importing.dictionary import HashCollision
from job.data.importing.hashing import hash_strings
from tests.test_import_pods import SHARD, digests, run_pods, write_config

# two long ids (more than 7 bytes: hashed through the mix, not exactly), one in each input file
NAME_A, NAME_B = "collides-with-the-other-0001", "collides-with-the-other-0002"
OPTIONS = ImportOptions(lhs_col=0, rel_col=1, rhs_col=2, shard_size=SHARD, group_size=SHARD, block_size=4096)


def write_inputs(root: Path, *, collide_in_both: bool) -> list[str]:
    """Two files whose ids repeat across shards (each id in several groups); NAME_A in the first file, NAME_B in
    the second (or NAME_A in both)."""
    rng = np.random.default_rng(3)
    ids = [f"e{i}" for i in range(50)] + ["a rather long id, well over seven bytes", "é-ünïcode"]
    root.mkdir(parents=True, exist_ok=True)
    files = []
    for k, extra in enumerate((NAME_A, NAME_A if collide_in_both else NAME_B)):
        rows = [f"{ids[a]}\tr{r}\t{ids[b]}" for a, r, b in zip(rng.integers(0, len(ids), 600),
                                                               rng.integers(0, 2, 600), rng.integers(0, len(ids), 600))]
        rows.insert(300, f"{extra}\tr0\te1")
        (root / f"{k}.tsv").write_text("\n".join(rows) + "\n")
        files.append(str(root / f"{k}.tsv"))
    return files


@pytest.fixture
def colliding(monkeypatch: pytest.MonkeyPatch) -> None:
    """NAME_B hashes as NAME_A does: a 64-bit collision, which no real pair of test ids has."""
    import pyarrow as pa

    target = hash_strings(pa.array([NAME_A]))[0][0]

    def weak(array: pa.Array) -> tuple[np.ndarray, np.ndarray]:
        hashes, lengths = hash_strings(array)
        hashes[np.asarray(array.to_pylist(), dtype=object) == NAME_B] = target
        return hashes, lengths

    monkeypatch.setattr(importer_module, "hash_strings", weak)


def test_ids_repeated_across_groups_come_out_once_and_the_same_for_any_pod_count(tmp_path: Path) -> None:
    files = write_inputs(tmp_path / "in", collide_in_both=False)
    one = write_config(tmp_path / "one.json", str(tmp_path / "one"))
    import_edges(load_config(one), files, OPTIONS)
    names = [name for part in range(3)
             for name in json.loads((tmp_path / "one" / "entities" / f"entity_names_all_{part}.json").read_text())]
    assert len(names) == len(set(names)) == 50 + 2 + 2  # every id once, though most are in every group
    three = write_config(tmp_path / "three.json", str(tmp_path / "three"))
    results = run_pods(three, files, 3, staging=str(tmp_path / "staging"), options=OPTIONS)
    assert results[0].edges_read == 1202
    assert digests(str(tmp_path / "three")) == digests(str(tmp_path / "one"))


def test_two_ids_sharing_a_hash_are_refused_naming_both(tmp_path: Path, colliding: None,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    files = write_inputs(tmp_path / "in", collide_in_both=False)
    config = write_config(tmp_path / "one.json", str(tmp_path / "one"))
    with pytest.raises(HashCollision, match=f"'{NAME_B}' and '{NAME_A}' share the same 64-bit hash"):
        import_edges(load_config(config), files, OPTIONS)
    assert not (tmp_path / "one" / "edges_a").exists()  # no bucket file written
    # two pods: the one whose partition holds the pair fails, and the other stops waiting with the same line
    results = run_pods(config, files, 2, staging=str(tmp_path / "staging"), options=OPTIONS)
    assert all("share the same 64-bit hash" in str(results[i]) for i in (0, 1))
    # on the command line: one line, exit code 2
    argv = ["import", config, *files, "-l", "0", "-r", "2", "--rel-col", "1", "--shard-size", str(SHARD / 2**20),
            "--group-size", str(SHARD / 2**20)]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and "share the same 64-bit hash" in err.splitlines()[-1]


def test_the_same_long_id_in_several_groups_is_no_collision(tmp_path: Path) -> None:
    files = write_inputs(tmp_path / "in", collide_in_both=True)
    config = write_config(tmp_path / "one.json", str(tmp_path / "one"))
    assert import_edges(load_config(config), files, OPTIONS).entities == {"all": 50 + 2 + 1}
