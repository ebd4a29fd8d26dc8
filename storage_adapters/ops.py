"""The storage operations on one URL (exists, list, read, write, remove ...), each retried when remote."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Sequence
from typing import IO, Any

from storage_adapters import local
from storage_adapters.errors import StorageError
from storage_adapters.fs import FILE_MODE, OBJECT_STORES, S3_SCHEMES, call, get_filesystem, is_local, local_path, scheme_of
from storage_adapters.multipart import download_file, upload_file


def _local_path(url: str) -> str | None:
    """The absolute OS path of a local URL (the path fsspec's LocalFileSystem would be given), else None: local
    operations go through :mod:`storage_adapters.local`, without importing fsspec."""
    return os.path.abspath(local_path(url)) if is_local(url) else None


def exists(url: str) -> bool:
    if (own := _local_path(url)) is not None:
        return call(url, "exists", lambda: local.exists(own))
    fs, path = get_filesystem(url)
    return bool(call(url, "exists", lambda: fs.exists(path)))


def change_marker(url: str) -> tuple[int, int] | None:
    """What changes when a local file is rewritten (size, mtime in ns), to tell a cached reading of it stale; None
    for an object store (whose objects a reader caches for its session). FileNotFoundError for a missing local
    file."""
    if not is_local(url):
        return None
    stat = os.stat(local_path(url))
    return stat.st_size, stat.st_mtime_ns


def isdir(url: str) -> bool:
    if (own := _local_path(url)) is not None:
        return call(url, "isdir", lambda: local.isdir(own))
    fs, path = get_filesystem(url)
    return bool(call(url, "isdir", lambda: fs.isdir(path)))


def listdir(url: str) -> list[str]:
    """Base names of the entries directly under ``url`` (empty if it does not exist)."""
    if (own := _local_path(url)) is not None:
        def own_entries() -> list[str]:
            try:
                return local.entries(own)
            except FileNotFoundError:
                return []

        return sorted(set(call(url, "list", own_entries)))
    fs, path = get_filesystem(url)

    def ls() -> list[str]:
        fs.invalidate_cache(path)  # other processes write here too (a cached listing would miss their files)
        try:
            return list(fs.ls(path, detail=False))
        except FileNotFoundError:
            return []

    entries = call(url, "list", ls)
    prefix = path.rstrip("/")
    names = {e.rstrip("/").rsplit("/", 1)[-1] for e in entries if e.rstrip("/") != prefix}
    return sorted(names)


def _check_bucket(url: str, fs: Any, path: str) -> None:
    bucket = path.split("/", 1)[0]
    if not bucket:
        raise StorageError(f"{url}: no bucket name in the URL")
    def head() -> bool | None:
        # HeadBucket's own answer: s3fs' exists() says False whatever went wrong (an endpoint that cannot be
        # reached, a 500), which is not a missing bucket. A refusal (403: credentials without s3:ListBucket) is
        # asked again through exists(), whose other probe (GetBucketLocation) such credentials may pass.
        try:
            fs.call_s3("head_bucket", Bucket=bucket)
            return True
        except PermissionError:
            return None
        except FileNotFoundError:
            return False

    found = call(url, "bucket check", head) if scheme_of(url) in S3_SCHEMES else None
    if found is None:
        found = call(url, "bucket check", lambda: fs.exists(bucket))
    if not found:
        raise StorageError(f"{url}: the bucket '{bucket}' does not exist (or these credentials cannot see it)")


def check_bucket(url: str) -> None:
    """On an object store, raise StorageError unless the URL's bucket exists; nothing to check for other URLs.

    A directory that is not there is an ordinary answer; a bucket that is not there is a mistyped URL or
    missing credentials, and the message should say so instead of "directory not found"."""
    if scheme_of(url) in OBJECT_STORES:
        fs, path = get_filesystem(url)
        _check_bucket(url, fs, path)


def makedirs(url: str) -> None:
    """Create a directory; on object stores (no directories) check that the bucket exists instead."""
    if (own := _local_path(url)) is not None:
        call(url, "makedirs", lambda: local.makedirs(own))
        return
    fs, path = get_filesystem(url)
    if scheme_of(url) in OBJECT_STORES:
        _check_bucket(url, fs, path)
        return
    call(url, "makedirs", lambda: fs.makedirs(path, exist_ok=True))


def remove(url: str, missing_ok: bool = True) -> None:
    if (own := _local_path(url)) is not None:
        def rm_local() -> None:
            try:
                local.remove(own)
            except FileNotFoundError:
                if not missing_ok:
                    raise

        call(url, "remove", rm_local)
        return
    fs, path = get_filesystem(url)

    def rm() -> None:
        if not missing_ok and scheme_of(url) in OBJECT_STORES and not fs.exists(path):
            raise FileNotFoundError(url)  # deleting a missing key is not an error for S3 itself
        try:
            fs.rm(path, recursive=fs.isdir(path))
        except FileNotFoundError:
            if not missing_ok:
                raise

    call(url, "remove", rm)


CHANGE_TAGS = ("ETag", "etag", "md5Hash", "generation", "mtime", "LastModified", "last_modified", "created")


def tree_listing(url: str) -> list[tuple[str, int, str]] | None:
    """Every file under ``url`` (recursively) as (path relative to it, size, change tag), sorted: what tells a
    directory's content unchanged without reading it (locally the modification time in ns and the inode, on S3 the
    ETag, which changes with the object's bytes). Empty when ``url`` does not exist; None when the backend reports
    no change tag for some file (nothing can be concluded from the listing then). One request per 1,000 objects on
    S3."""
    if is_local(url):
        root = local_path(url)
        found: list[tuple[str, int, str]] = []
        for directory, _, files in os.walk(root):
            for name in files:
                full = os.path.join(directory, name)
                try:
                    stat = os.stat(full)
                except FileNotFoundError:
                    continue
                # a replaced file (written under a temporary name, renamed over) is a new inode even within one
                # tick of the filesystem's clock
                found.append((os.path.relpath(full, root), stat.st_size, f"{stat.st_mtime_ns}:{stat.st_ino}"))
        return sorted(found)
    fs, path = get_filesystem(url)

    def find() -> dict[str, Any]:
        fs.invalidate_cache(path)
        try:
            return dict(fs.find(path, detail=True))
        except FileNotFoundError:
            return {}

    listing: list[tuple[str, int, str]] = []
    prefix = path.rstrip("/") + "/"
    for name, detail in call(url, "list", find).items():
        tag = next((str(detail[k]) for k in CHANGE_TAGS if detail.get(k) not in (None, "")), None)
        if tag is None:
            return None
        listing.append((name[len(prefix):] if name.startswith(prefix) else name, int(detail.get("size") or 0), tag))
    return sorted(listing)


def read_bytes(url: str) -> bytes:
    if (own := _local_path(url)) is not None:
        return call(url, "read", lambda: local.read_bytes(own))
    fs, path = get_filesystem(url)
    return call(url, "read", lambda: fs.cat_file(path))


def read_text(url: str) -> str:
    return read_bytes(url).decode("utf-8")


def read_many(urls: Sequence[str]) -> list[bytes | None]:
    """Each object's bytes in the order given, None for one that is missing. Remote objects of one scheme are read
    in one ``fs.cat`` (concurrent requests on an async filesystem such as s3fs); one that failed otherwise is read
    again alone, retried: a restarted group's rank 0 reads hundreds of small progress records, and one after
    another against an object store that took ~10 s of a recovery (bench/RESULTS.md, "Chaos")."""
    def one(url: str) -> bytes | None:
        try:
            return read_bytes(url)
        except FileNotFoundError:
            return None

    found: dict[str, bytes | None] = {}
    by_scheme: dict[str, list[str]] = {}
    for url in dict.fromkeys(urls):
        if is_local(url) or any(c in url for c in "*?["):  # fs.cat would expand a glob
            found[url] = one(url)
        else:
            by_scheme.setdefault(scheme_of(url), []).append(url)
    for group in by_scheme.values():
        fs, _ = get_filesystem(group[0])
        paths = {get_filesystem(url)[1]: url for url in group}
        answers = call(group[0], "read", lambda fs=fs, paths=paths: fs.cat(list(paths), on_error="return"))
        for path, url in paths.items():
            answer = answers.get(path, FileNotFoundError(url))
            found[url] = answer if isinstance(answer, bytes) else None if isinstance(answer, FileNotFoundError) \
                else one(url)
    return [found[url] for url in urls]


def remove_many(urls: Sequence[str]) -> None:
    """Remove the objects (files, never directories) ``urls``; missing ones are no error. On an object store, one
    bulk request per scheme and bucket (s3fs sends up to 1,000 keys a request) instead of a listing and a delete per
    object: the progress log's compaction drops hundreds of records at once."""
    by_scheme: dict[str, list[str]] = {}
    for url in urls:
        if is_local(url):
            with contextlib.suppress(FileNotFoundError):
                os.remove(local_path(url))
        else:
            by_scheme.setdefault(scheme_of(url), []).append(url)
    for group in by_scheme.values():
        fs, _ = get_filesystem(group[0])
        paths = [get_filesystem(url)[1] for url in group]

        def rm(paths: list[str] = paths, fs: Any = fs) -> None:
            try:
                fs.rm(paths)
            except FileNotFoundError:  # some filesystems refuse a list with a missing path: one at a time then
                for path in paths:
                    with contextlib.suppress(FileNotFoundError):
                        fs.rm_file(path)

        call(group[0], "remove", rm)


def write_bytes(url: str, data: bytes) -> None:
    """Write a whole object; local files are replaced atomically (temp file + rename), remote ones in one PUT."""
    if is_local(url):
        path = local_path(url)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        replace_local(path, data)
        return
    fs, path = get_filesystem(url)
    call(url, "write", lambda: fs.pipe_file(path, data))


def replace_local(path: str, data: bytes) -> None:
    """Replace the local file ``path`` atomically with ``data``: a temporary file beside it, fsynced, renamed over
    it (a reader sees the old bytes or the new ones, and after a power loss the new ones are whole)."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    os.fchmod(fd, FILE_MODE)  # mkstemp makes 0600; outputs get the usual umask-derived mode
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


def write_text(url: str, text: str) -> None:
    write_bytes(url, text.encode("utf-8"))


def append_text(url: str, text: str) -> None:
    """Append to a text object: in place locally; object stores cannot append, so there it is rewritten whole."""
    if is_local(url):
        path = local_path(url)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(text)
        return
    try:
        old = read_text(url)
    except FileNotFoundError:
        old = ""
    write_text(url, old + text)


def open_file(url: str, mode: str = "rb", **kwargs: Any) -> IO[Any]:
    """An fsspec file object (the opening is retried; reads and writes on it are the backend's own)."""
    fs, path = get_filesystem(url)
    return call(url, "open", lambda: fs.open(path, mode, **kwargs))


def size(url: str) -> int:
    if (own := _local_path(url)) is not None:
        return call(url, "size", lambda: local.size(own))
    fs, path = get_filesystem(url)
    return int(call(url, "size", lambda: fs.size(path)))


def info(url: str) -> dict[str, Any]:
    """The backend's metadata of one object (size, ETag/mtime where it has them)."""
    if (own := _local_path(url)) is not None:
        return call(url, "info", lambda: local.info(own))
    fs, path = get_filesystem(url)
    return dict(call(url, "info", lambda: fs.info(path)))


def get_file(url: str, local: str) -> None:
    """Download ``url`` to the local path ``local`` (retried; a failed try leaves no file behind)."""
    fs, path = get_filesystem(url)

    def get() -> None:
        try:
            if scheme_of(url) in S3_SCHEMES:
                download_file(fs, path, local, url=url)  # ranges resumed where they broke off, bounded memory
            else:
                fs.get_file(path, local)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(local)
            raise

    call(url, "download", get)


def put_file(local: str, url: str) -> None:
    """Upload the local file ``local`` to ``url`` in one step: the object appears whole or not at all (retried;
    on S3 part by part, with bounded memory: :mod:`storage_adapters.multipart`)."""
    fs, path = get_filesystem(url)
    if scheme_of(url) in S3_SCHEMES:
        call(url, "upload", lambda: upload_file(fs, local, path, url))
        return
    call(url, "upload", lambda: fs.put_file(local, path))
