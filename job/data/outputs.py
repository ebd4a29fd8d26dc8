"""Checking an output location before doing the work that fills it.

An import reads all its input (minutes to hours) before it writes; an export reads whole
checkpoints. A typo in an output path or a bucket that does not exist must fail at once,
not after that work, so both commands call ``check_output_dir`` first.
"""

from __future__ import annotations

import os

import storage_adapters as storage
from job.errors import UserError


def check_output_dir(url: str, *, create: bool, error: type[UserError] = UserError) -> None:
    """Fail (with ``error``) unless ``url`` can become a writable directory.

    Local paths: the path (or, when ``create`` is false and it does not exist yet, its nearest existing
    ancestor) must be a writable directory; ``create`` makes it now. Remote URLs: object stores have no
    directories, so this checks that the bucket exists (``storage.makedirs`` does exactly that, and
    writes nothing there), which names the bucket in its message.
    """
    if not storage.is_local(url):
        try:
            storage.makedirs(url)
        except PermissionError as err:
            raise error(f"{url}: output location is not writable ({err})") from None
        return
    path = os.path.abspath(storage.local_path(url))
    if os.path.exists(path) and not os.path.isdir(path):
        raise error(f"{url}: exists and is not a directory")
    if create:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as err:
            raise error(f"{url}: output directory cannot be created ({err.strerror or err})") from None
        existing = path
    else:
        existing = _nearest_existing(path)
        if not os.path.isdir(existing):
            raise error(f"{url}: output directory cannot be created ({existing} is not a directory)")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "output directory" if existing == path else f"output directory's parent {existing}"
        raise error(f"{url}: {what} is not writable")


def _nearest_existing(path: str) -> str:
    """``path`` itself or its closest ancestor that exists (the root always does)."""
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path
