"""Store fixtures: every store test runs against S3 (moto server on loopback) and a directory (a mount)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import boto3
import pytest
from moto.server import ThreadedMotoServer
from spotcr_agent.store import CheckpointStore

from .support import JOB


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def aws(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Point boto3 at the moto server the way the agent is pointed at any endpoint: plain configuration."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return moto_endpoint


@pytest.fixture(params=["s3", "directory"])
def backend_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make_store(backend_kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Callable[..., CheckpointStore]:
    """A factory of stores over one fresh bucket or directory (several stores may share it, as VMs do)."""
    if backend_kind == "s3":
        request.getfixturevalue("aws")
        bucket = f"spotcr-test-{uuid.uuid4().hex[:12]}"
        boto3.client("s3").create_bucket(Bucket=bucket)
        return lambda job=JOB, **options: CheckpointStore.for_s3(bucket, job, **options)
    root = tmp_path / "mnt"
    root.mkdir()
    return lambda job=JOB, **options: CheckpointStore.for_directory(root, job, **options)


@pytest.fixture
def store(make_store: Callable[..., CheckpointStore]) -> CheckpointStore:
    return make_store()
