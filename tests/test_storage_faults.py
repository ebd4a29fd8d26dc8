"""Storage under a bad network: a small HTTP proxy sits between s3fs and moto on 127.0.0.1 and
answers some requests with 500/503, drops connections, cuts bodies short, delays past the
client's timeout, or refuses access. Training must still finish with the same embeddings,
no reader may ever see a partial checkpoint, and permanent errors must fail fast.
"""

from __future__ import annotations

import errno
import http.client
import io
import itertools
import json
import logging
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
from storage_scope import use_storage

import storage_adapters as storage
from job.formats.checkpoint import CheckpointStorage
from storage_adapters.retry import NOT_FOUND, OTHER, PERMANENT, TRANSIENT, RetryPolicy, call_with_retry, classify

# the fault proxy --------------------------------------------------------------------------------------

_ERROR_BODY = '<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{message}</Message></Error>'
_ERRORS = {
    "500": (500, "InternalError", "We encountered an internal error. Please try again."),
    "503": (503, "SlowDown", "Please reduce your request rate."),
    "403": (403, "AccessDenied", "Access Denied"),
}


class FaultProxy:
    """An HTTP/1.1 proxy to ``upstream``; ``decide(method, path)`` returns None (forward) or a fault:
    "500", "503", "403", "drop" (close without answering), "cut" (half the body, then close),
    "delay:<seconds>" (forward, then wait before answering) or "hold" (wait for ``release`` before forwarding).

    A delay happens after the upstream has the whole request: a client that times out and closes its end
    before the server received the body never has that write committed, so the realistic slow request is
    one whose answer is late (and whose retry repeats an idempotent write), not one that lands late.
    """

    def __init__(self, upstream: str, decide: Callable[[str, str], str | None], port: int = 0) -> None:
        self.upstream = upstream.split("://", 1)[1]
        self.decide = decide
        self.release = threading.Event()
        self.held = threading.Event()
        self.log: list[tuple[str, str, str | None]] = []
        self.connections: list[socket.socket] = []
        self.stopped = False
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _handle(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                assert "chunked" not in (self.headers.get("Transfer-Encoding") or ""), "chunked request bodies unsupported"
                action = proxy.decide(self.command, self.path)
                proxy.log.append((self.command, self.path, action))
                if action in _ERRORS:
                    status, code, message = _ERRORS[action]
                    payload = _ERROR_BODY.format(code=code, message=message).encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload) if self.command != "HEAD" else 0))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(payload)
                    return
                if action == "drop":
                    self.close_connection = True
                    return
                if action == "hold":
                    proxy.held.set()
                    proxy.release.wait(60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("expect", "connection")}
                upstream = http.client.HTTPConnection(proxy.upstream, timeout=60)
                try:
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    response = upstream.getresponse()
                    data = response.read()
                finally:
                    upstream.close()
                if action and action.startswith("delay:"):
                    time.sleep(float(action.split(":", 1)[1]))
                self.send_response(response.status)
                for key, value in response.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection", "content-length", "date", "server"):
                        self.send_header(key, value)
                length = response.getheader("Content-Length") if self.command == "HEAD" else str(len(data))
                self.send_header("Content-Length", length or "0")
                self.end_headers()
                if self.command == "HEAD":
                    return
                if action == "cut" and len(data) > 1:
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        class Server(ThreadingHTTPServer):
            # the default backlog of 5 overflows when uploads, the background partition swap and edge reads
            # connect at once; under gVisor a client's non-blocking connect() to a full backlog then blocks
            # its whole event loop (seen as a test hung in sock_connect, past every timeout)
            request_queue_size = 128

            def get_request(self) -> tuple[socket.socket, Any]:
                conn, address = super().get_request()
                proxy.connections.append(conn)  # so that stop() can drop the client's kept-alive connections
                return conn, address

            def handle_error(self, request: Any, client_address: Any) -> None:
                pass  # clients that gave up (timeouts) close their end: expected here

        # ThreadingHTTPServer sets SO_REUSEADDR: a proxy can take over the port of one just stopped (a restart)
        self.server = Server(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> FaultProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def stop(self) -> None:
        """Go away like a gateway being restarted: nothing listens on the port, open connections are cut."""
        if self.stopped:
            return
        self.stopped = True
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
        for conn in self.connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed by its handler

    def faults(self) -> list[str]:
        return [action for _, _, action in self.log if action]


def proxy_options(endpoint: str, read_timeout: float = 2.0, attempts: int = 2) -> dict[str, Any]:
    """s3fs options through the proxy: short timeouts and few botocore retries, so our own retry layer works too."""
    return {"endpoint_url": endpoint, "config_kwargs": {"read_timeout": read_timeout, "connect_timeout": 2,
                                                        "retries": {"max_attempts": attempts, "mode": "legacy"}}}


@pytest.fixture
def quick_retries() -> Iterator[None]:
    from storage_adapters import retry

    previous = retry.set_retry_policy(total_seconds=60, first_delay=0.05, max_delay=0.5)
    yield
    retry.set_retry_policy(previous.total_seconds, previous.first_delay, previous.max_delay)


def _direct_fs(endpoint: str) -> Any:
    import s3fs

    return s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True, use_listings_cache=False)


# classification and retry, no network --------------------------------------------------------------------


class _ClientError(Exception):
    def __init__(self, code: str, status: int) -> None:
        super().__init__(f"An error occurred ({code})")
        self.response = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}


def _translated(code: str, status: int, exc: type[BaseException] = OSError) -> BaseException:
    """What s3fs raises: a Python error whose __cause__ is botocore's ClientError."""
    err = exc(errno.EIO, "translated") if exc is OSError else exc("translated")
    err.__cause__ = _ClientError(code, status)
    return err


@pytest.mark.parametrize(("err", "kind"), [
    (TimeoutError("read timed out"), TRANSIENT),
    (ConnectionResetError("reset by peer"), TRANSIENT),
    (OSError(errno.EBUSY, "SlowDown"), TRANSIENT),
    (_translated("InternalError", 500), TRANSIENT),
    (_translated("SlowDown", 503), TRANSIENT),
    (_translated("WeirdNewCode", 502), TRANSIENT),
    (_translated("AccessDenied", 403, PermissionError), PERMANENT),
    (_translated("NoSuchBucket", 404, FileNotFoundError), PERMANENT),
    (_translated("InvalidAccessKeyId", 403, PermissionError), PERMANENT),
    (_translated("NoSuchKey", 404, FileNotFoundError), NOT_FOUND),
    (FileNotFoundError("x"), NOT_FOUND),
    (ValueError("bug"), OTHER),
    (OSError(errno.EINVAL, "bad request"), OTHER),
])
def test_classify(err: BaseException, kind: str) -> None:
    assert classify(err) == kind


def test_retry_backs_off_and_is_bounded() -> None:
    sleeps: list[float] = []
    calls = itertools.count()

    def flaky() -> str:
        if next(calls) < 3:
            raise ConnectionResetError("dropped")
        return "ok"

    policy = RetryPolicy(total_seconds=100, first_delay=1, max_delay=3)
    assert call_with_retry("s3://b/k", "read", flaky, policy, sleep=sleeps.append) == "ok"
    assert len(sleeps) == 3 and 0.5 <= sleeps[0] <= 1 and 1 <= sleeps[1] <= 2 and 1.5 <= sleeps[2] <= 3

    def always() -> None:
        raise TimeoutError("slow")

    started = time.monotonic()
    with pytest.raises(storage.StorageError, match=r"s3://b/k: write still failing after \d+ attempts"):
        call_with_retry("s3://b/k", "write", always, RetryPolicy(total_seconds=0.3, first_delay=0.05, max_delay=0.1))
    assert time.monotonic() - started < 2

    def denied() -> None:
        raise _translated("AccessDenied", 403, PermissionError)

    attempts = []
    with pytest.raises(storage.StorageError, match="s3://b/k: read failed: access denied") as info:
        call_with_retry("s3://b/k", "read", lambda: attempts.append(1) or denied(), policy, sleep=sleeps.append)
    assert len(attempts) == 1 and info.value.exit_code == 2
    with pytest.raises(FileNotFoundError):
        call_with_retry("s3://b/k", "read", lambda: (_ for _ in ()).throw(FileNotFoundError("k")), policy)

    def not_allowed() -> None:  # s3fs' PermissionError for a CompleteMultipartUpload retried after a timeout
        raise _translated("MethodNotAllowed", 405, PermissionError)

    with pytest.raises(storage.StorageError, match=r"s3://b/k: write failed: MethodNotAllowed.*\(HTTP 405\)$") as info:
        call_with_retry("s3://b/k", "write", not_allowed, policy, sleep=sleeps.append)
    assert "access denied" not in str(info.value) and info.value.exit_code == 2


# through the proxy ----------------------------------------------------------------------------------------


def _cycle_faults(every: int, kinds: list[str], methods: tuple[str, ...], burst_every: int = 0,
                  burst: int = 0, delay_every: int = 0) -> Callable[[str, str], str | None]:
    """Every ``every``-th matching request gets the next fault of ``kinds``; every ``burst_every``-th starts
    ``burst`` consecutive 500s (more than botocore retries, so our own layer has to retry); every
    ``delay_every``-th waits 3 s (past the client's read timeout). The first GET of each edge file is cut short
    and the second dropped."""
    lock = threading.Lock()
    state: dict[str, Any] = {"n": 0, "burst": 0, "burst_key": None, "kind": 0}
    edge_gets: dict[str, int] = {}

    def decide(method: str, path: str) -> str | None:
        if method not in methods or "moto-api" in path:
            return None
        with lock:
            state["n"] += 1
            # A burst follows the request that started it: its retries fail too, whatever other requests run
            # concurrently, so botocore gives up deterministically and our own layer must retry.
            if state["burst"] > 0 and state["burst_key"] == (method, path):
                state["burst"] -= 1
                return "500"
            if method == "GET" and "/data/edges/edges_" in path:
                seen = edge_gets[path.split("?")[0]] = edge_gets.get(path.split("?")[0], 0) + 1
                if seen <= 2:
                    return ["cut", "drop"][seen - 1]
            if delay_every and state["n"] % delay_every == 0:
                return "delay:3"
            if burst_every and state["burst"] == 0 and state["n"] % burst_every == 0:
                state["burst"], state["burst_key"] = burst - 1, (method, path)
                return "500"
            if state["n"] % every == 0:
                kind = kinds[state["kind"] % len(kinds)]
                state["kind"] += 1
                if kind == "cut" and method != "GET":
                    kind = "drop"
                return kind
        return None

    return decide


class _CheckpointWatcher:
    """A reader polling the checkpoint directly on moto: a committed version must always be complete."""

    def __init__(self, fs: Any, prefix: str, keys: list[tuple[str, int]]) -> None:
        self.fs, self.prefix, self.keys = fs, prefix, keys
        self.stop = threading.Event()
        self.complete_reads: set[int] = set()
        self.raced = 0
        self.violations: list[str] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _marker(self) -> int:
        try:
            return int(self.fs.cat_file(f"{self.prefix}/checkpoint_version.txt").decode().strip() or 0)
        except FileNotFoundError:
            return 0

    def _run(self) -> None:
        while not self.stop.is_set():
            version = self._marker()
            if version == 0:
                time.sleep(0.02)
                continue
            names = [f"model.v{version}.h5"] + [f"embeddings_{t}_{p}.v{version}.h5" for t, p in self.keys]
            try:
                for name in names:
                    with h5py.File(io.BytesIO(self.fs.cat_file(f"{self.prefix}/{name}")), "r") as handle:
                        if name.startswith("embeddings") and handle["embeddings"].shape[0] == 0:
                            raise ValueError("empty")
                self.complete_reads.add(version)
            except FileNotFoundError as err:
                if self._marker() != version:
                    self.raced += 1  # the old version was deleted after a newer commit: read the marker again
                else:
                    self.violations.append(f"version {version} committed but {err} is missing")
            except (OSError, ValueError, KeyError) as err:
                self.violations.append(f"version {version}: unreadable file ({err})")

    def __enter__(self) -> _CheckpointWatcher:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join(30)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], dict[str, np.ndarray]]:
    from test_storage_contract import _embeddings, _train, write_cycle_graph

    root = tmp_path_factory.mktemp("faults-reference")
    raw = write_cycle_graph(str(root / "data"))
    cp = _train(raw, str(root / "data"), str(root / "checkpoints"))
    return root / "data", raw, _embeddings(cp)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["stage", "stream"])
def test_training_through_a_faulty_network(mode: str, reference: Any, s3_endpoint: str, s3_bucket: str,
                                           quick_retries: None, caplog: pytest.LogCaptureFixture) -> None:
    from test_storage_contract import _copy_tree, _embeddings, _train

    data_dir, raw, expected = reference
    _copy_tree(data_dir, f"{s3_bucket}/data")
    decide = _cycle_faults(every=6, kinds=["500", "drop", "503", "cut"], methods=("GET", "PUT", "HEAD"),
                           burst_every=37, burst=4, delay_every=45)
    caplog.set_level(logging.WARNING, logger="biggraph.storage")
    prefix = s3_bucket.split("://", 1)[1] + "/checkpoints"
    with FaultProxy(s3_endpoint, decide) as proxy, \
            _CheckpointWatcher(_direct_fs(s3_endpoint), prefix, [("node", 0), ("node", 1)]) as watcher:
        cp = _train(raw, f"{s3_bucket}/data", f"{s3_bucket}/checkpoints", edge_read_mode=mode,
                    # 2.5 s: past what a loaded 2-core CI machine needs for a HEAD through the proxy to moto (1 s
                    # timed out 8 times in a row there), still short of the proxy's 3 s "delay" fault
                    storage_options=proxy_options(proxy.endpoint, read_timeout=2.5))
        got = _embeddings(cp)
        time.sleep(0.3)  # let the watcher see the last version
    for name, array in expected.items():
        np.testing.assert_array_equal(got[name], array, err_msg=name)
    faults = proxy.faults()
    assert {"500", "drop", "503", "cut", "delay:3"} <= set(faults), faults
    assert any(method == "PUT" and action for method, _, action in proxy.log), "no checkpoint write was hit"
    assert any(method == "GET" and "/data/edges" in path and action for method, path, action in proxy.log)
    assert "retry" in caplog.text  # our own layer retried what botocore and s3fs gave up on
    assert watcher.violations == []
    assert watcher.complete_reads and max(watcher.complete_reads) == 3


@pytest.mark.slow
def test_marker_is_written_only_after_every_file_of_the_version(s3_endpoint: str, s3_bucket: str,
                                                                quick_retries: None) -> None:
    url = f"{s3_bucket}/ckpt"
    keys = [("node", 0), ("node", 1)]

    def decide(method: str, path: str) -> str | None:
        return "hold" if method == "PUT" and path.endswith("/model.v2.h5") else None

    with FaultProxy(s3_endpoint, decide) as proxy:
        use_storage(proxy_options(proxy.endpoint, read_timeout=30))
        cp = CheckpointStorage(url)
        cp.prepare()
        rng = np.random.default_rng(0)
        for version in (1, 2):
            for entity_type, part in keys:
                cp.save_entity_partition(version, entity_type, part, rng.standard_normal((4, 3)).astype(np.float32))
            cp.save_model(version, {"m": ("m", np.ones(2))})
            if version == 1:
                cp.save_version(1)
        committer = threading.Thread(target=storage.carry(cp.save_version), args=(2,))  # in this test's storage scope
        committer.start()
        assert proxy.held.wait(30)
        time.sleep(0.5)
        direct = _direct_fs(s3_endpoint)
        prefix = url.split("://", 1)[1]
        assert direct.cat_file(f"{prefix}/checkpoint_version.txt") == b"1\n"  # model.v2.h5 is still uploading
        assert committer.is_alive()
        proxy.release.set()
        committer.join(60)
        assert direct.cat_file(f"{prefix}/checkpoint_version.txt") == b"2\n"
        assert direct.exists(f"{prefix}/model.v2.h5")
        cp.close()


@pytest.mark.slow
def test_permanent_errors_fail_fast_naming_the_url(s3_endpoint: str, s3_bucket: str, quick_retries: None,
                                                   tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from test_storage_contract import _copy_tree, write_cycle_graph

    from job.cli import main

    write_cycle_graph(str(tmp_path / "data"))
    _copy_tree(tmp_path / "data", f"{s3_bucket}/data")
    with FaultProxy(s3_endpoint, lambda method, path: "403") as proxy:
        use_storage(proxy_options(proxy.endpoint))
        started = time.monotonic()
        with pytest.raises(storage.StorageError, match=f"{s3_bucket}/data/edges/edges_0_0.h5: .*access denied"):
            storage.read_bytes(f"{s3_bucket}/data/edges/edges_0_0.h5")
        assert time.monotonic() - started < 5  # no retrying of what cannot get better
        raw = write_cycle_graph(str(tmp_path / "unused"))
        raw.update(entity_path=f"{s3_bucket}/data/entities", edge_paths=[f"{s3_bucket}/data/edges"],
                   checkpoint_path=f"{s3_bucket}/ckpt", storage_options=proxy_options(proxy.endpoint))
        config = tmp_path / "config.json"
        config.write_text(json.dumps(raw))
        capsys.readouterr()
        assert main(["train", str(config)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and s3_bucket in err[0] and ("access denied" in err[0] or "does not exist" in err[0]), err
        assert time.monotonic() - started < 20


@pytest.mark.slow
def test_transient_errors_give_up_after_the_time_bound(s3_endpoint: str, s3_bucket: str, quick_retries: None) -> None:
    from storage_adapters import retry

    retry.set_retry_policy(total_seconds=1.5, first_delay=0.1, max_delay=0.3)
    with FaultProxy(s3_endpoint, lambda method, path: "500") as proxy:
        use_storage(proxy_options(proxy.endpoint, attempts=1))
        started = time.monotonic()
        with pytest.raises(storage.StorageError, match=rf"{s3_bucket}/k: write still failing after \d+ attempts"):
            storage.write_text(f"{s3_bucket}/k", "1")
        assert 1.0 < time.monotonic() - started < 15
        assert len(proxy.log) >= 2  # retried, then given up


@pytest.mark.slow
def test_a_gateway_restarting_mid_run_is_retried(s3_endpoint: str, s3_bucket: str, quick_retries: None,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """Refused connections after the endpoint has answered are a restart, not a typo: retried (and said)."""
    from storage_adapters import retry

    retry.forget_endpoints()
    url = f"{s3_bucket}/k"
    caplog.set_level(logging.WARNING, logger="biggraph.storage")
    restarted: list[FaultProxy] = []

    class RestartOnFirstRetry(logging.Handler):
        """Brings the gateway back on its port once the first retry has been announced (no timing guesses)."""

        def emit(self, record: logging.LogRecord) -> None:
            if not restarted and "connection refused" in record.getMessage():
                restarted.append(FaultProxy(s3_endpoint, lambda method, path: None, port=port).__enter__())

    handler = RestartOnFirstRetry(logging.WARNING)
    with FaultProxy(s3_endpoint, lambda method, path: None) as first:
        port = first.server.server_address[1]
        use_storage(proxy_options(first.endpoint, attempts=2))
        storage.write_text(url, "before the restart")  # the endpoint has answered: a run is under way
        first.stop()
        logging.getLogger("biggraph.storage").addHandler(handler)
        try:
            assert storage.read_text(url) == "before the restart"
        finally:
            logging.getLogger("biggraph.storage").removeHandler(handler)
            for proxy in restarted:
                proxy.stop()
    assert restarted and restarted[0].log, "the read was not answered by the restarted gateway"
    refused = [r.getMessage() for r in caplog.records if "connection refused" in r.getMessage()]
    # botocore's retries say so (3 attempts: proxy_options' max_attempts=2 retries), naming the request and endpoint
    assert refused and re.search(r"(Head|Get)Object failed on attempt \d of 3 \(EndpointConnectionError: ", refused[0]), refused
    assert f"http://127.0.0.1:{port}/{url.split('://', 1)[1]}" in refused[0], refused
