"""A job's exit, taken from an authenticated source: SSM's result of the status command on the instance said to
have ended it, never the agent's JobExited on the bus (agent_events._job_exited only asks).

Invariant (facts from authenticated sources): a job completes or fails from its exit only on what the status command
printed on an instance whose exit ends the job as the record stands (spotcr_contracts.protocol.exit_ends_job), read with
GetCommandInvocation, or what a dump order printed there on finding the job ended (checkpoints.reported_dump); a
JobExited that any VM knowing the run id could put moves nothing (tests/workflow/test_authenticated.py).

When the confirmation cannot come:
- the instance is gone before the status command runs: nothing ends the job from the claim; EC2's state change
  (an interruption or a lost instance) starts the job's normal recovery from its newest checkpoint, so the result
  stays right and the cost is the work since that checkpoint, run again;
- the status-change event is lost: the scheduler's tick asks again (ask_again) once the job's periodic checkpoint
  is due (the checkpoint is ordered too: a forged claim can cost one status command per interval, never a
  checkpoint), so the cost is at most one checkpoint interval of waiting before the job ends.
"""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools import Logger
from spotcr_contracts import commands, events, results

from spotcr_functions import agent_events, jobs
from spotcr_functions.deps import Deps
from spotcr_functions.models import JobRecord
from spotcr_functions.observability import SERVICE
from spotcr_functions.registry import EXIT_CLAIM

logger = Logger(service=SERVICE, child=True)


def on_status_command(deps: Deps, command_id: str, instance_id: str) -> dict[str, Any]:
    """SSM's status-change event for a status command (source aws.ssm, which no VM can put): read what the command
    printed on that instance and, if it reports the job's exit with its result stored or given up, end the job with
    the same end logic and guards as ever (agent_events.end_from_exit: exactly one end, redelivered copies only
    finish the release)."""
    record = jobs.record_tagged_on(deps, instance_id)
    if record is None:
        logger.info("status command of an instance that runs no job", instance_id=instance_id)
        return {"action": "ignored", "reason": "no job on that instance"}
    invocation = deps.cloud.command_invocation(command_id, instance_id) or {}
    exited = reported_exit(record, instance_id, invocation, deps.iso_now())
    if exited is None:
        logger.info("the status command reports no exit of this job", job_id=record.job_id, instance_id=instance_id)
        return {"action": "ignored", "reason": "no exit reported", "job_id": record.job_id}
    return {**agent_events.end_from_exit(deps, record, exited), "job_id": record.job_id}


def reported_exit(
    record: JobRecord, instance_id: str, invocation: dict[str, Any], read_at: str
) -> events.JobExited | None:
    """The exit the status command reported for this job's run on that instance, or None (the command failed, the
    job still runs, another job or run, or its result is still being committed: asked again later)."""
    if invocation.get("Status") != commands.COMMAND_SUCCEEDED:
        return None
    answer = agent_events.command_result(invocation, results.parse_status)
    if not isinstance(answer, results.StatusResult) or (answer.job_id, answer.run_id) != (record.job_id, record.run_id):
        return None
    return settled_exit(record, instance_id, answer, read_at)


def settled_exit(
    record: JobRecord, instance_id: str, answer: results.StatusResult | results.CheckpointResult, read_at: str
) -> events.JobExited | None:
    """The exit an answer of this job's run on that instance reports (the status command's, or a dump order's that
    found the job ended), once its result is stored or given up; else None."""
    if answer.exit_code is None or not answer.settled_exit():
        return None
    return events.JobExited(
        job_id=record.job_id,
        run_id=record.run_id,
        instance_id=instance_id,
        generation=answer.generation,
        at=read_at,
        exit_code=answer.exit_code,
        result=answer.result,
        result_error=answer.result_error,
        result_missing=answer.result_missing,
    )


def ask_again(deps: Deps, record: JobRecord) -> bool:
    """The scheduler's tick, for a due job whose exit was claimed at this generation but never confirmed (the
    status-change event lost): send the status command again. True when asked."""
    claim = record.extra.get(EXIT_CLAIM)
    if not isinstance(claim, dict) or claim.get("generation") != record.generation:
        return False
    instance_id = str(claim.get("instance_id") or "")
    if instance_id != record.instance_id:
        return False
    logger.info("exit claimed but unconfirmed; asking again", job_id=record.job_id, instance_id=instance_id)
    agent_events.ask_exit(deps, record, instance_id)
    return True
