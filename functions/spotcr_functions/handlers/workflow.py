"""The recovery workflow's steps. Each raises a named error (class name) that the state machine catches."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.utilities.typing import LambdaContext

from spotcr_functions import recovery, rendezvous
from spotcr_functions.handlers import _edge
from spotcr_functions.observability import logger, metrics, tracer


def _job(event: dict[str, Any]) -> tuple[str, int]:
    return str(event["job_id"]), int(event["generation"])


@logger.inject_lambda_context
@tracer.capture_lambda_handler
@_edge.throttles_named
def plan(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    return recovery.plan(_edge.deps(), *_job(event))


@logger.inject_lambda_context
@tracer.capture_lambda_handler
@_edge.throttles_named
def launch_backup(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    if event.get("lost_nodes"):  # LaunchLostNodes: a backup for each node lost during the recovery
        return recovery.launch_lost_backups(_edge.deps(), *_job(event), list(event["candidates"]))
    return recovery.launch_backup(_edge.deps(), *_job(event), int(event["index"]), dict(event["candidate"]))


@logger.inject_lambda_context
@tracer.capture_lambda_handler
@metrics.log_metrics  # the final-dump wait may send orders, each with its warning-to-command latency
@_edge.throttles_named
def await_agent_event(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    job_id, generation = _job(event)
    deps = _edge.deps()
    if event.get("check") == "backup-ready":  # the readiness wait timed out: the arrival recorded decides
        return recovery.check_backup_ready(deps, job_id, generation)
    if event["event"] == "final-dump":
        recovery.order_deferred_final_dump(deps, job_id, generation)
    rendezvous.wait_for(deps, job_id, str(event["event"]), generation, str(event["token"]))
    return {"waiting": event["event"]}


@logger.inject_lambda_context
@tracer.capture_lambda_handler
@_edge.throttles_named
def move_volume(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    return recovery.move_volume(_edge.deps(), *_job(event))


@logger.inject_lambda_context
@tracer.capture_lambda_handler
@_edge.throttles_named
def restore(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    return recovery.restore(_edge.deps(), *_job(event), str(event["attempt"]), str(event["token"]))


@logger.inject_lambda_context
@tracer.capture_lambda_handler
@metrics.log_metrics
@_edge.throttles_named
def check_restore(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    return recovery.check_restore(_edge.deps(), *_job(event), str(event["attempt"]))


@logger.inject_lambda_context
@tracer.capture_lambda_handler
@metrics.log_metrics
@_edge.throttles_named
def finish(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    return recovery.finish(_edge.deps(), *_job(event))


@logger.inject_lambda_context
@tracer.capture_lambda_handler
@metrics.log_metrics
@_edge.throttles_named
def fail(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    error = event.get("error") or {}
    return recovery.fail(_edge.deps(), *_job(event), str(error.get("Error", "")), str(error.get("Cause") or ""))
