"""Conditional writes that cannot silently weaken (issue 47, hazard 1).

The owner lock of a checkpoint directory is a compare-and-swap on ``owner.json``: on S3 a PUT with ``If-Match`` /
``If-None-Match``. It used to become a blind overwrite in two ways, each reproduced here for real:

- a store that ignores the headers: a stub store, a real HTTP proxy in front of moto that strips them;
- a botocore whose S3 model lacks ``IfMatch`` (before 1.35.69): s3fs drops keywords the model does not know. A real
  botocore loads such a model through ``AWS_DATA_PATH`` (its own search path for service models).

Either way a write against a stale tag must not land: the store is refused with one line, or, when the caller
accepted it with ``conditional_writes: unchecked``, the write goes through read-compare-write and is refused.
"""

from __future__ import annotations

import gzip
import http.client
import json
import logging
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from storage_scope import use_storage

import storage_adapters as storage
from storage_adapters import conditional


class HeaderStrippingStore:
    """A real HTTP store in front of moto that drops the conditional headers of every PUT, as some S3-compatible
    stores do; ``puts`` counts the PUTs that carried one (before it was dropped)."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.split("://", 1)[1]
        self.conditional_puts = 0
        store = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection", "expect")}
                if self.command == "PUT" and {"if-match", "if-none-match"} & {k.lower() for k in headers}:
                    store.conditional_puts += 1
                    headers = {k: v for k, v in headers.items() if k.lower() not in ("if-match", "if-none-match")}
                upstream = http.client.HTTPConnection(store.upstream, timeout=30)
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
                if self.command != "HEAD":
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
def fresh_probes() -> Iterator[None]:
    import s3fs

    conditional.forget_probes()
    s3fs.S3FileSystem.clear_instance_cache()
    yield
    conditional.forget_probes()
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def stripping_store(s3_endpoint: str, fresh_probes: None) -> Iterator[HeaderStrippingStore]:
    store = HeaderStrippingStore(s3_endpoint)
    try:
        yield store
    finally:
        store.close()


def _owner_then_stale_write(url: str) -> None:
    """Take the object, let another writer replace it, then write against the tag we read first."""
    first = storage.write_if(url, b"writer A", None)
    storage.write_if(url, b"writer B", first)
    storage.write_if(url, b"writer A again, on a stale tag", first)


def test_moto_honours_the_conditions_and_the_probe_leaves_nothing(s3_bucket: str, fresh_probes: None) -> None:
    url = f"{s3_bucket}/ckpt/owner.json"
    with pytest.raises(storage.ConditionFailed):
        _owner_then_stale_write(url)
    with pytest.raises(storage.ConditionFailed):
        storage.write_if(url, b"a second creator", None)
    assert storage.read_bytes(url) == b"writer B"
    assert storage.listdir(f"{s3_bucket}/ckpt") == ["owner.json"]  # the probe's scratch object is gone


def test_a_store_that_ignores_the_headers_is_refused_in_one_line(stripping_store: HeaderStrippingStore,
                                                                  s3_bucket: str) -> None:
    use_storage({"endpoint_url": stripping_store.endpoint})
    url = f"{s3_bucket}/ckpt/owner.json"
    with pytest.raises(storage.StorageError) as info:
        _owner_then_stale_write(url)
    message = str(info.value)
    assert not isinstance(info.value, storage.ConditionFailed)
    assert "\n" not in message and message.startswith(f"{url}: the store {stripping_store.endpoint} ignores "
                                                      "conditional writes"), message
    assert "conditional_writes: unchecked" in message
    assert stripping_store.conditional_puts >= 1  # the probe sent the headers; the store dropped them
    assert not storage.exists(url)  # refused before the first real write


def test_unchecked_falls_back_to_read_compare_write(stripping_store: HeaderStrippingStore, s3_bucket: str,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="biggraph.storage")
    use_storage({"endpoint_url": stripping_store.endpoint, "conditional_writes": "unchecked"})
    url = f"{s3_bucket}/ckpt/owner.json"
    with pytest.raises(storage.ConditionFailed):
        _owner_then_stale_write(url)
    assert storage.read_bytes(url) == b"writer B"
    said = [r.getMessage() for r in caplog.records if "ignores conditional writes" in r.getMessage()]
    assert len(said) == 1 and "conditional_writes: unchecked" in said[0], said


def _model_without_if_match(target: Path) -> None:
    """botocore's S3 model as it was before 1.35.69: PutObject without IfMatch, in an AWS_DATA_PATH directory."""
    import botocore

    builtin = Path(botocore.__file__).parent / "data" / "s3"
    version = sorted(p.name for p in builtin.iterdir() if p.is_dir())[-1]
    source = builtin / version
    raw = (source / "service-2.json.gz").read_bytes() if (source / "service-2.json.gz").exists() else None
    model = json.loads(gzip.decompress(raw) if raw is not None else (source / "service-2.json").read_bytes())
    del model["shapes"]["PutObjectRequest"]["members"]["IfMatch"]
    (target / "s3" / version).mkdir(parents=True)
    (target / "s3" / version / "service-2.json").write_text(json.dumps(model))


def test_a_botocore_without_if_match_is_refused(s3_bucket: str, fresh_probes: None, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    _model_without_if_match(tmp_path / "models")
    monkeypatch.setenv("AWS_DATA_PATH", str(tmp_path / "models"))
    fs, _ = storage.get_filesystem(f"{s3_bucket}/k")
    assert "IfMatch" not in fs.s3.meta.service_model.operation_model("PutObject").input_shape.members
    url = f"{s3_bucket}/ckpt/owner.json"
    with pytest.raises(storage.StorageError, match=r"^botocore \S+ does not know PutObject's IfMatch \(conditional "
                                                   r"writes\).*botocore>=1\.35\.69"):
        _owner_then_stale_write(url)
    assert not storage.exists(url)


def test_the_floors_are_declared() -> None:
    """s3fs >= 2024.12 (get_file's chunksize/max_concurrency: 2024.3.1) and the botocore that knows IfMatch."""
    tomllib = pytest.importorskip("tomllib")

    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
    for extra in ("s3", "test"):
        needs = project["optional-dependencies"][extra]
        assert "s3fs>=2024.12" in needs and f"botocore>={conditional.BOTOCORE_FLOOR}" in needs, (extra, needs)
