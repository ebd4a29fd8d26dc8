"""An import process takes its memory from glibc's kept heap (one arena) in small pages
(``job.data.importing.memory``), off by a switch: what each import pod pays the kernel for its working set (issue #46)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# a one-process import through the CLI (run_pod), then this process's pyarrow pool, numpy's huge-page flag and the
# number of malloc arenas once a new thread has allocated (glibc's malloc_info lists one <heap> per arena)
CHECK = """
import ctypes, sys, threading
from job.cli import main
code = main(["import", sys.argv[1], sys.argv[2], "-l", "0", "-r", "2", "--rel-col", "1"])
import pyarrow as pa
from numpy._core.multiarray import _set_madvise_hugepage
kept = []
thread = threading.Thread(target=lambda: kept.append(bytearray(1 << 20)))
thread.start()
thread.join()
libc = ctypes.CDLL(None)
libc.open_memstream.restype = ctypes.c_void_p
buffer, size = ctypes.c_char_p(), ctypes.c_size_t()
stream = libc.open_memstream(ctypes.byref(buffer), ctypes.byref(size))
libc.malloc_info(0, ctypes.c_void_p(stream))
libc.fclose(ctypes.c_void_p(stream))
arenas = buffer.value.decode().count("<heap nr=")
print(code, pa.default_memory_pool().backend_name, _set_madvise_hugepage(True), arenas)
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
    return run.stdout.split()[-4:]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge pages and glibc's malloc are Linux's")
def test_an_import_takes_memory_from_the_system_heap_in_small_pages(tmp_path: Path) -> None:
    assert _import_in_a_process(tmp_path, {}) == ["0", "system", "False", "1"]  # the new thread shares the one arena


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge pages and glibc's malloc are Linux's")
def test_the_switch_leaves_the_libraries_defaults(tmp_path: Path) -> None:
    code, pool, huge, arenas = _import_in_a_process(tmp_path, {"BIGGRAPH_IMPORT_MEMORY": "default"})
    assert (code, huge) == ("0", "True")  # numpy's default: huge pages asked for on large arrays
    assert int(arenas) > 1  # glibc's default: a thread of its own gets an arena of its own
    untouched = subprocess.run([sys.executable, "-c", "import pyarrow as pa; print(pa.default_memory_pool().backend_name)"],
                               capture_output=True, text=True, check=True).stdout.strip()
    assert pool == untouched != "system"  # pyarrow's own default pool (mimalloc or jemalloc in its wheels)
