"""The agent's lifecycle events: keep the registry true and resume the workflow steps waiting for them."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools import Logger
from spotcr_contracts import events

from spotcr_functions import jobs, rendezvous
from spotcr_functions.deps import Deps
from spotcr_functions.models import ACTIVE, JobRecord, Status
from spotcr_functions.observability import SERVICE

logger = Logger(service=SERVICE, child=True)


def on_agent_event(deps: Deps, event: events.AgentEvent) -> dict[str, Any]:
    record = deps.registry.get(event.job_id)
    if record is None and isinstance(event, events.JobStarted):
        # Events come in any order: the job may start before its instance's "running" state change arrives
        # (or that event is lost). The agent's word that a tagged instance runs it registers the job as well.
        jobs.register_instance(deps, event.instance_id)
        record = deps.registry.get(event.job_id)
    if record is None:
        logger.info("agent event for an unknown job", job_id=event.job_id, detail_type=event.DETAIL_TYPE)
        return {"action": "ignored", "reason": "unknown job"}
    if event.generation != record.generation and not _last_checkpoint_of_interrupted_primary(record, event):
        # A zombie primary (lower generation) must never move the job; a higher one cannot come from spotcr.
        logger.warning(
            "agent event from another generation ignored",
            job_id=event.job_id,
            detail_type=event.DETAIL_TYPE,
            event_generation=event.generation,
            job_generation=record.generation,
            instance_id=event.instance_id,
        )
        return {"action": "ignored", "reason": "stale generation"}
    handler = _HANDLERS.get(type(event))
    if handler is None:
        return {"action": "ignored", "reason": f"no action for {event.DETAIL_TYPE}"}
    return handler(deps, record, event)


def _last_checkpoint_of_interrupted_primary(record: JobRecord, event: events.AgentEvent) -> bool:
    """The primary may commit its final dump (on its own IMDS notice) at the generation it served before the
    warning bumped it; while the job recovers, that checkpoint is exactly the one recovery wants."""
    return (
        isinstance(event, events.CheckpointCompleted)
        and record.status == Status.RECOVERING
        and event.generation == record.generation - 1
        and event.instance_id == record.recovering_from
    )


def _agent_ready(deps: Deps, record: JobRecord, event: Any) -> dict[str, Any]:
    if event.mode != "restore":
        logger.info("agent ready", job_id=record.job_id, instance_id=event.instance_id)
        return {"action": "noted"}
    if record.backup_instance_id and event.instance_id != record.backup_instance_id:
        logger.warning("AgentReady from an instance that is not the job's backup", instance_id=event.instance_id)
        return {"action": "ignored", "reason": "not the backup"}
    rendezvous.arrive(deps, record.job_id, "backup-ready", record.generation, {"instance_id": event.instance_id})
    return {"action": "backup-ready"}


def _bootstrap_failed(deps: Deps, record: JobRecord, event: Any) -> dict[str, Any]:
    cause = f"{event.step}: {event.reason}"
    if record.status == Status.RECOVERING and event.instance_id == record.backup_instance_id:
        rendezvous.arrive(
            deps, record.job_id, "backup-ready", record.generation, {}, error="BootstrapFailed", cause=cause
        )
        return {"action": "backup-failed"}
    if event.instance_id == record.instance_id and record.status == Status.PENDING:
        _set_status(deps, record, Status.FAILED, reason=f"bootstrap failed: {cause}")
        return {"action": "failed"}
    return {"action": "ignored", "reason": "not the job's instance"}


def _job_started(deps: Deps, record: JobRecord, event: Any) -> dict[str, Any]:
    if event.instance_id != record.instance_id or record.status != Status.PENDING:
        return {"action": "ignored", "reason": f"job is {record.status} on {record.instance_id}"}
    _set_status(deps, record, Status.RUNNING, next_checkpoint_at=deps.unix_now() + record.interval_s)
    return {"action": "running"}


def _checkpoint_completed(deps: Deps, record: JobRecord, event: Any) -> dict[str, Any]:
    committed = _record_checkpoint(deps, record, event.checkpoint_id)
    deps.metric("CheckpointSeconds", "Seconds", event.seconds)
    if event.kind == "final":
        deps.metric("FinalDumpSeconds", "Seconds", event.seconds)
        deps.metric("FinalDumpBytes", "Bytes", event.bytes_uploaded)
        rendezvous.arrive(deps, record.job_id, "final-dump", record.generation, {"checkpoint_id": event.checkpoint_id})
    elif record.status == Status.CHECKPOINTING:
        _set_status(deps, record, Status.RUNNING, expect=Status.CHECKPOINTING)
    return {"action": "checkpoint", "committed": committed, "checkpoint_id": event.checkpoint_id}


def _checkpoint_failed(deps: Deps, record: JobRecord, event: Any) -> dict[str, Any]:
    logger.warning("checkpoint failed", job_id=record.job_id, kind=event.kind, reason=event.reason)
    if event.kind == "final":
        rendezvous.arrive(
            deps, record.job_id, "final-dump", record.generation, {}, error="CheckpointFailed", cause=event.reason
        )
    elif record.status == Status.CHECKPOINTING:
        _set_status(deps, record, Status.RUNNING, expect=Status.CHECKPOINTING)
    return {"action": "checkpoint-failed"}


def _restore_completed(deps: Deps, record: JobRecord, event: Any) -> dict[str, Any]:
    deps.metric("RestoreSeconds", "Seconds", event.seconds)
    output = {"checkpoint_id": event.checkpoint_id, "instance_id": event.instance_id, "pid": event.pid}
    rendezvous.arrive(deps, record.job_id, "restore", record.generation, output)
    return {"action": "restored"}


def _restore_failed(deps: Deps, record: JobRecord, event: Any) -> dict[str, Any]:
    cause = f"{event.checkpoint_id or 'newest'}: {event.reason}"
    rendezvous.arrive(deps, record.job_id, "restore", record.generation, {}, error="RestoreFailed", cause=cause)
    return {"action": "restore-failed"}


def _job_exited(deps: Deps, record: JobRecord, event: Any) -> dict[str, Any]:
    if event.instance_id != record.instance_id or record.status not in ACTIVE:
        return {"action": "ignored", "reason": f"job is {record.status} on {record.instance_id}"}
    status = Status.COMPLETED if event.exit_code == 0 else Status.FAILED
    _set_status(deps, record, status, exit_code=event.exit_code, reason=f"job exited with code {event.exit_code}")
    return {"action": status.value.lower()}


def _record_checkpoint(deps: Deps, record: JobRecord, checkpoint_id: str) -> bool:
    """Newest committed checkpoint wins; the one it replaces becomes the fallback for a failed restore."""
    for _ in range(3):
        if record.checkpoint_id and record.checkpoint_id >= checkpoint_id:
            return False
        condition = "#generation = :g AND " + (
            "checkpoint_id = :old" if record.checkpoint_id else "attribute_not_exists(checkpoint_id)"
        )
        values: dict[str, Any] = {":g": record.generation}
        set_values: dict[str, Any] = {"checkpoint_id": checkpoint_id, "updated_at": deps.iso_now()}
        if record.checkpoint_id:
            values[":old"] = record.checkpoint_id
            set_values["previous_checkpoint_id"] = record.checkpoint_id
        if deps.registry.update(record.job_id, set_values, condition=condition, condition_values=values):
            return True
        fresh = deps.registry.get(record.job_id)
        if fresh is None or fresh.generation != record.generation:
            return False
        record = fresh
    return False


def _set_status(deps: Deps, record: JobRecord, status: Status, expect: Status | None = None, **values: Any) -> bool:
    set_values = {"status": status.value, "updated_at": deps.iso_now(), **values}
    remove = ("next_checkpoint_at",) if status in (Status.COMPLETED, Status.FAILED) else ()
    condition_values = {":g": record.generation, ":expect": (expect or record.status).value}
    updated = deps.registry.update(
        record.job_id,
        set_values,
        remove=remove,
        condition="#generation = :g AND #status = :expect",
        condition_values=condition_values,
    )
    logger.info("job status", job_id=record.job_id, status=status.value, changed=updated is not None)
    return updated is not None


_HANDLERS: dict[type[events.AgentEvent], Any] = {
    events.AgentReady: _agent_ready,
    events.BootstrapFailed: _bootstrap_failed,
    events.JobStarted: _job_started,
    events.CheckpointCompleted: _checkpoint_completed,
    events.CheckpointFailed: _checkpoint_failed,
    events.RestoreCompleted: _restore_completed,
    events.RestoreFailed: _restore_failed,
    events.JobExited: _job_exited,
}
