"""Local paths go through ``os`` (``storage_adapters.local``), not fsspec, so that a local-only process does not
import fsspec (issue #46): every operation must answer what fsspec's ``LocalFileSystem`` answered, value or
error, for files, directories, links (to a file, to a directory, broken) and missing paths."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec
import pytest

import storage_adapters as storage

FS = fsspec.filesystem("file")


def _tree(root: Path) -> Path:
    """A file, an empty file, a directory with two entries, links to each kind and a broken one."""
    root.mkdir()
    (root / "file").write_bytes(b"some bytes\n")
    (root / "empty").write_bytes(b"")
    (root / "dir").mkdir()
    (root / "dir" / "a").write_text("a")
    (root / "dir" / "sub").mkdir()
    (root / "to_file").symlink_to(root / "file")
    (root / "to_dir").symlink_to(root / "dir")
    (root / "broken").symlink_to(root / "nowhere")
    return root


NAMES = ["file", "empty", "dir", "dir/", "to_file", "to_dir", "broken", "missing", "file/below", "."]


def _answer(func: Callable[[], Any]) -> Any:
    """The value, or the type of the error (messages differ only in how they name the path)."""
    try:
        return func()
    except Exception as err:  # noqa: BLE001 - any error is an answer to compare
        return type(err)


def _fsspec_listdir(path: str) -> list[str]:
    """What ``storage.listdir`` made of fsspec's listing (the code it replaced for local paths)."""
    try:
        entries = FS.ls(path, detail=False)
    except FileNotFoundError:
        return []
    return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries if e.rstrip("/") != path.rstrip("/")})


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("scheme", ["", "file://"])
def test_local_operations_answer_as_fsspec_did(tmp_path: Path, name: str, scheme: str) -> None:
    root = _tree(tmp_path / "t")
    url = f"{scheme}{root}/{name}"
    path = os.path.abspath(f"{root}/{name}")  # what get_filesystem handed fsspec
    assert _answer(lambda: storage.exists(url)) == _answer(lambda: FS.exists(path))
    assert _answer(lambda: storage.isdir(url)) == _answer(lambda: FS.isdir(path))
    assert _answer(lambda: storage.size(url)) == _answer(lambda: FS.size(path))
    assert _answer(lambda: storage.info(url)) == _answer(lambda: FS.info(path))
    assert _answer(lambda: storage.read_bytes(url)) == _answer(lambda: FS.cat_file(path))
    assert _answer(lambda: storage.listdir(url)) == _answer(lambda: _fsspec_listdir(path))


@pytest.mark.parametrize("name", ["file", "dir", "to_file", "to_dir", "broken", "missing"])
def test_remove_and_makedirs_leave_what_fsspec_left(tmp_path: Path, name: str) -> None:
    ours, theirs = _tree(tmp_path / "ours"), _tree(tmp_path / "theirs")
    for missing_ok in (True, False):
        mine = _answer(lambda ok=missing_ok: storage.remove(str(ours / name), missing_ok=ok))
        path = str(theirs / name)

        def fsspec_remove(path: str = path, missing_ok: bool = missing_ok) -> None:
            try:
                FS.rm(path, recursive=FS.isdir(path))
            except FileNotFoundError:
                if not missing_ok:
                    raise

        assert mine == _answer(fsspec_remove)
        assert sorted(os.listdir(ours)) == sorted(os.listdir(theirs))
    assert (ours / "file").exists() == (name != "file")  # a link's target stays
    storage.makedirs(str(ours / "new" / "deeper"))
    storage.makedirs(str(ours / "new" / "deeper"))  # already there: no error
    assert (ours / "new" / "deeper").is_dir()
    assert _answer(lambda: storage.makedirs(str(ours / "empty" / "x"))) == _answer(
        lambda: FS.makedirs(str(theirs / "empty" / "x"), exist_ok=True))


def test_local_operations_do_not_import_fsspec(tmp_path: Path) -> None:
    root = _tree(tmp_path / "t")
    code = ("import sys, storage_adapters as s\n"
            f"r = {str(root)!r}\n"
            "s.exists(r + '/file'); s.isdir(r); s.size(r + '/file'); s.info(r + '/file'); s.listdir(r)\n"
            "s.read_text(r + '/file'); s.makedirs(r + '/new'); s.remove(r + '/new'); s.write_text(r + '/w', 'x')\n"
            "print(sorted(m for m in ('fsspec', 'http.client', 'ssl', 'asyncio') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
