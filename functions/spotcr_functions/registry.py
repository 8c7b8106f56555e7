"""Data access for the job registry: every state change is one conditional DynamoDB write."""

from __future__ import annotations

from collections.abc import Mapping
from functools import cached_property
from typing import Any

from spotcr_functions import registry_schema
from spotcr_functions.models import ACTIVE, JobRecord, Status, event_attribute, token_attribute

WAIT_KEYS = ("final-dump", "backup-ready", "restore")  # what a workflow step waits for


class StaleGeneration(Exception):
    """The job moved on to another generation (or away from this instance): this work is no longer wanted."""


class Registry:
    def __init__(self, table_name: str, session: Any = None) -> None:
        self.table_name = table_name
        self._session = session

    @cached_property
    def table(self) -> Any:
        import boto3

        return (self._session or boto3).resource("dynamodb").Table(self.table_name)

    @cached_property
    def _conditional_failure(self) -> type[Exception]:
        return self.table.meta.client.exceptions.ConditionalCheckFailedException

    def get(self, job_id: str) -> JobRecord | None:
        item = self.table.get_item(Key={registry_schema.PARTITION_KEY: job_id}, ConsistentRead=True).get("Item")
        return JobRecord.from_item(item) if item else None

    def by_instance(self, instance_id: str) -> JobRecord | None:
        """The job whose current instance this is (then read consistently from the table)."""
        response = self.table.query(
            IndexName=registry_schema.BY_INSTANCE.name,
            KeyConditionExpression="instance_id = :i",
            ExpressionAttributeValues={":i": instance_id},
        )
        for item in response.get("Items", []):
            record = self.get(item[registry_schema.PARTITION_KEY])
            if record and record.instance_id == instance_id:
                return record
        return None

    def register(self, record: JobRecord) -> JobRecord:
        """Insert a new job, or replace a finished one of the same name; returns the registered record."""
        try:
            self.table.put_item(
                Item=record.to_item(),
                ConditionExpression="attribute_not_exists(job_id) OR #s IN (:completed, :failed)",
                ExpressionAttributeNames={"#s": "status"},
                ExpressionAttributeValues={":completed": Status.COMPLETED.value, ":failed": Status.FAILED.value},
            )
        except self._conditional_failure:
            existing = self.get(record.job_id)
            if existing is None:
                raise
            return existing
        return record

    def update(
        self,
        job_id: str,
        set_values: Mapping[str, Any] | None = None,
        remove: tuple[str, ...] = (),
        condition: str | None = None,
        condition_values: Mapping[str, Any] | None = None,
    ) -> JobRecord | None:
        """One conditional UpdateItem; returns the new record, or None when the condition failed."""
        names: dict[str, str] = {}
        values: dict[str, Any] = dict(condition_values or {})
        clauses = []
        for index, (attribute, value) in enumerate((set_values or {}).items()):
            names[f"#a{index}"] = attribute
            values[f":v{index}"] = value
            clauses.append(f"#a{index} = :v{index}")
        expression = ("SET " + ", ".join(clauses)) if clauses else ""
        if remove:
            for index, attribute in enumerate(remove):
                names[f"#r{index}"] = attribute
            expression += " REMOVE " + ", ".join(f"#r{index}" for index in range(len(remove)))
        arguments: dict[str, Any] = {
            "Key": {registry_schema.PARTITION_KEY: job_id},
            "UpdateExpression": expression.strip(),
            "ReturnValues": "ALL_NEW",
        }
        if condition:
            names.update({"#status": "status", "#generation": "generation", "#instance": "instance_id"})
            arguments["ConditionExpression"] = condition
        if names:
            used = {k: v for k, v in names.items() if k in arguments["UpdateExpression"] or k in (condition or "")}
            arguments["ExpressionAttributeNames"] = used
        if values:
            arguments["ExpressionAttributeValues"] = values
        try:
            response = self.table.update_item(**arguments)
        except self._conditional_failure:
            return None
        return JobRecord.from_item(response["Attributes"])

    def bump_generation(self, job_id: str, instance_id: str, generation: int, at: str) -> JobRecord | None:
        """The fencing write: generation+1 once per interrupted instance, only while that instance is current."""
        return self.update(
            job_id,
            {
                "generation": generation + 1,
                "status": Status.RECOVERING.value,
                "recovering_from": instance_id,
                "interrupted_at": at,
                "updated_at": at,
            },
            remove=(
                "next_checkpoint_at",
                "backup_instance_id",
                "backup_az",
                "handover_snapshot_id",
                "handover_volume_id",
                *(token_attribute(k) for k in WAIT_KEYS),
                *(event_attribute(k) for k in WAIT_KEYS),
            ),
            condition="#instance = :instance AND #generation = :generation AND #status IN (:p, :r, :c) "
            "AND (attribute_not_exists(recovering_from) OR recovering_from <> :instance)",
            condition_values={
                ":instance": instance_id,
                ":generation": generation,
                **{f":{s.value[0].lower()}": s.value for s in ACTIVE},
            },
        )

    def due_jobs(self, now: int) -> list[JobRecord]:
        """Jobs whose periodic checkpoint is due: RUNNING ones, and CHECKPOINTING ones whose dump never reported."""
        records = []
        for status in (Status.RUNNING, Status.CHECKPOINTING):
            arguments: dict[str, Any] = {
                "IndexName": registry_schema.BY_STATUS.name,
                "KeyConditionExpression": "#s = :s AND next_checkpoint_at <= :now",
                "ExpressionAttributeNames": {"#s": "status"},
                "ExpressionAttributeValues": {":s": status.value, ":now": now},
            }
            while True:
                response = self.table.query(**arguments)
                records += [JobRecord.from_item(item) for item in response.get("Items", [])]
                if "LastEvaluatedKey" not in response:
                    break
                arguments["ExclusiveStartKey"] = response["LastEvaluatedKey"]
        return records

    def store_token(self, job_id: str, key: str, generation: int, token: str, reset: bool = False) -> JobRecord:
        """The waiter's half of the rendezvous; `reset` forgets an earlier arrival (a second restore attempt)."""
        record = self.update(
            job_id,
            {token_attribute(key): {"token": token, "generation": generation}},
            remove=(event_attribute(key),) if reset else (),
            condition="#generation = :g",
            condition_values={":g": generation},
        )
        if record is None:
            raise StaleGeneration(f"job {job_id} is no longer at generation {generation}")
        return record

    def record_arrival(self, job_id: str, key: str, generation: int, arrival: Mapping[str, Any]) -> JobRecord | None:
        """The event's half of the rendezvous; None when the job is at another generation."""
        return self.update(
            job_id,
            {event_attribute(key): {**arrival, "generation": generation}},
            condition="#generation = :g",
            condition_values={":g": generation},
        )
