"""An import process takes its memory from glibc's kept heap in small pages (``job.data.importing.memory``), off by
a switch: what each import pod pays the kernel for its working set (issue #46)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# a one-process import through the CLI (run_pod), then this process's pyarrow pool and numpy's huge-page flag
CHECK = """
import sys
from job.cli import main
code = main(["import", sys.argv[1], sys.argv[2], "-l", "0", "-r", "2", "--rel-col", "1"])
import pyarrow as pa
from numpy._core.multiarray import _set_madvise_hugepage
print(code, pa.default_memory_pool().backend_name, _set_madvise_hugepage(True))
"""


def _import_in_a_process(tmp_path: Path, env: dict[str, str]) -> list[str]:
    edges = tmp_path / "edges.tsv"
    edges.write_text("".join(f"a{i}\tr{i % 3}\tb{i * 7 % 11}\n" for i in range(50)))
    out = tmp_path / "out"
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "entities": {"all": {"num_partitions": 2}},
        "relations": [{"name": "all_edges", "lhs": "all", "rhs": "all", "operator": "translation"}],
        "dynamic_relations": True, "global_emb": False, "dimension": 4, "entity_path": str(out / "entities"),
        "edge_paths": [str(out / "edges")], "checkpoint_path": str(out / "model"),
    }))
    run = subprocess.run([sys.executable, "-c", CHECK, str(config), str(edges)], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", **env}, cwd=Path(__file__).resolve().parent.parent)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout.split()[-3:]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge pages and glibc's malloc are Linux's")
def test_an_import_takes_memory_from_the_system_heap_in_small_pages(tmp_path: Path) -> None:
    assert _import_in_a_process(tmp_path, {}) == ["0", "system", "False"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge pages and glibc's malloc are Linux's")
def test_the_switch_leaves_the_libraries_defaults(tmp_path: Path) -> None:
    code, pool, huge = _import_in_a_process(tmp_path, {"BIGGRAPH_IMPORT_MEMORY": "default"})
    assert (code, huge) == ("0", "True")  # numpy's default: huge pages asked for on large arrays
    untouched = subprocess.run([sys.executable, "-c", "import pyarrow as pa; print(pa.default_memory_pool().backend_name)"],
                               capture_output=True, text=True, check=True).stdout.strip()
    assert pool == untouched != "system"  # pyarrow's own default pool (mimalloc or jemalloc in its wheels)
