"""Conditional writes through one Registry from several threads are each judged on their own condition.

boto3's Table builds a condition expression with one ConditionExpressionBuilder per resource, reset at each call:
two threads building at once take each other's placeholders, and a write is then refused (or allowed) on a
condition nobody wrote. Lambda runs one invocation at a time per execution environment, but the local AWS runs
concurrent invocations in one process, sharing the handlers' cached Registry: a wave of 100 recoveries saw a
backup's launch refused as "moved on" while its job had not moved.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import boto3
import pytest
from boto3.dynamodb.conditions import ConditionExpressionBuilder
from moto import mock_aws
from spotcr_functions import registry_schema
from spotcr_functions.models import JobRecord, Status
from spotcr_functions.registry import Registry

JOBS, WRITES = 8, 20


@pytest.fixture
def registry() -> Iterator[Registry]:
    with pytest.MonkeyPatch.context() as patch, mock_aws():
        patch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            patch.setenv(name, "testing")
        boto3.client("dynamodb").create_table(**registry_schema.create_table_arguments("jobs"))
        yield Registry("jobs")


def test_writes_from_many_threads_through_one_registry_are_each_judged_on_their_own_condition(
    registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given jobs recovering at generations of their own (job n at generation n + 1, RECOVERING)
    for n in range(JOBS):
        record = JobRecord.from_item(
            {
                "job_id": f"job-{n}",
                "status": Status.RECOVERING,
                "generation": n + 1,
                "instance_id": f"i-{n}",
                "az": "us-east-1a",
                "subnet_id": "subnet-1",
                "vpc_id": "vpc-1",
                "instance_type": "m7i.large",
                "storage": "s3",
                "interval_s": 600,
                "tags": {},
                "run_id": f"run-{n}",
            }
        )
        registry.register(record)

    # When each job's thread records a backup again and again, each write conditional on its own generation
    refused: list[str] = []

    def record_backups(n: int) -> None:
        for write in range(WRITES):
            if (
                registry.record_backup(f"job-{n}", n + 1, f"i-b{n}-{write}", "us-east-1a", "2026-11-27T10:00:00Z")
                is None
            ):
                refused.append(f"job-{n} write {write}")

    # (the interleaving forced: a thread that takes a value placeholder lets the others run, as a loaded process may)
    placeholder = ConditionExpressionBuilder._get_value_placeholder

    def yielding(builder: ConditionExpressionBuilder) -> str:
        time.sleep(0.001)
        return placeholder(builder)

    monkeypatch.setattr(ConditionExpressionBuilder, "_get_value_placeholder", yielding)
    threads = [threading.Thread(target=record_backups, args=(n,)) for n in range(JOBS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    # Then none was refused: every job stayed at its generation, RECOVERING, with its last backup recorded
    assert refused == []
    for n in range(JOBS):
        now = registry.get(f"job-{n}")
        assert now is not None
        assert (now.generation, now.status, now.backup_instance_id) == (
            n + 1,
            Status.RECOVERING,
            f"i-b{n}-{WRITES - 1}",
        )
