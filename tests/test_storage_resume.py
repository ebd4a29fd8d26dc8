"""A download that loses its connection resumes where it stopped (issue 47, hazard 3).

A staged edge file or a partition is gigabytes: one dropped connection used to start the whole download again from
byte 0 (s3fs' resume needs the retry loop the storage layer turns off, and its concurrent path retries no range).
A real HTTP proxy in front of moto cuts a response body after a known number of bytes and records every GET's
``Range``; the test reads where the next request started.
"""

from __future__ import annotations

import http.client
import logging
import os
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from storage_scope import use_storage

import storage_adapters as storage

MIB = 2**20


class CuttingProxy:
    """Forwards to ``upstream``; ``cut(range_header)`` gives the number of body bytes after which to close the
    connection (None: the whole body). ``ranges`` records every GET's Range header (None without one)."""

    def __init__(self, upstream: str, cut: Callable[[str | None], int | None]) -> None:
        self.upstream = upstream.split("://", 1)[1]
        self.ranges: list[str | None] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection", "expect")}
                limit = None
                if self.command == "GET" and "?" not in self.path:
                    proxy.ranges.append(self.headers.get("Range"))
                    limit = cut(self.headers.get("Range"))
                upstream = http.client.HTTPConnection(proxy.upstream, timeout=30)
                try:
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    response = upstream.getresponse()
                    data = response.read()
                finally:
                    upstream.close()
                self.send_response(response.status)
                for key, value in response.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection", "content-length", "date", "server"):
                        self.send_header(key, value)
                length = response.getheader("Content-Length") if self.command == "HEAD" else str(len(data))
                self.send_header("Content-Length", length or "0")
                self.end_headers()
                if self.command == "HEAD":
                    return
                if limit is not None and limit < len(data):
                    self.wfile.write(data[:limit])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def object_3mib(s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, bytes]]:
    """A 3 MiB object, downloaded in ranges of 1 MiB (16 MiB in production: the same code, smaller figures)."""
    import s3fs

    from storage_adapters import multipart

    monkeypatch.setattr(multipart, "PART_BYTES", MIB)
    data = os.urandom(3 * MIB)
    url = f"{s3_bucket}/edges/edges_0_0.h5"
    storage.write_bytes(url, data)
    s3fs.S3FileSystem.clear_instance_cache()
    yield url, data
    s3fs.S3FileSystem.clear_instance_cache()


def _start(range_header: str | None) -> int:
    return int(range_header.split("=", 1)[1].split("-", 1)[0]) if range_header else 0


def test_a_cut_download_resumes_at_the_byte_where_it_stopped(object_3mib: tuple[str, bytes], s3_endpoint: str,
                                                             tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    url, data = object_3mib
    caplog.set_level(logging.WARNING, logger="biggraph.storage")
    cuts: list[int] = []

    def cut_once_inside_the_second_range(range_header: str | None) -> int | None:
        start = _start(range_header)
        if not cuts and start >= MIB:
            cuts.append(start + 300_000)
            return 300_000
        return None

    proxy = CuttingProxy(s3_endpoint, cut_once_inside_the_second_range)
    try:
        use_storage({"endpoint_url": proxy.endpoint})
        storage.get_file(url, str(tmp_path / "copy.h5"))
    finally:
        proxy.close()
    assert (tmp_path / "copy.h5").read_bytes() == data
    assert cuts, proxy.ranges
    starts = [_start(r) for r in proxy.ranges]
    assert starts.count(0) == 1, proxy.ranges  # byte 0 asked once: nothing started again from the beginning
    assert cuts[0] in starts, (cuts, proxy.ranges)  # the next request began at the byte the cut stopped at
    said = [r.getMessage() for r in caplog.records if "resuming" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"{url}: download broke off at byte {cuts[0]} of {len(data)}"), said


def test_a_download_of_an_object_replaced_midway_is_refused(object_3mib: tuple[str, bytes], s3_endpoint: str,
                                                            tmp_path: Path) -> None:
    """Every range asks for the ETag the HEAD saw: a file is never stitched from two versions."""
    url, _ = object_3mib
    replaced: list[bool] = []

    def replace_after_the_first_range(range_header: str | None) -> int | None:
        if not replaced and _start(range_header) == 0:
            replaced.append(True)
            import s3fs

            s3fs.S3FileSystem(endpoint_url=s3_endpoint, skip_instance_cache=True).pipe_file(
                url.split("://", 1)[1], b"another version")
        return None

    proxy = CuttingProxy(s3_endpoint, replace_after_the_first_range)
    try:
        use_storage({"endpoint_url": proxy.endpoint})
        with pytest.raises(storage.StorageError, match=r"^s3://\S+: download failed: the object changed while it "
                                                       r"was read$"):
            storage.get_file(url, str(tmp_path / "copy.h5"))
    finally:
        proxy.close()
    assert not (tmp_path / "copy.h5").exists()


def test_botocore_retries_in_standard_mode_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    """botocore's "standard" mode by default; the options' retries and timeouts, or AWS_RETRY_MODE, still decide."""
    pytest.importorskip("s3fs", reason="s3fs is not installed")
    import s3fs

    monkeypatch.delenv("AWS_RETRY_MODE", raising=False)
    s3fs.S3FileSystem.clear_instance_cache()
    cases = [({}, {"mode": "standard"}),
             ({"config_kwargs": {"retries": {"max_attempts": 7}, "connect_timeout": 4}},
              {"mode": "standard", "total_max_attempts": 8}),
             ({"config_kwargs": {"retries": {"mode": "adaptive"}}}, {"mode": "adaptive"})]
    for options, expected in cases:
        use_storage({"endpoint_url": "http://127.0.0.1:9", **options})
        config = storage.get_filesystem("s3://b/k")[0].s3.meta.config
        assert config.retries == expected, options
        if "connect_timeout" in str(options):
            assert config.connect_timeout == 4
    monkeypatch.setenv("AWS_RETRY_MODE", "legacy")
    use_storage({"endpoint_url": "http://127.0.0.1:9"})
    assert "config_kwargs" not in storage.storage_options_for("s3://b/k")
    s3fs.S3FileSystem.clear_instance_cache()


def test_empty_and_missing_objects(s3_bucket: str, tmp_path: Path) -> None:
    storage.write_bytes(f"{s3_bucket}/empty.h5", b"")
    storage.get_file(f"{s3_bucket}/empty.h5", str(tmp_path / "empty.h5"))
    assert (tmp_path / "empty.h5").read_bytes() == b""
    with pytest.raises(FileNotFoundError):
        storage.get_file(f"{s3_bucket}/missing.h5", str(tmp_path / "missing.h5"))
    assert not (tmp_path / "missing.h5").exists()
