"""Checkpoints: periodic dumps ordered (the every-minute scheduler, the rebalance recommendation), and each dump's
outcome taken from SSM's result of the checkpoint command.

Invariant (facts from authenticated sources): a checkpoint is recorded as the job's, and the recovery's final-dump
wait resumed, only on what SSM reports the checkpoint command printed on that instance (GetCommandInvocation, after
SSM's status-change event or, for a final dump whose event was lost, when the Restore step begins): its one result
line must name the job's run, and the run and generation guards, who may record and the order decide as for any
report (agent_events.take_checkpoint_report). CheckpointCompleted and CheckpointFailed on the bus, which any job VM
knowing the run id could put, are telemetry (tests/workflow/test_authenticated.py).

When SSM's answer cannot come:
- a periodic dump's status-change event is lost: that checkpoint is not recorded; the next one is (at most one
  interval of work at risk, as with a missed dump);
- a final dump's: the Restore step asks SSM for it (settle_final_dump) before it closes the generation;
- a final dump nobody ordered (the agent's own IMDS notice) is reported to the final-dump command the warning sends
  (Agent.checkpoint reports a final dump already taken), by the warning or, where SSM throttled it, by the
  workflow's final-dump wait (recovery.order_deferred_final_dump); with no command delivered, it is not recorded and
  the job restores from its newest recorded checkpoint.

An order that finds the job ended answers with its exit, as the status command would: once its result is settled
that answer ends the job through the same guards (agent_events.end_from_exit). So a job that exits at the warning
ends once even when its primary is retired before a status command could answer there.
"""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools import Logger
from botocore.exceptions import ClientError
from spotcr_contracts import commands, events, results

from spotcr_functions import agent_events, exits, jobs
from spotcr_functions.deps import Deps
from spotcr_functions.models import JobRecord, Status
from spotcr_functions.observability import SERVICE, Metric
from spotcr_functions.registry import FINAL_DUMP_COMMAND

logger = Logger(service=SERVICE, child=True)


def run_scheduler(deps: Deps) -> dict[str, Any]:
    now = deps.unix_now()
    ordered = []
    asked = []
    for record in deps.registry.due_jobs(now):
        if record.status == Status.CHECKPOINTING:
            # Due again while the dump ordered an interval ago never reported: more than an interval of work at risk
            logger.warning("periodic checkpoint overdue", job_id=record.job_id, generation=record.generation)
            deps.metric(Metric.CHECKPOINTS_OVERDUE, "Count", 1)
        if exits.ask_again(deps, record):
            asked.append(record.job_id)
        if _order_periodic(deps, record, expected_due=record.next_checkpoint_at):
            ordered.append(record.job_id)
    timed_out = [record.job_id for record in deps.registry.overdue_pending(now) if jobs.time_out_pending(deps, record)]
    return {"ordered": ordered, "exits_asked": asked, "timed_out": timed_out}


def on_rebalance(deps: Deps, instance_id: str) -> dict[str, Any]:
    """An early sign of interruption: take a periodic checkpoint now so that little work is at risk."""
    record = deps.registry.by_instance(instance_id)
    if record is None or record.status not in (Status.RUNNING, Status.CHECKPOINTING):
        logger.info("rebalance recommendation for no running job", instance_id=instance_id)
        return {"action": "ignored"}
    ordered = _order_periodic(deps, record, expected_due=None)
    return {"action": "checkpoint" if ordered else "ignored", "job_id": record.job_id}


def _order_periodic(deps: Deps, record: JobRecord, expected_due: int | None) -> bool:
    """Claim the checkpoint with a conditional write (one order per due time, however many schedulers run); the
    same write mints the dump's sequence, which orders it after every dump ordered before."""
    next_at = deps.unix_now() + record.interval_s
    claimed = deps.registry.claim_periodic_dump(record, expected_due, next_at, deps.iso_now())
    if claimed is None:
        return False
    parameters = {
        "JobId": record.job_id,
        "Generation": str(record.generation),
        "Kind": "periodic",
        "RunId": record.run_id,
        "Sequence": str(claimed.dump_sequence),
    }
    try:
        deps.cloud.send_command(deps.settings.checkpoint_document, commands.CHECKPOINT, record.instance_id, parameters)
    except ClientError as error:
        logger.warning("periodic checkpoint not delivered", job_id=record.job_id, error=str(error))
        return False
    logger.info("periodic checkpoint ordered", job_id=record.job_id, generation=record.generation)
    return True


def on_checkpoint_command(deps: Deps, command_id: str, instance_id: str) -> dict[str, Any]:
    """SSM's status-change event for a checkpoint command (source aws.ssm, which no VM can put): take the dump's
    outcome from GetCommandInvocation of that command on that instance."""
    record = jobs.record_tagged_on(deps, instance_id)
    if record is None:
        logger.info("checkpoint command of an instance that runs no job", instance_id=instance_id)
        return {"action": "ignored", "reason": "no job on that instance"}
    return _take(deps, record, command_id, instance_id, deps.cloud.command_invocation(command_id, instance_id) or {})


def settle_final_dump(deps: Deps, record: JobRecord) -> JobRecord:
    """Before the Restore step closes the generation: a final-dump command of this generation whose answer never
    arrived (its status-change event lost, or the dump ended just after the wait) is read from SSM now, so a
    committed final dump is restored and a failed one is known. Returns the record as it then stands."""
    ordered = record.extra.get(FINAL_DUMP_COMMAND)
    arrival = record.arrival("final-dump") or {}
    if not isinstance(ordered, dict) or ordered.get("generation") != record.generation:
        return record
    if arrival.get("generation") == record.generation or not ordered.get("command_id"):
        return record  # answered, or never sent (a throttle left it to the final-dump wait, which did not send it)
    command_id, instance_id = str(ordered["command_id"]), str(ordered["instance_id"])
    invocation = deps.cloud.command_invocation(command_id, instance_id)
    if invocation is None:
        return record
    outcome = _take(deps, record, command_id, instance_id, invocation)
    logger.info("final dump settled from SSM", job_id=record.job_id, outcome=outcome.get("action"))
    return deps.registry.get(record.job_id) or record


def _take(
    deps: Deps, record: JobRecord, command_id: str, instance_id: str, invocation: dict[str, Any]
) -> dict[str, Any]:
    report = reported_dump(record, command_id, instance_id, invocation, deps.iso_now())
    if report is None:
        logger.info("the checkpoint command reports no dump of this run", job_id=record.job_id, command_id=command_id)
        return {"action": "ignored", "reason": "no dump of this run reported", "job_id": record.job_id}
    if isinstance(report, events.JobExited):
        return {**agent_events.end_from_exit(deps, record, report), "job_id": record.job_id}
    return {**agent_events.take_checkpoint_report(deps, record, report), "job_id": record.job_id}


def reported_dump(
    record: JobRecord, command_id: str, instance_id: str, invocation: dict[str, Any], read_at: str
) -> events.CheckpointCompleted | events.CheckpointFailed | events.JobExited | None:
    """The dump the checkpoint command reported on that instance (spotcr_agent.cli._checkpoint's result line), or
    None: still running, or another job or run. An order that found the job ended there reports its exit once its
    result is settled, as the status command would (exits.settled_exit), else None (the agent's JobExited asks the
    status command). A final-dump command that ended with no result at all (the instance went away under it, or the
    command never ran there) is a failed final dump that stopped nothing."""
    status = str(invocation.get("Status") or "")
    if not status or status in commands.COMMAND_RUNNING:
        return None
    answer = agent_events.command_result(invocation, results.parse_checkpoint)
    if not isinstance(answer, results.CheckpointResult) or (answer.job_id, answer.run_id) != (
        record.job_id,
        record.run_id,
    ):
        return _unanswered_final(record, command_id, instance_id, invocation, read_at)
    at = (record.job_id, instance_id, answer.generation, read_at)
    if status == commands.COMMAND_SUCCEEDED and answer.ok:
        return events.CheckpointCompleted(
            *at,
            run_id=record.run_id,
            checkpoint_id=answer.checkpoint_id,
            kind=answer.kind,
            seconds=answer.seconds,
            frozen_seconds=answer.frozen_seconds,
            bytes_total=answer.bytes_total,
            bytes_uploaded=answer.bytes_uploaded,
            memory_tracking=answer.memory_tracking[:1000],
            predicted_final_seconds=answer.predicted_final_seconds,
            next_interval_s=answer.next_interval_s,
            deadline_risk=answer.deadline_risk[:1000],
        )
    if answer.exit_code is not None and answer.exit_code != events.UNKNOWN_EXIT_CODE:
        return exits.settled_exit(record, instance_id, answer, read_at)
    reason = (answer.error or f"the checkpoint command ended {status} on {instance_id}")[:1000]
    stopped = answer.job_stopped
    return events.CheckpointFailed(*at, run_id=record.run_id, kind=answer.kind, reason=reason, job_stopped=stopped)


def _unanswered_final(
    record: JobRecord, command_id: str, instance_id: str, invocation: dict[str, Any], read_at: str
) -> events.CheckpointFailed | None:
    """The final-dump order ended with no result of the agent's (the instance went away under it, or the command
    never ran there): a failed final dump that stopped nothing. None for any other command."""
    ordered = record.extra.get(FINAL_DUMP_COMMAND)
    status = str(invocation.get("Status") or "")
    if status not in commands.COMMAND_FAILED or not isinstance(ordered, dict):
        return None
    if (ordered.get("command_id"), ordered.get("instance_id")) != (command_id, instance_id):
        return None
    stderr = str(invocation.get("StandardErrorContent") or "").strip()
    reason = f"the final dump command ended {status} on {instance_id} with no result" + (
        f": {stderr[-500:]}" if stderr else ""
    )
    generation = int(ordered.get("generation") or 0)
    return events.CheckpointFailed(
        record.job_id, instance_id, generation, read_at, run_id=record.run_id, kind="final", reason=reason
    )
