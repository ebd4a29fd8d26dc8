"""Local files standing in for objects: a local copy to read, a local file that becomes an object in one
step, the staging directories of uploads (and the cleanup of a killed process's ones), and copies between URLs."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator

from storage_adapters.fs import FILE_MODE, call, get_filesystem, is_local, local_path, scheme_of
from storage_adapters.ops import get_file, put_file


def copy(src: str, dst: str, link: bool = False) -> None:
    """Copy one object; on the same remote filesystem the store copies it server-side (retried). ``link``: locally,
    a hard link where the file system allows it (same bytes, no copy: for files never modified in place)."""
    if is_local(src) and is_local(dst):
        os.makedirs(os.path.dirname(os.path.abspath(local_path(dst))), exist_ok=True)
        if link:
            try:
                os.link(local_path(src), local_path(dst))
                return
            except FileExistsError:
                os.unlink(local_path(dst))
                return copy(src, dst, link)
            except OSError:
                pass  # another file system, or links not supported: copy
        shutil.copyfile(local_path(src), local_path(dst))
        return
    if scheme_of(src) == scheme_of(dst):
        fs, src_path = get_filesystem(src)
        _, dst_path = get_filesystem(dst)
        call(src, f"copy to {dst}", lambda: fs.copy(src_path, dst_path))
        return
    with local_copy_for_reading(src) as local:
        with local_file_for_writing(dst) as tmp:
            shutil.copyfile(local, tmp)


def move(src: str, dst: str) -> None:
    """Move one object over ``dst``: a rename locally (atomic), else a whole copy and then the removal of the source
    (a crash between the two leaves both; moving again finishes it). FileNotFoundError when ``src`` is gone."""
    if is_local(src) and is_local(dst):
        os.replace(local_path(src), local_path(dst))
        return
    fs, path = get_filesystem(src)
    if not call(src, "exists", lambda: fs.exists(path)):
        raise FileNotFoundError(src)
    copy(src, dst)
    call(src, "remove", lambda: fs.rm(path))


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
        os.fchmod(fd, FILE_MODE)
        os.close(fd)
        try:
            yield tmp
            _fsync_file(tmp)  # durable before the rename publishes it (a power loss must not leave empty blocks)
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


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    removed: list[str] = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(UPLOAD_DIR_PREFIX):
            continue
        pid_text = name[len(UPLOAD_DIR_PREFIX):].split("-", 1)[0]
        if not pid_text.isdigit() or process_exists(int(pid_text)):
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


def process_exists(pid: int) -> bool:
    """Whether a process with this PID runs on this machine (in this PID namespace)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True
