"""Compare-and-swap on one small object: read it with a tag, write it only if the tag still holds.

This is what lets two processes that never talk agree on who owns a checkpoint directory (job/checkpoint/owner.py).
The guarantee depends on the backend, and is as strong as the backend allows:

- local paths: the check and the write happen under ``flock`` on the object's directory (atomic between the
  processes of one machine, and on file systems whose ``flock`` is shared between machines); the tag is a hash of
  the content; the new content is fsynced and renamed into place, and the directory fsynced;
- S3: ``PutObject`` with ``If-None-Match: *`` (create) or ``If-Match: <ETag>`` (replace), which S3 itself checks
  atomically; a retried request whose first try landed is recognised by reading the object back. Two things could
  silently turn that into a blind overwrite, and both are checked before the first conditional write: s3fs drops
  any keyword the installed botocore's model lacks (botocore < 1.35.69 has no ``IfMatch``), so the model is
  checked; and some S3-compatible stores ignore the headers, so each store (endpoint and bucket) is probed once per
  process with a write that must be refused. A store that ignores them is refused for compare-and-swap, with one
  line, unless storage_options say ``conditional_writes: unchecked`` (then: read, compare, write, as below);
- other schemes: read, compare, write (no atomicity between machines; good enough to catch a writer that has been
  running for a while, which is the failure that matters).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import threading
import uuid
from collections.abc import Iterator
from typing import Any, Optional

from storage_adapters.errors import ConditionFailed, StorageError
from storage_adapters.fs import S3_SCHEMES, biggraph_option, call, get_filesystem, is_local, local_path, scheme_of
from storage_adapters.ops import read_bytes, replace_local, write_bytes
from storage_adapters.retry import client_error_info

logger = logging.getLogger("biggraph.storage")
_fallback_lock = threading.Lock()
_probe_lock = threading.Lock()
_store_honours: dict[tuple[str, str], bool] = {}  # (endpoint, bucket) -> whether it refused the probe's writes
_warned: set[tuple[str, str]] = set()  # stores already said to ignore the headers (conditional_writes: unchecked)
CONDITIONAL_KEYS = ("IfMatch", "IfNoneMatch")
BOTOCORE_FLOOR = "1.35.69"  # the first botocore whose S3 model has PutObject's IfMatch (IfNoneMatch: 1.35.0)


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
            from fsspec.asyn import sync  # lazy: only S3 needs it (storage_adapters.fs)

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
    if scheme_of(url) in S3_SCHEMES and _s3_checks_conditions(url):
        return _write_s3(url, data, expect)
    return _read_compare_write(url, data, expect)


def _read_compare_write(url: str, data: bytes, expect: Optional[str]) -> str:
    with _fallback_lock:
        try:
            current: Optional[str] = read_tagged(url)[1]
        except FileNotFoundError:
            current = None
        if current != expect:
            raise ConditionFailed(f"{url}: changed by another writer (expected {_what(expect)})")
        write_bytes(url, data)
        if scheme_of(url) not in S3_SCHEMES:
            return content_tag(data)
        now, tag = read_tagged(url)  # the tag a later read_tagged gives: the store's ETag
    if now != data:
        raise ConditionFailed(f"{url}: changed by another writer right after this write")
    return tag


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


def check_botocore_conditions(client: Any) -> None:
    """Raise StorageError unless the botocore model behind ``client`` knows PutObject's conditional keys: s3fs
    silently drops keywords the model lacks, which would make every conditional write a plain overwrite."""
    members = client.meta.service_model.operation_model("PutObject").input_shape.members
    missing = [key for key in CONDITIONAL_KEYS if key not in members]
    if missing:
        import botocore

        raise StorageError(
            f"botocore {botocore.__version__} does not know PutObject's {'/'.join(missing)} (conditional writes), so "
            f"s3fs would drop them and the checkpoint's owner lock would be a plain overwrite; install "
            f"botocore>={BOTOCORE_FLOOR} (pip install -U 'biggraph[s3]')")


def _s3_checks_conditions(url: str) -> bool:
    """Whether ``url``'s store checks conditional writes itself (True), or the caller accepted read-compare-write
    for a store that does not (False, said once). Raises StorageError for a store that ignores the headers."""
    fs, path = get_filesystem(url)
    check_botocore_conditions(fs.s3)
    bucket, key, _ = fs.split_path(path)
    store = (str(fs.s3.meta.endpoint_url), bucket)
    with _probe_lock:
        if store not in _store_honours:
            _store_honours[store] = _probe(url, fs, bucket, key)
    if _store_honours[store]:
        return True
    if biggraph_option(url, "conditional_writes", "checked") == "unchecked":
        if store not in _warned:
            _warned.add(store)
            logger.warning("%s: the store %s ignores conditional writes; conditional_writes: unchecked, so the owner "
                           "record is read, compared and written (not atomic between machines)", url, store[0])
        return False
    raise StorageError(
        f"{url}: the store {store[0]} ignores conditional writes (a PUT with If-Match on a wrong ETag or "
        f"If-None-Match on an existing object was accepted), so the single-writer lock cannot hold; use a store "
        f"that supports them, or accept read-compare-write with storage_options conditional_writes: unchecked")


def _probe(url: str, fs: Any, bucket: str, key: str) -> bool:
    """Whether the store refuses both conditional writes that must fail, tried on a scratch object beside ``key``."""
    scratch = f"{key.rsplit('/', 1)[0] + '/' if '/' in key else ''}.biggraph-condition-probe-{uuid.uuid4().hex}"

    def put(**condition: str) -> bool:
        try:
            fs.call_s3("put_object", Bucket=bucket, Key=scratch, Body=b"probe", **condition)
        except OSError as err:
            if _refused(err):
                return False
            raise
        return True

    call(url, "conditional write probe", lambda: put())
    try:
        wrong_tag = call(url, "conditional write probe", lambda: put(IfMatch='"00000000000000000000000000000000"'))
        over_existing = call(url, "conditional write probe", lambda: put(IfNoneMatch="*"))
    finally:
        with contextlib.suppress(Exception):
            fs.call_s3("delete_object", Bucket=bucket, Key=scratch)
    return not wrong_tag and not over_existing


def _refused(err: OSError) -> bool:
    """The store refused the condition: botocore's answer under s3fs' translation is a 412 PreconditionFailed, a 404
    (If-Match on an object that is gone) or a 409 ConditionalRequestConflict (another conditional write in flight)."""
    code, status = client_error_info(err)
    return status in (404, 412) or code == "ConditionalRequestConflict"


def _write_s3(url: str, data: bytes, expect: Optional[str]) -> str:
    fs, path = get_filesystem(url)
    bucket, key, _ = fs.split_path(path)
    condition: dict[str, Any] = {"IfNoneMatch": "*"} if expect is None else {"IfMatch": f'"{expect}"'}

    def put() -> Optional[str]:
        try:
            response = fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, **condition)
        except OSError as err:
            if _refused(err):
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


def forget_probes() -> None:
    """Forget which stores were probed (tests: a port of one test's store may be another's next)."""
    with _probe_lock:
        _store_honours.clear()
        _warned.clear()
