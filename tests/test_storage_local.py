"""``storage_adapters`` on plain paths, ``file://`` and ``memory://`` URLs: the same calls
must behave the same everywhere, and writes must never leave partial files behind."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from storage_scope import use_storage

import storage_adapters as storage


@pytest.fixture(params=["path", "file", "memory"])
def base(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty directory URL of each kind."""
    if request.param == "path":
        yield str(tmp_path / "root")
    elif request.param == "file":
        yield f"file://{tmp_path}/root"
    else:
        import fsspec

        name = f"storage-test-{uuid.uuid4().hex}"
        yield f"memory://{name}/root"
        if fsspec.filesystem("memory").exists(f"/{name}"):  # removing every file can remove the implied directory too
            fsspec.filesystem("memory").rm(f"/{name}", recursive=True)


def test_scheme_and_locality() -> None:
    assert storage.scheme_of("/a/b") == "" and storage.scheme_of("rel/x://y") == ""
    assert storage.scheme_of("S3://bucket/k") == "s3" and storage.scheme_of("file:///tmp") == "file"
    assert storage.is_local("/a") and storage.is_local("file:///a") and not storage.is_local("memory://a")
    assert storage.local_path("file:///tmp/x") == "/tmp/x" and storage.local_path("rel/x") == "rel/x"
    with pytest.raises(ValueError):
        storage.local_path("s3://bucket/x")


def test_join_keeps_schemes_and_double_slashes() -> None:
    assert storage.join("s3://bucket", "a", "b.h5") == "s3://bucket/a/b.h5"
    assert storage.join("s3://bucket/", "/a") == "s3://bucket/a"
    assert storage.join("memory://x/y", "z") == "memory://x/y/z"
    assert storage.join("/tmp/a", "b") == "/tmp/a/b"
    assert storage.join("file:///tmp", "c") == "file:///tmp/c"
    assert storage.join("base") == "base"


def test_write_read_exists_listdir(base: str) -> None:
    assert not storage.exists(base)
    assert storage.listdir(base) == []
    storage.makedirs(base)
    assert storage.isdir(base)
    storage.write_text(storage.join(base, "b.txt"), "héllo\n")
    storage.write_bytes(storage.join(base, "sub", "a.bin"), b"\x00\x01")
    assert storage.exists(storage.join(base, "b.txt"))
    assert storage.read_text(storage.join(base, "b.txt")) == "héllo\n"
    assert storage.read_bytes(storage.join(base, "sub", "a.bin")) == b"\x00\x01"
    assert storage.size(storage.join(base, "sub", "a.bin")) == 2
    assert storage.listdir(base) == ["b.txt", "sub"]
    assert storage.isdir(storage.join(base, "sub")) and not storage.isdir(storage.join(base, "b.txt"))
    storage.write_text(storage.join(base, "b.txt"), "replaced")
    assert storage.read_text(storage.join(base, "b.txt")) == "replaced"
    with storage.open_file(storage.join(base, "b.txt"), "rb") as handle:
        assert handle.read(3) == b"rep"
    with pytest.raises(FileNotFoundError):
        storage.read_bytes(storage.join(base, "missing"))


def test_remove(base: str) -> None:
    storage.write_text(storage.join(base, "d", "x"), "1")
    storage.write_text(storage.join(base, "f"), "1")
    storage.remove(storage.join(base, "f"))
    storage.remove(storage.join(base, "d"))
    assert storage.listdir(base) == []
    storage.remove(storage.join(base, "missing"))  # missing_ok by default
    with pytest.raises(FileNotFoundError):
        storage.remove(storage.join(base, "missing"), missing_ok=False)


def test_atomic_writes_leave_no_temporary_files(base: str) -> None:
    for i in range(3):
        storage.write_bytes(storage.join(base, "data.bin"), bytes([i]) * 100)
    assert storage.listdir(base) == ["data.bin"]


def test_local_file_for_writing_publishes_on_success(base: str) -> None:
    url = storage.join(base, "out", "file.h5")
    with storage.local_file_for_writing(url) as tmp:
        assert os.path.isabs(tmp) or tmp.startswith("/")
        with open(tmp, "wb") as handle:
            handle.write(b"complete")
        assert not storage.exists(url)  # not visible before the block ends
    assert storage.read_bytes(url) == b"complete"
    assert storage.listdir(storage.join(base, "out")) == ["file.h5"]


def test_local_file_for_writing_leaves_nothing_on_exception(base: str) -> None:
    url = storage.join(base, "file.h5")
    storage.write_bytes(url, b"old")
    seen: list[str] = []
    with pytest.raises(RuntimeError, match="boom"):
        with storage.local_file_for_writing(url) as tmp:
            seen.append(tmp)
            with open(tmp, "wb") as handle:
                handle.write(b"half")
            raise RuntimeError("boom")
    assert storage.read_bytes(url) == b"old"  # the previous version is untouched
    assert storage.listdir(base) == ["file.h5"]  # no temporary left next to it
    assert not os.path.exists(seen[0])  # nor in a staging directory


def test_local_copy_for_reading(base: str) -> None:
    url = storage.join(base, "x.bin")
    storage.write_bytes(url, b"abc")
    with storage.local_copy_for_reading(url) as path:
        with open(path, "rb") as handle:
            assert handle.read() == b"abc"
        staged = path
    if storage.is_local(url):
        assert staged == storage.local_path(url)  # no copy of local files
    else:
        assert not os.path.exists(staged)  # the staged copy is cleaned up


def test_unknown_scheme_names_the_url_and_package() -> None:
    with pytest.raises(storage.StorageError, match=r"nosuch://b/k: no filesystem backend for scheme 'nosuch://'"):
        storage.exists("nosuch://b/k")


def test_storage_options_are_not_passed_to_memory_or_local(tmp_path: Path) -> None:
    use_storage({"endpoint_url": "http://127.0.0.1:1"})
    try:
        storage.write_text(storage.join(str(tmp_path), "a"), "1")
        name = f"opts-{uuid.uuid4().hex}"
        storage.write_text(f"memory://{name}/a", "2")
        assert storage.read_text(f"memory://{name}/a") == "2"
        storage.remove(f"memory://{name}")
    finally:
        use_storage({})


def test_stale_upload_staging_dirs_of_dead_processes_are_removed(tmp_path: Path) -> None:
    """A trainer SIGKILLed during an upload leaves its staging copy; the next start deletes it, and only it."""
    import subprocess
    import sys

    from storage_adapters import UPLOAD_DIR_PREFIX, remove_stale_upload_dirs

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    dead_pid = int(dead.stdout)
    stale = tmp_path / f"{UPLOAD_DIR_PREFIX}{dead_pid}-abc"
    (stale / "inner").mkdir(parents=True)
    (stale / "embeddings_node_0.v3.h5").write_bytes(b"x" * 100)
    live = tmp_path / f"{UPLOAD_DIR_PREFIX}{os.getpid()}-def"  # this process: still uploading
    live.mkdir()
    unnamed = tmp_path / f"{UPLOAD_DIR_PREFIX}old-layout"  # no PID in the name: not ours to judge
    unnamed.mkdir()
    other = tmp_path / "something-else"
    other.mkdir()
    assert remove_stale_upload_dirs(str(tmp_path)) == [str(stale)]
    assert not stale.exists()
    assert live.exists() and unnamed.exists() and other.exists()


def test_upload_staging_dir_names_its_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    from storage_adapters import UPLOAD_DIR_PREFIX, upload_staging_dir

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    made = upload_staging_dir()
    assert os.path.basename(made).startswith(f"{UPLOAD_DIR_PREFIX}{os.getpid()}-")
    assert os.path.isdir(made)


# settings scoped to a job ---------------------------------------------------------------------------


def test_storage_layer_does_not_import_job() -> None:
    code = ("import sys, storage_adapters, storage_adapters.edge_reader\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'job'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_two_jobs_in_one_process_keep_their_own_options() -> None:
    """A second job's settings (another thread, another endpoint) never reach the first one's calls."""
    seen: dict[str, str] = {}
    barrier = threading.Barrier(2)

    def job(name: str) -> None:
        with storage.using(storage.StorageSettings(options={"endpoint_url": f"http://{name}:9000"})):
            barrier.wait(10)  # both scopes are open at once
            seen[name] = storage.storage_options_for("s3://b/k")["endpoint_url"]

    threads = [threading.Thread(target=job, args=(name,)) for name in ("minio", "ceph")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert seen == {"minio": "http://minio:9000", "ceph": "http://ceph:9000"}
    assert "endpoint_url" not in storage.storage_options_for("s3://b/k")  # nothing left behind


def test_a_carried_function_keeps_the_callers_settings_in_another_thread() -> None:
    with storage.using(storage.StorageSettings(options={"endpoint_url": "http://minio:9000"}, edge_read_mode="stream")):
        carried = storage.carry(lambda: (storage.storage_options_for("s3://b/k").get("endpoint_url"),
                                         storage.current().settings.edge_read_mode))
        plain = lambda: storage.storage_options_for("s3://b/k").get("endpoint_url")  # noqa: E731
        with ThreadPoolExecutor(1) as pool:
            assert pool.submit(carried).result() == ("http://minio:9000", "stream")
            assert pool.submit(plain).result() is None  # a thread does not inherit the scope by itself


def test_settings_hide_options_and_check_the_read_mode() -> None:
    settings = storage.StorageSettings(options={"key": "AKIAXXXX", "secret": "s3cr3t"})
    assert "AKIAXXXX" not in repr(settings) and "s3cr3t" not in repr(settings)
    with pytest.raises(ValueError, match="edge_read_mode must be one of stage, stream"):
        storage.StorageSettings(edge_read_mode="mmap")


def test_the_stage_cache_belongs_to_the_scope(tmp_path: Path) -> None:
    with storage.using(storage.StorageSettings(cache_dir=str(tmp_path / "c"), cache_bytes=2**20)) as session:
        cache = session.cache()
        assert cache.directory == str(tmp_path / "c") and cache.max_bytes == 2**20
        assert storage.current().cache() is cache
    assert storage.current().cache() is not cache
