"""Store fixtures: every store test runs against S3 (moto server on loopback) and a directory (a mount).

On S3 each store signs with a session vended as store-credentials vends it (its run's session policy), and every
call is evaluated against the synthesized stack's store role and that session policy (tests/localaws/vended.py)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import boto3
import pytest
from spotcr_agent.store import CheckpointStore

from tests.localaws.vended import Enforced, enforced

from .support import JOB, RUN


@pytest.fixture(params=["s3", "directory"])
def backend_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def s3_iam(aws: str) -> Iterator[Enforced]:
    """A fresh bucket, and the stack's IAM enforced on it."""
    bucket = f"spotcr-test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3").create_bucket(Bucket=bucket)
    with enforced(bucket) as world:
        yield world


@pytest.fixture
def make_store(backend_kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Callable[..., CheckpointStore]:
    """A factory of stores over one fresh bucket or directory (several stores may share it, as VMs do); a store is
    for one run of its job (RUN unless run_id is given), as the agent's always is."""
    if backend_kind == "s3":
        world: Enforced = request.getfixturevalue("s3_iam")

        def on_s3(job: str = JOB, run_id: str = RUN, **options: object) -> CheckpointStore:
            session = world.store_session(job, run_id)
            return CheckpointStore.for_s3(world.bucket, job, session=session, run_id=run_id, **options)  # type: ignore[arg-type]

        return on_s3
    root = tmp_path / "mnt"
    root.mkdir()
    return lambda job=JOB, run_id=RUN, **options: CheckpointStore.for_directory(root, job, run_id=run_id, **options)


@pytest.fixture
def store(make_store: Callable[..., CheckpointStore]) -> CheckpointStore:
    return make_store()
