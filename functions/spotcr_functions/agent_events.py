"""The agent's lifecycle events: keep the registry true and resume the workflow steps waiting for them."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeVar

from aws_lambda_powertools import Logger
from spotcr_contracts import commands, events, results, tags
from spotcr_contracts.protocol import exit_ends_job, final_dump_taker, is_newer, may_record, of_this_run

from spotcr_functions import efs_access, jobs, rendezvous
from spotcr_functions.deps import Deps
from spotcr_functions.models import ENDED, JobRecord, Status
from spotcr_functions.observability import SERVICE, Metric
from spotcr_functions.registry import WAIT_KEYS

logger = Logger(service=SERVICE, child=True)
T = TypeVar("T")

# Metrics the dashboard shows (infra/monitoring.py names the same).


def on_agent_event(deps: Deps, event: events.AgentEvent) -> dict[str, Any]:
    record = deps.registry.get(event.job_id)
    if _waiting_for_run(event) or (record is None and isinstance(event, events.JobStarted)):
        # Events come in any order: the agent may be up before its instance's "running" state change arrives (or
        # that event is lost). An agent waiting for its run registers the job as the state change would: the
        # instance's own tags decide, and it gets either the run's tag (a lost tag write is put again) or
        # spotcr:error when the name runs elsewhere.
        jobs.register_instance(deps, event.instance_id)
        record = deps.registry.get(event.job_id)
    if record is None:
        logger.info("agent event for an unknown job", job_id=event.job_id, detail_type=event.DETAIL_TYPE)
        return {"action": "ignored", "reason": "unknown job"}
    refused = _refusal(record, event)
    if refused is not None:
        return refused
    handler = _HANDLERS.get(type(event))
    if handler is None:
        return {"action": "ignored", "reason": f"no action for {event.DETAIL_TYPE}"}
    return handler(deps, record, event)


def _refusal(record: JobRecord, event: events.AgentEvent) -> dict[str, Any] | None:
    """Why this event (or this report of SSM's) must not move the job as the record stands, or None."""
    if not _of_this_run(record, event):
        # Another run of the same name (an instance refused, or an earlier run's VM) never moves this one.
        logger.warning(
            "agent event from another run ignored",
            job_id=event.job_id,
            detail_type=event.DETAIL_TYPE,
            event_run=event.run_id,
            job_run=record.run_id,
            instance_id=event.instance_id,
        )
        return {"action": "ignored", "reason": "another run"}
    if event.generation != record.generation and not (
        _last_checkpoint_of_interrupted_primary(record, event) or _exit_of_interrupted_primary(record, event)
    ):
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
    return None


def _of_this_run(record: JobRecord, event: events.AgentEvent) -> bool:
    """An event moves the job only if it carries the job's run id. A run-mode AgentReady without one (the agent
    waits for its run's tag) moves nothing either: it is only noted, after registration was checked from EC2."""
    return of_this_run(record, event.run_id) or _waiting_for_run(event)


def _waiting_for_run(event: events.AgentEvent) -> bool:
    return isinstance(event, events.AgentReady) and event.mode == "run" and not event.run_id


def _last_checkpoint_of_interrupted_primary(record: JobRecord, event: events.AgentEvent) -> bool:
    """The primary may commit its final dump (on its own IMDS notice) at the generation it served before the
    warning bumped it; while the job recovers, that checkpoint is exactly the one recovery wants (for a job over
    several VMs, node 0's, which takes every node's dumps: rule 6's `final_dump_taker`). A final dump
    that failed there and stopped the job says the old copy is gone, which the restore waits for."""
    failed_and_stopped = isinstance(event, events.CheckpointFailed) and event.kind == "final" and event.job_stopped
    return (
        (isinstance(event, events.CheckpointCompleted) or failed_and_stopped)
        and record.status == Status.RECOVERING
        and event.generation == record.generation - 1
        and event.instance_id == final_dump_taker(record)
    )


def _exit_of_interrupted_primary(record: JobRecord, event: events.AgentEvent) -> bool:
    """The job ended on the primary (node 0 of a job over several VMs) just before the warning: that exit is the
    last thing its generation did."""
    return (
        isinstance(event, events.JobExited)
        and record.status == Status.RECOVERING
        and event.generation == record.generation - 1
        and event.instance_id == final_dump_taker(record)
    )


def _agent_ready(deps: Deps, record: JobRecord, event: Any) -> dict[str, Any]:
    if event.mode != "restore":
        logger.info("agent ready", job_id=record.job_id, instance_id=event.instance_id)
        return {"action": "noted"}
    if record.status == Status.RECOVERING and record.backup_instance_id is None:
        # The recovery's write that records its backup may land after that VM booted (a throttled write retried
        # for longer than a boot): the report is kept for that write to find (rule 9, recovery.launch_backup).
        kept = deps.registry.keep_early_ready(record.job_id, record.generation, event.instance_id, deps.iso_now())
        if kept is not None and kept.backup_instance_id != event.instance_id:
            logger.info("ready report kept until its instance is recorded as the backup", instance_id=event.instance_id)
            return {"action": "kept", "reason": "not recorded as the backup yet"}
        record = kept or record
    if event.instance_id != record.backup_instance_id and record.node_count and record.status == Status.RECOVERING:
        # Maybe the backup of a node lost during the recovery (recorded yet or not): the restore step reads it.
        deps.registry.note_ready(record.job_id, record.generation, event.instance_id, deps.iso_now())
        return {"action": "kept", "reason": "a lost node's backup, or none of the job's"}
    if event.instance_id != record.backup_instance_id:
        # Only the backup the recovery recorded moves it, never a VM someone tagged spotcr:mode=restore
        # (jobs.register_instance tags that one spotcr:error).
        logger.warning("AgentReady from an instance that is not the job's backup", instance_id=event.instance_id)
        return {"action": "ignored", "reason": "not the backup"}
    rendezvous.arrive(deps, record.job_id, "backup-ready", record.generation, {"instance_id": event.instance_id})
    return {"action": "backup-ready"}


def _bootstrap_failed(deps: Deps, record: JobRecord, event: Any) -> dict[str, Any]:
    cause = f"{event.step}: {event.reason}"
    if record.status == Status.RECOVERING and record.backup_instance_id is None:
        # As a ready report (_agent_ready): a boot that fails before the backup is recorded is kept, not lost.
        kept = deps.registry.keep_early_ready(
            record.job_id, record.generation, event.instance_id, deps.iso_now(), error="BootstrapFailed", cause=cause
        )
        if kept is not None and kept.backup_instance_id != event.instance_id:
            logger.info("bootstrap failure kept until its instance is recorded", instance_id=event.instance_id)
            return {"action": "kept", "reason": "not recorded as the backup yet"}
        record = kept or record
    if record.status == Status.RECOVERING and event.instance_id == record.backup_instance_id:
        rendezvous.arrive(
            deps, record.job_id, "backup-ready", record.generation, {}, error="BootstrapFailed", cause=cause
        )
        return {"action": "backup-failed"}
    if record.status == Status.RECOVERING and record.node_count:  # maybe a lost node's backup: as _agent_ready
        deps.registry.note_ready(
            record.job_id, record.generation, event.instance_id, deps.iso_now(), error="BootstrapFailed", cause=cause
        )
        return {"action": "kept", "reason": "a lost node's backup, or none of the job's"}
    if event.instance_id == record.instance_id and record.status == Status.PENDING:
        failed = {"reason": f"bootstrap failed: {cause}", "updated_at": deps.iso_now()}
        if deps.registry.end(record, Status.FAILED, failed):
            efs_access.close_for(deps, record)
        return {"action": "failed"}
    return {"action": "ignored", "reason": "not the job's instance"}


def _job_started(deps: Deps, record: JobRecord, event: Any) -> dict[str, Any]:
    if event.instance_id != record.instance_id or record.status != Status.PENDING:
        return {"action": "ignored", "reason": f"job is {record.status} on {record.instance_id}"}
    started = deps.registry.mark_started(record, deps.unix_now() + record.interval_s, deps.iso_now())
    logger.info("job status", job_id=record.job_id, status=Status.RUNNING.value, changed=started is not None)
    return {"action": "running"}


def take_checkpoint_report(
    deps: Deps, record: JobRecord, report: events.CheckpointCompleted | events.CheckpointFailed
) -> dict[str, Any]:
    """A dump's outcome as SSM reported the checkpoint command's result on that instance
    (checkpoints.on_checkpoint_command): record a committed checkpoint, resume the final-dump wait. The same run
    and generation guards as any agent event (_refusal), then who may record (may_record) and the order (is_newer)
    decide. The agent's own CheckpointCompleted and CheckpointFailed on the bus move nothing (_checkpoint_noted)."""
    refused = _refusal(record, report)
    if refused is not None:
        return refused
    if isinstance(report, events.CheckpointCompleted):
        return _checkpoint_completed(deps, record, report)
    return _checkpoint_failed(deps, record, report)


def _checkpoint_noted(deps: Deps, record: JobRecord, event: Any) -> dict[str, Any]:
    """Telemetry only: any VM that knows the run id could put CheckpointCompleted or CheckpointFailed (a forged
    final dump would resume the final-dump wait and tell the restore the old copy is gone). A checkpoint is taken
    from SSM's result of the checkpoint command on that instance (checkpoints.on_checkpoint_command)."""
    reason = getattr(event, "reason", "")
    logger.info(
        "agent says " + event.DETAIL_TYPE,
        job_id=record.job_id,
        instance_id=event.instance_id,
        kind=event.kind,
        checkpoint_id=getattr(event, "checkpoint_id", None),
        reason=reason or None,
    )
    return {"action": "noted", "reason": "a checkpoint is taken from SSM's command result"}


def _checkpoint_completed(deps: Deps, record: JobRecord, event: Any) -> dict[str, Any]:
    committed = _record_checkpoint(deps, record, event.checkpoint_id, event.instance_id)
    deps.metric(Metric.CHECKPOINT_SECONDS, "Seconds", event.seconds)
    if event.kind == "final":
        deps.metric(Metric.FINAL_DUMP_SECONDS, "Seconds", event.seconds)
        deps.metric(Metric.FINAL_DUMP_BYTES, "Bytes", event.bytes_uploaded)
        output = {"checkpoint_id": event.checkpoint_id, "instance_id": event.instance_id}
        rendezvous.arrive(deps, record.job_id, "final-dump", record.generation, output)
    else:
        if committed and event.next_interval_s > 0:
            _apply_plan(deps, record, event)
        if record.status == Status.CHECKPOINTING:
            deps.registry.settle_periodic_dump(record, deps.iso_now())
    return {"action": "checkpoint", "committed": committed, "checkpoint_id": event.checkpoint_id}


def _apply_plan(deps: Deps, record: JobRecord, event: events.CheckpointCompleted) -> None:
    """The agent's deadline plan from its newest periodic dump: the next dump comes no later than its interval
    from now (never later than the job's own interval), and the record says whether the final dump fits."""
    interval = min(event.next_interval_s, record.interval_s)
    values: dict[str, Any] = {
        "planned_interval_s": interval,
        "predicted_final_dump_s": math.ceil(event.predicted_final_seconds),
        "updated_at": deps.iso_now(),
    }
    due = deps.unix_now() + interval
    if record.next_checkpoint_at is None or due < record.next_checkpoint_at:
        values["next_checkpoint_at"] = due
    if event.deadline_risk:
        values["final_dump_risk"] = event.deadline_risk
    deps.metric(Metric.PREDICTED_FINAL_DUMP_SECONDS, "Seconds", event.predicted_final_seconds)
    updated = deps.registry.record_plan(record, event.instance_id, values, at_risk=bool(event.deadline_risk))
    logger.info("deadline plan", job_id=record.job_id, interval_s=interval, applied=updated is not None)


def _final_dump_at_risk(deps: Deps, record: JobRecord, event: Any) -> dict[str, Any]:
    """Said once per periodic dump that predicts it: the dashboard counts it and its alarm pages."""
    logger.warning(
        "the final dump is predicted not to fit the notice",
        job_id=record.job_id,
        predicted_final_seconds=event.predicted_final_seconds,
        budget_seconds=event.budget_seconds,
        reason=event.reason,
    )
    deps.metric(Metric.FINAL_DUMPS_AT_RISK, "Count", 1)
    return {"action": "final-dump-at-risk", "reason": event.reason}


def _checkpoint_failed(deps: Deps, record: JobRecord, event: Any) -> dict[str, Any]:
    logger.warning("checkpoint failed", job_id=record.job_id, kind=event.kind, reason=event.reason)
    deps.metric(Metric.CHECKPOINTS_FAILED, "Count", 1)
    if event.kind == "final":
        output = {"instance_id": event.instance_id, "job_stopped": event.job_stopped}
        cause = event.reason + ("; the agent stopped the job there" if event.job_stopped else "")
        rendezvous.arrive(
            deps, record.job_id, "final-dump", record.generation, output, error="CheckpointFailed", cause=cause
        )
    elif record.status == Status.CHECKPOINTING:
        deps.registry.settle_periodic_dump(record, deps.iso_now())
    return {"action": "checkpoint-failed"}


def _restore_completed(deps: Deps, record: JobRecord, event: Any) -> dict[str, Any]:
    """Telemetry only: any VM that knows the run id could put this event. The restore is taken from SSM's result
    of the restore command on the backup (recovery.on_restore_command, recovery.check_restore)."""
    logger.info("agent says restored", job_id=record.job_id, instance_id=event.instance_id, attempt=event.attempt)
    return {"action": "noted", "reason": "a restore is taken from SSM's command result"}


def _restore_failed(deps: Deps, record: JobRecord, event: Any) -> dict[str, Any]:
    """Telemetry only (see _restore_completed): the failure is taken from SSM's result of the restore command."""
    logger.warning("agent says the restore failed", job_id=record.job_id, reason=event.reason, attempt=event.attempt)
    return {"action": "noted", "reason": "a restore is taken from SSM's command result"}


def _job_exited(deps: Deps, record: JobRecord, event: Any) -> dict[str, Any]:
    """Telemetry that asks: any VM that knows the run id could put this event, so it ends nothing. When it names the
    instance whose exit would end the job (exit_ends_job), the status command is sent to that instance; the job
    ends from SSM's answer (exits.on_status_command), which only that instance's SSM Agent can report."""
    logger.info("agent says the job exited", job_id=record.job_id, instance_id=event.instance_id, code=event.exit_code)
    if exit_ends_job(record, event) is None:
        return {"action": "noted", "reason": f"job is {record.status} on {record.instance_id}"}
    return {"action": "exit-claimed", "command_id": ask_exit(deps, record, event.instance_id)}


def ask_exit(deps: Deps, record: JobRecord, instance_id: str) -> str:
    """Send the status command to the instance said to have ended the job, and keep the ask in the record (the
    scheduler asks again while it stays unconfirmed: exits.ask_again). Returns the command's id."""
    command_id = deps.cloud.send_command(
        deps.settings.status_document, commands.STATUS, instance_id, {"JobId": record.job_id}
    )
    claim = {"command_id": command_id, "instance_id": instance_id, "generation": record.generation}
    deps.registry.record_exit_claim(record, {**claim, "asked_at": deps.unix_now()}, deps.iso_now())
    logger.info("exit claimed; asking the instance through SSM", job_id=record.job_id, command_id=command_id)
    return command_id


def end_from_exit(deps: Deps, record: JobRecord, event: events.JobExited) -> dict[str, Any]:
    """Exactly one end (spotcr_contracts.protocol, rules 10 and 11). `event` is the exit as SSM's status command
    reported it on that instance (exits.on_status_command), never the bus's. When anything moved between the read
    and the end (a periodic dump claimed, a checkpoint recorded, a restore finished) the end is retried against the
    fresh record, never dropped.
    """
    # An exit without the files the job declared (spotcr:result) is no success, whatever its code.
    status = Status.COMPLETED if event.exit_code == 0 and not event.result_missing else Status.FAILED
    reason = f"job exited with code {event.exit_code} on {event.instance_id}"
    if event.result_missing:
        reason += f" without its declared result: missing {event.result_missing.replace(',', ', ')}"
    seen: JobRecord | None = record
    for _ in range(MAX_END_ATTEMPTS):
        if seen is None:
            break
        why = exit_ends_job(seen, event)
        if why is None:
            if _ended_by(seen, event):
                # A redelivered copy of the exit that ended the job: finish what its first delivery may not have.
                efs_access.close_for(deps, seen)
                return {"action": "ignored", "reason": "job ended already", "vm": _release_vm(deps, seen, event)}
            return {"action": "ignored", "reason": f"job is {seen.status} on {seen.instance_id}"}
        kept = (
            ""
            if event.result or event.result_missing
            else f"; result not stored ({event.result_error or 'no reason given'})"
        )
        values = {"exit_code": event.exit_code, "reason": reason + kept, "updated_at": deps.iso_now()}
        if event.result:
            values["result"] = event.result
        ended = deps.registry.end(seen, status, values)
        if ended is not None:
            logger.info("job ended", job_id=seen.job_id, status=status.value, exit_code=event.exit_code, how=why)
            efs_access.close_for(deps, ended)
            if seen.status == Status.RECOVERING:
                _stop_recovery(deps, ended, event.instance_id, reason)
            return {"action": status.value.lower(), "vm": _release_vm(deps, ended, event)}
        seen = deps.registry.get(record.job_id)
    logger.error("job exit could not be recorded", job_id=record.job_id, exit_code=event.exit_code)
    raise RuntimeError(f"job {record.job_id}: exit with code {event.exit_code} could not be recorded")


MAX_END_ATTEMPTS = 8


def _ended_by(record: JobRecord, event: events.JobExited) -> bool:
    """The record's end is this exit (same code, and its result, if stored, is the one recorded)."""
    ended = record.status in ENDED and record.exit_code == event.exit_code
    return ended and (record.result or "") == event.result


def _release_vm(deps: Deps, record: JobRecord, event: events.JobExited) -> str:
    """Terminate the VM the job ended on once its result is stored, if spotcr launched it (a backup), and the
    backups among a job's other nodes.

    Never the user's own instance. Without a stored result the work dir on the VM is the only copy of the
    job's output: the VM is left running and the record's reason says so."""
    if not event.result:
        logger.error(
            "the job's result is not stored; its VM is left running with the work dir",
            job_id=record.job_id,
            instance_id=event.instance_id,
            result_error=event.result_error,
        )
        return f"kept {event.instance_id}: result not stored"
    # A job over several VMs ended on node 0: its other nodes' backups go too (their shares ended with it).
    others = [node.instance_id for node in record.nodes if node.instance_id != event.instance_id]
    for instance_id in others:
        other = deps.cloud.describe_instance(instance_id)
        if other is not None and tags.launched_by_spotcr(other.tags):
            deps.cloud.terminate_instance(instance_id)
    instance = deps.cloud.describe_instance(event.instance_id)
    if instance is None or not tags.launched_by_spotcr(instance.tags):
        return f"kept {event.instance_id}: not launched by spotcr"
    deps.cloud.terminate_instance(event.instance_id)
    logger.info("backup terminated: the job ended and its result is stored", job_id=record.job_id, result=event.result)
    return f"terminated {event.instance_id}"


def _stop_recovery(deps: Deps, record: JobRecord, ran_on: str, reason: str) -> None:
    """The job ended while a recovery ran: stop the workflow's waits and release a backup that never ran it.

    Tokens stored after the end are refused by the registry (a wait needs a RECOVERING job), so every wait of
    this generation is either in `record` (ALL_NEW of the end write) or never starts."""
    for key in WAIT_KEYS:
        token = record.token(key)
        if token and token.get("generation") == record.generation:
            deps.cloud.complete_task(str(token["token"]), {}, error="StaleGeneration", cause=f"the job ended: {reason}")
    for backup in record.backups():
        if backup != ran_on:
            deps.cloud.terminate_instance(backup)


def _record_checkpoint(deps: Deps, record: JobRecord, checkpoint_id: str, instance_id: str) -> bool:
    """Who may record and the order (spotcr_contracts.protocol, rules 4 and 6), decided on the record as read and
    checked again by the write (Registry.record_checkpoint): a bump, a Finish or a closed generation in between is
    seen, re-read and decided again."""
    for _ in range(3):
        if not may_record(record, instance_id) or not is_newer(record, checkpoint_id):
            return False
        if deps.registry.record_checkpoint(record, checkpoint_id, instance_id, deps.iso_now()):
            return True
        fresh = deps.registry.get(record.job_id)
        if fresh is None or fresh.generation != record.generation:
            return False
        record = fresh
    return False


_HANDLERS: dict[type[events.AgentEvent], Any] = {
    events.AgentReady: _agent_ready,
    events.BootstrapFailed: _bootstrap_failed,
    events.JobStarted: _job_started,
    events.CheckpointCompleted: _checkpoint_noted,
    events.CheckpointFailed: _checkpoint_noted,
    events.FinalDumpAtRisk: _final_dump_at_risk,
    events.RestoreCompleted: _restore_completed,
    events.RestoreFailed: _restore_failed,
    events.JobExited: _job_exited,
}


def command_result(invocation: dict[str, Any], parse: Callable[[str], T]) -> T | None:
    """The agent's result line in what SSM reports of a command (GetCommandInvocation), or None (logged) when it
    printed none of that type."""
    try:
        return parse(str(invocation.get("StandardOutputContent") or ""))
    except results.InvalidResult as error:
        logger.info("the command's result is not the agent's", problem=str(error), status=invocation.get("Status"))
        return None
