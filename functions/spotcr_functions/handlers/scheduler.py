"""Every minute: a periodic checkpoint for each running job whose interval is due; a job PENDING past its deadline
to start fails."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.utilities.typing import LambdaContext

from spotcr_functions import checkpoints
from spotcr_functions.handlers import _edge
from spotcr_functions.observability import logger, metrics, tracer


@logger.inject_lambda_context
@tracer.capture_lambda_handler
@metrics.log_metrics
def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    return checkpoints.run_scheduler(_edge.deps())
