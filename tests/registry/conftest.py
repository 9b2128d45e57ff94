"""Shared registry fixtures: a real S3 endpoint on loopback (moto's server mode)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from moto.server import ThreadedMotoServer

from registry.store import make_s3_client


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """URL of an S3 server on 127.0.0.1 for the whole session, with test credentials in the environment.

    Every client made during the session (boto3's default chain) talks to it with these credentials;
    tests isolate themselves with their own bucket (`s3_bucket`).
    """
    with pytest.MonkeyPatch.context() as env:
        env.setenv("AWS_ACCESS_KEY_ID", "testing")
        env.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        env.setenv("AWS_DEFAULT_REGION", "us-east-1")
        # A profile or proxy from the developer's shell must not redirect or break loopback requests.
        env.delenv("AWS_PROFILE", raising=False)
        env.setenv("NO_PROXY", "127.0.0.1,localhost")
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        try:
            yield f"http://{host}:{port}"
        finally:
            server.stop()


@pytest.fixture
def s3_bucket(s3_endpoint: str) -> str:
    """A new, empty bucket on `s3_endpoint`, unique to the test."""
    name = f"test-{uuid.uuid4().hex[:16]}"
    make_s3_client(s3_endpoint).create_bucket(Bucket=name)
    return name
