"""What the workflow tests share (the function tests too): the agents' part of a recovery, played."""

from __future__ import annotations

import boto3
from spotcr_contracts import events

from rehearsal.controlplane import (
    REGION,
    ControlPlane,
    agent_event,
    checkpoint_id,
    finish_checkpoint,
    finish_restore,
    invoke_function,
    load_event,
    now_iso,
    route,
)

NO_CAPACITY = "InsufficientInstanceCapacity"


def commit(
    plane: ControlPlane,
    job_id: str,
    instance_id: str,
    generation: int,
    kind: str,
    at_ms: int | None = None,
    sequence: int | None = None,
) -> str:
    """The VM commits the dump it was ordered and answers its command (finish_checkpoint)."""
    checkpoint = checkpoint_id(kind, generation, at_ms, sequence)
    finish_checkpoint(
        events.CheckpointCompleted(
            job_id,
            instance_id,
            generation,
            now_iso(),
            checkpoint_id=checkpoint,
            kind=kind,
            seconds=1.5,
            bytes_total=10,
            bytes_uploaded=5,
        )
    )
    return checkpoint


def recover(plane: ControlPlane, job_id: str, restored: str, final_from: str | None = None) -> str:
    """Play the agents through a recovery: optional final dump, backup ready, restore completed. Returns the backup."""
    record = plane.wait_until(lambda: (r := plane.job(job_id)).backup_instance_id and r, "the backup launch")
    backup = str(record.backup_instance_id)
    if final_from:
        plane.wait_for_token(job_id, "final-dump")
        sequence = ordered_sequence(plane, final_from, "final")
        restored = commit(plane, job_id, final_from, record.generation, "final", sequence=sequence)
    route(agent_event(events.AgentReady(job_id, backup, record.generation, now_iso(), mode="restore")))
    [restore] = plane.wait_until(lambda: plane.sent_commands("restore"), "the restore command")
    assert restore["parameters"]["CheckpointId"] == restored
    completed = events.RestoreCompleted(
        job_id, backup, record.generation, now_iso(), checkpoint_id=restored, seconds=1.0
    )
    finish_restore(completed)
    assert plane.wait_for_execution()["status"] == "SUCCEEDED"
    return backup


def ordered_sequence(plane: ControlPlane, instance_id: str, kind: str) -> int:
    """The sequence of the newest dump of this kind ordered to this instance (the command's Sequence)."""
    sent = [c for c in plane.sent_commands() if c["instances"] == [instance_id] and c["parameters"].get("Kind") == kind]
    return int(sent[-1]["parameters"]["Sequence"])


def order_periodic(plane: ControlPlane, job_id: str, instance_id: str) -> int:
    """The scheduler orders the job's periodic dump (made due now); returns the order's sequence."""
    table = boto3.resource("dynamodb", region_name=REGION).Table("spotcr-jobs")
    table.update_item(
        Key={"job_id": job_id}, UpdateExpression="SET next_checkpoint_at = :due", ExpressionAttributeValues={":due": 0}
    )
    assert invoke_function("scheduler", load_event("scheduled-event"))["ordered"] == [job_id]
    return ordered_sequence(plane, instance_id, "periodic")
