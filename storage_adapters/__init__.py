"""Every path is a URL: one thin layer over fsspec used by all of biggraph's I/O.

Plain paths and ``file://`` go to the local filesystem (and h5py opens them
directly); any other scheme (``s3://``, ``memory://``, ``gs://`` ...) goes through
the fsspec backend registered for it, imported lazily so that a missing optional
package is reported with the name of what to install. URLs are joined as strings,
never through ``pathlib.Path`` (which would turn ``s3://b/k`` into ``s3:/b/k``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from typing import IO, Any

from job.errors import UserError

# Which package provides each well-known scheme, for the "please install" message.
_SCHEME_PACKAGES = {
    "s3": "s3fs",
    "s3a": "s3fs",
    "gs": "gcsfs",
    "gcs": "gcsfs",
    "az": "adlfs",
    "abfs": "adlfs",
    "abfss": "adlfs",
    "hdfs": "pyarrow",
}

_storage_options: dict[str, Any] = {}
_options_lock = threading.Lock()


class StorageError(UserError):
    """A URL cannot be used: unknown scheme, missing backend package, or access refused."""


def set_storage_options(options: dict[str, Any]) -> None:
    """Process-wide extra arguments for remote filesystems (config key ``storage_options``)."""
    with _options_lock:
        _storage_options.clear()
        _storage_options.update(options)


def scheme_of(url: str) -> str:
    """The URL scheme, or "" for a plain path."""
    head, sep, _ = url.partition("://")
    if not sep or "/" in head:
        return ""
    return head.lower()


def is_local(url: str) -> bool:
    return scheme_of(url) in ("", "file", "local")


def local_path(url: str) -> str:
    """The OS path of a local URL."""
    if not is_local(url):
        raise ValueError(f"{url} is not a local path")
    if scheme_of(url):
        return url.split("://", 1)[1]
    return url


def join(base: str, *parts: str) -> str:
    """Join URL components with '/' (keeps the scheme and never normalises '//')."""
    out = base
    for part in parts:
        if not out.endswith("/"):
            out += "/"
        out += part.lstrip("/")
    return out


def get_filesystem(url: str) -> tuple[Any, str]:
    """The fsspec filesystem for ``url`` and the path within it."""
    import fsspec

    scheme = scheme_of(url)
    if is_local(url):
        return fsspec.filesystem("file"), os.path.abspath(local_path(url))
    try:
        cls = fsspec.get_filesystem_class(scheme)
    except (ImportError, ValueError) as err:
        package = _SCHEME_PACKAGES.get(scheme)
        hint = f"; install it with: pip install {package}" if package else ""
        raise StorageError(f"{url}: no filesystem backend for scheme '{scheme}://'{hint} ({err})") from None
    options = dict(_storage_options) if scheme not in ("memory",) else {}
    fs = cls(**options)
    return fs, fs._strip_protocol(url)


def exists(url: str) -> bool:
    fs, path = get_filesystem(url)
    return bool(fs.exists(path))


def isdir(url: str) -> bool:
    fs, path = get_filesystem(url)
    return bool(fs.isdir(path))


def listdir(url: str) -> list[str]:
    """Base names of the entries directly under ``url`` (empty if it does not exist)."""
    fs, path = get_filesystem(url)
    try:
        entries = fs.ls(path, detail=False)
    except FileNotFoundError:
        return []
    return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)


def makedirs(url: str) -> None:
    fs, path = get_filesystem(url)
    fs.makedirs(path, exist_ok=True)


def remove(url: str, missing_ok: bool = True) -> None:
    fs, path = get_filesystem(url)
    try:
        fs.rm(path, recursive=fs.isdir(path))
    except FileNotFoundError:
        if not missing_ok:
            raise


def read_bytes(url: str) -> bytes:
    fs, path = get_filesystem(url)
    return fs.cat_file(path)


def read_text(url: str) -> str:
    return read_bytes(url).decode("utf-8")


def write_bytes(url: str, data: bytes) -> None:
    """Write a whole object; local files are replaced atomically (temp file + rename)."""
    if is_local(url):
        path = local_path(url)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        return
    fs, path = get_filesystem(url)
    fs.pipe_file(path, data)


def write_text(url: str, text: str) -> None:
    write_bytes(url, text.encode("utf-8"))


def open_file(url: str, mode: str = "rb", **kwargs: Any) -> IO[Any]:
    fs, path = get_filesystem(url)
    return fs.open(path, mode, **kwargs)


def size(url: str) -> int:
    fs, path = get_filesystem(url)
    return int(fs.size(path))


@contextlib.contextmanager
def local_copy_for_reading(url: str) -> Iterator[str]:
    """A local path holding the object's bytes (the object itself when it is local)."""
    if is_local(url):
        yield local_path(url)
        return
    fs, path = get_filesystem(url)
    tmpdir = tempfile.mkdtemp(prefix="biggraph-stage-")
    try:
        target = os.path.join(tmpdir, os.path.basename(path) or "object")
        fs.get_file(path, target)
        yield target
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


@contextlib.contextmanager
def local_file_for_writing(url: str) -> Iterator[str]:
    """A local path to write to; on success it becomes ``url`` in one step.

    Locally that is a rename within the directory (atomic on POSIX); remotely it is a
    single upload, so a reader never sees a half-written object either way.
    """
    if is_local(url):
        final = os.path.abspath(local_path(url))
        os.makedirs(os.path.dirname(final), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(final), prefix=".tmp-", suffix=os.path.basename(final))
        os.close(fd)
        try:
            yield tmp
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        return
    fs, path = get_filesystem(url)
    tmpdir = tempfile.mkdtemp(prefix="biggraph-upload-")
    try:
        tmp = os.path.join(tmpdir, os.path.basename(path) or "object")
        yield tmp
        fs.put_file(tmp, path)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
