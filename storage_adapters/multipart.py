"""Uploads and downloads of large objects on S3 with bounded memory, and a multipart upload that settles
an unanswered completion by looking at the object instead of sending it blindly again.

Why not s3fs' own ``put_file``/``get_file``: both hold ``max_concurrency`` (10) chunks of 50 MiB per file in
memory, so the checkpoint's eight background uploads could hold 4 GiB, far past an out-of-core trainer's
``memory_budget`` (measured: a run budgeted at 1.9 GiB peaked at 2.5 GiB on S3 against 1.4 GiB on local disk).
Here one upload holds one part (``PART_BYTES``) and one download ``DOWNLOAD_CHUNKS`` ranges of that size in
flight, each streamed to the file a piece at a time. s3fs' download also restarted from byte 0 when a connection
dropped (its resume needs its own retry loop, which the storage layer turns off, and its concurrent path retries no
range); here a range that broke off is asked again from the byte where it stopped.

Why a completion of our own: ``CompleteMultipartUpload`` makes the server assemble the object before it
answers. A store on slow disks (MinIO, Ceph, s3rver) can take longer than botocore's read timeout for a
gigabyte; botocore then re-sends the request while the first is still assembling and s3fs aborts the upload
when that fails, so an upload that was about to succeed is lost (seen: 500 and 405 MethodNotAllowed answers,
then the run refused at its last commit). Here botocore never retries a completion (``retry._on_needs_retry``);
the object is polled instead, and the upload counts as done when the object carries this upload's mark (a
random token in its metadata, set when the upload was created) or the ETag of exactly these parts (the MD5 of
the parts' MD5s and the part count, as S3 computes it). After a timeout the completion is never sent again (the
server has it); after an error answer or a failed connection it is, once a slow store would have assembled the
object. The upload is aborted only when the object never appears within the settle time.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from storage_adapters.errors import StorageError
from storage_adapters.retry import (
    NOT_FOUND,
    PERMANENT,
    TRANSIENT,
    Backoff,
    call_with_retry,
    causes,
    classify,
    client_error_info,
    describe,
    permanent_reason,
)

logger = logging.getLogger("biggraph.storage")

MIN_PART_BYTES = 5 * 2**20  # S3's smallest part (but the last)
PART_BYTES = max(MIN_PART_BYTES, int(os.environ.get("BIGGRAPH_S3_PART_BYTES", str(16 * 2**20))))
DOWNLOAD_CHUNKS = 2  # ranged GETs in flight for one download
MAX_PARTS = 10_000  # S3's limit on the parts of one upload
SETTLE_SECONDS = float(os.environ.get("BIGGRAPH_S3_SETTLE_SECONDS", "600"))  # at least; more for larger objects
SETTLE_BYTES_PER_SECOND = 10 * 2**20  # how slowly a store may assemble an object before we give up on it
TOKEN_KEY = "biggraph-upload"  # user metadata naming the upload that wrote an object
RESEND_SECONDS = 30.0  # while settling, the completion is sent again this often (the first may have been lost)


def part_bytes_for(size: int, part_bytes: int | None = None) -> int:
    """The part size for an object of ``size`` bytes: ``PART_BYTES``, larger where 10,000 parts would not do."""
    base = part_bytes or PART_BYTES
    return max(base, math.ceil(size / MAX_PARTS))


def multipart_etag(part_md5s: list[bytes]) -> str:
    """The ETag S3 gives an object completed from parts with these MD5 digests (without the quotes)."""
    return f"{hashlib.md5(b''.join(part_md5s), usedforsecurity=False).hexdigest()}-{len(part_md5s)}"


@dataclass
class _Upload:
    fs: Any
    url: str
    bucket: str
    key: str
    size: int
    upload_id: str = ""
    token: str = ""  # the value of TOKEN_KEY in the object's metadata
    parts: list[dict[str, Any]] = field(default_factory=list)
    md5s: list[bytes] = field(default_factory=list)

    def call(self, operation: str, method: str, **kwargs: Any) -> Any:
        return call_with_retry(self.url, operation, lambda: self.fs.call_s3(method, Bucket=self.bucket, Key=self.key,
                                                                            **kwargs))

    def abort(self) -> None:
        with contextlib.suppress(Exception):  # best effort: a lifecycle rule removes what an abort could not
            self.fs.call_s3("abort_multipart_upload", Bucket=self.bucket, Key=self.key, UploadId=self.upload_id)


def upload_file(fs: Any, local: str, path: str, url: str, part_bytes: int | None = None,
                settle_seconds: float | None = None) -> None:
    """Upload the local file ``local`` to ``path`` on the s3fs filesystem ``fs`` (``url`` names it in messages).

    A file of one part is one PUT; a larger one a multipart upload, each part retried on its own.
    """
    size = os.path.getsize(local)
    chunk = part_bytes_for(size, part_bytes)
    bucket, key, _ = fs.split_path(path)
    upload = _Upload(fs, url, bucket, key, size)
    with open(local, "rb") as handle:
        if size <= chunk:
            body = handle.read()
            _check_size(url, local, size, len(body), handle)
            upload.call("upload", "put_object", Body=body)
            fs.invalidate_cache(path)
            return
        # a mark of this upload on the object: what a HEAD checks when the completion's answer is lost
        upload.token = uuid.uuid4().hex
        created = upload.call("start of multipart upload", "create_multipart_upload",
                              Metadata={TOKEN_KEY: upload.token})
        upload.upload_id = created["UploadId"]
        try:
            count, sent = math.ceil(size / chunk), 0
            for number in range(1, count + 1):
                body = handle.read(chunk)
                sent += len(body)
                if number == count:
                    _check_size(url, local, size, sent, handle)
                digest = hashlib.md5(body, usedforsecurity=False).digest()  # the ETag's recipe, not security
                answer = upload.call(f"upload of part {number} of {count}", "upload_part", PartNumber=number,
                                     UploadId=upload.upload_id, Body=body)
                del body
                upload.parts.append({"PartNumber": number, "ETag": answer["ETag"]})
                upload.md5s.append(digest)
        except BaseException:
            upload.abort()
            raise
    _complete(upload, settle_seconds)
    fs.invalidate_cache(path)


def _check_size(url: str, local: str, size: int, read: int, handle: Any) -> None:
    """The file must not change while it is uploaded (it is a finished local copy: a change is a bug)."""
    if read != size or handle.read(1):
        raise StorageError(f"{url}: upload of {local} refused: the file changed while it was read "
                           f"({size} bytes expected)")


def _failure_kind(err: BaseException) -> str:
    """How a completion failed: "timeout" (the server got the request and may still be assembling: never send
    it again), "refused" (an error answer, or a connection that failed: sending it again is safe) or "gone"."""
    if classify(err) == NOT_FOUND or isinstance(err, PermissionError):
        return "gone"  # NoSuchUpload, or 405 MethodNotAllowed: completed or aborted by an earlier request
    # botocore's ReadTimeoutError, aiohttp's ServerTimeoutError and fsspec's FSTimeoutError are all TimeoutErrors
    if any(isinstance(cause, TimeoutError) for cause in causes(err)) or client_error_info(err)[1] == 504:
        return "timeout"
    return "refused"


def _complete(upload: _Upload, settle_seconds: float | None) -> None:
    def send() -> Any:
        return upload.fs.call_s3("complete_multipart_upload", Bucket=upload.bucket, Key=upload.key,
                                 UploadId=upload.upload_id, MultipartUpload={"Parts": upload.parts})

    expected = multipart_etag(upload.md5s)
    try:
        send()
        return
    except Exception as err:  # classified below
        kind, first_error = classify(err, upload.url), describe(err)
        how = _failure_kind(err)
        if kind != TRANSIENT or how == "gone":
            if _is_ours(upload, expected):
                return  # NoSuchUpload/405 after an earlier request completed it
            upload.abort()
            reason = permanent_reason(err) if kind == PERMANENT else first_error
            raise StorageError(f"{upload.url}: multipart upload completion failed: {reason}") from None
    limit = settle_seconds if settle_seconds is not None else max(SETTLE_SECONDS,
                                                                  upload.size / SETTLE_BYTES_PER_SECOND)
    # after a timeout the server has the request: a second one would race its assembly. After an error answer
    # or a failed connection it may not: ask again, first once a slow store would have assembled the object
    resend_after = None if how == "timeout" else max(RESEND_SECONDS, upload.size / SETTLE_BYTES_PER_SECOND)
    logger.warning("%s: completing the multipart upload got no clean answer (%s); waiting up to %.0f s for the "
                   "object to appear with ETag %s instead of re-sending it blindly", upload.url, first_error, limit,
                   expected)
    started = time.monotonic()
    delay, last_send = 0.5, started
    while True:
        if _is_ours(upload, expected):
            logger.warning("%s: the multipart upload completed (ETag %s) %.1f s after its unanswered request",
                           upload.url, expected, time.monotonic() - started)
            return
        elapsed = time.monotonic() - started
        if elapsed >= limit:
            break
        if resend_after is not None and time.monotonic() - last_send >= resend_after:
            last_send = time.monotonic()
            try:
                send()
            except Exception as err:  # the object decides, not this answer
                logger.warning("%s: completion re-sent: %s; still waiting for the object", upload.url, describe(err))
                if _failure_kind(err) == "timeout":
                    resend_after = None  # this one arrived: never race it
        time.sleep(min(delay, max(0.0, limit - elapsed)))
        delay = min(10.0, delay * 2)
    upload.abort()
    if _is_ours(upload, expected):  # a completion that landed as the wait ended
        return
    raise StorageError(f"{upload.url}: the multipart upload did not complete: no object with ETag {expected} "
                       f"{limit:.0f} s after the completion request ({first_error}); the upload was aborted")


def _is_ours(upload: _Upload, expected: str) -> bool:
    """Whether the object under the key is this upload's: it carries the upload's mark, or the ETag of exactly
    these parts (an object with the same bytes). False while it is absent, older, or the HEAD goes unanswered."""
    try:
        head = upload.fs.call_s3("head_object", Bucket=upload.bucket, Key=upload.key)
    except Exception as err:  # absent or unanswered: keep waiting
        if classify(err, upload.url) == PERMANENT:
            upload.abort()
            raise StorageError(f"{upload.url}: checking the multipart upload failed (it was aborted): "
                               f"{permanent_reason(err)}") from None
        return False
    metadata = {str(k).lower(): v for k, v in (head.get("Metadata") or {}).items()}
    return metadata.get(TOKEN_KEY) == upload.token or str(head.get("ETag", "")).strip('"') == expected


def transfer_buffer_bytes(uploads: int, downloads: int) -> int:
    """The memory ``uploads`` uploads and ``downloads`` downloads in flight at once hold at most (one part per
    upload, ``DOWNLOAD_CHUNKS`` per download), for budgets that must count it."""
    return (uploads + downloads * DOWNLOAD_CHUNKS) * PART_BYTES


def download_file(fs: Any, path: str, local: str, chunk_bytes: int | None = None, url: str | None = None) -> None:
    """Download ``path`` to ``local`` in ranges of ``chunk_bytes``, ``DOWNLOAD_CHUNKS`` of them in flight, each
    streamed to its place in the file (memory: a piece of ``READ_PIECE`` per range).

    A range whose body breaks off (a dropped connection, a cut or timed-out body) is asked again from the byte where
    it stopped, not from its start, and never the whole file again: each try that brought bytes starts the retry
    policy afresh, tries without progress follow it (backoff, attempt n of m, each said). Every range is asked with
    ``If-Match`` on the ETag of the object's HEAD, so a file is never stitched from two versions of an object.
    """
    from fsspec.asyn import sync  # lazy: only S3 needs it (storage_adapters.fs)

    sync(fs.loop, _download, _Ranges(fs, path, local, chunk_bytes or PART_BYTES, url or f"s3://{path}"))


READ_PIECE = 2**20  # bytes read from a response body at a time


@dataclass
class _Ranges:
    fs: Any
    path: str
    local: str
    chunk: int
    url: str
    fd: int = -1
    condition: dict[str, str] = field(default_factory=dict)  # Bucket, Key, VersionId, IfMatch of every GET


async def _download(job: _Ranges) -> None:
    import asyncio  # here: only S3 downloads need it (~6 ms of every process's start-up otherwise)

    bucket, key, version = job.fs.split_path(job.path)
    job.condition = {"Bucket": bucket, "Key": key, **({"VersionId": version} if version else {})}
    head = await job.fs._call_s3("head_object", **job.condition)
    size = int(head["ContentLength"])
    if head.get("ETag"):
        job.condition["IfMatch"] = head["ETag"]
    job.fd = os.open(job.local, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        in_flight = asyncio.Semaphore(DOWNLOAD_CHUNKS)

        async def one(start: int) -> None:
            async with in_flight:
                await _fetch_range(job, start, min(size, start + job.chunk), size)

        results = await asyncio.gather(*(one(start) for start in range(0, size, job.chunk)), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
    finally:
        os.close(job.fd)


async def _fetch_range(job: _Ranges, start: int, end: int, size: int) -> None:
    import asyncio

    pos, backoff = start, Backoff()
    while pos < end:
        began = pos
        try:
            response = await job.fs._call_s3("get_object", Range=f"bytes={pos}-{end - 1}", **job.condition)
            async with response["Body"] as body:
                while pos < end:
                    piece = await body.read(min(READ_PIECE, end - pos))
                    if not piece:
                        break
                    os.pwrite(job.fd, piece, pos)
                    pos += len(piece)
            if pos < end:
                raise ConnectionResetError(f"the body ended at byte {pos} of {end}")
        except Exception as err:  # classified below
            if client_error_info(err)[1] == 412:
                raise StorageError(f"{job.url}: download failed: the object changed while it was read") from None
            if classify(err, job.url) != TRANSIENT:
                raise
            if pos > began:  # progress: the policy starts afresh from here
                backoff.restart()
            pause = backoff.failed()
            if pause is None:
                raise StorageError(f"{job.url}: download still failing at byte {pos} of {size} after "
                                   f"{backoff.attempt} attempts in {backoff.spent():.1f} s: {describe(err)}") from None
            logger.warning("%s: download broke off at byte %d of %d on attempt %d of %d (%s); resuming from that "
                           "byte in %.2f s", job.url, pos, size, backoff.attempt, backoff.limit, describe(err), pause)
            await asyncio.sleep(pause)
