"""The operations of :mod:`storage_adapters.ops` on a local path, straight through ``os``.

Why not fsspec's ``LocalFileSystem``: importing fsspec costs each process ~14 ms of CPU with bytecode and
several times that without (the image ships none), and a process that only touches local files (an import's
pod on a shared volume, issue #46) needs none of it. Each function gives what ``LocalFileSystem`` gives for
the same absolute path (``tests/test_storage_local.py`` holds them side by side): errors are the OS's own
(``FileNotFoundError``, ``NotADirectoryError``), symbolic links are followed as fsspec follows them.
Paths here are absolute OS paths; the URL handling stays in :mod:`storage_adapters.ops`.
"""

from __future__ import annotations

import os
import shutil
import stat
from typing import Any


def exists(path: str) -> bool:
    """Whether ``path`` is there (a link: whether its target is)."""
    return os.path.exists(path)


def isdir(path: str) -> bool:
    return os.path.isdir(path)


def entries(path: str) -> list[str]:
    """The names directly under the directory ``path``; empty for a file (fsspec lists a file as itself, which
    ``ops.listdir`` leaves out). FileNotFoundError when ``path`` is missing."""
    if not stat.S_ISDIR(os.stat(path).st_mode):
        return []
    return os.listdir(path)


def info(path: str) -> dict[str, Any]:
    """The metadata fsspec's ``LocalFileSystem.info`` reports: the target's size, type and times for a link,
    with ``islink`` and ``destination`` saying that it is one."""
    own = os.stat(path, follow_symlinks=False)
    link = stat.S_ISLNK(own.st_mode)
    out = os.stat(path) if link else own
    kind = "directory" if stat.S_ISDIR(out.st_mode) else "file" if stat.S_ISREG(out.st_mode) else "other"
    result: dict[str, Any] = {
        "name": path, "size": out.st_size, "type": kind, "created": getattr(out, "st_birthtime", out.st_ctime),
        "islink": link, "mode": out.st_mode, "uid": out.st_uid, "gid": out.st_gid, "mtime": out.st_mtime,
        "ino": out.st_ino, "nlink": out.st_nlink,
    }
    if link:
        result["destination"] = os.readlink(path)
    return result


def size(path: str) -> int:
    """The size of ``path`` (a link: of its target)."""
    return os.stat(path).st_size


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as handle:
        return handle.read()


def makedirs(path: str) -> None:
    os.makedirs(path, exist_ok=True)


def remove(path: str) -> None:
    """Remove a file, a link (not what it points at) or a whole directory; FileNotFoundError when missing."""
    if os.path.isdir(path) and not os.path.islink(path):
        if path == os.getcwd():
            raise ValueError("Cannot delete current working directory")  # fsspec's guard, kept
        shutil.rmtree(path)
    else:
        os.remove(path)
