"""Compare-and-swap on one small object: read it with a tag, write it only if the tag still holds.

This is what lets two processes that never talk agree on who owns a checkpoint directory (job/checkpoint/owner.py).
The guarantee depends on the backend, and is as strong as the backend allows:

- local paths: the check and the write happen under ``flock`` on the object's directory (atomic between the
  processes of one machine, and on file systems whose ``flock`` is shared between machines); the tag is a hash of
  the content; the new content is fsynced and renamed into place, and the directory fsynced;
- S3: ``PutObject`` with ``If-None-Match: *`` (create) or ``If-Match: <ETag>`` (replace), which S3 itself checks
  atomically; a retried request whose first try landed is recognised by reading the object back;
- other schemes: read, compare, write (no atomicity between machines; good enough to catch a writer that has been
  running for a while, which is the failure that matters).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import threading
from collections.abc import Iterator
from typing import Any, Optional

from fsspec.asyn import sync

from storage_adapters.errors import ConditionFailed, StorageError
from storage_adapters.fs import S3_SCHEMES, call, get_filesystem, is_local, local_path, scheme_of
from storage_adapters.ops import read_bytes, replace_local, write_bytes

_fallback_lock = threading.Lock()


def content_tag(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:32]


def read_tagged(url: str) -> tuple[bytes, str]:
    """The object's bytes and the tag a later :func:`write_if` compares against; FileNotFoundError if absent."""
    if scheme_of(url) in S3_SCHEMES:
        fs, path = get_filesystem(url)
        bucket, key, _ = fs.split_path(path)

        async def fetch() -> tuple[bytes, str]:
            response = await fs._call_s3("get_object", Bucket=bucket, Key=key)
            async with response["Body"] as body:
                data = await body.read()
            return data, str(response["ETag"]).strip('"')

        def get() -> tuple[bytes, str]:
            return sync(fs.loop, fetch)  # bytes and ETag from one response: no other write can fall between them

        data, tag = call(url, "read", get)
        return data, tag
    data = read_bytes(url)
    return data, content_tag(data)


def write_if(url: str, data: bytes, expect: Optional[str]) -> str:
    """Write ``data`` to ``url`` if the object is still as last read: absent when ``expect`` is None, else holding
    the tag ``expect``. Returns the new tag; raises :class:`ConditionFailed` when another writer changed it."""
    if is_local(url):
        return _write_local(url, data, expect)
    if scheme_of(url) in S3_SCHEMES:
        return _write_s3(url, data, expect)
    with _fallback_lock:
        try:
            current: Optional[str] = read_tagged(url)[1]
        except FileNotFoundError:
            current = None
        if current != expect:
            raise ConditionFailed(f"{url}: changed by another writer (expected {_what(expect)})")
        write_bytes(url, data)
    return content_tag(data)


def _what(expect: Optional[str]) -> str:
    return "no object" if expect is None else f"version {expect[:12]}"


@contextlib.contextmanager
def _directory_lock(directory: str) -> Iterator[int]:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _write_local(url: str, data: bytes, expect: Optional[str]) -> str:
    path = os.path.abspath(local_path(url))
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    try:
        with _directory_lock(directory) as dir_fd:
            try:
                with open(path, "rb") as fh:
                    current: Optional[str] = content_tag(fh.read())
            except FileNotFoundError:
                current = None
            if current != expect:
                raise ConditionFailed(f"{url}: changed by another writer (expected {_what(expect)})")
            replace_local(path, data)
            os.fsync(dir_fd)
    except PermissionError as err:
        raise StorageError(f"{url}: write failed: permission denied ({err.strerror})") from None
    return content_tag(data)


def _write_s3(url: str, data: bytes, expect: Optional[str]) -> str:
    fs, path = get_filesystem(url)
    bucket, key, _ = fs.split_path(path)
    condition: dict[str, Any] = {"IfNoneMatch": "*"} if expect is None else {"IfMatch": f'"{expect}"'}

    def put() -> Optional[str]:
        try:
            response = fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, **condition)
        except (FileExistsError, FileNotFoundError):
            return None
        except OSError as err:
            if err.errno == errno.EINVAL or "precondition" in str(err).lower() or "conditional" in str(err).lower():
                return None
            raise
        return str(response["ETag"]).strip('"')

    tag = call(url, "conditional write", put)
    fs.invalidate_cache(path)
    if tag is not None:
        return str(tag)
    # refused: either another writer, or our own earlier try of this very request landed before a retry
    try:
        now, now_tag = read_tagged(url)
    except FileNotFoundError:
        raise ConditionFailed(f"{url}: removed by another writer (expected {_what(expect)})") from None
    if now == data:
        return now_tag
    raise ConditionFailed(f"{url}: changed by another writer (expected {_what(expect)})")


def sync_directory(url: str) -> None:
    """Make the renames into a local directory durable (fsync of the directory); nothing to do elsewhere (an
    object store's PUT is durable when it returns)."""
    if not is_local(url):
        return
    try:
        fd = os.open(os.path.abspath(local_path(url)), os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.ENOTSUP):  # file systems without directory fsync
            raise
    finally:
        os.close(fd)
