"""Every path is a URL: one thin layer over fsspec used by all of biggraph's I/O.

Plain paths and ``file://`` go to the local filesystem (and h5py opens them
directly); any other scheme (``s3://``, ``memory://``, ``gs://``, ``az://`` ...) goes
through the fsspec backend registered for it, imported lazily so that a missing
optional package is reported with the name of what to install. URLs are joined as
strings, never through ``pathlib.Path`` (which would turn ``s3://b/k`` into ``s3:/b/k``).

Remote calls go through :func:`storage_adapters.retry.call_with_retry`: transient
failures (timeouts, dropped connections, 5xx, throttling) are retried with backoff for a
bounded time, each retry logged; permanent ones (no such bucket, access denied) and an
endpoint that cannot be reached at all (DNS, refused, TLS: a mistyped ``endpoint_url``)
raise ``StorageError`` at once, naming the URL. ``FileNotFoundError`` for a missing object
passes through.

Extra filesystem arguments come from the config key ``storage_options``: either one
mapping for every remote scheme (``{"endpoint_url": "http://minio:9000"}``) or one per
scheme (``{"s3": {...}, "gs": {...}}``). They are never logged or put in messages. They are
not process settings: a job passes them with ``using(StorageSettings(options=...))``
(:mod:`storage_adapters.session`), and they apply to the calls made inside that block.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import IO, Any

from storage_adapters.errors import NotHDF5Error, StorageError
from storage_adapters.session import StorageSession, StorageSettings, carry, current, using


def _default_file_mode() -> int:
    """The mode a plain ``open()`` would give a new file under the current umask."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


_FILE_MODE = _default_file_mode()

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
    "http": "aiohttp",
    "https": "aiohttp",
}
# Object stores: no directories, the first path component is a bucket/container that must exist.
_OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"}
_LOCAL_SCHEMES = ("", "file", "local")

def _per_scheme(options: dict[str, Any]) -> bool:
    return bool(options) and all(
        isinstance(v, dict) and (k in _SCHEME_PACKAGES or k == "memory") for k, v in options.items()
    )


def storage_options_for(url: str) -> dict[str, Any]:
    """The keyword arguments for the fsspec filesystem of ``url`` (a copy; do not log it)."""
    scheme = scheme_of(url)
    if scheme in _LOCAL_SCHEMES or scheme == "memory":
        options: dict[str, Any] = {}
    else:
        raw = dict(current().settings.options)
        if _per_scheme(raw):
            options = dict(raw.get(scheme) or raw.get({"s3a": "s3", "gcs": "gs", "abfss": "abfs"}.get(scheme, ""), {}))
        else:
            options = raw
    if scheme in ("s3", "s3a"):
        # Another process (a reader, a second worker) may change the bucket at any time: never trust a cached listing.
        options.setdefault("use_listings_cache", False)
    return options


def scheme_of(url: str) -> str:
    """The URL scheme, or "" for a plain path."""
    head, sep, _ = url.partition("://")
    if not sep or "/" in head:
        return ""
    return head.lower()


def is_local(url: str) -> bool:
    return scheme_of(url) in _LOCAL_SCHEMES


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
    package = _SCHEME_PACKAGES.get(scheme)
    try:
        cls = fsspec.get_filesystem_class(scheme)
    except (ImportError, ValueError) as err:
        hint = f"; install it with: pip install {package}" if package else ""
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise StorageError(f"{url}: no filesystem backend for scheme '{scheme}://'{hint} ({reason})") from None
    options = storage_options_for(url)
    if scheme in ("s3", "s3a"):
        # A filesystem of the storage layer's own (``session=None`` is s3fs' default: same behaviour, another key in
        # fsspec's instance cache): instrument_s3 changes how it retries, which must not reach code that opens URLs
        # through fsspec directly (the importer's input files, a user's own code) and relies on s3fs' defaults.
        options.setdefault("session", None)
    try:
        fs = cls(**options)
    except ImportError as err:
        hint = f"; install it with: pip install {package}" if package else ""
        raise StorageError(f"{url}: the backend for '{scheme}://' cannot be loaded{hint} ({err})") from None
    except TypeError as err:
        # the message names the offending key, never its value
        raise StorageError(f"{url}: config key 'storage_options' not accepted by {cls.__name__}: {err}") from None
    if scheme in ("s3", "s3a"):
        from storage_adapters.retry import instrument_s3

        try:
            instrument_s3(fs)  # creates the botocore client: no request is sent, so any failure is configuration
        except Exception as err:  # noqa: BLE001 - e.g. "Invalid endpoint: minio:9000" (no http://), unknown profile
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise StorageError(f"{url}: cannot set up the S3 client from storage_options: {reason}") from None
    return fs, fs._strip_protocol(url)


def _call(url: str, operation: str, func: Any) -> Any:
    if is_local(url):
        try:
            return func()
        except PermissionError as err:
            raise StorageError(f"{url}: {operation} failed: permission denied ({err.strerror})") from None
    from storage_adapters.retry import call_with_retry

    return call_with_retry(url, operation, func)


def exists(url: str) -> bool:
    fs, path = get_filesystem(url)
    return bool(_call(url, "exists", lambda: fs.exists(path)))


def isdir(url: str) -> bool:
    fs, path = get_filesystem(url)
    return bool(_call(url, "isdir", lambda: fs.isdir(path)))


def listdir(url: str) -> list[str]:
    """Base names of the entries directly under ``url`` (empty if it does not exist)."""
    fs, path = get_filesystem(url)

    def ls() -> list[str]:
        fs.invalidate_cache(path)  # other processes write here too (a cached listing would miss their files)
        try:
            return list(fs.ls(path, detail=False))
        except FileNotFoundError:
            return []

    entries = _call(url, "list", ls)
    prefix = path.rstrip("/")
    names = {e.rstrip("/").rsplit("/", 1)[-1] for e in entries if e.rstrip("/") != prefix}
    return sorted(names)


def _check_bucket(url: str, fs: Any, path: str) -> None:
    bucket = path.split("/", 1)[0]
    if not bucket:
        raise StorageError(f"{url}: no bucket name in the URL")
    from storage_adapters.retry import unreachable_marker, unreachable_since

    marker = unreachable_marker()
    if not _call(url, "bucket check", lambda: fs.exists(bucket)):
        # s3fs answers False for a bucket whatever went wrong: an endpoint that could not be reached is not
        # a missing bucket
        unreachable = unreachable_since(marker)
        if unreachable:
            raise StorageError(f"{url}: bucket check failed: {unreachable}")
        raise StorageError(f"{url}: the bucket '{bucket}' does not exist (or these credentials cannot see it)")


def check_bucket(url: str) -> None:
    """On an object store, raise StorageError unless the URL's bucket exists; nothing to check for other URLs.

    A directory that is not there is an ordinary answer; a bucket that is not there is a mistyped URL or
    missing credentials, and the message should say so instead of "directory not found"."""
    if scheme_of(url) in _OBJECT_STORES:
        fs, path = get_filesystem(url)
        _check_bucket(url, fs, path)


def makedirs(url: str) -> None:
    """Create a directory; on object stores (no directories) check that the bucket exists instead."""
    fs, path = get_filesystem(url)
    if scheme_of(url) in _OBJECT_STORES:
        _check_bucket(url, fs, path)
        return
    _call(url, "makedirs", lambda: fs.makedirs(path, exist_ok=True))


def remove(url: str, missing_ok: bool = True) -> None:
    fs, path = get_filesystem(url)

    def rm() -> None:
        if not missing_ok and scheme_of(url) in _OBJECT_STORES and not fs.exists(path):
            raise FileNotFoundError(url)  # deleting a missing key is not an error for S3 itself
        try:
            fs.rm(path, recursive=fs.isdir(path))
        except FileNotFoundError:
            if not missing_ok:
                raise

    _call(url, "remove", rm)


def read_bytes(url: str) -> bytes:
    fs, path = get_filesystem(url)
    return _call(url, "read", lambda: fs.cat_file(path))


def read_text(url: str) -> str:
    return read_bytes(url).decode("utf-8")


def write_bytes(url: str, data: bytes) -> None:
    """Write a whole object; local files are replaced atomically (temp file + rename), remote ones in one PUT."""
    if is_local(url):
        path = local_path(url)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".tmp-")
        os.fchmod(fd, _FILE_MODE)  # mkstemp makes 0600; outputs get the usual umask-derived mode
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
    _call(url, "write", lambda: fs.pipe_file(path, data))


def write_text(url: str, text: str) -> None:
    write_bytes(url, text.encode("utf-8"))


def open_file(url: str, mode: str = "rb", **kwargs: Any) -> IO[Any]:
    """An fsspec file object (the opening is retried; reads and writes on it are the backend's own)."""
    fs, path = get_filesystem(url)
    return _call(url, "open", lambda: fs.open(path, mode, **kwargs))


def size(url: str) -> int:
    fs, path = get_filesystem(url)
    return int(_call(url, "size", lambda: fs.size(path)))


def info(url: str) -> dict[str, Any]:
    """The backend's metadata of one object (size, ETag/mtime where it has them)."""
    fs, path = get_filesystem(url)
    return dict(_call(url, "info", lambda: fs.info(path)))


def get_file(url: str, local: str) -> None:
    """Download ``url`` to the local path ``local`` (retried; a failed try leaves no file behind)."""
    fs, path = get_filesystem(url)

    def get() -> None:
        try:
            fs.get_file(path, local)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(local)
            raise

    _call(url, "download", get)


def put_file(local: str, url: str) -> None:
    """Upload the local file ``local`` to ``url`` in one step (retried)."""
    fs, path = get_filesystem(url)
    _call(url, "upload", lambda: fs.put_file(local, path))


def copy(src: str, dst: str) -> None:
    """Copy one object; on the same remote filesystem the store copies it server-side (retried)."""
    if is_local(src) and is_local(dst):
        os.makedirs(os.path.dirname(os.path.abspath(local_path(dst))), exist_ok=True)
        shutil.copyfile(local_path(src), local_path(dst))
        return
    if scheme_of(src) == scheme_of(dst):
        fs, src_path = get_filesystem(src)
        _, dst_path = get_filesystem(dst)
        _call(src, f"copy to {dst}", lambda: fs.copy(src_path, dst_path))
        return
    with local_copy_for_reading(src) as local:
        with local_file_for_writing(dst) as tmp:
            shutil.copyfile(local, tmp)


@contextlib.contextmanager
def local_copy_for_reading(url: str) -> Iterator[str]:
    """A local path holding the object's bytes (the object itself when it is local)."""
    if is_local(url):
        yield local_path(url)
        return
    tmpdir = tempfile.mkdtemp(prefix="biggraph-stage-")
    try:
        target = os.path.join(tmpdir, url.rstrip("/").rsplit("/", 1)[-1] or "object")
        get_file(url, target)
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
        os.fchmod(fd, _FILE_MODE)
        os.close(fd)
        try:
            yield tmp
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        return
    tmpdir = upload_staging_dir()
    try:
        tmp = os.path.join(tmpdir, url.rstrip("/").rsplit("/", 1)[-1] or "object")
        yield tmp
        put_file(tmp, url)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


UPLOAD_DIR_PREFIX = "biggraph-upload-"


def upload_staging_dir() -> str:
    """A new local directory to build a file in before it is uploaded, named after this process so that a
    later run can tell a killed process's leftovers from a live one's (``remove_stale_upload_dirs``)."""
    return tempfile.mkdtemp(prefix=f"{UPLOAD_DIR_PREFIX}{os.getpid()}-")


def remove_stale_upload_dirs(root: str | None = None) -> list[str]:
    """Delete staging directories of processes that no longer exist (killed before they cleaned up).

    Only this user's directories whose owner PID is gone are touched; a directory of a live process, or
    one whose name carries no PID, is left alone. Returns the paths removed.
    """
    root = root or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(UPLOAD_DIR_PREFIX):
            continue
        pid_text = name[len(UPLOAD_DIR_PREFIX):].split("-", 1)[0]
        if not pid_text.isdigit() or _process_exists(int(pid_text)):
            continue
        path = os.path.join(root, name)
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


__all__ = [
    "NotHDF5Error", "StorageError", "StorageSession", "StorageSettings", "carry", "current", "using",
    "UPLOAD_DIR_PREFIX", "remove_stale_upload_dirs", "upload_staging_dir",
    "check_bucket", "copy", "exists", "get_file", "get_filesystem", "info", "is_local", "isdir", "join", "listdir",
    "local_copy_for_reading", "local_file_for_writing", "local_path", "makedirs", "open_file", "put_file",
    "read_bytes", "read_text", "remove", "scheme_of", "size", "storage_options_for",
    "write_bytes", "write_text",
]
