"""Data access for the job registry: every state change is one conditional DynamoDB write."""

from __future__ import annotations

from collections.abc import Mapping
from functools import cached_property
from typing import Any

from spotcr_contracts import commands

from spotcr_functions import registry_schema
from spotcr_functions.models import ACTIVE, ENDED, JobRecord, Status, event_attribute, token_attribute


def restore_key(attempt: str) -> str:
    """The rendezvous of one restore attempt: each attempt has its own token and its own answer, so a duplicated
    or late answer to attempt N (a RestoreFailed redelivered) never completes attempt N+1's token."""
    return "restore" if attempt in ("", commands.RESTORE_ATTEMPTS[0]) else f"restore-{attempt}"


RESTORE_KEYS = tuple(restore_key(a) for a in commands.RESTORE_ATTEMPTS)
WAIT_KEYS = ("final-dump", "backup-ready", *RESTORE_KEYS)  # what a workflow step waits for
# The job record's counter of dump and restore orders (JobRecord.dump_sequence): every write that orders one increments
# it in the same conditional write (Registry.update's `add`), so each order gets its own sequence
# (commands.checkpoint_order).
DUMP_SEQUENCE = "dump_sequence"


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
                ConditionExpression="attribute_not_exists(job_id) OR #s IN (:completed, :failed, :cancelled)",
                ExpressionAttributeNames={"#s": "status"},
                ExpressionAttributeValues={f":{s.value.lower()}": s.value for s in ENDED},
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
        *,
        extra_names: Mapping[str, str] | None = None,
        add: tuple[str, ...] = (),
    ) -> JobRecord | None:
        """One conditional UpdateItem; returns the new record, or None when the condition failed. Each attribute in
        `add` is a counter that the same write increments (DynamoDB's ADD: atomic, 1 when it was absent)."""
        names: dict[str, str] = dict(extra_names or {})
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
        if add:
            for index, attribute in enumerate(add):
                names[f"#n{index}"] = attribute
            values[":one"] = 1
            expression += " ADD " + ", ".join(f"#n{index} :one" for index in range(len(add)))
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
        """The fencing write: generation+1 once per interrupted instance, only while that instance is current.

        An early final dump (the agent took it on its own IMDS notice and it was recorded before this write) is
        kept: its arrival moves to the new generation, so recovery restores it at once instead of waiting for a
        final dump that was already taken. The write is conditional on the arrival it read, and re-read on a race.
        """
        for _ in range(5):
            record = self.get(job_id)
            if record is None or record.instance_id != instance_id or record.generation != generation:
                return None
            if record.status not in ACTIVE or record.recovering_from == instance_id:
                return None
            early = _early_final_dump(record, instance_id)
            carried = {event_attribute("final-dump"): {**early, "generation": generation + 1}} if early else {}
            arrival = record.arrival("final-dump")
            if arrival:
                checkpoint = (arrival.get("output") or {}).get("checkpoint_id")
                same_arrival = "event_final_dump.#ag = :ag AND " + (
                    "event_final_dump.#ao.checkpoint_id = :ac"
                    if checkpoint
                    else "attribute_not_exists(event_final_dump.#ao.checkpoint_id)"
                )
                arrival_values = {":ag": arrival.get("generation"), **({":ac": checkpoint} if checkpoint else {})}
            else:
                same_arrival, arrival_values = "attribute_not_exists(event_final_dump)", {}
            waits = (*(token_attribute(k) for k in WAIT_KEYS), *(event_attribute(k) for k in WAIT_KEYS))
            bumped = self.update(
                job_id,
                {
                    "generation": generation + 1,
                    "status": Status.RECOVERING.value,
                    "recovering_from": instance_id,
                    "interrupted_at": at,
                    "updated_at": at,
                    **carried,
                },
                remove=(
                    "next_checkpoint_at",
                    "restore_ordered_at",
                    "backup_instance_id",
                    "backup_az",
                    "handover_snapshot_id",
                    "handover_volume_id",
                    *(w for w in waits if w not in carried),
                ),
                condition="#instance = :instance AND #generation = :generation AND #status = :status "
                "AND (attribute_not_exists(recovering_from) OR recovering_from <> :instance) AND " + same_arrival,
                condition_values={
                    ":instance": instance_id,
                    ":generation": generation,
                    ":status": record.status.value,
                    **arrival_values,
                },
                extra_names={"#ag": "generation", "#ao": "output"} if arrival else None,
                add=(DUMP_SEQUENCE,),  # the final dump this warning orders
            )
            if bumped is not None:
                return bumped
        return None

    def bump_backup(self, seen: JobRecord, at: str) -> JobRecord | None:
        """The fencing write for a backup lost while it restores: generation+1, recovering from that backup."""
        waits = (*(token_attribute(k) for k in WAIT_KEYS), *(event_attribute(k) for k in WAIT_KEYS))
        return self.update(
            seen.job_id,
            {
                "generation": seen.generation + 1,
                "recovering_from": seen.backup_instance_id,
                "interrupted_at": at,
                "updated_at": at,
            },
            # The handed-over EBS volume (if any) stays named: it holds the job's data and moves on from the backup.
            remove=("backup_instance_id", "backup_az", "handover_snapshot_id", "restore_ordered_at", *waits),
            condition="#generation = :g AND #status = :recovering AND backup_instance_id = :b",
            condition_values={
                ":g": seen.generation,
                ":recovering": Status.RECOVERING.value,
                ":b": seen.backup_instance_id,
            },
            add=(DUMP_SEQUENCE,),  # the final dump the backup's warning may order
        )

    def end(self, seen: JobRecord, status: Status, values: Mapping[str, Any]) -> JobRecord | None:
        """Mark the job COMPLETED or FAILED if it is still exactly as `seen` (None when it moved: re-read, retry)."""
        backup = "backup_instance_id = :b" if seen.backup_instance_id else "attribute_not_exists(backup_instance_id)"
        return self.update(
            seen.job_id,
            {"status": status.value, **values},
            remove=("next_checkpoint_at",),
            condition=f"#generation = :g AND #status = :s AND #instance = :i AND {backup}",
            condition_values={
                ":g": seen.generation,
                ":s": seen.status.value,
                ":i": seen.instance_id,
                **({":b": seen.backup_instance_id} if seen.backup_instance_id else {}),
            },
        )

    def close_generation(self, job_id: str, generation: int, at: str) -> JobRecord | None:
        """The recovery orders a restore: from now on the interrupted instance's checkpoints of this generation are
        late and never recorded (agent_events.may_record), so the checkpoint chosen from the returned record is the
        newest the job will ever have at this generation until the backup commits its own. The same write mints the
        restore order's sequence (DUMP_SEQUENCE), above every dump the interrupted instance was ordered, so the
        backup's dumps rank after all of that instance's (commands.checkpoint_order). None when stale."""
        return self.update(
            job_id,
            {"restore_ordered_at": at, "updated_at": at},
            condition="#generation = :g AND #status = :recovering",
            condition_values={":g": generation, ":recovering": Status.RECOVERING.value},
            add=(DUMP_SEQUENCE,),
        )

    def due_jobs(self, now: int) -> list[JobRecord]:
        """Jobs whose periodic checkpoint is due: RUNNING ones, and CHECKPOINTING ones whose dump never reported."""
        return self._due((Status.RUNNING, Status.CHECKPOINTING), now)

    def overdue_pending(self, now: int) -> list[JobRecord]:
        """PENDING jobs past the deadline to start that registration set (none without one: pending_timeout 0)."""
        return self._due((Status.PENDING,), now)

    def _due(self, statuses: tuple[Status, ...], now: int) -> list[JobRecord]:
        records = []
        for status in statuses:
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

    def store_token(self, job_id: str, key: str, generation: int, token: str) -> JobRecord:
        """The waiter's half of the rendezvous (each restore attempt waits under its own key: restore_key)."""
        record = self.update(
            job_id,
            {token_attribute(key): {"token": token, "generation": generation}},
            condition="#generation = :g AND #status = :recovering",
            condition_values={":g": generation, ":recovering": Status.RECOVERING.value},
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


def _early_final_dump(record: JobRecord, instance_id: str) -> dict[str, Any] | None:
    """The final dump `instance_id` committed at the generation being bumped, if it arrived before the bump."""
    arrival = record.arrival("final-dump")
    if not arrival or arrival.get("error") or arrival.get("generation") != record.generation:
        return None
    output = arrival.get("output") or {}
    return arrival if output.get("instance_id") == instance_id and output.get("checkpoint_id") else None
