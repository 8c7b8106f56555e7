"""Store fixtures: every store test runs against S3 (moto server on loopback) and a directory (a mount)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import boto3
import pytest
from spotcr_agent.store import CheckpointStore

from .support import JOB


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
