"""Large objects on S3 (moto on 127.0.0.1, through the fault proxy where the network matters): uploads in parts
with bounded memory, each part retried alone, and a completion whose answer is lost or late settled by looking at
the object instead of re-sending it blindly (storage_adapters.multipart)."""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from storage_scope import use_storage
from test_storage_faults import FaultProxy, _direct_fs, proxy_options

import storage_adapters as storage
from storage_adapters import multipart

pytestmark = pytest.mark.slow
MIB = 2**20


@pytest.fixture
def small_parts(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(multipart, "PART_BYTES", 5 * MIB)  # S3's (and moto's) smallest part
    return 5 * MIB


def _file(path: Path, size: int, seed: int = 0) -> bytes:
    data = hashlib.shake_256(f"{seed}".encode()).digest(size)
    path.write_bytes(data)
    return data


def _expected_etag(data: bytes, part: int) -> str:
    return multipart.multipart_etag([hashlib.md5(data[i:i + part]).digest() for i in range(0, len(data), part)])


def _requests(proxy: FaultProxy, method: str, marker: str) -> list[str]:
    return [path for m, path, _ in proxy.log if m == method and marker in path]


def _fault(action: str, method: str, marker: str, times: int | None = None) -> Callable[[str, str], str | None]:
    """A proxy decision: ``action`` for requests of ``method`` whose path (+ "&") holds ``marker``, the first
    ``times`` of them (None: all)."""
    hits: list[str] = []

    def decide(request_method: str, path: str) -> str | None:
        if request_method == method and marker in path + "&" and (times is None or len(hits) < times):
            hits.append(path)
            return action
        return None

    return decide


COMPLETE = "uploadId="  # in the path of a completion (POST) and of an abort (DELETE)


def test_parts_are_uploaded_one_at_a_time_and_retried_alone(s3_endpoint: str, s3_bucket: str, small_parts: int,
                                                           tmp_path: Path) -> None:
    data = _file(tmp_path / "big.h5", 23 * MIB)
    with FaultProxy(s3_endpoint, _fault("500", "PUT", "partNumber=2&", times=1)) as proxy:
        use_storage(proxy_options(proxy.endpoint, read_timeout=30, attempts=1))
        storage.put_file(str(tmp_path / "big.h5"), f"{s3_bucket}/ckpt/big.h5")
    parts = [p for p in _requests(proxy, "PUT", "partNumber=")]
    numbers = [int(p.split("partNumber=")[1].split("&")[0]) for p in parts]
    assert numbers == [1, 2, 2, 3, 4, 5]  # 23 MiB in 5 MiB parts; the part that failed is sent again, alone
    assert len(_requests(proxy, "POST", "uploadId=")) == 1 and not _requests(proxy, "DELETE", "uploadId=")
    direct = _direct_fs(s3_endpoint)
    key = f"{s3_bucket[5:]}/ckpt/big.h5"
    assert direct.cat_file(key) == data
    assert direct.info(key)["ETag"].strip('"') == _expected_etag(data, small_parts)


def test_a_file_of_one_part_is_one_put(s3_endpoint: str, s3_bucket: str, small_parts: int, tmp_path: Path) -> None:
    data = _file(tmp_path / "small.h5", 3 * MIB)
    with FaultProxy(s3_endpoint, lambda method, path: None) as proxy:
        use_storage(proxy_options(proxy.endpoint, read_timeout=30))
        storage.put_file(str(tmp_path / "small.h5"), f"{s3_bucket}/small.h5")
    assert [m for m, _, _ in proxy.log] == ["PUT"]
    assert _direct_fs(s3_endpoint).cat_file(f"{s3_bucket[5:]}/small.h5") == data


def test_a_late_completion_is_settled_by_the_object_not_sent_again(s3_endpoint: str, s3_bucket: str,
                                                                   small_parts: int, tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """The server assembles the object but answers after the client's read timeout (a slow disk behind MinIO,
    Ceph, s3rver): the upload is done, and neither botocore nor s3fs may re-send or abort it."""
    data = _file(tmp_path / "big.h5", 12 * MIB)
    late = _fault("delay:4", "POST", COMPLETE)
    with FaultProxy(s3_endpoint, late) as proxy, caplog.at_level(logging.WARNING, "biggraph.storage"):
        use_storage(proxy_options(proxy.endpoint, read_timeout=1, attempts=3))
        storage.put_file(str(tmp_path / "big.h5"), f"{s3_bucket}/big.h5")
    assert len(_requests(proxy, "POST", "uploadId=")) == 1  # no blind retry by botocore
    assert not _requests(proxy, "DELETE", "uploadId=")  # and no abort
    assert _direct_fs(s3_endpoint).cat_file(f"{s3_bucket[5:]}/big.h5") == data
    assert "instead of re-sending it blindly" in caplog.text and "the multipart upload completed" in caplog.text


def test_a_lost_completion_is_sent_again(s3_endpoint: str, s3_bucket: str, small_parts: int, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The completion never reached the server (the connection dropped first): it is sent again while waiting."""
    monkeypatch.setattr(multipart, "RESEND_SECONDS", 1.0)
    data = _file(tmp_path / "big.h5", 11 * MIB)
    with FaultProxy(s3_endpoint, _fault("drop", "POST", COMPLETE, times=1)) as proxy:
        use_storage(proxy_options(proxy.endpoint, read_timeout=5, attempts=3))
        storage.put_file(str(tmp_path / "big.h5"), f"{s3_bucket}/big.h5")
    assert len(_requests(proxy, "POST", "uploadId=")) == 2
    assert _direct_fs(s3_endpoint).cat_file(f"{s3_bucket[5:]}/big.h5") == data


def test_a_completion_that_never_lands_is_aborted_and_the_old_object_kept(
        s3_endpoint: str, s3_bucket: str, small_parts: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(multipart, "SETTLE_SECONDS", 3.0)
    monkeypatch.setattr(multipart, "SETTLE_BYTES_PER_SECOND", 2**40)
    monkeypatch.setattr(multipart, "RESEND_SECONDS", 1.0)
    direct = _direct_fs(s3_endpoint)
    key = f"{s3_bucket[5:]}/part.h5"
    old = hashlib.shake_256(b"old").digest(11 * MIB)  # the same size: not taken for the new upload's object
    direct.pipe_file(key, old)
    _file(tmp_path / "new.h5", 11 * MIB)
    with FaultProxy(s3_endpoint, _fault("drop", "POST", COMPLETE)) as proxy:
        use_storage(proxy_options(proxy.endpoint, read_timeout=5, attempts=3))
        with pytest.raises(storage.StorageError, match=rf"{s3_bucket}/part.h5: the multipart upload did not "
                                                       r"complete: no object with ETag [0-9a-f]{32}-3 .*aborted"):
            multipart.upload_file(storage.get_filesystem(f"{s3_bucket}/part.h5")[0], str(tmp_path / "new.h5"),
                                  key, f"{s3_bucket}/part.h5")
    assert len(_requests(proxy, "POST", "uploadId=")) >= 2  # re-sent while waiting, never answered
    assert len(_requests(proxy, "DELETE", "uploadId=")) == 1
    assert direct.cat_file(key) == old


def test_an_error_answer_to_the_completion_is_sent_again_by_the_upload_not_botocore(
        s3_endpoint: str, s3_bucket: str, small_parts: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 500 (or a gateway's 503) may come from a proxy in front of a store still assembling the object: botocore
    does not re-send at once; the upload does, after polling the object, and the object is complete."""
    monkeypatch.setattr(multipart, "RESEND_SECONDS", 1.0)
    data = _file(tmp_path / "big.h5", 10 * MIB)  # exactly two parts
    with FaultProxy(s3_endpoint, _fault("500", "POST", COMPLETE, times=1)) as proxy:
        use_storage(proxy_options(proxy.endpoint, read_timeout=5, attempts=5))
        storage.put_file(str(tmp_path / "big.h5"), f"{s3_bucket}/big.h5")
    assert len(_requests(proxy, "PUT", "partNumber=")) == 2
    assert len(_requests(proxy, "POST", "uploadId=")) == 2 and not _requests(proxy, "DELETE", "uploadId=")
    head = _direct_fs(s3_endpoint).info(f"{s3_bucket[5:]}/big.h5")
    assert head["ETag"].strip('"') == _expected_etag(data, small_parts)
    assert _direct_fs(s3_endpoint).cat_file(f"{s3_bucket[5:]}/big.h5") == data


def test_the_object_is_recognised_by_its_upload_mark(s3_endpoint: str, s3_bucket: str, small_parts: int,
                                                     tmp_path: Path) -> None:
    """Stores whose ETags are no MD5 (SSE-KMS) are settled by the mark the upload put in the object's metadata:
    an object under the key without the mark (and without the parts' ETag) is not taken for the upload's."""
    fs = storage.get_filesystem(f"{s3_bucket}/k.h5")[0]
    key = f"{s3_bucket[5:]}/k.h5"
    upload = multipart._Upload(fs, f"{s3_bucket}/k.h5", s3_bucket[5:], "k.h5", 6 * MIB, token="mark-1")
    fs.call_s3("put_object", Bucket=s3_bucket[5:], Key="k.h5", Body=b"x" * 16, Metadata={"other": "1"})
    assert not multipart._is_ours(upload, "0" * 32 + "-2")
    fs.call_s3("put_object", Bucket=s3_bucket[5:], Key="k.h5", Body=b"x" * 16,
               Metadata={multipart.TOKEN_KEY: "mark-1"})
    assert multipart._is_ours(upload, "0" * 32 + "-2")
    assert _direct_fs(s3_endpoint).exists(key)


def test_a_file_that_changes_while_it_is_uploaded_is_refused(s3_endpoint: str, s3_bucket: str, small_parts: int,
                                                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _file(tmp_path / "big.h5", 11 * MIB)
    real = os.path.getsize
    monkeypatch.setattr(multipart.os.path, "getsize", lambda p: real(p) - 1 if str(p).endswith("big.h5") else real(p))
    with pytest.raises(storage.StorageError, match="the file changed while it was read"):
        storage.put_file(str(tmp_path / "big.h5"), f"{s3_bucket}/big.h5")
    assert not _direct_fs(s3_endpoint).exists(f"{s3_bucket[5:]}/big.h5")


def test_a_refused_completion_fails_at_once(s3_endpoint: str, s3_bucket: str, small_parts: int,
                                            tmp_path: Path) -> None:
    _file(tmp_path / "big.h5", 11 * MIB)
    with FaultProxy(s3_endpoint, _fault("403", "POST", COMPLETE)) as proxy:
        use_storage(proxy_options(proxy.endpoint, read_timeout=5))
        started = time.monotonic()
        with pytest.raises(storage.StorageError, match=rf"{s3_bucket}/big.h5: .*access denied"):
            storage.put_file(str(tmp_path / "big.h5"), f"{s3_bucket}/big.h5")
        assert time.monotonic() - started < 30
    assert len(_requests(proxy, "POST", "uploadId=")) == 1 and len(_requests(proxy, "DELETE", "uploadId=")) == 1
    assert not _direct_fs(s3_endpoint).exists(f"{s3_bucket[5:]}/big.h5")


_MEMORY_PROBE = """
import resource, sys
import storage_adapters as storage
endpoint, mode, url, local = sys.argv[1:5]
with storage.using(storage.StorageSettings(options={"endpoint_url": endpoint})):
    storage.write_bytes(url + ".warm", b"x")  # imports and the client, before the baseline
    storage.read_bytes(url + ".warm")
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    storage.put_file(local, url) if mode == "upload" else storage.get_file(url, local)
    print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024)
"""


def test_uploads_and_downloads_hold_a_bounded_amount_of_memory(s3_endpoint: str, s3_bucket: str,
                                                               tmp_path: Path) -> None:
    """A 240 MiB object through the storage layer, each way in a process of its own: its peak memory grows by a
    few parts (16 MiB each), not by the object (s3fs' own put_file/get_file hold up to 10 chunks of 50 MiB per
    file: 180 MiB more for this upload, measured)."""
    data = _file(tmp_path / "big.h5", 240 * MIB)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    grown = {}
    for mode, local in (("upload", "big.h5"), ("download", "back.h5")):
        out = subprocess.run([sys.executable, "-c", _MEMORY_PROBE, s3_endpoint, mode, f"{s3_bucket}/big.h5",
                              str(tmp_path / local)], capture_output=True, text=True, env=env, timeout=300)
        assert out.returncode == 0, out.stderr
        grown[mode] = int(out.stdout.strip().splitlines()[-1])
    assert (tmp_path / "back.h5").read_bytes() == data
    assert grown["upload"] < 64 * MIB and grown["download"] < 64 * MIB, grown
