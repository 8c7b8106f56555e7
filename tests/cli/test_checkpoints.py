"""`spotcr checkpoints`: what each checkpoint added to the store, read from the store itself."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import boto3
from spotcr_agent.store import CheckpointStore
from spotcr_cli import jobs

from tests.store.support import JOB, RUN, images, meta


def test_each_checkpoint_counts_its_manifest_and_the_packed_chunks_no_older_one_has(aws: str, tmp_path: Path) -> None:
    # Given two checkpoints in packs: the second shares one of the first's two files
    bucket = "spotcr-checkpoints-listing"
    boto3.client("s3").create_bucket(Bucket=bucket)
    store = CheckpointStore.for_s3(bucket, JOB, run_id=RUN)
    first = store.commit(images(tmp_path / "one", 1, 2), meta(1))
    second = store.commit(images(tmp_path / "two", 1, 3), meta(2, parent=1))
    assert first.manifest.packs() and second.manifest.packs()

    cloud: Any = SimpleNamespace(client=boto3.client, stack=SimpleNamespace(bucket=bucket))
    listed = jobs.checkpoints(cloud, SimpleNamespace(job_id=JOB, run_id=RUN, storage="s3"))  # type: ignore[arg-type]

    # Then each counts what it sent: its manifest and its new chunks' compressed bytes (about 1 MiB of random)
    assert [c.stored for c in listed] == [first.bytes_uploaded, second.bytes_uploaded]
    assert 1 << 20 < second.bytes_uploaded < first.bytes_uploaded
