"""A wrong endpoint is not a hang (issue #17).

With a mistyped S3 endpoint, biggraph used to retry for two minutes in silence (our 120 s budget, each
attempt hiding botocore's own five attempts). Now an endpoint that cannot be reached at all (a host
that does not resolve, a port where nothing listens, a failed TLS handshake) fails at its first request
with one line naming the endpoint and the cause, while the transient errors of a run under way are still
retried, every retry said as it happens.

Everything here is real: a closed port on 127.0.0.1 for "refused", a ``.invalid`` host for DNS (reserved:
it never resolves, with or without a network), plain-HTTP and self-signed TLS servers on 127.0.0.1, moto
behind the fault proxy of test_storage_faults for transient errors. Attempts are counted at the source
(botocore's own request events, the proxy's log), never by timing.
"""

from __future__ import annotations

import datetime
import http.server
import itertools
import json
import logging
import os
import re
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import CLEARED_AWS_ENV, TEST_AWS_ENV
from storage_scope import use_storage

import storage_adapters as storage
from storage_adapters import retry

# Distinctive credentials: if either ever shows up in a message or a log line, the test says so.
KEY = "AKIDLEAKCHECK0000000"
SECRET = "s3cr3t-must-never-be-printed"
INVALID_HOST = "no-such-host.invalid"


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Harmless AWS settings (no real profile or endpoint can be used), fresh filesystems and endpoint memory."""
    s3fs = pytest.importorskip("s3fs", reason="s3fs is not installed")
    for key, value in TEST_AWS_ENV.items():
        monkeypatch.setenv(key, value)
    for key in CLEARED_AWS_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    retry.forget_endpoints()  # a closed port of this test may be a port that answered in an earlier one
    s3fs.S3FileSystem.clear_instance_cache()  # clients read AWS_ENDPOINT_URL_S3 when they are created
    # a short budget: should fail-fast ever break, these tests fail in seconds (saying "retry") instead of hanging
    previous = retry.set_retry_policy(total_seconds=3, first_delay=0.05, max_delay=0.5)
    yield
    retry.set_retry_policy(previous.total_seconds, previous.first_delay, previous.max_delay, previous.max_attempts)
    retry.forget_endpoints()
    s3fs.S3FileSystem.clear_instance_cache()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nothing listens once the socket is closed


def _options(endpoint: str) -> dict[str, Any]:
    return {"endpoint_url": endpoint, "key": KEY, "secret": SECRET}


class BotocoreAttempts:
    """Every HTTP attempt botocore makes for the filesystem of ``url``, read from botocore's own events."""

    def __init__(self, url: str) -> None:
        fs, _ = storage.get_filesystem(url)
        self.events = fs.s3.meta.events
        self.attempts: list[tuple[str, int]] = []
        self.events.register("request-created.s3", self._record, unique_id="test-attempt-counter")

    def _record(self, request: Any = None, operation_name: str = "", **_: Any) -> None:
        self.attempts.append((operation_name, int(request.context.get("retries", {}).get("attempt", 1))))

    def close(self) -> None:
        self.events.unregister("request-created.s3", unique_id="test-attempt-counter")


def _fails_without_a_retry(url: str, operation: Callable[[], Any], caplog: pytest.LogCaptureFixture,
                           ) -> tuple[storage.StorageError, list[tuple[str, int]]]:
    caplog.set_level(logging.DEBUG, logger="biggraph.storage")
    counter = BotocoreAttempts(url)
    try:
        with pytest.raises(storage.StorageError) as info:
            operation()
    finally:
        counter.close()
    message = str(info.value)
    assert info.value.exit_code == 2 and "\n" not in message
    assert KEY not in message and SECRET not in message
    assert counter.attempts, "no request was sent"
    assert all(attempt == 1 for _, attempt in counter.attempts), f"botocore retried: {counter.attempts}"
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == [], f"a retry was made (or announced): {warnings}"
    return info.value, counter.attempts


# the policy: attempt n of m --------------------------------------------------------------------------------


def test_the_policy_says_how_many_attempts_a_call_gets() -> None:
    # 0.2 s doubling to 10 s: 0.2+0.4+0.8+1.6+3.2+6.4 = 12.6 s, then ten 10 s pauses fit in 120 s
    assert retry.RetryPolicy(total_seconds=120).attempts() == 17
    assert retry.RetryPolicy(total_seconds=0).attempts() == 1
    assert retry.RetryPolicy(total_seconds=120, max_attempts=4).attempts() == 4


def test_every_retry_is_logged_with_attempt_n_of_m(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="biggraph.storage")
    calls = itertools.count(1)

    def always_reset() -> None:
        raise ConnectionResetError(f"reset by peer (call {next(calls)})")

    policy = retry.RetryPolicy(total_seconds=100, first_delay=0.1, max_delay=0.2, max_attempts=3)
    pauses: list[float] = []
    with pytest.raises(storage.StorageError, match=r"^s3://b/k: read still failing after 3 attempts in "):
        retry.call_with_retry("s3://b/k", "read", always_reset, policy, sleep=pauses.append)
    lines = [r.getMessage() for r in caplog.records]
    assert len(pauses) == 2 and len(lines) == 2  # three attempts, two retries, each said
    for n, line in enumerate(lines, start=1):
        assert line.startswith(f"s3://b/k: read failed on attempt {n} of 3 (ConnectionResetError: reset by peer "
                               f"(call {n})); retrying in "), line


# unreachable endpoints fail at the first request -------------------------------------------------------------

_OPERATIONS: dict[str, Callable[[str, Path], Any]] = {
    "read": lambda url, tmp: storage.read_bytes(url),
    "write": lambda url, tmp: storage.write_text(url, "x"),
    "exists": lambda url, tmp: storage.exists(url),
    "isdir": lambda url, tmp: storage.isdir(url),
    "list": lambda url, tmp: storage.listdir(url),
    "size": lambda url, tmp: storage.size(url),
    "download": lambda url, tmp: storage.get_file(url, str(tmp / "copy")),
    "bucket check": lambda url, tmp: storage.makedirs(url),
}


@pytest.mark.parametrize("operation", sorted(_OPERATIONS))
def test_refused_at_the_first_request_fails_at_once(operation: str, aws_env: None, tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    port = _closed_port()
    use_storage(_options(f"http://127.0.0.1:{port}"))
    url = "s3://some-bucket/dir/key"
    err, _ = _fails_without_a_retry(url, lambda: _OPERATIONS[operation](url, tmp_path), caplog)
    assert str(err).startswith(f"{url}: {operation} failed: the storage endpoint http://127.0.0.1:{port} refused "
                               "the connection (nothing listens on that port); not retried"), err
    assert "does not exist" not in str(err)  # s3fs' bucket probe swallows the error: it is not a missing bucket


def test_an_unresolvable_host_fails_at_once(aws_env: None, caplog: pytest.LogCaptureFixture) -> None:
    # .invalid is reserved (RFC 6761): resolution must fail, online or offline, and quickly
    with pytest.raises(socket.gaierror):
        socket.getaddrinfo(INVALID_HOST, 9000)
    use_storage(_options(f"http://{INVALID_HOST}:9000"))
    err, attempts = _fails_without_a_retry("s3://some-bucket/key", lambda: storage.read_bytes("s3://some-bucket/key"),
                                           caplog)
    assert str(err).startswith(f"s3://some-bucket/key: read failed: cannot resolve the host of the storage endpoint "
                               f"http://{INVALID_HOST}:9000 (DNS: "), err
    assert "check the host name of the endpoint" in str(err)
    assert len(attempts) == 1


def test_https_to_a_plain_http_server_fails_at_once(aws_env: None, caplog: pytest.LogCaptureFixture) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        endpoint = f"https://127.0.0.1:{server.server_address[1]}"
        use_storage(_options(endpoint))
        err, _ = _fails_without_a_retry("s3://b/k", lambda: storage.read_bytes("s3://b/k"), caplog)
    finally:
        server.shutdown()
        server.server_close()
    assert f"s3://b/k: read failed: the TLS handshake with the storage endpoint {endpoint} failed (" in str(err), err
    assert "http:// server given as https://" in str(err)


def _self_signed_server(tmp_path: Path) -> tuple[str, Callable[[], None]]:
    """An HTTPS server on 127.0.0.1 whose certificate no client trusts."""
    crypto = pytest.importorskip("cryptography.x509", reason="cryptography is not installed")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = crypto.Name([crypto.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (crypto.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(crypto.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1)).sign(key, hashes.SHA256()))
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            try:
                context.wrap_socket(conn, server_side=True).close()
            except OSError:
                conn.close()  # the client aborts the handshake: that is the point

    threading.Thread(target=serve, daemon=True).start()

    def close() -> None:
        stop.set()
        listener.close()

    return f"https://127.0.0.1:{listener.getsockname()[1]}", close


def test_an_untrusted_certificate_fails_at_once_even_after_answers(aws_env: None, tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    endpoint, close = _self_signed_server(tmp_path)
    try:
        use_storage(_options(endpoint))
        err, _ = _fails_without_a_retry("s3://b/k", lambda: storage.read_bytes("s3://b/k"), caplog)
        assert f"the TLS certificate of the storage endpoint {endpoint} cannot be verified (" in str(err), err
        assert "client_kwargs.verify" in str(err)
        # unlike a refused connection, a certificate does not get better because the endpoint answered before
        retry.note_answered(request_url=f"{endpoint}/b/k")
        err, _ = _fails_without_a_retry("s3://b/k", lambda: storage.read_bytes("s3://b/k"), caplog)
        assert "cannot be verified" in str(err)
    finally:
        close()


def test_a_refusal_after_an_answer_is_transient(aws_env: None) -> None:
    """The rule itself, on a real refused request: first request fatal; once the endpoint answered, transient."""
    port = _closed_port()
    use_storage(_options(f"http://127.0.0.1:{port}"))
    fs, path = storage.get_filesystem("s3://b/k")
    with pytest.raises(Exception) as info:  # the raw botocore error, before our layer
        fs.cat_file(path)
    assert retry.classify(info.value) == retry.UNREACHABLE
    retry.note_answered(request_url=f"http://127.0.0.1:{port}/b/other-key")  # same host and port answered once
    assert retry.unreachable_reason(info.value) is None and retry.classify(info.value) == retry.TRANSIENT
    retry.forget_endpoints()
    retry.note_answered(request_url=f"http://127.0.0.1:{_closed_port()}/b/k")  # another endpoint does not count
    assert retry.classify(info.value) == retry.UNREACHABLE


def test_an_endpoint_without_a_scheme_is_a_config_error(aws_env: None) -> None:
    use_storage(_options("127.0.0.1:9000"))
    with pytest.raises(storage.StorageError, match=r"^s3://b/k: cannot set up the S3 client from storage_options: "
                                                   r"Invalid endpoint: 127\.0\.0\.1:9000$"):
        storage.read_bytes("s3://b/k")


def test_the_storage_layer_changes_only_its_own_filesystems(aws_env: None) -> None:
    """fsspec caches filesystems by their arguments: code opening URLs through fsspec directly must not get
    the instance whose s3fs retries were turned off."""
    import fsspec

    use_storage(_options(f"http://127.0.0.1:{_closed_port()}"))
    ours, _ = storage.get_filesystem("s3://b/k")
    direct = fsspec.filesystem("s3", **storage.storage_options_for("s3://b/k"))
    assert ours is storage.get_filesystem("s3://b/other")[0]  # still one cached filesystem for the storage layer
    assert direct is not ours and ours.retries == 1 and direct.retries == type(direct).retries > 1


# the commands: one line, exit code 2, no traceback, no retries -------------------------------------------------


def _write_config(tmp_path: Path, **extra: Any) -> Path:
    config = {
        "entities": {"node": {"num_partitions": 1}}, "relations": [{"name": "r", "lhs": "node", "rhs": "node"}],
        "dimension": 4, "entity_path": "s3://bkt/data/entities", "edge_paths": ["s3://bkt/data/edges"],
        "checkpoint_path": "s3://bkt/ckpt", **extra,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


def _run_cli(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, list[str]]:
    from job.cli import main

    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err and KEY not in err and SECRET not in err
    return code, [line for line in err.splitlines() if " INFO " not in line]


@pytest.mark.slow
def test_train_with_a_closed_port_fails_at_once(aws_env: None, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    port = _closed_port()
    config = _write_config(tmp_path, storage_options=_options(f"http://127.0.0.1:{port}"))
    code, lines = _run_cli(["train", str(config)], capsys)
    assert code == 2 and len(lines) == 1, lines  # no retry lines before the error
    assert lines[0].startswith("biggraph train: error: s3://bkt/") and \
        f"the storage endpoint http://127.0.0.1:{port} refused the connection" in lines[0], lines


@pytest.mark.slow
def test_report_with_an_unresolvable_endpoint_fails_at_once(aws_env: None, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # report reads config.json from the checkpoint, so its endpoint comes from the environment
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://{INVALID_HOST}:9000")
    code, lines = _run_cli(["report", "s3://bkt/ckpt", "--out", str(tmp_path / "r.html")], capsys)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("biggraph report: error: s3://bkt/ckpt/") and \
        f"cannot resolve the host of the storage endpoint http://{INVALID_HOST}:9000 (DNS: " in lines[0], lines


@pytest.mark.slow
def test_import_with_a_closed_port_fails_at_once(aws_env: None, tmp_path: Path, capsys: pytest.CaptureFixture,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    port = _closed_port()
    # the endpoint only in the config's storage_options (import used to ignore them and ask AWS itself)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    (tmp_path / "edges.tsv").write_text("a\tr\tb\nb\tr\tc\n")
    config = _write_config(tmp_path, storage_options={"endpoint_url": f"http://127.0.0.1:{port}"})
    code, lines = _run_cli(["import", str(config), str(tmp_path / "edges.tsv"), "-l", "0", "--rel-col", "1", "-r", "2"],
                           capsys)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("biggraph import: error: s3://bkt/data/") and \
        f"the storage endpoint http://127.0.0.1:{port} refused the connection" in lines[0], lines
    assert "does not exist" not in lines[0]


# transient errors of a run under way: still retried, and said -------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(("fault", "reason", "sends", "retries"), [
    # (fault, how botocore's retry names it, requests per botocore attempt, retries said by each layer)
    ("500", "InternalError (HTTP 500)", 1, 2),
    ("503", "SlowDown (HTTP 503)", 1, 2),  # s3fs' own loop would retry this one silently: it is off
    # aiohttp re-sends a request whose connection dropped once, at once (RFC 9112), below botocore: each attempt
    # is two requests, so the four faults are one botocore retry and one of ours
    ("drop", "ConnectionClosedError: Connection was closed", 2, 1),
])
def test_a_burst_of_errors_is_retried_and_every_retry_said(fault: str, reason: str, sends: int, retries: int,
                                                           s3_endpoint: str, s3_bucket: str,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    from test_storage_faults import FaultProxy

    retry.forget_endpoints()
    previous = retry.set_retry_policy(total_seconds=30, first_delay=0.05, max_delay=0.2, max_attempts=6)
    caplog.set_level(logging.WARNING, logger="biggraph.storage")
    failures = itertools.count()
    url = f"{s3_bucket}/k"

    def four_faults_on_put(method: str, path: str) -> str | None:
        return fault if method == "PUT" and path.endswith("/k") and next(failures) < 4 else None

    try:
        with FaultProxy(s3_endpoint, four_faults_on_put) as proxy:
            options = dict(_options(proxy.endpoint), config_kwargs={"retries": {"max_attempts": 1, "mode": "legacy"}})
            use_storage(options)
            storage.write_text(url, "written through the burst")
            assert storage.read_text(url) == "written through the burst"
    finally:
        retry.set_retry_policy(previous.total_seconds, previous.first_delay, previous.max_delay, previous.max_attempts)
        use_storage({})
    puts = [action for method, path, action in proxy.log if method == "PUT" and path.endswith("/k")]
    assert puts == [fault] * 4 + [None]
    lines = [r.getMessage() for r in caplog.records]
    request_url = f"{proxy.endpoint}/{url.split('://', 1)[1]}"
    botocore_lines = [line for line in lines if line.endswith("; botocore retries it")]
    ours = [line for line in lines if line.startswith(f"{url}: write failed on attempt")]
    # botocore makes 2 attempts per call (max_attempts=1 retry): each call that failed is one botocore retry and
    # one of ours, until the call that went through
    assert len(botocore_lines) == retries and all(
        line.startswith(f"{request_url}: PutObject failed on attempt 1 of 2 ({reason}") for line in botocore_lines), lines
    assert [line.split(" (")[0] for line in ours] == [f"{url}: write failed on attempt {n} of 6"
                                                      for n in range(1, retries + 1)], lines
    assert all("; retrying in " in line for line in ours)
    # every request sent is accounted for: the first of each of our attempts, or a retry botocore announced
    # (a layer retrying in silence, such as s3fs' own loop, would send requests nobody announced); each failed
    # attempt went out ``sends`` times, the last one, answered, once
    announced = (len(ours) + 1) + len(botocore_lines)
    assert len(puts) == (announced - 1) * sends + 1
    assert not any(KEY in line or SECRET in line for line in lines)


@pytest.mark.slow
def test_import_from_s3_survives_a_cut_body(s3_endpoint: str, s3_bucket: str, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """biggraph import reads its input through fsspec directly: s3fs' own retries still cover it."""
    import fsspec
    from test_storage_faults import FaultProxy

    source = f"{s3_bucket}/in/edges.tsv"
    fsspec.filesystem("s3", endpoint_url=s3_endpoint, skip_instance_cache=True).pipe_file(
        source.split("://", 1)[1], b"".join(f"a{i}\tr\tb{i}\n".encode() for i in range(20000)))
    object_path = "/" + source.split("://", 1)[1]
    cuts: list[str] = []

    def cut_the_first_read(method: str, path: str) -> str | None:
        if method == "GET" and path.startswith(object_path) and not cuts:
            cuts.append(path)
            return "cut"
        return None

    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "entities": {"node": {"num_partitions": 1}}, "relations": [{"name": "r", "lhs": "node", "rhs": "node"}],
        "dimension": 4, "entity_path": str(tmp_path / "entities"), "edge_paths": [str(tmp_path / "edges")],
        "checkpoint_path": str(tmp_path / "ckpt")}))
    with FaultProxy(s3_endpoint, cut_the_first_read) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.endpoint)  # biggraph import reads no storage_options
        use_storage({})
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
        code, lines = _run_cli(["import", str(config), source, "-l", "0", "--rel-col", "1", "-r", "2"], capsys)
    assert cuts and code == 0, lines
    assert (tmp_path / "entities" / "entity_count_node_0.txt").read_text().strip() == "40000"


# the docs quote what is printed ------------------------------------------------------------------------------


class _BrokenS3(http.server.BaseHTTPRequestHandler):
    """A store that answers: 404 for the bucket "missing", 500 InternalError for everything else."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        status, code = (404, "NoSuchBucket") if self.path.startswith("/missing") else (500, "InternalError")
        body = f"<Error><Code>{code}</Code><Message>{code}</Message></Error>".encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", "0" if self.command == "HEAD" else str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _answer


def _messages_of_every_kind(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> list[str]:
    """Real failures of each kind the troubleshooting section explains: their errors and their log lines."""
    caplog.set_level(logging.WARNING, logger="biggraph.storage")
    messages: list[str] = []

    def failure(options: dict[str, Any], operation: Callable[[], Any]) -> None:
        use_storage(options)
        with pytest.raises(storage.StorageError) as info:
            operation()
        messages.append(str(info.value))

    read = lambda: storage.read_bytes("s3://bkt/k")  # noqa: E731
    failure(_options(f"http://{INVALID_HOST}:9000"), read)
    failure(_options(f"http://127.0.0.1:{_closed_port()}"), read)
    failure(_options("127.0.0.1:9000"), read)
    endpoint, close = _self_signed_server(tmp_path)
    try:
        failure(_options(endpoint), read)
    finally:
        close()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _BrokenS3)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        failure(_options(f"https://127.0.0.1:{server.server_address[1]}"), read)
        answering = dict(_options(f"http://127.0.0.1:{server.server_address[1]}"),
                         config_kwargs={"retries": {"max_attempts": 1, "mode": "legacy"}})
        failure(answering, read)  # 500s: botocore's retries, ours, then "still failing"
        failure(answering, lambda: storage.makedirs("s3://missing/run1"))
    finally:
        server.shutdown()
        server.server_close()
    return messages + [record.getMessage() for record in caplog.records]


def test_troubleshooting_quotes_the_storage_messages(aws_env: None, tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    text = (Path(__file__).resolve().parent.parent / "docs" / "troubleshooting.md").read_text()
    section = text.split("\n## Storage: endpoints and retries\n", 1)[1].split("\n## ", 1)[0]
    templates = [message for line in section.splitlines() if line.startswith("### ")
                 for message in re.findall(r"`([^`]+)`", line)]
    assert len(templates) >= 9
    retry.set_retry_policy(max_attempts=2)  # the fixture restores the policy
    messages = _messages_of_every_kind(tmp_path, caplog)
    for template in templates:
        pattern = re.compile(".+".join(re.escape(part) for part in re.split(r"<[^>]+>", template)))
        assert any(pattern.fullmatch(message) for message in messages), \
            f"troubleshooting.md: nothing printed matches {template!r}; printed:\n" + "\n".join(messages)
