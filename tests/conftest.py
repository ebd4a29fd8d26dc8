"""Shared fixtures: a real S3 endpoint (moto's threaded server on 127.0.0.1), and a small real graph.

- ``moto_endpoint`` (session): starts one moto server for the whole run on a free port and
  points the AWS_* variables at harmless test values (so no real credentials or profile can
  ever be used), restoring them at the end.
- ``s3_endpoint``: the same endpoint, with moto reset to empty before the test and
  ``storage_adapters.using(StorageSettings(options={"endpoint_url": ...}))`` in force during it.
- ``s3_bucket``: a fresh bucket on it, as ``s3://name``.

Tests using them start a server, so mark them ``@pytest.mark.slow``.

- ``umls_p4`` (module): UMLS imported into 4 partitions, for the distributed tests
  (tests/helpers_distributed.py has the agents that train it and the checks on their runs).
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

# A TCPStore server (torch c10d, libuv or not) looks up the name of every client it accepts (getnameinfo of the
# peer, for its logs), from the thread that serves every client. Clients on 127.0.0.1 connect as ::ffff:127.0.0.1,
# which /etc/hosts does not name, so each accept asks DNS; this sandbox's resolver drops about one query in 25, and
# glibc's default wait (5 s, then a retry) then stalls the whole store: measured, 18 of 400 clones of one store took
# 5.0 s each (90 s of 92). One try of 1 s instead: one stall of 1 s in 400 clones here. Set before any lookup, so
# that this process and every child it starts (torchrun agents, workers) inherit it; a caller's own setting wins.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")

import pytest  # noqa: E402
from helpers_distributed import import_umls_p4  # noqa: E402
from storage_scope import scope_for_test, use_storage  # noqa: E402


def _pbg_optionals_by_equality() -> None:
    """The reference PBG (torchbiggraph 1.0.0, run in-process by the compatibility tests) recognises an
    ``Optional[X]`` field of its config schema by identity, ``type_ is Optional[X]``, which holds only while typing's
    bounded cache (128 entries) still holds that object. A whole test session creates more parameterized types than
    that, after which PBG fails to read any config ("NotImplementedError: Unknown type: typing.Optional[float]"),
    depending on which tests ran before: the same check by equality, in this test process only."""
    try:
        from torchbiggraph import schema
    except Exception:  # not installed: its tests skip, saying so
        return

    def unpack_optional(type_: object) -> object:
        try:
            candidate = type_.__args__[0]  # type: ignore[attr-defined]
        except (AttributeError, LookupError):
            raise TypeError("Not an optional type") from None
        if type_ != Optional[candidate]:
            raise TypeError("Not an optional type")
        return candidate

    schema.unpack_optional = unpack_optional


_pbg_optionals_by_equality()

TEST_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}
# Variables that could make boto find real credentials or another endpoint.
CLEARED_AWS_ENV = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE",
                   "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE")


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    pytest.importorskip("moto.server", reason="moto[server] is not installed")
    pytest.importorskip("s3fs", reason="s3fs is not installed")
    from moto.server import ThreadedMotoServer

    saved = {k: os.environ.get(k) for k in (*TEST_AWS_ENV, *CLEARED_AWS_ENV)}
    os.environ.update(TEST_AWS_ENV)
    for key in CLEARED_AWS_ENV:
        os.environ.pop(key, None)
    os.environ["AWS_CONFIG_FILE"] = os.devnull
    os.environ["AWS_SHARED_CREDENTIALS_FILE"] = os.devnull
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def reset_moto(endpoint: str) -> None:
    import requests

    requests.post(f"{endpoint}/moto-api/reset", timeout=30).raise_for_status()


@pytest.fixture(autouse=True)
def _storage_scope() -> Iterator[None]:
    """Storage settings a test (or a fixture) sets with ``use_storage`` end with the test."""
    with scope_for_test():
        yield


@pytest.fixture
def s3_endpoint(moto_endpoint: str) -> str:
    reset_moto(moto_endpoint)
    use_storage({"endpoint_url": moto_endpoint})  # on the test's own stack: undone after the test's own settings
    return moto_endpoint


@pytest.fixture
def s3_bucket(s3_endpoint: str) -> str:
    import s3fs

    name = f"test-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem(endpoint_url=s3_endpoint, skip_instance_cache=True).mkdir(name)
    return f"s3://{name}"


@pytest.fixture(scope="module")
def umls_p4(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """UMLS (a small real knowledge graph) imported into 4 partitions: ``{"root", "config"}``."""
    return import_umls_p4(tmp_path_factory.mktemp("umls_p4"))


@pytest.fixture
def fresh_library(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The native kernels' process-level cache emptied for the test, a private build directory, and neither the
    package's build nor a prebuilt one: what the test puts there."""
    from job import native

    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setenv("BIGGRAPH_NATIVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "PREBUILT", tmp_path / "prebuilt")
    monkeypatch.setattr(native, "BUILT", tmp_path / "ext" / "kernels.so")  # not the package's build either
    return tmp_path
