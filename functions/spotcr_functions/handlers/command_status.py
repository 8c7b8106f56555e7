"""EC2 Command Invocation Status-change Notification (source aws.ssm) → a checkpoint's or a restore's outcome, or a
job's exit, read from SSM (by the command's document)."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.utilities.typing import LambdaContext

from spotcr_functions import checkpoints, exits, recovery
from spotcr_functions.handlers import _edge
from spotcr_functions.observability import logger, metrics, tracer


@logger.inject_lambda_context
@tracer.capture_lambda_handler
@metrics.log_metrics
def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    detail = event.get("detail") if isinstance(event, dict) else None
    if event.get("source") != "aws.ssm" or not isinstance(detail, dict):
        return {"action": "ignored", "reason": "not an SSM command status change"}
    command_id, instance_id = str(detail.get("command-id") or ""), str(detail.get("instance-id") or "")
    if not command_id or not instance_id:
        logger.warning("command status change without command-id or instance-id ignored")
        return {"action": "ignored", "reason": "no command-id or instance-id"}
    # The event only says where to look: the outcome is read from GetCommandInvocation. Taking it twice records
    # the same answer, so redelivered copies change nothing.
    document_name = str(detail.get("document-name") or "")
    deps = _edge.deps()
    if document_name == deps.settings.status_document:
        return exits.on_status_command(deps, command_id, instance_id)
    if document_name in (deps.settings.checkpoint_document, deps.settings.final_dump_document):
        return checkpoints.on_checkpoint_command(deps, command_id, instance_id)
    return recovery.on_restore_command(deps, command_id, instance_id, document_name)
