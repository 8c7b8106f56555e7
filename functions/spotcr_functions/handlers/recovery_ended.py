"""A recovery workflow that failed, timed out or was aborted → the job is FAILED and the failure topic told."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.utilities.typing import LambdaContext

from spotcr_functions import recovery
from spotcr_functions.handlers import _edge
from spotcr_functions.models import RecoveryEnded
from spotcr_functions.observability import logger, metrics, tracer


@logger.inject_lambda_context
@tracer.capture_lambda_handler
@metrics.log_metrics
def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    ended = _edge.parse_or_none(event, RecoveryEnded)
    if ended is None:
        return {"action": "ignored", "reason": "malformed execution status change"}
    detail = ended.detail
    return recovery.on_recovery_ended(_edge.deps(), detail.state_machine_arn, detail.name, detail.status, detail.input)
