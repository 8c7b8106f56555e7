"""The job registry's DynamoDB table: key and index names, in one place for functions, infra and tests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PARTITION_KEY = "job_id"  # string


@dataclass(frozen=True)
class Index:
    name: str
    partition_key: str
    sort_key: str | None = None


# The scheduler's query: partition `status`, sort `next_checkpoint_at` (number, unix seconds); due = sort key <= now.
# A RUNNING or CHECKPOINTING job is due a periodic checkpoint; a PENDING one has not started by its deadline.
BY_STATUS = Index("by-status", "status", "next_checkpoint_at")
# EventBridge cannot filter on tags, so EC2 events find their job by instance id.
BY_INSTANCE = Index("by-instance", "instance_id")
INDEXES = (BY_STATUS, BY_INSTANCE)
ATTRIBUTE_TYPES = {PARTITION_KEY: "S", "status": "S", "next_checkpoint_at": "N", "instance_id": "S"}

# Powertools Idempotency's table: partition key `id` (string), TTL attribute `expiration`.
IDEMPOTENCY_PARTITION_KEY = "id"
IDEMPOTENCY_TTL_ATTRIBUTE = "expiration"


def create_table_arguments(table_name: str) -> dict[str, Any]:
    """CreateTable arguments for the jobs table (tests and the rehearsal create it in moto with these)."""
    indexes = []
    for index in INDEXES:
        schema = [{"AttributeName": index.partition_key, "KeyType": "HASH"}]
        if index.sort_key:
            schema.append({"AttributeName": index.sort_key, "KeyType": "RANGE"})
        indexes.append({"IndexName": index.name, "KeySchema": schema, "Projection": {"ProjectionType": "ALL"}})
    return {
        "TableName": table_name,
        "BillingMode": "PAY_PER_REQUEST",
        "KeySchema": [{"AttributeName": PARTITION_KEY, "KeyType": "HASH"}],
        "AttributeDefinitions": [{"AttributeName": k, "AttributeType": t} for k, t in ATTRIBUTE_TYPES.items()],
        "GlobalSecondaryIndexes": indexes,
    }


def create_idempotency_table_arguments(table_name: str) -> dict[str, Any]:
    return {
        "TableName": table_name,
        "BillingMode": "PAY_PER_REQUEST",
        "KeySchema": [{"AttributeName": IDEMPOTENCY_PARTITION_KEY, "KeyType": "HASH"}],
        "AttributeDefinitions": [{"AttributeName": IDEMPOTENCY_PARTITION_KEY, "AttributeType": "S"}],
    }
